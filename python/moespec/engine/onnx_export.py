"""The target's verify network as ONNX, its MoE blocks as moespec plugin nodes (for TensorRT).

One network serves prefill, decode and tree verify, as the runtime's one forward does: ``T`` new
tokens per request attend to ``P`` cached slots and, among themselves, to what ``attention_mask``
allows (causal for a sequence, ancestor-or-self for a draft tree); positions come in as they are
(``P + depth`` for a tree). Inputs and outputs (B requests, T new tokens, P past slots, S = P + T):

    input_ids        int64 [B, T]
    position_ids     int64 [B, T]
    attention_mask   bool  [B, T, S]       True: the token attends to that slot (the past first)
    past_key_{l}     dtype [B, Hkv, P, D]  per layer l (and past_value_{l}); multi-head latent attention
                     (DeepSeek-V3) caches as the runtime does: the normed latent [B, 1, P, kv_lora_rank]
                     in past_key, the rope key [B, 1, P, qk_rope_head_dim] in past_value
    -> logits        float32 [B, T, V]
       present_key_{l}, present_value_{l}  the past with the new tokens appended (S slots)
       hidden_{l}    dtype [B, T, H]       the residual stream after layer l, for each tap (EAGLE-3)
       expert_stats  int32 [L_moe, 4]      per MoE layer: natural unique, kept, re-routed, dropped

Each MoE layer is router MatMul -> ``MoespecRouteExperts`` -> ``MoespecBudgetedMoe`` (routing +
budget + experts, :mod:`moespec.engine.onnx_plugins`; DeepSeek-V3's correction bias and GPT-OSS's
expert biases as plugin inputs), plus the shared expert (Qwen2-MoE gated, DeepSeek-V3 not) in plain
ops. Every family the runtime loads exports: GQA with q/k norms, clipping, biases, GPT-OSS's sinks
and sliding windows (past slot j holds position j, the new tokens their ``position_ids``), MLA with
plain or interleaved rope, YaRN's cos/sin scale, float32-scaled norms. The budget, when given, is a
field of every route node (it caps each layer's unique experts over all B x T tokens, DESIGN.md
"Expert budget"; budgets are for verify passes: prefill through a network exported without one). All
B x T tokens are routed, so a batch of unequal trees is padded with tokens that count towards the
budget; export B = 1 trees, or equal sizes, for the runtime's exact budget. Arithmetic follows
:class:`moespec.runtime.backend.ReferenceBackend`: matmuls in the weights' dtype, norms and softmax
in float32, rope tables from the config's own inverse frequencies. Initializers carry the engine's
tensor names.

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
from moespec.runtime.attention import mla_scale

F32 = TensorProto.FLOAT


class _Exporter:
    def __init__(self, config: ModelConfig, weights: ModelWeights, budget: Optional[ExpertBudget]):
        self.c, self.w, self.budget = config, weights, budget
        self.dt = ONNX_DTYPES[weights.dtype]
        self.g = Graph("moespec_verify")

    # ---- small blocks -------------------------------------------------------------------------------

    def linear(self, x: str, name: str, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
               to: Optional[int] = None) -> str:
        """x @ weight^T (+ bias); ``weight`` [out, in] as the engine stores it (a Transpose TensorRT and
        onnxruntime fold at build time), cast to ``to`` first when given."""
        g = self.g
        w = g.weight(name, weight)
        w = g.op("Cast", w, to=to) if to is not None else w
        y = g.op("MatMul", x, g.op("Transpose", w, perm=[1, 0]))
        return g.op("Add", y, g.weight(name + "_bias", bias)) if bias is not None else y

    def rms_norm(self, x: str, name: str, weight: torch.Tensor, scale_fp32: bool = False) -> str:
        """transformers' RMSNorm: normalise in float32, cast back, scale (``scale_fp32``: scale in float32,
        then cast, as GPT-OSS's layer norms do)."""
        g = self.g
        xf = g.op("Cast", x, to=F32)
        ms = g.op("ReduceMean", g.op("Mul", xf, xf), g.const([-1]), keepdims=1)
        inv = g.op("Reciprocal", g.op("Sqrt", g.op("Add", ms, g.const(self.c.rms_norm_eps, F32))))
        if scale_fp32:
            return g.op("Cast", g.op("Mul", g.op("Cast", g.weight(name, weight), to=F32), g.op("Mul", xf, inv)),
                        to=self.dt)
        return g.op("Mul", g.weight(name, weight), g.op("Cast", g.op("Mul", xf, inv), to=self.dt))

    def layer_norm(self, x: str, name: str, weight: torch.Tensor) -> str:
        """A decoder layer's (or the final) norm, scaled as the family scales it."""
        return self.rms_norm(x, name, weight, self.c.norm_scale_fp32)

    def rotate(self, x: str, cos: str, sin: str) -> str:
        g, half = self.g, self.c.head_dim // 2
        x1, x2 = g.op("Split", x, g.const([half, half]), axis=-1, outputs=2)
        turned = g.op("Concat", g.op("Neg", x2), x1, axis=-1)
        return g.op("Add", g.op("Mul", x, cos), g.op("Mul", turned, sin))

    def rotate_interleaved(self, x: str, cos: str, sin: str) -> str:
        """Rope over interleaved pairs, de-interleaved (DeepSeek; runtime.attention.rotate_interleaved)."""
        g, half = self.g, self.c.head_dim // 2
        pairs = g.op("Reshape", x, g.const([0, 0, 0, half, 2]))  # [B, heads, T, D/2, 2]
        x1, x2 = (g.op("Squeeze", t, g.const([-1])) for t in g.op("Split", pairs, g.const([1, 1]), axis=-1, outputs=2))
        c, s = (g.op("Slice", t, g.const([0]), g.const([half]), g.const([-1])) for t in (cos, sin))
        return g.op("Concat", g.op("Sub", g.op("Mul", x1, c), g.op("Mul", x2, s)),
                    g.op("Add", g.op("Mul", x2, c), g.op("Mul", x1, s)), axis=-1)

    def swiglu(self, x: str, name: str, gate_up: torch.Tensor, down: torch.Tensor) -> str:
        g = self.g
        half = gate_up.shape[0] // 2
        gate, up = g.op("Split", self.linear(x, name + "gate_up", gate_up), g.const([half, half]), axis=-1, outputs=2)
        return self.linear(g.op("Mul", g.op("Mul", gate, g.op("Sigmoid", gate)), up), name + "down", down)

    def softmax(self, scores: str, mask: str, sinks: Optional[str]) -> str:
        """Masked softmax over the last axis in float32, back in the model dtype; ``sinks`` (float32,
        broadcast to scores' leading axes) add one logit to every row's denominator."""
        g = self.g
        scores = g.op("Where", mask, g.op("Cast", scores, to=F32), g.const(float("-inf"), F32))
        if sinks is None:
            return g.op("Cast", g.op("Softmax", scores, axis=-1), to=self.dt)
        lead = g.op("Slice", g.op("Shape", scores), g.const([0]), g.const([-1]))
        column = g.op("Expand", sinks, g.op("Concat", lead, g.const([1]), axis=0))
        probs = g.op("Softmax", g.op("Concat", scores, column, axis=-1), axis=-1)
        return g.op("Cast", g.op("Slice", probs, g.const([0]), g.const([-1]), g.const([-1])), to=self.dt)

    def present(self, i: int, kind: str, new: str, heads: int, width: int) -> str:
        """past_{kind}_{i} [B, heads, P, width] with ``new`` [B, heads, T, width] appended: present_{kind}_{i}."""
        g = self.g
        past = g.input(f"past_{kind}_{i}", self.dt, ["batch", heads, "past", width])
        return g.output(g.op("Concat", past, new, axis=2), self.dt, ["batch", heads, "total", width],
                        f"present_{kind}_{i}")

    # ---- layers -------------------------------------------------------------------------------------

    def attention(self, i: int, layer: LayerWeights, h: str, cos: str, sin: str, mask: str) -> str:
        """Layer i's attention of ``h`` [B, T, H] (normed) under ``mask`` bool [B, T, S]."""
        return (self.mla if self.c.mla is not None else self.gqa)(i, layer, h, cos, sin, mask)

    def gqa(self, i: int, layer: LayerWeights, h: str, cos: str, sin: str, mask: str) -> str:
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
        k_all, v_all = self.present(i, "key", k, Hkv, D), self.present(i, "value", v, Hkv, D)
        # grouped heads: q [B, Hkv, G, T, D] against k, v [B, Hkv, 1, S, D]
        q5 = g.op("Reshape", q, g.const([0, Hkv, Hq // Hkv, -1, D]))
        k5, v5 = (g.op("Unsqueeze", t, g.const([2])) for t in (k_all, v_all))
        scores = g.op("Mul", g.op("MatMul", q5, g.op("Transpose", k5, perm=[0, 1, 2, 4, 3])),
                      g.const(D ** -0.5, self.dt))
        sinks = None
        if layer.sinks is not None:  # [Hq] -> [1, Hkv, G, 1, 1]
            sinks = g.op("Reshape", g.op("Cast", g.weight(p + "sinks", layer.sinks), to=F32),
                         g.const([1, Hkv, Hq // Hkv, 1, 1]))
        probs = self.softmax(scores, g.op("Unsqueeze", mask, g.const([1, 2])), sinks)  # [B, Hkv, G, T, S]
        o = g.op("Reshape", g.op("MatMul", probs, v5), g.const([0, Hq, -1, D]))  # [B, Hq, T, D]
        o = g.op("Reshape", g.op("Transpose", o, perm=[0, 2, 1, 3]), g.const([0, 0, Hq * D]))
        return self.linear(o, p + "o", layer.o, layer.o_bias)

    def mla(self, i: int, layer: LayerWeights, h: str, cos: str, sin: str, mask: str) -> str:
        """Multi-head latent attention (runtime.attention._mla): the cache holds the normed latent
        (past_key) and the rope key (past_value); keys and values are expanded from the latent."""
        g, c, m = self.g, self.c, self.c.mla
        Hq, R, nope, rope, vd = c.num_heads, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        p = f"layers.{i}."
        if layer.q_a is not None:
            q = self.linear(self.rms_norm(self.linear(h, p + "q_a", layer.q_a), p + "q_a_norm", layer.q_a_norm),
                            p + "q", layer.q)
        else:
            q = self.linear(h, p + "q", layer.q)
        q = g.op("Transpose", g.op("Reshape", q, g.const([0, 0, Hq, nope + rope])), perm=[0, 2, 1, 3])
        q_pass, q_rot = g.op("Split", q, g.const([nope, rope]), axis=-1, outputs=2)  # [B, Hq, T, *]
        latent, k_rot = g.op("Split", self.linear(h, p + "kv_a", layer.kv_a), g.const([R, rope]), axis=-1, outputs=2)
        latent = self.rms_norm(latent, p + "kv_a_norm", layer.kv_a_norm)  # [B, T, R]
        turn = self.rotate_interleaved if m.rope_interleave else self.rotate
        q_rot, k_rot = turn(q_rot, cos, sin), turn(g.op("Unsqueeze", k_rot, g.const([1])), cos, sin)
        lat_all = self.present(i, "key", g.op("Unsqueeze", latent, g.const([1])), 1, R)  # [B, 1, S, R]
        rot_all = self.present(i, "value", k_rot, 1, rope)  # [B, 1, S, rope]
        kv = self.linear(g.op("Squeeze", lat_all, g.const([1])), p + "kv_b", layer.kv_b)  # [B, S, Hq (nope + vd)]
        kv = g.op("Transpose", g.op("Reshape", kv, g.const([0, 0, Hq, nope + vd])), perm=[0, 2, 1, 3])
        k_nope, v = g.op("Split", kv, g.const([nope, vd]), axis=-1, outputs=2)  # [B, Hq, S, *]
        lead = g.op("Slice", g.op("Shape", k_nope), g.const([0]), g.const([3]))
        k = g.op("Concat", k_nope, g.op("Expand", rot_all, g.op("Concat", lead, g.const([rope]), axis=0)), axis=-1)
        qk = g.op("MatMul", g.op("Concat", q_pass, q_rot, axis=-1), g.op("Transpose", k, perm=[0, 1, 3, 2]))
        scores = g.op("Mul", qk, g.const(mla_scale(c), self.dt))  # [B, Hq, T, S]
        probs = self.softmax(scores, g.op("Unsqueeze", mask, g.const([1])), None)
        o = g.op("Reshape", g.op("Transpose", g.op("MatMul", probs, v), perm=[0, 2, 1, 3]), g.const([0, 0, Hq * vd]))
        return self.linear(o, p + "o", layer.o, layer.o_bias)

    def moe(self, i: int, layer: LayerWeights, h: str, moe_index: int) -> tuple[str, str]:
        """The MoE feed-forward of layer i, the MoE layer ``moe_index`` (models.moe.moe_forward): (output
        [B, T, H], stats int32 [4])."""
        g, moe = self.g, self.c.moe
        p = f"layers.{i}."
        flat = g.op("Reshape", h, g.const([-1, self.c.hidden_size]))  # [B T, H]
        if moe.router_fp32:  # float32 x and weights
            logits = self.linear(g.op("Cast", flat, to=F32), p + "router", layer.router, to=F32)
        else:
            logits = self.linear(flat, p + "router", layer.router, layer.router_bias)
        route_in = [logits]
        if layer.score_bias is not None:
            route_in.append(g.op("Cast", g.weight(p + "score_bias", layer.score_bias), to=F32))
        ids, weights, _active, stats = plugin_node(g, ROUTE, route_in, 4,
                                                   route_fields(moe.router, self.budget and self.budget.for_layer(moe_index),
                                                                has_bias=len(route_in) > 1))
        moe_in = [flat, ids, weights, g.weight(p + "experts", layer.experts)]
        if layer.expert_biases is not None:
            moe_in.append(g.op("Cast", g.weight(p + "expert_biases", layer.expert_biases), to=F32))
        (out,) = plugin_node(g, MOE, moe_in, 1, moe_fields(  # weights rounded as the family's router rounds them
            moe.intermediate_size, moe.activation, moe.swiglu_limit, moe.swiglu_alpha, len(moe_in) > 4,
            round_weights=moe.weights_in_model_dtype and self.dt != F32))
        if layer.shared_down is not None:
            shared = self.swiglu(flat, p + "shared_", layer.shared_gate_up, layer.shared_down)
            if layer.shared_gate is not None:  # (Qwen2-MoE; DeepSeek-V3's shared experts are ungated)
                shared = g.op("Mul", g.op("Sigmoid", self.linear(flat, p + "shared_gate", layer.shared_gate)), shared)
            out = g.op("Add", out, shared)
        return g.op("Reshape", out, g.op("Shape", h)), stats

    # ---- the network --------------------------------------------------------------------------------

    def masks(self, mask: str, positions: str) -> dict[int, str]:
        """window -> the attention mask of the layers with that sliding window (0: full attention): a
        token sees a slot whose position is less than W before its own; past slot j holds position j,
        the new tokens their position_ids."""
        g, c = self.g, self.c
        out = {0: mask}
        windows = sorted({c.window(i) for i in range(c.num_layers)} - {0})
        if windows:
            past = g.op("Sub", g.op("Gather", g.op("Shape", mask), g.const(2), axis=0),
                        g.op("Gather", g.op("Shape", positions), g.const(1), axis=0))
            batch = g.op("Slice", g.op("Shape", positions), g.const([0]), g.const([1]))
            old = g.op("Expand", g.op("Unsqueeze", g.op("Range", g.const(0), past, g.const(1)), g.const([0])),
                       g.op("Concat", batch, g.op("Unsqueeze", past, g.const([0])), axis=0))  # [B, P]
            key_pos = g.op("Concat", old, positions, axis=1)  # [B, S]
            back = g.op("Sub", g.op("Unsqueeze", positions, g.const([2])), g.op("Unsqueeze", key_pos, g.const([1])))
            for window in windows:
                out[window] = g.op("And", mask, g.op("Less", back, g.const(window)))
        return out

    def build(self, taps: Sequence[int]) -> onnx.ModelProto:
        g, c, w = self.g, self.c, self.w
        ids = g.input("input_ids", TensorProto.INT64, ["batch", "tokens"])
        positions = g.input("position_ids", TensorProto.INT64, ["batch", "tokens"])
        mask = g.input("attention_mask", TensorProto.BOOL, ["batch", "tokens", "total"])
        masks = self.masks(mask, positions)
        inv_freq = g.weight("inv_freq", c.rope.inv_freq(c.head_dim))  # float32 [D/2]
        freqs = g.op("Mul", g.op("Unsqueeze", g.op("Cast", positions, to=F32), g.const([2])), inv_freq)
        emb = g.op("Unsqueeze", g.op("Concat", freqs, freqs, axis=-1), g.const([1]))  # [B, 1, T, D]
        scaling = c.rope.attention_scaling  # (1 but for yarn)
        cos, sin = (g.op(fn, emb) for fn in ("Cos", "Sin"))
        if scaling != 1.0:
            cos, sin = (g.op("Mul", t, g.const(scaling, F32)) for t in (cos, sin))
        cos, sin = (g.op("Cast", t, to=self.dt) for t in (cos, sin))
        x = g.op("Gather", g.weight("embed", w.embed), ids, axis=0)  # [B, T, H]
        stats = []
        for i, layer in enumerate(w.layers):
            p = f"layers.{i}."
            x = g.op("Add", x, self.attention(i, layer, self.layer_norm(x, p + "input_norm", layer.input_norm),
                                              cos, sin, masks[c.window(i)]))
            h = self.layer_norm(x, p + "post_norm", layer.post_norm)
            if c.is_moe_layer(i):
                mlp, layer_stats = self.moe(i, layer, h, len(stats))
                stats.append(g.op("Unsqueeze", layer_stats, g.const([0])))
            else:
                mlp = self.swiglu(h, p, layer.gate_up, layer.down)
            x = g.op("Add", x, mlp)
            if i in taps:
                g.output(x, self.dt, ["batch", "tokens", c.hidden_size], f"hidden_{i}")
        head = w.lm_head if w.lm_head is not w.embed else None
        normed = self.layer_norm(x, "final_norm", w.final_norm)
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
    for t in taps:
        if not 0 <= t < config.num_layers:
            raise ValueError(f"onnx export: tap layer {t} does not exist ({config.num_layers} layers)")
    return _Exporter(config, weights, budget).build(tuple(taps))
