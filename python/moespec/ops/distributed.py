"""MoE-Spec's expert budget across data-parallel ranks: one budget set for the whole expert-parallel
group.

Under expert parallelism each EP rank reads its own experts for every token routed to them, from
every rank. Two layouts:

- **tokens replicated across the EP ranks** (tensor-parallel attention, the usual vLLM / SGLang EP):
  every rank routes the same batch with the same logits, and ``route_experts`` is deterministic, so
  every rank computes the same budget set with no communication at all;
- **data-parallel attention** (each rank its own requests, DeepSeek-style DP + EP): a per-rank budget
  would bound each rank's set, but an EP rank reads the union of all of them (up to DP x B experts a
  layer), so it bounds nothing a rank reads. :func:`route_experts_across` chooses one set over the
  union of every rank's tokens instead: the ranks all-gather their router logits (T_r x N floats a
  layer: 64 KB for 64 tokens of 256 experts, next to the token all-to-all the layer runs anyway),
  route the gathered batch together under the budget and keep their own rows, so every rank gets the
  same set, exactly as if one process had routed the whole batch. (An all-reduce of the N expert
  scores would move less, but substitution also needs every token's full probabilities, and a
  gathered batch makes the result bit-identical to single-process routing.)
"""

from __future__ import annotations

from typing import Optional

import torch

from moespec.ops.routing import ExpertBudget, RouterSpec, Routing, route_experts


def route_experts_across(router_logits: torch.Tensor, spec: RouterSpec, budget: Optional[ExpertBudget] = None,
                         bias: Optional[torch.Tensor] = None, *, token_weights: Optional[torch.Tensor] = None,
                         group=None) -> Routing:
    """This rank's tokens routed under one budget set chosen over every rank's tokens.

    Every rank of ``group`` (a ``torch.distributed`` process group; default: the world) must call it
    for the same layer and pass, with the same ``spec``, ``budget``, ``bias`` and logits dtype, and
    ``token_weights`` given on all or none; ranks may hold different numbers of tokens (0 included). Returns this rank's rows of the gathered batch's routing:
    ``ids`` and ``weights`` [T_rank, K]; ``active_padded`` and ``stats`` are the whole group's (the
    experts the pass reads across the EP group)."""
    import torch.distributed as dist

    if router_logits.dim() != 2:
        raise ValueError(f"router_logits: expected a 2-d tensor [T, N], got shape {tuple(router_logits.shape)}")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    T, N = router_logits.shape
    sizes = [torch.zeros(1, dtype=torch.int64, device=router_logits.device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([T], dtype=torch.int64, device=router_logits.device), group=group)
    counts = [int(s.item()) for s in sizes]
    longest = max(counts)

    def gather(rows: torch.Tensor) -> torch.Tensor:
        padded = rows.new_zeros((longest, *rows.shape[1:]))
        padded[:T] = rows
        parts = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(parts, padded.contiguous(), group=group)
        return torch.cat([p[:n] for p, n in zip(parts, counts)])

    logits = gather(router_logits)
    weights = gather(token_weights.float()) if token_weights is not None else None
    routed = route_experts(logits, spec, budget, bias, token_weights=weights)
    start = sum(counts[:rank])
    return Routing(routed.ids[start:start + T], routed.weights[start:start + T], routed.active_padded,
                   routed.stats_tensor)
