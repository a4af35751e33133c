// TensorView helpers and argument checks (see cpp/include/moespec/tensor_view.h).
#include "moespec/tensor_view.h"

#include "moespec/error.h"

namespace moespec {

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float32";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat16: return "float16";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kUInt8: return "uint8";
    case DType::kFloat64: return "float64";
  }
  return "unknown";
}

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return 4;
    case DType::kBFloat16: return 2;
    case DType::kFloat16: return 2;
    case DType::kInt32: return 4;
    case DType::kInt64: return 8;
    case DType::kUInt8: return 1;
    case DType::kFloat64: return 8;
  }
  return 0;
}

const char* device_name(Device device) {
  switch (device) {
    case Device::kCPU: return "cpu";
    case Device::kCUDA: return "cuda";
  }
  return "unknown";
}

TensorView TensorView::contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape,
                                  Device device, int32_t device_index) {
  MOESPEC_CHECK_ARG(shape.size() <= static_cast<std::size_t>(kMaxDims), "shape", "at most ", kMaxDims,
                    " dims are supported, got ", shape.size());
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.ndim = static_cast<int32_t>(shape.size());
  t.device = device;
  t.device_index = device_index;
  int i = 0;
  for (int64_t s : shape) t.shape[i++] = s;
  int64_t stride = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    t.strides[d] = stride;
    stride *= t.shape[d];
  }
  return t;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= shape[d];
  return n;
}

bool TensorView::is_contiguous() const {
  int64_t expected = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (shape[d] != 1 && strides[d] != expected) return false;
    expected *= shape[d];
  }
  return true;
}

std::string TensorView::describe() const {
  if (!defined()) return "nothing";
  std::string out = detail::concat(dtype_name(dtype), "[");
  for (int d = 0; d < ndim; ++d) out += detail::concat(d ? ", " : "", shape[d]);
  out += detail::concat("] (", device_name(device));
  if (device == Device::kCUDA) out += detail::concat(":", device_index);
  return out + ")";
}

void check_not_null(const TensorView& t, const char* arg) {
  MOESPEC_CHECK_ARG(t.defined(), arg, "a tensor is required, got nothing");
  MOESPEC_CHECK_ARG(t.data != nullptr || t.numel() == 0, arg, "tensor ", t.describe(), " has no data pointer");
}

void check_ndim(const TensorView& t, const char* arg, int32_t ndim) {
  MOESPEC_CHECK_ARG(t.ndim == ndim, arg, "expected a ", ndim, "-d tensor, got ", t.describe());
}

void check_dtype(const TensorView& t, const char* arg, std::initializer_list<DType> allowed) {
  for (DType d : allowed)
    if (t.dtype == d) return;
  std::string names;
  for (DType d : allowed) names += detail::concat(names.empty() ? "" : " or ", dtype_name(d));
  throw_invalid(arg, "expected dtype ", names, ", got ", t.describe());
}

void check_dim(const TensorView& t, const char* arg, int32_t dim, int64_t expected) {
  MOESPEC_CHECK_ARG(dim < t.ndim && t.shape[dim] == expected, arg, "expected size ", expected, " in dim ", dim,
                    ", got ", t.describe());
}

void check_contiguous(const TensorView& t, const char* arg) {
  MOESPEC_CHECK_ARG(t.is_contiguous(), arg, "expected a contiguous tensor, got ", t.describe(),
                    " with non-row-major strides");
}

void check_device(const TensorView& t, const char* arg, Device device, int32_t device_index) {
  MOESPEC_CHECK_ARG(t.device == device && (device_index < 0 || t.device_index == device_index), arg,
                    "expected a tensor on ", device_name(device),
                    (device_index >= 0 && device == Device::kCUDA ? ":" + std::to_string(device_index) : ""),
                    ", got ", t.describe());
}

void check_view(const TensorView& t, const char* arg, std::initializer_list<DType> dtypes,
                std::initializer_list<int64_t> dims, Device device, int32_t device_index) {
  check_not_null(t, arg);
  check_ndim(t, arg, static_cast<int32_t>(dims.size()));
  int32_t d = 0;
  for (int64_t size : dims) check_dim(t, arg, d++, size);
  check_dtype(t, arg, dtypes);
  check_device(t, arg, device, device_index);
}

}  // namespace moespec
