"""moespec's plugin ops as ONNX nodes, and reference bodies for them in standard ONNX ops.

A node whose op type is a plugin's name and whose ``plugin_namespace`` attribute is "moespec" is
what TensorRT's ONNX parser turns into that plugin (it looks the creator up in its registry by
name, ``plugin_version`` and namespace, and reads the node's other attributes as the plugin's
fields, typed as the creator's getFieldNames declares them). Every field travels as an attribute of
the same name (plugins/tensorrt/*_plugin.h has the tables):

- ``MoespecRouteExperts``  router_logits [T, N] -> ids int32 [T, K] (dropped: N), weights float32
  [T, K], active int32 [N] (sorted, padded with N), stats int32 [4] (natural unique, kept,
  re-routed, dropped); routing + the expert budget of DESIGN.md "Expert budget".
- ``MoespecBudgetedMoe``   x [T, H], ids, weights, experts [E, 3 I H] -> [T, H] in x's dtype.

:func:`reference_functions` gives the same ops as ONNX model-local functions, for runtimes that do
not have the plugins (onnxruntime on the CPU: the test that the exported network's logits equal
moespec's runtime). They cover what the export emits: the softmax router family (Qwen3-MoE, OLMoE,
Mixtral, Qwen2-MoE) with or without renormalisation, budgets by substitution or truncation, SwiGLU
experts; the budget scores are summed in float64 as the native code sums them. They compute every
expert for every token (a reference, not a kernel). TensorRT must see the plugin nodes themselves:
the functions are attached only to the in-memory model a reference runtime loads (its parser
would otherwise expand them).
"""

from __future__ import annotations

from typing import Optional

import onnx
from onnx import TensorProto

from moespec.engine.onnx_graph import PLUGIN_DOMAIN, Graph
from moespec.ops import ExpertBudget, RouterSpec
from moespec.ops.routing import _FAMILY_CODES, budget_codes

ROUTE = "MoespecRouteExperts"
MOE = "MoespecBudgetedMoe"
PLUGIN_VERSION = "1"

# Field names, in the plugins' serialization order (plugins/tensorrt/*_plugin.h).
ROUTE_FIELDS = ("family", "top_k", "renormalize", "n_group", "topk_group", "scaling", "max_experts", "policy",
                "coverage", "has_bias", "has_token_weights", "softmax_vector_width")
MOE_FIELDS = ("intermediate_size", "activation", "limit", "alpha", "has_biases")
_PLUGIN_ATTRS = ("plugin_namespace", "plugin_version")


def route_fields(spec: RouterSpec, budget: Optional[ExpertBudget]) -> dict[str, object]:
    """MoespecRouteExperts' fields for ``spec`` and ``budget`` (None: no budget)."""
    max_experts, policy, coverage = budget_codes(budget)  # (the native ops' own codes)
    return {"family": _FAMILY_CODES[spec.family], "top_k": spec.top_k, "renormalize": int(spec.renormalize),
            "n_group": spec.n_group, "topk_group": spec.topk_group, "scaling": float(spec.scaling),
            "max_experts": max_experts, "policy": policy, "coverage": coverage,
            "has_bias": 0, "has_token_weights": 0, "softmax_vector_width": 16}


def moe_fields(intermediate_size: int) -> dict[str, object]:
    """MoespecBudgetedMoe's fields for SwiGLU experts of ``intermediate_size``."""
    return {"intermediate_size": intermediate_size, "activation": 0, "limit": 7.0, "alpha": 1.702, "has_biases": 0}


def plugin_node(g: Graph, name: str, inputs: list[str], outputs: int, fields: dict[str, object]) -> list[str]:
    """One plugin node; its outputs."""
    out = g.op(name, *inputs, outputs=[g.fresh(name) for _ in range(outputs)], domain=PLUGIN_DOMAIN,
               plugin_namespace="moespec", plugin_version=PLUGIN_VERSION, **fields)
    return out if isinstance(out, list) else [out]


# ---- reference bodies ---------------------------------------------------------------------------


def _route_function() -> onnx.FunctionProto:
    g = Graph(ROUTE)
    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    logits = "router_logits"
    prob = g.op("Softmax", g.op("Cast", logits, to=f32), axis=-1)  # [T, N]
    n = g.op("Gather", g.op("Shape", prob), g.const(1), axis=0)  # N (scalar)
    n1 = g.op("Unsqueeze", n, g.const([0]))  # [1]
    k1 = g.op("Unsqueeze", g.attr_const("top_k"), g.const([0]))
    natural = g.op("TopK", prob, k1, axis=-1, largest=1, sorted=1, outputs=2)[1]  # [T, K] int64
    onoff = g.const([0.0, 1.0], f32)
    # the budget: top-B experts by summed probability (float64), when B > 0 and the natural union exceeds it
    score = g.op("ReduceSum", g.op("Cast", prob, to=TensorProto.DOUBLE), g.const([0]), keepdims=0)  # [N]
    b = g.attr_const("max_experts")
    budgeted = g.op("Greater", b, g.const(0))
    b_sel = g.op("Where", budgeted, g.op("Min", b, n), n)
    top = g.op("TopK", score, g.op("Unsqueeze", b_sel, g.const([0])), axis=0, largest=1, sorted=1, outputs=2)[1]
    in_top = g.op("ReduceMax", g.op("OneHot", top, n1, onoff, axis=-1), g.const([0]), keepdims=0)  # [N]
    natural_used = g.op("ReduceMax", g.op("OneHot", natural, n1, onoff, axis=-1), g.const([0, 1]), keepdims=0)
    natural_unique = g.op("ReduceSum", natural_used, keepdims=0)  # float scalar
    binds = g.op("And", budgeted, g.op("Greater", natural_unique, g.op("Cast", b_sel, to=f32)))
    in_set = g.op("Or", g.op("Cast", in_top, to=TensorProto.BOOL), g.op("Not", binds))  # [N]
    outside = g.op("Not", g.op("Gather", in_set, natural, axis=0))  # [T, K]
    # substitution: a token with an expert outside the set takes its top-k inside it
    masked = g.op("Where", in_set, prob, g.const(float("-inf"), f32))
    moved = g.op("TopK", masked, k1, axis=-1, largest=1, sorted=1, outputs=2)[1]
    any_out = g.op("Cast", g.op("ReduceMax", g.op("Cast", outside, to=f32), g.const([1]), keepdims=1),
                   to=TensorProto.BOOL)  # [T, 1]
    substituted = g.op("Where", any_out, moved, natural)
    truncated = g.op("Where", outside, n, natural)  # dropped slots hold N
    is_sub = g.op("Equal", g.attr_const("policy"), g.const(0))
    ids = g.op("Where", is_sub, substituted, truncated)  # [T, K] int64
    # the family's weights on the final slots, renormalised when asked
    kept = g.op("Less", ids, n)
    slot = g.op("Min", ids, g.op("Sub", n, g.const(1)))
    zero = g.const(0.0, f32)
    w = g.op("Where", kept, g.op("GatherElements", prob, slot, axis=1), zero)
    total = g.op("ReduceSum", w, g.const([1]), keepdims=1)
    renormed = g.op("Where", g.op("Greater", total, zero), g.op("Div", w, total), zero)
    weights = g.op("Where", g.op("Equal", g.attr_const("renormalize"), g.const(1)), renormed, w)
    # active experts (sorted, padded with N) and the stats
    used = g.op("Slice", g.op("ReduceMax", g.op("OneHot", ids, g.op("Add", n1, g.const([1])), onoff, axis=-1),
                              g.const([0, 1]), keepdims=0), g.const([0]), n1)  # [N] 0/1
    arange = g.op("Range", g.const(0), n, g.const(1))
    key = g.op("Where", g.op("Cast", used, to=TensorProto.BOOL), arange, n)
    active = g.op("TopK", key, n1, axis=0, largest=0, sorted=1, outputs=2)[0]
    same = g.op("Equal", g.op("Unsqueeze", ids, g.const([2])), g.op("Unsqueeze", natural, g.const([1])))  # [T, K, K]
    fresh = g.op("Not", g.op("Cast", g.op("ReduceMax", g.op("Cast", same, to=f32), g.const([2]), keepdims=0),
                             to=TensorProto.BOOL))
    rerouted = g.op("Where", is_sub, g.op("ReduceSum", g.op("Cast", fresh, to=i64), keepdims=0), g.const(0))
    dropped = g.op("ReduceSum", g.op("Cast", g.op("Equal", ids, n), to=i64), keepdims=0)
    stats = g.op("Concat", *[g.op("Unsqueeze", g.op("Cast", s, to=i64), g.const([0]))
                             for s in (natural_unique, g.op("ReduceSum", used, keepdims=0), rerouted, dropped)], axis=0)
    i32 = TensorProto.INT32
    g.op("Cast", ids, to=i32, outputs=["ids"])
    g.op("Identity", weights, outputs=["weights"])
    g.op("Cast", active, to=i32, outputs=["active"])
    g.op("Cast", stats, to=i32, outputs=["stats"])
    return g.function(ROUTE, [logits], ["ids", "weights", "active", "stats"], ROUTE_FIELDS + _PLUGIN_ATTRS,
                      doc="Reference of the MoespecRouteExperts plugin: softmax family, budget by substitution or "
                          "truncation.")


def _moe_function() -> onnx.FunctionProto:
    g = Graph(MOE)
    f32 = TensorProto.FLOAT
    x, ids, weights, experts = "x", "ids", "weights", "experts"
    shape = g.op("Shape", experts)
    e1 = g.op("Slice", shape, g.const([0]), g.const([1]))  # [1] E
    h1 = g.op("Slice", g.op("Shape", x), g.const([1]), g.const([2]))  # [1] H
    i1 = g.op("Unsqueeze", g.attr_const("intermediate_size"), g.const([0]))
    blocks = g.op("Cast", experts, to=f32)
    gate, up, down = g.op("Split", g.op("Reshape", blocks, g.op("Concat", e1, g.const([3, -1]), axis=0)),
                          axis=1, num_outputs=3, outputs=3)  # [E, 1, I H] each
    gate = g.op("Reshape", gate, g.op("Concat", e1, i1, h1, axis=0))  # [E, I, H]
    up = g.op("Reshape", up, g.op("Concat", e1, i1, h1, axis=0))
    down = g.op("Reshape", down, g.op("Concat", e1, h1, i1, axis=0))  # [E, H, I]
    xf = g.op("Cast", x, to=f32)  # [T, H]
    g_ = g.op("MatMul", xf, g.op("Transpose", gate, perm=[0, 2, 1]))  # [E, T, I]
    u_ = g.op("MatMul", xf, g.op("Transpose", up, perm=[0, 2, 1]))
    h = g.op("Mul", g.op("Mul", g_, g.op("Sigmoid", g_)), u_)
    h = g.op("Cast", g.op("CastLike", h, experts), to=f32)  # rounded to the weights' dtype before down
    y = g.op("MatMul", h, g.op("Transpose", down, perm=[0, 2, 1]))  # [E, T, H]
    onehot = g.op("OneHot", g.op("Cast", ids, to=TensorProto.INT64), g.op("Add", e1, g.const([1])),
                  g.const([0.0, 1.0], f32), axis=-1)  # [T, K, E + 1]
    combine = g.op("ReduceSum", g.op("Mul", onehot, g.op("Unsqueeze", weights, g.const([2]))), g.const([1]),
                   keepdims=0)  # [T, E + 1]
    combine = g.op("Slice", combine, g.const([0]), e1, g.const([1]))  # [T, E]
    out = g.op("ReduceSum", g.op("Mul", g.op("Unsqueeze", g.op("Transpose", combine, perm=[1, 0]), g.const([2])), y),
               g.const([0]), keepdims=0)  # [T, H]
    g.op("CastLike", out, x, outputs=["out"])
    return g.function(MOE, [x, ids, weights, experts], ["out"], MOE_FIELDS + _PLUGIN_ATTRS,
                      doc="Reference of the MoespecBudgetedMoe plugin: SwiGLU experts, fp32 sums.")


def reference_functions() -> list[onnx.FunctionProto]:
    """The plugin ops' reference bodies, as model-local functions."""
    return [_route_function(), _moe_function()]


def check_reference_supports(model: onnx.ModelProto) -> None:
    """ValueError when a plugin node uses a variant the reference bodies do not implement."""
    for node in model.graph.node:
        if node.domain != PLUGIN_DOMAIN:
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == ROUTE and (attrs["family"] != 0 or attrs["coverage"] != 0 or attrs["has_bias"]
                                      or attrs["has_token_weights"]):
            raise ValueError(f"{node.name}: the reference MoespecRouteExperts covers the softmax family without "
                             f"coverage, bias or token weights")
        if node.op_type == MOE and (attrs["activation"] != 0 or attrs["has_biases"]):
            raise ValueError(f"{node.name}: the reference MoespecBudgetedMoe covers SwiGLU experts without biases")


def with_reference_functions(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` whose plugin nodes run as the reference functions (for onnxruntime)."""
    check_reference_supports(model)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    out.functions.extend(reference_functions())
    return out
