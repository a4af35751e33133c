"""Timing of linear on CUDA (cpp/kernels/linear.cu) against torch's GEMM at the projections of real
models, for tests/gpu/run.sh: per projection and T in {1, 4, 16, 64} tokens, time per call (a CUDA
graph of 20 calls, replayed, cycling over enough copies of the weight that none is still in L2),
achieved bandwidth (weight bytes / time) against a device copy measured in the same run (bytes read +
written / time) and torch.nn.functional.linear's time on the same inputs; also with programmatic
dependent launch off (MOESPEC_PDL=0: "plain_us"). Writes $OUT/linear_bench.json when OUT is set.
"""

from __future__ import annotations

import os
import pathlib
import sys

import torch
import torch.nn.functional as F
from gpu_common import DEVICE, SMOKE, copy_bandwidth, device_name, graph_seconds, results_saver

from moespec.ops.linear import linear

CUDA = DEVICE
SHAPES = {  # name: (N, K), from the published configs
    "qwen3-30b-a3b q/k/v": (5120, 2048),
    "qwen3-30b-a3b o": (2048, 4096),
    "qwen3-30b-a3b router": (128, 2048),
    "qwen3-30b-a3b lm_head": (151936, 2048),
    "mixtral-8x7b q/k/v": (6144, 4096),
    "mixtral-8x7b router": (8, 4096),
}
TOKENS = (1, 4, 16, 64)
CALLS = 20
L2_CLEAR = 256 << 20  # bytes of weights cycled through (past any L2)
if SMOKE:  # (gpu_common: the CPU, tiny shapes)
    SHAPES, TOKENS, CALLS, L2_CLEAR = {"tiny": (96, 64)}, (1, 4), 2, 1 << 16


def timed(fn, pdl: str) -> float:
    saved = os.environ.get("MOESPEC_PDL")
    os.environ["MOESPEC_PDL"] = "0" if saved == "0" else pdl  # (a caller's 0 wins: run.sh's fallback)
    try:
        return graph_seconds(fn, calls=CALLS)
    finally:
        if saved is None:
            os.environ.pop("MOESPEC_PDL")
        else:
            os.environ["MOESPEC_PDL"] = saved


def main() -> int:
    torch.manual_seed(0)
    copy = copy_bandwidth()
    print(f"device {device_name()}: device copy {copy:.0f} GB/s (read + write)")
    rows = []
    save = results_saver({"device": device_name(), "copy_GBps": copy, "rows": rows},
                         "linear_bench.json")  # (after every row)
    for name, (N, K) in SHAPES.items():
        nbytes = N * K * 2
        copies = max(1, min(CALLS, -(-L2_CLEAR // nbytes)))
        weights = [(torch.randn(N, K, device=CUDA) / K**0.5).to(torch.bfloat16) for _ in range(copies)]
        for T in TOKENS:
            x = torch.randn(T, K, device=CUDA).to(torch.bfloat16)
            turn = [0]

            def call(project):
                def run():
                    w = weights[turn[0] % copies]
                    turn[0] += 1
                    return project(x, w)
                return run

            t = timed(call(linear), "1")
            plain = timed(call(linear), "0")
            ref = timed(call(F.linear), "1")
            bw, torch_bw = nbytes / t / 1e9, nbytes / ref / 1e9
            rows.append({"shape": name, "N": N, "K": K, "T": T, "us": t * 1e6, "plain_us": plain * 1e6,
                         "torch_us": ref * 1e6, "GBps": bw, "of_copy": bw / copy, "torch_of_copy": torch_bw / copy,
                         "x_torch": ref / t})
            print(f"{name:24s} T={T:3d}: {t * 1e6:8.1f} us {bw:7.0f} GB/s ({100 * bw / copy:5.1f}% of copy)  "
                  f"torch {ref * 1e6:8.1f} us ({100 * torch_bw / copy:5.1f}%, {ref / t:5.2f}x)  "
                  f"no PDL {plain * 1e6:8.1f} us")
            save()
        del weights
    if save():
        print(f"wrote {pathlib.Path(os.environ['OUT']) / 'linear_bench.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
