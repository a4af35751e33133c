// Bindings of the native decoder step (cpp/include/moespec/decoder_step.h): the class
// moespec._native.DecoderModel, built once per loaded model by python/moespec/runtime/backend.py.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <vector>

#include "moespec/decoder_step.h"
#include "moespec/error.h"
#include "tensor_arg.h"

namespace py = pybind11;

namespace moespec {
namespace {

constexpr const char* kLayerFields[] = {"input_norm", "embed_norm", "qkv",    "qkv_bias", "q_norm",  "k_norm",
                                        "o",          "o_bias", "post_norm", "gate_up", "down",
                                        "router",     "experts", "shared_gate_up", "shared_down", "shared_gate"};

DecoderLayerViews layer_views(const py::dict& d, std::size_t index) {
  const std::string where = "layers[" + std::to_string(index) + "].";
  for (auto item : d) {
    const std::string key = py::str(item.first);
    bool known = false;
    for (const char* f : kLayerFields) known = known || key == f;
    MOESPEC_CHECK_ARG(known, where + key, "is not a layer field");
  }
  auto get = [&](const char* name) {
    return d.contains(name) ? to_view(d[name], (where + name).c_str()) : TensorView{};
  };
  DecoderLayerViews l;
  l.input_norm = get("input_norm");
  l.embed_norm = get("embed_norm");
  l.qkv = get("qkv");
  l.qkv_bias = get("qkv_bias");
  l.q_norm = get("q_norm");
  l.k_norm = get("k_norm");
  l.o = get("o");
  l.o_bias = get("o_bias");
  l.post_norm = get("post_norm");
  l.gate_up = get("gate_up");
  l.down = get("down");
  l.router = get("router");
  l.experts = get("experts");
  l.shared_gate_up = get("shared_gate_up");
  l.shared_down = get("shared_down");
  l.shared_gate = get("shared_gate");
  return l;
}

}  // namespace

void bind_decoder_step(py::module_& m) {
  py::class_<DecoderModel>(m, "DecoderModel", py::module_local(),  // (local: _native_emulated binds it too)
                           "A model's decoder layers for the native step (decoder_step.h); the caller keeps the "
                           "weight tensors alive.")
      .def(py::init([](int64_t hidden, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t vocab,
                       float eps, int qk_norm, float clip_qkv, int64_t num_experts, int64_t expert_intermediate,
                       int family, int top_k, bool renormalize, bool weights_in_model_dtype,
                       int softmax_vector_width, const py::list& layers, const py::object& final_norm,
                       const py::object& lm_head, bool norm_before_residual) {
             MOESPEC_CHECK_ARG(qk_norm >= 0 && qk_norm <= 2, "qk_norm", "expected 0, 1 or 2, got ", qk_norm);
             DecoderShape s;
             s.hidden = hidden, s.num_heads = num_heads, s.num_kv_heads = num_kv_heads, s.head_dim = head_dim;
             s.vocab = vocab, s.rms_norm_eps = eps, s.qk_norm = static_cast<QkNorm>(qk_norm), s.clip_qkv = clip_qkv;
             s.num_experts = num_experts, s.expert_intermediate = expert_intermediate;
             s.router.family = static_cast<RouterFamily>(family);
             s.router.top_k = top_k, s.router.renormalize = renormalize;
             s.weights_in_model_dtype = weights_in_model_dtype, s.softmax_vector_width = softmax_vector_width;
             s.norm_before_residual = norm_before_residual;
             std::vector<DecoderLayerViews> views;
             for (std::size_t i = 0; i < layers.size(); ++i) views.push_back(layer_views(layers[i].cast<py::dict>(), i));
             return new DecoderModel(s, std::move(views), to_view(final_norm, "final_norm"),
                                     to_view(lm_head, "lm_head"));
           }),
           py::arg("hidden"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("vocab"),
           py::arg("eps"), py::arg("qk_norm"), py::arg("clip_qkv"), py::arg("num_experts"),
           py::arg("expert_intermediate"), py::arg("family"), py::arg("top_k"), py::arg("renormalize"),
           py::arg("weights_in_model_dtype"), py::arg("softmax_vector_width"), py::arg("layers"),
           py::arg("final_norm"), py::arg("lm_head"), py::arg("norm_before_residual") = false)
      .def(
          "step",
          [](DecoderModel& model, const py::object& x, const py::object& cos, const py::object& sin,
             const py::object& k_cache, const py::object& v_cache, const py::object& offsets, const py::object& start,
             const py::object& mask, const py::object& taps, const py::object& tap_out, const py::object& logit_rows,
             const py::object& logits, const py::object& stats, int max_experts, int policy, double coverage,
             int score, const py::object& slots, const py::object& embed, const py::object& trace_ids,
             const py::object& trace_weights, int exact_layers) {
            DecoderStepArgs a;
            a.x = to_view(x, "x");
            a.cos = to_view(cos, "cos");
            a.sin = to_view(sin, "sin");
            a.k_cache = to_view(k_cache, "k_cache");
            a.v_cache = to_view(v_cache, "v_cache");
            a.offsets = to_view(offsets, "offsets");
            a.start = to_view(start, "start");
            a.mask = to_view(mask, "mask");
            a.taps = to_view(taps, "taps");
            a.tap_out = to_view(tap_out, "tap_out");
            a.logit_rows = to_view(logit_rows, "logit_rows");
            a.logits = to_view(logits, "logits");
            a.stats = to_view(stats, "stats");
            a.slots = to_view(slots, "slots");
            a.embed = to_view(embed, "embed");
            a.trace_ids = to_view(trace_ids, "trace_ids");
            a.trace_weights = to_view(trace_weights, "trace_weights");
            MOESPEC_CHECK_ARG(policy == 0 || policy == 1, "policy", "expected 0 or 1, got ", policy);
            a.budget.max_experts = max_experts;
            a.budget.policy = static_cast<BudgetPolicy>(policy);
            a.budget.coverage = coverage;
            a.budget.score = static_cast<BudgetScore>(score);
            MOESPEC_CHECK_ARG(exact_layers >= 0, "exact_layers", "must be >= 0, got ", exact_layers);
            a.exact_layers = exact_layers;
            py::gil_scoped_release release;
            model.step(a);
          },
          "One decode/verify step over packed tokens: x [P, H] in/out, cos/sin [P, D], caches [L, B, Hkv, S, D], "
          "offsets int32 [B+1], start int32 [B], mask int32 [P, W], taps int32 [NT] -> tap_out [NT, P, H], "
          "logit_rows int32 [R] -> logits [R, V], stats int32 [Lm, 4]; optional slots int32 [P] (slot offsets past "
          "start), embed [P, H] (layers with an embed_norm) and the routing trace trace_ids int32 / trace_weights "
          "float32 [Lm, P, K] (natural routing, written when given); exact_layers: the first MoE layers run without the "
          "budget.",
          py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("k_cache"), py::arg("v_cache"), py::arg("offsets"),
          py::arg("start"), py::arg("mask"), py::arg("taps"), py::arg("tap_out"), py::arg("logit_rows"),
          py::arg("logits"), py::arg("stats"), py::arg("max_experts"), py::arg("policy"), py::arg("coverage"),
          py::arg("score"), py::arg("slots") = py::none(), py::arg("embed") = py::none(),
          py::arg("trace_ids") = py::none(), py::arg("trace_weights") = py::none(), py::arg("exact_layers") = 0)
      .def("set_profiling", &DecoderModel::set_profiling, "Turns per-phase timing of steps on or off.",
           py::arg("on"))
      .def(
          "profile",
          [](const DecoderModel& model) {
            py::dict out;
            for (int i = 0; i < kNumDecoderPhases; ++i) out[kDecoderPhases[i]] = model.profile()[static_cast<std::size_t>(i)];
            return out;
          },
          "Seconds per phase of the steps since the last reset_profile (when profiling).")
      .def("reset_profile", &DecoderModel::reset_profile, "Zeroes the per-phase times.")
      .def_property_readonly("num_layers", &DecoderModel::num_layers)
      .def_property_readonly("num_moe_layers", &DecoderModel::num_moe_layers);
}

}  // namespace moespec
