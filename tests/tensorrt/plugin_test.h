// What the TensorRT plugin unit tests share: a PluginFieldCollection builder, the capability
// accessors, a field-by-field comparison of collections, stand-ins for what only libnvinfer makes
// (IExprBuilder, the logger finder), tensor descriptions and a logger that captures the reports.
// No GPU and no libnvinfer needed.
#pragma once

#include <NvInferRuntime.h>

#include <cstring>
#include <deque>
#include <initializer_list>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "plugin_log.h"

namespace plugin_test {

using nvinfer1::DataType;
using nvinfer1::DynamicPluginTensorDesc;
using nvinfer1::IDimensionExpr;
using nvinfer1::IPluginV3;
using nvinfer1::IPluginV3OneBuild;
using nvinfer1::IPluginV3OneCore;
using nvinfer1::IPluginV3OneRuntime;
using nvinfer1::PluginCapabilityType;
using nvinfer1::PluginField;
using nvinfer1::PluginFieldCollection;
using nvinfer1::PluginFieldType;
using nvinfer1::TensorFormat;

// A PluginFieldCollection being written; the values live as long as the builder (copies included:
// the PluginField array is rebuilt from the values on each collection() call).
class Fields {
 public:
  Fields& i32(const char* name, int32_t value) {
    entries_.push_back({name, PluginFieldType::kINT32, ints_.size()});
    ints_.push_back(value);
    return *this;
  }
  Fields& f32(const char* name, float value) {
    entries_.push_back({name, PluginFieldType::kFLOAT32, floats_.size()});
    floats_.push_back(value);
    return *this;
  }
  const PluginFieldCollection* collection() {
    fields_.clear();
    for (const Entry& e : entries_) {
      const void* data = e.type == PluginFieldType::kINT32 ? static_cast<const void*>(&ints_[e.index])
                                                           : static_cast<const void*>(&floats_[e.index]);
      fields_.emplace_back(e.name, data, e.type, 1);
    }
    collection_.nbFields = static_cast<int32_t>(fields_.size());
    collection_.fields = fields_.data();
    return &collection_;
  }

 private:
  struct Entry {
    const char* name;
    PluginFieldType type;
    size_t index;
  };
  std::vector<Entry> entries_;
  std::vector<int32_t> ints_;
  std::vector<float> floats_;
  std::vector<PluginField> fields_;
  PluginFieldCollection collection_{};
};

inline IPluginV3OneBuild* build_of(IPluginV3& p) {
  return static_cast<IPluginV3OneBuild*>(p.getCapabilityInterface(PluginCapabilityType::kBUILD));
}
inline IPluginV3OneRuntime* runtime_of(IPluginV3& p) {
  return static_cast<IPluginV3OneRuntime*>(p.getCapabilityInterface(PluginCapabilityType::kRUNTIME));
}
inline IPluginV3OneCore* core_of(IPluginV3& p) {
  return static_cast<IPluginV3OneCore*>(p.getCapabilityInterface(PluginCapabilityType::kCORE));
}
// Same names, types, lengths and bytes, in the same order.
inline bool same_fields(const PluginFieldCollection& a, const PluginFieldCollection& b, std::string* why) {
  if (a.nbFields != b.nbFields) {
    *why = "field counts " + std::to_string(a.nbFields) + " vs " + std::to_string(b.nbFields);
    return false;
  }
  for (int32_t i = 0; i < a.nbFields; ++i) {
    const PluginField& x = a.fields[i];
    const PluginField& y = b.fields[i];
    if (std::strcmp(x.name, y.name) != 0 || x.type != y.type || x.length != y.length || x.length != 1 ||
        std::memcmp(x.data, y.data, 4) != 0) {
      *why = std::string("field ") + x.name + " vs " + y.name;
      return false;
    }
  }
  return true;
}

// ---- A stand-in for TensorRT's expression builder (only libnvinfer makes real ones) -------------
// It implements the builder's internal interface (NvInferImpl.h); `operation` returns nothing, so
// a plugin that did arithmetic on shapes would fail here (STYLE.md habit 13).
class FakeDim final : public IDimensionExpr {
 public:
  FakeDim(bool constant, int64_t value) : impl_(constant, value) { mImpl = &impl_; }

 private:
  struct Impl final : nvinfer1::apiv::VDimensionExpr {
    Impl(bool c, int64_t v) : constant(c), value(v) {}
    bool isConstant() const override { return constant; }
    int64_t getConstantValue() const override { return constant ? value : std::numeric_limits<int64_t>::min(); }
    bool isSizeTensor() const override { return false; }
    bool constant;
    int64_t value;
  };
  Impl impl_;
};

class FakeExprBuilder final : public nvinfer1::IExprBuilder {
 public:
  FakeExprBuilder() { mImpl = &impl_; }
  const IDimensionExpr* symbol() { return impl_.make(false, 0); }

 private:
  struct Impl final : nvinfer1::apiv::VExprBuilder {
    const IDimensionExpr* make(bool constant, int64_t value) {
      made.push_back(std::make_unique<FakeDim>(constant, value));
      return made.back().get();
    }
    const IDimensionExpr* constant(int64_t value) override { return make(true, value); }
    const IDimensionExpr* operation(nvinfer1::DimensionOperation, const IDimensionExpr&,
                                    const IDimensionExpr&) override {
      return nullptr;
    }
    const IDimensionExpr* declareSizeTensor(int32_t, const IDimensionExpr&, const IDimensionExpr&) override {
      return nullptr;
    }
    std::deque<std::unique_ptr<FakeDim>> made;
  };
  Impl impl_;
};

inline DynamicPluginTensorDesc desc(DataType type, std::initializer_list<int64_t> max_dims,
                             TensorFormat format = TensorFormat::kLINEAR) {
  DynamicPluginTensorDesc d{};
  d.desc.type = type;
  d.desc.format = format;
  d.desc.scale = -1.0f;
  d.max.nbDims = static_cast<int32_t>(max_dims.size());
  int i = 0;
  for (int64_t v : max_dims) d.max.d[i++] = v;
  d.min = d.max;
  d.opt = d.max;
  d.desc.dims = d.max;
  return d;
}

inline bool error_mentions(const char* fragment) { return moespec::trt::last_error().find(fragment) != std::string::npos; }

// Collects what the plugins report (instead of stderr), as the application's logger would.
class CapturingLogger final : public nvinfer1::ILogger {
 public:
  void log(Severity severity, const char* msg) noexcept override {
    ++count;
    last_severity = severity;
    last = msg;
  }
  int count = 0;
  Severity last_severity = Severity::kVERBOSE;
  std::string last;
};

inline CapturingLogger& app_logger() {
  static CapturingLogger logger;
  return logger;
}

// What TensorRT hands a plugin library through setLoggerFinder.
class FakeLoggerFinder final : public nvinfer1::ILoggerFinder {
 public:
  nvinfer1::ILogger* findLogger() override { return &logger; }
  CapturingLogger logger;
};

inline const bool kLoggerInstalled = (moespec::trt::set_logger(&app_logger()), true);


}  // namespace plugin_test
