"""The graph steps' forward in few launches: the reference forward's semantics on packed tokens,
with the attention half of each layer in moespec's decoder ops (:mod:`moespec.ops.decoder`).

Per layer: ``rms_norm`` (the previous residual add and this layer's input norm in one launch), the
q/k/v projection, ``attention_inputs`` (clip, q/k norm, rope, the cache writes: one launch),
``tree_attention`` (over each request's used slots only: the cache length is read on the device,
so a captured graph replays at any length), the o projection, ``rms_norm`` (residual add + post
norm), then the MoE (router projection, routing + budget, experts) or the dense MLP. On CUDA a layer
is ~11 launches, every one a moespec kernel (the projections: :func:`moespec.ops.linear`'s CUDA
kernel), instead of the ~37 small torch kernels of the reference forward (its norms as
mean-reductions, rope as five elementwise ops per tensor, the cache's index_put, the mask, SDPA
over all S_max slots), and the graph has no mask of S_max columns to build. On the CPU the ops run
their plain-torch versions (the reference's own ops), which is what tests/python/test_graphs.py
holds against the reference backend.

Used where :func:`supports` says the model fits (GQA, with or without sliding windows and sinks;
float32 or bfloat16; head and hidden sizes within the kernels' bounds; not MLA) by the graphs
backend (:mod:`moespec.runtime.graphs`): its captured steps (B requests of T tokens), and, eagerly
(:func:`eager_forward`), the calls no bucket takes (trees of unequal sizes, prompts of up to 256
tokens): the tokens stay packed, with no padding. ``MOESPEC_FUSED_STEP=0`` keeps the reference
forward.

Dimensions: B requests, P tokens packed request after request, H hidden, Hq/Hkv heads, D head dim,
W mask words.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F

from moespec._loader import native
from moespec._tensor import to_device
from moespec.models.moe import moe_forward
from moespec.ops import ExpertBudget
from moespec.ops.linear import linear
from moespec.ops.decoder import attention_groups, attention_inputs, enabled, rms_norm, tree_attention
from moespec.runtime.state import StepGeometry, step_geometry

if TYPE_CHECKING:
    from moespec.models.cache import KVCache
    from moespec.models.runtime import TargetModel
    from moespec.runtime.backend import ForwardOutput


def supports(model: "TargetModel") -> bool:
    """Whether the fused forward runs ``model`` (else the graph steps run the reference forward);
    False when MOESPEC_FUSED_STEP=0."""
    if not enabled():
        return False
    c, n = model.config, native()
    D = c.head_dim
    return (model.dtype in (torch.float32, torch.bfloat16) and c.mla is None and D % 8 == 0
            and D <= (n.kMaxHeadDim if model.dtype == torch.bfloat16 else n.kMaxHeadDim // 2)
            and (c.num_heads + c.num_kv_heads) * D <= n.kMaxAttentionInputs and c.hidden_size <= n.kMaxNormWidth)


class FusedForward:
    """One model's fused forward; the rope table (cos and sin of every slot of a cache, [2, S, D] in the
    model dtype, built on the model's device with the reference's own ops) is made once per length. A longer
    cache makes a longer table; the shorter ones stay alive, since graphs captured over them read
    their memory at every replay (a freed table's memory would be reused under them)."""

    def __init__(self, model: "TargetModel"):
        self.model = model
        self.table = torch.empty(2, 0, 0)
        self.retired: list[torch.Tensor] = []  # tables a captured graph may still read

    def rope(self, length: int) -> torch.Tensor:
        """The table [2, S >= length, D]: cos, then sin."""
        if self.table.shape[1] < length:
            self.retired.append(self.table)
            positions = torch.arange(length, device=self.model.inv_freq.device)
            freqs = positions[:, None].float() * self.model.inv_freq  # [S, D/2], as the reference computes it
            emb = torch.cat((freqs, freqs), dim=-1)
            scaling = self.model.config.rope.attention_scaling  # (1 but for yarn)
            self.table = torch.stack([(emb.cos() * scaling).to(self.model.dtype),
                                      (emb.sin() * scaling).to(self.model.dtype)])
        return self.table

    def __call__(self, cache: "KVCache", batch: "PackedStep", budget: Optional[ExpertBudget]) -> "ForwardOutput":
        """The forward of a call's packed tokens (``batch``); logits [P, V] and taps [P, H] per token,
        ``num_tokens`` [P] (the callers shape them)."""
        from moespec.runtime.backend import ForwardOutput, dense_mlp

        model = self.model
        c, w = model.config, model.weights
        P = batch.tokens.shape[0]
        Hq, Hkv, D = c.num_heads, c.num_kv_heads, c.head_dim
        cos, sin = self.rope(cache.max_len).index_select(1, batch.positions)  # [P, D] each (one gather)
        eps = c.rms_norm_eps
        x, h = rms_norm(F.embedding(batch.tokens, w.embed), w.layers[0].input_norm, eps,
                        scale_fp32=c.norm_scale_fp32)  # [P, H] each
        tapped, stats = {}, []
        for i, layer in enumerate(w.layers):
            qkv = linear(h, layer.qkv, layer.qkv_bias, cpu_kernel=False)
            k_cache, v_cache = cache.k[i], cache.v[i]
            q = attention_inputs(qkv, layer.q_norm, layer.k_norm, cos, sin, k_cache, v_cache, batch.rows, batch.slots,
                                 num_heads=Hq, num_kv_heads=Hkv, qk_norm=c.qk_norm, eps=eps, clip=c.clip_qkv)
            o = tree_attention(q, k_cache, v_cache, batch.start, batch.offsets, batch.groups, batch.words, D**-0.5,
                               positions=batch.positions, window=c.window(i), sinks=layer.sinks)
            attended = linear(o.view(P, Hq * D), layer.o, layer.o_bias, cpu_kernel=False)
            x, h = rms_norm(attended, layer.post_norm, eps, residual=x, scale_fp32=c.norm_scale_fp32)
            if c.is_moe_layer(i):
                layer_budget = budget.for_layer(len(stats)) if budget is not None else None
                mlp, layer_stats = moe_forward(h, layer, c.moe, layer_budget, model.moe_impl,
                                               token_weights=batch.weights)
                stats.append(layer_stats)
            else:
                mlp = dense_mlp(h, layer)
            after = w.layers[i + 1].input_norm if i + 1 < len(w.layers) else w.final_norm
            x, h = rms_norm(mlp, after, eps, residual=x, scale_fp32=c.norm_scale_fp32)
            if i in model.taps:
                tapped[i] = x
        expert_stats = torch.stack(stats) if stats else torch.zeros(0, 4, dtype=torch.int32, device=x.device)
        logits = linear(h, w.lm_head, cpu_kernel=False)
        return ForwardOutput(logits=logits, hidden=tuple(tapped[t] for t in model.taps),
                             expert_stats=expert_stats, num_tokens=[P])


@dataclass
class PackedStep:
    """The inputs of one fused forward: P tokens packed request after request (B requests)."""

    tokens: torch.Tensor  # long [P]
    positions: torch.Tensor  # long [P] rope positions
    start: torch.Tensor  # long [B]: each request's first new slot (its committed tokens)
    offsets: torch.Tensor  # long [B + 1]: request b's tokens are the rows [offsets[b], offsets[b + 1])
    groups: torch.Tensor  # int32 [G, 3]: tree_attention's blocks (moespec.ops.decoder.attention_groups)
    words: torch.Tensor  # int32 [P, W]: each token's mask row over its request's new tokens
    rows: torch.Tensor  # long [P]: each token's request
    slots: torch.Tensor  # long [P]: its cache slot
    weights: Optional[torch.Tensor] = None  # float32 [P]: the tokens' weights in a budget's ranking (None: all 1)


def fits_eager(model: "TargetModel", num: list[int]) -> bool:
    """Whether :func:`eager_forward` takes a call of ``num[b]`` new tokens a request: no routing
    observer, and at most ``kMaxTreeTokens`` new tokens a request (a mask row's bits)."""
    return model.observer is None and 0 < max(num) <= native().kMaxTreeTokens


def eager_forward(fused: FusedForward, cache: "KVCache", seqs: list[list[int]], parents: Optional[list[list[int]]],
                  budget: Optional[ExpertBudget], last_only: bool, geo: Optional[StepGeometry] = None) -> "ForwardOutput":
    """A call that fits no graph bucket (unequal trees, short prompts), eagerly through the fused
    forward on its packed tokens (no padding), shaped as the backends return it."""
    from moespec.runtime.backend import ForwardOutput, _pad

    model = fused.model
    geo = geo or step_geometry(seqs, cache.lengths, parents)
    num = geo.num
    B, d = len(seqs), model.device
    rows = torch.repeat_interleave(torch.arange(B), torch.tensor(num))  # [P]
    cols = torch.arange(rows.shape[0]) - torch.tensor(geo.offsets[:-1])[rows]
    start = torch.tensor(cache.lengths)
    batch = PackedStep(tokens=to_device(geo.tokens.long(), d), positions=to_device(geo.positions.long(), d),
                       start=to_device(start, d), offsets=to_device(torch.tensor(geo.offsets), d),
                       groups=to_device(attention_groups(geo.offsets), d), words=to_device(geo.mask, d),
                       rows=to_device(rows, d), slots=to_device(start[rows] + cols, d),
                       weights=None if geo.weights is None else to_device(geo.weights, d))
    out = fused(cache, batch, budget)
    if last_only:  # each request's last token (zeros for a request without one)
        last = to_device([geo.offsets[b + 1] - 1 for b in range(B) if num[b]], d)
        logits = out.logits.new_zeros(B, out.logits.shape[-1])
        logits[to_device([b for b in range(B) if num[b]], d)] = out.logits[last]
    else:
        logits = _pad(out.logits, geo.offsets, num)
    return ForwardOutput(logits=logits, hidden=tuple(_pad(t, geo.offsets, num) for t in out.hidden),
                         expert_stats=out.expert_stats, num_tokens=num)
