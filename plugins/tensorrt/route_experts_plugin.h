// MoespecRouteExperts: the TensorRT IPluginV3 door to moespec::cuda::route_experts.
//
// A thin adapter (STYLE.md habit 13): TensorRT tensors become moespec::TensorView objects and
// one call of the CUDA kernel declared in cpp/include/moespec/route_experts.h, which defines the
// routing contract (DESIGN.md "Routing families", "Expert budget"). Its CPU reference is
// moespec::cpu::route_experts (cpp/src/route_experts.cc); its unit test is
// tests/tensorrt/test_route_experts_plugin.cc. Dimensions: T tokens, N experts, K top-k.
//
// Plugin fields (PluginFieldCollection, one value each, INT32 unless noted):
//   family                0 softmax, 1 deepseek_v3, 2 gpt_oss (RouterFamily)
//   top_k                 K, required
//   renormalize           0 | 1
//   n_group, topk_group   deepseek_v3 group-limited top-k (default 1, 1)
//   scaling               FLOAT32, deepseek_v3 routed_scaling_factor (default 1)
//   max_experts           budget B; 0 = no budget
//   policy                0 substitution, 1 truncation (BudgetPolicy)
//   coverage              FLOAT32, 0 = off, else in (0, 1]
//   has_bias              0 | 1: input `bias` is present (deepseek_v3 only)
//   has_token_weights     0 | 1: input `token_weights` is present
//   softmax_vector_width  8 | 16 (default 16)
//   score                 0 probability (MoE-Spec), 1 gates (BudgetScore; default 0)
// Serialization is these same fields (getFieldsToSerialize), so createPlugin rebuilds the plugin
// from what it serialized.
#pragma once

#include <NvInferRuntime.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "moespec/route_experts.h"
#include "plugin_common.h"

namespace moespec {
namespace trt {

constexpr char kRouteExpertsPluginName[] = "MoespecRouteExperts";
constexpr char kRouteExpertsPluginVersion[] = "1";

// Inputs, in this fixed order; an input whose has_* field is 0 is absent and the later ones move up
// (RouteExpertsFields::input_index gives the position).
enum class RouteExpertsInput : int32_t {
  kRouterLogits = 0,  // [T, N] float32 | bfloat16 | float16
  kBias = 1,          // [N] float32, deepseek_v3 e_score_correction_bias (when has_bias)
  kTokenWeights = 2,  // [T] float32 >= 0, budget scores (when has_token_weights)
};

enum class RouteExpertsOutput : int32_t {
  kIds = 0,      // [T, K] int32, a dropped slot holds N
  kWeights = 1,  // [T, K] float32, 0 for a dropped slot
  kActive = 2,   // [N] int32, sorted active expert ids padded with N
  kStats = 3,    // [4] int32, RoutingStats order
  kCount = 4,
};

// The plugin's fields, as they travel in a PluginFieldCollection (see the table above).
struct RouteExpertsFields {
  int32_t family = 0;
  int32_t top_k = 0;  // no default: a missing top_k is an error
  int32_t renormalize = 0;
  int32_t n_group = 1;
  int32_t topk_group = 1;
  float scaling = 1.0f;
  int32_t max_experts = 0;
  int32_t policy = 0;
  float coverage = 0.0f;  // ExpertBudget::coverage is a double; a float travels and converts exactly
  int32_t has_bias = 0;
  int32_t has_token_weights = 0;
  int32_t softmax_vector_width = 16;
  int32_t score = 0;

  // The field table (plugin_common.h): name and member, in serialization order.
  template <typename F, typename Visit>
  static void visit(F& f, Visit&& v) {
    v("family", f.family);
    v("top_k", f.top_k);
    v("renormalize", f.renormalize);
    v("n_group", f.n_group);
    v("topk_group", f.topk_group);
    v("scaling", f.scaling);
    v("max_experts", f.max_experts);
    v("policy", f.policy);
    v("coverage", f.coverage);
    v("has_bias", f.has_bias);
    v("has_token_weights", f.has_token_weights);
    v("softmax_vector_width", f.softmax_vector_width);
    v("score", f.score);
  }

  // The checks that need no tensor shapes (those with N run in configurePlugin and the kernel).
  void validate() const;

  RouterSpec spec() const;
  ExpertBudget budget() const;
  int32_t nb_inputs() const { return 1 + has_bias + has_token_weights; }
  // Position of `input` in the input list, -1 if absent.
  int32_t input_index(RouteExpertsInput input) const;

  bool operator==(const RouteExpertsFields& other) const;
};

class RouteExpertsPlugin final : public PluginBase<RouteExpertsPlugin, RouteExpertsFields> {
 public:
  static constexpr const char* kName = kRouteExpertsPluginName;
  static constexpr const char* kVersion = kRouteExpertsPluginVersion;
  // Throws moespec::Error if `fields` fail validate(). `layer_name` (createPlugin's name) only
  // labels error reports.
  RouteExpertsPlugin(const RouteExpertsFields& fields, std::string plugin_namespace, std::string layer_name = "")
      : PluginBase(fields, std::move(plugin_namespace), std::move(layer_name)) {}

  // IPluginV3OneBuild
  int32_t configurePlugin(const nvinfer1::DynamicPluginTensorDesc* in, int32_t nb_inputs,
                          const nvinfer1::DynamicPluginTensorDesc* out, int32_t nb_outputs) noexcept override;
  int32_t getOutputDataTypes(nvinfer1::DataType* output_types, int32_t nb_outputs,
                             const nvinfer1::DataType* input_types, int32_t nb_inputs) const noexcept override;
  int32_t getOutputShapes(const nvinfer1::DimsExprs* inputs, int32_t nb_inputs, const nvinfer1::DimsExprs* shape_inputs,
                          int32_t nb_shape_inputs, nvinfer1::DimsExprs* outputs, int32_t nb_outputs,
                          nvinfer1::IExprBuilder& expr_builder) noexcept override;
  bool supportsFormatCombination(int32_t pos, const nvinfer1::DynamicPluginTensorDesc* in_out, int32_t nb_inputs,
                                 int32_t nb_outputs) noexcept override;
  int32_t getNbOutputs() const noexcept override { return static_cast<int32_t>(RouteExpertsOutput::kCount); }
  size_t getWorkspaceSize(const nvinfer1::DynamicPluginTensorDesc* inputs, int32_t nb_inputs,
                          const nvinfer1::DynamicPluginTensorDesc* outputs, int32_t nb_outputs) const noexcept override;

  // IPluginV3OneRuntime
  int32_t onShapeChange(const nvinfer1::PluginTensorDesc* in, int32_t nb_inputs, const nvinfer1::PluginTensorDesc* out,
                        int32_t nb_outputs) noexcept override;
  int32_t enqueue(const nvinfer1::PluginTensorDesc* input_desc, const nvinfer1::PluginTensorDesc* output_desc,
                  const void* const* inputs, void* const* outputs, void* workspace,
                  cudaStream_t stream) noexcept override;
};

// Its creator (createPlugin returns nullptr, with the reason reported, for an unknown or invalid field).
using RouteExpertsPluginCreator = PluginCreator<RouteExpertsPlugin>;

}  // namespace trt
}  // namespace moespec
