// 16-bit row elements and their rounding, written once for both backends.
//
// A 16-bit row (dynamicemb.ops.interface.RowFormat) stores its embedding as float16
// or bfloat16 and its optimizer state as float32. Kernels compute in float32: they
// widen an element when they read it and narrow it when they write it back. Both
// conversions are integer code, so every compiler, ISA and flush-to-zero mode gives
// the same bits; this file is a cross-backend contract, pinned by known answers
// (test/table/test_row_rounding.py, test/dynamicemb_testing/rounding_reference.py).
//
// Round to nearest, narrow_rn<E>: IEEE round to nearest, ties to even, equal to
// torch's `.to(dtype)` bit for bit on every value but NaN. Float16: subnormals kept,
// a magnitude of 65520 or more becomes inf. Every NaN becomes the format's canonical
// quiet NaN, +0x7E00 (float16) or +0x7FC0 (bfloat16): torch's own NaN bits differ
// by device and code path (CPU bfloat16 gives 0xFFFF, CPU float16 keeps the sign and
// payload), so RowFormat.pack writes the canonical NaN too.
//
// Stochastic rounding, narrow_sr<E>(x, r16), r16 in [0, 65536): |x| rounds up to the
// next representable magnitude with probability (|x| - the one below) / (their gap),
// so the expected stored value is x. On u, the float32 bits of |x|:
//   bfloat16                    (u + r16) >> 16                    (16 dropped bits)
//   float16, |x| >= 2^-14       (u + (r16 & 0x1FFF)) >> 13, rebiased (13 dropped bits)
//   float16, |x| < 2^-14        q = |x| / 2^-24 in fixed point with 16 fraction bits
//                               (bits below truncated: a bias under 2^-16 of the gap),
//                               then (q + r16) >> 16
// then x's sign. A carry into the exponent gives the next binade; a float16 magnitude
// that rounds up from 65504 gives inf (as round to nearest does from 65520). inf stays
// inf, NaN rounds to nearest (the canonical NaN). No hardware conversion.
//
// Rounding bits: per (seed, stream, key, step) one 64-bit word, per column 16 bits:
//   w   = element_bits(seed, stream, key, step ^ kRoundingDomain)  (init_primitives.h)
//   r16 = lowbias32(lo32(w) ^ hi32(w) ^ uint32(col * 0x9E3779B9)) & 0xFFFF
// all arithmetic wrapping (uint64, uint32). stream is the table's init_stream (the
// CRC-32 of its name), key the raw int64 key, step the group's update count, col the
// embedding column. The initializer's counters stay below 2^40; kRoundingDomain puts
// every step below 2^48 at a counter of 2^49 or more, so these words are not the
// initializer's, even with the same seed and stream.
#pragma once

#include "dynamicemb/init_primitives.h"  // element_bits, DEMB_HD

namespace dynamicemb {

// Storage of one 16-bit element: its bits, so that no backend's half type (and no
// library header) is needed and the math never happens in 16 bits.
struct f16 {
  uint16_t bits;
};
struct bf16 {
  uint16_t bits;
};
static_assert(sizeof(f16) == 2 && sizeof(bf16) == 2, "16-bit row elements");

// A float's bits and back: the device's reinterpreting moves (NVRTC has no
// __builtin_memcpy), the host's memcpy.
DEMB_HD uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  __builtin_memcpy(&u, &x, sizeof u);
  return u;
#endif
}

DEMB_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  __builtin_memcpy(&x, &u, sizeof x);
  return x;
#endif
}

// ------------------------------------------------------------------ widening (exact)

DEMB_HD float widen(float x) { return x; }

DEMB_HD float widen(bf16 h) { return bits_float(static_cast<uint32_t>(h.bits) << 16); }

// A NaN keeps its payload and becomes quiet (as torch's `.float()` on the CPU).
DEMB_HD float widen(f16 h) {
  const uint32_t sign = static_cast<uint32_t>(h.bits & 0x8000u) << 16;
  const uint32_t exp = (h.bits >> 10) & 0x1Fu;
  uint32_t mant = h.bits & 0x3FFu;
  if (exp == 0x1Fu) return bits_float(sign | 0x7F800000u | (mant ? 0x400000u : 0u) | (mant << 13));
  if (exp != 0) return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
  if (mant == 0) return bits_float(sign);
  // subnormal: mant 2^-24, normalized (float32 is normal down to 2^-126)
  uint32_t e = 113;
  while (!(mant & 0x400u)) {
    mant <<= 1;
    --e;
  }
  return bits_float(sign | (e << 23) | ((mant & 0x3FFu) << 13));
}

// ------------------------------------------------- narrowing, round to nearest even

constexpr uint16_t kF16CanonicalNan = 0x7E00;
constexpr uint16_t kBf16CanonicalNan = 0x7FC0;

DEMB_HD bool is_nan_bits(uint32_t u) { return (u & 0x7FFFFFFFu) > 0x7F800000u; }

DEMB_HD uint16_t bf16_bits_rn(uint32_t u) {
  if (is_nan_bits(u)) return kBf16CanonicalNan;
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

DEMB_HD uint16_t f16_bits_rn(uint32_t u) {
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return kF16CanonicalNan;
  if (a >= 0x38800000u) {  // 2^-14 and above: normal, or inf
    const uint32_t h = ((a + 0xFFFu + ((a >> 13) & 1u)) >> 13) - (112u << 10);
    return static_cast<uint16_t>(sign | (h >= 0x7C00u ? 0x7C00u : h));
  }
  // subnormal: round mant 2^(e-150) at 2^-24, ties to even, with a sticky remainder
  const uint32_t exp = a >> 23;
  const uint32_t mant = exp ? (a & 0x7FFFFFu) | 0x800000u : a & 0x7FFFFFu;
  const int drop = 126 - static_cast<int>(exp ? exp : 1u);  // >= 14
  if (drop > 24) return sign;  // below 2^-25: rounds to zero
  const uint32_t k = mant >> drop;
  const uint32_t rem = mant & ((1u << drop) - 1u), half = 1u << (drop - 1);
  return static_cast<uint16_t>(sign | (k + (rem > half || (rem == half && (k & 1u)))));
}

// --------------------------------------------------------- narrowing, stochastic

DEMB_HD uint16_t bf16_bits_sr(uint32_t u, uint32_t r16) {
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a >= 0x7F800000u) return bf16_bits_rn(u);
  return static_cast<uint16_t>(((u >> 16) & 0x8000u) | ((a + (r16 & 0xFFFFu)) >> 16));
}

// Branch-free: every lane computes the normal and the subnormal result and selects
// one, so that a CPU loop over a row vectorizes (variable shifts and blends).
DEMB_HD uint16_t f16_bits_sr(uint32_t u, uint32_t r16) {
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7FFFFFFFu;
  const uint32_t nh = ((a + (r16 & 0x1FFFu)) >> 13) - (112u << 10);
  const uint32_t normal = nh < 0x7C00u ? nh : 0x7C00u;  // inf stays inf
  // below 2^-14: |x| / 2^-24 with 16 fraction bits, truncated (|x| = mant 2^(exp-150));
  // a lane at or above 2^-14 computes a value it does not use (its shifts masked)
  const uint32_t exp = a >> 23;
  const uint32_t mant = (a & 0x7FFFFFu) | (exp ? 0x800000u : 0u);
  const int shift = static_cast<int>(exp ? exp : 1u) - 110;
  const uint32_t units =
      shift >= 0 ? mant << (shift & 31) : mant >> (-shift < 31 ? -shift : 31);
  const uint32_t sub = (units + (r16 & 0xFFFFu)) >> 16;
  const uint32_t h = sign | (a >= 0x38800000u ? normal : sub);
  return static_cast<uint16_t>(a > 0x7F800000u ? kF16CanonicalNan : h);
}

// E is the stored element: float (rows stay float32: identity), f16 or bf16.
template <class E>
DEMB_HD E narrow_rn(float x);
template <>
DEMB_HD float narrow_rn<float>(float x) {
  return x;
}
template <>
DEMB_HD f16 narrow_rn<f16>(float x) {
  return f16{f16_bits_rn(float_bits(x))};
}
template <>
DEMB_HD bf16 narrow_rn<bf16>(float x) {
  return bf16{bf16_bits_rn(float_bits(x))};
}

// r16: 16 random bits (rounding_bits), in [0, 65536).
template <class E>
DEMB_HD E narrow_sr(float x, uint32_t r16);
template <>
DEMB_HD float narrow_sr<float>(float x, uint32_t /*r16*/) {
  return x;
}
template <>
DEMB_HD f16 narrow_sr<f16>(float x, uint32_t r16) {
  return f16{f16_bits_sr(float_bits(x), r16)};
}
template <>
DEMB_HD bf16 narrow_sr<bf16>(float x, uint32_t r16) {
  return bf16{bf16_bits_sr(float_bits(x), r16)};
}

// ------------------------------------------------------------------ rounding bits

// "SR" (0x5352) in bits 62..48 of the counter: these words are not the initializer's.
constexpr uint64_t kRoundingDomain = uint64_t{0x5352} << 48;

// The word of one row's update: one 64-bit hash per row and step.
DEMB_HD uint64_t rounding_word(uint64_t seed, int64_t stream, int64_t key, uint64_t step) {
  return element_bits(seed, stream, key, step ^ kRoundingDomain);
}

// Chris Wellons' lowbias32: a 32-bit bijective mix (two multiplies, which vectorize).
DEMB_HD uint32_t lowbias32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

// The row's half of the bits: lo32(w) ^ hi32(w).
DEMB_HD uint32_t rounding_base(uint64_t word) {
  return static_cast<uint32_t>(word) ^ static_cast<uint32_t>(word >> 32);
}

// 16 random bits for column `col` of the row whose rounding_base is `base`. The column
// is taken modulo 2^32 (uint32(col * 0x9E3779B9) depends on col's low 32 bits only):
// a loop over a row's columns counts them in 32-bit lanes, which a CPU loop
// vectorizes twice as wide as 64-bit ones (a bfloat16 row's narrowing: 22 -> 14 ns).
DEMB_HD uint32_t column_bits(uint32_t base, uint32_t col) {
  return lowbias32(base ^ (col * 0x9E3779B9u)) & 0xFFFFu;
}

// 16 random bits for column `col` of the row whose word is `word`.
DEMB_HD uint32_t rounding_bits(uint64_t word, int64_t col) {
  return column_bits(rounding_base(word), static_cast<uint32_t>(col));
}

}  // namespace dynamicemb
