// CPU instruction-set selection for the SIMD kernels (Highway-style runtime dispatch).
//
// Each SIMD kernel has one semantics, a scalar reference (<op>.cc) and per-ISA translation units
// (<op>_avx2.cc, <op>_avx512.cc) compiled with their own flags. The ISA is chosen once per process:
// the best one the CPU *and the OS* support (XSAVE state enabled), unless the environment variable
// MOESPEC_CPU_ISA=scalar|avx2|avx512 forces one (tests and benchmarks run every path that way).
#pragma once

#include <vector>

namespace moespec {

enum class CpuIsa : int {
  kScalar = 0,
  kAvx2 = 1,    // AVX2 + FMA + F16C
  kAvx512 = 2,  // AVX-512 F/BW/VL/DQ (+ BF16 dot products where present)
};

const char* cpu_isa_name(CpuIsa isa);

// ISAs this CPU and OS can run, best last. Always contains kScalar.
const std::vector<CpuIsa>& supported_cpu_isas();

// Whether the CPU has AVX512_BF16 (vdpbf16ps), for kernels that use it.
bool cpu_has_avx512_bf16();

// The ISA kernels use now: the best supported one, or MOESPEC_CPU_ISA if set (read once).
// Throws InvalidArgument if MOESPEC_CPU_ISA names an unknown or unsupported ISA.
CpuIsa active_cpu_isa();

// Overrides the active ISA for this process (tests); throws if the CPU cannot run it.
void set_active_cpu_isa(CpuIsa isa);

}  // namespace moespec
