"""The target model's forward pass: prefill, decode and tree verify over a preallocated KV cache.

transformers' ``generate`` cannot verify a draft tree, keep only accepted tokens in its cache or
budget experts, so moespec owns its forward pass; transformers is the checkpoint format and the
numerical reference (tests/python/test_models_*.py).

One forward serves all three entry points; :class:`TargetModel` validates the call and hands it to
the backend chosen once per model (:mod:`moespec.runtime.backend`: the native decoder step, or the
torch reference forward). Each request b of the cache's batch gets ``n_b`` new tokens at slots
``lengths[b] + j``; a new token sees the request's committed tokens plus, among the new ones, those
its relation allows: earlier tokens (prefill, decode) or its tree ancestors and itself (verify).
Positions are ``lengths[b] + j`` for sequences and ``lengths[b] + depth`` for trees. Requests of
different lengths run together; their padding (the reference pads, the native step packs) is
masked out of attention, never written to the cache and never routed to experts.

Dimensions: B requests, T new tokens (padded), S attended slots, L layers, H hidden, Hq/Hkv query
and key/value heads, D head dim, V vocabulary.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, Optional, Sequence

import os

import torch

from moespec._tensor import to_device
from moespec.models.cache import KVCache, PendingTree
from moespec.models.config import ModelConfig
from moespec.models.moe import MOE_IMPLS
from moespec.models.weights import ModelWeights
from moespec.ops import ExpertBudget
from moespec.runtime.backend import BACKENDS, ForwardOutput, make_backend, rms_norm, rotate

if TYPE_CHECKING:
    from moespec.spec.tree import DraftTree

__all__ = ["ForwardOutput", "TargetModel", "rms_norm", "rotate"]


class TargetModel:
    """A loaded target model (see :func:`moespec.models.load`).

    Parameters
    ----------
    config : ModelConfig
    weights : ModelWeights
    taps : sequence of int
        Layers whose output residual stream every call returns in ``ForwardOutput.hidden``
        (for the EAGLE-3 draft head). Change with :meth:`set_taps`.
    moe_impl : {"kernel", "reference"}, optional
        How MoE layers run their experts (:mod:`moespec.models.moe`); default: the environment
        variable MOESPEC_MOE_IMPL, else "kernel". Also settable later as ``model.moe_impl``
        ("reference" also selects the reference backend).
    backend : {"native", "reference", "graphs"}, optional
        How calls run (:mod:`moespec.runtime.backend`): the native decoder step (default where it
        runs: CPU, float32 or bfloat16), the torch reference forward, or that forward replayed as
        CUDA graphs; default: the environment variable MOESPEC_BACKEND, else "graphs" on CUDA and
        "native" elsewhere. Settable later as ``model.backend_name``.
    """

    def __init__(self, config: ModelConfig, weights: ModelWeights, *, taps: Sequence[int] = (),
                 moe_impl: Optional[str] = None, backend: Optional[str] = None):
        self.config = config
        self.weights = weights
        self.dtype = weights.dtype
        self.device = weights.device  # where the weights, caches and every call's tensors live
        self.inv_freq = config.rope.inv_freq(config.head_dim).to(self.device)  # float32 [D/2]
        self.taps: tuple[int, ...] = ()
        self.set_taps(taps)
        self._moe_impl = "kernel"
        self._backend_choice = backend
        self.backend = None
        self.moe_impl = moe_impl or os.environ.get("MOESPEC_MOE_IMPL", "kernel")  # chooses the backend too
        # receives every call's natural routing when set (moespec.models.trace.RoutingObserver); None: off
        self.observer = None

    @property
    def moe_impl(self) -> str:
        return self._moe_impl

    @moe_impl.setter
    def moe_impl(self, impl: str) -> None:
        if impl not in MOE_IMPLS:
            raise ValueError(f"moe_impl: expected one of {MOE_IMPLS}, got {impl!r}")
        self._moe_impl = impl
        self.backend = make_backend(self, self._backend_choice)

    @property
    def backend_name(self) -> str:
        """The backend calls run on: "native" or "reference" (see :mod:`moespec.runtime.backend`)."""
        return self.backend.name

    @backend_name.setter
    def backend_name(self, name: str) -> None:
        if name not in BACKENDS:
            raise ValueError(f"backend: expected one of {BACKENDS}, got {name!r}")
        self._backend_choice = name
        self.backend = make_backend(self, name)

    # ---- public API -------------------------------------------------------------------------------

    def set_taps(self, layers: Sequence[int]) -> None:
        """Sets the layers whose output hidden states calls return (0-based, < num_layers)."""
        for i in layers:
            if not 0 <= int(i) < self.config.num_layers:
                raise ValueError(f"taps: layer {i} does not exist (the model has {self.config.num_layers} layers)")
        self.taps = tuple(int(i) for i in layers)

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        """A KV cache for ``batch`` requests of up to ``max_len`` tokens each (prompt, output and one
        verify tree), allocated once: k and v are [L, batch, Hkv, max_len, D] in the model dtype (MLA:
        the latent [L, batch, 1, max_len, kv_lora_rank] and the rope key [L, batch, 1, max_len, rope])."""
        if batch < 1 or max_len < 1:
            raise ValueError(f"new_cache: batch and max_len must be >= 1, got batch={batch}, max_len={max_len}")
        from moespec.runtime.attention import cache_shapes

        c = self.config
        (hk, dk), (hv, dv) = cache_shapes(c)  # the attention block's layout (MLA: latent and rope key)
        return KVCache(torch.zeros(c.num_layers, batch, hk, max_len, dk, dtype=self.dtype, device=self.device),
                       torch.zeros(c.num_layers, batch, hv, max_len, dv, dtype=self.dtype, device=self.device),
                       [0] * batch)

    @torch.inference_mode()
    def prefill(self, cache: KVCache, prompts: Sequence[Sequence[int]], *,
                logits: Literal["last", "all"] = "last") -> ForwardOutput:
        """Appends ``prompts[b]`` (token ids; may be empty) to request b and commits them.

        Returns logits [B, V] of each request's last new token (``logits="last"``; zeros for a request
        with no new token) or [B, T, V] of every new token (``"all"``).
        """
        if logits not in ("last", "all"):
            raise ValueError(f"prefill: logits must be 'last' or 'all', got {logits!r}")
        seqs = self._token_lists(cache, prompts, "prompts")
        out = self.backend.forward(cache, seqs, None, None, last_only=logits == "last")
        self._observe("prefill", cache, seqs, None, out)
        self._advance(cache, out.num_tokens)
        return out

    @torch.inference_mode()
    def decode(self, cache: KVCache, tokens: Sequence[Optional[int]] | torch.Tensor) -> ForwardOutput:
        """Appends one token per request (None skips a request) and commits it; logits [B, V]."""
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.reshape(-1).tolist()
        seqs = self._token_lists(cache, [[] if t is None else [t] for t in tokens], "tokens")
        out = self.backend.forward(cache, seqs, None, None, last_only=True)
        self._observe("decode", cache, seqs, None, out)
        self._advance(cache, out.num_tokens)
        return out

    @torch.inference_mode()
    def verify(self, cache: KVCache, tokens: Sequence[Sequence[int]], parents: Sequence[Sequence[int]], *,
               budget: Optional[ExpertBudget] = None) -> ForwardOutput:
        """Runs one draft tree per request through the model without committing it.

        ``tokens[b]`` [M_b + 1] are the tree's tokens, node 0 the root (the last accepted token, not
        yet in the cache), ``parents[b]`` [M_b + 1] their parents (-1 for the root, else an earlier
        node). A node sees the committed tokens and its ancestors; its position is lengths[b] +
        its depth. ``budget`` caps each MoE layer's unique experts over all trees of the batch.
        Returns logits [B, T, V] for every node. Call :meth:`commit` next.
        """
        seqs = self._token_lists(cache, tokens, "tokens")
        if len(parents) != cache.batch:
            raise ValueError(f"verify: parents has {len(parents)} trees, the cache holds {cache.batch} requests")
        parent_lists = [[int(p) for p in ps] for ps in parents]
        for b, (seq, ps) in enumerate(zip(seqs, parent_lists)):
            if len(ps) != len(seq):
                raise ValueError(f"verify: tree {b} has {len(seq)} tokens but {len(ps)} parents")
            if seq and ps[0] != -1:
                raise ValueError(f"verify: tree {b}: node 0 is the root, its parent must be -1, got {ps[0]}")
            for i, p in enumerate(ps[1:], start=1):
                if not 0 <= p < i:
                    raise ValueError(f"verify: tree {b}: node {i} has parent {p}; parents must be earlier nodes")
        out = self.backend.forward(cache, seqs, parent_lists, budget, last_only=False)
        self._observe("verify", cache, seqs, parent_lists, out)
        cache.pending = PendingTree(parent_lists)
        return out

    @torch.inference_mode()
    def verify_trees(self, cache: KVCache, trees: Sequence[Optional["DraftTree"]], *,
                     budget: Optional[ExpertBudget] = None, read_back: bool = True,
                     borrow: bool = False) -> ForwardOutput:
        """:meth:`verify` of one :class:`moespec.spec.tree.DraftTree` per request (None: no tokens for
        that request), from the trees' own tensors: their packed ancestor masks and depths go to the
        forward as they are (the contract guarantees the structure; token ids and the cache's room
        are checked here). Call :meth:`commit` next.

        ``read_back=False`` (trees on a GPU whose caller checks their tokens: eagle3's step, which
        raises its deferred round's recorded problems before it commits): the trees' tokens and
        parents are not copied to the host here (no synchronisation; commit reads the parents back
        unless the acceptance did, :func:`moespec.spec.tree.host_lists`), and their token ids are
        clamped into the vocabulary on the device instead of checked.

        ``borrow=True`` (a caller done with the logits and taps before its next forward call: eagle3's
        step): on the graphs backend they may be views of a CUDA graph's static buffers, valid until
        the next call of the same shape, instead of copies."""
        from moespec.runtime.state import tree_geometry
        from moespec.spec.tree import HostLists, host_lists

        if cache.pending is not None:
            raise ValueError("a verified tree is pending: call commit before the next forward call")
        if len(trees) != cache.batch:
            raise ValueError(f"verify_trees: got {len(trees)} trees, the cache holds {cache.batch} requests")
        V = self.config.vocab_size
        num = [t.num_nodes if t is not None else 0 for t in trees]
        if read_back:  # every tree's tokens and parents in one copy to the host (trees on a GPU: one synchronisation)
            for b, (tokens, _) in enumerate(host_lists(trees)[0]):
                if tokens and (min(tokens) < 0 or max(tokens) >= V):
                    raise ValueError(f"verify_trees: tree {b} has token ids outside the vocabulary [0, {V})")
        for b, n in enumerate(num):
            if cache.lengths[b] + n > cache.max_len:
                raise ValueError(f"cache overflow: request {b} holds {cache.lengths[b]} tokens, {n} more exceed "
                                 f"max_len={cache.max_len} (make the cache with a larger max_len)")
        if not any(num):
            raise ValueError("verify_trees: no tokens to run")
        seqs, parents = HostLists(trees, 0), HostLists(trees, 1)  # (read only where a backend needs the lists)
        geo = tree_geometry(trees, cache.lengths, vocab=None if read_back else V, weights=budget is not None)
        out = self.backend.forward(cache, seqs, parents, budget, last_only=False, geo=geo, borrow=borrow)
        self._observe("verify", cache, seqs, parents, out)
        cache.pending = PendingTree(parents)
        return out

    def commit(self, cache: KVCache, accepted: Sequence[Sequence[int]]) -> None:
        """Keeps the accepted root-to-node path of each request's last verified tree.

        ``accepted[b]`` lists node indices from the root (0) down one path; their KV entries move to
        the request's next slots and its length grows by len(accepted[b]); other nodes are forgotten.
        """
        if cache.pending is None:
            raise ValueError("commit: no verified tree is pending (call verify first)")
        if len(accepted) != cache.batch:
            raise ValueError(f"commit: accepted has {len(accepted)} paths, the cache holds {cache.batch} requests")
        paths = [[int(i) for i in path] for path in accepted]
        for b, (path, ps) in enumerate(zip(paths, cache.pending.parents)):  # check all before moving any
            if path and (path[0] != 0 or not ps):
                raise ValueError(f"commit: request {b}: a path starts at the root (node 0) of its tree, got {path[0]}")
            for prev, node in zip(path, path[1:]):
                if not 0 <= node < len(ps) or ps[node] != prev:
                    raise ValueError(f"commit: request {b}: node {node} is not a child of node {prev}")
        # every request's moves at once: entry j of request b's path goes from slot start_b + path[j] to
        # start_b + j (each source read before any write: a path's sources are at or after its targets)
        rows = [(b, cache.lengths[b] + node, cache.lengths[b] + j) for b, path in enumerate(paths)
                for j, node in enumerate(path)]
        if rows:
            b, src, dst = to_device(list(zip(*rows)), cache.k.device, torch.long)  # [3, N], one copy
            cache.k[:, b, :, dst] = cache.k[:, b, :, src]  # ([N, L, Hkv, D] each side)
            cache.v[:, b, :, dst] = cache.v[:, b, :, src]
        for b, path in enumerate(paths):
            cache.lengths[b] += len(path)
        cache.pending = None

    # ---- internals --------------------------------------------------------------------------------

    def _token_lists(self, cache: KVCache, seqs, what: str) -> list[list[int]]:
        if cache.pending is not None:
            raise ValueError("a verified tree is pending: call commit before the next forward call")
        if len(seqs) != cache.batch:
            raise ValueError(f"{what}: got {len(seqs)} requests, the cache holds {cache.batch}")
        out = [s.tolist() if isinstance(s, torch.Tensor) else [int(t) for t in s] for s in seqs]
        V = self.config.vocab_size
        for b, s in enumerate(out):
            bad = [t for t in s if not 0 <= t < V]
            if bad:
                raise ValueError(f"{what}: request {b} has token id {bad[0]} outside the vocabulary [0, {V})")
            if cache.lengths[b] + len(s) > cache.max_len:
                raise ValueError(
                    f"cache overflow: request {b} holds {cache.lengths[b]} tokens, {len(s)} more exceed "
                    f"max_len={cache.max_len} (make the cache with a larger max_len)"
                )
        if not any(out):
            raise ValueError(f"{what}: no tokens to run")
        return out

    def _observe(self, kind: str, cache: KVCache, seqs, parents, out: ForwardOutput) -> None:
        if self.observer is not None and out.routing is not None:
            self.observer.record(kind, list(cache.lengths), seqs, parents, out.routing[0].numpy(),
                                 out.routing[1].numpy())

    def _advance(self, cache: KVCache, num: list[int]) -> None:
        for b, n in enumerate(num):
            cache.lengths[b] += n
