// Every moespec TensorRT plugin's enqueue, called directly on device buffers (no libnvinfer, no
// engine), against the C++ CPU core on the same inputs: MoespecRouteExperts vs cpu::route_experts,
// MoespecBudgetedMoe vs cpu::moe_experts, MoespecTreeSelect vs the CPU select_cost_aware carried
// request after request plus the verify tree built here from its choice. Needs a CUDA device: exits
// 77 (ctest's skip) without one; tests/gpu/run.sh runs it on the GPU machine.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "check.h"
#include "moe_experts_plugin.h"
#include "moespec/moe_experts.h"
#include "moespec/route_experts.h"
#include "moespec/select_cost_aware.h"
#include "plugin_test.h"
#include "route_experts_plugin.h"
#include "tree_select_plugin.h"

using namespace plugin_test;  // NOLINT(build/namespaces): the shared test helpers
using moespec::DType;
using moespec::TensorView;
using nvinfer1::PluginTensorDesc;
using nvinfer1::TensorRTPhase;

namespace {

bool have_device() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

// A device copy of a host vector (freed with the object).
struct DeviceBuffer {
  void* ptr = nullptr;
  size_t bytes = 0;
  template <typename T>
  explicit DeviceBuffer(const std::vector<T>& host) : bytes(sizeof(T) * host.size()) {
    CHECK(cudaMalloc(&ptr, bytes ? bytes : 1) == cudaSuccess);
    if (bytes) CHECK(cudaMemcpy(ptr, host.data(), bytes, cudaMemcpyHostToDevice) == cudaSuccess);
  }
  explicit DeviceBuffer(size_t n_bytes) : bytes(n_bytes) {
    CHECK(cudaMalloc(&ptr, bytes ? bytes : 1) == cudaSuccess);
    CHECK(cudaMemset(ptr, 0xff, bytes) == cudaSuccess);  // garbage: the plugin must write what it owns
  }
  ~DeviceBuffer() { cudaFree(ptr); }
  template <typename T>
  std::vector<T> host() const {
    std::vector<T> out(bytes / sizeof(T));
    CHECK(cudaMemcpy(out.data(), ptr, bytes, cudaMemcpyDeviceToHost) == cudaSuccess);
    return out;
  }
};

PluginTensorDesc tensor(nvinfer1::DataType type, std::initializer_list<int64_t> dims) { return desc(type, dims).desc; }

// Runs `plugin`'s enqueue on `ins` (descs + device buffers) into fresh outputs of `out_descs`.
std::vector<std::unique_ptr<DeviceBuffer>> enqueue(nvinfer1::IPluginV3& plugin, const std::vector<PluginTensorDesc>& in,
                                                   const std::vector<DeviceBuffer*>& ins,
                                                   const std::vector<PluginTensorDesc>& out, size_t workspace) {
  std::vector<const void*> in_ptrs;
  for (DeviceBuffer* b : ins) in_ptrs.push_back(b->ptr);
  std::vector<std::unique_ptr<DeviceBuffer>> outs;
  std::vector<void*> out_ptrs;
  for (const PluginTensorDesc& d : out) {
    int64_t n = 1;
    for (int32_t i = 0; i < d.dims.nbDims; ++i) n *= d.dims.d[i];
    outs.push_back(std::make_unique<DeviceBuffer>(static_cast<size_t>(n) * 4));  // every output here is 4-byte
    out_ptrs.push_back(outs.back()->ptr);
  }
  DeviceBuffer ws(workspace);
  cudaStream_t stream = nullptr;
  CHECK(cudaStreamCreate(&stream) == cudaSuccess);
  const int32_t rc = runtime_of(plugin)->enqueue(in.data(), out.data(), in_ptrs.data(), out_ptrs.data(), ws.ptr, stream);
  CHECK_MSG(rc == 0, moespec::trt::last_error());
  CHECK(cudaStreamSynchronize(stream) == cudaSuccess);
  cudaStreamDestroy(stream);
  return outs;
}

std::vector<DynamicPluginTensorDesc> dynamic(const std::vector<PluginTensorDesc>& d) {
  std::vector<DynamicPluginTensorDesc> out(d.size());
  for (size_t i = 0; i < d.size(); ++i) out[i].desc = d[i], out[i].min = out[i].opt = out[i].max = d[i].dims;
  return out;
}

size_t workspace_of(nvinfer1::IPluginV3& p, const std::vector<PluginTensorDesc>& in,
                    const std::vector<PluginTensorDesc>& out) {
  auto din = dynamic(in), dout = dynamic(out);
  CHECK(build_of(p)->configurePlugin(din.data(), static_cast<int32_t>(in.size()), dout.data(),
                                     static_cast<int32_t>(out.size())) == 0);
  return build_of(p)->getWorkspaceSize(din.data(), static_cast<int32_t>(in.size()), dout.data(),
                                       static_cast<int32_t>(out.size()));
}

template <typename Creator>
std::unique_ptr<nvinfer1::IPluginV3> make(Fields& f) {
  static Creator creator;
  return std::unique_ptr<nvinfer1::IPluginV3>(creator.createPlugin("enqueue", f.collection(), TensorRTPhase::kRUNTIME));
}

// Row t of a routing's (ids, weights), its slots sorted by id (a stable sort: the dropped slots, id N,
// keep their order).
std::vector<std::pair<int32_t, float>> slots_by_id(const std::vector<int32_t>& ids, const std::vector<float>& weights,
                                                   int64_t t, int64_t K) {
  std::vector<std::pair<int32_t, float>> row;
  for (int64_t k = 0; k < K; ++k) row.emplace_back(ids[t * K + k], weights[t * K + k]);
  std::stable_sort(row.begin(), row.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  return row;
}

}  // namespace

// One routing case: the plugin's enqueue on device buffers against the C++ CPU op, per budget.
void check_route_enqueue(int32_t family, int32_t n_group, int32_t topk_group, bool has_bias) {
  constexpr int64_t T = 37, N = 64, K = 8;
  std::mt19937 rng(7 + family);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<float> logits(T * N), bias(N);
  for (float& v : logits) v = normal(rng);
  for (float& v : bias) v = normal(rng) * 0.1f;
  for (int32_t budget : {0, 16}) {
    Fields f;
    f.i32("family", family).i32("top_k", K).i32("renormalize", family == 2 ? 0 : 1).i32("n_group", n_group)
        .i32("topk_group", topk_group).i32("max_experts", budget).i32("policy", 0).i32("has_bias", has_bias ? 1 : 0);
    if (family == 1) f.f32("scaling", 2.5f);
    auto p = make<moespec::trt::RouteExpertsPluginCreator>(f);
    CHECK(p != nullptr);
    if (!p) return;
    std::vector<PluginTensorDesc> in = {tensor(DataType::kFLOAT, {T, N})};
    if (has_bias) in.push_back(tensor(DataType::kFLOAT, {N}));
    const std::vector<PluginTensorDesc> out = {tensor(DataType::kINT32, {T, K}), tensor(DataType::kFLOAT, {T, K}),
                                               tensor(DataType::kINT32, {N}), tensor(DataType::kINT32, {4})};
    DeviceBuffer d_logits(logits), d_bias(bias);
    std::vector<DeviceBuffer*> buffers = {&d_logits};
    if (has_bias) buffers.push_back(&d_bias);
    auto got = enqueue(*p, in, buffers, out, workspace_of(*p, in, out));
    std::vector<int32_t> ids(T * K), active(N), stats(4);
    std::vector<float> weights(T * K);
    moespec::RouteExpertsArgs args;
    args.router_logits = TensorView::contiguous(logits.data(), DType::kFloat32, {T, N});
    if (has_bias) args.bias = TensorView::contiguous(bias.data(), DType::kFloat32, {N});
    args.ids = TensorView::contiguous(ids.data(), DType::kInt32, {T, K});
    args.weights = TensorView::contiguous(weights.data(), DType::kFloat32, {T, K});
    args.active = TensorView::contiguous(active.data(), DType::kInt32, {N});
    args.stats = TensorView::contiguous(stats.data(), DType::kInt32, {4});
    args.spec = dynamic_cast<moespec::trt::RouteExpertsPlugin&>(*p).fields().spec();
    args.budget = dynamic_cast<moespec::trt::RouteExpertsPlugin&>(*p).fields().budget();
    moespec::cpu::route_experts(args);
    const std::string what = "family " + std::to_string(family) + ", budget " + std::to_string(budget);
    CHECK_MSG(got[2]->host<int32_t>() == active && got[3]->host<int32_t>() == stats, what + ": active, stats");
    // deepseek_v3's slot order is unspecified (route_experts.h "Rounding": the CPU's is std::nth_element's,
    // the GPU's (value desc, id asc)), so its rows compare as sets of (id, weight); the others slot by slot.
    const bool unordered = family == static_cast<int32_t>(moespec::RouterFamily::kDeepSeekV3);
    const std::vector<int32_t> g_ids = got[0]->host<int32_t>();
    const std::vector<float> g_weights = got[1]->host<float>();
    for (int64_t t = 0; t < T; ++t) {
      const std::string row = what + ", token " + std::to_string(t);
      if (!unordered) {
        const auto at = g_ids.begin() + t * K;
        CHECK_MSG(std::equal(at, at + K, ids.begin() + t * K), row + ": ids");
        for (int64_t k = 0; k < K; ++k)
          CHECK_MSG(std::fabs(g_weights[t * K + k] - weights[t * K + k]) <= 1e-5f, row + ", slot " + std::to_string(k));
        continue;
      }
      const auto g_row = slots_by_id(g_ids, g_weights, t, K), want_row = slots_by_id(ids, weights, t, K);
      for (int64_t k = 0; k < K; ++k)
        CHECK_MSG(g_row[k].first == want_row[k].first && std::fabs(g_row[k].second - want_row[k].second) <= 1e-5f,
                  row + ", id " + std::to_string(want_row[k].first));
    }
  }
}

TEST(route_experts_enqueue_equals_the_cpu) {
  check_route_enqueue(0, 1, 1, false);  // softmax (Qwen3-MoE, OLMoE, Mixtral)
  check_route_enqueue(1, 8, 4, true);   // deepseek_v3: correction bias, 8 groups, 4 kept
  check_route_enqueue(2, 1, 1, false);  // gpt_oss
}

// One MoE case: SwiGLU, or GPT-OSS's clamped experts with their biases (activation 1).
void check_moe_enqueue(int32_t activation) {
  constexpr int64_t T = 24, H = 64, I = 32, E = 16, K = 4;
  std::mt19937 rng(11 + activation);
  std::normal_distribution<float> normal(0.0f, 0.5f);
  std::vector<float> x(T * H), experts(E * 3 * I * H), weights(T * K), biases(E * (2 * I + H));
  std::vector<int32_t> ids(T * K);
  for (float& v : x) v = normal(rng);
  for (float& v : experts) v = normal(rng) * 0.2f;
  for (float& v : biases) v = normal(rng) * 0.3f;
  for (int64_t i = 0; i < T * K; ++i) ids[i] = static_cast<int32_t>(rng() % (E + 1)), weights[i] = (rng() % 100) / 100.0f;
  const bool gpt_oss = activation == 1;
  Fields f;
  f.i32("intermediate_size", I).i32("activation", activation).i32("has_biases", gpt_oss ? 1 : 0);
  if (gpt_oss) f.f32("limit", 0.5f);  // (small, so that the clamps bind)
  auto p = make<moespec::trt::MoeExpertsPluginCreator>(f);
  CHECK(p != nullptr);
  if (!p) return;
  std::vector<PluginTensorDesc> in = {tensor(DataType::kFLOAT, {T, H}), tensor(DataType::kINT32, {T, K}),
                                      tensor(DataType::kFLOAT, {T, K}), tensor(DataType::kFLOAT, {E, 3 * I * H})};
  if (gpt_oss) in.push_back(tensor(DataType::kFLOAT, {E, 2 * I + H}));
  const std::vector<PluginTensorDesc> out = {tensor(DataType::kFLOAT, {T, H})};
  DeviceBuffer dx(x), dids(ids), dw(weights), de(experts), db(biases);
  std::vector<DeviceBuffer*> buffers = {&dx, &dids, &dw, &de};
  if (gpt_oss) buffers.push_back(&db);
  auto got = enqueue(*p, in, buffers, out, workspace_of(*p, in, out));
  std::vector<float> want(T * H);
  moespec::MoeExpertsArgs args;
  args.x = TensorView::contiguous(x.data(), DType::kFloat32, {T, H});
  args.ids = TensorView::contiguous(ids.data(), DType::kInt32, {T, K});
  args.weights = TensorView::contiguous(weights.data(), DType::kFloat32, {T, K});
  args.experts = TensorView::contiguous(experts.data(), DType::kFloat32, {E, 3 * I * H});
  if (gpt_oss) args.biases = TensorView::contiguous(biases.data(), DType::kFloat32, {E, 2 * I + H});
  args.out = TensorView::contiguous(want.data(), DType::kFloat32, {T, H});
  args.intermediate_size = I;
  args.activation = gpt_oss ? moespec::ExpertActivation::kGptOss : moespec::ExpertActivation::kSwiGLU;
  args.limit = 0.5f;
  moespec::cpu::moe_experts(args);
  const std::vector<float> y = got[0]->host<float>();
  float scale = 0.0f, err = 0.0f;
  for (size_t i = 0; i < y.size(); ++i) scale = std::fmax(scale, std::fabs(want[i])), err = std::fmax(err, std::fabs(y[i] - want[i]));
  CHECK_MSG(err <= 1e-5f * std::fmax(scale, 1.0f), "activation " + std::to_string(activation) + ": max |d| = " +
                                                        std::to_string(err));
}

TEST(moe_experts_enqueue_equals_the_cpu) {
  check_moe_enqueue(0);
  check_moe_enqueue(1);
}

TEST(tree_select_enqueue_equals_the_cpu_selection_and_tree) {
  constexpr int64_t B = 2, C = 30, L = 3, K = 4, N = 32;
  constexpr int32_t M = 12;
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  std::vector<int32_t> parents(B * C), depth(B * C), num(B), tokens(B * C), roots(B), predicted(B * C * L * K);
  std::vector<float> scores(B * C), prob(B * C * L * K), buffer(L * N, 0.0f), expert_s(L, 1e-3f);
  for (int64_t b = 0; b < B; ++b) {
    num[b] = static_cast<int32_t>(C - 3 * b);
    roots[b] = static_cast<int32_t>(1000 + b);
    for (int64_t c = 0; c < C; ++c) {
      const int64_t i = b * C + c;
      parents[i] = c < 4 ? -1 : static_cast<int32_t>(rng() % c);
      depth[i] = parents[i] < 0 ? 1 : depth[b * C + parents[i]] + 1;
      scores[i] = (parents[i] < 0 ? 0.0f : scores[b * C + parents[i]]) + std::log(0.05f + 0.9f * unit(rng));
      tokens[i] = static_cast<int32_t>(10 * i + 1);
      for (int64_t s = 0; s < L * K; ++s) predicted[i * L * K + s] = static_cast<int32_t>(rng() % N), prob[i * L * K + s] = unit(rng);
    }
  }
  for (int64_t e = 0; e < N; e += 3) buffer[e] = 1.0f;  // the roots' experts (layer 0)
  const float token_s = 2e-4f;
  std::vector<float> state = {0.004f, 2.0f};
  Fields f;
  f.i32("total_tokens", M).f32("token_s", token_s).i32("has_predicted_p", 1);
  auto p = make<moespec::trt::TreeSelectPluginCreator>(f);
  CHECK(p != nullptr);
  if (!p) return;
  const DataType i32 = DataType::kINT32, f32 = DataType::kFLOAT;
  const std::vector<PluginTensorDesc> in = {
      tensor(i32, {B, C}), tensor(i32, {B, C}), tensor(f32, {B, C}), tensor(i32, {B}), tensor(i32, {B, C}),
      tensor(i32, {B}), tensor(i32, {B, C, L, K}), tensor(f32, {L, N}), tensor(f32, {L}), tensor(f32, {2}),
      tensor(f32, {B, C, L, K})};
  const std::vector<PluginTensorDesc> out = {tensor(i32, {B, M + 1}), tensor(i32, {B, M + 1}), tensor(i32, {B, M + 1}),
                                             tensor(i32, {B, M + 1, 1}), tensor(i32, {B}), tensor(f32, {L, N}),
                                             tensor(f32, {2})};
  DeviceBuffer d0(parents), d1(depth), d2(scores), d3(num), d4(tokens), d5(roots), d6(predicted), d7(buffer),
      d8(expert_s), d9(state), d10(prob);
  auto got = enqueue(*p, in, {&d0, &d1, &d2, &d3, &d4, &d5, &d6, &d7, &d8, &d9, &d10}, out, workspace_of(*p, in, out));
  // The CPU rule, request after request with one buffer and S, A carried; then each request's tree.
  std::vector<float> cpu_buffer = buffer;
  double S = state[0], A = state[1];
  const std::vector<int32_t> g_tokens = got[0]->host<int32_t>(), g_parents = got[1]->host<int32_t>(),
                             g_depth = got[2]->host<int32_t>(), g_mask = got[3]->host<int32_t>(),
                             g_nodes = got[4]->host<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    std::vector<int32_t> selected(C, -1);
    const int64_t Cb = num[b];
    moespec::SelectCostAwareArgs a;
    a.parents = TensorView::contiguous(&parents[b * C], DType::kInt32, {Cb});
    a.depth = TensorView::contiguous(&depth[b * C], DType::kInt32, {Cb});
    a.scores = TensorView::contiguous(&scores[b * C], DType::kFloat32, {Cb});
    a.predicted = TensorView::contiguous(&predicted[b * C * L * K], DType::kInt32, {Cb, L, K});
    a.predicted_p = TensorView::contiguous(&prob[b * C * L * K], DType::kFloat32, {Cb, L, K});
    a.buffer = TensorView::contiguous(cpu_buffer.data(), DType::kFloat32, {L, N});
    a.expert_s = TensorView::contiguous(expert_s.data(), DType::kFloat32, {L});
    a.selected = TensorView::contiguous(selected.data(), DType::kInt32, {Cb});
    a.step_s = S, a.accepted = A, a.token_s = token_s, a.total_tokens = M;
    const moespec::SelectCostAwareResult r = moespec::select_cost_aware(a);
    S = r.step_s, A = r.accepted;
    // the tree: the root, then the chosen candidates in candidate order
    std::vector<bool> chosen(C, false);
    for (int64_t i = 0; i < r.count; ++i) chosen[selected[i]] = true;
    std::vector<int32_t> node_of(C, -1), want_tokens(M + 1, 0), want_parents(M + 1, -1), want_depth(M + 1, 0),
        want_mask(M + 1, 0);
    want_tokens[0] = roots[b], want_mask[0] = 1;
    int32_t n = 1;
    for (int64_t c = 0; c < Cb; ++c) {
      if (!chosen[c]) continue;
      const int32_t parent = parents[b * C + c] < 0 ? 0 : node_of[parents[b * C + c]];
      node_of[c] = n, want_tokens[n] = tokens[b * C + c], want_parents[n] = parent;
      want_depth[n] = want_depth[parent] + 1, want_mask[n] = want_mask[parent] | (1 << n);
      ++n;
    }
    CHECK_MSG(g_nodes[b] == n, "request " + std::to_string(b));
    for (int32_t i = 0; i <= M; ++i) {
      const int64_t at = b * (M + 1) + i;
      CHECK_MSG(g_tokens[at] == want_tokens[i] && g_parents[at] == want_parents[i] && g_depth[at] == want_depth[i] &&
                    g_mask[at] == want_mask[i],
                "request " + std::to_string(b) + " node " + std::to_string(i));
    }
  }
  CHECK(got[5]->host<float>() == cpu_buffer);
  const std::vector<float> s = got[6]->host<float>();
  CHECK(s[0] == static_cast<float>(S) && s[1] == static_cast<float>(A));
}

// Cost weight 0: EAGLE-2's selection, the best total_tokens candidates by score (ancestor-closed).
TEST(tree_select_cost_weight_zero_is_eagle2) {
  constexpr int64_t B = 1, C = 10, L = 1, K = 2, N = 8;
  constexpr int32_t M = 4;
  const std::vector<int32_t> parents = {-1, -1, 0, 0, 1, 2, 2, 3, 4, 5}, depth = {1, 1, 2, 2, 2, 3, 3, 3, 3, 4};
  const std::vector<float> scores = {-0.1f, -0.5f, -0.3f, -1.2f, -0.6f, -0.4f, -2.0f, -1.5f, -0.9f, -0.45f};
  std::vector<int32_t> num = {C}, tokens(C), roots = {7}, predicted(C * L * K, 3);
  for (int64_t c = 0; c < C; ++c) tokens[c] = static_cast<int32_t>(100 + c);
  std::vector<float> buffer(L * N, 0.0f), expert_s = {1.0f}, state = {0.0f, 1.0f};  // huge expert cost
  Fields f;
  f.i32("total_tokens", M).f32("token_s", 1.0f).f32("cost_weight", 0.0f);
  auto p = make<moespec::trt::TreeSelectPluginCreator>(f);
  CHECK(p != nullptr);
  if (!p) return;
  const DataType i32 = DataType::kINT32, f32 = DataType::kFLOAT;
  const std::vector<PluginTensorDesc> in = {tensor(i32, {B, C}), tensor(i32, {B, C}), tensor(f32, {B, C}),
                                            tensor(i32, {B}),    tensor(i32, {B, C}), tensor(i32, {B}),
                                            tensor(i32, {B, C, L, K}), tensor(f32, {L, N}), tensor(f32, {L}),
                                            tensor(f32, {2})};
  const std::vector<PluginTensorDesc> out = {tensor(i32, {B, M + 1}), tensor(i32, {B, M + 1}), tensor(i32, {B, M + 1}),
                                             tensor(i32, {B, M + 1, 1}), tensor(i32, {B}), tensor(f32, {L, N}),
                                             tensor(f32, {2})};
  DeviceBuffer d0(parents), d1(depth), d2(scores), d3(num), d4(tokens), d5(roots), d6(predicted), d7(buffer),
      d8(expert_s), d9(state);
  auto got = enqueue(*p, in, {&d0, &d1, &d2, &d3, &d4, &d5, &d6, &d7, &d8, &d9}, out, workspace_of(*p, in, out));
  // best 4 by score, ancestor-closed: 0 (-0.1), 2 (-0.3), 5 (-0.4, parent 2), 9 (-0.45, parent 5)
  CHECK(got[4]->host<int32_t>() == std::vector<int32_t>{5});
  CHECK((got[0]->host<int32_t>() == std::vector<int32_t>{7, 100, 102, 105, 109}));
  CHECK((got[1]->host<int32_t>() == std::vector<int32_t>{-1, 0, 1, 2, 3}));
}

// Exit code 77 = skipped (ctest SKIP_RETURN_CODE) on a machine without a CUDA device.
static const bool kSkipWithoutDevice = [] {
  if (!have_device()) {
    std::printf("no CUDA device: test_plugins_enqueue skipped\n");
    std::exit(77);
  }
  return true;
}();
