// linear on the GPU (moespec::cuda::linear): a dense projection at decode and verify sizes,
// out = x W^T (+ bias), each weight row streamed from device memory once per 64 tokens.
//
// Implements the contract of cpp/include/moespec/linear.h for CUDA tensors (bf16, K a multiple of
// 32, 16-byte aligned rows: every projection of a real model). Plain-torch reference:
// torch.nn.functional.linear; tests: tests/gpu/test_linear_cuda.py, timing:
// tests/gpu/bench_linear_cuda.py (both run by tests/gpu/run.sh).
//
// Why not torch's GEMM: at 1-64 tokens a projection is a stream of its weights, and cuBLAS reads them
// at ~70% of the device copy rate on an H200 (tests/gpu/profiles/h200.json), while the MoE kernel's
// tensor-core blocks (moe_mma.cuh) reach 85-97% on large matrices; and a torch GEMM cannot be a
// programmatic dependent launch, so every projection broke the chain of moespec's kernels in a layer
// (norm -> q/k/v -> attention inputs ..., norm -> router -> routing -> experts -> norm).
//
// One launch: grid ceil(N / 16) blocks, each owning 16 weight rows (a last tile of fewer reads its
// last row again and stores only its own), kWarpsK warps splitting the reduction dimension in 32-wide
// chunks against all T tokens (kTiles n-tiles of 8 a pass, passes beyond 64 tokens), the warps'
// partial sums added in warp order: per element one fixed order of operations that does not depend
// on the other tokens (batch-invariant) or on the launch (deterministic). Before it waits for the
// previous kernel (griddepcontrol.wait), a block prefetches its weight rows into L2, all of them where
// the grid's rows come to at most kPrefetchTotal (the router, a small o projection: they then stream
// from L2 once the wait returns) and else their first kPrefetchTotal / blocks bytes, at least
// kPrefetchBytes (L2 holds 50 MB on an H200): the weights are constant, so a projection's bytes stream
// while the kernels before it (the norm, the attention and its combine) run: the kernels between two
// projections release their dependents early (device_common.cuh), so a projection's blocks start as
// soon as the kernel before it has started, not once that one's own primary is done.
//
// Dimensions: T tokens, K input features, N output features.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "device_common.cuh"
#include "moe_mma.cuh"
#include "moespec/error.h"
#include "moespec/linear.h"

namespace moespec {
namespace cuda {
namespace {

using namespace device;  // kWarp, the tensor-core blocks (moe_mma.cuh), launch_kernel

constexpr int64_t kPrefetchBytes = 32 << 10;  // of a block's weight rows, before its wait: at least
constexpr int64_t kPrefetchTotal = 16 << 20;  // and the grid's share of this much (or all its rows)
constexpr int64_t kWideBelowBlocks = 512;     // grids of fewer blocks take 8 warps a block (bytes in flight)

struct LinearParams {
  const __nv_bfloat16* x;
  int64_t ldx, T, N, K;
  const __nv_bfloat16* weight;
  const void* bias;  // [N] bf16 or fp32, or null
  bool bias_fp32;
  __nv_bfloat16* out;  // [T, N]
  bool early;          // release the next kernel at the start (device_common.cuh)
};

template <int kTiles, int kWarpsK>
__global__ void __launch_bounds__(kWarpsK * kWarp) linear_kernel(LinearParams p) {
  __shared__ float red[(kWarpsK - 1) * kTiles * 4 * kWarp];
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * 16;
  const int nrows = p.N - r0 < 16 ? static_cast<int>(p.N - r0) : 16;
  release_early(p.early);  // (launched as a programmatic dependent: device_common.cuh)
  const __nv_bfloat16* const w[1] = {p.weight + r0 * p.K};
  const char* bytes = reinterpret_cast<const char*>(w[0]);
  const int64_t share = kPrefetchTotal / gridDim.x > kPrefetchBytes ? kPrefetchTotal / gridDim.x : kPrefetchBytes;
  const int64_t mine = 2 * nrows * p.K, ahead = mine < share ? mine : share;
  for (int64_t b = static_cast<int64_t>(threadIdx.x) * 128; b < ahead; b += static_cast<int64_t>(blockDim.x) * 128)
    prefetch_l2(bytes + b);
  wait_then_release(p.early);  // x is the previous kernel's output; out may still be read by it
  const auto row_of = [=](int32_t at) { return p.x + static_cast<int64_t>(at) * p.ldx; };
  const auto store = [=](int32_t at, int r, const float (&acc)[1][kTiles][4], int j, int i) {
    const int64_t n = r0 + r;
    float v = acc[0][j][i];
    if (p.bias != nullptr)
      v += p.bias_fp32 ? static_cast<const float*>(p.bias)[n]
                       : __bfloat162float(static_cast<const __nv_bfloat16*>(p.bias)[n]);
    p.out[static_cast<int64_t>(at) * p.N + n] = __float2bfloat16_rn(v);
  };
  expert_passes<1, kTiles, kWarpsK>(w, p.K, static_cast<int32_t>(p.T), red, row_of, store, nrows);
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// One launch of blocks of kWarpsK warps, its n-tiles by T.
template <int kWarpsK>
cudaError_t launch(const LinearParams& p, unsigned blocks, Pdl pdl, cudaStream_t stream) {
  cudaError_t err = cudaSuccess;
  with_tiles(p.T, [&](auto tiles) {
    err = launch_kernel(pdl, linear_kernel<decltype(tiles)::value, kWarpsK>, dim3(blocks), dim3(kWarpsK * kWarp), 0,
                        stream, p);
  });
  return err;
}

}  // namespace

void linear(const LinearArgs& a, void* stream) {
  validate_linear(a);
  MOESPEC_CHECK_ARG(a.x.device == Device::kCUDA, "x", "moespec::cuda::linear needs CUDA tensors, got ",
                    a.x.describe());
  MOESPEC_CHECK_ARG(a.x.dtype == DType::kBFloat16, "x", "the CUDA kernel takes bfloat16 (torch's GEMM the rest), got ",
                    a.x.describe());
  const int64_t T = a.x.shape[0], K = a.x.shape[1], N = a.weight.shape[0];
  const int64_t ldx = T > 1 ? a.x.strides[0] : K;
  MOESPEC_CHECK_ARG(K % kChunk == 0, "x", "the CUDA kernel needs K (dim 1) a multiple of ", kChunk, ", got ",
                    a.x.describe());
  MOESPEC_CHECK_ARG(aligned16(a.x.data) && ldx % 8 == 0, "x", "the CUDA kernel needs 16-byte aligned rows, got ",
                    a.x.describe(), " with row stride ", ldx);
  MOESPEC_CHECK_ARG(aligned16(a.weight.data), "weight", "the CUDA kernel needs a 16-byte aligned weight, got ",
                    a.weight.describe());
  DeviceGuard guard(a.x.device_index);  // (after the argument checks: they need no device)
  MOESPEC_CHECK_ARG(device_major() >= 8, "x", "the CUDA kernel needs sm_80 or newer (bf16 tensor cores)");
  if (T == 0) return;
  MOESPEC_CHECK_ARG(T <= INT32_MAX, "x", "too many tokens: ", T);
  const Pdl pdl = pdl_launch();
  const LinearParams p{a.x.ptr<const __nv_bfloat16>(), ldx, T, N, K, a.weight.ptr<const __nv_bfloat16>(),
                       a.bias.defined() ? a.bias.data : nullptr, a.bias.defined() && a.bias.dtype == DType::kFloat32,
                       a.out.ptr<__nv_bfloat16>(), pdl.early};
  const int64_t blocks = (N + 15) / 16;
  MOESPEC_CHECK_ARG(blocks <= INT32_MAX, "weight", "too many output features: ", N);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const unsigned grid = static_cast<unsigned>(blocks);
  const cudaError_t err =
      blocks < kWideBelowBlocks ? launch<8>(p, grid, pdl, s) : launch<4>(p, grid, pdl, s);
  if (err != cudaSuccess) throw_runtime("moespec::cuda::linear: launch failed: ", cudaGetErrorString(err));
}

}  // namespace cuda
}  // namespace moespec
