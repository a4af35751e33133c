// MoespecBudgetedMoe: the TensorRT IPluginV3 door to moespec::cuda::moe_experts.
//
// A thin adapter (STYLE.md habit 13) over the CUDA kernel declared in
// cpp/include/moespec/moe_experts.h (the contract: each active expert's weights read once, dropped
// and zero-weight slots skipped); it takes the routing MoespecRouteExperts produces (ids with the
// sentinel E for a dropped slot, weights), so routing + budget + experts are two plugin nodes. Its
// CPU reference is moespec::cpu::moe_experts; its unit test is tests/tensorrt/test_moe_experts_plugin.cc.
// Dimensions: T tokens, H hidden, K slots per token, E experts, I expert intermediate size.
//
// Plugin fields (INT32 unless noted):
//   intermediate_size  I, required
//   activation         0 SwiGLU (Qwen3-MoE, Mixtral, OLMoE, DeepSeek-V3), 1 GPT-OSS's clamped variant
//   limit, alpha       FLOAT32, GPT-OSS's clamp and sigmoid slope (defaults 7, 1.702)
//   has_biases         0 | 1: input `biases` is present (GPT-OSS only)
//   round_weights      0 | 1: each routing weight is rounded to x's dtype where it is read (the
//                      families whose router rounds its weights to the model dtype: Qwen3-MoE,
//                      OLMoE, GPT-OSS), as moespec::moe_experts' round_weights (default 0)
// Serialization is these same fields.
#pragma once

#include <NvInferRuntime.h>

#include <cstdint>
#include <string>
#include <utility>

#include "moespec/moe_experts.h"
#include "plugin_common.h"

namespace moespec {
namespace trt {

constexpr char kMoeExpertsPluginName[] = "MoespecBudgetedMoe";
constexpr char kMoeExpertsPluginVersion[] = "1";

enum class MoeExpertsInput : int32_t {
  kX = 0,        // [T, H] bfloat16 | float32
  kIds = 1,      // [T, K] int32, E = dropped
  kWeights = 2,  // [T, K] float32
  kExperts = 3,  // [E, 3 I H] x's dtype: gate [I, H], up [I, H], down [H, I] per expert
  kBiases = 4,   // [E, 2 I + H] float32 (when has_biases)
};

struct MoeExpertsFields {
  int32_t intermediate_size = 0;  // no default: a missing one is an error
  int32_t activation = 0;
  float limit = 7.0f;
  float alpha = 1.702f;
  int32_t has_biases = 0;
  int32_t round_weights = 0;

  template <typename F, typename Visit>
  static void visit(F& f, Visit&& v) {
    v("intermediate_size", f.intermediate_size);
    v("activation", f.activation);
    v("limit", f.limit);
    v("alpha", f.alpha);
    v("has_biases", f.has_biases);
    v("round_weights", f.round_weights);
  }
  void validate() const;
  int32_t nb_inputs() const { return 4 + has_biases; }
  bool operator==(const MoeExpertsFields& other) const { return same_fields(*this, other); }
};

class MoeExpertsPlugin final : public PluginBase<MoeExpertsPlugin, MoeExpertsFields> {
 public:
  static constexpr const char* kName = kMoeExpertsPluginName;
  static constexpr const char* kVersion = kMoeExpertsPluginVersion;
  MoeExpertsPlugin(const MoeExpertsFields& fields, std::string plugin_namespace, std::string layer_name = "")
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
  int32_t getNbOutputs() const noexcept override { return 1; }
  size_t getWorkspaceSize(const nvinfer1::DynamicPluginTensorDesc* inputs, int32_t nb_inputs,
                          const nvinfer1::DynamicPluginTensorDesc* outputs, int32_t nb_outputs) const noexcept override;

  // IPluginV3OneRuntime
  int32_t onShapeChange(const nvinfer1::PluginTensorDesc* in, int32_t nb_inputs, const nvinfer1::PluginTensorDesc* out,
                        int32_t nb_outputs) noexcept override;
  int32_t enqueue(const nvinfer1::PluginTensorDesc* input_desc, const nvinfer1::PluginTensorDesc* output_desc,
                  const void* const* inputs, void* const* outputs, void* workspace,
                  cudaStream_t stream) noexcept override;
};

using MoeExpertsPluginCreator = PluginCreator<MoeExpertsPlugin>;

}  // namespace trt
}  // namespace moespec
