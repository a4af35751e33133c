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
every level). The flags are written in place into a buffer allocated once, so that a CUDA graph of
a round (moespec.spec.draft_graph) writes the ones the finalize reads. Token ids are clamped for
the gathers, so bad input never reaches a device assert.

Dimensions: B requests, K top-k, C candidates (at most K + (D - 1) K^2), M tree nodes without the
root, N = M + 1, W = ceil(N / 32) mask words, L = levels + 1.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from moespec._loader import native
from moespec.spec.tree import _bits_as_int32, _describe

LOGPROB_TOLERANCE = 1e-3  # (kDraftLogprobTolerance) the largest log-prob accepted, counted as 0
_MAX_TOKEN = 2**31 - 1
_MAX_KEY = 2**63 - 1  # a sort key above every path's
_DEFERRED = {  # what a GPU round's finalize reports: argument -> what was expected
    "root_tokens": "token ids in [0, 2^31)",
    "draft_ids": "draft ids in [0, V_draft) (to be mapped through d2t)",  # (before tokens: the cause)
    "tokens": "token ids in [0, 2^31)",
    "logprobs": f"log-probabilities (finite or -inf, <= {LOGPROB_TOLERANCE})",
}


class TorchTreeCore:
    """B requests' EAGLE-2 trees in lockstep, in torch ops on ``device`` (buffers allocated once).

    A round is a fixed sequence of about 20 kernels per level and 60 at the finalize (B = 8, top-k 8,
    depth 6: ~190 in all): what is fixed by the shape (each candidate's depth, the roots' parent, the
    masks' own bits, the sort keys' weights) is computed once per tree size, outputs are written in
    place (``out=``), and problems are recorded as flags copied back with the finalize's results.
    With ``kernels`` (TreeBuilder's "fused" core; where top_k <= 16 and C <= 4096) each level and the
    finalize are one kernel instead (:mod:`moespec.ops.draft_tree`) on the same buffers, flags and
    semantics."""

    def __init__(self, batch: int, depth: int, top_k: int, total_tokens: int, device: torch.device,
                 kernels: bool = False):
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
        index = torch.arange(C)
        self._tokens = torch.zeros(B, C, dtype=torch.int64, **kw)  # [B, C]
        self._parent = torch.full((B, C), -1, dtype=torch.int32, **kw)  # [B, C] candidate index, -1: the root
        self._depth = torch.where(index < K, 1, 2 + (index - K).clamp(min=0) // (K * K)).to(**kw).expand(B, C)
        self._score = torch.zeros(B, C, dtype=torch.float32, **kw)  # [B, C]
        self._root = torch.zeros(B, dtype=torch.int64, **kw)  # [B]
        self._frontier = torch.zeros(B, K, dtype=torch.int64, **kw)  # [B, K] candidate indices, best first
        # node_of[b, c + 1]: the tree node of candidate c (column 0: the root's -1 -> node 0)
        self._node_of = torch.zeros(B, C + 1, dtype=torch.int64, **kw)
        # off the CPU, this round's value checks: the problem each checks, and its ok flag written in place
        # (a CUDA graph of the round writes these flags when replayed; a capture computes nothing, so
        # flags made during one would be read unwritten at the round's finalize)
        self._checks: list[str] = []
        self._ok = torch.ones(3 * depth + 1, dtype=torch.bool, **kw)  # [F]: 4 at expand_root, 3 per expand
        self._by_nodes: dict[tuple[int, int], dict] = {}  # (N, L) -> what a finalize of that shape reuses
        # moespec's tree kernels (draft_tree_expand / draft_tree_finalize: one launch a level and one a
        # finalize) where the sizes fit them, else the torch ops below
        n = native()
        self.kernels = kernels and top_k <= n.kMaxFusedTreeTopK and C <= n.kMaxFusedTreeCandidates
        if self.kernels:
            self._scratch = torch.empty(B, 2 * C + 6 * self.max_nodes, dtype=torch.int32, **kw)
            self._spare_flags = torch.empty(4, dtype=torch.uint8, **kw)  # (a level's flags where checked at the call)

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
                    draft_ids_ok: Optional[torch.Tensor] = None, d2t: Optional[torch.Tensor] = None) -> None:
        """roots [B], tokens [B, K] (target ids), logprobs [B, K] float; writes the frontier ``out``.
        ``draft_ids_ok``: the caller's deferred flag for the draft ids it mapped to ``tokens``; ``d2t``
        (the kernels only, checks deferred): tokens are draft ids, mapped through it here."""
        B, K = self.batch, self.top_k
        roots = self._ids(roots, "root_tokens", (B,))
        tokens = self._ids(tokens, "tokens", (B, K))
        logprobs = self._logprobs(logprobs, (B, K))
        self._check(roots, tokens, logprobs)
        self._checks = []
        if self.kernels:
            self._level_kernel(tokens, logprobs, out, roots, d2t)
            return
        self._store_ids(roots, self._root, "root_tokens")
        self._store_ids(tokens, self._tokens[:, :K], "tokens", draft_ids_ok)
        self._record("logprobs", lambda: logprobs.le(LOGPROB_TOLERANCE))
        torch.clamp(logprobs, max=0.0, out=self._score[:, :K])  # (the first K parents: -1 since __init__)
        torch.sort(self._score[:, :K], dim=1, descending=True, stable=True, out=(out["scores"], self._frontier))
        self.levels = 1
        out["index"].copy_(self._frontier)
        torch.gather(self._tokens, 1, self._frontier, out=out["tokens"])
        out["parent"].fill_(-1)
        out["parent_slot"].fill_(-1)

    def expand(self, tokens: torch.Tensor, logprobs: torch.Tensor, out: dict,
               draft_ids_ok: Optional[torch.Tensor] = None, d2t: Optional[torch.Tensor] = None) -> None:
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
        if self.kernels:
            self._level_kernel(tokens, logprobs, out, None, d2t)
            return
        base, n = self.num_candidates, K * K
        parent = self._frontier  # [B, K]
        self._store_ids(tokens, self._tokens[:, base: base + n].view(B, K, K), "tokens", draft_ids_ok)
        self._record("logprobs", lambda: logprobs.le(LOGPROB_TOLERANCE))
        score = self._score[:, base: base + n]  # [B, K K]
        torch.add(self._score.gather(1, parent)[:, :, None], logprobs.clamp(max=0.0), out=score.view(B, K, K))
        self._parent[:, base: base + n].view(B, K, K).copy_(parent[:, :, None].expand(B, K, K))
        best = torch.sort(score, dim=1, descending=True, stable=True)
        torch.add(best.indices[:, :K], base, out=self._frontier)
        self.levels += 1
        out["index"].copy_(self._frontier)
        out["scores"].copy_(best.values[:, :K])
        torch.gather(self._tokens, 1, self._frontier, out=out["tokens"])
        torch.gather(self._parent, 1, self._frontier, out=out["parent"])
        torch.floor_divide(best.indices[:, :K], K, out=out["parent_slot"])

    def finalize(self, out: dict) -> None:
        """Writes the trees of the best min(total_tokens, C) candidates into ``out`` (the views of
        DraftTreeViews: tokens, parents, depth, scores, candidates [B, N], mask_words [B, N, W],
        paths [B, M, L], num_leaves and max_depth [B])."""
        if self.levels < 1:
            raise ValueError("finalize: the trees have no root yet: call expand_root first")
        C, N = self.num_candidates, self.num_nodes
        M, L = N - 1, self.levels + 1
        if self.kernels:
            self._finalize_kernel(out, C)
            return
        at = self._shape_constants(N, L)
        up, ext_depth = at["up"], at["depth"]  # [B, N + 1]: parent / depth per node, column N: a sentinel
        score = self._score[:, :C]
        top = torch.sort(score, dim=1, descending=True, stable=True).indices[:, :M]
        rank = torch.sort(top, dim=1).values  # [B, M] the chosen candidates in creation order (ancestor-closed)
        self._node_of.scatter_(1, rank + 1, at["nodes"])
        parent1 = torch.add(self._parent[:, :C].gather(1, rank), 1, out=at["parent1"])  # [B, M] int64
        torch.gather(self._node_of, 1, parent1, out=up[:, 1:N])  # (the roots' children: node 0)
        torch.gather(self._depth[:, :C], 1, rank, out=ext_depth[:, 1:N])
        out["tokens"][:, 0].copy_(self._root)
        torch.gather(self._tokens[:, :C], 1, rank, out=out["tokens"][:, 1:])
        out["parents"][:, 0].fill_(-1)
        out["parents"][:, 1:].copy_(up[:, 1:N])
        out["depth"].copy_(ext_depth[:, :N])
        out["scores"][:, 0].fill_(0.0)
        torch.gather(score, 1, rank, out=out["scores"][:, 1:])
        out["candidates"][:, 0].fill_(-1)
        out["candidates"][:, 1:].copy_(rank)
        self._masks(up, at, out["mask_words"])
        leaf = at["leaf"]  # [B, N + 1]
        leaf.fill_(True)
        leaf.scatter_(1, up[:, 1:N], False)  # (column N, the sentinel: nobody's parent)
        leaf = leaf[:, :N]
        torch.sum(leaf, dim=1, dtype=torch.int32, out=out["num_leaves"])
        out["max_depth"].copy_(ext_depth[:, :N].amax(dim=1))
        self._paths(up, ext_depth, leaf, out["num_leaves"], at, out["paths"])

    @property
    def problems(self) -> torch.Tensor:
        """bool [F] on the device: this round's ok flags (none on the CPU, which checks at the call); a view
        of the flag buffer, valid until the next round."""
        return self._ok[: len(self._checks)]

    def raise_recorded(self, flags: Sequence[bool]) -> None:
        """Raises the first problem (in ``_DEFERRED`` order) whose flag in ``flags`` (:attr:`problems`
        on the host, copied back by the caller with the round's other results: one synchronisation)
        is not ok."""
        failed = {name for name, ok in zip(self._checks, flags) if not ok}
        for name, what in _DEFERRED.items():
            if name in failed:
                arg = "tokens" if name == "draft_ids" else name
                raise ValueError(f"{arg}: expected {what} in this round's expand_root / expand calls, got other "
                                 f"values (checked at finalize on {self.device}); start the next round with "
                                 "expand_root")

    def read_candidates(self, b: int) -> tuple[torch.Tensor, ...]:
        """Request ``b``'s candidate records [C] on the CPU: tokens, parents, depth, scores."""
        if not 0 <= b < self.batch:
            raise ValueError(f"b: expected a request index in [0, {self.batch}), got {b}")
        C = self.num_candidates
        return (self._tokens[b, :C].cpu(), self._parent[b, :C].cpu(), self._depth[b, :C].int().cpu(),
                self._score[b, :C].cpu())

    # -- the tree tensors --------------------------------------------------------------------------

    def _shape_constants(self, N: int, L: int) -> dict:
        """What every finalize of N nodes and L path columns reuses, built at its first finalize."""
        key = (N, L)
        if key not in self._by_nodes:
            B, W, kw = self.batch, (N + 31) // 32, dict(device=self.device)
            node = torch.arange(N + 1)
            own = torch.zeros(N + 1, W, dtype=torch.int64)  # row N: the sentinel's, no bits
            own[node[:N], node[:N] // 32] = 1 << (node[:N] % 32)
            up = torch.full((B, N + 1), N, dtype=torch.int64)  # the root's parent and the sentinel's: N
            depth = torch.zeros(B, N + 1, dtype=torch.int64)
            depth[:, N] = L  # a walk that passes the root writes into the discarded column L
            bits = max(1, N.bit_length())  # a path entry + 1 lies in [0, N]
            per = max(1, 62 // bits)  # path columns per int64 sort key
            weights = [torch.tensor([(N + 1) ** (min(L, c + per) - 1 - d) for d in range(c, min(L, c + per))])
                       for c in range(1, L, per)]  # (column 0, the root, is every path's)
            self._by_nodes[key] = dict(
                own=_bits_as_int32(own)[None].expand(B, N + 1, W).to(**kw), up=up.to(**kw), depth=depth.to(**kw),
                nodes=torch.arange(1, N, **kw).expand(B, N - 1), start=torch.arange(N, **kw).expand(B, N),
                parent1=torch.empty(B, N - 1, dtype=torch.int64, **kw), leaf=torch.empty(B, N + 1, dtype=torch.bool, **kw),
                paths=torch.empty(B, N, L + 1, dtype=torch.int64, **kw), columns=range(1, L, per),
                weights=[w.to(**kw) for w in weights], slot=torch.arange(N, **kw)[None, :])
        return self._by_nodes[key]

    def _masks(self, up: torch.Tensor, at: dict, out: torch.Tensor) -> None:
        """int32 [B, N, W] ancestor-or-self rows by pointer doubling over the packed rows: after round
        r a row holds the node and its 2^r - 1 nearest ancestors (the sentinel's row: none)."""
        B, N1, W = at["own"].shape
        rows, jump, reach = at["own"], up, 1
        while reach < self.levels + 1:
            rows = rows | rows.gather(1, jump[:, :, None].expand(B, N1, W))
            reach *= 2
            if reach < self.levels + 1:
                jump = jump.gather(1, jump)
        out.copy_(rows[:, : N1 - 1])

    def _paths(self, up: torch.Tensor, depth: torch.Tensor, leaf: torch.Tensor, num_leaves: torch.Tensor,
               at: dict, out: torch.Tensor) -> None:
        """int32 [B, M, L]: the root-to-leaf paths of the leaves in lexicographic order, then -1 rows."""
        paths = at["paths"]  # [B, N, L + 1], column L: discarded writes
        B, N, L = paths.shape[0], paths.shape[1], paths.shape[2] - 1
        paths.fill_(-1)
        node = at["start"]
        for step in range(L):  # walk up from every node: entry depth(u) of row n is u
            paths.scatter_(2, depth.gather(1, node)[:, :, None], node[:, :, None])
            if step + 1 < L:
                node = up.gather(1, node)
        paths = paths[:, :, :L]
        order = None  # leaves in path order: stable sorts of packed keys, least significant columns first
        for j in range(len(at["columns"]) - 1, -1, -1):
            c, w = at["columns"][j], at["weights"][j]
            block = paths[:, :, c: c + len(w)] if order is None else \
                paths.gather(1, order[:, :, None].expand(B, N, L))[:, :, c: c + len(w)]
            key = ((block + 1) * w).sum(dim=2)  # [B, N]
            if j == 0:  # the most significant key sorts the other nodes after the leaves
                leaves_now = leaf if order is None else leaf.gather(1, order)
                key = torch.where(leaves_now, key, _MAX_KEY)
            sorted_ = torch.sort(key, dim=1, stable=True).indices
            order = sorted_ if order is None else order.gather(1, sorted_)
        rows = paths.gather(1, order[:, : N - 1, None].expand(B, N - 1, L))
        out.copy_(torch.where(at["slot"][:, : N - 1, None] < num_leaves[:, None, None], rows, -1))

    # -- helpers -----------------------------------------------------------------------------------

    def _level_kernel(self, tokens: torch.Tensor, logprobs: torch.Tensor, out: dict, roots: Optional[torch.Tensor],
                      d2t: Optional[torch.Tensor]) -> None:
        """A level in one launch (moespec::draft_tree_expand): the root level with ``roots``; its flags
        written in the order the torch ops record them (checked now, on the CPU: into a spare buffer)."""
        from moespec.ops.draft_tree import draft_tree_expand

        base = 0 if roots is not None else self.num_candidates
        names = (["root_tokens"] if roots is not None else []) + (["draft_ids"] if d2t is not None else []) + \
            ["tokens", "logprobs"]
        B = self.batch  # ([B, n] contiguous)
        tokens, logprobs = tokens.reshape(B, -1).contiguous(), logprobs.reshape(B, -1).contiguous()
        flags = self._spare_flags
        if not self.check_now:
            flags = self._ok[len(self._checks): len(self._checks) + len(names)].view(torch.uint8)
            self._checks += names
        draft_tree_expand(tokens, logprobs, roots, d2t, self._tokens, self._parent, self._score, self._root,
                          self._frontier, *(out[name] for name in ("index", "tokens", "parent", "parent_slot", "scores")),
                          flags, base, LOGPROB_TOLERANCE)
        self.levels = 1 if roots is not None else self.levels + 1

    def _finalize_kernel(self, out: dict, C: int) -> None:
        """The trees of the C candidates in one launch (moespec::draft_tree_finalize)."""
        from moespec.ops.draft_tree import draft_tree_finalize

        draft_tree_finalize(self._score, self._parent, self._tokens, self._root, self._scratch,
                            *(out[name] for name in ("tokens", "parents", "depth", "scores", "candidates",
                                                     "mask_words", "paths", "num_leaves", "max_depth")),
                            C, self.top_k)

    def _store_ids(self, t: torch.Tensor, dest: torch.Tensor, name: str, draft_ids_ok=None) -> None:
        """Writes ids clamped into [0, 2^31) (bad input never reaches a device assert) and records
        whether the clamp changed any (and the caller's draft-id flag)."""
        torch.clamp(t, 0, _MAX_TOKEN, out=dest)
        if draft_ids_ok is not None:
            self._record("draft_ids", lambda: draft_ids_ok)
        self._record(name, lambda: dest.eq(t))

    def _record(self, name: str, ok) -> None:
        """Off the CPU: writes whether all of ``ok()`` (bools on the device) hold into the round's next
        flag (the reduction writes it: one launch)."""
        if not self.check_now:
            torch.all(ok(), out=self._ok[len(self._checks)])
            self._checks.append(name)

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
