// The kernels of select_cost_aware.cu, in a header of their own so that the C++ tests can run them
// on the CPU (tests/cpp/emulated/, tests/cpp/test_select_cost_aware_emulated.cc): they use
// nothing but threads, barriers, shuffles and shared memory (no PTX, no atomics).
//
// select_kernel: EcoSpec's cost-aware choice (the rule of cpp/include/moespec/select_cost_aware.h)
// for a whole batch in one block: the requests in order (the buffer, S and A carry from one to the
// next); a request's candidates' acceptances exp(score) once; then each round
//   1. every (candidate, layer) pair of the frontier is one item over the whole block: the layer's
//      expected new experts, sum_k p (1 - B), slot by slot, times the layer's expert time, into a
//      shared array of terms;
//   2. a thread per candidate sums token_s and its terms layer by layer (the CPU's order: the same
//      double roundings, with _rn intrinsics so that nvcc fuses no multiply-add the CPU does not)
//      and keeps its best by (gain desc, score desc, depth asc, index asc);
//   3. warp shuffles and one pass over the warps' bests pick the round's candidate (the order is a
//      strict total order, so the reduction's shape cannot change the pick);
//   4. its experts join the buffer (float32, B <- 1 - (1 - B)(1 - p), unfused; a repeated id in a
//      layer counts once, so each buffer entry has one writer).
// The buffer lives in shared memory for the whole batch when it fits (written back at the end), the
// terms for as many candidates as fit (candidates in chunks otherwise): SelectPlan. Rounds are
// inherently sequential (each pick changes the next prices); a round's latency is ~ K shared loads
// per item and L dependent adds per candidate, instead of the L * K dependent loads per candidate
// of a thread per candidate.
#pragma once

#include <cstddef>
#include <cstdint>

#include "device_common.cuh"  // (MOESPEC_DYNAMIC_SHARED)

namespace moespec {
namespace cuda {
namespace select_kernels {

constexpr int kSelectThreads = 1024;  // a multiple of 32 (the reduction shuffles whole warps)
constexpr int kLanes = 32;
constexpr unsigned kAllLanes = 0xffffffffu;

// Byte offsets of the shared arrays (16-byte aligned): coef [L] double (cost_scale * expert_s[l]),
// accept [C] double, term [chunk * L] double, buffer [L * N] float (when shared), chosen [C] bytes.
struct SelectLayout {
  int64_t coef, accept, term, buffer, chosen, bytes;
};

__host__ __device__ inline int64_t align16(int64_t n) { return (n + 15) / 16 * 16; }

__host__ __device__ inline SelectLayout select_layout(int64_t C, int64_t L, int64_t N, int64_t chunk,
                                                      bool buffer_shared) {
  SelectLayout s;
  s.coef = 0;
  s.accept = s.coef + align16(8 * L);
  s.term = s.accept + align16(8 * C);
  s.buffer = s.term + align16(8 * chunk * L);
  s.chosen = s.buffer + (buffer_shared ? align16(4 * L * N) : 0);
  s.bytes = s.chosen + align16(C);
  return s;
}

struct SelectPlan {
  int64_t chunk = 0;  // candidates whose terms are held at once; 0: does not fit
  bool buffer_shared = false;
  int64_t bytes = 0;  // dynamic shared memory
};

// The plan for `budget` bytes of dynamic shared memory: every candidate's terms and the buffer in
// shared memory when they fit; else the buffer in shared memory with chunks of >= 32 candidates;
// else the buffer in global memory and the largest chunk. chunk 0: not even one candidate fits.
inline SelectPlan plan_select(int64_t C, int64_t L, int64_t N, int64_t budget) {
  const int64_t want = C > 0 ? C : 1;
  auto fit = [&](bool shared) {
    SelectPlan p;
    p.buffer_shared = shared;
    const int64_t base = select_layout(C, L, N, 0, shared).bytes;
    int64_t chunk = L == 0 ? want : (budget - base) / (8 * L);
    chunk = chunk < want ? chunk : want;
    while (chunk > 0 && select_layout(C, L, N, chunk, shared).bytes > budget) --chunk;
    p.chunk = chunk > 0 ? chunk : 0;
    p.bytes = p.chunk > 0 ? select_layout(C, L, N, p.chunk, shared).bytes : 0;
    return p;
  };
  const SelectPlan shared = fit(true);
  if (shared.chunk >= (want < 32 ? want : 32)) return shared;
  const SelectPlan global = fit(false);
  return global.chunk >= shared.chunk ? global : shared;
}

struct Best {
  double gain, cost, accept;
  float score;
  int32_t depth, index;  // index -1: none
};

__device__ __forceinline__ bool better(const Best& a, const Best& b) {  // a before b
  if (b.index < 0) return a.index >= 0;
  if (a.index < 0) return false;
  if (a.gain != b.gain) return a.gain > b.gain;
  if (a.score != b.score) return a.score > b.score;
  if (a.depth != b.depth) return a.depth < b.depth;
  return a.index < b.index;
}

// Lane (this lane ^ o)'s best, if better than this lane's.
__device__ __forceinline__ void take_better(Best& mine, int o) {
  Best other;
  other.gain = __shfl_xor_sync(kAllLanes, mine.gain, o);
  other.cost = __shfl_xor_sync(kAllLanes, mine.cost, o);
  other.accept = __shfl_xor_sync(kAllLanes, mine.accept, o);
  other.score = __shfl_xor_sync(kAllLanes, mine.score, o);
  other.depth = __shfl_xor_sync(kAllLanes, mine.depth, o);
  other.index = __shfl_xor_sync(kAllLanes, mine.index, o);
  if (better(other, mine)) mine = other;
}

__device__ __forceinline__ bool repeat(const int32_t* e, int k) {
  for (int j = 0; j < k; ++j)
    if (e[j] == e[k]) return true;
  return false;
}

// blockDim.x: a multiple of 32, at most kSelectThreads; dynamic shared memory: select_layout(C, L,
// N, chunk, buffer_shared).bytes.
template <typename State>
__global__ void __launch_bounds__(kSelectThreads)
    select_kernel(const int32_t* __restrict__ parents, const int32_t* __restrict__ depth,
                  const float* __restrict__ scores, const int32_t* __restrict__ num_candidates,
                  const int32_t* __restrict__ predicted, const float* __restrict__ prob, float* __restrict__ buffer,
                  const float* __restrict__ expert_s, State* __restrict__ state, int32_t* __restrict__ selected,
                  int32_t* __restrict__ count, int B, int C, int L, int K, int N, float token_s, float cost_scale,
                  int total_tokens, int chunk, bool buffer_shared) {
  MOESPEC_DYNAMIC_SHARED(unsigned char, smem);
  const SelectLayout at = select_layout(C, L, N, chunk, buffer_shared);
  double* coef = reinterpret_cast<double*>(smem + at.coef);
  double* accept = reinterpret_cast<double*>(smem + at.accept);
  double* term = reinterpret_cast<double*>(smem + at.term);
  unsigned char* chosen = smem + at.chosen;
  float* buf = buffer_shared ? reinterpret_cast<float*>(smem + at.buffer) : buffer;
  __shared__ Best warp_best[kSelectThreads / kLanes];
  __shared__ double S, A;
  __shared__ int32_t picked;
  __shared__ bool any_cost;  // with all costs 0 the rule is EAGLE-2's: no stop at gain <= 0
  const int tid = static_cast<int>(threadIdx.x), threads = static_cast<int>(blockDim.x);
  const int lane = tid % kLanes, warp = tid / kLanes, warps = threads / kLanes;
  for (int l = tid; l < L; l += threads) coef[l] = static_cast<double>(__fmul_rn(cost_scale, expert_s[l]));
  if (buffer_shared)
    for (int i = tid; i < L * N; i += threads) buf[i] = buffer[i];
  if (tid == 0) {
    S = static_cast<double>(state[0]), A = static_cast<double>(state[1]);
    any_cost = token_s > 0;
    for (int l = 0; l < L; ++l) any_cost = any_cost || __fmul_rn(cost_scale, expert_s[l]) > 0;
  }
  __syncthreads();
  for (int b = 0; b < B; ++b) {
    const int n_cand = num_candidates[b];
    const int Cb = n_cand < 0 ? 0 : (n_cand > C ? C : n_cand);
    const int32_t* par = parents + static_cast<int64_t>(b) * C;
    const int32_t* dep = depth + static_cast<int64_t>(b) * C;
    const float* sc = scores + static_cast<int64_t>(b) * C;
    const int32_t* pred = predicted + static_cast<int64_t>(b) * C * L * K;
    const float* pp = prob ? prob + static_cast<int64_t>(b) * C * L * K : nullptr;
    int32_t* out = selected + static_cast<int64_t>(b) * C;
    for (int c = tid; c < C; c += threads) {
      chosen[c] = 0;
      out[c] = -1;
      accept[c] = c < Cb && isfinite(sc[c]) ? exp(static_cast<double>(sc[c])) : 0.0;
    }
    __syncthreads();
    // On the frontier: not chosen, and its parent is the root or chosen (a parent outside [0, C): never).
    auto frontier = [&](int c) {
      const int p = par[c];
      return !chosen[c] && (p < 0 || (p < C && chosen[p]));
    };
    const int limit = total_tokens < Cb ? total_tokens : Cb;
    int n = 0;
    while (n < limit) {
      const double rate = S / A;
      Best mine{0.0, 0.0, 0.0, 0.0f, 0, -1};
      for (int c0 = 0; c0 < Cb; c0 += chunk) {
        const int cn = Cb - c0 < chunk ? Cb - c0 : chunk;
        for (int i = tid; i < cn * L; i += threads) {  // 1. the terms
          const int c = c0 + i / L, l = i % L;
          if (!frontier(c)) continue;
          const int64_t row = (static_cast<int64_t>(c) * L + l) * K;
          const int32_t* e = pred + row;
          double fresh = 0.0;
          for (int k = 0; k < K; ++k) {
            if (repeat(e, k) || e[k] < 0 || e[k] >= N) continue;
            const double p = pp ? static_cast<double>(pp[row + k]) : 1.0;
            const double unread = __dsub_rn(1.0, static_cast<double>(buf[static_cast<int64_t>(l) * N + e[k]]));
            fresh = __dadd_rn(fresh, __dmul_rn(p, unread));
          }
          term[i] = __dmul_rn(coef[l], fresh);
        }
        __syncthreads();
        for (int j = tid; j < cn; j += threads) {  // 2. the costs and gains, layer after layer
          const int c = c0 + j;
          if (!frontier(c)) continue;
          double cost = token_s;
          for (int l = 0; l < L; ++l) cost = __dadd_rn(cost, term[static_cast<int64_t>(j) * L + l]);
          const Best cand{__dsub_rn(__dmul_rn(rate, accept[c]), cost), cost, accept[c], sc[c], dep[c], c};
          if (better(cand, mine)) mine = cand;
        }
        __syncthreads();  // (the next chunk's terms overwrite these)
      }
      for (int o = kLanes / 2; o > 0; o /= 2) take_better(mine, o);  // 3. the pick
      if (lane == 0) warp_best[warp] = mine;
      __syncthreads();
      if (warp == 0) {
        mine = lane < warps ? warp_best[lane] : Best{0.0, 0.0, 0.0, 0.0f, 0, -1};
        for (int o = kLanes / 2; o > 0; o /= 2) take_better(mine, o);
        if (lane == 0) {
          picked = mine.index < 0 || (mine.gain <= 0.0 && any_cost) ? -1 : mine.index;
          if (picked >= 0) {
            chosen[picked] = 1;
            out[n] = picked;
            S = __dadd_rn(S, mine.cost);
            A = __dadd_rn(A, mine.accept);
          }
        }
      }
      __syncthreads();
      const int pick = picked;
      if (pick < 0) break;
      for (int i = tid; i < L * K; i += threads) {  // 4. its experts join the buffer
        const int l = i / K, k = i % K;
        const int64_t row = (static_cast<int64_t>(pick) * L + l) * K;
        const int32_t* e = pred + row;
        if (repeat(e, k) || e[k] < 0 || e[k] >= N) continue;  // (one slot per expert: no race)
        const float p = pp ? pp[row + k] : 1.0f;
        float& v = buf[static_cast<int64_t>(l) * N + e[k]];
        v = __fsub_rn(1.0f, __fmul_rn(__fsub_rn(1.0f, v), __fsub_rn(1.0f, p)));
      }
      __syncthreads();
      ++n;
    }
    if (tid == 0) count[b] = n;
    __syncthreads();
  }
  if (buffer_shared)
    for (int i = tid; i < L * N; i += threads) buffer[i] = buf[i];
  if (tid == 0) state[0] = static_cast<State>(S), state[1] = static_cast<State>(A);
}

// One warp per request: lane 0 orders the chosen candidates and links parents and depths; the
// lanes then write each mask row's words, row after row (a row copies its parent's).
static __global__ void tree_kernel(const int32_t* __restrict__ selected, const int32_t* __restrict__ count,
                                   const int32_t* __restrict__ cand_parents, const int32_t* __restrict__ cand_tokens,
                                   const int32_t* __restrict__ root_tokens, int32_t* __restrict__ tokens,
                                   int32_t* __restrict__ parents, int32_t* __restrict__ depth,
                                   int32_t* __restrict__ mask, int32_t* __restrict__ num_nodes, int C, int M1, int W) {
  MOESPEC_DYNAMIC_SHARED(int32_t, node_of);  // [C]: node of each candidate, -1 if not chosen
  const int b = static_cast<int>(blockIdx.x), lane = static_cast<int>(threadIdx.x);
  const int32_t* sel = selected + static_cast<int64_t>(b) * C;
  const int32_t* cp = cand_parents + static_cast<int64_t>(b) * C;
  int32_t* tok = tokens + static_cast<int64_t>(b) * M1;
  int32_t* par = parents + static_cast<int64_t>(b) * M1;
  int32_t* dep = depth + static_cast<int64_t>(b) * M1;
  int32_t* msk = mask + static_cast<int64_t>(b) * M1 * W;
  int n = count[b];
  n = n < 0 ? 0 : (n > M1 - 1 ? M1 - 1 : n);
  for (int c = lane; c < C; c += static_cast<int>(blockDim.x)) node_of[c] = -1;
  __syncwarp();
  if (lane == 0) {
    for (int i = 0; i < n; ++i) {
      const int c = sel[i];
      if (c >= 0 && c < C) node_of[c] = 0;  // chosen
    }
    int next = 1;  // nodes in candidate order after the root
    for (int c = 0; c < C; ++c)
      if (node_of[c] == 0) node_of[c] = next++;
    n = next - 1;
    tok[0] = root_tokens[b], par[0] = -1, dep[0] = 0;
    for (int c = 0; c < C; ++c) {
      const int i = node_of[c];
      if (i <= 0) continue;
      const int p = cp[c] >= 0 && cp[c] < C && node_of[cp[c]] > 0 ? node_of[cp[c]] : 0;
      tok[i] = cand_tokens[static_cast<int64_t>(b) * C + c];
      par[i] = p;
      dep[i] = dep[p] + 1;  // p < i: parents precede children in candidate order
    }
    for (int i = n + 1; i < M1; ++i) tok[i] = 0, par[i] = -1, dep[i] = 0;
    num_nodes[b] = n + 1;
  }
  __syncwarp();
  const int rows = __shfl_sync(kAllLanes, n, 0) + 1;
  for (int i = 0; i < M1; ++i) {
    for (int w = lane; w < W; w += static_cast<int>(blockDim.x)) {
      int32_t word = 0;
      if (i < rows) {
        word = i ? msk[static_cast<int64_t>(par[i]) * W + w] : 0;
        if (w == i / 32) word |= static_cast<int32_t>(1u << (i % 32));
      }
      msk[static_cast<int64_t>(i) * W + w] = word;
    }
    __syncwarp();
  }
}

}  // namespace select_kernels
}  // namespace cuda
}  // namespace moespec
