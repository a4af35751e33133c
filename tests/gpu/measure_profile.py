"""Measures this GPU as a moespec hardware profile (python/moespec/cost/hardware.py) and writes it to
tests/gpu/profiles/<name>.json (and $OUT/profiles/ when OUT is set), where it replaces the built-in
spec-sheet profile of that name (h100-sxm, h200, b200) for ``moespec analyze speedup``.

Measured: read bandwidth (a float32 sum over 4 GiB), torch's bf16 GEMM on an 8192 x 28672 weight
(470 MB, beyond the L2) at M = 1..128 tokens (GB/s of weights at each M), its peak on an 8192^3
product, moespec's MoE kernel at 1..16 tokens per expert on a Qwen3-30B-A3B layer with every expert
active (1.2 GB; GB/s of expert weights, in a CUDA graph, as `moespec analyze profile` measures a
CPU), and the fixed cost of a step (the replay of a CUDA graph of one small kernel). Run by
tests/gpu/run.sh.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from gpu_common import SMOKE, event_seconds, graph_seconds  # (puts the source tree's python/ on sys.path)

from moespec.cost.hardware import PROFILE_SIZES, Hardware, save_profile  # noqa: E402

# sizes: the read buffer's floats, the GEMM weight [N, K], the peak product's side, the MoE layer (E, I, H)
READ, GEMM, PEAK, LAYER = 2**30, (28672, 8192), 8192, (128, 768, 2048)
if SMOKE:  # (gpu_common: tiny shapes; the profile goes to $OUT only)
    READ, GEMM, PEAK, LAYER = 2**16, (256, 128), 128, (16, 32, 64)


def main() -> int:
    if not torch.cuda.is_available():
        print("measure_profile: no CUDA device", file=sys.stderr)
        return 1
    device = torch.cuda.get_device_name()
    name = next((key for tag, key in (("H200", "h200"), ("H100", "h100-sxm"), ("B200", "b200")) if tag in device),
                "gpu")
    buf = torch.ones(READ, dtype=torch.float32, device="cuda")  # 4 GiB
    bandwidth = buf.numel() * 4 / event_seconds(lambda: buf.sum()) / 1e9
    del buf
    w = torch.randn(*GEMM, device="cuda", dtype=torch.bfloat16)
    table = {}
    for M in PROFILE_SIZES:
        x = torch.randn(M, GEMM[1], device="cuda", dtype=torch.bfloat16)
        table[M] = w.numel() * 2 / event_seconds(lambda: x @ w.T) / 1e9
    a = torch.randn(PEAK, PEAK, device="cuda", dtype=torch.bfloat16)
    peak = 2 * PEAK**3 / event_seconds(lambda: a @ a) / 1e12
    experts = expert_rates(*LAYER)
    small = torch.zeros(1024, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        small.add_(1.0)
    overhead = event_seconds(graph.replay, 200) * 1e6
    hw = Hardware(name, bandwidth, peak, overhead, f"measured by tests/gpu/measure_profile.py on {device} "
                  f"(torch {torch.__version__} bf16 GEMM; moe_experts at E={LAYER[0]} I={LAYER[1]} H={LAYER[2]})", table,
                  expert_gbs=experts)
    paths = [] if SMOKE else [Path(__file__).parent / "profiles" / f"{name}.json"]
    if os.environ.get("OUT"):
        paths.append(Path(os.environ["OUT"]) / "profiles" / f"{name}.json")
    for path in paths:
        save_profile(path, hw)
    print(f"{device}: read {bandwidth:.0f} GB/s, bf16 peak {peak:.0f} TFLOP/s, graph replay {overhead:.1f} us; "
          "GB/s of weights at M tokens: " + ", ".join(f"{m}: {v:.0f}" for m, v in table.items()))
    print("GB/s of expert weights at m tokens per expert: " + ", ".join(f"{m}: {v:.0f}" for m, v in experts.items()))
    print("wrote " + ", ".join(map(str, paths)))
    return 0


def expert_rates(E: int, I: int, H: int, K: int = 2) -> dict[int, float]:
    """GB/s of expert weights moe_experts streams with every expert serving m tokens (m = 1..16)."""
    from moespec.ops import moe_experts

    weights = torch.randn(E, 3 * I * H, device="cuda", dtype=torch.bfloat16) * 0.02
    rates = {}
    saved = os.environ.get("MOESPEC_GROUPED_MIN_TOKENS")
    os.environ["MOESPEC_GROUPED_MIN_TOKENS"] = "0"  # the kernel a verify runs, also at T = 1024 (m = 16)
    for m in (1, 2, 4, 8, 16):
        T = max(1, E * m // K)
        ids = ((torch.arange(T)[:, None] * K + torch.arange(K)[None]) % E).int().cuda()  # every expert m tokens
        x, wts = torch.randn(T, H, device="cuda", dtype=torch.bfloat16), torch.full((T, K), 0.5, device="cuda")
        rates[m] = weights.numel() * 2 / graph_seconds(lambda: moe_experts(x, ids, wts, weights, I)) / 1e9
    if saved is None:
        os.environ.pop("MOESPEC_GROUPED_MIN_TOKENS")
    else:
        os.environ["MOESPEC_GROUPED_MIN_TOKENS"] = saved
    return rates


if __name__ == "__main__":
    sys.exit(main())
