// moespec error type: every failure of the C++ core is a moespec::Error.
//
// An Error carries a kind (bad input vs. a failure while running) and the name of the argument at
// fault, so that the Python bindings can raise ValueError / RuntimeError with a message that says
// which argument, what was expected and what was given. Nothing in the core aborts the process.
#pragma once

#include <cstdio>
#include <exception>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

namespace moespec {

enum class ErrorKind {
  kInvalidArgument,  // the caller passed something wrong: reaches Python as ValueError
  kRuntime,          // a failure while running (CUDA error, unsupported build): RuntimeError
};

class Error : public std::exception {
 public:
  Error(ErrorKind kind, std::string argument, std::string message)
      : kind_(kind), argument_(std::move(argument)), message_(std::move(message)) {
    what_ = argument_.empty() ? message_ : argument_ + ": " + message_;
  }
  ErrorKind kind() const noexcept { return kind_; }
  const std::string& argument() const noexcept { return argument_; }
  const std::string& message() const noexcept { return message_; }
  const char* what() const noexcept override { return what_.c_str(); }

 private:
  ErrorKind kind_;
  std::string argument_;
  std::string message_;
  std::string what_;
};

namespace detail {
// Messages are built without iostreams: no locale is touched on an error path. (A toolchain that
// links libstdc++ statically into the Python module gives it a second, uninitialised copy of the
// locale machinery, and the first ostream insertion crashed the process on a GPU machine.) The
// text is what an ostream would print: integers in decimal, floating point as %g, bools as 1 / 0,
// pointers as %p.
inline void append(std::string& out, std::string_view v) { out.append(v.data(), v.size()); }
inline void append(std::string& out, const char* v) { out.append(v ? v : "(null)"); }
inline void append(std::string& out, char v) { out.push_back(v); }
inline void append(std::string& out, bool v) { out.push_back(v ? '1' : '0'); }
template <typename T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
void append(std::string& out, T v) {
  out.append(std::to_string(v));
}
template <typename T, std::enable_if_t<std::is_floating_point_v<T>, int> = 0>
void append(std::string& out, T v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", static_cast<double>(v));
  out.append(buf);
}
inline void append(std::string& out, const void* v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%p", v);
  out.append(buf);
}

template <typename... Parts>
std::string concat(Parts&&... parts) {
  std::string out;
  (append(out, std::forward<Parts>(parts)), ...);
  return out;
}
}  // namespace detail

// Throws an InvalidArgument error for `argument`; the remaining arguments are streamed into the message.
template <typename... Parts>
[[noreturn]] void throw_invalid(const std::string& argument, Parts&&... parts) {
  throw Error(ErrorKind::kInvalidArgument, argument, detail::concat(std::forward<Parts>(parts)...));
}

template <typename... Parts>
[[noreturn]] void throw_runtime(Parts&&... parts) {
  throw Error(ErrorKind::kRuntime, "", detail::concat(std::forward<Parts>(parts)...));
}

}  // namespace moespec

// Checks a condition on an argument; on failure throws InvalidArgument naming the argument.
#define MOESPEC_CHECK_ARG(cond, argument, ...)             \
  do {                                                     \
    if (!(cond)) ::moespec::throw_invalid((argument), __VA_ARGS__); \
  } while (0)
