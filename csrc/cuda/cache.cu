// CUDA kernels of a batch's promotion into a device cache, with every count on the
// device (dynamicemb/storage/tiered.py, TieredStorage.commit_padded): the batch's
// unique keys are padded to its lookup count n (count 0: padding), and the host
// store has found or inserted them (host_slots, -1 where its insert failed). The
// policy is the one TieredStorage._into_device_tier applies on the host: hits are
// pinned first; misses are promoted in batch order when they all fit in the
// cache's free slots, else only misses seen more than once, hottest first, as many
// as the cache holds beside the hits.
#include "cuda/common.cuh"
#include "dynamicemb/row_ref.h"

using namespace dynamicemb;
using namespace dynamicemb::cuda;

// plan (4,) counters: hits, misses, hot misses, and the sorted positions the cache
// call takes.
constexpr int kPlanHits = 0;
constexpr int kPlanMisses = 1;
constexpr int kPlanHot = 2;
constexpr int kPlanTaken = 3;

// One thread per unique key i: cache_slots[i] = its slot in the cache (-1: not
// there, padding, or not stored in the host store), and plan[0..2] += its kind.
extern "C" __global__ void demb_cache_probe(DEMB_TABLE_PARAMS, const int64_t* keys,
                                            const int16_t* tids, const int64_t* counts,
                                            const int64_t* host_slots, int64_t n,
                                            bool one_table, int64_t* cache_slots,
                                            unsigned long long* plan) {
  const int64_t i = global_thread();
  if (i >= n) return;
  if (counts[i] <= 0 || host_slots[i] < 0) {  // padding, or no row to cache
    cache_slots[i] = -1;
    return;
  }
  const int64_t slot = find_slot(DEMB_TABLE_VIEW, keys[i], tids[i], one_table);
  cache_slots[i] = slot;
  if (slot >= 0) {
    atomicAdd(plan + kPlanHits, 1ull);
  } else {
    atomicAdd(plan + kPlanMisses, 1ull);
    if (counts[i] > 1) atomicAdd(plan + kPlanHot, 1ull);
  }
}

// One thread per unique key i: rank[i], the promotion order (larger first; a stable
// sort keeps batch order among equals): a hit above every miss, padding and keys not
// stored below everything; when the misses fit in the cache's free slots (capacity -
// *size) every miss ranks 0, else a hot miss ranks by its count and a cold one -1.
// Thread 0 sets plan[3] = hits + the misses taken (all of them, or the hot ones up
// to capacity - hits).
extern "C" __global__ void demb_cache_rank(const int64_t* counts, const int64_t* host_slots,
                                           const int64_t* cache_slots, int64_t n,
                                           int64_t capacity, const int64_t* size,
                                           unsigned long long* plan, int64_t* rank) {
  const int64_t i = global_thread();
  const int64_t hits = static_cast<int64_t>(plan[kPlanHits]);
  const int64_t misses = static_cast<int64_t>(plan[kPlanMisses]);
  const bool overflow = misses > capacity - *size;
  if (i == 0) {
    const int64_t room = capacity - hits > 0 ? capacity - hits : 0;
    const int64_t hot = static_cast<int64_t>(plan[kPlanHot]);
    plan[kPlanTaken] = static_cast<unsigned long long>(hits + (overflow ? (hot < room ? hot : room)
                                                                        : misses));
  }
  if (i >= n) return;
  int64_t r;
  if (counts[i] <= 0 || host_slots[i] < 0) {
    r = -2;
  } else if (cache_slots[i] >= 0) {
    r = INT64_MAX;
  } else if (!overflow) {
    r = 0;
  } else {
    r = counts[i] > 1 ? counts[i] : -1;
  }
  rank[i] = r;
}

// One thread per sorted position q of order (n,) (the keys by descending rank): the
// cache call's key, table id, score (the host store's: host_scores is its (slots,
// 2) keys-and-scores array) and bucket, kNoBucket at positions q >= plan[3] (the
// call skips them).
extern "C" __global__ void demb_promotion_order(const int64_t* order, const int64_t* keys,
                                                const int16_t* tids, const int64_t* host_slots,
                                                const int64_t* host_keys_scores, int64_t n,
                                                const unsigned long long* plan,
                                                int64_t num_buckets, int64_t* out_keys,
                                                int16_t* out_tids, int64_t* out_scores,
                                                int32_t* out_buckets) {
  const int64_t q = global_thread();
  if (q >= n) return;
  const int64_t i = order[q];
  const int64_t slot = host_slots[i];
  out_keys[q] = keys[i];
  out_tids[q] = tids[i];
  out_scores[q] = slot >= 0 ? host_keys_scores[2 * slot + 1] : 0;
  out_buckets[q] = q < static_cast<int64_t>(plan[kPlanTaken])
                       ? static_cast<int32_t>(bucket_of(hash_key(keys[i], tids[i]), num_buckets))
                       : kNoBucket;
}

// One warp per sorted position q, after the cache call (slots, status, ev_keys,
// ev_tids (n,), in sorted order): a victim's row is written back to its host slot
// (found in the host store, whose parameters these are), then a new key's row is
// copied in from the host store, full rows of width floats (both in one warp: a
// slot is taken by one position only); and the row reference of unique key
// order[q]: its cache slot, else its host slot with HOST_ROW_BIT, else -1.
extern "C" __global__ void demb_promote_rows(DEMB_TABLE_PARAMS, float* host_values,
                                             float* cache_values, int64_t width,
                                             const int64_t* order, const int64_t* host_slots,
                                             const int64_t* slots, const int8_t* status,
                                             const int64_t* ev_keys, const int16_t* ev_tids,
                                             int64_t n, int64_t* refs) {
  const int64_t q = global_warp();
  if (q >= n) return;
  const int64_t i = order[q];
  const int8_t st = status[q];
  const int64_t slot = slots[q];
  if (st == kEvictedAndInserted) {
    int64_t home_slot = -1;
    if (lane_id() == 0) home_slot = find_slot(DEMB_TABLE_VIEW, ev_keys[q], ev_tids[q], false);
    home_slot = __shfl_sync(kFullMask, home_slot, 0);
    if (home_slot >= 0) {
      for (int64_t c = lane_id(); c < width; c += kWarp) {
        host_values[home_slot * width + c] = cache_values[slot * width + c];
      }
    }
  }
  if (st == kInserted || st == kEvictedAndInserted) {
    for (int64_t c = lane_id(); c < width; c += kWarp) {
      cache_values[slot * width + c] = host_values[host_slots[i] * width + c];
    }
  }
  if (lane_id() == 0) {
    refs[i] = slot >= 0 ? slot : host_slots[i] >= 0 ? host_slots[i] + kHostRowBit : -1;
  }
}
