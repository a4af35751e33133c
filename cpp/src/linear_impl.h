// The staged form of linear (cpp/include/moespec/linear.h), shared by the linear op and the
// native decoder step (decoder_step.cc), which stage an activation once for several projections.
#pragma once

#include <cstdint>

#include "moe_experts_simd.h"
#include "moespec/tensor_view.h"

namespace moespec {
namespace cpu {

// y[t * ldy + n] = sum_k act[t, k] w[n, k] (+ bias[n]), fp32, for t < T, n < N. act: T rows
// staged by stage_activations for weights of dtype w_dtype (row stride round_up(K, kMoeActPad)).
// bias: [N] in bias_dtype (float32 or w_dtype) or null. Row tiles run on the thread pool (inline
// when the product is small).
void linear_staged(const MoeExpertKernels& kernels, DType w_dtype, const void* w, int64_t N, int64_t K,
                   const void* bias, DType bias_dtype, const void* act, int64_t T, float* y, int64_t ldy);

}  // namespace cpu
}  // namespace moespec
