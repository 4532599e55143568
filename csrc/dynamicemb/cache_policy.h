// A padded batch's promotion into a device cache, per key, written once for every
// backend: csrc/cuda/cache.cu (one thread per key, one warp per row) and
// csrc/cpu/cache.cpp (OpenMP) are loops over these procedures. NVRTC compiles this
// header: it includes nothing but other headers of this folder.
//
// The batch's unique keys are padded to its lookup count n (count 0: padding, or a
// key of another group), and the host store has found or inserted them (host_slots,
// -1 where its insert failed). The cache is a second table whose scores are the
// host store's. Four loops, with one stable sort between the second and the third:
//   probe:   each key's cache slot before the call, -1 where absent or not
//            promotable; the plan counts hits, misses and hot misses (probe_kind);
//   rank:    the number of keys the cache call takes (PromotionTotals::taken) and
//            each key's rank (promotion_rank);
//   order:   the keys by descending rank become the cache call's keys, table ids,
//            scores and buckets (order_one);
//   promote: after the cache's insert, victims' rows go back to the host
//            store, new keys' rows come in, every key gets its reference (promote_one).
//
// The policy (both backends loop over these procedures; storage/layouts.py Cache.take calls them):
// the batch's hits come first, so they are pinned before any miss picks a victim;
// then every miss, in batch order, when the misses fit in the cache's free slots;
// else only the misses seen more than once, hottest first, at most as many as the
// cache holds beside the hits. Under a power law most keys of a batch are seen
// once: promoting them would push out rows that come back, for a copy in and a
// write-back each. The keys left out are read and updated in the host store.
#pragma once

#include "dynamicemb/hash_primitives.h"
#include "dynamicemb/row_ref.h"

namespace dynamicemb {

// plan (4,) int64: what the probe counted, and how many of the sorted positions
// the cache call takes.
constexpr int kPlanHits = 0;
constexpr int kPlanMisses = 1;
constexpr int kPlanHot = 2;
constexpr int kPlanTaken = 3;

// Ranks: larger first, ties in batch order (the sort is stable).
constexpr int64_t kRankHit = INT64_MAX;  // above every miss
constexpr int64_t kRankMiss = 0;         // every miss, when all of them fit
constexpr int64_t kRankCold = -1;        // a miss seen once, when they do not
constexpr int64_t kRankLeftOut = -2;     // padding, or no row in the host store

// Whether unique key i takes part: a key of the batch whose row the host store holds.
DEMB_HD bool is_promotable(int64_t count, int64_t host_slot) {
  return count > 0 && host_slot >= 0;
}

// A key seen more than once in the batch: the only misses promoted when not all fit.
DEMB_HD bool is_hot(int64_t count) { return count > 1; }

// What the probe counts of a promotable key at cache slot `slot` (-1: a miss).
enum ProbeKind : int8_t { kProbeHit = 0, kProbeMiss = 1, kProbeHotMiss = 2 };

DEMB_HD ProbeKind probe_kind(int64_t count, int64_t slot) {
  if (slot >= 0) return kProbeHit;
  return is_hot(count) ? kProbeHotMiss : kProbeMiss;
}

// The probe's counts, and what they decide.
struct PromotionTotals {
  int64_t hits;
  int64_t misses;  // hot misses included
  int64_t hot;

  // The misses do not fit in the cache's free slots: only hot ones are taken.
  DEMB_HD bool overflows(int64_t capacity, int64_t size) const {
    return misses > capacity - size;
  }
  // How many keys the cache call takes, the hits included: the first positions of
  // the order.
  DEMB_HD int64_t taken(int64_t capacity, int64_t size) const {
    if (!overflows(capacity, size)) return hits + misses;
    const int64_t room = capacity - hits > 0 ? capacity - hits : 0;
    return hits + (hot < room ? hot : room);
  }
};

// Unique key i's rank, from its probe (cache_slot -1: not cached or not promotable)
// and whether the misses overflow the cache.
DEMB_HD int64_t promotion_rank(int64_t count, int64_t host_slot, int64_t cache_slot,
                               bool overflow) {
  if (!is_promotable(count, host_slot)) return kRankLeftOut;
  if (cache_slot >= 0) return kRankHit;
  if (!overflow) return kRankMiss;
  return is_hot(count) ? count : kRankCold;
}

// Sorted position q of the cache call, order[q] being its unique key: the key,
// table id, score (the host store's: host_keys_scores is its (slots, 2) array of
// keys and scores; 0 where not stored) and bucket, kNoBucket at q >= taken (the
// call skips it). Each output is (n,).
DEMB_HD void order_one(int64_t q, const int64_t* order, const int64_t* keys,
                       const int16_t* tids, const int64_t* host_slots,
                       const int64_t* host_keys_scores, int64_t taken, int64_t num_buckets,
                       int64_t* out_keys, int16_t* out_tids, int64_t* out_scores,
                       int32_t* out_buckets) {
  const int64_t i = order[q];
  const int64_t slot = host_slots[i];
  out_keys[q] = keys[i];
  out_tids[q] = tids[i];
  out_scores[q] = slot >= 0 ? host_keys_scores[kSlotWords * slot + 1] : 0;
  out_buckets[q] = q < taken ? static_cast<int32_t>(bucket_of(hash_key(keys[i], tids[i]),
                                                              num_buckets))
                             : kNoBucket;
}

// Whether the cache call's status at a position evicted a row, which goes back to
// its host slot (found by the caller, only then: home_slot of promote_one).
DEMB_HD bool writes_back(int8_t status) { return status == kEvictedAndInserted; }

// A sorted position after the cache call (its status and cache slot), whose unique
// key has host slot host_slot: the victim's row is written back to home_slot (-1:
// the host store no longer holds it) before the new key's row is copied in from
// the host store, full rows of width floats; returns the key's row reference (its
// cache slot, else its host slot with kHostRowBit, else -1). `copy(dst, src,
// width)` is the backend's row copy (a memcpy, a warp's lanes). A slot is taken by
// one position and a victim is no key the call takes (hits are pinned first, new
// keys as they land), so positions may run in any order, or at once.
template <class Copy>
DEMB_HD int64_t promote_one(const Copy& copy, int8_t status, int64_t slot, int64_t host_slot,
                            int64_t home_slot, float* host_values, float* cache_values,
                            int64_t width) {
  if (writes_back(status) && home_slot >= 0) {
    copy(host_values + home_slot * width, cache_values + slot * width, width);
  }
  if (status == kInserted || status == kEvictedAndInserted) {
    copy(cache_values + slot * width, host_values + host_slot * width, width);
  }
  return slot >= 0 ? slot : host_slot >= 0 ? host_slot + kHostRowBit : -1;
}

}  // namespace dynamicemb
