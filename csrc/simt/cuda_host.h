// What the kernel files of csrc/cuda use from CUDA, for the host: built as C++
// against this header (forced in with -include, the .cu files unchanged; see
// runtime.h), CUDA's words become the runtime's calls.
#pragma once

#include <cmath>

#include "simt/runtime.h"


// ----------------------------------------------------------- CUDA's words
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__

#define threadIdx (::simt::thread_idx())
#define blockIdx (::simt::block_idx())
#define blockDim (::simt::block_dim())
#define gridDim (::simt::grid_dim())

#define SIMT_SITE (::simt::Site{__FILE__, __LINE__, __COUNTER__})
#define __shfl_sync(mask, v, src) ::simt::shfl_sync(SIMT_SITE, (mask), (v), (src))
#define __shfl_xor_sync(mask, v, m) ::simt::shfl_xor_sync(SIMT_SITE, (mask), (v), (m))
#define __ballot_sync(mask, p) ::simt::ballot_sync(SIMT_SITE, (mask), (p))
#define __any_sync(mask, p) ::simt::any_sync(SIMT_SITE, (mask), (p))
#define __syncwarp(...) ::simt::syncwarp(SIMT_SITE __VA_OPT__(, ) __VA_ARGS__)

// 16-byte aligned as CUDA's: a misaligned uint4 access is a fault on the device
// and, under the runtime's UBSan, here.
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};

using dim3 = simt::Dim3;

// 1 + the index of the lowest set bit, 0 for none.
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }

// Per byte: 0xFF where the bytes of a and b are equal, else 0.
inline unsigned __vcmpeq4(unsigned a, unsigned b) {
  unsigned out = 0;
  for (int i = 0; i < 4; ++i) {
    if (((a >> (8 * i)) & 0xFFu) == ((b >> (8 * i)) & 0xFFu)) out |= 0xFFu << (8 * i);
  }
  return out;
}

// CUDA's integer min/max: both operands of one type.
template <class T>
inline T min(T a, T b) {
  return b < a ? b : a;
}
template <class T>
inline T max(T a, T b) {
  return a < b ? b : a;
}

template <class T>
inline T atomicAdd(T* p, T v) {
  return simt::atomic_update(p, [v](T old) { return static_cast<T>(old + v); });
}
template <class T>
inline T atomicOr(T* p, T v) {
  return simt::atomic_update(p, [v](T old) { return static_cast<T>(old | v); });
}
template <class T>
inline T atomicAnd(T* p, T v) {
  return simt::atomic_update(p, [v](T old) { return static_cast<T>(old & v); });
}
template <class T>
inline T atomicMin(T* p, T v) {
  return simt::atomic_update(p, [v](T old) { return v < old ? v : old; });
}
template <class T>
inline T atomicMax(T* p, T v) {
  return simt::atomic_update(p, [v](T old) { return old < v ? v : old; });
}
template <class T>
inline T atomicCAS(T* p, T compare, T v) {
  return simt::atomic_update(p, [compare, v](T old) { return old == compare ? v : old; });
}
