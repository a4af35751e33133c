"""Cost-aware draft-tree selection (EcoSpec; DESIGN.md "Cost-aware tree"): the plain-Python reference.

After EAGLE-2's expansion, the verify set is chosen node by node, ancestor-closed, by value against
marginal cost. With a candidate c's cumulative draft log-probability s_c (exp(s_c) estimates the
probability that its whole path is accepted, EAGLE-2's assumption), its predicted experts E_l(c)
per MoE layer and the dynamic expert buffer B_l (the experts the verify pass already pays for:
the root's, then those of every node chosen so far),

    gain(c) = value_s * exp(s_c) - (token_s + sum_l expert_s[l] * |E_l(c) \\ B_l|)

the frontier candidate (its parent is the root or chosen) of largest gain is added (ties: EAGLE-2's
order, score desc, depth asc, index asc), its experts join the buffer, until the best gain is <= 0
or ``total_tokens`` nodes are chosen. ``value_s`` is the time one accepted token saves (a decode
step), ``token_s`` the verify time one more token costs besides new experts, ``expert_s[l]`` the
time to read one more expert of layer l (:func:`selection_costs` prices them with the cost model).
With zero costs it is exactly EAGLE-2's selection (the best ``total_tokens`` candidates: a child
never scores above its parent, so the best remaining candidate is always on the frontier).

The C++ tree core will implement the same rule beside EAGLE-2's; this reference is what it is tested
against. Dimensions: C candidates, L MoE layers, K predicted experts per node, N experts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class SelectionCosts:
    value_s: float  # time one accepted token saves
    token_s: float  # verify time of one more token, besides new experts
    expert_s: np.ndarray  # [L]: time of one more expert per layer

    def __post_init__(self) -> None:
        if self.value_s < 0 or self.token_s < 0 or (np.asarray(self.expert_s) < 0).any():
            raise ValueError("selection costs must be >= 0")


def marginal_cost(predicted: np.ndarray, buffer: np.ndarray, costs: SelectionCosts) -> float:
    """token_s + sum_l expert_s[l] * (experts of ``predicted`` [L, K] not in ``buffer`` [L, N] bool)."""
    L = predicted.shape[0]
    new = np.array([len(set(predicted[l].tolist()) - set(np.flatnonzero(buffer[l]).tolist())) for l in range(L)])
    return float(costs.token_s + (np.asarray(costs.expert_s) * new).sum())


def select_cost_aware(parents: Sequence[int], depth: Sequence[int], scores: Sequence[float], predicted: np.ndarray,
                      buffer: np.ndarray, costs: SelectionCosts, total_tokens: int) -> list[int]:
    """The chosen candidate indices, in the order chosen.

    parents [C]: candidate index of the parent, -1 for the root's children; depth [C]; scores [C]
    cumulative log-probs; predicted [C, L, K] expert ids; buffer [L, N] bool, the root's experts
    (copied, not changed)."""
    C = len(parents)
    if not (len(depth) == len(scores) == C == predicted.shape[0]):
        raise ValueError("select_cost_aware: parents, depth, scores and predicted need one row per candidate")
    if total_tokens < 1:
        raise ValueError(f"select_cost_aware: total_tokens must be >= 1, got {total_tokens}")
    buf = np.array(buffer, dtype=bool, copy=True)
    chosen: list[int] = []
    is_chosen = np.zeros(C, dtype=bool)
    while len(chosen) < min(total_tokens, C):
        best, best_key = -1, None
        for c in range(C):
            if is_chosen[c] or (parents[c] >= 0 and not is_chosen[parents[c]]):
                continue
            value = costs.value_s * math.exp(scores[c]) if math.isfinite(scores[c]) else 0.0
            gain = value - marginal_cost(predicted[c], buf, costs)
            key = (gain, scores[c], -depth[c], -c)
            if best_key is None or key > best_key:
                best, best_key = c, key
        if best < 0 or (best_key[0] <= 0 and (costs.token_s > 0 or np.asarray(costs.expert_s).any())):
            break
        chosen.append(best)
        is_chosen[best] = True
        for layer, experts in enumerate(predicted[best]):
            buf[layer, experts] = True
    return chosen


def select_cost_aware_native(parents, depth, scores, predicted, buffer, costs: SelectionCosts,
                             total_tokens: int) -> list[int]:
    """:func:`select_cost_aware` in the C++ tree core (``moespec._native.select_cost_aware``,
    cpp/include/moespec/select_cost_aware.h): same arguments, same result."""
    import torch

    from moespec._loader import native
    from moespec._tensor import view

    parents_t = torch.as_tensor(np.asarray(parents), dtype=torch.int32).contiguous()  # [C]
    depth_t = torch.as_tensor(np.asarray(depth), dtype=torch.int32).contiguous()  # [C]
    scores_t = torch.as_tensor(np.asarray(scores), dtype=torch.float32).contiguous()  # [C]
    predicted_t = torch.as_tensor(np.asarray(predicted), dtype=torch.int32).contiguous()  # [C, L, K]
    buffer_t = torch.as_tensor(np.asarray(buffer), dtype=torch.uint8).contiguous()  # [L, N]
    expert_t = torch.as_tensor(np.asarray(costs.expert_s), dtype=torch.float32).contiguous()  # [L]
    out = torch.empty(len(parents_t), dtype=torch.int32)  # [C]
    n = native().select_cost_aware(view(parents_t, "parents"), view(depth_t, "depth"), view(scores_t, "scores"),
                                   view(predicted_t, "predicted"), view(buffer_t, "buffer"),
                                   view(expert_t, "expert_s"), view(out, "selected"), float(costs.value_s),
                                   float(costs.token_s), int(total_tokens))
    return out[:n].tolist()


def selection_costs(shape, hw, *, tokens: int, context: int, bytes_per_weight: float = 2.0) -> SelectionCosts:
    """Prices for a verify of about ``tokens`` tokens after ``context`` cached ones on ``hw``, from
    the cost model (:mod:`moespec.cost.step_cost`): value = a decode step's time with top-k experts
    per layer; token = the dense weights' extra time for one more token plus the per-token cost;
    expert = one expert read at one token."""
    from moespec.cost.step_cost import step_cost

    decode = step_cost(shape, hw, tokens=1, requests=1, context=context, unique=float(shape.top_k),
                       bytes_per_weight=bytes_per_weight)
    dense = shape.dense_params * bytes_per_weight
    token = (hw.matrix_seconds(dense, tokens + 1, bytes_per_weight) - hw.matrix_seconds(dense, tokens, bytes_per_weight)
             + hw.token_layer_us * 1e-6 * shape.layers)
    expert = hw.expert_seconds(shape.expert_params * bytes_per_weight, 1.0, bytes_per_weight)
    return SelectionCosts(decode.seconds, max(token, 0.0), np.full(shape.moe_layers, expert))


# ---- the selector of the eco policies ------------------------------------------------------------

def default_hardware():
    """The profile the eco policies price nodes with: MOESPEC_HARDWARE (a name or a profile .json,
    see moespec.cost.hardware.hardware) when set, else a rough 2-core CPU estimate (measure yours
    with `moespec analyze profile --engine <engine> --out cpu.json`)."""
    import os

    from moespec.cost.hardware import Hardware, hardware

    if os.environ.get("MOESPEC_HARDWARE"):
        return hardware(os.environ["MOESPEC_HARDWARE"])
    return Hardware("cpu-estimate", 15.0, 0.1, 300.0, "a 2-core CPU estimate (set MOESPEC_HARDWARE to a measured "
                    "profile)", {1: 14.0, 8: 9.0, 64: 1.5}, expert_gbs={1: 9.0, 2: 12.0, 8: 7.0}, token_layer_us=27.0)


class CostAwareTrees:
    """Chooses each request's verify set after EAGLE-2's expansion (the ``eco`` policies): every
    candidate's experts predicted from its parent's draft hidden state and its token, the batch's
    buffer started with each root's predicted experts, then :func:`select_cost_aware_native`
    request by request (the buffer is the batch's union: one verify pass reads it)."""

    def __init__(self, target, predictor, costs: SelectionCosts, total_tokens: int):
        predictor.check_target(target.config)
        self.target, self.predictor, self.costs, self.total_tokens = target, predictor, costs, total_tokens
        self.top_k = target.config.moe.top_k

    def trees(self, builder, roots: Sequence[int], root_hidden, level_hidden: Sequence) -> list:
        """roots [B]; root_hidden [B, H]: the draft state that proposed level 1; level_hidden[i]
        [B, K, H]: the frontier states that proposed level i + 2 (slot s -> candidates C_i + s K + j)."""
        import torch

        from moespec.spec.tree import tree_from_selection

        embed = self.target.weights.embed
        B = len(roots)
        L, N = self.predictor.num_layers, self.predictor.num_experts
        root_pred = self.predictor.predict(root_hidden, embed[torch.tensor(roots)], self.top_k)  # [B, L, k]
        buffer = np.zeros((L, N), dtype=bool)
        for b in range(B):
            for layer in range(L):
                buffer[layer, root_pred[b, layer].numpy()] = True
        out = []
        for b in range(B):
            cands = builder.candidates(b)
            C = len(cands.tokens)
            K = int(builder.top_k)
            parent_h = [root_hidden[b].expand(min(K, C), -1)]
            start = K
            for h in level_hidden:
                if start >= C:
                    break
                parent_h.append(h[b].repeat_interleave(K, dim=0)[: C - start])  # [K K, H]
                start += K * K
            parent = torch.cat(parent_h)[:C]  # [C, H]
            predicted = self.predictor.predict(parent, embed[cands.tokens], self.top_k).numpy().astype(np.int32)
            chosen = select_cost_aware_native(cands.parents.numpy(), cands.depth.numpy(), cands.scores.numpy(),
                                              predicted, buffer, self.costs, self.total_tokens)
            for c in chosen:
                for layer in range(L):
                    buffer[layer, predicted[c, layer]] = True
            out.append(tree_from_selection(int(roots[b]), cands, chosen))
        return out
