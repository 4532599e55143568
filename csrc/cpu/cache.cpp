// CPU loops of a padded batch's promotion into a device cache (OpenMP): the same
// per-key procedures as csrc/cuda/cache.cu's kernels (dynamicemb/cache_policy.h,
// which states the policy), with the same outputs, padding included. The probe
// finds only the keys that take part, a chunk at a time with its misses overlapped
// (find_chunk, cpu/table.h); the other loops are one pass each over the n positions.
#include <omp.h>

#include <algorithm>
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

// order (n,) = the positions by descending rank, ties in position order (a stable
// sort), without a sort of n keys: every rank is one of the policy's constants but
// a hot miss's count, so the hits, the hot misses (sorted by count, stably), the
// misses, the cold misses and the positions left out follow one another.
void order_by_rank(const int64_t* r, int64_t n, int64_t* order) {
  std::vector<int64_t> hot;
  int64_t next = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (r[i] == kRankHit) order[next++] = i;
    else if (r[i] > kRankMiss) hot.push_back(i);
  }
  std::stable_sort(hot.begin(), hot.end(), [r](int64_t a, int64_t b) { return r[a] > r[b]; });
  std::copy(hot.begin(), hot.end(), order + next);
  next += static_cast<int64_t>(hot.size());
  for (const int64_t rank : {kRankMiss, kRankCold, kRankLeftOut}) {
    for (int64_t i = 0; i < n; ++i) {
      if (r[i] == rank) order[next++] = i;
    }
  }
  TORCH_CHECK(next == n, "a promotion rank outside the policy's (cache_policy.h)");
}

}  // namespace

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
  const int64_t* k = keys.data_ptr<int64_t>();
  const int16_t* t = tids.data_ptr<int16_t>();
  const int64_t* c = counts.data_ptr<int64_t>();
  const int64_t* hs = host_slots.data_ptr<int64_t>();
  int64_t* cs = cache_slots.data_ptr<int64_t>();
  int64_t hits = 0, misses = 0, hot = 0;
  const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) reduction(+ : hits, misses, hot) \
    if (n >= kParallelMinKeys)
  for (int64_t ch = 0; ch < chunks; ++ch) {
    int64_t at[kChunk];  // the chunk's promotable positions
    int m = 0;
    for (int64_t i = ch * kChunk; i < std::min(n, (ch + 1) * kChunk); ++i) {
      if (is_promotable(c[i], hs[i])) {
        at[m++] = i;
      } else {
        cs[i] = -1;
      }
    }
    find_chunk(v, k, t, [&at](int r) { return at[r]; }, m, one_table, cs);
    for (int r = 0; r < m; ++r) {
      const ProbeKind kind = probe_kind(c[at[r]], cs[at[r]]);
      hits += kind == kProbeHit;
      misses += kind != kProbeHit;
      hot += kind == kProbeHotMiss;
    }
  }
  const PromotionTotals totals{hits, misses, hot};
  const int64_t capacity = v.num_buckets * bc;
  const int64_t size = cache_size.data_ptr<int64_t>()[0];
  int64_t* p = plan.data_ptr<int64_t>();
  p[kPlanHits] = hits;
  p[kPlanMisses] = misses;
  p[kPlanHot] = hot;
  p[kPlanTaken] = totals.taken(capacity, size);
  const bool overflow = totals.overflows(capacity, size);
  int64_t* r = rank.data_ptr<int64_t>();
#pragma omp parallel for schedule(static) if (n >= kParallelMinKeys)
  for (int64_t i = 0; i < n; ++i) r[i] = promotion_rank(c[i], hs[i], cs[i], overflow);
  auto order = at::empty({n}, keys.options());
  order_by_rank(r, n, order.data_ptr<int64_t>());
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
#pragma omp parallel for schedule(static) if (n >= kParallelMinKeys)
  for (int64_t q = 0; q < n; ++q) {
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
#pragma omp parallel for schedule(static) if (n >= kParallelMinKeys)
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
