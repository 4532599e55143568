// CPU loops of a padded batch's promotion into a device cache (OpenMP): the same
// per-key procedures as csrc/cuda/cache.cu's kernels (dynamicemb/cache_policy.h,
// which states the policy), with the same outputs, padding included. The probe
// finds only the keys that take part, a chunk at a time with its misses overlapped
// (find_chunk, cpu/table.h); the plan's loops run over the positions up to the last
// promotable one, the others one pass each over the n positions.
#include <omp.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <tuple>
#include <vector>

#include "cpu/aten.h"
#include "cpu/checks.h"
#include "cpu/probe.h"
#include "cpu/table.h"
#include "cpu/verbs.h"
#include "dynamicemb/cache_policy.h"
#include "dynamicemb/hash_primitives.h"
#include "dynamicemb/table_view.h"

namespace dynamicemb {
namespace cpu {
namespace {

// Positions a thread takes at a time in the loops over a sorted order, whose work
// (score reads, row copies) is all at its front.
constexpr int kOrderChunk = 256;

void check_positions(const at::Tensor& t, at::ScalarType dtype, const char* name, int64_t n) {
  check_tensor(t, dtype, name);
  TORCH_CHECK(t.numel() == n, name, " must hold ", n, " entries, got ", t.numel());
}

// The row copy of promote_one: one thread copies the whole row.
struct RowCopy {
  void operator()(float* dst, const float* src, int64_t width) const {
    std::memcpy(dst, src, static_cast<size_t>(width) * sizeof(float));
  }
};

// The classes of the order, in order: rank kRankHit, a hot miss's count, kRankMiss,
// kRankCold, kRankLeftOut (cache_policy.h).
enum RankClass : int { kClassHit, kClassHot, kClassMiss, kClassCold, kClassLeftOut, kClasses };

inline int rank_class(int64_t rank) {
  if (rank == kRankHit) return kClassHit;
  if (rank > kRankMiss) return kClassHot;
  if (rank == kRankMiss) return kClassMiss;
  return rank == kRankCold ? kClassCold : kClassLeftOut;
}

// What one thread's range of positions holds: the probe's counts of its
// promotable keys, and how many it leaves out.
struct RangeCounts {
  int64_t hits = 0, misses = 0, hot = 0, left_out = 0;

  // Positions of each class: the probe's counts decide them, with the overflow.
  std::array<int64_t, kClasses> by_class(bool overflow) const {
    return {hits, overflow ? hot : 0, overflow ? 0 : misses, overflow ? misses - hot : 0,
            left_out};
  }
};

}  // namespace

// The probe, the plan, the ranks and the order in one parallel region: each
// thread probes a contiguous range of positions and counts its classes; one thread
// decides the plan and where each thread's classes start in the order; each
// thread then ranks its range and places its positions, in position order (the
// order is the stable sort by rank without a sort: every rank but a hot miss's
// count is one of the policy's constants). Only the hot misses are sorted, by
// count, stably. Positions past the last promotable one (the padding past the
// dedup's unique keys) are left out, in position order at the order's end: they
// are filled, not probed nor ranked.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> promotion_plan(
    const std::vector<at::Tensor>& meta, int64_t bc, const at::Tensor& keys,
    const at::Tensor& tids, const at::Tensor& counts, const at::Tensor& host_slots,
    bool one_table, const at::Tensor& cache_size) {
  check_batch(keys, tids);
  const int64_t n = keys.numel();
  check_positions(counts, at::kLong, "counts", n);
  check_positions(host_slots, at::kLong, "host_slots", n);
  check_positions(cache_size, at::kLong, "cache_size", 1);
  const CpuTableView v = view_of(meta, bc);
  auto cache_slots = at::empty({n}, keys.options());
  auto plan = at::zeros({4}, keys.options());
  auto rank = at::empty({n}, keys.options());
  auto order = at::empty({n}, keys.options());
  const int64_t* k = keys.data_ptr<int64_t>();
  const int16_t* t = tids.data_ptr<int16_t>();
  const int64_t* c = counts.data_ptr<int64_t>();
  const int64_t* hs = host_slots.data_ptr<int64_t>();
  int64_t* cs = cache_slots.data_ptr<int64_t>();
  int64_t* r = rank.data_ptr<int64_t>();
  int64_t* o = order.data_ptr<int64_t>();
  int64_t* p = plan.data_ptr<int64_t>();
  const int64_t capacity = v.num_buckets * bc;
  const int64_t size = cache_size.data_ptr<int64_t>()[0];
  int64_t end = n;
  while (end > 0 && !is_promotable(c[end - 1], hs[end - 1])) --end;
  const int threads = end >= kParallelMinKeys ? omp_get_max_threads() : 1;
  std::vector<RangeCounts> ranges(threads);
  std::vector<std::array<int64_t, kClasses>> next(threads);  // then where each ended
  bool overflow = false;
#pragma omp parallel num_threads(threads)
  {
    const int me = omp_get_thread_num();
    const int nt = omp_get_num_threads();
    const int64_t chunks = (end + kChunk - 1) / kChunk;
    const int64_t from = chunks * me / nt * kChunk;
    const int64_t to = std::min(end, chunks * (me + 1) / nt * kChunk);
    RangeCounts& mine = ranges[me];
    for (int64_t ch = from; ch < to; ch += kChunk) {
      int64_t at[kChunk];  // the chunk's promotable positions
      int m = 0;
      for (int64_t i = ch; i < std::min(to, ch + kChunk); ++i) {
        if (is_promotable(c[i], hs[i])) {
          at[m++] = i;
        } else {
          cs[i] = -1;
          ++mine.left_out;
        }
      }
      find_chunk(v, k, t, [&at](int q) { return at[q]; }, m, one_table, cs);
      for (int q = 0; q < m; ++q) {
        const ProbeKind kind = probe_kind(c[at[q]], cs[at[q]]);
        mine.hits += kind == kProbeHit;
        mine.misses += kind != kProbeHit;
        mine.hot += kind == kProbeHotMiss;
      }
    }
    // bounds in locals: the stores below may alias the shared `end` and `n` for the
    // compiler, which recomputed a division for every position (9% of the plan)
    const int64_t pad_from = end + (n - end) * me / nt, pad_to = end + (n - end) * (me + 1) / nt;
    for (int64_t i = pad_from; i < pad_to; ++i) {
      cs[i] = -1;
      r[i] = kRankLeftOut;
      o[i] = i;
    }
#pragma omp barrier
#pragma omp single
    {
      PromotionTotals totals{0, 0, 0};
      for (const RangeCounts& range : ranges) {
        totals.hits += range.hits;
        totals.misses += range.misses;
        totals.hot += range.hot;
      }
      p[kPlanHits] = totals.hits;
      p[kPlanMisses] = totals.misses;
      p[kPlanHot] = totals.hot;
      p[kPlanTaken] = totals.taken(capacity, size);
      overflow = totals.overflows(capacity, size);
      int64_t start = 0;
      for (int cls = 0; cls < kClasses; ++cls) {
        for (int u = 0; u < threads; ++u) {
          next[u][cls] = start;
          start += ranges[u].by_class(overflow)[cls];
        }
      }
    }
    std::array<int64_t, kClasses>& place = next[me];
    for (int64_t i = from; i < to; ++i) {
      r[i] = promotion_rank(c[i], hs[i], cs[i], overflow);
      o[place[rank_class(r[i])]++] = i;
    }
  }
  // Each thread placed exactly the positions its probe counted, class by class.
  int64_t placed = 0;
  for (int cls = 0; cls < kClasses; ++cls) {
    for (int u = 0; u < threads; ++u) {
      placed += ranges[u].by_class(overflow)[cls];
      TORCH_CHECK(next[u][cls] == placed, "a promotion rank outside the policy's (cache_policy.h)");
    }
  }
  if (overflow) {  // the hot misses follow the hits, sorted by count
    int64_t* hot = o + p[kPlanHits];
    std::stable_sort(hot, hot + p[kPlanHot], [r](int64_t a, int64_t b) { return r[a] > r[b]; });
  }
  return {cache_slots, plan, rank, order};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> promotion_order(
    const at::Tensor& order, const at::Tensor& keys, const at::Tensor& tids,
    const at::Tensor& host_slots, const at::Tensor& host_keys, const at::Tensor& plan,
    int64_t num_buckets) {
  check_batch(keys, tids);
  const int64_t n = keys.numel();
  check_positions(order, at::kLong, "order", n);
  check_positions(host_slots, at::kLong, "host_slots", n);
  check_positions(plan, at::kLong, "plan", 4);
  TORCH_CHECK(host_keys.device().is_cpu() && host_keys.scalar_type() == at::kLong &&
                  host_keys.dim() == 1 && host_keys.stride(0) == kSlotWords,
              "host_keys must be the keys column of a (slots, 2) int64 CPU array");
  TORCH_CHECK(num_buckets > 0 && (num_buckets & (num_buckets - 1)) == 0,
              "num_buckets must be a power of two, got ", num_buckets);
  auto out_keys = at::empty({n}, keys.options());
  auto out_tids = at::empty({n}, tids.options());
  auto out_scores = at::empty({n}, keys.options());
  auto buckets = at::empty({n}, keys.options().dtype(at::kInt));
  const int64_t* o = order.data_ptr<int64_t>();
  const int64_t* k = keys.data_ptr<int64_t>();
  const int16_t* t = tids.data_ptr<int16_t>();
  const int64_t* hs = host_slots.data_ptr<int64_t>();
  const int64_t* words = host_keys.data_ptr<int64_t>();
  const int64_t taken = plan.data_ptr<int64_t>()[kPlanTaken];
  int64_t* ok = out_keys.data_ptr<int64_t>();
  int16_t* ot = out_tids.data_ptr<int16_t>();
  int64_t* os = out_scores.data_ptr<int64_t>();
  int32_t* ob = buckets.data_ptr<int32_t>();
  // A key's score is a miss in the host store's large array: prefetched a few
  // positions ahead so that the misses overlap. Dynamic chunks: the order puts every
  // position that reads a score first (the rest is padding), which a static split
  // gave to one thread.
  constexpr int64_t kAhead = 16;
#pragma omp parallel for schedule(dynamic, kOrderChunk) if (n >= kParallelMinKeys)
  for (int64_t q = 0; q < n; ++q) {
    if (q + kAhead < n && hs[o[q + kAhead]] >= 0) {
      prefetch(words + kSlotWords * hs[o[q + kAhead]] + 1);
    }
    order_one(q, o, k, t, hs, words, taken, num_buckets, ok, ot, os, ob);
  }
  return {out_keys, out_tids, out_scores, buckets};
}

void promote_rows(const std::vector<at::Tensor>& host_meta, int64_t host_bc,
                  at::Tensor& host_values, at::Tensor& cache_values, const at::Tensor& order,
                  const at::Tensor& host_slots, const at::Tensor& slots,
                  const at::Tensor& status, const at::Tensor& ev_keys,
                  const at::Tensor& ev_tids, at::Tensor& refs) {
  const int64_t n = order.numel();
  check_positions(order, at::kLong, "order", n);
  check_positions(host_slots, at::kLong, "host_slots", n);
  check_positions(slots, at::kLong, "slots", n);
  check_positions(status, at::kChar, "status", n);
  check_positions(ev_keys, at::kLong, "ev_keys", n);
  check_positions(ev_tids, at::kShort, "ev_tids", n);
  check_positions(refs, at::kLong, "refs", n);
  check_tensor(host_values, at::kFloat, "host_values");
  check_tensor(cache_values, at::kFloat, "cache_values");
  TORCH_CHECK(host_values.dim() == 2 && cache_values.dim() == 2 &&
                  host_values.size(1) == cache_values.size(1),
              "the host store's and the cache's rows must have one width");
  const CpuTableView host = view_of(host_meta, host_bc);
  const int64_t width = cache_values.size(1);
  float* hv = host_values.data_ptr<float>();
  float* cv = cache_values.data_ptr<float>();
  const int64_t* o = order.data_ptr<int64_t>();
  const int64_t* hs = host_slots.data_ptr<int64_t>();
  const int64_t* s = slots.data_ptr<int64_t>();
  const int8_t* st = status.data_ptr<int8_t>();
  const int64_t* ek = ev_keys.data_ptr<int64_t>();
  const int16_t* et = ev_tids.data_ptr<int16_t>();
  int64_t* out = refs.data_ptr<int64_t>();
  // dynamic chunks: the positions that copy rows are the order's first `taken`
#pragma omp parallel for schedule(dynamic, kOrderChunk) if (n >= kParallelMinKeys)
  for (int64_t q = 0; q < n; ++q) {
    const int64_t i = o[q];
    int64_t home_slot = -1;
    if (writes_back(st[q])) {
      const KeyHome home = home_of(host, hash_key(ek[q], et[q]));
      const int j = find_one(host, DigestProbe{}, home, ek[q], et[q], false);
      home_slot = j < 0 ? -1 : home.base + j;
    }
    out[i] = promote_one(RowCopy{}, st[q], s[q], hs[i], home_slot, hv, cv, width);
  }
}

}  // namespace cpu
}  // namespace dynamicemb
