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
//                      in slot order (one warp ranks 32 slots at a time with __match_any_sync):
//                      counts, their exclusive scan `offsets` [E + 1], the grouped slot list
//                      `order` [S], each slot's position `pos` [T K] (-1: unused) and the list of
//                      used experts in id order `used` [1 + E] (used[0]: how many). Ids outside
//                      [0, E] count in the workspace's error counter and are dropped.
//   2. gate/up         h = act(gate x, up x) rounded to the weights' dtype (as the CPU rounds h to
//                      bf16), row `pos` of h [S, I];
//   3. down            y [S, H] = h down^T in fp32 (+ the down bias for GptOss);
//   4. combine_kernel  one block per token: out[t] = sum of weights[t, k] y[pos(t, k)] over its used
//                      slots in ascending id order (repeats in slot order), in fp32, rounded once:
//                      no atomics, so the result is deterministic.
// Steps 2 and 3 have two implementations, chosen once per call at the dispatch point (`launch`):
//   - bf16 on sm_80+ with H, I multiples of 32 and 16-byte aligned rows (every real MoE): tensor
//     cores. A block owns 16 weight rows of one used expert (grid: row tiles x used experts; blocks
//     past used[0] return at once, so unused experts are never read) and its 4 warps split the
//     reduction dimension in 32-wide chunks; each thread streams 16 bytes of 2 rows per chunk and
//     feeds them to mma.sync m16n8k16 with the expert's tokens (8 per n-tile, up to kMaxTiles
//     tiles per pass over the weights) as the other operand, permuting k identically in both
//     operands (a dot product does not depend on the order of its terms' positions, only on the
//     order of its sums: fixed here). The 4 warps' partial tiles are summed in warp order through
//     shared memory: deterministic.
//   - otherwise (fp32, odd sizes): plain FMA kernels, grid (E, rows / 32); each warp owns 4 rows,
//     dots them with 8 of the expert's slots per pass (16-byte loads where aligned).
// At decode and verify sizes on the tensor-core path (T K <= kFusedSlots) the four launches become
// two, "the fused pair" (below: grouping inside every block, the combine inside the down kernel,
// programmatic dependent launch between them on sm_90), with the same bits; MOESPEC_MOE_FUSED=0 keeps
// the four launches. round_weights rounds each weight to bf16 where it is read (grouping, combine).
// Sums within a dot product run in the hardware's order, not the CPU's: results agree with the CPU
// op within the tolerances of its SIMD paths (moe_experts.h, "Precision"), not bitwise.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>

#include "device_common.cuh"
#include "moe_mma.cuh"
#include "moespec/error.h"
#include "moespec/moe_experts.h"

namespace moespec {
namespace cuda {
namespace {

using namespace device;  // kWarp, kFullMask, to_f, from_f, warp_sum; the tensor-core blocks (moe_mma.cuh)

// T tokens, K slots per token, E experts, H hidden, I intermediate, S used slots (<= T K).
constexpr int kWarps = 8;                        // warps per block of the product kernels
constexpr int kRowsPerWarp = 4;                  // weight rows a warp owns
constexpr int kRowsPerBlock = kWarps * kRowsPerWarp;
constexpr int kTok = 8;                          // slots a warp carries per pass over its rows
constexpr int kCombineThreads = 256;  // >= kMaxSlots
constexpr int kMaxSlots = static_cast<int>(kMaxMoeSlots);  // K of one token (combine's sort in shared memory)
static_assert(kCombineThreads >= kMaxSlots, "combine_kernel ranks one slot a thread");
constexpr std::size_t kAlign = 256;

std::size_t align_up(std::size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

struct Workspace {
  int32_t* offsets;  // [E + 1]
  int32_t* used;     // [1 + E]: how many experts have a slot, then their ids ascending
  int32_t* order;    // [T K]
  int32_t* pos;      // [T K]
  int32_t* errors;   // [1]
  int32_t* tiles;    // [H / 16]: the fused down kernel's finished blocks per row tile
  void* h;           // [T K, I] in the weights' dtype
  float* y;          // [T K, H]
};

// Lays the workspace out from `base` (each part 256-byte aligned) into *w when given; returns its
// bytes (moe_experts_workspace_size: base null).
std::size_t carve(void* base, int64_t T, int64_t K, int64_t E, int64_t H, int64_t I, std::size_t elem,
                  Workspace* w) {
  char* p = static_cast<char*>(base);
  std::size_t at = 0;
  const auto take = [&](std::size_t bytes) {
    void* part = p ? p + at : nullptr;
    at += align_up(bytes);
    return part;
  };
  const std::size_t slots = static_cast<std::size_t>(T * K), experts = static_cast<std::size_t>(E + 1);
  Workspace v{};
  v.offsets = static_cast<int32_t*>(take(sizeof(int32_t) * experts));
  v.used = static_cast<int32_t*>(take(sizeof(int32_t) * experts));
  v.order = static_cast<int32_t*>(take(sizeof(int32_t) * slots));
  v.pos = static_cast<int32_t*>(take(sizeof(int32_t) * slots));
  v.errors = static_cast<int32_t*>(take(sizeof(int32_t)));
  v.tiles = static_cast<int32_t*>(take(sizeof(int32_t) * static_cast<std::size_t>(H / 16 + 1)));
  v.h = take(elem * slots * static_cast<std::size_t>(I));
  v.y = static_cast<float*>(take(sizeof(float) * slots * static_cast<std::size_t>(H)));
  if (w) *w = v;
  return at;
}

// ---- element access ---------------------------------------------------------------------------

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

// The weight of slot s as the experts use it (round_weights: rounded to bf16 first). Read through L2
// (ld.global.cg, not the non-coherent path a const __restrict__ pointer may get): the routing kernel
// writes the weights while a programmatic dependent may already be resident.
__device__ __forceinline__ float slot_weight(const float* __restrict__ weights, int64_t s, bool round) {
  const float w = __ldcg(weights + s);
  return round ? __bfloat162float(__float2bfloat16_rn(w)) : w;
}

// ---- 1. grouping --------------------------------------------------------------------------------

// Inclusive sum over the warp.
__device__ __forceinline__ int32_t warp_scan(int32_t v, int lane) {
#pragma unroll
  for (int o = 1; o < kWarp; o *= 2) {
    const int32_t n = __shfl_up_sync(kFullMask, v, o);
    if (lane >= o) v += n;
  }
  return v;
}

// blockDim.x = E rounded up to whole warps (<= 1024 = kMaxMoeExperts): one thread per expert.
__global__ void group_kernel(const int32_t* __restrict__ ids, const float* __restrict__ weights, bool round,
                             int64_t slots, int32_t E, int32_t* __restrict__ offsets, int32_t* __restrict__ order,
                             int32_t* __restrict__ pos, int32_t* __restrict__ used, int32_t* __restrict__ errors) {
  __shared__ int32_t counts[kMaxMoeExperts];  // per expert: its slots so far, then its offset
  __shared__ int32_t warp_slots[kWarp], warp_used[kWarp];
  const int tid = threadIdx.x, lane = tid % kWarp, warp = tid / kWarp;
  if (tid < E) counts[tid] = 0;
  __syncthreads();
  if (warp == 0) {  // rank each slot among its expert's slots, 32 slots at a time, in slot order
    int32_t bad = 0;
    for (int64_t c = 0; c < slots; c += kWarp) {
      const int64_t s = c + lane;
      int32_t e = -1;  // -1: the slot is not used
      if (s < slots) {
        const int32_t id = ids[s];
        if (id < 0 || id > E) ++bad;
        else if (id < E && slot_weight(weights, s, round) != 0.0f) e = id;
      }
      const unsigned same = __match_any_sync(kFullMask, e);
      const int32_t rank = __popc(same & ((1u << lane) - 1u));
      const int32_t base = e >= 0 ? counts[e] : 0;
      __syncwarp();
      if (e >= 0 && rank == 0) counts[e] = base + __popc(same);
      __syncwarp();
      if (s < slots) pos[s] = e >= 0 ? base + rank : -1;  // the rank for now, the position below
    }
    for (int o = kWarp / 2; o > 0; o /= 2) bad += __shfl_xor_sync(kFullMask, bad, o);
    if (lane == 0) errors[0] = bad;
  }
  __syncthreads();
  // Exclusive scans over the experts of their slot counts (-> offsets) and of "has a slot" (-> used).
  const int32_t count = tid < E ? counts[tid] : 0, flag = count > 0;
  const int32_t in_slots = warp_scan(count, lane), in_used = warp_scan(flag, lane);
  if (lane == kWarp - 1) warp_slots[warp] = in_slots, warp_used[warp] = in_used;
  __syncthreads();
  if (warp == 0) {
    const int nwarps = static_cast<int>(blockDim.x) / kWarp;
    const int32_t a = lane < nwarps ? warp_slots[lane] : 0, u = lane < nwarps ? warp_used[lane] : 0;
    const int32_t sa = warp_scan(a, lane), su = warp_scan(u, lane);
    warp_slots[lane] = sa - a, warp_used[lane] = su - u;  // exclusive, per warp
  }
  __syncthreads();
  const int32_t before = warp_slots[warp] + in_slots - count, used_before = warp_used[warp] + in_used - flag;
  if (tid < E) {
    offsets[tid] = before;
    counts[tid] = before;
    if (flag) used[1 + used_before] = tid;
  }
  if (tid == E - 1) offsets[E] = before + count, used[0] = used_before + flag;
  __syncthreads();
  for (int64_t s = tid; s < slots; s += blockDim.x) {
    const int32_t rank = pos[s];
    if (rank < 0) continue;
    const int32_t at = counts[ids[s]] + rank;
    pos[s] = at;
    order[at] = static_cast<int32_t>(s);
  }
}

// ---- 2. gate/up and the activation ---------------------------------------------------------------

struct ActParams {
  int activation;  // 0 SwiGLU, 1 GptOss
  float limit, alpha;
};

// h of one row from its gate and up sums (GptOss: + the row's biases, clamped).
__device__ __forceinline__ float activate(float g, float u, const float* bias, int64_t I, int64_t row,
                                          const ActParams& p) {
  if (p.activation == 0) return g / (1.0f + expf(-g)) * u;
  g += bias ? bias[row] : 0.0f;
  u += bias ? bias[I + row] : 0.0f;
  g = fminf(g, p.limit);
  u = fminf(fmaxf(u, -p.limit), p.limit);
  return (u + 1.0f) * g / (1.0f + expf(-p.alpha * g));
}

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
        if (lane == 0 && m < rows && j < tok)
          h[static_cast<int64_t>(first + j0 + j) * I + r0 + m] = from_f<W>(activate(gs, us, bias, I, r0 + m, p));
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

// ---- 2 and 3 on tensor cores (bf16, sm_80+; the blocks of moe_mma.cuh) -----------------------------

// Gate and up rows [r0, r0 + 16) of expert e over its `count` slots: slot `at` (0 <= at < count)
// reads the x row x_row(at) and writes h row h_row(at) (h = act(gate x, up x), rounded to bf16).
template <int kTiles, typename XRow, typename HRow>
__device__ __forceinline__ void up_rows(const __nv_bfloat16* __restrict__ experts, const float* __restrict__ biases,
                                        int e, int32_t count, int64_t r0, int64_t H, int64_t I, const ActParams& p,
                                        float* red, XRow x_row, HRow h_row) {
  const __nv_bfloat16* gate = experts + static_cast<int64_t>(e) * 3 * I * H + r0 * H;
  const __nv_bfloat16* const w[2] = {gate, gate + I * H};
  const float* bias = biases ? biases + static_cast<int64_t>(e) * (2 * I + H) : nullptr;
  const auto store = [=](int32_t at, int r, const float (&acc)[2][kTiles][4], int j, int i) {
    const int64_t row = r0 + r;
    h_row(at)[row] = __float2bfloat16_rn(activate(acc[0][j][i], acc[1][j][i], bias, I, row, p));
  };
  expert_passes<2, kTiles>(w, H, count, red, x_row, store);
}

// Down rows [r0, r0 + 16) of expert e over its `count` slots: slot `at` reads h row h_row(at) and
// writes the fp32 y row y_row(at) (+ the down bias).
template <int kTiles, typename HRow, typename YRow>
__device__ __forceinline__ void down_rows(const __nv_bfloat16* __restrict__ experts, const float* __restrict__ biases,
                                          int e, int32_t count, int64_t r0, int64_t H, int64_t I, float* red,
                                          HRow h_row, YRow y_row) {
  const __nv_bfloat16* const w[1] = {experts + static_cast<int64_t>(e) * 3 * I * H + 2 * I * H + r0 * I};
  const float* bias = biases ? biases + static_cast<int64_t>(e) * (2 * I + H) + 2 * I : nullptr;
  const auto store = [=](int32_t at, int r, const float (&acc)[1][kTiles][4], int j, int i) {
    const int64_t row = r0 + r;
    y_row(at)[row] = acc[0][j][i] + (bias ? bias[row] : 0.0f);
  };
  expert_passes<1, kTiles>(w, I, count, red, h_row, store);
}

// grid (I / 16, used experts bound), block kSplit warps: gate and up rows [16 blockIdx.x, +16) of
// expert used[1 + blockIdx.y], over all of its slots (grouped by group_kernel).
template <int kTiles>
__global__ void __launch_bounds__(kSplit * kWarp)
    up_mma_kernel(const __nv_bfloat16* __restrict__ x, int64_t ldx, int64_t K,
                  const __nv_bfloat16* __restrict__ experts, const float* __restrict__ biases,
                  const int32_t* __restrict__ offsets, const int32_t* __restrict__ order,
                  const int32_t* __restrict__ used, __nv_bfloat16* __restrict__ h, int64_t H, int64_t I, ActParams p) {
  __shared__ float red[(kSplit - 1) * 2 * kTiles * 4 * kWarp];
  if (static_cast<int32_t>(blockIdx.y) >= used[0]) return;  // no such used expert: nothing is read
  const int e = used[1 + blockIdx.y];
  const int32_t first = offsets[e];
  up_rows<kTiles>(experts, biases, e, offsets[e + 1] - first, static_cast<int64_t>(blockIdx.x) * 16, H, I, p, red,
                  [=](int32_t at) { return x + static_cast<int64_t>(order[first + at] / K) * ldx; },
                  [=](int32_t at) { return h + static_cast<int64_t>(first + at) * I; });
}

// grid (H / 16, used experts bound), block kSplit warps: down rows [16 blockIdx.x, +16) of expert
// used[1 + blockIdx.y] against the h rows of its slots -> y.
template <int kTiles>
__global__ void __launch_bounds__(kSplit * kWarp)
    down_mma_kernel(const __nv_bfloat16* __restrict__ experts, const float* __restrict__ biases,
                    const int32_t* __restrict__ offsets, const int32_t* __restrict__ used,
                    const __nv_bfloat16* __restrict__ h, float* __restrict__ y, int64_t H, int64_t I) {
  __shared__ float red[(kSplit - 1) * kTiles * 4 * kWarp];
  if (static_cast<int32_t>(blockIdx.y) >= used[0]) return;
  const int e = used[1 + blockIdx.y];
  const int32_t first = offsets[e];
  down_rows<kTiles>(experts, biases, e, offsets[e + 1] - first, static_cast<int64_t>(blockIdx.x) * 16, H, I, red,
                    [=](int32_t at) { return h + static_cast<int64_t>(first + at) * I; },
                    [=](int32_t at) { return y + static_cast<int64_t>(first + at) * H; });
}

// ---- the fused pair: two launches instead of four (tensor cores, T K <= kFusedSlots) --------------
//
// Every block of both kernels finds its own expert, the blockIdx.y-th used one in id order, and
// that expert's slots in slot order from ids and weights (find_expert: a bitmap of the used experts
// and one ballot pass over the slots in shared memory), so there is no group kernel and no global
// scan; h and y rows are indexed by slot (t K + k). The down kernel is a programmatic dependent
// launch of the gate/up kernel (sm_90): its blocks find their expert and prefetch the start of their
// weight rows into L2 while gate/up finishes, then wait for it (griddepcontrol.wait). The combine
// runs in the down kernel: per row tile of 16 outputs, the block that finishes the tile last (a
// counter per tile, zeroed by the gate/up kernel) sums each token's used slots of those rows in
// (id, k) order in fp32, as combine_kernel does; the order of the sum never depends on which block
// is last, so the result is deterministic.

constexpr int kFusedSlots = 1024;            // the most T K slots a call on the fused pair has
constexpr int kBitWords = static_cast<int>(kMaxMoeExperts) / 32;
constexpr int64_t kPrefetchBytes = 32 << 10;  // of a down block's weight rows, before the wait
static_assert(kBitWords <= kWarp, "find_expert scans the bitmap with one warp");

struct BlockExpert {  // a fused block's grouping, in shared memory
  uint32_t bits[kBitWords];   // the used experts
  int32_t key[kFusedSlots];   // per slot: its expert when used, else -1
  int32_t list[kFusedSlots];  // this block's expert's slots, ascending (the combine reuses it)
  int32_t expert, count, used, bad;
};

// Block-wide: g.expert = the j-th used expert in id order (-1: fewer are used), g.used how many are,
// g.list[0, g.count) its slots ascending, g.key every slot's expert (-1: unused), g.bad the slots
// with ids outside [0, E].
__device__ void find_expert(const int32_t* __restrict__ ids, const float* __restrict__ weights, bool round,
                            int32_t slots, int32_t E, int32_t j, BlockExpert& g) {
  const int tid = threadIdx.x, lane = tid % kWarp;
  const int words = (E + 31) / 32;
  for (int i = tid; i < words; i += blockDim.x) g.bits[i] = 0u;
  if (tid == 0) g.bad = 0, g.expert = -1, g.count = 0;
  __syncthreads();
  for (int32_t s = tid; s < slots; s += blockDim.x) {
    const int32_t id = __ldcg(ids + s);  // (through L2: see slot_weight)
    int32_t key = -1;
    if (id < 0 || id > E) atomicAdd(&g.bad, 1);
    else if (id < E && slot_weight(weights, s, round) != 0.0f) key = id;
    g.key[s] = key;
    if (key >= 0) atomicOr(&g.bits[key / 32], 1u << (key % 32));
  }
  __syncthreads();
  if (tid < kWarp) {  // warp 0: which word holds the j-th set bit, then which bit
    const uint32_t word = lane < words ? g.bits[lane] : 0u;
    const int32_t c = __popc(word), incl = warp_scan(c, lane), excl = incl - c;
    if (lane == kWarp - 1) g.used = incl;
    if (j >= excl && j < incl) {
      uint32_t v = word;
      for (int32_t i = excl; i < j; ++i) v &= v - 1u;  // drop the lower set bits
      g.expert = lane * 32 + __ffs(static_cast<int>(v)) - 1;
    }
  }
  __syncthreads();
  if (g.expert < 0) return;  // (uniform over the block)
  if (tid < kWarp) {  // warp 0: the expert's slots in slot order, 32 at a time
    const int32_t e = g.expert;
    int32_t n = 0;
    for (int32_t c = 0; c < slots; c += kWarp) {
      const int32_t s = c + lane;
      const bool hit = s < slots && g.key[s] == e;
      const unsigned ballot = __ballot_sync(kFullMask, hit);
      if (hit) g.list[n + __popc(ballot & ((1u << lane) - 1u))] = s;
      n += __popc(ballot);
    }
    if (lane == 0) g.count = n;
  }
  __syncthreads();
}

struct FusedParams {
  const int32_t* ids;
  const float* weights;
  bool round;
  int32_t slots, K, E;  // T K, K, E
  int64_t T, H, I;
};

// grid (I / 16, used experts bound), block kSplit warps: gate and up rows [16 blockIdx.x, +16) of
// the blockIdx.y-th used expert -> h [T K, I] by slot. Block (0, 0) zeroes the down kernel's tile
// counters and writes the error word.
template <int kTiles>
__global__ void __launch_bounds__(kSplit * kWarp)
    up_fused_kernel(FusedParams f, const __nv_bfloat16* __restrict__ x, int64_t ldx,
                    const __nv_bfloat16* __restrict__ experts, const float* __restrict__ biases,
                    __nv_bfloat16* __restrict__ h, int32_t* __restrict__ tiles_done, int32_t* __restrict__ errors,
                    ActParams p) {
  __shared__ float red[(kSplit - 1) * 2 * kTiles * 4 * kWarp];
  __shared__ BlockExpert g;
  wait_for_primary();  // (a programmatic dependent of the routing kernel: nothing is read before)
  const bool first_block = blockIdx.x == 0 && blockIdx.y == 0;
  if (first_block)
    for (int64_t i = threadIdx.x; i < f.H / 16; i += blockDim.x) tiles_done[i] = 0;
  find_expert(f.ids, f.weights, f.round, f.slots, f.E, static_cast<int32_t>(blockIdx.y), g);
  if (first_block && threadIdx.x == 0) errors[0] = g.bad;
  launch_dependents();  // every block of this grid has started: the down blocks may take free SMs. Keep it
  // after this block's wait, never early (device_common.cuh): the down blocks read ids and weights before
  // their own wait, which is safe because none of them starts before every block here has waited for the
  // routing kernel's completion
  if (g.expert < 0) return;
  const int32_t* list = g.list;
  const int64_t K = f.K;
  up_rows<kTiles>(experts, biases, g.expert, g.count, static_cast<int64_t>(blockIdx.x) * 16, f.H, f.I, p, red,
                  [=](int32_t at) { return x + static_cast<int64_t>(list[at] / K) * ldx; },
                  [=](int32_t at) { return h + static_cast<int64_t>(list[at]) * f.I; });
}

// Rows [r0, r0 + 16) of out for every token: each token's used slots in (id, k) order, weighted,
// summed in fp32 (the last block of a row tile; y written by the tile's other blocks).
__device__ void combine_tile(const FusedParams& f, BlockExpert& g, const float* __restrict__ y,
                             __nv_bfloat16* __restrict__ out, int64_t r0) {
  int32_t* order = g.list;  // [T K]: per token its used slots by (id, k), then -1
  for (int32_t s = threadIdx.x; s < f.slots; s += blockDim.x) order[s] = -1;
  __syncthreads();
  for (int32_t s = threadIdx.x; s < f.slots; s += blockDim.x) {
    const int32_t key = g.key[s];
    if (key < 0) continue;
    const int32_t t = s / f.K, k = s % f.K;
    int32_t rank = 0;
    for (int32_t q = 0; q < f.K; ++q) {
      const int32_t other = g.key[t * f.K + q];
      rank += other >= 0 && (other < key || (other == key && q < k));
    }
    order[t * f.K + rank] = s;
  }
  __syncthreads();
  for (int64_t i = threadIdx.x; i < f.T * 16; i += blockDim.x) {
    const int64_t t = i / 16, col = r0 + i % 16;
    float acc = 0.0f;
    for (int32_t q = 0; q < f.K; ++q) {
      const int32_t s = order[t * f.K + q];
      if (s < 0) break;
      acc += slot_weight(f.weights, s, f.round) * __ldcg(y + static_cast<int64_t>(s) * f.H + col);
    }
    out[t * f.H + col] = __float2bfloat16_rn(acc);
  }
}

// grid (H / 16, used experts bound), block kSplit warps: down rows [16 blockIdx.x, +16) of the
// blockIdx.y-th used expert against the h rows of its slots -> y [T K, H] by slot; the tile's last
// block then combines the tile's rows of out.
template <int kTiles>
__global__ void __launch_bounds__(kSplit * kWarp)
    down_fused_kernel(FusedParams f, const __nv_bfloat16* __restrict__ experts, const float* __restrict__ biases,
                      const __nv_bfloat16* __restrict__ h, float* __restrict__ y, int32_t* __restrict__ tiles_done,
                      __nv_bfloat16* __restrict__ out, bool early) {
  __shared__ float red[(kSplit - 1) * kTiles * 4 * kWarp];
  __shared__ BlockExpert g;
  __shared__ bool last;
  release_early(early);  // (the next kernel, e.g. the norm, waits for this one's completion to read out)
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * 16;
  find_expert(f.ids, f.weights, f.round, f.slots, f.E, static_cast<int32_t>(blockIdx.y), g);
  if (g.expert < 0) {
    wait_for_primary();  // (no block exits before its primary is complete: device_common.cuh)
    if (blockIdx.y == 0)  // no slot is used at all: the tile's outputs are 0
      for (int64_t i = threadIdx.x; i < f.T * 16; i += blockDim.x)
        out[i / 16 * f.H + r0 + i % 16] = __float2bfloat16_rn(0.0f);
    return;
  }
  const char* rows = reinterpret_cast<const char*>(experts + static_cast<int64_t>(g.expert) * 3 * f.I * f.H +
                                                   2 * f.I * f.H + r0 * f.I);
  const int64_t ahead = 32 * f.I < kPrefetchBytes ? 32 * f.I : kPrefetchBytes;  // (16 rows of 2-byte elements)
  for (int64_t b = static_cast<int64_t>(threadIdx.x) * 128; b < ahead; b += static_cast<int64_t>(blockDim.x) * 128)
    prefetch_l2(rows + b);
  wait_then_release(early);  // h (and the zeroed counters) are complete from here on
  const int32_t* list = g.list;
  down_rows<kTiles>(experts, biases, g.expert, g.count, r0, f.H, f.I, red,
                    [=](int32_t at) { return h + static_cast<int64_t>(list[at]) * f.I; },
                    [=](int32_t at) { return y + static_cast<int64_t>(list[at]) * f.H; });
  __threadfence();  // this block's y rows, visible before its count
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(&tiles_done[blockIdx.x], 1) == g.used - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  combine_tile(f, g, y, out, r0);
}

// ---- 4. combine ---------------------------------------------------------------------------------------

// blockDim.x >= K (kCombineThreads >= kMaxSlots). Thread k ranks slot k among the token's used
// slots by (id, k) in one step (no serial chain of dependent loads), then the threads sum columns.
template <typename W>
__global__ void combine_kernel(const int32_t* __restrict__ ids, const float* __restrict__ weights, bool round,
                               const int32_t* __restrict__ pos, const float* __restrict__ y, W* __restrict__ out,
                               int64_t K, int64_t H) {
  __shared__ int32_t row[kMaxSlots];   // y row of the token's i-th used slot, by (id, k)
  __shared__ float weight[kMaxSlots];  // its weight
  __shared__ int32_t key[kMaxSlots];   // id of slot k, or -1 when unused
  __shared__ int32_t used;
  const int64_t t = blockIdx.x;
  const int k = threadIdx.x;
  if (k == 0) used = 0;
  if (k < K) key[k] = pos[t * K + k] >= 0 ? ids[t * K + k] : -1;
  __syncthreads();
  if (k < K && key[k] >= 0) {
    int32_t rank = 0;
    for (int j = 0; j < K; ++j) rank += key[j] >= 0 && (key[j] < key[k] || (key[j] == key[k] && j < k));
    row[rank] = pos[t * K + k];
    weight[rank] = slot_weight(weights, t * K + k, round);
    atomicAdd(&used, 1);
  }
  __syncthreads();
  const int32_t n = used;
  for (int64_t c = threadIdx.x; c < H; c += blockDim.x) {
    float acc = 0.0f;
    for (int32_t i = 0; i < n; ++i) acc += weight[i] * y[static_cast<int64_t>(row[i]) * H + c];
    out[t * H + c] = from_f<W>(acc);
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// MOESPEC_MOE_FUSED: unset or "1" the fused pair where it fits, "0" the four launches (to compare).
bool fused_allowed() { return env_switch("MOESPEC_MOE_FUSED"); }

void check_launch(cudaError_t err) {
  if (err != cudaSuccess) throw_runtime("moespec::cuda::moe_experts: launch failed: ", cudaGetErrorString(err));
}

template <int kTiles>
void launch_fused(const MoeExpertsArgs& a, const Workspace& w, unsigned used_bound, const ActParams& p, bool round,
                  Pdl pdl, cudaStream_t stream) {
  const int64_t T = a.x.shape[0], H = a.x.shape[1], K = a.ids.shape[1], I = a.intermediate_size;
  const FusedParams f{a.ids.ptr<const int32_t>(), a.weights.ptr<const float>(), round,
                      static_cast<int32_t>(T * K), static_cast<int32_t>(K), static_cast<int32_t>(a.experts.shape[0]),
                      T, H, I};
  const auto* experts = a.experts.ptr<const __nv_bfloat16>();
  const float* biases = a.biases.defined() ? a.biases.ptr<const float>() : nullptr;
  auto* h = static_cast<__nv_bfloat16*>(w.h);
  const dim3 block(kSplit * kWarp);
  // (gate/up releases the down kernel after its wait, never early: the down blocks read the routing
  // output, gate/up's primary, before their own wait)
  cudaError_t err = launch_kernel(Pdl{pdl.dependent, false}, up_fused_kernel<kTiles>,
                                  dim3(static_cast<unsigned>(I / 16), used_bound), block, 0, stream, f,
                                  a.x.ptr<const __nv_bfloat16>(), a.x.strides[0], experts, biases, h, w.tiles,
                                  w.errors, p);
  if (err == cudaSuccess)
    err = launch_kernel(pdl, down_fused_kernel<kTiles>, dim3(static_cast<unsigned>(H / 16), used_bound), block, 0,
                        stream, f, experts, biases, static_cast<const __nv_bfloat16*>(h), w.y, w.tiles,
                        a.out.ptr<__nv_bfloat16>(), pdl.early);
  check_launch(err);
}

template <int kTiles>
void launch_mma(const MoeExpertsArgs& a, const Workspace& w, unsigned used_bound, const ActParams& p,
                cudaStream_t stream) {
  const int64_t H = a.x.shape[1], K = a.ids.shape[1], I = a.intermediate_size;
  const auto* x = a.x.ptr<const __nv_bfloat16>();
  const auto* experts = a.experts.ptr<const __nv_bfloat16>();
  const float* biases = a.biases.defined() ? a.biases.ptr<const float>() : nullptr;
  auto* h = static_cast<__nv_bfloat16*>(w.h);
  const dim3 block(kSplit * kWarp);
  check_launch(launch_kernel(Pdl{}, up_mma_kernel<kTiles>, dim3(static_cast<unsigned>(I / 16), used_bound), block, 0,
                             stream, x, a.x.strides[0], K, experts, biases, w.offsets, w.order, w.used, h, H, I, p));
  check_launch(launch_kernel(Pdl{}, down_mma_kernel<kTiles>, dim3(static_cast<unsigned>(H / 16), used_bound), block,
                             0, stream, experts, biases, w.offsets, w.used, static_cast<const __nv_bfloat16*>(h), w.y,
                             H, I));
}

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
  const ActParams p{static_cast<int>(a.activation), a.limit, a.alpha};
  const bool round = a.round_weights && std::is_same<W, __nv_bfloat16>::value;
  const int major = device_major();
  const bool mma = std::is_same<W, __nv_bfloat16>::value && vec && H % kChunk == 0 && I % kChunk == 0 &&
                   (T <= 1 || ldx % 8 == 0) && major >= 8;
  const int64_t bound = E < T * K ? E : T * K;  // (at least 1: with K = 0 block y = 0 writes the zeros)
  const unsigned used_bound = static_cast<unsigned>(bound > 0 ? bound : 1);
  if (mma && T * K <= kFusedSlots && fused_allowed()) {
    const Pdl pdl = pdl_launch();
    with_tiles(T, [&](auto tiles) { launch_fused<decltype(tiles)::value>(a, w, used_bound, p, round, pdl, stream); });
    return;
  }
  const unsigned group_threads = static_cast<unsigned>((E + kWarp - 1) / kWarp * kWarp);
  check_launch(launch_kernel(Pdl{}, group_kernel, dim3(1), dim3(group_threads), 0, stream, ids, weights, round,
                             static_cast<int32_t>(T * K), static_cast<int32_t>(E), w.offsets, w.order, w.pos, w.used,
                             w.errors));
  if (mma) {
    with_tiles(T, [&](auto tiles) { launch_mma<decltype(tiles)::value>(a, w, used_bound, p, stream); });
  } else {
    const dim3 up_grid(static_cast<unsigned>(E), static_cast<unsigned>((I + kRowsPerBlock - 1) / kRowsPerBlock));
    const dim3 down_grid(static_cast<unsigned>(E), static_cast<unsigned>((H + kRowsPerBlock - 1) / kRowsPerBlock));
    const dim3 block(kWarps * kWarp);
    auto up = vec ? up_kernel<W, true> : up_kernel<W, false>;
    auto down = vec ? down_kernel<W, true> : down_kernel<W, false>;
    check_launch(launch_kernel(Pdl{}, up, up_grid, block, 0, stream, x, ldx, K, experts, biases, w.offsets, w.order,
                               h, H, I, p));
    check_launch(launch_kernel(Pdl{}, down, down_grid, block, 0, stream, experts, biases, w.offsets,
                               static_cast<const W*>(h), w.y, H, I));
  }
  check_launch(launch_kernel(Pdl{}, combine_kernel<W>, dim3(static_cast<unsigned>(T)), dim3(kCombineThreads), 0,
                             stream, ids, weights, round, w.pos, static_cast<const float*>(w.y), a.out.ptr<W>(), K, H));
}

}  // namespace

std::size_t moe_experts_workspace_size(int64_t T, int64_t K, int64_t E, int64_t H, int64_t I, DType dtype) {
  if (T < 0 || K < 0 || E < 1 || H < 1 || I < 1) return 0;
  return carve(nullptr, T, K, E, H, I, dtype_size(dtype), nullptr);
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
  DeviceGuard guard(a.x.device_index);
  Workspace w{};
  carve(workspace, T, K, E, H, I, dtype_size(a.x.dtype), &w);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (a.x.dtype == DType::kBFloat16)
    launch<__nv_bfloat16>(a, w, s);
  else
    launch<float>(a, w, s);
}

}  // namespace cuda
}  // namespace moespec
