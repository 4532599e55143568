// CPU bucket probe: the digest match of hash_primitives.h, 16 slots at a time
// with SSE2. Returns exactly what probe_bucket_scalar returns.
#pragma once

#include "dynamicemb/hash_primitives.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace dynamicemb {
namespace cpu {

// Bit j set: digests[g + j] == digest, for the 16-slot group starting at g.
inline uint32_t match_group(const uint8_t* digests, int g, uint8_t digest) {
#if defined(__SSE2__)
  const __m128i group = _mm_loadu_si128(reinterpret_cast<const __m128i*>(digests + g));
  const __m128i target = _mm_set1_epi8(static_cast<char>(digest));
  return static_cast<uint32_t>(_mm_movemask_epi8(_mm_cmpeq_epi8(group, target)));
#else
  uint32_t mask = 0;
  for (int j = 0; j < 16; ++j) mask |= static_cast<uint32_t>(digests[g + j] == digest) << j;
  return mask;
#endif
}

// First offset >= from whose digest matches, or -1 (from a multiple of 16 or 0).
inline int next_digest_match(const uint8_t* digests, int bc, uint8_t digest, int from) {
  for (int g = from & ~15; g < bc; g += 16) {
    uint32_t match = match_group(digests, g, digest);
    if (g < from) match &= ~((1u << (from - g)) - 1u);
    if (match != 0) return g + __builtin_ctz(match);
  }
  return -1;
}

// Offset of (key, table id) in [from, to), or -1. Empty slots have digest 0,
// which no key has, so no occupancy bits are read.
// `keys` is indexable by offset in the bucket (a pointer or a SlotField).
template <class Keys>
inline int probe_range(const Keys& keys, const int16_t* tids, const uint8_t* digests,
                       int to, int64_t key, int16_t tid, uint8_t digest, int from) {
  for (int j = next_digest_match(digests, to, digest, from); j >= 0;
       j = next_digest_match(digests, to, digest, j + 1)) {
    if (keys[j] == key && tids[j] == tid) return j;
  }
  return -1;
}

// Offset of (key, table id) in the bucket, or -1: from the key's start offset to
// the end, then from the beginning (where inserts put it, see first_clear_bit_from).
template <class Keys>
inline int probe_bucket(const Keys& keys, const int16_t* tids, const uint8_t* digests,
                        int bc, int64_t key, int16_t tid, uint8_t digest, int start) {
  const int j = probe_range(keys, tids, digests, bc, key, tid, digest, start);
  return j >= 0 || start == 0 ? j : probe_range(keys, tids, digests, start, key, tid, digest, 0);
}

}  // namespace cpu
}  // namespace dynamicemb
