"""The graph steps' forward in few launches: the reference forward's semantics on packed tokens,
with the attention half of each layer in moespec's decoder ops (:mod:`moespec.ops.decoder`).

Per layer: ``rms_norm`` (the previous residual add and this layer's input norm in one launch), the
q/k/v projection, ``attention_inputs`` (clip, q/k norm, rope, the cache writes: one launch),
``tree_attention`` (over each request's used slots only: the cache length is read on the device,
so a captured graph replays at any length), the o projection, ``rms_norm`` (residual add + post
norm), then the MoE (router projection, routing + budget, experts) or the dense MLP. On CUDA a layer
is ~12 launches instead of the ~37 small torch kernels of the reference forward (its norms as
mean-reductions, rope as five elementwise ops per tensor, the cache's index_put, the mask, SDPA
over all S_max slots), and the graph has no mask of S_max columns to build. On the CPU the ops run
their plain-torch versions (the reference's own ops), which is what tests/python/test_graphs.py
holds against the reference backend.

Used by :class:`moespec.runtime.graphs.StaticStep` where :func:`supports` says the model fits
(GQA, with or without sliding windows and sinks; float32 or bfloat16; head and hidden sizes within
the kernels' bounds; not MLA); ``MOESPEC_FUSED_STEP=0`` keeps the reference forward.

Dimensions: B requests, T tokens each, P = B T, H hidden, Hq/Hkv heads, D head dim, W mask words.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from moespec._loader import native
from moespec.models.moe import moe_forward
from moespec.ops import ExpertBudget
from moespec.ops.decoder import attention_inputs, enabled, rms_norm, tree_attention

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
    """One model's fused forward; the rope table (cos, sin of every slot of a cache, in the model
    dtype, built on the model's device with the reference's own ops) is made once per length."""

    def __init__(self, model: "TargetModel"):
        self.model = model
        self.cos = self.sin = torch.empty(0)

    def rope(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cos.shape[0] < length:
            positions = torch.arange(length, device=self.model.inv_freq.device)
            freqs = positions[:, None].float() * self.model.inv_freq  # [S, D/2], as the reference computes it
            emb = torch.cat((freqs, freqs), dim=-1)
            scaling = self.model.config.rope.attention_scaling  # (1 but for yarn)
            self.cos = (emb.cos() * scaling).to(self.model.dtype)
            self.sin = (emb.sin() * scaling).to(self.model.dtype)
        return self.cos, self.sin

    def __call__(self, cache: "KVCache", tokens: torch.Tensor, positions: torch.Tensor, start: torch.Tensor,
                 words: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor,
                 budget: ExpertBudget | None) -> "ForwardOutput":
        """The forward of B requests' T new tokens each: ``tokens``, ``positions`` long [B, T],
        ``start`` long [B] (each request's first new slot), ``words`` int32 [B, T, W] (its mask rows
        over the new tokens), ``rows``, ``slots`` long [P] (each token's request and slot)."""
        from moespec.runtime.backend import ForwardOutput, dense_mlp

        model = self.model
        c, w = model.config, model.weights
        B, T = tokens.shape
        Hq, Hkv, D = c.num_heads, c.num_kv_heads, c.head_dim
        table_cos, table_sin = self.rope(cache.max_len)
        flat = positions.reshape(-1)
        cos, sin = table_cos[flat], table_sin[flat]  # [P, D]
        eps = c.rms_norm_eps
        x, h = rms_norm(F.embedding(tokens.reshape(-1), w.embed), w.layers[0].input_norm, eps,
                        scale_fp32=c.norm_scale_fp32)  # [P, H] each
        tapped, stats = {}, []
        for i, layer in enumerate(w.layers):
            qkv = F.linear(h, layer.qkv, layer.qkv_bias)
            k_cache, v_cache = cache.k[i], cache.v[i]
            q = attention_inputs(qkv, layer.q_norm, layer.k_norm, cos, sin, k_cache, v_cache, rows, slots,
                                 num_heads=Hq, num_kv_heads=Hkv, qk_norm=c.qk_norm, eps=eps, clip=c.clip_qkv)
            o = tree_attention(q.view(B, T, Hq, D), k_cache, v_cache, start, words, D**-0.5, positions=positions,
                               window=c.window(i), sinks=layer.sinks)
            x, h = rms_norm(F.linear(o.reshape(B * T, Hq * D), layer.o, layer.o_bias), layer.post_norm, eps,
                            residual=x, scale_fp32=c.norm_scale_fp32)
            if c.is_moe_layer(i):
                layer_budget = budget.for_layer(len(stats)) if budget is not None else None
                mlp, layer_stats = moe_forward(h, layer, c.moe, layer_budget, model.moe_impl)
                stats.append(layer_stats)
            else:
                mlp = dense_mlp(h, layer)
            after = w.layers[i + 1].input_norm if i + 1 < len(w.layers) else w.final_norm
            x, h = rms_norm(mlp, after, eps, residual=x, scale_fp32=c.norm_scale_fp32)
            if i in model.taps:
                tapped[i] = x.view(B, T, -1)
        logits = F.linear(h, w.lm_head).view(B, T, -1)
        expert_stats = torch.stack(stats) if stats else torch.zeros(0, 4, dtype=torch.int32, device=x.device)
        return ForwardOutput(logits=logits, hidden=tuple(tapped[t] for t in model.taps), expert_stats=expert_stats,
                             num_tokens=[T] * B)
