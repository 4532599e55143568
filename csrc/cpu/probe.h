// CPU bucket probe: the digest match of hash_primitives.h, 64 slots at a time
// (AVX-512BW or AVX2 where the build targets them) and 16 at a time with SSE2 for
// the rest of a bucket. Returns exactly what probe_bucket_scalar returns; the victim
// of a full bucket exactly what choose_victim returns. The CPU loops hand both to the
// per-key procedures of table_view.h as DigestProbe.
#pragma once

#include "dynamicemb/hash_primitives.h"
#include "dynamicemb/table_view.h"

#if defined(__AVX2__) || defined(__AVX512BW__) || defined(__AVX512F__)
#include <immintrin.h>
#elif defined(__SSE2__)
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

// Bit j set: digests[g + j] == digest, for the 64 slots starting at g. A miss
// scans the whole bucket (128 slots by default): 2 compares instead of 8.
inline uint64_t match_64(const uint8_t* digests, int g, uint8_t digest) {
#if defined(__AVX512BW__)
  const __m512i group = _mm512_loadu_si512(reinterpret_cast<const void*>(digests + g));
  return _mm512_cmpeq_epi8_mask(group, _mm512_set1_epi8(static_cast<char>(digest)));
#elif defined(__AVX2__)
  const __m256i target = _mm256_set1_epi8(static_cast<char>(digest));
  const auto half = [&](int at) {
    const __m256i group = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(digests + at));
    return static_cast<uint64_t>(
        static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpeq_epi8(group, target))));
  };
  return half(g) | half(g + 32) << 32;
#else
  uint64_t mask = 0;
  for (int q = 0; q < 4; ++q) mask |= static_cast<uint64_t>(match_group(digests, g + 16 * q, digest)) << (16 * q);
  return mask;
#endif
}

// Calls try_match(offset) for each digest match in [from, to), in order, until
// it returns true; returns that offset or -1 (to a multiple of 16). Groups of 16
// up to a 64-slot boundary (the first is the line a caller prefetched), then 64
// at a time, each load one aligned line (buckets start on a line when bc is a
// multiple of 64), then 16 again for the rest.
template <class TryMatch>
inline int scan_digests(const uint8_t* digests, int to, uint8_t digest, int from,
                        TryMatch&& try_match) {
  int g = from & ~15;
  for (; g < to && (g & 63) != 0; g += 16) {
    uint32_t match = match_group(digests, g, digest);
    if (g < from) match &= ~((1u << (from - g)) - 1u);
    for (; match != 0; match &= match - 1) {
      if (try_match(g + __builtin_ctz(match))) return g + __builtin_ctz(match);
    }
  }
  for (; g + 64 <= to; g += 64) {
    uint64_t match = match_64(digests, g, digest);
    if (g < from) match &= ~((uint64_t{1} << (from - g)) - 1u);
    for (; match != 0; match &= match - 1) {
      if (try_match(g + __builtin_ctzll(match))) return g + __builtin_ctzll(match);
    }
  }
  for (; g < to; g += 16) {
    uint32_t match = match_group(digests, g, digest);
    if (g < from) match &= ~((1u << (from - g)) - 1u);  // bc not a multiple of 64
    for (; match != 0; match &= match - 1) {
      if (try_match(g + __builtin_ctz(match))) return g + __builtin_ctz(match);
    }
  }
  return -1;
}

// scan_digests for a bucket of whole lines (bc a multiple of 64, as the default
// 128): the 16-slot group of `from` first (where a present key usually is: inserts
// start at its start offset), then one 64-slot compare per line, masked. A miss,
// which scans the whole bucket, then takes at most three compares and no loop over
// 16-slot groups, whose trip counts change with the key's start offset (their
// branches were most of a miss's time).
template <class TryMatch>
inline int scan_lines(const uint8_t* digests, int to, uint8_t digest, int from,
                      TryMatch&& try_match) {
  const int g = from & ~15;
  if (g >= to) return -1;
  uint32_t first = match_group(digests, g, digest) & (~0u << (from - g));
  if (to - g < 16) first &= (1u << (to - g)) - 1;
  for (; first != 0; first &= first - 1) {
    if (try_match(g + __builtin_ctz(first))) return g + __builtin_ctz(first);
  }
  for (int line = (g + 16) & ~63; line < to; line += 64) {
    uint64_t match = match_64(digests, line, digest);
    if (line < g + 16) match &= ~uint64_t{0} << (g + 16 - line);
    if (to - line < 64) match &= (uint64_t{1} << (to - line)) - 1;
    for (; match != 0; match &= match - 1) {
      if (try_match(line + __builtin_ctzll(match))) return line + __builtin_ctzll(match);
    }
  }
  return -1;
}

// First offset >= from whose digest matches, or -1.
inline int next_digest_match(const uint8_t* digests, int bc, uint8_t digest, int from) {
  if (bc % 64 == 0) return scan_lines(digests, bc, digest, from, [](int) { return true; });
  return scan_digests(digests, bc, digest, from, [](int) { return true; });
}

// Offset of (key, table id) in [from, to), or -1 (to a multiple of 16 unless the
// bucket, bc slots, is whole lines). Empty
// slots have digest 0, which no key has, so no occupancy bits are read. Every
// digest match of a group is tried before the next group is loaded (a miss in a
// full bucket of 128 has about one false match; rescanning from it was a second
// pass). `keys` is indexable by offset (a pointer or a SlotField); `tids` is
// nullptr when the table holds one logical table (every id is 0).
template <class Keys>
inline int probe_range(const Keys& keys, const int16_t* tids, const uint8_t* digests,
                       int to, int64_t key, int16_t tid, uint8_t digest, int from, int bc) {
  const auto holds = [&](int j) { return keys[j] == key && (tids == nullptr || tids[j] == tid); };
  if (bc % 64 == 0) return scan_lines(digests, to, digest, from, holds);
  return scan_digests(digests, to, digest, from, holds);
}

// Offset of (key, table id) in the bucket, or -1: from the key's start offset to
// the end, then from the beginning (where inserts put it, see first_clear_bit_from).
// `first` is what next_digest_match returned from `start` (kFirstUnknown: not
// known) on a bucket that has not changed since, and its slot did not hold the
// key: a read-only caller that has it skips the slots it already ruled out.
template <class Keys>
inline int probe_bucket(const Keys& keys, const int16_t* tids, const uint8_t* digests,
                        int bc, int64_t key, int16_t tid, uint8_t digest, int start,
                        int first = kFirstUnknown) {
  int j = -1;
  if (first == kFirstUnknown) {
    j = probe_range(keys, tids, digests, bc, key, tid, digest, start, bc);
  } else if (first >= 0) {  // `first` itself was compared by the caller
    j = probe_range(keys, tids, digests, bc, key, tid, digest, first + 1, bc);
  }
  return j >= 0 || start == 0 ? j
                              : probe_range(keys, tids, digests, start, key, tid, digest, 0, bc);
}

// choose_victim's slot of a full bucket, 8 slots a round where the build targets
// AVX-512 (bc is a multiple of 16): each lane keeps the lowest unpinned score it saw
// and its slot (a strict compare: the lowest of its slots with that score), then the
// lanes' minimum, ties to the lowest slot. The scalar loop, a branch on each slot's
// pin and score, was most of a cache insert's time (P3: 60% of the cache's upsert).
inline int victim_slot(const SlotField<uint64_t>& scores, const uint64_t* pinned, int bc) {
#if defined(__AVX512F__)
  if (bc % 8 == 0) {
    // scores.p[2 j] is slot j's score: the even words of two loads of 8
    const __m512i even = _mm512_setr_epi64(0, 2, 4, 6, 8, 10, 12, 14);
    const __m512i eight = _mm512_set1_epi64(8);
    __m512i best = _mm512_set1_epi64(-1);
    __m512i slot = _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7);
    __m512i j = slot;
    __mmask8 seen = 0;  // lanes that saw an unpinned slot
    for (int b = 0; b < bc; b += 8) {
      const uint64_t* p = scores.p + static_cast<int64_t>(b) * kSlotWords;
      const __m512i s = _mm512_permutex2var_epi64(_mm512_loadu_si512(p), even,
                                                  _mm512_loadu_si512(p + 8));
      const __mmask8 unpinned = static_cast<__mmask8>(~(pinned[b >> 6] >> (b & 63)));
      const __mmask8 take = unpinned & (_mm512_cmplt_epu64_mask(s, best) | ~seen);
      best = _mm512_mask_mov_epi64(best, take, s);
      slot = _mm512_mask_mov_epi64(slot, take, j);
      seen |= unpinned;
      j = _mm512_add_epi64(j, eight);
    }
    if (seen == 0) return -1;
    const uint64_t least = _mm512_mask_reduce_min_epu64(seen, best);
    const __mmask8 ties = seen & _mm512_cmpeq_epu64_mask(best, _mm512_set1_epi64(least));
    return static_cast<int>(_mm512_mask_reduce_min_epi64(ties, slot));
  }
#endif
  return choose_victim(scores, pinned, bc);
}

// The probe policy (table_view.h) of the CPU loops: probe_bucket and victim_slot.
struct DigestProbe {
  template <class Keys>
  int operator()(const Keys& keys, const int16_t* tids, const uint8_t* digests, int bc,
                 int64_t key, int16_t tid, uint8_t digest, int start, int first) const {
    return probe_bucket(keys, tids, digests, bc, key, tid, digest, start, first);
  }
  int victim(const SlotField<uint64_t>& scores, const uint64_t* pinned, int bc) const {
    return victim_slot(scores, pinned, bc);
  }
};

}  // namespace cpu
}  // namespace dynamicemb
