// What every CUDA kernel file of dynamicemb shares: the kernels' table
// arguments, the device policies of the per-key procedures (table_view.h) and
// small warp helpers. Compiled by NVRTC through CuPy (dynamicemb/_cuda.py) and,
// in the tests, by nvcc; no standard library.
//
// The table layout is the one of csrc/dynamicemb/hash_primitives.h and the view
// is the shared TableView, so a CUDA table and a CPU table hold the same bytes
// for the same contents.
#pragma once

#include "dynamicemb/hash_primitives.h"
#include "dynamicemb/table_view.h"

namespace dynamicemb {
namespace cuda {

constexpr unsigned kFullMask = 0xFFFFFFFFu;
constexpr int kWarp = 32;

// The kernels' table arguments, in this order, after the outputs they name.
#define DEMB_TABLE_PARAMS                                                             \
  int64_t *slot_words, int16_t *slot_tids, uint8_t *digests, uint64_t *occupied,       \
      uint64_t *pinned, int64_t num_buckets, int bc
#define DEMB_TABLE_VIEW table_view(slot_words, slot_tids, digests, occupied, pinned, num_buckets, bc)

__device__ __forceinline__ int64_t global_thread() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ int64_t global_warp() { return global_thread() / kWarp; }

__device__ __forceinline__ int lane_id() { return threadIdx.x & (kWarp - 1); }

// The probe policy (table_view.h) of one CUDA thread: 16 digests per 16-byte
// load, from the key's start group round the bucket (buckets and groups start on
// 16 bytes). Keys are unique in a table, so the first match is the match (as
// probe_bucket_scalar finds it); `first` is not needed.
struct ThreadProbe {
  template <class Keys>
  __device__ __forceinline__ int operator()(const Keys& keys, const int16_t* tids,
                                            const uint8_t* digests, int bc, int64_t key,
                                            int16_t tid, uint8_t digest, int start,
                                            int /*first*/) const {
    const uint32_t pattern = 0x01010101u * digest;
    for (int n = 0; n < bc; n += 16) {
      const int group = start + n < bc ? start + n : start + n - bc;
      const uint4 d = *reinterpret_cast<const uint4*>(digests + group);
      const uint32_t words[4] = {d.x, d.y, d.z, d.w};
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        uint32_t m = __vcmpeq4(words[w], pattern);
        while (m) {
          const int byte = (__ffs(m) - 1) >> 3;
          const int j = group + 4 * w + byte;
          if (keys[j] == key && (tids == nullptr || tids[j] == tid)) return j;
          m &= ~(0xFFu << (8 * byte));
        }
      }
    }
    return -1;
  }
};

// The slot of (key, tid) in table v, or -1: one thread's probe (find_one).
__device__ __forceinline__ int64_t find_slot(const TableView& v, int64_t key, int16_t tid,
                                             bool one_table) {
  if (one_table) tid = 0;
  const KeyHome home = home_of(v, hash_key(key, tid));
  const int j = find_one(v, ThreadProbe{}, home, key, tid, one_table);
  return j < 0 ? -1 : home.base + j;
}

// The bit policy (table_view.h) of kernels whose threads share a bucket's words.
struct AtomicBits {
  __device__ __forceinline__ static void set(uint64_t* bits, int j) {
    atomicOr(reinterpret_cast<unsigned long long*>(bits + (j >> 6)), 1ull << (j & 63));
  }
  __device__ __forceinline__ static void clear(uint64_t* bits, int j) {
    atomicAnd(reinterpret_cast<unsigned long long*>(bits + (j >> 6)), ~(1ull << (j & 63)));
  }
};

// Offset in the bucket of (key, tid), or -1, probed by a whole warp: each lane
// compares 4 digests of every 128. Every lane returns the same value.
__device__ __forceinline__ int probe_warp(const TableView& v, int64_t base, int64_t key,
                                          int16_t tid, bool one_table, uint8_t digest) {
  const uint32_t pattern = 0x01010101u * digest;
  const int lane = lane_id();
  for (int chunk = 0; chunk < v.bc; chunk += 4 * kWarp) {
    const int j0 = chunk + 4 * lane;
    int found = -1;
    if (j0 < v.bc) {
      uint32_t m = __vcmpeq4(*reinterpret_cast<const uint32_t*>(v.digests + base + j0), pattern);
      while (m) {
        const int byte = (__ffs(m) - 1) >> 3;
        const int j = j0 + byte;
        if (v.keys[base + j] == key && (one_table || v.tids[base + j] == tid)) {
          found = j;
          break;
        }
        m &= ~(0xFFu << (8 * byte));
      }
    }
    const unsigned hit = __ballot_sync(kFullMask, found >= 0);
    if (hit) return __shfl_sync(kFullMask, found, __ffs(hit) - 1);
  }
  return -1;
}

// The lane of a warp that owns offset j of a bucket in the warp-wide verbs:
// lane l compares digests 4l to 4l + 3 of every 128 (probe_warp), reads those
// slots' scores (choose_victim_warp) and writes those slots (the inserting
// kernel), so a slot is written and read by one thread and needs no fence.
__device__ __forceinline__ int owner_lane(int j) { return (j >> 2) & (kWarp - 1); }

// choose_victim (hash_primitives.h) by a warp: the slot whose bit in `pinned`
// (the bucket's pinned words) is clear with the minimum score, ties to the
// lowest slot; -1 when every slot is pinned. Each lane reads its own slots.
__device__ __forceinline__ int choose_victim_warp(const TableView& v, int64_t b,
                                                  const uint64_t* pinned) {
  const int64_t base = b * v.bc;
  uint64_t best = 0;
  int victim = -1;
  for (int chunk = 0; chunk < v.bc; chunk += 4 * kWarp) {
    for (int k = 0; k < 4; ++k) {  // j rises, so the first of equal scores stays
      const int j = chunk + 4 * lane_id() + k;
      if (j >= v.bc || test_bit(pinned, j)) continue;
      const uint64_t s = v.scores[base + j];
      if (victim < 0 || s < best) {
        victim = j;
        best = s;
      }
    }
  }
  for (int delta = kWarp / 2; delta > 0; delta >>= 1) {
    const uint64_t other_best = __shfl_xor_sync(kFullMask, best, delta);
    const int other = __shfl_xor_sync(kFullMask, victim, delta);
    const bool take = other >= 0 && (victim < 0 || other_best < best ||
                                     (other_best == best && other < victim));
    if (take) {
      best = other_best;
      victim = other;
    }
  }
  return victim;
}

}  // namespace cuda
}  // namespace dynamicemb
