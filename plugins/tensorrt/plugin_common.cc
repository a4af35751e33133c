// The shared parts of the moespec TensorRT plugins (see plugin_common.h).
#include "plugin_common.h"

#include <cuda_runtime_api.h>

namespace moespec {
namespace trt {

using nvinfer1::DataType;
using nvinfer1::PluginFieldType;

const char* field_type_name(PluginFieldType type) {
  return type == PluginFieldType::kFLOAT32 ? "FLOAT32" : type == PluginFieldType::kINT32 ? "INT32" : "other";
}

void report(const char* plugin, const char* layer, const char* method, const char* what) noexcept {
  try {
    std::string where = plugin;
    if (layer != nullptr && *layer != '\0') where += std::string(" '") + layer + "'";
    where += "::";
    where += method;
    report_error(where.c_str(), what);
  } catch (...) {
    report_error(method, what);
  }
}

DType to_dtype(DataType type) {
  switch (type) {
    case DataType::kFLOAT: return DType::kFloat32;
    case DataType::kHALF: return DType::kFloat16;
    case DataType::kBF16: return DType::kBFloat16;
    case DataType::kINT32: return DType::kInt32;
    case DataType::kINT64: return DType::kInt64;
    case DataType::kUINT8: return DType::kUInt8;
    default: throw_invalid("dtype", "TensorRT DataType ", static_cast<int32_t>(type), " has no moespec dtype");
  }
}

TensorView to_view(const nvinfer1::PluginTensorDesc& desc, const void* data, int32_t device_index) {
  MOESPEC_CHECK_ARG(desc.dims.nbDims >= 0 && desc.dims.nbDims <= TensorView::kMaxDims, "dims", "a tensor of ",
                    desc.dims.nbDims, " dims (at most ", TensorView::kMaxDims, " supported)");
  TensorView view;
  view.data = const_cast<void*>(data);
  view.dtype = to_dtype(desc.type);
  view.ndim = desc.dims.nbDims;
  int64_t stride = 1;
  for (int32_t d = view.ndim - 1; d >= 0; --d) {
    view.shape[d] = desc.dims.d[d];
    view.strides[d] = stride;
    stride *= desc.dims.d[d];
  }
  view.device = Device::kCUDA;
  view.device_index = device_index;
  return view;
}

int32_t current_device() {
  int device = 0;
  const cudaError_t status = cudaGetDevice(&device);
  if (status != cudaSuccess) throw_runtime("cudaGetDevice failed: ", cudaGetErrorString(status));
  return device;
}

}  // namespace trt
}  // namespace moespec
