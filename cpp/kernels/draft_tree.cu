// draft_tree_expand / draft_tree_finalize on the GPU (moespec::cuda::draft_tree_*): the block code
// of moespec/detail/draft_tree_block.h, which the CPU runs with one thread. Contract:
// moespec/draft_tree_device.h. A level is one block for the whole batch (its flags are one AND over
// every request: __syncthreads_and), a finalize a block per request. Plain launches (they sit among
// torch's kernels in a draft round's graph). Tests: tests/gpu/test_draft_tree_cuda.py.
#include <cuda_runtime.h>

#include <cstdint>

#include "device_common.cuh"
#include "moespec/detail/draft_tree_block.h"
#include "moespec/draft_tree_device.h"
#include "moespec/error.h"

namespace moespec {
namespace cuda {
namespace {

constexpr int kExpandThreads = 512;
constexpr int kFinalizeThreads = 256;

// Row strides of request b's slices (elements), from request 0's work.
struct FinalizeStrides {
  int64_t score, cand_parent, cand_tokens, scratch, tokens, parents, depth, scores, candidates, mask, paths;
};

__global__ void __launch_bounds__(kExpandThreads) expand_kernel(detail::ExpandWork w) {
  detail::expand_block(detail::DeviceBlock{}, w);
}

__global__ void __launch_bounds__(kFinalizeThreads) finalize_kernel(detail::FinalizeWork w, FinalizeStrides s) {
  const int64_t b = blockIdx.x;
  w.score += b * s.score, w.cand_parent += b * s.cand_parent, w.cand_tokens += b * s.cand_tokens;
  w.root += b, w.scratch += b * s.scratch, w.tokens += b * s.tokens, w.parents += b * s.parents;
  w.depth += b * s.depth, w.scores += b * s.scores, w.candidates += b * s.candidates, w.mask += b * s.mask;
  w.paths += b * s.paths, w.num_leaves += b, w.max_depth += b;
  detail::finalize_block(detail::DeviceBlock{}, w);
}

void check_launch(const char* op, cudaError_t err) {
  if (err != cudaSuccess) throw_runtime("moespec::cuda::", op, ": launch failed: ", cudaGetErrorString(err));
}

}  // namespace

void draft_tree_expand(const DraftExpandArgs& a, void* stream) {
  const int64_t B = check_draft_tree_expand(a, Device::kCUDA);
  if (B == 0) return;
  DeviceGuard guard(a.frontier.device_index);
  check_launch("draft_tree_expand", launch_kernel(Pdl{}, expand_kernel, dim3(1), dim3(kExpandThreads), 0,
                                                  static_cast<cudaStream_t>(stream), detail::expand_work(a, B)));
}

void draft_tree_finalize(const DraftFinalizeArgs& a, void* stream) {
  const int64_t B = check_draft_tree_finalize(a, Device::kCUDA);
  if (B == 0) return;
  DeviceGuard guard(a.score.device_index);
  const FinalizeStrides s{a.score.strides[0],  a.cand_parent.strides[0], a.cand_tokens.strides[0],
                          a.scratch.shape[1],  a.tokens.strides[0],      a.parents.strides[0],
                          a.depth.strides[0],  a.scores.strides[0],      a.candidates.strides[0],
                          a.mask.strides[0],   a.paths.strides[0]};
  check_launch("draft_tree_finalize",
               launch_kernel(Pdl{}, finalize_kernel, dim3(static_cast<unsigned>(B)), dim3(kFinalizeThreads), 0,
                             static_cast<cudaStream_t>(stream), detail::finalize_work(a, 0), s));
}

}  // namespace cuda
}  // namespace moespec
