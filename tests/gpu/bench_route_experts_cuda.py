"""Times route_experts on CUDA against the CPU op and plain torch (tests/gpu/run.sh runs it).

Softmax routing with renormalisation, k = 8, ExpertBudget(16) (substitution), float32 logits, at
T in {1, 16, 64} and N in {64, 128, 256}. Microseconds per call, columns:
  cuda op          moespec.ops.route_experts on CUDA tensors, eager (Python wrapper, output and
                   workspace allocation and 4 kernel launches), timed with CUDA events
  cuda graph       the same op captured 20 times in one CUDA graph, replayed: the GPU work alone
  torch topk       plain torch on CUDA, no budget: softmax, topk, renormalise
  torch budget     plain torch on CUDA with a budget: scores, top-B set, masked topk, renormalise
                   (always budgets, unlike the op, which is exact when the cap does not bind)
  cpu op           moespec.ops.route_experts on CPU tensors (time.perf_counter)
  cpu reference    moespec.ops.reference.route_experts_reference on CPU tensors
Usage: PYTHONPATH=python python3 tests/gpu/bench_route_experts_cuda.py
"""

from __future__ import annotations

import inspect
import time

import torch
from gpu_common import graph_seconds

from moespec.ops import ExpertBudget, RouterSpec, route_experts
from moespec.ops.reference import route_experts_reference

# T tokens, N experts, K top-k, B budget.
K, B = 8, 16
T_SIZES = (1, 16, 64)
N_SIZES = (64, 128, 256)
CUDA_ITERS, GRAPH_CALLS, GRAPH_REPLAYS, CPU_ITERS, REF_ITERS = 200, 20, 20, 200, 20


def cuda_us(fn, iters: int) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def cpu_us(fn, iters: int) -> float:
    fn()
    begin = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - begin) * 1e6 / iters


def graph_us(fn) -> float:
    return graph_seconds(fn, GRAPH_CALLS, GRAPH_REPLAYS) * 1e6


def torch_topk(logits: torch.Tensor):
    prob = torch.softmax(logits.float(), dim=-1)  # [T, N]
    weights, ids = prob.topk(K, dim=-1)  # [T, K]
    return ids, weights / weights.sum(dim=-1, keepdim=True)


def torch_budget(logits: torch.Tensor):
    prob = torch.softmax(logits.float(), dim=-1)  # [T, N]
    keep = prob.sum(dim=0).topk(B).indices  # [B]
    outside = torch.ones(prob.shape[1], dtype=torch.bool, device=prob.device).index_fill_(0, keep, False)  # [N]
    weights, ids = prob.masked_fill(outside, float("-inf")).topk(K, dim=-1)  # [T, K]
    return ids, weights / weights.sum(dim=-1, keepdim=True)


def main() -> None:
    spec, budget = RouterSpec("softmax", K, True), ExpertBudget(B)
    ref_kwargs = {"exact_score_order": False} if "exact_score_order" in inspect.signature(
        route_experts_reference).parameters else {}
    print(f"route_experts, softmax renormalize, k={K}, ExpertBudget({B}), float32 logits; "
          f"{torch.cuda.get_device_name()}; microseconds per call")
    columns = ("cuda op", "cuda graph", "torch topk", "torch budget", "cpu op", "cpu reference")
    print(f"{'T':>4} {'N':>5} " + " ".join(f"{c:>13}" for c in columns))
    gen = torch.Generator().manual_seed(0)
    for T in T_SIZES:
        for N in N_SIZES:
            cpu_logits = torch.randn(T, N, generator=gen)  # [T, N]
            logits = cpu_logits.cuda()
            row = (
                cuda_us(lambda: route_experts(logits, spec, budget), CUDA_ITERS),
                graph_us(lambda: route_experts(logits, spec, budget)),
                cuda_us(lambda: torch_topk(logits), CUDA_ITERS),
                cuda_us(lambda: torch_budget(logits), CUDA_ITERS),
                cpu_us(lambda: route_experts(cpu_logits, spec, budget), CPU_ITERS),
                cpu_us(lambda: route_experts_reference(cpu_logits, spec, budget, **ref_kwargs), REF_ITERS),
            )
            print(f"{T:>4} {N:>5} " + " ".join(f"{us:>13.1f}" for us in row), flush=True)


if __name__ == "__main__":
    main()
