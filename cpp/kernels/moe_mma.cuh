// The tensor-core building blocks of moe_experts.cu and linear.cu (bf16, sm_80+): one block of
// kWarpsK warps (kSplit for the experts) owns 16 weight rows of one matrix and streams them once per
// pass against up to kMaxTiles n-tiles of 8 tokens (mma.sync m16n8k16, fp32 accumulators), the
// warps' partial tiles summed in warp order (deterministic). Used by the MoE kernel's four launches,
// its fused pair and the dense projection alike.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

#include "device_common.cuh"

namespace moespec {
namespace cuda {
namespace device {

constexpr int kSplit = 4;     // warps of a block, splitting the reduction dimension
constexpr int kChunk = 32;    // reduction elements a warp takes per step: 16 bytes a thread, 2 mma
constexpr int kMaxTiles = 8;  // n-tiles (8 tokens each) per pass over the weights (T > 32: one pass
                              // for up to 64 tokens an expert; with 4, Mixtral's T = 64 made two
                              // passes over 700 MB and ran at 0.62x torch on the H200)

// 16 bytes of a weight stream, read once: not kept in L1.
__device__ __forceinline__ uint4 load_stream(const __nv_bfloat16* p) {
#ifdef MOESPEC_EMULATED
  return *reinterpret_cast<const uint4*>(p);
#else
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
#endif
}

// c += A B for one m16n8k16 tile (A: 16 x 16 row-major bf16, B: 16 x 8 column-major, c: fp32).
__device__ __forceinline__ void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
#if defined(MOESPEC_EMULATED)
  ::emu::mma_bf16_16816(c, {a0, a1, a2, a3}, {b0, b1});
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
               "{%8, %9}, {%0, %1, %2, %3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
  (void)c, (void)a0, (void)a1, (void)a2, (void)a3, (void)b0, (void)b1;  // (the host picks this path on sm_80+ only)
#endif
}

// acc[m][nt] += W_m[16 rows] . act[tokens of n-tile nt] over this warp's chunks of the reduction
// dimension n (chunks warp, warp + kWarpsK, ...). W_m: row r at w[m] + r * ldw; rows past `rows`
// (a last tile of fewer than 16) read row rows - 1 again (not stored by the caller). Thread (g, t) =
// (lane / 4, lane % 4) loads elements [8t, 8t + 8) of a chunk for rows g and g + 8 and for token g of
// each n-tile (act row arow[nt]); mma step s takes elements 8t + 4s + {0..3} as the fragment's
// k = {2t, 2t + 1, 2t + 8, 2t + 9}: the same permutation of k in A and B.
template <int kMats, int kTiles, int kUnroll, int kWarpsK>
__device__ __forceinline__ void mma_rows(const __nv_bfloat16* const (&w)[kMats], int64_t ldw, int nrows,
                                         const __nv_bfloat16* const (&arow)[kTiles], int tiles, int64_t n,
                                         int warp, int lane, float (&acc)[kMats][kTiles][4]) {
  const int g = lane / 4, t = lane % 4;
  const int r_lo = g < nrows ? g : nrows - 1, r_hi = g + 8 < nrows ? g + 8 : nrows - 1;
  const __nv_bfloat16* rows[kMats][2];
#pragma unroll
  for (int m = 0; m < kMats; ++m) rows[m][0] = w[m] + r_lo * ldw + 8 * t, rows[m][1] = w[m] + r_hi * ldw + 8 * t;
  constexpr int64_t kStride = static_cast<int64_t>(kWarpsK) * kChunk;
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
        // (activations through L2, ld.global.cg: a programmatic dependent's predecessor writes them while
        // it may be resident, so the non-coherent path, for data read-only for the kernel's life, is out)
        if (j < tiles) b[u][j] = __ldcg(reinterpret_cast<const uint4*>(arow[j] + 8 * t + k));
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

// The kWarpsK warps' tiles summed in warp order (deterministic) into warp 0's acc; returns true in
// warp 0. `red`: shared memory for (kWarpsK - 1) * kMats * kTiles * 4 * 32 floats.
template <int kMats, int kTiles, int kWarpsK>
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
    for (int v = 1; v < kWarpsK; ++v)
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
// elements (w[m], `nrows` <= 16 rows each, row stride n): the activation row of slot `at`
// (0 <= at < count) is row_of(at); each pass streams the block's weight rows once (mma_rows), sums
// the warps' tiles, and warp 0 hands every element of the tile's rows < nrows to
// store(at, row in the 16, the summed accumulators, tile, fragment element). A block of kWarpsK warps.
template <int kMats, int kTiles, int kWarpsK = kSplit, typename RowOf, typename Store>
__device__ __forceinline__ void expert_passes(const __nv_bfloat16* const (&w)[kMats], int64_t n, int32_t count,
                                              float* red, RowOf row_of, Store store, int nrows = 16) {
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
    mma_rows<kMats, kTiles, kUnroll, kWarpsK>(w, n, nrows, arow, tiles, n, warp, lane, acc);
    if (!reduce_warps<kMats, kTiles, kWarpsK>(acc, red, warp, lane)) continue;
#pragma unroll
    for (int j = 0; j < kTiles; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int32_t at = j0 + j * 8 + frag_col(lane, i);
        if (at < count && frag_row(lane, i) < nrows) store(at, frag_row(lane, i), acc, j, i);
      }
  }
}

// Host side: launch(std::integral_constant<int, n-tiles>) for a matrix that meets at most T tokens
// (an expert's slots: distinct ids per token), so that the n-tiles of a pass cover that many; the
// passes loop over more.
template <typename Launch>
void with_tiles(int64_t T, Launch&& launch) {
  if (T <= 8)
    launch(std::integral_constant<int, 1>{});
  else if (T <= 16)
    launch(std::integral_constant<int, 2>{});
  else if (T <= 32)
    launch(std::integral_constant<int, 4>{});
  else
    launch(std::integral_constant<int, kMaxTiles>{});
}

}  // namespace device
}  // namespace cuda
}  // namespace moespec
