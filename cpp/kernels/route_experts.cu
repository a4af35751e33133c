// route_experts on the GPU: routing families + MoE-Spec expert budget (moespec::cuda::route_experts).
//
// Implements the contract of cpp/include/moespec/route_experts.h (DESIGN.md "Routing families",
// "Expert budget"); the semantics are those of the CPU reference cpp/src/route_experts.cc, and the
// arithmetic is detail/route_math.h's, so that results match it (see "Matching the CPU" below).
// Tests: tests/gpu/test_route_experts_cuda.py (CUDA against the CPU op), run by tests/gpu/run.sh.
//
// Steps 1 and 3's per-token device functions and the kernels' shared types: route_token.cuh.
//
// One fixed launch sequence on the caller's stream, no host synchronisation, no allocation (all
// scratch lives in the caller's workspace), so a call can be captured in a CUDA graph:
//   1. natural_route_kernel  one warp per token: the family's full probability row -> prob [T, N],
//                            its selection key and the natural top-K -> nat_ids [T, K]; for the
//                            budget score "gates" also the natural weights by expert -> gates
//                            [T, N] (0 where the token did not choose the expert) and the
//                            token's first choice -> first [T]
//   2. budget_set_kernel     one block: natural union, budget scores (a row of prob or gates a
//                            token), the order of the experts by rank (counted where N <= 256,
//                            else a bitonic sort), the coverage prefix, B_eff, whether the cap binds, the set S;
//                            also zeroes the accumulators of steps 3 and 4
//   3. final_route_kernel    one warp per token: final ids (unchanged / substitution /
//                            truncation), the family's weights, re-routed and dropped counts, the
//                            used-expert marks
//   4. active_kernel         one block: the sorted active list (padded with N), the stats and the
//                            count of tokens with non-finite input (route_experts_nonfinite_offset)
// With T = 0 steps 1 and 3 are not launched (steps 2 and 4 then write active = [N] * N, stats = 0).
// At decode and verify sizes (T <= 64, N <= 256) one block runs the four steps in one launch
// (fused_route_kernel, block barriers between the steps; MOESPEC_ROUTE_FUSED=0 turns it off).
//
// Matching the CPU: every float operation is the one route_experts.cc performs, in the same order
// (sums that the CPU does sequentially are sequential here too; the softmax sum follows the lane
// tree of detail::softmax_ref; budget scores are double sums in token order). Top-K here is ordered
// by (value desc, id asc): without ties that is the CPU's sorted order (softmax, gpt_oss), while
// deepseek_v3's CPU order is std::nth_element's (and ties may resolve differently everywhere).
// Where the CPU calls libm's expf (the tail of PyTorch's sigmoid and of its reduced-precision
// softmax) this code uses (float)exp(double), nearly always the correctly rounded value, which is
// what glibc's expf (error < 0.502 ulp) returns in all but rare cases. nvcc contracts a * b + c into
// an fma by default: the sums below either add no product or one that is exact (see the comments).
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "device_common.cuh"
#include "route_token.cuh"
#include "moespec/detail/route_math.h"
#include "moespec/error.h"
#include "moespec/route_experts.h"

namespace moespec {
namespace cuda {
namespace {

// Steps 1 and 3 and the types the kernels share are in route_token.cuh.

__global__ void __launch_bounds__(kTokenThreads) natural_route_kernel(Params p) {
  __shared__ float s_x[kWarpsPerBlock][kMaxExperts];        // logits
  __shared__ float s_y[kWarpsPerBlock][kMaxExperts];        // probability, or the selection key
  __shared__ float s_group[kWarpsPerBlock][kMaxExperts / 2];  // deepseek_v3 group scores; natural weights
  const int warp = static_cast<int>(threadIdx.x) / kWarp, lane = static_cast<int>(threadIdx.x) % kWarp;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp;
  if (t >= p.T) return;  // whole warps; this kernel has no block-wide barrier
  natural_route_token(p, t, s_x[warp], s_y[warp], s_group[warp], lane);
}

// 2. One block of at least max(N, 64) threads: the budget set. Mirrors route_experts.cc
// choose_budget_set; scores are sorted by (score desc, id asc) with a bitonic sort, which for
// this total order gives the CPU's stable_sort order.
// The block's shared state of the budget set, for up to kCap experts (a power of two >= N).
template <int kCap>
struct BudgetShared {
  int32_t mark[kCap];    // natural union; then (score "gates") the first-choice marks by expert id
  double score[kCap];    // budget score by expert id
  double key[kCap];      // scores sorted, then their running sums
  int32_t order[kCap];   // expert ids sorted by score
  double total;
};

// An expert's rank is (first choice desc, score desc, id asc). Up to kCountedRankMax experts it is
// counted (N^2 / threads comparisons a thread, three barriers); beyond, a bitonic sort (log2(N)^2 / 2
// barrier-separated steps: 28 at N = 128, most of the budget step's time before the count).
constexpr int kCountedRankMax = 256;

// Whether expert a ranks before expert b, given their first-choice marks f and score keys k.
template <typename Key>
__device__ __forceinline__ bool ranks_before(int32_t fa, Key ka, int32_t a, int32_t fb, Key kb, int32_t b) {
  return fa > fb || (fa == fb && (ka > kb || (ka == kb && a < b)));
}

// The order-preserving bits of a score (-0 as +0): a total order even for a NaN, which a non-finite
// input can put in a score (reported by the stats), so that the ranks stay a permutation.
__device__ __forceinline__ uint64_t score_bits(double v) {
  if (v == 0.0) v = 0.0;
  const uint64_t u = static_cast<uint64_t>(__double_as_longlong(v));
  return (u >> 63) ? ~u : (u | (uint64_t{1} << 63));
}

// The whole block, threads >= N (both callers): each of N experts counts the experts ranked before
// it, threads / N threads an expert over every (threads / N)-th other (a warp's lanes read the same
// entry: broadcasts); then s_order[rank] = e and s_key[rank] = its score.
__device__ void rank_by_counting(int N, const int32_t* s_mark, const double* s_score, double* s_key,
                                 int32_t* s_order) {
  const int tid = static_cast<int>(threadIdx.x), parts = static_cast<int>(blockDim.x) / N;
  for (int e = tid; e < N; e += static_cast<int>(blockDim.x)) {
    s_key[e] = __longlong_as_double(static_cast<long long>(score_bits(s_score[e])));  // (bits, for the count)
    s_order[e] = 0;  // (the rank, as it is counted)
  }
  __syncthreads();
  if (tid < parts * N) {
    const int e = tid % N;
    const int32_t fe = s_mark[e];
    const uint64_t ke = static_cast<uint64_t>(__double_as_longlong(s_key[e]));
    int before = 0;
    for (int j = tid / N; j < N; j += parts) {
      const int32_t fj = s_mark[j];
      const uint64_t kj = static_cast<uint64_t>(__double_as_longlong(s_key[j]));
      before += ranks_before(fj, kj, j, fe, ke, e) ? 1 : 0;
    }
    atomicAdd(&s_order[e], before);  // (integers: the same count in any order)
  }
  __syncthreads();
  const int rank = tid < N ? s_order[tid] : 0;
  __syncthreads();
  if (tid < N) {
    s_order[rank] = tid;
    s_key[rank] = s_score[tid];
  }
  __syncthreads();
}

// The whole block: a bitonic sort of the padded (power of two) entries by rank; padding (ids >= N,
// first-choice mark 0, score -1) sorts after the scores, which are >= 0.
__device__ void rank_by_bitonic_sort(int N, int padded, const int32_t* s_mark, const double* s_score, double* s_key,
                                     int32_t* s_order) {
  const int tid = static_cast<int>(threadIdx.x), threads = static_cast<int>(blockDim.x);
  for (int i = tid; i < padded; i += threads) {
    s_key[i] = i < N ? s_score[i] : -1.0;
    s_order[i] = i;
  }
  __syncthreads();
  for (int size = 2; size <= padded; size *= 2) {
    for (int stride = size / 2; stride > 0; stride /= 2) {
      for (int i = tid; i < padded; i += threads) {
        const int j = i ^ stride;
        if (j <= i) continue;
        const double ki = s_key[i], kj = s_key[j];
        const int32_t oi = s_order[i], oj = s_order[j];
        const int32_t fi = s_mark[oi], fj = s_mark[oj];
        if ((i & size) == 0 ? ranks_before(fj, kj, oj, fi, ki, oi) : ranks_before(fi, ki, oi, fj, kj, oj)) {
          s_key[i] = kj;
          s_key[j] = ki;
          s_order[i] = oj;
          s_order[j] = oi;
        }
      }
      __syncthreads();
    }
  }
}

// The whole block (at least max(N, 64) threads); returns uniformly.
template <int kCap>
__device__ void budget_set_block(const Params& p, BudgetShared<kCap>& sh) {
  int32_t* s_mark = sh.mark;
  double* s_score = sh.score;
  double* s_key = sh.key;
  int32_t* s_order = sh.order;
  double& s_total = sh.total;
  const int tid = static_cast<int>(threadIdx.x), threads = static_cast<int>(blockDim.x);
  const int N = p.N, K = p.K;
  int32_t* counters = p.ws.counters;

  for (int e = tid; e < N; e += threads) {
    s_mark[e] = 0;
    p.ws.used[e] = 0;
  }
  if (tid == 0) {
    counters[kRerouted] = 0;
    counters[kDropped] = 0;
  }
  __syncthreads();
  const int64_t slots = p.T * K;
  for (int64_t i = tid; i < slots; i += threads) {
    const int32_t e = p.ws.nat_ids[i];
    if (e >= 0 && e < N) s_mark[e] = 1;
  }
  __syncthreads();
  const int natural = __syncthreads_count(tid < N && s_mark[tid] != 0);  // threads >= N
  if (tid == 0) counters[kNatural] = natural;

  const bool coverage = p.coverage > 0.0;
  int budget = p.max_experts < N ? p.max_experts : N;
  if (p.max_experts == 0 || (!coverage && (budget >= N || natural <= budget))) {
    if (tid == 0) counters[kCapped] = 0;
    return;  // uniform: every thread returns
  }

  // s_e = sum over t in order of w_t * p_te (score "gates": w_t * the token's natural weight on e,
  // 0 where e is not among its top-K: adding w_t * 0 = +0 leaves the sum's bits as the CPU's, which
  // has no such term), in double (the _rn intrinsics are never fused; the product of two floats is
  // exact in double anyway).
  const bool gates = p.score == BudgetScore::kGates;
  if (tid < N) {
    double acc = 0.0;
    const float* row = (gates ? p.ws.gates : p.ws.prob) + tid;
    for (int64_t t = 0; t < p.T; ++t) {
      const double wt = p.token_weights ? static_cast<double>(p.token_weights[t]) : 1.0;
      acc = __dadd_rn(acc, __dmul_rn(wt, static_cast<double>(row[t * N])));
    }
    s_score[tid] = acc;
  }
  // s_mark becomes the first-choice marks (all 0 for score "probability"), padding included; then
  // the experts sorted by rank go to s_order, their scores to s_key.
  int padded = 2;
  while (padded < N) padded *= 2;
  for (int i = tid; i < padded; i += threads) s_mark[i] = 0;
  __syncthreads();
  if (gates)
    for (int64_t t = tid; t < p.T; t += threads)
      if (p.ws.first[t] >= 0) s_mark[p.ws.first[t]] = 1;
  if (N <= kCountedRankMax)
    rank_by_counting(N, s_mark, s_score, s_key, s_order);
  else
    rank_by_bitonic_sort(N, padded, s_mark, s_score, s_key, s_order);

  if (coverage) {
    // total in id order and the running sums in score order, both sequential as on the CPU
    // (two threads of different warps work at the same time).
    if (tid == 0) {
      double cumulative = 0.0;
      for (int i = 0; i < N; ++i) {
        cumulative += s_key[i];
        s_key[i] = cumulative;
      }
    } else if (tid == kWarp) {
      double total = 0.0;
      for (int e = 0; e < N; ++e) total += s_score[e];
      s_total = total;
    }
    __syncthreads();
    const double total = s_total;
    const int below = __syncthreads_count(tid < N && total > 0.0 && s_key[tid] / total < p.coverage);
    int m = total > 0.0 ? below + 1 : 1;
    m = m < K ? K : m;
    m = m > N ? N : m;
    budget = m < budget ? m : budget;
  }
  const bool capped = budget < N && natural > budget;
  if (tid == 0) counters[kCapped] = capped ? 1 : 0;
  if (!capped) return;  // uniform
  for (int e = tid; e < N; e += threads) p.ws.in_set[e] = 0;
  __syncthreads();
  for (int i = tid; i < budget; i += threads) {
    const int32_t e = s_order[i];
    if (e < N) p.ws.in_set[e] = 1;
  }
}

__global__ void __launch_bounds__(kMaxThreads) budget_set_kernel(Params p) {
  __shared__ BudgetShared<kMaxExperts> sh;
  budget_set_block(p, sh);
}

__global__ void __launch_bounds__(kTokenThreads) final_route_kernel(Params p) {
  __shared__ float s_key[kWarpsPerBlock][kMaxExperts];  // substitution's selection key
  __shared__ int32_t s_ids[kWarpsPerBlock][kMaxTopK];
  __shared__ float s_w[kWarpsPerBlock][kMaxTopK];
  const int warp = static_cast<int>(threadIdx.x) / kWarp, lane = static_cast<int>(threadIdx.x) % kWarp;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp;
  if (t >= p.T) return;  // whole warps; this kernel has no block-wide barrier
  final_route_token(p, t, s_key[warp], s_ids[warp], s_w[warp], lane);
}

// 4. One block of round_up(N, 32) threads: active = the used ids ascending, then N; stats.
// The whole block (at least N threads, whole warps).
__device__ void active_block(const Params& p) {
  __shared__ int32_t s_warp_count[kMaxThreads / kWarp];
  const int e = static_cast<int>(threadIdx.x), lane = e % kWarp, warp = e / kWarp;
  const int warps = static_cast<int>(blockDim.x) / kWarp;
  const int N = p.N;
  const bool used = e < N && p.ws.used[e] != 0;
  const unsigned ballot = __ballot_sync(kFullMask, used);
  if (lane == 0) s_warp_count[warp] = __popc(ballot);
  __syncthreads();
  int before = __popc(ballot & ((1u << lane) - 1u)), count = 0;
  for (int v = 0; v < warps; ++v) {
    before += v < warp ? s_warp_count[v] : 0;
    count += s_warp_count[v];
  }
  if (e < N) {
    if (used) p.active[before] = e;
    else p.active[count + (e - before)] = N;  // `e - before` unused experts precede e
  }
  if (e == 0) {
    p.stats[0] = p.ws.counters[kNatural];
    p.stats[1] = count;
    p.stats[2] = p.ws.counters[kRerouted];
    p.stats[3] = p.ws.counters[kDropped];
  }
  // The tokens with non-finite input (integer sum: the same count in any order).
  __shared__ int32_t s_bad;
  if (e == 0) s_bad = 0;
  __syncthreads();
  int bad = 0;
  for (int64_t t = e; t < p.T; t += blockDim.x) bad += p.ws.bad[t];
  bad = device::warp_add(bad);
  if (lane == 0 && bad != 0) atomicAdd(&s_bad, bad);
  __syncthreads();
  if (e == 0) p.ws.counters[kNonFinite] = s_bad;
}

__global__ void __launch_bounds__(kMaxThreads) active_kernel(Params p) { active_block(p); }

// Steps 1-4 in one block, for decode and verify sizes (T <= kFusedMaxTokens, N <= kFusedMaxExperts):
// the same device functions, block barriers where the launch boundaries were; each warp takes
// tokens warp, warp + kFusedWarps, ... Three launch gaps and ramps fewer, so that routing + budget
// is a small share of a captured verify layer.
constexpr int kFusedWarps = 16;
constexpr int kFusedThreads = kFusedWarps * kWarp;
constexpr int kFusedMaxExperts = 256;
constexpr int64_t kFusedMaxTokens = 64;
static_assert(kFusedMaxExperts <= kFusedThreads, "the budget and active steps hold one expert per thread");
static_assert(2 * kMaxTopK <= kFusedMaxExperts / 2, "a token's final ids and weights fit its group scratch");

__global__ void __launch_bounds__(kFusedThreads) fused_route_kernel(Params p, bool early) {
  __shared__ float s_x[kFusedWarps][kFusedMaxExperts];
  __shared__ float s_y[kFusedWarps][kFusedMaxExperts];
  __shared__ float s_group[kFusedWarps][kFusedMaxExperts / 2];  // group scores, natural weights; final ids, weights
  __shared__ BudgetShared<kFusedMaxExperts> sh;
  device::release_and_wait(early);  // (launched as a programmatic dependent: device_common.cuh)
  const int warp = static_cast<int>(threadIdx.x) / kWarp, lane = static_cast<int>(threadIdx.x) % kWarp;
  for (int64_t t = warp; t < p.T; t += kFusedWarps) {
    natural_route_token(p, t, s_x[warp], s_y[warp], s_group[warp], lane);
    __syncwarp();  // the next token's writes to the scratch wait for this one's reads
  }
  __syncthreads();
  budget_set_block(p, sh);
  __syncthreads();
  int32_t* ids = reinterpret_cast<int32_t*>(s_group[warp]);
  for (int64_t t = warp; t < p.T; t += kFusedWarps) {
    final_route_token(p, t, s_y[warp], ids, s_group[warp] + kMaxTopK, lane);
    __syncwarp();  // the next token's writes to the scratch wait for this one's reads
  }
  __syncthreads();
  active_block(p);
}

// MOESPEC_ROUTE_FUSED=0 takes the four-launch path at every size (to compare the two); unset or 1:
// the fused kernel where it fits; anything else is an error naming the variable.
bool fused_allowed() { return env_switch("MOESPEC_ROUTE_FUSED"); }

// ---------------------------------------------------------------------------------------------
// Host side

constexpr std::size_t kAlign = 128;
constexpr std::size_t align_up(std::size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

// Byte offsets of the workspace sections; `total` is the size route_experts_workspace_size reports.
struct Layout {
  std::size_t counters, in_set, used, nat_ids, prob, bad, gates, first, total;
  Layout(int64_t T, int64_t N, int64_t K) {
    const std::size_t t = static_cast<std::size_t>(T), n = static_cast<std::size_t>(N),
                      k = static_cast<std::size_t>(K);
    counters = 0;
    in_set = counters + align_up(sizeof(int32_t) * kNumCounters);
    used = in_set + align_up(sizeof(int32_t) * n);
    nat_ids = used + align_up(sizeof(int32_t) * n);
    prob = nat_ids + align_up(sizeof(int32_t) * t * k);
    bad = prob + align_up(sizeof(float) * t * n);
    gates = bad + align_up(sizeof(int32_t) * t);
    first = gates + align_up(sizeof(float) * t * n);
    total = first + align_up(sizeof(int32_t) * t);
  }
};

void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) throw_runtime("route_experts: ", what, " failed: ", cudaGetErrorString(status));
}


int round_up_warp(int n) { return (n + kWarp - 1) / kWarp * kWarp; }

}  // namespace

bool available() { return true; }

std::size_t route_experts_nonfinite_offset() { return Layout(0, 0, 0).counters + sizeof(int32_t) * kNonFinite; }

std::size_t route_experts_workspace_size(int64_t T, int64_t N, int64_t K) {
  MOESPEC_CHECK_ARG(T >= 0, "T", "must be >= 0, got ", T);
  MOESPEC_CHECK_ARG(N >= 0, "N", "must be >= 0, got ", N);
  MOESPEC_CHECK_ARG(K >= 0, "K", "must be >= 0, got ", K);
  return Layout(T, N, K).total;
}

void route_experts(const RouteExpertsArgs& args, void* workspace, std::size_t workspace_bytes, void* stream) {
  validate_route_experts(args, Device::kCUDA);
  const int64_t T = args.router_logits.shape[0];
  const int32_t N = static_cast<int32_t>(args.router_logits.shape[1]);
  const int32_t K = args.spec.top_k;
  constexpr int64_t kMaxTokens = static_cast<int64_t>(0x7fffffff) * kWarpsPerBlock;
  MOESPEC_CHECK_ARG(T <= kMaxTokens, "router_logits", "at most ", kMaxTokens, " tokens, got ", T);
  const Layout layout(T, N, K);
  MOESPEC_CHECK_ARG(workspace_bytes >= layout.total, "workspace", "needs route_experts_workspace_size(T=", T,
                    ", N=", N, ", K=", K, ") = ", layout.total, " bytes, got ", workspace_bytes);
  MOESPEC_CHECK_ARG(workspace != nullptr, "workspace", "is null");
  MOESPEC_CHECK_ARG(reinterpret_cast<uintptr_t>(workspace) % 16 == 0, "workspace",
                    "must be 16-byte aligned, got address ", workspace);

  char* base = static_cast<char*>(workspace);
  Params p;
  p.logits = args.router_logits.data;
  p.ld = args.router_logits.strides[0];
  p.dtype = args.router_logits.dtype;
  p.bias = args.bias.defined() ? args.bias.ptr<const float>() : nullptr;
  p.token_weights = args.token_weights.defined() ? args.token_weights.ptr<const float>() : nullptr;
  p.ids = args.ids.ptr<int32_t>();
  p.weights = args.weights.ptr<float>();
  p.active = args.active.ptr<int32_t>();
  p.stats = args.stats.ptr<int32_t>();
  p.T = T;
  p.N = N;
  p.K = K;
  p.family = args.spec.family;
  p.renormalize = args.spec.renormalize;
  p.n_group = args.spec.n_group;
  p.topk_group = args.spec.topk_group;
  p.scaling = args.spec.scaling;
  p.max_experts = args.budget.max_experts;
  p.policy = args.budget.policy;
  p.coverage = args.budget.coverage;
  p.score = args.budget.score;
  p.width = args.softmax_vector_width;
  const int64_t total = T * N;
  p.sigmoid_tail = total - total % (2 * static_cast<int64_t>(args.softmax_vector_width));
  p.ws.counters = reinterpret_cast<int32_t*>(base + layout.counters);
  p.ws.in_set = reinterpret_cast<int32_t*>(base + layout.in_set);
  p.ws.used = reinterpret_cast<int32_t*>(base + layout.used);
  p.ws.nat_ids = reinterpret_cast<int32_t*>(base + layout.nat_ids);
  p.ws.prob = reinterpret_cast<float*>(base + layout.prob);
  p.ws.bad = reinterpret_cast<int32_t*>(base + layout.bad);
  p.ws.gates = reinterpret_cast<float*>(base + layout.gates);
  p.ws.first = reinterpret_cast<int32_t*>(base + layout.first);

  DeviceGuard guard(args.router_logits.device_index);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (T <= kFusedMaxTokens && N <= kFusedMaxExperts && fused_allowed()) {
    const Pdl pdl = pdl_launch();
    check_cuda(launch_kernel(pdl, fused_route_kernel, dim3(1), dim3(kFusedThreads), 0, s, p, pdl.early),
               "launching fused_route_kernel");
    return;
  }
  const unsigned token_blocks = static_cast<unsigned>((T + kWarpsPerBlock - 1) / kWarpsPerBlock);
  const int expert_threads = round_up_warp(N);
  const dim3 tokens(token_blocks), token_block(kTokenThreads);
  const dim3 budget_block(static_cast<unsigned>(expert_threads < 2 * kWarp ? 2 * kWarp : expert_threads));
  if (T > 0) check_cuda(launch_kernel(Pdl{}, natural_route_kernel, tokens, token_block, 0, s, p), "launching natural_route_kernel");
  check_cuda(launch_kernel(Pdl{}, budget_set_kernel, dim3(1), budget_block, 0, s, p), "launching budget_set_kernel");
  if (T > 0) check_cuda(launch_kernel(Pdl{}, final_route_kernel, tokens, token_block, 0, s, p), "launching final_route_kernel");
  check_cuda(launch_kernel(Pdl{}, active_kernel, dim3(1), dim3(static_cast<unsigned>(expert_threads)), 0, s, p),
             "launching active_kernel");
}

}  // namespace cuda
}  // namespace moespec
