// What the CPU loops over a table share (hash_table.cpp, cache.cpp): the table's
// view from its `meta` tensors, the batch checks and the chunked, prefetched find.
#pragma once

#include <vector>

#include "cpu/aten.h"
#include "cpu/checks.h"
#include "cpu/probe.h"
#include "dynamicemb/hash_primitives.h"
#include "dynamicemb/table_view.h"

namespace dynamicemb {
namespace cpu {

// Below this many keys one thread is faster than waking the pool.
constexpr int64_t kParallelMinKeys = 4096;

// The shared TableView plus what only the CPU loops' threading needs.
struct CpuTableView : TableView {
  int bc_shift;  // log2(bc) when bc is a power of two, else -1

  int64_t bucket_of_slot(int64_t s) const { return bc_shift >= 0 ? s >> bc_shift : s / bc; }
  // The thread of `nt` that owns bucket b in calls that split buckets among threads:
  // contiguous ranges, so threads never write the same bitmap cache line (with
  // b % nt, neighbouring buckets' pinned bits shared lines across threads).
  int owner_of(int64_t b, int nt) const {
    return static_cast<int>((b * nt) >> __builtin_ctzll(static_cast<uint64_t>(num_buckets)));
  }
};

inline CpuTableView view_of(const std::vector<at::Tensor>& meta, int64_t bc) {
  TORCH_CHECK(meta.size() == 6, "meta must hold 6 tensors, got ", meta.size());
  for (int f = 0; f < 2; ++f) {
    const char* name = f == 0 ? "keys" : "scores";
    TORCH_CHECK(meta[f].device().is_cpu() && meta[f].scalar_type() == at::kLong &&
                    meta[f].dim() == 1 && meta[f].stride(0) == kSlotWords,
                name, " must be an int64 CPU column of the (capacity, 2) slot array");
  }
  TORCH_CHECK(meta[1].numel() == meta[0].numel() &&
                  meta[1].data_ptr<int64_t>() == meta[0].data_ptr<int64_t>() + 1,
              "keys and scores must be the two columns of one (capacity, 2) array");
  check_tensor(meta[2], at::kShort, "tids");
  check_tensor(meta[3], at::kByte, "digests");
  check_tensor(meta[4], at::kLong, "occupied");
  check_tensor(meta[5], at::kLong, "pinned");
  const int64_t num_buckets = meta[0].numel() / bc;
  TORCH_CHECK(num_buckets * bc == meta[0].numel(), "capacity not a multiple of bc");
  TORCH_CHECK(meta[4].numel() == num_buckets * words_per_bucket(static_cast<int>(bc)),
              "occupied has wrong size");
  CpuTableView v;
  static_cast<TableView&>(v) = table_view(
      meta[0].data_ptr<int64_t>(), meta[2].data_ptr<int16_t>(), meta[3].data_ptr<uint8_t>(),
      reinterpret_cast<uint64_t*>(meta[4].data_ptr<int64_t>()),
      reinterpret_cast<uint64_t*>(meta[5].data_ptr<int64_t>()), num_buckets,
      static_cast<int>(bc));
  v.bc_shift = (bc & (bc - 1)) == 0 ? __builtin_ctzll(static_cast<uint64_t>(bc)) : -1;
  return v;
}

inline void check_batch(const at::Tensor& keys, const at::Tensor& tids) {
  check_tensor(keys, at::kLong, "keys");
  check_tensor(tids, at::kShort, "table_ids");
  TORCH_CHECK(keys.dim() == 1 && tids.sizes() == keys.sizes(),
              "keys and table_ids must be 1-D of one length");
}

inline void prefetch(const void* p) { __builtin_prefetch(p, 0, 3); }

// Probe up to kChunk keys in three phases so that the cache misses of a chunk
// overlap: hash and prefetch the buckets' digests; find each key's first digest
// match and prefetch its key and table id; then compare. The r-th key of the chunk
// is position at(r) of keys, tids and slots, r < m.
constexpr int kChunk = 128;

template <class Positions>
inline void find_chunk(const TableView& v, const int64_t* keys, const int16_t* tids,
                       const Positions& at, int m, bool single_table, int64_t* slots) {
  KeyHome home[kChunk];
  int first[kChunk];
  for (int r = 0; r < m; ++r) {
    const int64_t i = at(r);
    const KeyHome& h = home[r] = home_of(v, hash_key(keys[i], tids[i]));
    prefetch(v.digests + h.base + h.start);  // the key's start group
  }
  for (int r = 0; r < m; ++r) {
    const KeyHome& h = home[r];
    const int j = next_digest_match(v.digests + h.base, v.bc, h.digest, h.start);
    first[r] = j;
    if (j >= 0) {
      prefetch(&v.keys[h.base + j]);
      if (!single_table) prefetch(v.tids + h.base + j);
    }
  }
  for (int r = 0; r < m; ++r) {
    const int64_t i = at(r);
    const KeyHome& h = home[r];
    const int j = find_one(v, DigestProbe{}, h, keys[i], tids[i], single_table, first[r]);
    slots[i] = j < 0 ? -1 : h.base + j;
  }
}

}  // namespace cpu
}  // namespace dynamicemb
