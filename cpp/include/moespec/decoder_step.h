// decoder_step: the target model's decoder layers for one decode or verify call, in native code.
//
// The runtime's fast path (python/moespec/runtime/backend.py, NativeBackend): one call runs every
// decoder layer of a step, from the embedded tokens to the logits, with no per-op dispatch. Its
// semantics are the reference forward's (python/moespec/models/runtime.py, the torch ops), which
// the tests hold it against (tests/python/test_decoder_step.py):
//
//   per layer:  h = rms_norm(x); q, k, v = qkv h (+ bias); [q/k norm]; [clip]; rope(q, k);
//               write k, v at the tokens' cache slots; o = attention(q, cache, mask); x += o_proj o
//               h = rms_norm(x); x += moe(h) (router -> route_experts with the budget -> moe_experts
//               [+ sigmoid-gated shared expert]) or dense SwiGLU(h)
//   then:       taps (x after the tap layers), logits = lm_head(rms_norm(x)) for the chosen rows.
//
// Rounding (bf16 models): every op rounds its result to bf16 where the torch reference does
// (norm output, each projection, rope's two products and their sum, attention output, residual
// adds, activation, gate); products and sums inside an op are fp32 (linear.h, moe_experts.h).
// fp32 models: fp32 throughout. The result equals the reference within the tolerance of the
// summation orders (stated in the test), and it is batch-invariant: every value of token t depends
// only on t's row, its cache and its mask, never on the other tokens of the call or the thread
// count, so a verify pass gives the same bits as decoding the same tokens one by one.
//
// Tokens are packed (no padding): the P tokens of the call are grouped by request; request b owns
// rows [offsets[b], offsets[b + 1]) and its n_b new tokens go to cache slots start[b] + j (or
// start[b] + slots[p] when slots are given). Token p of request b sees the committed slots
// [0, start[b]) and the slots start[b] + i whose bit (i % 32) of word i / 32 of mask row p is set
// (ancestor-or-self rows for a tree; i <= j for a sequence): the draft tree's packed mask
// (draft_tree.h) as it is. Bits at or past the request's highest slot written in the call are
// ignored.
//
// The same step runs EAGLE-3's draft layer (python/moespec/spec/eagle3.py, the midlayer): a layer
// with an embed_norm projects q/k/v from cat(embed_norm(e), input_norm(x)) [2H], e the tokens'
// embeddings (args.embed), and keeps x (or input_norm(x) with norm_before_residual) as its
// residual; the draft's scratch slots are the explicit slots.
//
// Dimensions: P tokens, B requests, L layers, H hidden, Hq/Hkv query/key-value heads, D head dim,
// S_max cache slots, W mask words, E experts, K top-k, I (expert) intermediate, Is shared
// intermediate, V vocabulary, R logit rows, Lm MoE layers, NT taps.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "moespec/route_experts.h"
#include "moespec/tensor_view.h"

namespace moespec {

enum class QkNorm : int32_t { kNone = 0, kPerHead = 1, kFull = 2 };

struct DecoderShape {
  int64_t hidden = 0;      // H
  int64_t num_heads = 0;   // Hq
  int64_t num_kv_heads = 0;  // Hkv
  int64_t head_dim = 0;    // D
  int64_t vocab = 0;       // V
  float rms_norm_eps = 1e-6f;
  QkNorm qk_norm = QkNorm::kNone;
  float clip_qkv = 0.0f;   // > 0: clamp q, k, v to [-clip, clip]
  // MoE layers
  int64_t num_experts = 0;         // E
  int64_t expert_intermediate = 0;  // I of one expert
  RouterSpec router;
  bool weights_in_model_dtype = false;  // routing weights rounded to the model dtype (Qwen3, OLMoE)
  int32_t softmax_vector_width = 16;    // route_experts' rounding (route_experts.h)
  bool norm_before_residual = false;    // layers with an embed_norm: the residual is input_norm(x), not x
};

// One layer's weights in the runtime layout (python/moespec/models/weights.py); absent views are
// default-constructed. All in the model dtype (float32 or bfloat16), contiguous, on the CPU.
struct DecoderLayerViews {
  TensorView input_norm;  // [H]
  TensorView embed_norm;  // [H] (optional): q/k/v from cat(embed_norm(embed), input_norm(x)) (EAGLE-3)
  TensorView qkv;         // [(Hq + 2 Hkv) D, H], or [(Hq + 2 Hkv) D, 2 H] with an embed_norm
  TensorView qkv_bias;    // [(Hq + 2 Hkv) D] (optional)
  TensorView q_norm;      // [D] per-head or [Hq D] full (with qk_norm)
  TensorView k_norm;      // [D] or [Hkv D]
  TensorView o;           // [H, Hq D]
  TensorView o_bias;      // [H] (optional)
  TensorView post_norm;   // [H]
  TensorView gate_up;     // dense layer: [2 I, H]
  TensorView down;        // dense layer: [H, I]
  TensorView router;      // MoE layer: [E, H]
  TensorView experts;     // MoE layer: [E, 3 I H]
  TensorView shared_gate_up;  // shared expert (optional): [2 Is, H]
  TensorView shared_down;     // [H, Is]
  TensorView shared_gate;     // [1, H]
};

struct DecoderStepArgs {
  TensorView x;        // in/out [P, H] model dtype: the embedded tokens in, the last residual out
  TensorView cos;      // [P, D] model dtype: rope cos at each token's position (as the reference builds it)
  TensorView sin;      // [P, D]
  TensorView k_cache;  // in/out [L, B, Hkv, S_max, D] model dtype, contiguous
  TensorView v_cache;  // in/out [L, B, Hkv, S_max, D]
  TensorView offsets;  // [B + 1] int32: request b's rows are [offsets[b], offsets[b + 1])
  TensorView start;    // [B] int32: committed tokens of request b (its new tokens' first slot)
  TensorView mask;     // [P, W] int32: bit i of row p = p sees its request's slot start[b] + i
  TensorView slots;    // [P] int32 (optional): token p's slot is start[b] + slots[p]; default p - offsets[b]
  TensorView embed;    // [P, H] model dtype: the tokens' embeddings (needed by layers with an embed_norm)
  TensorView taps;     // [NT] int32: layers whose output residual is copied out (optional)
  TensorView tap_out;  // out [NT, P, H] model dtype
  TensorView logit_rows;  // [R] int32: rows of x whose logits are computed
  TensorView logits;      // out [R, V] model dtype, or float32 (the model dtype's values widened exactly)
  TensorView stats;       // out [Lm, 4] int32: RoutingStats per MoE layer
  // Routing trace (optional, both or neither; python/moespec/models/trace.py): the natural
  // (unbudgeted) top-K ids and weights of every token at every MoE layer. With a budget the step
  // routes a second time without it for the trace; without one it copies the routing it ran.
  TensorView trace_ids;      // out [Lm, P, K] int32
  TensorView trace_weights;  // out [Lm, P, K] float32
  ExpertBudget budget;    // max_experts 0: no budget
  int32_t exact_layers = 0;  // the first exact_layers MoE layers run without the budget
};

// The phases a step's time is split into when profiling (DecoderModel::profile).
constexpr int kNumDecoderPhases = 10;
constexpr const char* kDecoderPhases[kNumDecoderPhases] = {
    "norms+residual", "qkv", "rope+cache write", "attention", "o_proj",
    "router+routing", "routed experts", "shared expert", "dense mlp", "final norm+lm_head"};

// A model's layers as the native step sees them: shapes and weight views, checked once.
class DecoderModel {
 public:
  // Throws Error(kInvalidArgument) naming the layer and tensor at fault. The views must stay valid
  // (the caller owns the tensors) for the life of the object.
  DecoderModel(const DecoderShape& shape, std::vector<DecoderLayerViews> layers, TensorView final_norm,
               TensorView lm_head);
  ~DecoderModel();

  // Runs one step (see the file comment). Validates the arguments first; a failed call leaves the
  // cache's committed slots unchanged. Scratch memory is kept between calls (at most
  // kMaxDecoderStepTokens tokens' worth), released after a step that left a buffer above the retain
  // limit (moespec/scratch.h). Calls from several threads are serialized
  // (they share the scratch).
  void step(const DecoderStepArgs& args);

  // Profiling (off by default): seconds spent per phase of the steps run since the last reset, in
  // the order of kDecoderPhases. Costs two clock reads per phase and layer when on.
  void set_profiling(bool on) { profiling_ = on; }
  const std::vector<double>& profile() const { return phase_seconds_; }
  void reset_profile() { phase_seconds_.assign(kNumDecoderPhases, 0.0); }

  const DecoderShape& shape() const { return shape_; }
  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  int64_t num_moe_layers() const { return num_moe_; }

 private:
  struct Workspace;
  struct LayerNorms {  // fp32 values of a layer's norm weights (empty when absent)
    std::vector<float> input, post, q, k, embed;
  };
  void derive_from_weights();  // norms_, final_norm_values_, widest_*_: computed once

  DecoderShape shape_;
  std::vector<DecoderLayerViews> layers_;
  TensorView final_norm_, lm_head_;
  DType dtype_ = DType::kFloat32;
  int64_t num_moe_ = 0;
  std::vector<LayerNorms> norms_;
  std::vector<float> final_norm_values_;
  int64_t widest_out_ = 0, widest_in_ = 0;  // widest projection output / input over the layers
  bool embed_input_ = false;                // some layer has an embed_norm (the step needs args.embed)
  std::unique_ptr<Workspace> ws_;
  std::mutex step_mutex_;  // one step at a time: the workspace is shared
  bool profiling_ = false;
  std::vector<double> phase_seconds_;
};

constexpr int64_t kMaxDecoderStepTokens = 8192;  // P per call (prefill in chunks beyond it)

}  // namespace moespec
