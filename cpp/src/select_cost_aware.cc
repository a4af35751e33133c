// select_cost_aware: see cpp/include/moespec/select_cost_aware.h (contract and semantics).
#include "moespec/select_cost_aware.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "moespec/error.h"

namespace moespec {

int64_t select_cost_aware(const SelectCostAwareArgs& a) {
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
  check_view(a.buffer, "buffer", {DType::kUInt8}, {L, N});
  check_view(a.expert_s, "expert_s", {DType::kFloat32}, {L});
  check_view(a.selected, "selected", {DType::kInt32}, {C});
  for (const auto& [view, name] : {std::pair{&a.parents, "parents"}, std::pair{&a.depth, "depth"},
                                   std::pair{&a.scores, "scores"}, std::pair{&a.predicted, "predicted"},
                                   std::pair{&a.buffer, "buffer"}, std::pair{&a.expert_s, "expert_s"},
                                   std::pair{&a.selected, "selected"}})
    check_contiguous(*view, name);
  MOESPEC_CHECK_ARG(a.total_tokens >= 1, "total_tokens", "must be >= 1, got ", a.total_tokens);
  MOESPEC_CHECK_ARG(a.value_s >= 0 && a.token_s >= 0, "value_s", "value_s and token_s must be >= 0, got ", a.value_s,
                    " and ", a.token_s);
  const int32_t* parent = a.parents.ptr<const int32_t>();
  const int32_t* depth = a.depth.ptr<const int32_t>();
  const float* score = a.scores.ptr<const float>();
  const int32_t* pred = a.predicted.ptr<const int32_t>();
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
  for (int64_t i = 0; i < C * L * K; ++i)
    MOESPEC_CHECK_ARG(pred[i] >= 0 && pred[i] < N, "predicted", "expert id ", pred[i], " outside [0, N=", N, ")");

  std::vector<uint8_t> buf(static_cast<std::size_t>(L * N));
  std::memcpy(buf.data(), a.buffer.ptr<const uint8_t>(), buf.size());
  std::vector<uint8_t> chosen(static_cast<std::size_t>(C), 0);
  int32_t* out = a.selected.ptr<int32_t>();
  const int64_t limit = std::min<int64_t>(a.total_tokens, C);
  int64_t count = 0;
  while (count < limit) {
    int64_t best = -1;
    double best_gain = 0.0;
    for (int64_t c = 0; c < C; ++c) {
      if (chosen[c] || (parent[c] >= 0 && !chosen[parent[c]])) continue;
      double cost = a.token_s;
      for (int64_t l = 0; l < L; ++l) {
        const int32_t* e = pred + (c * L + l) * K;
        int64_t fresh = 0;
        for (int64_t k = 0; k < K; ++k) {
          bool repeat = false;  // a repeated id in one prediction counts once
          for (int64_t j = 0; j < k; ++j) repeat = repeat || e[j] == e[k];
          fresh += !repeat && !buf[l * N + e[k]];
        }
        cost += static_cast<double>(expert_s[l]) * static_cast<double>(fresh);
      }
      const double value = std::isfinite(score[c]) ? a.value_s * std::exp(static_cast<double>(score[c])) : 0.0;
      const double gain = value - cost;
      const bool better = best < 0 || gain > best_gain ||
                          (gain == best_gain && (score[c] > score[best] ||
                                                 (score[c] == score[best] && (depth[c] < depth[best] ||
                                                                              (depth[c] == depth[best] && c < best)))));
      if (better) {
        best = c;
        best_gain = gain;
      }
    }
    if (best < 0 || (best_gain <= 0 && any_cost)) break;
    chosen[best] = 1;
    out[count++] = static_cast<int32_t>(best);
    for (int64_t l = 0; l < L; ++l)
      for (int64_t k = 0; k < K; ++k) buf[l * N + pred[(best * L + l) * K + k]] = 1;
  }
  return count;
}

}  // namespace moespec
