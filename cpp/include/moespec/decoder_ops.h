// decoder_ops: the attention half of a decoder layer on CUDA, in few launches, for the runtime's
// graph steps (python/moespec/runtime/graphs.py; kernels: cpp/kernels/decoder_ops.cu).
//
// Three ops whose semantics are the reference forward's torch ops (python/moespec/runtime/
// attention.py; the plain-torch implementations in python/moespec/ops/decoder.py, which run them on
// the CPU and which tests/gpu/test_decoder_ops_cuda.py holds the kernels to):
//
//   rms_norm          out = weight * round(s * rsqrt(mean(s^2) + eps)), s = x or round(x + residual)
//                     (then also written to `sum`): the residual add and the norm of a layer in one
//                     launch (scale_fp32: the scale in fp32, then rounded, as GPT-OSS does).
//   attention_inputs  from a layer's q/k/v projection [P, (Hq + 2 Hkv) D]: clip, q/k norm (per head
//                     or over all heads), rope (rotate-half) of q and k, k and v written at the
//                     tokens' cache slots, q returned [P, Hq, D]: one launch, one block a token.
//   tree_attention    the call's tokens packed request after request (requests of any sizes up
//                     to 256 tokens): each token's attention over its request's committed slots
//                     [0, start[b]) and the new slots start[b] + j whose bit j is set in its mask
//                     row (the draft tree's packed ancestor words), reading only those slots (the
//                     cache's length is read on the device: a graph replays it at any length); with
//                     a sliding window only slots whose position is less than `window` behind the
//                     token's (a committed slot's position is its index, new slot j's is the
//                     position of the request's token j); with sinks one more logit per head in
//                     every softmax's denominator (GPT-OSS). A block takes a group of up to 8
//                     tokens of one request (`groups`, built by the host); the slots are split over
//                     blocks (flash-decoding) and the splits combined in split order (no atomics:
//                     deterministic); one launch, two when split.
//
// Rounding: a bf16 model rounds to bf16 where torch rounds (each elementwise op's result, the
// norm's normalised value before the scale); sums (norm, q.k, p.v) run in fp32 in the hardware's
// order, so results agree with the torch ops to within their summation order, not bitwise.
//
// No op synchronises with the host or allocates: scratch comes from the caller
// (tree_attention_workspace_size), launches go to the caller's stream, so a step that calls them is
// captured in a CUDA graph. Values the host cannot check without a synchronisation (cache slots,
// start) are bounded on the device: a slot outside the cache is not written, a start past it is
// cut to it.
//
// Dimensions: P tokens (packed request after request), B requests, G groups of at most 8 tokens of
// one request, H hidden, Hq/Hkv query and key-value heads, D head dim, S_max cache slots, W mask
// words per row.
#pragma once

#include <cstddef>
#include <cstdint>

#include "moespec/tensor_view.h"

namespace moespec {

// Bounds of the kernels' shared-memory layouts (the runtime falls back to torch ops beyond them).
constexpr int64_t kMaxNormWidth = 12032;        // H of rms_norm (its fp32 row in 47 KB of shared memory)
constexpr int64_t kMaxAttentionInputs = 12032;  // (Hq + Hkv) D of attention_inputs (likewise)
constexpr int64_t kMaxHeadDim = 256;           // D of tree_attention (128 for float32)
constexpr int64_t kMaxTreeTokens = 256;        // new slots of a request in tree_attention (W <= 8 mask words)
constexpr int64_t kTreeGroupTokens = 8;        // tokens a block of tree_attention takes (a `groups` count)

struct RmsNormArgs {
  TensorView x;         // [P, H] float32 | bfloat16
  TensorView residual;  // [P, H] (optional): s = round(x + residual)
  TensorView weight;    // [H], x's dtype
  TensorView out;       // out [P, H]
  TensorView sum;       // out [P, H] (with residual): s
  float eps = 1e-6f;
  bool scale_fp32 = false;
};

enum class QkNormKind : int32_t { kNone = 0, kPerHead = 1, kFull = 2 };

struct AttentionInputsArgs {
  TensorView qkv;      // [P, (Hq + 2 Hkv) D]: each token's q, k, v (after the projection's bias)
  TensorView q_norm;   // [D] (per head) or [Hq D] (full); absent: no q/k norm
  TensorView k_norm;   // [D] or [Hkv D]
  TensorView cos;      // [P, D] the rope table's rows at the tokens' positions, in the model dtype
  TensorView sin;      // [P, D]
  TensorView k_cache;  // in/out [B, Hkv, S_max, D] one layer's keys, contiguous
  TensorView v_cache;  // in/out [B, Hkv, S_max, D]
  TensorView rows;     // [P] int64: each token's request
  TensorView slots;    // [P] int64: each token's cache slot
  TensorView q;        // out [P, Hq, D]
  int64_t num_heads = 0;     // Hq
  int64_t num_kv_heads = 0;  // Hkv
  QkNormKind qk_norm = QkNormKind::kNone;
  float eps = 1e-6f;
  float clip = 0.0f;  // > 0: q, k, v clamped to [-clip, clip] first
};

struct TreeAttentionArgs {
  TensorView q;        // [P, Hq, D]: the call's tokens packed request after request
  TensorView k_cache;  // [B, Hkv, S_max, D] contiguous
  TensorView v_cache;  // [B, Hkv, S_max, D]
  TensorView start;    // [B] int64: committed slots of request b; its new token j is at slot start[b] + j
  TensorView offsets;  // [B + 1] int64: request b's tokens are the rows [offsets[b], offsets[b + 1])
  TensorView groups;   // [G, 3] int32: a block's tokens: (request, first row, count <= 8), rows of one request
  TensorView mask;     // [P, W] int32: bit j % 32 of word j / 32 = the token sees its request's new slot j
  TensorView spans;    // [B] int64 (optional): new slots request b's mask rows index (default: its token
                       // count; the draft head's levels see scratch slots past their own tokens)
  TensorView positions;  // [P] int64 (needed with a window): the tokens' rope positions
  TensorView sinks;    // [Hq] float32 or q's dtype (optional): each head's sink logit
  TensorView out;      // out [P, Hq, D]
  float scale = 1.0f;
  int64_t window = 0;  // > 0: a sliding window of that many positions
};

// Shape, dtype and layout checks (moespec::Error naming the argument), device-independent.
void validate_rms_norm(const RmsNormArgs& a);
void validate_attention_inputs(const AttentionInputsArgs& a);
void validate_tree_attention(const TreeAttentionArgs& a);

namespace cuda {

// Splits of the slots tree_attention launches for G groups (1: no combine pass).
int64_t tree_attention_splits(int64_t groups, int64_t num_heads, int64_t max_slots);
// Bytes of scratch tree_attention needs for P tokens in G groups (0 when it does not split).
std::size_t tree_attention_workspace_size(int64_t P, int64_t groups, int64_t num_heads, int64_t head_dim,
                                          int64_t max_slots);

void rms_norm(const RmsNormArgs& a, void* stream);
void attention_inputs(const AttentionInputsArgs& a, void* stream);
void tree_attention(const TreeAttentionArgs& a, void* workspace, std::size_t workspace_bytes, void* stream);

}  // namespace cuda
}  // namespace moespec
