// Bindings of the draft tree (cpp/include/moespec/draft_tree.h): the class DraftTreeBatch of
// moespec._native, driven by python/moespec/spec/tree.py.
//
// Tensors cross as descriptors (cpp/bindings/tensor_arg.h); outputs are written into tensors the
// caller allocated once. Each method checks its arguments in the core (moespec::Error becomes
// ValueError / RuntimeError through module.cc's translator) and releases the GIL around the work.
#include <pybind11/pybind11.h>

#include <cstdint>

#include "moespec/draft_tree.h"
#include "moespec/draft_tree_device.h"
#include "moespec/select_cost_aware.h"
#include "tensor_arg.h"

namespace py = pybind11;

namespace moespec {
namespace {

DraftFrontierViews frontier_views(const py::object& index, const py::object& tokens, const py::object& parent,
                                  const py::object& parent_slot, const py::object& depth, const py::object& scores) {
  DraftFrontierViews f;
  f.index = to_view(index, "frontier_index");
  f.tokens = to_view(tokens, "frontier_tokens");
  f.parent = to_view(parent, "frontier_parent");
  f.parent_slot = to_view(parent_slot, "frontier_parent_slot");
  f.depth = to_view(depth, "frontier_depth");
  f.scores = to_view(scores, "frontier_scores");
  return f;
}

int32_t expand_root_binding(DraftTreeBatch& self, const py::object& root_tokens, const py::object& tokens,
                            const py::object& logprobs, const py::object& index, const py::object& frontier_tokens,
                            const py::object& parent, const py::object& parent_slot, const py::object& depth,
                            const py::object& scores) {
  const TensorView r = to_view(root_tokens, "root_tokens");
  const TensorView t = to_view(tokens, "tokens");
  const TensorView l = to_view(logprobs, "logprobs");
  const DraftFrontierViews f = frontier_views(index, frontier_tokens, parent, parent_slot, depth, scores);
  py::gil_scoped_release release;
  self.expand_root(r, t, l, f);
  return self.levels();
}

int32_t expand_binding(DraftTreeBatch& self, const py::object& tokens, const py::object& logprobs,
                       const py::object& index, const py::object& frontier_tokens, const py::object& parent,
                       const py::object& parent_slot, const py::object& depth, const py::object& scores) {
  const TensorView t = to_view(tokens, "tokens");
  const TensorView l = to_view(logprobs, "logprobs");
  const DraftFrontierViews f = frontier_views(index, frontier_tokens, parent, parent_slot, depth, scores);
  py::gil_scoped_release release;
  self.expand(t, l, f);
  return self.levels();
}

int64_t finalize_binding(DraftTreeBatch& self, const py::object& tokens, const py::object& parents,
                         const py::object& depth, const py::object& scores, const py::object& candidates,
                         const py::object& mask_words, const py::object& paths, const py::object& num_leaves,
                         const py::object& max_depth) {
  DraftTreeViews out;
  out.tokens = to_view(tokens, "tokens");
  out.parents = to_view(parents, "parents");
  out.depth = to_view(depth, "depth");
  out.scores = to_view(scores, "scores");
  out.candidates = to_view(candidates, "candidates");
  out.mask_words = to_view(mask_words, "mask_words");
  out.paths = to_view(paths, "paths");
  out.num_leaves = to_view(num_leaves, "num_leaves");
  out.max_depth = to_view(max_depth, "max_depth");
  py::gil_scoped_release release;
  return self.finalize(out);
}

void read_candidates_binding(const DraftTreeBatch& self, int64_t b, const py::object& tokens,
                             const py::object& parents, const py::object& depth, const py::object& scores) {
  DraftCandidateViews out;
  out.tokens = to_view(tokens, "tokens");
  out.parents = to_view(parents, "parents");
  out.depth = to_view(depth, "depth");
  out.scores = to_view(scores, "scores");
  py::gil_scoped_release release;
  self.read_candidates(b, out);
}

}  // namespace

void bind_draft_tree(py::module_& m) {
  py::class_<DraftTreeBatch>(m, "DraftTreeBatch", py::module_local(),  // (local: _native_emulated binds it too)
                             "EAGLE-2 dynamic draft trees of B requests expanded in lockstep (CPU).")
      .def(py::init([](int32_t batch, int32_t depth, int32_t top_k, int32_t total_tokens) {
             return DraftTreeBatch(batch, DraftTreeParams{depth, top_k, total_tokens});
           }),
           "B requests; depth D >= 1 levels, top_k K, total_tokens = most nodes M without the root.",
           py::arg("batch"), py::arg("depth"), py::arg("top_k"), py::arg("total_tokens"))
      .def("expand_root", &expand_root_binding,
           "Starts the trees: root_tokens [B], tokens [B, K], logprobs f32 [B, K] -> frontier outputs [B, K] "
           "(index, tokens, parent, parent_slot, depth i32, scores f32; None skips). Returns levels.",
           py::arg("root_tokens"), py::arg("tokens"), py::arg("logprobs"), py::arg("index"),
           py::arg("frontier_tokens"), py::arg("parent"), py::arg("parent_slot"), py::arg("depth"),
           py::arg("scores"))
      .def("expand", &expand_binding,
           "One level: tokens [B, K, K], logprobs f32 [B, K, K] (row s: children of frontier slot s) -> "
           "frontier outputs [B, K]. Returns levels.",
           py::arg("tokens"), py::arg("logprobs"), py::arg("index"), py::arg("frontier_tokens"), py::arg("parent"),
           py::arg("parent_slot"), py::arg("depth"), py::arg("scores"))
      .def("finalize", &finalize_binding,
           "Writes the trees: tokens/parents/depth/scores/candidates [B, M+1], mask_words i32 [B, M+1, W], "
           "paths i32 [B, M, levels+1], num_leaves/max_depth i32 [B]. Returns M.",
           py::arg("tokens"), py::arg("parents"), py::arg("depth"), py::arg("scores"), py::arg("candidates"),
           py::arg("mask_words"), py::arg("paths"), py::arg("num_leaves"), py::arg("max_depth"))
      .def("read_candidates", &read_candidates_binding,
           "Request b's candidate records into [C] outputs: tokens, parents i32, depth i32, scores f32 (None skips).",
           py::arg("b"), py::arg("tokens"), py::arg("parents"), py::arg("depth"), py::arg("scores"))
      .def_property_readonly("batch", &DraftTreeBatch::batch, "B.")
      .def_property_readonly("levels", &DraftTreeBatch::levels, "Levels expanded so far (0 before expand_root).")
      .def_property_readonly("depth", [](const DraftTreeBatch& s) { return s.params().depth; }, "D.")
      .def_property_readonly("top_k", [](const DraftTreeBatch& s) { return s.params().top_k; }, "K.")
      .def_property_readonly("total_tokens", [](const DraftTreeBatch& s) { return s.params().total_tokens; },
                             "Most tree nodes without the root.")
      .def_property_readonly(
          "num_candidates", [](const DraftTreeBatch& s) { return draft_tree_num_candidates(s.params(), s.levels()); },
          "C: candidates recorded per request so far.")
      .def_property_readonly(
          "num_nodes", [](const DraftTreeBatch& s) { return draft_tree_num_nodes(s.params(), s.levels()); },
          "M + 1: nodes of the trees a finalize gives now (1 before expand_root).")
      .def_property_readonly(
          "max_nodes", [](const DraftTreeBatch& s) { return draft_tree_num_nodes(s.params(), s.params().depth); },
          "The largest M + 1 (trees of depth levels).");
  m.def(
      "select_cost_aware",
      [](const py::object& parents, const py::object& depth, const py::object& scores, const py::object& predicted,
         const py::object& predicted_p, const py::object& buffer, const py::object& expert_s,
         const py::object& selected, double step_s, double accepted, float token_s, int32_t total_tokens) {
        SelectCostAwareArgs a;
        a.parents = to_view(parents, "parents");
        a.depth = to_view(depth, "depth");
        a.scores = to_view(scores, "scores");
        a.predicted = to_view(predicted, "predicted");
        a.predicted_p = to_view(predicted_p, "predicted_p");
        a.buffer = to_view(buffer, "buffer");
        a.expert_s = to_view(expert_s, "expert_s");
        a.selected = to_view(selected, "selected");
        a.step_s = step_s;
        a.accepted = accepted;
        a.token_s = token_s;
        a.total_tokens = total_tokens;
        SelectCostAwareResult r;
        {
          py::gil_scoped_release release;
          r = select_cost_aware(a);
        }
        return py::make_tuple(r.count, r.step_s, r.accepted);
      },
      "Cost-aware verify set of one request's candidates: parents/depth int32 [C], scores float32 [C], predicted "
      "int32 [C, L, K], predicted_p float32 [C, L, K] or None (all 1), buffer float32 [L, N] (in/out), expert_s "
      "float32 [L] -> selected int32 [C] (in order); returns (count, step_s, accepted) after the chosen nodes.",
      py::arg("parents"), py::arg("depth"), py::arg("scores"), py::arg("predicted"), py::arg("predicted_p"),
      py::arg("buffer"), py::arg("expert_s"), py::arg("selected"), py::arg("step_s"), py::arg("accepted"),
      py::arg("token_s"), py::arg("total_tokens"));
  m.def(
      "select_cost_aware_cuda",
      [](const py::object& parents, const py::object& depth, const py::object& scores,
         const py::object& num_candidates, const py::object& predicted, const py::object& predicted_p,
         const py::object& buffer, const py::object& expert_s, const py::object& state, const py::object& selected,
         const py::object& count, float token_s, int32_t total_tokens, uintptr_t stream) {
        SelectCostAwareBatchArgs a;
        a.parents = to_view(parents, "parents");
        a.depth = to_view(depth, "depth");
        a.scores = to_view(scores, "scores");
        a.num_candidates = to_view(num_candidates, "num_candidates");
        a.predicted = to_view(predicted, "predicted");
        a.predicted_p = to_view(predicted_p, "predicted_p");
        a.buffer = to_view(buffer, "buffer");
        a.expert_s = to_view(expert_s, "expert_s");
        a.state = to_view(state, "state");
        a.selected = to_view(selected, "selected");
        a.count = to_view(count, "count");
        a.token_s = token_s;
        a.total_tokens = total_tokens;
        py::gil_scoped_release release;
        cuda::select_cost_aware(a, reinterpret_cast<void*>(stream));
      },
      "The cost-aware selection of a batch on CUDA (select_cost_aware.h, SelectCostAwareBatchArgs): buffer and "
      "state (float64 [2]: S, A) in/out, selected int32 [B, C] and count int32 [B] out; no host sync.",
      py::arg("parents"), py::arg("depth"), py::arg("scores"), py::arg("num_candidates"), py::arg("predicted"),
      py::arg("predicted_p"), py::arg("buffer"), py::arg("expert_s"), py::arg("state"), py::arg("selected"),
      py::arg("count"), py::arg("token_s"), py::arg("total_tokens"), py::arg("stream"));
  m.def(
      "tree_from_selection_cuda",
      [](const py::object& selected, const py::object& count, const py::object& cand_parents,
         const py::object& cand_tokens, const py::object& root_tokens, const py::object& tokens,
         const py::object& parents, const py::object& depth, const py::object& mask, const py::object& num_nodes,
         uintptr_t stream) {
        TreeFromSelectionArgs a;
        a.selected = to_view(selected, "selected");
        a.count = to_view(count, "count");
        a.cand_parents = to_view(cand_parents, "cand_parents");
        a.cand_tokens = to_view(cand_tokens, "cand_tokens");
        a.root_tokens = to_view(root_tokens, "root_tokens");
        a.tokens = to_view(tokens, "tokens");
        a.parents = to_view(parents, "parents");
        a.depth = to_view(depth, "depth");
        a.mask = to_view(mask, "mask");
        a.num_nodes = to_view(num_nodes, "num_nodes");
        py::gil_scoped_release release;
        cuda::tree_from_selection(a, reinterpret_cast<void*>(stream));
      },
      "The verify trees of a batch's selections on CUDA (select_cost_aware.h, TreeFromSelectionArgs).",
      py::arg("selected"), py::arg("count"), py::arg("cand_parents"), py::arg("cand_tokens"), py::arg("root_tokens"),
      py::arg("tokens"), py::arg("parents"), py::arg("depth"), py::arg("mask"), py::arg("num_nodes"),
      py::arg("stream"));
  m.def(
      "draft_tree_expand",
      [](const py::object& tokens, const py::object& logprobs, const py::object& roots, const py::object& d2t,
         const py::object& cand_tokens, const py::object& cand_parent, const py::object& score, const py::object& root,
         const py::object& frontier, const py::object& out_index, const py::object& out_tokens,
         const py::object& out_parent, const py::object& out_parent_slot, const py::object& out_scores,
         const py::object& ok, int64_t base, float tolerance, uintptr_t stream) {
        DraftExpandArgs a;
        a.tokens = to_view(tokens, "tokens");
        a.logprobs = to_view(logprobs, "logprobs");
        a.roots = to_view(roots, "roots");
        a.d2t = to_view(d2t, "d2t");
        a.cand_tokens = to_view(cand_tokens, "cand_tokens");
        a.cand_parent = to_view(cand_parent, "cand_parent");
        a.score = to_view(score, "score");
        a.root = to_view(root, "root");
        a.frontier = to_view(frontier, "frontier");
        a.out_index = to_view(out_index, "out_index");
        a.out_tokens = to_view(out_tokens, "out_tokens");
        a.out_parent = to_view(out_parent, "out_parent");
        a.out_parent_slot = to_view(out_parent_slot, "out_parent_slot");
        a.out_scores = to_view(out_scores, "out_scores");
        a.ok = to_view(ok, "ok");
        a.base = base;
        a.tolerance = tolerance;
        py::gil_scoped_release release;
        if (a.frontier.device == Device::kCUDA) {
          cuda::draft_tree_expand(a, reinterpret_cast<void*>(stream));
        } else {
          draft_tree_expand(a);
        }
      },
      "One level of the draft tree core's buffers (draft_tree_device.h, DraftExpandArgs) on the CPU or CUDA "
      "(`stream`: the CUDA stream; ignored on the CPU).",
      py::arg("tokens"), py::arg("logprobs"), py::arg("roots"), py::arg("d2t"), py::arg("cand_tokens"),
      py::arg("cand_parent"), py::arg("score"), py::arg("root"), py::arg("frontier"), py::arg("out_index"),
      py::arg("out_tokens"), py::arg("out_parent"), py::arg("out_parent_slot"), py::arg("out_scores"), py::arg("ok"),
      py::arg("base"), py::arg("tolerance"), py::arg("stream"));
  m.def(
      "draft_tree_finalize",
      [](const py::object& score, const py::object& cand_parent, const py::object& cand_tokens, const py::object& root,
         const py::object& scratch, const py::object& tokens, const py::object& parents, const py::object& depth,
         const py::object& scores, const py::object& candidates, const py::object& mask, const py::object& paths,
         const py::object& num_leaves, const py::object& max_depth, int64_t num_candidates, int32_t top_k,
         uintptr_t stream) {
        DraftFinalizeArgs a;
        a.score = to_view(score, "score");
        a.cand_parent = to_view(cand_parent, "cand_parent");
        a.cand_tokens = to_view(cand_tokens, "cand_tokens");
        a.root = to_view(root, "root");
        a.scratch = to_view(scratch, "scratch");
        a.tokens = to_view(tokens, "tokens");
        a.parents = to_view(parents, "parents");
        a.depth = to_view(depth, "depth");
        a.scores = to_view(scores, "scores");
        a.candidates = to_view(candidates, "candidates");
        a.mask = to_view(mask, "mask");
        a.paths = to_view(paths, "paths");
        a.num_leaves = to_view(num_leaves, "num_leaves");
        a.max_depth = to_view(max_depth, "max_depth");
        a.num_candidates = num_candidates;
        a.top_k = top_k;
        py::gil_scoped_release release;
        if (a.score.device == Device::kCUDA) {
          cuda::draft_tree_finalize(a, reinterpret_cast<void*>(stream));
        } else {
          draft_tree_finalize(a);
        }
      },
      "The trees of the draft tree core's buffers (draft_tree_device.h, DraftFinalizeArgs) on the CPU or CUDA.",
      py::arg("score"), py::arg("cand_parent"), py::arg("cand_tokens"), py::arg("root"), py::arg("scratch"),
      py::arg("tokens"), py::arg("parents"), py::arg("depth"), py::arg("scores"), py::arg("candidates"),
      py::arg("mask"), py::arg("paths"), py::arg("num_leaves"), py::arg("max_depth"), py::arg("num_candidates"),
      py::arg("top_k"), py::arg("stream"));
  m.attr("kMaxFusedTreeTopK") = kMaxFusedTreeTopK;
  m.attr("kMaxFusedTreeCandidates") = kMaxFusedTreeCandidates;
  m.attr("kMaxDraftTopK") = kMaxDraftTopK;
  m.attr("kMaxDraftDepth") = kMaxDraftDepth;
  m.attr("kMaxDraftTreeTokens") = kMaxDraftTreeTokens;
  m.attr("kDraftLogprobTolerance") = kDraftLogprobTolerance;
}

}  // namespace moespec
