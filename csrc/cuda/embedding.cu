// CUDA kernels of the embedding lookup and the fused backward, over the shared
// per-row primitives (init_primitives.h, optimizer_primitives.h, row_ref.h,
// rounding_primitives.h).
//
// Float sums run in the CPU kernels' order (a bag's rows in input order, a
// unique row's gradients in rank order), so the two backends agree to the
// rounding of a fused multiply-add. Host-tier rows are read through the
// unified address space (pinned host memory is addressable from the GPU).
//
// Stored rows have one format per launch (RowFormat, dynamicemb/ops/records.py):
// float32 [embedding | state], or a float16 / bfloat16 embedding and a float32
// state at state_offset bytes; every tier holds rows as float32 words, `width` of
// them a row. A kernel that reads or writes stored rows switches once on the format
// (a launch-uniform branch) into a template over the stored element E (float, f16,
// bf16), so the loops carry no branch on it: 16-bit elements are widened exactly and
// the math is float32's, in float32's order (csrc/cpu/rows.h).
#include "cuda/common.cuh"
#include "dynamicemb/init_primitives.h"
#include "dynamicemb/optimizer_primitives.h"
#include "dynamicemb/rounding_primitives.h"
#include "dynamicemb/row_ref.h"

using namespace dynamicemb;
using namespace dynamicemb::cuda;

static_assert(kSquareLanes == kWarp, "row-wise Adagrad sums a row's squares a lane per sum");

// The element type of the stored rows' embedding: RowFormat.code.
enum RowDtype : int { kFloat32Rows = 0, kFloat16Rows = 1, kBfloat16Rows = 2 };

// Row arguments of the lookup kernels: the two tiers' values (one width in float32
// words, one format: row_dtype, a RowFormat.code, and state_offset, the bytes before
// a row's state, which a lookup does not read), the batch's transient rows (float32,
// dim wide), the row reference of each unique row, and for a call whose references
// may be negative the unique keys, their table ids and the tables' initializers
// (init_ints (T, 3): stream, mode, seed; init_floats (T, 5): mean, std_dev, lower,
// upper, value), else null.
#define DEMB_ROW_PARAMS                                                                   \
  const float *device_rows, const float *host_rows, int64_t width, int row_dtype,         \
      int64_t state_offset, const float *transient, int64_t dim, const int64_t *row_ref,  \
      const int64_t *init_keys, const int16_t *init_tids, const int64_t *init_ints,       \
      const float *init_floats
#define DEMB_ROWS(E)                                                                  \
  RowReader<E> {                                                                      \
    device_rows, host_rows, width, transient, dim, row_ref, init_keys, init_tids,     \
        init_ints, init_floats                                                        \
  }

// Reads element c of unique row u, stored rows' elements being E. A negative
// reference (given the initializers whenever one may occur) is a key without a
// stored row: its row is its table's initializer's, computed here (initializers are
// functions of the key) and read as a stored one would be (rounded to nearest into
// E, widened). Transient rows are float32.
template <class E>
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
      return widen(narrow_rn<E>(PackedInits{init_ints, init_floats}.element(
          init_tids[u], init_keys[u], static_cast<int>(c))));
    }
    const float* words = row_of(r, device_rows, host_rows, width, transient, dim);
    if constexpr (sizeof(E) != sizeof(float)) {
      if (is_stored_ref(r)) return widen(reinterpret_cast<const E*>(words)[c]);
    }
    return words[c];  // float32 rows, and transient rows of any format
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

// Row i's initial values, by its warp's lanes: the initializer's elements of `key`
// in table t (rounded to nearest into E) and state_value in every state word (from
// state_offset bytes to the row's end). A 16-bit row's padding before its state is
// left as it is. Float32 rows: a lane per word of [embedding | state].
template <class E>
__device__ __forceinline__ void init_row(float* row, int64_t width, int64_t dim,
                                         int64_t state_offset, const PackedInits& inits,
                                         int16_t t, int64_t key, float state_value) {
  if constexpr (sizeof(E) == sizeof(float)) {
    for (int64_t c = lane_id(); c < width; c += kWarp) {
      row[c] = inits.new_row_element(t, key, c, dim, state_value);
    }
    return;
  }
  E* embedding = reinterpret_cast<E*>(row);
  for (int64_t c = lane_id(); c < dim; c += kWarp) {
    embedding[c] = narrow_rn<E>(inits.element(t, key, static_cast<int>(c)));
  }
  for (int64_t c = state_offset / 4 + lane_id(); c < width; c += kWarp) row[c] = state_value;
}

// The initial rows of keys, one warp per key (lanes over the columns): row
// slots[i] of values (rows of format row_dtype, state_offset: DEMB_ROW_PARAMS) =
// key i's table's initializer's values, then state_value in its optimizer state
// (init_row), for every i < n, or with a status (null: none) for each i whose
// status is kInserted or kEvictedAndInserted, the others left alone: the host
// needs no count of the new keys, and a steady step's warps (hits) return after
// one read.
extern "C" __global__ void demb_init_rows(float* values, int64_t width, int row_dtype,
                                          int64_t state_offset, const int64_t* slots,
                                          const int8_t* status, const int64_t* keys,
                                          const int16_t* tids, int64_t n, int64_t dim,
                                          const int64_t* init_ints, const float* init_floats,
                                          float state_value) {
  const int64_t i = global_warp();
  if (i >= n) return;
  if (status != nullptr && status[i] != kInserted && status[i] != kEvictedAndInserted) return;
  float* row = values + slots[i] * width;
  const PackedInits inits{init_ints, init_floats};
  switch (row_dtype) {
    case kFloat16Rows:
      return init_row<f16>(row, width, dim, state_offset, inits, tids[i], keys[i], state_value);
    case kBfloat16Rows:
      return init_row<bf16>(row, width, dim, state_offset, inits, tids[i], keys[i], state_value);
    default:
      return init_row<float>(row, width, dim, state_offset, inits, tids[i], keys[i],
                             state_value);
  }
}

// Pools the columns of one bag (lookups begin to end - 1), a column per lane, into
// dst: the (weighted) sum in input order, or mean; zeros for an empty bag.
template <class E>
__device__ __forceinline__ void pool_bag_columns(const RowReader<E>& rows, const int64_t* inverse,
                                                 const float* weights, int64_t begin,
                                                 int64_t end, bool mean, float* dst) {
  const float inv_len = end > begin ? 1.f / static_cast<float>(end - begin) : 0.f;
  for (int64_t c = lane_id(); c < rows.dim; c += kWarp) {
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

// 16-byte loads of stored rows: kChunk<E> adjacent columns a lane (4 float32 or 8
// 16-bit elements), widened from one uint4.
template <class E>
constexpr int kChunk = 16 / static_cast<int>(sizeof(E));

__device__ __forceinline__ bool aligned16(const void* p) {
  return (reinterpret_cast<uint64_t>(p) & 15u) == 0;
}

// Whether every stored row of this launch can be read a uint4 at a time: rows of
// whole 16-byte lines (width a multiple of 4 words) in 16-byte aligned tiers, dim a
// multiple of kChunk<E>. Launch-uniform.
template <class E>
__device__ __forceinline__ bool reads_chunks(const RowReader<E>& rows) {
  return rows.width % 4 == 0 && rows.dim % kChunk<E> == 0 && aligned16(rows.device_rows) &&
         aligned16(rows.host_rows);
}

// x[0, kChunk<E>) = the (widened) elements of one uint4 of stored elements E.
__device__ __forceinline__ void widen_chunk(const uint4& v, float* x, float) {
  x[0] = bits_float(v.x), x[1] = bits_float(v.y), x[2] = bits_float(v.z), x[3] = bits_float(v.w);
}
template <class E>
__device__ __forceinline__ void widen_chunk(const uint4& v, float* x, E) {
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {  // little endian: the lower half is the lower column
    x[2 * i] = widen(E{static_cast<uint16_t>(words[i] & 0xFFFFu)});
    x[2 * i + 1] = widen(E{static_cast<uint16_t>(words[i] >> 16)});
  }
}

// x[0, kChunk<E>) = columns [c0, c0 + kChunk<E>) of unique row u: one 16-byte load
// of a stored row (reads_chunks), an element at a time from a transient or computed one.
template <class E>
__device__ __forceinline__ void read_chunk(const RowReader<E>& rows, int64_t u, int64_t c0,
                                           float* x) {
  const int64_t r = rows.row_ref[u];
  if (is_stored_ref(r)) {
    const float* words = row_of(r, rows.device_rows, rows.host_rows, rows.width,
                                rows.transient, rows.dim);
    const uint4 v = reinterpret_cast<const uint4*>(words)[c0 / kChunk<E>];
    return widen_chunk(v, x, E{});
  }
#pragma unroll
  for (int i = 0; i < kChunk<E>; ++i) x[i] = rows.at(u, c0 + i);
}

// pool_bag_columns with kChunk<E> columns a lane, each row's chunk one 16-byte load
// (reads_chunks); the same sums in the same order, column by column.
template <class E>
__device__ __forceinline__ void pool_bag_chunks(const RowReader<E>& rows, const int64_t* inverse,
                                                const float* weights, int64_t begin, int64_t end,
                                                bool mean, float* dst) {
  constexpr int kN = kChunk<E>;
  const float inv_len = end > begin ? 1.f / static_cast<float>(end - begin) : 0.f;
  const bool wide_stores = aligned16(dst);  // uniform in the warp: dst is the bag's
  for (int64_t c0 = int64_t{lane_id()} * kN; c0 < rows.dim; c0 += kWarp * kN) {
    float acc[kN] = {};  // an empty bag's zeros
    float x[kN];
    for (int64_t j = begin; j < end; ++j) {
      read_chunk(rows, inverse[j], c0, x);
#pragma unroll
      for (int i = 0; i < kN; ++i) {
        if (j == begin) {
          acc[i] = weights ? weights[j] * x[i] : x[i];
        } else {
          acc[i] = fmaf(weights ? weights[j] : 1.f, x[i], acc[i]);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < kN; ++i) acc[i] = mean ? acc[i] * inv_len : acc[i];
    if (wide_stores) {
#pragma unroll
      for (int q = 0; q < kN; q += 4) {
        reinterpret_cast<uint4*>(dst + c0 + q)[0] = uint4{float_bits(acc[q]), float_bits(acc[q + 1]),
                                                          float_bits(acc[q + 2]),
                                                          float_bits(acc[q + 3])};
      }
    } else {
#pragma unroll
      for (int i = 0; i < kN; ++i) dst[c0 + i] = acc[i];
    }
  }
}

// A bag pooled with 16-byte loads where the launch's rows allow them.
template <class E>
__device__ __forceinline__ void pool_bag_rows(const RowReader<E>& rows, const int64_t* inverse,
                                         const float* weights, int64_t begin, int64_t end,
                                         bool mean, float* dst) {
  if (reads_chunks(rows)) return pool_bag_chunks(rows, inverse, weights, begin, end, mean, dst);
  pool_bag_columns(rows, inverse, weights, begin, end, mean, dst);
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
  switch (row_dtype) {
    case kFloat16Rows: return pool_bag_rows(DEMB_ROWS(f16), inverse, weights, begin, end, mean, dst);
    case kBfloat16Rows: return pool_bag_rows(DEMB_ROWS(bf16), inverse, weights, begin, end, mean, dst);
    default: return pool_bag_rows(DEMB_ROWS(float), inverse, weights, begin, end, mean, dst);
  }
}

// Sequence lookup, one warp per lookup j: out[j] = the row of inverse[j], pooled as a bag
// of one (the same bits: its first term is written, not added), so with 16-byte loads
// where the launch's rows allow them. Lookups with inverse < 0 are left as they are; a
// refused batch's rows are zeros (its inverse is not read).
extern "C" __global__ void demb_sequence_forward(DEMB_ROW_PARAMS, const int64_t* inverse,
                                                 int64_t n, float* out, const int64_t* error) {
  const int64_t j = global_warp();
  if (j >= n) return;
  const bool bad = refused(error);
  if (!bad && inverse[j] < 0) return;
  const int64_t end = bad ? j : j + 1;
  float* dst = out + j * dim;
  switch (row_dtype) {
    case kFloat16Rows: return pool_bag_rows(DEMB_ROWS(f16), inverse, nullptr, j, end, false, dst);
    case kBfloat16Rows: return pool_bag_rows(DEMB_ROWS(bf16), inverse, nullptr, j, end, false, dst);
    default: return pool_bag_rows(DEMB_ROWS(float), inverse, nullptr, j, end, false, dst);
  }
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

// Row-wise Adagrad's step scale for a row whose lanes summed `squares` (lane j:
// columns j, j + 32, ...): the sums folded in rowwise_square_sum's order, the row's
// accumulator state[0] advanced (rowwise_scale) and written by lane 0.
__device__ __forceinline__ float rowwise_warp_scale(float squares, float* state, int d,
                                                    const OptimizerParams& p) {
  for (int half = kWarp / 2; half > 0; half /= 2) {
    squares += __shfl_xor_sync(kFullMask, squares, half);  // lane j < half: + lane j + half
  }
  squares = __shfl_sync(kFullMask, squares, 0);  // lane 0 folded in the shared order
  float sum = state[0];
  __syncwarp();  // every lane read the accumulator before lane 0 writes it
  const float scale = rowwise_scale(&sum, squares, d, p);
  if (lane_id() == 0) state[0] = sum;
  return scale;
}

// The optimizer's update of a float32 row (its state after its d floats) from its
// summed gradient acc (d,), a column per lane.
__device__ __forceinline__ void update_float32_row(float* row, const float* acc, int d,
                                                   const OptimizerParams& p) {
  float* state = row + d;
  if (p.kind == kRowwiseAdagrad) {
    float squares = 0.f;
    for (int c = lane_id(); c < d; c += kWarp) {
      const float gi = rowwise_gradient(row, acc, c, p);
      squares += gi * gi;
    }
    const float scale = rowwise_warp_scale(squares, state, d, p);
    for (int c = lane_id(); c < d; c += kWarp) rowwise_step(row, acc, c, scale, p);
    return;
  }
  for (int c = lane_id(); c < d; c += kWarp) {  // element-wise rules, a column per lane
    switch (p.kind) {
      case kSgd: sgd_row(row + c, acc + c, 1, p); break;
      case kAdam: adam_row(row + c, state + c, state + d + c, acc + c, 1, p); break;
      case kAdagrad: adagrad_row(row + c, state + c, acc + c, 1, p); break;
      default: break;
    }
  }
}

// How an update writes a 16-bit row's elements back: stochastically, column c with
// rounding_bits(word, c) of its row's rounding_word, or to nearest.
struct RowRounding {
  uint64_t word;
  bool stochastic;

  template <class E>
  __device__ __forceinline__ E narrow(float x, int c) const {
    return stochastic ? narrow_sr<E>(x, rounding_bits(word, c)) : narrow_rn<E>(x);
  }
};

// The update of a row with a 16-bit embedding (E) and a float32 state: each lane
// widens its columns, updates them as update_float32_row does, and narrows them back.
template <class E>
__device__ __forceinline__ void update_narrow_row(E* row, float* state, const float* acc,
                                                  int d, const OptimizerParams& p,
                                                  const RowRounding& rounding) {
  if (p.kind == kRowwiseAdagrad) {
    float squares = 0.f;
    for (int c = lane_id(); c < d; c += kWarp) {
      const float w = widen(row[c]);
      const float gi = rowwise_gradient(&w, acc + c, 0, p);
      squares += gi * gi;
    }
    const float scale = rowwise_warp_scale(squares, state, d, p);
    for (int c = lane_id(); c < d; c += kWarp) {
      float w = widen(row[c]);
      rowwise_step(&w, acc + c, 0, scale, p);
      row[c] = rounding.narrow<E>(w, c);
    }
    return;
  }
  for (int c = lane_id(); c < d; c += kWarp) {
    float w = widen(row[c]);
    switch (p.kind) {
      case kSgd: sgd_row(&w, acc + c, 1, p); break;
      case kAdam: adam_row(&w, state + c, state + d + c, acc + c, 1, p); break;
      case kAdagrad: adagrad_row(&w, state + c, acc + c, 1, p); break;
      default: break;
    }
    row[c] = rounding.narrow<E>(w, c);
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
//
// Rows of format row_dtype (DEMB_ROW_PARAMS); a 16-bit row is written back with
// RowRounding: round_keys (U,) and round_tids (U,) each unique row's key and table
// id, round_spec (T, 2) each table's (stream, seed), round_step (1,) the update's
// step, read here, after demb_place_grads advanced the schedule's; stochastic, else
// to nearest. Float32 rows read none of them (null).
extern "C" __global__ void demb_fused_update(float* device_rows, float* host_rows, int64_t width,
                                             int row_dtype, int64_t state_offset, int64_t dim,
                                             const int64_t* row_ref, int64_t num_unique,
                                             const int64_t* starts, const int64_t* pos,
                                             const float* scale, const float* grad,
                                             const int64_t* first_piece, const float* partial,
                                             int kind, float lr, float eps, float beta1,
                                             float beta2, float weight_decay,
                                             float one_minus_beta1, float one_minus_beta2,
                                             float step_size, float bias_correction2_sqrt,
                                             float decay_scale, const double* lr_at,
                                             const int64_t* step_at, double beta1_exact,
                                             double beta2_exact, double decoupled_decay,
                                             const int64_t* round_keys,
                                             const int16_t* round_tids,
                                             const int64_t* round_spec,
                                             const int64_t* round_step, bool stochastic) {
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
  const int d = static_cast<int>(dim);
  if (row_dtype == kFloat32Rows) {
    update_float32_row(row, acc, d, p);
    return;
  }
  RowRounding rounding{0, stochastic};
  if (stochastic) {
    const int64_t* table = round_spec + 2 * round_tids[u];  // (stream, seed)
    rounding.word = rounding_word(static_cast<uint64_t>(table[1]), table[0], round_keys[u],
                                  static_cast<uint64_t>(*round_step));
  }
  float* state = row + state_offset / 4;
  if (row_dtype == kFloat16Rows) {
    update_narrow_row(reinterpret_cast<f16*>(row), state, acc, d, p, rounding);
  } else {
    update_narrow_row(reinterpret_cast<bf16*>(row), state, acc, d, p, rounding);
  }
}

// The weights' gradients of one bag's lookups begin to end - 1, a lookup per lane:
// out[j] = dot(gk (dim,), row of inverse[j]), summed in column order.
template <class E>
__device__ __forceinline__ void bag_weight_grads(const RowReader<E>& rows, const int64_t* inverse,
                                                 int64_t begin, int64_t end, const float* gk,
                                                 float* out) {
  for (int64_t j = begin + lane_id(); j < end; j += kWarp) {
    if (inverse[j] < 0) continue;
    float dot = 0.f;
    for (int64_t c = 0; c < rows.dim; ++c) dot = fmaf(gk[c], rows.at(inverse[j], c), dot);
    out[j] = dot;
  }
}

// Gradient of per-sample weights, one warp per bag (bag_weight_grads): out[j] =
// dot(grad[b, col(f):+dim], row of inverse[j]) for each lookup j of bag k = f *
// batch + b. A refused batch (error) writes nothing: its offsets are not read.
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
  const int64_t begin = offsets[k], end = offsets[k + 1];
  switch (row_dtype) {
    case kFloat16Rows: return bag_weight_grads(DEMB_ROWS(f16), inverse, begin, end, gk, out);
    case kBfloat16Rows: return bag_weight_grads(DEMB_ROWS(bf16), inverse, begin, end, gk, out);
    default: return bag_weight_grads(DEMB_ROWS(float), inverse, begin, end, gk, out);
  }
}
