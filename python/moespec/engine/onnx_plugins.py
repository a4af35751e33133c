"""moespec's plugin ops as ONNX nodes, and reference bodies for them in standard ONNX ops.

A node whose op type is a plugin's name and whose ``plugin_namespace`` attribute is "moespec" is
what TensorRT's ONNX parser turns into that plugin (it looks the creator up in its registry by
name, ``plugin_version`` and namespace, and reads the node's other attributes as the plugin's
fields, typed as the creator's getFieldNames declares them). Every field travels as an attribute of
the same name (plugins/tensorrt/*_plugin.h has the tables):

- ``MoespecRouteExperts``  router_logits [T, N] -> ids int32 [T, K] (dropped: N), weights float32
  [T, K], active int32 [N] (sorted, padded with N), stats int32 [4] (natural unique, kept,
  re-routed, dropped); routing + the expert budget of DESIGN.md "Expert budget".
  (+ bias float32 [N] when ``has_bias``: deepseek_v3's selection bias).
- ``MoespecBudgetedMoe``   x [T, H], ids, weights, experts [E, 3 I H] (+ biases float32 [E, 2 I + H]
  when ``has_biases``: GPT-OSS) -> [T, H] in x's dtype.

:func:`reference_functions` gives the same ops as ONNX model-local functions, for runtimes that do
not have the plugins (onnxruntime on the CPU: the test that the exported network's logits equal
moespec's runtime), one function per variant (``MoespecRouteExperts_<family>``,
``MoespecBudgetedMoe_<activation>``): the softmax family (Qwen3-MoE, OLMoE, Mixtral, Qwen2-MoE) with
or without renormalisation, deepseek_v3 (sigmoid, bias, group-limited top-k, scaling), gpt_oss
(top-k of the biased logits, softmax over the k); budgets by substitution or truncation; SwiGLU and
GPT-OSS experts. The budget scores are summed in float64 as the native code sums them. They compute
every expert for every token (a reference, not a kernel). TensorRT must see the plugin nodes
themselves: :func:`with_reference_functions` renames the nodes to their variants and attaches the
functions only in the in-memory copy a reference runtime loads (the parser would otherwise expand
them).
"""

from __future__ import annotations

from typing import Optional

import onnx
from onnx import TensorProto

from moespec.engine.onnx_graph import PLUGIN_DOMAIN, Graph
from moespec.ops import ExpertBudget, RouterSpec
from moespec.ops.moe import _ACTIVATION_CODES
from moespec.ops.routing import _FAMILY_CODES, budget_codes

ROUTE = "MoespecRouteExperts"
MOE = "MoespecBudgetedMoe"
PLUGIN_VERSION = "1"

# Field names, in the plugins' serialization order (plugins/tensorrt/*_plugin.h).
ROUTE_FIELDS = ("family", "top_k", "renormalize", "n_group", "topk_group", "scaling", "max_experts", "policy",
                "coverage", "has_bias", "has_token_weights", "softmax_vector_width", "score")
MOE_FIELDS = ("intermediate_size", "activation", "limit", "alpha", "has_biases", "round_weights")
_PLUGIN_ATTRS = ("plugin_namespace", "plugin_version")
_ACTIVATION_NAMES = {code: name for name, code in _ACTIVATION_CODES.items()}  # the activation field's codes
_FAMILY_NAMES = {code: name for name, code in _FAMILY_CODES.items()}  # the family field's codes


def route_fields(spec: RouterSpec, budget: Optional[ExpertBudget], has_bias: bool = False) -> dict[str, object]:
    """MoespecRouteExperts' fields for ``spec`` and ``budget`` (None: no budget); ``has_bias``: a
    selection bias comes as the second input (deepseek_v3's e_score_correction_bias)."""
    max_experts, policy, coverage, score = budget_codes(budget)  # (the native ops' own codes)
    return {"family": _FAMILY_CODES[spec.family], "top_k": spec.top_k, "renormalize": int(spec.renormalize),
            "n_group": spec.n_group, "topk_group": spec.topk_group, "scaling": float(spec.scaling),
            "max_experts": max_experts, "policy": policy, "coverage": coverage,
            "has_bias": int(has_bias), "has_token_weights": 0, "softmax_vector_width": 16, "score": score}


def moe_fields(intermediate_size: int, activation: str = "swiglu", limit: float = 7.0, alpha: float = 1.702,
               has_biases: bool = False, round_weights: bool = False) -> dict[str, object]:
    """MoespecBudgetedMoe's fields for experts of ``intermediate_size`` ("swiglu", or "gpt_oss": the
    clamped variant with ``limit`` and ``alpha``; ``has_biases``: the experts' biases come as input 5;
    ``round_weights``: each routing weight rounded to x's dtype first, as moe_experts' round_weights)."""
    return {"intermediate_size": intermediate_size, "activation": _ACTIVATION_CODES[activation], "limit": float(limit),
            "alpha": float(alpha), "has_biases": int(has_biases), "round_weights": int(round_weights)}


def plugin_node(g: Graph, name: str, inputs: list[str], outputs: int, fields: dict[str, object]) -> list[str]:
    """One plugin node; its outputs."""
    out = g.op(name, *inputs, outputs=[g.fresh(name) for _ in range(outputs)], domain=PLUGIN_DOMAIN,
               plugin_namespace="moespec", plugin_version=PLUGIN_VERSION, **fields)
    return out if isinstance(out, list) else [out]


# ---- reference bodies ---------------------------------------------------------------------------


def _family_scores(g: Graph, family: str, logits: str, k1: str) -> tuple[str, str, str]:
    """(prob, key, natural) of a router family: the full probability [T, N] float32 (the budget's
    scores), the selection key [T, N] and the natural top-k ids int64 [T, K]."""
    f32 = TensorProto.FLOAT
    lf = g.op("Cast", logits, to=f32)
    if family == "softmax":
        prob = g.op("Softmax", lf, axis=-1)
        return prob, prob, g.op("TopK", prob, k1, axis=-1, largest=1, sorted=1, outputs=2)[1]
    if family == "gpt_oss":  # top-k of the logits (which hold the router bias), softmax over the k
        return g.op("Softmax", lf, axis=-1), lf, g.op("TopK", lf, k1, axis=-1, largest=1, sorted=1, outputs=2)[1]
    # deepseek_v3: sigmoid scores, the bias on the selection key, group-limited top-k
    prob = g.op("Sigmoid", lf)
    key = g.op("Add", prob, "bias")
    shape = g.op("Shape", key)
    t1, n = g.op("Slice", shape, g.const([0]), g.const([1])), g.op("Gather", shape, g.const(1), axis=0)
    groups1 = g.op("Unsqueeze", g.attr_const("n_group"), g.const([0]))
    per = g.op("Div", n, g.attr_const("n_group"))
    grouped = g.op("Reshape", key, g.op("Concat", t1, groups1, g.const([-1]), axis=0))  # [T, G, N / G]
    best2 = g.op("Unsqueeze", g.op("Min", per, g.const(2)), g.const([0]))
    group_score = g.op("ReduceSum", g.op("TopK", grouped, best2, axis=-1, largest=1, sorted=1, outputs=2)[0],
                       g.const([-1]), keepdims=0)  # [T, G]
    kept_groups = g.op("TopK", group_score, g.op("Unsqueeze", g.attr_const("topk_group"), g.const([0])), axis=-1,
                       largest=1, sorted=1, outputs=2)[1]
    keep = g.op("ReduceMax", g.op("OneHot", kept_groups, groups1, g.const([0.0, 1.0], f32), axis=-1), g.const([1]),
                keepdims=0)  # [T, G]
    keep = g.op("Reshape", g.op("Expand", g.op("Unsqueeze", keep, g.const([2])),
                                g.op("Concat", t1, groups1, g.op("Unsqueeze", per, g.const([0])), axis=0)),
                g.op("Concat", t1, g.const([-1]), axis=0))  # [T, N]
    choice = g.op("Where", g.op("Cast", keep, to=TensorProto.BOOL), key, g.const(float("-inf"), f32))
    return prob, key, g.op("TopK", choice, k1, axis=-1, largest=1, sorted=1, outputs=2)[1]


def _family_weights(g: Graph, family: str, logits: str, prob: str, ids: str, n: str) -> str:
    """The family's weights [T, K] float32 on the final slots ``ids`` (a dropped slot, id N, weighs 0)."""
    f32 = TensorProto.FLOAT
    kept = g.op("Less", ids, n)
    slot = g.op("Min", ids, g.op("Sub", n, g.const(1)))
    zero = g.const(0.0, f32)
    renormalize = g.op("Equal", g.attr_const("renormalize"), g.const(1))
    if family == "gpt_oss":
        top = g.op("Where", kept, g.op("GatherElements", g.op("Cast", logits, to=f32), slot, axis=1),
                   g.const(float("-inf"), f32))
        any_kept = g.op("Cast", g.op("ReduceMax", g.op("Cast", kept, to=f32), g.const([1]), keepdims=1),
                        to=TensorProto.BOOL)
        return g.op("Where", any_kept, g.op("Softmax", top, axis=1), zero)
    w = g.op("Where", kept, g.op("GatherElements", prob, slot, axis=1), zero)
    total = g.op("ReduceSum", w, g.const([1]), keepdims=1)
    if family == "softmax":
        return g.op("Where", renormalize, g.op("Where", g.op("Greater", total, zero), g.op("Div", w, total), zero), w)
    renormed = g.op("Div", w, g.op("Add", total, g.const(1e-20, f32)))
    return g.op("Mul", g.op("Where", renormalize, renormed, w), g.attr_const("scaling", "float"))


def _route_function(family: str) -> onnx.FunctionProto:
    g = Graph(ROUTE)
    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    logits = "router_logits"
    k1 = g.op("Unsqueeze", g.attr_const("top_k"), g.const([0]))
    prob, key, natural = _family_scores(g, family, logits, k1)  # [T, N], [T, N], [T, K] int64
    n = g.op("Gather", g.op("Shape", prob), g.const(1), axis=0)  # N (scalar)
    n1 = g.op("Unsqueeze", n, g.const([0]))  # [1]
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
    masked = g.op("Where", in_set, key, g.const(float("-inf"), f32))
    moved = g.op("TopK", masked, k1, axis=-1, largest=1, sorted=1, outputs=2)[1]
    any_out = g.op("Cast", g.op("ReduceMax", g.op("Cast", outside, to=f32), g.const([1]), keepdims=1),
                   to=TensorProto.BOOL)  # [T, 1]
    substituted = g.op("Where", any_out, moved, natural)
    truncated = g.op("Where", outside, n, natural)  # dropped slots hold N
    is_sub = g.op("Equal", g.attr_const("policy"), g.const(0))
    ids = g.op("Where", is_sub, substituted, truncated)  # [T, K] int64
    weights = _family_weights(g, family, logits, prob, ids, n)
    # active experts (sorted, padded with N) and the stats
    used = g.op("Slice", g.op("ReduceMax", g.op("OneHot", ids, g.op("Add", n1, g.const([1])), onoff, axis=-1),
                              g.const([0, 1]), keepdims=0), g.const([0]), n1)  # [N] 0/1
    arange = g.op("Range", g.const(0), n, g.const(1))
    key_ = g.op("Where", g.op("Cast", used, to=TensorProto.BOOL), arange, n)
    active = g.op("TopK", key_, n1, axis=0, largest=0, sorted=1, outputs=2)[0]
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
    inputs = [logits, "bias"] if family == "deepseek_v3" else [logits]
    return g.function(reference_name(ROUTE, family), inputs, ["ids", "weights", "active", "stats"],
                      ROUTE_FIELDS + _PLUGIN_ATTRS,
                      doc=f"Reference of the MoespecRouteExperts plugin, {family} family: budget by substitution or "
                          f"truncation.")


def _moe_function(activation: str) -> onnx.FunctionProto:
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
    if activation == "gpt_oss":  # biases [E, 2 I + H]: gate, up, down; clamped gate and up
        b_gate, b_up, b_down = g.op("Split", "biases", g.op("Concat", i1, i1, h1, axis=0), axis=1, outputs=3)
        g_ = g.op("Add", g_, g.op("Unsqueeze", b_gate, g.const([1])))
        u_ = g.op("Add", u_, g.op("Unsqueeze", b_up, g.const([1])))
        limit = g.attr_const("limit", "float")
        g_ = g.op("Min", g_, limit)
        u_ = g.op("Max", g.op("Min", u_, limit), g.op("Neg", limit))
        glu = g.op("Mul", g_, g.op("Sigmoid", g.op("Mul", g_, g.attr_const("alpha", "float"))))
        h = g.op("Mul", g.op("Add", u_, g.const(1.0, f32)), glu)
    else:
        h = g.op("Mul", g.op("Mul", g_, g.op("Sigmoid", g_)), u_)
    h = g.op("Cast", g.op("CastLike", h, experts), to=f32)  # rounded to the weights' dtype before down
    y = g.op("MatMul", h, g.op("Transpose", down, perm=[0, 2, 1]))  # [E, T, H]
    if activation == "gpt_oss":
        y = g.op("Add", y, g.op("Unsqueeze", b_down, g.const([1])))
    onehot = g.op("OneHot", g.op("Cast", ids, to=TensorProto.INT64), g.op("Add", e1, g.const([1])),
                  g.const([0.0, 1.0], f32), axis=-1)  # [T, K, E + 1]
    rounded = g.op("Cast", g.op("CastLike", weights, x), to=f32)  # (round_weights: to x's dtype, as read)
    used = g.op("Where", g.op("Equal", g.attr_const("round_weights"), g.const(1)), rounded, weights)
    combine = g.op("ReduceSum", g.op("Mul", onehot, g.op("Unsqueeze", used, g.const([2]))), g.const([1]),
                   keepdims=0)  # [T, E + 1]
    combine = g.op("Slice", combine, g.const([0]), e1, g.const([1]))  # [T, E]
    out = g.op("ReduceSum", g.op("Mul", g.op("Unsqueeze", g.op("Transpose", combine, perm=[1, 0]), g.const([2])), y),
               g.const([0]), keepdims=0)  # [T, H]
    g.op("CastLike", out, x, outputs=["out"])
    inputs = [x, ids, weights, experts] + (["biases"] if activation == "gpt_oss" else [])
    return g.function(reference_name(MOE, activation), inputs, ["out"], MOE_FIELDS + _PLUGIN_ATTRS,
                      doc=f"Reference of the MoespecBudgetedMoe plugin, {activation} experts: fp32 sums.")


def reference_name(plugin: str, variant: str) -> str:
    """The model-local function that runs ``plugin``'s ``variant`` (a router family, or an activation)."""
    return f"{plugin}_{variant}"


def reference_functions() -> list[onnx.FunctionProto]:
    """The plugin ops' reference bodies, as model-local functions: one per router family and activation."""
    return [_route_function(f) for f in _FAMILY_CODES] + [_moe_function(a) for a in _ACTIVATION_CODES]


def reference_variant(node: onnx.NodeProto) -> str:
    """The reference function a plugin node runs as; ValueError when the node uses a variant the
    reference bodies do not implement."""
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    if node.op_type == ROUTE:
        if attrs["coverage"] != 0 or attrs["has_token_weights"] or attrs.get("score", 0) != 0:
            raise ValueError(f"{node.name}: the reference MoespecRouteExperts covers budgets without coverage, "
                             f"token weights or the gates score")
        family = _FAMILY_NAMES.get(attrs["family"])
        if family is None or attrs["has_bias"] != (family == "deepseek_v3"):
            raise ValueError(f"{node.name}: the reference MoespecRouteExperts takes a bias exactly for the "
                             f"deepseek_v3 family (family {attrs['family']}, has_bias {attrs['has_bias']})")
        return reference_name(ROUTE, family)
    if node.op_type == MOE:
        activation = _ACTIVATION_NAMES.get(attrs["activation"])
        if activation is None or attrs["has_biases"] != (activation == "gpt_oss"):
            raise ValueError(f"{node.name}: the reference MoespecBudgetedMoe covers SwiGLU experts without biases "
                             f"and GPT-OSS experts with them")
        return reference_name(MOE, activation)
    raise ValueError(f"{node.name}: {node.op_type} is not a moespec plugin with a reference body")


def with_reference_functions(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` whose plugin nodes run as the reference functions (for onnxruntime): each
    node is renamed to its variant's function, which the copy carries."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for node in out.graph.node:
        if node.domain == PLUGIN_DOMAIN:
            node.op_type = reference_variant(node)
    out.functions.extend(reference_functions())
    return out
