// Error reporting of the moespec TensorRT plugins.
//
// Every TensorRT interface method is noexcept, so each plugin method catches what the core throws
// (moespec::Error and the rest), reports it here and returns TensorRT's failure value (-1, false,
// nullptr, 0 bytes). A report goes to the logger TensorRT hands the library (setLoggerFinder, see
// plugin_registry.cc), else to the one given to initMoespecPlugins, else to stderr; the calling
// thread also keeps the last message, which the unit tests read.
#pragma once

#include <NvInferRuntime.h>

#include <string>

namespace moespec {
namespace trt {

// The logger given to initMoespecPlugins (nullptr: none). Not owned.
void set_logger(nvinfer1::ILogger* logger) noexcept;

// The logger finder TensorRT passes to setLoggerFinder (nullptr: none); it wins over set_logger's.
void set_logger_finder(nvinfer1::ILoggerFinder* finder) noexcept;

// Logs "where: what" at ILogger::Severity::kERROR and keeps it as this thread's last_error().
void report_error(const char* where, const char* what) noexcept;

// This thread's last reported error ("" if none since clear_last_error()).
std::string last_error();
void clear_last_error() noexcept;

}  // namespace trt
}  // namespace moespec
