// CUDA kernels of a batch's promotion into a device cache, with every count on the
// device (dynamicemb/storage/layouts.py, Cache.take): loops over
// the per-key procedures of csrc/dynamicemb/cache_policy.h, which states the
// policy, one thread per key (one warp per row for the copies). The CPU's loops
// over the same procedures are csrc/cpu/cache.cpp.
#include "cuda/common.cuh"
#include "dynamicemb/cache_policy.h"
#include "dynamicemb/row_ref.h"

using namespace dynamicemb;
using namespace dynamicemb::cuda;

// One thread per unique key i: cache_slots[i] = its slot in the cache (-1: not
// there, or not promotable), and plan[kPlanHits..kPlanHot] += its kind.
extern "C" __global__ void demb_cache_probe(DEMB_TABLE_PARAMS, const int64_t* keys,
                                            const int16_t* tids, const int64_t* counts,
                                            const int64_t* host_slots, int64_t n,
                                            bool one_table, int64_t* cache_slots,
                                            unsigned long long* plan) {
  const int64_t i = global_thread();
  if (i >= n) return;
  if (!is_promotable(counts[i], host_slots[i])) {
    cache_slots[i] = -1;
    return;
  }
  const int64_t slot = find_slot(DEMB_TABLE_VIEW, keys[i], tids[i], one_table);
  cache_slots[i] = slot;
  const ProbeKind kind = probe_kind(counts[i], slot);
  if (kind == kProbeHit) {
    atomicAdd(plan + kPlanHits, 1ull);
  } else {
    atomicAdd(plan + kPlanMisses, 1ull);
    if (kind == kProbeHotMiss) atomicAdd(plan + kPlanHot, 1ull);
  }
}

// One thread per unique key i: rank[i] (promotion_rank), from the probe's counts
// and the cache's free slots (capacity - *size). Thread 0 sets plan[kPlanTaken].
extern "C" __global__ void demb_cache_rank(const int64_t* counts, const int64_t* host_slots,
                                           const int64_t* cache_slots, int64_t n,
                                           int64_t capacity, const int64_t* size,
                                           unsigned long long* plan, int64_t* rank) {
  const int64_t i = global_thread();
  PromotionTotals totals;
  totals.hits = static_cast<int64_t>(plan[kPlanHits]);
  totals.misses = static_cast<int64_t>(plan[kPlanMisses]);
  totals.hot = static_cast<int64_t>(plan[kPlanHot]);
  if (i == 0) plan[kPlanTaken] = static_cast<unsigned long long>(totals.taken(capacity, *size));
  if (i >= n) return;
  rank[i] = promotion_rank(counts[i], host_slots[i], cache_slots[i],
                           totals.overflows(capacity, *size));
}

// One thread per sorted position q of order (n,) (the keys by descending rank): the
// cache call's key, table id, score and bucket (order_one).
extern "C" __global__ void demb_promotion_order(const int64_t* order, const int64_t* keys,
                                                const int16_t* tids, const int64_t* host_slots,
                                                const int64_t* host_keys_scores, int64_t n,
                                                const unsigned long long* plan,
                                                int64_t num_buckets, int64_t* out_keys,
                                                int16_t* out_tids, int64_t* out_scores,
                                                int32_t* out_buckets) {
  const int64_t q = global_thread();
  if (q >= n) return;
  order_one(q, order, keys, tids, host_slots, host_keys_scores,
            static_cast<int64_t>(plan[kPlanTaken]), num_buckets, out_keys, out_tids,
            out_scores, out_buckets);
}

// The row copy of promote_one by one warp: lane l copies columns l, l + 32, ...
struct WarpCopy {
  __device__ __forceinline__ void operator()(float* dst, const float* src, int64_t width) const {
    for (int64_t c = lane_id(); c < width; c += kWarp) dst[c] = src[c];
  }
};

// One warp per sorted position q, after the cache call (slots, status, ev_keys,
// ev_tids (n,), in sorted order): promote_one, the victim's host slot found by
// lane 0 in the host store (whose parameters these are); and the row reference of
// unique key order[q].
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
  int64_t home_slot = -1;
  if (writes_back(st)) {
    if (lane_id() == 0) home_slot = find_slot(DEMB_TABLE_VIEW, ev_keys[q], ev_tids[q], false);
    home_slot = __shfl_sync(kFullMask, home_slot, 0);
  }
  const int64_t ref = promote_one(WarpCopy{}, st, slots[q], host_slots[i], home_slot,
                                  host_values, cache_values, width);
  if (lane_id() == 0) refs[i] = ref;
}
