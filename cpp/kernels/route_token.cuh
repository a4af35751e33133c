// route_experts on the GPU, its per-token steps: the types its kernels share (constants, workspace
// counters and sections, Params) and the warp-per-token device functions of steps 1 (natural route)
// and 3 (final route). Included by route_experts.cu only, whose header comment explains the steps
// and how the arithmetic matches the CPU's (route_experts.cc).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "device_common.cuh"
#include "moespec/detail/route_math.h"
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
  float* gates;       // [T, N] natural weights by expert, 0 where not chosen (score "gates" only)
  int32_t* first;     // [T] the token's first choice, -1 for a token of weight 0 (score "gates" only)
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

// The warp's largest key: the largest high half, then the largest low half among the lanes holding
// it (two REDUX instructions on sm_80+, where ten shuffles in a chain took most of a top-K round).
__device__ __forceinline__ uint64_t warp_max(uint64_t v) {
  const uint32_t hi = static_cast<uint32_t>(v >> 32);
  const uint32_t top = device::warp_max_u32(hi);
  const uint32_t low = device::warp_max_u32(hi == top ? static_cast<uint32_t>(v) : 0u);
  return (static_cast<uint64_t>(top) << 32) | low;
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
  for (int i = 0; i < vec; ++i) x[i] = detail::exp_ref(x[i] - m);
  float sum = vec > 0 ? detail::lane_tree_sum(x, vec, width) : 0.0f;
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

// Score "gates": token t's natural weights (into its gates row, zeroed by the warp before) and first
// choice (first: the slot of largest weight, ties the lower id; -1 for a token of weight 0), as
// route_experts.cc score_experts. Lane 0, after warp_topk has written nat_ids (the same thread) and
// the warp's prob row is in memory; w is the warp's shared scratch of K floats.
__device__ void natural_gates(const Params& p, int64_t t, float* w) {
  const int K = p.K;
  const int32_t* nat = p.ws.nat_ids + t * K;
  const float* prob = p.ws.prob + t * p.N;
  for (int j = 0; j < K; ++j) w[j] = p.family == RouterFamily::kGptOss ? load_logit(p, t, nat[j]) : prob[nat[j]];
  finish_weights(p, nat, w);
  int best = 0;
  for (int j = 0; j < K; ++j) {
    if (nat[j] >= 0 && nat[j] < p.N) p.ws.gates[t * p.N + nat[j]] = w[j];
    if (w[j] > w[best] || (w[j] == w[best] && nat[j] < nat[best])) best = j;
  }
  const bool weighted = p.token_weights == nullptr || p.token_weights[t] > 0.0f;
  p.ws.first[t] = weighted ? nat[best] : -1;
}

// 1. One warp per token: prob row, selection key, natural top-K.
// Token t by one warp; x, y (N floats) and group (N / 2 floats, at least kMaxTopK) are the warp's shared scratch.
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
    for (int e = lane; e < N; e += kWarp) p.ws.gates[t * N + e] = 0.0f;
    __syncwarp();  // every lane's prob row entries and zeros are visible to lane 0
    if (lane == 0) natural_gates(p, t, group);  // (the group scores are spent: group is K floats of scratch)
  }
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
    outside = device::warp_add(outside);  // warp-uniform from here
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
      fresh = device::warp_add(fresh);
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

}  // namespace
}  // namespace cuda
}  // namespace moespec
