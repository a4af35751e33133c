// select_cost_aware on the GPU (moespec::cuda::select_cost_aware): EcoSpec's cost-aware verify-set
// choice for a whole batch in one launch, the rule of cpp/include/moespec/select_cost_aware.h (its
// CPU function, cpp/src/select_cost_aware.cc, is the reference; python/moespec/spec/cost_aware.py
// holds both to its plain-Python one). Tests: tests/gpu/test_select_cost_aware_cuda.py.
//
// One block walks the requests in order (the buffer, S and A carry from one to the next); in each
// round every thread prices its share of the candidates (double sums in the CPU's order: layer by
// layer, slot by slot, with explicit _rn intrinsics so that nvcc fuses no multiply-add the CPU does
// not), a block reduction picks the best by (gain desc, score desc, depth asc, index asc), and the
// block adds its experts to the buffer (float32, B <- 1 - (1 - B)(1 - p), unfused). No host
// synchronisation, no allocation: capturable in a CUDA graph.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>

#include "device_common.cuh"
#include "moespec/error.h"
#include "moespec/select_cost_aware.h"

namespace moespec {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr unsigned kFullWarp = 0xffffffffu;

struct Best {
  double gain, cost, accept;
  float score;
  int32_t depth, index;  // index -1: none
};

__device__ bool better(const Best& a, const Best& b) {  // a before b
  if (b.index < 0) return a.index >= 0;
  if (a.index < 0) return false;
  if (a.gain != b.gain) return a.gain > b.gain;
  if (a.score != b.score) return a.score > b.score;
  if (a.depth != b.depth) return a.depth < b.depth;
  return a.index < b.index;
}

__device__ bool repeat(const int32_t* e, int k) {
  for (int j = 0; j < k; ++j)
    if (e[j] == e[k]) return true;
  return false;
}

template <typename State>
__global__ void __launch_bounds__(kThreads)
    select_kernel(const int32_t* __restrict__ parents, const int32_t* __restrict__ depth,
                  const float* __restrict__ scores, const int32_t* __restrict__ num_candidates,
                  const int32_t* __restrict__ predicted, const float* __restrict__ prob, float* __restrict__ buffer,
                  const float* __restrict__ expert_s, State* __restrict__ state, int32_t* __restrict__ selected,
                  int32_t* __restrict__ count, int B, int C, int L, int K, int N, float token_s, float cost_scale,
                  int total_tokens) {
  extern __shared__ unsigned char chosen[];  // [C]
  __shared__ Best best[kThreads];
  __shared__ double S, A;
  __shared__ int32_t picked;
  __shared__ bool any_cost;  // with all costs 0 the rule is EAGLE-2's: no stop at gain <= 0
  if (threadIdx.x == 0) {
    S = static_cast<double>(state[0]), A = static_cast<double>(state[1]);
    any_cost = token_s > 0;
    for (int l = 0; l < L; ++l) any_cost = any_cost || __fmul_rn(cost_scale, expert_s[l]) > 0;
  }
  __syncthreads();
  for (int b = 0; b < B; ++b) {
    const int Cb = num_candidates[b];
    const int32_t* par = parents + static_cast<int64_t>(b) * C;
    const int32_t* dep = depth + static_cast<int64_t>(b) * C;
    const float* sc = scores + static_cast<int64_t>(b) * C;
    const int32_t* pred = predicted + static_cast<int64_t>(b) * C * L * K;
    const float* pp = prob ? prob + static_cast<int64_t>(b) * C * L * K : nullptr;
    int32_t* out = selected + static_cast<int64_t>(b) * C;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
      chosen[c] = 0;
      out[c] = -1;
    }
    __syncthreads();
    const int limit = total_tokens < Cb ? total_tokens : Cb;
    int n = 0;
    while (n < limit) {
      const double rate = S / A;
      Best mine{0.0, 0.0, 0.0, 0.0f, 0, -1};
      for (int c = threadIdx.x; c < Cb; c += blockDim.x) {
        if (chosen[c] || (par[c] >= 0 && !chosen[par[c]])) continue;
        double cost = token_s;
        for (int l = 0; l < L; ++l) {
          const int32_t* e = pred + (static_cast<int64_t>(c) * L + l) * K;
          double fresh = 0.0;
          for (int k = 0; k < K; ++k) {
            if (repeat(e, k) || e[k] < 0 || e[k] >= N) continue;
            const double p = pp ? static_cast<double>(pp[(static_cast<int64_t>(c) * L + l) * K + k]) : 1.0;
            const double unread = __dsub_rn(1.0, static_cast<double>(buffer[static_cast<int64_t>(l) * N + e[k]]));
            fresh = __dadd_rn(fresh, __dmul_rn(p, unread));
          }
          cost = __dadd_rn(cost, __dmul_rn(static_cast<double>(__fmul_rn(cost_scale, expert_s[l])), fresh));
        }
        const double accept = isfinite(sc[c]) ? exp(static_cast<double>(sc[c])) : 0.0;
        const Best cand{__dsub_rn(__dmul_rn(rate, accept), cost), cost, accept, sc[c], dep[c], c};
        if (better(cand, mine)) mine = cand;
      }
      best[threadIdx.x] = mine;
      __syncthreads();
      for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
        if (threadIdx.x < stride && better(best[threadIdx.x + stride], best[threadIdx.x]))
          best[threadIdx.x] = best[threadIdx.x + stride];
        __syncthreads();
      }
      if (threadIdx.x == 0) {
        const Best& top = best[0];
        picked = top.index < 0 || (top.gain <= 0.0 && any_cost) ? -1 : top.index;
        if (picked >= 0) {
          chosen[picked] = 1;
          out[n] = picked;
          S = __dadd_rn(S, top.cost);
          A = __dadd_rn(A, top.accept);
        }
      }
      __syncthreads();
      if (picked < 0) break;
      for (int i = threadIdx.x; i < L * K; i += blockDim.x) {  // its experts join the buffer
        const int l = i / K, k = i % K;
        const int32_t* e = pred + (static_cast<int64_t>(picked) * L + l) * K;
        if (repeat(e, k) || e[k] < 0 || e[k] >= N) continue;  // (one slot per expert: no race)
        const float p = pp ? pp[(static_cast<int64_t>(picked) * L + l) * K + k] : 1.0f;
        float& v = buffer[static_cast<int64_t>(l) * N + e[k]];
        v = __fsub_rn(1.0f, __fmul_rn(__fsub_rn(1.0f, v), __fsub_rn(1.0f, p)));
      }
      __syncthreads();
      ++n;
    }
    if (threadIdx.x == 0) count[b] = n;
    __syncthreads();
  }
  if (threadIdx.x == 0) state[0] = static_cast<State>(S), state[1] = static_cast<State>(A);
}

// One warp per request: lane 0 orders the chosen candidates and links parents and depths; the
// lanes then write each mask row's words, row after row (a row copies its parent's).
__global__ void tree_kernel(const int32_t* __restrict__ selected, const int32_t* __restrict__ count,
                            const int32_t* __restrict__ cand_parents, const int32_t* __restrict__ cand_tokens,
                            const int32_t* __restrict__ root_tokens, int32_t* __restrict__ tokens,
                            int32_t* __restrict__ parents, int32_t* __restrict__ depth, int32_t* __restrict__ mask,
                            int32_t* __restrict__ num_nodes, int C, int M1, int W) {
  extern __shared__ int32_t node_of[];  // [C]: node of each candidate, -1 if not chosen
  const int b = blockIdx.x, lane = threadIdx.x;
  const int32_t* sel = selected + static_cast<int64_t>(b) * C;
  const int32_t* cp = cand_parents + static_cast<int64_t>(b) * C;
  int32_t* tok = tokens + static_cast<int64_t>(b) * M1;
  int32_t* par = parents + static_cast<int64_t>(b) * M1;
  int32_t* dep = depth + static_cast<int64_t>(b) * M1;
  int32_t* msk = mask + static_cast<int64_t>(b) * M1 * W;
  int n = count[b];
  n = n < 0 ? 0 : (n > M1 - 1 ? M1 - 1 : n);
  for (int c = lane; c < C; c += blockDim.x) node_of[c] = -1;
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
  const int rows = __shfl_sync(kFullWarp, n, 0) + 1;
  for (int i = 0; i < M1; ++i) {
    for (int w = lane; w < W; w += blockDim.x) {
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

// A contiguous tensor of `dtype` and these dims on CUDA device `dev`, or an Error naming it.
void check_cuda(const TensorView& v, const char* name, DType dtype, std::initializer_list<int64_t> dims, int32_t dev) {
  check_view(v, name, {dtype}, dims, Device::kCUDA, dev);
  check_contiguous(v, name);
}

}  // namespace

void select_cost_aware(const SelectCostAwareBatchArgs& a, void* stream) {
  check_not_null(a.parents, "parents");
  MOESPEC_CHECK_ARG(a.parents.ndim == 2, "parents", "expected [B, C], got ", a.parents.describe());
  const int64_t B = a.parents.shape[0], C = a.parents.shape[1];
  check_not_null(a.predicted, "predicted");
  MOESPEC_CHECK_ARG(a.predicted.ndim == 4, "predicted", "expected [B, C, L, K], got ", a.predicted.describe());
  const int64_t L = a.predicted.shape[2], K = a.predicted.shape[3];
  check_not_null(a.buffer, "buffer");
  MOESPEC_CHECK_ARG(a.buffer.ndim == 2, "buffer", "expected [L, N], got ", a.buffer.describe());
  const int64_t N = a.buffer.shape[1];
  const int32_t dev = a.parents.device_index;
  check_cuda(a.parents, "parents", DType::kInt32, {B, C}, dev);
  check_cuda(a.depth, "depth", DType::kInt32, {B, C}, dev);
  check_cuda(a.scores, "scores", DType::kFloat32, {B, C}, dev);
  check_cuda(a.num_candidates, "num_candidates", DType::kInt32, {B}, dev);
  check_cuda(a.predicted, "predicted", DType::kInt32, {B, C, L, K}, dev);
  if (a.predicted_p.defined()) check_cuda(a.predicted_p, "predicted_p", DType::kFloat32, {B, C, L, K}, dev);
  check_cuda(a.buffer, "buffer", DType::kFloat32, {L, N}, dev);
  check_cuda(a.expert_s, "expert_s", DType::kFloat32, {L}, dev);
  const bool state_f32 = a.state.dtype == DType::kFloat32;
  check_cuda(a.state, "state", state_f32 ? DType::kFloat32 : DType::kFloat64, {2}, dev);
  check_cuda(a.selected, "selected", DType::kInt32, {B, C}, dev);
  check_cuda(a.count, "count", DType::kInt32, {B}, dev);
  MOESPEC_CHECK_ARG(a.total_tokens >= 1, "total_tokens", "must be >= 1, got ", a.total_tokens);
  MOESPEC_CHECK_ARG(a.token_s >= 0, "token_s", "must be >= 0, got ", a.token_s);
  MOESPEC_CHECK_ARG(a.cost_scale >= 0 && std::isfinite(a.cost_scale), "cost_scale", "must be finite and >= 0, got ",
                    a.cost_scale);
  MOESPEC_CHECK_ARG(C <= (int64_t{1} << 20) && L * K <= (int64_t{1} << 20), "predicted", "too many candidates or slots: ",
                    a.predicted.describe());
  if (B == 0) return;
  DeviceGuard guard(dev);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const float token_s = a.token_s * a.cost_scale;
  auto launch = [&](auto* state) {
    select_kernel<<<1, kThreads, static_cast<std::size_t>(C), s>>>(
        a.parents.ptr<const int32_t>(), a.depth.ptr<const int32_t>(), a.scores.ptr<const float>(),
        a.num_candidates.ptr<const int32_t>(), a.predicted.ptr<const int32_t>(),
        a.predicted_p.defined() ? a.predicted_p.ptr<const float>() : nullptr, a.buffer.ptr<float>(),
        a.expert_s.ptr<const float>(), state, a.selected.ptr<int32_t>(), a.count.ptr<int32_t>(),
        static_cast<int>(B), static_cast<int>(C), static_cast<int>(L), static_cast<int>(K), static_cast<int>(N),
        token_s, a.cost_scale, a.total_tokens);
  };
  if (state_f32) {
    launch(a.state.ptr<float>());
  } else {
    launch(a.state.ptr<double>());
  }
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw_runtime("moespec::cuda::select_cost_aware: launch failed: ", cudaGetErrorString(err));
}

void tree_from_selection(const TreeFromSelectionArgs& a, void* stream) {
  check_not_null(a.selected, "selected");
  MOESPEC_CHECK_ARG(a.selected.ndim == 2, "selected", "expected [B, C], got ", a.selected.describe());
  const int64_t B = a.selected.shape[0], C = a.selected.shape[1];
  check_not_null(a.mask, "mask");
  MOESPEC_CHECK_ARG(a.mask.ndim == 3, "mask", "expected [B, M + 1, W], got ", a.mask.describe());
  const int64_t M1 = a.mask.shape[1], W = a.mask.shape[2];
  MOESPEC_CHECK_ARG(M1 >= 1 && W == (M1 + 31) / 32, "mask", "expected W = ceil((M + 1) / 32) words per row, got ",
                    a.mask.describe());
  const int32_t dev = a.selected.device_index;
  const DType i32 = DType::kInt32;
  check_cuda(a.selected, "selected", i32, {B, C}, dev);
  check_cuda(a.count, "count", i32, {B}, dev);
  check_cuda(a.cand_parents, "cand_parents", i32, {B, C}, dev);
  check_cuda(a.cand_tokens, "cand_tokens", i32, {B, C}, dev);
  check_cuda(a.root_tokens, "root_tokens", i32, {B}, dev);
  check_cuda(a.tokens, "tokens", i32, {B, M1}, dev);
  check_cuda(a.parents, "parents", i32, {B, M1}, dev);
  check_cuda(a.depth, "depth", i32, {B, M1}, dev);
  check_cuda(a.mask, "mask", i32, {B, M1, W}, dev);
  check_cuda(a.num_nodes, "num_nodes", i32, {B}, dev);
  MOESPEC_CHECK_ARG(C <= (int64_t{1} << 14), "selected", "at most 16384 candidates per request, got ", C);
  if (B == 0) return;
  DeviceGuard guard(dev);
  tree_kernel<<<static_cast<unsigned>(B), 32, sizeof(int32_t) * static_cast<std::size_t>(C),
                static_cast<cudaStream_t>(stream)>>>(
      a.selected.ptr<const int32_t>(), a.count.ptr<const int32_t>(), a.cand_parents.ptr<const int32_t>(),
      a.cand_tokens.ptr<const int32_t>(), a.root_tokens.ptr<const int32_t>(), a.tokens.ptr<int32_t>(),
      a.parents.ptr<int32_t>(), a.depth.ptr<int32_t>(), a.mask.ptr<int32_t>(), a.num_nodes.ptr<int32_t>(),
      static_cast<int>(C), static_cast<int>(M1), static_cast<int>(W));
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw_runtime("moespec::cuda::tree_from_selection: launch failed: ", cudaGetErrorString(err));
}

}  // namespace cuda
}  // namespace moespec
