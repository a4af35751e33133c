"""The target's verify network as ONNX, its MoE blocks as moespec plugin nodes (for TensorRT).

One network serves prefill, decode and tree verify, as the runtime's one forward does: ``T`` new
tokens per request attend to ``P`` cached slots and, among themselves, to what ``attention_mask``
allows (causal for a sequence, ancestor-or-self for a draft tree); positions come in as they are
(``P + depth`` for a tree). Inputs and outputs (B requests, T new tokens, P past slots, S = P + T):

    input_ids        int64 [B, T]
    position_ids     int64 [B, T]
    attention_mask   bool  [B, T, S]       True: the token attends to that slot (the past first)
    past_key_{l}     dtype [B, Hkv, P, D]  per layer l (and past_value_{l})
    -> logits        float32 [B, T, V]
       present_key_{l}, present_value_{l}  [B, Hkv, S, D]  the past with the new tokens appended
       hidden_{l}    dtype [B, T, H]       the residual stream after layer l, for each tap (EAGLE-3)
       expert_stats  int32 [L_moe, 4]      per MoE layer: natural unique, kept, re-routed, dropped

Each MoE layer is router MatMul -> ``MoespecRouteExperts`` -> ``MoespecBudgetedMoe`` (routing +
budget + experts, :mod:`moespec.engine.onnx_plugins`), plus the shared expert (Qwen2-MoE) in plain
ops; the budget, when given, is a field of every route node (it caps each layer's unique experts
over all B x T tokens, DESIGN.md "Expert budget"; budgets are for verify passes: prefill through a
network exported without one). All B x T tokens are routed, so a batch of unequal trees is padded
with tokens that count towards the budget; export B = 1 trees, or equal sizes, for the runtime's
exact budget. Arithmetic follows :class:`moespec.runtime.backend.ReferenceBackend`: matmuls in the
weights' dtype, norms and softmax in float32, rope tables from the config's own inverse
frequencies. Initializers carry the engine's tensor names.

Dimensions: L layers, H hidden, Hq/Hkv query and key/value heads (G = Hq / Hkv), D head dim, E
experts, V vocabulary.
"""

from __future__ import annotations

from typing import Optional, Sequence

import onnx
import torch
from onnx import TensorProto

from moespec.engine.onnx_graph import ONNX_DTYPES, Graph
from moespec.engine.onnx_plugins import MOE, ROUTE, moe_fields, plugin_node, route_fields
from moespec.models.config import ModelConfig
from moespec.models.weights import LayerWeights, ModelWeights
from moespec.ops import ExpertBudget

F32 = TensorProto.FLOAT


class _Exporter:
    def __init__(self, config: ModelConfig, weights: ModelWeights, budget: Optional[ExpertBudget]):
        self.c, self.w, self.budget = config, weights, budget
        self.dt = ONNX_DTYPES[weights.dtype]
        self.g = Graph("moespec_verify")

    # ---- small blocks -------------------------------------------------------------------------------

    def linear(self, x: str, name: str, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> str:
        """x @ weight^T (+ bias); ``weight`` [out, in] as the engine stores it (a Transpose TensorRT and
        onnxruntime fold at build time)."""
        g = self.g
        y = g.op("MatMul", x, g.op("Transpose", g.weight(name, weight), perm=[1, 0]))
        return g.op("Add", y, g.weight(name + "_bias", bias)) if bias is not None else y

    def rms_norm(self, x: str, name: str, weight: torch.Tensor) -> str:
        """transformers' RMSNorm: normalise in float32, cast back, scale."""
        g = self.g
        xf = g.op("Cast", x, to=F32)
        ms = g.op("ReduceMean", g.op("Mul", xf, xf), g.const([-1]), keepdims=1)
        inv = g.op("Reciprocal", g.op("Sqrt", g.op("Add", ms, g.const(self.c.rms_norm_eps, F32))))
        return g.op("Mul", g.weight(name, weight), g.op("Cast", g.op("Mul", xf, inv), to=self.dt))

    def rotate(self, x: str, cos: str, sin: str) -> str:
        g, half = self.g, self.c.head_dim // 2
        x1, x2 = g.op("Split", x, g.const([half, half]), axis=-1, outputs=2)
        turned = g.op("Concat", g.op("Neg", x2), x1, axis=-1)
        return g.op("Add", g.op("Mul", x, cos), g.op("Mul", turned, sin))

    def swiglu(self, x: str, name: str, gate_up: torch.Tensor, down: torch.Tensor) -> str:
        g = self.g
        half = gate_up.shape[0] // 2
        gate, up = g.op("Split", self.linear(x, name + "gate_up", gate_up), g.const([half, half]), axis=-1, outputs=2)
        return self.linear(g.op("Mul", g.op("Mul", gate, g.op("Sigmoid", gate)), up), name + "down", down)

    # ---- layers -------------------------------------------------------------------------------------

    def attention(self, i: int, layer: LayerWeights, h: str, cos: str, sin: str, mask: str) -> str:
        g, c = self.g, self.c
        D, Hq, Hkv = c.head_dim, c.num_heads, c.num_kv_heads
        p = f"layers.{i}."
        q, k, v = g.op("Split", self.linear(h, p + "qkv", layer.qkv, layer.qkv_bias),
                       g.const([Hq * D, Hkv * D, Hkv * D]), axis=-1, outputs=3)
        if c.qk_norm == "full":
            q, k = self.rms_norm(q, p + "q_norm", layer.q_norm), self.rms_norm(k, p + "k_norm", layer.k_norm)
        if c.clip_qkv is not None:
            lo, hi = g.const(-c.clip_qkv, self.dt), g.const(c.clip_qkv, self.dt)
            q, k, v = (g.op("Clip", t, lo, hi) for t in (q, k, v))
        q, k, v = (g.op("Reshape", t, g.const([0, 0, n, D])) for t, n in ((q, Hq), (k, Hkv), (v, Hkv)))
        if c.qk_norm == "per_head":
            q, k = self.rms_norm(q, p + "q_norm", layer.q_norm), self.rms_norm(k, p + "k_norm", layer.k_norm)
        q = self.rotate(g.op("Transpose", q, perm=[0, 2, 1, 3]), cos, sin)  # [B, Hq, T, D]
        k = self.rotate(g.op("Transpose", k, perm=[0, 2, 1, 3]), cos, sin)  # [B, Hkv, T, D]
        v = g.op("Transpose", v, perm=[0, 2, 1, 3])
        shape = ["batch", Hkv, "past", D]
        past_k = g.input(f"past_key_{i}", self.dt, shape)
        past_v = g.input(f"past_value_{i}", self.dt, shape)
        k_all = g.output(g.op("Concat", past_k, k, axis=2), self.dt, ["batch", Hkv, "total", D], f"present_key_{i}")
        v_all = g.output(g.op("Concat", past_v, v, axis=2), self.dt, ["batch", Hkv, "total", D], f"present_value_{i}")
        # grouped heads: q [B, Hkv, G, T, D] against k, v [B, Hkv, 1, S, D]
        q5 = g.op("Reshape", q, g.const([0, Hkv, Hq // Hkv, -1, D]))
        k5, v5 = (g.op("Unsqueeze", t, g.const([2])) for t in (k_all, v_all))
        scores = g.op("Mul", g.op("MatMul", q5, g.op("Transpose", k5, perm=[0, 1, 2, 4, 3])),
                      g.const(D ** -0.5, self.dt))
        scores = g.op("Where", mask, g.op("Cast", scores, to=F32), g.const(float("-inf"), F32))
        probs = g.op("Cast", g.op("Softmax", scores, axis=-1), to=self.dt)
        o = g.op("Reshape", g.op("MatMul", probs, v5), g.const([0, Hq, -1, D]))  # [B, Hq, T, D]
        o = g.op("Reshape", g.op("Transpose", o, perm=[0, 2, 1, 3]), g.const([0, 0, Hq * D]))
        return self.linear(o, p + "o", layer.o, layer.o_bias)

    def moe(self, i: int, layer: LayerWeights, h: str) -> tuple[str, str]:
        """The MoE feed-forward of layer i: (output [B, T, H], stats int32 [4])."""
        g, moe = self.g, self.c.moe
        p = f"layers.{i}."
        flat = g.op("Reshape", h, g.const([-1, self.c.hidden_size]))  # [B T, H]
        logits = self.linear(flat, p + "router", layer.router)
        ids, weights, _active, stats = plugin_node(g, ROUTE, [logits], 4, route_fields(moe.router, self.budget))
        if moe.weights_in_model_dtype and self.dt != F32:  # rounded as the family's router rounds them
            weights = g.op("Cast", g.op("Cast", weights, to=self.dt), to=F32)
        (out,) = plugin_node(g, MOE, [flat, ids, weights, g.weight(p + "experts", layer.experts)], 1,
                             moe_fields(moe.intermediate_size))
        if layer.shared_down is not None:
            shared = self.swiglu(flat, p + "shared_", layer.shared_gate_up, layer.shared_down)
            gate = g.op("Sigmoid", self.linear(flat, p + "shared_gate", layer.shared_gate))
            out = g.op("Add", out, g.op("Mul", gate, shared))
        return g.op("Reshape", out, g.op("Shape", h)), stats

    # ---- the network --------------------------------------------------------------------------------

    def build(self, taps: Sequence[int]) -> onnx.ModelProto:
        g, c, w = self.g, self.c, self.w
        ids = g.input("input_ids", TensorProto.INT64, ["batch", "tokens"])
        positions = g.input("position_ids", TensorProto.INT64, ["batch", "tokens"])
        mask = g.input("attention_mask", TensorProto.BOOL, ["batch", "tokens", "total"])
        mask5 = g.op("Unsqueeze", mask, g.const([1, 2]))  # [B, 1, 1, T, S]
        inv_freq = g.weight("inv_freq", c.rope.inv_freq(c.head_dim))  # float32 [D/2]
        freqs = g.op("Mul", g.op("Unsqueeze", g.op("Cast", positions, to=F32), g.const([2])), inv_freq)
        emb = g.op("Unsqueeze", g.op("Concat", freqs, freqs, axis=-1), g.const([1]))  # [B, 1, T, D]
        cos, sin = (g.op("Cast", g.op(fn, emb), to=self.dt) for fn in ("Cos", "Sin"))
        x = g.op("Gather", g.weight("embed", w.embed), ids, axis=0)  # [B, T, H]
        stats = []
        for i, layer in enumerate(w.layers):
            p = f"layers.{i}."
            x = g.op("Add", x, self.attention(i, layer, self.rms_norm(x, p + "input_norm", layer.input_norm),
                                              cos, sin, mask5))
            h = self.rms_norm(x, p + "post_norm", layer.post_norm)
            if c.is_moe_layer(i):
                mlp, layer_stats = self.moe(i, layer, h)
                stats.append(g.op("Unsqueeze", layer_stats, g.const([0])))
            else:
                mlp = self.swiglu(h, p, layer.gate_up, layer.down)
            x = g.op("Add", x, mlp)
            if i in taps:
                g.output(x, self.dt, ["batch", "tokens", c.hidden_size], f"hidden_{i}")
        head = w.lm_head if w.lm_head is not w.embed else None
        normed = self.rms_norm(x, "final_norm", w.final_norm)
        if head is None:  # tied: the embedding itself, one initializer
            logits = g.op("MatMul", normed, g.op("Transpose", "embed", perm=[1, 0]))
        else:
            logits = self.linear(normed, "lm_head", head)
        g.output(g.op("Cast", logits, to=F32), F32, ["batch", "tokens", c.vocab_size], "logits")
        if stats:
            g.output(g.op("Concat", *stats, axis=0), TensorProto.INT32, [len(stats), 4], "expert_stats")
        return g.model()


def export_verify(config: ModelConfig, weights: ModelWeights, *, budget: Optional[ExpertBudget] = None,
                  taps: Sequence[int] = ()) -> onnx.ModelProto:
    """The verify network of a model (see the module docstring). ``budget`` caps each MoE layer's
    unique experts; ``taps`` are layers whose residual stream is an output. Raises ValueError for a
    model the network does not cover."""
    if budget is not None and config.moe is None:
        raise ValueError("onnx export: a budget needs an MoE model")
    if weights.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"onnx export: weights of dtype {weights.dtype} (expected float32, bfloat16 or float16)")
    if weights.device.type != "cpu":
        raise ValueError("onnx export: load the model on the CPU")
    unsupported = [what for what, present in (
        ("multi-head latent attention", config.mla is not None),
        ("attention sinks", config.attention_sinks), ("sliding-window layers", bool(config.sliding_layers)),
        ("float32-scaled norms", config.norm_scale_fp32), ("yarn rope", config.rope.kind == "yarn"),
        ("a router bias", config.moe is not None and (config.moe.router_bias or config.moe.score_bias)),
        ("the deepseek_v3 router", config.moe is not None and config.moe.router.family != "softmax"),
        ("GPT-OSS experts", config.moe is not None and config.moe.activation != "swiglu")) if present]
    if unsupported:
        raise ValueError(f"onnx export: {config.architecture} uses {', '.join(unsupported)}, which the verify network "
                         f"does not export yet")
    for t in taps:
        if not 0 <= t < config.num_layers:
            raise ValueError(f"onnx export: tap layer {t} does not exist ({config.num_layers} layers)")
    return _Exporter(config, weights, budget).build(tuple(taps))
