// Unit test of the MoespecRouteExperts TensorRT plugin (plugins/tensorrt/route_experts_plugin.*):
// its metadata (outputs, dtypes, shapes, formats, workspace), its field validation and its
// serialization round trip. It needs neither a GPU nor libnvinfer: the plugin is made through its
// creator like TensorRT would, and the one object only libnvinfer can make (IExprBuilder) is
// replaced by a small fake. REFERENCE.md "4. TensorRT plugins" recalls why metadata is tested: a
// TRT-LLM plugin once wrote outputTypes[nbOutputs], one past the end.
#include <NvInferRuntime.h>

#include <cstring>
#include <deque>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "check.h"
#include "plugin_test.h"
#include "moespec/error.h"
#include "moespec/route_experts.h"
#include "plugin_log.h"
#include "route_experts_plugin.h"

using namespace plugin_test;  // NOLINT(build/namespaces): the shared test helpers and their nvinfer1 names
using nvinfer1::DimsExprs;
using nvinfer1::TensorRTPhase;
using moespec::trt::RouteExpertsFields;
using moespec::trt::RouteExpertsInput;
using moespec::trt::RouteExpertsPlugin;
using moespec::trt::RouteExpertsPluginCreator;

namespace {

constexpr int kOutputs = 4;  // ids, weights, active, stats

RouteExpertsPluginCreator& creator() {
  static RouteExpertsPluginCreator c;
  return c;
}

std::unique_ptr<IPluginV3> create(const PluginFieldCollection* fc, TensorRTPhase phase = TensorRTPhase::kBUILD) {
  return std::unique_ptr<IPluginV3>(creator().createPlugin("router0", fc, phase));
}

const RouteExpertsFields& fields_of(IPluginV3& p) { return dynamic_cast<RouteExpertsPlugin&>(p).fields(); }

// Every field of the plugin away from its default, per family.
Fields softmax_fields() {
  Fields f;
  f.i32("family", 0).i32("top_k", 8).i32("renormalize", 1).i32("max_experts", 16).i32("policy", 1);
  f.f32("coverage", 0.9f).i32("has_token_weights", 1).i32("softmax_vector_width", 8).i32("score", 1);
  return f;
}
Fields deepseek_fields() {
  Fields f;
  f.i32("family", 1).i32("top_k", 8).i32("renormalize", 1).i32("n_group", 8).i32("topk_group", 4);
  f.f32("scaling", 2.5f).i32("max_experts", 32).f32("coverage", 0.75f).i32("has_bias", 1);
  f.i32("has_token_weights", 1);
  return f;
}
Fields gpt_oss_fields() {
  Fields f;
  f.i32("family", 2).i32("top_k", 4);
  return f;
}

}  // namespace

TEST(creator_metadata) {
  RouteExpertsPluginCreator& c = creator();
  CHECK(std::string(c.getPluginName()) == "MoespecRouteExperts");
  CHECK(std::string(c.getPluginVersion()) == "1");
  CHECK(std::string(c.getPluginNamespace()) == "moespec");
  const PluginFieldCollection* names = c.getFieldNames();
  CHECK(names != nullptr && names->nbFields == 13);
  const char* expected[] = {"family",   "top_k",       "renormalize", "n_group",
                            "topk_group", "scaling",  "max_experts", "policy",
                            "coverage", "has_bias", "has_token_weights", "softmax_vector_width", "score"};
  for (int i = 0; names != nullptr && i < names->nbFields && i < 13; ++i) {
    CHECK_MSG(std::string(names->fields[i].name) == expected[i], names->fields[i].name);
    const bool is_float = std::string(expected[i]) == "scaling" || std::string(expected[i]) == "coverage";
    CHECK(names->fields[i].type == (is_float ? PluginFieldType::kFLOAT32 : PluginFieldType::kINT32));
    CHECK(names->fields[i].length == 1);
  }
}

TEST(plugin_identity_and_capabilities) {
  Fields f = gpt_oss_fields();
  auto p = create(f.collection());
  CHECK(p != nullptr);
  if (!p) return;
  IPluginV3OneCore* core = core_of(*p);
  CHECK(core != nullptr && std::string(core->getPluginName()) == "MoespecRouteExperts");
  CHECK(core != nullptr && std::string(core->getPluginVersion()) == "1");
  CHECK(core != nullptr && std::string(core->getPluginNamespace()) == "moespec");
  CHECK(build_of(*p) != nullptr);
  CHECK(runtime_of(*p) != nullptr);
  CHECK(p->getCapabilityInterface(static_cast<PluginCapabilityType>(7)) == nullptr);
}

TEST(outputs_and_dtypes_within_bounds) {
  for (Fields f : {softmax_fields(), deepseek_fields(), gpt_oss_fields()}) {
    auto p = create(f.collection());
    CHECK(p != nullptr);
    if (!p) continue;
    IPluginV3OneBuild* b = build_of(*p);
    CHECK(b->getNbOutputs() == kOutputs);
    const int32_t nb_inputs = fields_of(*p).nb_inputs();
    for (DataType logits : {DataType::kFLOAT, DataType::kBF16, DataType::kHALF}) {
      DataType in[3] = {logits, DataType::kFLOAT, DataType::kFLOAT};
      // One guard slot past the end: a write there is the out-of-bounds bug.
      DataType out[kOutputs + 1] = {DataType::kFP4, DataType::kFP4, DataType::kFP4, DataType::kFP4, DataType::kFP4};
      CHECK(b->getOutputDataTypes(out, kOutputs, in, nb_inputs) == 0);
      CHECK(out[0] == DataType::kINT32);  // ids
      CHECK(out[1] == DataType::kFLOAT);  // weights
      CHECK(out[2] == DataType::kINT32);  // active
      CHECK(out[3] == DataType::kINT32);  // stats
      CHECK(out[kOutputs] == DataType::kFP4);
    }
    // Wrong counts are refused, and nothing is written.
    DataType in[3] = {DataType::kFLOAT, DataType::kFLOAT, DataType::kFLOAT};
    DataType out[kOutputs + 1] = {DataType::kFP4, DataType::kFP4, DataType::kFP4, DataType::kFP4, DataType::kFP4};
    CHECK(b->getOutputDataTypes(out, kOutputs - 1, in, nb_inputs) != 0);
    CHECK(b->getOutputDataTypes(out, kOutputs, in, nb_inputs + 1) != 0);
    CHECK(error_mentions("getOutputDataTypes"));
    for (DataType t : out) CHECK(t == DataType::kFP4);
  }
}

TEST(input_list_follows_the_fields) {
  RouteExpertsFields f;
  f.top_k = 2;
  CHECK(f.nb_inputs() == 1);
  CHECK(f.input_index(RouteExpertsInput::kRouterLogits) == 0);
  CHECK(f.input_index(RouteExpertsInput::kBias) == -1);
  CHECK(f.input_index(RouteExpertsInput::kTokenWeights) == -1);
  f.has_token_weights = 1;
  CHECK(f.nb_inputs() == 2 && f.input_index(RouteExpertsInput::kTokenWeights) == 1);
  f.family = 1;
  f.has_bias = 1;
  CHECK(f.nb_inputs() == 3);
  CHECK(f.input_index(RouteExpertsInput::kBias) == 1 && f.input_index(RouteExpertsInput::kTokenWeights) == 2);
}

TEST(output_shapes) {
  Fields f = deepseek_fields();  // 3 inputs, K = 8
  auto p = create(f.collection());
  CHECK(p != nullptr);
  if (!p) return;
  FakeExprBuilder eb;
  const IDimensionExpr* T = eb.symbol();
  const IDimensionExpr* N = eb.constant(256);
  DimsExprs in[3]{};
  in[0].nbDims = 2;  // router_logits [T, N]
  in[0].d[0] = T;
  in[0].d[1] = N;
  in[1].nbDims = 1;  // bias [N]
  in[1].d[0] = N;
  in[2].nbDims = 1;  // token_weights [T]
  in[2].d[0] = T;
  DimsExprs out[kOutputs + 1]{};
  out[kOutputs].nbDims = -7;  // guard
  CHECK(build_of(*p)->getOutputShapes(in, 3, nullptr, 0, out, kOutputs, eb) == 0);
  auto is_const = [](const IDimensionExpr* e, int64_t v) {
    return e != nullptr && e->isConstant() && e->getConstantValue() == v;
  };
  CHECK(out[0].nbDims == 2 && out[0].d[0] == T && is_const(out[0].d[1], 8));  // ids [T, K]
  CHECK(out[1].nbDims == 2 && out[1].d[0] == T && is_const(out[1].d[1], 8));  // weights [T, K]
  CHECK(out[2].nbDims == 1 && out[2].d[0] == N);                              // active [N]
  CHECK(out[3].nbDims == 1 && is_const(out[3].d[0], 4));                      // stats [4]
  CHECK(out[kOutputs].nbDims == -7);

  in[0].nbDims = 3;  // not [T, N]
  CHECK(build_of(*p)->getOutputShapes(in, 3, nullptr, 0, out, kOutputs, eb) != 0);
  CHECK(error_mentions("router_logits"));
  in[0].nbDims = 2;
  CHECK(build_of(*p)->getOutputShapes(in, 2, nullptr, 0, out, kOutputs, eb) != 0);  // has_bias + has_token_weights: 3
  CHECK(error_mentions("expected 3 inputs"));
}

TEST(supported_formats) {
  Fields plain = gpt_oss_fields();  // router_logits only
  auto p = create(plain.collection());
  CHECK(p != nullptr);
  if (!p) return;
  IPluginV3OneBuild* b = build_of(*p);
  DynamicPluginTensorDesc io[5] = {desc(DataType::kBF16, {7, 32}), desc(DataType::kINT32, {7, 4}),
                                   desc(DataType::kFLOAT, {7, 4}), desc(DataType::kINT32, {32}),
                                   desc(DataType::kINT32, {4})};
  for (int pos = 0; pos < 5; ++pos) CHECK_MSG(b->supportsFormatCombination(pos, io, 1, kOutputs), std::to_string(pos));
  for (DataType t : {DataType::kFLOAT, DataType::kHALF}) {
    io[0].desc.type = t;
    CHECK(b->supportsFormatCombination(0, io, 1, kOutputs));
  }
  for (DataType t : {DataType::kINT32, DataType::kINT8, DataType::kFP8}) {
    io[0].desc.type = t;
    CHECK(!b->supportsFormatCombination(0, io, 1, kOutputs));
  }
  io[0].desc.type = DataType::kBF16;
  io[0].desc.format = TensorFormat::kCHW32;
  CHECK(!b->supportsFormatCombination(0, io, 1, kOutputs));
  io[1].desc.type = DataType::kINT64;  // ids must be int32
  CHECK(!b->supportsFormatCombination(1, io, 1, kOutputs));
  io[2].desc.type = DataType::kHALF;  // weights must be float32
  CHECK(!b->supportsFormatCombination(2, io, 1, kOutputs));
  CHECK(!b->supportsFormatCombination(5, io, 1, kOutputs));   // past the end
  CHECK(!b->supportsFormatCombination(-1, io, 1, kOutputs));  // before the start
  CHECK(!b->supportsFormatCombination(0, io, 2, kOutputs));   // wrong input count

  Fields full = deepseek_fields();  // router_logits, bias, token_weights
  auto q = create(full.collection());
  CHECK(q != nullptr);
  if (!q) return;
  DynamicPluginTensorDesc jo[7] = {desc(DataType::kHALF, {7, 32}), desc(DataType::kFLOAT, {32}),
                                   desc(DataType::kFLOAT, {7}),     desc(DataType::kINT32, {7, 8}),
                                   desc(DataType::kFLOAT, {7, 8}),  desc(DataType::kINT32, {32}),
                                   desc(DataType::kINT32, {4})};
  for (int pos = 0; pos < 7; ++pos)
    CHECK_MSG(build_of(*q)->supportsFormatCombination(pos, jo, 3, kOutputs), std::to_string(pos));
  jo[1].desc.type = DataType::kBF16;  // bias is float32
  jo[2].desc.type = DataType::kHALF;  // token_weights is float32
  CHECK(!build_of(*q)->supportsFormatCombination(1, jo, 3, kOutputs));
  CHECK(!build_of(*q)->supportsFormatCombination(2, jo, 3, kOutputs));
}

TEST(configure_checks_shapes_with_the_core) {
  Fields f = softmax_fields();  // K = 8, token_weights
  auto p = create(f.collection());
  CHECK(p != nullptr);
  if (!p) return;
  IPluginV3OneBuild* b = build_of(*p);
  DynamicPluginTensorDesc in[2] = {desc(DataType::kBF16, {64, 128}), desc(DataType::kFLOAT, {64})};
  // Only the outputs' types are read: their shapes are the plugin's own (getOutputShapes).
  DynamicPluginTensorDesc out[4] = {desc(DataType::kINT32, {}), desc(DataType::kFLOAT, {}),
                                    desc(DataType::kINT32, {}), desc(DataType::kINT32, {})};
  moespec::trt::clear_last_error();
  CHECK(b->configurePlugin(in, 2, out, 4) == 0);
  CHECK_MSG(moespec::trt::last_error().empty(), moespec::trt::last_error());

  // N = 5 experts < K = 8: the core's check, reported at build time.
  DynamicPluginTensorDesc few_experts[2] = {desc(DataType::kBF16, {64, 5}), desc(DataType::kFLOAT, {64})};
  CHECK(b->configurePlugin(few_experts, 2, out, 4) != 0);
  CHECK_MSG(error_mentions("top_k"), moespec::trt::last_error());
  CHECK_MSG(error_mentions("MoespecRouteExperts 'router0'::configurePlugin"), moespec::trt::last_error());

  // token_weights of the wrong length; router_logits not 2-d; a wrong input count.
  DynamicPluginTensorDesc bad_tw[2] = {desc(DataType::kBF16, {64, 128}), desc(DataType::kFLOAT, {63})};
  CHECK(b->configurePlugin(bad_tw, 2, out, 4) != 0);
  CHECK_MSG(error_mentions("token_weights"), moespec::trt::last_error());
  DynamicPluginTensorDesc flat[2] = {desc(DataType::kBF16, {64 * 128}), desc(DataType::kFLOAT, {64})};
  CHECK(b->configurePlugin(flat, 2, out, 4) != 0);
  CHECK_MSG(error_mentions("router_logits"), moespec::trt::last_error());
  CHECK(b->configurePlugin(in, 1, out, 4) != 0);

  // deepseek_v3: the groups must divide N (the core's rule, known only with N).
  Fields g = deepseek_fields();  // n_group 8
  auto q = create(g.collection());
  CHECK(q != nullptr);
  if (!q) return;
  DynamicPluginTensorDesc ds_in[3] = {desc(DataType::kFLOAT, {16, 60}), desc(DataType::kFLOAT, {60}),
                                      desc(DataType::kFLOAT, {16})};
  CHECK(build_of(*q)->configurePlugin(ds_in, 3, out, 4) != 0);
  CHECK_MSG(error_mentions("n_group"), moespec::trt::last_error());
  ds_in[0] = desc(DataType::kFLOAT, {16, 64});
  ds_in[1] = desc(DataType::kFLOAT, {64});
  CHECK(build_of(*q)->configurePlugin(ds_in, 3, out, 4) == 0);
}

TEST(workspace_size_is_the_kernels) {
  Fields f = deepseek_fields();
  auto p = create(f.collection());
  CHECK(p != nullptr);
  if (!p) return;
  DynamicPluginTensorDesc in[3] = {desc(DataType::kFLOAT, {97, 256}), desc(DataType::kFLOAT, {256}),
                                   desc(DataType::kFLOAT, {97})};
  DynamicPluginTensorDesc out[4] = {desc(DataType::kINT32, {97, 8}), desc(DataType::kFLOAT, {97, 8}),
                                    desc(DataType::kINT32, {256}), desc(DataType::kINT32, {4})};
  CHECK(build_of(*p)->getWorkspaceSize(in, 3, out, 4) == moespec::cuda::route_experts_workspace_size(97, 256, 8));
  CHECK(build_of(*p)->getWorkspaceSize(in, 2, out, 4) == 0);  // wrong input count: reported, 0
}

TEST(serialization_round_trip) {
  for (Fields f : {softmax_fields(), deepseek_fields(), gpt_oss_fields()}) {
    auto p = create(f.collection());
    CHECK(p != nullptr);
    if (!p) continue;
    const PluginFieldCollection* saved = runtime_of(*p)->getFieldsToSerialize();
    CHECK(saved != nullptr && saved->nbFields == 13);  // every field, defaults included
    if (!saved) continue;
    // What TensorRT does when it deserializes an engine.
    auto q = create(saved, TensorRTPhase::kRUNTIME);
    CHECK(q != nullptr);
    if (!q) continue;
    CHECK(fields_of(*q) == fields_of(*p));
    const PluginFieldCollection* again = runtime_of(*q)->getFieldsToSerialize();
    std::string why;
    CHECK_MSG(again != nullptr && same_fields(*saved, *again, &why), why);
    // The given fields come back with their values.
    const PluginFieldCollection* given = f.collection();
    for (int32_t i = 0; i < given->nbFields; ++i) {
      bool found = false;
      for (int32_t j = 0; j < saved->nbFields; ++j) {
        if (std::strcmp(given->fields[i].name, saved->fields[j].name) != 0) continue;
        found = saved->fields[j].type == given->fields[i].type &&
                std::memcmp(saved->fields[j].data, given->fields[i].data, 4) == 0;
      }
      CHECK_MSG(found, given->fields[i].name);
    }
  }
  // The double in ExpertBudget gets exactly the float that travels.
  Fields f = softmax_fields();
  auto p = create(f.collection());
  CHECK(p != nullptr && fields_of(*p).budget().coverage == static_cast<double>(0.9f));
  CHECK(p != nullptr && fields_of(*p).spec().renormalize);
  CHECK(p != nullptr && fields_of(*p).budget().policy == moespec::BudgetPolicy::kTruncation);
  CHECK(p != nullptr && fields_of(*p).budget().score == moespec::BudgetScore::kGates);
}

TEST(clone_and_attach) {
  Fields f = deepseek_fields();
  auto p = create(f.collection());
  CHECK(p != nullptr);
  if (!p) return;
  std::unique_ptr<IPluginV3> c(p->clone());
  CHECK(c != nullptr && c.get() != p.get());
  if (!c) return;
  CHECK(fields_of(*c) == fields_of(*p));
  CHECK(std::string(core_of(*c)->getPluginNamespace()) == "moespec");
  p.reset();  // the clone owns its own state
  std::string why;
  Fields again = deepseek_fields();
  auto fresh = create(again.collection());
  CHECK_MSG(fresh && same_fields(*runtime_of(*c)->getFieldsToSerialize(),
                                 *runtime_of(*fresh)->getFieldsToSerialize(), &why),
            why);
  std::unique_ptr<IPluginV3> attached(runtime_of(*c)->attachToContext(nullptr));
  CHECK(attached != nullptr && fields_of(*attached) == fields_of(*c));
  CHECK(attached != nullptr && build_of(*attached)->getNbOutputs() == kOutputs);
}

TEST(bad_fields_are_refused) {
  struct Case {
    const char* what;
    Fields fields;
    const char* fragment;  // the field the report must name
  };
  std::vector<Case> cases;
  auto add = [&](const char* what, Fields f, const char* fragment) { cases.push_back({what, std::move(f), fragment}); };
  add("top_k = 0", Fields().i32("family", 0).i32("top_k", 0), "top_k");
  add("top_k missing", Fields().i32("family", 0), "top_k");
  add("top_k above kMaxTopK", Fields().i32("top_k", moespec::kMaxTopK + 1), "top_k");
  add("max_experts below top_k", Fields().i32("top_k", 4).i32("max_experts", 3), "max_experts");
  add("max_experts negative", Fields().i32("top_k", 4).i32("max_experts", -1), "max_experts");
  add("unknown family 3", Fields().i32("family", 3).i32("top_k", 2), "family");
  add("unknown family -1", Fields().i32("family", -1).i32("top_k", 2), "family");
  add("unknown policy", Fields().i32("top_k", 2).i32("max_experts", 4).i32("policy", 2), "policy");
  add("unknown score", Fields().i32("top_k", 2).i32("max_experts", 4).i32("score", 2), "score");
  add("coverage above 1", Fields().i32("top_k", 2).f32("coverage", 1.5f), "coverage");
  add("coverage NaN", Fields().i32("top_k", 2).f32("coverage", std::numeric_limits<float>::quiet_NaN()), "coverage");
  add("scaling inf", Fields().i32("top_k", 2).f32("scaling", std::numeric_limits<float>::infinity()), "scaling");
  add("softmax_vector_width 12", Fields().i32("top_k", 2).i32("softmax_vector_width", 12), "softmax_vector_width");
  add("bias on softmax", Fields().i32("family", 0).i32("top_k", 2).i32("has_bias", 1), "has_bias");
  add("has_token_weights 2", Fields().i32("top_k", 2).i32("has_token_weights", 2), "has_token_weights");
  add("renormalize 2", Fields().i32("top_k", 2).i32("renormalize", 2), "renormalize");
  add("topk_group above n_group",
      Fields().i32("family", 1).i32("top_k", 2).i32("n_group", 4).i32("topk_group", 5), "topk_group");
  add("n_group 0", Fields().i32("family", 1).i32("top_k", 2).i32("n_group", 0), "n_group");
  add("top_k as FLOAT32", Fields().f32("top_k", 2.0f), "top_k");
  add("scaling as INT32", Fields().i32("top_k", 2).i32("scaling", 1), "scaling");
  add("unknown field", Fields().i32("top_k", 2).i32("topk", 2), "topk");
  add("field twice", Fields().i32("top_k", 2).i32("top_k", 3), "more than once");
  for (Case& c : cases) {
    moespec::trt::clear_last_error();
    auto p = create(c.fields.collection());
    CHECK_MSG(p == nullptr, c.what);
    CHECK_MSG(error_mentions(c.fragment) && error_mentions("createPlugin"),
              std::string(c.what) + ": report '" + moespec::trt::last_error() + "'");
  }
  // Not one value: a length-2 field, a field without data, no collection at all.
  int32_t two[2] = {2, 3};
  PluginField wide("top_k", two, PluginFieldType::kINT32, 2);
  PluginFieldCollection wide_fc{1, &wide};
  CHECK(create(&wide_fc) == nullptr && error_mentions("top_k"));
  PluginField empty("top_k", nullptr, PluginFieldType::kINT32, 1);
  PluginFieldCollection empty_fc{1, &empty};
  CHECK(create(&empty_fc) == nullptr && error_mentions("top_k"));
  CHECK(create(nullptr) == nullptr && error_mentions("PluginFieldCollection"));
  // The constructor refuses what createPlugin refuses.
  RouteExpertsFields bad;
  bad.top_k = 0;
  CHECK_THROWS_WITH(RouteExpertsPlugin(bad, "moespec"), "top_k");
}

TEST(errors_go_to_the_logger) {
  CHECK(kLoggerInstalled);
  const int before = app_logger().count;
  Fields f;
  f.i32("top_k", 0);
  CHECK(create(f.collection()) == nullptr);
  CHECK(app_logger().count == before + 1);
  CHECK(app_logger().last_severity == nvinfer1::ILogger::Severity::kERROR);
  CHECK_MSG(app_logger().last == "MoespecRouteExperts 'router0'::createPlugin: top_k: must be in [1, 64], got 0 "
                                 "(a required field)",
            app_logger().last);
  CHECK(app_logger().last == moespec::trt::last_error());
  // A logger finder (set by TensorRT) wins over the application's logger.
  FakeLoggerFinder finder;
  moespec::trt::set_logger_finder(&finder);
  CHECK(create(f.collection()) == nullptr);
  moespec::trt::set_logger_finder(nullptr);
  CHECK(finder.logger.count == 1 && app_logger().count == before + 1);
  CHECK(finder.logger.last.find("top_k") != std::string::npos);
}

TEST(budget_fields_at_their_edges) {
  // max_experts == top_k is the smallest budget; coverage 1 the largest; both valid.
  Fields f;
  f.i32("top_k", 4).i32("max_experts", 4).f32("coverage", 1.0f);
  CHECK(create(f.collection()) != nullptr);
  Fields g;
  g.i32("top_k", moespec::kMaxTopK).i32("max_experts", 0);
  CHECK(create(g.collection()) != nullptr);
}
