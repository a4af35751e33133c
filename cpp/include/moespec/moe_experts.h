// moe_experts: the expert half of an MoE layer over the routing contract, reading each active
// expert's weights once (DESIGN.md "Budgeted MoE layer").
//
//   out[t] = sum over slots k of t's routing with ids[t, k] != E and weights[t, k] != 0 of
//            weights[t, k] * expert_{ids[t, k]}(x[t])
// with, for expert e (weights in the runtime layout of python/moespec/models/weights.py, one
// contiguous block per expert: gate [I, H], up [I, H], down [H, I], row-major):
//   SwiGLU  (Qwen3-MoE, Mixtral, OLMoE, DeepSeek-V3):
//           g = gate x, u = up x, h = silu(g) * u, y = down h
//   GptOss: g = gate x + bg, u = up x + bu, g = min(g, limit), u = clamp(u, -limit, limit),
//           h = (u + 1) * g * sigmoid(alpha * g), y = down h + bd
//           (biases [E, 2I + H] float32: gate bias [I], up bias [I], down bias [H] per expert)
//
// Precision: products and sums in fp32. With bf16 weights the activations x and h are rounded to
// bf16 before their matmul (the AVX-512 BF16 path multiplies bf16 pairs); the per-expert results
// are accumulated over the token's experts in fp32 and rounded to out's dtype once. With fp32
// weights everything is fp32. The scalar path defines these semantics; the SIMD paths sum in
// other orders and agree with it within a relative 1e-5 (fp32) / 4e-3 (bf16) of the output scale
// (max |out|); for bf16 add one bf16 ulp of the value itself, since two fp32 sums a few ulp apart
// can round to neighbouring bf16 values (tests/cpp/test_moe_experts.cc checks exactly this).
// Every path is deterministic: a token's output depends only on its own x row, ids and weights
// (on one ISA, the same bits alone as in any batch: verify agrees with decode) and never on the
// thread count. A token's experts are accumulated in ascending id order (repeats in slot order).
//
// A dropped slot (id E) and a zero-weight slot cost nothing beyond the routing scan (and a
// zero-weight slot contributes exactly nothing, even if its expert would give inf or NaN); an
// expert no slot uses is never read. Scratch memory (x and h staged in the product's dtype, an
// fp32 accumulator for bf16 out) is kept per calling thread and reused, released after a call that
// left it above the retain limit (moespec/scratch.h).
// Work runs on the process-wide thread pool (thread_pool.h): first the gate/up rows of every
// active expert (tasks over expert x row tiles), then the down rows (tasks over output column
// tiles, each owning its columns of out for every token: no atomics).
//
// Dimensions: T tokens, H hidden, I expert intermediate size, E experts, K top-k.
#pragma once

#include <cstddef>
#include <cstdint>

#include "moespec/tensor_view.h"

namespace moespec {

enum class ExpertActivation : int32_t {
  kSwiGLU = 0,
  kGptOss = 1,
};

struct MoeExpertsArgs {
  TensorView x;        // [T, H] float32 | bfloat16 (rows of stride >= H, contiguous within a row)
  TensorView ids;      // [T, K] int32, values in [0, E]; E marks a dropped slot
  TensorView weights;  // [T, K] float32
  TensorView experts;  // [E, 3 I H] float32 | bfloat16, contiguous; I = intermediate_size
  TensorView biases;   // [E, 2 I + H] float32, GptOss only (optional: absent = zeros)
  TensorView out;      // out [T, H], x's dtype, contiguous; overwritten
  int64_t intermediate_size = 0;  // I
  ExpertActivation activation = ExpertActivation::kSwiGLU;
  float limit = 7.0f;    // GptOss clamp
  float alpha = 1.702f;  // GptOss sigmoid slope
  // Each routing weight rounded to x's dtype before use (the families whose router rounds its
  // weights to the model dtype: Qwen3-MoE, OLMoE, GPT-OSS), so the caller needs no cast of its own;
  // a weight that rounds to 0 counts as a zero-weight slot. No effect with fp32 x.
  bool round_weights = false;
};

// Validates shapes, dtypes, devices and scalars; throws Error(kInvalidArgument) naming the argument.
// (x's dtype must equal experts' dtype; ids values are checked by the kernel: an id outside
// [0, E] is an InvalidArgument error naming the token and slot.)
void validate_moe_experts(const MoeExpertsArgs& args);

namespace cpu {
// Runs on the CPU ISA chosen by cpu_isa.h (MOESPEC_CPU_ISA forces one) and the thread pool.
void moe_experts(const MoeExpertsArgs& args);
}  // namespace cpu

// The most experts the CUDA kernel groups (one block holds a count per expert) and the most slots
// per token it combines (their order is sorted in shared memory).
constexpr int64_t kMaxMoeExperts = 1024;
constexpr int64_t kMaxMoeSlots = 64;

namespace cuda {
// Bytes of device scratch memory moe_experts needs for T tokens, K slots, E experts, H hidden, I
// intermediate, weights of `dtype`: O(E + T K (H + I)), bounded by the call's own tensors.
std::size_t moe_experts_workspace_size(int64_t T, int64_t K, int64_t E, int64_t H, int64_t I, DType dtype);

// The same contract on CUDA tensors (cpp/kernels/moe_experts.cu): one fixed launch sequence on
// `stream` (a cudaStream_t), no host synchronisation, no allocation (`workspace`: the bytes above,
// 16-byte aligned, on the same device), so it can be captured in a CUDA graph. Differences from
// the CPU: ids outside [0, E] cannot throw without a host sync: they are dropped and counted in
// the workspace's error word; E <= kMaxMoeExperts and K <= kMaxMoeSlots. Results agree with the CPU op within
// its SIMD tolerances (sums in another order), deterministically. Throws Error(kRuntime) when
// moespec was built without CUDA.
void moe_experts(const MoeExpertsArgs& args, void* workspace, std::size_t workspace_bytes, void* stream);
}  // namespace cuda

}  // namespace moespec
