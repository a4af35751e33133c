// Unit test of the MoespecTreeSelect TensorRT plugin (plugins/tensorrt/tree_select_plugin.*): its
// metadata (outputs, dtypes, shapes, formats, workspace), its field and shape validation, and its
// serialization round trip. Like the other plugin tests it needs neither a GPU nor libnvinfer
// (plugin_test.h has the stand-ins); tests/gpu/test_plugins_cuda.py runs its enqueue.
#include <NvInferRuntime.h>

#include <memory>
#include <string>
#include <vector>

#include "check.h"
#include "plugin_log.h"
#include "plugin_test.h"
#include "tree_select_plugin.h"

using moespec::trt::TreeSelectFields;
using moespec::trt::TreeSelectPlugin;
using moespec::trt::TreeSelectPluginCreator;
using nvinfer1::TensorRTPhase;

using namespace plugin_test;  // NOLINT(build/namespaces): the shared test helpers

namespace {

constexpr int64_t B = 3, C = 40, L = 4, K = 8, N = 64;
constexpr int32_t M = 40;  // total_tokens: 41 rows, 2 mask words

TreeSelectPluginCreator& creator() {
  static TreeSelectPluginCreator c;
  return c;
}

std::unique_ptr<IPluginV3> create(const PluginFieldCollection* fc) {
  return std::unique_ptr<IPluginV3>(creator().createPlugin("tree0", fc, TensorRTPhase::kBUILD));
}

Fields eco(bool with_p = true) {
  Fields f;
  f.i32("total_tokens", M).f32("token_s", 2e-4f).f32("cost_weight", 1.0f).i32("has_predicted_p", with_p ? 1 : 0);
  return f;
}

// The inputs (predicted_p last when present), then the outputs, at the test shapes.
std::vector<DynamicPluginTensorDesc> tensors(bool with_p) {
  const DataType i32 = DataType::kINT32, f32 = DataType::kFLOAT;
  std::vector<DynamicPluginTensorDesc> d = {
      desc(i32, {B, C}), desc(i32, {B, C}),       desc(f32, {B, C}), desc(i32, {B}), desc(i32, {B, C}),
      desc(i32, {B}),    desc(i32, {B, C, L, K}), desc(f32, {L, N}), desc(f32, {L}), desc(f32, {2})};
  if (with_p) d.push_back(desc(f32, {B, C, L, K}));
  for (auto out : {desc(i32, {B, M + 1}), desc(i32, {B, M + 1}), desc(i32, {B, M + 1}), desc(i32, {B, M + 1, 2}),
                   desc(i32, {B}), desc(f32, {L, N}), desc(f32, {2})})
    d.push_back(out);
  return d;
}

}  // namespace

TEST(creator_metadata_and_identity) {
  TreeSelectPluginCreator& c = creator();
  CHECK(std::string(c.getPluginName()) == "MoespecTreeSelect");
  CHECK(std::string(c.getPluginVersion()) == "1" && std::string(c.getPluginNamespace()) == "moespec");
  const PluginFieldCollection* names = c.getFieldNames();
  CHECK(names != nullptr && names->nbFields == 4);
  const char* expected[] = {"total_tokens", "token_s", "cost_weight", "has_predicted_p"};
  const PluginFieldType types[] = {PluginFieldType::kINT32, PluginFieldType::kFLOAT32, PluginFieldType::kFLOAT32,
                                   PluginFieldType::kINT32};
  for (int i = 0; names != nullptr && i < names->nbFields && i < 4; ++i) {
    CHECK_MSG(std::string(names->fields[i].name) == expected[i], names->fields[i].name);
    CHECK(names->fields[i].type == types[i] && names->fields[i].data == nullptr);
  }
  Fields f = eco();
  auto p = create(f.collection());
  CHECK(p != nullptr);
  if (!p) return;
  CHECK(build_of(*p)->getNbOutputs() == 7 && runtime_of(*p) != nullptr);
}

TEST(output_dtypes_shapes_and_formats) {
  Fields f = eco();
  auto p = create(f.collection());
  CHECK(p != nullptr);
  if (!p) return;
  IPluginV3OneBuild* b = build_of(*p);
  std::vector<DataType> in_types(11, DataType::kINT32);
  DataType out_types[7];
  CHECK(b->getOutputDataTypes(out_types, 7, in_types.data(), 11) == 0);
  for (int i = 0; i < 5; ++i) CHECK(out_types[i] == DataType::kINT32);
  CHECK(out_types[5] == DataType::kFLOAT && out_types[6] == DataType::kFLOAT);
  CHECK(b->getOutputDataTypes(out_types, 7, in_types.data(), 10) != 0);  // has_predicted_p: 11 inputs
  FakeExprBuilder exprs;
  nvinfer1::DimsExprs in[11];
  for (auto& d : in) d.nbDims = 2, d.d[0] = exprs.symbol(), d.d[1] = exprs.symbol();
  nvinfer1::DimsExprs out[7];
  CHECK(b->getOutputShapes(in, 11, nullptr, 0, out, 7, exprs) == 0);
  for (int i = 0; i < 3; ++i) {  // tokens, parents, depth: [B, M + 1]
    CHECK(out[i].nbDims == 2 && out[i].d[0] == in[0].d[0]);
    CHECK(out[i].d[1]->isConstant() && out[i].d[1]->getConstantValue() == M + 1);
  }
  CHECK(out[3].nbDims == 3 && out[3].d[0] == in[0].d[0] && out[3].d[2]->getConstantValue() == 2);  // W = 2
  CHECK(out[4].nbDims == 1 && out[4].d[0] == in[0].d[0]);
  CHECK(out[5].d[0] == in[7].d[0] && out[5].d[1] == in[7].d[1]);  // the buffer's shape
  CHECK(out[6].d[0] == in[9].d[0]);                               // the state's
  auto t = tensors(true);
  for (int pos = 0; pos < 18; ++pos) CHECK_MSG(b->supportsFormatCombination(pos, t.data(), 11, 7), std::to_string(pos));
  auto wrong = tensors(true);
  wrong[2] = desc(DataType::kHALF, {B, C});  // scores are float32
  CHECK(!b->supportsFormatCombination(2, wrong.data(), 11, 7));
  wrong[0] = desc(DataType::kFLOAT, {B, C});  // parents are int32
  CHECK(!b->supportsFormatCombination(0, wrong.data(), 11, 7));
  wrong[14] = desc(DataType::kINT32, {B, M + 1, 2}, TensorFormat::kCHW32);  // the mask output, not linear
  CHECK(!b->supportsFormatCombination(14, wrong.data(), 11, 7));
  wrong[16] = desc(DataType::kINT32, {L, N});  // the buffer output is float32
  CHECK(!b->supportsFormatCombination(16, wrong.data(), 11, 7));
}

TEST(configure_checks_shapes_and_workspace_holds_the_selection) {
  Fields f = eco(false);
  auto p = create(f.collection());
  CHECK(p != nullptr);
  if (!p) return;
  IPluginV3OneBuild* b = build_of(*p);
  auto t = tensors(false);
  CHECK(b->configurePlugin(t.data(), 10, &t[10], 7) == 0);
  const size_t ws = b->getWorkspaceSize(t.data(), 10, &t[10], 7);
  CHECK(ws == moespec::trt::tree_select_workspace_size(B, C) && ws >= sizeof(int32_t) * (B * C + B));
  struct Bad {
    int pos;
    DynamicPluginTensorDesc d;
    const char* names;
  };
  const Bad cases[] = {{1, desc(DataType::kINT32, {B, C + 1}), "depth"},
                       {3, desc(DataType::kINT32, {B + 1}), "num_candidates"},
                       {6, desc(DataType::kINT32, {B, C, L, K, 1}), "predicted"},
                       {7, desc(DataType::kFLOAT, {L + 1, N}), "buffer"},
                       {8, desc(DataType::kFLOAT, {L - 1}), "expert_s"},
                       {9, desc(DataType::kFLOAT, {3}), "state"},
                       {0, desc(DataType::kINT32, {B, moespec::trt::kMaxTreeCandidates + 1}), "parents"}};
  for (const Bad& c : cases) {
    auto bad = tensors(false);
    bad[c.pos] = c.d;
    if (c.pos == 0) {  // C everywhere else too, so that only the limit fails
      for (int i : {1, 2, 4}) bad[i] = desc(bad[i].desc.type, {B, moespec::trt::kMaxTreeCandidates + 1});
      bad[6] = desc(DataType::kINT32, {B, moespec::trt::kMaxTreeCandidates + 1, L, K});
    }
    moespec::trt::clear_last_error();
    CHECK_MSG(b->configurePlugin(bad.data(), 10, &bad[10], 7) != 0, c.names);
    CHECK_MSG(error_mentions(c.names) && error_mentions("MoespecTreeSelect 'tree0'"), moespec::trt::last_error());
  }
}

TEST(serialization_round_trip_and_clone) {
  Fields f = eco();
  auto p = create(f.collection());
  CHECK(p != nullptr);
  if (!p) return;
  const PluginFieldCollection* saved = runtime_of(*p)->getFieldsToSerialize();
  CHECK(saved != nullptr && saved->nbFields == 4);
  auto back = std::unique_ptr<IPluginV3>(creator().createPlugin("tree0", saved, TensorRTPhase::kRUNTIME));
  CHECK(back != nullptr);
  if (!back) return;
  const TreeSelectFields& a = dynamic_cast<TreeSelectPlugin&>(*p).fields();
  const TreeSelectFields& c = dynamic_cast<TreeSelectPlugin&>(*back).fields();
  CHECK(a == c && c.total_tokens == M && c.token_s == 2e-4f && c.cost_weight == 1.0f && c.has_predicted_p == 1);
  std::string why;
  CHECK_MSG(same_fields(*saved, *runtime_of(*back)->getFieldsToSerialize(), &why), why);
  auto copy = std::unique_ptr<IPluginV3>(p->clone());
  CHECK(copy != nullptr && dynamic_cast<TreeSelectPlugin&>(*copy).fields() == a);
}

TEST(bad_fields_are_refused_by_name) {
  struct Bad {
    Fields fields;
    const char* names;
  };
  Fields missing;
  Fields big;
  big.i32("total_tokens", moespec::trt::kMaxTreeTokens + 1);
  Fields twice = eco();
  twice.f32("token_s", 1.0f);
  Fields negative;
  negative.i32("total_tokens", 8).f32("token_s", -1.0f);
  Fields weight;
  weight.i32("total_tokens", 8).f32("cost_weight", -0.5f);
  Fields flag;
  flag.i32("total_tokens", 8).i32("has_predicted_p", 2);
  Fields unknown;
  unknown.i32("total_tokens", 8).i32("top_k", 2);
  Fields type;
  type.f32("total_tokens", 8.0f);
  Bad cases[] = {{missing, "total_tokens"}, {big, "total_tokens"}, {twice, "more than once"}, {negative, "token_s"},
                 {weight, "cost_weight"},   {flag, "has_predicted_p"}, {unknown, "top_k"},
                 {type, "expected type INT32"}};
  for (Bad& c : cases) {
    moespec::trt::clear_last_error();
    CHECK_MSG(create(c.fields.collection()) == nullptr, c.names);
    CHECK_MSG(error_mentions(c.names) && error_mentions("MoespecTreeSelect 'tree0'"), moespec::trt::last_error());
  }
}
