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

static_assert(kSquareLanes == kWarp, "row-wise Adagrad sums a row's squares a lane per sum");

// Row arguments of the lookup kernels: the two tiers' values (one width), the
// batch's transient rows (dim wide), the row reference of each unique row, and
// for a call whose references may be negative the unique keys, their table ids
// and the tables' initializers (init_ints (T, 3): stream,
// mode, seed; init_floats (T, 5): mean, std_dev, lower, upper, value), else null.
#define DEMB_ROW_PARAMS                                                                   \
  const float *device_rows, const float *host_rows, int64_t width, const float *transient, \
      int64_t dim, const int64_t *row_ref, const int64_t *init_keys,                       \
      const int16_t *init_tids, const int64_t *init_ints, const float *init_floats
#define DEMB_ROWS                                                                     \
  RowReader {                                                                         \
    device_rows, host_rows, width, transient, dim, row_ref, init_keys, init_tids,     \
        init_ints, init_floats                                                        \
  }

// Reads element c of unique row u. A negative reference (given the initializers
// whenever one may occur) is a key without a stored row: its row is its table's
// initializer's, computed here (initializers are functions of the key).
struct RowReader {
  const float* device_rows;
  const float* host_rows;
  int64_t width;
  const float* transient;
  int64_t dim;
  const int64_t* row_ref;
  const int64_t* init_keys;
  const int16_t* init_tids;
  const int64_t* init_ints;
  const float* init_floats;

  __device__ __forceinline__ float at(int64_t u, int64_t c) const {
    const int64_t r = row_ref[u];
    if (r < 0 && init_ints != nullptr) {
      return PackedInits{init_ints, init_floats}.element(init_tids[u], init_keys[u],
                                                         static_cast<int>(c));
    }
    return row_of(r, device_rows, host_rows, width, transient, dim)[c];
  }
};

// Whether the module's input check refused this batch (error: its word, or null).
__device__ __forceinline__ bool refused(const int64_t* error) {
  return error != nullptr && *error != 0;
}

// The first problem of offsets (num_bags + 1,) over num_indices lookups, as the
// CPU's check_offsets: 1 the first entry is not 0, 2 the last is not
// num_indices, 3 an entry is below the one before. The word *error takes
// max(4 - code) over the problems found (the smallest code wins; 0: none found,
// so a word that starts at 0 stays 0 for a good batch). One thread per entry.
extern "C" __global__ void demb_check_offsets(const int64_t* offsets, int64_t num_bags,
                                              int64_t num_indices, unsigned long long* error) {
  const int64_t i = global_thread();
  if (i > num_bags) return;
  unsigned long long code = 0;
  if (i == 0 && offsets[0] != 0) {
    code = 1;
  } else if (i == num_bags && offsets[i] != num_indices) {
    code = 2;
  } else if (i > 0 && offsets[i] < offsets[i - 1]) {
    code = 3;
  }
  if (code) atomicMax(error, 4 - code);
}

// The initial rows of keys, one warp per key (lanes over the columns):
// values[slots[i], c] = key i's table's initializer's value for c < dim and
// state_value for the optimizer state after it (c < width), for every i < n, or
// with a status (null: none) for each i whose status is kInserted or
// kEvictedAndInserted, the others left alone: the host needs no count of the new
// keys, and a steady step's warps (hits) return after one read.
extern "C" __global__ void demb_init_rows(float* values, int64_t width, const int64_t* slots,
                                          const int8_t* status, const int64_t* keys,
                                          const int16_t* tids, int64_t n, int64_t dim,
                                          const int64_t* init_ints, const float* init_floats,
                                          float state_value) {
  const int64_t i = global_warp();
  if (i >= n) return;
  if (status != nullptr && status[i] != kInserted && status[i] != kEvictedAndInserted) return;
  float* row = values + slots[i] * width;
  const PackedInits inits{init_ints, init_floats};
  for (int64_t c = lane_id(); c < width; c += kWarp) {
    row[c] = inits.new_row_element(tids[i], keys[i], c, dim, state_value);
  }
}

// Pooled lookup, one warp per bag k = f * batch + b: out[b, col(f) + c] = the
// (weighted) sum, or mean, of the bag's rows. Empty bags write zeros.
// A batch the input check refused (error) pools to zeros: its offsets are not read.
extern "C" __global__ void demb_pooled_forward(DEMB_ROW_PARAMS, const int64_t* inverse,
                                               const int64_t* offsets, const float* weights,
                                               const int64_t* feature_col, int64_t batch,
                                               int64_t num_bags, bool mean, float* out,
                                               int64_t out_width, const int64_t* error) {
  const int64_t k = global_warp();
  if (k >= num_bags) return;
  const int64_t col = feature_col[k / batch];
  if (col < 0) return;
  float* dst = out + (k % batch) * out_width + col;
  const bool bad = refused(error);
  const int64_t begin = bad ? 0 : offsets[k], end = bad ? 0 : offsets[k + 1];
  const float inv_len = end > begin ? 1.f / static_cast<float>(end - begin) : 0.f;
  const RowReader rows = DEMB_ROWS;
  for (int64_t c = lane_id(); c < dim; c += kWarp) {
    float acc = 0.f;
    for (int64_t j = begin; j < end; ++j) {
      const float x = rows.at(inverse[j], c);
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
// (positions with inverse < 0 are left as they are; a refused batch's are zeros).
extern "C" __global__ void demb_sequence_forward(DEMB_ROW_PARAMS, const int64_t* inverse,
                                                 int64_t n, float* out, const int64_t* error) {
  const int64_t e = global_thread();
  if (e >= n * dim) return;
  if (refused(error)) {
    out[e] = 0.f;
    return;
  }
  const int64_t j = e / dim;
  if (inverse[j] < 0) return;
  out[e] = DEMB_ROWS.at(inverse[j], e - j * dim);
}

// Where each lookup's gradient is and how it is scaled, placed at its rank:
// pos[rank[j]] = offset of its gradient row in grad, scale[rank[j]] = weight x
// (1 / bag length for MEAN). One thread per bag (pooled) or lookup (sequence).
// Ranks outside [0, entries) are skipped (and counted in bad[0] when bad is given).
// A batch the input check refused (error) places nothing: its offsets are not read
// (and its dedup gave no unique row to update). optimizer_step (null: none): the
// optimizer's step count in device memory, advanced by one for the backward unless
// the batch is refused (the launch has at least one thread).
extern "C" __global__ void demb_place_grads(const int64_t* rank, int64_t n, int64_t entries,
                                            const int64_t* offsets, const float* weights,
                                            const int64_t* feature_col, int64_t batch,
                                            int64_t num_bags, bool mean, int64_t grad_width,
                                            int64_t* pos, float* scale,
                                            unsigned long long* bad, const int64_t* error,
                                            int64_t* optimizer_step) {
  const int64_t k = global_thread();
  const bool pooled = offsets != nullptr;
  if (refused(error)) return;
  if (k == 0 && optimizer_step != nullptr) ++*optimizer_step;
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
// applies the optimizer to its stored row. A row with no entry is a padding
// position of a step counted on the device (every unique row has a lookup): it
// is skipped, as are rows not stored (transient or computed). lr_at and step_at
// (null: none): the learning rate and the optimizer's step count in device memory,
// from which the step's scalars are computed here (schedule_step) instead of
// taken from the arguments. Shared memory: dim floats per warp.
extern "C" __global__ void demb_fused_update(float* device_rows, float* host_rows, int64_t width,
                                             int64_t dim, const int64_t* row_ref,
                                             int64_t num_unique, const int64_t* starts,
                                             const int64_t* pos, const float* scale,
                                             const float* grad, const int64_t* first_piece,
                                             const float* partial, int kind, float lr,
                                             float eps, float beta1, float beta2,
                                             float weight_decay, float one_minus_beta1,
                                             float one_minus_beta2, float step_size,
                                             float bias_correction2_sqrt, float decay_scale,
                                             const double* lr_at, const int64_t* step_at,
                                             double beta1_exact, double beta2_exact,
                                             double decoupled_decay) {
  extern __shared__ float shared_acc[];
  const int64_t u = global_warp();
  if (u >= num_unique) return;
  const int64_t begin = starts[u], end = starts[u + 1];
  if (begin == end || !is_stored_ref(row_ref[u])) return;
  float* acc = shared_acc + (threadIdx.x / kWarp) * dim;
  const int64_t p0 = first_piece ? first_piece[u] : 0, p1 = first_piece ? first_piece[u + 1] : 0;
  for (int64_t c = lane_id(); c < dim; c += kWarp) {
    float a = 0.f;
    if (p1 > p0) {
#pragma unroll 4
      for (int64_t p = p0; p < p1; ++p) a = p == p0 ? partial[p * dim + c] : a + partial[p * dim + c];
    } else {
      a = entry_sum(pos, scale, grad, begin, end, c);
    }
    acc[c] = a;  // read by this lane only (its columns)
  }
  OptimizerParams p =
      optimizer_params(kind, lr, eps, beta1, beta2, weight_decay, one_minus_beta1,
                       one_minus_beta2, step_size, bias_correction2_sqrt, decay_scale);
  if (lr_at != nullptr) {
    schedule_step(p, *lr_at, *step_at, beta1_exact, beta2_exact, decoupled_decay);
  }
  float* row = stored_row_of(row_ref[u], device_rows, host_rows, width);
  float* state = row + dim;
  const int d = static_cast<int>(dim);
  if (kind == kRowwiseAdagrad) {  // rowwise_square_sum's order: a sum per lane, folded
    float squares = 0.f;
    for (int c = lane_id(); c < d; c += kWarp) {
      const float gi = rowwise_gradient(row, acc, c, p);
      squares += gi * gi;
    }
    for (int half = kWarp / 2; half > 0; half /= 2) {
      squares += __shfl_xor_sync(kFullMask, squares, half);  // lane j < half: + lane j + half
    }
    squares = __shfl_sync(kFullMask, squares, 0);  // lane 0 folded in the shared order
    float sum = state[0];
    __syncwarp();  // every lane read the accumulator before lane 0 writes it
    const float scale = rowwise_scale(&sum, squares, d, p);
    if (lane_id() == 0) state[0] = sum;
    for (int c = lane_id(); c < d; c += kWarp) rowwise_step(row, acc, c, scale, p);
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
// A refused batch (error) writes nothing: its offsets are not read.
extern "C" __global__ void demb_per_sample_weight_grad(DEMB_ROW_PARAMS, const int64_t* inverse,
                                                       const int64_t* offsets,
                                                       const int64_t* feature_col,
                                                       int64_t batch, int64_t num_bags,
                                                       const float* grad, int64_t grad_width,
                                                       float* out, const int64_t* error) {
  const int64_t k = global_warp();
  if (k >= num_bags || refused(error)) return;
  const int64_t col = feature_col[k / batch];
  if (col < 0) return;
  const float* gk = grad + (k % batch) * grad_width + col;
  const RowReader rows = DEMB_ROWS;
  for (int64_t j = offsets[k] + lane_id(); j < offsets[k + 1]; j += kWarp) {
    if (inverse[j] < 0) continue;
    float dot = 0.f;
    for (int64_t c = 0; c < dim; ++c) dot = fmaf(gk[c], rows.at(inverse[j], c), dot);
    out[j] = dot;
  }
}
