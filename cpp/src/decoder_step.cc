// decoder_step on the CPU: every decoder layer of a decode or verify step in one native call
// (contract and rounding: cpp/include/moespec/decoder_step.h; reference: the torch forward of
// python/moespec/models/runtime.py, which tests/python/test_decoder_step.py holds this against).
//
// Values between ops are fp32 arrays holding exactly what the reference's tensors hold (bf16
// values for a bf16 model: `round_model` after every op where torch rounds). The projections are
// linear_staged (linear.h), the MoE experts moe_experts, the routing route_experts, attention a
// per-(request, kv head, token chunk) task over the cache with the NT product for q.k and the NN
// accumulation for p.v (moe_experts_simd.h). Only the projections, the experts and attention run
// on the thread pool; the elementwise ops (P x H values) run on the calling thread.
#include "moespec/decoder_step.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <tuple>
#include <utility>
#include <vector>

#include "aligned_buffer.h"
#include "linear_impl.h"
#include "moe_experts_simd.h"
#include "moespec/cpu_isa.h"
#include "moespec/detail/route_math.h"
#include "moespec/error.h"
#include "moespec/moe_experts.h"
#include "moespec/thread_pool.h"

namespace moespec {
using cpu::AlignedBuffer;
using cpu::release_if_large;
using cpu::kMoeActPad;
using cpu::MoeExpertKernels;
using cpu::moe_expert_kernels;
using cpu::staged_row_bytes;

namespace {

int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

constexpr int64_t kMaxHeadDim = 512;

// What the model dtype makes of a value: bf16 rounding, or nothing for fp32.
struct Rounder {
  bool bf16;
  float operator()(float v) const { return bf16 ? detail::bf16_to_float(detail::float_to_bf16(v)) : v; }
};

// n values into base[i, i + n) (the dtype tested once: the loops vectorise).
void store_values(void* base, DType dtype, int64_t i, const float* v, int64_t n) {
  if (dtype == DType::kBFloat16) {
    uint16_t* dst = static_cast<uint16_t*>(base) + i;
    for (int64_t j = 0; j < n; ++j) dst[j] = detail::float_to_bf16(v[j]);
  } else {
    std::memcpy(static_cast<float*>(base) + i, v, static_cast<std::size_t>(n) * 4);
  }
}

// n values from t's elements [i, i + n) as fp32.
void load_values(const TensorView& t, int64_t i, float* v, int64_t n) {
  if (n == 0) return;
  if (t.dtype == DType::kBFloat16) {
    const uint16_t* src = t.ptr<const uint16_t>() + i;
    for (int64_t j = 0; j < n; ++j) v[j] = detail::bf16_to_float(src[j]);
  } else {
    std::memcpy(v, t.ptr<const float>() + i, static_cast<std::size_t>(n) * 4);
  }
}

float silu(float g) { return g / (1.0f + std::exp(-g)); }
float sigmoid(float g) { return 1.0f / (1.0f + std::exp(-g)); }

// transformers' RMSNorm over n values: normalise in fp32, round to the model dtype, then scale.
void rms_norm(const float* x, int64_t n, const float* w, float eps, Rounder r, float* out) {
  // the squares in 16 partial sums (element i into sum i % 16), added pairwise: 16 independent
  // chains (vectorised) where one in-order sum was most of a norm's time
  float part[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int l = 0; l < 16; ++l) part[l] += x[i + l] * x[i + l];
  for (int l = 0; i < n; ++i, ++l) part[l] += x[i] * x[i];
  for (int half = 8; half >= 1; half /= 2)
    for (int l = 0; l < half; ++l) part[l] += part[l + half];
  const float ss = part[0];
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = r(w[i] * r(x[i] * inv));
}

// A weight vector's values as fp32 (norm weights, read for every token).
std::vector<float> values(const TensorView& t) {
  std::vector<float> out(static_cast<std::size_t>(t.defined() ? t.numel() : 0));
  load_values(t, 0, out.data(), static_cast<int64_t>(out.size()));
  return out;
}

void check_weight(const TensorView& t, const char* what, int64_t layer, DType dtype,
                  std::initializer_list<int64_t> shape) {
  const std::string arg = layer >= 0 ? "layers[" + std::to_string(layer) + "]." + what : std::string(what);
  MOESPEC_CHECK_ARG(t.defined() && t.data != nullptr, arg, "is missing");
  MOESPEC_CHECK_ARG(t.device == Device::kCPU, arg, "must be on the CPU, got ", t.describe());
  MOESPEC_CHECK_ARG(t.dtype == dtype, arg, "expected the model dtype ", dtype_name(dtype), ", got ", t.describe());
  MOESPEC_CHECK_ARG(t.ndim == static_cast<int32_t>(shape.size()), arg, "expected ", shape.size(), " dims, got ",
                    t.describe());
  int d = 0;
  for (int64_t s : shape) {
    MOESPEC_CHECK_ARG(t.shape[d] == s, arg, "dim ", d, " must be ", s, ", got ", t.describe());
    ++d;
  }
  MOESPEC_CHECK_ARG(t.is_contiguous(), arg, "must be contiguous, got ", t.describe());
}

}  // namespace

// Scratch of one step, reused (a warm step allocates nothing) and released after a step that left a
// buffer above the retain limit (moespec/scratch.h).
struct DecoderModel::Workspace {
  // fp32 values: residual, normed, projection outputs, q, attention output, feed-forward output,
  // activations of the shared expert / dense MLP, logits and gates
  AlignedBuffer x, h, y, q, o, mlp, inner, logits_f32;
  AlignedBuffer act;       // staged activations (stage_values)
  AlignedBuffer bits;      // model-dtype copies for moe_experts / route_experts (bf16 models)
  AlignedBuffer bits_out;  // moe_experts' output in the model dtype
  AlignedBuffer ids, weights, active, trace_active;  // routing (trace_active: the traced natural routing's)
  AlignedBuffer row_req, row_slot;  // [P] request and cache slot of each row
  AlignedBuffer span;      // [B] slots past start a request's call covers
  AlignedBuffer e;         // [P, H] fp32 values of the embeddings (layers with an embed_norm)
  AlignedBuffer cos, sin;  // [P, D] fp32 values of the rope tables' rows
  std::vector<std::array<int64_t, 4>> attend_tasks;
};

DecoderModel::DecoderModel(const DecoderShape& shape, std::vector<DecoderLayerViews> layers, TensorView final_norm,
                           TensorView lm_head)
    : shape_(shape), layers_(std::move(layers)), final_norm_(final_norm), lm_head_(lm_head),
      ws_(std::make_unique<Workspace>()), phase_seconds_(kNumDecoderPhases, 0.0) {
  const DecoderShape& s = shape_;
  MOESPEC_CHECK_ARG(s.hidden >= 1 && s.num_heads >= 1 && s.num_kv_heads >= 1 && s.head_dim >= 2 && s.vocab >= 1,
                    "shape", "hidden, heads, head_dim and vocab must be positive (head_dim >= 2), got H=", s.hidden,
                    " Hq=", s.num_heads, " Hkv=", s.num_kv_heads, " D=", s.head_dim, " V=", s.vocab);
  MOESPEC_CHECK_ARG(s.head_dim % 2 == 0 && s.head_dim <= kMaxHeadDim, "shape.head_dim",
                    "rope needs an even head_dim of at most ", kMaxHeadDim, ", got ", s.head_dim);
  MOESPEC_CHECK_ARG(s.num_heads % s.num_kv_heads == 0, "shape.num_heads", "must be a multiple of num_kv_heads=",
                    s.num_kv_heads, ", got ", s.num_heads);
  MOESPEC_CHECK_ARG(!layers_.empty(), "layers", "the model has no layers");
  MOESPEC_CHECK_ARG(s.softmax_vector_width == 8 || s.softmax_vector_width == 16, "shape.softmax_vector_width",
                    "expected 8 or 16, got ", s.softmax_vector_width);
  dtype_ = lm_head_.dtype;
  MOESPEC_CHECK_ARG(dtype_ == DType::kFloat32 || dtype_ == DType::kBFloat16, "lm_head",
                    "the native step runs float32 and bfloat16 models, got ", lm_head_.describe());
  const int64_t H = s.hidden, D = s.head_dim, Hq = s.num_heads, Hkv = s.num_kv_heads;
  check_weight(lm_head_, "lm_head", -1, dtype_, {s.vocab, H});
  check_weight(final_norm_, "final_norm", -1, dtype_, {H});
  for (int64_t i = 0; i < num_layers(); ++i) {
    const DecoderLayerViews& l = layers_[static_cast<std::size_t>(i)];
    check_weight(l.input_norm, "input_norm", i, dtype_, {H});
    if (l.embed_norm.defined()) check_weight(l.embed_norm, "embed_norm", i, dtype_, {H});
    check_weight(l.qkv, "qkv", i, dtype_, {(Hq + 2 * Hkv) * D, l.embed_norm.defined() ? 2 * H : H});
    if (l.qkv_bias.defined()) check_weight(l.qkv_bias, "qkv_bias", i, dtype_, {(Hq + 2 * Hkv) * D});
    if (s.qk_norm == QkNorm::kPerHead) {
      check_weight(l.q_norm, "q_norm", i, dtype_, {D});
      check_weight(l.k_norm, "k_norm", i, dtype_, {D});
    } else if (s.qk_norm == QkNorm::kFull) {
      check_weight(l.q_norm, "q_norm", i, dtype_, {Hq * D});
      check_weight(l.k_norm, "k_norm", i, dtype_, {Hkv * D});
    }
    check_weight(l.o, "o", i, dtype_, {H, Hq * D});
    if (l.o_bias.defined()) check_weight(l.o_bias, "o_bias", i, dtype_, {H});
    check_weight(l.post_norm, "post_norm", i, dtype_, {H});
    if (l.router.defined()) {
      const int64_t E = s.num_experts, I = s.expert_intermediate;
      MOESPEC_CHECK_ARG(E >= 1 && E <= kMaxExperts && I >= 1, "shape.num_experts",
                        "an MoE layer needs 1 <= E <= ", kMaxExperts, " and I >= 1, got E=", E, " I=", I);
      MOESPEC_CHECK_ARG(s.router.top_k >= 1 && s.router.top_k <= E, "shape.router.top_k", "must be in [1, E=", E,
                        "], got ", s.router.top_k);
      check_weight(l.router, "router", i, dtype_, {E, H});
      check_weight(l.experts, "experts", i, dtype_, {E, 3 * I * H});
      if (l.shared_down.defined()) {
        const int64_t Is = l.shared_down.shape[1];
        check_weight(l.shared_gate_up, "shared_gate_up", i, dtype_, {2 * Is, H});
        check_weight(l.shared_down, "shared_down", i, dtype_, {H, Is});
        check_weight(l.shared_gate, "shared_gate", i, dtype_, {1, H});
      }
      ++num_moe_;
    } else {
      MOESPEC_CHECK_ARG(l.gate_up.defined() && l.gate_up.ndim == 2, "layers[" + std::to_string(i) + "].gate_up",
                        "a dense layer needs gate_up [2 I, H]");
      const int64_t I = l.gate_up.shape[0] / 2;
      check_weight(l.gate_up, "gate_up", i, dtype_, {2 * I, H});
      check_weight(l.down, "down", i, dtype_, {H, I});
    }
  }
  derive_from_weights();
}

DecoderModel::~DecoderModel() = default;

void DecoderModel::derive_from_weights() {
  const DecoderShape& s = shape_;
  widest_out_ = std::max({s.hidden, (s.num_heads + 2 * s.num_kv_heads) * s.head_dim, s.num_experts});
  widest_in_ = std::max(s.hidden, s.num_heads * s.head_dim);
  embed_input_ = false;
  for (const DecoderLayerViews& l : layers_)
    if (l.embed_norm.defined()) {
      embed_input_ = true;
      widest_in_ = std::max(widest_in_, 2 * s.hidden);
    }
  for (const DecoderLayerViews& l : layers_)
    for (const TensorView* down : {&l.shared_down, &l.down})
      if (down->defined()) {
        widest_out_ = std::max(widest_out_, 2 * down->shape[1]);
        widest_in_ = std::max(widest_in_, down->shape[1]);
      }
  norms_.clear();
  for (const DecoderLayerViews& l : layers_)
    norms_.push_back({values(l.input_norm), values(l.post_norm), values(l.q_norm), values(l.k_norm),
                      values(l.embed_norm)});
  final_norm_values_ = values(final_norm_);
}

namespace {

// Everything a step's helpers share.
struct Ctx {
  const DecoderShape& s;
  const MoeExpertKernels& k;
  DType dtype;
  Rounder r;
};

// fp32 values [T, K] (row stride ld) -> activation rows (bf16 bits or fp32, in the staged layout)
// for the product with weights of dtype w_dtype.
void stage_values(const Ctx& c, DType w_dtype, const float* x, int64_t ld, int64_t T, int64_t K, void* dst) {
  const int64_t Kp = round_up(K, kMoeActPad);
  const bool act_bf16 = w_dtype == DType::kBFloat16 && c.k.bf16_act == DType::kBFloat16;
  const bool even_odd = staged_position(c.k, w_dtype, 1) != 1;
  for (int64_t t = 0; t < T; ++t) {
    if (act_bf16) {
      uint16_t* row = static_cast<uint16_t*>(dst) + t * Kp;
      for (int64_t i = 0; i < K; ++i) row[i] = detail::float_to_bf16(x[t * ld + i]);
      std::fill(row + K, row + Kp, uint16_t{0});
    } else if (even_odd) {
      float* row = static_cast<float*>(dst) + t * Kp;
      std::fill(row, row + Kp, 0.0f);
      for (int64_t i = 0; i < K; ++i) row[staged_position(c.k, w_dtype, i)] = x[t * ld + i];
    } else {
      float* row = static_cast<float*>(dst) + t * Kp;
      std::memcpy(row, x + t * ld, static_cast<std::size_t>(K) * 4);
      std::fill(row + K, row + Kp, 0.0f);
    }
  }
}

// y [T, N] = round(x [T, K] w^T + bias), all fp32 values; act: scratch for the staged x.
void project(const Ctx& c, const TensorView& w, const TensorView& bias, const float* x, int64_t T, char* act,
             float* y) {
  const int64_t N = w.shape[0], K = w.shape[1];
  stage_values(c, w.dtype, x, K, T, K, act);
  cpu::linear_staged(c.k, c.dtype, w.data, N, K, bias.defined() ? bias.data : nullptr, bias.dtype, act, T, y, N);
  if (c.r.bf16)
    for (int64_t i = 0; i < T * N; ++i) y[i] = c.r(y[i]);
}

// Rows of mask words and the request geometry of one step.
struct Geometry {
  const int32_t* offsets;  // [B + 1]
  const int32_t* start;    // [B]
  const int32_t* span;     // [B]: request b's slots of the call lie in [start, start + span)
  const uint32_t* mask;    // [P, W]
  int64_t W, B, S_max;
};

// Attention of the tokens [t0, t1) of request b for kv head g (its G query heads): scores over
// the visible slots with the NT product, softmax, the NN accumulation over v; o [P, Hq D] values.
void attend(const Ctx& c, const Geometry& geo, const void* k_layer, const void* v_layer, const float* q, float* o,
            int64_t b, int64_t g, int64_t t0, int64_t t1) {
  const DecoderShape& s = c.s;
  const int64_t D = s.head_dim, Hq = s.num_heads, Hkv = s.num_kv_heads, G = Hq / Hkv;
  const int64_t first = geo.offsets[b], start = geo.start[b];
  // Slots [0, S): the committed prefix and the call's slots up to the last one a row of the task
  // sees (a prompt's causal mask: the task's last token; later slots are masked for every row, and
  // a masked slot adds exactly 0 to the softmax sum and to the output: the same bits either way).
  int64_t seen = 0;
  for (int64_t t = t0; t < t1; ++t) {
    const uint32_t* bits = geo.mask + (first + t) * geo.W;
    for (int64_t w = geo.W - 1; w >= 0; --w)
      if (bits[w] != 0) {
        seen = std::max<int64_t>(seen, 32 * w + 32 - __builtin_clz(bits[w]));
        break;
      }
  }
  const int64_t S = start + std::max<int64_t>(std::min<int64_t>(seen, geo.span[b]), start > 0 ? 0 : 1);
  const int64_t rows = (t1 - t0) * G;
  const int64_t Dp = round_up(D, kMoeActPad);
  const std::size_t w_size = dtype_size(c.dtype);
  const std::size_t head_off = static_cast<std::size_t>((b * Hkv + g) * geo.S_max * D) * w_size;
  const char* kb = static_cast<const char*>(k_layer) + head_off;
  const char* vb = static_cast<const char*>(v_layer) + head_off;

  thread_local AlignedBuffer qv, scores, acc, act, kv;
  float* qrows = qv.get<float>(rows * D);
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t hg = 0; hg < G; ++hg)
      std::memcpy(qrows + ((t - t0) * G + hg) * D, q + (first + t) * Hq * D + (g * G + hg) * D,
                  static_cast<std::size_t>(D) * 4);
  char* a = act.get<char>(rows * Dp * 4);
  // The head's keys and values as fp32 once per task (bf16 caches): every token row of the task
  // then runs the fp32 products on them instead of converting each cache row again.
  const void* keys = kb;
  const void* vals = vb;
  bool f32 = c.dtype == DType::kFloat32;
  if (!f32 && c.k.bf16_act == DType::kFloat32) {
    float* kf = kv.get<float>(2 * S * D);
    const uint16_t* k16 = reinterpret_cast<const uint16_t*>(kb);
    const uint16_t* v16 = reinterpret_cast<const uint16_t*>(vb);
    for (int64_t i = 0; i < S * D; ++i) kf[i] = detail::bf16_to_float(k16[i]);
    for (int64_t i = 0; i < S * D; ++i) kf[S * D + i] = detail::bf16_to_float(v16[i]);
    keys = kf;
    vals = kf + S * D;
    f32 = true;
  }
  stage_values(c, f32 ? DType::kFloat32 : DType::kBFloat16, qrows, D, rows, D, a);
  float* sc = scores.get<float>(rows * S);
  (f32 ? c.k.matmul_f32 : c.k.matmul_bf16)(keys, D, S, a, Dp, nullptr, rows, D, sc, S);

  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  thread_local std::vector<float> inv_sum;
  inv_sum.resize(static_cast<std::size_t>(rows));
  for (int64_t t = t0; t < t1; ++t) {
    const uint32_t* bits = geo.mask + (first + t) * geo.W;
    for (int64_t hg = 0; hg < G; ++hg) {
      const int64_t n = (t - t0) * G + hg;
      float* row = sc + n * S;
      for (int64_t j = 0; j < start; ++j) row[j] *= scale;  // the committed prefix: all visible
      for (int64_t j = start; j < S; ++j) {  // the call's slots: by the mask
        const bool visible = (bits[(j - start) >> 5] >> ((j - start) & 31)) & 1u;
        row[j] = visible ? row[j] * scale : -std::numeric_limits<float>::infinity();
      }
      // the maximum in 8 partial maxima (exact in any order; 8 chains instead of one)
      float part[8];
      std::fill_n(part, 8, -std::numeric_limits<float>::infinity());
      int64_t j = 0;
      for (; j + 8 <= S; j += 8)
        for (int l = 0; l < 8; ++l) part[l] = std::max(part[l], row[j + l]);
      for (int l = 0; j < S; ++j, ++l) part[l] = std::max(part[l], row[j]);
      const float m = std::max({part[0], part[1], part[2], part[3], part[4], part[5], part[6], part[7]});
      inv_sum[static_cast<std::size_t>(n)] = 1.0f / c.k.exp_sum(row, S, m);
    }
  }
  float* out = acc.get<float>(rows * D);
  std::fill_n(out, rows * D, 0.0f);
  (f32 ? c.k.accumulate_f32 : c.k.accumulate_bf16)(vals, D, S, D, sc, S, rows, out, D);
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t hg = 0; hg < G; ++hg) {
      const int64_t n = (t - t0) * G + hg;
      float* dst = o + (first + t) * Hq * D + (g * G + hg) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = c.r(out[n * D + d] * inv_sum[static_cast<std::size_t>(n)]);
    }  release_if_large(qv, scores, acc, act, kv, inv_sum);
}

constexpr int64_t kAttendChunk = 8;  // tokens per attention task (at most)

// fn(p0, p1) over the rows [0, P): from kParallelRowsMin rows on (a prompt) on the pool, in blocks of
// kRowBlock rows; below it inline (a decode or verify step: waking the pool costs more than its
// rows). Every row is computed by the same code either way (the same bits).
constexpr int64_t kParallelRowsMin = 32;
constexpr int64_t kRowBlock = 16;

template <typename F>
void for_rows(int64_t P, F&& fn) {
  if (P < kParallelRowsMin) {
    fn(int64_t{0}, P);
    return;
  }
  ThreadPool::instance().parallel_for((P + kRowBlock - 1) / kRowBlock, [&](int64_t i) {
    fn(i * kRowBlock, std::min(P, (i + 1) * kRowBlock));
  });
}

// Adds the time since the last mark to one phase (when profiling).
class PhaseClock {
 public:
  PhaseClock(bool on, std::vector<double>& seconds) : on_(on), seconds_(seconds), last_(now()) {}
  void mark(int phase) {
    if (!on_) return;
    const auto t = now();
    seconds_[static_cast<std::size_t>(phase)] += std::chrono::duration<double>(t - last_).count();
    last_ = t;
  }

 private:
  static std::chrono::steady_clock::time_point now() { return std::chrono::steady_clock::now(); }
  bool on_;
  std::vector<double>& seconds_;
  std::chrono::steady_clock::time_point last_;
};
enum Phase { kNorm, kQkv, kRope, kAttend, kOProj, kRoute, kExperts, kShared, kDense, kHead };

}  // namespace

void DecoderModel::step(const DecoderStepArgs& a) {
  const DecoderShape& s = shape_;
  const int64_t H = s.hidden, D = s.head_dim, Hq = s.num_heads, Hkv = s.num_kv_heads, L = num_layers();
  const int64_t Nq = Hq * D, Nkv = Hkv * D;
  const std::string dt = dtype_name(dtype_);
  // ---- validation (nothing is written before it passes) ----
  check_not_null(a.x, "x");
  check_ndim(a.x, "x", 2);
  check_dim(a.x, "x", 1, H);
  check_dtype(a.x, "x", {dtype_});
  check_contiguous(a.x, "x");
  check_device(a.x, "x", Device::kCPU);
  const int64_t P = a.x.shape[0];
  MOESPEC_CHECK_ARG(P >= 1 && P <= kMaxDecoderStepTokens, "x", "a step runs 1 to ", kMaxDecoderStepTokens,
                    " tokens, got ", P);
  for (auto [t, name] : {std::pair{&a.cos, "cos"}, std::pair{&a.sin, "sin"}}) {
    check_not_null(*t, name);
    check_ndim(*t, name, 2);
    check_dim(*t, name, 0, P);
    check_dim(*t, name, 1, D);
    check_dtype(*t, name, {dtype_});
    check_contiguous(*t, name);
    check_device(*t, name, Device::kCPU);
  }
  check_not_null(a.offsets, "offsets");
  check_ndim(a.offsets, "offsets", 1);
  check_dtype(a.offsets, "offsets", {DType::kInt32});
  check_contiguous(a.offsets, "offsets");
  const int64_t B = a.offsets.shape[0] - 1;
  MOESPEC_CHECK_ARG(B >= 1, "offsets", "expected [B + 1] with B >= 1, got ", a.offsets.describe());
  for (auto [t, name] : {std::pair{&a.k_cache, "k_cache"}, std::pair{&a.v_cache, "v_cache"}}) {
    check_not_null(*t, name);
    check_ndim(*t, name, 5);
    check_dim(*t, name, 0, L);
    check_dim(*t, name, 1, B);
    check_dim(*t, name, 2, Hkv);
    check_dim(*t, name, 4, D);
    check_dtype(*t, name, {dtype_});
    check_contiguous(*t, name);
    check_device(*t, name, Device::kCPU);
  }
  const int64_t S_max = a.k_cache.shape[3];
  check_dim(a.v_cache, "v_cache", 3, S_max);
  check_not_null(a.start, "start");
  check_ndim(a.start, "start", 1);
  check_dim(a.start, "start", 0, B);
  check_dtype(a.start, "start", {DType::kInt32});
  check_contiguous(a.start, "start");
  check_not_null(a.mask, "mask");
  check_ndim(a.mask, "mask", 2);
  check_dim(a.mask, "mask", 0, P);
  check_dtype(a.mask, "mask", {DType::kInt32});
  check_contiguous(a.mask, "mask");
  const int64_t W = a.mask.shape[1];
  const int32_t* offsets = a.offsets.ptr<const int32_t>();
  const int32_t* start = a.start.ptr<const int32_t>();
  MOESPEC_CHECK_ARG(offsets[0] == 0 && offsets[B] == P, "offsets", "must run from 0 to P=", P, ", got ", offsets[0],
                    " .. ", offsets[B]);
  const int32_t* slots = nullptr;
  if (a.slots.defined()) {
    check_ndim(a.slots, "slots", 1);
    check_dim(a.slots, "slots", 0, P);
    check_dtype(a.slots, "slots", {DType::kInt32});
    check_contiguous(a.slots, "slots");
    slots = a.slots.ptr<const int32_t>();
  }
  if (embed_input_) {
    check_not_null(a.embed, "embed");
    check_ndim(a.embed, "embed", 2);
    check_dim(a.embed, "embed", 0, P);
    check_dim(a.embed, "embed", 1, H);
    check_dtype(a.embed, "embed", {dtype_});
    check_contiguous(a.embed, "embed");
  }
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = offsets[b + 1] - offsets[b];
    MOESPEC_CHECK_ARG(n >= 0, "offsets", "must be non-decreasing, got offsets[", b, "]=", offsets[b], " > offsets[",
                      b + 1, "]=", offsets[b + 1]);
    int64_t span = n;
    if (slots != nullptr) {
      span = 0;
      for (int64_t p = offsets[b]; p < offsets[b + 1]; ++p) {
        MOESPEC_CHECK_ARG(slots[p] >= 0, "slots", "row ", p, " has slot offset ", slots[p], " < 0");
        span = std::max<int64_t>(span, int64_t{slots[p]} + 1);
      }
    }
    MOESPEC_CHECK_ARG(start[b] >= 0 && start[b] + span <= S_max, "start", "request ", b, " holds ", start[b],
                      " tokens; ", span, " more slots exceed the cache's ", S_max, " slots");
    MOESPEC_CHECK_ARG(span <= 32 * W, "mask", "request ", b, " writes ", span, " slots past its start but mask rows "
                      "hold ", 32 * W, " bits");
  }
  int64_t n_taps = 0;
  const int32_t* taps = nullptr;
  if (a.taps.defined()) {
    check_ndim(a.taps, "taps", 1);
    check_dtype(a.taps, "taps", {DType::kInt32});
    check_contiguous(a.taps, "taps");
    n_taps = a.taps.shape[0];
    taps = a.taps.ptr<const int32_t>();
    for (int64_t i = 0; i < n_taps; ++i)
      MOESPEC_CHECK_ARG(taps[i] >= 0 && taps[i] < L, "taps", "layer ", taps[i], " does not exist (", L, " layers)");
    if (n_taps > 0) {
      check_not_null(a.tap_out, "tap_out");
      check_ndim(a.tap_out, "tap_out", 3);
      check_dim(a.tap_out, "tap_out", 0, n_taps);
      check_dim(a.tap_out, "tap_out", 1, P);
      check_dim(a.tap_out, "tap_out", 2, H);
      check_dtype(a.tap_out, "tap_out", {dtype_});
      check_contiguous(a.tap_out, "tap_out");
    }
  }
  check_not_null(a.logit_rows, "logit_rows");
  check_ndim(a.logit_rows, "logit_rows", 1);
  check_dtype(a.logit_rows, "logit_rows", {DType::kInt32});
  check_contiguous(a.logit_rows, "logit_rows");
  const int64_t R = a.logit_rows.shape[0];
  const int32_t* logit_rows = a.logit_rows.ptr<const int32_t>();
  for (int64_t i = 0; i < R; ++i)
    MOESPEC_CHECK_ARG(logit_rows[i] >= 0 && logit_rows[i] < P, "logit_rows", "row ", logit_rows[i],
                      " is outside [0, P=", P, ")");
  check_not_null(a.logits, "logits");
  check_ndim(a.logits, "logits", 2);
  check_dim(a.logits, "logits", 0, R);
  check_dim(a.logits, "logits", 1, s.vocab);
  check_dtype(a.logits, "logits", {dtype_, DType::kFloat32});
  check_contiguous(a.logits, "logits");
  if (num_moe_ > 0) {
    check_not_null(a.stats, "stats");
    check_ndim(a.stats, "stats", 2);
    check_dim(a.stats, "stats", 0, num_moe_);
    check_dim(a.stats, "stats", 1, kRoutingStatsSize);
    check_dtype(a.stats, "stats", {DType::kInt32});
    check_contiguous(a.stats, "stats");  // (route_experts checks the budget at the first MoE layer; only
                                         // the new tokens' uncommitted slots are written by then)
  }
  const bool tracing = a.trace_ids.defined() || a.trace_weights.defined();
  if (tracing) {
    MOESPEC_CHECK_ARG(a.trace_ids.defined() && a.trace_weights.defined(), "trace_ids",
                      "trace_ids and trace_weights go together (give both or neither)");
    MOESPEC_CHECK_ARG(num_moe_ > 0, "trace_ids", "the model has no MoE layer to trace");
    const int64_t K = s.router.top_k;
    for (const auto& [view, name, dt] : {std::tuple{&a.trace_ids, "trace_ids", DType::kInt32},
                                          std::tuple{&a.trace_weights, "trace_weights", DType::kFloat32}}) {
      check_not_null(*view, name);
      check_ndim(*view, name, 3);
      check_dim(*view, name, 0, num_moe_);
      check_dim(*view, name, 1, P);
      check_dim(*view, name, 2, K);
      check_dtype(*view, name, {dt});
      check_contiguous(*view, name);
    }
  }

  // ---- the step ----
  std::lock_guard<std::mutex> lock(step_mutex_);
  Workspace& ws = *ws_;
  const Ctx c{s, moe_expert_kernels(active_cpu_isa()), dtype_, Rounder{dtype_ == DType::kBFloat16}};
  const Rounder r = c.r;
  const int64_t widest = widest_out_, widest_in = widest_in_;  // widest projection output / input
  float* x = ws.x.get<float>(P * H);
  float* h = ws.h.get<float>(P * (embed_input_ ? 2 * H : H));
  float* y = ws.y.get<float>(P * widest);
  float* q = ws.q.get<float>(P * Nq);
  float* o = ws.o.get<float>(P * Nq);
  float* mlp = ws.mlp.get<float>(P * H);
  float* inner = ws.inner.get<float>(P * widest_in);
  char* act = ws.act.get<char>(static_cast<int64_t>(staged_row_bytes(c.k, DType::kFloat32, widest_in)) * P);
  load_values(a.x, 0, x, P * H);
  float* cos_v = ws.cos.get<float>(P * D);
  float* sin_v = ws.sin.get<float>(P * D);
  load_values(a.cos, 0, cos_v, P * D);
  load_values(a.sin, 0, sin_v, P * D);
  int32_t* row_req = ws.row_req.get<int32_t>(P);
  int32_t* row_slot = ws.row_slot.get<int32_t>(P);  // cache slot of each row
  int32_t* span = ws.span.get<int32_t>(B);
  for (int64_t b = 0; b < B; ++b) {
    span[b] = 0;
    for (int32_t p = offsets[b]; p < offsets[b + 1]; ++p) {
      const int32_t rel = slots != nullptr ? slots[p] : p - offsets[b];
      row_req[p] = static_cast<int32_t>(b);
      row_slot[p] = start[b] + rel;
      span[b] = std::max(span[b], rel + 1);
    }
  }
  float* e = embed_input_ ? ws.e.get<float>(P * H) : nullptr;
  if (e != nullptr)
    load_values(a.embed, 0, e, P * H);

  const Geometry geo{offsets, start, span, reinterpret_cast<const uint32_t*>(a.mask.data), W, B, S_max};
  const std::size_t w_size = dtype_size(dtype_);
  const std::size_t layer_elems = static_cast<std::size_t>(B * Hkv * S_max * D);
  ThreadPool& pool = ThreadPool::instance();
  std::vector<std::array<int64_t, 4>>& attend_tasks = ws.attend_tasks;  // (request, kv head, t0, t1)
  attend_tasks.clear();  // keeps its capacity: a warm step allocates nothing
  // Tokens per task: kAttendChunk, or fewer where the (request, kv head) pairs alone would leave
  // a thread idle (a verify of 7 tokens with 3 kv heads: 6 tasks for 2 threads, not 3). A row's
  // values do not depend on its task.
  const int64_t pairs = B * Hkv, wanted = 2 * static_cast<int64_t>(pool.num_threads());
  const int64_t per_pair = std::max<int64_t>(1, (wanted + pairs - 1) / pairs);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = offsets[b + 1] - offsets[b];
    const int64_t chunk = std::clamp<int64_t>((n + per_pair - 1) / per_pair, 1, kAttendChunk);
    for (int64_t g = 0; g < Hkv; ++g)
      for (int64_t t0 = 0; t0 < n; t0 += chunk) attend_tasks.push_back({b, g, t0, std::min<int64_t>(t0 + chunk, n)});
  }

  int64_t moe_index = 0;
  PhaseClock clock(profiling_, phase_seconds_);
  for (int64_t li = 0; li < L; ++li) {
    const DecoderLayerViews& l = layers_[static_cast<std::size_t>(li)];
    // attention
    const LayerNorms& norms = norms_[static_cast<std::size_t>(li)];
    if (l.embed_norm.defined()) {  // EAGLE-3: q/k/v from cat(embed_norm(e), input_norm(x)) [P, 2H]
      for_rows(P, [&](int64_t p0, int64_t p1) {
        for (int64_t p = p0; p < p1; ++p) {
          rms_norm(e + p * H, H, norms.embed.data(), s.rms_norm_eps, r, h + p * 2 * H);
          rms_norm(x + p * H, H, norms.input.data(), s.rms_norm_eps, r, h + p * 2 * H + H);
          if (s.norm_before_residual) std::memcpy(x + p * H, h + p * 2 * H + H, static_cast<std::size_t>(H) * 4);
        }
      });
    } else {
      for_rows(P, [&](int64_t p0, int64_t p1) {
        for (int64_t p = p0; p < p1; ++p) rms_norm(x + p * H, H, norms.input.data(), s.rms_norm_eps, r, h + p * H);
      });
    }
    clock.mark(kNorm);
    const int64_t Nqkv = Nq + 2 * Nkv;
    project(c, l.qkv, l.qkv_bias, h, P, act, y);
    clock.mark(kQkv);
    char* k_layer = static_cast<char*>(a.k_cache.data) + li * layer_elems * w_size;
    char* v_layer = static_cast<char*>(a.v_cache.data) + li * layer_elems * w_size;
    for_rows(P, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        float* qp = y + p * Nqkv;
        float* kp = qp + Nq;
        float* vp = kp + Nkv;
        if (s.qk_norm == QkNorm::kFull) {
          rms_norm(qp, Nq, norms.q.data(), s.rms_norm_eps, r, qp);
          rms_norm(kp, Nkv, norms.k.data(), s.rms_norm_eps, r, kp);
        }
        if (s.clip_qkv > 0.0f)
          for (int64_t i = 0; i < Nqkv; ++i) qp[i] = std::clamp(qp[i], -s.clip_qkv, s.clip_qkv);
        if (s.qk_norm == QkNorm::kPerHead) {
          for (int64_t hh = 0; hh < Hq; ++hh) rms_norm(qp + hh * D, D, norms.q.data(), s.rms_norm_eps, r, qp + hh * D);
          for (int64_t hh = 0; hh < Hkv; ++hh) rms_norm(kp + hh * D, D, norms.k.data(), s.rms_norm_eps, r, kp + hh * D);
        }
        // rope: x * cos + rotate_half(x) * sin, each product and the sum rounded
        const int64_t half = D / 2;
        float rot[kMaxHeadDim];
        auto rope = [&](float* v) {
          for (int64_t d = 0; d < D; ++d) rot[d] = d < half ? -v[d + half] : v[d - half];
          for (int64_t d = 0; d < D; ++d) {
            const float cs = cos_v[p * D + d], sn = sin_v[p * D + d];
            v[d] = r(r(v[d] * cs) + r(rot[d] * sn));
          }
        };
        for (int64_t hh = 0; hh < Hq; ++hh) rope(qp + hh * D);
        for (int64_t hh = 0; hh < Hkv; ++hh) rope(kp + hh * D);
        std::memcpy(q + p * Nq, qp, static_cast<std::size_t>(Nq) * 4);
        const int64_t b = row_req[p];
        const int64_t slot = row_slot[p];
        for (int64_t g = 0; g < Hkv; ++g) {
          const std::size_t at = static_cast<std::size_t>(((b * Hkv + g) * S_max + slot) * D);
          store_values(k_layer, dtype_, static_cast<int64_t>(at), kp + g * D, D);
          store_values(v_layer, dtype_, static_cast<int64_t>(at), vp + g * D, D);
        }
      }
    });
    clock.mark(kRope);
    pool.parallel_for(static_cast<int64_t>(attend_tasks.size()), [&](int64_t i) {
      const auto& t = attend_tasks[static_cast<std::size_t>(i)];
      attend(c, geo, k_layer, v_layer, q, o, t[0], t[1], t[2], t[3]);
    });
    clock.mark(kAttend);
    project(c, l.o, l.o_bias, o, P, act, y);
    clock.mark(kOProj);
    // the residual, then the feed-forward's norm
    for_rows(P, [&](int64_t p0, int64_t p1) {
      for (int64_t i = p0 * H; i < p1 * H; ++i) x[i] = r(x[i] + y[i]);
      for (int64_t p = p0; p < p1; ++p) rms_norm(x + p * H, H, norms.post.data(), s.rms_norm_eps, r, h + p * H);
    });
    clock.mark(kNorm);
    if (l.router.defined()) {
      const int64_t E = s.num_experts, K = s.router.top_k;
      project(c, l.router, TensorView{}, h, P, act, y);  // router logits [P, E]
      uint16_t* bits = ws.bits.get<uint16_t>(P * std::max(E, H) * 2);
      RouteExpertsArgs ra;
      if (dtype_ == DType::kBFloat16) {
        for (int64_t i = 0; i < P * E; ++i) bits[i] = detail::float_to_bf16(y[i]);
        ra.router_logits = TensorView::contiguous(bits, DType::kBFloat16, {P, E});
      } else {
        ra.router_logits = TensorView::contiguous(y, DType::kFloat32, {P, E});
      }
      int32_t* ids = ws.ids.get<int32_t>(P * K);
      float* weights = ws.weights.get<float>(P * K);
      ra.ids = TensorView::contiguous(ids, DType::kInt32, {P, K});
      ra.weights = TensorView::contiguous(weights, DType::kFloat32, {P, K});
      ra.active = TensorView::contiguous(ws.active.get<int32_t>(E), DType::kInt32, {E});
      ra.stats = TensorView::contiguous(a.stats.ptr<int32_t>() + moe_index * kRoutingStatsSize, DType::kInt32,
                                        {kRoutingStatsSize});
      ra.spec = s.router;
      ra.budget = moe_index < a.exact_layers ? ExpertBudget{} : a.budget;
      ra.softmax_vector_width = s.softmax_vector_width;
      cpu::route_experts(ra);
      if (tracing) {  // the natural routing: what was run, or (with a budget) a second, unbudgeted routing
        int32_t* t_ids = a.trace_ids.ptr<int32_t>() + moe_index * P * K;
        float* t_weights = a.trace_weights.ptr<float>() + moe_index * P * K;
        if (ra.budget.max_experts > 0) {
          RouteExpertsArgs na = ra;
          na.budget = ExpertBudget{};
          na.ids = TensorView::contiguous(t_ids, DType::kInt32, {P, K});
          na.weights = TensorView::contiguous(t_weights, DType::kFloat32, {P, K});
          na.active = TensorView::contiguous(ws.trace_active.get<int32_t>(E), DType::kInt32, {E});
          int32_t natural_stats[kRoutingStatsSize];
          na.stats = TensorView::contiguous(natural_stats, DType::kInt32, {kRoutingStatsSize});
          cpu::route_experts(na);
        } else {
          std::copy(ids, ids + P * K, t_ids);
          std::copy(weights, weights + P * K, t_weights);
        }
      }
      if (s.weights_in_model_dtype)
        for (int64_t i = 0; i < P * K; ++i) weights[i] = r(weights[i]);
      clock.mark(kRoute);
      MoeExpertsArgs ma;
      void* hx = h;
      void* out = mlp;
      uint16_t* out_bits = ws.bits_out.get<uint16_t>(P * H);
      if (dtype_ == DType::kBFloat16) {
        for (int64_t i = 0; i < P * H; ++i) bits[i] = detail::float_to_bf16(h[i]);
        hx = bits;
        out = out_bits;
      }
      ma.x = TensorView::contiguous(hx, dtype_, {P, H});
      ma.ids = ra.ids;
      ma.weights = ra.weights;
      ma.experts = l.experts;
      ma.out = TensorView::contiguous(out, dtype_, {P, H});
      ma.intermediate_size = s.expert_intermediate;
      cpu::moe_experts(ma);
      if (dtype_ == DType::kBFloat16)
        for (int64_t i = 0; i < P * H; ++i) mlp[i] = detail::bf16_to_float(out_bits[i]);
      clock.mark(kExperts);
      if (l.shared_down.defined()) {
        const int64_t Is = l.shared_down.shape[1];
        project(c, l.shared_gate_up, TensorView{}, h, P, act, y);  // [P, 2 Is]
        for (int64_t p = 0; p < P; ++p)
          for (int64_t j = 0; j < Is; ++j)
            inner[p * Is + j] = r(r(silu(y[p * 2 * Is + j])) * y[p * 2 * Is + Is + j]);
        float* gate = ws.logits_f32.get<float>(P);
        project(c, l.shared_gate, TensorView{}, h, P, act, gate);  // [P, 1]
        project(c, l.shared_down, TensorView{}, inner, P, act, y);  // [P, H]
        for (int64_t p = 0; p < P; ++p) {
          const float sg = r(sigmoid(gate[p]));
          for (int64_t j = 0; j < H; ++j) mlp[p * H + j] = r(mlp[p * H + j] + r(sg * y[p * H + j]));
        }
        clock.mark(kShared);
      }
      ++moe_index;
    } else {
      const int64_t I = l.down.shape[1];
      project(c, l.gate_up, TensorView{}, h, P, act, y);  // [P, 2 I]
      for (int64_t p = 0; p < P; ++p)
        for (int64_t j = 0; j < I; ++j) inner[p * I + j] = r(r(silu(y[p * 2 * I + j])) * y[p * 2 * I + I + j]);
      project(c, l.down, TensorView{}, inner, P, act, mlp);
      clock.mark(kDense);
    }
    for_rows(P, [&](int64_t p0, int64_t p1) {
      for (int64_t i = p0 * H; i < p1 * H; ++i) x[i] = r(x[i] + mlp[i]);
    });
    for (int64_t t = 0; t < n_taps; ++t)
      if (taps[t] == li) store_values(a.tap_out.data, dtype_, t * P * H, x, P * H);
    clock.mark(kNorm);
  }
  store_values(a.x.data, dtype_, 0, x, P * H);

  // logits of the chosen rows
  for (int64_t i = 0; i < R; ++i)
    rms_norm(x + logit_rows[i] * H, H, final_norm_values_.data(), s.rms_norm_eps, r, h + i * H);
  float* logits = ws.logits_f32.get<float>(R * s.vocab);
  if (R > 0) {
    project(c, lm_head_, TensorView{}, h, R, act, logits);
    if (a.logits.dtype == DType::kFloat32) {  // the model dtype's values, widened exactly
      float* out = a.logits.ptr<float>();
      for (int64_t i = 0; i < R * s.vocab; ++i) out[i] = r(logits[i]);
    } else {
      store_values(a.logits.data, dtype_, 0, logits, R * s.vocab);
    }
  }
  clock.mark(kHead);
  release_if_large(ws.x, ws.h, ws.y, ws.q, ws.o, ws.mlp, ws.inner, ws.logits_f32, ws.act, ws.bits, ws.bits_out,
                   ws.ids, ws.weights, ws.active, ws.trace_active, ws.row_req, ws.row_slot, ws.span, ws.e, ws.cos,
                   ws.sin);
}

}  // namespace moespec
