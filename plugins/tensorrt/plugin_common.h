// What every moespec TensorRT plugin shares: its fields as a PluginFieldCollection (parse with
// checks, serialize, list the names), error reports from noexcept methods, and TensorRT tensors
// as moespec::TensorView objects.
//
// A plugin's fields are a struct with a static field table and a validate():
//
//   struct MyFields {
//     int32_t a = 0; float b = 1.0f;
//     template <typename F, typename Visit> static void visit(F& f, Visit&& v) { v("a", f.a); v("b", f.b); }
//     void validate() const;  // throws moespec::Error naming the field
//   };
//
// Every field is one INT32 or FLOAT32 value (the member's type); serialization is the same table.
#pragma once

#include <NvInferRuntime.h>

#include <cstdint>
#include <cstring>
#include <exception>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "moespec/error.h"
#include "moespec/tensor_view.h"
#include "plugin_log.h"

namespace moespec {
namespace trt {

constexpr char kPluginNamespace[] = "moespec";

static_assert(sizeof(float) == sizeof(int32_t), "fields are 4-byte values");

template <typename V>
constexpr nvinfer1::PluginFieldType field_type() {
  static_assert(std::is_same_v<V, int32_t> || std::is_same_v<V, float>, "fields are int32 or float32");
  return std::is_same_v<V, float> ? nvinfer1::PluginFieldType::kFLOAT32 : nvinfer1::PluginFieldType::kINT32;
}

const char* field_type_name(nvinfer1::PluginFieldType type);

// One PluginField per field, pointing into `fields`.
template <typename Fields>
std::vector<nvinfer1::PluginField> to_plugin_fields(const Fields& fields) {
  std::vector<nvinfer1::PluginField> out;
  Fields::visit(fields, [&](const char* name, const auto& value) {
    out.emplace_back(name, &value, field_type<std::decay_t<decltype(value)>>(), 1);
  });
  return out;
}

template <typename Fields>
std::string field_names() {
  const Fields defaults;
  std::string names;
  Fields::visit(defaults, [&](const char* name, const auto&) {
    names += names.empty() ? "" : ", ";
    names += name;
  });
  return names;
}

// The named fields of `fc` over Fields' defaults, validated; throws moespec::Error naming the field
// at fault (unknown name, wrong type or length, given twice, bad value).
template <typename Fields>
Fields fields_from_collection(const nvinfer1::PluginFieldCollection* fc, const char* plugin) {
  MOESPEC_CHECK_ARG(fc != nullptr, "fields", "no PluginFieldCollection given");
  MOESPEC_CHECK_ARG(fc->nbFields >= 0 && (fc->nbFields == 0 || fc->fields != nullptr), "fields",
                    "a collection of ", fc->nbFields, " fields without field data");
  Fields out;
  uint64_t seen = 0;
  for (int32_t i = 0; i < fc->nbFields; ++i) {
    const nvinfer1::PluginField& given = fc->fields[i];
    MOESPEC_CHECK_ARG(given.name != nullptr, "fields", "field ", i, " has no name");
    bool matched = false;
    int bit = 0;
    Fields::visit(out, [&](const char* name, auto& value) {
      const uint64_t mask = uint64_t{1} << bit++;
      if (matched || std::strcmp(name, given.name) != 0) return;
      matched = true;
      using V = std::decay_t<decltype(value)>;
      MOESPEC_CHECK_ARG(given.type == field_type<V>(), name, "expected type ", field_type_name(field_type<V>()),
                        ", got PluginFieldType ", static_cast<int32_t>(given.type), " (",
                        field_type_name(given.type), ")");
      MOESPEC_CHECK_ARG(given.length == 1 && given.data != nullptr, name, "expected one value, got ", given.length,
                        given.data == nullptr ? " and no data" : "");
      MOESPEC_CHECK_ARG((seen & mask) == 0, name, "given more than once");
      seen |= mask;
      std::memcpy(&value, given.data, sizeof(V));
    });
    MOESPEC_CHECK_ARG(matched, given.name, "not a field of ", plugin, " (its fields: ", field_names<Fields>(), ")");
  }
  out.validate();
  return out;
}

// Field by field, bit for bit.
template <typename Fields>
bool same_fields(const Fields& a, const Fields& b) {
  const std::vector<nvinfer1::PluginField> x = to_plugin_fields(a), y = to_plugin_fields(b);
  for (size_t i = 0; i < x.size(); ++i)
    if (std::memcmp(x[i].data, y[i].data, sizeof(int32_t)) != 0) return false;
  return true;
}

// A PluginFieldCollection view of fields: serialize() points into the given value (keep it alive);
// names() lists names and types only (a creator's getFieldNames).
class FieldCollection {
 public:
  template <typename Fields>
  const nvinfer1::PluginFieldCollection* serialize(const Fields& fields) {
    fields_ = to_plugin_fields(fields);
    return finish();
  }
  template <typename Fields>
  const nvinfer1::PluginFieldCollection* names() {
    static const Fields defaults;
    fields_ = to_plugin_fields(defaults);
    for (nvinfer1::PluginField& field : fields_) field.data = nullptr;
    return finish();
  }

 private:
  const nvinfer1::PluginFieldCollection* finish() {
    collection_.nbFields = static_cast<int32_t>(fields_.size());
    collection_.fields = fields_.data();
    return &collection_;
  }
  std::vector<nvinfer1::PluginField> fields_;
  nvinfer1::PluginFieldCollection collection_{};
};

// "<plugin> '<layer>'::<method>: <what>", through plugin_log.h.
void report(const char* plugin, const char* layer, const char* method, const char* what) noexcept;

// Runs `body`; an exception becomes a report and `on_error` (TensorRT methods are noexcept).
template <typename Result, typename Body>
Result guarded(const char* plugin, const char* layer, const char* method, Result on_error, Body&& body) noexcept {
  try {
    return body();
  } catch (const std::exception& e) {
    report(plugin, layer, method, e.what());
  } catch (...) {
    report(plugin, layer, method, "unknown exception");
  }
  return on_error;
}

// The IPluginV3 plumbing every plugin shares: its capabilities, identity (Derived::kName,
// Derived::kVersion, the namespace), its fields (validated at construction), clone and
// attachToContext (no per-context resources), serialization (the fields), and `guard` for
// noexcept methods. Derived adds the build and runtime methods of its op.
template <typename Derived, typename FieldsT>
class PluginBase : public nvinfer1::IPluginV3,
                   public nvinfer1::IPluginV3OneCore,
                   public nvinfer1::IPluginV3OneBuild,
                   public nvinfer1::IPluginV3OneRuntime {
 public:
  using Fields = FieldsT;
  // Throws moespec::Error if `fields` fail validate(). `layer_name` only labels error reports.
  PluginBase(const Fields& fields, std::string plugin_namespace, std::string layer_name)
      : fields_(fields), namespace_(std::move(plugin_namespace)), layer_name_(std::move(layer_name)) {
    fields_.validate();
  }
  PluginBase(const PluginBase&) = delete;
  PluginBase& operator=(const PluginBase&) = delete;

  const Fields& fields() const { return fields_; }

  nvinfer1::IPluginCapability* getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept override {
    switch (type) {
      case nvinfer1::PluginCapabilityType::kCORE: return static_cast<nvinfer1::IPluginV3OneCore*>(this);
      case nvinfer1::PluginCapabilityType::kBUILD: return static_cast<nvinfer1::IPluginV3OneBuild*>(this);
      case nvinfer1::PluginCapabilityType::kRUNTIME: return static_cast<nvinfer1::IPluginV3OneRuntime*>(this);
    }
    report(Derived::kName, layer_name_.c_str(), "getCapabilityInterface", "unknown PluginCapabilityType");
    return nullptr;
  }
  nvinfer1::IPluginV3* clone() noexcept override {
    return guard("clone", static_cast<nvinfer1::IPluginV3*>(nullptr),
                 [&]() -> nvinfer1::IPluginV3* { return new Derived(fields_, namespace_, layer_name_); });
  }
  const char* getPluginName() const noexcept override { return Derived::kName; }
  const char* getPluginVersion() const noexcept override { return Derived::kVersion; }
  const char* getPluginNamespace() const noexcept override { return namespace_.c_str(); }
  nvinfer1::IPluginV3* attachToContext(nvinfer1::IPluginResourceContext*) noexcept override { return clone(); }
  const nvinfer1::PluginFieldCollection* getFieldsToSerialize() noexcept override {
    return guard("getFieldsToSerialize", static_cast<const nvinfer1::PluginFieldCollection*>(nullptr),
                 [&] { return serialized_.serialize(fields_); });
  }

 protected:
  template <typename Result, typename Body>
  Result guard(const char* method, Result on_error, Body&& body) const noexcept {
    return guarded(Derived::kName, layer_name_.c_str(), method, on_error, std::forward<Body>(body));
  }

  const Fields fields_;
  const std::string namespace_;
  const std::string layer_name_;

 private:
  FieldCollection serialized_;  // points into fields_
};

// The creator of a PluginBase plugin: field names from its table, plugins from a collection.
template <typename Plugin>
class PluginCreator final : public nvinfer1::IPluginCreatorV3One {
 public:
  PluginCreator() : field_names_(names_.template names<typename Plugin::Fields>()) {}
  PluginCreator(const PluginCreator&) = delete;
  PluginCreator& operator=(const PluginCreator&) = delete;

  // Returns nullptr, with the reason reported (plugin_log.h), when a field is unknown or invalid.
  nvinfer1::IPluginV3* createPlugin(const char* name, const nvinfer1::PluginFieldCollection* fc,
                                    nvinfer1::TensorRTPhase) noexcept override {
    return guarded(Plugin::kName, name, "createPlugin", static_cast<nvinfer1::IPluginV3*>(nullptr),
                   [&]() -> nvinfer1::IPluginV3* {
                     return new Plugin(fields_from_collection<typename Plugin::Fields>(fc, Plugin::kName), namespace_,
                                       name != nullptr ? name : "");
                   });
  }
  const nvinfer1::PluginFieldCollection* getFieldNames() noexcept override { return field_names_; }
  const char* getPluginName() const noexcept override { return Plugin::kName; }
  const char* getPluginVersion() const noexcept override { return Plugin::kVersion; }
  const char* getPluginNamespace() const noexcept override { return namespace_.c_str(); }
  // The namespace given to the plugins created from now on (kPluginNamespace by default); set it
  // before registering the creator under that namespace.
  void set_plugin_namespace(const std::string& plugin_namespace) { namespace_ = plugin_namespace; }

 private:
  FieldCollection names_;
  const nvinfer1::PluginFieldCollection* field_names_;
  std::string namespace_ = kPluginNamespace;
};

DType to_dtype(nvinfer1::DataType type);

// A contiguous CUDA view of a linear-format TensorRT tensor.
TensorView to_view(const nvinfer1::PluginTensorDesc& desc, const void* data, int32_t device_index);

// The current CUDA device (cudaGetDevice); throws on failure.
int32_t current_device();

}  // namespace trt
}  // namespace moespec
