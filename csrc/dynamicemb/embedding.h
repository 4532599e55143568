// One bag's pooling and one row's summed gradient: the per-bag and per-row
// procedures of the embedding module, written once (host and device).
//
// Their float order is the module's contract on every backend: a bag's rows are
// added in input order, a unique row's gradients in rank order, the first term
// written, not added to zero. The CPU loops (csrc/cpu/embedding.cpp) call these
// row by row, vectorizing over columns and prefetching in the `before` hooks. The
// CUDA kernels (csrc/cuda/embedding.cu) give each lane of a warp a column and
// walk the same order per column with fmaf, keeping the accumulator in a
// register; called a row at a time here, a lane would keep dim / 32 accumulators
// in local memory, so they keep their transposed loops and share the optimizer's
// per-row rules (optimizer_primitives.h) instead.
#pragma once

#include "dynamicemb/optimizer_primitives.h"

namespace dynamicemb {

// The `before` hook of a loop that does not prefetch. A host hook that only
// prefetches must be inlined early (csrc/cpu/embedding.cpp: DEMB_PREFETCH_HOOK):
// GCC finds it free of side effects and would drop its calls.
struct NoPrefetch {
  DEMB_HD void operator()(int64_t /*j*/) const {}
};

// One bag's pooling: acc (dim,) = the sum over lookups j in [begin, end), in
// input order, of weights[j] * row_at(j) (weights nullptr: 1 each), times
// 1 / (end - begin) when `mean`; zeros for an empty bag. row_at(j) is lookup j's
// row (dim,); before(j) runs before it is read.
template <class RowAt, class Before>
DEMB_HD void pool_bag(float* __restrict__ acc, int64_t dim, int64_t begin, int64_t end,
                      const float* weights, bool mean, const RowAt& row_at,
                      const Before& before) {
  if (begin == end) {
    for (int64_t c = 0; c < dim; ++c) acc[c] = 0.f;
    return;
  }
  for (int64_t j = begin; j < end; ++j) {
    before(j);
    const float* __restrict__ row = row_at(j);
    const float scale = weights ? weights[j] : 1.f;
    if (j == begin) {  // written, not added: acc need not be zeroed
      if (weights) {
        for (int64_t c = 0; c < dim; ++c) acc[c] = scale * row[c];
      } else {
        for (int64_t c = 0; c < dim; ++c) acc[c] = row[c];
      }
    } else {
      for (int64_t c = 0; c < dim; ++c) acc[c] += scale * row[c];
    }
  }
  if (mean) {
    const float inv_len = 1.f / static_cast<float>(end - begin);
    for (int64_t c = 0; c < dim; ++c) acc[c] *= inv_len;
  }
}

// One unique row's gradient: acc (dim,) = the sum over its entries e in
// [begin, end), in rank order, of scale[e] * grad[pos[e] : pos[e] + dim]; zeros
// when it has none. before(e) runs before entry e is read.
template <class Before>
DEMB_HD void sum_row_grads(float* __restrict__ acc, int64_t dim, const int64_t* pos,
                           const float* scale, const float* grad, int64_t begin, int64_t end,
                           const Before& before) {
  if (begin == end) {
    for (int64_t c = 0; c < dim; ++c) acc[c] = 0.f;
    return;
  }
  for (int64_t e = begin; e < end; ++e) {
    before(e);
    const float* __restrict__ ge = grad + pos[e];
    const float s = scale[e];
    if (e == begin) {
      for (int64_t c = 0; c < dim; ++c) acc[c] = s * ge[c];
    } else {
      for (int64_t c = 0; c < dim; ++c) acc[c] += s * ge[c];
    }
  }
}

}  // namespace dynamicemb
