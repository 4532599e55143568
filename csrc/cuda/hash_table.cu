// CUDA kernels of the scored hash table. find, erase, undo and grow are a
// thread per key or slot over the per-key procedures of dynamicemb/table_view.h
// (with the device's probe and atomic bit policies of common.cuh); the inserting
// pass is the GPU's own warp-cooperative algorithm, which meets the per-key
// contract written there. dynamicemb/ops/cuda/ launches them on PyTorch's current
// stream; the Python side owns the tensors and the policy.
//
// Inserting calls are processed bucket by bucket: the caller sorts the keys of a
// pass by bucket (stably, so each bucket's keys keep their input order) and one
// warp walks each bucket's run. A bucket is then only ever touched by one warp,
// so no slot needs a lock or an atomic, and the result is the one the CPU loop
// gives (it also walks each bucket's keys in input order): same slots, same
// victims. The warp probes 128 digests per load, and chooses
// victims by a warp reduction. While a warp walks its bucket, the bucket's
// occupied and pinned bits live in every lane's registers (each lane applies
// the same updates) and each slot is written by its owner lane (owner_lane), so
// settling a key waits on no store of the key before it.
#include "cuda/common.cuh"

namespace dynamicemb {
namespace cuda {
namespace {

// Most slots per bucket the inserting kernel supports (bits kept in registers).
constexpr int kMaxBucketWords = 16;  // bucket_capacity <= 1024

// The bits of the bucket a warp is walking, the same in every lane.
struct BucketBits {
  uint64_t occupied[kMaxBucketWords];
  uint64_t pinned[kMaxBucketWords];
  uint64_t pinned_here[kMaxBucketWords];  // pins taken by this pass
  int words;
};

// One key of a bucket's run; the calling warp owns bucket b. `hint` is the
// offset where the key was seen at the start of its chunk (or -1): trusted only
// if the slot still holds the key, since an earlier key of the run may have
// evicted it (and a key not seen then may since have been inserted by a repeat
// of it). Returns the key's status, kExpiredHit for a hit on a row last accessed
// before `expired_before` (written as kInserted: upsert_one's contract).
template <class Rule>
__device__ int8_t upsert_key(const TableView& v, const PassOutputs& o, const Rule& rule,
                             BucketBits& bits, int64_t i, int64_t key, int16_t tid,
                             uint64_t given, uint64_t h, int hint, bool evicts,
                             bool one_table, uint64_t expired_before) {
  const int64_t base = bucket_of(h, v.num_buckets) * v.bc;
  const uint8_t digest = digest_of(h);
  const int lane = lane_id();
  bool holds = false;
  if (hint >= 0 && lane == owner_lane(hint)) {
    holds = v.digests[base + hint] == digest && v.keys[base + hint] == key &&
            (one_table || v.tids[base + hint] == tid);
  }
  int j = __any_sync(kFullMask, holds) ? hint : probe_warp(v, base, key, tid, one_table, digest);
  if (j >= 0) {
    // the slot's owner reads its score, and tells the warp whether the row expired
    uint64_t old = 0;
    if (lane == owner_lane(j)) old = v.scores[base + j];
    const bool expired =
        __shfl_sync(kFullMask, rule.time_of(old) < expired_before ? 1 : 0, owner_lane(j)) != 0;
    if (lane == owner_lane(j)) {
      if (o.prev_scores) o.prev_scores[i] = old;
      v.scores[base + j] = expired ? rule.on_insert(given) : rule.on_hit(old, given);
      o.slots[i] = base + j;
      o.status[i] = expired ? kInserted : kHit;
    }
    set_bit(bits.pinned, j);
    set_bit(bits.pinned_here, j);
    return expired ? kExpiredHit : kHit;
  }
  int8_t outcome = kInserted;
  j = first_clear_bit_from(bits.occupied, v.bc, start_offset(h, v.bc));
  if (j < 0) {
    j = evicts ? choose_victim_warp(v, base / v.bc, bits.pinned) : -1;
    if (j < 0) {
      if (lane == 0) {
        o.slots[i] = -1;
        o.status[i] = kFailed;
        if (o.prev_scores) o.prev_scores[i] = kNoPrevScore;
      }
      return kFailed;
    }
    if (lane == owner_lane(j)) {
      o.ev_keys[i] = v.keys[base + j];
      o.ev_tids[i] = v.tids[base + j];
      o.ev_scores[i] = v.scores[base + j];
    }
    outcome = kEvictedAndInserted;
  }
  set_bit(bits.occupied, j);
  set_bit(bits.pinned, j);
  set_bit(bits.pinned_here, j);
  if (lane == owner_lane(j)) {
    v.keys[base + j] = key;
    v.tids[base + j] = tid;
    v.digests[base + j] = digest;
    v.scores[base + j] = rule.on_insert(given);
    if (o.prev_scores) o.prev_scores[i] = kNoPrevScore;
    o.slots[i] = base + j;
    o.status[i] = outcome;
  }
  return outcome;
}

// What one inserting pass gives each of its runs: the keys (n,), their scores (per
// key, or per table: given_score), the order of the pass's positions and its options.
struct PassInputs {
  const int64_t* keys;
  const int16_t* tids;
  const uint64_t* given;
  const uint64_t* table_scores;
  const int64_t* order;
  bool evicts;
  bool one_table;
  uint64_t expired_before;  // expired_before(now, ttl): 0, nothing expires
};

// The run of keys order[q0, q1) of bucket b, in order. The run goes 32 keys at
// a time: each lane loads one key and probes for it (its hint), then the warp
// settles the 32 in order with the key's fields broadcast by shuffles. A key
// whose own hash is not of bucket b (stale buckets given by the caller) fails
// (slot -1, kFailed) and touches no slot: the warp owns bucket b only. At the
// end the bucket's bits are stored, this pass's pins cleared. outcomes (5,) += the
// run's keys by status, and outcomes[kExpiredOutcome] += its expired hits.
// Returns the run's inserts into empty slots (the same in every lane).
template <class Rule>
__device__ unsigned long long upsert_run(const TableView& v, const PassOutputs& o,
                                         const Rule& rule, const PassInputs& in, int64_t b,
                                         int64_t q0, int64_t q1,
                                         unsigned long long* outcomes) {
  const int64_t* keys = in.keys;
  const int16_t* tids = in.tids;
  const int64_t* order = in.order;
  BucketBits bits;
  bits.words = v.words;
  for (int w = 0; w < bits.words; ++w) {
    bits.occupied[w] = v.occupied_of(b)[w];
    bits.pinned[w] = v.pinned_of(b)[w];
    bits.pinned_here[w] = 0;
  }
  unsigned long long counted[kExpiredHit + 1] = {0, 0, 0, 0, 0, 0};
  for (int64_t chunk = q0; chunk < q1; chunk += kWarp) {
    __syncwarp();  // the chunk's probes read slots other lanes wrote
    const int64_t q = chunk + lane_id();
    int64_t my_i = 0, my_key = 0;
    int my_tid = 0, my_hint = -1;
    uint64_t my_h = 0, my_given = 0;
    if (q < q1) {
      my_i = order[q];
      my_key = keys[my_i];
      my_tid = tids[my_i];
      my_given = given_score(in.given, in.table_scores, my_i, static_cast<int16_t>(my_tid));
      my_h = hash_key(my_key, static_cast<int16_t>(my_tid));
      my_hint = find_one(v, ThreadProbe{}, home_of(v, my_h), my_key,
                         static_cast<int16_t>(my_tid), in.one_table);
    }
    const int in_chunk = q1 - chunk < kWarp ? static_cast<int>(q1 - chunk) : kWarp;
    for (int t = 0; t < in_chunk; ++t) {
      const int64_t i = __shfl_sync(kFullMask, my_i, t);
      const uint64_t h = __shfl_sync(kFullMask, my_h, t);
      int8_t status = kFailed;
      if (bucket_of(h, v.num_buckets) != b) {  // not this warp's bucket: fails untouched
        if (lane_id() == 0) {
          o.slots[i] = -1;
          o.status[i] = kFailed;
          if (o.prev_scores) o.prev_scores[i] = kNoPrevScore;
        }
      } else {
        status = upsert_key(v, o, rule, bits, i, __shfl_sync(kFullMask, my_key, t),
                            static_cast<int16_t>(__shfl_sync(kFullMask, my_tid, t)),
                            __shfl_sync(kFullMask, my_given, t), h,
                            __shfl_sync(kFullMask, my_hint, t), in.evicts, in.one_table,
                            in.expired_before);
      }
      ++counted[status];
    }
  }
  if (lane_id() == 0) {
    for (int s = 0; s <= kFailed; ++s) {
      if (counted[s]) atomicAdd(outcomes + s, counted[s]);
    }
    if (counted[kExpiredHit]) atomicAdd(outcomes + kExpiredOutcome, counted[kExpiredHit]);
    for (int w = 0; w < bits.words; ++w) {
      v.occupied_of(b)[w] = bits.occupied[w];
      v.pinned_of(b)[w] = bits.pinned[w] & ~bits.pinned_here[w];
    }
  }
  return counted[kInserted];
}

}  // namespace
}  // namespace cuda
}  // namespace dynamicemb

using namespace dynamicemb;
using namespace dynamicemb::cuda;

// out[i] = hash_key(keys[i], tids[i]). keys (n,), tids (n,), out (n,).
extern "C" __global__ void demb_hash_keys(const int64_t* keys, const int16_t* tids, int64_t n,
                                          int64_t* out) {
  const int64_t i = global_thread();
  if (i < n) out[i] = static_cast<int64_t>(hash_key(keys[i], tids[i]));
}

// buckets[i] = bucket of (keys[i], tids[i]) in a table of num_buckets; (n,) int32.
extern "C" __global__ void demb_buckets_of(const int64_t* keys, const int16_t* tids, int64_t n,
                                           int64_t num_buckets, int32_t* buckets) {
  const int64_t i = global_thread();
  if (i >= n) return;
  buckets[i] = static_cast<int32_t>(bucket_of(hash_key(keys[i], tids[i]), num_buckets));
}

// slots[i] = slot of (keys[i], tids[i]) or -1. One thread per key.
extern "C" __global__ void demb_find(DEMB_TABLE_PARAMS, const int64_t* keys, const int16_t* tids,
                                     int64_t n, bool one_table, int64_t* slots) {
  const int64_t i = global_thread();
  if (i < n) slots[i] = find_slot(DEMB_TABLE_VIEW, keys[i], tids[i], one_table);
}

// The end of the run of bucket b that starts at q0 in sorted_buckets (m,): the first
// position past q0 of another bucket, or m. The warp reads 32 positions at a time.
__device__ int64_t run_end(const int32_t* sorted_buckets, int64_t m, int64_t q0, int32_t b) {
  for (int64_t base = q0 + 1; base < m; base += kWarp) {
    const int64_t q = base + lane_id();
    const unsigned other = __ballot_sync(kFullMask, q >= m || sorted_buckets[q] != b);
    if (other) return min(m, base + __ffs(other) - 1);
  }
  return m;
}

// One inserting pass. `order` (m,) holds the pass's key positions sorted stably
// by bucket, sorted_buckets (m,) their buckets: the keys of a bucket are a run. One
// warp per 32 positions: its lanes find which of them start a run (a ballot), and
// the warp settles those runs one after the other (so the host never learns how
// many runs there are). A position of bucket kNoBucket (padding, dedup.cu) gets
// slot -1 and status kFailed from its own lane and is counted nowhere.
// rule: 0 clock (score = now), 1 count (adds given), 2 given, 3 count then clock
// (LRU_LFU). outcomes (5,) += the pass's keys by InsertStatus (hit, inserted,
// evicted, failed), then its expired hits. now_at (null: time 0): the call's time,
// the table's clock or step in device memory. size: the table's size in device
// memory, += the inserts into empty slots. table_scores (null: none): the given
// rule's scores by table id, for a null `given`. ttl (0: none): a hit on a row
// last accessed before now - ttl is an insert (upsert_one).
extern "C" __global__ void demb_upsert(DEMB_TABLE_PARAMS, const int64_t* keys,
                                       const int16_t* tids, const uint64_t* given, int rule,
                                       bool evicts, bool one_table,
                                       const int32_t* sorted_buckets, const int64_t* order,
                                       int64_t m, int64_t* slots, int8_t* status,
                                       uint64_t* prev_scores, int64_t* ev_keys,
                                       int16_t* ev_tids, uint64_t* ev_scores,
                                       unsigned long long* outcomes, const int64_t* now_at,
                                       unsigned long long* size, const uint64_t* table_scores,
                                       uint64_t ttl) {
  const int64_t first = global_warp() * kWarp;  // the same for the warp's lanes
  if (first >= m) return;
  const uint64_t now = now_at != nullptr ? static_cast<uint64_t>(*now_at) : 0;
  const int64_t q = first + lane_id();
  bool starts = false;
  if (q < m) {
    const int32_t b = sorted_buckets[q];
    if (b == kNoBucket) {  // a padding position: no slot, and no count
      slots[order[q]] = -1;
      status[order[q]] = kFailed;
      if (prev_scores) prev_scores[order[q]] = kNoPrevScore;
    } else {
      starts = q == 0 || sorted_buckets[q - 1] != b;
    }
  }
  unsigned runs = __ballot_sync(kFullMask, starts);
  const TableView v = DEMB_TABLE_VIEW;
  const PassOutputs o{slots, status, prev_scores, ev_keys, ev_tids, ev_scores};
  const PassInputs in{keys,   tids,      given, table_scores,
                      order,  evicts,    one_table, expired_before(now, ttl)};
  unsigned long long inserted = 0;
  while (runs) {
    const int64_t q0 = first + __ffs(runs) - 1;
    runs &= runs - 1;
    const int32_t b = sorted_buckets[q0];
    const int64_t q1 = run_end(sorted_buckets, m, q0, b);
    switch (rule) {
      case 0:
        inserted += upsert_run(v, o, ClockScore{now}, in, b, q0, q1, outcomes);
        break;
      case 1:
        inserted += upsert_run(v, o, CountScore{}, in, b, q0, q1, outcomes);
        break;
      case 3:
        inserted += upsert_run(v, o, CountThenClockScore{now}, in, b, q0, q1, outcomes);
        break;
      default:
        inserted += upsert_run(v, o, GivenScore{}, in, b, q0, q1, outcomes);
        break;
    }
  }
  if (inserted && lane_id() == 0) atomicAdd(size, inserted);
}

// Reverts an inserting call: a thread per key, given only the oldest key of each
// slot the call touched (slots of the others -1): its record alone restores the
// slot (undo_one), so slots are independent and their bits are cleared atomically.
extern "C" __global__ void demb_undo_upsert(DEMB_TABLE_PARAMS, const int64_t* slots,
                                            const int8_t* status, const uint64_t* prev_scores,
                                            const int64_t* ev_keys, const int16_t* ev_tids,
                                            const uint64_t* ev_scores, int64_t n) {
  const int64_t i = global_thread();
  if (i >= n || slots[i] < 0) return;
  const TableView v = DEMB_TABLE_VIEW;
  const PassRecord r{slots, status, prev_scores, ev_keys, ev_tids, ev_scores};
  undo_one<AtomicBits>(v, r, i);
}

// Moves old slot `from` (one thread each) to the table with twice the buckets,
// at the same offset of its new bucket (b or b + old buckets, so no two old
// buckets meet). moved (old capacity,) = new slot, or -1 for an empty slot.
extern "C" __global__ void demb_grow(DEMB_TABLE_PARAMS, int64_t* new_slot_words,
                                     int16_t* new_tids, uint8_t* new_digests,
                                     uint64_t* new_occupied, uint64_t* new_pinned,
                                     int64_t* moved) {
  const int64_t from = global_thread();
  if (from >= num_buckets * bc) return;
  const TableView o = DEMB_TABLE_VIEW;
  const TableView n =
      table_view(new_slot_words, new_tids, new_digests, new_occupied, new_pinned,
                 2 * num_buckets, bc);
  const int64_t b = from / bc;
  // Threads of neighbouring old slots share the new bitmap words: atomic bits.
  moved[from] = move_one<AtomicBits>(o, n, b, static_cast<int>(from - b * bc));
}

// Erases keys that are unique in the call; erased (n,) = whether each was present.
extern "C" __global__ void demb_erase(DEMB_TABLE_PARAMS, const int64_t* keys,
                                      const int16_t* tids, int64_t n, bool* erased) {
  const int64_t i = global_thread();
  if (i >= n) return;
  const TableView v = DEMB_TABLE_VIEW;
  // Threads of other keys of the bucket share its bitmap words: atomic bits.
  erased[i] = erase_one<AtomicBits>(v, ThreadProbe{}, home_of(v, hash_key(keys[i], tids[i])),
                                    keys[i], tids[i]);
}

// Erases keys[i] wherever status[i] == which (the victims of a call, by their
// status in it: each a different key), one thread each; erased[0] += and size[0]
// -= the keys found (size: the table's size in device memory).
extern "C" __global__ void demb_erase_where(DEMB_TABLE_PARAMS, const int64_t* keys,
                                            const int16_t* tids, const int8_t* status,
                                            int which, int64_t n,
                                            unsigned long long* erased,
                                            unsigned long long* size) {
  const int64_t i = global_thread();
  if (i >= n || status[i] != which) return;
  const TableView v = DEMB_TABLE_VIEW;
  if (erase_one<AtomicBits>(v, ThreadProbe{}, home_of(v, hash_key(keys[i], tids[i])), keys[i],
                            tids[i])) {
    atomicAdd(erased, 1ull);
    atomicAdd(size, ~0ull);  // - 1
  }
}

// TTL sweep, one thread per slot: empties slots whose last access (score &
// time_mask) is before `before`; expired (capacity,) = whether each was emptied.
extern "C" __global__ void demb_expire(DEMB_TABLE_PARAMS, uint64_t time_mask, uint64_t before,
                                       bool* expired) {
  const int64_t s = global_thread();
  if (s >= num_buckets * bc) return;
  const TableView v = DEMB_TABLE_VIEW;
  const int64_t b = s / bc;
  // Threads of a bucket's slots share its bitmap words: atomic bits.
  expired[s] = expire_one<AtomicBits>(v, b, static_cast<int>(s - b * bc), time_mask, before);
}
