// select_cost_aware: EcoSpec's cost-aware choice of a draft tree's verify set, on the CPU.
//
// DESIGN.md "Cost-aware tree"; the plain-Python reference is python/moespec/spec/cost_aware.py
// (select_cost_aware), which tests/python/test_cost_aware.py holds this against. Over one
// request's EAGLE-2 candidates (DraftTreeBuilder::candidates), with B_l the expert buffer of MoE
// layer l (initially `buffer`: the experts the verify pass already pays for) and E_l(c) the
// predicted experts of candidate c:
//
//   gain(c) = value_s * exp(score_c) - (token_s + sum_l expert_s[l] * |E_l(c) \ B_l|)
//
// repeatedly the frontier candidate (parent = the root or chosen) of largest gain is chosen (ties:
// score desc, depth asc, index asc: EAGLE-2's order), its experts join the buffer, until
// total_tokens are chosen, none is left, or the best gain is <= 0 while some cost is > 0 (with all
// costs 0 it is EAGLE-2's selection). The result is ancestor-closed and becomes the verify tree through
// DraftTreeBuilder::finalize_selected (C++) or moespec.spec.tree.tree_from_selection (the eco policies).
//
// Dimensions: C candidates, L MoE layers, K predicted experts per candidate, N experts.
#pragma once

#include <cstdint>

#include "moespec/tensor_view.h"

namespace moespec {

struct SelectCostAwareArgs {
  TensorView parents;    // [C] int32: candidate index of the parent, -1 = the root; parents precede children
  TensorView depth;      // [C] int32 >= 1
  TensorView scores;     // [C] float32: cumulative draft log-probs (finite or -inf)
  TensorView predicted;  // [C, L, K] int32: predicted expert ids in [0, N)
  TensorView buffer;     // [L, N] uint8: 1 = already paid for (read only)
  TensorView expert_s;   // [L] float32 >= 0: time of one more expert of layer l
  TensorView selected;   // out [C] int32: the chosen candidates in the order chosen (the rest untouched)
  float value_s = 0.0f;  // >= 0: time one accepted token saves
  float token_s = 0.0f;  // >= 0: verify time of one more token besides new experts
  int32_t total_tokens = 1;  // >= 1
};

// Returns how many candidates were chosen. Throws Error(kInvalidArgument) naming the argument.
// Allocates O(L N + C) scratch per call (bounded by the views' sizes).
int64_t select_cost_aware(const SelectCostAwareArgs& args);

}  // namespace moespec
