// linear: a dense projection at decode and verify sizes, y = x W^T (+ bias), weights streamed once.
//
//   out[t, n] = round(sum_k x[t, k] * w[n, k] + bias[n])     for t < T, n < N
// in fp32 (products and sums), rounded once to out's dtype. With bf16 weights x is bf16 too (the
// model dtype) and the product is the same one moe_experts uses (moe_experts_simd.h: AVX-512 BF16
// dot products, AVX2 shift-and-FMA, a scalar reference), so the same semantics and tolerance hold
// (cpp/include/moespec/moe_experts.h "Precision"): every ISA agrees with the scalar path within a
// relative 1e-5 (fp32) / 4e-3 (bf16) of the output scale.
//
// Batch invariance: each element follows one fixed order of operations that depends only on its
// own row of x and of w, so a token's output does not depend on the other tokens of the call nor
// on the thread count. (A verify pass and a decode step give the same bits for the same token.)
//
// Work: the N weight rows are cut into tiles run on the process-wide thread pool; every tile reads
// its rows once for all T tokens (rows outer up to 32 tokens, then tokens outer). T is meant to be
// small (decode, verify; prefill goes through torch's GEMM). Plain-torch reference:
// torch.nn.functional.linear (tests/python/test_linear.py); C++ tests: tests/cpp/test_linear.cc.
//
// Dimensions: T tokens, K input features, N output features.
#pragma once

#include <cstdint>

#include "moespec/tensor_view.h"

namespace moespec {

struct LinearArgs {  // every tensor on one device (the CPU, or one CUDA device)
  TensorView x;       // [T, K] float32 | bfloat16, rows contiguous (row stride >= K)
  TensorView weight;  // [N, K] x's dtype, contiguous
  TensorView bias;    // [N] x's dtype or float32 (optional)
  TensorView out;     // [T, N] x's dtype, contiguous; may not alias x
};

// Validates shapes, dtypes and devices; throws Error(kInvalidArgument) naming the argument.
void validate_linear(const LinearArgs& args);

namespace cpu {
// Runs on the active CPU ISA (MOESPEC_CPU_ISA) and the thread pool.
void linear(const LinearArgs& args);
}  // namespace cpu

namespace cuda {
// On CUDA tensors (cpp/kernels/linear.cu): bf16 x, weight and out, K a multiple of 32, x's rows and
// the weight 16-byte aligned (else kInvalidArgument naming what does not fit: callers take torch's
// GEMM for those); tensor cores, each weight row streamed once per 64 tokens, fp32 accumulation in a
// fixed order per element (batch-invariant, deterministic). Launched on `stream` (a cudaStream_t)
// with no host synchronisation and no allocation; a programmatic dependent launch on sm_90
// (MOESPEC_PDL). Not bit-equal to the CPU kernel (the sums' order differs): within the bf16 tolerance.
void linear(const LinearArgs& args, void* stream);
}  // namespace cuda

}  // namespace moespec
