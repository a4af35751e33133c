// select_cost_aware: see cpp/include/moespec/select_cost_aware.h (contract and semantics).
#include "moespec/select_cost_aware.h"

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "moespec/error.h"

namespace moespec {
namespace {

// A repeated id in one layer's prediction counts once (its first slot).
bool repeat(const int32_t* e, int64_t k) {
  for (int64_t j = 0; j < k; ++j)
    if (e[j] == e[k]) return true;
  return false;
}

// cost(c) = token_s + sum_l expert_s[l] sum_k p (1 - B), summed from token_s on, layer after layer:
// the order of the Python reference (cost_aware.marginal_cost) and of the CUDA kernel, so that all
// three round alike.
double marginal_cost(double token_s, const int32_t* e, const float* p, const float* buf, const float* expert_s,
                     int64_t L, int64_t K, int64_t N) {
  double cost = token_s;
  for (int64_t l = 0; l < L; ++l, e += K) {
    double fresh = 0.0;
    for (int64_t k = 0; k < K; ++k)
      if (!repeat(e, k)) fresh += (p ? p[l * K + k] : 1.0) * (1.0 - buf[l * N + e[k]]);
    cost += static_cast<double>(expert_s[l]) * fresh;
  }
  return cost;
}

}  // namespace

SelectCostAwareResult select_cost_aware(const SelectCostAwareArgs& a) {
  check_not_null(a.parents, "parents");
  const int64_t C = a.parents.ndim == 1 ? a.parents.shape[0] : -1;
  check_not_null(a.predicted, "predicted");
  const bool p3 = a.predicted.ndim == 3;
  const int64_t L = p3 ? a.predicted.shape[1] : -1, K = p3 ? a.predicted.shape[2] : -1;
  check_not_null(a.buffer, "buffer");
  const int64_t N = a.buffer.ndim == 2 ? a.buffer.shape[1] : -1;
  check_view(a.parents, "parents", {DType::kInt32}, {C});
  check_view(a.depth, "depth", {DType::kInt32}, {C});
  check_view(a.scores, "scores", {DType::kFloat32}, {C});
  check_view(a.predicted, "predicted", {DType::kInt32}, {C, L, K});
  if (a.predicted_p.defined()) check_view(a.predicted_p, "predicted_p", {DType::kFloat32}, {C, L, K});
  check_view(a.buffer, "buffer", {DType::kFloat32}, {L, N});
  check_view(a.expert_s, "expert_s", {DType::kFloat32}, {L});
  check_view(a.selected, "selected", {DType::kInt32}, {C});
  for (const auto& [view, name] : {std::pair{&a.parents, "parents"}, std::pair{&a.depth, "depth"},
                                   std::pair{&a.scores, "scores"}, std::pair{&a.predicted, "predicted"},
                                   std::pair{&a.predicted_p, "predicted_p"}, std::pair{&a.buffer, "buffer"},
                                   std::pair{&a.expert_s, "expert_s"}, std::pair{&a.selected, "selected"}})
    if (view->defined()) check_contiguous(*view, name);
  MOESPEC_CHECK_ARG(a.total_tokens >= 1, "total_tokens", "must be >= 1, got ", a.total_tokens);
  MOESPEC_CHECK_ARG(a.step_s >= 0 && a.token_s >= 0, "step_s", "step_s and token_s must be >= 0, got ", a.step_s,
                    " and ", a.token_s);
  MOESPEC_CHECK_ARG(a.accepted > 0 && std::isfinite(a.accepted), "accepted", "must be finite and > 0, got ",
                    a.accepted);
  const int32_t* parent = a.parents.ptr<const int32_t>();
  const int32_t* depth = a.depth.ptr<const int32_t>();
  const float* score = a.scores.ptr<const float>();
  const int32_t* pred = a.predicted.ptr<const int32_t>();
  const float* prob = a.predicted_p.defined() ? a.predicted_p.ptr<const float>() : nullptr;
  float* buf = a.buffer.ptr<float>();
  const float* expert_s = a.expert_s.ptr<const float>();
  bool any_cost = a.token_s > 0;
  for (int64_t l = 0; l < L; ++l) {
    MOESPEC_CHECK_ARG(expert_s[l] >= 0, "expert_s", "must be >= 0, got ", expert_s[l], " at layer ", l);
    any_cost = any_cost || expert_s[l] > 0;
  }
  for (int64_t c = 0; c < C; ++c) {
    MOESPEC_CHECK_ARG(parent[c] >= -1 && parent[c] < c, "parents", "candidate ", c, " has parent ", parent[c],
                      "; parents must be -1 or earlier candidates");
    MOESPEC_CHECK_ARG(!(std::isnan(score[c]) || score[c] == INFINITY), "scores", "candidate ", c,
                      " has score ", score[c], " (must be finite or -inf)");
  }
  for (int64_t i = 0; i < C * L * K; ++i) {
    MOESPEC_CHECK_ARG(pred[i] >= 0 && pred[i] < N, "predicted", "expert id ", pred[i], " outside [0, N=", N, ")");
    MOESPEC_CHECK_ARG(!prob || (prob[i] >= 0 && prob[i] <= 1), "predicted_p", "probability ", prob ? prob[i] : 0,
                      " outside [0, 1]");
  }
  for (int64_t i = 0; i < L * N; ++i)
    MOESPEC_CHECK_ARG(buf[i] >= 0 && buf[i] <= 1, "buffer", "entry ", buf[i], " outside [0, 1]");

  std::vector<uint8_t> chosen(static_cast<std::size_t>(C), 0);
  int32_t* out = a.selected.ptr<int32_t>();
  const int64_t limit = std::min<int64_t>(a.total_tokens, C);
  SelectCostAwareResult r{0, a.step_s, a.accepted};
  while (r.count < limit) {
    int64_t best = -1;
    double best_gain = 0.0, best_cost = 0.0, best_accept = 0.0;
    const double rate = r.step_s / r.accepted;  // the step's time per emitted token so far
    for (int64_t c = 0; c < C; ++c) {
      if (chosen[c] || (parent[c] >= 0 && !chosen[parent[c]])) continue;
      const double cost =
          marginal_cost(a.token_s, pred + c * L * K, prob ? prob + c * L * K : nullptr, buf, expert_s, L, K, N);
      const double accept = std::isfinite(score[c]) ? std::exp(static_cast<double>(score[c])) : 0.0;
      const double gain = rate * accept - cost;
      const bool better = best < 0 || gain > best_gain ||
                          (gain == best_gain && (score[c] > score[best] ||
                                                 (score[c] == score[best] && (depth[c] < depth[best] ||
                                                                              (depth[c] == depth[best] && c < best)))));
      if (better) {
        best = c;
        best_gain = gain;
        best_cost = cost;
        best_accept = accept;
      }
    }
    if (best < 0 || (best_gain <= 0 && any_cost)) break;
    chosen[best] = 1;
    out[r.count++] = static_cast<int32_t>(best);
    r.step_s += best_cost;
    r.accepted += best_accept;
    for (int64_t l = 0; l < L; ++l)
      for (int64_t k = 0; k < K; ++k) {
        const int64_t i = (best * L + l) * K + k;
        if (repeat(pred + (best * L + l) * K, k)) continue;
        float& b = buf[l * N + pred[i]];
        b = 1.0f - (1.0f - b) * (1.0f - (prob ? prob[i] : 1.0f));
      }
  }
  return r;
}

}  // namespace moespec
