"""The draft tree core's two kernels as torch ops (``moespec::draft_tree_expand``,
``moespec::draft_tree_finalize``) over the buffers of :class:`moespec.spec.tree_device.TorchTreeCore`
(its "fused" form): a level of EAGLE-2's expansion, and the finished trees, one launch each on CUDA
(``cpp/kernels/draft_tree.cu``) instead of ~20 and ~60 torch kernels; on the CPU the same block code
runs with one thread (``cpp/src/draft_tree_device.cc``). Contract and bounds (top_k <= 16, at most 4096
candidates): ``cpp/include/moespec/draft_tree_device.h``. They write their arguments in place and
return nothing; as torch ops they are seen by the dispatcher, so a CUDA graph (or the CPU tests'
stand-in for one, tests/python/fake_graph.py) records them with the round's other ops.
"""

from __future__ import annotations

from typing import Optional

import torch

from moespec._loader import native
from moespec._tensor import view


def _stream(t: torch.Tensor) -> int:
    return torch.cuda.current_stream(t.device).cuda_stream if t.device.type == "cuda" else 0


@torch.library.custom_op("moespec::draft_tree_expand", mutates_args=(
    "cand_tokens", "cand_parent", "score", "root", "frontier", "out_index", "out_tokens", "out_parent",
    "out_parent_slot", "out_scores", "ok"))
def draft_tree_expand(tokens: torch.Tensor, logprobs: torch.Tensor, roots: Optional[torch.Tensor],
                      d2t: Optional[torch.Tensor], cand_tokens: torch.Tensor, cand_parent: torch.Tensor,
                      score: torch.Tensor, root: torch.Tensor, frontier: torch.Tensor, out_index: torch.Tensor,
                      out_tokens: torch.Tensor, out_parent: torch.Tensor, out_parent_slot: torch.Tensor,
                      out_scores: torch.Tensor, ok: torch.Tensor, base: int, tolerance: float) -> None:
    """One level: tokens int64 [B, n] (draft ids when ``d2t``), logprobs float32 [B, n] (n = K at the
    root level, given ``roots`` int64 [B]; K^2 after) recorded as candidates [base, base + n) of the
    records cand_tokens / cand_parent / score [B, S]; the K best written to ``frontier`` and the out_*
    views [B, K]; the level's check flags to ``ok`` uint8 (root ids, draft ids, ids, log-probs; as
    DraftExpandArgs says)."""
    native().draft_tree_expand(
        view(tokens, "tokens"), view(logprobs, "logprobs"), view(roots, "roots"), view(d2t, "d2t"),
        view(cand_tokens, "cand_tokens"), view(cand_parent, "cand_parent"), view(score, "score"),
        view(root, "root"), view(frontier, "frontier"), view(out_index, "out_index"), view(out_tokens, "out_tokens"),
        view(out_parent, "out_parent"), view(out_parent_slot, "out_parent_slot"), view(out_scores, "out_scores"),
        view(ok, "ok"), base, tolerance, _stream(frontier))


@torch.library.custom_op("moespec::draft_tree_finalize", mutates_args=(
    "scratch", "tokens", "parents", "depth", "scores", "candidates", "mask", "paths", "num_leaves", "max_depth"))
def draft_tree_finalize(score: torch.Tensor, cand_parent: torch.Tensor, cand_tokens: torch.Tensor,
                        root: torch.Tensor, scratch: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                        depth: torch.Tensor, scores: torch.Tensor, candidates: torch.Tensor, mask: torch.Tensor,
                        paths: torch.Tensor, num_leaves: torch.Tensor, max_depth: torch.Tensor, num_candidates: int,
                        top_k: int) -> None:
    """The trees of the best N - 1 of the first ``num_candidates`` candidates (N = tokens.shape[1]),
    written into the DraftTreeViews-shaped outputs (scratch int32 [B, >= 2 C + 6 N])."""
    native().draft_tree_finalize(
        view(score, "score"), view(cand_parent, "cand_parent"), view(cand_tokens, "cand_tokens"), view(root, "root"),
        view(scratch, "scratch"), view(tokens, "tokens"), view(parents, "parents"), view(depth, "depth"),
        view(scores, "scores"), view(candidates, "candidates"), view(mask, "mask"), view(paths, "paths"),
        view(num_leaves, "num_leaves"), view(max_depth, "max_depth"), num_candidates, top_k, _stream(score))
