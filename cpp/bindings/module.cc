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
#include "moespec/error.h"
#include "moespec/route_experts.h"
#include "moespec/tensor_view.h"

namespace py = pybind11;

namespace moespec {
namespace {

TensorView to_view(const py::object& desc, const char* arg) {
  TensorView v;
  if (desc.is_none()) return v;
  auto t = desc.cast<py::tuple>();
  MOESPEC_CHECK_ARG(t.size() == 6, arg, "malformed tensor descriptor");
  v.data = reinterpret_cast<void*>(t[0].cast<uintptr_t>());
  const int code = t[1].cast<int>();
  MOESPEC_CHECK_ARG(code >= 0 && code <= static_cast<int>(DType::kUInt8), arg, "unsupported dtype code ", code);
  v.dtype = static_cast<DType>(code);
  auto shape = t[2].cast<py::tuple>();
  auto strides = t[3].cast<py::tuple>();
  MOESPEC_CHECK_ARG(shape.size() <= static_cast<std::size_t>(TensorView::kMaxDims), arg, "at most ",
                    TensorView::kMaxDims, " dims are supported, got ", shape.size());
  MOESPEC_CHECK_ARG(strides.size() == shape.size(), arg, "shape and strides differ in length");
  v.ndim = static_cast<int32_t>(shape.size());
  for (int d = 0; d < v.ndim; ++d) {
    v.shape[d] = shape[d].cast<int64_t>();
    v.strides[d] = strides[d].cast<int64_t>();
  }
  v.device = t[4].cast<int>() == 1 ? Device::kCUDA : Device::kCPU;
  v.device_index = t[5].cast<int32_t>();
  return v;
}

CpuIsa isa_from_name(const std::string& name) {
  for (CpuIsa isa : {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512})
    if (name == cpu_isa_name(isa)) return isa;
  throw_invalid("isa", "expected scalar, avx2 or avx512, got '", name, "'");
}

void route_experts_binding(const py::object& router_logits, const py::object& bias, const py::object& token_weights,
                           const py::object& ids, const py::object& weights, const py::object& active,
                           const py::object& stats, int family, int top_k, bool renormalize, int n_group,
                           int topk_group, float scaling, int max_experts, int policy, double coverage,
                           int softmax_vector_width, const py::object& workspace, uintptr_t stream) {
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
  a.softmax_vector_width = softmax_vector_width;
  if (a.router_logits.device == Device::kCUDA) {
    TensorView ws = to_view(workspace, "workspace");
    check_not_null(ws, "workspace");
    check_device(ws, "workspace", Device::kCUDA, a.router_logits.device_index);
    const std::size_t bytes = static_cast<std::size_t>(ws.numel()) * dtype_size(ws.dtype);
    py::gil_scoped_release release;
    cuda::route_experts(a, ws.data, bytes, reinterpret_cast<void*>(stream));
  } else {
    py::gil_scoped_release release;
    cpu::route_experts(a);
  }
}

}  // namespace
}  // namespace moespec

PYBIND11_MODULE(_native, m) {
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
        py::arg("coverage"), py::arg("softmax_vector_width"), py::arg("workspace"), py::arg("stream"));
  m.def("route_experts_workspace_size", &cuda::route_experts_workspace_size,
        "Bytes of CUDA workspace route_experts needs for T tokens, N experts, top-K.", py::arg("T"), py::arg("N"),
        py::arg("K"));
  m.def("cuda_available", &cuda::available, "Whether this build has the CUDA kernels.");
  m.def("cpu_isa", [] { return std::string(cpu_isa_name(active_cpu_isa())); }, "The CPU ISA kernels use now.");
  m.def(
      "set_cpu_isa", [](const std::string& name) { set_active_cpu_isa(isa_from_name(name)); },
      "Forces the CPU ISA (scalar, avx2, avx512) for this process.", py::arg("name"));
  m.def(
      "supported_cpu_isas",
      [] {
        py::list out;
        for (CpuIsa isa : supported_cpu_isas()) out.append(cpu_isa_name(isa));
        return out;
      },
      "ISAs this CPU can run, best last.");
  m.attr("kMaxExperts") = kMaxExperts;
  m.attr("kMaxTopK") = kMaxTopK;
}
