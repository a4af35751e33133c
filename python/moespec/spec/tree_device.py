"""The draft tree core in torch ops, for trees whose buffers live on the GPU.

:class:`moespec.spec.tree.TreeBuilder` runs one of two cores with one semantics: the native
``DraftTreeBatch`` (C++, the CPU) and this one (any device; the default off the CPU), which keeps
the candidates, the frontier and the finished trees on the builder's device, so that a draft round
(expand_root, D - 1 expands, finalize) needs no host synchronisation until the finalize, which
copies two ints per request back (each tree's leaf count and depth: the shapes of its ``paths``).

Semantics (cpp/include/moespec/draft_tree.h, "Semantics"): candidates are recorded level by level,
the ranking is (score desc, depth asc, candidate index asc), and since index order is depth order a
stable descending sort of the float32 scores over the candidates in index order is that ranking
(-0 and +0 compare equal in the sort as in the native key). Scores are the same float32 sums
(parent + min(log-prob, 0)), so both cores give identical trees (tests/python/test_draft_tree.py
holds them against each other and against the plain-Python reference).

Value checks need the values on the host. On the CPU they run at the call (a failed call changes
nothing, as in the native core); on a GPU each call records a flag on the device and the finalize
raises the first recorded problem, naming the argument (checking at the call would synchronise
every level). Token ids are clamped for the gathers, so bad input never reaches a device assert.

Dimensions: B requests, K top-k, C candidates (at most K + (D - 1) K^2), M tree nodes without the
root, N = M + 1, W = ceil(N / 32) mask words, L = levels + 1.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from moespec.spec.tree import _bits_as_int32, _describe

LOGPROB_TOLERANCE = 1e-3  # (kDraftLogprobTolerance) the largest log-prob accepted, counted as 0
_MAX_TOKEN = 2**31 - 1
_DEFERRED = {  # what a GPU round's finalize reports: argument -> what was expected
    "root_tokens": "token ids in [0, 2^31)",
    "draft_ids": "draft ids in [0, V_draft) (to be mapped through d2t)",  # (before tokens: the cause)
    "tokens": "token ids in [0, 2^31)",
    "logprobs": f"log-probabilities (finite or -inf, <= {LOGPROB_TOLERANCE})",
}


class TorchTreeCore:
    """B requests' EAGLE-2 trees in lockstep, in torch ops on ``device`` (buffers allocated once)."""

    def __init__(self, batch: int, depth: int, top_k: int, total_tokens: int, device: torch.device):
        for name, value, low, high in (("batch", batch, 1, None), ("depth", depth, 1, 64), ("top_k", top_k, 1, 64),
                                       ("total_tokens", total_tokens, 1, 4096)):
            if value < low or (high is not None and value > high):
                raise ValueError(f"{name}: expected an int in [{low}, {high or 'inf'}], got {value}")
        self.batch, self.depth, self.top_k, self.total_tokens = batch, depth, top_k, total_tokens
        self.device = torch.device(device)
        self.check_now = self.device.type == "cpu"  # else: deferred to finalize (see the module docstring)
        self.levels = 0
        B, K, C = batch, top_k, self.candidates_after(depth)
        kw = dict(device=self.device)
        self._tokens = torch.zeros(B, C, dtype=torch.int64, **kw)  # [B, C]
        self._parent = torch.zeros(B, C, dtype=torch.int64, **kw)  # [B, C] candidate index, -1: the root
        self._depth = torch.zeros(B, C, dtype=torch.int32, **kw)  # [B, C]
        self._score = torch.zeros(B, C, dtype=torch.float32, **kw)  # [B, C]
        self._root = torch.zeros(B, dtype=torch.int64, **kw)  # [B]
        self._frontier = torch.zeros(B, K, dtype=torch.int64, **kw)  # [B, K] candidate indices, best first
        self._bad = torch.zeros(len(_DEFERRED), dtype=torch.bool, **kw)  # deferred problems, by _DEFERRED

    # -- sizes -------------------------------------------------------------------------------------

    def candidates_after(self, levels: int) -> int:
        K = self.top_k
        return 0 if levels <= 0 else K + (levels - 1) * K * K

    @property
    def num_candidates(self) -> int:
        return self.candidates_after(self.levels)

    @property
    def num_nodes(self) -> int:
        return min(self.total_tokens, self.num_candidates) + 1

    @property
    def max_nodes(self) -> int:
        return min(self.total_tokens, self.candidates_after(self.depth)) + 1

    # -- one round ---------------------------------------------------------------------------------

    def expand_root(self, roots: torch.Tensor, tokens: torch.Tensor, logprobs: torch.Tensor, out: dict,
                    bad_draft_ids: Optional[torch.Tensor] = None) -> None:
        """roots [B], tokens [B, K] (target ids), logprobs [B, K] float; writes the frontier ``out``.
        ``bad_draft_ids``: the caller's deferred flag for draft ids it could not map."""
        B, K = self.batch, self.top_k
        roots = self._ids(roots, "root_tokens", (B,))
        tokens = self._ids(tokens, "tokens", (B, K))
        logprobs = self._logprobs(logprobs, (B, K))
        self._check(roots, tokens, logprobs)
        self._bad.zero_()
        self._record_bad(roots, tokens, logprobs, bad_draft_ids)
        self._root.copy_(roots.clamp(0, _MAX_TOKEN))
        self._tokens[:, :K] = tokens.clamp(0, _MAX_TOKEN)
        self._parent[:, :K] = -1
        self._depth[:, :K] = 1
        score = logprobs.clamp(max=0.0)
        self._score[:, :K] = score
        order = torch.sort(score, dim=1, descending=True, stable=True).indices  # [B, K]
        self._frontier.copy_(order)
        self.levels = 1
        self._write_frontier(out, torch.full_like(order, -1))

    def expand(self, tokens: torch.Tensor, logprobs: torch.Tensor, out: dict,
               bad_draft_ids: Optional[torch.Tensor] = None) -> None:
        """tokens [B, K, K] (target ids; row s: the children of frontier slot s), logprobs [B, K, K]."""
        B, K = self.batch, self.top_k
        if self.levels < 1:
            raise ValueError("expand: the trees have no root yet: call expand_root first")
        if self.levels >= self.depth:
            raise ValueError(f"expand: the trees already have depth={self.depth} levels: call finalize, or "
                             "expand_root to start the next trees")
        tokens = self._ids(tokens, "tokens", (B, K, K))
        logprobs = self._logprobs(logprobs, (B, K, K))
        self._check(None, tokens, logprobs)
        self._record_bad(None, tokens, logprobs, bad_draft_ids)
        base, n = self.num_candidates, K * K
        parent = self._frontier  # [B, K]
        score = (self._score.gather(1, parent)[:, :, None] + logprobs.clamp(max=0.0)).reshape(B, n)  # [B, K K]
        self._tokens[:, base: base + n] = tokens.clamp(0, _MAX_TOKEN).reshape(B, n)
        self._parent[:, base: base + n] = parent[:, :, None].expand(B, K, K).reshape(B, n)
        self._depth[:, base: base + n] = self.levels + 1
        self._score[:, base: base + n] = score
        best = torch.sort(score, dim=1, descending=True, stable=True).indices[:, :K]  # [B, K] among the new
        self._frontier.copy_(best + base)
        self.levels += 1
        self._write_frontier(out, best // K)

    def finalize(self, out: dict) -> None:
        """Writes the trees of the best min(total_tokens, C) candidates into ``out`` (the views of
        DraftTreeViews: tokens, parents, depth, scores, candidates [B, N], mask_words [B, N, W],
        paths [B, M, L], num_leaves and max_depth [B])."""
        if self.levels < 1:
            raise ValueError("finalize: the trees have no root yet: call expand_root first")
        B, C, N = self.batch, self.num_candidates, self.num_nodes
        M, L = N - 1, self.levels + 1
        score = self._score[:, :C]
        rank = torch.sort(score, dim=1, descending=True, stable=True).indices[:, :M].sort(dim=1).values  # [B, M]
        node_of = torch.full((B, C), -1, dtype=torch.int64, device=self.device)  # [B, C]
        node_of.scatter_(1, rank, torch.arange(1, N, device=self.device).expand(B, M))
        cparent = self._parent[:, :C].gather(1, rank)  # [B, M]
        parents = torch.cat([torch.full((B, 1), -1, dtype=torch.int64, device=self.device),
                             torch.where(cparent < 0, 0, node_of.gather(1, cparent.clamp(min=0)))], dim=1)  # [B, N]
        depth = torch.cat([torch.zeros(B, 1, dtype=torch.int32, device=self.device),
                           self._depth[:, :C].gather(1, rank)], dim=1)  # [B, N]
        out["tokens"].copy_(torch.cat([self._root[:, None], self._tokens[:, :C].gather(1, rank)], dim=1))
        out["parents"].copy_(parents)
        out["depth"].copy_(depth)
        out["scores"].copy_(torch.cat([torch.zeros(B, 1, device=self.device), score.gather(1, rank)], dim=1))
        out["candidates"].copy_(torch.cat([torch.full((B, 1), -1, dtype=torch.int64, device=self.device), rank], 1))
        out["mask_words"].copy_(self._masks(parents))
        leaf = torch.ones(B, N + 1, dtype=torch.bool, device=self.device)
        leaf.scatter_(1, parents + 1, False)  # column p + 1: node p has a child (column 0: the root's -1)
        leaf = leaf[:, 1:]  # [B, N]
        out["paths"].copy_(self._paths(parents, depth, leaf, L)[:, :M])
        out["num_leaves"].copy_(leaf.sum(dim=1))
        out["max_depth"].copy_(depth.max(dim=1).values)

    def read_candidates(self, b: int) -> tuple[torch.Tensor, ...]:
        """Request ``b``'s candidate records [C] on the CPU: tokens, parents, depth, scores."""
        if not 0 <= b < self.batch:
            raise ValueError(f"b: expected a request index in [0, {self.batch}), got {b}")
        C = self.num_candidates
        return (self._tokens[b, :C].cpu(), self._parent[b, :C].int().cpu(), self._depth[b, :C].cpu(),
                self._score[b, :C].cpu())

    # -- the tree tensors --------------------------------------------------------------------------

    def _masks(self, parents: torch.Tensor) -> torch.Tensor:
        """int32 [B, N, W] ancestor-or-self rows: each node's own bit, OR-ed up its parent chain by
        ``levels`` rounds of pointer jumping over the packed rows."""
        B, N = parents.shape
        W = (N + 31) // 32
        node = torch.arange(N, device=self.device)
        own = torch.zeros(N, W, dtype=torch.int64, device=self.device)
        own[node, node // 32] = 1 << (node % 32)
        own = _bits_as_int32(own)[None].expand(B, N, W)  # [B, N, W]
        rows = own
        up = parents.clamp(min=0)[:, :, None].expand(B, N, W)  # the root's parent: itself (its row is final)
        for _ in range(self.levels):
            rows = own | rows.gather(1, up)
        return rows

    def _paths(self, parents: torch.Tensor, depth: torch.Tensor, leaf: torch.Tensor, L: int) -> torch.Tensor:
        """int32 [B, N, L]: the root-to-leaf paths of the leaves in lexicographic order, then -1 rows."""
        B, N = parents.shape
        paths = torch.full((B, N, L + 1), -1, dtype=torch.int64, device=self.device)  # column L: discarded writes
        node = torch.arange(N, device=self.device).expand(B, N)
        for _ in range(L):  # walk up from every node: entry depth(u) of row n is u
            valid = node >= 0
            at = torch.where(valid, depth.gather(1, node.clamp(min=0)).long(), L)
            paths.scatter_(2, at[:, :, None], node[:, :, None])
            node = torch.where(valid, parents.gather(1, node.clamp(min=0)), -1)
        paths = paths[:, :, :L]
        order = torch.arange(N, device=self.device).expand(B, N)
        for d in range(L - 1, -1, -1):  # least significant column first; stable sorts keep the rest
            key = paths.gather(1, order[:, :, None].expand(B, N, L))[:, :, d]
            order = order.gather(1, torch.sort(key, dim=1, stable=True).indices)
        first = torch.sort((~leaf).gather(1, order).to(torch.int8), dim=1, stable=True).indices
        order = order.gather(1, first)  # leaves first, in path order
        rows = paths.gather(1, order[:, :, None].expand(B, N, L))
        keep = torch.arange(N, device=self.device)[None, :] < leaf.sum(dim=1, keepdim=True)
        return torch.where(keep[:, :, None], rows, -1).to(torch.int32)

    # -- helpers -----------------------------------------------------------------------------------

    def _write_frontier(self, out: dict, parent_slot: torch.Tensor) -> None:
        cand = self._frontier
        out["index"].copy_(cand)
        out["tokens"].copy_(self._tokens.gather(1, cand))
        out["parent"].copy_(self._parent.gather(1, cand))
        out["parent_slot"].copy_(parent_slot)
        out["scores"].copy_(self._score.gather(1, cand))

    def _ids(self, t, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = torch.as_tensor(t)
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name}: expected dtype int32 or int64, got {_describe(t)}")
        self._shape(t, name, shape)
        return t.to(self.device, torch.int64, non_blocking=True)

    def _logprobs(self, t, shape: tuple[int, ...]) -> torch.Tensor:
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise ValueError(f"logprobs: expected dtype float32, got {_describe(t)}")
        self._shape(t, "logprobs", shape)
        return t.to(self.device, torch.float32, non_blocking=True)

    @staticmethod
    def _shape(t: torch.Tensor, name: str, shape: tuple[int, ...]) -> None:
        if t.dim() != len(shape):
            raise ValueError(f"{name}: expected {len(shape)} dimensions, got {_describe(t)}")
        for d, (got, want) in enumerate(zip(t.shape, shape)):
            if got != want:
                raise ValueError(f"{name}: expected size {want} in dim {d}, got {_describe(t)}")

    @staticmethod
    def _bad_ids(t: torch.Tensor) -> torch.Tensor:
        return (t < 0) | (t > _MAX_TOKEN)

    @staticmethod
    def _bad_logprobs(t: torch.Tensor) -> torch.Tensor:
        return t.isnan() | (t > LOGPROB_TOLERANCE)

    def _check(self, roots: Optional[torch.Tensor], tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        """At the call (CPU): the native core's checks, naming the argument and the first bad entry."""
        if not self.check_now:
            return
        for name, t, bad, what in (("root_tokens", roots, self._bad_ids, "a token id in [0, 2^31)"),
                                   ("tokens", tokens, self._bad_ids, "token ids in [0, 2^31)"),
                                   ("logprobs", logprobs, self._bad_logprobs,
                                    f"log-probabilities (finite or -inf, <= {LOGPROB_TOLERANCE})")):
            where = bad(t).nonzero() if t is not None else ()
            if len(where):
                first = tuple(int(i) for i in where[0])
                value = t[first].item()
                value = f"{value:g}" if isinstance(value, float) else value  # (as the native core prints it)
                raise ValueError(f"{name}: expected {what}, got {value} at [{', '.join(map(str, first))}]")

    def _record_bad(self, roots: Optional[torch.Tensor], tokens: torch.Tensor, logprobs: torch.Tensor,
                    bad_draft_ids: Optional[torch.Tensor]) -> None:
        """Off the CPU: ORs this call's problems into the device flags (no synchronisation)."""
        if self.check_now:
            return
        no = torch.zeros((), dtype=torch.bool, device=self.device)
        found = dict(root_tokens=no if roots is None else self._bad_ids(roots).any(),
                     draft_ids=no if bad_draft_ids is None else bad_draft_ids.to(self.device),
                     tokens=self._bad_ids(tokens).any(), logprobs=self._bad_logprobs(logprobs).any())
        self._bad |= torch.stack([found[name] for name in _DEFERRED])

    @property
    def problems(self) -> torch.Tensor:
        """bool [len(_DEFERRED)] on the device: the problems recorded this round (all False on the CPU)."""
        return self._bad

    def raise_recorded(self, flags: Sequence[bool]) -> None:
        """Raises the first problem of ``flags`` (:attr:`problems` on the host, copied back by the
        caller with the round's other results: one synchronisation)."""
        for flag, (name, what) in zip(flags, _DEFERRED.items()):
            if flag:
                arg = "tokens" if name == "draft_ids" else name
                raise ValueError(f"{arg}: expected {what} in this round's expand_root / expand calls, got other "
                                 f"values (checked at finalize on {self.device}); start the next round with "
                                 "expand_root")
