// The SIMD part of moe_experts: the matrix product both of its phases use, one table per ISA.
//
// moe_experts.cc defines the scalar table (the reference: one fp32 product and one fp32 sum per
// element, k ascending, std::exp in the activation) and does everything else (grouping,
// accumulation) in shared scalar code; moe_experts_avx2.cc and moe_experts_avx512.cc define the same product with
// intrinsics, compiled with their own flags. They sum in other orders and agree with the scalar
// table within the tolerance of cpp/include/moespec/moe_experts.h (tests/cpp/test_moe_experts.cc).
//
// Each output element's value depends only on its own weight row and activation row (never on the
// blocking, the tile or the thread that computes it), so moe_experts' results do not depend on the
// thread count.
#pragma once

#include <cstddef>
#include <cstdint>

#include "moespec/cpu_isa.h"
#include "moespec/moe_experts.h"
#include "moespec/tensor_view.h"

namespace moespec {
namespace cpu {

// Activation rows are padded with zeros to a multiple of this many elements (the widest step).
constexpr int64_t kMoeActPad = 32;
// Up to this many tokens the products run weight rows outer (a row block read from memory once,
// the activations in L2); above it tokens outer (compute-bound: the weight tile in L2).
constexpr int64_t kMoeRowsOuterMaxTokens = 32;

// "NT" product, both operands contiguous along K:
//   c[n * ldc + r] = sum_{k < K} w[r * ldw + k] * act[row_n * ld_act + k]
//   for r < n_rows, n < n_tok, with row_n = rows[n] (rows == nullptr: row_n = n).
// w: weight rows (fp32 or bf16 by table entry), exactly K readable elements per row.
// act: activation rows of the entry's activation dtype, 64-byte aligned, ld_act a multiple of
// kMoeActPad and elements [K, round_up(K, kMoeActPad)) of each row zero.
using MoeMatmulNt = void (*)(const void* w, int64_t ldw, int64_t n_rows, const void* act, int64_t ld_act,
                             const int32_t* rows, int64_t n_tok, int64_t K, float* c, int64_t ldc);

// "NN" accumulation, the weight rows along the summed dimension (attention's probabilities times
// values, linear.h's users):
//   c[n * ldc + j] += sum_{s < S} a[n * lda + s] * w[s * ldw + j]   for j < N, n < n_tok
// with s ascending, one multiply-add per s (SIMD paths fuse it): every element's order depends on
// nothing but S, so results do not depend on n_tok or the blocking. w: S rows of N contiguous
// elements (fp32 or bf16 by table entry); a, c: fp32.
using MoeAccumulateNn = void (*)(const void* w, int64_t ldw, int64_t S, int64_t N, const float* a, int64_t lda,
                                 int64_t n_tok, float* c, int64_t ldc);

// Softmax numerators in place: x[i] = exp(x[i] - shift) for i < n (an x[i] of -inf gives exactly 0);
// returns their sum in the order of NonzeroSum (so zeros anywhere leave it unchanged: what keeps the
// native step's attention batch-invariant, and a tree node's row equal to decoding its path). The
// SIMD paths use a polynomial exp (within 2 ulp of expf).
using MoeExpSum = float (*)(float* x, int64_t n, float shift);

// The sum of a sequence of non-negative terms that ignores its zeros: the k-th nonzero term goes
// into lane k % 8, and the lanes are added as ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)).
// Zeros anywhere (masked slots, padding) leave every lane unchanged, bit for bit, while 8 chains
// run independently (one in-order chain was most of a softmax row's time).
struct NonzeroSum {
  float lane[8] = {};
  int64_t count = 0;  // nonzero terms so far
  void add(float v) {
    lane[count & 7] += v;  // + 0 leaves a lane's (non-negative) bits unchanged
    count += v != 0.0f;
  }
  float total() const {
    return ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]));
  }
};

// The experts' activation over n (gate, up) pairs: h[j] = act(g[j], u[j]); h may alias g or u.
// SwiGLU: g / (1 + exp(-g)) * u. GptOss: g' = min(g, limit), u' = clamp(u, -limit, limit),
// (u' + 1) * g' / (1 + exp(-alpha g')). Elementwise, so a token's values never depend on its
// companions; the SIMD paths use exp_sum's polynomial exp.
using MoeActivate = void (*)(ExpertActivation activation, float limit, float alpha, const float* g, const float* u,
                             int64_t n, float* h);

struct MoeExpertKernels {
  MoeMatmulNt matmul_f32;   // fp32 weights x fp32 activations
  MoeMatmulNt matmul_bf16;  // bf16 weights x activations of dtype bf16_act
  MoeAccumulateNn accumulate_f32;   // fp32 rows
  MoeAccumulateNn accumulate_bf16;  // bf16 rows
  MoeExpSum exp_sum;
  MoeActivate activate;
  // Activations for matmul_bf16: kBFloat16 (products of bf16 pairs, vdpbf16ps) or kFloat32 (exact
  // fp32 copies of the bf16-rounded values).
  DType bf16_act;
  const char* name;
  // fp32 activations for matmul_bf16 stored even-odd: within each block of 16 elements, the 8 even
  // ones first, then the 8 odd ones (AVX2 widens 16 bf16 weights into those two vectors with one
  // AND and one shift). See staged_position.
  bool bf16_act_even_odd = false;
};

// Where element i of an activation row goes when staged for the product of `kernels` with weights
// of dtype `w_dtype` (every staging site writes through this: stage_activations, moe_experts'
// intermediate rows, the native decoder step).
inline int64_t staged_position(const MoeExpertKernels& kernels, DType w_dtype, int64_t i) {
  if (!kernels.bf16_act_even_odd || w_dtype != DType::kBFloat16) return i;
  const int64_t j = i & 15;
  return (i & ~int64_t{15}) + (j >> 1) + ((j & 1) << 3);
}

// The table for `isa` (for avx512: the AVX512_BF16 variant when the CPU has it).
const MoeExpertKernels& moe_expert_kernels(CpuIsa isa);

// Activation staging for the product of `kernels` with weights of dtype `w_dtype`: rows x [T, K]
// (dtype x_dtype = w_dtype, row stride ld) -> dst [T, round_up(K, kMoeActPad)] in the product's
// activation dtype (bf16 bits, or fp32 values; exact copies), zero-padded. dst 64-byte aligned.
void stage_activations(const MoeExpertKernels& kernels, DType w_dtype, const void* x, int64_t ld, int64_t T,
                       int64_t K, void* dst);
// Bytes of one staged row of K elements.
std::size_t staged_row_bytes(const MoeExpertKernels& kernels, DType w_dtype, int64_t K);

// cpu::moe_experts with the given table instead of the active ISA's (tests run every table).
void moe_experts_with(const MoeExpertsArgs& args, const MoeExpertKernels& kernels);

namespace scalar {
extern const MoeExpertKernels kMoeExperts;
}
#if defined(MOESPEC_HAVE_AVX2)
namespace avx2 {
extern const MoeExpertKernels kMoeExperts;
// Also the AVX-512 tables' exp and activation entries (an AVX-512 CPU runs AVX2 code).
float exp_sum(float* x, int64_t n, float shift);
void activate(ExpertActivation activation, float limit, float alpha, const float* g, const float* u, int64_t n,
              float* h);
}
#endif
#if defined(MOESPEC_HAVE_AVX512)
namespace avx512 {
extern const MoeExpertKernels kMoeExperts;      // bf16 weights converted to fp32 (shift) + FMA
extern const MoeExpertKernels kMoeExpertsBf16;  // bf16 pairs with vdpbf16ps (needs AVX512_BF16)
}
#endif

}  // namespace cpu
}  // namespace moespec
