// pybind11 module moespec._native: thin bindings from Python to the C++ core.
//
// Tensors cross as descriptors built by python/moespec/_tensor.py: a tuple
// (data_ptr, dtype_code, shape, strides, device_type, device_index) or None for an absent optional.
// Nothing is copied; the Python caller keeps the tensors alive for the call. Each binding checks
// its arguments (the core's validate_* functions), releases the GIL around the kernel, and turns
// moespec::Error into ValueError (bad input) or RuntimeError (failure while running).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>

#include "moespec/cpu_isa.h"
#include "moespec/decoder_ops.h"
#include "moespec/decoder_step.h"
#include "moespec/error.h"
#include "moespec/linear.h"
#include "moespec/moe_experts.h"
#include "moespec/route_experts.h"
#include "moespec/scratch.h"
#include "moespec/thread_pool.h"
#include "moespec/tensor_view.h"
#include "tensor_arg.h"

namespace py = pybind11;

namespace moespec {

void bind_draft_tree(py::module_& m);     // cpp/bindings/draft_tree.cc
void bind_decoder_step(py::module_& m);  // cpp/bindings/decoder_step.cc

namespace {

CpuIsa isa_from_name(const std::string& name) {
  for (CpuIsa isa : {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512})
    if (name == cpu_isa_name(isa)) return isa;
  throw_invalid("isa", "expected scalar, avx2 or avx512, got '", name, "'");
}

struct CudaWorkspace {
  void* data;
  std::size_t bytes;
};

// The caller's scratch tensor of a CUDA kernel, checked: present and on the kernel's device.
CudaWorkspace cuda_workspace(const py::object& workspace, int32_t device_index) {
  const TensorView ws = to_view(workspace, "workspace");
  check_not_null(ws, "workspace");
  check_device(ws, "workspace", Device::kCUDA, device_index);
  return {ws.data, static_cast<std::size_t>(ws.numel()) * dtype_size(ws.dtype)};
}

void route_experts_binding(const py::object& router_logits, const py::object& bias, const py::object& token_weights,
                           const py::object& ids, const py::object& weights, const py::object& active,
                           const py::object& stats, int family, int top_k, bool renormalize, int n_group,
                           int topk_group, float scaling, int max_experts, int policy, double coverage,
                           int score, int softmax_vector_width, const py::object& workspace, uintptr_t stream) {
  RouteExpertsArgs a;
  a.router_logits = to_view(router_logits, "router_logits");
  a.bias = to_view(bias, "bias");
  a.token_weights = to_view(token_weights, "token_weights");
  a.ids = to_view(ids, "ids");
  a.weights = to_view(weights, "weights");
  a.active = to_view(active, "active");
  a.stats = to_view(stats, "stats");
  a.spec.family = static_cast<RouterFamily>(family);
  a.spec.top_k = top_k;
  a.spec.renormalize = renormalize;
  a.spec.n_group = n_group;
  a.spec.topk_group = topk_group;
  a.spec.scaling = scaling;
  a.budget.max_experts = max_experts;
  a.budget.policy = static_cast<BudgetPolicy>(policy);
  a.budget.coverage = coverage;
  a.budget.score = static_cast<BudgetScore>(score);
  a.softmax_vector_width = softmax_vector_width;
  if (a.router_logits.device == Device::kCUDA) {
    const CudaWorkspace ws = cuda_workspace(workspace, a.router_logits.device_index);
    py::gil_scoped_release release;
    cuda::route_experts(a, ws.data, ws.bytes, reinterpret_cast<void*>(stream));
  } else {
    py::gil_scoped_release release;
    cpu::route_experts(a);
  }
}

void moe_experts_binding(const py::object& x, const py::object& ids, const py::object& weights,
                         const py::object& experts, const py::object& biases, const py::object& out,
                         int64_t intermediate_size, int activation, float limit, float alpha, bool round_weights,
                         const py::object& workspace, uintptr_t stream) {
  MoeExpertsArgs a;
  a.x = to_view(x, "x");
  a.ids = to_view(ids, "ids");
  a.weights = to_view(weights, "weights");
  a.experts = to_view(experts, "experts");
  a.biases = to_view(biases, "biases");
  a.out = to_view(out, "out");
  a.intermediate_size = intermediate_size;
  MOESPEC_CHECK_ARG(activation == 0 || activation == 1, "activation", "expected 0 (swiglu) or 1 (gpt_oss), got ",
                    activation);
  a.activation = static_cast<ExpertActivation>(activation);
  a.limit = limit;
  a.alpha = alpha;
  a.round_weights = round_weights;
  if (a.x.device == Device::kCUDA) {
    const CudaWorkspace ws = cuda_workspace(workspace, a.x.device_index);
    py::gil_scoped_release release;
    cuda::moe_experts(a, ws.data, ws.bytes, reinterpret_cast<void*>(stream));
    return;
  }
  py::gil_scoped_release release;
  cpu::moe_experts(a);
}

// The decoder ops run on CUDA only (the CPU runs their plain-torch versions, moespec/ops/decoder.py);
// their arguments are checked on either device, so that bad input gets the same message.
void require_cuda_tensor(const TensorView& t, const char* arg, const char* op) {
  MOESPEC_CHECK_ARG(t.device == Device::kCUDA, arg, op,
                    " has a CUDA kernel only (the CPU runs moespec.ops.decoder's torch version), got ", t.describe());
}

void rms_norm_binding(const py::object& x, const py::object& residual, const py::object& weight,
                      const py::object& out, const py::object& sum, float eps, bool scale_fp32, uintptr_t stream) {
  RmsNormArgs a;
  a.x = to_view(x, "x");
  a.residual = to_view(residual, "residual");
  a.weight = to_view(weight, "weight");
  a.out = to_view(out, "out");
  a.sum = to_view(sum, "sum");
  a.eps = eps;
  a.scale_fp32 = scale_fp32;
  validate_rms_norm(a);
  require_cuda_tensor(a.x, "x", "rms_norm");
  py::gil_scoped_release release;
  cuda::rms_norm(a, reinterpret_cast<void*>(stream));
}

void attention_inputs_binding(const py::object& qkv, const py::object& q_norm, const py::object& k_norm,
                              const py::object& cos, const py::object& sin, const py::object& k_cache,
                              const py::object& v_cache, const py::object& rows, const py::object& slots,
                              const py::object& q, int64_t num_heads, int64_t num_kv_heads, int qk_norm, float eps,
                              float clip, uintptr_t stream) {
  AttentionInputsArgs a;
  a.qkv = to_view(qkv, "qkv");
  a.q_norm = to_view(q_norm, "q_norm");
  a.k_norm = to_view(k_norm, "k_norm");
  a.cos = to_view(cos, "cos");
  a.sin = to_view(sin, "sin");
  a.k_cache = to_view(k_cache, "k_cache");
  a.v_cache = to_view(v_cache, "v_cache");
  a.rows = to_view(rows, "rows");
  a.slots = to_view(slots, "slots");
  a.q = to_view(q, "q");
  a.num_heads = num_heads;
  a.num_kv_heads = num_kv_heads;
  a.qk_norm = static_cast<QkNormKind>(qk_norm);
  a.eps = eps;
  a.clip = clip;
  validate_attention_inputs(a);
  require_cuda_tensor(a.qkv, "qkv", "attention_inputs");
  py::gil_scoped_release release;
  cuda::attention_inputs(a, reinterpret_cast<void*>(stream));
}

void tree_attention_binding(const py::object& q, const py::object& k_cache, const py::object& v_cache,
                            const py::object& start, const py::object& offsets, const py::object& groups,
                            const py::object& spans, const py::object& mask, const py::object& positions,
                            const py::object& sinks, const py::object& out, float scale, int64_t window,
                            const py::object& workspace, uintptr_t stream) {
  TreeAttentionArgs a;
  a.q = to_view(q, "q");
  a.k_cache = to_view(k_cache, "k_cache");
  a.v_cache = to_view(v_cache, "v_cache");
  a.start = to_view(start, "start");
  a.offsets = to_view(offsets, "offsets");
  a.groups = to_view(groups, "groups");
  a.spans = to_view(spans, "spans");
  a.mask = to_view(mask, "mask");
  a.positions = to_view(positions, "positions");
  a.sinks = to_view(sinks, "sinks");
  a.out = to_view(out, "out");
  a.scale = scale;
  a.window = window;
  validate_tree_attention(a);
  require_cuda_tensor(a.q, "q", "tree_attention");
  CudaWorkspace ws{nullptr, 0};
  if (!workspace.is_none()) ws = cuda_workspace(workspace, a.q.device_index);
  py::gil_scoped_release release;
  cuda::tree_attention(a, ws.data, ws.bytes, reinterpret_cast<void*>(stream));
}

void linear_binding(const py::object& x, const py::object& weight, const py::object& bias, const py::object& out,
                    uintptr_t stream) {
  LinearArgs a;
  a.x = to_view(x, "x");
  a.weight = to_view(weight, "weight");
  a.bias = to_view(bias, "bias");
  a.out = to_view(out, "out");
  py::gil_scoped_release release;
  if (a.x.device == Device::kCUDA) cuda::linear(a, reinterpret_cast<void*>(stream));
  else cpu::linear(a);
}

}  // namespace
}  // namespace moespec

// (MOESPEC_MODULE_NAME: _native; the build also makes _native_emulated, the same bindings over the CUDA
// kernels' sources run by the block emulator, for tests/python/virtual_cuda.py.)
#ifndef MOESPEC_MODULE_NAME
#define MOESPEC_MODULE_NAME _native
#endif
#ifdef MOESPEC_EMULATED_MODULE
namespace moespec::emulated {
void synchronize();  // (tests/cpp/emulated/synchronize.cc)
}
#endif
PYBIND11_MODULE(MOESPEC_MODULE_NAME, m) {
  using namespace moespec;
  m.doc() = "moespec native core (C++ CPU kernels, CUDA kernels where built).";

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      if (e.kind() == ErrorKind::kInvalidArgument) PyErr_SetString(PyExc_ValueError, e.what());
      else PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });

  m.def("route_experts", &route_experts_binding,
        "Routing + expert budget: logits [T, N] -> ids int32 [T, K], weights f32 [T, K], active int32 [N], "
        "stats int32 [4], written into the given outputs.",
        py::arg("router_logits"), py::arg("bias"), py::arg("token_weights"), py::arg("ids"), py::arg("weights"),
        py::arg("active"), py::arg("stats"), py::arg("family"), py::arg("top_k"), py::arg("renormalize"),
        py::arg("n_group"), py::arg("topk_group"), py::arg("scaling"), py::arg("max_experts"), py::arg("policy"),
        py::arg("coverage"), py::arg("score"), py::arg("softmax_vector_width"), py::arg("workspace"), py::arg("stream"));
  m.def("route_experts_workspace_size", &cuda::route_experts_workspace_size,
        "Bytes of CUDA workspace route_experts needs for T tokens, N experts, top-K.", py::arg("T"), py::arg("N"),
        py::arg("K"));
  m.def("route_experts_nonfinite_offset", &cuda::route_experts_nonfinite_offset,
        "Byte offset in route_experts' CUDA workspace of the int32 count of tokens with non-finite input.");
  m.def("cuda_available", &cuda::available, "Whether this build has the CUDA kernels.");
#ifdef MOESPEC_EMULATED_MODULE
  m.def("emulated_synchronize", &emulated::synchronize,
        "Runs the emulated launches not run yet (a launch waits for the next one or this); a kernel's fault "
        "is a RuntimeError.");
#endif
  m.def("cpu_isa", [] { return std::string(cpu_isa_name(active_cpu_isa())); }, "The CPU ISA kernels use now.");
  m.def(
      "set_cpu_isa", [](const std::string& name) { set_active_cpu_isa(isa_from_name(name)); },
      "Forces the CPU ISA (scalar, avx2, avx512) for this process.", py::arg("name"));
  m.def("cpu_has_avx512_bf16", &cpu_has_avx512_bf16,
        "Whether the CPU has AVX512_BF16 (bf16 dot products: torch's bf16 GEMMs run at speed only there).");
  m.def(
      "supported_cpu_isas",
      [] {
        py::list out;
        for (CpuIsa isa : supported_cpu_isas()) out.append(cpu_isa_name(isa));
        return out;
      },
      "ISAs this CPU can run, best last.");
  m.def("moe_experts", &moe_experts_binding,
        "MoE experts over a routing: x [T, H], ids int32 [T, K], weights f32 [T, K], experts [E, 3 I H] "
        "(+ biases f32 [E, 2 I + H] for gpt_oss) -> out [T, H], written into the given output; round_weights: "
        "each weight rounded to x's dtype first; CUDA tensors take a workspace of moe_experts_workspace_size bytes "
        "and the stream.",
        py::arg("x"), py::arg("ids"), py::arg("weights"), py::arg("experts"), py::arg("biases"), py::arg("out"),
        py::arg("intermediate_size"), py::arg("activation"), py::arg("limit"), py::arg("alpha"),
        py::arg("round_weights") = false, py::arg("workspace") = py::none(), py::arg("stream") = 0);
  m.def(
      "moe_experts_workspace_size",
      [](int64_t T, int64_t K, int64_t E, int64_t H, int64_t I, int dtype) {
        return cuda::moe_experts_workspace_size(T, K, E, H, I, static_cast<DType>(dtype));
      },
      "Bytes of CUDA scratch moe_experts needs (T tokens, K slots, E experts, H hidden, I intermediate, dtype code).",
      py::arg("T"), py::arg("K"), py::arg("E"), py::arg("H"), py::arg("I"), py::arg("dtype"));
  m.def("linear", &linear_binding,
        "Dense projection at decode/verify sizes: x [T, K], weight [N, K] (+ bias [N]) -> out [T, N], written "
        "into the given output; CUDA tensors run on the given stream.",
        py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("out"), py::arg("stream") = 0);
  m.def("rms_norm", &rms_norm_binding,
        "RMSNorm of x [P, H] (after adding residual, the sum written to sum) scaled by weight [H] -> out; CUDA.",
        py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("out"), py::arg("sum"), py::arg("eps"),
        py::arg("scale_fp32"), py::arg("stream"));
  m.def("attention_inputs", &attention_inputs_binding,
        "qkv [P, (Hq + 2 Hkv) D] -> clip, q/k norm, rope; k and v written at the cache slots, q [P, Hq, D]; CUDA.",
        py::arg("qkv"), py::arg("q_norm"), py::arg("k_norm"), py::arg("cos"), py::arg("sin"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("rows"), py::arg("slots"), py::arg("q"), py::arg("num_heads"),
        py::arg("num_kv_heads"), py::arg("qk_norm"), py::arg("eps"), py::arg("clip"), py::arg("stream"));
  m.def("tree_attention", &tree_attention_binding,
        "Attention of packed tokens q [P, Hq, D] over each request's committed slots and its new slots by mask "
        "words (a sliding window over positions, sinks); CUDA.",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("start"), py::arg("offsets"), py::arg("groups"),
        py::arg("spans"), py::arg("mask"), py::arg("positions"),
        py::arg("sinks"), py::arg("out"), py::arg("scale"), py::arg("window"), py::arg("workspace"), py::arg("stream"));
  m.def("tree_attention_workspace_size", &cuda::tree_attention_workspace_size,
        "Bytes of CUDA scratch tree_attention needs (0: none).", py::arg("P"), py::arg("groups"), py::arg("num_heads"),
        py::arg("head_dim"), py::arg("max_slots"));
  m.attr("kTreeGroupTokens") = kTreeGroupTokens;
  m.def("num_threads", [] { return ThreadPool::instance().num_threads(); }, "Threads of moespec's CPU pool.");
  m.def(
      "set_num_threads",
      [](int n) {
        MOESPEC_CHECK_ARG(n >= 1, "n", "expected at least 1 thread, got ", n);
        ThreadPool::instance().set_num_threads(n);
      },
      "Sets the number of threads of moespec's CPU pool.", py::arg("n"));
  m.def("scratch_bytes", &scratch_bytes, "Bytes the CPU kernels' scratch buffers hold now (moespec/scratch.h).");
  m.def("scratch_retain_bytes", &scratch_retain_bytes,
        "Bytes per scratch buffer kept after a call (MOESPEC_SCRATCH_RETAIN_MB, default 64 MiB).");
  m.def("set_scratch_retain_bytes", &set_scratch_retain_bytes,
        "Sets the scratch retain limit (bytes per buffer); returns the previous one.", py::arg("bytes"));
  bind_draft_tree(m);
  bind_decoder_step(m);
  m.attr("kMaxExperts") = kMaxExperts;
  m.attr("kMaxTopK") = kMaxTopK;
  m.attr("kMaxDecoderStepTokens") = kMaxDecoderStepTokens;
  m.attr("kMaxNormWidth") = kMaxNormWidth;
  m.attr("kMaxAttentionInputs") = kMaxAttentionInputs;
  m.attr("kMaxHeadDim") = kMaxHeadDim;
  m.attr("kMaxTreeTokens") = kMaxTreeTokens;
}
