// What moespec's CUDA kernels share: warp constants, fp32 / bf16 element conversions and the warp
// sum (moe_experts.cu, decoder_ops.cu).
#pragma once

#include <cuda_bf16.h>

namespace moespec {
namespace cuda {
namespace device {

constexpr int kWarp = 32;
constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename W>
__device__ __forceinline__ W from_f(float v);
template <>
__device__ __forceinline__ float from_f<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

}  // namespace device
}  // namespace cuda
}  // namespace moespec
