"""Benchmarks the CPU MoE experts kernel: bandwidth against a memory copy, torch paths, linearity.

    python -m moespec.bench.moe [--shapes qwen3,olmoe] [--tokens 1,4,16,64] [--repeats 5]
                                [--plot build/bench/moe_active_experts.png]

For each layer shape (Qwen3-30B-A3B: hidden 2048, expert 768, 128 experts, top-8; OLMoE: 2048,
1024, 64, top-8; bf16 weights) and T tokens, routings are built that touch exactly A experts
(A swept from 8 to N), and these implementations run the same work, interleaved in one run:
- moespec: ``moespec.ops.moe_experts`` (the native kernel, each active expert read once; up to 64
  tokens its streaming schedule);
- moespec tiled: the same with MOESPEC_MOE_SCHEDULE=tiled (its tiled schedule at every size; the
  same bits);
- torch grouped_mm: tokens sorted by expert, ``torch.nn.functional.grouped_mm`` for gate/up and
  down (transformers' default experts implementation);
- torch loop: a per-expert loop of ``F.linear`` calls (transformers' ``eager`` experts).
Achieved bandwidth = bytes of the A experts' weights / time, against a plain ``copy_`` of a 1 GiB
buffer measured in the same run (bytes copied / time). At T = 16 the time against A is fitted by a
straight line (R^2 printed, drawn into the PNG). The "default" shape is the default engine's
(hidden 576, expert 256, 48 experts, top-8). A shape whose experts total less than 512 MB runs over
enough copies of them, one after another, that no call finds its weights in the caches.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from moespec.ops import moe_experts, num_threads

SHAPES = {  # hidden H, expert intermediate I, experts N, top-k
    "qwen3": (2048, 768, 128, 8),
    "olmoe": (2048, 1024, 64, 8),
    "default": (576, 256, 48, 8),
}
COLD_BYTES = 512 * 2**20  # a shape's experts are repeated up to this many bytes (colder than the caches)


def _time(fn, repeats: int, min_seconds: float = 0.05) -> float:
    """Median seconds per call over ``repeats`` batches of calls."""
    fn()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < min_seconds / repeats or n == 0:
        fn()
        n += 1
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - start) / n)
    return statistics.median(samples)


def copy_bandwidth(repeats: int, nbytes: int = 1 << 30) -> float:
    """GB/s of a plain tensor copy (bytes copied per second)."""
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    return nbytes / _time(lambda: dst.copy_(src), repeats) / 1e9


def routing(T: int, K: int, N: int, active: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """ids int32 [T, K] touching exactly ``active`` experts (each token: K distinct), weights [T, K]."""
    chosen = torch.randperm(N, generator=gen)[:active]
    ids = torch.empty(T, K, dtype=torch.int32)
    for t in range(T):  # round-robin over the chosen experts so that all of them are used
        ids[t] = chosen[(torch.arange(K) + t * K) % active]
    return ids, torch.rand(T, K, generator=gen)


def torch_grouped_mm(x, ids, weights, gate_up, down):
    """transformers' grouped_mm experts path."""
    T, K = ids.shape
    E = gate_up.shape[0]
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat)
    xs = x[order // K]
    counts = torch.bincount(flat, minlength=E)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    gate, up = F.grouped_mm(xs, gate_up.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
    y = F.grouped_mm(F.silu(gate) * up, down.transpose(-2, -1), offs=offs)
    y = y * weights.reshape(-1)[order, None].to(y.dtype)
    out = torch.zeros(T, x.shape[1], dtype=torch.float32)
    out.index_add_(0, order // K, y.float())
    return out.to(x.dtype)


def torch_loop(x, ids, weights, gate_up, down):
    """transformers' eager experts path: a loop over the hit experts."""
    out = torch.zeros_like(x)
    for e in ids.unique().tolist():
        token, slot = torch.where(ids == e)
        gate, up = F.linear(x[token], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[e]) * weights[token, slot, None]
        out.index_add_(0, token, y.to(x.dtype))
    return out


def bench_shape(name: str, tokens: list[int], repeats: int, gen: torch.Generator, progress) -> list[dict]:
    H, I, N, K = SHAPES[name]
    expert_bytes = 3 * I * H * 2
    copies = max(1, -(-COLD_BYTES // (N * expert_bytes)))
    layers = []
    for _ in range(copies):
        experts = (torch.randn(N, 3 * I * H, generator=gen) * 0.02).to(torch.bfloat16)  # moespec's layout
        gate_up = experts[:, : 2 * I * H].reshape(N, 2 * I, H).contiguous()  # transformers' layout
        down = experts[:, 2 * I * H :].reshape(N, H, I).contiguous()
        layers.append((experts, gate_up, down))
    next_layer = itertools.cycle(layers).__next__
    rows = []
    for T in tokens:
        sweep = sorted({a for a in (8, 16, 32, 48, 64, 96, 128) if K <= a <= min(N, T * K)})
        for A in sweep:
            ids, weights = routing(T, K, N, A, gen)
            x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
            impls = {
                "moespec": lambda: moe_experts(x, ids, weights, next_layer()[0], I),
                "tiled": lambda: tiled(lambda: moe_experts(x, ids, weights, next_layer()[0], I)),
                "grouped_mm": lambda: torch_grouped_mm(x, ids, weights, *next_layer()[1:]),
                "loop": lambda: torch_loop(x, ids, weights, *next_layer()[1:]),
            }
            times = {k: [] for k in impls}
            for _ in range(3):  # interleave the implementations
                for k, fn in impls.items():
                    times[k].append(_time(fn, max(1, repeats // 3 + 1)))
            row = {"shape": name, "T": T, "active": A, "bytes": A * expert_bytes}
            row.update({k: statistics.median(v) for k, v in times.items()})
            rows.append(row)
            progress.update(1)
    return rows


def tiled(fn):
    """fn() with the kernel's tiled schedule forced (MOESPEC_MOE_SCHEDULE=tiled, read at each call)."""
    os.environ["MOESPEC_MOE_SCHEDULE"] = "tiled"
    try:
        return fn()
    finally:
        del os.environ["MOESPEC_MOE_SCHEDULE"]


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Least squares y = a + b x; returns (a, b, R^2)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    a = my - b * mx
    ss_res = sum((y - a - b * x) ** 2 for x, y in zip(xs, ys))
    ss_tot = sum((y - my) ** 2 for y in ys)
    return a, b, 1.0 - ss_res / ss_tot if ss_tot else 1.0


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="qwen3,olmoe")
    parser.add_argument("--tokens", default="1,4,16,64")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--plot", default="build/bench/moe_active_experts.png")
    args = parser.parse_args(argv)
    shapes, tokens = args.shapes.split(","), [int(t) for t in args.tokens.split(",")]
    gen = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__} ({torch.get_num_threads()} threads), moespec pool {num_threads()} threads, bf16")
    copy = copy_bandwidth(args.repeats)
    print(f"plain memory copy (1 GiB tensor copy_): {copy:.2f} GB/s\n")
    total = sum(len({a for a in (8, 16, 32, 48, 64, 96, 128) if SHAPES[s][3] <= a <= min(SHAPES[s][2], t * SHAPES[s][3])})
                for s in shapes for t in tokens)
    rows = []
    with tqdm(total=total, desc="moe benchmark", leave=False) as progress:
        for name in shapes:
            rows += bench_shape(name, tokens, args.repeats, gen, progress)
    header = (f"{'shape':<8}{'T':>4}{'active':>8}{'moespec ms':>12}{'GB/s':>8}{'% copy':>8}{'tiled ms':>10}"
              f"{'tiled/moespec':>15}{'grouped_mm ms':>15}{'loop ms':>10}{'best torch/moespec':>20}")
    print(header)
    for r in rows:
        gbs = r["bytes"] / r["moespec"] / 1e9
        best = min(r["grouped_mm"], r["loop"])
        print(f"{r['shape']:<8}{r['T']:>4}{r['active']:>8}{r['moespec'] * 1e3:>12.2f}{gbs:>8.2f}"
              f"{100 * gbs / copy:>7.0f}%{r['tiled'] * 1e3:>10.2f}{r['tiled'] / r['moespec']:>14.2f}x"
              f"{r['grouped_mm'] * 1e3:>15.2f}{r['loop'] * 1e3:>10.2f}{best / r['moespec']:>19.2f}x")
    print()
    fits = {}
    for name in shapes:
        pts = [(r["active"], r["moespec"] * 1e3) for r in rows if r["shape"] == name and r["T"] == 16]
        if len(pts) >= 3:
            a, b, r2 = fit_line([p[0] for p in pts], [p[1] for p in pts])
            fits[name] = (pts, a, b, r2)
            print(f"{name}: T=16, time = {a:.3f} ms + {b:.4f} ms x active experts, R^2 = {r2:.4f}")
    if args.plot and fits:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.5, 4))
        for name, (pts, a, b, r2) in fits.items():
            xs = [p[0] for p in pts]
            ax.plot(xs, [p[1] for p in pts], "o", label=f"{name} measured")
            ax.plot(xs, [a + b * x for x in xs], "-", label=f"{name} fit (R$^2$={r2:.3f})")
        ax.set_xlabel("active experts")
        ax.set_ylabel("moe_experts time (ms), T = 16, bf16")
        ax.set_title("Time is linear in the experts read")
        ax.legend()
        ax.grid(alpha=0.3)
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
