// MoespecTreeSelect: the TensorRT IPluginV3 door to EcoSpec's cost-aware tree selection on CUDA.
//
// A thin adapter (STYLE.md habit 13) over two kernels declared in cpp/include/moespec/
// select_cost_aware.h: moespec::cuda::select_cost_aware (the rule, documented there, applied
// request after request with one expert buffer and the step's S, A carried) and
// moespec::cuda::tree_from_selection (the chosen, ancestor-closed candidates -> the verify tree's
// tokens, parents, depths and packed ancestor-or-self mask). Their CPU reference is
// moespec::select_cost_aware (cpp/src/select_cost_aware.cc) with moespec.spec.tree.tree_from_selection;
// the unit test is tests/tensorrt/test_tree_select_plugin.cc. With cost_weight 0 (or all costs 0)
// the selection is EAGLE-2's: the best total_tokens candidates by cumulative log-probability.
// Dimensions: B requests, C candidates per request (EAGLE-2's expansion), L MoE layers, K predicted
// experts per candidate and layer, N experts, M = total_tokens, W = ceil((M + 1) / 32).
//
// Plugin fields:
//   total_tokens       INT32, M: nodes besides the root, required, in [1, kMaxTreeTokens]
//   token_s            FLOAT32 >= 0: verify time of one more token besides its new experts (default 0)
//   cost_weight        FLOAT32 >= 0: multiplies every cost (token_s, expert_s); 0 = EAGLE-2 (default 1)
//   has_predicted_p    INT32 0 | 1: input `predicted_p` is present (else every prediction counts as sure)
// Serialization is these same fields.
#pragma once

#include <NvInferRuntime.h>

#include <cstdint>
#include <string>
#include <utility>

#include "plugin_common.h"

namespace moespec {
namespace trt {

constexpr char kTreeSelectPluginName[] = "MoespecTreeSelect";
constexpr char kTreeSelectPluginVersion[] = "1";
constexpr int32_t kMaxTreeTokens = 4096;     // M: bounds the outputs' size
constexpr int32_t kMaxTreeCandidates = 4096;  // C: the kernels keep one byte (selection) and one word (tree) per candidate in shared memory

enum class TreeSelectInput : int32_t {
  kParents = 0,        // [B, C] int32: candidate index of the parent, -1 = the root; parents first
  kDepth = 1,          // [B, C] int32 >= 1
  kScores = 2,         // [B, C] float32: cumulative draft log-probabilities (-inf: never chosen)
  kNumCandidates = 3,  // [B] int32 in [0, C]: request b's candidates are its first ones
  kCandTokens = 4,     // [B, C] int32: each candidate's token
  kRootTokens = 5,     // [B] int32: each tree's root (the last accepted token)
  kPredicted = 6,      // [B, C, L, K] int32: predicted expert ids per candidate and MoE layer
  kBuffer = 7,         // [L, N] float32 in [0, 1]: the experts the verify pass already reads (the roots')
  kExpertS = 8,        // [L] float32 >= 0: time of one more expert of layer l
  kState = 9,          // [2] float32: S, A before the batch (step seconds so far, expected tokens > 0)
  kPredictedP = 10,    // [B, C, L, K] float32 in [0, 1] (when has_predicted_p)
};

enum class TreeSelectOutput : int32_t {
  kTokens = 0,    // [B, M + 1] int32: the root, then the chosen candidates in candidate order; 0 past the tree
  kParents = 1,   // [B, M + 1] int32: node index of the parent, -1 for the root and past the tree
  kDepth = 2,     // [B, M + 1] int32
  kMask = 3,      // [B, M + 1, W] int32: bit j of row i set iff node j is node i or an ancestor
  kNumNodes = 4,  // [B] int32: chosen + 1
  kBuffer = 5,    // [L, N] float32: the buffer with the chosen nodes' experts
  kState = 6,     // [2] float32: S, A after the batch
  kCount = 7,
};

struct TreeSelectFields {
  int32_t total_tokens = 0;  // no default: a missing one is an error
  float token_s = 0.0f;
  float cost_weight = 1.0f;
  int32_t has_predicted_p = 0;

  template <typename F, typename Visit>
  static void visit(F& f, Visit&& v) {
    v("total_tokens", f.total_tokens);
    v("token_s", f.token_s);
    v("cost_weight", f.cost_weight);
    v("has_predicted_p", f.has_predicted_p);
  }
  void validate() const;
  int32_t nb_inputs() const { return 10 + has_predicted_p; }
  int32_t rows() const { return total_tokens + 1; }            // M + 1
  int32_t mask_words() const { return (rows() + 31) / 32; }  // W
  bool operator==(const TreeSelectFields& other) const { return same_fields(*this, other); }
};

class TreeSelectPlugin final : public PluginBase<TreeSelectPlugin, TreeSelectFields> {
 public:
  static constexpr const char* kName = kTreeSelectPluginName;
  static constexpr const char* kVersion = kTreeSelectPluginVersion;
  TreeSelectPlugin(const TreeSelectFields& fields, std::string plugin_namespace, std::string layer_name = "")
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
  int32_t getNbOutputs() const noexcept override { return static_cast<int32_t>(TreeSelectOutput::kCount); }
  size_t getWorkspaceSize(const nvinfer1::DynamicPluginTensorDesc* inputs, int32_t nb_inputs,
                          const nvinfer1::DynamicPluginTensorDesc* outputs, int32_t nb_outputs) const noexcept override;

  // IPluginV3OneRuntime
  int32_t onShapeChange(const nvinfer1::PluginTensorDesc* in, int32_t nb_inputs, const nvinfer1::PluginTensorDesc* out,
                        int32_t nb_outputs) noexcept override;
  int32_t enqueue(const nvinfer1::PluginTensorDesc* input_desc, const nvinfer1::PluginTensorDesc* output_desc,
                  const void* const* inputs, void* const* outputs, void* workspace,
                  cudaStream_t stream) noexcept override;
};

using TreeSelectPluginCreator = PluginCreator<TreeSelectPlugin>;

// Workspace bytes for B requests of C candidates: the selection's chosen list [B, C] and counts [B].
size_t tree_select_workspace_size(int64_t B, int64_t C);

}  // namespace trt
}  // namespace moespec
