// MoespecBudgetedMoe: the TensorRT IPluginV3 door to moespec::cuda::moe_experts (see
// moe_experts_plugin.h). Shapes and dtypes in, views out, one kernel call; the shape and scalar
// checks are the core's validate_moe_experts, and every exception becomes a report plus TensorRT's
// failure value.
#include "moe_experts_plugin.h"

#include <cmath>
#include <utility>

#include "moespec/error.h"

namespace moespec {
namespace trt {

using nvinfer1::DataType;
using nvinfer1::DimsExprs;
using nvinfer1::DynamicPluginTensorDesc;
using nvinfer1::PluginFieldCollection;
using nvinfer1::PluginTensorDesc;

namespace {

constexpr int32_t idx(MoeExpertsInput input) { return static_cast<int32_t>(input); }

MoeExpertsArgs make_args(const MoeExpertsFields& f, const PluginTensorDesc* in, const void* const* inputs,
                         const PluginTensorDesc& out, void* output, int32_t device_index) {
  MoeExpertsArgs args;
  args.x = to_view(in[idx(MoeExpertsInput::kX)], inputs[idx(MoeExpertsInput::kX)], device_index);
  args.ids = to_view(in[idx(MoeExpertsInput::kIds)], inputs[idx(MoeExpertsInput::kIds)], device_index);
  args.weights = to_view(in[idx(MoeExpertsInput::kWeights)], inputs[idx(MoeExpertsInput::kWeights)], device_index);
  args.experts = to_view(in[idx(MoeExpertsInput::kExperts)], inputs[idx(MoeExpertsInput::kExperts)], device_index);
  if (f.has_biases)
    args.biases = to_view(in[idx(MoeExpertsInput::kBiases)], inputs[idx(MoeExpertsInput::kBiases)], device_index);
  args.out = to_view(out, output, device_index);
  args.intermediate_size = f.intermediate_size;
  args.activation = static_cast<ExpertActivation>(f.activation);
  args.limit = f.limit;
  args.alpha = f.alpha;
  args.round_weights = f.round_weights != 0;
  return args;
}

void check_counts(const MoeExpertsFields& f, int32_t nb_inputs, int32_t nb_outputs) {
  MOESPEC_CHECK_ARG(nb_inputs == f.nb_inputs(), "inputs", "expected ", f.nb_inputs(),
                    " inputs (x, ids, weights, experts", f.has_biases ? ", biases" : "", "), got ", nb_inputs);
  MOESPEC_CHECK_ARG(nb_outputs == 1, "outputs", "expected 1 output (out), got ", nb_outputs);
}

const nvinfer1::Dims& dims_2d(const nvinfer1::Dims& d, const char* name, const char* shape) {
  MOESPEC_CHECK_ARG(d.nbDims == 2, name, "expected a 2-d tensor ", shape, ", got ", d.nbDims, " dims");
  return d;
}

}  // namespace

// ---- MoeExpertsFields ----------------------------------------------------------------------------

void MoeExpertsFields::validate() const {
  MOESPEC_CHECK_ARG(intermediate_size >= 1, "intermediate_size", "must be >= 1, got ", intermediate_size,
                    intermediate_size == 0 ? " (a required field)" : "");
  MOESPEC_CHECK_ARG(activation == 0 || activation == 1, "activation", "must be 0 (SwiGLU) or 1 (GPT-OSS), got ",
                    activation);
  MOESPEC_CHECK_ARG(std::isfinite(limit) && std::isfinite(alpha), "limit", "limit and alpha must be finite, got ",
                    limit, " and ", alpha);
  MOESPEC_CHECK_ARG(has_biases == 0 || has_biases == 1, "has_biases", "must be 0 or 1, got ", has_biases);
  MOESPEC_CHECK_ARG(has_biases == 0 || activation == 1, "has_biases", "only activation 1 (GPT-OSS) takes biases");
  MOESPEC_CHECK_ARG(round_weights == 0 || round_weights == 1, "round_weights", "must be 0 or 1, got ", round_weights);
}

// ---- MoeExpertsPlugin ----------------------------------------------------------------------------

int32_t MoeExpertsPlugin::configurePlugin(const DynamicPluginTensorDesc* in, int32_t nb_inputs,
                                          const DynamicPluginTensorDesc* out, int32_t nb_outputs) noexcept {
  return guard("configurePlugin", int32_t{-1}, [&] {
    check_counts(fields_, nb_inputs, nb_outputs);
    MOESPEC_CHECK_ARG(in != nullptr && out != nullptr, "inputs", "no tensor descriptions given");
    // The core's checks on the profile's largest shapes (shapes only: placeholders stand in for data).
    static char placeholder;
    PluginTensorDesc in_max[5];
    const void* in_data[5] = {&placeholder, &placeholder, &placeholder, &placeholder, &placeholder};
    for (int32_t i = 0; i < nb_inputs; ++i) {
      in_max[i] = in[i].desc;
      in_max[i].dims = in[i].max;
    }
    PluginTensorDesc out_max = out[0].desc;
    out_max.dims = dims_2d(in[idx(MoeExpertsInput::kX)].max, "x", "[T, H]");
    const MoeExpertsArgs args = make_args(fields_, in_max, in_data, out_max, &placeholder, 0);
    validate_moe_experts(args);
    MOESPEC_CHECK_ARG(args.experts.shape[0] <= kMaxMoeExperts, "experts", "the CUDA kernel groups at most ",
                      kMaxMoeExperts, " experts, got ", args.experts.shape[0]);
    MOESPEC_CHECK_ARG(args.ids.shape[1] <= kMaxMoeSlots, "ids", "the CUDA kernel takes at most ", kMaxMoeSlots,
                      " slots per token, got ", args.ids.shape[1]);
    return int32_t{0};
  });
}

int32_t MoeExpertsPlugin::getOutputDataTypes(DataType* output_types, int32_t nb_outputs, const DataType* input_types,
                                             int32_t nb_inputs) const noexcept {
  return guard("getOutputDataTypes", int32_t{-1}, [&] {
    check_counts(fields_, nb_inputs, nb_outputs);
    MOESPEC_CHECK_ARG(output_types != nullptr && input_types != nullptr, "outputs", "no type arrays given");
    output_types[0] = input_types[idx(MoeExpertsInput::kX)];  // out has x's dtype
    return int32_t{0};
  });
}

int32_t MoeExpertsPlugin::getOutputShapes(const DimsExprs* inputs, int32_t nb_inputs, const DimsExprs*, int32_t,
                                          DimsExprs* outputs, int32_t nb_outputs, nvinfer1::IExprBuilder&) noexcept {
  return guard("getOutputShapes", int32_t{-1}, [&] {
    check_counts(fields_, nb_inputs, nb_outputs);
    MOESPEC_CHECK_ARG(inputs != nullptr && outputs != nullptr, "inputs", "no dimension arrays given");
    const DimsExprs& x = inputs[idx(MoeExpertsInput::kX)];
    MOESPEC_CHECK_ARG(x.nbDims == 2, "x", "expected a 2-d tensor [T, H], got ", x.nbDims, " dims");
    outputs[0] = x;  // [T, H]
    return int32_t{0};
  });
}

bool MoeExpertsPlugin::supportsFormatCombination(int32_t pos, const DynamicPluginTensorDesc* in_out,
                                                 int32_t nb_inputs, int32_t nb_outputs) noexcept {
  return guard("supportsFormatCombination", false, [&] {
    check_counts(fields_, nb_inputs, nb_outputs);
    MOESPEC_CHECK_ARG(in_out != nullptr && pos >= 0 && pos < nb_inputs + nb_outputs, "pos", "position ", pos,
                      " outside the ", nb_inputs + nb_outputs, " tensors");
    const PluginTensorDesc& desc = in_out[pos].desc;
    if (desc.format != nvinfer1::TensorFormat::kLINEAR) return false;
    const DataType type = desc.type;
    const DataType x = in_out[idx(MoeExpertsInput::kX)].desc.type;
    switch (pos) {
      case idx(MoeExpertsInput::kX): return type == DataType::kBF16 || type == DataType::kFLOAT;
      case idx(MoeExpertsInput::kIds): return type == DataType::kINT32;
      case idx(MoeExpertsInput::kWeights): return type == DataType::kFLOAT;
      case idx(MoeExpertsInput::kExperts): return type == x;  // the weights' dtype is x's
      default: break;
    }
    if (pos < nb_inputs) return type == DataType::kFLOAT;  // biases
    return type == x;                                      // out
  });
}

size_t MoeExpertsPlugin::getWorkspaceSize(const DynamicPluginTensorDesc* inputs, int32_t nb_inputs,
                                          const DynamicPluginTensorDesc*, int32_t nb_outputs) const noexcept {
  return guard("getWorkspaceSize", size_t{0}, [&] {
    check_counts(fields_, nb_inputs, nb_outputs);
    MOESPEC_CHECK_ARG(inputs != nullptr, "inputs", "no tensor descriptions given");
    const nvinfer1::Dims& x = dims_2d(inputs[idx(MoeExpertsInput::kX)].max, "x", "[T, H]");
    const nvinfer1::Dims& ids = dims_2d(inputs[idx(MoeExpertsInput::kIds)].max, "ids", "[T, K]");
    const nvinfer1::Dims& experts = dims_2d(inputs[idx(MoeExpertsInput::kExperts)].max, "experts", "[E, 3 I H]");
    return cuda::moe_experts_workspace_size(x.d[0], ids.d[1], experts.d[0], x.d[1], fields_.intermediate_size,
                                            to_dtype(inputs[idx(MoeExpertsInput::kX)].desc.type));
  });
}

int32_t MoeExpertsPlugin::onShapeChange(const PluginTensorDesc* in, int32_t nb_inputs, const PluginTensorDesc* out,
                                        int32_t nb_outputs) noexcept {
  return guard("onShapeChange", int32_t{-1}, [&] {
    check_counts(fields_, nb_inputs, nb_outputs);
    MOESPEC_CHECK_ARG(in != nullptr && out != nullptr, "inputs", "no tensor descriptions given");
    return int32_t{0};  // enqueue reads the shapes it gets
  });
}

int32_t MoeExpertsPlugin::enqueue(const PluginTensorDesc* input_desc, const PluginTensorDesc* output_desc,
                                  const void* const* inputs, void* const* outputs, void* workspace,
                                  cudaStream_t stream) noexcept {
  return guard("enqueue", int32_t{-1}, [&] {
    MOESPEC_CHECK_ARG(input_desc != nullptr && output_desc != nullptr && inputs != nullptr && outputs != nullptr,
                      "inputs", "no tensors given");
    const MoeExpertsArgs args = make_args(fields_, input_desc, inputs, output_desc[0], outputs[0], current_device());
    const std::size_t bytes = cuda::moe_experts_workspace_size(
        args.x.shape[0], args.ids.shape[1], args.experts.shape[0], args.x.shape[1], fields_.intermediate_size,
        args.x.dtype);
    cuda::moe_experts(args, workspace, bytes, static_cast<void*>(stream));
    return int32_t{0};
  });
}

}  // namespace trt
}  // namespace moespec
