// draft_tree: the draft tree of speculative decoding, built by EAGLE-2's dynamic expansion and
// reranking, on the CPU.
//
// Implements DESIGN.md "Contracts" -> "Draft tree" and the tree of "Speculative decoding
// (EAGLE-3)"; the algorithm is EAGLE's cnets.Model.topK_genrate (REFERENCE.md 3, section 1.4).
// Python wrapper: python/moespec/spec/tree.py. Tests: tests/cpp/test_draft_tree.cc and
// tests/python/test_draft_tree.py (which holds it against a plain-Python reference).
//
// Dimensions: K top-k (branching), D depth (levels below the root), C recorded candidates,
// M tree nodes without the root (M <= total_tokens), W = ceil((M + 1) / 32) mask words per row,
// B requests.
//
// Semantics, per request (DraftTreeBuilder):
//   expand_root(root, tokens [K], logprobs [K]) starts a tree: the root (node 0) is the last
//     accepted token; its K draft children become candidates 0..K-1, depth 1, score = logprob.
//     They are the first frontier.
//   expand(tokens [K, K], logprobs [K, K]): row s holds the K children the draft proposes after
//     frontier slot s. Each is recorded as candidate C + s*K + j (C = candidates so far), with
//     depth = parent depth + 1 and score = parent score + logprob. The next frontier is the K
//     best of these K*K new candidates. At most D - 1 calls per tree (levels 1..D).
//   finalize(): the min(total_tokens, C) best candidates, sorted by candidate index (creation
//     order), become nodes 1..M.
//   "Best" is always the order (score desc, depth asc, candidate index asc); frontier slots are
//   listed best first. (Candidates are created level by level, so index order is also depth
//   order.) A log-prob must be finite or -inf and at most kDraftLogprobTolerance; a positive
//   one (the rounding of a log-softmax) counts as 0. So a child never scores above its parent,
//   every parent ranks before its children and the selected set is closed under ancestors
//   (finalize still checks it: a violation is a kRuntime error). -inf candidates are kept like
//   any other (they rank last). EAGLE's `depth=d` makes d expansions after the root: D = d + 1.
//
// The tree contract (DraftTree, also written into views by DraftTreeBatch::finalize):
//   tokens     [M+1]  token ids (node 0 = root); ids as given (map draft ids to target ids first)
//   parents    [M+1]  node index of the parent, -1 for the root; always an earlier node
//   depth      [M+1]  0 for the root; the position offset of the node in the verify pass
//   scores     [M+1]  cumulative draft log-prob (root 0)
//   candidates [M+1]  the node's candidate index (root -1)
//   mask_words [M+1, W]  ancestor-or-self mask: bit (j % 32) of word j / 32 of row i is set iff
//                        node j is node i or one of its ancestors (the bits of an int32 view)
//   paths      [num_leaves, max_depth+1]  the node indices from the root to each leaf (a node no
//              other node has as parent), padded with -1; rows in lexicographic order
//
// Errors: bad parameters, shapes, dtypes, devices or values throw moespec::Error(kInvalidArgument)
// naming the argument; a call that fails changes nothing. Calls out of order (expand before
// expand_root, more than D - 1 expands) are kInvalidArgument errors naming the method.
// Cost: expand is O(K^2 log K), finalize O(C + M log M + M (W + D)); no allocation after
// construction (measured: about 1.2 us per expand and 3 us per finalize per request at K=10,
// D=7, total_tokens=60).
#pragma once

#include <cstdint>
#include <vector>

#include "moespec/tensor_view.h"

namespace moespec {

constexpr int32_t kMaxDraftTopK = 64;         // K
constexpr int32_t kMaxDraftDepth = 64;        // D
constexpr int32_t kMaxDraftTreeTokens = 4096;  // total_tokens (M + 1 <= 4097, mask <= 2 MiB)
constexpr float kDraftLogprobTolerance = 1e-3f;  // largest log-prob accepted (counted as 0)

struct DraftTreeParams {
  int32_t depth = 7;          // D: levels below the root, >= 1 (the root expansion is level 1)
  int32_t top_k = 10;         // K: children per expanded node and frontier size, >= 1
  int32_t total_tokens = 60;  // largest M (tree nodes without the root), >= 1
};

// Throws kInvalidArgument naming "depth", "top_k" or "total_tokens" when out of range.
void validate_draft_tree_params(const DraftTreeParams& params);

// Candidates recorded after `levels` levels: 0, then K + (levels - 1) K^2.
int64_t draft_tree_num_candidates(const DraftTreeParams& params, int32_t levels);
// Tree nodes (root included) a finalize after `levels` levels gives: min(total_tokens, C) + 1.
int64_t draft_tree_num_nodes(const DraftTreeParams& params, int32_t levels);
// Mask words per row of a tree of `nodes` nodes (root included).
inline int64_t draft_tree_mask_words(int64_t nodes) { return (nodes + 31) / 32; }

// One recorded candidate: every node the expansion proposed, selected or not.
struct DraftCandidate {
  int32_t token;   // token id
  int32_t parent;  // candidate index of the parent; -1 = the root
  int32_t depth;   // 1 for the root's children
  float score;     // cumulative log-prob: parent score + log-prob (<= the parent's)
};

// One finished tree (see "The tree contract" above). Buffers are reused from call to call.
struct DraftTree {
  int32_t num_nodes = 0;   // M + 1
  int32_t mask_width = 0;  // W
  int32_t num_leaves = 0;
  int32_t max_depth = 0;
  std::vector<int32_t> tokens;       // [M+1]
  std::vector<int32_t> parents;      // [M+1]
  std::vector<int32_t> depth;        // [M+1]
  std::vector<float> scores;         // [M+1]
  std::vector<int32_t> candidates;   // [M+1]
  std::vector<uint32_t> mask_words;  // [M+1, W]
  std::vector<int32_t> paths;        // [num_leaves, max_depth+1]
};

// Builds one request's tree. Allocates its buffers for the largest tree at construction; a round
// (expand_root, expands, finalize) allocates nothing.
class DraftTreeBuilder {
 public:
  explicit DraftTreeBuilder(const DraftTreeParams& params);

  // Starts a new tree (forgetting the previous one). root_token >= 0; tokens [K] int32|int64,
  // ids in [0, 2^31); logprobs [K] float32; CPU; any strides.
  void expand_root(int64_t root_token, const TensorView& tokens, const TensorView& logprobs);
  // One more level: tokens [K, K] int32|int64, logprobs [K, K] float32, row s = children of
  // frontier slot s. Needs 1 <= levels() < depth.
  void expand(const TensorView& tokens, const TensorView& logprobs);
  // The tree of the best min(total_tokens, C) candidates. Valid until the next call on this
  // builder; expanding further after a finalize is allowed.
  const DraftTree& finalize();
  // The tree of a caller-chosen set of candidate indices (for other selection rules, e.g.
  // cost-aware ones): each in [0, C), no repeats, closed under ancestors (else kInvalidArgument
  // naming `selected`), 1..total_tokens of them, in any order.
  const DraftTree& finalize_selected(const int32_t* selected, int64_t count);

  const DraftTreeParams& params() const { return params_; }
  int32_t levels() const { return levels_; }  // 0 before expand_root, then 1..depth
  int32_t root_token() const { return root_token_; }
  // Every candidate of the current tree, by index.
  const std::vector<DraftCandidate>& candidates() const { return candidates_; }
  // The frontier, best first: candidate indices [K], and the slot of each one's parent in the
  // previous frontier [K] (-1 for the root's children).
  const std::vector<int32_t>& frontier() const { return frontier_; }
  const std::vector<int32_t>& frontier_parent_slots() const { return frontier_parent_slot_; }
  const DraftTree& tree() const { return tree_; }

  // Value checks of expand_root / expand without changing anything (DraftTreeBatch checks every
  // request before changing any). `batch_index` >= 0 is put in the error's position.
  void check_root(int64_t root_token, const TensorView& tokens, const TensorView& logprobs,
                  int64_t batch_index = -1) const;
  void check_expand(const TensorView& tokens, const TensorView& logprobs, int64_t batch_index = -1) const;

 private:
  friend class DraftTreeBatch;  // checks every request, then records
  void record_root(int64_t root_token, const TensorView& tokens, const TensorView& logprobs);
  void record_level(const TensorView& tokens, const TensorView& logprobs);
  const DraftTree& build_tree(bool caller_selection);

  DraftTreeParams params_;
  int32_t levels_ = 0;
  int32_t root_token_ = 0;
  std::vector<DraftCandidate> candidates_;    // [C]
  std::vector<int32_t> frontier_;             // [K]
  std::vector<int32_t> frontier_parent_slot_;  // [K]
  std::vector<uint64_t> keys_;                // scratch: ranking keys (score, index) [C]
  std::vector<int32_t> rank_;                 // scratch: selected candidate indices [M]
  std::vector<int32_t> node_of_;              // scratch: candidate -> node (-1) [C]
  std::vector<int32_t> child_start_;          // scratch: children of each node, CSR [M+2]
  std::vector<int32_t> child_list_;           // scratch [M]
  std::vector<int32_t> stack_;                // scratch: depth-first walk [M+1]
  DraftTree tree_;
};

// What DraftTreeBatch writes after a level: [B, K] views, CPU, any non-overlapping strides; an
// absent (default) view is skipped.
struct DraftFrontierViews {
  TensorView index;        // int32: candidate index of each frontier node (best first)
  TensorView tokens;       // int32 | int64: its token
  TensorView parent;       // int32: candidate index of its parent (-1 = the root)
  TensorView parent_slot;  // int32: slot of its parent in the previous frontier (-1 = the root)
  TensorView depth;        // int32: its depth (= levels)
  TensorView scores;       // float32: its cumulative log-prob
};

// What DraftTreeBatch::finalize writes, M = draft_tree_num_nodes(params, levels) - 1,
// W = draft_tree_mask_words(M + 1), L = levels + 1. CPU views, any non-overlapping strides.
struct DraftTreeViews {
  TensorView tokens;      // int32 | int64 [B, M+1]
  TensorView parents;     // int32 [B, M+1]
  TensorView depth;       // int32 [B, M+1]
  TensorView scores;      // float32 [B, M+1]
  TensorView candidates;  // int32 [B, M+1] (optional)
  TensorView mask_words;  // int32 [B, M+1, W]
  TensorView paths;       // int32 [B, M, L]: rows past num_leaves and entries past a path's end are -1
  TensorView num_leaves;  // int32 [B]
  TensorView max_depth;   // int32 [B]
};

// Request b's candidate records, written into [C] views (CPU, any positive strides; an absent
// view is skipped), C = draft_tree_num_candidates(params, levels).
struct DraftCandidateViews {
  TensorView tokens;   // int32 | int64
  TensorView parents;  // int32: candidate index of the parent, -1 = the root
  TensorView depth;    // int32
  TensorView scores;   // float32
};

// B requests expanded in lockstep (same params, same number of levels), with tensor views in and
// out: the entry points the Python speculative-decoding loop drives.
class DraftTreeBatch {
 public:
  DraftTreeBatch(int32_t batch, const DraftTreeParams& params);

  // root_tokens [B] int32|int64; tokens [B, K] int32|int64; logprobs [B, K] float32.
  void expand_root(const TensorView& root_tokens, const TensorView& tokens, const TensorView& logprobs,
                   const DraftFrontierViews& frontier);
  // tokens [B, K, K] int32|int64; logprobs [B, K, K] float32.
  void expand(const TensorView& tokens, const TensorView& logprobs, const DraftFrontierViews& frontier);
  // Writes every request's tree; returns M.
  int64_t finalize(const DraftTreeViews& out);
  // Writes request b's candidate records.
  void read_candidates(int64_t b, const DraftCandidateViews& out) const;

  int32_t batch() const { return static_cast<int32_t>(requests_.size()); }
  int32_t levels() const { return requests_.front().levels(); }
  const DraftTreeParams& params() const { return params_; }
  // Request b's builder (its candidates, frontier and last tree); throws naming "b" if out of range.
  const DraftTreeBuilder& request(int64_t b) const;

 private:
  void write_frontier(const DraftFrontierViews& frontier) const;

  DraftTreeParams params_;
  std::vector<DraftTreeBuilder> requests_;
};

}  // namespace moespec
