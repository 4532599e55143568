// Per-row fused optimizer updates, written once for both backends.
//
// A value row is [embedding (dim) | optimizer state]. `grad` is the row's summed
// gradient. Weight decay takes one of two forms (FBGEMM's WeightDecayMode): L2
// adds weight_decay * w to the gradient before the rule (torch.optim's
// weight_decay); decoupled scales the row by decay_scale = 1 - lr * weight_decay
// before the rule (torch.optim.AdamW). The caller sets the unused form to its
// identity (weight_decay 0, decay_scale 1). Float operation order follows
// torch.optim so results can be compared bit-for-bit where sums agree.
#pragma once

#include "dynamicemb/hash_primitives.h"  // DEMB_HD

namespace dynamicemb {

enum OptimizerKind : int32_t {
  kSgd = 0,             // state: none
  kAdam = 1,            // state: m (dim), v (dim)
  kAdagrad = 2,         // state: sum of squares (dim)
  kRowwiseAdagrad = 3,  // state: sum of mean squares (1)
};

// State floats per row for an optimizer and embedding dim.
DEMB_HD int optimizer_state_dim(int kind, int dim) {
  switch (kind) {
    case kAdam: return 2 * dim;
    case kAdagrad: return dim;
    case kRowwiseAdagrad: return 1;
    default: return 0;
  }
}

struct OptimizerParams {
  int32_t kind;
  float lr;
  float eps;
  float beta1;
  float beta2;
  float weight_decay;
  // Adam scalars, computed in double by the caller as torch.optim.Adam does:
  float one_minus_beta1;  // 1 - beta1
  float one_minus_beta2;  // 1 - beta2
  float step_size;        // lr / (1 - beta1^step)
  float bias_correction2_sqrt;  // sqrt(1 - beta2^step)
  float decay_scale;  // decoupled weight decay: 1 - lr * weight_decay (1: none)
};

// The parameters of one update, in the order of the struct's fields. The Adam
// scalars come from the caller, computed in double as torch.optim.Adam does.
DEMB_HD OptimizerParams optimizer_params(int32_t kind, float lr, float eps, float beta1,
                                         float beta2, float weight_decay,
                                         float one_minus_beta1, float one_minus_beta2,
                                         float step_size, float bias_correction2_sqrt,
                                         float decay_scale) {
  OptimizerParams p;
  p.kind = kind;
  p.lr = lr;
  p.eps = eps;
  p.beta1 = beta1;
  p.beta2 = beta2;
  p.weight_decay = weight_decay;
  p.one_minus_beta1 = one_minus_beta1;
  p.one_minus_beta2 = one_minus_beta2;
  p.step_size = step_size;
  p.bias_correction2_sqrt = bias_correction2_sqrt;
  p.decay_scale = decay_scale;
  return p;
}

// The scalars of one update that change from step to step, computed from the
// learning rate and the optimizer's step count where the update runs (a step
// whose scalars live in device memory: a CUDA graph replays it as it is), in
// double as the host computes them: Adam's step size lr / (1 - beta1^step) and
// sqrt(1 - beta2^step), and the decoupled weight decay's scale 1 - lr * decay
// (decay 0: none).
DEMB_HD void schedule_step(OptimizerParams& p, double lr, int64_t step, double beta1,
                           double beta2, double decoupled_decay) {
  p.lr = static_cast<float>(lr);
  p.step_size = p.lr;
  p.bias_correction2_sqrt = 1.f;
  if (p.kind == kAdam) {
    p.step_size = static_cast<float>(lr / (1.0 - pow(beta1, static_cast<double>(step))));
    p.bias_correction2_sqrt = static_cast<float>(sqrt(1.0 - pow(beta2, static_cast<double>(step))));
  }
  p.decay_scale = static_cast<float>(1.0 - lr * decoupled_decay);
}

// The rows' pointers are __restrict__: a row, its state and its gradient never
// overlap, and without the promise GCC versions each loop by a run-time overlap
// check that takes a scalar copy, contracted differently (one ulp), when the
// gradient lies within a vector of the row: which happened by where the heap put a
// thread's accumulator (issue 38's flake).
DEMB_HD void sgd_row(float* __restrict__ w, const float* __restrict__ g, int dim,
                     const OptimizerParams& p) {
  for (int i = 0; i < dim; ++i) {
    const float gi = g[i] + p.weight_decay * w[i];
    w[i] *= p.decay_scale;
    w[i] -= p.lr * gi;
  }
}

DEMB_HD void adagrad_row(float* __restrict__ w, float* __restrict__ sum,
                         const float* __restrict__ g, int dim, const OptimizerParams& p) {
  for (int i = 0; i < dim; ++i) {
    const float gi = g[i] + p.weight_decay * w[i];
    sum[i] += gi * gi;
    w[i] *= p.decay_scale;
    w[i] -= p.lr * gi / (sqrtf(sum[i]) + p.eps);
  }
}

// Row-wise Adagrad's sum of a row's squared gradients, in the one order every
// backend keeps: kSquareLanes running sums (sum j: columns j, j + 32, ... in
// order), then folded in halves (sum j += sum j + 16, then + 8, ..., + 1), as a
// warp's lanes and shuffles compute it; a CPU vectorizes the lanes.
constexpr int kSquareLanes = 32;

DEMB_HD float rowwise_gradient(const float* __restrict__ w, const float* __restrict__ g,
                               int i, const OptimizerParams& p) {
  return g[i] + p.weight_decay * w[i];
}

// The kSquareLanes running sums folded in halves into lanes[0], which it returns.
DEMB_HD float fold_square_lanes(float* lanes) {
  for (int half = kSquareLanes / 2; half > 0; half /= 2) {
    for (int j = 0; j < half; ++j) lanes[j] += lanes[j + half];
  }
  return lanes[0];
}

DEMB_HD float rowwise_square_sum(const float* __restrict__ w, const float* __restrict__ g,
                                 int dim, const OptimizerParams& p) {
  float lanes[kSquareLanes] = {};
  int base = 0;
#if defined(__GNUC__) && !defined(__CUDACC__)
  // The host's lanes as one vector (the same operations per lane, so the same sums):
  // whole blocks of 32 columns in registers, the rest below.
  typedef float Lanes __attribute__((vector_size(kSquareLanes * sizeof(float))));
  Lanes sums = {};
  for (; base + kSquareLanes <= dim; base += kSquareLanes) {
    Lanes gv, wv;
    __builtin_memcpy(&gv, g + base, sizeof gv);
    __builtin_memcpy(&wv, w + base, sizeof wv);
    const Lanes gi = gv + p.weight_decay * wv;
    sums += gi * gi;
  }
  __builtin_memcpy(lanes, &sums, sizeof lanes);
#endif
  for (; base < dim; base += kSquareLanes) {
    const int n = dim - base < kSquareLanes ? dim - base : kSquareLanes;
    for (int j = 0; j < n; ++j) {
      const float gi = rowwise_gradient(w, g, base + j, p);
      lanes[j] += gi * gi;
    }
  }
  return fold_square_lanes(lanes);
}

// The accumulator after a row's squares were summed, and the step it gives.
DEMB_HD float rowwise_scale(float* __restrict__ sum, float squares, int dim,
                            const OptimizerParams& p) {
  sum[0] += squares / static_cast<float>(dim);
  return p.lr / (sqrtf(sum[0]) + p.eps);
}

DEMB_HD void rowwise_step(float* __restrict__ w, const float* __restrict__ g, int i,
                          float scale, const OptimizerParams& p) {
  const float gi = rowwise_gradient(w, g, i, p);
  w[i] *= p.decay_scale;
  w[i] -= scale * gi;
}

DEMB_HD void rowwise_adagrad_row(float* __restrict__ w, float* __restrict__ sum,
                                 const float* __restrict__ g, int dim,
                                 const OptimizerParams& p) {
  const float scale = rowwise_scale(sum, rowwise_square_sum(w, g, dim, p), dim, p);
  for (int i = 0; i < dim; ++i) rowwise_step(w, g, i, scale, p);
}

DEMB_HD void adam_row(float* __restrict__ w, float* __restrict__ m, float* __restrict__ v,
                      const float* __restrict__ g, int dim, const OptimizerParams& p) {
  for (int i = 0; i < dim; ++i) {
    const float gi = g[i] + p.weight_decay * w[i];
    w[i] *= p.decay_scale;  // AdamW: param.mul_(1 - lr * weight_decay) first
    // torch's lerp(m, g, 1 - beta1), then v * beta2 + (1 - beta2) * g * g
    m[i] = p.one_minus_beta1 < 0.5f ? m[i] + p.one_minus_beta1 * (gi - m[i])
                                    : gi - (gi - m[i]) * (1.f - p.one_minus_beta1);
    v[i] = v[i] * p.beta2;
    v[i] = v[i] + p.one_minus_beta2 * gi * gi;
    const float denom = sqrtf(v[i]) / p.bias_correction2_sqrt + p.eps;
    w[i] = w[i] + (-p.step_size) * m[i] / denom;
  }
}

// Updates one row's embedding w (dim,) and its optimizer state (a 16-bit row's
// embedding is widened into w first and narrowed back after: rounding_primitives.h).
DEMB_HD void optimizer_update(float* w, float* state, const float* g, int dim,
                              const OptimizerParams& p) {
  switch (p.kind) {
    case kSgd: sgd_row(w, g, dim, p); break;
    case kAdam: adam_row(w, state, state + dim, g, dim, p); break;
    case kAdagrad: adagrad_row(w, state, g, dim, p); break;
    case kRowwiseAdagrad: rowwise_adagrad_row(w, state, g, dim, p); break;
    default: break;
  }
}

// Updates one float32 value row; `row` points at the embedding, the state follows it.
DEMB_HD void optimizer_update(float* row, const float* g, int dim,
                              const OptimizerParams& p) {
  optimizer_update(row, row + dim, g, dim, p);
}

}  // namespace dynamicemb
