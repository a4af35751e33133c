// AVX-512 path of route_experts' probability maps (semantics: detail/route_math.h).
// Compiled with -mavx512f -mavx512dq -mavx512bw -mavx512vl -mfma; only called after runtime
// dispatch has checked the CPU and OS (cpu_isa.cc).
#include <immintrin.h>

#include "moespec/detail/route_math.h"
#include "route_experts_simd.h"

namespace moespec {
namespace cpu {
namespace avx512 {
namespace {

inline __m512 pow2i(__m512i q) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(q, _mm512_set1_epi32(0x7f)), 23));
}

// detail::exp_ref on 16 lanes.
inline __m512 exp16(__m512 d) {
  const __m512 qf = _mm512_roundscale_ps(_mm512_mul_ps(d, _mm512_set1_ps(1.442695040888963407359924681001892137426645954152985934135449406931f)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512i q = _mm512_cvtps_epi32(qf);
  __m512 s = _mm512_fmadd_ps(qf, _mm512_set1_ps(-0.693145751953125f), d);
  s = _mm512_fmadd_ps(qf, _mm512_set1_ps(-1.428606765330187045e-06f), s);
  __m512 u = _mm512_set1_ps(0.000198527617612853646278381f);
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.00139304355252534151077271f));
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.00833336077630519866943359f));
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.0416664853692054748535156f));
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.166666671633720397949219f));
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.5f));
  u = _mm512_add_ps(_mm512_set1_ps(1.0f), _mm512_fmadd_ps(_mm512_mul_ps(s, s), u, s));
  const __m512i h = _mm512_srai_epi32(q, 1);
  u = _mm512_mul_ps(_mm512_mul_ps(u, pow2i(h)), pow2i(_mm512_sub_epi32(q, h)));
  const __mmask16 under = _mm512_cmp_ps_mask(d, _mm512_set1_ps(-104.0f), _CMP_LT_OQ);
  const __mmask16 over = _mm512_cmp_ps_mask(d, _mm512_set1_ps(100.0f), _CMP_GT_OQ);
  u = _mm512_mask_mov_ps(u, under, _mm512_setzero_ps());
  return _mm512_mask_mov_ps(u, over, _mm512_set1_ps(INFINITY));
}

inline __mmask16 tail_mask(int64_t r) { return static_cast<__mmask16>((1u << r) - 1u); }

void softmax_rows(const float* x, int64_t ld_x, float* y, int64_t ld_y, int64_t rows, int64_t n, int width) {
  const int64_t full = n - n % 16;
  const __mmask16 tm = tail_mask(n - full);
  for (int64_t t = 0; t < rows; ++t) {
    const float* xr = x + t * ld_x;
    float* yr = y + t * ld_y;
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    for (int64_t i = 0; i < full; i += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(xr + i));
    if (tm) vmax = _mm512_mask_max_ps(vmax, tm, vmax, _mm512_maskz_loadu_ps(tm, xr + full));
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
    for (int64_t i = 0; i < full; i += 16) _mm512_storeu_ps(yr + i, exp16(_mm512_sub_ps(_mm512_loadu_ps(xr + i), m)));
    if (tm) _mm512_mask_storeu_ps(yr + full, tm, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tm, xr + full), m)));
    float sum;
    if (n < width) {
      sum = yr[0];
      for (int64_t i = 1; i < n; ++i) sum += yr[i];
    } else if (width == 16) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t i = 0; i < full; i += 16) acc = _mm512_add_ps(acc, _mm512_loadu_ps(yr + i));
      if (tm) acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps(tm, yr + full));
      alignas(64) float lanes[16];
      _mm512_store_ps(lanes, acc);
      for (int half = 8; half >= 1; half /= 2)
        for (int l = 0; l < half; ++l) lanes[l] += lanes[l + half];
      sum = lanes[0];
    } else {  // width 8
      const int64_t full8 = n - n % 8;
      __m256 acc = _mm256_setzero_ps();
      for (int64_t i = 0; i < full8; i += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(yr + i));
      if (n > full8)
        acc = _mm256_add_ps(acc, _mm256_maskz_loadu_ps(static_cast<__mmask8>((1u << (n - full8)) - 1u), yr + full8));
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, acc);
      for (int half = 4; half >= 1; half /= 2)
        for (int l = 0; l < half; ++l) lanes[l] += lanes[l + half];
      sum = lanes[0];
    }
    const __m512 r = _mm512_set1_ps(1.0f / sum);
    for (int64_t i = 0; i < full; i += 16) _mm512_storeu_ps(yr + i, _mm512_mul_ps(_mm512_loadu_ps(yr + i), r));
    if (tm) _mm512_mask_storeu_ps(yr + full, tm, _mm512_mul_ps(_mm512_maskz_loadu_ps(tm, yr + full), r));
  }
}

void sigmoid(const float* x, float* y, int64_t count) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const int64_t full = count - count % 16;
  for (int64_t i = 0; i < full; i += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_loadu_ps(x + i)));
    _mm512_storeu_ps(y + i, _mm512_div_ps(one, _mm512_add_ps(one, e)));
  }
  if (count > full) {
    const __mmask16 tm = tail_mask(count - full);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_maskz_loadu_ps(tm, x + full)));
    _mm512_mask_storeu_ps(y + full, tm, _mm512_div_ps(one, _mm512_add_ps(one, e)));
  }
}

}  // namespace

const RouteMathKernels kRouteMath = {softmax_rows, sigmoid};

}  // namespace avx512
}  // namespace cpu
}  // namespace moespec
