"""The roofline cost of one decode, verify or draft step, and the speed-up of speculation.

A step of T tokens from B requests with S cached tokens each, whose MoE layers touch U_l unique
experts, costs (``step_cost``)

    overhead + T L c_token + t(dense weights, M = T) + sum_l t(U_l experts, M = T K / U_l) + t_attention(B, S, T)

where t(bytes, M) is the hardware profile's time to read a weight matrix and apply it to M tokens
(:meth:`moespec.cost.hardware.Hardware.matrix_seconds`: a roofline from a spec sheet, or this
machine's measured kernels), c_token the profile's per-token, per-layer cost besides weights
(measured on CPUs, 0 on spec sheets), dense weights are everything a token reads whatever it routes to
(attention, norms, routers, shared experts, dense layers, lm_head: ``MoeShape.dense_params``), and
attention reads each request's KV cache once (``MoeShape.kv_elements``) and computes
``MoeShape.attention_flops`` per token. A speculative step is a draft of ``depth`` head forwards
plus one verify; its speed-up over plain decoding is AL x t(decode) / (t(draft) + t(verify)).

Dimensions: T tokens of a step, B requests, S context, K top-k, U unique experts of a layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

import numpy as np

from moespec.cost.hardware import Hardware
from moespec.cost.shapes import MoeShape

DRAFT_VOCAB = 32000  # EAGLE-3 heads' usual draft vocabulary (SpecForge's default)


@dataclass(frozen=True)
class StepCost:
    seconds: float
    overhead_s: float
    dense_s: float
    experts_s: float
    attention_s: float
    bytes_dense: float
    bytes_experts: float
    bytes_kv: float
    flops: float

    @property
    def bytes(self) -> float:
        return self.bytes_dense + self.bytes_experts + self.bytes_kv


def shape_from_config(config, name: str = "engine") -> MoeShape:
    """The :class:`MoeShape` of a runtime :class:`moespec.models.config.ModelConfig`."""
    moe = config.moe
    if moe is None:
        raise ValueError("the cost model needs an MoE model (this config has no MoE layer)")
    dense_layers = config.num_layers - len(moe.layers)
    qk = {"none": "", "per_head": "head", "full": "full"}[config.qk_norm]
    return MoeShape(name=name.lower(), hf_id="(this engine)", hidden=config.hidden_size, layers=config.num_layers,
                    dense_layers=dense_layers, dense_intermediate=config.intermediate_size if dense_layers else 0,
                    num_experts=moe.num_experts, top_k=moe.top_k, expert_intermediate=moe.intermediate_size,
                    shared_intermediate=moe.shared_intermediate_size, vocab=config.vocab_size,
                    tied_embeddings=config.tie_word_embeddings, num_heads=config.num_heads,
                    num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, qkv_bias=config.attention_bias,
                    qk_norm=qk, shared_expert_gate=moe.shared_intermediate_size > 0)


def step_cost(shape: MoeShape, hw: Hardware, *, tokens: int, requests: int, context: int,
              unique: Union[float, Sequence[float]], bytes_per_weight: float = 2.0,
              kv_bytes: float = 2.0) -> StepCost:
    """Cost of one forward step (see the module docstring). ``unique``: unique experts of each MoE
    layer (a sequence of ``shape.moe_layers``) or one value for every layer."""
    if tokens < 1 or requests < 1 or requests > tokens or context < 0:
        raise ValueError(f"step_cost: need tokens >= requests >= 1 and context >= 0, got tokens={tokens}, "
                         f"requests={requests}, context={context}")
    U = np.broadcast_to(np.asarray(unique, dtype=np.float64), (shape.moe_layers,))
    if (U <= 0).any() or (U > shape.num_experts).any():
        raise ValueError(f"step_cost: unique experts must be in (0, {shape.num_experts}]")
    dense_bytes = shape.dense_params * bytes_per_weight
    dense_s = hw.matrix_seconds(dense_bytes, tokens, bytes_per_weight)
    expert_bytes = shape.expert_params * bytes_per_weight
    experts_s = float(sum(hw.expert_seconds(u * expert_bytes, tokens * shape.top_k / u, bytes_per_weight) for u in U))
    kv = requests * shape.kv_elements(context + tokens // requests) * kv_bytes  # read S, write T
    attn_flops = tokens * shape.attention_flops(context)
    attention_s = max(kv / ((hw.attention_gbs or hw.bandwidth_gbs) * 1e9), attn_flops / (hw.peak_tflops * 1e12))
    flops = 2.0 * tokens * (shape.dense_params + shape.top_k * shape.expert_params * shape.moe_layers) + attn_flops
    overhead = hw.step_overhead_us * 1e-6 + hw.token_layer_us * 1e-6 * tokens * shape.layers
    return StepCost(overhead + dense_s + experts_s + attention_s, overhead, dense_s, experts_s, attention_s,
                    dense_bytes, float(U.sum() * expert_bytes), kv, flops)


def draft_params(shape: MoeShape) -> int:
    """An EAGLE-3 head for this target: fc (3H -> H), one decoder layer whose q/k/v read
    cat(embedding, hidden) [2H], a SwiGLU of 3H, and a draft lm_head of DRAFT_VOCAB rows (an
    approximation: heads differ in their MLP width and vocabulary)."""
    H = shape.hidden
    heads, kv_heads = shape.num_heads, shape.num_kv_heads
    D = shape.head_dim if not shape.kv_lora_rank else shape.qk_nope_head_dim + shape.qk_rope_head_dim
    if shape.kv_lora_rank:
        kv_heads = max(1, heads // 8)  # heads for MLA targets are GQA layers
    attention = 2 * H * (heads + 2 * kv_heads) * D + heads * D * H
    return 3 * H * H + attention + 3 * H * 3 * H + DRAFT_VOCAB * H


def draft_seconds(shape: MoeShape, hw: Hardware, *, depth: int, top_k: int, requests: int,
                  bytes_per_weight: float = 2.0) -> float:
    """The EAGLE-2 draft of a step: ``depth`` head forwards, the first on the root, the others on
    ``top_k`` frontier nodes per request; each reads the head once and costs one step overhead."""
    nbytes = draft_params(shape) * bytes_per_weight
    total = 0.0
    for level in range(depth):
        tokens = requests * (1 if level == 0 else top_k)
        total += hw.step_overhead_us * 1e-6 + hw.matrix_seconds(nbytes, tokens, bytes_per_weight)
    return total
