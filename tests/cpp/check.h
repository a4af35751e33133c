// A minimal test harness for the C++ unit tests: TEST(name) { CHECK(...); } and a main that runs
// every test, prints each failure with file:line, and exits non-zero if any failed.
#pragma once

#include <cstdio>
#include <exception>
#include <functional>
#include <string>
#include <vector>

namespace moespec_test {

struct Case {
  const char* name;
  std::function<void()> body;
};

inline std::vector<Case>& registry() {
  static std::vector<Case> cases;
  return cases;
}

inline int& failures() {
  static int n = 0;
  return n;
}

struct Register {
  Register(const char* name, std::function<void()> body) { registry().push_back({name, std::move(body)}); }
};

inline void fail(const char* file, int line, const std::string& what) {
  ++failures();
  std::fprintf(stderr, "  FAILED %s:%d: %s\n", file, line, what.c_str());
}

}  // namespace moespec_test

#define TEST(name)                                                              \
  static void name();                                                           \
  static ::moespec_test::Register register_##name(#name, name);                 \
  static void name()

#define CHECK(cond)                                                             \
  do {                                                                          \
    if (!(cond)) ::moespec_test::fail(__FILE__, __LINE__, #cond);               \
  } while (0)

#define CHECK_MSG(cond, msg)                                                    \
  do {                                                                          \
    if (!(cond)) ::moespec_test::fail(__FILE__, __LINE__, std::string(#cond) + ": " + (msg)); \
  } while (0)

// Checks that `stmt` throws moespec::Error whose message contains `fragment`.
#define CHECK_THROWS_WITH(stmt, fragment)                                                        \
  do {                                                                                           \
    bool thrown_ = false;                                                                        \
    try {                                                                                        \
      stmt;                                                                                      \
    } catch (const ::moespec::Error& e_) {                                                       \
      thrown_ = true;                                                                            \
      if (std::string(e_.what()).find(fragment) == std::string::npos)                            \
        ::moespec_test::fail(__FILE__, __LINE__, std::string("message '") + e_.what() +          \
                                                     "' lacks '" + (fragment) + "'");            \
    }                                                                                            \
    if (!thrown_) ::moespec_test::fail(__FILE__, __LINE__, std::string(#stmt) + " did not throw"); \
  } while (0)

int main() {
  int failed_cases = 0;
  for (const auto& c : ::moespec_test::registry()) {
    const int before = ::moespec_test::failures();
    try {
      c.body();
    } catch (const std::exception& e) {
      ::moespec_test::fail(__FILE__, __LINE__, std::string("unexpected exception: ") + e.what());
    }
    const bool ok = ::moespec_test::failures() == before;
    failed_cases += ok ? 0 : 1;
    std::printf("[%s] %s\n", ok ? "  ok  " : "FAILED", c.name);
  }
  std::printf("%zu cases, %d failed\n", ::moespec_test::registry().size(), failed_cases);
  return failed_cases == 0 ? 0 : 1;
}
