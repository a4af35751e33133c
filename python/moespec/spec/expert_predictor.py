"""Expert predictors for cost-aware draft trees (EcoSpec; DESIGN.md "Cost-aware tree").

A predictor scores, for a draft node not yet verified, each MoE layer's experts for the node's token
in the target. The zero-training baseline here is the **history predictor**: the routing the target
actually used for the request's last ``history`` verified tokens (the node's nearest verified
ancestors: the sequence before the tree's root), each expert scored by its routing weight summed
with recency weights ``decay^age``; ``history=1`` is "the nearest verified ancestor's experts".
Co-routing of neighbouring tokens is what makes it work; :func:`predictor_recall` measures how well
on a routing trace (``moespec analyze predictor``).

Dimensions: m history tokens, L MoE layers, K top-k, N experts, V verify nodes.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np


def history_scores(ids: np.ndarray, weights: np.ndarray, num_experts: int, decay: float = 0.7) -> np.ndarray:
    """ids, weights [m, L, K] of the last m verified tokens (oldest first) -> scores [L, N]."""
    m, L, K = ids.shape
    age = decay ** np.arange(m - 1, -1, -1, dtype=np.float64)  # [m]: 1 for the newest
    scores = np.zeros((L, num_experts))
    for layer in range(L):
        np.add.at(scores[layer], ids[:, layer].reshape(-1), (weights[:, layer] * age[:, None]).reshape(-1))
    return scores


def top_experts(scores: np.ndarray, k: int) -> np.ndarray:
    """The k best-scored experts per layer: [L, N] -> [L, k] (ties: lower id first)."""
    return np.argsort(-scores, axis=-1, kind="stable")[:, :k]


def predictor_recall(trace, histories: Sequence[int] = (1, 4, 16), decay: float = 0.7) -> dict[str, Any]:
    """Recall of the history predictor on a routing trace, for every decode token and every verify
    node whose request has verified tokens before it: per history length, the mean share of a
    token's true top-k experts among the predicted top-k (per layer), and for verify passes the
    share of the request's true union of experts covered by the predicted top-k and by the
    size-matched prediction (top-|union|); chance is k / N, ``population`` the recall of the
    trace's k most used experts per layer (a static predictor, in-sample).

    The verified tokens a trace identifies are its prefill and decode rows and the roots of its
    verify trees (a trace does not record which draft nodes were accepted), so on a verify trace the
    history is the prompt and the earlier roots; on a decode trace it is exact."""
    if not histories or min(histories) < 1:
        raise ValueError(f"history lengths must be >= 1, got {list(histories)}")
    N, K = trace.num_experts, trace.top_k
    sequence: dict[int, dict[int, int]] = {}  # request -> position -> row of a verified token
    out = {h: {"node": [], "union": [], "union_sized": []} for h in histories}
    for start, end in trace.passes():
        kind = int(trace.kind[start])
        for req in np.unique(trace.request[start:end]):
            rows = start + np.flatnonzero(trace.request[start:end] == req)
            seq = sequence.setdefault(int(req), {})
            first = rows[trace.parent[rows] < 0][0] if kind == 2 else rows[0]
            known = sorted(p for p in seq if p < int(trace.position[first]))
            if kind > 0 and known:
                true = trace.ids[rows]  # [V, L, K]
                for h in histories:
                    hist = [seq[p] for p in known[-h:]]
                    scores = history_scores(trace.ids[hist], trace.weights[hist], N, decay)
                    pred = top_experts(scores, K)  # [L, K]
                    out[h]["node"].append((true[:, :, :, None] == pred[None, :, None, :]).any(-1).mean())
                    if kind == 2:
                        for layer in range(true.shape[1]):
                            union = np.unique(true[:, layer])
                            sized = top_experts(scores[layer : layer + 1], len(union))[0]
                            out[h]["union"].append(np.isin(union, pred[layer]).mean())
                            out[h]["union_sized"].append(np.isin(union, sized).mean())
            for r in (rows if kind < 2 else [first]):
                seq[int(trace.position[r])] = int(r)
    # the population's k most used experts per layer (in-sample: the trace's own decode/verify marginals)
    gen = trace.ids[trace.kind > 0]  # [R', L, K]
    counts = np.stack([np.bincount(gen[:, layer].reshape(-1), minlength=N) for layer in range(gen.shape[1])])
    popular = top_experts(counts.astype(np.float64), K)  # [L, K]
    population = float((gen[:, :, :, None] == popular[None, :, None, :]).any(-1).mean()) if len(gen) else None
    summary = {}
    for h in histories:
        o = out[h]
        if not o["node"]:
            raise ValueError("the trace has no decode or verify token after a verified one")
        summary[str(h)] = {"node_recall": float(np.mean(o["node"])), "steps": len(o["node"]),
                           "union_recall_top_k": float(np.mean(o["union"])) if o["union"] else None,
                           "union_recall_top_union": float(np.mean(o["union_sized"])) if o["union"] else None}
    return {"histories": summary, "chance": K / N, "population": population, "decay": decay, "num_experts": N,
            "top_k": K}


def format_recall(r: dict[str, Any]) -> str:
    lines = [f"history predictor (decay {r['decay']}): recall of a token's true top-{r['top_k']} of {r['num_experts']} "
             f"experts per layer; chance {r['chance']:.3f}, population top-{r['top_k']} (in-sample) "
             f"{r['population']:.3f}" if r["population"] is not None else "",
             f"{'history':>8}{'tokens':>9}{'node recall':>13}{'union recall (top-k)':>22}{'(top-|union|)':>15}"]
    for h, s in r["histories"].items():
        u, us = s["union_recall_top_k"], s["union_recall_top_union"]
        lines.append(f"{h:>8}{s['steps']:>9}{s['node_recall']:>13.3f}{'-' if u is None else f'{u:.3f}':>22}"
                     f"{'-' if us is None else f'{us:.3f}':>15}")
    return "\n".join(lines)
