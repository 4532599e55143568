// The part of ATen the CPU kernels use: tensors, the few factory functions, checks.
// Including this instead of <torch/extension.h> (all of libtorch's C++ API and
// pybind11) cuts each kernel file's compile time by about four; only bindings.cpp
// needs pybind11, through <torch/python.h>.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>
