// route_experts: MoE routing for every supported router family, with the MoE-Spec expert budget.
//
// Implements DESIGN.md "Routing families" and "Expert budget" and produces the routing contract:
//   ids     int32   [T, K]  expert id per token slot; a dropped slot holds the sentinel N
//   weights float32 [T, K]  the slot's routing weight (0 for a dropped slot)
//   active  int32   [N]     sorted ids of the experts used by at least one slot, padded with N
//   stats   int32   [4]     natural unique experts, kept (= active) experts, slots re-routed,
//                           slots dropped (RoutingStats field order)
// Dimensions: T tokens, N experts, K top-k, B budget (max unique experts per call).
//
// Semantics, per family, without a budget (these equal transformers 5.24's router modules):
//   softmax     p = softmax(logits) in fp32; natural ids = top-K of p (descending);
//               weights = p at ids, divided by their sum when `renormalize`.
//               (Qwen3-MoE and OLMoE: renormalize = norm_topk_prob; Mixtral: always true.)
//   deepseek_v3 s = sigmoid(logits) in fp32; selection on s + bias (e_score_correction_bias),
//               group-limited: each of n_group groups is scored by the sum of its two best biased
//               scores, the best topk_group groups stay, the rest are masked; top-K of the masked
//               biased scores (unordered, as transformers' topk(sorted=False)); weights = s at ids,
//               divided by (sum + 1e-20) when `renormalize`, times `scaling`.
//   gpt_oss     logits already include the router bias; ids = top-K of logits (descending);
//               weights = softmax over the K selected logits (in the logits' dtype).
// With a budget (MoE-Spec, applied to all T tokens of the call together):
//   1. score s_e = sum_t w_t * p_te with p the family's full probability (softmax over all N for
//      softmax and gpt_oss, sigmoid for deepseek_v3) and w_t the optional token weights (default 1);
//      experts ranked by (s_e desc, id asc) -- score "probability", MoE-Spec's;
//      score "gates" (moespec's): s_e = sum_t w_t * g_te with g_te the token's natural routing
//      weight on e (the family's weights of its top-K, 0 for an expert outside them), and the
//      experts that are the first choice of some token with w_t > 0 (its natural slot of largest
//      weight; ties: the lower id) rank before all others: (first choice desc, s_e desc, id asc);
//   2. B_eff = max_experts, or with coverage c the smallest prefix of ranked experts whose
//      cumulative share of the total score reaches c (clamped to [K, N]) if that is smaller;
//   3. if the natural union of the tokens' experts has at most B_eff experts, or B_eff >= N, the
//      routing is returned unchanged (exact);
//   4. else S = the B_eff first experts of the ranking and each token is re-routed:
//      substitution: a token whose natural experts all lie in S keeps them; any other token takes
//      the top-K of the family's selection score restricted to S (no group limit);
//      truncation: natural ids, slots outside S dropped (id N, weight 0);
//      then the family's own weights/renormalisation on the kept slots (a token with every slot
//      dropped gets all-zero weights).
//
// Rounding: the CPU implementation reproduces the order of operations of PyTorch's CPU kernels
// (a Sleef-style exp, the vector-lane reduction tree of softmax, the ILP order of short sums,
// std::nth_element/partial_sort top-k), so that fp32 weights are bit-identical to transformers'.
// `softmax_vector_width` is that reduction tree's width: 16 for PyTorch's AVX-512 kernels, 8 for
// its AVX2 kernels. (PyTorch's sigmoid finishes the last T*N mod 2*width elements of the tensor
// with libm's expf; so does ours. Above 32768 elements PyTorch splits the tensor across threads
// and each chunk gets such a tail, so there its DeepSeek-V3 scores can differ from ours by 1 ulp.) The CUDA implementation uses the same arithmetic; its top-K is
// ordered by (value desc, id asc), so deepseek_v3's unordered slot order (and with it the last bit
// of its renormalised weights) can differ from the CPU.
#pragma once

#include <cstddef>
#include <cstdint>

#include "moespec/tensor_view.h"

namespace moespec {

enum class RouterFamily : int32_t {
  kSoftmax = 0,     // Qwen3-MoE, OLMoE, Mixtral
  kDeepSeekV3 = 1,  // sigmoid + correction bias + group-limited top-k
  kGptOss = 2,      // top-k on logits, softmax over the k
};

enum class BudgetPolicy : int32_t {
  kSubstitution = 0,
  kTruncation = 1,
};

// How a budget ranks the experts of a call (step 1 above).
enum class BudgetScore : int32_t {
  kProbability = 0,  // MoE-Spec: full-probability mass summed over the tokens
  kGates = 1,        // the tokens' own top-K weights summed, first choices first
};

struct RouterSpec {
  RouterFamily family = RouterFamily::kSoftmax;
  int32_t top_k = 1;
  bool renormalize = false;
  int32_t n_group = 1;     // deepseek_v3 only
  int32_t topk_group = 1;  // deepseek_v3 only
  float scaling = 1.0f;    // deepseek_v3 routed_scaling_factor
};

struct ExpertBudget {
  int32_t max_experts = 0;  // B; 0 = no budget; 0 < B < K is an error; B >= N caps nothing unless coverage is set
  BudgetPolicy policy = BudgetPolicy::kSubstitution;
  double coverage = 0.0;    // 0 = off; else in (0, 1]: keep the smallest mass-c prefix (<= B)
  BudgetScore score = BudgetScore::kProbability;
};

struct RoutingStats {
  int32_t natural_unique = 0;  // unique experts of the natural (unbudgeted) routing
  int32_t kept = 0;            // unique experts after budgeting (= number of active ids)
  int32_t rerouted = 0;        // slots now holding an expert the token did not choose naturally (substitution)
  int32_t dropped = 0;         // slots dropped (truncation)
};
constexpr int kRoutingStatsSize = 4;

constexpr int32_t kMaxExperts = 1024;
constexpr int32_t kMaxTopK = 64;

struct RouteExpertsArgs {
  TensorView router_logits;  // [T, N] float32 | bfloat16 | float16
  TensorView bias;           // [N] float32, deepseek_v3 only (optional: absent = zeros)
  TensorView token_weights;  // [T] float32 >= 0, budget scores only (optional: absent = ones)
  TensorView ids;            // out [T, K] int32
  TensorView weights;        // out [T, K] float32
  TensorView active;         // out [N] int32
  TensorView stats;          // out [4] int32
  RouterSpec spec;
  ExpertBudget budget;
  int32_t softmax_vector_width = 16;  // 8 or 16, see "Rounding" above
};

// Validates shapes, dtypes, devices and scalar arguments (not tensor values); throws
// moespec::Error(kInvalidArgument) naming the argument at fault.
void validate_route_experts(const RouteExpertsArgs& args, Device device);

namespace cpu {
// Routes on the CPU (the reference semantics). Also validates values: NaN or inf in
// router_logits, bias or token_weights is an InvalidArgument error.
void route_experts(const RouteExpertsArgs& args);
}  // namespace cpu

namespace cuda {
// Bytes of device scratch memory route_experts needs for T tokens, N experts, top-K.
std::size_t route_experts_workspace_size(int64_t T, int64_t N, int64_t K);

// Routes on the GPU: one fixed launch sequence on `stream` (a cudaStream_t), no host
// synchronisation and no allocation, so it can be captured in a CUDA graph. `workspace` must hold
// route_experts_workspace_size(T, N, K) bytes on the same device. Tensor values are not checked on
// the host (that would need a host sync): a token with a non-finite logit, bias or token weight gets
// unspecified ids in [0, N] and weights, never a crash, and the call leaves the number of such
// tokens as an int32 at byte route_experts_nonfinite_offset() of the workspace, for a caller that
// synchronises anyway (moespec.ops.route_experts reads it and raises, outside graph capture).
// Throws Error(kRuntime) when moespec was built without CUDA.
void route_experts(const RouteExpertsArgs& args, void* workspace, std::size_t workspace_bytes, void* stream);

// Byte offset in route_experts' workspace of the int32 count of tokens with non-finite input.
std::size_t route_experts_nonfinite_offset();

// Whether this build has the CUDA kernels.
bool available();
}  // namespace cuda

}  // namespace moespec
