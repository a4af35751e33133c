// Unit tests of route_experts (cpp/src/route_experts*.cc): every ISA against the scalar reference,
// the budget invariants, and the argument errors. Numerical parity with transformers and the
// plain-torch reference is tested in Python (tests/python/test_route_experts*.py).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <set>
#include <vector>

#include "check.h"
#include "moespec/cpu_isa.h"
#include "moespec/detail/route_math.h"
#include "moespec/error.h"
#include "moespec/route_experts.h"
#include "route_experts_simd.h"

using namespace moespec;

namespace {

// Owns the buffers of one route_experts call.
struct Call {
  int64_t T, N, K;
  std::vector<float> logits, bias, token_weights;
  std::vector<int32_t> ids, active, stats;
  std::vector<float> weights;
  RouteExpertsArgs args;

  Call(int64_t T_, int64_t N_, RouterSpec spec, uint32_t seed, float scale = 3.0f) : T(T_), N(N_), K(spec.top_k) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, scale);
    logits.resize(T * N);
    for (float& x : logits) x = normal(rng);
    if (spec.family == RouterFamily::kDeepSeekV3) {
      bias.resize(N);
      for (float& x : bias) x = 0.1f * normal(rng);
    }
    ids.assign(T * K, -1);
    weights.assign(T * K, -1.0f);
    active.assign(N, -1);
    stats.assign(kRoutingStatsSize, -1);
    args.spec = spec;
  }

  const RouteExpertsArgs& build() {
    args.router_logits = TensorView::contiguous(logits.data(), DType::kFloat32, {T, N});
    args.bias = bias.empty() ? TensorView() : TensorView::contiguous(bias.data(), DType::kFloat32, {N});
    args.token_weights =
        token_weights.empty() ? TensorView() : TensorView::contiguous(token_weights.data(), DType::kFloat32, {T});
    args.ids = TensorView::contiguous(ids.data(), DType::kInt32, {T, K});
    args.weights = TensorView::contiguous(weights.data(), DType::kFloat32, {T, K});
    args.active = TensorView::contiguous(active.data(), DType::kInt32, {N});
    args.stats = TensorView::contiguous(stats.data(), DType::kInt32, {kRoutingStatsSize});
    return args;
  }

  void run() { cpu::route_experts(build()); }

  std::set<int32_t> natural_union() {
    Call plain(*this);
    plain.args.budget = ExpertBudget{};
    plain.run();
    return std::set<int32_t>(plain.ids.begin(), plain.ids.end());
  }
};

RouterSpec softmax_spec(int k, bool renorm) {
  RouterSpec s;
  s.family = RouterFamily::kSoftmax;
  s.top_k = k;
  s.renormalize = renorm;
  return s;
}

RouterSpec deepseek_spec(int k, int n_group, int topk_group) {
  RouterSpec s;
  s.family = RouterFamily::kDeepSeekV3;
  s.top_k = k;
  s.renormalize = true;
  s.n_group = n_group;
  s.topk_group = topk_group;
  s.scaling = 2.5f;
  return s;
}

RouterSpec gpt_oss_spec(int k) {
  RouterSpec s;
  s.family = RouterFamily::kGptOss;
  s.top_k = k;
  return s;
}

std::vector<RouterSpec> all_specs(int k) {
  return {softmax_spec(k, false), softmax_spec(k, true), deepseek_spec(k, 8, 4), gpt_oss_spec(k)};
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

struct IsaGuard {
  CpuIsa saved = active_cpu_isa();
  ~IsaGuard() { set_active_cpu_isa(saved); }
};

}  // namespace

// Subnormal results have an ulp of 2^-149.
TEST(exp_ref_is_within_two_ulp_of_libm) {
  CHECK(detail::exp_ref(0.0f) == 1.0f);
  CHECK(detail::exp_ref(-200.0f) == 0.0f);
  CHECK(std::isinf(detail::exp_ref(101.0f)));
  for (float x = -103.0f; x < 88.0f; x += 0.0137f) {
    const double want = std::exp(static_cast<double>(x));
    const double got = detail::exp_ref(x);
    CHECK_MSG(std::fabs(got - want) <= 2.5 * std::ldexp(1.0, std::max(std::ilogb(want), -126) - 23), std::to_string(x));
  }
}

TEST(short_sum_matches_exact_sum_closely) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  for (int k = 1; k <= kMaxTopK; ++k) {
    std::vector<float> v(k);
    double exact = 0;
    for (float& x : v) exact += (x = u(rng));
    CHECK_MSG(std::fabs(detail::short_sum_ref(v.data(), k) - exact) <= 1e-5 * k, std::to_string(k));
  }
}

TEST(every_isa_computes_bit_identical_probabilities) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 4.0f);
  const auto& scalar = cpu::route_math_kernels(CpuIsa::kScalar);
  for (CpuIsa isa : supported_cpu_isas()) {
    const auto& k = cpu::route_math_kernels(isa);
    for (int n : {1, 2, 3, 7, 8, 9, 15, 16, 17, 23, 31, 32, 33, 60, 64, 100, 128, 255, 256, 257, 512, 1000}) {
      for (int width : {8, 16}) {
        const int rows = 3;
        std::vector<float> x(rows * (n + 5)), want(rows * n), got(rows * n);
        for (float& v : x) v = normal(rng);
        scalar.softmax_rows(x.data(), n + 5, want.data(), n, rows, n, width);
        k.softmax_rows(x.data(), n + 5, got.data(), n, rows, n, width);
        CHECK_MSG(same_bits(want, got), std::string(cpu_isa_name(isa)) + " softmax n=" + std::to_string(n) +
                                            " width=" + std::to_string(width));
      }
      std::vector<float> x(n), want(n), got(n);
      for (float& v : x) v = 10.0f * normal(rng);
      scalar.sigmoid(x.data(), want.data(), n);
      k.sigmoid(x.data(), got.data(), n);
      CHECK_MSG(same_bits(want, got), std::string(cpu_isa_name(isa)) + " sigmoid n=" + std::to_string(n));
    }
  }
}

TEST(every_isa_routes_identically) {
  IsaGuard guard;
  uint32_t seed = 1;
  for (const RouterSpec& spec : all_specs(4)) {
    for (int budget : {0, 6, 12}) {
      for (BudgetPolicy policy : {BudgetPolicy::kSubstitution, BudgetPolicy::kTruncation}) {
        Call ref(37, 64, spec, ++seed);
        ref.args.budget = ExpertBudget{budget, policy, 0.0f};
        set_active_cpu_isa(CpuIsa::kScalar);
        ref.run();
        for (CpuIsa isa : supported_cpu_isas()) {
          Call c = ref;
          set_active_cpu_isa(isa);
          c.run();
          CHECK_MSG(c.ids == ref.ids && same_bits(c.weights, ref.weights) && c.active == ref.active &&
                        c.stats == ref.stats,
                    cpu_isa_name(isa));
        }
      }
    }
  }
}

TEST(budget_invariants_hold) {
  uint32_t seed = 100;
  for (int k : {1, 2, 4, 8}) {
    for (const RouterSpec& spec : all_specs(k)) {
      for (int B : {k, k + 1, 2 * k, 24, 64}) {
        for (BudgetPolicy policy : {BudgetPolicy::kSubstitution, BudgetPolicy::kTruncation}) {
          Call c(50, 64, spec, ++seed);
          const std::set<int32_t> natural = c.natural_union();
          c.args.budget = ExpertBudget{B, policy, 0.0f};
          c.run();
          const int32_t kept = c.stats[1];
          CHECK(c.stats[0] == static_cast<int32_t>(natural.size()));
          CHECK(kept <= std::max<int32_t>(B, 0) || static_cast<int>(natural.size()) <= B);
          std::set<int32_t> used;
          for (int32_t id : c.ids)
            if (id < c.N) used.insert(id);
          CHECK(static_cast<int32_t>(used.size()) == kept);
          CHECK(std::equal(used.begin(), used.end(), c.active.begin()));
          for (int64_t e = kept; e < c.N; ++e) CHECK(c.active[e] == c.N);
          if (static_cast<int>(natural.size()) <= B) {  // the cap does not bind: untouched
            Call plain = c;
            plain.args.budget = ExpertBudget{};
            plain.run();
            CHECK(plain.ids == c.ids && same_bits(plain.weights, c.weights));
            CHECK(c.stats[2] == 0 && c.stats[3] == 0);
            continue;
          }
          for (int64_t t = 0; t < c.T; ++t) {
            std::set<int32_t> row;
            int dropped = 0;
            for (int64_t j = 0; j < k; ++j) {
              const int32_t id = c.ids[t * k + j];
              if (id == c.N) {
                ++dropped;
                CHECK(c.weights[t * k + j] == 0.0f);
              } else {
                row.insert(id);
              }
            }
            if (policy == BudgetPolicy::kSubstitution) CHECK(dropped == 0 && static_cast<int>(row.size()) == k);
            double sum = 0;
            for (int64_t j = 0; j < k; ++j) sum += c.weights[t * k + j];
            const bool renormalized = spec.renormalize || spec.family == RouterFamily::kGptOss;
            if (renormalized && dropped < k) {
              const double want = spec.family == RouterFamily::kDeepSeekV3 ? spec.scaling : 1.0;
              CHECK_MSG(std::fabs(sum - want) < 1e-5 * want, std::to_string(sum));
            }
          }
          if (policy == BudgetPolicy::kSubstitution) CHECK(c.stats[3] == 0 && c.stats[2] > 0);
          if (policy == BudgetPolicy::kTruncation) CHECK(c.stats[2] == 0 && c.stats[3] > 0);
        }
      }
    }
  }
}

TEST(coverage_keeps_a_mass_prefix_within_the_budget) {
  Call c(40, 64, softmax_spec(4, true), 5);
  const size_t natural = c.natural_union().size();
  c.args.budget = ExpertBudget{64, BudgetPolicy::kSubstitution, 0.5f};
  c.run();
  CHECK(c.stats[1] >= 4 && static_cast<size_t>(c.stats[1]) < natural);
  Call tighter = c;
  tighter.args.budget.max_experts = 5;
  tighter.run();
  CHECK(tighter.stats[1] <= 5);
  Call full = c;
  full.args.budget.coverage = 1.0f;
  full.run();  // coverage 1 keeps every expert with mass: the cap does not bind
  CHECK(full.stats[2] == 0);
}

TEST(gates_score_keeps_each_tokens_first_choice) {
  // (softmax and gpt_oss: their substitution key orders experts as their weights do)
  for (const RouterSpec& spec : {softmax_spec(4, false), softmax_spec(4, true), gpt_oss_spec(4)}) {
    Call plain(12, 64, spec, 21);
    plain.run();
    std::vector<int32_t> first(plain.T);
    std::set<int32_t> distinct;
    for (int64_t t = 0; t < plain.T; ++t) {  // the heaviest natural slot, ties: the lower id
      int64_t best = t * plain.K;
      for (int64_t i = t * plain.K; i < (t + 1) * plain.K; ++i)
        if (plain.weights[i] > plain.weights[best] ||
            (plain.weights[i] == plain.weights[best] && plain.ids[i] < plain.ids[best]))
          best = i;
      first[t] = plain.ids[best];
      distinct.insert(first[t]);
    }
    Call c = plain;
    const int32_t budget = std::max<int32_t>(4, static_cast<int32_t>(distinct.size()));
    c.args.budget = ExpertBudget{budget, BudgetPolicy::kSubstitution, 0.0, BudgetScore::kGates};
    c.run();
    CHECK(c.stats[1] <= budget && c.stats[2] > 0);  // the cap binds, and every token keeps its first choice
    for (int64_t t = 0; t < c.T; ++t)
      CHECK(std::find(c.ids.begin() + t * c.K, c.ids.begin() + (t + 1) * c.K, first[t]) != c.ids.begin() + (t + 1) * c.K);
  }
}

TEST(token_weights_change_the_budget_scores) {
  Call a(30, 64, softmax_spec(2, false), 9);
  a.args.budget = ExpertBudget{4, BudgetPolicy::kSubstitution, 0.0f};
  a.run();
  Call b = a;
  b.token_weights.assign(b.T, 0.0f);
  b.token_weights[0] = 1.0f;  // only token 0 counts: S is its favourite experts
  b.run();
  Call first = b;
  first.args.budget = ExpertBudget{};
  first.run();
  for (int j = 0; j < 2; ++j) CHECK(b.ids[j] == first.ids[j]);
  CHECK(a.ids != b.ids);
}

TEST(zero_tokens_is_fine) {
  Call c(0, 16, softmax_spec(2, true), 3);
  c.args.budget = ExpertBudget{4, BudgetPolicy::kTruncation, 0.0f};
  c.run();
  CHECK(c.stats[0] == 0 && c.stats[1] == 0);
  CHECK(std::all_of(c.active.begin(), c.active.end(), [&](int32_t x) { return x == 16; }));
}

TEST(bad_arguments_are_named) {
  {
    Call c(4, 16, softmax_spec(4, true), 1);
    c.args.budget = ExpertBudget{3, BudgetPolicy::kSubstitution, 0.0f};
    CHECK_THROWS_WITH(c.run(), "budget.max_experts: a budget of 3 experts is below top_k=4");
  }
  {
    Call c(4, 16, softmax_spec(4, true), 1);
    c.logits[5] = NAN;
    CHECK_THROWS_WITH(c.run(), "router_logits: non-finite value nan at token 0, expert 5");
    c.logits[5] = INFINITY;
    CHECK_THROWS_WITH(c.run(), "non-finite value inf");
  }
  {
    Call c(4, 16, softmax_spec(4, true), 1);
    c.bias.assign(16, 0.0f);
    CHECK_THROWS_WITH(c.run(), "bias: only family='deepseek_v3' takes a bias");
  }
  {
    Call c(4, 16, softmax_spec(17, true), 1);
    CHECK_THROWS_WITH(c.run(), "spec.top_k: top_k must be in [1, min(N, 64)] with N = 16 experts, got 17");
  }
  {
    Call c(4, 16, softmax_spec(2, true), 1);
    c.args.budget.coverage = 1.5f;
    CHECK_THROWS_WITH(c.run(), "budget.coverage: must be in (0, 1]");
  }
  {
    Call c(4, 16, softmax_spec(2, true), 1);
    c.args.budget.score = static_cast<BudgetScore>(2);
    CHECK_THROWS_WITH(c.run(), "budget.score: unknown score 2 (0: probability, 1: gates)");
  }
  {
    Call c(4, 16, softmax_spec(2, true), 1);
    c.build();
    c.args.ids.shape[1] = 3;
    CHECK_THROWS_WITH(cpu::route_experts(c.args), "ids: expected size 2 in dim 1");
  }
  {
    Call c(4, 16, deepseek_spec(4, 3, 2), 1);
    CHECK_THROWS_WITH(c.run(), "spec.n_group: n_group must divide the 16 experts, got 3");
  }
  {
    Call c(4, 16, deepseek_spec(8, 8, 2), 1);
    CHECK_THROWS_WITH(c.run(), "spec.top_k: top_k=8 exceeds the 4 experts of the topk_group=2 kept groups");
  }
  {
    Call c(4, 16, softmax_spec(2, true), 1);
    c.args.softmax_vector_width = 4;
    CHECK_THROWS_WITH(c.run(), "softmax_vector_width: must be 8 or 16");
  }
  {
    Call c(4, 16, softmax_spec(2, true), 1);
    c.token_weights.assign(4, 1.0f);
    c.token_weights[2] = -1.0f;
    CHECK_THROWS_WITH(c.run(), "token_weights: must be finite and >= 0, got -1 at token 2");
  }
}

TEST(cuda_entry_point_reports_a_cpu_only_build) {
  if (cuda::available()) return;
  Call c(4, 16, softmax_spec(2, true), 1);
  CHECK_THROWS_WITH(cuda::route_experts(c.build(), nullptr, 0, nullptr), "built without CUDA");
}
