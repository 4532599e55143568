// Per-key primitives of the scored hash table, written once for both backends.
//
// Everything here is a small inline function over plain pointers: the CPU bulk
// loops (csrc/cpu) and the CUDA kernels (csrc/cuda) call the same code, so the
// two backends can be diffed. Nothing here allocates or knows about torch.
//
// Layout of one table with `num_buckets` buckets of `bc` slots (slot-major):
//   keys     (capacity,) stride 2   int64   key of each slot      } one (capacity, 2)
//   scores   (capacity,) stride 2   uint64  larger = keep         } array: a slot's key
//                                                                   and score share a line
//   tids     (capacity,)            int16   table id of each slot
//   digests  (capacity,)            uint8   top byte of the hash; 0 = empty slot
//   occupied (num_buckets, words)   uint64  bit j of bucket b: slot b*bc+j holds a key
//   pinned   (num_buckets, words)   uint64  bit j: slot is used by the current call
// where words = ceil(bc / 64).
#pragma once

#include "dynamicemb/portable_types.h"

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define DEMB_HD __host__ __device__ __forceinline__
#define DEMB_HD_INLINED __host__ __device__ __forceinline__
#else
#define DEMB_HD inline
// A per-key procedure that a host loop must inline (its call would pass a dozen
// arguments per key): the CPU upsert pipeline.
#define DEMB_HD_INLINED inline __attribute__((always_inline))
#endif

namespace dynamicemb {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;

// The documented 64-bit hash of (table id, key): splitmix64's finalizer applied
// to the key offset by a per-table constant. Known-answer tested.
DEMB_HD uint64_t hash_key(int64_t key, int64_t table_id) {
  uint64_t x = static_cast<uint64_t>(key) +
               (static_cast<uint64_t>(table_id) + 1ull) * kGolden;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// num_buckets is a power of two.
DEMB_HD int64_t bucket_of(uint64_t h, int64_t num_buckets) {
  return static_cast<int64_t>(h & static_cast<uint64_t>(num_buckets - 1));
}

// Digest 0 marks an empty slot, so a probe needs no occupancy bits: a key whose
// top byte is 0 gets digest 1. Whoever empties a slot resets its digest.
constexpr uint8_t kEmptyDigest = 0;

DEMB_HD uint8_t digest_of(uint64_t h) {
  const uint8_t d = static_cast<uint8_t>(h >> 56);
  return d == kEmptyDigest ? uint8_t{1} : d;
}

DEMB_HD int words_per_bucket(int bc) { return (bc + 63) / 64; }

// Keys and scores are interleaved: slot s's key is word 2s of one array and its
// score word 2s + 1, so the probe that reads a key has its score in the same
// cache line (an upsert touches one line fewer than with two arrays).
constexpr int64_t kSlotWords = 2;

// One field (key or score) of the interleaved slot array, indexed by slot.
template <class T>
struct SlotField {
  T* p;
  DEMB_HD T& operator[](int64_t s) const { return p[s * kSlotWords]; }
  DEMB_HD SlotField operator+(int64_t s) const { return SlotField{p + s * kSlotWords}; }
};

DEMB_HD bool test_bit(const uint64_t* bits, int j) {
  return (bits[j >> 6] >> (j & 63)) & 1ull;
}
DEMB_HD void set_bit(uint64_t* bits, int j) { bits[j >> 6] |= 1ull << (j & 63); }
DEMB_HD void clear_bit(uint64_t* bits, int j) {
  bits[j >> 6] &= ~(1ull << (j & 63));
}

DEMB_HD int count_trailing_zeros(uint64_t x) {
#if defined(__CUDA_ARCH__)
  return __ffsll(static_cast<long long>(x)) - 1;
#else
  return __builtin_ctzll(x);
#endif
}

// Where a key's probe and insert start in its bucket: the first slot of one of
// its bc/16 groups, from bits 32..63 of the hash (multiply-shift, no modulo).
DEMB_HD int start_offset(uint64_t h, int bc) {
  const uint64_t groups = static_cast<uint64_t>(bc / 16);
  return 16 * static_cast<int>((((h >> 32) & 0xFFFFFFFFull) * groups) >> 32);
}

// First j in [from, to) whose bit is clear, or -1 (bits past bc are clear).
DEMB_HD int first_clear_bit_in(const uint64_t* bits, int from, int to) {
  for (int j = from; j < to;) {
    const int w = j >> 6;
    const uint64_t free_bits = ~bits[w] & (~0ull << (j & 63));
    if (free_bits != 0) {
      const int k = w * 64 + count_trailing_zeros(free_bits);
      return k < to ? k : -1;
    }
    j = (w + 1) * 64;
  }
  return -1;
}

// The slot an insert takes: the first clear bit at or after `start`, wrapping
// around the bucket; -1 when all bc bits are set.
DEMB_HD int first_clear_bit_from(const uint64_t* bits, int bc, int start) {
  const int j = first_clear_bit_in(bits, start, bc);
  return j >= 0 ? j : first_clear_bit_in(bits, 0, start);
}

// Victim of a full bucket: the unpinned slot with the minimum score, ties to the
// lowest slot. Returns the offset in the bucket, or -1 when every slot is pinned.
// `scores` is indexable by offset in the bucket (a pointer or a SlotField).
template <class Scores>
DEMB_HD int choose_victim(const Scores& scores, const uint64_t* pinned, int bc) {
  int victim = -1;
  uint64_t best = 0;
  for (int j = 0; j < bc; ++j) {
    if (test_bit(pinned, j)) continue;
    if (victim < 0 || scores[j] < best) {
      victim = j;
      best = scores[j];
    }
  }
  return victim;
}

// Scalar probe of one bucket: offset of (key, table id), or -1, scanning from
// the key's start offset to the end, then from the beginning. `tids` is nullptr
// when the table holds one logical table (every id is 0: the key decides alone).
// Backends may use a vectorized digest match with the same result (see
// csrc/cpu/probe.h and the probe policies of table_view.h).
template <class Keys>
DEMB_HD int probe_bucket_scalar(const Keys& keys, const int16_t* tids,
                                const uint8_t* digests, int bc, int64_t key, int16_t tid,
                                uint8_t digest, int start) {
  for (int n = 0; n < bc; ++n) {
    const int j = start + n < bc ? start + n : start + n - bc;
    if (digests[j] == digest && keys[j] == key && (tids == nullptr || tids[j] == tid)) return j;
  }
  return -1;
}

// Score rules: the policy objects the bulk loops are templated on. A kernel calls
// on_insert / on_hit and never branches on the strategy's name.
// time_of(score) is the last access a score records, which a ttl measures (rules
// that record none return the score: a table with a ttl never uses them).
struct ClockScore {  // LRU, STEP, NO_EVICTION: the call's clock (or step) value
  uint64_t now;
  DEMB_HD uint64_t on_insert(uint64_t /*given*/) const { return now; }
  DEMB_HD uint64_t on_hit(uint64_t /*old*/, uint64_t /*given*/) const { return now; }
  DEMB_HD static uint64_t time_of(uint64_t score) { return score; }
};

// Scores stay below 2^63 so they read as non-negative int64 in Python.
constexpr uint64_t kMaxScore = 0x7FFFFFFFFFFFFFFFull;

struct CountScore {  // LFU: times the key was seen; `given` is this call's count
  DEMB_HD uint64_t on_insert(uint64_t given) const { return given; }
  DEMB_HD uint64_t on_hit(uint64_t old, uint64_t given) const {  // saturating
    return given > kMaxScore - old ? kMaxScore : old + given;
  }
  DEMB_HD static uint64_t time_of(uint64_t score) { return score; }
};

struct GivenScore {  // CUSTOMIZED: the caller's score
  DEMB_HD uint64_t on_insert(uint64_t given) const { return given; }
  DEMB_HD uint64_t on_hit(uint64_t /*old*/, uint64_t given) const { return given; }
  DEMB_HD static uint64_t time_of(uint64_t score) { return score; }
};

// LRU_LFU (upstream's compound (TIMESTAMP, LFU)), one word ranked as upstream ranks
// its two: the count above the clock, so the minimum score is the least frequent
// key and, among equal counts, the least recently used one.
//   bits 62..32: times seen, saturating at 2^31 - 1   bits 31..0: the call's clock
constexpr int kCompoundCountShift = 32;
constexpr uint64_t kCompoundTimeMask = 0xFFFFFFFFull;
constexpr uint64_t kCompoundMaxCount = kMaxScore >> kCompoundCountShift;

struct CountThenClockScore {  // `now` < 2^32; `given` is this call's count
  uint64_t now;
  DEMB_HD uint64_t pack(uint64_t count) const {
    return (count << kCompoundCountShift) | (now & kCompoundTimeMask);
  }
  DEMB_HD uint64_t on_insert(uint64_t given) const {
    return pack(given > kCompoundMaxCount ? kCompoundMaxCount : given);
  }
  DEMB_HD uint64_t on_hit(uint64_t old, uint64_t given) const {
    const uint64_t count = old >> kCompoundCountShift;
    return pack(given > kCompoundMaxCount - count ? kCompoundMaxCount : count + given);
  }
  DEMB_HD static uint64_t time_of(uint64_t score) { return score & kCompoundTimeMask; }
};

// The score an inserting pass gives key i of table `tid`: its own (`per_key`, (n,)),
// its table's (`per_table`, (T,): CUSTOMIZED scores of a padded call, read by table
// id), or none (0: a rule that reads no score).
DEMB_HD uint64_t given_score(const uint64_t* per_key, const uint64_t* per_table, int64_t i,
                             int16_t tid) {
  if (per_key != nullptr) return per_key[i];
  return per_table != nullptr ? per_table[tid] : 0;
}

// TTL: a row whose last access (the rule's time_of its score) is below this time
// has expired at the call's time `now`, for a lifetime of `ttl` ticks (0: no ttl,
// nothing expires), as ScoredHashTable.expired_before. An inserting pass takes a
// hit on an expired row as an insert (upsert_one).
DEMB_HD uint64_t expired_before(uint64_t now, uint64_t ttl) {
  return ttl != 0 && now > ttl ? now - ttl : 0;
}

// The previous score an inserting pass records for a key it inserted into a slot
// without one (prev_scores): a new key's or a victim's slot. Scores stay below
// 2^63, so as int64 this is -1, which no score is; a hit on an expired row records
// the row's score there instead.
constexpr uint64_t kNoPrevScore = ~0ull;

// Outcome of one key in an inserting call (the kernels' `status` output).
enum InsertStatus : int8_t {
  kHit = 0,
  kInserted = 1,
  kEvictedAndInserted = 2,
  kFailed = 3,
};

// What upsert_one returns for a hit on an expired row, whose status it writes as
// kInserted (the row is new): the passes count these apart from inserts into empty
// slots (at kExpiredOutcome of a call's outcomes).
constexpr int8_t kExpiredHit = 5;
// An inserting call's outcome counts: hits, inserted, evicted and inserted, failed,
// then expired hits.
constexpr int kExpiredOutcome = 4;

// The bucket of a padding position of a batch whose unique keys are padded to its
// lookup count (csrc/cuda/dedup.cu), or of a key a padded pass skips: sorted after
// every real bucket, walked by no pass; an inserting pass gives it slot -1 and
// kFailed and counts it nowhere.
constexpr int32_t kNoBucket = 0x7FFFFFFF;

}  // namespace dynamicemb
