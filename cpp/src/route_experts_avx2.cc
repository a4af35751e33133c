// AVX2/FMA path of route_experts' probability maps (semantics: detail/route_math.h).
// Compiled with -mavx2 -mfma -mf16c; only called after runtime dispatch has checked the CPU.
// A 16-lane reduction tree is emulated with two 8-lane accumulators (lanes 0-7 and 8-15).
#include <immintrin.h>

#include "moespec/detail/route_math.h"
#include "route_experts_simd.h"

namespace moespec {
namespace cpu {
namespace avx2 {
namespace {

inline __m256 pow2i(__m256i q) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(q, _mm256_set1_epi32(0x7f)), 23));
}

// detail::exp_ref on 8 lanes.
inline __m256 exp8(__m256 d) {
  const __m256 qf = _mm256_round_ps(_mm256_mul_ps(d, _mm256_set1_ps(1.442695040888963407359924681001892137426645954152985934135449406931f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256i q = _mm256_cvtps_epi32(qf);
  __m256 s = _mm256_fmadd_ps(qf, _mm256_set1_ps(-0.693145751953125f), d);
  s = _mm256_fmadd_ps(qf, _mm256_set1_ps(-1.428606765330187045e-06f), s);
  __m256 u = _mm256_set1_ps(0.000198527617612853646278381f);
  u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.00139304355252534151077271f));
  u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.00833336077630519866943359f));
  u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.0416664853692054748535156f));
  u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.166666671633720397949219f));
  u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.5f));
  u = _mm256_add_ps(_mm256_set1_ps(1.0f), _mm256_fmadd_ps(_mm256_mul_ps(s, s), u, s));
  const __m256i h = _mm256_srai_epi32(q, 1);
  u = _mm256_mul_ps(_mm256_mul_ps(u, pow2i(h)), pow2i(_mm256_sub_epi32(q, h)));
  u = _mm256_blendv_ps(u, _mm256_setzero_ps(), _mm256_cmp_ps(d, _mm256_set1_ps(-104.0f), _CMP_LT_OQ));
  return _mm256_blendv_ps(u, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(d, _mm256_set1_ps(100.0f), _CMP_GT_OQ));
}

// Mask of the first r (< 8) lanes, for maskload/maskstore.
inline __m256i tail_mask(int64_t r) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(r)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

inline float tree(float* lanes, int width) {
  for (int half = width / 2; half >= 1; half /= 2)
    for (int l = 0; l < half; ++l) lanes[l] += lanes[l + half];
  return lanes[0];
}

void softmax_rows(const float* x, int64_t ld_x, float* y, int64_t ld_y, int64_t rows, int64_t n, int width) {
  const int64_t full = n - n % 8;
  const int64_t rem = n - full;
  const __m256i tm = tail_mask(rem);
  for (int64_t t = 0; t < rows; ++t) {
    const float* xr = x + t * ld_x;
    float* yr = y + t * ld_y;
    __m256 vmax = _mm256_set1_ps(-INFINITY);
    for (int64_t i = 0; i < full; i += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(xr + i));
    alignas(32) float lanes[16];
    _mm256_store_ps(lanes, vmax);
    float mx = lanes[0];
    for (int l = 1; l < 8; ++l) mx = lanes[l] > mx ? lanes[l] : mx;
    for (int64_t i = full; i < n; ++i) mx = xr[i] > mx ? xr[i] : mx;
    const __m256 m = _mm256_set1_ps(mx);
    for (int64_t i = 0; i < full; i += 8) _mm256_storeu_ps(yr + i, exp8(_mm256_sub_ps(_mm256_loadu_ps(xr + i), m)));
    if (rem) _mm256_maskstore_ps(yr + full, tm, exp8(_mm256_sub_ps(_mm256_maskload_ps(xr + full, tm), m)));
    float sum;
    if (n < width) {
      sum = yr[0];
      for (int64_t i = 1; i < n; ++i) sum += yr[i];
    } else {
      // Lane l of the width-lane accumulator sums y[l], y[l + width], ...; adding zeros for
      // absent tail lanes is exact (all terms are >= 0).
      __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
      int64_t i = 0;
      if (width == 16) {
        for (; i + 16 <= n; i += 16) {
          lo = _mm256_add_ps(lo, _mm256_loadu_ps(yr + i));
          hi = _mm256_add_ps(hi, _mm256_loadu_ps(yr + i + 8));
        }
        if (i + 8 <= n) {
          lo = _mm256_add_ps(lo, _mm256_loadu_ps(yr + i));
          i += 8;
          if (i < n) hi = _mm256_add_ps(hi, _mm256_maskload_ps(yr + i, tail_mask(n - i)));
        } else if (i < n) {
          lo = _mm256_add_ps(lo, _mm256_maskload_ps(yr + i, tail_mask(n - i)));
        }
      } else {
        for (; i + 8 <= n; i += 8) lo = _mm256_add_ps(lo, _mm256_loadu_ps(yr + i));
        if (i < n) lo = _mm256_add_ps(lo, _mm256_maskload_ps(yr + i, tail_mask(n - i)));
      }
      _mm256_store_ps(lanes, lo);
      _mm256_store_ps(lanes + 8, hi);
      sum = tree(lanes, width);
    }
    const __m256 r = _mm256_set1_ps(1.0f / sum);
    for (int64_t i = 0; i < full; i += 8) _mm256_storeu_ps(yr + i, _mm256_mul_ps(_mm256_loadu_ps(yr + i), r));
    if (rem) _mm256_maskstore_ps(yr + full, tm, _mm256_mul_ps(_mm256_maskload_ps(yr + full, tm), r));
  }
}

void sigmoid(const float* x, float* y, int64_t count) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const int64_t full = count - count % 8;
  for (int64_t i = 0; i < full; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_loadu_ps(x + i)));
    _mm256_storeu_ps(y + i, _mm256_div_ps(one, _mm256_add_ps(one, e)));
  }
  if (count > full) {
    const __m256i tm = tail_mask(count - full);
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_maskload_ps(x + full, tm)));
    _mm256_maskstore_ps(y + full, tm, _mm256_div_ps(one, _mm256_add_ps(one, e)));
  }
}

}  // namespace

const RouteMathKernels kRouteMath = {softmax_rows, sigmoid};

}  // namespace avx2
}  // namespace cpu
}  // namespace moespec
