// Per-key primitives of the scored hash table, written once for both backends.
//
// Everything here is a small inline function over plain pointers: the CPU bulk
// loops (csrc/cpu) and the CUDA kernels (csrc/cuda) call the same code, so the
// two backends can be diffed. Nothing here allocates or knows about torch.
//
// Layout of one table with `num_buckets` buckets of `bc` slots (SoA, slot-major):
//   keys     (capacity,)            int64   key of each slot
//   scores   (capacity,)            uint64  larger = keep
//   tids     (capacity,)            int16   table id of each slot
//   digests  (capacity,)            uint8   top byte of the hash
//   occupied (num_buckets, words)   uint64  bit j of bucket b: slot b*bc+j holds a key
//   pinned   (num_buckets, words)   uint64  bit j: slot is used by the current call
// where words = ceil(bc / 64).
#pragma once

#include <cstdint>

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define DEMB_HD __host__ __device__ __forceinline__
#else
#define DEMB_HD inline
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

DEMB_HD uint8_t digest_of(uint64_t h) { return static_cast<uint8_t>(h >> 56); }

DEMB_HD int words_per_bucket(int bc) { return (bc + 63) / 64; }

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

// Lowest j < bc whose bit is clear, or -1 when all bc bits are set.
DEMB_HD int lowest_clear_bit(const uint64_t* bits, int bc) {
  const int words = words_per_bucket(bc);
  for (int w = 0; w < words; ++w) {
    const uint64_t free_bits = ~bits[w];
    if (free_bits != 0) {
      const int j = w * 64 + count_trailing_zeros(free_bits);
      return j < bc ? j : -1;
    }
  }
  return -1;
}

// Victim of a full bucket: the unpinned slot with the minimum score, ties to the
// lowest slot. Returns the offset in the bucket, or -1 when every slot is pinned.
DEMB_HD int choose_victim(const uint64_t* scores, const uint64_t* pinned, int bc) {
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

// Scalar probe of one bucket: offset of (key, table id), or -1. Backends may use
// a vectorized digest match with the same result (see csrc/cpu/probe.h).
DEMB_HD int probe_bucket_scalar(const int64_t* keys, const int16_t* tids,
                                const uint8_t* digests, const uint64_t* occupied,
                                int bc, int64_t key, int16_t tid, uint8_t digest) {
  for (int j = 0; j < bc; ++j) {
    if (digests[j] == digest && test_bit(occupied, j) && keys[j] == key &&
        tids[j] == tid) {
      return j;
    }
  }
  return -1;
}

// Score rules: the policy objects the bulk loops are templated on. A kernel calls
// on_insert / on_hit and never branches on the strategy's name.
struct ClockScore {  // LRU, STEP, NO_EVICTION: the call's clock (or step) value
  uint64_t now;
  DEMB_HD uint64_t on_insert(uint64_t /*given*/) const { return now; }
  DEMB_HD uint64_t on_hit(uint64_t /*old*/, uint64_t /*given*/) const { return now; }
};

// Scores stay below 2^63 so they read as non-negative int64 in Python.
constexpr uint64_t kMaxScore = 0x7FFFFFFFFFFFFFFFull;

struct CountScore {  // LFU: times the key was seen; `given` is this call's count
  DEMB_HD uint64_t on_insert(uint64_t given) const { return given; }
  DEMB_HD uint64_t on_hit(uint64_t old, uint64_t given) const {  // saturating
    return given > kMaxScore - old ? kMaxScore : old + given;
  }
};

struct GivenScore {  // CUSTOMIZED: the caller's score
  DEMB_HD uint64_t on_insert(uint64_t given) const { return given; }
  DEMB_HD uint64_t on_hit(uint64_t /*old*/, uint64_t given) const { return given; }
};

// Outcome of one key in an inserting call (the kernels' `status` output).
enum InsertStatus : int8_t {
  kHit = 0,
  kInserted = 1,
  kEvictedAndInserted = 2,
  kFailed = 3,
  kDeferred = 4,
};

}  // namespace dynamicemb
