// draft_tree on the CPU: EAGLE-2 dynamic expansion, reranking and the tree contract.
//
// Contract and semantics: cpp/include/moespec/draft_tree.h (DESIGN.md "Contracts" -> "Draft
// tree"). EAGLE's counterpart: cnets.Model.topK_genrate (REFERENCE.md 3, section 1.4). The
// plain-Python reference the tests hold it against is in tests/python/test_draft_tree.py.
#include "moespec/draft_tree.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "moespec/error.h"

namespace moespec {
namespace {

// ---------------------------------------------------------------------------------------------
// Strided element access (views are checked before any of these runs)

template <typename T>
T* at(const TensorView& v, int64_t offset) {
  return v.ptr<T>() + offset;
}

int64_t offset2(const TensorView& v, int64_t i, int64_t j) { return i * v.strides[0] + j * v.strides[1]; }

int64_t load_token(const TensorView& v, int64_t offset) {
  return v.dtype == DType::kInt64 ? *at<int64_t>(v, offset) : *at<int32_t>(v, offset);
}

void store_token(const TensorView& v, int64_t offset, int32_t token) {
  if (v.dtype == DType::kInt64) *at<int64_t>(v, offset) = token;
  else *at<int32_t>(v, offset) = token;
}

// Row b of a view: one dimension fewer.
TensorView select0(const TensorView& v, int64_t b) {
  TensorView r = v;
  r.data = static_cast<char*>(v.data) + b * v.strides[0] * static_cast<int64_t>(dtype_size(v.dtype));
  r.ndim = v.ndim - 1;
  for (int d = 0; d < r.ndim; ++d) {
    r.shape[d] = v.shape[d + 1];
    r.strides[d] = v.strides[d + 1];
  }
  return r;
}

// A [K] view as a [1, K] view, so that the root and the levels share one code path.
TensorView as_one_row(const TensorView& v) {
  TensorView r = v;
  r.ndim = 2;
  r.shape[0] = 1;
  r.strides[0] = 0;
  r.shape[1] = v.shape[0];
  r.strides[1] = v.strides[0];
  return r;
}

// ---------------------------------------------------------------------------------------------
// Argument checks

// Outputs must not alias themselves (a broadcast view would).
void check_out(const TensorView& v, const char* arg, std::initializer_list<DType> dtypes,
               std::initializer_list<int64_t> dims) {
  check_view(v, arg, dtypes, dims);
  for (int32_t d = 0; d < v.ndim; ++d)
    MOESPEC_CHECK_ARG(v.shape[d] <= 1 || v.strides[d] > 0, arg, "an output needs positive strides, got stride ",
                      v.strides[d], " in dim ", d, " of ", v.describe());
}

void check_optional_out(const TensorView& v, const char* arg, std::initializer_list<DType> dtypes,
                        std::initializer_list<int64_t> dims) {
  if (v.defined()) check_out(v, arg, dtypes, dims);
}

constexpr std::initializer_list<DType> kTokenDTypes = {DType::kInt32, DType::kInt64};

// "[b, i, j]" with the parts that exist (b < 0: no batch index; one_row: no row index).
std::string position(int64_t b, bool one_row, int64_t i, int64_t j) {
  std::string out = "[";
  if (b >= 0) out += std::to_string(b) + ", ";
  if (!one_row) out += std::to_string(i) + ", ";
  return out + std::to_string(j) + "]";
}

// Checks the values of a [rows, K] block of children.
void check_children(const TensorView& tokens, const TensorView& logprobs, int64_t b, bool one_row) {
  const int64_t rows = tokens.shape[0];
  const int64_t K = tokens.shape[1];
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < K; ++j) {
      const int64_t token = load_token(tokens, offset2(tokens, i, j));
      MOESPEC_CHECK_ARG(token >= 0 && token <= std::numeric_limits<int32_t>::max(), "tokens",
                        "expected token ids in [0, 2^31), got ", token, " at ", position(b, one_row, i, j));
      const float lp = *at<float>(logprobs, offset2(logprobs, i, j));
      MOESPEC_CHECK_ARG(!std::isnan(lp) && lp <= kDraftLogprobTolerance, "logprobs",
                        "expected log-probabilities (finite or -inf, <= ", kDraftLogprobTolerance, "), got ", lp,
                        " at ", position(b, one_row, i, j));
    }
  }
}

// The ranking of candidates, (score desc, depth asc, index asc), as one integer key sorted
// ascending: the score's bits mapped to an order-reversing unsigned integer, then the index.
// Depth needs no bits: candidates are created level by level, so index order is depth order.
// (A parent always ranks before its children because a child's score is <= its parent's.)
uint64_t rank_key(float score, int32_t index) {
  if (score == 0.0f) score = 0.0f;  // -0 ties with +0
  uint32_t bits;
  std::memcpy(&bits, &score, sizeof bits);
  const uint32_t ascending = (bits & 0x80000000u) ? ~bits : bits | 0x80000000u;  // float order
  return (static_cast<uint64_t>(~ascending) << 32) | static_cast<uint32_t>(index);
}

int32_t key_index(uint64_t key) { return static_cast<int32_t>(key & 0xffffffffu); }

}  // namespace

// -------------------------------------------------------------------------------------------------
// Sizes

void validate_draft_tree_params(const DraftTreeParams& p) {
  MOESPEC_CHECK_ARG(p.depth >= 1 && p.depth <= kMaxDraftDepth, "depth", "expected an int in [1, ", kMaxDraftDepth,
                    "], got ", p.depth);
  MOESPEC_CHECK_ARG(p.top_k >= 1 && p.top_k <= kMaxDraftTopK, "top_k", "expected an int in [1, ", kMaxDraftTopK,
                    "], got ", p.top_k);
  MOESPEC_CHECK_ARG(p.total_tokens >= 1 && p.total_tokens <= kMaxDraftTreeTokens, "total_tokens",
                    "expected an int in [1, ", kMaxDraftTreeTokens, "], got ", p.total_tokens);
}

int64_t draft_tree_num_candidates(const DraftTreeParams& p, int32_t levels) {
  const int64_t K = p.top_k;
  return levels <= 0 ? 0 : K + static_cast<int64_t>(levels - 1) * K * K;
}

int64_t draft_tree_num_nodes(const DraftTreeParams& p, int32_t levels) {
  return std::min<int64_t>(p.total_tokens, draft_tree_num_candidates(p, levels)) + 1;
}

// -------------------------------------------------------------------------------------------------
// DraftTreeBuilder

DraftTreeBuilder::DraftTreeBuilder(const DraftTreeParams& params) : params_(params) {
  validate_draft_tree_params(params);
  const int64_t C = draft_tree_num_candidates(params, params.depth);
  const int64_t N = draft_tree_num_nodes(params, params.depth);  // M + 1 at most
  const int64_t K = params.top_k;
  candidates_.reserve(C);
  frontier_.reserve(K);
  frontier_parent_slot_.reserve(K);
  rank_.reserve(C);
  keys_.reserve(C);
  node_of_.reserve(C);
  child_start_.reserve(N + 1);
  child_list_.reserve(N);
  stack_.reserve(N);
  tree_.tokens.reserve(N);
  tree_.parents.reserve(N);
  tree_.depth.reserve(N);
  tree_.scores.reserve(N);
  tree_.candidates.reserve(N);
  tree_.mask_words.reserve(N * draft_tree_mask_words(N));
  tree_.paths.reserve((N - 1) * (params.depth + 1));
}

void DraftTreeBuilder::check_root(int64_t root_token, const TensorView& tokens, const TensorView& logprobs,
                                  int64_t b) const {
  MOESPEC_CHECK_ARG(root_token >= 0 && root_token <= std::numeric_limits<int32_t>::max(), "root_tokens",
                    "expected a token id in [0, 2^31), got ", root_token,
                    b >= 0 ? " at [" + std::to_string(b) + "]" : "");
  check_view(tokens, "tokens", kTokenDTypes, {params_.top_k});
  check_view(logprobs, "logprobs", {DType::kFloat32}, {params_.top_k});
  check_children(as_one_row(tokens), as_one_row(logprobs), b, true);
}

void DraftTreeBuilder::check_expand(const TensorView& tokens, const TensorView& logprobs, int64_t b) const {
  MOESPEC_CHECK_ARG(levels_ >= 1, "expand", "the tree has no root yet: call expand_root first");
  MOESPEC_CHECK_ARG(levels_ < params_.depth, "expand", "the tree already has depth=", params_.depth,
                    " levels: call finalize, or expand_root to start the next tree");
  check_view(tokens, "tokens", kTokenDTypes, {params_.top_k, params_.top_k});
  check_view(logprobs, "logprobs", {DType::kFloat32}, {params_.top_k, params_.top_k});
  check_children(tokens, logprobs, b, false);
}

void DraftTreeBuilder::expand_root(int64_t root_token, const TensorView& tokens, const TensorView& logprobs) {
  check_root(root_token, tokens, logprobs);
  record_root(root_token, tokens, logprobs);
}

void DraftTreeBuilder::expand(const TensorView& tokens, const TensorView& logprobs) {
  check_expand(tokens, logprobs);
  record_level(tokens, logprobs);
}

void DraftTreeBuilder::record_root(int64_t root_token, const TensorView& tokens, const TensorView& logprobs) {
  const int32_t K = params_.top_k;
  root_token_ = static_cast<int32_t>(root_token);
  candidates_.clear();
  frontier_.clear();
  frontier_parent_slot_.clear();
  for (int32_t j = 0; j < K; ++j) {
    const float lp = *at<float>(logprobs, j * logprobs.strides[0]);
    candidates_.push_back({static_cast<int32_t>(load_token(tokens, j * tokens.strides[0])), -1, 1,
                           std::min(lp, 0.0f)});
    frontier_parent_slot_.push_back(-1);
  }
  keys_.resize(K);
  for (int32_t j = 0; j < K; ++j) keys_[j] = rank_key(candidates_[j].score, j);
  std::sort(keys_.begin(), keys_.end());
  for (int32_t j = 0; j < K; ++j) frontier_.push_back(key_index(keys_[j]));
  levels_ = 1;
}

void DraftTreeBuilder::record_level(const TensorView& tokens, const TensorView& logprobs) {
  const int32_t K = params_.top_k;
  const int32_t base = static_cast<int32_t>(candidates_.size());
  for (int32_t s = 0; s < K; ++s) {
    const DraftCandidate parent = candidates_[frontier_[s]];
    for (int32_t j = 0; j < K; ++j) {
      const float lp = *at<float>(logprobs, offset2(logprobs, s, j));
      candidates_.push_back({static_cast<int32_t>(load_token(tokens, offset2(tokens, s, j))), frontier_[s],
                             parent.depth + 1, parent.score + std::min(lp, 0.0f)});
    }
  }
  keys_.resize(static_cast<std::size_t>(K) * K);
  for (int32_t i = 0; i < K * K; ++i) keys_[i] = rank_key(candidates_[base + i].score, base + i);
  std::partial_sort(keys_.begin(), keys_.begin() + K, keys_.end());
  for (int32_t s = 0; s < K; ++s) {
    frontier_[s] = key_index(keys_[s]);
    frontier_parent_slot_[s] = (frontier_[s] - base) / K;
  }
  ++levels_;
}

const DraftTree& DraftTreeBuilder::finalize() {
  MOESPEC_CHECK_ARG(levels_ >= 1, "finalize", "the tree has no root yet: call expand_root first");
  const int32_t C = static_cast<int32_t>(candidates_.size());
  const int32_t M = std::min(params_.total_tokens, C);
  keys_.resize(C);
  for (int32_t i = 0; i < C; ++i) keys_[i] = rank_key(candidates_[i].score, i);
  if (M < C) std::nth_element(keys_.begin(), keys_.begin() + M, keys_.end());
  rank_.resize(M);
  for (int32_t n = 0; n < M; ++n) rank_[n] = key_index(keys_[n]);
  std::sort(rank_.begin(), rank_.end());
  return build_tree(false);
}

const DraftTree& DraftTreeBuilder::finalize_selected(const int32_t* selected, int64_t count) {
  MOESPEC_CHECK_ARG(levels_ >= 1, "finalize_selected", "the tree has no root yet: call expand_root first");
  const int32_t C = static_cast<int32_t>(candidates_.size());
  MOESPEC_CHECK_ARG(count >= 1 && count <= std::min(params_.total_tokens, C), "selected", "expected 1 to ",
                    std::min(params_.total_tokens, C), " candidate indices (total_tokens=", params_.total_tokens,
                    ", ", C, " candidates), got ", count);
  MOESPEC_CHECK_ARG(selected != nullptr, "selected", "no data");
  rank_.assign(selected, selected + count);
  for (int32_t c : rank_)
    MOESPEC_CHECK_ARG(c >= 0 && c < C, "selected", "expected candidate indices in [0, ", C, "), got ", c);
  std::sort(rank_.begin(), rank_.end());
  for (int64_t i = 1; i < count; ++i)
    MOESPEC_CHECK_ARG(rank_[i] != rank_[i - 1], "selected", "candidate ", rank_[i], " is selected twice");
  return build_tree(true);
}

// Builds tree_ from the sorted candidate indices in rank_ (checked for closure first).
const DraftTree& DraftTreeBuilder::build_tree(bool caller_selection) {
  const int32_t M = static_cast<int32_t>(rank_.size());
  const int32_t N = M + 1;
  node_of_.assign(candidates_.size(), -1);
  for (int32_t n = 1; n <= M; ++n) node_of_[rank_[n - 1]] = n;
  for (int32_t n = 1; n <= M; ++n) {
    const int32_t p = candidates_[rank_[n - 1]].parent;
    if (p < 0 || node_of_[p] >= 0) continue;
    if (caller_selection)
      throw_invalid("selected", "the set is not closed under ancestors: candidate ", rank_[n - 1],
                    " is selected but its parent ", p, " is not");
    throw_runtime("draft_tree: internal error: the selected set is not closed under ancestors (candidate ",
                  rank_[n - 1], " without its parent ", p, ")");
  }

  DraftTree& t = tree_;
  const int32_t W = static_cast<int32_t>(draft_tree_mask_words(N));
  t.num_nodes = N;
  t.mask_width = W;
  t.tokens.resize(N);
  t.parents.resize(N);
  t.depth.resize(N);
  t.scores.resize(N);
  t.candidates.resize(N);
  t.mask_words.resize(static_cast<std::size_t>(N) * W);
  t.tokens[0] = root_token_;
  t.parents[0] = -1;
  t.depth[0] = 0;
  t.scores[0] = 0.0f;
  t.candidates[0] = -1;
  std::fill(t.mask_words.begin(), t.mask_words.begin() + W, 0u);
  t.mask_words[0] = 1u;
  int32_t max_depth = 0;
  for (int32_t n = 1; n < N; ++n) {
    const DraftCandidate& c = candidates_[rank_[n - 1]];
    const int32_t parent = c.parent < 0 ? 0 : node_of_[c.parent];
    t.tokens[n] = c.token;
    t.parents[n] = parent;
    t.depth[n] = c.depth;
    t.scores[n] = c.score;
    t.candidates[n] = rank_[n - 1];
    max_depth = std::max(max_depth, c.depth);
    // Ancestor-or-self row: the parent's row (an earlier, finished row) plus the node's own bit.
    uint32_t* row = t.mask_words.data() + static_cast<std::size_t>(n) * W;
    std::copy_n(t.mask_words.data() + static_cast<std::size_t>(parent) * W, W, row);
    row[n / 32] |= 1u << (n % 32);
  }
  t.max_depth = max_depth;

  // Children lists (ascending, because nodes are visited in order), then a depth-first walk that
  // visits children in ascending order: it meets the leaves in lexicographic order of their paths.
  child_start_.assign(N + 1, 0);
  for (int32_t n = 1; n < N; ++n) ++child_start_[t.parents[n] + 1];
  for (int32_t n = 0; n < N; ++n) child_start_[n + 1] += child_start_[n];
  child_list_.resize(M);
  stack_.assign(child_start_.begin(), child_start_.begin() + N);  // fill cursors, reused below
  for (int32_t n = 1; n < N; ++n) child_list_[stack_[t.parents[n]]++] = n;
  int32_t leaves = 0;
  for (int32_t n = 0; n < N; ++n) leaves += child_start_[n] == child_start_[n + 1] ? 1 : 0;
  const int32_t L = max_depth + 1;
  t.num_leaves = leaves;
  t.paths.assign(static_cast<std::size_t>(leaves) * L, -1);
  stack_.clear();
  stack_.push_back(0);
  int32_t row = 0;
  while (!stack_.empty()) {
    const int32_t v = stack_.back();
    stack_.pop_back();
    if (child_start_[v] == child_start_[v + 1]) {
      for (int32_t u = v; u >= 0; u = t.parents[u]) t.paths[static_cast<std::size_t>(row) * L + t.depth[u]] = u;
      ++row;
      continue;
    }
    for (int32_t i = child_start_[v + 1] - 1; i >= child_start_[v]; --i) stack_.push_back(child_list_[i]);
  }
  return t;
}

// -------------------------------------------------------------------------------------------------
// DraftTreeBatch

DraftTreeBatch::DraftTreeBatch(int32_t batch, const DraftTreeParams& params) : params_(params) {
  MOESPEC_CHECK_ARG(batch >= 1, "batch", "expected at least 1 request, got ", batch);
  validate_draft_tree_params(params);
  requests_.reserve(batch);
  for (int32_t b = 0; b < batch; ++b) requests_.emplace_back(params);
}

const DraftTreeBuilder& DraftTreeBatch::request(int64_t b) const {
  MOESPEC_CHECK_ARG(b >= 0 && b < batch(), "b", "expected a request index in [0, ", batch(), "), got ", b);
  return requests_[b];
}

void DraftTreeBatch::expand_root(const TensorView& root_tokens, const TensorView& tokens,
                                 const TensorView& logprobs, const DraftFrontierViews& frontier) {
  const int64_t B = batch();
  const int64_t K = params_.top_k;
  check_view(root_tokens, "root_tokens", kTokenDTypes, {B});
  check_view(tokens, "tokens", kTokenDTypes, {B, K});
  check_view(logprobs, "logprobs", {DType::kFloat32}, {B, K});
  for (int64_t b = 0; b < B; ++b)
    requests_[b].check_root(load_token(root_tokens, b * root_tokens.strides[0]), select0(tokens, b),
                            select0(logprobs, b), b);
  write_frontier(frontier);  // checks the views only: nothing is written before every check passed
  for (int64_t b = 0; b < B; ++b)
    requests_[b].record_root(load_token(root_tokens, b * root_tokens.strides[0]), select0(tokens, b),
                             select0(logprobs, b));
  write_frontier(frontier);
}

void DraftTreeBatch::expand(const TensorView& tokens, const TensorView& logprobs, const DraftFrontierViews& frontier) {
  const int64_t B = batch();
  const int64_t K = params_.top_k;
  MOESPEC_CHECK_ARG(levels() >= 1, "expand", "the trees have no root yet: call expand_root first");
  MOESPEC_CHECK_ARG(levels() < params_.depth, "expand", "the trees already have depth=", params_.depth,
                    " levels: call finalize, or expand_root to start the next trees");
  check_view(tokens, "tokens", kTokenDTypes, {B, K, K});
  check_view(logprobs, "logprobs", {DType::kFloat32}, {B, K, K});
  for (int64_t b = 0; b < B; ++b) requests_[b].check_expand(select0(tokens, b), select0(logprobs, b), b);
  write_frontier(frontier);
  for (int64_t b = 0; b < B; ++b) requests_[b].record_level(select0(tokens, b), select0(logprobs, b));
  write_frontier(frontier);
}

void DraftTreeBatch::write_frontier(const DraftFrontierViews& f) const {
  const int64_t B = batch();
  const int64_t K = params_.top_k;
  check_optional_out(f.index, "frontier_index", {DType::kInt32}, {B, K});
  check_optional_out(f.tokens, "frontier_tokens", kTokenDTypes, {B, K});
  check_optional_out(f.parent, "frontier_parent", {DType::kInt32}, {B, K});
  check_optional_out(f.parent_slot, "frontier_parent_slot", {DType::kInt32}, {B, K});
  check_optional_out(f.depth, "frontier_depth", {DType::kInt32}, {B, K});
  check_optional_out(f.scores, "frontier_scores", {DType::kFloat32}, {B, K});
  if (levels() == 0) return;  // before the first level: checks only
  for (int64_t b = 0; b < B; ++b) {
    const DraftTreeBuilder& r = requests_[b];
    for (int64_t s = 0; s < K; ++s) {
      const int32_t c = r.frontier()[s];
      const DraftCandidate& cand = r.candidates()[c];
      if (f.index.defined()) *at<int32_t>(f.index, offset2(f.index, b, s)) = c;
      if (f.tokens.defined()) store_token(f.tokens, offset2(f.tokens, b, s), cand.token);
      if (f.parent.defined()) *at<int32_t>(f.parent, offset2(f.parent, b, s)) = cand.parent;
      if (f.parent_slot.defined())
        *at<int32_t>(f.parent_slot, offset2(f.parent_slot, b, s)) = r.frontier_parent_slots()[s];
      if (f.depth.defined()) *at<int32_t>(f.depth, offset2(f.depth, b, s)) = cand.depth;
      if (f.scores.defined()) *at<float>(f.scores, offset2(f.scores, b, s)) = cand.score;
    }
  }
}

int64_t DraftTreeBatch::finalize(const DraftTreeViews& out) {
  MOESPEC_CHECK_ARG(levels() >= 1, "finalize", "the trees have no root yet: call expand_root first");
  const int64_t B = batch();
  const int64_t N = draft_tree_num_nodes(params_, levels());
  const int64_t M = N - 1;
  const int64_t W = draft_tree_mask_words(N);
  const int64_t L = levels() + 1;
  check_out(out.tokens, "tokens", kTokenDTypes, {B, N});
  check_out(out.parents, "parents", {DType::kInt32}, {B, N});
  check_out(out.depth, "depth", {DType::kInt32}, {B, N});
  check_out(out.scores, "scores", {DType::kFloat32}, {B, N});
  check_optional_out(out.candidates, "candidates", {DType::kInt32}, {B, N});
  check_out(out.mask_words, "mask_words", {DType::kInt32}, {B, N, W});
  check_out(out.paths, "paths", {DType::kInt32}, {B, M, L});
  check_out(out.num_leaves, "num_leaves", {DType::kInt32}, {B});
  check_out(out.max_depth, "max_depth", {DType::kInt32}, {B});
  for (int64_t b = 0; b < B; ++b) {
    const DraftTree& t = requests_[b].finalize();
    for (int64_t n = 0; n < N; ++n) {
      store_token(out.tokens, offset2(out.tokens, b, n), t.tokens[n]);
      *at<int32_t>(out.parents, offset2(out.parents, b, n)) = t.parents[n];
      *at<int32_t>(out.depth, offset2(out.depth, b, n)) = t.depth[n];
      *at<float>(out.scores, offset2(out.scores, b, n)) = t.scores[n];
      if (out.candidates.defined()) *at<int32_t>(out.candidates, offset2(out.candidates, b, n)) = t.candidates[n];
      int32_t* mask = at<int32_t>(out.mask_words, b * out.mask_words.strides[0] + n * out.mask_words.strides[1]);
      for (int64_t w = 0; w < W; ++w)
        mask[w * out.mask_words.strides[2]] = static_cast<int32_t>(t.mask_words[n * W + w]);
    }
    const int64_t width = t.max_depth + 1;
    for (int64_t r = 0; r < M; ++r) {
      int32_t* path = at<int32_t>(out.paths, b * out.paths.strides[0] + r * out.paths.strides[1]);
      for (int64_t d = 0; d < L; ++d)
        path[d * out.paths.strides[2]] = r < t.num_leaves && d < width ? t.paths[r * width + d] : -1;
    }
    *at<int32_t>(out.num_leaves, b * out.num_leaves.strides[0]) = t.num_leaves;
    *at<int32_t>(out.max_depth, b * out.max_depth.strides[0]) = t.max_depth;
  }
  return M;
}

void DraftTreeBatch::read_candidates(int64_t b, const DraftCandidateViews& out) const {
  const DraftTreeBuilder& r = request(b);
  const int64_t C = static_cast<int64_t>(r.candidates().size());
  check_optional_out(out.tokens, "tokens", kTokenDTypes, {C});
  check_optional_out(out.parents, "parents", {DType::kInt32}, {C});
  check_optional_out(out.depth, "depth", {DType::kInt32}, {C});
  check_optional_out(out.scores, "scores", {DType::kFloat32}, {C});
  for (int64_t c = 0; c < C; ++c) {
    const DraftCandidate& cand = r.candidates()[c];
    if (out.tokens.defined()) store_token(out.tokens, c * out.tokens.strides[0], cand.token);
    if (out.parents.defined()) *at<int32_t>(out.parents, c * out.parents.strides[0]) = cand.parent;
    if (out.depth.defined()) *at<int32_t>(out.depth, c * out.depth.strides[0]) = cand.depth;
    if (out.scores.defined()) *at<float>(out.scores, c * out.scores.strides[0]) = cand.score;
  }
}

}  // namespace moespec
