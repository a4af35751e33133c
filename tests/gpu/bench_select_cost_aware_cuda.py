"""Timing of the eco policies' selection on CUDA (moespec::cuda::select_cost_aware, one block for the
batch: cpp/kernels/select_cost_aware.cuh) at real models' shapes, for tests/gpu/run.sh: the MoE layers
and experts of Qwen3-30B-A3B (48 x 128, top-8 predictions) and DeepSeek-V3 (58 x 256), batches of 1, 4
and 8 requests, total_tokens 16, 32 and 64 with R = 4 x total_tokens candidates a request (what a GPU
eco round hands the selection: CostAwareTrees.candidate_cap), soft predictions. Per row: microseconds
per call (a CUDA graph of calls, each restoring the buffer and S, A first), the nodes chosen (the
rounds: each is a pass over the frontier) and microseconds per round; beside it the host selection
the CPU path runs (the C++ core request by request, moespec.spec.cost_aware.select_cost_aware_native),
whose time a GPU step would spend with a synchronisation. Writes $OUT/select_bench.json when OUT is
set. The prices: an expert 2.4 us (Qwen3's 9.4 MB at ~4 TB/s), S opening at 5 ms a request (a
48-layer step's dense part), so that most rounds pay and the selection runs near total_tokens.
"""

from __future__ import annotations

import sys
import time

import numpy as np
import torch
from gpu_common import DEVICE, SMOKE, device_name, graph_seconds, results_saver

from moespec.spec.cost_aware import SelectionCosts, select_cost_aware_cuda, select_cost_aware_native

MODELS = {"qwen3-30b-a3b": (48, 128, 8), "deepseek-v3": (58, 256, 8)}  # MoE layers, experts, predicted top-k
BATCHES, TOTALS = (1, 4, 8), (16, 32, 64)
if SMOKE:
    MODELS, BATCHES, TOTALS = {"tiny": (3, 16, 2)}, (1, 2), (4,)
EXPERT_S, STEP_S = 2.4e-6, 5e-3


def inputs(B: int, C: int, L: int, N: int, K: int, seed: int) -> dict:
    """A batch of EAGLE-like candidate trees (each candidate a child of an earlier one or of the root,
    scores summed down the tree) with random soft expert predictions."""
    rng = np.random.default_rng(seed)
    parents = np.full((B, C), -1, np.int32)
    depth = np.ones((B, C), np.int32)
    scores = np.zeros((B, C), np.float32)
    for b in range(B):
        for c in range(C):
            p = int(rng.integers(-1, c)) if c else -1
            parents[b, c], depth[b, c] = p, 1 if p < 0 else depth[b, p] + 1
            scores[b, c] = (scores[b, p] if p >= 0 else 0.0) - np.float32(rng.random() * 1.5)
    return {"parents": parents, "depth": depth, "scores": scores, "num": np.full(B, C, np.int32),
            "predicted": rng.integers(0, N, (B, C, L, K)).astype(np.int32),  # (a repeated id counts once)
            "predicted_p": rng.random((B, C, L, K)).astype(np.float32), "buffer": np.zeros((L, N), np.float32)}


def host_selection(x: dict, costs: SelectionCosts, total: int) -> tuple[float, int]:
    """(seconds, nodes chosen) of the host selection, request by request with buffer, S and A carried."""
    times, chosen = [], 0
    for _ in range(3):
        buffer, S, A = x["buffer"].copy(), STEP_S * len(x["parents"]), float(len(x["parents"]))
        start, chosen = time.perf_counter(), 0
        for b in range(len(x["parents"])):
            picked, S, A = select_cost_aware_native(x["parents"][b], x["depth"][b], x["scores"][b], x["predicted"][b],
                                                    x["predicted_p"][b], buffer, costs, total, step_s=S, accepted=A)
            chosen += len(picked)
        times.append(time.perf_counter() - start)
    return sorted(times)[1], chosen


def gpu_selection(x: dict, costs: SelectionCosts, total: int) -> tuple[float, int]:
    """(seconds per call, nodes chosen) of the batch selection on the device, in a graph of calls."""
    t = {k: torch.from_numpy(v).to(DEVICE) for k, v in x.items()}
    buffer0, buffer = t["buffer"], t["buffer"].clone()
    state0 = torch.tensor([STEP_S * len(x["parents"]), float(len(x["parents"]))], dtype=torch.float64, device=DEVICE)
    state = state0.clone()

    def call():
        buffer.copy_(buffer0)
        state.copy_(state0)
        return select_cost_aware_cuda(t["parents"], t["depth"], t["scores"], t["num"], t["predicted"], t["predicted_p"],
                                      buffer, costs, total, state)

    _, count = call()
    chosen = int(count.sum())
    return graph_seconds(call, calls=10, replays=5), chosen


def main() -> int:
    rows: list[dict] = []
    save = results_saver({"device": device_name(), "rows": rows}, "select_bench.json")
    print(f"device {device_name()}; selection of R = 4 x total_tokens candidates a request")
    print(f"{'model':<15}{'B':>3}{'total':>6}{'R':>5}{'nodes':>7}{'gpu us':>10}{'us/round':>10}{'host us':>10}")
    for name, (L, N, K) in MODELS.items():
        costs = SelectionCosts(0.0, np.full(L, EXPERT_S))
        for B in BATCHES:
            for total in TOTALS:
                C = 4 * total
                x = inputs(B, C, L, N, K, seed=B * 1000 + total)
                host_s, host_nodes = host_selection(x, costs, total)
                gpu_s, nodes = gpu_selection(x, costs, total) if DEVICE.type == "cuda" else (float("nan"), host_nodes)
                if nodes != host_nodes:
                    print(f"  the device chose {nodes} nodes, the host {host_nodes}", file=sys.stderr)
                    return 1
                rows.append({"model": name, "L": L, "N": N, "K": K, "B": B, "total_tokens": total, "R": C,
                             "nodes": nodes, "gpu_us": gpu_s * 1e6, "us_per_round": gpu_s * 1e6 / max(nodes, 1),
                             "host_us": host_s * 1e6})
                save()
                r = rows[-1]
                print(f"{name:<15}{B:>3}{total:>6}{C:>5}{nodes:>7}{r['gpu_us']:>10.1f}{r['us_per_round']:>10.2f}"
                      f"{r['host_us']:>10.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
