// A CPU runtime for CUDA kernels, written for dynamicemb's tests: each launch
// runs every GPU thread of a block as a fiber of one OS thread, and the 32 lanes
// of a warp meet at each warp collective (runtime.cpp). Lanes run one at a time
// between collectives, in the order the launch names (forward, reverse or
// shuffled), so a result that depends on the order of lanes between two
// collectives (a missing __syncwarp) differs between orders; a collective that a
// lane of its mask never reaches, or reaches at another call site, and a shuffle
// from a lane outside the mask, fail the launch by name.
//
// The kernel files of csrc/cuda compile unchanged against cuda_host.h (which
// includes this); dynamicemb_testing/simt.py builds them, with a launch function
// per kernel that calls simt::launch, and the CUDA emulation's SIMT mode calls it.
// Nothing here is part of the package.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

namespace simt {

struct Dim3 {
  unsigned x = 1, y = 1, z = 1;
};

// The order in which lanes (and warps, and blocks) run between two collectives.
enum class Order : int { kForward = 0, kReverse = 1, kShuffled = 2 };

// One launch: its grid and block (x only: the kernels here are 1-D), dynamic
// shared bytes, the lane order and, for kShuffled, the seed of the permutations.
struct LaunchConfig {
  int64_t grid;
  int64_t block;
  int64_t shared_bytes;
  int order;
  uint64_t seed;
};

// A collective's call site: the file and line, and a number unique to the call
// (two calls on one line differ).
struct Site {
  const char* file;
  int line;
  int id;
};

enum class Kind : int { kShfl, kShflXor, kBallot, kAny, kSyncwarp };

const Dim3& thread_idx();
const Dim3& block_idx();
const Dim3& block_dim();
const Dim3& grid_dim();

// Every lane of `mask` calls these at one site; each returns what a GPU gives
// lane `threadIdx.x % 32`. value: the lane's operand (its bytes); arg: the
// source lane (shfl), the xor mask (shfl_xor), or 0.
uint64_t collective(Kind kind, Site site, unsigned mask, uint64_t value, int arg);

// A point where another lane may run (at atomics: the order of atomic operations
// of lanes is not fixed on a GPU).
void yield_point();

template <class T>
uint64_t bits_of(T v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "a 1-8 byte value");
  uint64_t out = 0;
  std::memcpy(&out, &v, sizeof(T));
  return out;
}

template <class T>
T from_bits(uint64_t b) {
  T v;
  std::memcpy(&v, &b, sizeof(T));
  return v;
}

template <class T>
T shfl_sync(Site s, unsigned mask, T v, int src) {
  return from_bits<T>(collective(Kind::kShfl, s, mask, bits_of(v), src));
}

template <class T>
T shfl_xor_sync(Site s, unsigned mask, T v, int lane_mask) {
  return from_bits<T>(collective(Kind::kShflXor, s, mask, bits_of(v), lane_mask));
}

inline unsigned ballot_sync(Site s, unsigned mask, int predicate) {
  return static_cast<unsigned>(collective(Kind::kBallot, s, mask, predicate != 0, 0));
}

inline int any_sync(Site s, unsigned mask, int predicate) {
  return collective(Kind::kAny, s, mask, predicate != 0, 0) != 0;
}

inline void syncwarp(Site s, unsigned mask = 0xFFFFFFFFu) {
  collective(Kind::kSyncwarp, s, mask, 0, 0);
}

// Atomics: lanes of one launch run on one OS thread, so the read-modify-write
// is whole; each is a point where another lane may run first.
template <class T, class F>
T atomic_update(T* p, F f) {
  yield_point();
  const T old = *p;
  *p = f(old);
  return old;
}

// Runs body(ctx) as every thread of config's grid, block by block; `shared` (of
// shared_capacity bytes) is the dynamic shared memory, filled with 0xFF (NaN
// floats) before each block. Returns 0, or 1 with what went wrong in `error`
// (a collective used as no GPU allows, a deadlock, a report of the undefined-
// behaviour sanitizer during the launch).
int run(const LaunchConfig& config, void (*body)(void*), void* ctx, void* shared,
        size_t shared_capacity, char* error, size_t error_size);

// Writes a message to error (printf format) and returns 1.
int fail(char* error, size_t error_size, const char* format, ...);

// How an argument is passed: 'u' unsigned (pointers too), 'i' signed, 'b' bool,
// 'f' floating point; with its size in bytes.
template <class T>
constexpr char kind_of() {
  return std::is_pointer<T>::value                 ? 'u'
         : std::is_same<T, bool>::value            ? 'b'
         : std::is_floating_point<T>::value        ? 'f'
         : std::is_signed<T>::value                ? 'i'
                                                   : 'u';
}

template <class... A>
struct Kernel {
  void (*fn)(A...);
  void* const* values;

  template <size_t... I>
  void invoke(std::index_sequence<I...>) const {
    fn(*static_cast<const std::decay_t<A>*>(values[I])...);
  }
  static void body(void* self) {
    static_cast<const Kernel*>(self)->invoke(std::index_sequence_for<A...>{});
  }
};

// Launches kernel `fn` (named `name`) with arguments values[i] (each pointing at
// sizes[i] bytes of kind kinds[i]: how CuPy would pack them), after checking them
// against the kernel's parameters: a missing, extra or mistyped argument fails the
// launch, where a GPU would read garbage.
template <class... A>
int launch(const char* name, void (*fn)(A...), const LaunchConfig& config,
           void* const* values, const int* sizes, const char* kinds, int count,
           void* shared, size_t shared_capacity, char* error, size_t error_size) {
  constexpr int n = sizeof...(A);
  if (count != n) {
    return fail(error, error_size, "%s takes %d arguments, was given %d", name, n, count);
  }
  const int want_sizes[] = {static_cast<int>(sizeof(std::decay_t<A>))..., 0};
  const char want_kinds[] = {kind_of<std::decay_t<A>>()..., 0};
  for (int i = 0; i < n; ++i) {
    if (sizes[i] != want_sizes[i] || kinds[i] != want_kinds[i]) {
      return fail(error, error_size,
                  "%s: argument %d is %c%d (%d bytes), the kernel takes %c%d", name, i,
                  kinds[i], 8 * sizes[i], sizes[i], want_kinds[i], 8 * want_sizes[i]);
    }
  }
  const Kernel<A...> kernel{fn, values};
  return run(config, &Kernel<A...>::body, const_cast<Kernel<A...>*>(&kernel), shared,
             shared_capacity, error, error_size);
}

}  // namespace simt
