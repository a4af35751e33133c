"""Draft trees for speculative decoding: EAGLE-2's dynamic expansion and reranking.

Implements DESIGN.md "Contracts" -> "Draft tree" and the tree of "Speculative decoding (EAGLE-3)"
over the native ``DraftTreeBatch`` (C++: cpp/include/moespec/draft_tree.h, cpp/src/draft_tree.cc,
which state the exact semantics; EAGLE's counterpart is ``cnets.Model.topK_genrate``). The
plain-Python reference the tests hold it against is in tests/python/test_draft_tree.py.

One round, for B requests in lockstep::

    frontier = builder.expand_root(root_tokens, tokens, logprobs)  # the root's top-K children
    while builder.can_expand and more_levels_wanted:
        ...  # run the draft on frontier.tokens, parents' hidden states picked by frontier.parent_slot
        frontier = builder.expand(child_tokens, child_logprobs)  # [B, K, K]: top-K after each slot
    trees = builder.finalize()  # one DraftTree per request: verify them, accept, commit

The builder allocates its buffers once, on its device; the frontier and the trees it returns are
views of those buffers, valid until the next call that rewrites them (``clone()`` to keep one). Two
cores, one semantics: on the CPU the native ``DraftTreeBatch``; on a GPU the torch core of
:mod:`moespec.spec.tree_device`, whose buffers stay on the device (no host synchronisation between
levels; the finalize copies each tree's leaf count and depth back). Draft-vocabulary ids are mapped
to target ids here (EAGLE-3's ``d2t``), before they reach the core, which sees target ids only.

Dimensions: B requests, K top-k, D depth (levels below the root), C candidates,
M tree nodes without the root (M <= total_tokens), W = ceil((M + 1) / 32) mask words, P leaves.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F

from moespec._loader import native
from moespec._tensor import view

__all__ = ["Candidates", "DraftTree", "Frontier", "HostLists", "TreeBuilder", "host_lists", "pack_mask",
           "unpack_mask"]

_BIT = torch.arange(32, dtype=torch.int32)  # [32]


def unpack_mask(mask_words: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """Unpacks bit-packed mask rows: int32 [..., W] -> bool [..., num_nodes].

    Bit ``j % 32`` of word ``j // 32`` is column ``j``.

    Examples
    --------
    >>> unpack_mask(torch.tensor([[1], [3]], dtype=torch.int32), 2)
    tensor([[ True, False],
            [ True,  True]])
    """
    bits = (mask_words.unsqueeze(-1) >> _BIT.to(mask_words.device)) & 1  # [..., W, 32]
    return bits.flatten(-2)[..., :num_nodes].bool()  # [..., num_nodes]


def pack_mask(bits: torch.Tensor) -> torch.Tensor:
    """Packs mask rows, the inverse of :func:`unpack_mask`: bool [..., n] -> int32 [..., ceil(n / 32)].

    Examples
    --------
    >>> pack_mask(torch.tensor([[True, False], [True, True]]))
    tensor([[1],
            [3]], dtype=torch.int32)
    """
    n = bits.shape[-1]
    W = max(1, (n + 31) // 32)
    padded = F.pad(bits.long(), (0, 32 * W - n)).unflatten(-1, (W, 32))  # [..., W, 32]
    return _bits_as_int32((padded << _BIT.to(bits.device).long()).sum(-1))  # [..., W]


def _bits_as_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words in [0, 2^32) -> the int32 words of the same bits (two's complement)."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


@dataclass(frozen=True, eq=False)
class DraftTree:
    """One request's draft tree (the contract of DESIGN.md "Contracts" -> "Draft tree").

    Node 0 is the root (the last accepted token); every other node's parent is an earlier node and
    the node set is closed under ancestors.

    Attributes
    ----------
    tokens : Tensor int64 [M+1]
        Target token ids (node 0: the root).
    parents : Tensor int32 [M+1]
        Parent node index, -1 for the root. A tree the eco policies choose on a GPU
        (moespec.spec.cost_aware.CostAwareTrees.device_trees) ends in padding rows where it has
        fewer nodes: parent -1 past the root, copies of the root (its token, depth 0, its mask row),
        never on a path and weightless in a budget's ranking.
    depth : Tensor int32 [M+1]
        Depth below the root: the node's position offset in the verify pass.
    mask_words : Tensor int32 [M+1, W]
        Ancestor-or-self attention mask, bit-packed: bit ``j % 32`` of word ``j // 32`` of row ``i``
        is set iff node ``j`` is node ``i`` or one of its ancestors. :meth:`mask` unpacks it.
    paths : Tensor int32 [P, max_depth+1], or None
        Node indices from the root to each leaf (a node that is nobody's parent), padded with -1,
        rows in lexicographic order: the ``retrieve_indices`` of acceptance. None in the trees of
        :meth:`TreeBuilder.deferred_trees` (their shapes not read back yet; a step's own trees).
    scores : Tensor float32 [M+1]
        Cumulative draft log-probability of each node (root 0).
    candidates : Tensor int32 [M+1]
        Each node's index among the builder's candidates (root -1), see :meth:`TreeBuilder.candidates`.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    mask_words: torch.Tensor
    paths: Optional[torch.Tensor]
    scores: torch.Tensor
    candidates: torch.Tensor
    # tokens and parents as host lists, once read (host_lists): a tree read back once is not read again
    host: Optional[tuple[list[int], list[int]]] = field(default=None, repr=False, compare=False)

    @property
    def num_nodes(self) -> int:
        """M + 1 (the root included)."""
        return self.tokens.shape[0]

    def mask(self) -> torch.Tensor:
        """The ancestor-or-self mask as bool [M+1, M+1]: ``mask[i, j]`` iff j is i or an ancestor of i."""
        return unpack_mask(self.mask_words, self.num_nodes)

    def clone(self) -> "DraftTree":
        """A copy that owns its memory (the builder's next finalize does not change it)."""
        return DraftTree(*(t.clone() if t is not None else None for t in (
            self.tokens, self.parents, self.depth, self.mask_words, self.paths, self.scores, self.candidates)),
            host=self.host)


def host_lists(trees: Sequence[Optional[DraftTree]],
               also: Sequence[torch.Tensor] = ()) -> tuple[list[tuple[list[int], list[int]]], list[int]]:
    """Each tree's tokens and parents as host lists (([], []) for None), read back once: the trees
    not read yet come back together, with ``also`` (integer or bool tensors on their device: a step's argmax
    choices, a deferred round's problem flags) in the same copy (one synchronisation for trees on a
    GPU), and keep their lists (:attr:`DraftTree.host`). Returns the lists and ``also``'s values,
    flattened one after the other."""
    todo = [t for t in trees if t is not None and t.host is None]
    parts = [x.reshape(-1) for t in todo for x in (t.tokens, t.parents)] + [x.reshape(-1) for x in also]
    values: list[list[int]] = [[] for _ in parts]
    for device in {x.device for x in parts}:  # (one copy a device: trees on the CPU beside GPU logits)
        mine = [i for i, x in enumerate(parts) if x.device == device]
        flat, at = torch.cat([parts[i] for i in mine]).tolist(), 0  # (one launch: cat promotes the dtypes)
        for i in mine:
            values[i], at = flat[at: at + parts[i].numel()], at + parts[i].numel()
    for j, t in enumerate(todo):
        object.__setattr__(t, "host", (values[2 * j], values[2 * j + 1]))
    return [t.host if t is not None else ([], []) for t in trees], [v for x in values[2 * len(todo):] for v in x]


class HostLists(Sequence):
    """The trees' tokens (``column`` 0) or parents (1) as host lists, read back (:func:`host_lists`)
    at the first look at an item: a verify step whose trees stay on the device until the acceptance
    reads them back takes its lengths from the trees and needs no copy of its own."""

    def __init__(self, trees: Sequence[Optional[DraftTree]], column: int):
        self.trees, self.column = list(trees), column
        self._lists: Optional[list] = None

    def __len__(self) -> int:
        return len(self.trees)

    def __getitem__(self, b):
        if self._lists is None:
            self._lists = host_lists(self.trees)[0]
        return [lists[self.column] for lists in self._lists[b]] if isinstance(b, slice) else self._lists[b][self.column]

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None  # (mutable, as a list)

    def __repr__(self) -> str:
        return repr(list(self))


@dataclass(frozen=True, eq=False)
class Frontier:
    """The nodes the draft runs on next: the K best candidates of the last level, per request.

    Attributes
    ----------
    index : Tensor int32 [B, K]
        Candidate index of each frontier node, best first.
    tokens : Tensor int64 [B, K]
        Its token (a target id): the draft's next input.
    parent : Tensor int32 [B, K]
        Candidate index of its parent (-1: the root).
    parent_slot : Tensor int32 [B, K]
        Row of its parent in the previous frontier (-1: the root): which of the draft's last outputs
        (hidden states, KV) continues into this node, as EAGLE's ``out_ids``.
    scores : Tensor float32 [B, K]
        Its cumulative draft log-probability.
    depth : int
        Its depth below the root (the same for every frontier node: the number of levels so far).
    """

    index: torch.Tensor
    tokens: torch.Tensor
    parent: torch.Tensor
    parent_slot: torch.Tensor
    scores: torch.Tensor
    depth: int

    def clone(self) -> "Frontier":
        """A copy that owns its memory (the builder's next expand does not change it)."""
        return Frontier(self.index.clone(), self.tokens.clone(), self.parent.clone(), self.parent_slot.clone(),
                        self.scores.clone(), self.depth)


@dataclass(frozen=True, eq=False)
class Candidates:
    """Every candidate one request's expansion recorded, selected or not, by candidate index [C].

    ``tokens`` int64, ``parents`` int32 (candidate index, -1 = the root), ``depth`` int32 (1 for the
    root's children), ``scores`` float32 (cumulative log-probability). A cost-aware selection
    (EcoSpec) picks among these.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    scores: torch.Tensor


CORES = ("native", "torch", "fused")


def default_device_core() -> str:
    """The tree core off the CPU: "fused" (the torch core's buffers, a level and a finalize in one
    of moespec's kernels each) where the build has its CUDA kernels, unless MOESPEC_TREE_FUSED=0;
    else "torch"."""
    setting = os.environ.get("MOESPEC_TREE_FUSED", "1")
    if setting not in ("0", "1"):
        raise ValueError(f"MOESPEC_TREE_FUSED: expected '1' or '0', got {setting!r}")
    return "fused" if setting == "1" and native().cuda_available() else "torch"


class TreeBuilder:
    """Builds B requests' EAGLE-2 dynamic draft trees in lockstep (native ``DraftTreeBatch``).

    Parameters
    ----------
    batch : int
        B, the number of requests.
    depth : int
        D >= 1: the most levels below the root (the root expansion is level 1, so at most D - 1
        calls to :meth:`expand`). EAGLE's ``depth=d`` runs d expansions after the root: pass d + 1.
    top_k : int
        K, in [1, 64]: children kept per expanded node, and frontier size.
    total_tokens : int
        The most tree nodes besides the root, in [1, 4096]; a tree has
        M = min(total_tokens, C) of them, C = K + (levels - 1) K^2 candidates.
    d2t : Tensor int64 [V_draft], optional
        EAGLE-3's draft-to-target vocabulary map: draft id ``i`` is target id ``i + d2t[i]``. When
        given, the child tokens passed in are draft ids (root tokens are target ids).

    Notes
    -----
    Children's log-probabilities must be finite or -inf and at most 1e-3 (a positive one, the
    rounding of a log-softmax, counts as 0). Ranking is by (score desc, depth asc, candidate index
    asc), so ties are broken the same way everywhere and the trees are closed under ancestors.
    device : the device of the builder's buffers and outputs (default: the CPU). Inputs may live on
        any device (they are copied to the builder's).
    core : "native" (the C++ core; the CPU only), "torch" (:mod:`moespec.spec.tree_device`; any
        device) or "fused" (the torch core's buffers with a level and a finalize in one of moespec's
        kernels each, ``draft_tree_expand`` / ``draft_tree_finalize``, where top_k <= 16 and the
        candidates <= 4096, else the torch ops; on the CPU the kernels' block code runs with one
        thread); default native on the CPU, elsewhere :func:`default_device_core`. All give
        identical trees.

    Bad input raises ValueError naming the argument, and leaves the builder as it was; on a GPU the
    value checks (token ids, log-probabilities) run at :meth:`finalize` instead (checking at each call
    would synchronise every level).

    Examples
    --------
    >>> builder = TreeBuilder(1, depth=2, top_k=2, total_tokens=3)
    >>> frontier = builder.expand_root(torch.tensor([7]), torch.tensor([[5, 6]]), torch.tensor([[-0.1, -1.0]]))
    >>> frontier.tokens
    tensor([[5, 6]])
    >>> frontier = builder.expand(torch.tensor([[[8, 9], [10, 11]]]),
    ...                           torch.tensor([[[-0.2, -3.0], [-0.05, -0.5]]]))
    >>> frontier.tokens, frontier.parent_slot
    (tensor([[ 8, 10]]), tensor([[0, 1]], dtype=torch.int32))
    >>> tree = builder.finalize()[0]
    >>> tree.tokens, tree.parents, tree.depth
    (tensor([7, 5, 6, 8]), tensor([-1,  0,  0,  1], dtype=torch.int32), tensor([0, 1, 1, 2], dtype=torch.int32))
    >>> tree.paths
    tensor([[ 0,  1,  3],
            [ 0,  2, -1]], dtype=torch.int32)
    >>> tree.mask().int()
    tensor([[1, 0, 0, 0],
            [1, 1, 0, 0],
            [1, 0, 1, 0],
            [1, 1, 0, 1]], dtype=torch.int32)
    """

    def __init__(self, batch: int, *, depth: int = 7, top_k: int = 10, total_tokens: int = 60,
                 d2t: Optional[torch.Tensor] = None, device: Union[str, torch.device, None] = None,
                 core: Optional[str] = None) -> None:
        for name, value in (("batch", batch), ("depth", depth), ("top_k", top_k), ("total_tokens", total_tokens)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name}: expected an int, got {value!r}")
        if d2t is not None and (not isinstance(d2t, torch.Tensor) or d2t.dim() != 1 or d2t.dtype != torch.int64):
            raise ValueError(f"d2t: expected an int64 tensor [V_draft], got {_describe(d2t)}")
        device = torch.device("cpu" if device is None else device)
        core = core or ("native" if device.type == "cpu" else default_device_core())
        if core not in CORES or (core == "native" and device.type != "cpu"):
            raise ValueError(f"core: expected 'native' (the CPU only), 'torch' or 'fused', got {core!r} on {device}")
        if core == "native":
            self._impl, self._core = native().DraftTreeBatch(batch, depth, top_k, total_tokens), None
        else:
            from moespec.spec.tree_device import TorchTreeCore

            self._impl = self._core = TorchTreeCore(batch, depth, top_k, total_tokens, device, kernels=core == "fused")
        self.device = device
        self._d2t = None if d2t is None else d2t.to(device)
        B, K = batch, top_k
        n_max = self._impl.max_nodes  # the largest M + 1
        w_max = (n_max + 31) // 32
        i32 = dict(dtype=torch.int32, device=device)
        # Frontier buffers [B, K], their descriptors built once.
        self._f_index = torch.empty(B, K, **i32)  # [B, K]
        self._f_tokens = torch.empty(B, K, dtype=torch.int64, device=device)  # [B, K]
        self._f_parent = torch.empty(B, K, **i32)  # [B, K]
        self._f_parent_slot = torch.empty(B, K, **i32)  # [B, K]
        self._f_scores = torch.empty(B, K, dtype=torch.float32, device=device)  # [B, K]
        self._f_views = None if self._core is not None else (
            view(self._f_index, "frontier_index"), view(self._f_tokens, "frontier_tokens"),
            view(self._f_parent, "frontier_parent"), view(self._f_parent_slot, "frontier_parent_slot"), None,
            view(self._f_scores, "frontier_scores"))
        self._f_out = dict(index=self._f_index, tokens=self._f_tokens, parent=self._f_parent,
                           parent_slot=self._f_parent_slot, scores=self._f_scores)  # (the torch core's)
        self._frontier = Frontier(self._f_index, self._f_tokens, self._f_parent, self._f_parent_slot,
                                  self._f_scores, 0)
        # Tree buffers for the largest tree; a finalize writes a prefix of them.
        self._t_tokens = torch.empty(B, n_max, dtype=torch.int64, device=device)  # [B, M+1]
        self._t_parents = torch.empty(B, n_max, **i32)  # [B, M+1]
        self._t_depth = torch.empty(B, n_max, **i32)  # [B, M+1]
        self._t_scores = torch.empty(B, n_max, dtype=torch.float32, device=device)  # [B, M+1]
        self._t_candidates = torch.empty(B, n_max, **i32)  # [B, M+1]
        self._t_mask = torch.empty(B, n_max, w_max, **i32)  # [B, M+1, W]
        self._t_paths = torch.empty(B, n_max - 1, depth + 1, **i32)  # [B, M, D+1]
        self._t_leaves = torch.empty(B, **i32)  # [B]
        self._t_max_depth = torch.empty(B, **i32)  # [B]
        self._by_levels: dict[int, tuple] = {}  # levels -> (descriptors, per-request slices)

    # -- properties ------------------------------------------------------------------------------

    @property
    def batch(self) -> int:
        return self._impl.batch

    @property
    def depth(self) -> int:
        return self._impl.depth

    @property
    def top_k(self) -> int:
        return self._impl.top_k

    @property
    def total_tokens(self) -> int:
        return self._impl.total_tokens

    @property
    def levels(self) -> int:
        """Levels expanded in the current trees (0 before :meth:`expand_root`)."""
        return self._impl.levels

    @property
    def can_expand(self) -> bool:
        """Whether :meth:`expand` may be called now (1 <= levels < depth)."""
        return 1 <= self._impl.levels < self._impl.depth

    @property
    def num_candidates(self) -> int:
        """C: candidates recorded per request so far."""
        return self._impl.num_candidates

    # -- one round -------------------------------------------------------------------------------

    def expand_root(self, root_tokens: Union[torch.Tensor, Sequence[int]], tokens: torch.Tensor,
                    logprobs: torch.Tensor) -> Frontier:
        """Starts new trees from each request's root and the draft's top-K after it.

        Parameters
        ----------
        root_tokens : Tensor int32 | int64 [B] (or a list of ints)
            The last accepted token of each request (a target id).
        tokens : Tensor int32 | int64 [B, K]
            The draft's top-K tokens after the root (draft ids when the builder has a ``d2t``).
        logprobs : Tensor float [B, K]
            Their log-probabilities (converted to float32).

        Returns
        -------
        Frontier
            The K children of each root, best first (depth 1).
        """
        tokens, ok, d2t = self._map(tokens)
        if self._core is not None:
            self._core.expand_root(torch.as_tensor(root_tokens), tokens, logprobs, self._f_out, draft_ids_ok=ok,
                                   d2t=d2t)
            return self._current_frontier()
        # Locals keep converted copies alive while the native call reads them.
        roots, logprobs = _cpu(torch.as_tensor(root_tokens)), _float32(logprobs)
        self._impl.expand_root(view(roots, "root_tokens"), view(tokens, "tokens"), view(logprobs, "logprobs"),
                               *self._f_views)
        return self._current_frontier()

    def expand(self, tokens: torch.Tensor, logprobs: torch.Tensor) -> Frontier:
        """Adds one level: the draft's top-K children of every frontier node.

        Parameters
        ----------
        tokens : Tensor int32 | int64 [B, K, K]
            ``tokens[b, s]``: the top-K tokens after frontier slot ``s`` of request ``b``.
        logprobs : Tensor float [B, K, K]
            Their log-probabilities; a child's score is its parent's plus this.

        Returns
        -------
        Frontier
            The K best of the K^2 new candidates of each request, best first.
        """
        tokens, ok, d2t = self._map(tokens)
        if self._core is not None:
            self._core.expand(tokens, logprobs, self._f_out, draft_ids_ok=ok, d2t=d2t)
            return self._current_frontier()
        logprobs = _float32(logprobs)  # locals: alive during the call
        self._impl.expand(view(tokens, "tokens"), view(logprobs, "logprobs"), *self._f_views)
        return self._current_frontier()

    def finalize(self) -> list[DraftTree]:
        """Each request's tree: its ``min(total_tokens, C)`` best candidates, in creation order.

        Returns
        -------
        list of DraftTree, one per request
            Views of the builder's buffers, valid until the next ``finalize`` (``clone()`` to keep).
        """
        if self._core is None:
            descriptors, _, _ = self._current_layout()
            self._impl.finalize(*descriptors)
            return self._trees(torch.cat([self._t_leaves, self._t_max_depth]).tolist())
        self.finalize_device()
        return self.finalize_host()

    def finalize_device(self) -> None:
        """The torch core's half of :meth:`finalize` that runs on the device (no synchronisation; what a
        CUDA graph of a draft round captures): the trees into the builder's buffers."""
        if self._core is None:
            raise ValueError("finalize_device: the native core finalizes on the host: call finalize")
        self._core.finalize(self._current_layout()[1])

    def finalized(self) -> dict[str, torch.Tensor]:
        """The last :meth:`finalize_device`'s trees as batch tensors (views of the buffers, [B, M + 1]):
        tokens, parents, depth, scores, candidates (the eco policies' GPU selection takes its
        candidates from them, moespec.spec.cost_aware.CostAwareTrees.device_trees)."""
        out = self._current_layout()[1]
        return {k: out[k] for k in ("tokens", "parents", "depth", "scores", "candidates")}

    @property
    def on_device(self) -> bool:
        """Whether the torch core builds the trees (finalize_device, finalize_host, deferred_trees)."""
        return self._core is not None

    def deferred_trees(self) -> tuple[list[DraftTree], torch.Tensor]:
        """:meth:`finalize_host` without its copy back, for a step that reads the trees back once,
        later (moespec.spec.eagle3_policy): the trees as views of the buffers, their ``paths`` None
        (their shapes not known on the host), and the round's problem flags on the device (bool [F],
        a view, valid until the next round as the trees are: to copy back with the step's results and
        hand to :meth:`raise_recorded` before the trees' results are used: until then their tokens
        are unchecked)."""
        if self._core is None:
            raise ValueError("deferred_trees: the native core finalizes on the host: call finalize")
        return self._trees(None), self._core.problems

    def raise_recorded(self, flags: Sequence[int]) -> None:
        """Raises the first problem a deferred round recorded (``flags``: the values of
        :meth:`deferred_trees`' flags), naming the argument."""
        self._core.raise_recorded(flags)

    def finalize_host(self) -> list[DraftTree]:
        """The other half: the round's one copy back (the paths' shapes and the problems recorded on
        the device; a GPU's one synchronisation), then the trees as views of the buffers."""
        if self._core is None:
            raise ValueError("finalize_host: the native core finalizes on the host: call finalize")
        B = self.batch
        host = torch.cat([self._t_leaves, self._t_max_depth, self._core.problems.int()]).tolist()
        self._core.raise_recorded(host[2 * B:])
        return self._trees(host)

    def _current_layout(self) -> tuple:
        levels = self._impl.levels
        if levels not in self._by_levels:
            self._by_levels[levels] = self._layout(levels)
        return self._by_levels[levels]

    def _trees(self, host: Optional[list[int]]) -> list[DraftTree]:
        """The trees as views of the buffers; ``host``: each tree's leaf count, then its depth (None: the
        paths unknown)."""
        B, slices = self.batch, self._current_layout()[2]
        trees = []
        for b, (tokens, parents, depth, mask, paths, strides, offset, scores, candidates) in enumerate(slices):
            if host is not None:
                paths = paths.as_strided((host[b], host[B + b] + 1), strides, offset)  # [P, max_depth+1]
            trees.append(DraftTree(tokens, parents, depth, mask, paths if host is not None else None, scores,
                                   candidates))
        return trees

    def candidates(self, b: int) -> Candidates:
        """Request ``b``'s candidate records [C] (new tensors, on the CPU)."""
        if self._core is not None:
            return Candidates(*self._core.read_candidates(b))
        c = self._impl.num_candidates
        out = Candidates(torch.empty(c, dtype=torch.int64), torch.empty(c, dtype=torch.int32),
                         torch.empty(c, dtype=torch.int32), torch.empty(c, dtype=torch.float32))
        self._impl.read_candidates(b, view(out.tokens, "tokens"), view(out.parents, "parents"),
                                     view(out.depth, "depth"), view(out.scores, "scores"))
        return out

    # -- helpers ---------------------------------------------------------------------------------

    def _current_frontier(self) -> Frontier:
        levels = self._impl.levels
        if self._frontier.depth != levels:
            self._frontier = Frontier(self._f_index, self._f_tokens, self._f_parent, self._f_parent_slot,
                                      self._f_scores, levels)
        return self._frontier

    def _map(self, tokens) -> tuple:
        """Draft ids -> target ids on the builder's device, and the torch core's deferred flag that
        they were all in range (off the CPU it is raised at the finalize; None where the range is
        checked now, or without a d2t); or, for the tree kernels with checks deferred, the draft ids
        and the map (the level's kernel maps them and records the flag)."""
        if self._d2t is None or not isinstance(tokens, torch.Tensor):
            return (tokens if self._core is not None else _cpu(tokens)), None, None
        if self._core is not None and self._core.kernels and not self._core.check_now:
            return tokens, None, self._d2t
        V = self._d2t.shape[0]
        tokens = tokens.to(self.device, non_blocking=True)
        inside = tokens.clamp(0, V - 1)
        ok = inside.eq(tokens).all()
        if self._core is None or self._core.check_now:
            if not bool(ok):
                raise ValueError(f"tokens: draft ids must lie in [0, {V}) to be mapped through d2t, "
                                 f"got values in [{int(tokens.min())}, {int(tokens.max())}]")
            ok = None
        tokens = tokens + self._d2t[inside]
        return (tokens if self._core is not None else _cpu(tokens)), ok, None

    def _layout(self, levels: int) -> tuple:
        """The finalize outputs for trees of ``levels`` levels (the native core's descriptors of them, the
        torch core's tensors), and per-request slices."""
        n = self._impl.num_nodes  # M + 1
        w = (n + 31) // 32
        tokens, parents, depth = self._t_tokens[:, :n], self._t_parents[:, :n], self._t_depth[:, :n]
        scores, candidates = self._t_scores[:, :n], self._t_candidates[:, :n]
        mask, paths = self._t_mask[:, :n, :w], self._t_paths[:, :n - 1, :levels + 1]
        outputs = dict(tokens=tokens, parents=parents, depth=depth, scores=scores, candidates=candidates,
                       mask_words=mask, paths=paths, num_leaves=self._t_leaves, max_depth=self._t_max_depth)
        descriptors = None if self._core is not None else tuple(
            view(outputs[k], k) for k in ("tokens", "parents", "depth", "scores", "candidates", "mask_words", "paths",
                                          "num_leaves", "max_depth"))
        # (as_strided of a request's paths costs less than slicing them: a finalize does it B times)
        slices = [(tokens[b], parents[b], depth[b], mask[b], paths[b], paths[b].stride(), paths[b].storage_offset(),
                   scores[b], candidates[b]) for b in range(self.batch)]
        return descriptors, outputs, slices


def tree_from_selection(root_token: int, cands: Candidates, selected: Sequence[int]) -> DraftTree:
    """The DraftTree of a chosen, ancestor-closed set of candidate indices (a cost-aware selection):
    nodes in creation order after the root, the contract's masks and lexicographic root-to-leaf paths."""
    order = sorted(int(c) for c in selected)
    node_of = {c: i + 1 for i, c in enumerate(order)}
    n = len(order) + 1
    parents = [-1] + [node_of.get(int(cands.parents[c]), 0) if int(cands.parents[c]) >= 0 else 0 for c in order]
    for c in order:
        p = int(cands.parents[c])
        if p >= 0 and p not in node_of:
            raise ValueError(f"tree_from_selection: candidate {c}'s parent {p} is not selected (not ancestor-closed)")
    depth = [0] * n
    bits = torch.zeros(n, n, dtype=torch.bool)  # [M+1, M+1]
    for i in range(n):
        if i:
            depth[i] = depth[parents[i]] + 1
            bits[i] = bits[parents[i]]
        bits[i, i] = True
    has_child = set(parents[1:])
    leaves = [i for i in range(n) if i not in has_child]
    paths = []
    for leaf in leaves:
        path, i = [], leaf
        while i >= 0:
            path.append(i)
            i = parents[i]
        paths.append(path[::-1])
    paths.sort()
    width = max(len(p) for p in paths)
    tokens = torch.tensor([int(root_token)] + [int(cands.tokens[c]) for c in order], dtype=torch.int64)
    return DraftTree(tokens=tokens, parents=torch.tensor(parents, dtype=torch.int32),
                     depth=torch.tensor(depth, dtype=torch.int32), mask_words=pack_mask(bits),
                     paths=torch.tensor([p + [-1] * (width - len(p)) for p in paths], dtype=torch.int32),
                     scores=torch.tensor([0.0] + [float(cands.scores[c]) for c in order], dtype=torch.float32),
                     candidates=torch.tensor([-1] + order, dtype=torch.int32))


def _describe(t: object) -> str:
    if isinstance(t, torch.Tensor):
        return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)} ({t.device})"
    return type(t).__name__


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t if not isinstance(t, torch.Tensor) or t.device.type == "cpu" else t.cpu()


def _float32(t: torch.Tensor) -> torch.Tensor:
    if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float32:
        t = t.float()
    return _cpu(t)
