// draft_tree_expand / draft_tree_finalize: the draft tree core of python/moespec/spec/tree_device.py
// (the torch core's buffers, EAGLE-2's semantics: moespec/draft_tree.h "Semantics") as one kernel a
// level and one a finalize, instead of ~20 torch kernels a level and ~60 a finalize in a captured
// draft round. CUDA: cpp/kernels/draft_tree.cu (moespec::cuda::draft_tree_*); the CPU runs the same
// block code with one thread (moespec::draft_tree_*; cpp/src/draft_tree_device.cc), which
// tests/python/test_draft_tree.py holds to the native core and the plain-Python reference, and
// tests/gpu/test_draft_tree_cuda.py holds the kernels to the CPU. The block code:
// moespec/detail/draft_tree_block.h. No host synchronisation, no allocation: capturable.
//
// Dimensions: B requests, K top-k, n = K (the root level) or K^2 new candidates a request, S the
// candidate records' row length (C at the deepest level), C candidates so far, N = min(total, C) + 1
// nodes, W = ceil(N / 32) mask words, L = levels + 1 path columns.
#pragma once

#include <cstdint>

#include "moespec/tensor_view.h"

namespace moespec {

// Bounds of the two ops (the Python core takes torch ops beyond them): a level's ranking is
// O(B n^2) in one block, a finalize's O(C^2) in a block per request.
constexpr int32_t kMaxFusedTreeTopK = 16;
constexpr int64_t kMaxFusedTreeCandidates = 4096;

// One level: records the n new candidates of each request (ids clamped into [0, 2^31), draft ids
// mapped through d2t first, clamped into it; score = the parent's + min(log-prob, 0), the root
// level's the log-prob's), then writes the K best of them (score desc, index asc) as the frontier.
// With `ok`, writes whether the level's values were valid, one flag a check, in the torch core's
// order: root ids (the root level), draft ids (with d2t), ids, log-probs (finite or -inf, <= tolerance).
struct DraftExpandArgs {
  TensorView tokens;       // int64 [B, n], contiguous
  TensorView logprobs;     // float32 [B, n], contiguous
  TensorView roots;        // int64 [B] (the root level; absent after)
  TensorView d2t;          // int64 [V] or absent
  TensorView cand_tokens;  // int64 [B, S], rows contiguous: written at [base, base + n)
  TensorView cand_parent;  // int32 [B, S]
  TensorView score;        // float32 [B, S]
  TensorView root;         // int64 [B]: the roots' ids (written at the root level)
  TensorView frontier;     // int64 [B, K] in/out: candidate indices, best first
  TensorView out_index;    // int32 [B, K], contiguous
  TensorView out_tokens;   // int64 [B, K]
  TensorView out_parent;   // int32 [B, K]
  TensorView out_parent_slot;  // int32 [B, K]
  TensorView out_scores;   // float32 [B, K]
  TensorView ok;           // uint8 [F] (the flags, 1 = valid) or absent
  int64_t base = 0;        // candidate index of the level's first: 0, then K + (level - 2) K^2
  float tolerance = 1e-3f;
};

// The trees of the best N - 1 candidates of C (score desc, index asc), nodes in candidate order: the
// DraftTreeViews contract (moespec/draft_tree.h) with tokens int64, written into these views.
struct DraftFinalizeArgs {
  TensorView score;        // float32 [B, S], rows contiguous; the first C read
  TensorView cand_parent;  // int32 [B, S]
  TensorView cand_tokens;  // int64 [B, S]
  TensorView root;         // int64 [B]
  TensorView scratch;      // int32 [B, >= 2 C + 6 N], contiguous
  TensorView tokens;       // int64 [B, N], rows contiguous (any row stride; as every output)
  TensorView parents;      // int32 [B, N]
  TensorView depth;        // int32 [B, N]
  TensorView scores;       // float32 [B, N]
  TensorView candidates;   // int32 [B, N]
  TensorView mask;         // int32 [B, N, W]
  TensorView paths;        // int32 [B, N - 1, L]
  TensorView num_leaves;   // int32 [B]
  TensorView max_depth;    // int32 [B]
  int64_t num_candidates = 0;  // C
  int32_t top_k = 0;       // K (a candidate's depth follows from its index)
};

// The CPU (tensors on the CPU) and CUDA (on one GPU, `stream` a cudaStream_t) versions; bad shapes,
// dtypes, devices or sizes beyond the bounds throw moespec::Error(kInvalidArgument) naming the argument.
void draft_tree_expand(const DraftExpandArgs& args);
void draft_tree_finalize(const DraftFinalizeArgs& args);
// The checks both versions run; return B.
int64_t check_draft_tree_expand(const DraftExpandArgs& args, Device device);
int64_t check_draft_tree_finalize(const DraftFinalizeArgs& args, Device device);

namespace cuda {
void draft_tree_expand(const DraftExpandArgs& args, void* stream);
void draft_tree_finalize(const DraftFinalizeArgs& args, void* stream);
}  // namespace cuda

}  // namespace moespec
