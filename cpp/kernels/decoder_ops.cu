// The decoder ops on the GPU (moespec::cuda::rms_norm, attention_inputs, tree_attention): the
// attention half of a decoder layer in four launches instead of the ~30 small torch kernels the
// reference forward issues (norm as mean-reductions, rope as five elementwise ops per tensor, the
// cache's index_put, the mask, SDPA over every slot of the cache).
//
// Contract and rounding: cpp/include/moespec/decoder_ops.h. Reference: the plain-torch versions in
// python/moespec/ops/decoder.py (the reference forward's own ops); tests/gpu/test_decoder_ops_cuda.py
// holds these kernels to them, run by tests/gpu/run.sh.
//
//   rms_norm_kernel          one block a row: the row (after the residual add) in shared memory as
//                            fp32, its sum of squares reduced in a fixed order, then scaled.
//   attention_inputs_kernel  one block a token: q and k in shared memory as fp32 (clipped and
//                            normed: a warp per head, or the block over all heads), then rope (each
//                            element with its rotate-half partner), q out, k and v to the cache.
//   tree_attention_kernel    grid (split, query head, group of <= 8 tokens of one request), 8 warps,
//                            a warp a token: the split's slots staged 32 or 64 at a time in shared
//                            memory (16-byte loads; rows padded to an odd word count: the per-slot
//                            dot products read without bank conflicts), a lane per slot for q.k,
//                            an online softmax per warp, a lane per pair of dims for p.v (a
//                            sliding window, the head's sink where the model has them). Only
//                            slots below start + T are read. With one split it writes the output; else
//                            (m, l, acc) per split, and
//   combine_kernel           sums the splits in split order.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "device_common.cuh"
#include "moespec/decoder_ops.h"
#include "moespec/error.h"

namespace moespec {
namespace cuda {
namespace {

using namespace device;  // kWarp, kFullMask, to_f, from_f, warp_sum

constexpr int kThreads = 256;          // every kernel's block (combine: 128)
constexpr int kWarpsPerBlock = kThreads / kWarp;  // tree_attention: tokens a block
static_assert(kWarpsPerBlock == kTreeGroupTokens, "tree_attention: a warp a token of the group");
// tree_attention's blocks an SM: the 48 registers ptxas chose on its own, stated, so that on sm_90a it
// allocates them without the 12 bytes of spills it made in the bf16 64-slot instantiation (ptxas -v;
// sm_80's bf16 instantiations spill 8-12 bytes either way)
constexpr int kTreeBlocksPerSm = 5;
constexpr int kWordsPerLane = 4;       // tree_attention: 32-bit words of a cache row a lane accumulates
constexpr int kMaxMaskWords = (kMaxTreeTokens + 31) / 32;
constexpr int kTargetBlocks = 528;     // tree_attention splits until about 4 blocks an SM of an H100/H200
constexpr int kMaxSplits = 32;
constexpr int kMinSplitSlots = 64;

// What the model dtype makes of a value (torch rounds each elementwise op's result).
template <typename T>
__device__ __forceinline__ float rnd(float v) { return to_f(from_f<T>(v)); }

__device__ __forceinline__ float warp_max(float v) {
  for (int o = kWarp / 2; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}

// The block's sum of v, in a fixed order (warps, then warp 0 over their sums); red: 32 floats of
// shared memory, free again on return.
__device__ float block_sum(float v, float* red) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = (blockDim.x + kWarp - 1) / kWarp;
  v = warp_sum(v);
  if (lane == 0) red[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float t = lane < warps ? red[lane] : 0.0f;
    t = warp_sum(t);
    if (lane == 0) red[kWarp - 1] = t;
  }
  __syncthreads();
  const float total = red[kWarp - 1];
  __syncthreads();
  return total;
}

// transformers' RMSNorm scale of a normalised value h: weight * round(h), or round(weight * h).
template <typename T>
__device__ __forceinline__ float norm_scale(float h, float weight, bool scale_fp32) {
  return scale_fp32 ? rnd<T>(weight * h) : rnd<T>(weight * rnd<T>(h));
}

// ---- rms_norm -------------------------------------------------------------------------------------

template <typename T>
__global__ void __launch_bounds__(kThreads) rms_norm_kernel(const T* __restrict__ x, const T* __restrict__ residual,
                                                            const T* __restrict__ weight, T* __restrict__ out,
                                                            T* __restrict__ sum, int H, float eps, bool scale_fp32,
                                                            bool early) {
  release_and_wait(early);  // (launched as a programmatic dependent: device_common.cuh)
  MOESPEC_DYNAMIC_SHARED(float, row);  // [H]
  __shared__ float red[kWarp];
  const int64_t base = static_cast<int64_t>(blockIdx.x) * H;
  float squares = 0.0f;
  for (int i = threadIdx.x; i < H; i += blockDim.x) {
    float v = to_f(x[base + i]);
    if (residual != nullptr) {
      v = rnd<T>(v + to_f(residual[base + i]));
      sum[base + i] = from_f<T>(v);
    }
    row[i] = v;
    squares += v * v;
  }
  const float inv = rsqrtf(block_sum(squares, red) / static_cast<float>(H) + eps);
  for (int i = threadIdx.x; i < H; i += blockDim.x)  // (each thread reads back the values it wrote)
    out[base + i] = from_f<T>(norm_scale<T>(row[i] * inv, to_f(weight[i]), scale_fp32));
}

// ---- attention_inputs -----------------------------------------------------------------------------

struct InputsShape {
  int Hq, Hkv, D, B;
  int64_t S;
  QkNormKind norm;
  float eps, clip;
};

template <typename T>
__device__ __forceinline__ float clip_value(float v, float clip) {
  return clip > 0.0f ? rnd<T>(fminf(fmaxf(v, -clip), clip)) : v;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) attention_inputs_kernel(
    const T* __restrict__ qkv, const T* __restrict__ q_norm, const T* __restrict__ k_norm, const T* __restrict__ cos,
    const T* __restrict__ sin, T* __restrict__ k_cache, T* __restrict__ v_cache, const int64_t* __restrict__ rows,
    const int64_t* __restrict__ slots, T* __restrict__ q, InputsShape s, bool early) {
  release_and_wait(early);  // (launched as a programmatic dependent: device_common.cuh)
  MOESPEC_DYNAMIC_SHARED(float, qk);  // [(Hq + Hkv) D]: q then k, clipped and normed
  __shared__ float red[kWarp];
  const int D = s.D, QD = s.Hq * D, QK = (s.Hq + s.Hkv) * D;
  const int64_t p = blockIdx.x;
  const T* row = qkv + p * static_cast<int64_t>(QK + s.Hkv * D);
  const bool full = s.norm == QkNormKind::kFull;
  float sq = 0.0f, sk = 0.0f;
  for (int i = threadIdx.x; i < QK; i += blockDim.x) {
    float v = to_f(row[i]);
    if (!full) v = clip_value<T>(v, s.clip);  // (the reference clips after a full norm, before a per-head one)
    qk[i] = v;
    (i < QD ? sq : sk) += v * v;
  }
  if (full) {
    const float iq = rsqrtf(block_sum(sq, red) / static_cast<float>(QD) + s.eps);
    const float ik = rsqrtf(block_sum(sk, red) / static_cast<float>(QK - QD) + s.eps);
    for (int i = threadIdx.x; i < QK; i += blockDim.x) {  // (each thread its own values)
      const bool is_q = i < QD;
      const float w = to_f(is_q ? q_norm[i] : k_norm[i - QD]);
      qk[i] = clip_value<T>(norm_scale<T>(qk[i] * (is_q ? iq : ik), w, false), s.clip);
    }
  } else if (s.norm == QkNormKind::kPerHead) {
    __syncthreads();
    const int lane = threadIdx.x % kWarp;
    for (int h = threadIdx.x / kWarp; h < s.Hq + s.Hkv; h += blockDim.x / kWarp) {
      float* head = qk + h * D;
      float part = 0.0f;
      for (int d = lane; d < D; d += kWarp) part += head[d] * head[d];
      const float inv = rsqrtf(warp_sum(part) / static_cast<float>(D) + s.eps);
      const T* w = h < s.Hq ? q_norm : k_norm;
      for (int d = lane; d < D; d += kWarp) head[d] = norm_scale<T>(head[d] * inv, to_f(w[d]), false);
    }
  }
  __syncthreads();
  const int64_t b = rows[p], slot = slots[p];
  const bool write = b >= 0 && b < s.B && slot >= 0 && slot < s.S;  // (the host checked them; never out of bounds)
  const int half = D / 2;
  for (int i = threadIdx.x; i < QK; i += blockDim.x) {  // rope: x cos + rotate_half(x) sin, each op rounded
    const int h = i / D, d = i % D;
    const float partner = d < half ? -qk[i + half] : qk[i - half];
    // (__fmul_rn / __fadd_rn: never contracted into an fma, so that fp32 rounds as torch's separate ops)
    const float v = rnd<T>(__fadd_rn(rnd<T>(__fmul_rn(qk[i], to_f(cos[p * D + d]))),
                                     rnd<T>(__fmul_rn(partner, to_f(sin[p * D + d])))));
    if (h < s.Hq)
      q[p * QD + i] = from_f<T>(v);
    else if (write)
      k_cache[((b * s.Hkv + (h - s.Hq)) * s.S + slot) * D + d] = from_f<T>(v);
  }
  if (!write) return;
  for (int i = threadIdx.x; i < s.Hkv * D; i += blockDim.x)
    v_cache[((b * s.Hkv + i / D) * s.S + slot) * D + i % D] = from_f<T>(clip_value<T>(to_f(row[QK + i]), s.clip));
}

// ---- tree_attention -------------------------------------------------------------------------------

struct TreeShape {
  int B, Hq, Hkv, D, W, splits;
  int64_t P, S, window;  // window 0: none
  float scale;
  bool sinks_f32;  // the sinks' dtype: float32, or the model's
};

// Head h's sink logit, or -inf without sinks (then it adds nothing to a denominator).
template <typename T>
__device__ __forceinline__ float sink_logit(const void* sinks, bool f32, int h) {
  if (sinks == nullptr) return -INFINITY;
  return f32 ? static_cast<const float*>(sinks)[h] : to_f(static_cast<const T*>(sinks)[h]);
}

// Splits the slots [0, end) into `splits` ranges of whole chunks; range c of them.
__device__ __forceinline__ void split_range(int64_t end, int splits, int chunk, int c, int64_t& lo, int64_t& hi) {
  const int64_t per = ((end + splits - 1) / splits + chunk - 1) / chunk * chunk;
  lo = c * per;
  hi = lo + per < end ? lo + per : end;
}

template <typename T, int kChunk>  // kChunk: slots staged at a time (32 or 64: one or two a lane)
__global__ void __launch_bounds__(kThreads, kTreeBlocksPerSm) tree_attention_kernel(
    const T* __restrict__ q, const T* __restrict__ k_cache, const T* __restrict__ v_cache,
    const int64_t* __restrict__ start, const int64_t* __restrict__ offsets, const int32_t* __restrict__ groups,
    const int64_t* __restrict__ spans, const int32_t* __restrict__ mask, const int64_t* __restrict__ positions, const void* __restrict__ sinks,
    T* __restrict__ out, float* __restrict__ partial, TreeShape s, bool early) {
  release_and_wait(early);  // (launched as a programmatic dependent: device_common.cuh)
  constexpr int kPerWord = 4 / sizeof(T);  // elements in a 32-bit word
  MOESPEC_DYNAMIC_SHARED(uint32_t, smem);
  __shared__ int64_t new_pos[kMaxTreeTokens];  // (a window) the new slots' positions
  __shared__ uint32_t mask_bits[kWarpsPerBlock][kMaxMaskWords];  // a warp's token's mask row (not a local array)
  const int D = s.D, words = D / kPerWord, stride = words + 1;  // (odd: lane r's row r starts in bank r)
  constexpr int kPerLane = kChunk / kWarp;
  uint32_t* ks = smem;                                      // [kChunk, stride]
  uint32_t* vs = ks + kChunk * stride;                      // [kChunk, stride]
  float* qs = reinterpret_cast<float*>(vs + kChunk * stride);  // [warps, D]
  const int c = blockIdx.x, h = blockIdx.y, warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int32_t* group = groups + 3 * static_cast<int64_t>(blockIdx.z);  // (request, first row, count)
  const int b = group[0];
  if (b < 0 || b >= s.B) return;  // (block-uniform, before any barrier; the host built the groups)
  const int64_t first = offsets[b];
  const int64_t rows = spans != nullptr ? spans[b] : offsets[b + 1] - first;  // the request's new slots
  const int64_t p = static_cast<int64_t>(group[1]) + warp;  // this warp's token
  const bool active = warp < group[2] && p < s.P;
  const int g = h / (s.Hq / s.Hkv);
  int64_t st = start[b];
  st = st < 0 ? 0 : (st > s.S ? s.S : st);
  const int64_t n = rows < 0 ? 0 : (rows > 32 * s.W ? 32 * s.W : rows);  // its new slots (a mask row has 32 W bits)
  const int64_t end = st + n < s.S ? st + n : s.S;  // the request's tokens see no slot past it
  int64_t lo, hi;
  split_range(end, s.splits, kChunk, c, lo, hi);
  const int64_t row = p * s.Hq + h;  // of q, out (when active)
  uint32_t* bits = mask_bits[warp];  // (read after the chunk loop's first barrier)
  int64_t q_pos = 0;
  if (s.window > 0) {  // (read after the chunk loop's first barrier)
    for (int j = threadIdx.x; j < n; j += blockDim.x) new_pos[j] = positions[first + j];
    if (active) q_pos = positions[p];
  }
  if (active) {
    for (int d = lane; d < D; d += kWarp) qs[warp * D + d] = to_f(q[row * D + d]);
    for (int w = lane; w < s.W; w += kWarp) bits[w] = static_cast<uint32_t>(mask[p * s.W + w]);
  }
  const T* kb = k_cache + (static_cast<int64_t>(b) * s.Hkv + g) * s.S * D;
  const T* vb = v_cache + (static_cast<int64_t>(b) * s.Hkv + g) * s.S * D;
  float m = -INFINITY, l = 0.0f, acc[kWordsPerLane * kPerWord] = {};
  const int vec = D * static_cast<int>(sizeof(T)) / 16;  // 16-byte pieces of a row
  for (int64_t base = lo; base < hi; base += kChunk) {  // (lo, hi: the same for the whole block)
    __syncthreads();  // the previous chunk is consumed
    for (int i = threadIdx.x; i < kChunk * vec; i += blockDim.x) {
      const int r = i / vec, u = i % vec;
      uint4 kv = make_uint4(0, 0, 0, 0), vv = make_uint4(0, 0, 0, 0);
      if (base + r < hi) {
        kv = reinterpret_cast<const uint4*>(kb + (base + r) * D)[u];
        vv = reinterpret_cast<const uint4*>(vb + (base + r) * D)[u];
      }
      uint32_t* kd = ks + r * stride + u * 4;
      uint32_t* vd = vs + r * stride + u * 4;
      kd[0] = kv.x, kd[1] = kv.y, kd[2] = kv.z, kd[3] = kv.w;
      vd[0] = vv.x, vd[1] = vv.y, vd[2] = vv.z, vd[3] = vv.w;
    }
    __syncthreads();
    if (!active) continue;
    float score[kPerLane], top = -INFINITY;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {  // lane's slots: lane, lane + 32
      const int r = lane + kWarp * j;
      const int64_t slot = base + r, rel = slot - st;
      const bool visible = slot < hi && (rel < 0 || ((bits[rel >> 5] >> (rel & 31)) & 1u)) &&
                           (s.window == 0 || q_pos - (rel < 0 ? slot : new_pos[rel]) < s.window);
      float dot = 0.0f;
      const float* qv = qs + warp * D;
      for (int w = 0; w < words; ++w) {
        const uint32_t word = ks[r * stride + w];
        if constexpr (kPerWord == 2) {
          dot += qv[2 * w] * __uint_as_float(word << 16) + qv[2 * w + 1] * __uint_as_float(word & 0xffff0000u);
        } else {
          dot += qv[w] * __uint_as_float(word);
        }
      }
      score[j] = visible ? dot * s.scale : -INFINITY;
      top = fmaxf(top, score[j]);
    }
    top = warp_max(top);
    if (top == -INFINITY) continue;  // (warp-uniform) nothing this token sees in the chunk
    const float m_new = fmaxf(m, top), alpha = expf(m - m_new);
    float p[kPerLane], psum = 0.0f;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      p[j] = score[j] == -INFINITY ? 0.0f : expf(score[j] - m_new);
      psum += p[j];
    }
    l = l * alpha + warp_sum(psum);
    for (float& a : acc) a *= alpha;
    m = m_new;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      for (int src = 0; src < kWarp; ++src) {
        const float pr = __shfl_sync(kFullMask, p[j], src);
        if (pr == 0.0f) continue;  // (warp-uniform: a broadcast value)
        const uint32_t* vr = vs + (src + kWarp * j) * stride;
        for (int k = 0; k < kWordsPerLane; ++k) {
          const int w = lane + kWarp * k;
          const uint32_t word = w < words ? vr[w] : 0u;  // (no break: ptxas kept acc in local memory)
          if constexpr (kPerWord == 2) {
            acc[2 * k] += pr * __uint_as_float(word << 16);
            acc[2 * k + 1] += pr * __uint_as_float(word & 0xffff0000u);
          } else {
            acc[k] += pr * __uint_as_float(word);
          }
        }
      }
    }
  }
  if (!active) return;
  if (s.splits == 1) {  // out = acc e^(m - top) / (l e^(m - top) + e^(sink - top)), top = max(m, sink)
    const float sink = sink_logit<T>(sinks, s.sinks_f32, h), top = fmaxf(m, sink);
    const float keep = l > 0.0f ? expf(m - top) : 0.0f;
    const float den = l * keep + (sink == -INFINITY ? 0.0f : expf(sink - top));
    const float inv = den > 0.0f ? keep / den : 0.0f;
    for (int k = 0; k < kWordsPerLane; ++k) {
      const int w = lane + kWarp * k;
      if (w >= words) break;
      for (int e = 0; e < kPerWord; ++e) out[row * D + w * kPerWord + e] = from_f<T>(acc[k * kPerWord + e] * inv);
    }
    return;
  }
  float* part = partial + (row * s.splits + c) * (D + 2);  // [m, l, acc over D]
  if (lane == 0) part[0] = m, part[1] = l;
  for (int k = 0; k < kWordsPerLane; ++k) {
    const int w = lane + kWarp * k;
    if (w >= words) break;
    for (int e = 0; e < kPerWord; ++e) part[2 + w * kPerWord + e] = acc[k * kPerWord + e];
  }
}

// One block a (token, head): its splits' (m, l, acc) summed in split order (with the head's sink
// in the denominator).
template <typename T>
__global__ void combine_kernel(const float* __restrict__ partial, const void* __restrict__ sinks, T* __restrict__ out,
                               int splits, int D, int Hq, bool sinks_f32, bool early) {
  release_and_wait(early);  // (launched as a programmatic dependent: device_common.cuh)
  const float* part = partial + static_cast<int64_t>(blockIdx.x) * splits * (D + 2);
  const float sink = sink_logit<T>(sinks, sinks_f32, static_cast<int>(blockIdx.x % Hq));
  float top = sink;
  for (int c = 0; c < splits; ++c)
    if (part[c * (D + 2) + 1] > 0.0f) top = fmaxf(top, part[c * (D + 2)]);
  float den = sink == -INFINITY ? 0.0f : expf(sink - top);
  for (int c = 0; c < splits; ++c)
    if (part[c * (D + 2) + 1] > 0.0f) den += expf(part[c * (D + 2)] - top) * part[c * (D + 2) + 1];
  const float inv = den > 0.0f ? 1.0f / den : 0.0f;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float num = 0.0f;
    for (int c = 0; c < splits; ++c)
      if (part[c * (D + 2) + 1] > 0.0f) num += expf(part[c * (D + 2)] - top) * part[c * (D + 2) + 2 + d];
    out[static_cast<int64_t>(blockIdx.x) * D + d] = from_f<T>(num * inv);
  }
}

int tree_chunk(int64_t D, DType dtype) {  // slots staged at a time: two padded tiles under 48 KB
  return D * static_cast<int64_t>(dtype_size(dtype)) / 4 > 64 ? 32 : 64;
}

void check_launch(const char* op, cudaError_t err) {
  if (err != cudaSuccess) throw_runtime("moespec::cuda::", op, ": launch failed: ", cudaGetErrorString(err));
}

void check_cuda_args(const TensorView& t, const char* arg, const char* op) {
  MOESPEC_CHECK_ARG(t.device == Device::kCUDA, arg, "moespec::cuda::", op, " needs CUDA tensors, got ", t.describe());
}

template <typename T>
const T* data(const TensorView& t) {
  return t.defined() ? static_cast<const T*>(t.data) : nullptr;
}

template <typename T>
void launch_rms_norm(const RmsNormArgs& a, cudaStream_t stream) {
  const int64_t P = a.x.shape[0], H = a.x.shape[1];
  const Pdl pdl = pdl_launch();
  check_launch("rms_norm", launch_kernel(pdl, rms_norm_kernel<T>, dim3(static_cast<unsigned>(P)), dim3(kThreads),
                                        H * sizeof(float), stream, data<T>(a.x), data<T>(a.residual),
                                        data<T>(a.weight), a.out.ptr<T>(), a.sum.defined() ? a.sum.ptr<T>() : nullptr,
                                        static_cast<int>(H), a.eps, a.scale_fp32, pdl.early));
}

template <typename T>
void launch_attention_inputs(const AttentionInputsArgs& a, cudaStream_t stream) {
  const InputsShape s{static_cast<int>(a.num_heads), static_cast<int>(a.num_kv_heads),
                      static_cast<int>(a.k_cache.shape[3]), static_cast<int>(a.k_cache.shape[0]), a.k_cache.shape[2],
                      a.qk_norm, a.eps, a.clip};
  const std::size_t shared = static_cast<std::size_t>((s.Hq + s.Hkv) * s.D) * sizeof(float);
  const Pdl pdl = pdl_launch();
  check_launch("attention_inputs",
               launch_kernel(pdl, attention_inputs_kernel<T>, dim3(static_cast<unsigned>(a.qkv.shape[0])),
                             dim3(kThreads), shared, stream, data<T>(a.qkv), data<T>(a.q_norm), data<T>(a.k_norm),
                             data<T>(a.cos), data<T>(a.sin), a.k_cache.ptr<T>(), a.v_cache.ptr<T>(),
                             data<int64_t>(a.rows), data<int64_t>(a.slots), a.q.ptr<T>(), s, pdl.early));
}

template <typename T>
void launch_tree_attention(const TreeAttentionArgs& a, float* partial, cudaStream_t stream) {
  const int64_t P = a.q.shape[0], Hq = a.q.shape[1], D = a.q.shape[2], G = a.groups.shape[0];
  const TreeShape s{static_cast<int>(a.k_cache.shape[0]), static_cast<int>(Hq), static_cast<int>(a.k_cache.shape[1]),
                    static_cast<int>(D), static_cast<int>(a.mask.shape[1]),
                    static_cast<int>(tree_attention_splits(G, Hq, a.k_cache.shape[2])), P, a.k_cache.shape[2],
                    a.window, a.scale, a.sinks.defined() && a.sinks.dtype == DType::kFloat32};
  const void* sinks = a.sinks.defined() ? a.sinks.data : nullptr;
  const int chunk = tree_chunk(D, a.q.dtype);
  const int64_t words = D * static_cast<int64_t>(sizeof(T)) / 4;
  const std::size_t shared = (2 * chunk * (words + 1)) * sizeof(uint32_t) + kWarpsPerBlock * D * sizeof(float);
  const dim3 grid(s.splits, static_cast<unsigned>(Hq), static_cast<unsigned>(G));
  auto kernel = chunk == 64 ? tree_attention_kernel<T, 64> : tree_attention_kernel<T, 32>;
  const Pdl pdl = pdl_launch();
  check_launch("tree_attention",
               launch_kernel(pdl, kernel, grid, dim3(kThreads), shared, stream, data<T>(a.q), data<T>(a.k_cache),
                             data<T>(a.v_cache), data<int64_t>(a.start), data<int64_t>(a.offsets),
                             data<int32_t>(a.groups), data<int64_t>(a.spans), data<int32_t>(a.mask),
                             data<int64_t>(a.positions), sinks, a.out.ptr<T>(), partial, s, pdl.early));
  if (s.splits > 1)
    check_launch("tree_attention", launch_kernel(pdl, combine_kernel<T>, dim3(static_cast<unsigned>(P * Hq)), dim3(128),
                                                 0, stream, static_cast<const float*>(partial), sinks, a.out.ptr<T>(),
                                                 s.splits, static_cast<int>(D), static_cast<int>(Hq), s.sinks_f32,
                                                 pdl.early));
}

// launch(element): the op's launches (each checked) for the model dtype's element type (bf16 or fp32).
template <typename Launch>
void launch_by_dtype(DType dtype, Launch&& launch) {
  if (dtype == DType::kBFloat16)
    launch(__nv_bfloat16{});
  else
    launch(float{});
}

}  // namespace

int64_t tree_attention_splits(int64_t groups, int64_t num_heads, int64_t max_slots) {
  const int64_t blocks = std::max<int64_t>(1, groups * num_heads);
  const int64_t most = std::max<int64_t>(1, std::min<int64_t>(kMaxSplits, (max_slots + kMinSplitSlots - 1) / kMinSplitSlots));
  return std::max<int64_t>(1, std::min<int64_t>(most, (kTargetBlocks + blocks - 1) / blocks));
}

std::size_t tree_attention_workspace_size(int64_t P, int64_t groups, int64_t num_heads, int64_t head_dim,
                                          int64_t max_slots) {
  if (P < 1 || groups < 1 || num_heads < 1 || head_dim < 1 || max_slots < 1) return 0;
  const int64_t splits = tree_attention_splits(groups, num_heads, max_slots);
  if (splits == 1) return 0;
  return static_cast<std::size_t>(P * num_heads * splits * (head_dim + 2)) * sizeof(float);
}

void rms_norm(const RmsNormArgs& a, void* stream) {
  validate_rms_norm(a);
  check_cuda_args(a.x, "x", "rms_norm");
  if (a.x.shape[0] == 0) return;
  DeviceGuard guard(a.x.device_index);
  launch_by_dtype(a.x.dtype, [&](auto element) {
    launch_rms_norm<decltype(element)>(a, static_cast<cudaStream_t>(stream));
  });
}

void attention_inputs(const AttentionInputsArgs& a, void* stream) {
  validate_attention_inputs(a);
  check_cuda_args(a.qkv, "qkv", "attention_inputs");
  if (a.qkv.shape[0] == 0) return;
  DeviceGuard guard(a.qkv.device_index);
  launch_by_dtype(a.qkv.dtype, [&](auto element) {
    launch_attention_inputs<decltype(element)>(a, static_cast<cudaStream_t>(stream));
  });
}

void tree_attention(const TreeAttentionArgs& a, void* workspace, std::size_t workspace_bytes, void* stream) {
  validate_tree_attention(a);
  check_cuda_args(a.q, "q", "tree_attention");
  const int64_t P = a.q.shape[0], G = a.groups.shape[0], Hq = a.q.shape[1], D = a.q.shape[2];
  const std::size_t need = tree_attention_workspace_size(P, G, Hq, D, a.k_cache.shape[2]);
  MOESPEC_CHECK_ARG(need == 0 || (workspace != nullptr && workspace_bytes >= need), "workspace", "needs ", need,
                    " bytes (tree_attention_workspace_size), got ", workspace_bytes);
  MOESPEC_CHECK_ARG(G <= 65535, "groups", "at most 65535 groups a call, got ", G);
  if (P == 0 || G == 0) return;
  DeviceGuard guard(a.q.device_index);
  launch_by_dtype(a.q.dtype, [&](auto element) {
    launch_tree_attention<decltype(element)>(a, static_cast<float*>(workspace), static_cast<cudaStream_t>(stream));
  });
}

}  // namespace cuda
}  // namespace moespec
