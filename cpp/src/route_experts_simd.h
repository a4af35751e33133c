// The SIMD part of route_experts: the per-row probability maps, one table per ISA.
//
// route_experts.cc defines the scalar table (the reference, built on detail/route_math.h);
// route_experts_avx2.cc and route_experts_avx512.cc define the same functions with intrinsics,
// compiled with their own flags. All three give bit-identical results (tests/cpp check it).
#pragma once

#include <cstdint>

#include "moespec/cpu_isa.h"

namespace moespec {
namespace cpu {

struct RouteMathKernels {
  // y[t, :] = softmax(x[t, :]) for t < rows, rows of n floats with row stride ld_x / ld_y,
  // in PyTorch's order with a `width`-lane reduction tree (detail::softmax_ref).
  void (*softmax_rows)(const float* x, int64_t ld_x, float* y, int64_t ld_y, int64_t rows, int64_t n,
                       int width);
  // y[i] = 1 / (1 + exp(-x[i])) for i < count (detail::sigmoid_ref).
  void (*sigmoid)(const float* x, float* y, int64_t count);
};

const RouteMathKernels& route_math_kernels(CpuIsa isa);

namespace scalar {
extern const RouteMathKernels kRouteMath;
}
#if defined(MOESPEC_HAVE_AVX2)
namespace avx2 {
extern const RouteMathKernels kRouteMath;
}
#endif
#if defined(MOESPEC_HAVE_AVX512)
namespace avx512 {
extern const RouteMathKernels kRouteMath;
}
#endif

}  // namespace cpu
}  // namespace moespec
