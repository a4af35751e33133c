// The CUDA entry points of a build without CUDA (MOESPEC_CUDA=OFF): they say so.
#include "moespec/error.h"
#include "moespec/moe_experts.h"
#include "moespec/route_experts.h"
#include "moespec/select_cost_aware.h"

namespace moespec {
namespace cuda {

bool available() { return false; }

std::size_t route_experts_workspace_size(int64_t, int64_t, int64_t) { return 0; }

std::size_t route_experts_nonfinite_offset() { return 0; }

void route_experts(const RouteExpertsArgs&, void*, std::size_t, void*) {
  throw_runtime("moespec was built without CUDA: reconfigure with -DMOESPEC_CUDA=ON (needs nvcc) to run on GPUs");
}

std::size_t moe_experts_workspace_size(int64_t, int64_t, int64_t, int64_t, int64_t, DType) { return 0; }

void tree_from_selection(const TreeFromSelectionArgs&, void*) {
  throw_runtime("moespec was built without CUDA: reconfigure with -DMOESPEC_CUDA=ON (needs nvcc) to run on GPUs");
}

void select_cost_aware(const SelectCostAwareBatchArgs&, void*) {
  throw_runtime("moespec was built without CUDA: reconfigure with -DMOESPEC_CUDA=ON (needs nvcc) to run on GPUs");
}

void moe_experts(const MoeExpertsArgs&, void*, std::size_t, void*) {
  throw_runtime("moespec was built without CUDA: reconfigure with -DMOESPEC_CUDA=ON (needs nvcc) to run on GPUs");
}

}  // namespace cuda
}  // namespace moespec
