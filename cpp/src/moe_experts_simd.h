// The SIMD part of moe_experts: the matrix product both of its phases use, one table per ISA.
//
// moe_experts.cc defines the scalar table (the reference: one fp32 product and one fp32 sum per
// element, k ascending) and does everything else (grouping, activation, accumulation) in shared
// scalar code; moe_experts_avx2.cc and moe_experts_avx512.cc define the same product with
// intrinsics, compiled with their own flags. They sum in other orders and agree with the scalar
// table within the tolerance of cpp/include/moespec/moe_experts.h (tests/cpp/test_moe_experts.cc).
//
// Each output element's value depends only on its own weight row and activation row (never on the
// blocking, the tile or the thread that computes it), so moe_experts' results do not depend on the
// thread count.
#pragma once

#include <cstdint>

#include "moespec/cpu_isa.h"
#include "moespec/moe_experts.h"
#include "moespec/tensor_view.h"

namespace moespec {
namespace cpu {

// Activation rows are padded with zeros to a multiple of this many elements (the widest step).
constexpr int64_t kMoeActPad = 32;

// "NT" product, both operands contiguous along K:
//   c[n * ldc + r] = sum_{k < K} w[r * ldw + k] * act[row_n * ld_act + k]
//   for r < n_rows, n < n_tok, with row_n = rows[n] (rows == nullptr: row_n = n).
// w: weight rows (fp32 or bf16 by table entry), exactly K readable elements per row.
// act: activation rows of the entry's activation dtype, 64-byte aligned, ld_act a multiple of
// kMoeActPad and elements [K, round_up(K, kMoeActPad)) of each row zero.
using MoeMatmulNt = void (*)(const void* w, int64_t ldw, int64_t n_rows, const void* act, int64_t ld_act,
                             const int32_t* rows, int64_t n_tok, int64_t K, float* c, int64_t ldc);

struct MoeExpertKernels {
  MoeMatmulNt matmul_f32;   // fp32 weights x fp32 activations
  MoeMatmulNt matmul_bf16;  // bf16 weights x activations of dtype bf16_act
  // Activations for matmul_bf16: kBFloat16 (products of bf16 pairs, vdpbf16ps) or kFloat32 (exact
  // fp32 copies of the bf16-rounded values).
  DType bf16_act;
  const char* name;
};

// The table for `isa` (for avx512: the AVX512_BF16 variant when the CPU has it).
const MoeExpertKernels& moe_expert_kernels(CpuIsa isa);

// cpu::moe_experts with the given table instead of the active ISA's (tests run every table).
void moe_experts_with(const MoeExpertsArgs& args, const MoeExpertKernels& kernels);

namespace scalar {
extern const MoeExpertKernels kMoeExperts;
}
#if defined(MOESPEC_HAVE_AVX2)
namespace avx2 {
extern const MoeExpertKernels kMoeExperts;
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
