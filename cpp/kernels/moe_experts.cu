// moe_experts on the GPU (moespec::cuda::moe_experts): the experts of an MoE layer over the
// routing contract, each active expert's weights streamed from device memory once.
//
// Implements the contract of cpp/include/moespec/moe_experts.h (DESIGN.md "Budgeted MoE layer")
// for CUDA tensors, at decode and verify sizes (T = 1..128 tokens, 1-16 tokens per expert).
// Reference: the CPU op (cpp/src/moe_experts.cc; plain torch: moespec.ops.reference.
// moe_experts_reference). Tests: tests/gpu/test_moe_experts_cuda.py, run by tests/gpu/run.sh.
//
// One fixed launch sequence on the caller's stream, no host synchronisation and no allocation (the
// scratch lives in the caller's workspace, moe_experts_workspace_size), so that routing + budget +
// experts can be captured in one CUDA graph:
//   1. group_kernel    one block: per expert the slots (t, k) that use it (id != E, weight != 0),
//                      in slot order: counts, their exclusive scan `offsets` [E + 1], the grouped
//                      slot list `order` [S] and each slot's position `pos` [T K] (-1: unused).
//                      Ids outside [0, E] count in the workspace's error counter and are dropped.
//   2. up_kernel       grid (E, I / 32): each warp owns 4 rows of gate and up of one expert; every
//                      row is read once (16-byte loads) and dotted with the x rows of all of the
//                      expert's slots (8 at a time; more re-read the row); h = act(g, u) rounded to
//                      the weights' dtype (as the CPU rounds h to bf16), row `pos` of h [S, I].
//                      Blocks of experts no slot uses return at once: those weights are never read.
//   3. down_kernel     grid (E, H / 32): the same over down [H, I] and h: y [S, H] in fp32 (+ the
//                      down bias for GptOss).
//   4. combine_kernel  one block per token: out[t] = sum of weights[t, k] y[pos(t, k)] over its used
//                      slots in ascending id order (repeats in slot order), in fp32, rounded once:
//                      no atomics, so the result is deterministic.
// Sums within a dot product run in the warp's order, not the CPU's: results agree with the CPU op
// within the tolerances of its SIMD paths (moe_experts.h, "Precision"), not bitwise.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "moespec/error.h"
#include "moespec/moe_experts.h"

namespace moespec {
namespace cuda {
namespace {

// T tokens, K slots per token, E experts, H hidden, I intermediate, S used slots (<= T K).
constexpr int kWarp = 32;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kWarps = 8;                        // warps per block of the product kernels
constexpr int kRowsPerWarp = 4;                  // weight rows a warp owns
constexpr int kRowsPerBlock = kWarps * kRowsPerWarp;
constexpr int kTok = 8;                          // slots a warp carries per pass over its rows
constexpr int kGroupThreads = 1024;
constexpr int kCombineThreads = 256;
constexpr int kMaxSlots = static_cast<int>(kMaxMoeSlots);  // K of one token (combine's sort in shared memory)
constexpr std::size_t kAlign = 256;

std::size_t align_up(std::size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

struct Workspace {
  int32_t* offsets;  // [E + 1]
  int32_t* order;    // [T K]
  int32_t* pos;      // [T K]
  int32_t* errors;   // [1]
  void* h;           // [T K, I] in the weights' dtype
  float* y;          // [T K, H]
};

Workspace carve(void* base, int64_t T, int64_t K, int64_t E, int64_t I, std::size_t elem) {  // (y last: [T K, H])
  char* p = static_cast<char*>(base);
  Workspace w{};
  const std::size_t slots = static_cast<std::size_t>(T * K);
  w.offsets = reinterpret_cast<int32_t*>(p);
  p += align_up(sizeof(int32_t) * static_cast<std::size_t>(E + 1));
  w.order = reinterpret_cast<int32_t*>(p);
  p += align_up(sizeof(int32_t) * slots);
  w.pos = reinterpret_cast<int32_t*>(p);
  p += align_up(sizeof(int32_t) * slots);
  w.errors = reinterpret_cast<int32_t*>(p);
  p += align_up(sizeof(int32_t));
  w.h = p;
  p += align_up(elem * slots * static_cast<std::size_t>(I));
  w.y = reinterpret_cast<float*>(p);
  return w;
}

// ---- element access ---------------------------------------------------------------------------

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename W>
__device__ __forceinline__ W from_f(float v);
template <>
__device__ __forceinline__ float from_f<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// 16 bytes of W as floats.
template <typename W>
struct Pack;
template <>
struct Pack<float> {
  static constexpr int kN = 4;
  __device__ __forceinline__ static void load(const float* p, float (&f)[kN]) {
    const float4 v = __ldg(reinterpret_cast<const float4*>(p));
    f[0] = v.x, f[1] = v.y, f[2] = v.z, f[3] = v.w;
  }
};
template <>
struct Pack<__nv_bfloat16> {
  static constexpr int kN = 8;
  __device__ __forceinline__ static void load(const __nv_bfloat16* p, float (&f)[kN]) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 x = __bfloat1622float2(h[i]);
      f[2 * i] = x.x, f[2 * i + 1] = x.y;
    }
  }
};

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

// acc[m][j] += row_m . act_j over n elements, for `rows` weight rows (row m at w + m * ldw) and
// `tok` activation rows (act_j at act + idx[j] * lda); each lane sums its own elements (16-byte
// packs when kVec, else lane-strided scalars); the caller reduces over the warp.
template <typename W, int kRows, bool kVec>
__device__ __forceinline__ void dot_rows(const W* __restrict__ w, int64_t ldw, int rows, const W* __restrict__ act,
                                         int64_t lda, const int32_t* idx, int tok, int64_t n,
                                         float (&acc)[kRows][kTok], int lane) {
  if constexpr (kVec) {
    constexpr int kN = Pack<W>::kN;
    for (int64_t e = static_cast<int64_t>(lane) * kN; e < n; e += static_cast<int64_t>(kWarp) * kN) {
      float wv[kRows][kN];
#pragma unroll
      for (int m = 0; m < kRows; ++m)
        if (m < rows) Pack<W>::load(w + m * ldw + e, wv[m]);
#pragma unroll
      for (int j = 0; j < kTok; ++j) {
        if (j >= tok) break;
        float av[kN];
        Pack<W>::load(act + idx[j] * lda + e, av);
#pragma unroll
        for (int m = 0; m < kRows; ++m) {
          if (m >= rows) break;
          float s = acc[m][j];
#pragma unroll
          for (int q = 0; q < kN; ++q) s += wv[m][q] * av[q];
          acc[m][j] = s;
        }
      }
    }
  } else {
    for (int64_t e = lane; e < n; e += kWarp) {
      float wv[kRows];
#pragma unroll
      for (int m = 0; m < kRows; ++m) wv[m] = m < rows ? to_f(w[m * ldw + e]) : 0.0f;
#pragma unroll
      for (int j = 0; j < kTok; ++j) {
        if (j >= tok) break;
        const float a = to_f(act[idx[j] * lda + e]);
#pragma unroll
        for (int m = 0; m < kRows; ++m) acc[m][j] += wv[m] * a;
      }
    }
  }
}

// ---- 1. grouping --------------------------------------------------------------------------------

__global__ void group_kernel(const int32_t* __restrict__ ids, const float* __restrict__ weights, int64_t slots,
                             int32_t E, int32_t* __restrict__ offsets, int32_t* __restrict__ order,
                             int32_t* __restrict__ pos, int32_t* __restrict__ errors) {
  extern __shared__ int32_t counts[];  // [E + 1]
  for (int64_t s = threadIdx.x; s < slots; s += blockDim.x) pos[s] = -1;
  if (threadIdx.x == 0) errors[0] = 0;
  __syncthreads();
  for (int32_t e = threadIdx.x; e < E; e += blockDim.x) {
    int32_t c = 0;
    for (int64_t s = 0; s < slots; ++s) c += ids[s] == e && weights[s] != 0.0f;
    counts[e] = c;
  }
  if (threadIdx.x == 0) {
    int32_t bad = 0;
    for (int64_t s = 0; s < slots; ++s) bad += ids[s] < 0 || ids[s] > E;
    errors[0] = bad;
  }
  __syncthreads();
  if (threadIdx.x == 0) {  // E <= kMaxMoeExperts: a sequential scan costs microseconds
    int32_t run = 0;
    for (int32_t e = 0; e < E; ++e) {
      const int32_t c = counts[e];
      counts[e] = run;
      offsets[e] = run;
      run += c;
    }
    offsets[E] = run;
  }
  __syncthreads();
  for (int32_t e = threadIdx.x; e < E; e += blockDim.x) {
    int32_t at = counts[e];
    for (int64_t s = 0; s < slots; ++s)
      if (ids[s] == e && weights[s] != 0.0f) {
        order[at] = static_cast<int32_t>(s);
        pos[s] = at++;
      }
  }
}

// ---- 2. gate/up and the activation ---------------------------------------------------------------

struct ActParams {
  int activation;  // 0 SwiGLU, 1 GptOss
  float limit, alpha;
};

template <typename W, bool kVec>
__global__ void __launch_bounds__(kWarps * kWarp)
    up_kernel(const W* __restrict__ x, int64_t ldx, int64_t K, const W* __restrict__ experts,
              const float* __restrict__ biases, const int32_t* __restrict__ offsets, const int32_t* __restrict__ order,
              W* __restrict__ h, int64_t H, int64_t I, ActParams p) {
  const int e = blockIdx.x;
  const int32_t first = offsets[e], count = offsets[e + 1] - first;
  if (count == 0) return;  // an expert no slot uses is never read
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kRowsPerBlock + warp * kRowsPerWarp;
  if (r0 >= I) return;
  const int rows = static_cast<int>(I - r0 < kRowsPerWarp ? I - r0 : kRowsPerWarp);
  const W* gate = experts + static_cast<int64_t>(e) * 3 * I * H + r0 * H;
  const W* up = gate + I * H;
  const float* bias = biases ? biases + static_cast<int64_t>(e) * (2 * I + H) : nullptr;
  for (int32_t j0 = 0; j0 < count; j0 += kTok) {
    const int tok = count - j0 < kTok ? count - j0 : kTok;
    int32_t idx[kTok];  // x row of each slot
#pragma unroll
    for (int j = 0; j < kTok; ++j) idx[j] = j < tok ? order[first + j0 + j] / static_cast<int32_t>(K) : 0;
    float g[kRowsPerWarp][kTok] = {}, u[kRowsPerWarp][kTok] = {};
    dot_rows<W, kRowsPerWarp, kVec>(gate, H, rows, x, ldx, idx, tok, H, g, lane);
    dot_rows<W, kRowsPerWarp, kVec>(up, H, rows, x, ldx, idx, tok, H, u, lane);
#pragma unroll
    for (int m = 0; m < kRowsPerWarp; ++m)
#pragma unroll
      for (int j = 0; j < kTok; ++j) {
        const float gs = warp_sum(g[m][j]), us = warp_sum(u[m][j]);
        if (lane == 0 && m < rows && j < tok) {
          float a;
          if (p.activation == 0) {
            a = gs / (1.0f + expf(-gs)) * us;
          } else {
            float gg = gs + (bias ? bias[r0 + m] : 0.0f);
            float uu = us + (bias ? bias[I + r0 + m] : 0.0f);
            gg = fminf(gg, p.limit);
            uu = fminf(fmaxf(uu, -p.limit), p.limit);
            a = (uu + 1.0f) * gg / (1.0f + expf(-p.alpha * gg));
          }
          h[static_cast<int64_t>(first + j0 + j) * I + r0 + m] = from_f<W>(a);
        }
      }
  }
}

// ---- 3. down ----------------------------------------------------------------------------------------

template <typename W, bool kVec>
__global__ void __launch_bounds__(kWarps * kWarp)
    down_kernel(const W* __restrict__ experts, const float* __restrict__ biases, const int32_t* __restrict__ offsets,
                const W* __restrict__ h, float* __restrict__ y, int64_t H, int64_t I) {
  const int e = blockIdx.x;
  const int32_t first = offsets[e], count = offsets[e + 1] - first;
  if (count == 0) return;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kRowsPerBlock + warp * kRowsPerWarp;
  if (r0 >= H) return;
  const int rows = static_cast<int>(H - r0 < kRowsPerWarp ? H - r0 : kRowsPerWarp);
  const W* down = experts + static_cast<int64_t>(e) * 3 * I * H + 2 * I * H + r0 * I;
  const float* bias = biases ? biases + static_cast<int64_t>(e) * (2 * I + H) + 2 * I : nullptr;
  for (int32_t j0 = 0; j0 < count; j0 += kTok) {
    const int tok = count - j0 < kTok ? count - j0 : kTok;
    int32_t idx[kTok];  // h row of each slot: its position
#pragma unroll
    for (int j = 0; j < kTok; ++j) idx[j] = first + j0 + (j < tok ? j : 0);
    float d[kRowsPerWarp][kTok] = {};
    dot_rows<W, kRowsPerWarp, kVec>(down, I, rows, h, I, idx, tok, I, d, lane);
#pragma unroll
    for (int m = 0; m < kRowsPerWarp; ++m)
#pragma unroll
      for (int j = 0; j < kTok; ++j) {
        const float s = warp_sum(d[m][j]);
        if (lane == 0 && m < rows && j < tok)
          y[static_cast<int64_t>(first + j0 + j) * H + r0 + m] = s + (bias ? bias[r0 + m] : 0.0f);
      }
  }
}

// ---- 4. combine ---------------------------------------------------------------------------------------

template <typename W>
__global__ void combine_kernel(const int32_t* __restrict__ ids, const float* __restrict__ weights,
                               const int32_t* __restrict__ pos, const float* __restrict__ y, W* __restrict__ out,
                               int64_t K, int64_t H) {
  __shared__ int32_t slot[kMaxSlots];  // the token's used slots, by (id, k)
  __shared__ int32_t used;
  const int64_t t = blockIdx.x;
  if (threadIdx.x == 0) {
    int32_t n = 0;
    for (int64_t k = 0; k < K; ++k) {
      if (pos[t * K + k] < 0) continue;
      int32_t at = n++;  // insertion by id (stable: a repeat stays after the earlier slot)
      while (at > 0 && ids[t * K + slot[at - 1]] > ids[t * K + k]) {
        slot[at] = slot[at - 1];
        --at;
      }
      slot[at] = static_cast<int32_t>(k);
    }
    used = n;
  }
  __syncthreads();
  for (int64_t c = threadIdx.x; c < H; c += blockDim.x) {
    float acc = 0.0f;
    for (int32_t i = 0; i < used; ++i) {
      const int64_t s = t * K + slot[i];
      acc += weights[s] * y[static_cast<int64_t>(pos[s]) * H + c];
    }
    out[t * H + c] = from_f<W>(acc);
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <typename W>
void launch(const MoeExpertsArgs& a, const Workspace& w, cudaStream_t stream) {
  const int64_t T = a.x.shape[0], H = a.x.shape[1], K = a.ids.shape[1], E = a.experts.shape[0];
  const int64_t I = a.intermediate_size;
  const int64_t ldx = a.x.strides[0];
  const W* x = a.x.ptr<const W>();
  const W* experts = a.experts.ptr<const W>();
  const float* biases = a.biases.defined() ? a.biases.ptr<const float>() : nullptr;
  W* h = static_cast<W*>(w.h);
  const int32_t* ids = a.ids.ptr<const int32_t>();
  const float* weights = a.weights.ptr<const float>();
  constexpr int kN = Pack<W>::kN;
  const bool vec = H % kN == 0 && I % kN == 0 && (T <= 1 || ldx % kN == 0) && aligned16(x) && aligned16(experts) &&
                   aligned16(h);
  group_kernel<<<1, kGroupThreads, sizeof(int32_t) * static_cast<std::size_t>(E + 1), stream>>>(
      ids, weights, T * K, static_cast<int32_t>(E), w.offsets, w.order, w.pos, w.errors);
  const ActParams p{static_cast<int>(a.activation), a.limit, a.alpha};
  const dim3 up_grid(static_cast<unsigned>(E), static_cast<unsigned>((I + kRowsPerBlock - 1) / kRowsPerBlock));
  const dim3 down_grid(static_cast<unsigned>(E), static_cast<unsigned>((H + kRowsPerBlock - 1) / kRowsPerBlock));
  if (vec) {
    up_kernel<W, true><<<up_grid, kWarps * kWarp, 0, stream>>>(x, ldx, K, experts, biases, w.offsets, w.order, h, H,
                                                                 I, p);
    down_kernel<W, true><<<down_grid, kWarps * kWarp, 0, stream>>>(experts, biases, w.offsets, h, w.y, H, I);
  } else {
    up_kernel<W, false><<<up_grid, kWarps * kWarp, 0, stream>>>(x, ldx, K, experts, biases, w.offsets, w.order, h,
                                                                  H, I, p);
    down_kernel<W, false><<<down_grid, kWarps * kWarp, 0, stream>>>(experts, biases, w.offsets, h, w.y, H, I);
  }
  combine_kernel<W><<<static_cast<unsigned>(T), kCombineThreads, 0, stream>>>(ids, weights, w.pos, w.y,
                                                                              a.out.ptr<W>(), K, H);
}

}  // namespace

std::size_t moe_experts_workspace_size(int64_t T, int64_t K, int64_t E, int64_t H, int64_t I, DType dtype) {
  if (T < 0 || K < 0 || E < 1 || H < 1 || I < 1) return 0;
  const std::size_t slots = static_cast<std::size_t>(T * K);
  return align_up(sizeof(int32_t) * static_cast<std::size_t>(E + 1)) + 2 * align_up(sizeof(int32_t) * slots) +
         align_up(sizeof(int32_t)) + align_up(dtype_size(dtype) * slots * static_cast<std::size_t>(I)) +
         align_up(sizeof(float) * slots * static_cast<std::size_t>(H));
}

void moe_experts(const MoeExpertsArgs& a, void* workspace, std::size_t workspace_bytes, void* stream) {
  validate_moe_experts(a);
  MOESPEC_CHECK_ARG(a.x.device == Device::kCUDA, "x", "moespec::cuda::moe_experts needs CUDA tensors, got ",
                    a.x.describe());
  const int64_t T = a.x.shape[0], H = a.x.shape[1], K = a.ids.shape[1], E = a.experts.shape[0];
  const int64_t I = a.intermediate_size;
  MOESPEC_CHECK_ARG(E <= kMaxMoeExperts, "experts", "the CUDA kernel groups at most ", kMaxMoeExperts,
                    " experts, got ", E);
  MOESPEC_CHECK_ARG(K <= kMaxSlots, "ids", "the CUDA kernel takes at most ", kMaxSlots, " slots per token, got ", K);
  const std::size_t need = moe_experts_workspace_size(T, K, E, H, I, a.x.dtype);
  MOESPEC_CHECK_ARG(workspace != nullptr && workspace_bytes >= need && aligned16(workspace), "workspace",
                    "needs ", need, " bytes (moe_experts_workspace_size), 16-byte aligned, got ", workspace_bytes);
  if (T == 0) return;
  const Workspace w = carve(workspace, T, K, E, I, dtype_size(a.x.dtype));
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (a.x.dtype == DType::kBFloat16)
    launch<__nv_bfloat16>(a, w, s);
  else
    launch<float>(a, w, s);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw_runtime("moespec::cuda::moe_experts: launch failed: ", cudaGetErrorString(err));
}

}  // namespace cuda
}  // namespace moespec
