// CUDA's bfloat16 types on the block emulator (cuda_runtime.h beside it): the bits and the rounding
// of cuda_bf16.h (round to nearest even; a NaN becomes 0x7fff).
#pragma once

#include <cstdint>
#include <cstring>

#include "cuda_runtime.h"

struct __nv_bfloat16 {
  uint16_t __x = 0;
  __nv_bfloat16() = default;
  __nv_bfloat16(float f);  // NOLINT: implicit, as CUDA's
  operator float() const;  // NOLINT
};
struct __nv_bfloat162 {
  __nv_bfloat16 x, y;
};

inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  __nv_bfloat16 h;
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    h.__x = 0x7fff;
  } else {
    h.__x = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  return h;
}
inline float __bfloat162float(__nv_bfloat16 h) {
  const uint32_t u = static_cast<uint32_t>(h.__x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline __nv_bfloat16::__nv_bfloat16(float f) : __x(__float2bfloat16_rn(f).__x) {}
inline __nv_bfloat16::operator float() const { return __bfloat162float(*this); }
inline float2 __bfloat1622float2(__nv_bfloat162 v) { return float2{__bfloat162float(v.x), __bfloat162float(v.y)}; }
inline __nv_bfloat162 __float22bfloat162_rn(float2 v) { return {__float2bfloat16_rn(v.x), __float2bfloat16_rn(v.y)}; }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return {__float2bfloat16_rn(a), __float2bfloat16_rn(b)}; }
