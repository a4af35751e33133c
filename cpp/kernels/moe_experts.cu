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
// Sums within a dot product run in the hardware's order, not the CPU's: results agree with the CPU
// op within the tolerances of its SIMD paths (moe_experts.h, "Precision"), not bitwise.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "device_common.cuh"
#include "moespec/error.h"
#include "moespec/moe_experts.h"

namespace moespec {
namespace cuda {
namespace {

using namespace device;  // kWarp, kFullMask, to_f, from_f, warp_sum

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
  void* h;           // [T K, I] in the weights' dtype
  float* y;          // [T K, H]
};

Workspace carve(void* base, int64_t T, int64_t K, int64_t E, int64_t I, std::size_t elem) {  // (y last: [T K, H])
  char* p = static_cast<char*>(base);
  Workspace w{};
  const std::size_t slots = static_cast<std::size_t>(T * K);
  w.offsets = reinterpret_cast<int32_t*>(p);
  p += align_up(sizeof(int32_t) * static_cast<std::size_t>(E + 1));
  w.used = reinterpret_cast<int32_t*>(p);
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
__global__ void group_kernel(const int32_t* __restrict__ ids, const float* __restrict__ weights, int64_t slots,
                             int32_t E, int32_t* __restrict__ offsets, int32_t* __restrict__ order,
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
        else if (id < E && weights[s] != 0.0f) e = id;
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

// ---- 2 and 3 on tensor cores (bf16, sm_80+) ------------------------------------------------------

constexpr int kSplit = 4;     // warps of a block, splitting the reduction dimension
constexpr int kChunk = 32;    // reduction elements a warp takes per step: 16 bytes a thread, 2 mma
constexpr int kMaxTiles = 8;  // n-tiles (8 tokens each) per pass over the weights (T > 32: one pass
                              // for up to 64 tokens an expert; with 4, Mixtral's T = 64 made two
                              // passes over 700 MB and ran at 0.62x torch on the H200)

// 16 bytes of a weight stream, read once: not kept in L1.
__device__ __forceinline__ uint4 load_stream(const __nv_bfloat16* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

// c += A B for one m16n8k16 tile (A: 16 x 16 row-major bf16, B: 16 x 8 column-major, c: fp32).
__device__ __forceinline__ void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
               "{%8, %9}, {%0, %1, %2, %3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
  (void)c, (void)a0, (void)a1, (void)a2, (void)a3, (void)b0, (void)b1;  // (the host picks this path on sm_80+ only)
#endif
}

// acc[m][nt] += W_m[16 rows] . act[tokens of n-tile nt] over this warp's chunks of the reduction
// dimension n (chunks warp, warp + kSplit, ...). W_m: row r at w[m] + r * ldw. Thread (g, t) =
// (lane / 4, lane % 4) loads elements [8t, 8t + 8) of a chunk for rows g and g + 8 and for token g of
// each n-tile (act row arow[nt]); mma step s takes elements 8t + 4s + {0..3} as the fragment's
// k = {2t, 2t + 1, 2t + 8, 2t + 9}: the same permutation of k in A and B.
template <int kMats, int kTiles, int kUnroll>
__device__ __forceinline__ void mma_rows(const __nv_bfloat16* const (&w)[kMats], int64_t ldw,
                                         const __nv_bfloat16* const (&arow)[kTiles], int tiles, int64_t n,
                                         int warp, int lane, float (&acc)[kMats][kTiles][4]) {
  const int g = lane / 4, t = lane % 4;
  const __nv_bfloat16* rows[kMats][2];
#pragma unroll
  for (int m = 0; m < kMats; ++m) rows[m][0] = w[m] + g * ldw + 8 * t, rows[m][1] = rows[m][0] + 8 * ldw;
  constexpr int64_t kStride = static_cast<int64_t>(kSplit) * kChunk;
  for (int64_t k0 = static_cast<int64_t>(warp) * kChunk; k0 < n; k0 += kStride * kUnroll) {
    uint4 a[kUnroll][kMats][2] = {}, b[kUnroll][kTiles] = {};
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {  // every load of kUnroll chunks first: bytes in flight
      const int64_t k = k0 + u * kStride;
      if (k >= n) break;
#pragma unroll
      for (int m = 0; m < kMats; ++m) {
        a[u][m][0] = load_stream(rows[m][0] + k);
        a[u][m][1] = load_stream(rows[m][1] + k);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t k = k0 + u * kStride;
      if (k >= n) break;
#pragma unroll
      for (int j = 0; j < kTiles; ++j)
        if (j < tiles) b[u][j] = __ldg(reinterpret_cast<const uint4*>(arow[j] + 8 * t + k));
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (k0 + u * kStride >= n) break;
#pragma unroll
      for (int j = 0; j < kTiles; ++j) {
        if (j >= tiles) break;
#pragma unroll
        for (int m = 0; m < kMats; ++m) {
          const uint4 &lo = a[u][m][0], &hi = a[u][m][1], &x = b[u][j];
          mma_bf16(acc[m][j], lo.x, hi.x, lo.y, hi.y, x.x, x.y);
          mma_bf16(acc[m][j], lo.z, hi.z, lo.w, hi.w, x.z, x.w);
        }
      }
    }
  }
}

// The kSplit warps' tiles summed in warp order (deterministic) into warp 0's acc; returns true in
// warp 0. `red`: shared memory for kSplit * kMats * kTiles * 4 * 32 floats.
template <int kMats, int kTiles>
__device__ __forceinline__ bool reduce_warps(float (&acc)[kMats][kTiles][4], float* red, int warp, int lane) {
  constexpr int kPer = kMats * kTiles * 4;
  if (warp > 0) {
#pragma unroll
    for (int m = 0; m < kMats; ++m)
#pragma unroll
      for (int j = 0; j < kTiles; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) red[((warp - 1) * kPer + (m * kTiles + j) * 4 + i) * kWarp + lane] = acc[m][j][i];
  }
  __syncthreads();
  if (warp == 0) {
#pragma unroll
    for (int v = 1; v < kSplit; ++v)
#pragma unroll
      for (int m = 0; m < kMats; ++m)
#pragma unroll
        for (int j = 0; j < kTiles; ++j)
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[m][j][i] += red[((v - 1) * kPer + (m * kTiles + j) * 4 + i) * kWarp + lane];
  }
  __syncthreads();  // (red is reused by the next pass)
  return warp == 0;
}

// The fragment element i of the accumulator: row (of the 16) and token column (of the 8).
__device__ __forceinline__ int frag_row(int lane, int i) { return lane / 4 + (i >= 2 ? 8 : 0); }
__device__ __forceinline__ int frag_col(int lane, int i) { return 2 * (lane % 4) + (i & 1); }


// The passes of one block over its expert's slots, kTiles * 8 at a time, against weight rows of n
// elements (w[m], 16 rows each, row stride n): the activation row of slot `at` (0 <= at < count) is
// row_of(at); each pass streams the block's weight rows once
// (mma_rows), sums the warps' tiles, and warp 0 hands every element of the tile to
// store(at, row in the 16, the summed accumulators, tile, fragment element).
template <int kMats, int kTiles, typename RowOf, typename Store>
__device__ __forceinline__ void expert_passes(const __nv_bfloat16* const (&w)[kMats], int64_t n, int32_t count,
                                              float* red, RowOf row_of, Store store) {
  constexpr int kUnroll = kTiles <= 2 ? 4 : 2;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  for (int32_t j0 = 0; j0 < count; j0 += kTiles * 8) {
    const int tiles = (count - j0 + 7) / 8 < kTiles ? (count - j0 + 7) / 8 : kTiles;
    const __nv_bfloat16* arow[kTiles];
#pragma unroll
    for (int j = 0; j < kTiles; ++j) {  // token g of tile j (past the last: the last again, not stored)
      const int32_t at = j0 + j * 8 + lane / 4;
      arow[j] = row_of(at < count ? at : count - 1);
    }
    float acc[kMats][kTiles][4] = {};
    mma_rows<kMats, kTiles, kUnroll>(w, n, arow, tiles, n, warp, lane, acc);
    if (!reduce_warps<kMats, kTiles>(acc, red, warp, lane)) continue;
#pragma unroll
    for (int j = 0; j < kTiles; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int32_t at = j0 + j * 8 + frag_col(lane, i);
        if (at < count) store(at, frag_row(lane, i), acc, j, i);
      }
  }
}

// grid (I / 16, used experts bound), block kSplit warps: gate and up rows [16 blockIdx.x, +16) of
// expert used[1 + blockIdx.y], over all of its slots.
template <int kTiles>
__global__ void __launch_bounds__(kSplit * kWarp)
    up_mma_kernel(const __nv_bfloat16* __restrict__ x, int64_t ldx, int64_t K,
                  const __nv_bfloat16* __restrict__ experts, const float* __restrict__ biases,
                  const int32_t* __restrict__ offsets, const int32_t* __restrict__ order,
                  const int32_t* __restrict__ used, __nv_bfloat16* __restrict__ h, int64_t H, int64_t I, ActParams p) {
  __shared__ float red[(kSplit - 1) * 2 * kTiles * 4 * kWarp];
  if (static_cast<int32_t>(blockIdx.y) >= used[0]) return;  // no such used expert: nothing is read
  const int e = used[1 + blockIdx.y];
  const int32_t first = offsets[e], count = offsets[e + 1] - first;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * 16;
  const __nv_bfloat16* gate = experts + static_cast<int64_t>(e) * 3 * I * H + r0 * H;
  const __nv_bfloat16* const w[2] = {gate, gate + I * H};
  const float* bias = biases ? biases + static_cast<int64_t>(e) * (2 * I + H) : nullptr;
  expert_passes<2, kTiles>(
      w, H, count, red, [=](int32_t at) { return x + static_cast<int64_t>(order[first + at] / K) * ldx; },
      [=](int32_t at, int r, const float (&acc)[2][kTiles][4], int j, int i) {
        const int64_t row = r0 + r;
        h[static_cast<int64_t>(first + at) * I + row] =
            __float2bfloat16_rn(activate(acc[0][j][i], acc[1][j][i], bias, I, row, p));
      });
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
  const int32_t first = offsets[e], count = offsets[e + 1] - first;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * 16;
  const __nv_bfloat16* const w[1] = {experts + static_cast<int64_t>(e) * 3 * I * H + 2 * I * H + r0 * I};
  const float* bias = biases ? biases + static_cast<int64_t>(e) * (2 * I + H) + 2 * I : nullptr;
  expert_passes<1, kTiles>(
      w, I, count, red, [=](int32_t at) { return h + static_cast<int64_t>(first + at) * I; },
      [=](int32_t at, int r, const float (&acc)[1][kTiles][4], int j, int i) {
        const int64_t row = r0 + r;
        y[static_cast<int64_t>(first + at) * H + row] = acc[0][j][i] + (bias ? bias[row] : 0.0f);
      });
}

// ---- 4. combine ---------------------------------------------------------------------------------------

// blockDim.x >= K (kCombineThreads >= kMaxSlots). Thread k ranks slot k among the token's used
// slots by (id, k) in one step (no serial chain of dependent loads), then the threads sum columns.
template <typename W>
__global__ void combine_kernel(const int32_t* __restrict__ ids, const float* __restrict__ weights,
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
    weight[rank] = weights[t * K + k];
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

// Whether the current device has bf16 mma.sync (sm_80+); asked once per device.
bool device_has_bf16_mma() {
  static int cached[64] = {};  // 0 unknown, 1 yes, 2 no
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) return false;
  if (cached[device] == 0) {
    int major = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    cached[device] = major >= 8 ? 1 : 2;
  }
  return cached[device] == 1;
}

template <int kTiles>
void launch_mma(const MoeExpertsArgs& a, const Workspace& w, unsigned used_bound, const ActParams& p,
                cudaStream_t stream) {
  const int64_t H = a.x.shape[1], K = a.ids.shape[1], I = a.intermediate_size;
  const auto* x = a.x.ptr<const __nv_bfloat16>();
  const auto* experts = a.experts.ptr<const __nv_bfloat16>();
  const float* biases = a.biases.defined() ? a.biases.ptr<const float>() : nullptr;
  auto* h = static_cast<__nv_bfloat16*>(w.h);
  up_mma_kernel<kTiles><<<dim3(static_cast<unsigned>(I / 16), used_bound), kSplit * kWarp, 0, stream>>>(
      x, a.x.strides[0], K, experts, biases, w.offsets, w.order, w.used, h, H, I, p);
  down_mma_kernel<kTiles><<<dim3(static_cast<unsigned>(H / 16), used_bound), kSplit * kWarp, 0, stream>>>(
      experts, biases, w.offsets, w.used, h, w.y, H, I);
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
  const unsigned group_threads = static_cast<unsigned>((E + kWarp - 1) / kWarp * kWarp);
  group_kernel<<<1, group_threads, 0, stream>>>(ids, weights, T * K, static_cast<int32_t>(E), w.offsets, w.order,
                                                w.pos, w.used, w.errors);
  const ActParams p{static_cast<int>(a.activation), a.limit, a.alpha};
  const bool mma = std::is_same<W, __nv_bfloat16>::value && vec && H % kChunk == 0 && I % kChunk == 0 &&
                   (T <= 1 || ldx % 8 == 0) && device_has_bf16_mma();
  if (mma) {  // tokens per expert are at most T (distinct ids per token): n-tiles for that, more loop
    const unsigned used_bound = static_cast<unsigned>(E < T * K ? E : T * K);
    if (T <= 8)
      launch_mma<1>(a, w, used_bound, p, stream);
    else if (T <= 16)
      launch_mma<2>(a, w, used_bound, p, stream);
    else if (T <= 32)
      launch_mma<4>(a, w, used_bound, p, stream);
    else
      launch_mma<kMaxTiles>(a, w, used_bound, p, stream);
  } else {
    const dim3 up_grid(static_cast<unsigned>(E), static_cast<unsigned>((I + kRowsPerBlock - 1) / kRowsPerBlock));
    const dim3 down_grid(static_cast<unsigned>(E), static_cast<unsigned>((H + kRowsPerBlock - 1) / kRowsPerBlock));
    if (vec) {
      up_kernel<W, true><<<up_grid, kWarps * kWarp, 0, stream>>>(x, ldx, K, experts, biases, w.offsets, w.order, h,
                                                                   H, I, p);
      down_kernel<W, true><<<down_grid, kWarps * kWarp, 0, stream>>>(experts, biases, w.offsets, h, w.y, H, I);
    } else {
      up_kernel<W, false><<<up_grid, kWarps * kWarp, 0, stream>>>(x, ldx, K, experts, biases, w.offsets, w.order,
                                                                    h, H, I, p);
      down_kernel<W, false><<<down_grid, kWarps * kWarp, 0, stream>>>(experts, biases, w.offsets, h, w.y, H, I);
    }
  }
  combine_kernel<W><<<static_cast<unsigned>(T), kCombineThreads, 0, stream>>>(ids, weights, w.pos, w.y,
                                                                              a.out.ptr<W>(), K, H);
}

}  // namespace

std::size_t moe_experts_workspace_size(int64_t T, int64_t K, int64_t E, int64_t H, int64_t I, DType dtype) {
  if (T < 0 || K < 0 || E < 1 || H < 1 || I < 1) return 0;
  const std::size_t slots = static_cast<std::size_t>(T * K);
  return 2 * align_up(sizeof(int32_t) * static_cast<std::size_t>(E + 1)) + 2 * align_up(sizeof(int32_t) * slots) +
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
