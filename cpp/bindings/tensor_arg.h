// Tensor arguments of the pybind11 bindings: a descriptor tuple becomes a moespec::TensorView.
//
// The descriptor is built by python/moespec/_tensor.py `view`: (data_ptr, dtype_code, shape,
// strides, device_type, device_index), or None for an absent optional tensor (a default view).
// Nothing is copied; the Python caller keeps the tensor alive for the call. Shared by every
// binding file (module.cc, draft_tree.cc, ...).
#pragma once

#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>

#include "moespec/error.h"
#include "moespec/tensor_view.h"

namespace moespec {

inline TensorView to_view(const pybind11::object& desc, const char* arg) {
  TensorView v;
  if (desc.is_none()) return v;
  auto t = desc.cast<pybind11::tuple>();
  MOESPEC_CHECK_ARG(t.size() == 6, arg, "malformed tensor descriptor");
  v.data = reinterpret_cast<void*>(t[0].cast<uintptr_t>());
  const int code = t[1].cast<int>();
  MOESPEC_CHECK_ARG(code >= 0 && code <= static_cast<int>(DType::kFloat64), arg, "unsupported dtype code ", code);
  v.dtype = static_cast<DType>(code);
  auto shape = t[2].cast<pybind11::tuple>();
  auto strides = t[3].cast<pybind11::tuple>();
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

}  // namespace moespec
