// CPU bucket probe: the digest match of hash_primitives.h, 16 slots at a time
// with SSE2. Returns exactly what probe_bucket_scalar returns.
#pragma once

#include "dynamicemb/hash_primitives.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace dynamicemb {
namespace cpu {

inline int probe_bucket(const int64_t* keys, const int16_t* tids,
                        const uint8_t* digests, const uint64_t* occupied, int bc,
                        int64_t key, int16_t tid, uint8_t digest) {
#if defined(__SSE2__)
  const __m128i target = _mm_set1_epi8(static_cast<char>(digest));
  for (int g = 0; g < bc; g += 16) {
    const __m128i group =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(digests + g));
    uint32_t match =
        static_cast<uint32_t>(_mm_movemask_epi8(_mm_cmpeq_epi8(group, target)));
    match &= static_cast<uint32_t>(occupied[g >> 6] >> (g & 63)) & 0xFFFFu;
    while (match != 0) {
      const int j = g + __builtin_ctz(match);
      if (keys[j] == key && tids[j] == tid) return j;
      match &= match - 1;
    }
  }
  return -1;
#else
  return probe_bucket_scalar(keys, tids, digests, occupied, bc, key, tid, digest);
#endif
}

}  // namespace cpu
}  // namespace dynamicemb
