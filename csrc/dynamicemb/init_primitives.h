// Per-element initializers, written once for both backends.
//
// A new row's element (key, column) is a pure function of (seed, table, key,
// column): counter-based random numbers, no generator state. So a row's initial
// value does not depend on the batch it arrived in, the thread count, the cache
// size or the device, which is what makes cached and uncached training identical.
#pragma once

#include "dynamicemb/hash_primitives.h"

namespace dynamicemb {

enum InitMode : int32_t {
  kInitNormal = 0,
  kInitTruncatedNormal = 1,
  kInitUniform = 2,
  kInitConstant = 3,
  kInitDebug = 4,  // every element = key mod 100000 (non-negative)
};

struct InitParams {
  int32_t mode;
  float mean;
  float std_dev;
  float lower;
  float upper;
  float value;
  uint64_t seed;
};

// 64 random bits for (seed, table, key, counter): two rounds of the table hash, the
// first of the row alone (row_bits), the second with the counter (counter_bits).
DEMB_HD uint64_t row_bits(uint64_t seed, int64_t table, int64_t key) {
  return hash_key(key, table) ^ (seed * kGolden);
}

DEMB_HD uint64_t counter_bits(uint64_t row, uint64_t counter) {
  return hash_key(static_cast<int64_t>(row ^ (counter * 0xD1B54A32D192ED03ull)), 0);
}

DEMB_HD uint64_t element_bits(uint64_t seed, int64_t table, int64_t key, uint64_t counter) {
  return counter_bits(row_bits(seed, table, key), counter);
}

// Uniform in (0, 1): 24 random bits, centred in their cell so 0 and 1 never occur.
DEMB_HD float open_uniform(uint64_t bits) {
  return (static_cast<float>(bits >> 40) + 0.5f) * (1.0f / 16777216.0f);
}

// Standard normal by Box-Muller from two independent uniforms; `row`: row_bits.
DEMB_HD float standard_normal(uint64_t row, uint64_t counter) {
  const float u1 = open_uniform(counter_bits(row, 2 * counter));
  const float u2 = open_uniform(counter_bits(row, 2 * counter + 1));
  return sqrtf(-2.0f * logf(u1)) * cosf(6.28318530717958647692f * u2);
}

// Column `col` of a uniform row whose row_bits is `row`: one fused multiply-add,
// whatever a compiler contracts.
DEMB_HD float uniform_element(const InitParams& p, uint64_t row, int col) {
  return fmaf(p.upper - p.lower, open_uniform(counter_bits(row, static_cast<uint64_t>(col))),
              p.lower);
}

// Column `col` of the initial row of `key` in `table`, whose row_bits is `row`.
DEMB_HD float init_element_of_row(const InitParams& p, uint64_t row, int64_t key, int col) {
  const uint64_t c = static_cast<uint64_t>(col);
  switch (p.mode) {
    case kInitNormal:
      return p.mean + p.std_dev * standard_normal(row, c);
    case kInitTruncatedNormal: {
      // Resample (deterministically: the next counters) until inside [lower, upper].
      for (uint64_t attempt = 0; attempt < 64; ++attempt) {
        const float x = p.mean + p.std_dev * standard_normal(row, c + (attempt << 32));
        if (x >= p.lower && x <= p.upper) return x;
      }
      return fminf(fmaxf(p.mean, p.lower), p.upper);
    }
    case kInitUniform:
      return uniform_element(p, row, col);
    case kInitConstant:
      return p.value;
    case kInitDebug: {
      const int64_t m = key % 100000;
      return static_cast<float>(m < 0 ? m + 100000 : m);
    }
    default:
      return 0.f;
  }
}

DEMB_HD float init_element(const InitParams& p, int64_t table, int64_t key, int col) {
  return init_element_of_row(p, row_bits(p.seed, table, key), key, col);
}

// The initializers of a group's tables packed for the kernels (InitSpec,
// dynamicemb/ops/records.py): ints (T, 3) int64 (stream, mode, seed) and
// floats (T, 5) float32 (mean, std_dev, lower, upper, value).
struct PackedInits {
  const int64_t* ints;
  const float* floats;

  // Table t's initializer.
  DEMB_HD InitParams params(int64_t t) const {
    return InitParams{static_cast<int32_t>(ints[3 * t + 1]), floats[5 * t], floats[5 * t + 1],
                      floats[5 * t + 2], floats[5 * t + 3], floats[5 * t + 4],
                      static_cast<uint64_t>(ints[3 * t + 2])};
  }

  // Element `col` of the initial row of `key` in table t (its stream: ints[3 t]).
  DEMB_HD float element(int64_t t, int64_t key, int col) const {
    return init_element(params(t), ints[3 * t], key, col);
  }

  // out[0, dim) = element(t, key, c) for every column c: the row's bits hashed once
  // and the mode chosen outside the column loop, which a CPU then vectorizes for a
  // uniform row (per element, a 32,768-row batch of them took 8 ms on 2 threads).
  DEMB_HD void row(int64_t t, int64_t key, float* out, int dim) const {
    const InitParams p = params(t);
    const uint64_t bits = row_bits(p.seed, ints[3 * t], key);
    if (p.mode == kInitUniform) {
      for (int c = 0; c < dim; ++c) out[c] = uniform_element(p, bits, c);
    } else {
      for (int c = 0; c < dim; ++c) out[c] = init_element_of_row(p, bits, key, c);
    }
  }

  // Column c of a new stored row [embedding (dim) | optimizer state] of `key` in
  // table t: the initializer's value, then state_value for every state column.
  DEMB_HD float new_row_element(int64_t t, int64_t key, int64_t c, int64_t dim,
                                float state_value) const {
    return c < dim ? element(t, key, static_cast<int>(c)) : state_value;
  }
};

}  // namespace dynamicemb
