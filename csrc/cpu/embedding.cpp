// CPU kernels of the embedding module: dedup of (table, key) pairs, row
// initialization, pooled and sequence lookups, and the fused backward (segmented
// gradient reduction + optimizer update). OpenMP over bags / unique rows: loops
// over the per-bag and per-row procedures of dynamicemb/embedding.h that add the
// threading, row prefetches and streaming stores.
//
// Rows of a lookup are addressed by unique index u through row_ref[u] (see
// dynamicemb/row_ref.h): a slot of the device tier, a slot of the host store, a
// transient row, or (negative) a row its table's initializer computes. `tiers` is [device values, host values], both [*, width] with
// rows [embedding | optimizer state]; the host tensor may be empty.
#include <omp.h>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#include "cpu/aten.h"
#include "cpu/checks.h"
#include "cpu/dedup.h"
#include "cpu/rows.h"
#include "cpu/verbs.h"
#include "dynamicemb/embedding.h"
#include "dynamicemb/hash_primitives.h"
#include "dynamicemb/init_primitives.h"
#include "dynamicemb/optimizer_primitives.h"
#include "dynamicemb/row_ref.h"

namespace dynamicemb {
namespace cpu {
namespace {

constexpr int64_t kParallelMinWork = 2048;

// The update prefetches the stored row this many unique rows ahead (with write intent),
// while it sums the gradients of the rows before it: at 2 the row loads stalled the
// update (perf annotate), at 16 it was slower again; at 8 the fused
// backward of row-wise Adagrad took 2.8-3.2 ms a step against 3.2-3.4 at 2, SGD's
// 2.0-2.2 against 2.55 (benchmark/RESULTS.md, issue 55).
constexpr int64_t kUpdateAhead = 8;

// Whether an inserting call's status stored a new row (init_rows initializes it).
inline bool new_row_status(int8_t status) {
  return status == kInserted || status == kEvictedAndInserted;
}

// Rows a thread takes at a time when it initializes new rows: dynamic chunks, the
// rows an inserting call stored being anywhere among its positions (a padded batch's
// all in its first U of N).
constexpr int64_t kInitChunk = 256;

// The attribute of a lambda that only prefetches, handed to the procedures of
// embedding.h as their `before` hook: GCC finds such a function free of side
// effects (a prefetch is none) and drops the calls to it unless it is inlined
// first; without this the row prefetches vanished and the pooled forward took
// 1.45x as long.
#define DEMB_PREFETCH_HOOK __attribute__((always_inline))

// Outputs at least this large are written with streaming (non-temporal) stores:
// they cannot stay in the private caches until their consumer reads them, and
// ordinary stores would first read every output line from memory.
constexpr int64_t kStreamMinBytes = int64_t{8} << 20;

// Bag geometry of the FBGEMM layout: bag k = feature * batch + sample.
struct Bags {
  const int64_t* offsets;
  const int64_t* feature_col;  // output column of each feature, -1: not ours
  int64_t batch;
  int64_t num_bags;
};

Bags bags_of(const at::Tensor& offsets, const at::Tensor& feature_col, int64_t batch) {
  check_tensor(offsets, at::kLong, "offsets");
  check_tensor(feature_col, at::kLong, "feature_col");
  TORCH_CHECK(offsets.numel() == feature_col.numel() * batch + 1,
              "offsets must have num_features * batch + 1 entries");
  return Bags{offsets.data_ptr<int64_t>(), feature_col.data_ptr<int64_t>(), batch,
              offsets.numel() - 1};
}

// Whether the module's input check refused this batch (error: its (1,) int64 word).
bool refused(const c10::optional<at::Tensor>& error) {
  if (!error.has_value()) return false;
  check_tensor(*error, at::kLong, "error");
  TORCH_CHECK(error->numel() == 1, "the error word is one int64");
  return error->data_ptr<int64_t>()[0] != 0;
}


}  // namespace

// What is wrong with an offsets tensor of `num_indices` lookups: 0 nothing,
// 1 it does not start at 0, 2 it does not end at num_indices, 3 it decreases.
// With `error` (the module's (1,) int64 word), the word takes max(word, 4 - code)
// for a problem (demb_check_offsets: the smallest code wins) and None is returned.
c10::optional<int64_t> check_offsets(const at::Tensor& offsets, int64_t num_indices,
                                     const c10::optional<at::Tensor>& error) {
  check_tensor(offsets, at::kLong, "offsets");
  const int64_t* o = offsets.data_ptr<int64_t>();
  const int64_t m = offsets.numel();
  TORCH_CHECK(m >= 1, "offsets must have at least one entry");
  refused(error);  // checks the word
  int64_t code = 0;
  if (o[0] != 0) {
    code = 1;
  } else if (o[m - 1] != num_indices) {
    code = 2;
  } else {
    int64_t decreasing = 0;
#pragma omp parallel for schedule(static) reduction(| : decreasing) if (m >= kParallelMinWork * 16)
    for (int64_t i = 1; i < m; ++i) decreasing |= o[i] < o[i - 1];
    code = decreasing ? 3 : 0;
  }
  if (!error.has_value()) return code;
  // atomicMax of the unsigned word in the kernel
  uint64_t* word = reinterpret_cast<uint64_t*>(error->data_ptr<int64_t>());
  if (code) *word = std::max(*word, static_cast<uint64_t>(4 - code));
  return c10::nullopt;
}

namespace {

using UniqueTuple =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// `dedup`: the unique arrays have n entries, the rest past the U pairs padding
// (pad_unique; with `group` starts has n + 1 entries). A `refused` batch has no pair.
UniqueTuple dedup_lookups(const at::Tensor& keys, const at::Tensor& tids,
                          const c10::optional<at::Tensor>& frequencies, bool group,
                          bool refused, const BatchPart& part) {
  const int64_t n = keys.numel();
  const int64_t* freq = nullptr;
  if (frequencies.has_value()) {
    check_tensor(*frequencies, at::kLong, "frequencies");
    TORCH_CHECK(frequencies->numel() == n, "one frequency per key");
    freq = frequencies->data_ptr<int64_t>();
  }
  auto ukeys = at::empty({n}, keys.options());
  auto utids = at::empty({n}, tids.options());
  auto counts = at::empty({n}, keys.options());
  auto inverse = at::empty({n}, keys.options());
  auto starts = at::empty({group ? n + 2 : 0}, keys.options());
  auto rank = at::empty({group ? n : 0}, keys.options());
  int64_t* starts_at = group ? starts.data_ptr<int64_t>() : nullptr;
  int64_t* rank_at = group ? rank.data_ptr<int64_t>() : nullptr;
  const DedupOut out{ukeys.data_ptr<int64_t>(), utids.data_ptr<int16_t>(), nullptr,
                     counts.data_ptr<int64_t>(), inverse.data_ptr<int64_t>()};
  if (refused) {
    refuse_unique(out, n, starts_at, rank_at, part);
    return {ukeys, utids, inverse, counts, group ? starts.narrow(0, 0, n + 1) : starts, rank};
  }
  const int64_t u = DedupSet(n).run(keys.data_ptr<int64_t>(), tids.data_ptr<int16_t>(), freq,
                                    n, out, n + 1, [](int64_t) {}, part);
  if (group) group_by_unique(inverse.data_ptr<int64_t>(), n, u, starts_at, rank_at);
  pad_unique(out, u, n, starts_at);
  return {ukeys, utids, inverse, counts, group ? starts.narrow(0, 0, n + 1) : starts, rank};
}

void check_lookups(const at::Tensor& keys, const at::Tensor& tids) {
  check_tensor(keys, at::kLong, "keys");
  check_tensor(tids, at::kShort, "tids");
  TORCH_CHECK(tids.numel() == keys.numel(), "one table id per key");
  TORCH_CHECK(keys.numel() < (int64_t{1} << 31), "dedup takes fewer than 2^31 keys, got ",
              keys.numel());
}

}  // namespace

// Unique (table, key) pairs in first-occurrence order, padded to the N lookups, as
// DedupKernels.dedup: (unique_keys (N,), unique_tids (N,), inverse (N,), counts
// (N,), starts (N + 1,), rank (N,)); counts[u] sums the frequencies of u's lookups
// (1 each when none are given); with `group`, the lookups grouped by unique index
// (group_by_unique), which the fused backward walks, else starts and rank empty.
// Entries past the U pairs: key 0, table 0, count 0 (starts: the lookup count). A batch the error word refuses has no pair (inverse
// -1); lookups of other groups than part's get inverse -1. `time` (2,) int64 (a
// table's clock and step; None: none) advances by one unless the batch is refused.
UniqueTuple dedup(const at::Tensor& keys, const at::Tensor& tids,
                         const c10::optional<at::Tensor>& frequencies, bool group,
                         const c10::optional<at::Tensor>& error,
                         const c10::optional<at::Tensor>& time,
                         const c10::optional<at::Tensor>& part_groups, int64_t part_group) {
  check_lookups(keys, tids);
  const BatchPart part = batch_part(part_groups, part_group, keys.numel());
  const bool refused = is_refused(error);
  if (time.has_value()) {
    check_tensor(*time, at::kLong, "time");
    TORCH_CHECK(time->numel() == 2, "time holds a clock and a step");
    if (!refused) {
      int64_t* clock_and_step = time->data_ptr<int64_t>();
      ++clock_and_step[0];
      ++clock_and_step[1];
    }
  }
  return dedup_lookups(keys, tids, frequencies, group, refused, part);
}

namespace {

// init_rows' checks of everything but the values.
void check_init_args(const at::Tensor& slots, const c10::optional<at::Tensor>& status,
                     const at::Tensor& keys, const at::Tensor& tids,
                     const at::Tensor& init_ints, const at::Tensor& init_floats) {
  check_tensor(slots, at::kLong, "slots");
  if (status) check_tensor(*status, at::kChar, "status");
  check_tensor(keys, at::kLong, "keys");
  check_tensor(tids, at::kShort, "table_ids");
  check_tensor(init_ints, at::kLong, "init ints");
  check_tensor(init_floats, at::kFloat, "init floats");
  const int64_t n = slots.numel();
  TORCH_CHECK((!status || status->numel() == n) && keys.numel() == n && tids.numel() == n,
              "slots, status and keys need one length");
  TORCH_CHECK(init_ints.dim() == 2 && init_ints.size(1) == 3 && init_floats.dim() == 2 &&
                  init_floats.size(0) == init_ints.size(0) && init_floats.size(1) == 5,
              "an InitSpec holds (T, 3) ints and (T, 5) floats");
}

// init_rows of 16-bit rows (values [C, row_bytes / 4] words): the initializer's elements
// rounded to nearest, the state floats at the format's offset.
void init_narrow_rows(at::Tensor& values, const at::Tensor& slots,
                      const c10::optional<at::Tensor>& status, const at::Tensor& keys,
                      const at::Tensor& tids, int64_t dim, const at::Tensor& init_ints,
                      const at::Tensor& init_floats, double state_value,
                      const RowFormatArg& row_format) {
  const at::Tensor no_rows = at::empty({0}, at::kLong);
  const RowSource src = row_source({values, values}, at::empty({0, dim}, at::kFloat), no_rows,
                                   dim, row_format);
  check_init_args(slots, status, keys, tids, init_ints, init_floats);
  const int64_t n = slots.numel();
  const int64_t state_floats = (src.row_bytes - src.state_offset) / 4;
  const int64_t* s = slots.data_ptr<int64_t>();
  const int8_t* st = status ? status->data_ptr<int8_t>() : nullptr;
  const int64_t* k = keys.data_ptr<int64_t>();
  const int16_t* t = tids.data_ptr<int16_t>();
  const PackedInits inits{init_ints.data_ptr<int64_t>(), init_floats.data_ptr<float>()};
  const float state = static_cast<float>(state_value);
  with_element(src.code, [&](auto element) {
    using E = decltype(element);
#pragma omp parallel if (n * dim >= kParallelMinWork)
    {
      std::vector<float> w(dim);  // the initializer's row, then narrowed
#pragma omp for schedule(dynamic, kInitChunk)
      for (int64_t i = 0; i < n; ++i) {
        const int64_t ahead = i + kPrefetchAhead;  // as init_rows' float32 loop
        if (ahead < n && s[ahead] >= 0 && (st == nullptr || new_row_status(st[ahead]))) {
          prefetch_bytes(src.device_bytes + s[ahead] * src.row_bytes, src.row_bytes, 1);
        }
        if (st != nullptr && !new_row_status(st[i])) continue;
        char* row = src.device_bytes + s[i] * src.row_bytes;
        inits.row(t[i], k[i], w.data(), static_cast<int>(dim));
        narrow_row_rn(w.data(), reinterpret_cast<E*>(row), dim);
        float* f = src.state_of(row);
        for (int64_t c = 0; c < state_floats; ++c) f[c] = state;
      }
    }
  });
}

}  // namespace

// The initial rows [initializer (dim) | state_value] of keys[i] of table tids[i] at
// values[slots[i]], as demb_init_rows (PackedInits::new_row_element): every key's,
// or with a status only those an inserting call just stored (kInserted,
// kEvictedAndInserted), the others left alone. spec: init_ints (T, 3) int64 and
// init_floats (T, 5) float32 (InitSpec).
void init_rows(at::Tensor& values, const at::Tensor& slots,
               const c10::optional<at::Tensor>& status, const at::Tensor& keys,
               const at::Tensor& tids, int64_t dim, const at::Tensor& init_ints,
               const at::Tensor& init_floats, double state_value,
               const c10::optional<RowFormatArg>& row_format) {
  if (row_format.has_value() && std::get<0>(*row_format) != kFloat32Rows) {
    init_narrow_rows(values, slots, status, keys, tids, dim, init_ints, init_floats,
                     state_value, *row_format);
    return;
  }
  check_tensor(values, at::kFloat, "values");
  check_init_args(slots, status, keys, tids, init_ints, init_floats);
  const int64_t n = slots.numel();
  TORCH_CHECK(values.dim() == 2, "values must be [C, width]");
  const int64_t width = values.size(1);
  TORCH_CHECK(0 <= dim && dim <= width, "dim must be in [0, ", width, "], got ", dim);
  float* v = values.data_ptr<float>();
  const int64_t* s = slots.data_ptr<int64_t>();
  const int8_t* st = status ? status->data_ptr<int8_t>() : nullptr;
  const int64_t* k = keys.data_ptr<int64_t>();
  const int16_t* t = tids.data_ptr<int16_t>();
  const int64_t* ints = init_ints.data_ptr<int64_t>();
  const float* floats = init_floats.data_ptr<float>();
  const float state = static_cast<float>(state_value);
  const PackedInits inits{ints, floats};
#pragma omp parallel for schedule(dynamic, kInitChunk) if (n * width >= kParallelMinWork)
  for (int64_t i = 0; i < n; ++i) {
    // the rows are cold: each line written waits for its read for ownership unless
    // requested ahead
    const int64_t ahead = i + kPrefetchAhead;
    if (ahead < n && s[ahead] >= 0 && (st == nullptr || new_row_status(st[ahead]))) {
      prefetch_row(v + s[ahead] * width, width, 1);
    }
    if (st != nullptr && !new_row_status(st[i])) continue;
    float* row = v + s[i] * width;
    inits.row(t[i], k[i], row, static_cast<int>(dim));
    for (int64_t c = dim; c < width; ++c) row[c] = state;  // new_row_element's state columns
  }
}

namespace {

// The bags of pooled_forward, with rows read through make_rows()'s readers.
template <class MakeRows>
void pool_bags(const Bags& bags, int64_t num_features, const int64_t* inv, const float* w,
               int64_t dim, bool mean, float* o, int64_t out_width, bool stream,
               const MakeRows& make_rows) {
#pragma omp parallel if (bags.num_bags >= kParallelMinWork / 16)
  {
    const auto rows = make_rows();
    std::vector<float> local(stream ? dim : 0);
    const int64_t batch = bags.batch;
    for (int64_t f = 0; f < num_features; ++f) {
      const int64_t col = bags.feature_col[f];
      if (col < 0) continue;
      const int64_t* off = bags.offsets + f * batch;
      const int64_t ahead_end = off[batch];
#pragma omp for schedule(static) nowait
      for (int64_t b = 0; b < batch; ++b) {
        float* dst = o + b * out_width + col;
        const int64_t begin = off[b], end = off[b + 1];
        const auto row_at = [&](int64_t j) { return rows.row(inv[j]); };
        const auto before = [&](int64_t j) DEMB_PREFETCH_HOOK {
          const int64_t jp = j + kPrefetchAhead;
          if (jp < ahead_end && inv[jp] >= 0) rows.prefetch(inv[jp]);
        };
        if (stream && end - begin == 1 && !w && !mean) {
          before(begin);  // a lone unweighted row goes straight from the table
          rows.stream_to(dst, inv[begin]);
          continue;
        }
        // the first row is written, not added: `out` need not be zeroed
        float* acc = stream ? local.data() : dst;
        pool_bag(acc, dim, begin, end, w, mean, row_at, before);
        if (stream) stream_copy(dst, acc, dim);
      }
    }
    if (stream) store_fence();
  }
}

}  // namespace

// Pooled lookup: out[b, col_f : col_f + dim] = sum (or mean) over bag (f, b).
// Writes every column of its features (zeros for empty bags). Bags of a feature
// are split among threads by sample; rows are prefetched kPrefetchAhead lookups
// ahead (the gather is latency-bound). Outputs of kStreamMinBytes or more are
// written with streaming stores (each bag summed in a thread-local row first).
// `init`: negative references read their initializer's row (ComputedRows). A
// batch the input check refused (`error` set) pools to zeros, its offsets unread.
void pooled_forward(const std::vector<at::Tensor>& tiers, const at::Tensor& transient,
                    const at::Tensor& row_ref, const at::Tensor& inverse,
                    const at::Tensor& offsets, const c10::optional<at::Tensor>& weights,
                    const at::Tensor& feature_col, int64_t batch, int64_t dim, bool mean,
                    at::Tensor& out, const c10::optional<InitRowsArg>& init,
                    const c10::optional<at::Tensor>& error,
                    const c10::optional<RowFormatArg>& row_format) {
  const RowSource src = row_source(tiers, transient, row_ref, dim, row_format);
  const Bags bags = bags_of(offsets, feature_col, batch);
  check_tensor(inverse, at::kLong, "inverse");
  check_tensor(out, at::kFloat, "out");
  float* o = out.data_ptr<float>();
  const int64_t out_width = out.size(1);
  if (refused(error)) {
    for (int64_t f = 0; f < feature_col.numel(); ++f) {
      const int64_t col = bags.feature_col[f];
      for (int64_t b = 0; col >= 0 && b < batch; ++b) {
        std::fill(o + b * out_width + col, o + b * out_width + col + dim, 0.f);
      }
    }
    return;
  }
  const int64_t* inv = inverse.data_ptr<int64_t>();
  const float* w = weights.has_value() ? weights->data_ptr<float>() : nullptr;
  const bool stream = out.nbytes() >= kStreamMinBytes;
  with_rows(src, init, row_ref.numel(), [&](const auto& make_rows) {
    pool_bags(bags, feature_col.numel(), inv, w, dim, mean, o, out_width, stream, make_rows);
  });
}

// Sequence lookup: out[j] = row of lookup j, for lookups whose inverse is >= 0.
// Streaming stores from kStreamMinBytes of output, as in pooled_forward. `init`
// and `error` as in pooled_forward (a refused batch's out (N, dim) is zeros).
void sequence_forward(const std::vector<at::Tensor>& tiers, const at::Tensor& transient,
                      const at::Tensor& row_ref, const at::Tensor& inverse, int64_t dim,
                      at::Tensor& out, const c10::optional<InitRowsArg>& init,
                      const c10::optional<at::Tensor>& error,
                      const c10::optional<RowFormatArg>& row_format) {
  const RowSource src = row_source(tiers, transient, row_ref, dim, row_format);
  check_tensor(inverse, at::kLong, "inverse");
  check_tensor(out, at::kFloat, "out");
  const int64_t* inv = inverse.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  const int64_t n = inverse.numel();
  TORCH_CHECK(out.numel() >= n * dim, "out must be (N, dim)");
  if (refused(error)) {
    std::fill(o, o + n * dim, 0.f);
    return;
  }
  const bool stream = out.nbytes() >= kStreamMinBytes;
  with_rows(src, init, row_ref.numel(), [&](const auto& make_rows) {
#pragma omp parallel if (n >= kParallelMinWork)
    {
      const auto rows = make_rows();
#pragma omp for schedule(static) nowait
      for (int64_t j = 0; j < n; ++j) {
        const int64_t jp = j + kPrefetchAhead;
        if (jp < n && inv[jp] >= 0) rows.prefetch(inv[jp]);
        if (inv[j] < 0) continue;
        if (stream) {
          rows.stream_to(o + j * dim, inv[j]);
        } else {
          const float* row = rows.row(inv[j]);
          std::copy(row, row + dim, o + j * dim);
        }
      }
      if (stream) store_fence();
    }
  });
}

namespace {

// Each lookup's gradient offset and scale, placed at its rank (group_by_unique),
// so that the lookups of a unique row are read in a run. In pooled mode the
// gradient of a lookup of bag (feature, sample) is the sample's row of grad at
// the feature's column, times the per-sample weight and 1 / bag length for MEAN;
// in sequence mode (bags == nullptr) lookup j's is row j. Lookups of rank -1
// (another group's) are skipped. Returns how many ranks were at or past
// `entries` (none were placed; a correct grouping has none).
int64_t place_grads(const Bags* bags, const int64_t* rank, int64_t n, int64_t entries,
                    const float* w, int64_t grad_width, bool mean, int64_t* pos, float* scale) {
  const int64_t units = bags ? bags->num_bags : n;
  const int threads = units >= kParallelMinWork ? omp_get_max_threads() : 1;
  int64_t out_of_range = 0;
#pragma omp parallel num_threads(threads) reduction(+ : out_of_range)
  {
    const int nt = omp_get_num_threads(), me = omp_get_thread_num();
    const int64_t lo = units * me / nt, hi = units * (me + 1) / nt;
    if (bags == nullptr) {
      for (int64_t j = lo; j < hi; ++j) {
        if (rank[j] < 0) continue;
        if (rank[j] >= entries) {
          ++out_of_range;
          continue;
        }
        pos[rank[j]] = j * grad_width;
        scale[rank[j]] = 1.f;
      }
    } else if (lo < hi) {
      int64_t f = lo / bags->batch, b = lo % bags->batch;  // bag k = f * batch + b
      for (int64_t k = lo; k < hi; ++k) {
        const int64_t col = bags->feature_col[f];
        const int64_t begin = bags->offsets[k], end = bags->offsets[k + 1];
        if (col >= 0 && end > begin) {
          const int64_t p = b * grad_width + col;
          const float bag_scale = mean ? 1.f / static_cast<float>(end - begin) : 1.f;
          for (int64_t j = begin; j < end; ++j) {
            if (rank[j] < 0) continue;
            if (rank[j] >= entries) {
              ++out_of_range;
              continue;
            }
            pos[rank[j]] = p;
            scale[rank[j]] = (w ? w[j] : 1.f) * bag_scale;
          }
        }
        if (++b == bags->batch) {
          b = 0;
          ++f;
        }
      }
    }
  }
  return out_of_range;
}

// Whether every value of v (n,) is finite: inf and NaN have every exponent bit
// set, so the largest magnitude's bits reach 0x7f800000. An integer max
// reduction, which the compiler vectorizes; a reduction of float compares
// (!(fabs(x) <= FLT_MAX)) it does not, and that scalar loop cost as much as the
// whole sum (1 ms a step at 22,893 rows of dim 128).
inline bool all_finite(const float* __restrict__ v, int64_t n) {
  uint32_t top = 0;
  for (int64_t c = 0; c < n; ++c) {
    uint32_t bits;
    std::memcpy(&bits, v + c, sizeof bits);
    top = std::max(top, bits & 0x7fffffffu);
  }
  return top < 0x7f800000u;
}

// Where each lookup's gradient lies and its scale, placed at its rank: the runs
// the backward sums, one per unique row (u < U = starts.numel() - 1).
struct GradRuns {
  const int64_t* first;  // run u is entries [first[u], first[u + 1])
  int64_t num_unique;
  int64_t dim;
  const float* grad;
  std::vector<int64_t> pos;
  std::vector<float> scale;

  GradRuns(const at::Tensor& starts, const at::Tensor& rank, const at::Tensor& offsets,
           const c10::optional<at::Tensor>& weights, const at::Tensor& feature_col,
           int64_t batch, bool mean, const at::Tensor& grad_tensor, int64_t row_dim) {
    check_tensor(starts, at::kLong, "starts");
    check_tensor(rank, at::kLong, "rank");
    check_tensor(grad_tensor, at::kFloat, "grad");
    const bool pooled = offsets.numel() > 0;
    const int64_t n = rank.numel();
    num_unique = starts.numel() - 1;
    TORCH_CHECK(num_unique >= 0, "starts must have one entry per unique row + 1");
    dim = row_dim;
    first = starts.data_ptr<int64_t>();
    const int64_t num_entries = first[num_unique];
    TORCH_CHECK(num_entries <= n, "starts counts more lookups than rank has");
    const float* w = weights.has_value() ? weights->data_ptr<float>() : nullptr;
    grad = grad_tensor.data_ptr<float>();
    Bags bags{nullptr, nullptr, batch, 0};
    if (pooled) {
      bags = bags_of(offsets, feature_col, batch);
      TORCH_CHECK(bags.offsets[bags.num_bags] == n, "offsets must end at len(rank)");
    }
    TORCH_CHECK(!w || weights->numel() == n, "one weight per lookup");
    pos.assign(num_entries, 0);  // zeros: a bad grouping reads row 0, not beyond
    scale.assign(num_entries, 0.f);
    TORCH_CHECK(place_grads(pooled ? &bags : nullptr, rank.data_ptr<int64_t>(), n, num_entries,
                            w, grad_tensor.size(1), mean, pos.data(), scale.data()) == 0,
                "rank must be below starts[-1]");
  }

  // Whether unique row u has no lookup (its run is empty: a padded batch's rows past
  // its unique count, or a row whose lookups another group took).
  bool empty(int64_t u) const { return first[u] == first[u + 1]; }

  // acc (dim,) = run u's sum, in rank order; returns whether every value is finite.
  template <class Before>
  bool sum(int64_t u, float* __restrict__ acc, const Before& before) const {
    sum_row_grads(acc, dim, pos.data(), scale.data(), grad, first[u], first[u + 1], before);
    return all_finite(acc, dim);
  }

  // Prefetches the gradient rows kPrefetchAhead entries ahead of entry e.
  DEMB_PREFETCHES void prefetch_ahead(int64_t e) const {
    const int64_t ep = e + kPrefetchAhead;
    if (ep < first[num_unique]) prefetch_row(grad + pos[ep], dim);
  }
};

// The update's parameters. With `schedule` (a DeviceSchedule) the learning rate
// and step count are read from its tensors, the step advanced first when it says
// so, and the step's scalars computed from them as demb_fused_update does
// (schedule_step); the caller has checked that the batch was not refused.
OptimizerParams update_params(int64_t kind, double lr, double eps, double beta1, double beta2,
                              double weight_decay, double step_size,
                              double bias_correction2_sqrt, double decay_scale,
                              const c10::optional<ScheduleArg>& schedule) {
  OptimizerParams p = optimizer_params(
      static_cast<int32_t>(kind), static_cast<float>(lr), static_cast<float>(eps),
      static_cast<float>(beta1), static_cast<float>(beta2), static_cast<float>(weight_decay),
      static_cast<float>(1.0 - beta1), static_cast<float>(1.0 - beta2),
      static_cast<float>(step_size), static_cast<float>(bias_correction2_sqrt),
      static_cast<float>(decay_scale));
  if (!schedule.has_value()) return p;
  const at::Tensor& lr_at = std::get<0>(*schedule);
  const at::Tensor& step_at = std::get<1>(*schedule);
  check_tensor(lr_at, at::kDouble, "lr");
  check_tensor(step_at, at::kLong, "step");
  TORCH_CHECK(lr_at.numel() == 1 && step_at.numel() == 1, "lr and step are (1,) each");
  int64_t* step = step_at.data_ptr<int64_t>();
  if (std::get<2>(*schedule)) ++*step;  // demb_place_grads' advance
  schedule_step(p, lr_at.data_ptr<double>()[0], *step, std::get<3>(*schedule),
                std::get<4>(*schedule), std::get<5>(*schedule));
  return p;
}

}  // namespace

// The checked-batch backward's first pass: sums row u (u < U) = the sum of the
// gradients of unique row u's lookups, in rank order (deterministic), for every
// unique row (rows with no lookup get zeros). `starts` and `rank` group the lookups
// by unique row (group_by_unique, computed by the dedup in the forward). Returns how
// many rows' sums hold NaN or inf: a non-finite gradient value reaches the sum of
// every row that reads it, so a caller that updates no row when this is non-zero
// refuses such a batch without a separate pass over the gradient. A batch the input
// check refused (`error` set) writes nothing and returns 0.
int64_t sum_gradients(const at::Tensor& starts, const at::Tensor& rank,
                      const at::Tensor& offsets, const c10::optional<at::Tensor>& weights,
                      const at::Tensor& feature_col, int64_t batch, bool mean,
                      const at::Tensor& grad, at::Tensor& sums,
                      const c10::optional<at::Tensor>& error) {
  check_tensor(sums, at::kFloat, "sums");
  TORCH_CHECK(sums.dim() == 2, "sums must be (>= unique rows, dim)");
  if (refused(error)) return 0;  // nothing to sum: its offsets are not read
  const GradRuns runs(starts, rank, offsets, weights, feature_col, batch, mean, grad,
                      sums.size(1));
  TORCH_CHECK(sums.size(0) >= runs.num_unique, "sums must be (>= unique rows, dim)");
  float* out = sums.data_ptr<float>();
  const int64_t num_unique = runs.num_unique, dim = runs.dim;
  int64_t non_finite = 0;
#pragma omp parallel for schedule(dynamic, 64) if (num_unique * dim >= kParallelMinWork) \
    reduction(+ : non_finite)
  for (int64_t u = 0; u < num_unique; ++u) {
    non_finite += !runs.sum(u, out + u * dim,
                            [&](int64_t e) DEMB_PREFETCH_HOOK { runs.prefetch_ahead(e); });
  }
  return non_finite;
}

// The checked-batch backward's second pass: the optimizer's update of every stored
// unique row (device tier or host store) from its summed gradient, row u of `sums`
// (sum_gradients). Rows not stored (transient or computed) are skipped. `schedule`: the
// scalars from device memory (update_params); a refused batch (`error` set)
// updates nothing and leaves the schedule's step as it is.
void update_rows(const std::vector<at::Tensor>& tiers, const at::Tensor& row_ref,
                 const at::Tensor& sums, int64_t kind, double lr, double eps, double beta1,
                 double beta2, double weight_decay, double step_size,
                 double bias_correction2_sqrt, double decay_scale,
                 const c10::optional<at::Tensor>& error,
                 const c10::optional<ScheduleArg>& schedule,
                 const c10::optional<RowFormatArg>& row_format,
                 const c10::optional<RoundingArg>& rounding) {
  check_tensor(sums, at::kFloat, "sums");
  TORCH_CHECK(sums.dim() == 2, "sums must be (>= unique rows, dim)");
  if (refused(error)) return;
  const int64_t dim = sums.size(1);
  const at::Tensor no_transient = at::empty({0, dim}, at::kFloat);
  const RowSource src = row_source(tiers, no_transient, row_ref, dim, row_format);
  const int64_t num_unique = row_ref.numel();
  TORCH_CHECK(sums.size(0) >= num_unique, "sums must have a row per unique row");
  const int64_t* slot = row_ref.data_ptr<int64_t>();
  const int64_t state_floats = optimizer_state_dim(static_cast<int>(kind), dim);
  with_updates(src, rounding, num_unique, state_floats, [&](const auto& make_updates) {
    const OptimizerParams p = update_params(kind, lr, eps, beta1, beta2, weight_decay,
                                            step_size, bias_correction2_sqrt, decay_scale,
                                            schedule);
    const float* acc = sums.data_ptr<float>();
#pragma omp parallel if (num_unique * dim >= kParallelMinWork)
    {
      const auto rows = make_updates();
#pragma omp for schedule(dynamic, 64)
      for (int64_t u = 0; u < num_unique; ++u) {
        if (!is_stored_ref(slot[u])) continue;
        const int64_t up = u + kUpdateAhead;
        if (up < num_unique && is_stored_ref(slot[up])) rows.prefetch(up);
        rows.apply(u, acc + u * dim, static_cast<int>(dim), p);
      }
    }
  });
}

// The checked-row backward, one pass: per unique row, its summed gradient
// (sum_gradients' order) in a thread-local row, then, when every value of the sum
// is finite, the optimizer's update of the stored row (update_rows'), so its
// results are those of the two passes bit for bit. A row whose sum holds NaN or
// inf keeps its value and state; rows not stored are summed (checked), not updated;
// rows with no lookup (padding) are skipped.
// `error` and `schedule` as in update_rows (the step advances even when some rows
// are not finite, as the host's count does). Returns how many rows had a
// non-finite sum (0 for a refused batch).
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
                            const c10::optional<RoundingArg>& rounding) {
  if (refused(error)) return 0;  // its offsets are not read, the step not counted
  const GradRuns runs(starts, rank, offsets, weights, feature_col, batch, mean, grad, dim);
  const at::Tensor no_transient = at::empty({0, dim}, at::kFloat);
  const RowSource src = row_source(tiers, no_transient, row_ref, dim, row_format);
  const int64_t num_unique = runs.num_unique;
  TORCH_CHECK(row_ref.numel() == num_unique, "one row_ref per unique row");
  const int64_t* slot = row_ref.data_ptr<int64_t>();
  const int64_t state_floats = optimizer_state_dim(static_cast<int>(kind), dim);
  int64_t non_finite = 0;
  with_updates(src, rounding, num_unique, state_floats, [&](const auto& make_updates) {
    const OptimizerParams p = update_params(kind, lr, eps, beta1, beta2, weight_decay,
                                            step_size, bias_correction2_sqrt, decay_scale,
                                            schedule);
#pragma omp parallel if (num_unique * dim >= kParallelMinWork) reduction(+ : non_finite)
    {
      const auto rows = make_updates();
      std::vector<float> acc(dim);
#pragma omp for schedule(dynamic, 64)
      for (int64_t u = 0; u < num_unique; ++u) {
        // a row with no lookup is padding (every unique row has one), skipped as
        // CUDA's demb_fused_update skips it: the rows past a padded batch's unique
        // count, about two thirds of a power-law batch's, each cost a memset of acc
        // and a finiteness pass
        if (runs.empty(u)) continue;
        const int64_t up = u + kUpdateAhead;  // with write intent, while this one sums
        if (up < num_unique && is_stored_ref(slot[up])) rows.prefetch(up);
        const bool finite = runs.sum(
            u, acc.data(), [&](int64_t e) DEMB_PREFETCH_HOOK { runs.prefetch_ahead(e); });
        non_finite += !finite;
        if (finite && is_stored_ref(slot[u])) {
          rows.apply(u, acc.data(), static_cast<int>(dim), p);
        }
      }
    }
  });
  return non_finite;
}

// Gradient of per-sample weights (SUM pooling): out[j] = <grad of bag(j) in its
// feature's columns, row of lookup j>, for lookups of this group (inverse >= 0).
// Runs before the optimizer so it sees the rows the forward used. `init` as in
// pooled_forward; a refused batch (`error` set) writes nothing.
void per_sample_weight_grad(const std::vector<at::Tensor>& tiers,
                            const at::Tensor& transient, const at::Tensor& row_ref,
                            const at::Tensor& inverse, const at::Tensor& offsets,
                            const at::Tensor& feature_col, int64_t batch, int64_t dim,
                            const at::Tensor& grad, at::Tensor& out,
                            const c10::optional<InitRowsArg>& init,
                            const c10::optional<at::Tensor>& error,
                            const c10::optional<RowFormatArg>& row_format) {
  const RowSource src = row_source(tiers, transient, row_ref, dim, row_format);
  const Bags bags = bags_of(offsets, feature_col, batch);
  check_tensor(inverse, at::kLong, "inverse");
  check_tensor(grad, at::kFloat, "grad");
  check_tensor(out, at::kFloat, "out");
  if (refused(error)) return;
  const int64_t* inv = inverse.data_ptr<int64_t>();
  const float* g = grad.data_ptr<float>();
  const int64_t grad_width = grad.size(1);
  float* o = out.data_ptr<float>();
  with_rows(src, init, row_ref.numel(), [&](const auto& make_rows) {
#pragma omp parallel if (bags.num_bags >= kParallelMinWork / 16)
    {
      const auto rows = make_rows();
#pragma omp for schedule(static)
      for (int64_t k = 0; k < bags.num_bags; ++k) {
        const int64_t col = bags.feature_col[k / batch];
        if (col < 0) continue;
        const float* gk = g + (k % batch) * grad_width + col;
        for (int64_t j = bags.offsets[k]; j < bags.offsets[k + 1]; ++j) {
          if (inv[j] < 0) continue;
          const float* row = rows.row(inv[j]);
          float dot = 0.f;
          for (int64_t c = 0; c < dim; ++c) dot += gk[c] * row[c];
          o[j] = dot;
        }
      }
    }
  });
}

}  // namespace cpu
}  // namespace dynamicemb
