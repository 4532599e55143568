// How the CPU embedding kernels (embedding.cpp) read and write value rows.
//
// A row reference (dynamicemb/row_ref.h) names a slot of the device tier or the host
// store, a transient row (float32, dim), or a row its initializer computes. Stored
// rows have one format per call (RowFormat, dynamicemb/ops/records.py): float32
// [embedding | state] (code 0), or a float16 (1) or bfloat16 (2) embedding and a
// float32 state at `state_offset`; every tier stores rows as float32 words. The
// readers give the kernels every row as float32: 16-bit rows widened exactly
// (rounding_primitives.h), so the math and its order are float32's on both formats.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <tuple>
#include <vector>

#include "cpu/aten.h"
#include "cpu/checks.h"
#include "cpu/verbs.h"
#include "dynamicemb/init_primitives.h"
#include "dynamicemb/optimizer_primitives.h"
#include "dynamicemb/rounding_primitives.h"
#include "dynamicemb/row_ref.h"

namespace dynamicemb {
namespace cpu {
namespace {

// Random row reads are latency-bound: rows are prefetched this many lookups ahead.
constexpr int64_t kPrefetchAhead = 8;

// Functions that only prefetch are inlined where they are called: GCC finds a call of
// one free of side effects (a prefetch is none) and drops it otherwise (the rows of
// the update went unprefetched and the row-wise Adagrad backward took twice as long).
#define DEMB_PREFETCHES inline __attribute__((always_inline))

// Prefetch every cache line of `bytes` bytes from p.
DEMB_PREFETCHES void prefetch_bytes(const void* p, int64_t bytes, int rw = 0) {
  const char* c = static_cast<const char*>(p);
  for (int64_t b = 0; b < bytes; b += 64) {
    if (rw) {
      __builtin_prefetch(c + b, 1);
    } else {
      __builtin_prefetch(c + b, 0);
    }
  }
}

// Prefetch every cache line of a row of `dim` floats.
DEMB_PREFETCHES void prefetch_row(const void* row, int64_t dim, int rw = 0) {
  prefetch_bytes(row, dim * static_cast<int64_t>(sizeof(float)), rw);
}

constexpr int64_t kFloat32Rows = 0, kFloat16Rows = 1, kBfloat16Rows = 2;

// w[0, n) = the n elements of e widened (exactly: every ISA gives the same floats).
inline void widen_row(const bf16* e, float* __restrict__ w, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(e);
  for (int64_t c = 0; c < n; ++c) {  // a shift: vectorized
    const uint32_t u = static_cast<uint32_t>(bits[c]) << 16;
    __builtin_memcpy(w + c, &u, sizeof u);
  }
}

inline void widen_row(const f16* e, float* __restrict__ w, int64_t n) {
  int64_t c = 0;
#if defined(__AVX512F__)
  // 16 lanes a store: the update then loads w 64 bytes at a time, and a 64-byte load
  // from two 32-byte stores cannot be forwarded (it waits for them to retire: the
  // 8-lane loop alone made a float16 row's update 3x float32's)
  for (; c + 16 <= n; c += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(e + c));
    _mm512_storeu_ps(w + c, _mm512_cvtph_ps(h));
  }
#endif
#if defined(__F16C__)
  // vcvtph2ps is exact, and quiets a NaN as widen(f16) does
  for (; c + 8 <= n; c += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(e + c));
    _mm256_storeu_ps(w + c, _mm256_cvtph_ps(h));
  }
#endif
  for (; c < n; ++c) w[c] = widen(e[c]);
}

// e[0, n) = w's n floats rounded to nearest (narrow_rn: every ISA gives the same bits).
inline void narrow_row_rn(const float* w, bf16* __restrict__ e, int64_t n) {
  for (int64_t c = 0; c < n; ++c) e[c] = narrow_rn<bf16>(w[c]);  // vectorized
}

inline void narrow_row_rn(const float* w, f16* __restrict__ e, int64_t n) {
  int64_t c = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  for (; c + 16 <= n; c += 16) {  // as below, 16 lanes at a time
    const __m512 x = _mm512_loadu_ps(w + c);
    const __m256i h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(e + c),
                        _mm256_mask_mov_epi16(h, nan, _mm256_set1_epi16(kF16CanonicalNan)));
  }
#endif
#if defined(__F16C__)
  // vcvtps2ph rounds to nearest even as narrow_rn (subnormals, overflow to inf); a NaN
  // keeps its payload there, so NaN lanes take the canonical NaN
  const __m256i canonical = _mm256_set1_epi32(kF16CanonicalNan);
  for (; c + 8 <= n; c += 8) {
    const __m256 x = _mm256_loadu_ps(w + c);
    const __m128i h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    const __m256i wide = _mm256_blendv_epi8(_mm256_cvtepu16_epi32(h), canonical, nan);
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(wide),
                                            _mm256_extracti128_si256(wide, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(e + c), packed);
  }
#endif
  for (; c < n; ++c) e[c] = narrow_rn<f16>(w[c]);
}

// e[0, n) = w's n floats rounded stochastically (narrow_sr), element c with
// rounding_bits(word, col + c): the row's columns from `col`, counted in 32-bit lanes
// (column_bits). Both types first round every lane as their _sr function rounds its
// bulk case (vectorized); when a lane is another case a second pass gives every lane
// the whole function (branch-free, vectorized too: a scalar repair of the odd lanes,
// branching on each, cost a float16 step 5-10%; the whole function in the first pass
// cost a bfloat16 row's narrowing a third).
//
// bfloat16: the bulk case is a finite x; inf and NaN go to the second pass.
inline void narrow_row_sr(const float* w, bf16* __restrict__ e, int64_t n, uint64_t word,
                          int64_t col) {
  uint16_t* h = reinterpret_cast<uint16_t*>(e);
  const uint32_t base = rounding_base(word), first = static_cast<uint32_t>(col);
  const int m = static_cast<int>(n);
  uint32_t others = 0;  // (a bool reduction is not vectorized)
  for (int c = 0; c < m; ++c) {
    const uint32_t u = float_bits(w[c]);
    const uint32_t a = u & 0x7FFFFFFFu;
    const uint32_t r = column_bits(base, first + static_cast<uint32_t>(c));
    others |= static_cast<uint32_t>(a >= 0x7F800000u);
    h[c] = static_cast<uint16_t>(((u >> 16) & 0x8000u) | ((a + r) >> 16));
  }
  if (!others) return;
  for (int c = 0; c < m; ++c) {
    h[c] = bf16_bits_sr(float_bits(w[c]), column_bits(base, first + static_cast<uint32_t>(c)));
  }
}

// float16: the bulk case is a finite normal result; zero, subnormal, overflow, inf and
// NaN go to the second pass.
inline void narrow_row_sr(const float* w, f16* __restrict__ e, int64_t n, uint64_t word,
                          int64_t col) {
  uint16_t* h = reinterpret_cast<uint16_t*>(e);
  const uint32_t base = rounding_base(word), first = static_cast<uint32_t>(col);
  const int m = static_cast<int>(n);
  // |x| in [2^-14, the largest |x| whose rounding up stays below 2^16): a normal result
  constexpr uint32_t kLow = 0x38800000u, kHigh = 0x47800000u - 0x2000u;
  uint32_t others = 0;
  for (int c = 0; c < m; ++c) {
    const uint32_t u = float_bits(w[c]);
    const uint32_t a = u & 0x7FFFFFFFu;
    const uint32_t r = column_bits(base, first + static_cast<uint32_t>(c)) & 0x1FFFu;
    others |= static_cast<uint32_t>(a - kLow > kHigh - kLow);
    h[c] = static_cast<uint16_t>(((u >> 16) & 0x8000u) | (((a + r) >> 13) - (112u << 10)));
  }
  if (!others) return;
  for (int c = 0; c < m; ++c) {
    h[c] = f16_bits_sr(float_bits(w[c]), column_bits(base, first + static_cast<uint32_t>(c)));
  }
}

struct RowSource {
  float* device;  // [*, width] 4-byte words (float32 rows: floats)
  float* host;
  int64_t width;
  const float* transient;
  int64_t dim;
  const int64_t* row_ref;
  int64_t code;          // the stored rows' format (kFloat32Rows, ...)
  char* device_bytes;    // the tiers' bytes, row_bytes (4 * width) a row
  char* host_bytes;
  int64_t row_bytes;
  int64_t state_offset;  // bytes from a row's start to its float32 state

  const float* row(int64_t u) const {
    return row_of(row_ref[u], device, host, width, transient, dim);
  }
  float* stored_row(int64_t u) const { return stored_row_of(row_ref[u], device, host, width); }
  // The bytes of stored row u (any format).
  char* stored_bytes(int64_t u) const {
    const int64_t r = row_ref[u];
    return r >= kHostRowBit ? host_bytes + (r - kHostRowBit) * row_bytes
                            : device_bytes + r * row_bytes;
  }
  float* state_of(char* row) const { return reinterpret_cast<float*>(row + state_offset); }
};

// RowFormatArg: (code, state_offset) of 16-bit rows; None: float32.
RowSource row_source(const std::vector<at::Tensor>& tiers, const at::Tensor& transient,
                     const at::Tensor& row_ref, int64_t dim,
                     const c10::optional<RowFormatArg>& format = c10::nullopt) {
  TORCH_CHECK(tiers.size() == 2, "tiers must be [device values, host values]");
  check_tensor(transient, at::kFloat, "transient");
  check_tensor(row_ref, at::kLong, "row_ref");
  const int64_t code = format ? std::get<0>(*format) : kFloat32Rows;
  TORCH_CHECK(code == kFloat32Rows || code == kFloat16Rows || code == kBfloat16Rows,
              "row format code must be 0 (float32), 1 (float16) or 2 (bfloat16), got ", code);
  for (const auto& t : tiers) {
    check_tensor(t, at::kFloat, "values");
    TORCH_CHECK(t.dim() == 2 && t.size(1) == tiers[0].size(1),
                "values must be [*, width] with one width for both tiers");
  }
  const int64_t row_bytes = tiers[0].size(1) * tiers[0].element_size();
  const int64_t state_offset =
      code == kFloat32Rows ? dim * static_cast<int64_t>(sizeof(float)) : std::get<1>(*format);
  if (code == kFloat32Rows) {
    TORCH_CHECK(tiers[0].size(1) >= dim, "values must be [*, width >= dim]");
  } else {
    TORCH_CHECK(state_offset >= dim * 2 && state_offset % 4 == 0 && state_offset <= row_bytes,
                "a 16-bit row's state offset must be 4-byte aligned, within the row and after "
                "its ", dim, " embedding elements, got ", state_offset, " of ", row_bytes);
  }
  RowSource src{tiers[0].data_ptr<float>(), tiers[1].data_ptr<float>(), tiers[0].size(1),
                transient.data_ptr<float>(), dim, row_ref.data_ptr<int64_t>(), code,
                static_cast<char*>(tiers[0].data_ptr()), static_cast<char*>(tiers[1].data_ptr()),
                row_bytes, state_offset};
  return src;
}

// dst[0:n] = src[0:n], with streaming stores on the aligned body of dst. Callers
// end their streaming with store_fence().
inline __attribute__((always_inline)) void stream_copy(float* __restrict dst,
                                                       const float* __restrict src, int64_t n) {
#if defined(__AVX512F__)
  constexpr int64_t kLanes = 16;
#elif defined(__AVX__)
  constexpr int64_t kLanes = 8;
#elif defined(__SSE2__)
  constexpr int64_t kLanes = 4;
#else
  constexpr int64_t kLanes = 1;
#endif
  int64_t c = 0;
  for (; c < n && reinterpret_cast<uintptr_t>(dst + c) % (kLanes * sizeof(float)); ++c) {
    dst[c] = src[c];
  }
  for (; c + kLanes <= n; c += kLanes) {
#if defined(__AVX512F__)
    _mm512_stream_ps(dst + c, _mm512_loadu_ps(src + c));
#elif defined(__AVX__)
    _mm256_stream_ps(dst + c, _mm256_loadu_ps(src + c));
#elif defined(__SSE2__)
    _mm_stream_ps(dst + c, _mm_loadu_ps(src + c));
#else
    dst[c] = src[c];
#endif
  }
  for (; c < n; ++c) dst[c] = src[c];
}

// Orders this thread's streaming stores before its later stores.
inline void store_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}


// dst[0, n) = the n elements of e widened (widen_row's floats), with streaming stores
// on the aligned body of dst, as stream_copy: a 16-bit row goes to a large output
// without a float32 copy in between.
inline void stream_widen(float* __restrict dst, const bf16* e, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(e);
  int64_t c = 0;
#if defined(__AVX512F__)
  for (; c < n && reinterpret_cast<uintptr_t>(dst + c) % 64; ++c) dst[c] = widen(e[c]);
  for (; c + 16 <= n; c += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bits + c));
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + c),
                        _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
#elif defined(__AVX2__)
  for (; c < n && reinterpret_cast<uintptr_t>(dst + c) % 32; ++c) dst[c] = widen(e[c]);
  for (; c + 8 <= n; c += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bits + c));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + c),
                        _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
#endif
  for (; c < n; ++c) dst[c] = widen(e[c]);
}

inline void stream_widen(float* __restrict dst, const f16* e, int64_t n) {
  int64_t c = 0;
#if defined(__AVX512F__)
  for (; c < n && reinterpret_cast<uintptr_t>(dst + c) % 64; ++c) dst[c] = widen(e[c]);
  for (; c + 16 <= n; c += 16) {  // vcvtph2ps: exact, a NaN quieted as widen(f16) does
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(e + c));
    _mm512_stream_ps(dst + c, _mm512_cvtph_ps(h));
  }
#elif defined(__F16C__) && defined(__AVX__)
  for (; c < n && reinterpret_cast<uintptr_t>(dst + c) % 32; ++c) dst[c] = widen(e[c]);
  for (; c + 8 <= n; c += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(e + c));
    _mm256_stream_ps(dst + c, _mm256_cvtph_ps(h));
  }
#endif
  for (; c < n; ++c) dst[c] = widen(e[c]);
}

// The lookups' reader of unique rows, one per thread, chosen once per call so that
// the loops carry no branch for the rows they do not have. StoredRows reads each
// referenced float32 row (a call whose references are never negative). ComputedRows
// computes the row of a negative reference (a key without a stored row) from its
// table's initializer into the thread's scratch row, as the CUDA kernels'
// RowReader does. WidenedRows reads 16-bit rows widened into the scratch row, and a
// computed row as the stored one would be (rounded to nearest, then widened). A
// caller uses a row before it asks for the next. stream_to(dst, u) writes row u to a
// large output with streaming stores (stream_copy), a 16-bit row widened on the way.
struct StoredRows {
  RowSource src;
  const float* row(int64_t u) const { return src.row(u); }
  void stream_to(float* dst, int64_t u) const { stream_copy(dst, row(u), src.dim); }
  DEMB_PREFETCHES void prefetch(int64_t u) const { prefetch_row(src.row(u), src.dim); }
};

struct ComputedRows {
  RowSource src;
  const int64_t* keys;  // (U,) the unique keys of the references
  const int16_t* tids;  // (U,) their table ids
  PackedInits inits;
  mutable std::vector<float> scratch;  // (dim,)

  const float* row(int64_t u) const {
    if (src.row_ref[u] >= 0) return src.row(u);
    inits.row(tids[u], keys[u], scratch.data(), static_cast<int>(src.dim));
    return scratch.data();
  }
  void stream_to(float* dst, int64_t u) const { stream_copy(dst, row(u), src.dim); }
  DEMB_PREFETCHES void prefetch(int64_t u) const {
    if (src.row_ref[u] >= 0) prefetch_row(src.row(u), src.dim);
  }
};

template <class E>
struct WidenedRows {
  RowSource src;
  const int64_t* keys;  // nullptr: no computed rows (references never negative)
  const int16_t* tids;
  PackedInits inits;
  mutable std::vector<float> scratch;  // (dim,)
  mutable std::vector<E> narrow;       // (dim,) a computed row as stored

  const float* row(int64_t u) const {
    const int64_t r = src.row_ref[u];
    float* w = scratch.data();
    if (r < 0) {
      inits.row(tids[u], keys[u], w, static_cast<int>(src.dim));
      narrow_row_rn(w, narrow.data(), src.dim);
      widen_row(narrow.data(), w, src.dim);
      return w;
    }
    if (r >= kTransientRowBit && r < kHostRowBit) {
      return src.transient + (r - kTransientRowBit) * src.dim;
    }
    widen_row(reinterpret_cast<const E*>(src.stored_bytes(u)), w, src.dim);
    return w;
  }
  void stream_to(float* dst, int64_t u) const {
    if (is_stored_ref(src.row_ref[u])) {
      stream_widen(dst, reinterpret_cast<const E*>(src.stored_bytes(u)), src.dim);
    } else {
      stream_copy(dst, row(u), src.dim);
    }
  }
  DEMB_PREFETCHES void prefetch(int64_t u) const {
    if (is_stored_ref(src.row_ref[u])) {
      prefetch_bytes(src.stored_bytes(u), src.dim * static_cast<int64_t>(sizeof(E)));
    }
  }
};

// Calls body(E{}) with E the element type of 16-bit rows of `code`.
template <class Body>
void with_element(int64_t code, const Body& body) {
  if (code == kFloat16Rows) {
    body(f16{});
  } else {
    body(bf16{});
  }
}

// Calls body(make_rows), make_rows() giving a thread its reader: for float32 rows
// ComputedRows over `init` (an InitRows) when it is given, else StoredRows; for
// 16-bit rows WidenedRows.
template <class Body>
void with_rows(const RowSource& src, const c10::optional<InitRowsArg>& init, int64_t num_refs,
               const Body& body) {
  const int64_t* k = nullptr;
  const int16_t* t = nullptr;
  PackedInits inits{nullptr, nullptr};
  if (init.has_value()) {
    const at::Tensor& keys = std::get<0>(*init);
    const at::Tensor& tids = std::get<1>(*init);
    const at::Tensor& ints = std::get<0>(std::get<2>(*init));
    const at::Tensor& floats = std::get<1>(std::get<2>(*init));
    check_tensor(keys, at::kLong, "init keys");
    check_tensor(tids, at::kShort, "init table_ids");
    check_tensor(ints, at::kLong, "init ints");
    check_tensor(floats, at::kFloat, "init floats");
    TORCH_CHECK(keys.dim() == 1 && tids.sizes() == keys.sizes(),
                "init keys and table_ids must be 1-D of one length");
    TORCH_CHECK(keys.numel() == num_refs, "init keys must have one entry per row reference");
    TORCH_CHECK(ints.dim() == 2 && ints.size(1) == 3 && floats.dim() == 2 &&
                    floats.size(0) == ints.size(0) && floats.size(1) == 5,
                "an InitSpec holds (T, 3) ints and (T, 5) floats");
    inits = PackedInits{ints.data_ptr<int64_t>(), floats.data_ptr<float>()};
    k = keys.data_ptr<int64_t>();
    t = tids.data_ptr<int16_t>();
  }
  if (src.code != kFloat32Rows) {
    with_element(src.code, [&](auto element) {
      using E = decltype(element);
      body([&] {
        return WidenedRows<E>{src, k, t, inits, std::vector<float>(src.dim),
                              std::vector<E>(src.dim)};
      });
    });
  } else if (k == nullptr) {
    body([&] { return StoredRows{src}; });
  } else {
    body([&] { return ComputedRows{src, k, t, inits, std::vector<float>(src.dim)}; });
  }
}

// How an update writes a 16-bit row back (RoundingArg, verbs.h): stochastically from
// rounding_bits(rounding_word(seed, stream, key, step), column), or to nearest.
struct Rounding {
  const int64_t* keys;  // (U,) each unique row's key
  const int16_t* tids;  // (U,) its table id
  const int64_t* spec;  // (T, 2): each table's (stream, seed)
  const int64_t* step_at;  // (1,) read when a thread's writer is made, after the
  int64_t step;            // schedule's advance (update_params): the update's step
  bool stochastic;
};

Rounding rounding_of(const c10::optional<RoundingArg>& arg, int64_t num_unique) {
  TORCH_CHECK(arg.has_value(), "an update of 16-bit rows needs its rounding");
  const at::Tensor& keys = std::get<0>(*arg);
  const at::Tensor& tids = std::get<1>(*arg);
  const at::Tensor& spec = std::get<2>(*arg);
  const at::Tensor& step = std::get<3>(*arg);
  check_tensor(keys, at::kLong, "rounding keys");
  check_tensor(tids, at::kShort, "rounding table_ids");
  check_tensor(spec, at::kLong, "rounding spec");
  check_tensor(step, at::kLong, "rounding step");
  TORCH_CHECK(keys.numel() >= num_unique && tids.numel() == keys.numel(),
              "rounding keys and table_ids need an entry per unique row");
  TORCH_CHECK(spec.dim() == 2 && spec.size(1) == 2, "rounding spec is (T, 2): stream, seed");
  TORCH_CHECK(step.numel() == 1, "rounding step is (1,) int64");
  const int16_t* t = tids.data_ptr<int16_t>();
  for (int64_t u = 0; u < num_unique; ++u) {
    TORCH_CHECK(0 <= t[u] && t[u] < spec.size(0), "rounding table id out of range");
  }
  return Rounding{keys.data_ptr<int64_t>(), t, spec.data_ptr<int64_t>(),
                  step.data_ptr<int64_t>(), 0, std::get<4>(*arg)};
}

// Row blocks of the fused 16-bit step (step_narrow_row): one float32 block stays in
// registers from its widening to its narrowing.
constexpr int kStepBlock = 32;

// e[0, n) narrowed back from x, stochastically (columns from col) or to nearest.
template <class E>
inline void narrow_block(const float* x, E* e, int n, const Rounding& r, uint64_t word,
                         int64_t col) {
  if (r.stochastic) {
    narrow_row_sr(x, e, n, word, col);
  } else {
    narrow_row_rn(x, e, n);
  }
}

// The element steps of SGD and row-wise Adagrad (rowwise_step; SGD's with scale = lr)
// on a 16-bit row, a block at a time: widened, stepped and narrowed, where the
// generic update widens the whole row into memory, updates it there and narrows it
// back (three passes over it). The same operations per element: the same bits.
template <class E>
void step_narrow_row(E* e, const float* g, int dim, float scale, const OptimizerParams& p,
                     const Rounding& r, uint64_t word) {
  float x[kStepBlock];
  int c = 0;
  for (; c + kStepBlock <= dim; c += kStepBlock) {  // whole blocks: constant trip counts
    widen_row(e + c, x, kStepBlock);
    for (int i = 0; i < kStepBlock; ++i) rowwise_step(x, g + c, i, scale, p);
    narrow_block(x, e + c, kStepBlock, r, word, c);
  }
  if (c < dim) {
    const int n = dim - c;
    widen_row(e + c, x, n);
    for (int i = 0; i < n; ++i) rowwise_step(x, g + c, i, scale, p);
    narrow_block(x, e + c, n, r, word, c);
  }
}

// rowwise_square_sum of a 16-bit row, its blocks widened in turn: a block is one
// round of the lanes (column c + j adds to lane j), so the order is that function's.
template <class E>
float square_sum_narrow(const E* e, const float* g, int dim, const OptimizerParams& p) {
  static_assert(kStepBlock == kSquareLanes, "a block is one round of the lanes");
  float lanes[kSquareLanes] = {};
  float x[kStepBlock];
  int c = 0;
  for (; c + kStepBlock <= dim; c += kStepBlock) {
    widen_row(e + c, x, kStepBlock);
    for (int j = 0; j < kStepBlock; ++j) {
      const float gi = rowwise_gradient(x, g + c, j, p);
      lanes[j] += gi * gi;
    }
  }
  if (c < dim) {
    const int n = dim - c;
    widen_row(e + c, x, n);
    for (int j = 0; j < n; ++j) {
      const float gi = rowwise_gradient(x, g + c, j, p);
      lanes[j] += gi * gi;
    }
  }
  return fold_square_lanes(lanes);
}

// The optimizer's update of the 16-bit row of unique row u, in float32 with its
// state in place: SGD and row-wise Adagrad by blocks (step_narrow_row; row-wise
// Adagrad's scale from square_sum_narrow first), the others on the row widened into
// w (dim,) and narrowed back.
template <class E>
void update_narrow_row(char* row, float* state, const float* g, int dim,
                       const OptimizerParams& p, float* __restrict__ w, const Rounding& r,
                       int64_t u) {
  E* e = reinterpret_cast<E*>(row);
  uint64_t word = 0;
  if (r.stochastic) {
    const int64_t* table = r.spec + 2 * r.tids[u];
    word = rounding_word(static_cast<uint64_t>(table[1]), table[0], r.keys[u],
                         static_cast<uint64_t>(r.step));
  }
  if (p.kind == kSgd) {
    step_narrow_row(e, g, dim, p.lr, p, r, word);
    return;
  }
  if (p.kind == kRowwiseAdagrad) {
    const float scale = rowwise_scale(state, square_sum_narrow(e, g, dim, p), dim, p);
    step_narrow_row(e, g, dim, scale, p, r, word);
    return;
  }
  widen_row(e, w, dim);
  optimizer_update(w, state, g, dim, p);
  narrow_block(w, e, dim, r, word, 0);
}


// The backward's writer of stored rows, one per thread, chosen once per call:
// Float32Updates updates float32 rows in place; NarrowUpdates<E> widens a 16-bit
// row, updates it and its float32 state, and narrows it back (`Rounding`).
struct Float32Updates {
  RowSource src;
  int64_t row_floats;  // dim + state floats
  DEMB_PREFETCHES void prefetch(int64_t u) const {
    prefetch_row(src.stored_row(u), row_floats, 1);
  }
  void apply(int64_t u, const float* g, int dim, const OptimizerParams& p) const {
    optimizer_update(src.stored_row(u), g, dim, p);
  }
};

template <class E>
struct NarrowUpdates {
  RowSource src;
  Rounding rounding;
  mutable std::vector<float> w;  // (dim,) the widened embedding
  DEMB_PREFETCHES void prefetch(int64_t u) const {
    prefetch_bytes(src.stored_bytes(u), src.row_bytes, 1);
  }
  void apply(int64_t u, const float* g, int dim, const OptimizerParams& p) const {
    char* row = src.stored_bytes(u);
    update_narrow_row<E>(row, src.state_of(row), g, dim, p, w.data(), rounding, u);
  }
};

// Calls body(make_updates), make_updates() giving a thread its writer; checks that a
// row holds the optimizer's state_floats. `rounding` (RoundingArg) is read for
// 16-bit rows only.
template <class Body>
void with_updates(const RowSource& src, const c10::optional<RoundingArg>& rounding,
                  int64_t num_unique, int64_t state_floats, const Body& body) {
  if (src.code == kFloat32Rows) {
    TORCH_CHECK(src.width >= src.dim + state_floats,
                "value rows too narrow for the optimizer state");
    body([&] { return Float32Updates{src, src.dim + state_floats}; });
    return;
  }
  TORCH_CHECK(src.state_offset + state_floats * static_cast<int64_t>(sizeof(float)) <=
                  src.row_bytes,
              "value rows too narrow for the optimizer state");
  const Rounding r = rounding_of(rounding, num_unique);
  with_element(src.code, [&](auto element) {
    using E = decltype(element);
    body([&] {
      Rounding now = r;
      now.step = *r.step_at;
      return NarrowUpdates<E>{src, now, std::vector<float>(src.dim)};
    });
  });
}

}  // namespace
}  // namespace cpu
}  // namespace dynamicemb
