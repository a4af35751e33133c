"""Plain-torch reference implementations of moespec's native ops (gpt-fast style, no tricks).

The tests hold every native kernel against these, and the op benchmarks time them as the
"plain torch" baseline. They follow the semantics documented in cpp/include/moespec/route_experts.h
with ordinary torch ops, so on the CPU they round exactly as the native code does.
"""

from __future__ import annotations

from typing import Optional

import torch

from moespec.ops.routing import ExpertBudget, RouterSpec, RoutingStats

# T tokens, N experts, K top-k, B budget.


def route_experts_reference(
    router_logits: torch.Tensor,
    spec: RouterSpec,
    budget: Optional[ExpertBudget] = None,
    bias: Optional[torch.Tensor] = None,
    token_weights: Optional[torch.Tensor] = None,
    *,
    exact_score_order: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, RoutingStats]:
    """Returns ``(ids int32 [T, K], weights float32 [T, K], active int32 [kept], stats)``.

    ``exact_score_order`` sums the budget scores token by token, as the native code does (the tests
    need that for identical results); False uses one vectorised sum (what the benchmarks time).
    """
    T, N = router_logits.shape
    K = spec.top_k
    logits = router_logits.float()  # [T, N]

    # The family's full probability, selection key and natural (unbudgeted) top-k.
    if spec.family == "softmax":
        prob = torch.softmax(logits, dim=-1)  # [T, N]
        key = prob
        natural = prob.topk(K, dim=-1).indices  # [T, K]
    elif spec.family == "deepseek_v3":
        prob = logits.sigmoid()  # [T, N]
        key = prob + bias if bias is not None else prob
        choice = key
        if spec.n_group > 1:
            group_score = key.view(T, spec.n_group, N // spec.n_group).topk(2, dim=-1).values.sum(-1)  # [T, G]
            groups = group_score.topk(spec.topk_group, dim=-1, sorted=False).indices
            keep = torch.zeros_like(group_score).scatter_(1, groups, 1.0).bool()
            choice = key.masked_fill(~keep.repeat_interleave(N // spec.n_group, dim=1), float("-inf"))
        natural = choice.topk(K, dim=-1, sorted=False).indices  # [T, K]
    else:  # gpt_oss: logits already hold the router bias
        prob = torch.softmax(logits, dim=-1)  # [T, N], for budget scores only
        key = router_logits
        natural = router_logits.topk(K, dim=-1).indices  # [T, K]

    ids = natural
    natural_unique = natural.unique().numel()
    rerouted = dropped = 0
    if budget is not None:
        w = token_weights.double() if token_weights is not None else torch.ones(T, dtype=torch.float64)
        if budget.score == "gates":  # the tokens' natural weights, [T, N] with zeros off their top-k
            natural_weights = _family_weights(spec, natural, prob, router_logits)  # [T, K]
            per_expert = torch.zeros(T, N, dtype=torch.float64).scatter_(1, natural, natural_weights.double())
        else:
            per_expert = prob.double()
        if exact_score_order:
            score = torch.zeros(N, dtype=torch.float64)
            for t in range(T):  # summed token by token, as the native code does
                score += w[t] * per_expert[t]
        else:
            score = (w[:, None] * per_expert).sum(0)  # [N]
        order = torch.sort(score, descending=True, stable=True).indices  # ties: lower id first
        if budget.score == "gates":  # the first choices of the weighted tokens rank first
            by_id, perm = natural.sort(dim=-1)  # slots by expert id: argmax takes the lower id on a tie
            best = by_id.gather(1, natural_weights.gather(1, perm).argmax(dim=-1, keepdim=True))[:, 0]  # [T]
            first = torch.zeros(N, dtype=torch.bool)
            first[best[w > 0]] = True
            order = order[torch.sort((~first[order]).to(torch.int8), stable=True).indices]
        B = min(budget.max_experts, N)
        if budget.coverage is not None:
            total = score.cumsum(0)[-1] if N else 0.0
            if total > 0:
                share = score[order].cumsum(0) / total
                m = int((share < budget.coverage).sum()) + 1
            else:
                m = 1
            B = min(B, min(max(m, K), N))
        if B < N and natural_unique > B:
            in_set = torch.zeros(N, dtype=torch.bool)
            in_set[order[:B]] = True
            outside = ~in_set[natural]  # [T, K]
            if budget.policy == "substitution":
                moved = key.masked_fill(~in_set, float("-inf")).topk(K, dim=-1, sorted=spec.family != "deepseek_v3").indices
                stays = ~outside.any(dim=-1, keepdim=True)  # [T, 1]: all natural experts in S
                ids = torch.where(stays, natural, moved)
                # re-routed slots: those holding an expert the token did not choose naturally
                rerouted = int((ids[:, :, None] != natural[:, None, :]).all(dim=-1).sum())
            else:
                dropped = int(outside.sum())
                ids = natural.masked_fill(outside, N)

    weights = _family_weights(spec, ids, prob, router_logits)
    kept = ids < N  # [T, K]
    active = ids[kept].unique().to(torch.int32)  # sorted
    stats = RoutingStats(natural_unique, active.numel(), rerouted, dropped)
    return ids.to(torch.int32), weights, active, stats


def _family_weights(spec: RouterSpec, ids: torch.Tensor, prob: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
    """The family's weights float32 [T, K] on the slots ``ids`` [T, K]; a dropped slot (id N) weighs 0."""
    N = prob.shape[1]
    kept = ids < N  # [T, K]
    slot = ids.clamp(max=N - 1)
    if spec.family == "softmax":
        weights = torch.where(kept, prob.gather(1, slot), 0.0)
        if spec.renormalize:
            total = weights.sum(dim=-1, keepdim=True)
            weights = torch.where(total > 0, weights / total, 0.0)
    elif spec.family == "deepseek_v3":
        weights = torch.where(kept, prob.gather(1, slot), 0.0)
        if spec.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * spec.scaling
    else:
        top = router_logits.gather(1, slot).masked_fill(~kept, float("-inf"))
        weights = torch.softmax(top, dim=1, dtype=top.dtype).float()
        weights = torch.where(kept.any(dim=-1, keepdim=True), weights, 0.0)
    return weights.float()


def moe_experts_reference(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    intermediate_size: int,
    *,
    activation: str = "swiglu",
    biases: Optional[torch.Tensor] = None,
    limit: float = 7.0,
    alpha: float = 1.702,
) -> torch.Tensor:
    """moe_experts' semantics in plain torch: fp32 products and sums; with bf16 weights x and h
    rounded to bf16 before their matmul; results accumulated in fp32, rounded once. [T, H]."""
    T, H = x.shape
    E, I = experts.shape[0], intermediate_size
    bf16 = experts.dtype == torch.bfloat16
    blocks = experts.float().reshape(E, 3, I * H)
    gate, up = blocks[:, 0].reshape(E, I, H), blocks[:, 1].reshape(E, I, H)
    down = blocks[:, 2].reshape(E, H, I)
    xin = x.float()  # x already carries the weights' dtype
    acc = torch.zeros(T, H, dtype=torch.float32)
    for e in range(E):
        token, slot = torch.where(ids == e)
        w = weights[token, slot]
        token, w = token[w != 0], w[w != 0]
        if token.numel() == 0:
            continue
        g, u = xin[token] @ gate[e].T, xin[token] @ up[e].T  # [n, I]
        if activation == "gpt_oss":
            if biases is not None:
                g, u = g + biases[e, :I], u + biases[e, I : 2 * I]
            g, u = g.clamp(max=limit), u.clamp(-limit, limit)
            h = (u + 1) * g * torch.sigmoid(alpha * g)
        else:
            h = torch.nn.functional.silu(g) * u
        if bf16:
            h = h.to(torch.bfloat16).float()
        y = h @ down[e].T  # [n, H]
        if activation == "gpt_oss" and biases is not None:
            y = y + biases[e, 2 * I :]
        acc.index_add_(0, token, w[:, None] * y)
    return acc.to(x.dtype)
