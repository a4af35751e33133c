"""Cost-aware draft counts per batch size: how many EAGLE chain drafts a step should verify.

Serving engines that draft chains (vLLM 0.32's EAGLE-3) verify the same number of drafts K for
every request of a step, and vLLM chooses K per step from a batch-size schedule
(``speculative_config["num_speculative_tokens_per_batch_size"]``: inclusive ranges
``(first batch, last batch, K)``). This module writes that schedule from the cost model: at batch B
each K in 0..max_drafts is priced as

    speed-up(B, K) = AL(K) t_ar(B) / (draft(K, B) + t_verify(B, K))     (K = 0: 1, plain decoding)

with t_ar and t_verify :func:`moespec.cost.step_cost.step_cost` of B and B (K + 1) tokens, their
unique experts per layer predicted by the coactivation model (IPF, :mod:`moespec.cost.coactivation`)
for B chains of K + 1 tokens and capped by the expert budget if one applies, draft(K, B) K head
forwards (:func:`moespec.cost.step_cost.draft_seconds`), and AL(K) = 1 + a + ... + a^K from the
per-level acceptance a (:func:`per_level_acceptance`). K is the argmax (the smaller on a tie): the
same rule as the cost-aware tree (:mod:`moespec.spec.cost_aware`: expected accepted tokens per
predicted second), restricted to the chains vLLM can verify.

Dimensions: B batch (requests), K drafts per request, N experts.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from moespec.cost.coactivation import CoactivationModel
from moespec.cost.hardware import Hardware
from moespec.cost.relations import Group
from moespec.cost.shapes import MoeShape
from moespec.cost.step_cost import draft_seconds, step_cost

MAX_BATCH = 4096
MAX_DRAFTS = 16


def per_level_acceptance(acceptance: float, depth: int) -> float:
    """a with 1 + a + ... + a^depth = ``acceptance`` (tokens a step with ``depth`` drafts)."""
    if depth < 1:
        raise ValueError(f"depth: the drafts the acceptance was measured with, >= 1, got {depth}")
    if not 1.0 <= acceptance <= depth + 1:
        raise ValueError(f"acceptance: tokens per step with {depth} drafts lie in [1, {depth + 1}], got {acceptance}")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        a = (lo + hi) / 2
        lo, hi = (a, hi) if sum(a**d for d in range(depth + 1)) < acceptance else (lo, a)
    return (lo + hi) / 2


def batch_grid(max_batch: int) -> list[int]:
    """The batch sizes priced: 1-8 each, then steps of a quarter (10, 12, 15, 18, 22, ...), and max_batch."""
    out, b = list(range(1, min(max_batch, 8) + 1)), 8
    while b < max_batch:
        step = max(1, b // 4)
        b = min(b + step, max_batch)
        out.append(b)
    return out


def price_chains(shape: MoeShape, hw: Hardware, routing: CoactivationModel, *, batch: int, level_acceptance: float,
                 max_drafts: int, context: int, budget: Optional[int] = None) -> list[dict[str, Any]]:
    """One row per K in 0..max_drafts at ``batch``: acceptance length, step times, speed-up."""
    unique_ar = routing.predict([Group.chain(1)] * batch, "ipf")
    t_ar = step_cost(shape, hw, tokens=batch, requests=batch, context=context, unique=unique_ar).seconds
    rows = [{"drafts": 0, "acceptance": 1.0, "unique": float(unique_ar.mean()), "ar_ms": t_ar * 1e3,
             "step_ms": t_ar * 1e3, "speedup": 1.0}]
    for k in range(1, max_drafts + 1):
        unique = routing.predict([Group.chain(k + 1)] * batch, "ipf")
        if budget is not None:
            unique = np.minimum(unique, float(budget))
        t_ver = step_cost(shape, hw, tokens=batch * (k + 1), requests=batch, context=context, unique=unique).seconds
        t_draft = draft_seconds(shape, hw, depth=k, top_k=1, requests=batch)
        al = float(sum(level_acceptance**d for d in range(k + 1)))
        rows.append({"drafts": k, "acceptance": al, "unique": float(unique.mean()), "ar_ms": t_ar * 1e3,
                     "step_ms": (t_draft + t_ver) * 1e3, "speedup": al * t_ar / (t_draft + t_ver)})
    return rows


def draft_schedule(shape: MoeShape, hw: Hardware, routing: CoactivationModel, *, acceptance: float, depth: int,
                   max_batch: int = 64, max_drafts: int = 7, context: int = 1024, budget: Optional[int] = None,
                   batches: Optional[Sequence[int]] = None) -> dict[str, Any]:
    """The cost-optimal drafts per batch size and vLLM's schedule of them.

    ``acceptance``: tokens per step measured with ``depth`` chain drafts (it fixes the per-level
    acceptance); ``budget``: MoE-Spec's cap on unique experts per layer of a verify pass (the
    acceptance should then be measured under it). Batch sizes between the priced ones take the K of
    the priced size below. Returns ``{"num_speculative_tokens_per_batch_size": [[first, last, K],
    ...], "rows": [per priced batch: its best K and every K's prices], ...}``.
    """
    if not 1 <= max_batch <= MAX_BATCH:
        raise ValueError(f"max_batch must be in [1, {MAX_BATCH}], got {max_batch}")
    if not 1 <= max_drafts <= MAX_DRAFTS:
        raise ValueError(f"max_drafts must be in [1, {MAX_DRAFTS}], got {max_drafts}")
    if not 0 <= context <= 1_000_000:
        raise ValueError(f"context must be in [0, 1000000], got {context}")
    if budget is not None and not shape.top_k <= budget <= shape.num_experts:
        raise ValueError(f"budget must be in [top_k={shape.top_k}, {shape.num_experts}], got {budget}")
    if routing.num_experts != shape.num_experts or routing.top_k != shape.top_k:
        raise ValueError(f"routing model of {routing.num_experts} experts top-{routing.top_k} does not match the "
                         f"shape's {shape.num_experts} top-{shape.top_k}")
    a = per_level_acceptance(acceptance, depth)
    grid = sorted(set(batches)) if batches is not None else batch_grid(max_batch)
    if grid[0] != 1 or grid[-1] > max_batch:
        raise ValueError(f"batches must start at 1 and not exceed max_batch={max_batch}, got {grid}")
    rows = []
    for b in grid:
        prices = price_chains(shape, hw, routing, batch=b, level_acceptance=a, max_drafts=max_drafts,
                              context=context, budget=budget)
        best = max(prices, key=lambda r: (r["speedup"], -r["drafts"]))
        rows.append({"batch": b, "drafts": best["drafts"], "speedup": best["speedup"], "prices": prices})
    ranges: list[list[int]] = []
    for i, row in enumerate(rows):
        last = rows[i + 1]["batch"] - 1 if i + 1 < len(rows) else max_batch
        if ranges and ranges[-1][2] == row["drafts"]:
            ranges[-1][1] = last
        else:
            ranges.append([row["batch"], last, row["drafts"]])
    return {"num_speculative_tokens_per_batch_size": ranges, "num_speculative_tokens": max(1, max(
        r[2] for r in ranges)), "level_acceptance": a, "acceptance": acceptance, "depth": depth,
        "max_batch": max_batch, "max_drafts": max_drafts, "context": context, "budget": budget,
        "hardware": hw.name, "shape": shape.name, "rows": rows}


def format_schedule(s: dict[str, Any]) -> str:
    lines = [f"{s['shape']} on {s['hardware']}: acceptance {s['acceptance']:.2f} at {s['depth']} drafts "
             f"(per level {s['level_acceptance']:.3f}), context {s['context']}"
             + (f", budget {s['budget']}" if s["budget"] else ""),
             f"{'batch':>6}{'drafts':>8}{'x ar':>7}   speed-up by drafts 0..{s['max_drafts']}"]
    for row in s["rows"]:
        lines.append(f"{row['batch']:>6}{row['drafts']:>8}{row['speedup']:>7.2f}   "
                     + " ".join(f"{p['speedup']:.2f}" for p in row["prices"]))
    lines.append("vLLM: speculative_config['num_speculative_tokens_per_batch_size'] = "
                 f"{s['num_speculative_tokens_per_batch_size']} (num_speculative_tokens "
                 f"{s['num_speculative_tokens']})")
    return "\n".join(lines)
