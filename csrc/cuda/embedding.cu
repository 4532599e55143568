// CUDA kernels of the embedding lookup and the fused backward, over the shared
// per-row primitives (init_primitives.h, optimizer_primitives.h, row_ref.h).
//
// Float sums run in the CPU kernels' order (a bag's rows in input order, a
// unique row's gradients in rank order), so the two backends agree to the
// rounding of a fused multiply-add. Host-tier rows are read through the
// unified address space (pinned host memory is addressable from the GPU).
#include "cuda/common.cuh"
#include "dynamicemb/init_primitives.h"
#include "dynamicemb/optimizer_primitives.h"
#include "dynamicemb/row_ref.h"

using namespace dynamicemb;
using namespace dynamicemb::cuda;

// Row arguments of the lookup kernels: the two tiers' values (one width), the
// batch's transient rows (dim wide) and the row reference of each unique row.
#define DEMB_ROW_PARAMS                                                                   \
  const float *device_rows, const float *host_rows, int64_t width, const float *transient, \
      int64_t dim, const int64_t *row_ref
#define DEMB_ROW_OF(u) row_of(row_ref[u], device_rows, host_rows, width, transient, dim)

// The first problem of offsets (num_bags + 1,) over num_indices lookups, as the
// CPU's check_offsets: 1 the first entry is not 0, 2 the last is not
// num_indices, 3 an entry is below the one before. *problem starts at 4 (none)
// and takes the smallest code found. One thread per entry.
extern "C" __global__ void demb_check_offsets(const int64_t* offsets, int64_t num_bags,
                                              int64_t num_indices, unsigned long long* problem) {
  const int64_t i = global_thread();
  if (i > num_bags) return;
  unsigned long long code = 4;
  if (i == 0 && offsets[0] != 0) {
    code = 1;
  } else if (i == num_bags && offsets[i] != num_indices) {
    code = 2;
  } else if (i > 0 && offsets[i] < offsets[i - 1]) {
    code = 3;
  }
  if (code < 4) atomicMin(problem, code);
}

// out[rows[i], c] = the initializer's value of (table, keys[i], c), c < dim.
extern "C" __global__ void demb_init_rows(float* out, int64_t out_width, const int64_t* rows,
                                          const int64_t* keys, int64_t m, int64_t table,
                                          int64_t dim, int mode, float mean, float std_dev,
                                          float lower, float upper, float value,
                                          uint64_t seed) {
  const int64_t e = global_thread();
  if (e >= m * dim) return;
  const int64_t i = e / dim;
  const int c = static_cast<int>(e - i * dim);
  const InitParams p{mode, mean, std_dev, lower, upper, value, seed};
  out[rows[i] * out_width + c] = init_element(p, table, keys[i], c);
}

// Pooled lookup, one warp per bag k = f * batch + b: out[b, col(f) + c] = the
// (weighted) sum, or mean, of the bag's rows. Empty bags write zeros.
extern "C" __global__ void demb_pooled_forward(DEMB_ROW_PARAMS, const int64_t* inverse,
                                               const int64_t* offsets, const float* weights,
                                               const int64_t* feature_col, int64_t batch,
                                               int64_t num_bags, bool mean, float* out,
                                               int64_t out_width) {
  const int64_t k = global_warp();
  if (k >= num_bags) return;
  const int64_t col = feature_col[k / batch];
  if (col < 0) return;
  float* dst = out + (k % batch) * out_width + col;
  const int64_t begin = offsets[k], end = offsets[k + 1];
  const float inv_len = end > begin ? 1.f / static_cast<float>(end - begin) : 0.f;
  for (int64_t c = lane_id(); c < dim; c += kWarp) {
    float acc = 0.f;
    for (int64_t j = begin; j < end; ++j) {
      const float x = DEMB_ROW_OF(inverse[j])[c];
      if (j == begin) {
        acc = weights ? weights[j] * x : x;
      } else {
        acc = fmaf(weights ? weights[j] : 1.f, x, acc);
      }
    }
    dst[c] = mean ? acc * inv_len : acc;
  }
}

// Sequence lookup, one thread per element: out[j, c] = row of inverse[j]
// (positions with inverse < 0 are left as they are).
extern "C" __global__ void demb_sequence_forward(DEMB_ROW_PARAMS, const int64_t* inverse,
                                                 int64_t n, float* out) {
  const int64_t e = global_thread();
  if (e >= n * dim) return;
  const int64_t j = e / dim;
  if (inverse[j] < 0) return;
  out[e] = DEMB_ROW_OF(inverse[j])[e - j * dim];
}

// Where each lookup's gradient is and how it is scaled, placed at its rank:
// pos[rank[j]] = offset of its gradient row in grad, scale[rank[j]] = weight x
// (1 / bag length for MEAN). One thread per bag (pooled) or lookup (sequence).
// Ranks outside [0, entries) are skipped (and counted in bad[0] when bad is given).
extern "C" __global__ void demb_place_grads(const int64_t* rank, int64_t n, int64_t entries,
                                            const int64_t* offsets, const float* weights,
                                            const int64_t* feature_col, int64_t batch,
                                            int64_t num_bags, bool mean, int64_t grad_width,
                                            int64_t* pos, float* scale,
                                            unsigned long long* bad) {
  const int64_t k = global_thread();
  const bool pooled = offsets != nullptr;
  if (k >= (pooled ? num_bags : n)) return;
  int64_t begin = k, end = k + 1, p = k * grad_width;
  float bag_scale = 1.f;
  if (pooled) {
    const int64_t col = feature_col[k / batch];
    begin = offsets[k];
    end = offsets[k + 1];
    if (col < 0 || end == begin) return;
    p = (k % batch) * grad_width + col;
    if (mean) bag_scale = 1.f / static_cast<float>(end - begin);
  }
  for (int64_t j = begin; j < end; ++j) {
    const int64_t r = rank[j];
    if (r < 0) continue;
    if (r >= entries) {
      if (bad != nullptr) atomicAdd(bad, 1ull);
      continue;
    }
    pos[r] = p;
    scale[r] = pooled ? (weights ? weights[j] : 1.f) * bag_scale : 1.f;
  }
}

// Sum of the scaled gradients of entries [begin, end) (rank order) for column c.
__device__ __forceinline__ float entry_sum(const int64_t* pos, const float* scale,
                                           const float* grad, int64_t begin, int64_t end,
                                           int64_t c) {
  float a = 0.f;
#pragma unroll 4
  for (int64_t e = begin; e < end; ++e) {
    const float g = grad[pos[e] + c];
    a = e == begin ? scale[e] * g : fmaf(scale[e], g, a);
  }
  return a;
}

// Hot rows (more lookups than one piece holds, ops/cuda.py PIECE_ENTRIES) are summed
// in two levels so that no warp walks a power law's head alone: one warp per
// piece writes partial (pieces, dim), then the row's warp adds its pieces in
// order. Other rows are summed in rank order, as the CPU backend sums them.

// The pieces of each unique row u (entries starts[u] to starts[u + 1] - 1): a row
// of more than piece_entries entries has ceil(entries / piece_entries) pieces, any
// other none. pieces (num_unique,) is scanned into first_piece[1:] by the caller;
// thread 0 writes first_piece[0] = 0.
extern "C" __global__ void demb_piece_counts(const int64_t* starts, int64_t num_unique,
                                             int64_t piece_entries, int64_t* pieces,
                                             int64_t* first_piece) {
  const int64_t u = global_thread();
  if (u == 0) first_piece[0] = 0;
  if (u >= num_unique) return;
  const int64_t entries = starts[u + 1] - starts[u];
  pieces[u] = entries > piece_entries ? (entries + piece_entries - 1) / piece_entries : 0;
}

// One warp per piece p of a hot row: partial[p, :] = the sum of its entries.
// Row u's pieces are first_piece[u] to first_piece[u + 1] - 1, and piece
// p - first_piece[u] of it holds entries starts[u] + piece_entries * (p -
// first_piece[u]) onwards, at most piece_entries of them. The grid covers a
// bound on the number of pieces known on the host (the real number,
// first_piece[num_unique], stays on the device): warps past it return.
extern "C" __global__ void demb_piece_sums(const int64_t* starts, const int64_t* first_piece,
                                           int64_t num_unique, int64_t piece_entries,
                                           int64_t bound, const int64_t* pos,
                                           const float* scale, const float* grad, int64_t dim,
                                           float* partial) {
  const int64_t p = global_warp();
  if (p >= bound || p >= first_piece[num_unique]) return;
  // The row holding piece p: the last u with first_piece[u] <= p.
  int64_t lo = 0, hi = num_unique;
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (first_piece[mid] <= p) lo = mid; else hi = mid;
  }
  const int64_t begin = starts[lo] + piece_entries * (p - first_piece[lo]);
  const int64_t end = min(begin + piece_entries, starts[lo + 1]);
  for (int64_t c = lane_id(); c < dim; c += kWarp) {
    partial[p * dim + c] = entry_sum(pos, scale, grad, begin, end, c);
  }
}

// One warp per unique row u: sums its lookups' scaled gradients (entries
// starts[u] to starts[u + 1] - 1 of pos/scale, in rank order; or, for a hot
// row, its pieces' partial sums first_piece[u] to first_piece[u + 1] - 1) and
// applies the optimizer to its stored row. Shared memory: dim floats per warp.
extern "C" __global__ void demb_fused_update(float* device_rows, float* host_rows, int64_t width,
                                             int64_t dim, const int64_t* row_ref,
                                             int64_t num_unique, const int64_t* starts,
                                             const int64_t* pos, const float* scale,
                                             const float* grad, const int64_t* first_piece,
                                             const float* partial, int kind, float lr,
                                             float eps, float beta1, float beta2,
                                             float weight_decay, float one_minus_beta1,
                                             float one_minus_beta2, float step_size,
                                             float bias_correction2_sqrt, float decay_scale) {
  extern __shared__ float shared_acc[];
  const int64_t u = global_warp();
  if (u >= num_unique || is_transient_ref(row_ref[u])) return;
  float* acc = shared_acc + (threadIdx.x / kWarp) * dim;
  const int64_t begin = starts[u], end = starts[u + 1];
  const int64_t p0 = first_piece ? first_piece[u] : 0, p1 = first_piece ? first_piece[u + 1] : 0;
  for (int64_t c = lane_id(); c < dim; c += kWarp) {
    float a = 0.f;
    if (p1 > p0) {
#pragma unroll 4
      for (int64_t p = p0; p < p1; ++p) a = p == p0 ? partial[p * dim + c] : a + partial[p * dim + c];
    } else {
      a = entry_sum(pos, scale, grad, begin, end, c);
    }
    acc[c] = a;
  }
  __syncwarp();
  const OptimizerParams p =
      optimizer_params(kind, lr, eps, beta1, beta2, weight_decay, one_minus_beta1,
                       one_minus_beta2, step_size, bias_correction2_sqrt, decay_scale);
  float* row = stored_row_of(row_ref[u], device_rows, host_rows, width);
  float* state = row + dim;
  const int d = static_cast<int>(dim);
  if (kind == kRowwiseAdagrad) {  // one sum over the row: one lane, in column order
    if (lane_id() == 0) rowwise_adagrad_row(row, state, acc, d, p);
    return;
  }
  for (int c = lane_id(); c < d; c += kWarp) {  // element-wise rules, a column per lane
    switch (kind) {
      case kSgd: sgd_row(row + c, acc + c, 1, p); break;
      case kAdam: adam_row(row + c, state + c, state + d + c, acc + c, 1, p); break;
      case kAdagrad: adagrad_row(row + c, state + c, acc + c, 1, p); break;
      default: break;
    }
  }
}

// Gradient of per-sample weights, one warp per bag, a lookup per lane:
// out[j] = dot(grad[b, col(f):+dim], row of inverse[j]), summed in column order.
extern "C" __global__ void demb_per_sample_weight_grad(DEMB_ROW_PARAMS, const int64_t* inverse,
                                                       const int64_t* offsets,
                                                       const int64_t* feature_col,
                                                       int64_t batch, int64_t num_bags,
                                                       const float* grad, int64_t grad_width,
                                                       float* out) {
  const int64_t k = global_warp();
  if (k >= num_bags) return;
  const int64_t col = feature_col[k / batch];
  if (col < 0) return;
  const float* gk = grad + (k % batch) * grad_width + col;
  for (int64_t j = offsets[k] + lane_id(); j < offsets[k + 1]; j += kWarp) {
    if (inverse[j] < 0) continue;
    const float* row = DEMB_ROW_OF(inverse[j]);
    float dot = 0.f;
    for (int64_t c = 0; c < dim; ++c) dot = fmaf(gk[c], row[c], dot);
    out[j] = dot;
  }
}
