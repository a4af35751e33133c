"""The target model's forward pass: prefill, decode and tree verify over a preallocated KV cache.

transformers' ``generate`` cannot verify a draft tree, keep only accepted tokens in its cache or
budget experts, so moespec owns its forward pass; transformers is the checkpoint format and the
numerical reference (tests/python/test_models_*.py).

One forward serves all three entry points. Each request b of the cache's batch gets ``n_b`` new
tokens at slots ``lengths[b] + j``; a new token sees the request's committed tokens plus, among the
new ones, those its relation allows: earlier tokens (prefill, decode) or its tree ancestors and
itself (verify). Positions are ``lengths[b] + j`` for sequences and ``lengths[b] + depth`` for trees.
Batches are padded: requests of different lengths run together, padded slots are masked out of
attention, never written to the cache and never routed to experts.

Dimensions: B requests, T new tokens (padded), S attended slots, L layers, H hidden, Hq/Hkv query
and key/value heads, D head dim, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, Sequence

import os

import torch
import torch.nn.functional as F

from moespec.models.cache import KVCache, PendingTree
from moespec.models.config import ModelConfig
from moespec.models.moe import MOE_IMPLS, moe_forward
from moespec.models.weights import LayerWeights, ModelWeights
from moespec.ops import ExpertBudget, RoutingStats


@dataclass
class ForwardOutput:
    """What one call of prefill / decode / verify returns."""

    logits: torch.Tensor  # decode and prefill(logits="last"): [B, V]; prefill("all") and verify: [B, T, V]
    hidden: tuple[torch.Tensor, ...]  # per tap layer: the residual stream after it, [B, T, H]
    expert_stats: torch.Tensor  # int32 [MoE layers, 4]: natural unique, kept, re-routed, dropped
    num_tokens: list[int]  # [B] new tokens per request (T = max)

    def expert_stats_by_layer(self) -> list[RoutingStats]:
        return [RoutingStats(*row) for row in self.expert_stats.tolist()]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: normalise in fp32, cast back, then scale."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@dataclass
class _Batch:
    """The padded inputs of one forward call."""

    tokens: torch.Tensor  # long [B, T]
    num: list[int]  # [B]
    starts: list[int]  # [B] committed tokens before this call
    positions: torch.Tensor  # long [B, T]
    visible: torch.Tensor  # bool [B, T, S]
    valid: torch.Tensor  # bool [B, T]
    rows: torch.Tensor  # long [P]: request of each valid token
    cols: torch.Tensor  # long [P]: its index among the request's new tokens
    slots: torch.Tensor  # long [P]: its cache slot


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
        variable MOESPEC_MOE_IMPL, else "kernel". Also settable later as ``model.moe_impl``.
    """

    def __init__(self, config: ModelConfig, weights: ModelWeights, *, taps: Sequence[int] = (),
                 moe_impl: Optional[str] = None):
        self.config = config
        self.weights = weights
        self.dtype = weights.dtype
        self.inv_freq = config.rope.inv_freq(config.head_dim)  # float32 [D/2]
        self.taps: tuple[int, ...] = ()
        self.set_taps(taps)
        self._moe_impl = "kernel"
        self.moe_impl = moe_impl or os.environ.get("MOESPEC_MOE_IMPL", "kernel")

    @property
    def moe_impl(self) -> str:
        return self._moe_impl

    @moe_impl.setter
    def moe_impl(self, impl: str) -> None:
        if impl not in MOE_IMPLS:
            raise ValueError(f"moe_impl: expected one of {MOE_IMPLS}, got {impl!r}")
        self._moe_impl = impl

    # ---- public API -------------------------------------------------------------------------------

    def set_taps(self, layers: Sequence[int]) -> None:
        """Sets the layers whose output hidden states calls return (0-based, < num_layers)."""
        for i in layers:
            if not 0 <= int(i) < self.config.num_layers:
                raise ValueError(f"taps: layer {i} does not exist (the model has {self.config.num_layers} layers)")
        self.taps = tuple(int(i) for i in layers)

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        """A KV cache for ``batch`` requests of up to ``max_len`` tokens each (prompt, output and one
        verify tree), allocated once: k and v are [L, batch, Hkv, max_len, D] in the model dtype."""
        if batch < 1 or max_len < 1:
            raise ValueError(f"new_cache: batch and max_len must be >= 1, got batch={batch}, max_len={max_len}")
        c = self.config
        shape = (c.num_layers, batch, c.num_kv_heads, max_len, c.head_dim)
        return KVCache(torch.zeros(shape, dtype=self.dtype), torch.zeros(shape, dtype=self.dtype), [0] * batch)

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
        batch = self._batch(cache, seqs, parents=None)
        out = self._forward(cache, batch, budget=None, last_only=logits == "last")
        self._advance(cache, batch.num)
        return out

    @torch.inference_mode()
    def decode(self, cache: KVCache, tokens: Sequence[Optional[int]] | torch.Tensor) -> ForwardOutput:
        """Appends one token per request (None skips a request) and commits it; logits [B, V]."""
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.reshape(-1).tolist()
        seqs = self._token_lists(cache, [[] if t is None else [t] for t in tokens], "tokens")
        batch = self._batch(cache, seqs, parents=None)
        out = self._forward(cache, batch, budget=None, last_only=True)
        self._advance(cache, batch.num)
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
        batch = self._batch(cache, seqs, parents=parent_lists)
        out = self._forward(cache, batch, budget=budget, last_only=False)
        cache.pending = PendingTree(parent_lists)
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
        for b, path in enumerate(paths):
            if path:
                start = cache.lengths[b]
                src = torch.tensor(path) + start
                dst = torch.arange(len(path)) + start
                cache.k[:, b, :, dst] = cache.k[:, b, :, src]
                cache.v[:, b, :, dst] = cache.v[:, b, :, src]
                cache.lengths[b] = start + len(path)
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

    def _batch(self, cache: KVCache, seqs: list[list[int]], parents: Optional[list[list[int]]]) -> _Batch:
        B, T = len(seqs), max(len(s) for s in seqs)
        num = [len(s) for s in seqs]
        starts = list(cache.lengths)
        tokens = torch.tensor([s + [0] * (T - len(s)) for s in seqs])  # [B, T]
        start, count = torch.tensor(starts), torch.tensor(num)
        index = torch.arange(T)
        valid = index[None, :] < count[:, None]  # [B, T]
        S = max(s + n for s, n in zip(starts, num))
        slot = torch.arange(S)
        prefix = slot[None, :] < start[:, None]  # [B, S]
        rel = slot[None, :] - start[:, None]  # [B, S]: index among the new tokens
        in_new = (rel >= 0) & (rel < count[:, None])  # [B, S]
        if parents is None:  # sequences: causal among the new tokens
            depth = index.expand(B, T)
            new_vis = in_new[:, None, :] & (rel[:, None, :] <= index[None, :, None])  # [B, T, S]
        else:  # trees: ancestor-or-self rows, each built from its parent's row
            depth = torch.zeros(B, T, dtype=torch.long)
            relation = torch.zeros(B, T, T, dtype=torch.bool)  # [b, i, j]: node i sees node j
            for b, ps in enumerate(parents):
                for i, p in enumerate(ps):
                    if i:
                        relation[b, i] = relation[b, p]
                        depth[b, i] = depth[b, p] + 1
                    relation[b, i, i] = True
            new_vis = torch.gather(relation, 2, rel.clamp(0, T - 1)[:, None, :].expand(B, T, S)) & in_new[:, None, :]
        visible = prefix[:, None, :] | new_vis  # [B, T, S]
        visible[:, :, 0] |= ~valid  # padded queries look at one slot (their output is discarded)
        rows, cols = valid.nonzero(as_tuple=True)
        return _Batch(tokens=tokens, num=num, starts=starts, positions=start[:, None] + depth, visible=visible,
                      valid=valid, rows=rows, cols=cols, slots=start[rows] + cols)

    def _advance(self, cache: KVCache, num: list[int]) -> None:
        for b, n in enumerate(num):
            cache.lengths[b] += n

    def _forward(self, cache: KVCache, batch: _Batch, budget: Optional[ExpertBudget], last_only: bool) -> ForwardOutput:
        c, w = self.config, self.weights
        B, T = batch.tokens.shape
        S = batch.visible.shape[-1]
        freqs = batch.positions[..., None].float() * self.inv_freq  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(self.dtype)[:, None], emb.sin().to(self.dtype)[:, None]  # [B, 1, T, D]
        mask = batch.visible[:, None]  # [B, 1, T, S]
        x = F.embedding(batch.tokens, w.embed)  # [B, T, H]
        tapped, stats = {}, []
        for i, layer in enumerate(w.layers):
            x = x + self._attention(i, layer, rms_norm(x, layer.input_norm, c.rms_norm_eps), cos, sin, mask, cache,
                                    batch, S)
            h = rms_norm(x, layer.post_norm, c.rms_norm_eps)
            if c.is_moe_layer(i):
                y, layer_stats = moe_forward(h[batch.rows, batch.cols], layer, c.moe, budget,  # valid tokens only
                                             self.moe_impl)
                mlp = torch.zeros_like(h)
                mlp[batch.rows, batch.cols] = y
                stats.append(layer_stats)
            else:
                gate, up = F.linear(h, layer.gate_up).chunk(2, dim=-1)
                mlp = F.linear(F.silu(gate) * up, layer.down)
            x = x + mlp
            if i in self.taps:
                tapped[i] = x
        if last_only:
            last = torch.tensor([max(n - 1, 0) for n in batch.num])
            x = x[torch.arange(B), last]  # [B, H]
        logits = F.linear(rms_norm(x, w.final_norm, c.rms_norm_eps), w.lm_head)
        if last_only:
            logits = logits * batch.valid.any(dim=1, keepdim=True)  # zeros for requests without new tokens
        expert_stats = torch.stack(stats) if stats else torch.zeros(0, 4, dtype=torch.int32)
        return ForwardOutput(logits=logits, hidden=tuple(tapped[t] for t in self.taps), expert_stats=expert_stats,
                             num_tokens=list(batch.num))

    def _attention(self, index: int, layer: LayerWeights, h: torch.Tensor, cos, sin, mask, cache: KVCache,
                   batch: _Batch, S: int) -> torch.Tensor:
        c = self.config
        B, T, _ = h.shape
        D, Hq, Hkv = c.head_dim, c.num_heads, c.num_kv_heads
        q, k, v = F.linear(h, layer.qkv, layer.qkv_bias).split([Hq * D, Hkv * D, Hkv * D], dim=-1)
        if c.qk_norm == "full":
            q, k = rms_norm(q, layer.q_norm, c.rms_norm_eps), rms_norm(k, layer.k_norm, c.rms_norm_eps)
        if c.clip_qkv is not None:
            q, k, v = (t.clamp(-c.clip_qkv, c.clip_qkv) for t in (q, k, v))
        q, k, v = q.view(B, T, Hq, D), k.view(B, T, Hkv, D), v.view(B, T, Hkv, D)
        if c.qk_norm == "per_head":
            q, k = rms_norm(q, layer.q_norm, c.rms_norm_eps), rms_norm(k, layer.k_norm, c.rms_norm_eps)
        q = rotate(q.transpose(1, 2), cos, sin)  # [B, Hq, T, D]
        k = rotate(k.transpose(1, 2), cos, sin)  # [B, Hkv, T, D]
        k_cache, v_cache = cache.k[index], cache.v[index]  # [B, Hkv, S_max, D]
        k_cache[batch.rows, :, batch.slots] = k[batch.rows, :, batch.cols]
        v_cache[batch.rows, :, batch.slots] = v.transpose(1, 2)[batch.rows, :, batch.cols]
        o = F.scaled_dot_product_attention(q, k_cache[:, :, :S], v_cache[:, :, :S], attn_mask=mask,
                                           scale=D**-0.5, enable_gqa=Hq != Hkv)  # [B, Hq, T, D]
        return F.linear(o.transpose(1, 2).reshape(B, T, Hq * D), layer.o, layer.o_bias)
