"""route_experts_across (moespec.ops.distributed): data-parallel ranks, each with its own tokens, get
one budget set over the union of their tokens: every rank's rows equal the same rows of routing the
whole batch in one process, and every rank reports the same set. Two processes, gloo, on the CPU."""

from __future__ import annotations

import json

import pytest
import torch
import torch.multiprocessing as mp

from moespec.ops import ExpertBudget, RouterSpec, route_experts

N, K, SIZES = 32, 4, (5, 0, 9)  # rank 1 has no tokens this pass
CASES = [(RouterSpec("softmax", K, True), ExpertBudget(8)), (RouterSpec("softmax", K, True), ExpertBudget(6, "truncation")),
         (RouterSpec("deepseek_v3", K, True, n_group=4, topk_group=2, scaling=2.0), ExpertBudget(10))]


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(SIZES), N, generator=g), torch.rand(N, generator=g), torch.rand(sum(SIZES), generator=g)


def _rank(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist

    from moespec.ops.distributed import route_experts_across

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    results = []
    for i, (spec, budget) in enumerate(CASES):
        logits, bias, tw = _batch(i)
        start = sum(SIZES[:rank])
        rows = slice(start, start + SIZES[rank])
        bias = bias if spec.family == "deepseek_v3" else None
        r = route_experts_across(logits[rows], spec, budget, bias, token_weights=tw[rows])
        results.append({"ids": r.ids.tolist(), "weights": r.weights.tolist(), "active": r.active.tolist(),
                        "stats": r.stats_tensor.tolist()})
    dist.destroy_process_group()
    with open(f"{out}.{rank}", "w") as f:
        json.dump(results, f)


def test_every_rank_gets_its_rows_of_one_routing_of_the_whole_batch(tmp_path):
    world = len(SIZES)
    mp.start_processes(_rank, args=(world, f"file://{tmp_path / 'store'}", str(tmp_path / "out")), nprocs=world,
                       join=True, start_method="spawn")
    got = [json.loads((tmp_path / f"out.{r}").read_text()) for r in range(world)]
    for i, (spec, budget) in enumerate(CASES):
        logits, bias, tw = _batch(i)
        want = route_experts(logits, spec, budget, bias if spec.family == "deepseek_v3" else None, token_weights=tw)
        assert want.stats.natural_unique > budget.max_experts  # the budget binds over the union
        for rank in range(world):
            start = sum(SIZES[:rank])
            g = got[rank][i]
            assert g["ids"] == want.ids[start:start + SIZES[rank]].tolist()
            assert g["weights"] == want.weights[start:start + SIZES[rank]].tolist()
            assert g["active"] == want.active.tolist() and g["stats"] == want.stats_tensor.tolist()  # one set


def test_a_rank_with_a_bad_tensor_gets_a_clear_error():
    from moespec.ops.distributed import route_experts_across

    with pytest.raises(ValueError, match="router_logits"):
        route_experts_across(torch.zeros(4), RouterSpec("softmax", 2))
