// draft_tree_expand / draft_tree_finalize on the CPU (the block code with one thread) and the
// argument checks the CUDA versions share. Contract: moespec/draft_tree_device.h.
#include "moespec/draft_tree_device.h"

#include <initializer_list>

#include "moespec/detail/draft_tree_block.h"
#include "moespec/error.h"

namespace moespec {
namespace {

// `v` has these dims and dtype on `device` (the first view's index), its last dim contiguous and its
// rows apart (each dim's stride at least the extent of the dims after it: the kernels' threads and
// blocks write rows of their own).
void check_rows(const TensorView& v, const char* name, DType dtype, std::initializer_list<int64_t> dims, Device device,
                int32_t index) {
  check_view(v, name, {dtype}, dims, device, index);
  MOESPEC_CHECK_ARG(v.strides[v.ndim - 1] == 1 || v.shape[v.ndim - 1] <= 1, name,
                    "expected its last dim contiguous, got ", v.describe());
  int64_t span = 1;  // elements from the first to the last of one index of dim d (1 + its inner offsets)
  for (int d = v.ndim - 1; d >= 1; --d) {
    span += (v.shape[d] - 1) * v.strides[d];
    MOESPEC_CHECK_ARG(v.shape[d - 1] <= 1 || v.strides[d - 1] >= span, name, "expected rows that do not overlap, got ",
                      v.describe(), " with stride ", v.strides[d - 1], " in dim ", d - 1);
  }
}

void check_packed(const TensorView& v, const char* name, DType dtype, std::initializer_list<int64_t> dims,
                  Device device, int32_t index) {
  check_view(v, name, {dtype}, dims, device, index);
  check_contiguous(v, name);
}

int32_t candidate_depth(int64_t c, int64_t K) { return c < K ? 1 : 2 + static_cast<int32_t>((c - K) / (K * K)); }

}  // namespace

int64_t check_draft_tree_expand(const DraftExpandArgs& a, Device device) {
  check_not_null(a.frontier, "frontier");
  MOESPEC_CHECK_ARG(a.frontier.ndim == 2, "frontier", "expected [B, K], got ", a.frontier.describe());
  const int64_t B = a.frontier.shape[0], K = a.frontier.shape[1];
  const int32_t dev = a.frontier.device_index;
  MOESPEC_CHECK_ARG(K >= 1 && K <= kMaxFusedTreeTopK, "frontier", "expected K in [1, ", kMaxFusedTreeTopK,
                    "], got ", a.frontier.describe());
  check_packed(a.frontier, "frontier", DType::kInt64, {B, K}, device, dev);
  const bool root_level = a.roots.defined();
  const int64_t n = root_level ? K : K * K;
  check_packed(a.tokens, "tokens", DType::kInt64, {B, n}, device, dev);
  check_packed(a.logprobs, "logprobs", DType::kFloat32, {B, n}, device, dev);
  if (root_level) check_packed(a.roots, "roots", DType::kInt64, {B}, device, dev);
  if (a.d2t.defined()) {
    MOESPEC_CHECK_ARG(a.d2t.ndim == 1 && a.d2t.shape[0] >= 1, "d2t", "expected [V], V >= 1, got ", a.d2t.describe());
    check_packed(a.d2t, "d2t", DType::kInt64, {a.d2t.shape[0]}, device, dev);
  }
  check_not_null(a.score, "score");
  MOESPEC_CHECK_ARG(a.score.ndim == 2, "score", "expected [B, S], got ", a.score.describe());
  const int64_t S = a.score.shape[1];
  MOESPEC_CHECK_ARG(root_level ? a.base == 0 : a.base >= K && a.base + n <= S, "base",
                    root_level ? "expected 0 at the root level, got " : "expected K <= base <= S - K^2, got ", a.base);
  MOESPEC_CHECK_ARG(n <= S, "score", "expected room for ", n, " candidates, got ", a.score.describe());
  check_rows(a.score, "score", DType::kFloat32, {B, S}, device, dev);
  check_rows(a.cand_tokens, "cand_tokens", DType::kInt64, {B, S}, device, dev);
  check_rows(a.cand_parent, "cand_parent", DType::kInt32, {B, S}, device, dev);
  MOESPEC_CHECK_ARG(a.score.strides[0] == a.cand_tokens.strides[0] && a.score.strides[0] == a.cand_parent.strides[0],
                    "cand_tokens", "expected the candidate records' rows at one stride, got ", a.score.describe(), ", ",
                    a.cand_tokens.describe(), " and ", a.cand_parent.describe());
  check_packed(a.root, "root", DType::kInt64, {B}, device, dev);
  check_packed(a.out_index, "out_index", DType::kInt32, {B, K}, device, dev);
  check_packed(a.out_tokens, "out_tokens", DType::kInt64, {B, K}, device, dev);
  check_packed(a.out_parent, "out_parent", DType::kInt32, {B, K}, device, dev);
  check_packed(a.out_parent_slot, "out_parent_slot", DType::kInt32, {B, K}, device, dev);
  check_packed(a.out_scores, "out_scores", DType::kFloat32, {B, K}, device, dev);
  if (a.ok.defined()) {
    const int64_t flags = 2 + (root_level ? 1 : 0) + (a.d2t.defined() ? 1 : 0);
    MOESPEC_CHECK_ARG(a.ok.ndim == 1 && a.ok.shape[0] >= flags, "ok", "expected [F], F >= ", flags, ", got ",
                      a.ok.describe());
    check_packed(a.ok, "ok", DType::kUInt8, {a.ok.shape[0]}, device, dev);
  }
  return B;
}

int64_t check_draft_tree_finalize(const DraftFinalizeArgs& a, Device device) {
  check_not_null(a.score, "score");
  MOESPEC_CHECK_ARG(a.score.ndim == 2, "score", "expected [B, S], got ", a.score.describe());
  const int64_t B = a.score.shape[0], S = a.score.shape[1], C = a.num_candidates, K = a.top_k;
  const int32_t dev = a.score.device_index;
  MOESPEC_CHECK_ARG(K >= 1 && K <= kMaxFusedTreeTopK, "top_k", "expected an int in [1, ", kMaxFusedTreeTopK,
                    "], got ", K);
  MOESPEC_CHECK_ARG(C >= 1 && C <= S && C <= kMaxFusedTreeCandidates, "num_candidates", "expected an int in [1, ",
                    S < kMaxFusedTreeCandidates ? S : kMaxFusedTreeCandidates, "], got ", C);
  check_rows(a.score, "score", DType::kFloat32, {B, S}, device, dev);
  check_rows(a.cand_parent, "cand_parent", DType::kInt32, {B, S}, device, dev);
  check_rows(a.cand_tokens, "cand_tokens", DType::kInt64, {B, S}, device, dev);
  check_packed(a.root, "root", DType::kInt64, {B}, device, dev);
  check_not_null(a.tokens, "tokens");
  MOESPEC_CHECK_ARG(a.tokens.ndim == 2, "tokens", "expected [B, N], got ", a.tokens.describe());
  const int64_t N = a.tokens.shape[1];
  MOESPEC_CHECK_ARG(N >= 2 && N <= C + 1, "tokens", "expected N in [2, C + 1 = ", C + 1, "] nodes, got ",
                    a.tokens.describe());
  const int64_t W = (N + 31) / 32, L = 1 + candidate_depth(C - 1, K);
  check_rows(a.tokens, "tokens", DType::kInt64, {B, N}, device, dev);
  check_rows(a.parents, "parents", DType::kInt32, {B, N}, device, dev);
  check_rows(a.depth, "depth", DType::kInt32, {B, N}, device, dev);
  check_rows(a.scores, "scores", DType::kFloat32, {B, N}, device, dev);
  check_rows(a.candidates, "candidates", DType::kInt32, {B, N}, device, dev);
  check_rows(a.mask, "mask", DType::kInt32, {B, N, W}, device, dev);
  check_rows(a.paths, "paths", DType::kInt32, {B, N - 1, L}, device, dev);
  check_packed(a.num_leaves, "num_leaves", DType::kInt32, {B}, device, dev);
  check_packed(a.max_depth, "max_depth", DType::kInt32, {B}, device, dev);
  check_not_null(a.scratch, "scratch");
  MOESPEC_CHECK_ARG(a.scratch.ndim == 2 && a.scratch.shape[1] >= 2 * C + 6 * N, "scratch", "expected [B, >= 2 C + 6 N = ",
                    2 * C + 6 * N, "], got ", a.scratch.describe());
  check_packed(a.scratch, "scratch", DType::kInt32, {B, a.scratch.shape[1]}, device, dev);
  return B;
}

namespace detail {

ExpandWork expand_work(const DraftExpandArgs& a, int64_t B) {
  ExpandWork w{};
  w.B = static_cast<int32_t>(B);
  w.K = static_cast<int32_t>(a.frontier.shape[1]);
  w.root_level = a.roots.defined();
  w.n = w.root_level ? w.K : w.K * w.K;
  w.base = a.base;
  w.tokens = a.tokens.ptr<const int64_t>();
  w.logprobs = a.logprobs.ptr<const float>();
  w.roots = w.root_level ? a.roots.ptr<const int64_t>() : nullptr;
  w.d2t = a.d2t.defined() ? a.d2t.ptr<const int64_t>() : nullptr;
  w.vocab = a.d2t.defined() ? a.d2t.shape[0] : 0;
  w.cand_tokens = a.cand_tokens.ptr<int64_t>();
  w.cand_parent = a.cand_parent.ptr<int32_t>();
  w.score = a.score.ptr<float>();
  w.stride = a.score.strides[0];
  w.root = a.root.ptr<int64_t>();
  w.frontier = a.frontier.ptr<int64_t>();
  w.out_index = a.out_index.ptr<int32_t>();
  w.out_tokens = a.out_tokens.ptr<int64_t>();
  w.out_parent = a.out_parent.ptr<int32_t>();
  w.out_parent_slot = a.out_parent_slot.ptr<int32_t>();
  w.out_scores = a.out_scores.ptr<float>();
  w.ok = a.ok.defined() ? a.ok.ptr<uint8_t>() : nullptr;
  w.tolerance = a.tolerance;
  return w;
}

FinalizeWork finalize_work(const DraftFinalizeArgs& a, int64_t b) {
  FinalizeWork w{};
  w.K = a.top_k;
  w.C = a.num_candidates;
  w.N = a.tokens.shape[1];
  w.W = a.mask.shape[2];
  w.L = a.paths.shape[2];
  w.score = a.score.ptr<const float>() + b * a.score.strides[0];
  w.cand_parent = a.cand_parent.ptr<const int32_t>() + b * a.cand_parent.strides[0];
  w.cand_tokens = a.cand_tokens.ptr<const int64_t>() + b * a.cand_tokens.strides[0];
  w.root = a.root.ptr<const int64_t>() + b;
  w.scratch = a.scratch.ptr<int32_t>() + b * a.scratch.shape[1];
  w.tokens = a.tokens.ptr<int64_t>() + b * a.tokens.strides[0];
  w.parents = a.parents.ptr<int32_t>() + b * a.parents.strides[0];
  w.depth = a.depth.ptr<int32_t>() + b * a.depth.strides[0];
  w.scores = a.scores.ptr<float>() + b * a.scores.strides[0];
  w.candidates = a.candidates.ptr<int32_t>() + b * a.candidates.strides[0];
  w.mask = a.mask.ptr<int32_t>() + b * a.mask.strides[0];
  w.mask_stride = a.mask.strides[1];
  w.paths = a.paths.ptr<int32_t>() + b * a.paths.strides[0];
  w.paths_stride = a.paths.strides[1];
  w.num_leaves = a.num_leaves.ptr<int32_t>() + b;
  w.max_depth = a.max_depth.ptr<int32_t>() + b;
  return w;
}

}  // namespace detail

void draft_tree_expand(const DraftExpandArgs& a) {
  const int64_t B = check_draft_tree_expand(a, Device::kCPU);
  if (B > 0) detail::expand_block(detail::HostBlock{}, detail::expand_work(a, B));
}

void draft_tree_finalize(const DraftFinalizeArgs& a) {
  const int64_t B = check_draft_tree_finalize(a, Device::kCPU);
  for (int64_t b = 0; b < B; ++b) detail::finalize_block(detail::HostBlock{}, detail::finalize_work(a, b));
}

}  // namespace moespec
