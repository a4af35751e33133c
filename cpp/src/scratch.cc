// The scratch accounting and retain limit of scratch.h (AlignedBuffer and release_if_large in
// aligned_buffer.h use them).
#include "moespec/scratch.h"

#include <atomic>
#include <cstdlib>
#include <string>

#include "aligned_buffer.h"
#include "moespec/error.h"

namespace moespec {
namespace {

constexpr long kMaxRetainMB = 1L << 20;  // 1 TiB: beyond any machine, a typo guard

std::size_t retain_from_env() {
  const char* env = std::getenv("MOESPEC_SCRATCH_RETAIN_MB");
  if (env == nullptr || *env == '\0') return std::size_t{64} << 20;
  char* end = nullptr;
  const long mb = std::strtol(env, &end, 10);
  MOESPEC_CHECK_ARG(*end == '\0' && mb >= 0 && mb <= kMaxRetainMB, "MOESPEC_SCRATCH_RETAIN_MB",
                    "expected an integer in [0, ", kMaxRetainMB, "], got '", std::string(env), "'");
  return static_cast<std::size_t>(mb) << 20;
}

std::atomic<std::size_t>& retain() {
  static std::atomic<std::size_t> bytes{retain_from_env()};
  return bytes;
}

}  // namespace

namespace cpu {
std::atomic<std::size_t> g_scratch_held{0};

std::size_t scratch_retain_limit() { return retain().load(std::memory_order_relaxed); }
}  // namespace cpu

std::size_t scratch_bytes() { return cpu::g_scratch_held.load(std::memory_order_relaxed); }
std::size_t scratch_retain_bytes() { return cpu::scratch_retain_limit(); }
std::size_t set_scratch_retain_bytes(std::size_t bytes) { return retain().exchange(bytes); }

}  // namespace moespec
