// Unit tests of the draft tree (cpp/src/draft_tree.cc): a tree worked out by hand, ties, -inf
// log-probs, the contract's invariants on random trees against a brute-force selection, the
// batch entry points against per-request builders, and the argument errors. The property tests
// against a plain-Python EAGLE-2 reference are in tests/python/test_draft_tree.py.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <type_traits>
#include <vector>

#include "check.h"
#include "moespec/draft_tree.h"
#include "moespec/error.h"

using namespace moespec;

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

template <typename T>
constexpr DType dtype_of() {
  return std::is_same_v<T, float> ? DType::kFloat32 : std::is_same_v<T, int64_t> ? DType::kInt64 : DType::kInt32;
}
template <typename T>
TensorView view1(std::vector<T>& v) {
  return TensorView::contiguous(v.data(), dtype_of<T>(), {static_cast<int64_t>(v.size())});
}
template <typename T>
TensorView view2(std::vector<T>& v, int64_t rows, int64_t cols) {
  return TensorView::contiguous(v.data(), dtype_of<T>(), {rows, cols});
}

bool bit(const DraftTree& t, int32_t i, int32_t j) {
  return (t.mask_words[static_cast<std::size_t>(i) * t.mask_width + j / 32] >> (j % 32)) & 1u;
}

// Random children: log-probs from a few coarse values (ties on purpose), sometimes -inf.
struct Draws {
  std::mt19937 rng;
  explicit Draws(uint32_t seed) : rng(seed) {}
  void fill(std::vector<int32_t>& tokens, std::vector<float>& logprobs, int64_t n) {
    tokens.resize(n);
    logprobs.resize(n);
    std::uniform_int_distribution<int32_t> tok(0, 50), kind(0, 9);
    std::uniform_real_distribution<float> u(-6.0f, 0.0f);
    for (int64_t i = 0; i < n; ++i) {
      tokens[i] = tok(rng);
      const int k = kind(rng);
      logprobs[i] = k == 0 ? -kInf : k < 5 ? std::round(u(rng)) : k == 5 ? 5e-4f : u(rng);
    }
  }
};

// Checks every invariant of the tree contract, and the selection against a brute-force ranking.
void check_contract(const DraftTreeBuilder& builder, const DraftTree& t) {
  const auto& cands = builder.candidates();
  const int32_t C = static_cast<int32_t>(cands.size());
  const int32_t M = std::min(builder.params().total_tokens, C);
  CHECK(t.num_nodes == M + 1);
  CHECK(t.mask_width == (M + 1 + 31) / 32);
  CHECK(t.tokens[0] == builder.root_token() && t.parents[0] == -1 && t.depth[0] == 0 && t.candidates[0] == -1);
  // Selection: the M best by (score desc, depth asc, index asc), in index order.
  std::vector<int32_t> order(C);
  for (int32_t i = 0; i < C; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    if (cands[a].score != cands[b].score) return cands[a].score > cands[b].score;
    return cands[a].depth < cands[b].depth;
  });
  order.resize(M);
  std::sort(order.begin(), order.end());
  for (int32_t n = 1; n <= M; ++n) {
    CHECK(t.candidates[n] == order[n - 1]);
    const DraftCandidate& c = cands[t.candidates[n]];
    CHECK(t.tokens[n] == c.token && t.depth[n] == c.depth && t.scores[n] == c.score);
    CHECK(t.parents[n] >= 0 && t.parents[n] < n);
    CHECK(t.depth[n] == t.depth[t.parents[n]] + 1);
    CHECK(t.candidates[t.parents[n]] == c.parent);  // closed under ancestors
  }
  // Mask: ancestor-or-self.
  for (int32_t i = 0; i <= M; ++i) {
    std::vector<bool> anc(M + 1, false);
    for (int32_t u = i; u >= 0; u = t.parents[u]) anc[u] = true;
    for (int32_t j = 0; j <= M; ++j) CHECK(bit(t, i, j) == anc[j]);
    for (int32_t j = M + 1; j < 32 * t.mask_width; ++j) CHECK(!bit(t, i, j));
  }
  // Paths: every leaf's root path, lexicographic, padded with -1.
  std::vector<bool> is_parent(M + 1, false);
  for (int32_t n = 1; n <= M; ++n) is_parent[t.parents[n]] = true;
  std::vector<std::vector<int32_t>> want;
  int32_t max_depth = 0;
  for (int32_t n = 0; n <= M; ++n) {
    max_depth = std::max(max_depth, t.depth[n]);
    if (is_parent[n]) continue;
    std::vector<int32_t> path;
    for (int32_t u = n; u >= 0; u = t.parents[u]) path.insert(path.begin(), u);
    want.push_back(path);
  }
  std::sort(want.begin(), want.end());
  CHECK(t.max_depth == max_depth);
  CHECK(t.num_leaves == static_cast<int32_t>(want.size()));
  CHECK(t.paths.size() == want.size() * (max_depth + 1));
  for (std::size_t r = 0; r < want.size() && t.paths.size() == want.size() * (max_depth + 1); ++r)
    for (int32_t d = 0; d <= max_depth; ++d)
      CHECK(t.paths[r * (max_depth + 1) + d] == (d < static_cast<int32_t>(want[r].size()) ? want[r][d] : -1));
}

}  // namespace

TEST(hand_worked_tree) {
  DraftTreeBuilder b(DraftTreeParams{3, 2, 4});
  std::vector<int64_t> t0 = {5, 6};
  std::vector<float> l0 = {-0.1f, -1.0f};
  b.expand_root(100, view1(t0), view1(l0));
  CHECK(b.levels() == 1);
  CHECK((b.frontier() == std::vector<int32_t>{0, 1}));
  std::vector<int32_t> t1 = {7, 8, 9, 10};
  std::vector<float> l1 = {-0.2f, -3.0f, -0.05f, -0.5f};
  b.expand(view2(t1, 2, 2), view2(l1, 2, 2));
  CHECK((b.frontier() == std::vector<int32_t>{2, 4}));  // scores -0.3 and -1.05
  CHECK((b.frontier_parent_slots() == std::vector<int32_t>{0, 1}));
  std::vector<int32_t> t2 = {11, 12, 13, 14};
  std::vector<float> l2 = {-0.1f, -2.0f, -0.01f, -0.02f};
  b.expand(view2(t2, 2, 2), view2(l2, 2, 2));
  CHECK(b.levels() == 3);
  CHECK(b.candidates().size() == 10u);
  CHECK(b.candidates()[8].parent == 4 && b.candidates()[8].depth == 3);
  const DraftTree& t = b.finalize();  // best 4: candidates 0 (-0.1), 2 (-0.3), 6 (-0.4), 1 (-1.0)
  CHECK(t.num_nodes == 5);
  CHECK((t.tokens == std::vector<int32_t>{100, 5, 6, 7, 11}));
  CHECK((t.parents == std::vector<int32_t>{-1, 0, 0, 1, 3}));
  CHECK((t.depth == std::vector<int32_t>{0, 1, 1, 2, 3}));
  CHECK((t.candidates == std::vector<int32_t>{-1, 0, 1, 2, 6}));
  CHECK((t.mask_words == std::vector<uint32_t>{1, 3, 5, 11, 27}));
  CHECK(t.num_leaves == 2 && t.max_depth == 3);
  CHECK((t.paths == std::vector<int32_t>{0, 1, 3, 4, 0, 2, -1, -1}));
  check_contract(b, t);
}

TEST(ties_prefer_shallow_then_early_candidates) {
  const int32_t K = 3;
  DraftTreeBuilder b(DraftTreeParams{3, K, 5});
  std::vector<int32_t> t0 = {1, 2, 3};
  std::vector<float> l0(K, 0.0f);
  b.expand_root(0, view1(t0), view1(l0));
  std::vector<int32_t> t1(K * K, 4);
  std::vector<float> l1(K * K, 0.0f);
  b.expand(view2(t1, K, K), view2(l1, K, K));
  CHECK((b.frontier() == std::vector<int32_t>{3, 4, 5}));  // all children of slot 0 (candidate 0)
  CHECK((b.frontier_parent_slots() == std::vector<int32_t>{0, 0, 0}));
  b.expand(view2(t1, K, K), view2(l1, K, K));
  const DraftTree& t = b.finalize();
  CHECK((t.candidates == std::vector<int32_t>{-1, 0, 1, 2, 3, 4}));
  CHECK((t.parents == std::vector<int32_t>{-1, 0, 0, 0, 1, 1}));
  check_contract(b, t);
}

TEST(minus_infinity_and_small_positive_logprobs) {
  DraftTreeBuilder b(DraftTreeParams{2, 2, 6});
  std::vector<int32_t> t0 = {1, 2};
  std::vector<float> l0 = {-kInf, 4e-4f};  // the positive one counts as 0
  b.expand_root(0, view1(t0), view1(l0));
  CHECK(b.candidates()[1].score == 0.0f);
  CHECK((b.frontier() == std::vector<int32_t>{1, 0}));
  std::vector<int32_t> t1 = {3, 4, 5, 6};
  std::vector<float> l1 = {-1.0f, -kInf, -kInf, -2.0f};
  b.expand(view2(t1, 2, 2), view2(l1, 2, 2));
  // Candidates 2, 3 are children of candidate 1 (slot 0), 4, 5 of candidate 0 (score -inf).
  CHECK(b.candidates()[2].score == -1.0f && b.candidates()[3].score == -kInf);
  CHECK(b.candidates()[4].score == -kInf && b.candidates()[5].score == -kInf);
  const DraftTree& t = b.finalize();  // every candidate (6): -inf ones too, parents first
  CHECK(t.num_nodes == 7);
  check_contract(b, t);
  DraftTreeBuilder small(DraftTreeParams{2, 2, 3});
  small.expand_root(0, view1(t0), view1(l0));
  small.expand(view2(t1, 2, 2), view2(l1, 2, 2));
  const DraftTree& s = small.finalize();  // 1 (0), 2 (-1), then 0 (-inf, depth 1) before depth 2
  CHECK((s.candidates == std::vector<int32_t>{-1, 0, 1, 2}));
  check_contract(small, s);
}

TEST(random_trees_keep_the_contract) {
  Draws draws(20240611u);  // fixed seed: failures reproduce
  std::uniform_int_distribution<int32_t> k_of(1, 10), d_of(1, 8), n_of(1, 80);
  for (int iter = 0; iter < 300; ++iter) {
    const DraftTreeParams p{d_of(draws.rng), k_of(draws.rng), n_of(draws.rng)};
    DraftTreeBuilder b(p);
    const int32_t K = p.top_k;
    std::vector<int32_t> tokens;
    std::vector<float> logprobs;
    for (int round = 0; round < 2; ++round) {  // a second round reuses the builder
      draws.fill(tokens, logprobs, K);
      b.expand_root(7, view1(tokens), view1(logprobs));
      check_contract(b, b.finalize());
      const int32_t levels = std::uniform_int_distribution<int32_t>(1, p.depth)(draws.rng);
      while (b.levels() < levels) {
        draws.fill(tokens, logprobs, K * K);
        b.expand(view2(tokens, K, K), view2(logprobs, K, K));
        for (int32_t s = 0; s < K; ++s) {
          const DraftCandidate& c = b.candidates()[b.frontier()[s]];
          CHECK(c.depth == b.levels());
          if (s > 0) {
            const DraftCandidate& prev = b.candidates()[b.frontier()[s - 1]];
            CHECK(prev.score > c.score || (prev.score == c.score && b.frontier()[s - 1] < b.frontier()[s]));
          }
        }
      }
      CHECK(static_cast<int64_t>(b.candidates().size()) == draft_tree_num_candidates(p, b.levels()));
      check_contract(b, b.finalize());
    }
  }
}

TEST(no_reallocation_after_the_first_round) {
  const DraftTreeParams p{4, 5, 40};
  DraftTreeBuilder b(p);
  Draws draws(7u);
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;
  const void* cand_data = nullptr;
  const void* mask_data = nullptr;
  const void* path_data = nullptr;
  for (int round = 0; round < 3; ++round) {
    draws.fill(tokens, logprobs, 5);
    b.expand_root(1, view1(tokens), view1(logprobs));
    while (b.levels() < p.depth) {
      draws.fill(tokens, logprobs, 25);
      b.expand(view2(tokens, 5, 5), view2(logprobs, 5, 5));
    }
    const DraftTree& t = b.finalize();
    if (round == 0) {
      cand_data = b.candidates().data();
      mask_data = t.mask_words.data();
      path_data = t.paths.data();
    }
    CHECK(b.candidates().data() == cand_data);
    CHECK(t.mask_words.data() == mask_data);
    CHECK(t.paths.data() == path_data);
  }
}

TEST(finalize_selected_takes_any_closed_set) {
  DraftTreeBuilder b(DraftTreeParams{3, 2, 4});
  std::vector<int32_t> t0 = {5, 6}, t1 = {7, 8, 9, 10};
  std::vector<float> l0 = {-0.1f, -1.0f}, l1 = {-0.2f, -3.0f, -0.05f, -0.5f};
  b.expand_root(100, view1(t0), view1(l0));
  b.expand(view2(t1, 2, 2), view2(l1, 2, 2));
  std::vector<int32_t> sel = {5, 1, 0};  // candidate 5 is a child of candidate 1
  const DraftTree& t = b.finalize_selected(sel.data(), 3);
  CHECK((t.candidates == std::vector<int32_t>{-1, 0, 1, 5}));
  CHECK((t.parents == std::vector<int32_t>{-1, 0, 0, 2}));
  CHECK((t.paths == std::vector<int32_t>{0, 1, -1, 0, 2, 3}));
  std::vector<int32_t> open = {5, 0};
  CHECK_THROWS_WITH(b.finalize_selected(open.data(), 2), "selected: the set is not closed under ancestors");
  CHECK(b.tree().num_nodes == 4);  // the failed call changed nothing
  std::vector<int32_t> twice = {0, 0};
  CHECK_THROWS_WITH(b.finalize_selected(twice.data(), 2), "selected twice");
  std::vector<int32_t> outside = {6};
  CHECK_THROWS_WITH(b.finalize_selected(outside.data(), 1), "candidate indices in [0, 6)");
  std::vector<int32_t> many = {0, 1, 2, 3, 4};
  CHECK_THROWS_WITH(b.finalize_selected(many.data(), 5), "expected 1 to 4 candidate indices");
}

TEST(batch_equals_per_request_builders) {
  const int32_t B = 3, K = 4;
  const DraftTreeParams p{4, K, 23};
  DraftTreeBatch batch(B, p);
  std::vector<DraftTreeBuilder> solo(B, DraftTreeBuilder(p));
  Draws draws(99u);
  std::vector<int64_t> roots = {11, 22, 33};
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;
  std::vector<int32_t> index(B * K), parent_slot(B * K), depth(B * K), parent(B * K);
  std::vector<int64_t> ftokens(B * K);
  std::vector<float> fscores(B * K);
  DraftFrontierViews fv;
  fv.index = view2(index, B, K);
  fv.tokens = TensorView::contiguous(ftokens.data(), DType::kInt64, {B, K});
  fv.parent = view2(parent, B, K);
  fv.parent_slot = view2(parent_slot, B, K);
  fv.depth = view2(depth, B, K);
  fv.scores = view2(fscores, B, K);
  auto check_frontier = [&] {
    for (int32_t b = 0; b < B; ++b)
      for (int32_t s = 0; s < K; ++s) {
        const int32_t c = solo[b].frontier()[s];
        const DraftCandidate& cand = solo[b].candidates()[c];
        CHECK(index[b * K + s] == c && ftokens[b * K + s] == cand.token && parent[b * K + s] == cand.parent);
        CHECK(parent_slot[b * K + s] == solo[b].frontier_parent_slots()[s] && depth[b * K + s] == cand.depth);
        CHECK(fscores[b * K + s] == cand.score);
      }
  };
  draws.fill(tokens, logprobs, B * K);
  // Inputs as strided views: tokens read through a transposed [K, B] buffer.
  std::vector<int32_t> tokens_t(B * K);
  for (int32_t b = 0; b < B; ++b)
    for (int32_t j = 0; j < K; ++j) tokens_t[j * B + b] = tokens[b * K + j];
  TensorView tv = TensorView::contiguous(tokens_t.data(), DType::kInt32, {B, K});
  tv.strides[0] = 1;
  tv.strides[1] = B;
  batch.expand_root(view1(roots), tv, view2(logprobs, B, K), fv);
  for (int32_t b = 0; b < B; ++b) {
    std::vector<int32_t> t(tokens.begin() + b * K, tokens.begin() + (b + 1) * K);
    std::vector<float> l(logprobs.begin() + b * K, logprobs.begin() + (b + 1) * K);
    solo[b].expand_root(roots[b], view1(t), view1(l));
  }
  check_frontier();
  while (batch.levels() < p.depth) {
    draws.fill(tokens, logprobs, B * K * K);
    batch.expand(TensorView::contiguous(tokens.data(), DType::kInt32, {B, K, K}),
                 TensorView::contiguous(logprobs.data(), DType::kFloat32, {B, K, K}), fv);
    for (int32_t b = 0; b < B; ++b) {
      std::vector<int32_t> t(tokens.begin() + b * K * K, tokens.begin() + (b + 1) * K * K);
      std::vector<float> l(logprobs.begin() + b * K * K, logprobs.begin() + (b + 1) * K * K);
      solo[b].expand(view2(t, K, K), view2(l, K, K));
    }
    check_frontier();
  }
  const int64_t N = draft_tree_num_nodes(p, p.depth), M = N - 1, W = draft_tree_mask_words(N), L = p.depth + 1;
  CHECK(N == 24 && W == 1);
  std::vector<int64_t> out_tokens(B * N);
  std::vector<int32_t> parents(B * N), depths(B * N), cands(B * N), mask(B * N * W), paths(B * M * L, 77), leaves(B),
      max_depth(B);
  std::vector<float> scores(B * N);
  DraftTreeViews out;
  out.tokens = TensorView::contiguous(out_tokens.data(), DType::kInt64, {B, N});
  out.parents = view2(parents, B, N);
  out.depth = view2(depths, B, N);
  out.scores = view2(scores, B, N);
  out.candidates = view2(cands, B, N);
  out.mask_words = TensorView::contiguous(mask.data(), DType::kInt32, {B, N, W});
  out.paths = TensorView::contiguous(paths.data(), DType::kInt32, {B, M, L});
  out.num_leaves = view1(leaves);
  out.max_depth = view1(max_depth);
  CHECK(batch.finalize(out) == M);
  for (int32_t b = 0; b < B; ++b) {
    const DraftTree& t = solo[b].finalize();
    check_contract(solo[b], t);
    CHECK(leaves[b] == t.num_leaves && max_depth[b] == t.max_depth);
    for (int64_t n = 0; n < N; ++n) {
      CHECK(out_tokens[b * N + n] == t.tokens[n] && parents[b * N + n] == t.parents[n]);
      CHECK(depths[b * N + n] == t.depth[n] && scores[b * N + n] == t.scores[n] && cands[b * N + n] == t.candidates[n]);
      CHECK(static_cast<uint32_t>(mask[b * N + n]) == t.mask_words[n]);
    }
    for (int64_t r = 0; r < M; ++r)
      for (int64_t d = 0; d < L; ++d) {
        const int32_t want = r < t.num_leaves && d <= t.max_depth ? t.paths[r * (t.max_depth + 1) + d] : -1;
        CHECK(paths[(b * M + r) * L + d] == want);
      }
  }
  std::vector<int32_t> ctok(draft_tree_num_candidates(p, p.depth));
  DraftCandidateViews cv;
  cv.tokens = view1(ctok);
  batch.read_candidates(2, cv);
  for (std::size_t c = 0; c < ctok.size(); ++c) CHECK(ctok[c] == solo[2].candidates()[c].token);
  CHECK_THROWS_WITH(batch.read_candidates(3, cv), "b: expected a request index in [0, 3)");
}

TEST(a_failed_batch_call_changes_nothing) {
  const int32_t B = 2, K = 2;
  DraftTreeBatch batch(B, DraftTreeParams{3, K, 5});
  std::vector<int32_t> roots = {1, 2}, tokens = {3, 4, 5, 6};
  std::vector<float> logprobs = {-1.0f, -2.0f, -1.0f, std::nanf("")};
  std::vector<int32_t> index(B * K, -7);
  DraftFrontierViews fv;
  fv.index = view2(index, B, K);
  CHECK_THROWS_WITH(batch.expand_root(view1(roots), view2(tokens, B, K), view2(logprobs, B, K), fv),
                    "logprobs: expected log-probabilities (finite or -inf, <= 0.001), got nan at [1, 1]");
  CHECK(batch.levels() == 0 && batch.request(0).levels() == 0);
  CHECK((index == std::vector<int32_t>(B * K, -7)));
  logprobs[3] = -0.5f;
  batch.expand_root(view1(roots), view2(tokens, B, K), view2(logprobs, B, K), fv);
  CHECK((index == std::vector<int32_t>{0, 1, 1, 0}));  // request 1: -0.5 beats -1
  std::vector<int32_t> t1(B * K * K, 3);
  std::vector<float> l1(B * K * K, -1.0f);
  l1[B * K * K - 1] = 0.5f;
  std::vector<int32_t> bad_index(B * K + 1);
  fv.index = view2(bad_index, B, K + 1);
  CHECK_THROWS_WITH(batch.expand(TensorView::contiguous(t1.data(), DType::kInt32, {B, K, K}),
                                 TensorView::contiguous(l1.data(), DType::kFloat32, {B, K, K}), fv),
                    "got 0.5 at [1, 1, 1]");
  l1[B * K * K - 1] = -1.0f;
  CHECK_THROWS_WITH(batch.expand(TensorView::contiguous(t1.data(), DType::kInt32, {B, K, K}),
                                 TensorView::contiguous(l1.data(), DType::kFloat32, {B, K, K}), fv),
                    "frontier_index: expected size 2 in dim 1");
  CHECK(batch.levels() == 1 && batch.request(1).candidates().size() == 2u);
}

TEST(argument_errors_name_the_argument) {
  CHECK_THROWS_WITH(DraftTreeBuilder(DraftTreeParams{0, 2, 5}), "depth: expected an int in [1, 64], got 0");
  CHECK_THROWS_WITH(DraftTreeBuilder(DraftTreeParams{2, 0, 5}), "top_k: expected an int in [1, 64], got 0");
  CHECK_THROWS_WITH(DraftTreeBuilder(DraftTreeParams{2, 65, 5}), "top_k");
  CHECK_THROWS_WITH(DraftTreeBuilder(DraftTreeParams{2, 2, 0}), "total_tokens: expected an int in [1, 4096], got 0");
  CHECK_THROWS_WITH(DraftTreeBatch(0, DraftTreeParams{2, 2, 5}), "batch: expected at least 1 request, got 0");

  DraftTreeBuilder b(DraftTreeParams{2, 2, 5});
  std::vector<int32_t> tok = {1, 2}, tok3 = {1, 2, 3}, neg = {1, -4};
  std::vector<float> lp = {-1.0f, -2.0f}, lp_inf = {kInf, -1.0f};
  std::vector<int32_t> t4 = {1, 2, 3, 4};
  std::vector<float> l4 = {-1.0f, -1.0f, -1.0f, -1.0f};
  CHECK_THROWS_WITH(b.expand(view2(t4, 2, 2), view2(l4, 2, 2)), "expand: the tree has no root yet");
  CHECK_THROWS_WITH(b.finalize(), "finalize: the tree has no root yet");
  CHECK_THROWS_WITH(b.expand_root(-1, view1(tok), view1(lp)), "root_tokens: expected a token id in [0, 2^31), got -1");
  CHECK_THROWS_WITH(b.expand_root(0, view1(tok3), view1(lp)), "tokens: expected size 2 in dim 0");
  CHECK_THROWS_WITH(b.expand_root(0, view1(lp), view1(lp)), "tokens: expected dtype int32 or int64");
  CHECK_THROWS_WITH(b.expand_root(0, view1(tok), view1(tok)), "logprobs: expected dtype float32");
  CHECK_THROWS_WITH(b.expand_root(0, view1(neg), view1(lp)), "tokens: expected token ids in [0, 2^31), got -4 at [1]");
  CHECK_THROWS_WITH(b.expand_root(0, view1(tok), view1(lp_inf)), "got inf at [0]");
  CHECK_THROWS_WITH(b.expand_root(0, TensorView(), view1(lp)), "tokens: a tensor is required");
  TensorView on_gpu = view1(lp);
  on_gpu.device = Device::kCUDA;
  CHECK_THROWS_WITH(b.expand_root(0, view1(tok), on_gpu), "logprobs: expected a tensor on cpu");
  b.expand_root(0, view1(tok), view1(lp));
  CHECK_THROWS_WITH(b.expand(view1(t4), view2(l4, 2, 2)), "tokens: expected a 2-d tensor");
  b.expand(view2(t4, 2, 2), view2(l4, 2, 2));
  CHECK_THROWS_WITH(b.expand(view2(t4, 2, 2), view2(l4, 2, 2)), "expand: the tree already has depth=2 levels");

  DraftTreeBatch batch(1, DraftTreeParams{2, 2, 5});
  std::vector<int32_t> roots = {0}, frontier(2);
  batch.expand_root(view1(roots), view2(tok, 1, 2), view2(lp, 1, 2), DraftFrontierViews{});
  std::vector<int32_t> out(6), mask(3), paths(4), leaves(1), max_depth(1);
  std::vector<float> scores(3);
  DraftTreeViews v;
  v.tokens = view2(out, 1, 3);
  v.parents = view2(out, 1, 3);
  v.depth = view2(out, 1, 3);
  v.scores = view2(scores, 1, 3);
  v.mask_words = TensorView::contiguous(mask.data(), DType::kInt32, {1, 3, 1});
  v.paths = TensorView::contiguous(paths.data(), DType::kInt32, {1, 2, 3});  // L = levels + 1 = 2
  v.num_leaves = view1(leaves);
  v.max_depth = view1(max_depth);
  CHECK_THROWS_WITH(batch.finalize(v), "paths: expected size 2 in dim 2");
  v.paths = TensorView::contiguous(paths.data(), DType::kInt32, {1, 2, 2});
  v.tokens.strides[1] = 0;
  CHECK_THROWS_WITH(batch.finalize(v), "tokens: an output needs positive strides");
  v.tokens.strides[1] = 1;
  CHECK(batch.finalize(v) == 2);
}
