// moe_experts on the CPU: the expert half of an MoE layer, each active expert's weights read once
// (DESIGN.md "Budgeted MoE layer"; contract and semantics: cpp/include/moespec/moe_experts.h).
//
// This file holds the validation, the orchestration shared by every ISA, the scalar reference
// product and the ISA dispatch. The SIMD products live in moe_experts_avx2.cc and
// moe_experts_avx512.cc (table: moe_experts_simd.h). Plain-torch reference used by the Python
// tests: python/moespec/ops/reference.py (moe_experts_reference).
//
// Plan of one call (U = slots in use, i.e. id != E and weight != 0):
//   1. group the used slots by expert (counting sort over ids, token order kept within an expert);
//   2. copy x once into xa [T, Hp] in the product's activation dtype, zero-padded to Hp;
//   3. phase 1, tasks (active expert, tile of kRowTile gate/up rows): g, u for the expert's tokens,
//      the activation, h rounded to bf16 for bf16 weights, stored in hbuf [U, Ip] grouped by expert;
//   4. phase 2, tasks (tile of kColTile output columns): for every active expert in ascending id,
//      y = down h (+ bias) for its tokens and acc[t, c] += weight * y; then out = round(acc).
// That is the tiled schedule (prefill). Up to kStreamMaxTokens tokens (decode, verify) the products
// of phases 1 and 2 run instead over contiguous row ranges of the active experts' matrices, one
// long run of bytes per task (stream_rows_task), and the activation and the weighted sum follow as
// passes of their own: the same operations on every element, so the same bits.
// Every element is computed by one fixed sequence of operations whatever the tile or the thread,
// so results are identical for any thread count.
#include "moespec/moe_experts.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "moespec/cpu_isa.h"
#include "moespec/detail/route_math.h"
#include "moespec/error.h"
#include "moespec/thread_pool.h"
#include "aligned_buffer.h"
#include "moe_experts_simd.h"

namespace moespec {

// ---------------------------------------------------------------------------------------------
// Validation

void validate_moe_experts(const MoeExpertsArgs& a) {
  check_not_null(a.x, "x");
  check_ndim(a.x, "x", 2);
  check_dtype(a.x, "x", {DType::kFloat32, DType::kBFloat16});
  const int64_t T = a.x.shape[0];
  const int64_t H = a.x.shape[1];
  const Device device = a.x.device;
  const int32_t device_index = a.x.device_index;
  MOESPEC_CHECK_ARG(H >= 1, "x", "hidden size H (dim 1) must be >= 1, got ", a.x.describe());
  MOESPEC_CHECK_ARG(a.x.strides[1] == 1 && (T <= 1 || a.x.strides[0] >= H), "x",
                    "expected rows of contiguous elements (stride 1 in dim 1, row stride >= H), got strides [",
                    a.x.strides[0], ", ", a.x.strides[1], "]");

  check_not_null(a.experts, "experts");
  check_ndim(a.experts, "experts", 2);
  check_dtype(a.experts, "experts", {DType::kFloat32, DType::kBFloat16});
  check_contiguous(a.experts, "experts");
  check_device(a.experts, "experts", device, device_index);
  MOESPEC_CHECK_ARG(a.experts.dtype == a.x.dtype, "x", "x's dtype must equal experts' dtype ",
                    dtype_name(a.experts.dtype), ", got ", a.x.describe());
  const int64_t E = a.experts.shape[0];
  MOESPEC_CHECK_ARG(E >= 1 && E < (int64_t{1} << 31) - 1, "experts", "number of experts E (dim 0) must be in [1, 2^31 - 1), got ",
                    a.experts.describe());
  const int64_t I = a.intermediate_size;
  MOESPEC_CHECK_ARG(I >= 1, "intermediate_size", "must be >= 1, got ", I);
  MOESPEC_CHECK_ARG(a.experts.shape[1] % (3 * H) == 0 && a.experts.shape[1] / (3 * H) == I, "intermediate_size",
                    "experts' rows must hold 3 * I * H = ", 3 * I * H, " elements (gate, up [I, H], down [H, I] with H = ",
                    H, ", I = ", I, "), got ", a.experts.describe());

  check_not_null(a.ids, "ids");
  check_ndim(a.ids, "ids", 2);
  check_dim(a.ids, "ids", 0, T);
  check_dtype(a.ids, "ids", {DType::kInt32});
  check_contiguous(a.ids, "ids");
  check_device(a.ids, "ids", device, device_index);
  const int64_t K = a.ids.shape[1];

  check_not_null(a.weights, "weights");
  check_ndim(a.weights, "weights", 2);
  check_dim(a.weights, "weights", 0, T);
  check_dim(a.weights, "weights", 1, K);
  check_dtype(a.weights, "weights", {DType::kFloat32});
  check_contiguous(a.weights, "weights");
  check_device(a.weights, "weights", device, device_index);

  MOESPEC_CHECK_ARG(a.activation == ExpertActivation::kSwiGLU || a.activation == ExpertActivation::kGptOss,
                    "activation", "expected 0 (SwiGLU) or 1 (GptOss), got ", static_cast<int>(a.activation));
  if (a.activation == ExpertActivation::kGptOss) {
    MOESPEC_CHECK_ARG(std::isfinite(a.limit), "limit", "must be finite, got ", a.limit);
    MOESPEC_CHECK_ARG(std::isfinite(a.alpha), "alpha", "must be finite, got ", a.alpha);
  } else {
    MOESPEC_CHECK_ARG(!a.biases.defined(), "biases", "only activation GptOss takes biases, got ",
                      a.biases.describe(), " with SwiGLU");
  }
  if (a.biases.defined()) {
    check_not_null(a.biases, "biases");
    check_ndim(a.biases, "biases", 2);
    check_dim(a.biases, "biases", 0, E);
    check_dim(a.biases, "biases", 1, 2 * I + H);
    check_dtype(a.biases, "biases", {DType::kFloat32});
    check_contiguous(a.biases, "biases");
    check_device(a.biases, "biases", device, device_index);
  }

  check_not_null(a.out, "out");
  check_ndim(a.out, "out", 2);
  check_dim(a.out, "out", 0, T);
  check_dim(a.out, "out", 1, H);
  MOESPEC_CHECK_ARG(a.out.dtype == a.x.dtype, "out", "expected x's dtype ", dtype_name(a.x.dtype), ", got ",
                    a.out.describe());
  check_contiguous(a.out, "out");
  check_device(a.out, "out", device, device_index);
}

namespace cpu {

// ---------------------------------------------------------------------------------------------
// Scalar reference product and ISA dispatch

namespace scalar {
namespace {

inline float to_float(float v) { return v; }
inline float to_float(uint16_t v) { return detail::bf16_to_float(v); }

template <typename W>
void matmul_nt(const void* w, int64_t ldw, int64_t n_rows, const void* act, int64_t ld_act, const int32_t* rows,
               int64_t n_tok, int64_t K, float* c, int64_t ldc) {
  const W* wp = static_cast<const W*>(w);
  const float* ap = static_cast<const float*>(act);
  for (int64_t n = 0; n < n_tok; ++n) {
    const float* a = ap + (rows ? rows[n] : n) * ld_act;
    for (int64_t r = 0; r < n_rows; ++r) {
      const W* wr = wp + r * ldw;
      float s = 0.0f;
      for (int64_t k = 0; k < K; ++k) s += to_float(wr[k]) * a[k];
      c[n * ldc + r] = s;
    }
  }
}

template <typename W>
void accumulate_nn(const void* w, int64_t ldw, int64_t S, int64_t N, const float* a, int64_t lda, int64_t n_tok,
                   float* c, int64_t ldc) {
  const W* wp = static_cast<const W*>(w);
  for (int64_t n = 0; n < n_tok; ++n) {
    float* cn = c + n * ldc;
    for (int64_t s = 0; s < S; ++s) {
      const float av = a[n * lda + s];
      const W* ws = wp + s * ldw;
      for (int64_t j = 0; j < N; ++j) cn[j] += av * to_float(ws[j]);
    }
  }
}

float exp_sum(float* x, int64_t n, float shift) {
  NonzeroSum sum;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = std::isinf(x[i]) && x[i] < 0 ? 0.0f : std::exp(x[i] - shift);
    sum.add(x[i]);
  }
  return sum.total();
}

void activate(ExpertActivation activation, float limit, float alpha, const float* g, const float* u, int64_t n,
              float* h) {
  for (int64_t j = 0; j < n; ++j) {
    float gv = g[j], uv = u[j];
    if (activation == ExpertActivation::kSwiGLU) {
      h[j] = gv / (1.0f + std::exp(-gv)) * uv;
      continue;
    }
    gv = limit < gv ? limit : gv;
    uv = uv < -limit ? -limit : (limit < uv ? limit : uv);
    h[j] = (uv + 1.0f) * gv * (1.0f / (1.0f + std::exp(-(alpha * gv))));
  }
}

}  // namespace
const MoeExpertKernels kMoeExperts = {matmul_nt<float>, matmul_nt<uint16_t>, accumulate_nn<float>,
                                      accumulate_nn<uint16_t>, exp_sum, activate, DType::kFloat32, "scalar"};
}  // namespace scalar

std::size_t staged_row_bytes(const MoeExpertKernels& kernels, DType w_dtype, int64_t K) {
  const bool act_bf16 = w_dtype == DType::kBFloat16 && kernels.bf16_act == DType::kBFloat16;
  return static_cast<std::size_t>((K + kMoeActPad - 1) / kMoeActPad * kMoeActPad) * (act_bf16 ? 2 : 4);
}

void stage_activations(const MoeExpertKernels& kernels, DType w_dtype, const void* x, int64_t ld, int64_t T,
                       int64_t K, void* dst) {
  const bool bf16 = w_dtype == DType::kBFloat16;
  const bool act_bf16 = bf16 && kernels.bf16_act == DType::kBFloat16;
  const int64_t Kp = (K + kMoeActPad - 1) / kMoeActPad * kMoeActPad;
  for (int64_t t = 0; t < T; ++t) {
    if (act_bf16) {
      uint16_t* row = static_cast<uint16_t*>(dst) + t * Kp;
      std::memcpy(row, static_cast<const uint16_t*>(x) + t * ld, static_cast<std::size_t>(K) * 2);
      std::fill(row + K, row + Kp, uint16_t{0});
    } else {
      float* row = static_cast<float*>(dst) + t * Kp;
      if (bf16 && kernels.bf16_act_even_odd) {
        const uint16_t* src = static_cast<const uint16_t*>(x) + t * ld;
        std::fill(row, row + Kp, 0.0f);
        for (int64_t i = 0; i < K; ++i) row[staged_position(kernels, w_dtype, i)] = detail::bf16_to_float(src[i]);
        continue;
      }
      if (bf16) {
        const uint16_t* src = static_cast<const uint16_t*>(x) + t * ld;
        for (int64_t i = 0; i < K; ++i) row[i] = detail::bf16_to_float(src[i]);
      } else {
        std::memcpy(row, static_cast<const float*>(x) + t * ld, static_cast<std::size_t>(K) * 4);
      }
      std::fill(row + K, row + Kp, 0.0f);
    }
  }
}

const MoeExpertKernels& moe_expert_kernels(CpuIsa isa) {
  switch (isa) {
#if defined(MOESPEC_HAVE_AVX512)
    case CpuIsa::kAvx512: return cpu_has_avx512_bf16() ? avx512::kMoeExpertsBf16 : avx512::kMoeExperts;
#endif
#if defined(MOESPEC_HAVE_AVX2)
    case CpuIsa::kAvx2: return avx2::kMoeExperts;
#endif
    default: return scalar::kMoeExperts;
  }
}

namespace {

// ---------------------------------------------------------------------------------------------
// Orchestration

constexpr int64_t kRowTile = 32;  // phase 1: gate/up rows per task
constexpr int64_t kColTile = 64;  // phase 2: output columns per task
constexpr int64_t kStreamMaxTokens = 64;  // up to this many tokens a call, the streaming schedule
constexpr int64_t kStreamRangesPerThread = 2;  // contiguous row ranges per pool thread (some slack for balance)
constexpr int64_t kStreamAlign = 16;  // ranges start at multiples of this many rows

int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// Per calling thread, reused across calls (released above the retain limit, scratch.h): the grouping
// and the staged activations.
struct Workspace {
  std::vector<int64_t> offsets;     // [E + 1] first use of each expert
  std::vector<int32_t> active;      // active experts, ascending
  std::vector<int32_t> use_token;   // [U] token of each use, grouped by expert
  std::vector<float> use_weight;    // [U] its routing weight
  std::vector<int64_t> cursor;      // [E] next free use of each expert while grouping
  AlignedBuffer xa;                 // [T, Hp] x in the activation dtype
  AlignedBuffer hbuf;               // [U, Ip] h in the activation dtype
  AlignedBuffer acc;                // [T, H] fp32 accumulator (bf16 output only)
  AlignedBuffer gu;                 // [U, 2I] gate and up products (the streaming schedule)
  AlignedBuffer y;                  // [U, H] down products (the streaming schedule)
};

// Per pool thread: a task's product outputs.
struct TaskScratch {
  std::vector<float> a, b;
};

// Everything a task needs, fixed for the call.
struct Problem {
  MoeMatmulNt matmul;   // the ISA's product for the experts' dtype
  bool bf16;            // bf16 weights, x and out
  bool act_bf16;        // activations (xa, hbuf) stored as bf16 bits, else fp32
  const MoeExpertKernels* kernels;  // (staged_position of hbuf's elements)
  DType w_dtype;
  int64_t T, H, I, Hp, Ip;  // Hp, Ip: H, I rounded up to kMoeActPad (activation row strides)
  const char* experts;  // base of experts, bytes
  std::size_t w_size;   // bytes per weight element
  const float* biases;  // [E, 2I + H] or null
  ExpertActivation activation;
  float limit, alpha;
  const Workspace* ws;
  const void* xa;  // [T, Hp]
  void* hbuf;      // [U, Ip]
  float* acc;      // [T, H]: the workspace's, or out itself when out is fp32
  void* out;       // [T, H]
};

// h of one use (hbuf row `use`) for intermediate rows [j0, j0 + rows), from its gate and up
// products gn, un (rows each, overwritten): biases, the activation, the rounding, the staged
// position; the last rows also zero the row's padding.
void store_h(const Problem& p, int32_t e, int64_t use, float* gn, float* un, int64_t j0, int64_t rows) {
  const float* bg = p.biases ? p.biases + e * (2 * p.I + p.H) : nullptr;
  const int64_t row = use * p.Ip;
  if (bg) {
    const float* bu = bg + p.I;
    for (int64_t j = 0; j < rows; ++j) {
      gn[j] += bg[j0 + j];
      un[j] += bu[j0 + j];
    }
  }
  p.kernels->activate(p.activation, p.limit, p.alpha, gn, un, rows, gn);  // h into g's row
  for (int64_t j = 0; j < rows; ++j) {
    const int64_t at = row + staged_position(*p.kernels, p.w_dtype, j0 + j);  // (a tile's blocks of 16 are its own)
    if (p.act_bf16) static_cast<uint16_t*>(p.hbuf)[at] = detail::float_to_bf16(gn[j]);
    else if (p.bf16) static_cast<float*>(p.hbuf)[at] = detail::bf16_to_float(detail::float_to_bf16(gn[j]));
    else static_cast<float*>(p.hbuf)[at] = gn[j];
  }
  if (j0 + rows == p.I) {  // the last rows zero the padding
    if (p.act_bf16) std::fill_n(static_cast<uint16_t*>(p.hbuf) + row + p.I, p.Ip - p.I, uint16_t{0});
    else
      for (int64_t j = p.I; j < p.Ip; ++j)
        static_cast<float*>(p.hbuf)[row + staged_position(*p.kernels, p.w_dtype, j)] = 0.0f;
  }
}

const char* expert_block(const Problem& p, int32_t e) {
  return p.experts + static_cast<std::size_t>(e) * static_cast<std::size_t>(3 * p.I * p.H) * p.w_size;
}

// Phase 1 task (tiled schedule): rows [j0, j1) of expert e's gate and up for all its tokens -> hbuf.
void gate_up_task(const Problem& p, int32_t e, int64_t j0, int64_t j1) {
  thread_local TaskScratch scratch;
  const int64_t first = p.ws->offsets[e];
  const int64_t n_e = p.ws->offsets[e + 1] - first;
  const int64_t rows = j1 - j0;
  scratch.a.resize(static_cast<std::size_t>(n_e * rows));
  scratch.b.resize(static_cast<std::size_t>(n_e * rows));
  float* g = scratch.a.data();
  float* u = scratch.b.data();
  const char* gate = expert_block(p, e) + static_cast<std::size_t>(j0 * p.H) * p.w_size;
  const char* up = expert_block(p, e) + static_cast<std::size_t>((p.I + j0) * p.H) * p.w_size;
  const int32_t* tokens = p.ws->use_token.data() + first;
  p.matmul(gate, p.H, rows, p.xa, p.Hp, tokens, n_e, p.H, g, rows);
  p.matmul(up, p.H, rows, p.xa, p.Hp, tokens, n_e, p.H, u, rows);
  for (int64_t n = 0; n < n_e; ++n) store_h(p, e, first + n, g + n * rows, u + n * rows, j0, rows);
  release_if_large(scratch.a, scratch.b);
}

// The streaming schedule (few tokens): a matrix's rows, expert after expert in ascending id, form
// one sequence (the gate/up blocks [2I, H] for phase 1, the down blocks [H, I] for phase 2), and a
// task takes one contiguous range of it, so that each thread reads long runs of consecutive bytes
// (the hardware prefetcher's best case: on the 2-core EPYC VM two threads read 29 GB/s that way,
// 20-24 GB/s in the tiled schedule's interleaved 36 KB pieces). Products go to per-use rows
// (dst [U, ld]); the activation and the weighted sum over experts follow as their own passes, in
// the tiled schedule's order of operations (the same bits).
void stream_rows_task(const Problem& p, int64_t rows_per_expert, int64_t offset, int64_t K, const void* act,
                      int64_t ld_act, bool by_token, float* dst, int64_t ld, int64_t r0, int64_t r1) {
  for (int64_t k = r0 / rows_per_expert; k * rows_per_expert < r1; ++k) {
    const int32_t e = p.ws->active[static_cast<std::size_t>(k)];
    const int64_t a = std::max(r0 - k * rows_per_expert, int64_t{0});
    const int64_t b = std::min(r1 - k * rows_per_expert, rows_per_expert);
    if (b <= a) continue;
    const int64_t first = p.ws->offsets[e];
    const int64_t n_e = p.ws->offsets[e + 1] - first;
    const char* w = expert_block(p, e) + static_cast<std::size_t>(offset + a * K) * p.w_size;
    const char* x = static_cast<const char*>(act);
    if (!by_token) x += static_cast<std::size_t>(first * ld_act) * (p.act_bf16 ? 2 : 4);
    const int32_t* tokens = by_token ? p.ws->use_token.data() + first : nullptr;
    // An expert with many tokens is compute-bound: its products run tokens outer, over chunks of
    // kRowTile rows that stay in L2 (one pass over the whole range per token block would stream it
    // from memory again and again); otherwise the range is one rows-outer stream.
    const int64_t chunk = n_e > kMoeRowsOuterMaxTokens ? kRowTile : b - a;
    for (int64_t r = a; r < b; r += chunk) {
      const int64_t rows = std::min(chunk, b - r);
      p.matmul(w + static_cast<std::size_t>((r - a) * K) * p.w_size, K, rows, x, ld_act, tokens, n_e, K,
               dst + first * ld + r, ld);
    }
  }
}

// Phase 2 task: output columns [c0, c1) of every token: acc = sum over the tokens' experts of
// weight * (down h + bias), experts in ascending id; then out = acc in out's dtype. With `y` (the
// streaming schedule) the down products are there already, [U, H]; else the task computes them.
void down_task(const Problem& p, int64_t c0, int64_t c1, const float* y_all) {
  thread_local TaskScratch scratch;
  const int64_t cols = c1 - c0;
  for (int64_t t = 0; t < p.T; ++t) std::fill_n(p.acc + t * p.H + c0, cols, 0.0f);
  const std::size_t h_size = p.act_bf16 ? 2 : 4;
  for (int32_t e : p.ws->active) {
    const int64_t first = p.ws->offsets[e];
    const int64_t n_e = p.ws->offsets[e + 1] - first;
    const float* y;
    int64_t ldy;
    if (y_all != nullptr) {
      y = y_all + first * p.H + c0;
      ldy = p.H;
    } else {
      scratch.a.resize(static_cast<std::size_t>(std::max<int64_t>(n_e * cols, 1)));
      const char* down = expert_block(p, e) + static_cast<std::size_t>(2 * p.I * p.H + c0 * p.I) * p.w_size;
      const char* h = static_cast<const char*>(p.hbuf) + static_cast<std::size_t>(first * p.Ip) * h_size;
      p.matmul(down, p.I, cols, h, p.Ip, nullptr, n_e, p.I, scratch.a.data(), cols);
      y = scratch.a.data();
      ldy = cols;
    }
    const float* bd = p.biases ? p.biases + e * (2 * p.I + p.H) + 2 * p.I + c0 : nullptr;
    for (int64_t n = 0; n < n_e; ++n) {
      const float w = p.ws->use_weight[first + n];
      float* acc = p.acc + p.ws->use_token[first + n] * p.H + c0;
      const float* yn = y + n * ldy;
      if (bd) {
        for (int64_t c = 0; c < cols; ++c) acc[c] += w * (yn[c] + bd[c]);
      } else {
        for (int64_t c = 0; c < cols; ++c) acc[c] += w * yn[c];
      }
    }
  }
  if (p.bf16) {
    uint16_t* out = static_cast<uint16_t*>(p.out);
    for (int64_t t = 0; t < p.T; ++t)
      for (int64_t c = c0; c < c1; ++c) out[t * p.H + c] = detail::float_to_bf16(p.acc[t * p.H + c]);
  }
  release_if_large(scratch.a);
}

// MOESPEC_MOE_SCHEDULE=tiled keeps the tiled schedule at every size (to compare the two; the
// results are the same bits); unset or "auto": the streaming one up to kStreamMaxTokens tokens.
bool streaming_allowed() {
  const char* env = std::getenv("MOESPEC_MOE_SCHEDULE");
  if (env == nullptr || std::strcmp(env, "auto") == 0) return true;
  MOESPEC_CHECK_ARG(std::strcmp(env, "tiled") == 0, "MOESPEC_MOE_SCHEDULE", "expected 'auto' or 'tiled', got '",
                    std::string(env), "'");
  return false;
}

// Groups the used slots by expert; checks ids. Returns U.
int64_t group_slots(const MoeExpertsArgs& a, int64_t T, int64_t K, int64_t E, Workspace& ws) {
  const int32_t* ids = a.ids.ptr<const int32_t>();
  const float* weights = a.weights.ptr<const float>();
  const bool round = a.round_weights && a.x.dtype == DType::kBFloat16;
  const auto weight_of = [&](int64_t s) {  // the slot's weight as used (round_weights: rounded to bf16)
    return round ? detail::bf16_to_float(detail::float_to_bf16(weights[s])) : weights[s];
  };
  ws.offsets.assign(static_cast<std::size_t>(E + 1), 0);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t k = 0; k < K; ++k) {
      const int32_t id = ids[t * K + k];
      MOESPEC_CHECK_ARG(id >= 0 && id <= E, "ids", "ids[", t, ", ", k, "] = ", id, " is outside [0, ", E,
                        "] (E = ", E, " marks a dropped slot)");
      if (id < E && weight_of(t * K + k) != 0.0f) ++ws.offsets[id + 1];
    }
  }
  ws.active.clear();
  for (int64_t e = 0; e < E; ++e) {
    if (ws.offsets[e + 1] > 0) ws.active.push_back(static_cast<int32_t>(e));
    ws.offsets[e + 1] += ws.offsets[e];
  }
  const int64_t U = ws.offsets[E];
  ws.use_token.resize(static_cast<std::size_t>(U));
  ws.use_weight.resize(static_cast<std::size_t>(U));
  ws.cursor.assign(ws.offsets.begin(), ws.offsets.end() - 1);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t k = 0; k < K; ++k) {
      const int32_t id = ids[t * K + k];
      const float w = weight_of(t * K + k);
      if (id == E || w == 0.0f) continue;
      const int64_t pos = ws.cursor[id]++;
      ws.use_token[pos] = static_cast<int32_t>(t);
      ws.use_weight[pos] = w;
    }
  }
  return U;
}

}  // namespace

void moe_experts(const MoeExpertsArgs& args) { moe_experts_with(args, moe_expert_kernels(active_cpu_isa())); }

void moe_experts_with(const MoeExpertsArgs& args, const MoeExpertKernels& kernels) {
  validate_moe_experts(args);
  check_device(args.x, "x", Device::kCPU);
  const int64_t T = args.x.shape[0], H = args.x.shape[1];
  const int64_t E = args.experts.shape[0], K = args.ids.shape[1];
  const int64_t I = args.intermediate_size;
  if (T == 0) return;

  thread_local Workspace ws;
  const int64_t U = group_slots(args, T, K, E, ws);
  const bool bf16 = args.experts.dtype == DType::kBFloat16;
  if (U == 0) {  // every slot dropped or zero-weighted: nothing to read
    std::memset(args.out.data, 0, static_cast<std::size_t>(T * H) * dtype_size(args.out.dtype));
    return;
  }

  Problem p{};
  p.bf16 = bf16;
  p.act_bf16 = bf16 && kernels.bf16_act == DType::kBFloat16;
  p.kernels = &kernels;
  p.w_dtype = args.experts.dtype;
  p.matmul = bf16 ? kernels.matmul_bf16 : kernels.matmul_f32;
  p.T = T, p.H = H, p.I = I;
  p.Hp = round_up(H, kMoeActPad), p.Ip = round_up(I, kMoeActPad);
  p.experts = static_cast<const char*>(args.experts.data);
  p.w_size = dtype_size(args.experts.dtype);
  p.biases = args.biases.defined() ? args.biases.ptr<const float>() : nullptr;
  p.activation = args.activation;
  p.limit = args.limit, p.alpha = args.alpha;
  p.ws = &ws;
  const std::size_t act_size = p.act_bf16 ? 2 : 4;
  void* xa = ws.xa.get(static_cast<std::size_t>(T * p.Hp) * act_size);
  stage_activations(kernels, args.x.dtype, args.x.data, T > 1 ? args.x.strides[0] : H, T, H,
                    xa);  // x is read only here (so out may alias x)
  p.xa = xa;
  p.hbuf = ws.hbuf.get(static_cast<std::size_t>(U * p.Ip) * act_size);
  p.acc = bf16 ? static_cast<float*>(ws.acc.get(static_cast<std::size_t>(T * H) * 4)) : args.out.ptr<float>();
  p.out = args.out.data;

  ThreadPool& pool = ThreadPool::instance();
  const int64_t n_active = static_cast<int64_t>(ws.active.size());
  const int64_t col_tiles = (H + kColTile - 1) / kColTile;
  if (T <= kStreamMaxTokens && streaming_allowed()) {  // the streaming schedule (see stream_rows_task)
    float* gu = static_cast<float*>(ws.gu.get(static_cast<std::size_t>(U * 2 * I) * 4));  // [U, 2I]
    float* y = static_cast<float*>(ws.y.get(static_cast<std::size_t>(U * H) * 4));        // [U, H]
    const int64_t ranges = kStreamRangesPerThread * pool.num_threads();
    auto stream = [&](int64_t rows_per_expert, int64_t offset, int64_t K, const void* act, int64_t ld_act,
                      bool by_token, float* dst, int64_t ld) {
      const int64_t total = n_active * rows_per_expert;
      const int64_t n = std::min(ranges, (total + kStreamAlign - 1) / kStreamAlign);
      pool.parallel_for(n, [&](int64_t i) {  // range i: rows [i total / n, (i + 1) total / n), kStreamAlign-aligned
        auto edge = [&](int64_t k) {
          return std::min(total, (k * total / n + kStreamAlign - 1) / kStreamAlign * kStreamAlign);
        };
        stream_rows_task(p, rows_per_expert, offset, K, act, ld_act, by_token, dst, ld, edge(i), edge(i + 1));
      });
    };
    stream(2 * I, 0, H, xa, p.Hp, true, gu, 2 * I);  // gate and up products
    pool.parallel_for(n_active, [&p, gu, I](int64_t k) {
      const int32_t e = p.ws->active[static_cast<std::size_t>(k)];
      for (int64_t use = p.ws->offsets[e]; use < p.ws->offsets[e + 1]; ++use)
        store_h(p, e, use, gu + use * 2 * I, gu + use * 2 * I + I, 0, I);
    });
    stream(H, 2 * I * H, I, p.hbuf, p.Ip, false, y, H);  // down products (after gate and up: offset 2 I H)
    pool.parallel_for(col_tiles, [&p, y](int64_t task) {
      const int64_t c0 = task * kColTile;
      down_task(p, c0, std::min(c0 + kColTile, p.H), y);
    });
  } else {  // the tiled schedule: tasks of (expert, kRowTile gate/up rows), then of kColTile columns
    const int64_t row_tiles = (I + kRowTile - 1) / kRowTile;
    pool.parallel_for(n_active * row_tiles, [&p, row_tiles](int64_t task) {
      const int32_t e = p.ws->active[static_cast<std::size_t>(task / row_tiles)];
      const int64_t j0 = task % row_tiles * kRowTile;
      gate_up_task(p, e, j0, std::min(j0 + kRowTile, p.I));
    });
    pool.parallel_for(col_tiles, [&p](int64_t task) {
      const int64_t c0 = task * kColTile;
      down_task(p, c0, std::min(c0 + kColTile, p.H), nullptr);
    });
  }
  release_if_large(ws.xa, ws.hbuf, ws.acc, ws.gu, ws.y, ws.use_token, ws.use_weight);
}

}  // namespace cpu
}  // namespace moespec
