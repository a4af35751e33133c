// AVX2 path of moe_experts' product (contract: moe_experts_simd.h; reference: the scalar table in
// moe_experts.cc). Compiled with -mavx2 -mfma -mf16c; only called after runtime dispatch has
// checked the CPU and OS (cpu_isa.cc). bf16 weights are converted exactly to fp32 by a shift;
// activations are fp32.
//
// Blocking and loop orders as in moe_experts_avx512.cc (see there), with 8-lane vectors and
// kR = 2 rows per block (16 registers). Each element follows one canonical order (see Tile),
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

constexpr int kR = 2;   // weight rows per block (many tokens)
constexpr int kTN = 3;  // activation rows per block: 2 x kR x kTN = 12 accumulators (+ 2 weights, 1 activation)
constexpr int64_t kRowsOuterMaxTokens = 32;  // up to this many tokens, weight rows outer (activations in L2)

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
// The last n < 8 elements, zero-extended (no read past them).
template <typename W>
inline __m256 load_tail(const W* p, int64_t n) {
  W tmp[8] = {};
  std::memcpy(tmp, p, static_cast<std::size_t>(n) * sizeof(W));
  return load8(tmp);
}

// A tile computes c[n * ldc + r] for R weight rows w[r] and TN activation rows x[n] over K.
// Canonical order of one element: K is cut into chunks of 8 (the last one zero-extended); chunk i
// is multiplied into partial accumulator i % 2; the result is hsum(partial 0 + partial 1).
template <typename W>
struct Tile {
  // pf: null, or R rows to prefetch into L2 meanwhile (the caller's next block of weight rows).
  template <int R, int TN>
  static void run(const W* const* w, const float* const* x, int64_t K, float* c, int64_t ldc, const W* const* pf) {
    __m256 acc[2][R][TN];
    for (int p = 0; p < 2; ++p)
      for (int r = 0; r < R; ++r)
        for (int n = 0; n < TN; ++n) acc[p][r][n] = _mm256_setzero_ps();
    const int64_t full = K & ~int64_t{7};
    int64_t k = 0;
    for (; k + 16 <= full; k += 16) {
      if (pf != nullptr) {
        for (int r = 0; r < R; ++r)
          for (int64_t b = 0; b < 16 * static_cast<int64_t>(sizeof(W)); b += 64)
            _mm_prefetch(reinterpret_cast<const char*>(pf[r] + k) + b, _MM_HINT_T1);
      }
      for (int p = 0; p < 2; ++p) {
        __m256 wr[R];
        for (int r = 0; r < R; ++r) wr[r] = load8(w[r] + k + 8 * p);
        for (int n = 0; n < TN; ++n) {
          const __m256 xn = _mm256_load_ps(x[n] + k + 8 * p);
          for (int r = 0; r < R; ++r) acc[p][r][n] = _mm256_fmadd_ps(wr[r], xn, acc[p][r][n]);
        }
      }
    }
    int p = 0;  // parity of the next chunk
    if (k < full) {  // one full chunk left: an even one
      __m256 wr[R];
      for (int r = 0; r < R; ++r) wr[r] = load8(w[r] + k);
      for (int n = 0; n < TN; ++n) {
        const __m256 xn = _mm256_load_ps(x[n] + k);
        for (int r = 0; r < R; ++r) acc[0][r][n] = _mm256_fmadd_ps(wr[r], xn, acc[0][r][n]);
      }
      k += 8;
      p = 1;
    }
    if (k < K) {  // the last chunk; activations are zero-padded
      __m256 wr[R];
      for (int r = 0; r < R; ++r) wr[r] = load_tail(w[r] + k, K - k);
      for (int n = 0; n < TN; ++n) {
        const __m256 xn = _mm256_load_ps(x[n] + k);
        for (int r = 0; r < R; ++r) acc[p][r][n] = _mm256_fmadd_ps(wr[r], xn, acc[p][r][n]);
      }
    }
    for (int n = 0; n < TN; ++n)
      for (int r = 0; r < R; ++r) c[n * ldc + r] = hsum(_mm256_add_ps(acc[0][r][n], acc[1][r][n]));
  }
};

// The operand types, for the driver below (the same driver as moe_experts_avx512.cc's).
template <typename WT>
struct WeightOps {
  using W = WT;
  using A = float;
};

template <class O, int R>
void run_tile_tn(int tn, const typename O::W* const* w, const float* const* x, int64_t K, float* c, int64_t ldc,
                 const typename O::W* const* pf = nullptr) {
  static_assert(kTN == 3, "run_tile_tn dispatches 1 to 3 tokens");
  switch (tn) {
    case 1: Tile<typename O::W>::template run<R, 1>(w, x, K, c, ldc, pf); break;
    case 2: Tile<typename O::W>::template run<R, 2>(w, x, K, c, ldc, pf); break;
    default: Tile<typename O::W>::template run<R, 3>(w, x, K, c, ldc, pf); break;
  }
}

template <class Ops>
void matmul_nt(const void* w, int64_t ldw, int64_t n_rows, const void* act, int64_t ld_act, const int32_t* rows,
               int64_t n_tok, int64_t K, float* c, int64_t ldc) {
  using W = typename Ops::W;
  using A = typename Ops::A;
  const W* wp = static_cast<const W*>(w);
  const A* ap = static_cast<const A*>(act);
  auto act_row = [&](int64_t n) { return ap + (rows ? rows[n] : n) * ld_act; };
  if (n_tok <= kTN) {
    // Few tokens (decode): memory-bound. Each weight row is read once, rows in order (one
    // sequential stream for the prefetcher).
    const A* x[kTN];
    for (int64_t n = 0; n < n_tok; ++n) x[n] = act_row(n);
    for (int64_t r = 0; r < n_rows; ++r) {
      const W* wr = wp + r * ldw;
      run_tile_tn<Ops, 1>(static_cast<int>(n_tok), &wr, x, K, c + r, ldc);
    }
    return;
  }
  if (n_tok <= kRowsOuterMaxTokens) {
    // Some tokens (verify): rows outer. A block of kR rows, read from memory once, stays in L1
    // while every token's activations (in L2) pass; the prefetcher keeps streaming meanwhile.
    const A* x[kRowsOuterMaxTokens];
    for (int64_t n = 0; n < n_tok; ++n) x[n] = act_row(n);
    int64_t r0 = 0;
    for (; r0 + kR <= n_rows; r0 += kR) {
      const W* wr[kR];
      const W* next[kR];
      for (int i = 0; i < kR; ++i) wr[i] = wp + (r0 + i) * ldw, next[i] = wr[i] + kR * ldw;
      const bool prefetch = r0 + 2 * kR <= n_rows;  // while the first token block runs
      for (int64_t n0 = 0; n0 < n_tok; n0 += kTN)
        run_tile_tn<Ops, kR>(static_cast<int>(std::min<int64_t>(kTN, n_tok - n0)), wr, x + n0, K,
                             c + n0 * ldc + r0, ldc, n0 == 0 && prefetch ? next : nullptr);
    }
    for (; r0 < n_rows; ++r0) {
      const W* wr = wp + r0 * ldw;
      for (int64_t n0 = 0; n0 < n_tok; n0 += kTN)
        run_tile_tn<Ops, 1>(static_cast<int>(std::min<int64_t>(kTN, n_tok - n0)), &wr, x + n0, K,
                            c + n0 * ldc + r0, ldc);
    }
    return;
  }
  // Many tokens (prefill): compute-bound. Tokens outer: a block of kTN activation rows stays in L1
  // while the task's weight rows (its tile, in L2) pass.
  for (int64_t n0 = 0; n0 < n_tok; n0 += kTN) {
    const int tn = static_cast<int>(std::min<int64_t>(kTN, n_tok - n0));
    const A* x[kTN];
    for (int i = 0; i < tn; ++i) x[i] = act_row(n0 + i);
    int64_t r0 = 0;
    for (; r0 + kR <= n_rows; r0 += kR) {
      const W* wr[kR];
      for (int i = 0; i < kR; ++i) wr[i] = wp + (r0 + i) * ldw;
      run_tile_tn<Ops, kR>(tn, wr, x, K, c + n0 * ldc + r0, ldc);
    }
    for (; r0 < n_rows; ++r0) {
      const W* wr = wp + r0 * ldw;
      run_tile_tn<Ops, 1>(tn, &wr, x, K, c + n0 * ldc + r0, ldc);
    }
  }
}

}  // namespace

const MoeExpertKernels kMoeExperts = {matmul_nt<WeightOps<float>>, matmul_nt<WeightOps<uint16_t>>, DType::kFloat32, "avx2"};

}  // namespace avx2
}  // namespace cpu
}  // namespace moespec
