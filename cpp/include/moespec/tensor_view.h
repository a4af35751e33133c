// TensorView: the non-owning tensor description every moespec kernel takes.
//
// A view is a pointer plus dtype, shape, strides (in elements) and device. It owns nothing and
// knows nothing of torch, TensorRT or Python: the bindings, the torch ops and the TensorRT plugins
// each build views from their own tensors and call the same kernels (DESIGN.md "Architecture").
// The check_* helpers validate a view and throw moespec::Error naming the argument at fault.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

namespace moespec {

enum class DType : int32_t {
  kFloat32 = 0,
  kBFloat16 = 1,
  kFloat16 = 2,
  kInt32 = 3,
  kInt64 = 4,
  kUInt8 = 5,
  kFloat64 = 6,
};

enum class Device : int32_t {
  kCPU = 0,
  kCUDA = 1,
};

const char* dtype_name(DType dtype);
std::size_t dtype_size(DType dtype);
const char* device_name(Device device);

struct TensorView {
  static constexpr int kMaxDims = 6;

  void* data = nullptr;
  DType dtype = DType::kFloat32;
  int32_t ndim = 0;
  int64_t shape[kMaxDims] = {};
  int64_t strides[kMaxDims] = {};  // in elements, not bytes
  Device device = Device::kCPU;
  int32_t device_index = 0;

  // A contiguous (row-major) view; throws InvalidArgument if the shape has too many dims.
  static TensorView contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape,
                               Device device = Device::kCPU, int32_t device_index = 0);

  // An optional argument that was not given is a default-constructed view (no data, no dims).
  bool defined() const { return data != nullptr || ndim > 0; }
  int64_t numel() const;
  bool is_contiguous() const;
  template <typename T>
  T* ptr() const {
    return static_cast<T*>(data);
  }
  // "float32[3, 4] (cpu)", for error messages.
  std::string describe() const;
};

// Validation helpers. Each throws moespec::Error(kInvalidArgument) whose message names `arg`,
// the expectation and what was found.
void check_ndim(const TensorView& t, const char* arg, int32_t ndim);
void check_dtype(const TensorView& t, const char* arg, std::initializer_list<DType> allowed);
void check_dim(const TensorView& t, const char* arg, int32_t dim, int64_t expected);
void check_contiguous(const TensorView& t, const char* arg);
void check_device(const TensorView& t, const char* arg, Device device, int32_t device_index = -1);
void check_not_null(const TensorView& t, const char* arg);
// All of the above for one input: defined, `dims.size()` dimensions of these sizes, one of `dtypes`,
// on `device` (device_index -1: any index of it). Contiguity is checked apart (check_contiguous).
void check_view(const TensorView& t, const char* arg, std::initializer_list<DType> dtypes,
                std::initializer_list<int64_t> dims, Device device = Device::kCPU, int32_t device_index = -1);

}  // namespace moespec
