// Error reporting of the moespec TensorRT plugins: see plugin_log.h.
#include "plugin_log.h"

#include <atomic>
#include <cstdio>
#include <exception>

namespace moespec {
namespace trt {
namespace {

std::atomic<nvinfer1::ILogger*> g_logger{nullptr};
std::atomic<nvinfer1::ILoggerFinder*> g_logger_finder{nullptr};
thread_local std::string t_last_error;

nvinfer1::ILogger* current_logger() noexcept {
  if (nvinfer1::ILoggerFinder* finder = g_logger_finder.load()) {
    try {
      // findLogger() must be called on the thread of the plugin call that reports: it is.
      if (nvinfer1::ILogger* logger = finder->findLogger()) return logger;
    } catch (...) {
      // fall through to the other loggers
    }
  }
  return g_logger.load();
}

}  // namespace

void set_logger(nvinfer1::ILogger* logger) noexcept { g_logger.store(logger); }

void set_logger_finder(nvinfer1::ILoggerFinder* finder) noexcept { g_logger_finder.store(finder); }

void report_error(const char* where, const char* what) noexcept {
  const char* w = where != nullptr ? where : "moespec plugin";
  const char* m = what != nullptr ? what : "unknown error";
  try {
    t_last_error = std::string(w) + ": " + m;
  } catch (...) {
    t_last_error.clear();  // out of memory: the log line below still goes out
  }
  const char* line = t_last_error.empty() ? m : t_last_error.c_str();
  if (nvinfer1::ILogger* logger = current_logger()) {
    logger->log(nvinfer1::ILogger::Severity::kERROR, line);
  } else {
    std::fprintf(stderr, "[moespec TensorRT plugin] error: %s\n", line);
  }
}

std::string last_error() { return t_last_error; }

void clear_last_error() noexcept { t_last_error.clear(); }

}  // namespace trt
}  // namespace moespec
