// Scalar arithmetic of route_experts, shared by the CPU code (scalar reference and SIMD paths
// check against it) and the CUDA kernels (__host__ __device__).
//
// These functions fix the order of every floating-point operation so that results equal those of
// PyTorch's CPU kernels bit for bit (the reference transformers' routers run on):
//  - exp_ref: the Sleef u10 single-precision exp that PyTorch's Vectorized<float>::exp uses
//    (Cody-Waite reduction by ln 2, degree-6 polynomial with FMA, scaling by two powers of two);
//  - softmax_ref: aten's _vec_softmax_lastdim: max, exp(x - max), a vector-lane sum (W lanes,
//    lane l accumulates x[l], x[l+W], ...; then the lanes pairwise as a shuffle tree; a row shorter
//    than W is summed sequentially), r = 1 / sum, y = e * r;
//  - short_sum_ref: aten's sum over a short contiguous last dim (the AVX2 sum kernel: 4-way ILP
//    below 8 elements, 8-lane vector partials from 8 on);
//  - sigmoid_ref: 1 / (1 + exp_ref(-x)).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "moespec/detail/host_device.h"

namespace moespec {
namespace detail {

MOESPEC_HD uint32_t float_bits(float x) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
#endif
}

MOESPEC_HD float bits_float(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
#endif
}

MOESPEC_HD float bf16_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

// Round to nearest even, as torch's BFloat16(float) (NaN kept quiet).
// (Branch-free, so that loops over it vectorise.)
MOESPEC_HD uint16_t float_to_bf16(float x) {
  const uint32_t u = float_bits(x);
  const uint32_t quiet_nan = (u >> 16) | 0x40u;
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

MOESPEC_HD float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (mant << 13));
  if (exp == 0) {
    if (mant == 0) return bits_float(sign);
    // subnormal: value = mant * 2^-24
    float v = static_cast<float>(mant) * 5.9604644775390625e-08f;
    return sign ? -v : v;
  }
  return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

// Round to nearest even float -> IEEE half.
MOESPEC_HD uint16_t float_to_half(float x) {
  const uint32_t u = float_bits(x);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (abs < 0x38800000u) {  // subnormal half (or zero): scale into integer units of 2^-24
    const float a = bits_float(abs) * 16777216.0f;  // exact: power-of-two scaling
    const float r = rintf(a);                       // round half to even
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(r));
  }
  uint32_t m = abs + 0xfffu + ((abs >> 13) & 1u);
  return static_cast<uint16_t>(sign | ((m - 0x38000000u) >> 13));
}

// 2^q for q in [-126, 127] as a float, built from its bits.
MOESPEC_HD float pow2i(int32_t q) { return bits_float(static_cast<uint32_t>(q + 0x7f) << 23); }

// Sleef's expf (u10), as PyTorch's vectorized exp computes it.
MOESPEC_HD float exp_ref(float d) {
  if (d < -104.0f) return 0.0f;
  if (d > 100.0f) return INFINITY;
  const float kLog2e = 1.442695040888963407359924681001892137426645954152985934135449406931f;
  const float kLn2Hi = 0.693145751953125f;
  const float kLn2Lo = 1.428606765330187045e-06f;
  const float qf = rintf(d * kLog2e);
  const int32_t q = static_cast<int32_t>(qf);
  float s = fmaf(qf, -kLn2Hi, d);
  s = fmaf(qf, -kLn2Lo, s);
  float u = 0.000198527617612853646278381f;
  u = fmaf(u, s, 0.00139304355252534151077271f);
  u = fmaf(u, s, 0.00833336077630519866943359f);
  u = fmaf(u, s, 0.0416664853692054748535156f);
  u = fmaf(u, s, 0.166666671633720397949219f);
  u = fmaf(u, s, 0.5f);
  u = 1.0f + fmaf(s * s, u, s);
  const int32_t h = q >> 1;
  return u * pow2i(h) * pow2i(q - h);
}

MOESPEC_HD float sigmoid_ref(float x) { return 1.0f / (1.0f + exp_ref(-x)); }

// a + b rounded on its own: never contracted with a multiply that produced a or b (on the device an
// fma would round exp_ref's scaling once instead of twice where it is subnormal).
MOESPEC_HD float add_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

// Sum of n >= W values with W lanes: lane l accumulates x[l], x[l + W], ... in order, then the lanes
// pairwise as a tree. Every index is a constant once the loops are unrolled, so on the device the
// lanes stay in registers.
template <int W>
MOESPEC_HD float lane_tree_sum_w(const float* x, int n) {
  float lanes[W];
  for (int l = 0; l < W; ++l) lanes[l] = x[l];
  for (int i = W; i < n; i += W)
    for (int l = 0; l < W; ++l)
      if (i + l < n) lanes[l] = add_rn(lanes[l], x[i + l]);
  for (int half = W / 2; half >= 1; half /= 2)
    for (int l = 0; l < half; ++l) lanes[l] = add_rn(lanes[l], lanes[l + half]);
  return lanes[0];
}

// Sum of n >= 1 values in PyTorch's vector-reduction order with `width` lanes (8 or 16).
MOESPEC_HD float lane_tree_sum(const float* x, int n, int width) {
  if (n < width) {
    float acc = x[0];
    for (int i = 1; i < n; ++i) acc = add_rn(acc, x[i]);
    return acc;
  }
  return width == 16 ? lane_tree_sum_w<16>(x, n) : lane_tree_sum_w<8>(x, n);
}

// y = softmax(x) over n >= 1 finite-or--inf values (at least one finite), torch's order.
MOESPEC_HD void softmax_ref(const float* x, float* y, int n, int width) {
  float m = x[0];
  for (int i = 1; i < n; ++i) m = x[i] > m ? x[i] : m;
  for (int i = 0; i < n; ++i) y[i] = exp_ref(x[i] - m);
  const float r = 1.0f / lane_tree_sum(y, n, width);
  for (int i = 0; i < n; ++i) y[i] *= r;
}

// Sum of a short row of k values as aten's CPU sum kernel does it over a contiguous last dim.
MOESPEC_HD float short_sum_ref(const float* v, int k) {
  if (k < 8) {  // scalar row_sum: 4 ILP partials, tail onto partial 0
    float p[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const int rows = k / 4;
    for (int r = 0; r < rows; ++r)
      for (int j = 0; j < 4; ++j) p[j] += v[r * 4 + j];
    for (int i = rows * 4; i < k; ++i) p[0] += v[i];
    return ((p[0] + p[1]) + p[2]) + p[3];
  }
  // vectorized_inner_sum with 8-float vectors: the vectors are summed lane-wise with 4 ILP
  // partial vectors, the scalar tail first, then the lanes one by one.
  const int nvec = k / 8;
  float acc[4][8] = {};
  const int rows = nvec / 4;
  for (int r = 0; r < rows; ++r)
    for (int j = 0; j < 4; ++j)
      for (int l = 0; l < 8; ++l) acc[j][l] += v[(r * 4 + j) * 8 + l];
  for (int i = rows * 4; i < nvec; ++i)
    for (int l = 0; l < 8; ++l) acc[0][l] += v[i * 8 + l];
  for (int j = 1; j < 4; ++j)
    for (int l = 0; l < 8; ++l) acc[0][l] += acc[j][l];
  float total = 0.0f;
  for (int i = nvec * 8; i < k; ++i) total += v[i];
  for (int l = 0; l < 8; ++l) total += acc[0][l];
  return total;
}

}  // namespace detail
}  // namespace moespec
