// The decoder ops' argument checks (contract: cpp/include/moespec/decoder_ops.h), device-independent:
// the CUDA entry points run them before launching, and the bindings before they say an op has no
// CPU kernel (the CPU runs the plain-torch versions, python/moespec/ops/decoder.py).
#include "moespec/decoder_ops.h"

#include <cstdint>
#include <utility>

#include "moespec/error.h"

namespace moespec {
namespace {

constexpr auto kFloats = {DType::kFloat32, DType::kBFloat16};

// t: contiguous, defined, on `like`'s device, `like`'s dtype, these sizes.
void check_like(const TensorView& t, const char* arg, const TensorView& like, std::initializer_list<int64_t> dims) {
  check_view(t, arg, {like.dtype}, dims, like.device, like.device_index);
  check_contiguous(t, arg);
}

void check_index(const TensorView& t, const char* arg, const TensorView& like, int64_t n) {
  check_view(t, arg, {DType::kInt64}, {n}, like.device, like.device_index);
  check_contiguous(t, arg);
}

void check_float(const TensorView& t, const char* arg) {
  check_not_null(t, arg);
  check_dtype(t, arg, kFloats);
  check_contiguous(t, arg);
}

}  // namespace

void validate_rms_norm(const RmsNormArgs& a) {
  check_float(a.x, "x");
  check_ndim(a.x, "x", 2);
  const int64_t P = a.x.shape[0], H = a.x.shape[1];
  MOESPEC_CHECK_ARG(H >= 1 && H <= kMaxNormWidth, "x", "width H must be in [1, ", kMaxNormWidth, "], got ",
                    a.x.describe());
  check_like(a.weight, "weight", a.x, {H});
  check_like(a.out, "out", a.x, {P, H});
  MOESPEC_CHECK_ARG(a.residual.defined() == a.sum.defined(), "sum",
                    "residual and sum come together (sum receives x + residual), got residual ",
                    a.residual.describe(), " and sum ", a.sum.describe());
  if (a.residual.defined()) {
    check_like(a.residual, "residual", a.x, {P, H});
    check_like(a.sum, "sum", a.x, {P, H});
  }
  MOESPEC_CHECK_ARG(a.eps >= 0.0f, "eps", "must be >= 0, got ", a.eps);
}

void validate_attention_inputs(const AttentionInputsArgs& a) {
  check_float(a.qkv, "qkv");
  check_ndim(a.qkv, "qkv", 2);
  const int64_t Hq = a.num_heads, Hkv = a.num_kv_heads;
  MOESPEC_CHECK_ARG(Hq >= 1 && Hkv >= 1 && Hq % Hkv == 0, "num_heads",
                    "expected Hq >= 1 query heads, a multiple of Hkv >= 1 key-value heads, got ", Hq, " and ", Hkv);
  check_view(a.k_cache, "k_cache", {a.qkv.dtype}, {a.k_cache.shape[0], Hkv, a.k_cache.shape[2], a.k_cache.shape[3]},
             a.qkv.device, a.qkv.device_index);
  check_contiguous(a.k_cache, "k_cache");
  const int64_t B = a.k_cache.shape[0], S = a.k_cache.shape[2], D = a.k_cache.shape[3];
  check_like(a.v_cache, "v_cache", a.k_cache, {B, Hkv, S, D});
  MOESPEC_CHECK_ARG(D >= 2 && D % 2 == 0, "k_cache", "head dim D must be even (rope rotates halves), got ",
                    a.k_cache.describe());
  const int64_t P = a.qkv.shape[0];
  MOESPEC_CHECK_ARG(a.qkv.shape[1] == (Hq + 2 * Hkv) * D, "qkv", "expected (Hq + 2 Hkv) D = ", (Hq + 2 * Hkv) * D,
                    " columns (q, k, v of each token), got ", a.qkv.describe());
  MOESPEC_CHECK_ARG((Hq + Hkv) * D <= kMaxAttentionInputs, "qkv", "(Hq + Hkv) D must be at most ",
                    kMaxAttentionInputs, ", got ", (Hq + Hkv) * D);
  check_like(a.cos, "cos", a.qkv, {P, D});
  check_like(a.sin, "sin", a.qkv, {P, D});
  check_index(a.rows, "rows", a.qkv, P);
  check_index(a.slots, "slots", a.qkv, P);
  check_like(a.q, "q", a.qkv, {P, Hq, D});
  const bool norm = a.qk_norm != QkNormKind::kNone;
  MOESPEC_CHECK_ARG(a.qk_norm == QkNormKind::kNone || a.qk_norm == QkNormKind::kPerHead ||
                        a.qk_norm == QkNormKind::kFull,
                    "qk_norm", "expected 0 (none), 1 (per head) or 2 (full), got ", static_cast<int>(a.qk_norm));
  MOESPEC_CHECK_ARG(a.q_norm.defined() == norm && a.k_norm.defined() == norm, "q_norm",
                    "q_norm and k_norm are given exactly when qk_norm is not none");
  if (norm) {
    const bool full = a.qk_norm == QkNormKind::kFull;
    check_like(a.q_norm, "q_norm", a.qkv, {full ? Hq * D : D});
    check_like(a.k_norm, "k_norm", a.qkv, {full ? Hkv * D : D});
  }
  MOESPEC_CHECK_ARG(a.eps >= 0.0f && a.clip >= 0.0f, "clip", "eps and clip must be >= 0, got ", a.eps, " and ",
                    a.clip);
}

void validate_tree_attention(const TreeAttentionArgs& a) {
  check_float(a.q, "q");
  check_ndim(a.q, "q", 3);
  const int64_t P = a.q.shape[0], Hq = a.q.shape[1], D = a.q.shape[2];
  const int64_t max_d = a.q.dtype == DType::kFloat32 ? kMaxHeadDim / 2 : kMaxHeadDim;
  MOESPEC_CHECK_ARG(D >= 8 && D <= max_d && D % 8 == 0, "q", "head dim D must be a multiple of 8 in [8, ", max_d,
                    "] (16-byte rows), got ", a.q.describe());
  check_view(a.k_cache, "k_cache", {a.q.dtype}, {a.k_cache.shape[0], a.k_cache.shape[1], a.k_cache.shape[2], D},
             a.q.device, a.q.device_index);
  check_contiguous(a.k_cache, "k_cache");
  const int64_t B = a.k_cache.shape[0], Hkv = a.k_cache.shape[1], S = a.k_cache.shape[2];
  MOESPEC_CHECK_ARG(Hkv >= 1 && Hq % Hkv == 0, "k_cache", "query heads ", Hq, " must be a multiple of key-value heads, got ",
                    a.k_cache.describe());
  MOESPEC_CHECK_ARG(S >= 1, "k_cache", "needs at least one slot, got ", a.k_cache.describe());
  check_like(a.v_cache, "v_cache", a.k_cache, {B, Hkv, S, D});
  for (const auto& [cache, name] : {std::pair{&a.k_cache, "k_cache"}, std::pair{&a.v_cache, "v_cache"}})
    MOESPEC_CHECK_ARG(reinterpret_cast<uintptr_t>(cache->data) % 16 == 0, name,
                      "must start on a 16-byte boundary (its rows are read 16 bytes at a time), got address ",
                      cache->data);
  check_index(a.start, "start", a.q, B);
  check_index(a.offsets, "offsets", a.q, B + 1);
  check_view(a.groups, "groups", {DType::kInt32}, {a.groups.shape[0], 3}, a.q.device, a.q.device_index);
  check_contiguous(a.groups, "groups");
  check_view(a.mask, "mask", {DType::kInt32}, {P, a.mask.shape[1]}, a.q.device, a.q.device_index);
  check_contiguous(a.mask, "mask");
  const int64_t W = a.mask.shape[1];
  MOESPEC_CHECK_ARG(W >= 1 && W <= (kMaxTreeTokens + 31) / 32, "mask", "expected 1 to ", (kMaxTreeTokens + 31) / 32,
                    " words a row (at most ", kMaxTreeTokens, " new tokens a request), got ", a.mask.describe());
  check_like(a.out, "out", a.q, {P, Hq, D});
  MOESPEC_CHECK_ARG(a.scale > 0.0f, "scale", "must be > 0, got ", a.scale);
  MOESPEC_CHECK_ARG(a.window >= 0, "window", "must be >= 0 (0: none), got ", a.window);
  if (a.window > 0 || a.positions.defined()) check_index(a.positions, "positions", a.q, P);
  if (a.spans.defined()) {
    check_index(a.spans, "spans", a.q, B);
    MOESPEC_CHECK_ARG(a.window == 0, "spans", "not with a sliding window (a new slot's position is its token's)");
  }
  if (a.sinks.defined()) {
    check_view(a.sinks, "sinks", {DType::kFloat32, a.q.dtype}, {Hq}, a.q.device, a.q.device_index);
    check_contiguous(a.sinks, "sinks");
  }
}

}  // namespace moespec
