// select_cost_aware on the GPU (moespec::cuda::select_cost_aware): EcoSpec's cost-aware verify-set
// choice for a whole batch in one launch, the rule of cpp/include/moespec/select_cost_aware.h (its
// CPU function, cpp/src/select_cost_aware.cc, is the reference; python/moespec/spec/cost_aware.py
// holds both to its plain-Python one), and tree_from_selection. The kernels are in
// select_cost_aware.cuh (how a round is spread over the block); the C++ tests run them on the CPU
// (tests/cpp/test_select_cost_aware_emulated.cc), tests/gpu/test_select_cost_aware_cuda.py on a GPU.
// No host synchronisation, no allocation: capturable in a CUDA graph.
#include <cuda_runtime.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "device_common.cuh"
#include "moespec/error.h"
#include "moespec/select_cost_aware.h"
#include "select_cost_aware.cuh"

namespace moespec {
namespace cuda {
namespace {

using select_kernels::kSelectThreads;
using select_kernels::plan_select;
using select_kernels::select_kernel;
using select_kernels::SelectPlan;
using select_kernels::tree_kernel;

// The dynamic shared memory a block of the current device may have (its opt-in maximum, less the
// kernel's static arrays and some slack); asked once per device.
int64_t shared_budget() {
  static int cached[64] = {};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) return 48 * 1024 - 4096;
  if (cached[device] == 0) {
    int optin = 0;
    if (cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess || optin <= 0)
      optin = 48 * 1024;
    cached[device] = optin;
  }
  return static_cast<int64_t>(cached[device]) - 4096;
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
  MOESPEC_CHECK_ARG(C <= (int64_t{1} << 20) && L * K <= (int64_t{1} << 20) && L * N <= (int64_t{1} << 26), "predicted",
                    "too many candidates, slots or experts: ", a.predicted.describe(), " with ", N, " experts");
  if (B == 0) return;
  DeviceGuard guard(dev);
  const SelectPlan plan = plan_select(C, L, N, shared_budget());
  MOESPEC_CHECK_ARG(plan.chunk > 0, "predicted", "too many candidates for one block's shared memory: ",
                    a.predicted.describe(), " with ", N, " experts");
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const float token_s = a.token_s * a.cost_scale;
  auto launch = [&](auto* state) {
    auto* kernel = select_kernel<std::remove_pointer_t<decltype(state)>>;
    static std::atomic<int64_t> granted[64] = {};  // the kernel's shared-memory limit set so far, per device
    std::atomic<int64_t>& limit = granted[dev >= 0 && dev < 64 ? dev : 0];
    if (plan.bytes > 48 * 1024 && plan.bytes > limit.load()) {
      const cudaError_t err =
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(plan.bytes));
      if (err != cudaSuccess)
        throw_runtime("moespec::cuda::select_cost_aware: shared memory of ", plan.bytes, " bytes refused: ",
                      cudaGetErrorString(err));
      limit.store(plan.bytes);
    }
    return launch_kernel(
        Pdl{}, kernel, dim3(1), dim3(kSelectThreads), static_cast<std::size_t>(plan.bytes), s, a.parents.ptr<const int32_t>(), a.depth.ptr<const int32_t>(), a.scores.ptr<const float>(),
        a.num_candidates.ptr<const int32_t>(), a.predicted.ptr<const int32_t>(),
        a.predicted_p.defined() ? a.predicted_p.ptr<const float>() : nullptr, a.buffer.ptr<float>(),
        a.expert_s.ptr<const float>(), state, a.selected.ptr<int32_t>(), a.count.ptr<int32_t>(),
        static_cast<int>(B), static_cast<int>(C), static_cast<int>(L), static_cast<int>(K), static_cast<int>(N),
        token_s, a.cost_scale, a.total_tokens, static_cast<int>(plan.chunk), plan.buffer_shared);
  };
  const cudaError_t err = state_f32 ? launch(a.state.ptr<float>()) : launch(a.state.ptr<double>());
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
  MOESPEC_CHECK_ARG(C <= 12 * 1024, "selected", "at most 12288 candidates per request (48 KB of shared memory), got ", C);
  if (B == 0) return;
  DeviceGuard guard(dev);
  const cudaError_t err = launch_kernel(
      Pdl{}, tree_kernel, dim3(static_cast<unsigned>(B)), dim3(32), sizeof(int32_t) * static_cast<std::size_t>(C),
      static_cast<cudaStream_t>(stream), a.selected.ptr<const int32_t>(), a.count.ptr<const int32_t>(), a.cand_parents.ptr<const int32_t>(),
      a.cand_tokens.ptr<const int32_t>(), a.root_tokens.ptr<const int32_t>(), a.tokens.ptr<int32_t>(),
      a.parents.ptr<int32_t>(), a.depth.ptr<int32_t>(), a.mask.ptr<int32_t>(), a.num_nodes.ptr<int32_t>(),
      static_cast<int>(C), static_cast<int>(M1), static_cast<int>(W));
  if (err != cudaSuccess) throw_runtime("moespec::cuda::tree_from_selection: launch failed: ", cudaGetErrorString(err));
}

}  // namespace cuda
}  // namespace moespec
