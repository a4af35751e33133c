// The CUDA entry points of a build without CUDA (MOESPEC_CUDA=OFF): they say so.
#include "moespec/decoder_ops.h"
#include "moespec/draft_tree_device.h"
#include "moespec/error.h"
#include "moespec/linear.h"
#include "moespec/moe_experts.h"
#include "moespec/route_experts.h"
#include "moespec/select_cost_aware.h"

namespace moespec {
namespace cuda {
namespace {

[[noreturn]] void no_cuda() {
  throw_runtime("moespec was built without CUDA: reconfigure with -DMOESPEC_CUDA=ON (needs nvcc) to run on GPUs");
}

}  // namespace

bool available() { return false; }

std::size_t route_experts_workspace_size(int64_t, int64_t, int64_t) { return 0; }

std::size_t route_experts_nonfinite_offset() { return 0; }

void route_experts(const RouteExpertsArgs&, void*, std::size_t, void*) {
  no_cuda();
}

std::size_t moe_experts_workspace_size(int64_t, int64_t, int64_t, int64_t, int64_t, DType) { return 0; }

void tree_from_selection(const TreeFromSelectionArgs&, void*) {
  no_cuda();
}

void draft_tree_expand(const DraftExpandArgs&, void*) {
  no_cuda();
}

void draft_tree_finalize(const DraftFinalizeArgs&, void*) {
  no_cuda();
}

void select_cost_aware(const SelectCostAwareBatchArgs&, void*) {
  no_cuda();
}

void moe_experts(const MoeExpertsArgs&, void*, std::size_t, void*) {
  no_cuda();
}

int64_t tree_attention_splits(int64_t, int64_t, int64_t) { return 1; }

std::size_t tree_attention_workspace_size(int64_t, int64_t, int64_t, int64_t, int64_t) { return 0; }

void linear(const LinearArgs&, void*) {
  no_cuda();
}

void rms_norm(const RmsNormArgs&, void*) {
  no_cuda();
}

void attention_inputs(const AttentionInputsArgs&, void*) {
  no_cuda();
}

void tree_attention(const TreeAttentionArgs&, void*, std::size_t, void*) {
  no_cuda();
}

}  // namespace cuda
}  // namespace moespec
