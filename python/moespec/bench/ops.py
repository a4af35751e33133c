"""Times the native routing + expert-budget op against the plain-torch reference.

    python -m moespec.bench.ops [--repeats 7] [--budget 16] [--device cpu|cuda]

For T in {1, 16, 64}, N in {64, 128, 256}, k = 8 and a budget of 16 experts (substitution), it
prints the median time per call of: the native op called directly (what moespec.ops.route_experts
does in eager mode), the same op through the torch dispatcher (torch.ops.moespec.route_experts,
what torch.compile sees), and the plain-torch reference (moespec.ops.reference). Implementations
are interleaved within each repeat so that machine noise hits them alike; ratios are from one run.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from moespec._loader import native
from moespec.ops import ExpertBudget, RouterSpec, route_experts
from moespec.ops.reference import route_experts_reference
from moespec.ops.routing import _FAMILY_CODES, budget_codes, softmax_vector_width


def _time_per_call(fn, min_seconds: float = 0.02) -> float:
    """Seconds per call of fn(), from a batch long enough to time reliably."""
    n = 1
    while True:
        start = time.perf_counter()
        for _ in range(n):
            fn()
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds:
            return elapsed / n
        n *= 2


def bench(tokens=(1, 16, 64), experts=(64, 128, 256), top_k=8, budget=16, repeats=7, device="cpu"):
    spec = RouterSpec("softmax", top_k, True)
    b = ExpertBudget(budget)
    rows = []
    for T in tokens:
        for N in experts:
            logits = torch.randn(T, N, device=device)
            op_args = (logits, None, None, _FAMILY_CODES["softmax"], top_k, True, 1, 1, 1.0, *budget_codes(b),
                       softmax_vector_width())
            impls = {
                "native": lambda: route_experts(logits, spec, b),
                "torch.ops": lambda: torch.ops.moespec.route_experts(*op_args),
            }
            if device == "cpu":
                impls["reference"] = lambda: route_experts_reference(logits, spec, b, exact_score_order=False)
            for fn in impls.values():
                fn()  # warm-up
            times = {name: [] for name in impls}
            for _ in range(repeats):
                for name, fn in impls.items():
                    times[name].append(_time_per_call(fn))
            rows.append((T, N, {name: statistics.median(ts) for name, ts in times.items()}))
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--budget", type=int, default=16)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args(argv)
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, "
          f"torch {torch.__version__}, moespec CPU ISA {native().cpu_isa()}")
    print(f"route_experts, softmax family, k=8, budget={args.budget} (substitution); median of {args.repeats}")
    rows = bench(budget=args.budget, repeats=args.repeats, device=args.device)
    names = list(rows[0][2])
    header = f"{'T':>4} {'N':>5} " + " ".join(f"{n + ' (us)':>16}" for n in names)
    if "reference" in names:
        header += f" {'reference/native':>17}"
    print(header)
    for T, N, t in rows:
        line = f"{T:>4} {N:>5} " + " ".join(f"{t[n] * 1e6:>16.1f}" for n in names)
        if "reference" in names:
            line += f" {t['reference'] / t['native']:>16.1f}x"
        print(line)


if __name__ == "__main__":
    main()
