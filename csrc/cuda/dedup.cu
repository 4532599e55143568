// CUDA dedup of (table id, key) pairs: an open-addressing set over one batch in
// which each entry ends holding the smallest position of its pair. Position
// order then gives the unique pairs in first-occurrence order, as the CPU dedup
// gives them (dynamicemb/ops/cuda.py scans the first-position flags between the
// two kernels below).
#include "cuda/common.cuh"

using namespace dynamicemb;
using namespace dynamicemb::cuda;

// An entry holds a position + 1 (a zeroed set is empty: its fill is shared).
constexpr int32_t kEmptyEntry = 0;

// Inserts position i of keys (n,) into `set` (mask + 1 entries, all 0), and
// records in where (n,) the entry of its pair. An entry only ever holds
// positions of one pair, so atomicMin leaves the first of them. lookup_group
// (null: every position): a position whose entry is not `group` is another
// group's lookup: it is left out (where -1).
extern "C" __global__ void demb_dedup_insert(const int64_t* keys, const int16_t* tids, int64_t n,
                                             int32_t* set, int64_t mask, int64_t* where,
                                             const int64_t* lookup_group, int64_t group) {
  const int64_t i = global_thread();
  if (i >= n) return;
  if (lookup_group != nullptr && lookup_group[i] != group) {
    where[i] = -1;
    return;
  }
  const int64_t key = keys[i];
  const int16_t tid = tids[i];
  int64_t pos = static_cast<int64_t>(hash_key(key, tid) & static_cast<uint64_t>(mask));
  while (true) {
    int32_t held = set[pos];
    if (held == kEmptyEntry) {
      held = atomicCAS(&set[pos], kEmptyEntry, static_cast<int32_t>(i + 1));
      if (held == kEmptyEntry) break;
    }
    if (keys[held - 1] == key && tids[held - 1] == tid) {
      atomicMin(&set[pos], static_cast<int32_t>(i + 1));
      break;
    }
    pos = (pos + 1) & mask;
  }
  where[i] = pos;
}

// first[i] = the first position of the pair of position i (set[where[i]] - 1), and
// is_first[i] = whether i is that position (1 or 0; its scan numbers the pairs);
// first -1 and is_first 0 for a position left out (where -1).
extern "C" __global__ void demb_dedup_first(const int32_t* set, const int64_t* where, int64_t n,
                                            int64_t* first, int64_t* is_first) {
  const int64_t i = global_thread();
  if (i >= n) return;
  first[i] = where[i] < 0 ? -1 : set[where[i]] - 1;
  is_first[i] = first[i] == i;
}

// Given number[i] = the inclusive scan of is_first (so the pair first seen at i is
// unique pair number[i] - 1): inverse[i] = its pair's number, occurrences[u] +=
// 1 (zeroed before), and the first position of each pair writes its key and
// table id to unique_keys/unique_tids, and when unique_buckets is given its bucket
// in a table of num_buckets (what an inserting pass over the unique pairs sorts
// by). Integer atomics: the counts are exact whatever the order.
//
// The unique arrays have n entries, and those past the unique count
// (number[n - 1], which stays on the device) are padding: key 0, table 0, bucket
// kNoBucket (an inserting pass marks them failed and counts nothing). error
// (null: none): a batch refused by the module's input check (*error != 0) has no
// unique pair: every position pads and every inverse is -1, so nothing
// after the dedup reads or changes a row for it. A position left out by the
// insert (first -1: another group's lookup) gets inverse -1. time (null: none):
// the table's clock and step (2,), advanced by one for the call unless it is
// refused (the launch has at least one thread, so an empty batch ticks too).
extern "C" __global__ void demb_dedup_number(const int64_t* keys, const int16_t* tids,
                                             const int64_t* first, const int64_t* number,
                                             int64_t n, int64_t* unique_keys,
                                             int16_t* unique_tids, int64_t* inverse,
                                             unsigned long long* occurrences,
                                             int64_t num_buckets, int32_t* unique_buckets,
                                             const int64_t* error,
                                             int64_t* time) {
  const int64_t i = global_thread();
  const bool refused = error != nullptr && *error != 0;
  if (i == 0 && time != nullptr && !refused) {
    ++time[0];
    ++time[1];
  }
  if (i >= n) return;
  if (i >= (refused ? 0 : number[n - 1])) {
    unique_keys[i] = 0;
    unique_tids[i] = 0;
    if (unique_buckets != nullptr) unique_buckets[i] = kNoBucket;
  }
  const int64_t f = first[i];
  if (refused || f < 0) {
    inverse[i] = -1;
    return;
  }
  const int64_t u = number[f] - 1;
  inverse[i] = u;
  atomicAdd(occurrences + u, 1ull);
  if (f == i) {
    unique_keys[u] = keys[i];
    unique_tids[u] = tids[i];
    if (unique_buckets != nullptr) {
      unique_buckets[u] = static_cast<int32_t>(bucket_of(hash_key(keys[i], tids[i]), num_buckets));
    }
  }
}
