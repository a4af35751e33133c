// select_cost_aware: EcoSpec's cost-aware choice of a draft tree's verify set, on the CPU.
//
// DESIGN.md "Cost-aware tree"; the plain-Python reference is python/moespec/spec/cost_aware.py
// (select_cost_aware), which tests/python/test_cost_aware.py holds this against. Over one
// request's EAGLE-2 candidates (DraftTreeBuilder::candidates), with B[l, e] the expert buffer of
// MoE layer l (the probability that the verify pass already reads expert e; 0/1 for hard sets),
// a candidate's predicted experts e_clk with probabilities p_clk (1 when `predicted_p` is empty),
// a(c) = exp(score_c) (its path's acceptance probability, EAGLE-2's estimate) and the step so far
// costing S seconds for A expected emitted tokens:
//
//   cost(c) = token_s + sum_l expert_s[l] * sum_k p_clk * (1 - B[l, e_clk])   (expected new experts)
//   gain(c) = (S / A) * a(c) - cost(c)
//
// repeatedly the frontier candidate (parent = the root or chosen) of largest gain is chosen (ties:
// score desc, depth asc, index asc: EAGLE-2's order): S += cost(c), A += a(c), and its experts join
// the buffer (B <- 1 - (1 - B)(1 - p)), until total_tokens are chosen, none is left, or the best
// gain is <= 0 while some cost is > 0 (with all costs 0 it is EAGLE-2's selection). S / A is the
// step's time per emitted token: a node is kept while it lowers it (its expected accepted token
// saves more time than it adds). The result is ancestor-closed and becomes the verify tree through
// DraftTreeBuilder::finalize_selected (C++) or moespec.spec.tree.tree_from_selection (the eco policies).
// A batch is chosen request by request with one buffer, S and A carried from one call to the next
// (the verify pass reads the batch's union and emits the batch's tokens).
//
// Dimensions: C candidates, L MoE layers, K predicted experts per candidate, N experts.
#pragma once

#include <cstdint>

#include "moespec/tensor_view.h"

namespace moespec {

struct SelectCostAwareArgs {
  TensorView parents;      // [C] int32: candidate index of the parent, -1 = the root; parents precede children
  TensorView depth;        // [C] int32 >= 1
  TensorView scores;       // [C] float32: cumulative draft log-probs (finite or -inf)
  TensorView predicted;    // [C, L, K] int32: predicted expert ids in [0, N); a repeated id counts once
  TensorView predicted_p;  // [C, L, K] float32 in [0, 1], or undefined (a default view): all 1
  TensorView buffer;       // in/out [L, N] float32 in [0, 1]: the buffer; on return it holds the chosen nodes' experts
  TensorView expert_s;     // [L] float32 >= 0: time of one more expert of layer l
  TensorView selected;     // out [C] int32: the chosen candidates in the order chosen (the rest untouched)
  double step_s = 0.0;     // >= 0: S before this request's candidates (draft + verify of the roots + earlier requests)
  double accepted = 1.0;   // > 0: A before this request's candidates (each request's root emits its bonus token)
  float token_s = 0.0f;    // >= 0: verify time of one more token besides new experts
  int32_t total_tokens = 1;  // >= 1
};

struct SelectCostAwareResult {
  int64_t count = 0;      // candidates chosen (selected[:count])
  double step_s = 0.0;    // S after them
  double accepted = 0.0;  // A after them
};

// Throws Error(kInvalidArgument) naming the argument. Allocates O(C) scratch per call.
SelectCostAwareResult select_cost_aware(const SelectCostAwareArgs& args);

}  // namespace moespec

namespace moespec {

// A batch of requests at once, on CUDA (cpp/kernels/select_cost_aware.cu): exactly the CPU rule
// applied request after request with one buffer and S, A carried over (as the eco selector calls
// select_cost_aware), in one launch with no host synchronisation. Request b's candidates are rows
// [0, num_candidates[b]) of its slice. Values are not checked (that needs a host sync): the CPU
// function is the one that names bad values; here an expert id outside [0, N) costs nothing and
// joins nothing. Sums and products are rounded as the CPU rounds them (no fused multiply-add);
// exp(score) is CUDA's double exp (within 1 ulp of glibc's), so a choice can differ from the CPU's
// only between two gains within a few ulp of each other.
struct SelectCostAwareBatchArgs {
  TensorView parents;         // [B, C] int32
  TensorView depth;           // [B, C] int32
  TensorView scores;          // [B, C] float32
  TensorView num_candidates;  // [B] int32 in [0, C]
  TensorView predicted;       // [B, C, L, K] int32
  TensorView predicted_p;     // [B, C, L, K] float32, or undefined: all 1
  TensorView buffer;          // in/out [L, N] float32
  TensorView expert_s;        // [L] float32
  TensorView state;           // in/out [2] float64 (or float32, TensorRT's widest): S, A (A > 0)
  TensorView selected;        // out [B, C] int32: request b's choice in order, then -1
  TensorView count;           // out [B] int32
  float token_s = 0.0f;
  float cost_scale = 1.0f;  // >= 0: multiplies token_s and expert_s; 0 = EAGLE-2's selection
  int32_t total_tokens = 1;
};

namespace cuda {
// Throws Error(kInvalidArgument) naming a bad shape, dtype or device; Error(kRuntime) without CUDA.
void select_cost_aware(const SelectCostAwareBatchArgs& args, void* stream);
}  // namespace cuda

}  // namespace moespec

namespace moespec {

// The verify trees of a batch's selections on CUDA (the GPU twin of moespec.spec.tree.
// tree_from_selection, without the root-to-leaf paths): request b's nodes are the root then its
// chosen candidates in candidate order; node i's parent is the node of its candidate's parent (the
// root for depth-1 candidates), its depth one more than its parent's, its mask row the parent's row
// plus bit i (the DraftTree contract's ancestor-or-self mask). Rows past a request's node count are
// parent -1, depth 0, mask 0, token 0. A candidate whose parent was not chosen (not ancestor-closed:
// never from select_cost_aware) hangs from the root.
struct TreeFromSelectionArgs {
  TensorView selected;     // [B, C] int32: chosen candidates (any order), then -1 (select_cost_aware's output)
  TensorView count;        // [B] int32
  TensorView cand_parents;  // [B, C] int32: candidate index of each candidate's parent, -1 = the root
  TensorView cand_tokens;  // [B, C] int32
  TensorView root_tokens;  // [B] int32
  TensorView tokens;       // out [B, M + 1] int32
  TensorView parents;      // out [B, M + 1] int32
  TensorView depth;        // out [B, M + 1] int32
  TensorView mask;         // out [B, M + 1, W] int32, W = ceil((M + 1) / 32)
  TensorView num_nodes;    // out [B] int32: count + 1
};

namespace cuda {
void tree_from_selection(const TreeFromSelectionArgs& args, void* stream);
}  // namespace cuda

}  // namespace moespec
