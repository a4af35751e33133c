// AVX-512 path of moe_experts' product (contract: moe_experts_simd.h; reference: the scalar table
// in moe_experts.cc). Compiled with -mavx512f -mavx512dq -mavx512bw -mavx512vl -mfma -mavx512bf16;
// only called after runtime dispatch has checked the CPU and OS (cpu_isa.cc). The one use of
// AVX512_BF16, vdpbf16ps, sits in Bf16DpOps, reached only through kMoeExpertsBf16, which dispatch
// picks only when cpu_has_avx512_bf16(); kMoeExperts converts bf16 weights with a shift instead.
//
// Blocking: a tile holds 2 partial accumulators (16 fp32 lanes) for each of R weight rows x TN
// activation rows (R <= kR = 4, TN <= kTN = 3: 24 accumulators). The loop order follows the
// number of tokens n (matmul_nt): n <= 32 (decode, verify): blocks of 4 rows outer, read from
// memory once, the next block prefetched;
// more (prefill): tokens outer, the task's weight tile in L2. Each element follows one canonical
// order (see Tile), whatever its block, so results depend neither on the blocking nor on the
// tokens that share an expert (a token alone gets the same bits as in a batch).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "moe_experts_simd.h"

namespace moespec {
namespace cpu {
namespace avx512 {
namespace {

constexpr int kR = 4;   // weight rows per block
constexpr int kTN = 3;  // activation rows per block: 2 x kR x kTN = 24 accumulators (+ 4 weights, 1 activation)
constexpr int kDecodeRows = kR;  // one token: the same blocks (2 partials already give 8 chains)
constexpr int64_t kRowsOuterMaxTokens = kMoeRowsOuterMaxTokens;  // (moe_experts_simd.h)

// The lane sums of four vectors, [sum(a), sum(b), sum(c), sum(d)], stored to out[0..3]. Each sum
// is a fixed tree over a's own lanes (no other vector enters it), so a vector's sum does not
// depend on its companions: ((a0 + a2) + (a1 + a3)) within each 128-bit lane, then the lanes as
// (L0 + L1) + (L2 + L3). Only zero-masked shuffles: the unmasked ones (and
// _mm512_reduce_add_ps, _mm512_castps512_ps128) trip GCC 12's -Wuninitialized (GCC bug 105593).
inline void hsum4(__m512 a, __m512 b, __m512 c, __m512 d, float* out) {
  constexpr __mmask16 kAll = 0xffff;
  const __m512 ab = _mm512_add_ps(_mm512_maskz_unpacklo_ps(kAll, a, b), _mm512_maskz_unpackhi_ps(kAll, a, b));
  const __m512 cd = _mm512_add_ps(_mm512_maskz_unpacklo_ps(kAll, c, d), _mm512_maskz_unpackhi_ps(kAll, c, d));
  __m512 v = _mm512_add_ps(_mm512_maskz_shuffle_ps(kAll, ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_maskz_shuffle_ps(kAll, ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  v = _mm512_add_ps(v, _mm512_maskz_shuffle_f32x4(kAll, v, v, _MM_SHUFFLE(2, 3, 0, 1)));
  v = _mm512_add_ps(v, _mm512_maskz_shuffle_f32x4(kAll, v, v, _MM_SHUFFLE(1, 0, 3, 2)));
  _mm512_mask_storeu_ps(out, 0x000f, v);
}

// c[n * ldc + r] = the lane sum of v[n * R + r], for R x TN vectors, four at a time.
template <int R, int TN>
inline void store_sums(const __m512* v, float* c, int64_t ldc) {
  constexpr int kCount = R * TN;
  float sums[(kCount + 3) / 4 * 4];
  for (int i = 0; i < kCount; i += 4) {
    const __m512 zero = _mm512_setzero_ps();
    hsum4(v[i], i + 1 < kCount ? v[i + 1] : zero, i + 2 < kCount ? v[i + 2] : zero,
          i + 3 < kCount ? v[i + 3] : zero, sums + i);
  }
  for (int n = 0; n < TN; ++n)
    for (int r = 0; r < R; ++r) c[n * ldc + r] = sums[n * R + r];
}

// A tile computes c[n * ldc + r] for R weight rows w[r] and TN activation rows x[n] over K.
// Canonical order of one element (every tile and blocking follows it, so the blocking never
// changes a result): K is cut into chunks of one vector (the last one masked); chunk i is
// multiplied into partial accumulator i % 2; the result is the lane sum (hsum4) of
// partial 0 + partial 1.
// Two partials keep two independent FMA chains per element even when R = TN = 1.
template <class Ops>
struct Tile {
  using W = typename Ops::W;
  using A = typename Ops::A;
  // kPrefetch: also prefetch pf[0 .. R * K) into L2 meanwhile (the caller's next block of weight
  // rows, contiguous), R * 2 chunks per step.
  template <int R, int TN, bool kPrefetch = false>
  static void run(const W* const* w, const A* const* x, int64_t K, float* c, int64_t ldc, const W* pf = nullptr) {
    constexpr int64_t kStep = Ops::kStep;
    __m512 acc[2][R][TN];
    for (int p = 0; p < 2; ++p)
      for (int r = 0; r < R; ++r)
        for (int n = 0; n < TN; ++n) acc[p][r][n] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 2 * kStep <= K; k += 2 * kStep) {
      if (kPrefetch) {
        for (int64_t b = 0; b < R * 2 * kStep * static_cast<int64_t>(sizeof(W)); b += 64)
          _mm_prefetch(reinterpret_cast<const char*>(pf + R * k) + b, _MM_HINT_T1);
      }
      step<0, R, TN>(acc, w, x, k, kStep);
      step<1, R, TN>(acc, w, x, k + kStep, kStep);
    }
    const int64_t rest = K - k;  // < 2 chunks: [full chunk,] masked chunk
    if (rest > kStep) {
      step<0, R, TN>(acc, w, x, k, kStep);
      step<1, R, TN>(acc, w, x, k + kStep, rest - kStep);
    } else if (rest > 0) {
      step<0, R, TN>(acc, w, x, k, rest);
    }
    __m512 sum[R * TN];
    for (int n = 0; n < TN; ++n)
      for (int r = 0; r < R; ++r) sum[n * R + r] = _mm512_add_ps(acc[0][r][n], acc[1][r][n]);
    store_sums<R, TN>(sum, c, ldc);
  }

 private:
  // One chunk of `valid` elements at k (a full one, or the masked last one; activations are
  // zero-padded) into partial P.
  template <int P, int R, int TN>
  static inline void step(__m512 (&acc)[2][R][TN], const W* const* w, const A* const* x, int64_t k, int64_t valid) {
    typename Ops::WVec wr[R];
    for (int r = 0; r < R; ++r) wr[r] = valid == Ops::kStep ? Ops::load_w(w[r] + k) : Ops::load_w_tail(w[r] + k, valid);
    for (int n = 0; n < TN; ++n) {
      const typename Ops::AVec xn = Ops::load_a(x[n] + k);
      for (int r = 0; r < R; ++r) acc[P][r][n] = Ops::madd(acc[P][r][n], wr[r], xn);
    }
  }
};

// fp32 weights x fp32 activations.
struct F32Ops {
  using W = float;
  using A = float;
  using WVec = __m512;
  using AVec = __m512;
  static constexpr int64_t kStep = 16;
  static __m512 load_w(const float* p) { return _mm512_loadu_ps(p); }
  static __m512 load_w_tail(const float* p, int64_t n) {
    return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1u), p);
  }
  static __m512 load_a(const float* p) { return _mm512_load_ps(p); }
  static __m512 madd(__m512 acc, __m512 w, __m512 x) { return _mm512_fmadd_ps(w, x, acc); }
};

inline __m512 bf16_to_ps(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

// bf16 weights (converted exactly to fp32 by a shift) x fp32 activations.
struct Bf16F32Ops {
  using W = uint16_t;
  using A = float;
  using WVec = __m512;
  using AVec = __m512;
  static constexpr int64_t kStep = 16;
  static __m512 load_w(const uint16_t* p) {
    return bf16_to_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static __m512 load_w_tail(const uint16_t* p, int64_t n) {
    return bf16_to_ps(_mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1u), p));
  }
  static __m512 load_a(const float* p) { return _mm512_load_ps(p); }
  static __m512 madd(__m512 acc, __m512 w, __m512 x) { return _mm512_fmadd_ps(w, x, acc); }
};

// bf16 weights x bf16 activations: products of bf16 pairs (vdpbf16ps).
struct Bf16DpOps {
  using W = uint16_t;
  using A = uint16_t;
  using WVec = __m512bh;
  using AVec = __m512bh;
  static constexpr int64_t kStep = 32;
  static __m512bh load_w(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static __m512bh load_w_tail(const uint16_t* p, int64_t n) {
    return (__m512bh)_mm512_maskz_loadu_epi16(static_cast<__mmask32>((uint64_t{1} << n) - 1u), p);
  }
  static __m512bh load_a(const uint16_t* p) { return (__m512bh)_mm512_load_si512(p); }
  static __m512 madd(__m512 acc, __m512bh w, __m512bh x) { return _mm512_dpbf16_ps(acc, w, x); }
};

#include "moe_experts_schedule.inc"  // run_tile_tn, matmul_nt: the ISA-independent schedule

// accumulate_nn (moe_experts_simd.h): blocks of NV <= 4 vectors (64 columns) x TN <= 4 activation
// rows, 16 accumulators: a weight row is loaded (and widened) once per 4 rows, and with twice the
// AVX2 entry's lanes. s ascending, one FMA per s and element: the same bits as the AVX2 entry.
template <typename WT>
inline __m512 load_row16(const WT* p, __mmask16 m) {
  if constexpr (sizeof(WT) == 4) return _mm512_maskz_loadu_ps(m, p);
  else return bf16_to_ps(_mm256_maskz_loadu_epi16(m, p));
}

template <typename WT, int TN, int NV>
void accumulate_block(const WT* w, int64_t ldw, int64_t S, const __mmask16* masks, const float* a, int64_t lda,
                      float* c, int64_t ldc) {
  __m512 acc[TN][NV];
  for (int n = 0; n < TN; ++n)
    for (int v = 0; v < NV; ++v) acc[n][v] = _mm512_maskz_loadu_ps(masks[v], c + n * ldc + v * 16);
  for (int64_t s = 0; s < S; ++s) {
    __m512 wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = load_row16(w + s * ldw + v * 16, masks[v]);
    for (int n = 0; n < TN; ++n) {
      const __m512 av = _mm512_set1_ps(a[n * lda + s]);
      for (int v = 0; v < NV; ++v) acc[n][v] = _mm512_fmadd_ps(av, wv[v], acc[n][v]);
    }
  }
  for (int n = 0; n < TN; ++n)
    for (int v = 0; v < NV; ++v) _mm512_mask_storeu_ps(c + n * ldc + v * 16, masks[v], acc[n][v]);
}

template <typename WT, int TN>
void accumulate_rows(int nv, const WT* w, int64_t ldw, int64_t S, const __mmask16* masks, const float* a,
                     int64_t lda, float* c, int64_t ldc) {
  switch (nv) {
    case 1: accumulate_block<WT, TN, 1>(w, ldw, S, masks, a, lda, c, ldc); break;
    case 2: accumulate_block<WT, TN, 2>(w, ldw, S, masks, a, lda, c, ldc); break;
    case 3: accumulate_block<WT, TN, 3>(w, ldw, S, masks, a, lda, c, ldc); break;
    default: accumulate_block<WT, TN, 4>(w, ldw, S, masks, a, lda, c, ldc); break;
  }
}

template <typename WT>
void accumulate_nn(const void* w, int64_t ldw, int64_t S, int64_t N, const float* a, int64_t lda, int64_t n_tok,
                   float* c, int64_t ldc) {
  const WT* wp = static_cast<const WT*>(w);
  for (int64_t j0 = 0; j0 < N; j0 += 64) {
    const int64_t cols = std::min<int64_t>(64, N - j0);
    const int nv = static_cast<int>((cols + 15) / 16);
    __mmask16 masks[4];
    for (int v = 0; v < 4; ++v) {
      const int64_t left = std::clamp<int64_t>(cols - v * 16, 0, 16);
      masks[v] = static_cast<__mmask16>((1u << left) - 1u);
    }
    for (int64_t n0 = 0; n0 < n_tok; n0 += 4) {
      const float* an = a + n0 * lda;
      float* cn = c + n0 * ldc + j0;
      switch (std::min<int64_t>(4, n_tok - n0)) {
        case 1: accumulate_rows<WT, 1>(nv, wp + j0, ldw, S, masks, an, lda, cn, ldc); break;
        case 2: accumulate_rows<WT, 2>(nv, wp + j0, ldw, S, masks, an, lda, cn, ldc); break;
        case 3: accumulate_rows<WT, 3>(nv, wp + j0, ldw, S, masks, an, lda, cn, ldc); break;
        default: accumulate_rows<WT, 4>(nv, wp + j0, ldw, S, masks, an, lda, cn, ldc); break;
      }
    }
  }
}

}  // namespace

// (The exp and activation entries are the AVX2 ones: neither is a bottleneck worth a third copy.)
const MoeExpertKernels kMoeExperts = {matmul_nt<F32Ops>, matmul_nt<Bf16F32Ops>, accumulate_nn<float>,
                                      accumulate_nn<uint16_t>, avx2::exp_sum, avx2::activate, DType::kFloat32, "avx512"};
const MoeExpertKernels kMoeExpertsBf16 = {matmul_nt<F32Ops>, matmul_nt<Bf16DpOps>, accumulate_nn<float>,
                                          accumulate_nn<uint16_t>, avx2::exp_sum, avx2::activate, DType::kBFloat16,
                                          "avx512_bf16"};

}  // namespace avx512
}  // namespace cpu
}  // namespace moespec
