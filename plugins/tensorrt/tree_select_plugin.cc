// MoespecTreeSelect: the TensorRT IPluginV3 door to moespec::cuda::select_cost_aware and
// moespec::cuda::tree_from_selection (see tree_select_plugin.h). Shapes are checked here, once,
// against each other (the kernels check them again at enqueue); every exception becomes a report
// plus TensorRT's failure value.
#include "tree_select_plugin.h"

#include <cuda_runtime_api.h>

#include <cmath>

#include "moespec/error.h"
#include "moespec/select_cost_aware.h"

namespace moespec {
namespace trt {

using nvinfer1::DataType;
using nvinfer1::Dims;
using nvinfer1::DimsExprs;
using nvinfer1::DynamicPluginTensorDesc;
using nvinfer1::PluginTensorDesc;

namespace {

constexpr int32_t kNbOutputs = static_cast<int32_t>(TreeSelectOutput::kCount);
constexpr int32_t idx(TreeSelectInput input) { return static_cast<int32_t>(input); }
constexpr int32_t idx(TreeSelectOutput output) { return static_cast<int32_t>(output); }
constexpr size_t kAlign = 256;

size_t aligned(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

void check_counts(const TreeSelectFields& f, int32_t nb_inputs, int32_t nb_outputs) {
  MOESPEC_CHECK_ARG(nb_inputs == f.nb_inputs(), "inputs", "expected ", f.nb_inputs(),
                    " inputs (parents, depth, scores, num_candidates, cand_tokens, root_tokens, predicted, buffer, "
                    "expert_s, state", f.has_predicted_p ? ", predicted_p" : "", "), got ", nb_inputs);
  MOESPEC_CHECK_ARG(nb_outputs == kNbOutputs, "outputs", "expected ", kNbOutputs,
                    " outputs (tokens, parents, depth, mask, num_nodes, buffer, state), got ", nb_outputs);
}

// B, C, L, K, N of the inputs' dims, each input checked against them.
struct TreeShapes {
  int64_t B = 0, C = 0, L = 0, K = 0, N = 0;
};

void expect(const Dims& d, const char* name, std::initializer_list<int64_t> want, const char* shape) {
  bool ok = d.nbDims == static_cast<int32_t>(want.size());
  int32_t i = 0;
  for (int64_t w : want) ok = ok && d.d[i++] == w;
  if (!ok) {
    std::string got = "[";
    for (int32_t j = 0; j < d.nbDims; ++j) got += (j ? ", " : "") + std::to_string(d.d[j]);
    throw_invalid(name, "expected ", shape, ", got ", got, "]");
  }
}

TreeShapes tree_shapes(const TreeSelectFields& f, const Dims* in) {
  TreeShapes s;
  const Dims& parents = in[idx(TreeSelectInput::kParents)];
  MOESPEC_CHECK_ARG(parents.nbDims == 2, "parents", "expected [B, C], got ", parents.nbDims, " dims");
  s.B = parents.d[0], s.C = parents.d[1];
  const Dims& predicted = in[idx(TreeSelectInput::kPredicted)];
  MOESPEC_CHECK_ARG(predicted.nbDims == 4, "predicted", "expected [B, C, L, K], got ", predicted.nbDims, " dims");
  s.L = predicted.d[2], s.K = predicted.d[3];
  const Dims& buffer = in[idx(TreeSelectInput::kBuffer)];
  MOESPEC_CHECK_ARG(buffer.nbDims == 2, "buffer", "expected [L, N], got ", buffer.nbDims, " dims");
  s.N = buffer.d[1];
  expect(in[idx(TreeSelectInput::kDepth)], "depth", {s.B, s.C}, "[B, C] as parents");
  expect(in[idx(TreeSelectInput::kScores)], "scores", {s.B, s.C}, "[B, C] as parents");
  expect(in[idx(TreeSelectInput::kNumCandidates)], "num_candidates", {s.B}, "[B]");
  expect(in[idx(TreeSelectInput::kCandTokens)], "cand_tokens", {s.B, s.C}, "[B, C] as parents");
  expect(in[idx(TreeSelectInput::kRootTokens)], "root_tokens", {s.B}, "[B]");
  expect(predicted, "predicted", {s.B, s.C, s.L, s.K}, "[B, C, L, K] with B, C of parents");
  expect(buffer, "buffer", {s.L, s.N}, "[L, N] with L of predicted");
  expect(in[idx(TreeSelectInput::kExpertS)], "expert_s", {s.L}, "[L]");
  expect(in[idx(TreeSelectInput::kState)], "state", {2}, "[2] (S, A)");
  if (f.has_predicted_p) expect(in[idx(TreeSelectInput::kPredictedP)], "predicted_p", {s.B, s.C, s.L, s.K},
                                "[B, C, L, K] as predicted");
  MOESPEC_CHECK_ARG(s.C >= 1 && s.C <= kMaxTreeCandidates, "parents", "C must be in [1, ", kMaxTreeCandidates,
                    "] candidates per request, got ", s.C);
  MOESPEC_CHECK_ARG(s.L >= 1 && s.K >= 1 && s.N >= 1 && s.L * s.K <= (int64_t{1} << 20), "predicted",
                    "L, K and N must be >= 1 with L * K <= 2^20, got L=", s.L, ", K=", s.K, ", N=", s.N);
  return s;
}

// tree_shapes over the dims `get` takes from each of the inputs (a profile's max, or the bound shapes).
template <typename Desc, typename Get>
TreeShapes shapes_of(const TreeSelectFields& f, const Desc* in, int32_t nb_inputs, Get&& get) {
  Dims dims[11];
  for (int32_t i = 0; i < nb_inputs; ++i) dims[i] = get(in[i]);
  return tree_shapes(f, dims);
}

TensorView input(const PluginTensorDesc* desc, const void* const* data, TreeSelectInput which, int32_t device) {
  return to_view(desc[idx(which)], data[idx(which)], device);
}

TensorView output(const PluginTensorDesc* desc, void* const* data, TreeSelectOutput which, int32_t device) {
  return to_view(desc[idx(which)], data[idx(which)], device);
}

void check_cuda_call(cudaError_t status, const char* what) {
  if (status != cudaSuccess) throw_runtime(what, " failed: ", cudaGetErrorString(status));
}

}  // namespace

size_t tree_select_workspace_size(int64_t B, int64_t C) {
  return aligned(sizeof(int32_t) * static_cast<size_t>(B * C)) + aligned(sizeof(int32_t) * static_cast<size_t>(B));
}

// ---- TreeSelectFields ----------------------------------------------------------------------------

void TreeSelectFields::validate() const {
  MOESPEC_CHECK_ARG(total_tokens >= 1 && total_tokens <= kMaxTreeTokens, "total_tokens", "must be in [1, ",
                    kMaxTreeTokens, "], got ", total_tokens, total_tokens == 0 ? " (a required field)" : "");
  MOESPEC_CHECK_ARG(std::isfinite(token_s) && token_s >= 0.0f, "token_s", "must be finite and >= 0, got ", token_s);
  MOESPEC_CHECK_ARG(std::isfinite(cost_weight) && cost_weight >= 0.0f, "cost_weight",
                    "must be finite and >= 0 (0: EAGLE-2's selection), got ", cost_weight);
  MOESPEC_CHECK_ARG(has_predicted_p == 0 || has_predicted_p == 1, "has_predicted_p", "must be 0 or 1, got ",
                    has_predicted_p);
}

// ---- TreeSelectPlugin ----------------------------------------------------------------------------

int32_t TreeSelectPlugin::configurePlugin(const DynamicPluginTensorDesc* in, int32_t nb_inputs,
                                          const DynamicPluginTensorDesc* out, int32_t nb_outputs) noexcept {
  return guard("configurePlugin", int32_t{-1}, [&] {
    check_counts(fields_, nb_inputs, nb_outputs);
    MOESPEC_CHECK_ARG(in != nullptr && out != nullptr, "inputs", "no tensor descriptions given");
    shapes_of(fields_, in, nb_inputs, [](const DynamicPluginTensorDesc& d) { return d.max; });
    return int32_t{0};
  });
}

int32_t TreeSelectPlugin::getOutputDataTypes(DataType* output_types, int32_t nb_outputs, const DataType* input_types,
                                             int32_t nb_inputs) const noexcept {
  return guard("getOutputDataTypes", int32_t{-1}, [&] {
    check_counts(fields_, nb_inputs, nb_outputs);
    MOESPEC_CHECK_ARG(output_types != nullptr && input_types != nullptr, "outputs", "no type arrays given");
    for (int32_t i = 0; i < kNbOutputs; ++i) output_types[i] = DataType::kINT32;
    output_types[idx(TreeSelectOutput::kBuffer)] = DataType::kFLOAT;
    output_types[idx(TreeSelectOutput::kState)] = DataType::kFLOAT;
    return int32_t{0};
  });
}

int32_t TreeSelectPlugin::getOutputShapes(const DimsExprs* inputs, int32_t nb_inputs, const DimsExprs*, int32_t,
                                          DimsExprs* outputs, int32_t nb_outputs,
                                          nvinfer1::IExprBuilder& exprs) noexcept {
  return guard("getOutputShapes", int32_t{-1}, [&] {
    check_counts(fields_, nb_inputs, nb_outputs);
    MOESPEC_CHECK_ARG(inputs != nullptr && outputs != nullptr, "inputs", "no dimension arrays given");
    const DimsExprs& parents = inputs[idx(TreeSelectInput::kParents)];
    MOESPEC_CHECK_ARG(parents.nbDims == 2, "parents", "expected [B, C], got ", parents.nbDims, " dims");
    const nvinfer1::IDimensionExpr* rows = exprs.constant(fields_.rows());
    MOESPEC_CHECK_ARG(rows != nullptr, "total_tokens", "the expression builder gave no constant");
    for (TreeSelectOutput o : {TreeSelectOutput::kTokens, TreeSelectOutput::kParents, TreeSelectOutput::kDepth}) {
      DimsExprs& d = outputs[idx(o)];
      d.nbDims = 2, d.d[0] = parents.d[0], d.d[1] = rows;  // [B, M + 1]
    }
    DimsExprs& mask = outputs[idx(TreeSelectOutput::kMask)];
    mask.nbDims = 3, mask.d[0] = parents.d[0], mask.d[1] = rows, mask.d[2] = exprs.constant(fields_.mask_words());
    DimsExprs& nodes = outputs[idx(TreeSelectOutput::kNumNodes)];
    nodes.nbDims = 1, nodes.d[0] = parents.d[0];
    outputs[idx(TreeSelectOutput::kBuffer)] = inputs[idx(TreeSelectInput::kBuffer)];
    outputs[idx(TreeSelectOutput::kState)] = inputs[idx(TreeSelectInput::kState)];
    return int32_t{0};
  });
}

bool TreeSelectPlugin::supportsFormatCombination(int32_t pos, const DynamicPluginTensorDesc* in_out,
                                                 int32_t nb_inputs, int32_t nb_outputs) noexcept {
  return guard("supportsFormatCombination", false, [&] {
    check_counts(fields_, nb_inputs, nb_outputs);
    MOESPEC_CHECK_ARG(in_out != nullptr && pos >= 0 && pos < nb_inputs + nb_outputs, "pos", "position ", pos,
                      " outside the ", nb_inputs + nb_outputs, " tensors");
    const PluginTensorDesc& desc = in_out[pos].desc;
    if (desc.format != nvinfer1::TensorFormat::kLINEAR) return false;
    bool is_float = false;
    if (pos < nb_inputs) {
      const auto which = static_cast<TreeSelectInput>(pos);
      is_float = which == TreeSelectInput::kScores || which == TreeSelectInput::kBuffer ||
                 which == TreeSelectInput::kExpertS || which == TreeSelectInput::kState ||
                 which == TreeSelectInput::kPredictedP;
    } else {
      const auto which = static_cast<TreeSelectOutput>(pos - nb_inputs);
      is_float = which == TreeSelectOutput::kBuffer || which == TreeSelectOutput::kState;
    }
    return desc.type == (is_float ? DataType::kFLOAT : DataType::kINT32);
  });
}

size_t TreeSelectPlugin::getWorkspaceSize(const DynamicPluginTensorDesc* inputs, int32_t nb_inputs,
                                          const DynamicPluginTensorDesc*, int32_t nb_outputs) const noexcept {
  return guard("getWorkspaceSize", size_t{0}, [&] {
    check_counts(fields_, nb_inputs, nb_outputs);
    MOESPEC_CHECK_ARG(inputs != nullptr, "inputs", "no tensor descriptions given");
    const Dims& parents = inputs[idx(TreeSelectInput::kParents)].max;
    MOESPEC_CHECK_ARG(parents.nbDims == 2, "parents", "expected [B, C], got ", parents.nbDims, " dims");
    return tree_select_workspace_size(parents.d[0], parents.d[1]);
  });
}

int32_t TreeSelectPlugin::onShapeChange(const PluginTensorDesc* in, int32_t nb_inputs, const PluginTensorDesc* out,
                                        int32_t nb_outputs) noexcept {
  return guard("onShapeChange", int32_t{-1}, [&] {
    check_counts(fields_, nb_inputs, nb_outputs);
    MOESPEC_CHECK_ARG(in != nullptr && out != nullptr, "inputs", "no tensor descriptions given");
    shapes_of(fields_, in, nb_inputs, [](const PluginTensorDesc& d) { return d.dims; });
    return int32_t{0};
  });
}

int32_t TreeSelectPlugin::enqueue(const PluginTensorDesc* in, const PluginTensorDesc* out, const void* const* inputs,
                                  void* const* outputs, void* workspace, cudaStream_t stream) noexcept {
  return guard("enqueue", int32_t{-1}, [&] {
    MOESPEC_CHECK_ARG(in != nullptr && out != nullptr && inputs != nullptr && outputs != nullptr, "inputs",
                      "no tensors given");
    const int32_t dev = current_device();
    const int64_t B = in[idx(TreeSelectInput::kParents)].dims.d[0], C = in[idx(TreeSelectInput::kParents)].dims.d[1];
    // The buffer and the state are read and updated in place: start from copies in the outputs.
    const TensorView buffer = output(out, outputs, TreeSelectOutput::kBuffer, dev);
    const TensorView state = output(out, outputs, TreeSelectOutput::kState, dev);
    check_cuda_call(cudaMemcpyAsync(buffer.data, inputs[idx(TreeSelectInput::kBuffer)],
                                    sizeof(float) * static_cast<size_t>(buffer.numel()), cudaMemcpyDeviceToDevice,
                                    stream), "cudaMemcpyAsync (buffer)");
    check_cuda_call(cudaMemcpyAsync(state.data, inputs[idx(TreeSelectInput::kState)], 2 * sizeof(float),
                                    cudaMemcpyDeviceToDevice, stream), "cudaMemcpyAsync (state)");
    MOESPEC_CHECK_ARG(workspace != nullptr || B * C == 0, "workspace", "no workspace given");
    TensorView selected = to_view(in[idx(TreeSelectInput::kParents)], workspace, dev);  // [B, C] int32
    PluginTensorDesc count_desc = in[idx(TreeSelectInput::kNumCandidates)];             // [B] int32
    TensorView count = to_view(count_desc, static_cast<char*>(workspace) + aligned(sizeof(int32_t) * B * C), dev);

    SelectCostAwareBatchArgs sel;
    sel.parents = input(in, inputs, TreeSelectInput::kParents, dev);
    sel.depth = input(in, inputs, TreeSelectInput::kDepth, dev);
    sel.scores = input(in, inputs, TreeSelectInput::kScores, dev);
    sel.num_candidates = input(in, inputs, TreeSelectInput::kNumCandidates, dev);
    sel.predicted = input(in, inputs, TreeSelectInput::kPredicted, dev);
    if (fields_.has_predicted_p) sel.predicted_p = input(in, inputs, TreeSelectInput::kPredictedP, dev);
    sel.buffer = buffer;
    sel.expert_s = input(in, inputs, TreeSelectInput::kExpertS, dev);
    sel.state = state;
    sel.selected = selected;
    sel.count = count;
    sel.token_s = fields_.token_s;
    sel.cost_scale = fields_.cost_weight;
    sel.total_tokens = fields_.total_tokens;
    cuda::select_cost_aware(sel, static_cast<void*>(stream));

    TreeFromSelectionArgs tree;
    tree.selected = selected;
    tree.count = count;
    tree.cand_parents = sel.parents;
    tree.cand_tokens = input(in, inputs, TreeSelectInput::kCandTokens, dev);
    tree.root_tokens = input(in, inputs, TreeSelectInput::kRootTokens, dev);
    tree.tokens = output(out, outputs, TreeSelectOutput::kTokens, dev);
    tree.parents = output(out, outputs, TreeSelectOutput::kParents, dev);
    tree.depth = output(out, outputs, TreeSelectOutput::kDepth, dev);
    tree.mask = output(out, outputs, TreeSelectOutput::kMask, dev);
    tree.num_nodes = output(out, outputs, TreeSelectOutput::kNumNodes, dev);
    cuda::tree_from_selection(tree, static_cast<void*>(stream));
    return int32_t{0};
  });
}

}  // namespace trt
}  // namespace moespec
