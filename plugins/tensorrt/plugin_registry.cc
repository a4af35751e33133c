// Entry points of libmoespec_trt_plugins.so: how TensorRT and applications find its plugin creators.
//
// - getCreators / setLoggerFinder: the C entry points TensorRT looks up when it loads a plugin
//   library itself (IPluginRegistry::loadLibrary, trtexec --dynamicPlugins, plugins serialized into
//   a version-compatible plan). They need nothing from libnvinfer.
// - initMoespecPlugins(logger, namespace): registers the creators with getPluginRegistry(), the
//   pattern of TensorRT-LLM's initTrtLlmPlugins (REFERENCE.md "4. TensorRT plugins"); from Python:
//   ctypes.CDLL(path, mode=RTLD_GLOBAL).initMoespecPlugins(None, b"moespec"). getPluginRegistry()
//   lives in libnvinfer, so this entry point exists only when the build found libnvinfer
//   (MOESPEC_TRT_HAVE_NVINFER); a headers-only build is a compile check and leaves it out.
#include <NvInferRuntime.h>

#include <cstdint>
#include <exception>
#include <mutex>
#include <string>

#include "moe_experts_plugin.h"
#include "plugin_log.h"
#include "route_experts_plugin.h"
#include "tree_select_plugin.h"

// The library is built with hidden visibility; these entry points are its only exports.
// (TensorRT's own TENSORRTAPI exports only while building TensorRT itself.)
#if defined(_WIN32)
#define MOESPEC_TRT_EXPORT __declspec(dllexport)
#else
#define MOESPEC_TRT_EXPORT __attribute__((visibility("default")))
#endif

namespace {

moespec::trt::RouteExpertsPluginCreator& route_experts_creator() {
  static moespec::trt::RouteExpertsPluginCreator creator;
  return creator;
}

moespec::trt::MoeExpertsPluginCreator& moe_experts_creator() {
  static moespec::trt::MoeExpertsPluginCreator creator;
  return creator;
}

moespec::trt::TreeSelectPluginCreator& tree_select_creator() {
  static moespec::trt::TreeSelectPluginCreator creator;
  return creator;
}

}  // namespace

// The plugin creators of this library (MoespecRouteExperts, MoespecBudgetedMoe and MoespecTreeSelect,
// version "1", namespace "moespec").
extern "C" MOESPEC_TRT_EXPORT nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators) {
  nbCreators = 0;
  try {
    static nvinfer1::IPluginCreatorInterface* const creators[] = {&route_experts_creator(), &moe_experts_creator(),
                                                                  &tree_select_creator()};
    nbCreators = static_cast<int32_t>(sizeof(creators) / sizeof(creators[0]));
    return creators;
  } catch (const std::exception& e) {
    moespec::trt::report_error("getCreators", e.what());
  } catch (...) {
    moespec::trt::report_error("getCreators", "unknown exception");
  }
  return nullptr;
}

// TensorRT's way to give the library a logger (used by plugin_log.h).
extern "C" MOESPEC_TRT_EXPORT void setLoggerFinder(nvinfer1::ILoggerFinder* finder) {
  moespec::trt::set_logger_finder(finder);
}

#if defined(MOESPEC_TRT_HAVE_NVINFER)
// Registers the creators under `libNamespace` ("moespec" when null or empty), once; `logger` is an
// nvinfer1::ILogger* (null: TensorRT's global logger). Returns false, with the reason logged, if
// the registry refuses or a different namespace was registered before.
extern "C" MOESPEC_TRT_EXPORT bool initMoespecPlugins(void* logger, const char* libNamespace) {
  try {
    moespec::trt::set_logger(logger != nullptr ? static_cast<nvinfer1::ILogger*>(logger) : ::getLogger());
    const std::string ns =
        libNamespace != nullptr && *libNamespace != '\0' ? libNamespace : moespec::trt::kPluginNamespace;
    static std::mutex mutex;
    static std::string registered;  // the namespace registered so far ("" before the first call)
    std::lock_guard<std::mutex> lock(mutex);
    if (!registered.empty()) {
      if (registered == ns) return true;
      moespec::trt::report_error("initMoespecPlugins", ("the moespec plugins are already registered under namespace '" +
                                                        registered + "', not '" + ns + "'")
                                                           .c_str());
      return false;
    }
    nvinfer1::IPluginRegistry* registry = getPluginRegistry();
    if (registry == nullptr) {
      moespec::trt::report_error("initMoespecPlugins", "getPluginRegistry() returned no registry");
      return false;
    }
    route_experts_creator().set_plugin_namespace(ns);
    moe_experts_creator().set_plugin_namespace(ns);
    tree_select_creator().set_plugin_namespace(ns);
    nvinfer1::IPluginCreatorV3One* const creators[] = {&route_experts_creator(), &moe_experts_creator(),
                                                       &tree_select_creator()};
    for (nvinfer1::IPluginCreatorV3One* creator : creators) {
      if (!registry->registerCreator(*creator, ns.c_str())) {
        moespec::trt::report_error("initMoespecPlugins", ("the plugin registry refused creator " +
                                                          std::string(creator->getPluginName()) + " version " +
                                                          creator->getPluginVersion() + " in namespace '" + ns + "'")
                                                             .c_str());
        return false;
      }
    }
    registered = ns;
    return true;
  } catch (const std::exception& e) {
    moespec::trt::report_error("initMoespecPlugins", e.what());
  } catch (...) {
    moespec::trt::report_error("initMoespecPlugins", "unknown exception");
  }
  return false;
}
#endif  // MOESPEC_TRT_HAVE_NVINFER
