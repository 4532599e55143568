// Argument checks of the CPU verbs, and the readers of the padded step's shared
// arguments (the error word, a BatchPart), written once for every .cpp of csrc/cpu.
#pragma once

#include "cpu/aten.h"
#include "cpu/dedup.h"

namespace dynamicemb {
namespace cpu {

// A tensor a kernel reads as raw memory: on the CPU, of dtype `dtype`, contiguous.
// Raises (c10::Error, a RuntimeError in Python) naming the argument otherwise.
inline void check_tensor(const at::Tensor& t, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == dtype, name, " has dtype ", t.scalar_type(),
              ", expected ", dtype);
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// Whether the module's error word (None, or (1,) int64) refuses the batch: on the
// CPU the word is read where the CUDA kernels test it.
inline bool is_refused(const c10::optional<at::Tensor>& error) {
  if (!error.has_value()) return false;
  check_tensor(*error, at::kLong, "error");
  TORCH_CHECK(error->numel() == 1, "the error word is one int64");
  return error->data_ptr<int64_t>()[0] != 0;
}

// The lookups of a batch of n keys a padded call takes: a BatchPart's groups ((n,)
// int64, None: every lookup) and group.
inline BatchPart batch_part(const c10::optional<at::Tensor>& groups, int64_t group, int64_t n) {
  if (!groups.has_value()) return BatchPart{};
  check_tensor(*groups, at::kLong, "part.groups");
  TORCH_CHECK(groups->numel() == n, "part.groups needs one group per key (", n, "), got ",
              groups->numel());
  return BatchPart{groups->data_ptr<int64_t>(), group};
}

}  // namespace cpu
}  // namespace dynamicemb
