// linear on the CPU: a dense projection at decode and verify sizes (contract:
// cpp/include/moespec/linear.h). The product is moe_experts' per-ISA NT product
// (moe_experts_simd.h), so this file holds only validation, staging and the tiling over rows.
#include "moespec/linear.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "aligned_buffer.h"
#include "linear_impl.h"
#include "moespec/cpu_isa.h"
#include "moespec/detail/route_math.h"
#include "moespec/error.h"
#include "moespec/thread_pool.h"

namespace moespec {

void validate_linear(const LinearArgs& a) {
  check_not_null(a.x, "x");
  check_ndim(a.x, "x", 2);
  check_dtype(a.x, "x", {DType::kFloat32, DType::kBFloat16});
  const int32_t index = a.x.device == Device::kCUDA ? a.x.device_index : -1;  // every tensor on x's device
  const int64_t T = a.x.shape[0], K = a.x.shape[1];
  MOESPEC_CHECK_ARG(K >= 1, "x", "input features K (dim 1) must be >= 1, got ", a.x.describe());
  MOESPEC_CHECK_ARG(a.x.strides[1] == 1 && (T <= 1 || a.x.strides[0] >= K), "x",
                    "expected rows of contiguous elements (stride 1 in dim 1, row stride >= K), got strides [",
                    a.x.strides[0], ", ", a.x.strides[1], "]");
  check_not_null(a.weight, "weight");
  check_ndim(a.weight, "weight", 2);
  check_dim(a.weight, "weight", 1, K);
  check_contiguous(a.weight, "weight");
  check_device(a.weight, "weight", a.x.device, index);
  MOESPEC_CHECK_ARG(a.weight.dtype == a.x.dtype, "weight", "expected x's dtype ", dtype_name(a.x.dtype), ", got ",
                    a.weight.describe());
  const int64_t N = a.weight.shape[0];
  MOESPEC_CHECK_ARG(N >= 1, "weight", "output features N (dim 0) must be >= 1, got ", a.weight.describe());
  if (a.bias.defined()) {
    check_not_null(a.bias, "bias");
    check_ndim(a.bias, "bias", 1);
    check_dim(a.bias, "bias", 0, N);
    check_dtype(a.bias, "bias", {DType::kFloat32, a.x.dtype});
    check_contiguous(a.bias, "bias");
    check_device(a.bias, "bias", a.x.device, index);
  }
  check_not_null(a.out, "out");
  check_ndim(a.out, "out", 2);
  check_dim(a.out, "out", 0, T);
  check_dim(a.out, "out", 1, N);
  MOESPEC_CHECK_ARG(a.out.dtype == a.x.dtype, "out", "expected x's dtype ", dtype_name(a.x.dtype), ", got ",
                    a.out.describe());
  check_contiguous(a.out, "out");
  check_device(a.out, "out", a.x.device, index);
}

namespace cpu {
namespace {

constexpr int64_t kMinRowTile = 16;   // rows per task, at least (a multiple of every ISA's kR)
constexpr int64_t kMaxRowTile = 1024;
constexpr int64_t kLongRangesMaxTokens = 16;  // up to this many tokens, ~2 tasks per thread (row_tile)
constexpr int64_t kInlineMacs = 1 << 15;  // below this many multiply-adds, no thread pool

// Rows per task: ~8 tasks per thread for many tokens (compute-bound: balance), ~2 for few (memory-
// bound: long runs of consecutive bytes per task, as the MoE kernel's streaming schedule).
int64_t row_tile(int64_t N, int64_t T, int threads) {
  const int64_t per_thread = T <= kLongRangesMaxTokens ? 2 : 8;
  const int64_t want = (N + per_thread * threads - 1) / (per_thread * threads);
  const int64_t tile = (want + kMinRowTile - 1) / kMinRowTile * kMinRowTile;
  return std::clamp(tile, kMinRowTile, kMaxRowTile);
}

float bias_at(const void* bias, DType dtype, int64_t n) {
  return dtype == DType::kBFloat16 ? detail::bf16_to_float(static_cast<const uint16_t*>(bias)[n])
                                   : static_cast<const float*>(bias)[n];
}

}  // namespace

void linear_staged(const MoeExpertKernels& kernels, DType w_dtype, const void* w, int64_t N, int64_t K,
                   const void* bias, DType bias_dtype, const void* act, int64_t T, float* y, int64_t ldy) {
  if (T == 0) return;
  const bool bf16 = w_dtype == DType::kBFloat16;
  const MoeMatmulNt matmul = bf16 ? kernels.matmul_bf16 : kernels.matmul_f32;
  const int64_t Kp = (K + kMoeActPad - 1) / kMoeActPad * kMoeActPad;
  const std::size_t w_size = bf16 ? 2 : 4;
  auto rows = [&](int64_t r0, int64_t r1) {
    matmul(static_cast<const char*>(w) + static_cast<std::size_t>(r0 * K) * w_size, K, r1 - r0, act, Kp, nullptr, T,
           K, y + r0, ldy);
    if (bias != nullptr)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t n = r0; n < r1; ++n) y[t * ldy + n] += bias_at(bias, bias_dtype, n);
  };
  ThreadPool& pool = ThreadPool::instance();
  if (N * K * T < kInlineMacs || pool.num_threads() == 1) {
    rows(0, N);
    return;
  }
  const int64_t tile = row_tile(N, T, pool.num_threads());
  pool.parallel_for((N + tile - 1) / tile, [&](int64_t task) {
    const int64_t r0 = task * tile;
    rows(r0, std::min(r0 + tile, N));
  });
}

void linear(const LinearArgs& a) {
  validate_linear(a);
  MOESPEC_CHECK_ARG(a.x.device == Device::kCPU, "x", "moespec::cpu::linear needs CPU tensors, got ", a.x.describe());
  const int64_t T = a.x.shape[0], K = a.x.shape[1], N = a.weight.shape[0];
  if (T == 0) return;
  const MoeExpertKernels& kernels = moe_expert_kernels(active_cpu_isa());
  const DType dtype = a.x.dtype;
  thread_local AlignedBuffer act_buf, y_buf;
  void* act = act_buf.get(staged_row_bytes(kernels, dtype, K) * static_cast<std::size_t>(T));
  stage_activations(kernels, dtype, a.x.data, T > 1 ? a.x.strides[0] : K, T, K, act);
  const bool f32 = dtype == DType::kFloat32;
  float* y = f32 ? a.out.ptr<float>() : y_buf.get<float>(T * N);
  linear_staged(kernels, dtype, a.weight.data, N, K, a.bias.defined() ? a.bias.data : nullptr, a.bias.dtype, act, T,
                y, N);
  if (!f32) {
    uint16_t* out = a.out.ptr<uint16_t>();
    for (int64_t i = 0; i < T * N; ++i) out[i] = detail::float_to_bf16(y[i]);
  }
  release_if_large(act_buf, y_buf);
}

}  // namespace cpu
}  // namespace moespec
