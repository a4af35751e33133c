// route_experts on the CPU: routing families + MoE-Spec expert budget (the reference semantics).
//
// Contract and semantics: cpp/include/moespec/route_experts.h. CUDA counterpart:
// cpp/kernels/route_experts.cu. Plain-torch reference used by the tests:
// python/moespec/ops/reference.py. The SIMD probability maps live in route_experts_avx2.cc and
// route_experts_avx512.cc; everything else (top-k, budget, weights) is scalar and shared.
#include "moespec/route_experts.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <utility>
#include <vector>

#include "moespec/cpu_isa.h"
#include "moespec/detail/route_math.h"
#include "moespec/error.h"
#include "aligned_buffer.h"
#include "route_experts_simd.h"

namespace moespec {

// ---------------------------------------------------------------------------------------------
// Validation (shared by the CPU and CUDA entry points)

void validate_route_experts(const RouteExpertsArgs& a, Device device) {
  check_not_null(a.router_logits, "router_logits");
  check_ndim(a.router_logits, "router_logits", 2);
  check_dtype(a.router_logits, "router_logits", {DType::kFloat32, DType::kBFloat16, DType::kFloat16});
  check_device(a.router_logits, "router_logits", device);
  MOESPEC_CHECK_ARG(a.router_logits.strides[1] == 1 && a.router_logits.strides[0] >= a.router_logits.shape[1],
                    "router_logits", "expected rows of contiguous experts (stride 1 in dim 1), got strides [",
                    a.router_logits.strides[0], ", ", a.router_logits.strides[1], "]");
  const int64_t T = a.router_logits.shape[0];
  const int64_t N = a.router_logits.shape[1];
  const int32_t device_index = a.router_logits.device_index;
  MOESPEC_CHECK_ARG(N >= 1 && N <= kMaxExperts, "router_logits", "number of experts N (dim 1) must be in [1, ",
                    kMaxExperts, "], got ", N);
  const RouterSpec& s = a.spec;
  MOESPEC_CHECK_ARG(s.family == RouterFamily::kSoftmax || s.family == RouterFamily::kDeepSeekV3 ||
                        s.family == RouterFamily::kGptOss,
                    "spec.family", "unknown router family ", static_cast<int>(s.family));
  MOESPEC_CHECK_ARG(s.top_k >= 1 && s.top_k <= kMaxTopK && s.top_k <= N, "spec.top_k",
                    "top_k must be in [1, min(N, ", kMaxTopK, ")] with N = ", N, " experts, got ", s.top_k);
  const int64_t K = s.top_k;
  if (s.family == RouterFamily::kDeepSeekV3) {
    MOESPEC_CHECK_ARG(s.n_group >= 1 && N % s.n_group == 0, "spec.n_group", "n_group must divide the ", N,
                      " experts, got ", s.n_group);
    MOESPEC_CHECK_ARG(s.n_group == 1 || N / s.n_group >= 2, "spec.n_group",
                      "each group needs at least 2 experts (its score is the sum of its best two), got ",
                      N / s.n_group, " experts per group");
    MOESPEC_CHECK_ARG(s.topk_group >= 1 && s.topk_group <= s.n_group, "spec.topk_group",
                      "topk_group must be in [1, n_group=", s.n_group, "], got ", s.topk_group);
    MOESPEC_CHECK_ARG(K <= static_cast<int64_t>(s.topk_group) * (N / s.n_group), "spec.top_k", "top_k=", K,
                      " exceeds the ", s.topk_group * (N / s.n_group), " experts of the topk_group=", s.topk_group,
                      " kept groups");
    MOESPEC_CHECK_ARG(std::isfinite(s.scaling), "spec.scaling", "must be finite, got ", s.scaling);
  } else {
    MOESPEC_CHECK_ARG(!a.bias.defined(), "bias",
                      "only family='deepseek_v3' takes a bias (e_score_correction_bias); for gpt_oss the router "
                      "bias belongs in router_logits");
  }
  if (a.bias.defined()) {
    check_ndim(a.bias, "bias", 1);
    check_dim(a.bias, "bias", 0, N);
    check_dtype(a.bias, "bias", {DType::kFloat32});
    check_contiguous(a.bias, "bias");
    check_device(a.bias, "bias", device, device_index);
  }
  if (a.token_weights.defined()) {
    check_ndim(a.token_weights, "token_weights", 1);
    check_dim(a.token_weights, "token_weights", 0, T);
    check_dtype(a.token_weights, "token_weights", {DType::kFloat32});
    check_contiguous(a.token_weights, "token_weights");
    check_device(a.token_weights, "token_weights", device, device_index);
  }
  const ExpertBudget& b = a.budget;
  MOESPEC_CHECK_ARG(b.max_experts >= 0, "budget.max_experts", "must be >= top_k, got ", b.max_experts);
  MOESPEC_CHECK_ARG(b.max_experts == 0 || b.max_experts >= K, "budget.max_experts", "a budget of ", b.max_experts,
                    " experts is below top_k=", K, ": one token alone needs ", K, " experts");
  MOESPEC_CHECK_ARG(b.policy == BudgetPolicy::kSubstitution || b.policy == BudgetPolicy::kTruncation,
                    "budget.policy", "unknown policy ", static_cast<int>(b.policy));
  MOESPEC_CHECK_ARG(b.score == BudgetScore::kProbability || b.score == BudgetScore::kGates, "budget.score",
                    "unknown score ", static_cast<int>(b.score), " (0: probability, 1: gates)");
  MOESPEC_CHECK_ARG(b.coverage >= 0.0 && b.coverage <= 1.0, "budget.coverage",
                    "must be in (0, 1] (or 0 for off), got ", b.coverage);
  MOESPEC_CHECK_ARG(a.softmax_vector_width == 8 || a.softmax_vector_width == 16, "softmax_vector_width",
                    "must be 8 or 16, got ", a.softmax_vector_width);
  struct Out {
    const TensorView& t;
    const char* name;
    DType dtype;
    std::initializer_list<int64_t> shape;
  };
  for (const Out& o : {Out{a.ids, "ids", DType::kInt32, {T, K}}, Out{a.weights, "weights", DType::kFloat32, {T, K}},
                       Out{a.active, "active", DType::kInt32, {N}},
                       Out{a.stats, "stats", DType::kInt32, {kRoutingStatsSize}}}) {
    check_not_null(o.t, o.name);
    check_ndim(o.t, o.name, static_cast<int32_t>(o.shape.size()));
    int d = 0;
    for (int64_t size : o.shape) check_dim(o.t, o.name, d++, size);
    check_dtype(o.t, o.name, {o.dtype});
    check_contiguous(o.t, o.name);
    check_device(o.t, o.name, device, device_index);
  }
}

namespace cpu {

// ---------------------------------------------------------------------------------------------
// SIMD dispatch

namespace scalar {
namespace {
void softmax_rows(const float* x, int64_t ld_x, float* y, int64_t ld_y, int64_t rows, int64_t n, int width) {
  for (int64_t t = 0; t < rows; ++t) detail::softmax_ref(x + t * ld_x, y + t * ld_y, static_cast<int>(n), width);
}
void sigmoid(const float* x, float* y, int64_t count) {
  for (int64_t i = 0; i < count; ++i) y[i] = detail::sigmoid_ref(x[i]);
}
}  // namespace
const RouteMathKernels kRouteMath = {softmax_rows, sigmoid};
}  // namespace scalar

const RouteMathKernels& route_math_kernels(CpuIsa isa) {
  switch (isa) {
#if defined(MOESPEC_HAVE_AVX512)
    case CpuIsa::kAvx512: return avx512::kRouteMath;
#endif
#if defined(MOESPEC_HAVE_AVX2)
    case CpuIsa::kAvx2: return avx2::kRouteMath;
#endif
    default: return scalar::kRouteMath;
  }
}

namespace {

// ---------------------------------------------------------------------------------------------
// PyTorch-identical top-k: same algorithm (partial_sort when k * 64 <= n, else nth_element and,
// when sorted, a sort of the first k - 1), same comparator, hence the same order among ties.

using Entry = std::pair<float, int64_t>;

void topk_like_torch(const float* row, int64_t n, int64_t k, bool sorted, std::vector<Entry>& queue, int32_t* out) {
  queue.resize(static_cast<std::size_t>(n));
  for (int64_t j = 0; j < n; ++j) queue[j] = Entry(row[j], j);
  auto greater = [](const Entry& x, const Entry& y) { return x.first > y.first; };
  if (k * 64 <= n) {
    std::partial_sort(queue.begin(), queue.begin() + k, queue.end(), greater);
  } else {
    std::nth_element(queue.begin(), queue.begin() + (k - 1), queue.end(), greater);
    if (sorted) std::sort(queue.begin(), queue.begin() + (k - 1), greater);
  }
  for (int64_t j = 0; j < k; ++j) out[j] = static_cast<int32_t>(queue[j].second);
}

// Fast top-k for sorted results: one pass keeping the k best in a small sorted array. Without ties
// the descending top-k is unique, so it equals topk_like_torch; on any tie among the values it
// compares (a conservative test) it returns false and the caller falls back to topk_like_torch.
// Scans row[candidates[i]] for i < count, or row[0..count) when candidates is null.
bool topk_sorted_fast(const float* row, const int32_t* candidates, int64_t count, int64_t k, int32_t* out) {
  float vals[kMaxTopK];
  int64_t filled = 0;
  for (int64_t c = 0; c < count; ++c) {
    const int32_t e = candidates ? candidates[c] : static_cast<int32_t>(c);
    const float v = row[e];
    if (filled == k) {
      if (v < vals[k - 1]) continue;
      if (v == vals[k - 1]) return false;
    }
    int64_t pos = filled < k ? filled : k - 1;  // the free slot, or the evicted last one
    while (pos > 0 && vals[pos - 1] < v) {
      vals[pos] = vals[pos - 1];
      out[pos] = out[pos - 1];
      --pos;
    }
    if (pos > 0 && vals[pos - 1] == v) return false;
    vals[pos] = v;
    out[pos] = e;
    if (filled < k) ++filled;
  }
  return filled == k;
}

// aten's BFloat16/Half softmax over a short last dim (gpt_oss in reduced precision): the first
// n - n % width values take the vector exp and a lane-tree partial sum, the rest libm's expf and
// a sequential sum; the result is rounded to the reduced type. Returns the rounded values as float.
void softmax_reduced_like_torch(const float* x, float* y, int n, int width, DType dtype) {
  float m = x[0];
  for (int i = 1; i < n; ++i) m = std::max(m, x[i]);
  const int vec = n - n % width;
  float sum = 0.0f;
  if (vec > 0) {
    float lanes[16] = {};
    for (int i = 0; i < vec; ++i) {
      y[i] = detail::exp_ref(x[i] - m);
      lanes[i % width] += y[i];
    }
    for (int half = width / 2; half >= 1; half /= 2)
      for (int l = 0; l < half; ++l) lanes[l] += lanes[l + half];
    sum = lanes[0];
  }
  for (int i = vec; i < n; ++i) {
    y[i] = std::exp(x[i] - m);
    sum += y[i];
  }
  const float r = 1.0f / sum;
  for (int i = 0; i < n; ++i) {
    const float v = y[i] * r;
    y[i] = dtype == DType::kBFloat16 ? detail::bf16_to_float(detail::float_to_bf16(v))
                                     : detail::half_to_float(detail::float_to_half(v));
  }
}

// ---------------------------------------------------------------------------------------------
// The routing itself

struct Scratch {
  std::vector<float> logits;      // [T, N] router logits as float
  std::vector<float> prob;        // [T, N] the family's full probability (softmax or sigmoid)
  std::vector<float> select;      // [N] one token's selection key
  std::vector<int32_t> nat_ids;   // [T, K] natural routing
  std::vector<Entry> queue;       // top-k scratch
  std::vector<double> score;      // [N] budget scores
  std::vector<uint8_t> first;     // [N] score "gates": the first choice of some token
  std::vector<float> nat_w;       // [K] one token's natural weights (score "gates")
  std::vector<int32_t> order;     // [N] experts by descending score
  std::vector<uint8_t> in_set;    // [N] budget set S, or union marks
  std::vector<int32_t> members;   // ids in S, ascending
  std::vector<uint8_t> used;      // [N] experts used after re-routing
  std::vector<float> group_score; // [n_group] deepseek_v3 group scores
};

Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

void load_logits(const RouteExpertsArgs& a, int64_t T, int64_t N, float* out) {
  const TensorView& v = a.router_logits;
  const int64_t ld = v.strides[0];
  for (int64_t t = 0; t < T; ++t) {
    float* dst = out + t * N;
    switch (v.dtype) {
      case DType::kFloat32: std::memcpy(dst, v.ptr<const float>() + t * ld, sizeof(float) * N); break;
      case DType::kBFloat16: {
        const uint16_t* src = v.ptr<const uint16_t>() + t * ld;
        for (int64_t e = 0; e < N; ++e) dst[e] = detail::bf16_to_float(src[e]);
        break;
      }
      default: {
        const uint16_t* src = v.ptr<const uint16_t>() + t * ld;
        for (int64_t e = 0; e < N; ++e) dst[e] = detail::half_to_float(src[e]);
        break;
      }
    }
    for (int64_t e = 0; e < N; ++e)
      MOESPEC_CHECK_ARG(std::isfinite(dst[e]), "router_logits", "non-finite value ", dst[e], " at token ", t,
                        ", expert ", e);
  }
}

class Router {
 public:
  Router(const RouteExpertsArgs& a, Scratch& s)
      : a_(a), s_(s), spec_(a.spec), T_(a.router_logits.shape[0]), N_(a.router_logits.shape[1]),
        K_(a.spec.top_k), width_(a.softmax_vector_width),
        math_(route_math_kernels(active_cpu_isa())),
        bias_(a.bias.defined() ? a.bias.ptr<const float>() : nullptr) {}

  void run() {
    s_.logits.resize(T_ * N_);
    s_.prob.resize(T_ * N_);
    s_.select.resize(N_);
    s_.nat_ids.resize(T_ * K_);
    load_logits(a_, T_, N_, s_.logits.data());
    if (bias_)
      for (int64_t e = 0; e < N_; ++e)
        MOESPEC_CHECK_ARG(std::isfinite(bias_[e]), "bias", "non-finite value ", bias_[e], " at expert ", e);
    if (a_.token_weights.defined()) {
      const float* w = a_.token_weights.ptr<const float>();
      for (int64_t t = 0; t < T_; ++t)
        MOESPEC_CHECK_ARG(std::isfinite(w[t]) && w[t] >= 0.0f, "token_weights",
                          "must be finite and >= 0, got ", w[t], " at token ", t);
    }
    compute_probabilities();
    for (int64_t t = 0; t < T_; ++t) natural_topk(t, s_.nat_ids.data() + t * K_);

    RoutingStats stats;
    const bool capped = choose_budget_set(stats);
    int32_t* ids = a_.ids.ptr<int32_t>();
    float* weights = a_.weights.ptr<float>();
    s_.used.assign(N_, 0);
    for (int64_t t = 0; t < T_; ++t) {
      int32_t* row = ids + t * K_;
      const int32_t* nat = s_.nat_ids.data() + t * K_;
      if (!capped) {
        std::copy(nat, nat + K_, row);
      } else if (a_.budget.policy == BudgetPolicy::kSubstitution) {
        bool all_in_set = true;
        for (int64_t j = 0; j < K_; ++j) all_in_set = all_in_set && s_.in_set[nat[j]];
        if (all_in_set) {
          std::copy(nat, nat + K_, row);
        } else {
          substitute_topk(t, row);
          for (int64_t j = 0; j < K_; ++j) stats.rerouted += std::find(nat, nat + K_, row[j]) == nat + K_ ? 1 : 0;
        }
      } else {
        for (int64_t j = 0; j < K_; ++j) {
          const bool keep = s_.in_set[nat[j]] != 0;
          row[j] = keep ? nat[j] : static_cast<int32_t>(N_);
          stats.dropped += keep ? 0 : 1;
        }
      }
      compute_weights(t, row, weights + t * K_);
      for (int64_t j = 0; j < K_; ++j)
        if (row[j] < N_) s_.used[row[j]] = 1;
    }
    int32_t* active = a_.active.ptr<int32_t>();
    int32_t count = 0;
    for (int64_t e = 0; e < N_; ++e)
      if (s_.used[e]) active[count++] = static_cast<int32_t>(e);
    std::fill(active + count, active + N_, static_cast<int32_t>(N_));
    stats.kept = count;
    int32_t* out = a_.stats.ptr<int32_t>();
    out[0] = stats.natural_unique;
    out[1] = stats.kept;
    out[2] = stats.rerouted;
    out[3] = stats.dropped;
    release_if_large(s_.logits, s_.prob, s_.nat_ids);  // [T, N] and [T, K]; the [N] rows stay
  }

 private:
  bool reduced_gpt_oss() const {
    return spec_.family == RouterFamily::kGptOss && a_.router_logits.dtype != DType::kFloat32;
  }

  // prob = the family's full probability: sigmoid for deepseek_v3, softmax otherwise (gpt_oss
  // needs it only for budget scores).
  void compute_probabilities() {
    if (spec_.family == RouterFamily::kDeepSeekV3) {
      const int64_t total = T_ * N_;
      math_.sigmoid(s_.logits.data(), s_.prob.data(), total);
      // PyTorch's sigmoid kernel runs blocks of two vectors (2 * width floats) and finishes the
      // last total % (2 * width) elements of the tensor with scalar code on libm's expf.
      for (int64_t i = total - total % (2 * width_); i < total; ++i)
        s_.prob[i] = 1.0f / (1.0f + std::exp(-s_.logits[i]));
    } else if (spec_.family == RouterFamily::kSoftmax || a_.budget.max_experts > 0) {
      math_.softmax_rows(s_.logits.data(), N_, s_.prob.data(), N_, T_, N_, width_);
    }
  }

  // The family's natural selection for token t (without a budget), in transformers' slot order.
  void natural_topk(int64_t t, int32_t* out) {
    const float* prob = s_.prob.data() + t * N_;
    switch (spec_.family) {
      case RouterFamily::kSoftmax:
        if (!topk_sorted_fast(prob, nullptr, N_, K_, out)) topk_like_torch(prob, N_, K_, true, s_.queue, out);
        break;
      case RouterFamily::kGptOss: {
        const float* logits = s_.logits.data() + t * N_;
        if (!topk_sorted_fast(logits, nullptr, N_, K_, out)) topk_like_torch(logits, N_, K_, true, s_.queue, out);
        break;
      }
      case RouterFamily::kDeepSeekV3: {
        float* sel = s_.select.data();
        for (int64_t e = 0; e < N_; ++e) sel[e] = prob[e] + (bias_ ? bias_[e] : 0.0f);
        if (spec_.n_group > 1) mask_groups(sel);
        topk_like_torch(sel, N_, K_, false, s_.queue, out);
        break;
      }
    }
  }

  // deepseek_v3's group limit: keep the topk_group groups with the largest sum of their two best
  // biased scores, set every other expert's score to -inf.
  void mask_groups(float* sel) {
    const int64_t G = spec_.n_group, per = N_ / G;
    std::vector<float>& group_score = s_.group_score;
    group_score.resize(G);
    for (int64_t g = 0; g < G; ++g) {
      float best = -INFINITY, second = -INFINITY;
      for (int64_t e = g * per; e < (g + 1) * per; ++e) {
        if (sel[e] > best) {
          second = best;
          best = sel[e];
        } else if (sel[e] > second) {
          second = sel[e];
        }
      }
      group_score[g] = best + second;
    }
    int32_t keep[kMaxExperts];
    topk_like_torch(group_score.data(), G, spec_.topk_group, false, s_.queue, keep);
    uint8_t kept[kMaxExperts] = {};
    for (int32_t i = 0; i < spec_.topk_group; ++i) kept[keep[i]] = 1;
    for (int64_t g = 0; g < G; ++g)
      if (!kept[g]) std::fill(sel + g * per, sel + (g + 1) * per, -INFINITY);
  }

  // Chooses the budget set S (s_.in_set) and fills stats.natural_unique. Returns whether the cap
  // binds, i.e. whether tokens must be re-routed.
  bool choose_budget_set(RoutingStats& stats) {
    s_.in_set.assign(N_, 0);
    for (int64_t i = 0; i < T_ * K_; ++i) s_.in_set[s_.nat_ids[i]] = 1;
    int64_t natural = 0;
    for (int64_t e = 0; e < N_; ++e) natural += s_.in_set[e];
    stats.natural_unique = static_cast<int32_t>(natural);
    const ExpertBudget& b = a_.budget;
    if (b.max_experts == 0) return false;
    int64_t budget = std::min<int64_t>(b.max_experts, N_);
    const bool coverage = b.coverage > 0.0;
    if (!coverage && (budget >= N_ || natural <= budget)) return false;

    score_experts();
    s_.order.resize(N_);
    std::iota(s_.order.begin(), s_.order.end(), 0);
    std::stable_sort(s_.order.begin(), s_.order.end(), [&](int32_t x, int32_t y) {
      return s_.first[x] != s_.first[y] ? s_.first[x] > s_.first[y] : s_.score[x] > s_.score[y];
    });
    if (coverage) {
      double total = 0.0;
      for (int64_t e = 0; e < N_; ++e) total += s_.score[e];
      int64_t m = 1;
      if (total > 0.0) {
        double cumulative = 0.0;
        m = 0;
        for (int64_t i = 0; i < N_; ++i) {
          cumulative += s_.score[s_.order[i]];
          if (cumulative / total < b.coverage) ++m;
        }
        m += 1;
      }
      m = std::min<int64_t>(std::max<int64_t>(m, K_), N_);
      budget = std::min(budget, m);
    }
    if (budget >= N_ || natural <= budget) return false;
    std::fill(s_.in_set.begin(), s_.in_set.end(), 0);
    for (int64_t i = 0; i < budget; ++i) s_.in_set[s_.order[i]] = 1;
    s_.members.clear();
    for (int64_t e = 0; e < N_; ++e)
      if (s_.in_set[e]) s_.members.push_back(static_cast<int32_t>(e));
    return true;
  }

  // The budget's scores s_.score (sums in token order) and first-choice marks s_.first (all 0 for
  // score "probability"): header, step 1.
  void score_experts() {
    s_.score.assign(N_, 0.0);
    s_.first.assign(N_, 0);
    const float* w = a_.token_weights.defined() ? a_.token_weights.ptr<const float>() : nullptr;
    const bool gates = a_.budget.score == BudgetScore::kGates;
    s_.nat_w.resize(K_);
    for (int64_t t = 0; t < T_; ++t) {
      const double wt = w ? static_cast<double>(w[t]) : 1.0;
      if (!gates) {
        const float* p = s_.prob.data() + t * N_;
        for (int64_t e = 0; e < N_; ++e) s_.score[e] += wt * static_cast<double>(p[e]);
        continue;
      }
      const int32_t* nat = s_.nat_ids.data() + t * K_;
      compute_weights(t, nat, s_.nat_w.data());
      int64_t best = 0;
      for (int64_t j = 0; j < K_; ++j) {
        s_.score[nat[j]] += wt * static_cast<double>(s_.nat_w[j]);
        const float wj = s_.nat_w[j], wb = s_.nat_w[best];
        if (wj > wb || (wj == wb && nat[j] < nat[best])) best = j;
      }
      if (wt > 0.0) s_.first[nat[best]] = 1;
    }
  }

  // Substitution: token t's top-K of the family's selection key restricted to S (no group limit).
  void substitute_topk(int64_t t, int32_t* out) {
    const float* key = spec_.family == RouterFamily::kGptOss ? s_.logits.data() + t * N_ : s_.prob.data() + t * N_;
    // S holds >= K experts, so the masked (-inf) ones never make the top-K: scan S alone.
    if (spec_.family != RouterFamily::kDeepSeekV3 &&
        topk_sorted_fast(key, s_.members.data(), static_cast<int64_t>(s_.members.size()), K_, out))
      return;
    float* sel = s_.select.data();
    for (int64_t e = 0; e < N_; ++e) {
      float v = key[e];
      if (spec_.family == RouterFamily::kDeepSeekV3 && bias_) v += bias_[e];
      sel[e] = s_.in_set[e] ? v : -INFINITY;
    }
    topk_like_torch(sel, N_, K_, spec_.family != RouterFamily::kDeepSeekV3, s_.queue, out);
  }

  // The family's weights for token t's final slots (a slot holding N is dropped: weight 0).
  void compute_weights(int64_t t, const int32_t* row, float* out) {
    const float* prob = s_.prob.data() + t * N_;
    const int32_t N = static_cast<int32_t>(N_);
    const int k = static_cast<int>(K_);
    switch (spec_.family) {
      case RouterFamily::kSoftmax: {
        for (int j = 0; j < k; ++j) out[j] = row[j] < N ? prob[row[j]] : 0.0f;
        if (spec_.renormalize) {
          const float sum = detail::short_sum_ref(out, k);
          for (int j = 0; j < k; ++j) out[j] = sum > 0.0f ? out[j] / sum : 0.0f;
        }
        break;
      }
      case RouterFamily::kDeepSeekV3: {
        for (int j = 0; j < k; ++j) out[j] = row[j] < N ? prob[row[j]] : 0.0f;
        if (spec_.renormalize) {
          const float denominator = detail::short_sum_ref(out, k) + 1e-20f;
          for (int j = 0; j < k; ++j) out[j] /= denominator;
        }
        for (int j = 0; j < k; ++j) out[j] *= spec_.scaling;
        break;
      }
      case RouterFamily::kGptOss: {
        const float* logits = s_.logits.data() + t * N_;
        float top[kMaxTopK];
        bool any = false;
        for (int j = 0; j < k; ++j) {
          top[j] = row[j] < N ? logits[row[j]] : -INFINITY;
          any = any || row[j] < N;
        }
        if (!any) {
          std::fill(out, out + k, 0.0f);
        } else if (reduced_gpt_oss()) {
          softmax_reduced_like_torch(top, out, k, width_, a_.router_logits.dtype);
        } else {
          detail::softmax_ref(top, out, k, width_);
        }
        break;
      }
    }
  }

  const RouteExpertsArgs& a_;
  Scratch& s_;
  const RouterSpec& spec_;
  const int64_t T_, N_, K_;
  const int width_;
  const RouteMathKernels& math_;
  const float* bias_;
};

}  // namespace

void route_experts(const RouteExpertsArgs& args) {
  validate_route_experts(args, Device::kCPU);
  Router(args, scratch()).run();
}

}  // namespace cpu
}  // namespace moespec
