// Argument checks of the CPU verbs, written once for every .cpp of csrc/cpu.
#pragma once

#include "cpu/aten.h"

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

}  // namespace cpu
}  // namespace dynamicemb
