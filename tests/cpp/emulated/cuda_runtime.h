// The CUDA runtime and device built-ins a moespec kernel source uses, on the block emulator
// (cuda_emulator.h): a .cu file compiled as C++ with this folder first on the include path runs its
// kernels on the CPU. The device is played as an sm_90 GPU (132 SMs, 227 KB of shared memory a block
// by opt-in); launches run to completion before they return (one stream, nothing asynchronous).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>

#include "cuda_emulator.h"

#ifndef MOESPEC_EMULATED
#define MOESPEC_EMULATED 1
#endif

// ---- qualifiers and indices ----------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#define __shared__ static
#define MOESPEC_DYNAMIC_SHARED(type, name) type* name = reinterpret_cast<type*>(::emu::dynamic_shared_buffer().data())

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
inline const emu::Dim3& threadIdx = emu::thread_idx;  // (variables, as CUDA's: a struct may have fields of these names)
inline const emu::Dim3& blockIdx = emu::block_idx;
inline const emu::Dim3& blockDim = emu::block_dim;
inline const emu::Dim3& gridDim = emu::grid_dim;

struct uint2 {
  unsigned x, y;
};
struct uint4 {
  unsigned x, y, z, w;
};
struct float2 {
  float x, y;
};
struct float4 {
  float x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }
inline float2 make_float2(float x, float y) { return float2{x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }

// ---- barriers, shuffles, votes -------------------------------------------------------------------
inline void __syncthreads() { ::emu::block_count(0); }
inline int __syncthreads_count(int p) { return ::emu::block_count(p); }
inline int __syncthreads_and(int p) { return ::emu::block_count(p) == static_cast<int>(::emu::block_threads()); }
inline int __syncthreads_or(int p) { return ::emu::block_count(p) > 0; }
inline void __syncwarp(unsigned mask = 0xffffffffu) { ::emu::exchange(mask, 0u, -1); }
inline void __threadfence() {}
inline void __threadfence_block() {}

template <typename T>
T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
  const int lane = static_cast<int>(::emu::Block::self()->lane());
  const int s = (lane & ~(width - 1)) + (src & (width - 1));
  return ::emu::from_bits<T>(::emu::exchange(mask, ::emu::to_bits(v), s));
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  const int lane = static_cast<int>(::emu::Block::self()->lane());
  const int s = lane ^ lane_mask;
  return ::emu::from_bits<T>(::emu::exchange(mask, ::emu::to_bits(v), s / width == lane / width ? s : lane));
}
template <typename T>
T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  const int lane = static_cast<int>(::emu::Block::self()->lane());
  const int s = lane - static_cast<int>(delta);
  return ::emu::from_bits<T>(::emu::exchange(mask, ::emu::to_bits(v), s >= (lane & ~(width - 1)) ? s : lane));
}
template <typename T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  const int lane = static_cast<int>(::emu::Block::self()->lane());
  const int s = lane + static_cast<int>(delta);
  return ::emu::from_bits<T>(::emu::exchange(mask, ::emu::to_bits(v), s < (lane | (width - 1)) + 1 ? s : lane));
}
inline unsigned __ballot_sync(unsigned mask, int p) { return ::emu::vote(mask, p != 0, &::emu::run_ballot); }
inline int __any_sync(unsigned mask, int p) { return __ballot_sync(mask, p) != 0; }
inline int __all_sync(unsigned mask, int p) { return __ballot_sync(mask, p) == mask; }
// __reduce_*_sync (sm_80+, one instruction on a GPU): the unsigned maximum and the (wrapping) sum.
struct EmuMaxU32 {
  uint32_t operator()(uint32_t a, uint32_t b) const { return a > b ? a : b; }
};
struct EmuAdd32 {
  uint32_t operator()(uint32_t a, uint32_t b) const { return a + b; }
};
inline unsigned __reduce_max_sync(unsigned mask, unsigned v) { return ::emu::reduce<EmuMaxU32>(mask, v); }
inline unsigned __reduce_add_sync(unsigned mask, unsigned v) { return ::emu::reduce<EmuAdd32>(mask, v); }
inline int __reduce_add_sync(unsigned mask, int v) {
  return static_cast<int>(::emu::reduce<EmuAdd32>(mask, static_cast<uint32_t>(v)));
}
template <typename T>
unsigned __match_any_sync(unsigned mask, T v) {
  return ::emu::vote(mask, ::emu::to_bits(v), &::emu::run_match);
}

// ---- atomics (blocks and fibers never run at once: plain read-modify-writes) ---------------------
template <typename T, typename F>
T emu_read_modify_write(T* p, F f) {
  const T old = *p;
  *p = f(old);
  return old;
}
template <typename T>
T atomicAdd(T* p, T v) { return emu_read_modify_write(p, [v](T o) { return static_cast<T>(o + v); }); }
template <typename T>
T atomicOr(T* p, T v) { return emu_read_modify_write(p, [v](T o) { return static_cast<T>(o | v); }); }
template <typename T>
T atomicAnd(T* p, T v) { return emu_read_modify_write(p, [v](T o) { return static_cast<T>(o & v); }); }
template <typename T>
T atomicMax(T* p, T v) { return emu_read_modify_write(p, [v](T o) { return o > v ? o : v; }); }
template <typename T>
T atomicMin(T* p, T v) { return emu_read_modify_write(p, [v](T o) { return o < v ? o : v; }); }
template <typename T>
T atomicExch(T* p, T v) { return emu_read_modify_write(p, [v](T) { return v; }); }
template <typename T>
T atomicCAS(T* p, T expected, T v) { return emu_read_modify_write(p, [&](T o) { return o == expected ? v : o; }); }

// ---- loads, bits, arithmetic ---------------------------------------------------------------------
template <typename T>
T __ldg(const T* p) {
  return *p;
}
template <typename T>
T __ldcg(const T* p) {
  return *p;
}
template <typename T>
T __ldcs(const T* p) {
  return *p;
}
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __popcll(unsigned long long v) { return __builtin_popcountll(v); }
inline int __ffs(int v) { return __builtin_ffs(v); }
inline int __clz(int v) { return v == 0 ? 32 : __builtin_clz(static_cast<unsigned>(v)); }
inline float __uint_as_float(unsigned u) { return ::emu::from_bits<float>(u); }
inline unsigned __float_as_uint(float f) { return static_cast<unsigned>(::emu::to_bits(f)); }
inline float __int_as_float(int i) { return ::emu::from_bits<float>(static_cast<uint32_t>(i)); }
inline int __float_as_int(float f) { return static_cast<int>(::emu::to_bits(f)); }
inline long long __double_as_longlong(double d) { return static_cast<long long>(::emu::to_bits(d)); }
inline double __longlong_as_double(long long i) { return ::emu::from_bits<double>(static_cast<uint64_t>(i)); }
// Round-to-nearest arithmetic: the host's IEEE operations (the emulated build has no multiply-add
// contraction, so these round as the named intrinsics do).
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dsub_rn(double a, double b) { return a - b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdividef(float a, float b) { return a / b; }
inline float __expf(float v) { return std::exp(v); }
inline float __logf(float v) { return std::log(v); }
inline float rsqrtf(float v) { return 1.0f / std::sqrt(v); }
using std::exp;  // (expf, fmaxf and the other float functions: <math.h>'s, global)
using std::isfinite;
using std::isinf;
using std::isnan;

// ---- the runtime API -----------------------------------------------------------------------------
enum cudaError_t { cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorLaunchFailure = 4 };
struct CUstream_st;
using cudaStream_t = CUstream_st*;
inline cudaError_t& emu_last_error() {
  static cudaError_t e = cudaSuccess;
  return e;
}
inline std::string& emu_last_message() {
  static std::string m;
  return m;
}
inline const char* cudaGetErrorString(cudaError_t e) {
  return e == cudaSuccess ? "no error" : emu_last_message().empty() ? "emulated error" : emu_last_message().c_str();
}
inline cudaError_t cudaGetLastError() { return std::exchange(emu_last_error(), cudaSuccess); }
inline cudaError_t cudaPeekAtLastError() { return emu_last_error(); }
inline cudaError_t cudaGetDevice(int* d) {
  *d = 0;
  return cudaSuccess;
}
inline cudaError_t cudaSetDevice(int d) { return d == 0 ? cudaSuccess : cudaErrorInvalidValue; }
enum cudaDeviceAttr {
  cudaDevAttrComputeCapabilityMajor,
  cudaDevAttrComputeCapabilityMinor,
  cudaDevAttrMultiProcessorCount,
  cudaDevAttrMaxSharedMemoryPerBlockOptin,
  cudaDevAttrMaxSharedMemoryPerBlock,
};
inline cudaError_t cudaDeviceGetAttribute(int* v, cudaDeviceAttr a, int device) {
  if (device != 0) return cudaErrorInvalidValue;
  switch (a) {
    case cudaDevAttrComputeCapabilityMajor: *v = 9; break;
    case cudaDevAttrComputeCapabilityMinor: *v = 0; break;
    case cudaDevAttrMultiProcessorCount: *v = 132; break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *v = 232448; break;
    case cudaDevAttrMaxSharedMemoryPerBlock: *v = 49152; break;
  }
  return cudaSuccess;
}
struct cudaFuncAttributes {
  int ptxVersion = 90, binaryVersion = 90, maxThreadsPerBlock = 1024;
  std::size_t sharedSizeBytes = 0;
};
inline std::map<const void*, int>& emu_shared_limits() {  // kernel -> its dynamic shared memory limit
  static std::map<const void*, int> m;
  return m;
}
template <typename F>
cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* a, F) {
  *a = cudaFuncAttributes{};
  return cudaSuccess;
}
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize, cudaFuncAttributePreferredSharedMemoryCarveout };
template <typename F>
cudaError_t cudaFuncSetAttribute(F* kernel, cudaFuncAttribute a, int v) {
  if (a == cudaFuncAttributeMaxDynamicSharedMemorySize) {
    if (v < 0 || v > 232448) return cudaErrorInvalidValue;
    emu_shared_limits()[reinterpret_cast<const void*>(kernel)] = v;
  }
  return cudaSuccess;
}
enum cudaLaunchAttributeID {
  cudaLaunchAttributeProgrammaticStreamSerialization = 5,
  emuLaunchAttributeEarlyRelease = 0x7e01,  // (the emulator's own: the launch's blocks release early)
};
struct cudaLaunchAttributeValue {
  int programmaticStreamSerializationAllowed = 0;
};
struct cudaLaunchAttribute {
  cudaLaunchAttributeID id;
  cudaLaunchAttributeValue val;
};
namespace emu {
// The attribute moespec's launch_kernel adds, in the emulated build only, to a launch whose blocks
// call launch_dependents at their start, before their wait (cuda_emulator.h plays it, and checks it).
inline cudaLaunchAttribute early_release_attribute() {
  cudaLaunchAttribute a{};
  a.id = emuLaunchAttributeEarlyRelease;
  return a;
}
}  // namespace emu
struct cudaLaunchConfig_t {
  dim3 gridDim, blockDim;
  std::size_t dynamicSmemBytes = 0;
  cudaStream_t stream = nullptr;
  cudaLaunchAttribute* attrs = nullptr;
  unsigned numAttrs = 0;
};

// A launch: enqueued on the one stream (run at the next launch that is not its programmatic
// dependent, or at a synchronisation; cuda_emulator.h's enqueue). A bad configuration is the launch's
// error; a fault while a kernel runs is the error of the call that runs it (a later launch or a
// synchronisation), as a GPU reports a kernel's fault at a later call.
template <typename... Params, typename... Args>
cudaError_t cudaLaunchKernelEx(const cudaLaunchConfig_t* c, void (*kernel)(Params...), Args... args) {
  const auto it = emu_shared_limits().find(reinterpret_cast<const void*>(kernel));
  const std::size_t limit = it == emu_shared_limits().end() ? 49152 : static_cast<std::size_t>(it->second);
  bool dependent = false, early = false;
  for (unsigned i = 0; i < c->numAttrs; ++i) {
    dependent |= c->attrs[i].id == cudaLaunchAttributeProgrammaticStreamSerialization &&
                 c->attrs[i].val.programmaticStreamSerializationAllowed != 0;
    early |= c->attrs[i].id == emuLaunchAttributeEarlyRelease;
  }
  try {
    if (c->dynamicSmemBytes > limit)
      throw ::emu::Fault("launch: " + std::to_string(c->dynamicSmemBytes) + " bytes of dynamic shared memory over the "
                         "kernel's limit of " + std::to_string(limit) + " (cudaFuncSetAttribute)");
    ::emu::enqueue(dependent, early, ::emu::Dim3{c->gridDim.x, c->gridDim.y, c->gridDim.z},
                   ::emu::Dim3{c->blockDim.x, c->blockDim.y, c->blockDim.z}, c->dynamicSmemBytes,
                   ::emu::default_order(), kernel, static_cast<Params>(args)...);
  } catch (const std::exception& e) {
    emu_last_message() = std::string("emulated launch: ") + e.what();
    emu_last_error() = cudaErrorLaunchFailure;
    return emu_last_error();
  }
  return cudaSuccess;
}

// Runs every launch enqueued; the error of a kernel that faults.
inline cudaError_t cudaStreamSynchronize(cudaStream_t) {
  try {
    ::emu::synchronize();
  } catch (const std::exception& e) {
    emu_last_message() = std::string("emulated kernel: ") + e.what();
    emu_last_error() = cudaErrorLaunchFailure;
    return emu_last_error();
  }
  return cudaSuccess;
}
inline cudaError_t cudaDeviceSynchronize() { return cudaStreamSynchronize(nullptr); }
