// route_experts on the GPU: routing families + MoE-Spec expert budget (moespec::cuda::route_experts).
//
// Implements the contract of cpp/include/moespec/route_experts.h (DESIGN.md "Routing families",
// "Expert budget"); the semantics are those of the CPU reference cpp/src/route_experts.cc, and the
// arithmetic is detail/route_math.h's, so that results match it (see "Matching the CPU" below).
// Tests: tests/gpu/test_route_experts_cuda.py (CUDA against the CPU op), run by tests/gpu/run.sh.
//
// One fixed launch sequence on the caller's stream, no host synchronisation, no allocation (all
// scratch lives in the caller's workspace), so a call can be captured in a CUDA graph:
//   1. natural_route_kernel  one warp per token: the family's full probability row -> prob [T, N],
//                            its selection key and the natural top-K -> nat_ids [T, K]; for the
//                            budget score "gates" also the natural weights -> nat_w [T, K] and the
//                            token's first choice -> first [T]
//   2. budget_set_kernel     one block: natural union, budget scores, the order of the experts by
//                            rank, the coverage prefix, B_eff, whether the cap binds, the set S;
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
#include "moespec/detail/route_math.h"
#include "moespec/error.h"
#include "moespec/route_experts.h"

namespace moespec {
namespace cuda {
namespace {

// T tokens, N experts, K top-k, G deepseek_v3 groups.
constexpr int kWarp = 32;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kWarpsPerBlock = 4;  // tokens per block of the per-token kernels
constexpr int kTokenThreads = kWarp * kWarpsPerBlock;
constexpr int kMaxThreads = 1024;
static_assert(kMaxExperts <= kMaxThreads, "the one-block kernels hold one expert per thread");
static_assert(kMaxExperts <= kWarp * 32, "a lane's experts of a row fit a 32-bit mask");

// Workspace counters (int32).
enum Counter : int {
  kNatural = 0,   // natural union size
  kCapped = 1,    // 1 when the cap binds (tokens are re-routed)
  kRerouted = 2,  // slots holding an expert the token did not choose naturally (substitution)
  kDropped = 3,   // slots dropped (truncation)
  kNonFinite = 4,  // tokens with a non-finite logit, bias or token weight (written by step 4)
  kNumCounters = 16,  // room to grow
};

// The workspace, carved from the caller's buffer; every section 128-byte aligned.
struct Workspace {
  int32_t* counters;  // [kNumCounters]
  int32_t* in_set;    // [N] 1 for experts of the budget set S (written only when the cap binds)
  int32_t* used;      // [N] 1 for experts used by a final slot
  int32_t* nat_ids;   // [T, K] natural top-K
  float* prob;        // [T, N] the family's full probability (softmax, or sigmoid for deepseek_v3)
  int32_t* bad;       // [T] 1 for a token with a non-finite input (step 1)
  float* nat_w;       // [T, K] natural weights (score "gates" only)
  int32_t* first;     // [T] the token's first choice, -1 for a token of weight 0 (score "gates" only)
};

constexpr std::size_t kAlign = 128;
constexpr std::size_t align_up(std::size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

// Byte offsets of the workspace sections; `total` is the size route_experts_workspace_size reports.
struct Layout {
  std::size_t counters, in_set, used, nat_ids, prob, bad, nat_w, first, total;
  Layout(int64_t T, int64_t N, int64_t K) {
    const std::size_t t = static_cast<std::size_t>(T), n = static_cast<std::size_t>(N),
                      k = static_cast<std::size_t>(K);
    counters = 0;
    in_set = counters + align_up(sizeof(int32_t) * kNumCounters);
    used = in_set + align_up(sizeof(int32_t) * n);
    nat_ids = used + align_up(sizeof(int32_t) * n);
    prob = nat_ids + align_up(sizeof(int32_t) * t * k);
    bad = prob + align_up(sizeof(float) * t * n);
    nat_w = bad + align_up(sizeof(int32_t) * t);
    first = nat_w + align_up(sizeof(float) * t * k);
    total = first + align_up(sizeof(int32_t) * t);
  }
};

// Everything the kernels read, passed by value.
struct Params {
  const void* logits;          // [T, N] with row stride ld, dtype `dtype`
  int64_t ld;
  DType dtype;
  const float* bias;           // [N] or null
  const float* token_weights;  // [T] or null
  int32_t* ids;                // out [T, K]
  float* weights;              // out [T, K]
  int32_t* active;             // out [N]
  int32_t* stats;              // out [4]
  int64_t T;
  int32_t N, K;
  RouterFamily family;
  bool renormalize;
  int32_t n_group, topk_group;
  float scaling;
  int32_t max_experts;
  BudgetPolicy policy;
  double coverage;
  BudgetScore score;
  int32_t width;               // softmax_vector_width
  int64_t sigmoid_tail;        // flat index from which the CPU's sigmoid uses libm's expf
  Workspace ws;
};

// ---------------------------------------------------------------------------------------------
// Device helpers

__device__ __forceinline__ float load_logit(const Params& p, int64_t t, int e) {
  const int64_t i = t * p.ld + e;
  switch (p.dtype) {
    case DType::kFloat32: return static_cast<const float*>(p.logits)[i];
    case DType::kBFloat16: return detail::bf16_to_float(static_cast<const uint16_t*>(p.logits)[i]);
    default: return detail::half_to_float(static_cast<const uint16_t*>(p.logits)[i]);
  }
}

// expf as glibc computes it (see "Matching the CPU" above).
__device__ __forceinline__ float expf_libm(float x) { return static_cast<float>(exp(static_cast<double>(x))); }

// A 64-bit key whose unsigned order is (value desc, id asc): the float's bits mapped to an
// order-preserving unsigned (+0 and -0 equal), then the id complemented so that a lower id wins.
// The low half is never 0, so 0 means "no candidate".
constexpr uint32_t kIdComplement = 0xffffu;

__device__ __forceinline__ uint64_t topk_key(float v, int e) {
  if (v == 0.0f) v = 0.0f;  // -0 -> +0
  const uint32_t u = __float_as_uint(v);
  const uint32_t ordered = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return (static_cast<uint64_t>(ordered) << 32) | (kIdComplement - static_cast<uint32_t>(e));
}

__device__ __forceinline__ uint64_t warp_max(uint64_t v) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    const uint64_t other = __shfl_xor_sync(kFullMask, v, offset);
    v = other > v ? other : v;
  }
  return v;
}

__device__ __forceinline__ int warp_sum(int v) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

// The best not-yet-taken entry among this lane's experts e = lane + 32 j (bit j of `taken`).
__device__ __forceinline__ uint64_t lane_best(const float* vals, int n, int lane, uint32_t taken) {
  uint64_t best = 0;
  for (int j = 0, e = lane; e < n; ++j, e += kWarp) {
    if ((taken >> j) & 1u) continue;
    const uint64_t key = topk_key(vals[e], e);
    best = key > best ? key : best;
  }
  return best;
}

// Top-k of vals[0, n) (k <= n), ordered by (value desc, id asc), written by lane 0 to out[0, k).
// Whole warp; vals may be shared or global memory.
__device__ void warp_topk(const float* vals, int n, int k, int32_t* out, int lane) {
  uint32_t taken = 0;
  uint64_t best = lane_best(vals, n, lane, taken);
  for (int r = 0; r < k; ++r) {
    const uint64_t winner = warp_max(best);
    // winner is 0 only if fewer than k entries exist, which validation rules out; then n (dropped).
    const int e = winner ? static_cast<int>(kIdComplement - static_cast<uint32_t>(winner)) : n;
    if (lane == 0) out[r] = e;
    if (e < n && e % kWarp == lane) {
      taken |= 1u << (e / kWarp);
      best = lane_best(vals, n, lane, taken);
    }
  }
}

// y = softmax(x) over n values, as detail::softmax_ref with `width` lanes: lane l < width sums
// y[l], y[l + width], ... in order, then the lanes pairwise as a tree (a row shorter than width is
// summed sequentially). Whole warp; x and y are this warp's shared rows.
__device__ void warp_softmax(const float* x, float* y, int n, int width, int lane) {
  float m = -INFINITY;
  for (int e = lane; e < n; e += kWarp) m = x[e] > m ? x[e] : m;
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    const float other = __shfl_xor_sync(kFullMask, m, offset);
    m = other > m ? other : m;
  }
  for (int e = lane; e < n; e += kWarp) y[e] = detail::exp_ref(x[e] - m);
  __syncwarp();
  float acc = 0.0f;
  if (n < width) {
    if (lane == 0) {
      acc = y[0];
      for (int i = 1; i < n; ++i) acc += y[i];
    }
  } else {
    if (lane < width) {
      acc = y[lane];
      for (int i = lane + width; i < n; i += width) acc += y[i];
    }
    for (int half = width / 2; half >= 1; half /= 2) acc += __shfl_down_sync(kFullMask, acc, half);
  }
  const float r = 1.0f / __shfl_sync(kFullMask, acc, 0);
  __syncwarp();  // every lane has read y before it is overwritten
  for (int e = lane; e < n; e += kWarp) y[e] *= r;
  __syncwarp();
}

// deepseek_v3's group limit on the selection key sel[0, N): each group's score is the sum of its
// two best values; the topk_group best groups (ties: lower group id) stay, the others' experts
// become -inf. Whole warp; group_score is this warp's shared scratch of G floats.
__device__ void mask_groups(float* sel, int n, int groups, int keep, float* group_score, int lane) {
  const int per = n / groups;
  for (int g = lane; g < groups; g += kWarp) {
    float best = -INFINITY, second = -INFINITY;
    for (int e = g * per; e < (g + 1) * per; ++e) {
      const float v = sel[e];
      if (v > best) {
        second = best;
        best = v;
      } else if (v > second) {
        second = v;
      }
    }
    group_score[g] = best + second;
  }
  __syncwarp();
  for (int g = lane; g < groups; g += kWarp) {
    const float s = group_score[g];
    int rank = 0;
    for (int h = 0; h < groups; ++h) rank += (group_score[h] > s || (group_score[h] == s && h < g)) ? 1 : 0;
    if (rank >= keep)
      for (int e = g * per; e < (g + 1) * per; ++e) sel[e] = -INFINITY;
  }
  __syncwarp();
}

// aten's BFloat16/Half softmax over a short row, as route_experts.cc softmax_reduced_like_torch:
// the first n - n % width values take exp_ref and a lane-tree sum, the rest libm's expf and a
// sequential sum; results rounded to the reduced type. In place; one thread.
__device__ void softmax_reduced(float* x, int n, int width, DType dtype) {
  float m = x[0];
  for (int i = 1; i < n; ++i) m = x[i] > m ? x[i] : m;
  const int vec = n - n % width;
  float sum = 0.0f;
  if (vec > 0) {
    float lanes[16] = {};
    for (int i = 0; i < vec; ++i) {
      x[i] = detail::exp_ref(x[i] - m);
      lanes[i % width] = __fadd_rn(lanes[i % width], x[i]);  // never fused with exp_ref's last multiply
    }
    for (int half = width / 2; half >= 1; half /= 2)
      for (int l = 0; l < half; ++l) lanes[l] += lanes[l + half];
    sum = lanes[0];
  }
  for (int i = vec; i < n; ++i) {
    x[i] = expf_libm(x[i] - m);
    sum += x[i];
  }
  const float r = 1.0f / sum;
  for (int i = 0; i < n; ++i) {
    const float v = x[i] * r;
    x[i] = dtype == DType::kBFloat16 ? detail::bf16_to_float(detail::float_to_bf16(v))
                                     : detail::half_to_float(detail::float_to_half(v));
  }
}

// The family's weights of one token's final slots, as route_experts.cc compute_weights. On entry
// w[j] holds the gathered value of slot j: prob (softmax, deepseek_v3) or the logit (gpt_oss), 0
// resp. -inf for a dropped slot. One thread.
__device__ void finish_weights(const Params& p, const int32_t* ids, float* w) {
  const int k = p.K;
  switch (p.family) {
    case RouterFamily::kSoftmax:
      if (p.renormalize) {
        const float sum = detail::short_sum_ref(w, k);
        for (int j = 0; j < k; ++j) w[j] = sum > 0.0f ? w[j] / sum : 0.0f;
      }
      break;
    case RouterFamily::kDeepSeekV3:
      if (p.renormalize) {
        const float denominator = detail::short_sum_ref(w, k) + 1e-20f;
        for (int j = 0; j < k; ++j) w[j] /= denominator;
      }
      for (int j = 0; j < k; ++j) w[j] *= p.scaling;
      break;
    default: {  // gpt_oss
      bool any = false;
      for (int j = 0; j < k; ++j) any = any || ids[j] < p.N;
      if (!any) {
        for (int j = 0; j < k; ++j) w[j] = 0.0f;
      } else if (p.dtype != DType::kFloat32) {
        softmax_reduced(w, k, p.width, p.dtype);
      } else {
        detail::softmax_ref(w, w, k, p.width);
      }
      break;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Kernels

// Score "gates": token t's natural weights (nat_w) and first choice (first: the slot of largest
// weight, ties the lower id; -1 for a token of weight 0), as route_experts.cc score_experts. Lane 0,
// after warp_topk has written nat_ids (the same thread) and the warp's prob row is in memory.
__device__ void natural_gates(const Params& p, int64_t t) {
  const int K = p.K;
  const int32_t* nat = p.ws.nat_ids + t * K;
  const float* prob = p.ws.prob + t * p.N;
  float w[kMaxTopK];
  for (int j = 0; j < K; ++j) w[j] = p.family == RouterFamily::kGptOss ? load_logit(p, t, nat[j]) : prob[nat[j]];
  finish_weights(p, nat, w);
  int best = 0;
  for (int j = 0; j < K; ++j) {
    p.ws.nat_w[t * K + j] = w[j];
    if (w[j] > w[best] || (w[j] == w[best] && nat[j] < nat[best])) best = j;
  }
  const bool weighted = p.token_weights == nullptr || p.token_weights[t] > 0.0f;
  p.ws.first[t] = weighted ? nat[best] : -1;
}

// 1. One warp per token: prob row, selection key, natural top-K.
// Token t by one warp; x, y (N floats) and group (N / 2) are the warp's shared scratch.
__device__ void natural_route_token(const Params& p, int64_t t, float* x, float* y, float* group, int lane) {
  const int N = p.N;
  float* prob = p.ws.prob + t * N;
  bool finite = true;
  for (int e = lane; e < N; e += kWarp) {
    x[e] = load_logit(p, t, e);
    finite = finite && isfinite(x[e]) && (p.bias == nullptr || isfinite(p.bias[e]));
  }
  if (p.token_weights != nullptr) finite = finite && isfinite(p.token_weights[t]) && p.token_weights[t] >= 0.0f;
  const bool bad = __any_sync(kFullMask, !finite);
  if (lane == 0) p.ws.bad[t] = bad ? 1 : 0;
  __syncwarp();

  const float* key;
  if (p.family == RouterFamily::kDeepSeekV3) {
    // prob = sigmoid (libm's expf on the tensor's tail, as PyTorch); key = prob + bias. (In
    // sigmoid_ref's 1 + exp_ref(-x) an fma may absorb exp_ref's last multiply, by a power of two:
    // exact unless the result is subnormal, and then 1 + it rounds to 1 either way.)
    for (int e = lane; e < N; e += kWarp) {
      const float v = x[e];
      const float s = t * N + e >= p.sigmoid_tail ? 1.0f / (1.0f + expf_libm(-v)) : detail::sigmoid_ref(v);
      prob[e] = s;
      y[e] = s + (p.bias ? p.bias[e] : 0.0f);
    }
    __syncwarp();
    if (p.n_group > 1 && p.topk_group < p.n_group) mask_groups(y, N, p.n_group, p.topk_group, group, lane);
    key = y;
  } else {
    if (p.family == RouterFamily::kSoftmax || p.max_experts > 0) {
      warp_softmax(x, y, N, p.width, lane);
      for (int e = lane; e < N; e += kWarp) prob[e] = y[e];
    }
    key = p.family == RouterFamily::kSoftmax ? y : x;
  }
  warp_topk(key, N, p.K, p.ws.nat_ids + t * p.K, lane);
  if (p.score == BudgetScore::kGates && p.max_experts > 0) {  // (warp-uniform)
    __syncwarp();  // every lane's prob row entries are visible to lane 0
    if (lane == 0) natural_gates(p, t);
  }
}

__global__ void __launch_bounds__(kTokenThreads) natural_route_kernel(Params p) {
  __shared__ float s_x[kWarpsPerBlock][kMaxExperts];        // logits
  __shared__ float s_y[kWarpsPerBlock][kMaxExperts];        // probability, or the selection key
  __shared__ float s_group[kWarpsPerBlock][kMaxExperts / 2];  // deepseek_v3 group scores
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
  // no term where e is not among its top-K), in double (the _rn intrinsics are never fused; the
  // product of two floats is exact in double anyway).
  const bool gates = p.score == BudgetScore::kGates;
  if (tid < N) {
    double acc = 0.0;
    const float* prob = p.ws.prob + tid;
    for (int64_t t = 0; t < p.T; ++t) {
      const double wt = p.token_weights ? static_cast<double>(p.token_weights[t]) : 1.0;
      if (!gates) {
        acc = __dadd_rn(acc, __dmul_rn(wt, static_cast<double>(prob[t * N])));
        continue;
      }
      for (int j = 0; j < K; ++j)
        if (p.ws.nat_ids[t * K + j] == tid) acc = __dadd_rn(acc, __dmul_rn(wt, static_cast<double>(p.ws.nat_w[t * K + j])));
    }
    s_score[tid] = acc;
  }
  int padded = 2;
  while (padded < N) padded *= 2;
  // s_mark becomes the first-choice marks (all 0 for score "probability"), padding included.
  for (int i = tid; i < padded; i += threads) s_mark[i] = 0;
  __syncthreads();
  if (gates)
    for (int64_t t = tid; t < p.T; t += threads)
      if (p.ws.first[t] >= 0) s_mark[p.ws.first[t]] = 1;
  for (int i = tid; i < padded; i += threads) {
    s_key[i] = i < N ? s_score[i] : -1.0;  // scores are >= 0: padding sorts last
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
        const int32_t fi = s_mark[oi], fj = s_mark[oj];  // the rank: (first desc, score desc, id asc)
        const bool j_first = fj > fi || (fj == fi && (kj > ki || (kj == ki && oj < oi)));
        const bool i_first = fi > fj || (fi == fj && (ki > kj || (ki == kj && oi < oj)));
        if ((i & size) == 0 ? j_first : i_first) {
          s_key[i] = kj;
          s_key[j] = ki;
          s_order[i] = oj;
          s_order[j] = oi;
        }
      }
      __syncthreads();
    }
  }

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

// 3. One warp per token: final ids, weights, stats counts, used-expert marks.
// Token t by one warp; key (N floats), ids and w (K each) are the warp's shared scratch.
__device__ void final_route_token(const Params& p, int64_t t, float* key, int32_t* ids, float* w, int lane) {
  const int N = p.N, K = p.K;
  const int32_t* nat = p.ws.nat_ids + t * K;
  const float* prob = p.ws.prob + t * N;
  const int32_t* in_set = p.ws.in_set;

  if (p.ws.counters[kCapped] == 0) {
    for (int j = lane; j < K; j += kWarp) ids[j] = nat[j];
  } else {
    const bool truncation = p.policy == BudgetPolicy::kTruncation;
    int outside = 0;
    for (int j = lane; j < K; j += kWarp) {
      const int32_t e = nat[j];
      const bool keep = e >= 0 && e < N && in_set[e] != 0;
      outside += keep ? 0 : 1;
      if (truncation) ids[j] = keep ? e : N;
    }
    outside = warp_sum(outside);  // warp-uniform from here
    if (truncation) {
      if (lane == 0 && outside > 0) atomicAdd(&p.ws.counters[kDropped], outside);
    } else if (outside == 0) {
      for (int j = lane; j < K; j += kWarp) ids[j] = nat[j];  // every natural expert is in S
    } else {
      // top-K of the family's selection key restricted to S (no group limit).
      for (int e = lane; e < N; e += kWarp) {
        float v = p.family == RouterFamily::kGptOss ? load_logit(p, t, e) : prob[e];
        if (p.family == RouterFamily::kDeepSeekV3 && p.bias) v += p.bias[e];
        key[e] = in_set[e] ? v : -INFINITY;
      }
      __syncwarp();
      warp_topk(key, N, K, ids, lane);
      __syncwarp();
      // re-routed slots: those now holding an expert the token did not choose naturally
      int fresh = 0;
      for (int j = lane; j < K; j += kWarp) {
        bool natural = false;
        for (int i = 0; i < K; ++i) natural = natural || nat[i] == ids[j];
        fresh += natural ? 0 : 1;
      }
      fresh = warp_sum(fresh);
      if (lane == 0 && fresh > 0) atomicAdd(&p.ws.counters[kRerouted], fresh);
    }
  }
  __syncwarp();

  for (int j = lane; j < K; j += kWarp) {
    const int32_t e = ids[j];
    const bool kept = e >= 0 && e < N;
    if (p.family == RouterFamily::kGptOss) {
      w[j] = kept ? load_logit(p, t, e) : -INFINITY;
    } else {
      w[j] = kept ? prob[e] : 0.0f;
    }
    if (kept) atomicOr(&p.ws.used[e], 1);
  }
  __syncwarp();
  if (lane == 0) finish_weights(p, ids, w);
  __syncwarp();
  for (int j = lane; j < K; j += kWarp) {
    p.ids[t * K + j] = ids[j];
    p.weights[t * K + j] = w[j];
  }
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
  bad = warp_sum(bad);
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

__global__ void __launch_bounds__(kFusedThreads) fused_route_kernel(Params p) {
  __shared__ float s_x[kFusedWarps][kFusedMaxExperts];
  __shared__ float s_y[kFusedWarps][kFusedMaxExperts];
  __shared__ float s_group[kFusedWarps][kFusedMaxExperts / 2];  // group scores; then final ids, weights
  __shared__ BudgetShared<kFusedMaxExperts> sh;
  device::wait_for_primary();  // (launched as a programmatic dependent: device_common.cuh)
  device::launch_dependents();
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
bool fused_allowed() {
  const char* flag = std::getenv("MOESPEC_ROUTE_FUSED");
  if (flag == nullptr || std::strcmp(flag, "1") == 0) return true;
  MOESPEC_CHECK_ARG(std::strcmp(flag, "0") == 0, "MOESPEC_ROUTE_FUSED", "expected '1' or '0', got '",
                    std::string(flag), "'");
  return false;
}

// ---------------------------------------------------------------------------------------------
// Host side

void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) throw_runtime("route_experts: ", what, " failed: ", cudaGetErrorString(status));
}

// Makes `device` current for the scope of a call (the stream belongs to it), then restores.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check_cuda(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ == device) {
      previous_ = -1;
    } else {
      check_cuda(cudaSetDevice(device), "cudaSetDevice");
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
  p.ws.nat_w = reinterpret_cast<float*>(base + layout.nat_w);
  p.ws.first = reinterpret_cast<int32_t*>(base + layout.first);

  DeviceGuard guard(args.router_logits.device_index);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (T <= kFusedMaxTokens && N <= kFusedMaxExperts && fused_allowed()) {
    check_cuda(launch_kernel(pdl_allowed(), fused_route_kernel, dim3(1), dim3(kFusedThreads), 0, s, p),
               "launching fused_route_kernel");
    return;
  }
  const unsigned token_blocks = static_cast<unsigned>((T + kWarpsPerBlock - 1) / kWarpsPerBlock);
  const int expert_threads = round_up_warp(N);
  if (T > 0) {
    natural_route_kernel<<<token_blocks, kTokenThreads, 0, s>>>(p);
    check_cuda(cudaGetLastError(), "launching natural_route_kernel");
  }
  budget_set_kernel<<<1, expert_threads < 2 * kWarp ? 2 * kWarp : expert_threads, 0, s>>>(p);
  check_cuda(cudaGetLastError(), "launching budget_set_kernel");
  if (T > 0) {
    final_route_kernel<<<token_blocks, kTokenThreads, 0, s>>>(p);
    check_cuda(cudaGetLastError(), "launching final_route_kernel");
  }
  active_kernel<<<1, expert_threads, 0, s>>>(p);
  check_cuda(cudaGetLastError(), "launching active_kernel");
}

}  // namespace cuda
}  // namespace moespec
