// Every CPU verb of the extension dynamicemb._C_<level>, declared once: bindings.cpp
// binds them, hash_table.cpp, cache.cpp and embedding.cpp define them. Python reaches
// them only through dynamicemb/ops/cpu.py; dynamicemb/ops/cuda.py offers the same verbs
// on CUDA.
//
// `meta` is the table's tensor list [keys, scores, tids, digests, occupied, pinned]
// (csrc/dynamicemb/hash_primitives.h), `bc` its bucket capacity. `tiers` is
// [device values, host values], both (*, width) float rows [embedding | optimizer
// state]; the host tensor may be empty. `row_ref` (U,) holds each unique row's
// reference (csrc/dynamicemb/row_ref.h).
#pragma once

#include "cpu/aten.h"

#include <tuple>
#include <vector>

namespace dynamicemb {
namespace cpu {

// ---- the scored hash table (hash_table.cpp)

// The 64-bit hash of each (table id, key). keys (n,) int64, tids (n,) int16.
at::Tensor hash_keys(const at::Tensor& keys, const at::Tensor& tids);
// Slot of each key, -1 where absent. Read-only.
at::Tensor find(const std::vector<at::Tensor>& meta, int64_t bc, const at::Tensor& keys,
                const at::Tensor& tids, bool single_table);
// What an inserting pass returns, (n,) each: (slots, status, prev_scores,
// ev_keys, ev_tids, ev_scores).
using PassResult =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
// What dedup_upsert returns: the dedup's (unique_keys, unique_tids, inverse,
// counts, starts, rank), then the PassResult.
using DedupUpserted =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
               at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
// dedup padded to the n keys, then an inserting pass over the unique keys, as the
// CUDA backend's: nothing is read on the host but the error word. part_groups (None: every key) and part_group are a
// BatchPart's fields; table_scores (T,) the given rule's scores by table id; ttl
// (0: none) the rows' lifetime. outcomes (5,): hits, inserted, evicted, failed,
// expired hits.
DedupUpserted dedup_upsert(
    const std::vector<at::Tensor>& meta, int64_t bc, const at::Tensor& keys,
    const at::Tensor& tids, const c10::optional<at::Tensor>& frequencies, int64_t rule,
    at::Tensor& time, int64_t now_index, bool evicts, bool one_table,
    const c10::optional<at::Tensor>& error, at::Tensor& outcomes, at::Tensor& size,
    const c10::optional<at::Tensor>& part_groups, int64_t part_group,
    const c10::optional<at::Tensor>& table_scores, int64_t ttl);
// One inserting pass over keys (n,) (buckets (n,) int32, optional: kNoBucket skips
// a key); outcomes (5,) and size (1,) advance. time (None: the call's time is 0)
// and now_index: the call's time is time[now_index]; ttl (0: none): a hit on a row
// expired at that time is an insert (outcomes[4]).
PassResult upsert(const std::vector<at::Tensor>& meta, int64_t bc, const at::Tensor& keys,
                  const at::Tensor& tids, const c10::optional<at::Tensor>& scores, int64_t rule,
                  bool evicts, bool one_table, const c10::optional<at::Tensor>& buckets,
                  at::Tensor& outcomes, at::Tensor& size, const c10::optional<at::Tensor>& time,
                  int64_t now_index, int64_t ttl);
// Reverts an inserting call from what its passes wrote (each (n,)), newest first.
void undo_upsert(const std::vector<at::Tensor>& meta, int64_t bc, const at::Tensor& slots,
                 const at::Tensor& status, const at::Tensor& prev_scores,
                 const at::Tensor& ev_keys, const at::Tensor& ev_tids,
                 const at::Tensor& ev_scores);
// Moves every slot into new_meta (twice the buckets); returns the new slot of
// each old slot, -1 where empty: (old capacity,).
at::Tensor grow(const std::vector<at::Tensor>& old_meta,
                const std::vector<at::Tensor>& new_meta, int64_t bc);
// Erases each key once; returns (n,) bool: whether it was there.
at::Tensor erase(const std::vector<at::Tensor>& meta, int64_t bc, const at::Tensor& keys,
                 const at::Tensor& tids);
// Erases keys[i] where status[i] == which; erased (1,) += and size (1,) -= the
// keys found.
void erase_where(const std::vector<at::Tensor>& meta, int64_t bc, const at::Tensor& keys,
                 const at::Tensor& tids, const at::Tensor& status, int64_t which,
                 at::Tensor& erased, at::Tensor& size);
// TTL sweep: empties every slot whose last access (score & time_mask) is before
// `before`; returns (capacity,) bool, the slots it emptied.
at::Tensor expire(const std::vector<at::Tensor>& meta, int64_t bc, int64_t time_mask,
                  int64_t before);
// Occupied slots of [start, end), ascending.
at::Tensor occupied_slots(const std::vector<at::Tensor>& meta, int64_t bc, int64_t start,
                          int64_t end);

// ---- a padded batch's promotion into a cache (cache.cpp; dynamicemb/cache_policy.h)

// The probe and the rank: (cache_slots (n,), plan (4,), rank (n,)) of unique keys
// padded to n (counts 0: padding; host_slots -1: not stored), for a cache `meta`
// holding cache_size (1,) keys.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> promotion_plan(
    const std::vector<at::Tensor>& meta, int64_t bc, const at::Tensor& keys,
    const at::Tensor& tids, const at::Tensor& counts, const at::Tensor& host_slots,
    bool one_table, const at::Tensor& cache_size);
// The cache call's (keys, tids, scores, buckets) (n,) in `order` (the keys by
// descending rank); host_keys is the keys column of the host store's (slots, 2) array.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> promotion_order(
    const at::Tensor& order, const at::Tensor& keys, const at::Tensor& tids,
    const at::Tensor& host_slots, const at::Tensor& host_keys, const at::Tensor& plan,
    int64_t num_buckets);
// After the cache call (slots .. ev_tids (n,), in `order`): victims' rows written back
// to the host store `host_meta`, new keys' rows copied in, refs (n,) written.
void promote_rows(const std::vector<at::Tensor>& host_meta, int64_t host_bc,
                  at::Tensor& host_values, at::Tensor& cache_values, const at::Tensor& order,
                  const at::Tensor& host_slots, const at::Tensor& slots,
                  const at::Tensor& status, const at::Tensor& ev_keys,
                  const at::Tensor& ev_tids, at::Tensor& refs);

// ---- the embedding module (embedding.cpp)
//
// The keyword arguments of a step counted on the device, as the CUDA kernels take
// them: `error`, the module's (1,) int64 error word (set: the batch was refused,
// nothing is read or updated; the outputs are written as the kernels write them);
// `init`, an InitRows; `schedule`, a DeviceSchedule (dynamicemb/ops/records.py).

// InitRows: (keys (U,) int64, table_ids (U,) int16, InitSpec (ints (T, 3) int64,
// floats (T, 5) float32)); a negative row reference reads its initializer's row.
using InitRowsArg = std::tuple<at::Tensor, at::Tensor, std::tuple<at::Tensor, at::Tensor>>;
// DeviceSchedule: (lr (1,) float64, step (1,) int64, advance, beta1, beta2,
// decoupled_decay).
using ScheduleArg = std::tuple<at::Tensor, at::Tensor, bool, double, double, double>;
// RowFormat of 16-bit rows: (code: 1 float16, 2 bfloat16; state_offset in bytes), in
// float32-word tiers [*, row_bytes / 4]; None: float32 rows.
using RowFormatArg = std::tuple<int64_t, int64_t>;
// How an update narrows 16-bit rows: (keys (U,) int64, table_ids (U,) int16, spec
// (T, 2) int64 of each table's (stream, seed), step (1,) int64 read after the
// schedule's advance (it may be the schedule's step), stochastic):
// rounding_primitives.h's bits, or round to nearest.
using RoundingArg = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, bool>;

// 0, or the first problem of an offsets tensor of num_indices lookups; with
// `error`, the problem recorded in the word and None returned.
c10::optional<int64_t> check_offsets(const at::Tensor& offsets, int64_t num_indices,
                                     const c10::optional<at::Tensor>& error);
// Unique (table, key) pairs in first-occurrence order, padded to the n keys:
// (unique_keys, unique_tids, inverse, counts, starts, rank), (n,) each but starts
// (n + 1,), both empty unless `group`; a refused batch
// (error word) has no pair; time (2,) (None: none) advances by one unless refused.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
dedup(const at::Tensor& keys, const at::Tensor& tids,
             const c10::optional<at::Tensor>& frequencies, bool group,
             const c10::optional<at::Tensor>& error, const c10::optional<at::Tensor>& time,
             const c10::optional<at::Tensor>& part_groups, int64_t part_group);
// values[slots[i]] = the full initial row [initializer (dim) | state_value] of each
// key (with a status: each whose status is kInserted or kEvictedAndInserted);
// init_ints (T, 3) and init_floats (T, 5) are an InitSpec's.
void init_rows(at::Tensor& values, const at::Tensor& slots,
               const c10::optional<at::Tensor>& status, const at::Tensor& keys,
               const at::Tensor& tids, int64_t dim, const at::Tensor& init_ints,
               const at::Tensor& init_floats, double state_value,
               const c10::optional<RowFormatArg>& row_format = c10::nullopt);
// Pooled lookup (sum or mean per bag) into out (batch, *) at each feature's column.
void pooled_forward(const std::vector<at::Tensor>& tiers, const at::Tensor& transient,
                    const at::Tensor& row_ref, const at::Tensor& inverse,
                    const at::Tensor& offsets, const c10::optional<at::Tensor>& weights,
                    const at::Tensor& feature_col, int64_t batch, int64_t dim, bool mean,
                    at::Tensor& out, const c10::optional<InitRowsArg>& init,
                    const c10::optional<at::Tensor>& error,
                    const c10::optional<RowFormatArg>& row_format);
// Sequence lookup: out (N, dim) row j = row of lookup j.
void sequence_forward(const std::vector<at::Tensor>& tiers, const at::Tensor& transient,
                      const at::Tensor& row_ref, const at::Tensor& inverse, int64_t dim,
                      at::Tensor& out, const c10::optional<InitRowsArg>& init,
                      const c10::optional<at::Tensor>& error,
                      const c10::optional<RowFormatArg>& row_format);
// The backward, checked per batch, in two passes: each unique row's gradient
// summed into sums (U, dim), returning how many sums hold NaN or inf; then the
// optimizer's update of every stored row from its sum.
int64_t sum_gradients(const at::Tensor& starts, const at::Tensor& rank,
                      const at::Tensor& offsets, const c10::optional<at::Tensor>& weights,
                      const at::Tensor& feature_col, int64_t batch, bool mean,
                      const at::Tensor& grad, at::Tensor& sums,
                      const c10::optional<at::Tensor>& error);
void update_rows(const std::vector<at::Tensor>& tiers, const at::Tensor& row_ref,
                 const at::Tensor& sums, int64_t kind, double lr, double eps, double beta1,
                 double beta2, double weight_decay, double step_size,
                 double bias_correction2_sqrt, double decay_scale,
                 const c10::optional<at::Tensor>& error,
                 const c10::optional<ScheduleArg>& schedule,
                 const c10::optional<RowFormatArg>& row_format,
                 const c10::optional<RoundingArg>& rounding);
// The backward, checked per row, in one pass: each unique row's gradient summed
// and, when finite, applied to its stored row; returns how many rows were not.
int64_t sum_and_update_rows(const std::vector<at::Tensor>& tiers, const at::Tensor& row_ref,
                            const at::Tensor& starts, const at::Tensor& rank,
                            const at::Tensor& offsets, const c10::optional<at::Tensor>& weights,
                            const at::Tensor& feature_col, int64_t batch, bool mean,
                            const at::Tensor& grad, int64_t dim, int64_t kind, double lr,
                            double eps, double beta1, double beta2, double weight_decay,
                            double step_size, double bias_correction2_sqrt,
                            double decay_scale, const c10::optional<at::Tensor>& error,
                            const c10::optional<ScheduleArg>& schedule,
                            const c10::optional<RowFormatArg>& row_format,
                            const c10::optional<RoundingArg>& rounding);
// Gradient of per-sample weights (SUM pooling): out (N,).
void per_sample_weight_grad(const std::vector<at::Tensor>& tiers,
                            const at::Tensor& transient, const at::Tensor& row_ref,
                            const at::Tensor& inverse, const at::Tensor& offsets,
                            const at::Tensor& feature_col, int64_t batch, int64_t dim,
                            const at::Tensor& grad, at::Tensor& out,
                            const c10::optional<InitRowsArg>& init,
                            const c10::optional<at::Tensor>& error,
                            const c10::optional<RowFormatArg>& row_format);

}  // namespace cpu
}  // namespace dynamicemb
