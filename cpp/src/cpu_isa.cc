// CPU ISA detection and the process-wide active ISA (see cpp/include/moespec/cpu_isa.h).
#include "moespec/cpu_isa.h"

#include <atomic>
#include <cstdlib>
#include <string>

#include "moespec/error.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#define MOESPEC_X86 1
#endif

namespace moespec {
namespace {

#ifdef MOESPEC_X86
unsigned long long read_xcr0() {
  unsigned int lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<unsigned long long>(hi) << 32) | lo;
}
#endif

struct CpuFeatures {
  bool avx2 = false;
  bool avx512 = false;
  bool avx512_bf16 = false;
};

CpuFeatures detect() {
  CpuFeatures f;
#ifdef MOESPEC_X86
  unsigned int eax, ebx, ecx, edx;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return f;
  const bool osxsave = ecx & (1u << 27);
  const bool fma = ecx & (1u << 12);
  const bool f16c = ecx & (1u << 29);
  if (!osxsave) return f;
  const unsigned long long xcr0 = read_xcr0();
  const bool os_avx = (xcr0 & 0x6) == 0x6;         // XMM and YMM state
  const bool os_avx512 = (xcr0 & 0xe6) == 0xe6;    // plus opmask, ZMM_Hi256, Hi16_ZMM
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return f;
  const bool avx2 = ebx & (1u << 5);
  const bool avx512f = ebx & (1u << 16), avx512dq = ebx & (1u << 17);
  const bool avx512bw = ebx & (1u << 30), avx512vl = ebx & (1u << 31);
  f.avx2 = os_avx && avx2 && fma && f16c;
  f.avx512 = f.avx2 && os_avx512 && avx512f && avx512dq && avx512bw && avx512vl;
  if (f.avx512 && __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx)) f.avx512_bf16 = eax & (1u << 5);
#endif
  return f;
}

const CpuFeatures& features() {
  static const CpuFeatures f = detect();
  return f;
}

bool supported(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kScalar: return true;
    case CpuIsa::kAvx2: return features().avx2;
    case CpuIsa::kAvx512: return features().avx512;
  }
  return false;
}

CpuIsa initial_isa() {
  const char* env = std::getenv("MOESPEC_CPU_ISA");
  if (env == nullptr || *env == '\0') return supported_cpu_isas().back();
  const std::string name(env);
  CpuIsa isa;
  if (name == "scalar") isa = CpuIsa::kScalar;
  else if (name == "avx2") isa = CpuIsa::kAvx2;
  else if (name == "avx512") isa = CpuIsa::kAvx512;
  else throw_invalid("MOESPEC_CPU_ISA", "expected scalar, avx2 or avx512, got '", name, "'");
  MOESPEC_CHECK_ARG(supported(isa), "MOESPEC_CPU_ISA", "this CPU cannot run '", name, "'");
  return isa;
}

std::atomic<int>& active_slot() {
  static std::atomic<int> slot{static_cast<int>(initial_isa())};
  return slot;
}

}  // namespace

const char* cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kScalar: return "scalar";
    case CpuIsa::kAvx2: return "avx2";
    case CpuIsa::kAvx512: return "avx512";
  }
  return "unknown";
}

const std::vector<CpuIsa>& supported_cpu_isas() {
  static const std::vector<CpuIsa> isas = [] {
    std::vector<CpuIsa> v{CpuIsa::kScalar};
    if (supported(CpuIsa::kAvx2)) v.push_back(CpuIsa::kAvx2);
    if (supported(CpuIsa::kAvx512)) v.push_back(CpuIsa::kAvx512);
    return v;
  }();
  return isas;
}

bool cpu_has_avx512_bf16() { return features().avx512_bf16; }

CpuIsa active_cpu_isa() { return static_cast<CpuIsa>(active_slot().load(std::memory_order_relaxed)); }

void set_active_cpu_isa(CpuIsa isa) {
  MOESPEC_CHECK_ARG(supported(isa), "isa", "this CPU cannot run '", cpu_isa_name(isa), "'");
  active_slot().store(static_cast<int>(isa), std::memory_order_relaxed);
}

}  // namespace moespec
