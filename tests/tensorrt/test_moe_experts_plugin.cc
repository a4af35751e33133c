// Unit test of the MoespecBudgetedMoe TensorRT plugin (plugins/tensorrt/moe_experts_plugin.*): its
// metadata (output, dtype, shape, formats, workspace), its field validation against the core's
// checks, and its serialization round trip. Like test_route_experts_plugin.cc it needs neither a
// GPU nor libnvinfer (plugin_test.h has the stand-ins).
#include <NvInferRuntime.h>

#include <memory>
#include <string>

#include "check.h"
#include "moe_experts_plugin.h"
#include "moespec/moe_experts.h"
#include "plugin_log.h"
#include "plugin_test.h"

using moespec::trt::MoeExpertsFields;
using moespec::trt::MoeExpertsPlugin;
using moespec::trt::MoeExpertsPluginCreator;
using nvinfer1::TensorRTPhase;

using namespace plugin_test;  // NOLINT(build/namespaces): the shared test helpers

namespace {

constexpr int64_t T = 16, H = 64, I = 32, E = 8, K = 2;

MoeExpertsPluginCreator& creator() {
  static MoeExpertsPluginCreator c;
  return c;
}

std::unique_ptr<IPluginV3> create(const PluginFieldCollection* fc) {
  return std::unique_ptr<IPluginV3>(creator().createPlugin("moe0", fc, TensorRTPhase::kBUILD));
}

Fields swiglu() {
  Fields f;
  f.i32("intermediate_size", static_cast<int32_t>(I));
  return f;
}

Fields gpt_oss() {
  Fields f;
  f.i32("intermediate_size", static_cast<int32_t>(I)).i32("activation", 1).f32("limit", 1.5f);
  f.f32("alpha", 1.25f).i32("has_biases", 1).i32("round_weights", 1);
  return f;
}

// x, ids, weights, experts (+ biases), out at the test shapes.
std::vector<DynamicPluginTensorDesc> tensors(DataType dtype, bool biases, int64_t experts_cols = 3 * I * H) {
  std::vector<DynamicPluginTensorDesc> d = {desc(dtype, {T, H}), desc(DataType::kINT32, {T, K}),
                                            desc(DataType::kFLOAT, {T, K}), desc(dtype, {E, experts_cols})};
  if (biases) d.push_back(desc(DataType::kFLOAT, {E, 2 * I + H}));
  d.push_back(desc(dtype, {T, H}));
  return d;
}

}  // namespace

TEST(creator_metadata_and_identity) {
  MoeExpertsPluginCreator& c = creator();
  CHECK(std::string(c.getPluginName()) == "MoespecBudgetedMoe");
  CHECK(std::string(c.getPluginVersion()) == "1" && std::string(c.getPluginNamespace()) == "moespec");
  const PluginFieldCollection* names = c.getFieldNames();
  CHECK(names != nullptr && names->nbFields == 6);
  const char* expected[] = {"intermediate_size", "activation", "limit", "alpha", "has_biases", "round_weights"};
  for (int i = 0; names != nullptr && i < names->nbFields && i < 6; ++i) {
    CHECK_MSG(std::string(names->fields[i].name) == expected[i], names->fields[i].name);
    CHECK(names->fields[i].data == nullptr && names->fields[i].length == 1);
  }
  Fields f = swiglu();
  auto p = create(f.collection());
  CHECK(p != nullptr);
  if (!p) return;
  CHECK(std::string(core_of(*p)->getPluginName()) == "MoespecBudgetedMoe");
  CHECK(build_of(*p)->getNbOutputs() == 1 && runtime_of(*p) != nullptr);
}

TEST(output_dtype_shape_and_formats) {
  Fields f = gpt_oss();
  auto p = create(f.collection());
  CHECK(p != nullptr);
  if (!p) return;
  IPluginV3OneBuild* b = build_of(*p);
  const DataType in_types[5] = {DataType::kBF16, DataType::kINT32, DataType::kFLOAT, DataType::kBF16,
                                DataType::kFLOAT};
  DataType out_type = DataType::kINT8;
  CHECK(b->getOutputDataTypes(&out_type, 1, in_types, 5) == 0 && out_type == DataType::kBF16);
  CHECK(b->getOutputDataTypes(&out_type, 1, in_types, 4) != 0);  // has_biases: 5 inputs
  FakeExprBuilder exprs;
  nvinfer1::DimsExprs in[5];
  for (auto& d : in) d.nbDims = 2, d.d[0] = exprs.symbol(), d.d[1] = exprs.symbol();
  nvinfer1::DimsExprs out{};
  CHECK(b->getOutputShapes(in, 5, nullptr, 0, &out, 1, exprs) == 0);
  CHECK(out.nbDims == 2 && out.d[0] == in[0].d[0] && out.d[1] == in[0].d[1]);  // [T, H] of x
  auto t = tensors(DataType::kBF16, true);
  for (int pos = 0; pos < 6; ++pos) CHECK_MSG(b->supportsFormatCombination(pos, t.data(), 5, 1), std::to_string(pos));
  auto mixed = tensors(DataType::kBF16, true);
  mixed[3] = desc(DataType::kFLOAT, {E, 3 * I * H});  // experts must carry x's dtype
  CHECK(!b->supportsFormatCombination(3, mixed.data(), 5, 1));
  auto half = tensors(DataType::kHALF, true);
  CHECK(!b->supportsFormatCombination(0, half.data(), 5, 1));
  auto chw = tensors(DataType::kBF16, true);
  chw[0] = desc(DataType::kBF16, {T, H}, TensorFormat::kCHW32);
  CHECK(!b->supportsFormatCombination(0, chw.data(), 5, 1));
}

TEST(configure_checks_shapes_with_the_core_and_workspace_is_the_kernels) {
  Fields f = swiglu();
  auto p = create(f.collection());
  CHECK(p != nullptr);
  if (!p) return;
  IPluginV3OneBuild* b = build_of(*p);
  auto t = tensors(DataType::kBF16, false);
  CHECK(b->configurePlugin(t.data(), 4, &t[4], 1) == 0);
  CHECK(b->getWorkspaceSize(t.data(), 4, &t[4], 1) ==
        moespec::cuda::moe_experts_workspace_size(T, K, E, H, I, moespec::DType::kBFloat16));
  moespec::trt::clear_last_error();
  auto wrong = tensors(DataType::kBF16, false, 3 * I * H + 1);  // experts' rows do not hold 3 I H
  CHECK(b->configurePlugin(wrong.data(), 4, &wrong[4], 1) != 0 && error_mentions("intermediate_size"));
  auto many = tensors(DataType::kBF16, false);
  many[3] = desc(DataType::kBF16, {moespec::kMaxMoeExperts + 1, 3 * I * H});
  CHECK(b->configurePlugin(many.data(), 4, &many[4], 1) != 0 && error_mentions("experts"));
}

TEST(serialization_round_trip_and_clone) {
  Fields f = gpt_oss();
  auto p = create(f.collection());
  CHECK(p != nullptr);
  if (!p) return;
  const PluginFieldCollection* saved = runtime_of(*p)->getFieldsToSerialize();
  CHECK(saved != nullptr && saved->nbFields == 6);
  auto back = std::unique_ptr<IPluginV3>(creator().createPlugin("moe0", saved, TensorRTPhase::kRUNTIME));
  CHECK(back != nullptr);
  if (!back) return;
  const MoeExpertsFields& a = dynamic_cast<MoeExpertsPlugin&>(*p).fields();
  const MoeExpertsFields& c = dynamic_cast<MoeExpertsPlugin&>(*back).fields();
  CHECK(a == c && c.activation == 1 && c.limit == 1.5f && c.alpha == 1.25f && c.has_biases == 1 &&
        c.round_weights == 1);
  std::string why;
  CHECK_MSG(same_fields(*saved, *runtime_of(*back)->getFieldsToSerialize(), &why), why);
  auto copy = std::unique_ptr<IPluginV3>(p->clone());
  CHECK(copy != nullptr && dynamic_cast<MoeExpertsPlugin&>(*copy).fields() == a);
}

TEST(bad_fields_are_refused_by_name) {
  struct Bad {
    Fields fields;
    const char* names;
  };
  Fields missing;
  Fields activation = swiglu();
  activation.i32("activation", 2);
  Fields biases = swiglu();
  biases.i32("has_biases", 1);  // SwiGLU takes none
  Fields round = swiglu();
  round.i32("round_weights", 2);
  Fields unknown = swiglu();
  unknown.i32("top_k", 2);
  Fields twice = swiglu();
  twice.i32("intermediate_size", 8);
  Fields type;
  type.f32("intermediate_size", 32.0f);
  Bad cases[] = {{missing, "intermediate_size"}, {activation, "activation"}, {biases, "has_biases"},
                 {round, "round_weights"},       {unknown, "top_k"},         {twice, "more than once"},
                 {type, "expected type INT32"}};
  for (Bad& c : cases) {
    moespec::trt::clear_last_error();
    CHECK_MSG(create(c.fields.collection()) == nullptr, c.names);
    CHECK_MSG(error_mentions(c.names) && error_mentions("MoespecBudgetedMoe 'moe0'"), moespec::trt::last_error());
  }
}
