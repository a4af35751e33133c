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
// and before it exits, so that a kernel's completion implies its primary's, transitively.
//
// Where a block lets the next kernel launch (launch_dependents): right after its wait, or, released
// early, at its start, before its wait. Early, the next kernel's blocks may start (and prefetch their
// weights into L2) while this kernel still waits for its own primary, so a chain of early releases
// keeps HBM streaming the coming projections' weights through the small kernels between them (norms,
// attention, routing). That is safe for every dependent that touches nothing before its wait but
// what no kernel writes (the weights it prefetches). A dependent that reads a kernel's output before
// its wait (the MoE down kernel finds its expert in the routing output, its primary's primary) needs
// its primary to release after its wait: then nothing of the dependent starts before the primary's
// primary is complete. The MoE gate/up kernel is that primary and releases late; every other moespec
// kernel releases early unless MOESPEC_PDL_EARLY=0 (pdl_launch). The block emulator plays both
// (tests/cpp/emulated/cuda_emulator.h).
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
#if defined(MOESPEC_EMULATED)  // (the block emulator checks it is where the launch declared it)
  ::emu::Block::self()->launch_dependents();
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}

// A block's release of the next kernel, early or after its wait (the rule above): release_early at
// the block's start, wait_then_release where it waits for its primary (between the two, at most the
// prefetch of weights).
__device__ __forceinline__ void release_early(bool early) {
  if (early) launch_dependents();
}
__device__ __forceinline__ void wait_then_release(bool early) {
  wait_for_primary();
  if (!early) launch_dependents();
}
// Both, for a block with nothing to do before its wait.
__device__ __forceinline__ void release_and_wait(bool early) {
  release_early(early);
  wait_then_release(early);
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

// An on/off switch from the environment: unset or "1" on, "0" off, anything else an error naming it.
inline bool env_switch(const char* name) {
  const char* env = std::getenv(name);
  if (env == nullptr || std::strcmp(env, "1") == 0) return true;
  MOESPEC_CHECK_ARG(std::strcmp(env, "0") == 0, name, "expected '1' or '0', got '", std::string(env), "'");
  return false;
}

// How a kernel is launched: as a programmatic dependent of the kernel before it on the stream, and
// whether its blocks release the next kernel early (device::release_early) or after their wait.
struct Pdl {
  bool dependent = false;
  bool early = false;
};

// Whether kernels are launched as programmatic dependents: the device is sm_90+ and MOESPEC_PDL is
// on ("0": plain launches, to compare).
inline bool pdl_allowed() { return env_switch("MOESPEC_PDL") && device_major() >= 9; }

// How moespec's programmatic dependents are launched: dependent where pdl_allowed, early unless
// MOESPEC_PDL_EARLY=0 (the MoE gate/up kernel, whose dependents read its primary's output before their
// wait, takes Pdl{dependent, false} instead).
inline Pdl pdl_launch() {
  const bool early = env_switch("MOESPEC_PDL_EARLY");  // (read first: a bad value errs on any device)
  Pdl p;
  p.dependent = pdl_allowed();
  p.early = p.dependent && early;
  return p;
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

// kernel<<<grid, block, shared, stream>>>(args...), as a programmatic dependent launch when
// pdl.dependent (and the kernel's code has the waits: has_pdl_code). pdl.early must be what the kernel
// does (its `early` argument): the block emulator plays the launches by it and checks the blocks.
template <typename... Params, typename... Args>
cudaError_t launch_kernel(Pdl pdl, void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t shared,
                          cudaStream_t stream, Args... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared;
  config.stream = stream;
  cudaLaunchAttribute attribute[2];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = pdl.dependent && has_pdl_code(reinterpret_cast<const void*>(kernel)) ? 1 : 0;
#ifdef MOESPEC_EMULATED  // (the emulator's own attribute: its blocks release the next launch early)
  if (pdl.early) attribute[config.numAttrs++] = ::emu::early_release_attribute();
#endif
  return cudaLaunchKernelEx(&config, kernel, static_cast<Params>(args)...);
}

}  // namespace cuda
}  // namespace moespec
