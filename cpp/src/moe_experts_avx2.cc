// AVX2 path of moe_experts' product (contract: moe_experts_simd.h; reference: the scalar table in
// moe_experts.cc). Compiled with -mavx2 -mfma -mf16c; only called after runtime dispatch has
// checked the CPU and OS (cpu_isa.cc). bf16 weights are converted exactly to fp32 by a shift;
// activations are fp32.
//
// Blocking and loop orders as in moe_experts_avx512.cc (see there), with 8-lane vectors and
// kR = 4 rows per block (16 registers). Each element follows one canonical order (see Tile),
// whatever its block, so the results depend neither on the blocking nor on the tokens that share
// an expert.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "moe_experts_simd.h"

namespace moespec {
namespace cpu {
namespace avx2 {
namespace {

constexpr int kR = 4;   // weight rows per block
constexpr int kTN = 3;  // activation rows per block: kR x kTN = 12 accumulators (+ 3 activations, 1 weight)
constexpr int kDecodeRows = 8;  // one token: 8 accumulator chains (the FMA latency hides more loads in flight)
constexpr int64_t kRowsOuterMaxTokens = kMoeRowsOuterMaxTokens;  // (moe_experts_simd.h)

// The lane sums of four vectors, [sum(a), sum(b), sum(c), sum(d)], stored to out[0..3]. Each sum
// is a fixed tree over its own vector's lanes: ((v0 + v2) + (v1 + v3)) within each 128-bit half,
// then low half + high half.
inline void hsum4(__m256 a, __m256 b, __m256 c, __m256 d, float* out) {
  const __m256 ab = _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
  const __m256 cd = _mm256_add_ps(_mm256_unpacklo_ps(c, d), _mm256_unpackhi_ps(c, d));
  const __m256 v = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)));
}

// c[n * ldc + r] = the lane sum of v[n * R + r], for R x TN vectors, four at a time.
template <int R, int TN>
inline void store_sums(const __m256* v, float* c, int64_t ldc) {
  constexpr int kCount = R * TN;
  float sums[(kCount + 3) / 4 * 4];
  for (int i = 0; i < kCount; i += 4) {
    const __m256 zero = _mm256_setzero_ps();
    hsum4(v[i], i + 1 < kCount ? v[i + 1] : zero, i + 2 < kCount ? v[i + 2] : zero,
          i + 3 < kCount ? v[i + 3] : zero, sums + i);
  }
  for (int n = 0; n < TN; ++n)
    for (int r = 0; r < R; ++r) c[n * ldc + r] = sums[n * R + r];
}

// Weight rows of type W (fp32, or bf16 converted exactly to fp32 by a shift); activations fp32.
template <typename WT>
struct Ops8 {
  using W = WT;
  using A = float;
  static constexpr int64_t kStep = 8;
  static __m256 load_w(const float* p) { return _mm256_loadu_ps(p); }
  static __m256 load_w(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  // The first n < 8 elements, zero-extended (no read past them).
  static __m256 load_w_tail(const W* p, int64_t n) {
    W tmp[8] = {};
    std::memcpy(tmp, p, static_cast<std::size_t>(n) * sizeof(W));
    return load_w(tmp);
  }
  static __m256 load_a(const float* p) { return _mm256_load_ps(p); }
};

// bf16 weight rows, 16 elements a step: one 256-bit load, widened exactly into the even elements
// (a shift) and the odd ones (an AND: a bf16 is the high half of its fp32), to be multiplied with
// activations staged even-odd (kMoeExperts.bf16_act_even_odd, staged_position).
struct OpsBf16Pairs {
  using W = uint16_t;
  using A = float;
  static constexpr int64_t kStep = 16;
  static void load_w2(const uint16_t* p, __m256& even, __m256& odd) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  // The first n < 16 elements, zero-extended (no read past them).
  static void load_w2_tail(const uint16_t* p, int64_t n, __m256& even, __m256& odd) {
    uint16_t tmp[16] = {};
    std::memcpy(tmp, p, static_cast<std::size_t>(n) * sizeof(uint16_t));
    load_w2(tmp, even, odd);
  }
  static __m256 load_a(const float* p) { return _mm256_load_ps(p); }
};

// A tile computes c[n * ldc + r] for R weight rows w[r] and TN activation rows x[n] over K.
// Canonical order of one element: K is cut into chunks of 8 (the last one zero-extended), all
// multiplied into one accumulator in chunk order; the result is its lane sum (hsum4). Per chunk a
// tile converts its R weight vectors once and loads its TN activation vectors once (R x TN FMAs on
// registers: with R = 4, TN = 3, 12 FMAs per 7 loads, so the FMA ports, not the loads, set the pace).
template <class Ops>
struct Tile {
  using W = typename Ops::W;
  using A = typename Ops::A;
  // kPrefetch: also prefetch pf[0 .. R * K) into L2 meanwhile (the caller's next block of weight
  // rows, contiguous), R * 2 chunks per step.
  template <int R, int TN, bool kPrefetch = false>
  static void run(const W* const* w, const A* const* x, int64_t K, float* c, int64_t ldc, const W* pf = nullptr) {
    constexpr int64_t kStep = Ops::kStep;
    __m256 acc[R][TN];
    for (int r = 0; r < R; ++r)
      for (int n = 0; n < TN; ++n) acc[r][n] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 2 * kStep <= K; k += 2 * kStep) {
      if (kPrefetch) {
        for (int64_t b = 0; b < R * 2 * kStep * static_cast<int64_t>(sizeof(W)); b += 64)
          _mm_prefetch(reinterpret_cast<const char*>(pf + R * k) + b, _MM_HINT_T1);
      }
      step<R, TN>(acc, w, x, k, kStep);
      step<R, TN>(acc, w, x, k + kStep, kStep);
    }
    for (; k < K; k += kStep) step<R, TN>(acc, w, x, k, std::min<int64_t>(kStep, K - k));
    __m256 sum[R * TN];
    for (int n = 0; n < TN; ++n)
      for (int r = 0; r < R; ++r) sum[n * R + r] = acc[r][n];
    store_sums<R, TN>(sum, c, ldc);
  }

 private:
  // One chunk of `valid` elements at k (a full one, or the zero-extended last one; activations are
  // zero-padded).
  template <int R, int TN>
  static inline void step(__m256 (&acc)[R][TN], const W* const* w, const A* const* x, int64_t k, int64_t valid) {
    if constexpr (Ops::kStep == 16) {  // even-odd pairs: the even half first, then the odd half
      for (int r = 0; r < R; ++r) {
        __m256 we, wo;
        if (valid == Ops::kStep) Ops::load_w2(w[r] + k, we, wo);
        else Ops::load_w2_tail(w[r] + k, valid, we, wo);
        for (int n = 0; n < TN; ++n) acc[r][n] = _mm256_fmadd_ps(we, Ops::load_a(x[n] + k), acc[r][n]);
        for (int n = 0; n < TN; ++n) acc[r][n] = _mm256_fmadd_ps(wo, Ops::load_a(x[n] + k + 8), acc[r][n]);
      }
    } else {
      __m256 a[TN];
      for (int n = 0; n < TN; ++n) a[n] = Ops::load_a(x[n] + k);
      for (int r = 0; r < R; ++r) {
        const __m256 wr = valid == Ops::kStep ? Ops::load_w(w[r] + k) : Ops::load_w_tail(w[r] + k, valid);
        for (int n = 0; n < TN; ++n) acc[r][n] = _mm256_fmadd_ps(wr, a[n], acc[r][n]);
      }
    }
  }
};

#include "moe_experts_schedule.inc"  // run_tile_tn, matmul_nt: the ISA-independent schedule

// accumulate_nn (moe_experts_simd.h): blocks of 4 vectors (32 columns) x 2 activation rows, s
// ascending, one FMA per s and element; a column tail of < 8 goes through a zero-extended load
// and a partial store.
template <typename WT>
void accumulate_nn(const void* w, int64_t ldw, int64_t S, int64_t N, const float* a, int64_t lda, int64_t n_tok,
                   float* c, int64_t ldc) {
  using O = Ops8<WT>;
  const WT* wp = static_cast<const WT*>(w);
  for (int64_t j0 = 0; j0 < N; j0 += 32) {
    const int64_t cols = std::min<int64_t>(32, N - j0);
    const int nv = static_cast<int>((cols + 7) / 8);
    for (int64_t n0 = 0; n0 < n_tok; n0 += 2) {
      const int tn = n_tok - n0 >= 2 ? 2 : 1;
      __m256 acc[2][4];
      for (int n = 0; n < tn; ++n)
        for (int v = 0; v < nv; ++v) {
          const int64_t left = cols - v * 8;
          float* cp = c + (n0 + n) * ldc + j0 + v * 8;
          if (left >= 8) {
            acc[n][v] = _mm256_loadu_ps(cp);
          } else {
            float tmp[8] = {};
            std::memcpy(tmp, cp, static_cast<std::size_t>(left) * 4);
            acc[n][v] = _mm256_loadu_ps(tmp);
          }
        }
      for (int64_t s = 0; s < S; ++s) {
        const WT* ws = wp + s * ldw + j0;
        __m256 wv[4];
        for (int v = 0; v < nv; ++v) {
          const int64_t left = cols - v * 8;
          wv[v] = left >= 8 ? O::load_w(ws + v * 8) : O::load_w_tail(ws + v * 8, left);
        }
        for (int n = 0; n < tn; ++n) {
          const __m256 av = _mm256_set1_ps(a[(n0 + n) * lda + s]);
          for (int v = 0; v < nv; ++v) acc[n][v] = _mm256_fmadd_ps(av, wv[v], acc[n][v]);
        }
      }
      for (int n = 0; n < tn; ++n)
        for (int v = 0; v < nv; ++v) {
          const int64_t left = cols - v * 8;
          float* cp = c + (n0 + n) * ldc + j0 + v * 8;
          if (left >= 8) {
            _mm256_storeu_ps(cp, acc[n][v]);
          } else {
            float tmp[8];
            _mm256_storeu_ps(tmp, acc[n][v]);
            std::memcpy(cp, tmp, static_cast<std::size_t>(left) * 4);
          }
        }
    }
  }
}

// exp of 8 lanes (Cephes' expf: n = round(x log2 e), r = x - n ln 2 in two parts, a degree-6
// polynomial, times 2^n), within 2 ulp of expf over [-87, 88]; inputs are clamped to that range.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

}  // namespace

float exp_sum(float* x, int64_t n, float shift) {
  const __m256 s = _mm256_set1_ps(shift), neg_inf = _mm256_set1_ps(-__builtin_inff());
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    _mm256_storeu_ps(x + i, _mm256_andnot_ps(_mm256_cmp_ps(v, neg_inf, _CMP_EQ_OQ), exp8(_mm256_sub_ps(v, s))));
  }
  if (i < n) {
    float tmp[8];
    for (int j = 0; j < 8; ++j) tmp[j] = i + j < n ? x[i + j] : -__builtin_inff();
    const __m256 v = _mm256_loadu_ps(tmp);
    _mm256_storeu_ps(tmp, _mm256_andnot_ps(_mm256_cmp_ps(v, neg_inf, _CMP_EQ_OQ), exp8(_mm256_sub_ps(v, s))));
    for (int64_t j = 0; i + j < n; ++j) x[i + j] = tmp[j];
  }
  // NonzeroSum's order with the lanes in one vector: a block of 8 nonzero terms adds to them at
  // once (rotated by the count so far: lane l takes the block's term (l - count) % 8), a block with
  // a zero term by term into lane count % 8 (the other lanes add +0: unchanged).
  const __m256 zero = _mm256_setzero_ps();
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), seven = _mm256_set1_epi32(7);
  __m256 lanes = zero;
  int64_t count = 0;
  auto one = [&](float v) {
    const __m256i lane = _mm256_set1_epi32(static_cast<int>(count & 7));
    const __m256 at = _mm256_castsi256_ps(_mm256_cmpeq_epi32(iota, lane));
    lanes = _mm256_add_ps(lanes, _mm256_and_ps(_mm256_set1_ps(v), at));
    count += v != 0.0f;
  };
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 v = _mm256_loadu_ps(x + j);
    if (_mm256_movemask_ps(_mm256_cmp_ps(v, zero, _CMP_EQ_OQ)) == 0) {
      const __m256i shift_by = _mm256_set1_epi32(static_cast<int>(count & 7));
      const __m256i from = _mm256_and_si256(_mm256_sub_epi32(iota, shift_by), seven);
      lanes = _mm256_add_ps(lanes, _mm256_permutevar8x32_ps(v, from));
      count += 8;
    } else {
      for (int64_t t = 0; t < 8; ++t) one(x[j + t]);
    }
  }
  for (; j < n; ++j) one(x[j]);
  NonzeroSum sum;
  _mm256_storeu_ps(sum.lane, lanes);
  return sum.total();
}

void activate(ExpertActivation activation, float limit, float alpha, const float* g, const float* u, int64_t n,
              float* h) {
  const __m256 one = _mm256_set1_ps(1.0f), hi = _mm256_set1_ps(limit), lo = _mm256_set1_ps(-limit);
  const __m256 neg_alpha = _mm256_set1_ps(-alpha), zero = _mm256_setzero_ps();
  const bool swiglu = activation == ExpertActivation::kSwiGLU;
  auto eight = [&](__m256 gv, __m256 uv) {
    if (swiglu) return _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, gv)))), uv);
    gv = _mm256_min_ps(gv, hi);
    uv = _mm256_min_ps(_mm256_max_ps(uv, lo), hi);
    const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_mul_ps(neg_alpha, gv))));
    return _mm256_mul_ps(_mm256_mul_ps(_mm256_add_ps(uv, one), gv), sig);
  };
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(h + j, eight(_mm256_loadu_ps(g + j), _mm256_loadu_ps(u + j)));
  if (j < n) {
    float gt[8] = {}, ut[8] = {}, ht[8];
    std::memcpy(gt, g + j, static_cast<std::size_t>(n - j) * 4);
    std::memcpy(ut, u + j, static_cast<std::size_t>(n - j) * 4);
    _mm256_storeu_ps(ht, eight(_mm256_loadu_ps(gt), _mm256_loadu_ps(ut)));
    std::memcpy(h + j, ht, static_cast<std::size_t>(n - j) * 4);
  }
}

const MoeExpertKernels kMoeExperts = {matmul_nt<Ops8<float>>, matmul_nt<OpsBf16Pairs>, accumulate_nn<float>,
                                      accumulate_nn<uint16_t>, exp_sum, activate, DType::kFloat32, "avx2", true};

}  // namespace avx2
}  // namespace cpu
}  // namespace moespec
