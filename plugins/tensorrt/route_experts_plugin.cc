// MoespecRouteExperts: the TensorRT IPluginV3 door to moespec::cuda::route_experts (see
// route_experts_plugin.h). Shapes and dtypes in, views out, one kernel call; every check on shapes
// and scalars is the core's own validate_route_experts, and every exception becomes a report
// (plugin_log.h) plus TensorRT's failure value.
#include "route_experts_plugin.h"

#include <cmath>
#include <cstring>
#include <exception>
#include <type_traits>
#include <utility>

#include "moespec/error.h"
#include "plugin_log.h"

namespace moespec {
namespace trt {

using nvinfer1::DataType;
using nvinfer1::DimsExprs;
using nvinfer1::DynamicPluginTensorDesc;
using nvinfer1::IDimensionExpr;
using nvinfer1::PluginField;
using nvinfer1::PluginFieldCollection;
using nvinfer1::PluginFieldType;
using nvinfer1::PluginTensorDesc;

namespace {

constexpr int32_t kNbOutputs = static_cast<int32_t>(RouteExpertsOutput::kCount);

constexpr int32_t idx(RouteExpertsOutput output) { return static_cast<int32_t>(output); }

// The kernel's arguments for one call: views of the bound tensors plus the fields' scalars.
RouteExpertsArgs make_args(const RouteExpertsFields& f, const PluginTensorDesc* in, const void* const* inputs,
                           const PluginTensorDesc* out, void* const* outputs, int32_t device_index) {
  RouteExpertsArgs args;
  const int32_t logits = f.input_index(RouteExpertsInput::kRouterLogits);
  const int32_t bias = f.input_index(RouteExpertsInput::kBias);
  const int32_t token_weights = f.input_index(RouteExpertsInput::kTokenWeights);
  args.router_logits = to_view(in[logits], inputs[logits], device_index);
  if (bias >= 0) args.bias = to_view(in[bias], inputs[bias], device_index);
  if (token_weights >= 0) args.token_weights = to_view(in[token_weights], inputs[token_weights], device_index);
  args.ids = to_view(out[idx(RouteExpertsOutput::kIds)], outputs[idx(RouteExpertsOutput::kIds)], device_index);
  args.weights =
      to_view(out[idx(RouteExpertsOutput::kWeights)], outputs[idx(RouteExpertsOutput::kWeights)], device_index);
  args.active = to_view(out[idx(RouteExpertsOutput::kActive)], outputs[idx(RouteExpertsOutput::kActive)], device_index);
  args.stats = to_view(out[idx(RouteExpertsOutput::kStats)], outputs[idx(RouteExpertsOutput::kStats)], device_index);
  args.spec = f.spec();
  args.budget = f.budget();
  args.softmax_vector_width = f.softmax_vector_width;
  return args;
}

void check_counts(const RouteExpertsFields& f, int32_t nb_inputs, int32_t nb_outputs) {
  MOESPEC_CHECK_ARG(nb_inputs == f.nb_inputs(), "inputs", "expected ", f.nb_inputs(), " inputs (router_logits",
                    f.has_bias ? ", bias" : "", f.has_token_weights ? ", token_weights" : "", "), got ", nb_inputs);
  MOESPEC_CHECK_ARG(nb_outputs == kNbOutputs, "outputs", "expected ", kNbOutputs,
                    " outputs (ids, weights, active, stats), got ", nb_outputs);
}

}  // namespace

// ---- RouteExpertsFields -------------------------------------------------------------------------

void RouteExpertsFields::validate() const {
  MOESPEC_CHECK_ARG(family == static_cast<int32_t>(RouterFamily::kSoftmax) ||
                        family == static_cast<int32_t>(RouterFamily::kDeepSeekV3) ||
                        family == static_cast<int32_t>(RouterFamily::kGptOss),
                    "family", "must be 0 (softmax), 1 (deepseek_v3) or 2 (gpt_oss), got ", family);
  MOESPEC_CHECK_ARG(top_k >= 1 && top_k <= kMaxTopK, "top_k", "must be in [1, ", kMaxTopK, "], got ", top_k,
                    top_k == 0 ? " (a required field)" : "");
  MOESPEC_CHECK_ARG(renormalize == 0 || renormalize == 1, "renormalize", "must be 0 or 1, got ", renormalize);
  if (family == static_cast<int32_t>(RouterFamily::kDeepSeekV3)) {
    MOESPEC_CHECK_ARG(n_group >= 1, "n_group", "must be >= 1, got ", n_group);
    MOESPEC_CHECK_ARG(topk_group >= 1 && topk_group <= n_group, "topk_group", "must be in [1, n_group=", n_group,
                      "], got ", topk_group);
  }
  MOESPEC_CHECK_ARG(std::isfinite(scaling), "scaling", "must be finite, got ", scaling);
  MOESPEC_CHECK_ARG(max_experts == 0 || max_experts >= top_k, "max_experts", "must be 0 (no budget) or at least top_k=",
                    top_k, " (one token alone needs ", top_k, " experts), got ", max_experts);
  MOESPEC_CHECK_ARG(policy == static_cast<int32_t>(BudgetPolicy::kSubstitution) ||
                        policy == static_cast<int32_t>(BudgetPolicy::kTruncation),
                    "policy", "must be 0 (substitution) or 1 (truncation), got ", policy);
  MOESPEC_CHECK_ARG(std::isfinite(coverage) && coverage >= 0.0f && coverage <= 1.0f, "coverage",
                    "must be in (0, 1] (or 0 for off), got ", coverage);
  MOESPEC_CHECK_ARG(has_bias == 0 || has_bias == 1, "has_bias", "must be 0 or 1, got ", has_bias);
  MOESPEC_CHECK_ARG(has_bias == 0 || family == static_cast<int32_t>(RouterFamily::kDeepSeekV3), "has_bias",
                    "only family 1 (deepseek_v3) takes a bias input; for gpt_oss the router bias belongs in "
                    "router_logits");
  MOESPEC_CHECK_ARG(has_token_weights == 0 || has_token_weights == 1, "has_token_weights", "must be 0 or 1, got ",
                    has_token_weights);
  MOESPEC_CHECK_ARG(softmax_vector_width == 8 || softmax_vector_width == 16, "softmax_vector_width",
                    "must be 8 or 16, got ", softmax_vector_width);
  MOESPEC_CHECK_ARG(score == static_cast<int32_t>(BudgetScore::kProbability) ||
                        score == static_cast<int32_t>(BudgetScore::kGates),
                    "score", "must be 0 (probability) or 1 (gates), got ", score);
}

RouterSpec RouteExpertsFields::spec() const {
  RouterSpec spec;
  spec.family = static_cast<RouterFamily>(family);
  spec.top_k = top_k;
  spec.renormalize = renormalize != 0;
  spec.n_group = n_group;
  spec.topk_group = topk_group;
  spec.scaling = scaling;
  return spec;
}

ExpertBudget RouteExpertsFields::budget() const {
  ExpertBudget budget;
  budget.max_experts = max_experts;
  budget.policy = static_cast<BudgetPolicy>(policy);
  budget.coverage = coverage;
  budget.score = static_cast<BudgetScore>(score);
  return budget;
}

int32_t RouteExpertsFields::input_index(RouteExpertsInput input) const {
  switch (input) {
    case RouteExpertsInput::kRouterLogits: return 0;
    case RouteExpertsInput::kBias: return has_bias ? 1 : -1;
    case RouteExpertsInput::kTokenWeights: return has_token_weights ? 1 + has_bias : -1;
  }
  return -1;
}

bool RouteExpertsFields::operator==(const RouteExpertsFields& other) const { return same_fields(*this, other); }

// ---- RouteExpertsPlugin -------------------------------------------------------------------------

int32_t RouteExpertsPlugin::configurePlugin(const DynamicPluginTensorDesc* in, int32_t nb_inputs,
                                            const DynamicPluginTensorDesc* out, int32_t nb_outputs) noexcept {
  return guard("configurePlugin", int32_t{-1}, [&] {
    check_counts(fields_, nb_inputs, nb_outputs);
    MOESPEC_CHECK_ARG(in != nullptr && out != nullptr, "inputs", "no tensor descriptions given");
    // The core's shape and scalar checks, on the profile's largest input shapes, the outputs at the
    // shapes getOutputShapes gives them. validate_route_experts reads shapes, never data, so a
    // placeholder address stands in for the buffers bound at enqueue.
    const nvinfer1::Dims& logits = in[fields_.input_index(RouteExpertsInput::kRouterLogits)].max;
    MOESPEC_CHECK_ARG(logits.nbDims == 2, "router_logits", "expected a 2-d tensor [T, N], got ", logits.nbDims,
                      " dims");
    const int64_t T = logits.d[0];
    const int64_t N = logits.d[1];
    const int64_t K = fields_.top_k;
    const nvinfer1::Dims out_dims[kNbOutputs] = {{2, {T, K}}, {2, {T, K}}, {1, {N}}, {1, {kRoutingStatsSize}}};
    static char placeholder;
    PluginTensorDesc in_max[3];
    PluginTensorDesc out_max[kNbOutputs];
    const void* in_data[3] = {&placeholder, &placeholder, &placeholder};
    void* out_data[kNbOutputs] = {&placeholder, &placeholder, &placeholder, &placeholder};
    for (int32_t i = 0; i < nb_inputs; ++i) {
      in_max[i] = in[i].desc;
      in_max[i].dims = in[i].max;
    }
    for (int32_t i = 0; i < nb_outputs; ++i) {
      out_max[i] = out[i].desc;
      out_max[i].dims = out_dims[i];
    }
    validate_route_experts(make_args(fields_, in_max, in_data, out_max, out_data, 0), Device::kCUDA);
    return int32_t{0};
  });
}

int32_t RouteExpertsPlugin::getOutputDataTypes(DataType* output_types, int32_t nb_outputs,
                                               const DataType* input_types, int32_t nb_inputs) const noexcept {
  return guard("getOutputDataTypes", int32_t{-1}, [&] {
    check_counts(fields_, nb_inputs, nb_outputs);
    MOESPEC_CHECK_ARG(output_types != nullptr && input_types != nullptr, "outputs", "no type arrays given");
    output_types[idx(RouteExpertsOutput::kIds)] = DataType::kINT32;
    output_types[idx(RouteExpertsOutput::kWeights)] = DataType::kFLOAT;
    output_types[idx(RouteExpertsOutput::kActive)] = DataType::kINT32;
    output_types[idx(RouteExpertsOutput::kStats)] = DataType::kINT32;
    return int32_t{0};
  });
}

int32_t RouteExpertsPlugin::getOutputShapes(const DimsExprs* inputs, int32_t nb_inputs, const DimsExprs*, int32_t,
                                            DimsExprs* outputs, int32_t nb_outputs,
                                            nvinfer1::IExprBuilder& expr_builder) noexcept {
  return guard("getOutputShapes", int32_t{-1}, [&] {
    check_counts(fields_, nb_inputs, nb_outputs);
    MOESPEC_CHECK_ARG(inputs != nullptr && outputs != nullptr, "inputs", "no dimension arrays given");
    const DimsExprs& logits = inputs[fields_.input_index(RouteExpertsInput::kRouterLogits)];
    MOESPEC_CHECK_ARG(logits.nbDims == 2, "router_logits", "expected a 2-d tensor [T, N], got ", logits.nbDims,
                      " dims");
    const IDimensionExpr* T = logits.d[0];
    const IDimensionExpr* N = logits.d[1];
    const IDimensionExpr* K = expr_builder.constant(fields_.top_k);
    const IDimensionExpr* S = expr_builder.constant(kRoutingStatsSize);
    if (K == nullptr || S == nullptr) throw_runtime("IExprBuilder::constant returned nothing");
    DimsExprs& ids = outputs[idx(RouteExpertsOutput::kIds)];
    ids.nbDims = 2;  // [T, K]
    ids.d[0] = T;
    ids.d[1] = K;
    DimsExprs& weights = outputs[idx(RouteExpertsOutput::kWeights)];
    weights.nbDims = 2;  // [T, K]
    weights.d[0] = T;
    weights.d[1] = K;
    DimsExprs& active = outputs[idx(RouteExpertsOutput::kActive)];
    active.nbDims = 1;  // [N]
    active.d[0] = N;
    DimsExprs& stats = outputs[idx(RouteExpertsOutput::kStats)];
    stats.nbDims = 1;  // [4]
    stats.d[0] = S;
    return int32_t{0};
  });
}

bool RouteExpertsPlugin::supportsFormatCombination(int32_t pos, const DynamicPluginTensorDesc* in_out,
                                                   int32_t nb_inputs, int32_t nb_outputs) noexcept {
  return guard("supportsFormatCombination", false, [&] {
    check_counts(fields_, nb_inputs, nb_outputs);
    MOESPEC_CHECK_ARG(in_out != nullptr && pos >= 0 && pos < nb_inputs + nb_outputs, "pos", "position ", pos,
                      " outside the ", nb_inputs + nb_outputs, " tensors");
    const PluginTensorDesc& desc = in_out[pos].desc;
    if (desc.format != nvinfer1::TensorFormat::kLINEAR) return false;
    const DataType type = desc.type;
    if (pos == fields_.input_index(RouteExpertsInput::kRouterLogits))
      return type == DataType::kFLOAT || type == DataType::kBF16 || type == DataType::kHALF;
    if (pos < nb_inputs) return type == DataType::kFLOAT;  // bias, token_weights
    return type == (pos - nb_inputs == idx(RouteExpertsOutput::kWeights) ? DataType::kFLOAT : DataType::kINT32);
  });
}

size_t RouteExpertsPlugin::getWorkspaceSize(const DynamicPluginTensorDesc* inputs, int32_t nb_inputs,
                                            const DynamicPluginTensorDesc*, int32_t nb_outputs) const noexcept {
  return guard("getWorkspaceSize", size_t{0}, [&] {
    check_counts(fields_, nb_inputs, nb_outputs);
    MOESPEC_CHECK_ARG(inputs != nullptr, "inputs", "no tensor descriptions given");
    const nvinfer1::Dims& max = inputs[fields_.input_index(RouteExpertsInput::kRouterLogits)].max;  // [T, N]
    MOESPEC_CHECK_ARG(max.nbDims == 2, "router_logits", "expected a 2-d tensor [T, N], got ", max.nbDims, " dims");
    return cuda::route_experts_workspace_size(max.d[0], max.d[1], fields_.top_k);
  });
}

int32_t RouteExpertsPlugin::onShapeChange(const PluginTensorDesc* in, int32_t nb_inputs, const PluginTensorDesc* out,
                                          int32_t nb_outputs) noexcept {
  return guard("onShapeChange", int32_t{-1}, [&] {
    check_counts(fields_, nb_inputs, nb_outputs);
    MOESPEC_CHECK_ARG(in != nullptr && out != nullptr, "inputs", "no tensor descriptions given");
    return int32_t{0};  // nothing to precompute: enqueue reads the shapes it gets
  });
}

int32_t RouteExpertsPlugin::enqueue(const PluginTensorDesc* input_desc, const PluginTensorDesc* output_desc,
                                    const void* const* inputs, void* const* outputs, void* workspace,
                                    cudaStream_t stream) noexcept {
  return guard("enqueue", int32_t{-1}, [&] {
    MOESPEC_CHECK_ARG(input_desc != nullptr && output_desc != nullptr && inputs != nullptr && outputs != nullptr,
                      "inputs", "no tensors given");
    const RouteExpertsArgs args = make_args(fields_, input_desc, inputs, output_desc, outputs, current_device());
    const int64_t T = args.router_logits.shape[0];
    const int64_t N = args.router_logits.shape[1];
    cuda::route_experts(args, workspace, cuda::route_experts_workspace_size(T, N, fields_.top_k),
                        static_cast<void*>(stream));
    return int32_t{0};
  });
}

}  // namespace trt
}  // namespace moespec
