"""Predicted speed-up of speculative decoding against batch size and tree size, for any MoE shape.

For a shape on a hardware profile, at batch B with a draft tree of n nodes (root included) and
acceptance length AL (tokens emitted per speculative step):

    t_ar(B)   = step_cost(B tokens of B requests, U = E[unique | B x chain:1])
    t_spec(B) = draft_seconds(depth, top_k, B) + step_cost(B n tokens, U = E[unique | B x tree])
    speed-up  = AL t_ar(B) / t_spec(B)

with the unique experts from the IPF model (:mod:`moespec.cost.coactivation`) and from the
independence baseline. A shape we cannot run gets its routing statistics by transfer
(:func:`transfer`): the expert-share profile of a trace's model resampled to the shape's N experts
and its pooled relation lifts, or, without a model, SYNTHETIC_LIFTS with uniform marginals.

Dimensions: B batch (requests), n tree nodes, N experts, K top-k.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence, Union

import numpy as np

from moespec.cost.coactivation import CoactivationModel, _pooled
from moespec.cost.hardware import Hardware
from moespec.cost.relations import RELATIONS, Group
from moespec.cost.shapes import MoeShape
from moespec.cost.step_cost import draft_seconds, step_cost

# the default engine's pooled lifts (README "The IPF model of unique experts"), rounded: the
# stated parameters of the synthetic routing used when no model is given
SYNTHETIC_LIFTS = {"parent": 1.55, "sibling": 1.65, "ancestor": 1.25, "cousin": 1.45, "seq1": 1.6, "seq2": 1.45,
                   "seq4": 1.4, "seq8": 1.2, "cross": 0.97}


def transfer(num_experts: int, top_k: int, model: Optional[CoactivationModel] = None) -> CoactivationModel:
    """A one-layer model for N experts, top-K: from ``model`` (its sorted expert-share profile,
    averaged over layers, resampled to N and scaled to sum K; its pooled lifts) or synthetic."""
    if model is None:
        marginals = np.full((1, num_experts), top_k / num_experts)
        lifts = {r: np.full((1, num_experts), SYNTHETIC_LIFTS[r]) for r in RELATIONS}
        source = {"routing": "synthetic", "lifts": SYNTHETIC_LIFTS}
    else:
        profile = np.sort(model.marginals, axis=-1)[:, ::-1].mean(0)  # [N_src], descending
        src = (np.arange(len(profile)) + 0.5) / len(profile)
        dst = (np.arange(num_experts) + 0.5) / num_experts
        share = np.interp(dst, src, profile / profile.sum())
        marginals = np.minimum(share / share.sum() * top_k, 0.999)[None]
        pooled = {r: float(_pooled(model.lifts[r], model.marginals).mean()) if model.pairs[r] else 1.0
                  for r in RELATIONS}
        lifts = {r: np.full((1, num_experts), v) for r, v in pooled.items()}
        source = {"routing": "transferred", "from": model.source.get("meta", {}).get("model"), "lifts": pooled}
    pairs = {r: 1 for r in RELATIONS}
    return CoactivationModel(num_experts, top_k, [0], marginals, lifts, pairs, source)


def tree_group(tree: str) -> tuple[Group, int, int]:
    """(the request's Group, draft depth, draft top_k) of ``depth,top_k,total`` or ``chain:n``."""
    from moespec.cost.relations import parse_tree

    group = parse_tree(tree)
    if tree.strip().startswith("chain:"):
        return group, group.n - 1, 1
    depth, top_k, _ = (int(x) for x in tree.split(","))
    return group, depth, top_k


def predict_speedup(shape: MoeShape, hw: Hardware, *, batches: Sequence[int], tree: str, acceptance: float,
                    context: int, routing: CoactivationModel) -> list[dict[str, Any]]:
    """One row per batch size: AR and verify step times and the speed-up, with IPF and independence."""
    if acceptance < 1:
        raise ValueError(f"--acceptance must be >= 1 (tokens per step), got {acceptance}")
    group, depth, top_k = tree_group(tree)
    rows = []
    for B in batches:
        if not 1 <= B <= 4096:
            raise ValueError(f"--batch sizes must be in [1, 4096], got {B}")
        row: dict[str, Any] = {"batch": B, "tree_tokens": group.n}
        draft = draft_seconds(shape, hw, depth=depth, top_k=top_k, requests=B) if depth else 0.0
        for predictor in ("ipf", "independent"):
            u_ar = float(routing.predict([Group.chain(1)] * B, predictor)[0])
            u_spec = float(routing.predict([group] * B, predictor)[0])
            t_ar = step_cost(shape, hw, tokens=B, requests=B, context=context, unique=u_ar).seconds
            t_ver = step_cost(shape, hw, tokens=B * group.n, requests=B, context=context, unique=u_spec).seconds
            row[predictor] = {"unique_ar": u_ar, "unique_verify": u_spec, "ar_ms": t_ar * 1e3,
                              "verify_ms": t_ver * 1e3, "draft_ms": draft * 1e3,
                              "speedup": acceptance * t_ar / (draft + t_ver)}
        rows.append(row)
    return rows


def tree_sizes(max_tokens: int = 64) -> list[str]:
    """EAGLE-2 trees of growing size: depth = log2-ish of the nodes, top_k 4 (total 1, 2, 4, ...)."""
    out, total = [], 1
    while total <= max_tokens:
        depth = max(1, min(8, int(np.ceil(np.log2(total + 1)))))
        out.append(f"{depth},4,{total}")
        total *= 2
    return out


def scaled_acceptance(acceptance: float, depth: int, new_depth: int) -> float:
    """AL of a tree of ``new_depth`` levels given AL at ``depth`` levels, if each level's token is
    accepted with the same probability a: AL = 1 + a + ... + a^depth (solved for a, then re-applied)."""
    from moespec.cost.schedule import per_level_acceptance

    if depth < 1 or acceptance <= 1:
        return acceptance
    a = per_level_acceptance(min(acceptance, depth + 1), depth)
    return float(sum(a**d for d in range(new_depth + 1)))


def acceptance_from_trace(trace) -> float:
    """Mean tokens emitted per verify step of a trace: a request's next root lies that far ahead."""
    roots = (trace.kind == 2) & (trace.parent < 0)
    out = []
    for req in np.unique(trace.request[roots]):
        pos = np.sort(trace.position[roots & (trace.request == req)])
        out.extend(np.diff(pos).tolist())
    if not out:
        raise ValueError("the trace has no two verify passes of one request to measure acceptance on")
    return float(np.mean(out))


def _label(routing: CoactivationModel) -> str:
    src = routing.source
    if src.get("routing") == "synthetic":
        return "routing: synthetic (uniform shares, the default engine's lifts rounded)"
    return f"routing: transferred from {Path(str(src.get('from'))).name}'s trace (share profile, pooled lifts)"


def speedup_plot(results: dict[str, list[dict[str, Any]]], path: Union[str, Path], *, title: str,
                 x_key: str = "batch", x_label: str = "batch size (requests)") -> Path:
    from moespec.bench.plots import _pyplot, _save

    import textwrap

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5.4))
    cmap = plt.get_cmap("tab20")
    for i, (name, rows) in enumerate(results.items()):
        color = cmap((2 * i) % 20 + (i // 10) % 2)
        xs = [r[x_key] for r in rows]
        ax.plot(xs, [r["ipf"]["speedup"] for r in rows], "-o", color=color, ms=3, label=name)
        ax.plot(xs, [r["independent"]["speedup"] for r in rows], "--", color=color, alpha=0.6)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel(x_label)
    ax.set_ylabel("predicted speed-up over plain decoding")
    ax.set_title("\n".join(textwrap.wrap(title, 110)) + "\n(solid: IPF unique experts, dashed: independence)",
                 fontsize=8)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    return _save(plt, fig, Path(path))
