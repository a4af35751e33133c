// What moespec's CUDA kernels share: warp constants, fp32 / bf16 element conversions, the warp
// sum (moe_experts.cu, decoder_ops.cu), and programmatic dependent launch (every .cu).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "moespec/error.h"

// A kernel's dynamic shared memory as `type* name` (16-byte aligned; one per kernel). The block
// emulator (tests/cpp/emulated/cuda_runtime.h) defines its own.
#ifndef MOESPEC_DYNAMIC_SHARED
#define MOESPEC_DYNAMIC_SHARED(type, name)                        \
  extern __shared__ __align__(16) unsigned char moespec_smem_[]; \
  type* name = reinterpret_cast<type*>(moespec_smem_)
#endif

namespace moespec {
namespace cuda {
namespace device {

constexpr int kWarp = 32;
constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename W>
__device__ __forceinline__ W from_f(float v);
template <>
__device__ __forceinline__ float from_f<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

// The full warp's maximum and sum of 32-bit integers: one REDUX instruction on sm_80+ (a chain of
// five shuffles below it).
#if defined(MOESPEC_EMULATED) || (defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800)
__device__ __forceinline__ uint32_t warp_max_u32(uint32_t v) { return __reduce_max_sync(kFullMask, v); }
__device__ __forceinline__ int warp_add(int v) { return __reduce_add_sync(kFullMask, v); }
#else
__device__ __forceinline__ uint32_t warp_max_u32(uint32_t v) {
  for (int o = kWarp / 2; o > 0; o /= 2) {
    const uint32_t other = __shfl_xor_sync(kFullMask, v, o);
    v = other > v ? other : v;
  }
  return v;
}
__device__ __forceinline__ int warp_add(int v) {
  for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}
#endif

// ---- programmatic dependent launch (sm_90+; no-ops below) ---------------------------------------
// A kernel launched by launch_kernel with pdl may start while the kernel before it on the stream is
// still running (once every block of that one has called launch_dependents). The rule that keeps
// this safe, kept by every such kernel: each block calls wait_for_primary() before its first global
// memory access that depends on earlier work (reads its outputs, or writes what it may still read)
// and before it exits, so that a kernel's completion implies its primary's, transitively. Before the
// wait a block may only read what was complete before it could start: the moe down kernel's ids and
// weights (the routing kernel's output: its primary, gate/up, triggers only after its own wait) and
// its weight prefetch.
__device__ __forceinline__ void wait_for_primary() {
#if defined(MOESPEC_EMULATED)  // (the block emulator runs the primary from here: tests/cpp/emulated)
  ::emu::Block::self()->wait_for_primary();
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// Lets the next kernel on the stream (if launched with pdl) be scheduled once every block of this
// one has called it; its blocks then wait (wait_for_primary) for this kernel's completion.
__device__ __forceinline__ void launch_dependents() {
#if defined(MOESPEC_EMULATED)  // (the block emulator checks it follows the block's wait)
  ::emu::Block::self()->launch_dependents();
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}

// Asks L2 to fetch the 128-byte line at p (a hint: no result, no fault).
__device__ __forceinline__ void prefetch_l2(const void* p) {
#ifdef MOESPEC_EMULATED
  (void)p;
#else
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#endif
}

}  // namespace device

// Makes `device` current for the scope of an op's call (its tensors and stream are that device's:
// the capability checks and the launches ask the current device), then restores the previous one.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cudaError_t status = cudaGetDevice(&previous_);
    if (status == cudaSuccess && previous_ == device) {
      previous_ = -1;
    } else if (status == cudaSuccess) {
      status = cudaSetDevice(device);
    }
    if (status != cudaSuccess) {
      previous_ = -1;
      throw_runtime("moespec: making CUDA device ", device, " current failed: ", cudaGetErrorString(status));
    }
  }
  ~DeviceGuard() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

// The current device's compute capability major (0 when unknown); asked once per device. sm_80+:
// bf16 mma.sync; sm_90+: programmatic dependent launch.
inline int device_major() {
  static int cached[64] = {};  // 0: not asked yet
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) return 0;
  if (cached[device] == 0) {
    int major = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) major = 0;
    cached[device] = major > 0 ? major : -1;
  }
  return cached[device] > 0 ? cached[device] : 0;
}

// Whether kernels are launched as programmatic dependents: the device is sm_90+ and MOESPEC_PDL is
// unset or "1" ("0": plain launches, to compare; anything else is an error naming the variable).
inline bool pdl_allowed() {
  const char* env = std::getenv("MOESPEC_PDL");
  if (env != nullptr && std::strcmp(env, "1") != 0) {
    MOESPEC_CHECK_ARG(std::strcmp(env, "0") == 0, "MOESPEC_PDL", "expected '1' or '0', got '", std::string(env), "'");
    return false;
  }
  return device_major() >= 9;
}

// Whether `kernel`'s code on the current device was compiled from sm_90+ PTX, so that it holds the
// griddepcontrol instructions above: a newer GPU running the build's JIT-compiled compute_80 PTX (no
// sm_100 binary in the build) would run code without them, whose blocks would not wait for their
// primary. Asked once per kernel and device (a list as long as the kernels times the devices).
inline bool has_pdl_code(const void* kernel) {
  struct Seen {
    const void* kernel;
    int device;
    bool ok;
  };
  static std::mutex mutex;
  static std::vector<Seen> seen;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  std::lock_guard<std::mutex> lock(mutex);
  for (const Seen& s : seen)
    if (s.kernel == kernel && s.device == device) return s.ok;
  cudaFuncAttributes attributes = {};
  const bool ok = cudaFuncGetAttributes(&attributes, kernel) == cudaSuccess && attributes.ptxVersion >= 90;
  seen.push_back({kernel, device, ok});
  return ok;
}

// kernel<<<grid, block, shared, stream>>>(args...), as a programmatic dependent launch when pdl (and
// the kernel's code has the waits: has_pdl_code).
template <typename... Params, typename... Args>
cudaError_t launch_kernel(bool pdl, void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t shared,
                          cudaStream_t stream, Args... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = pdl && has_pdl_code(reinterpret_cast<const void*>(kernel)) ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, static_cast<Params>(args)...);
}

}  // namespace cuda
}  // namespace moespec
