// Drives csrc/dynamicemb/rounding_primitives.h on its own, without torch, for
// test_row_rounding.py, which compares what it writes with torch and with the Python
// reference (dynamicemb_testing/rounding_reference.py). Raw little-endian files:
//
//   widen OUT              OUT: uint32[2][65536], the float32 bits of widen(f16{h}),
//                          then of widen(bf16{h}), for every h
//   narrow X R OUT         X: float32[n], R: uint32[n] (16 random bits each); OUT:
//                          uint16[4][n]: narrow_rn<f16>, narrow_rn<bf16>,
//                          narrow_sr<f16>(x, r), narrow_sr<bf16>(x, r)
//   bits IN OUT            IN: n records of int64 (seed, stream, key, step, col); OUT:
//                          n records of uint64 (rounding_word, rounding_bits)
//   self                   properties that need no reference; prints "N checks, M wrong"
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "dynamicemb/rounding_primitives.h"

using namespace dynamicemb;

namespace {

template <class T>
std::vector<T> read_all(const char* path) {
  std::FILE* f = std::fopen(path, "rb");
  if (!f) {
    std::perror(path);
    std::exit(2);
  }
  std::vector<T> out;
  T v;
  while (std::fread(&v, sizeof v, 1, f) == 1) out.push_back(v);
  std::fclose(f);
  return out;
}

template <class T>
void write_all(const char* path, const std::vector<T>& data) {
  std::FILE* f = std::fopen(path, "wb");
  if (!f || std::fwrite(data.data(), sizeof(T), data.size(), f) != data.size()) {
    std::perror(path);
    std::exit(2);
  }
  std::fclose(f);
}

int widen_all(const char* out_path) {
  std::vector<uint32_t> out(2 * 65536);
  for (uint32_t h = 0; h < 65536; ++h) {
    out[h] = float_bits(widen(f16{static_cast<uint16_t>(h)}));
    out[65536 + h] = float_bits(widen(bf16{static_cast<uint16_t>(h)}));
  }
  write_all(out_path, out);
  return 0;
}

int narrow_all(const char* x_path, const char* r_path, const char* out_path) {
  const std::vector<uint32_t> x = read_all<uint32_t>(x_path), r = read_all<uint32_t>(r_path);
  if (x.size() != r.size()) return 2;
  const size_t n = x.size();
  std::vector<uint16_t> out(4 * n);
  for (size_t i = 0; i < n; ++i) {
    const float v = bits_float(x[i]);
    out[i] = narrow_rn<f16>(v).bits;
    out[n + i] = narrow_rn<bf16>(v).bits;
    out[2 * n + i] = narrow_sr<f16>(v, r[i]).bits;
    out[3 * n + i] = narrow_sr<bf16>(v, r[i]).bits;
  }
  write_all(out_path, out);
  return 0;
}

int bits_all(const char* in_path, const char* out_path) {
  const std::vector<int64_t> in = read_all<int64_t>(in_path);
  std::vector<uint64_t> out;
  for (size_t i = 0; i + 5 <= in.size(); i += 5) {
    const uint64_t w = rounding_word(static_cast<uint64_t>(in[i]), in[i + 1], in[i + 2],
                                     static_cast<uint64_t>(in[i + 3]));
    out.push_back(w);
    out.push_back(rounding_bits(w, in[i + 4]));
  }
  write_all(out_path, out);
  return 0;
}

struct Tally {
  long checks = 0, wrong = 0;
  void expect(bool ok, const char* what, uint32_t arg) {
    ++checks;
    if (!ok && ++wrong <= 10) std::printf("wrong: %s at 0x%08x\n", what, arg);
  }
};

// exact_from: below it SR truncates |x| to 16 bits below the last place (f16 subnormals)
template <class E>
void check_format(Tally& t, const char* name, float exact_from) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const E e{static_cast<uint16_t>(h)};
    const float w = widen(e);
    if (w != w) continue;  // NaN: canonical, checked against torch by the test
    // every 16-bit value survives both narrowings, whatever the random bits
    t.expect(narrow_rn<E>(w).bits == h, name, h);
    t.expect(narrow_sr<E>(w, 0).bits == h && narrow_sr<E>(w, 0xFFFF).bits == h, name, h);
  }
  // SR lands on a neighbour: r16 = 0 truncates, r16 = 0xFFFF rounds every inexact value
  // away from zero, and any r16 gives one of the two
  uint32_t s = 12345;
  for (int i = 0; i < 200000; ++i) {
    s = lowbias32(s + 0x9E3779B9u);
    const float x = bits_float(s & 0xBFFFFFFFu);  // exponents below 2^1 (f16 range too)
    const float x2 = bits_float((s & 0x807FFFFFu) | ((100u + s % 60u) << 23));
    for (float v : {x, x2}) {
      const float down = widen(narrow_sr<E>(v, 0)), up = widen(narrow_sr<E>(v, 0xFFFF));
      const float mid = widen(narrow_sr<E>(v, s >> 16));
      if (std::isinf(down)) {  // past the largest finite value: inf whatever the bits
        t.expect(up == down && mid == down, name, float_bits(v));
        continue;
      }
      t.expect(std::fabs(down) <= std::fabs(v) && std::fabs(down) <= std::fabs(up) &&
                   std::signbit(down) == std::signbit(v) && std::signbit(up) == std::signbit(v),
               name, float_bits(v));
      if (std::fabs(v) >= exact_from) {
        t.expect(std::fabs(v) <= std::fabs(up) && (down == v) == (up == down), name,
                 float_bits(v));
      }
      t.expect(mid == down || mid == up, name, float_bits(v));
    }
  }
  t.expect(narrow_sr<float>(1.5f, 7) == 1.5f && narrow_rn<float>(-2.25f) == -2.25f &&
               widen(0.75f) == 0.75f,
           "float identity", 0);
}

int self_check() {
  Tally t;
  check_format<f16>(t, "f16", 6.103515625e-05f);  // 2^-14
  check_format<bf16>(t, "bf16", 0.f);
  // rounding bits: 16 bits, and columns of a row differ (lowbias32 is a bijection)
  const uint64_t w = rounding_word(0, 7, 42, 1);
  for (int64_t c = 0; c < 4096; ++c) {
    t.expect(rounding_bits(w, c) < 65536u, "bits range", static_cast<uint32_t>(c));
  }
  t.expect(rounding_word(0, 7, 42, 1) != rounding_word(0, 7, 42, 2), "step", 0);
  t.expect(rounding_word(0, 7, 42, 0) != element_bits(0, 7, 42, 0), "domain", 0);
  std::printf("%ld checks, %ld wrong\n", t.checks, t.wrong);
  return t.wrong ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 3 && !std::strcmp(argv[1], "widen")) return widen_all(argv[2]);
  if (argc == 5 && !std::strcmp(argv[1], "narrow")) return narrow_all(argv[2], argv[3], argv[4]);
  if (argc == 4 && !std::strcmp(argv[1], "bits")) return bits_all(argv[2], argv[3]);
  if (argc == 2 && !std::strcmp(argv[1], "self")) return self_check();
  std::fprintf(stderr, "usage: rounding_check widen|narrow|bits|self ...\n");
  return 2;
}
