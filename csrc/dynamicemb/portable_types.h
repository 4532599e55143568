// Fixed-width integer types and float math for the shared headers, under every
// compiler that includes them: the host C++ compiler, nvcc, and NVRTC (CuPy's
// run-time compiler), which has no C++ standard library headers.
#pragma once

#if defined(__CUDACC_RTC__)
typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef short int16_t;
typedef unsigned short uint16_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;
#define INT64_MAX 0x7FFFFFFFFFFFFFFFll
#else
#include <cmath>
#include <cstdint>
#endif
