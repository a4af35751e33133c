"""Timing of moe_experts on CUDA (cpp/kernels/moe_experts.cu) at real MoE layer shapes, for
tests/gpu/run.sh: per shape and T in {1, 4, 16, 64}, the active experts swept from top-k to E;
time per call (a CUDA graph of 20 calls, replayed), achieved bandwidth (expert bytes read / time)
against a device-to-device copy measured in the same run (bytes read + written / time), the best
torch path (torch._grouped_mm where this torch has it, else a per-expert loop of F.linear) and the
linearity of time in active experts (R^2 of a least-squares line). The kernel is timed on each of
its launch sequences: the fused pair with programmatic dependent launch (the default, "us"), launched
plainly (MOESPEC_PDL=0, "plain_us") and the four launches (MOESPEC_MOE_FUSED=0, "four_us"). Writes
$OUT/moe_experts_bench.json when OUT is set. Targets (issue "GPU runtime"): at T <= 16, >= 70% of
the copy bandwidth, >= 1.5x the best torch path, R^2 >= 0.98.
"""

from __future__ import annotations

import os
import pathlib
import sys

import torch
import torch.nn.functional as F
from gpu_common import (DEVICE, SMOKE, captured, copy_bandwidth, device_name, event_seconds, graph_seconds, results_saver,
                        sync, timeline)

from moespec.ops import moe_experts

CUDA = DEVICE
SHAPES = {  # name: (H, I, E, top-k), from the published configs
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "olmoe-1b-7b": (2048, 1024, 64, 8),
    "mixtral-8x7b": (4096, 14336, 8, 2),
}
TOKENS = (1, 4, 16, 64)
CALLS = 20
PREFILL = (64, 128, 256, 512, 1024, 2048, 4096)
if SMOKE:  # (gpu_common: the CPU, tiny shapes)
    SHAPES, TOKENS, CALLS, PREFILL = {"tiny": (64, 32, 16, 2)}, (1, 4), 2, (64,)


def routing(T: int, K: int, active: int, E: int):
    """ids [T, K] using exactly min(active, T K) experts (spread round robin, distinct within a token)."""
    experts = torch.randperm(E, generator=torch.Generator().manual_seed(active))[:active]
    slots = torch.arange(T * K) % active
    ids = experts[slots].reshape(T, K).to(torch.int32)
    return ids.to(CUDA), torch.full((T, K), 1.0 / K, device=CUDA)


def launches_seconds(fused: str, pdl: str, fn) -> float:
    """graph_seconds of fn with MOESPEC_MOE_FUSED=fused and MOESPEC_PDL=pdl (captured under them: they
    are read at capture, when the kernels are launched). A caller's "0" wins (tests/gpu/run.sh's
    fallback run: every variant then times the path it asked for)."""
    saved = {name: os.environ.get(name) for name in ("MOESPEC_MOE_FUSED", "MOESPEC_PDL")}
    os.environ.update({"MOESPEC_MOE_FUSED": "0" if saved["MOESPEC_MOE_FUSED"] == "0" else fused,
                       "MOESPEC_PDL": "0" if saved["MOESPEC_PDL"] == "0" else pdl})
    try:
        return graph_seconds(fn, calls=CALLS)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value


def torch_loop(x, ids, weights, gate, up, down):
    out = torch.zeros_like(x, dtype=torch.float32)
    for e in torch.unique(ids).tolist():  # (a host sync: the torch path's cost, as users run it)
        token, slot = torch.where(ids == e)
        h = F.silu(F.linear(x[token], gate[e])) * F.linear(x[token], up[e])
        out.index_add_(0, token, F.linear(h, down[e]).float() * weights[token, slot, None])
    return out.to(x.dtype)


def main() -> int:
    torch.manual_seed(0)
    copy = copy_bandwidth()
    print(f"device {device_name()}: device copy {copy:.0f} GB/s (read + write)")
    rows = []
    results = {"device": device_name(), "copy_GBps": copy, "rows": rows}
    save = results_saver(results, "moe_experts_bench.json")  # (after every row)
    grouped = hasattr(torch, "_grouped_mm")
    for name, (H, I, E, K) in SHAPES.items():
        experts = (torch.randn(E, 3 * I * H, device=CUDA, dtype=torch.bfloat16) / H**0.5)
        blocks = experts.view(E, 3, I * H)
        gate, up, down = blocks[:, 0].view(E, I, H), blocks[:, 1].view(E, I, H), blocks[:, 2].view(E, H, I)
        per_expert = 3 * I * H * 2
        for T in TOKENS:
            x = torch.randn(T, H, device=CUDA, dtype=torch.bfloat16)
            sweep = sorted({min(a, T * K, E) for a in (K, 2 * K, 4 * K, 8 * K, 16 * K, E)})
            times = []
            for active in sweep:
                ids, weights = routing(T, K, active, E)
                call = lambda: moe_experts(x, ids, weights, experts, I)  # noqa: E731
                t, plain, four = (launches_seconds(f, d, call) for f, d in (("1", "1"), ("1", "0"), ("0", "1")))
                ref_ids, ref_w = ids, weights
                sync()
                loop = event_seconds(lambda: torch_loop(x, ref_ids, ref_w, gate, up, down), 5)
                best_torch = loop
                if grouped:
                    try:
                        best_torch = min(best_torch, _grouped_time(x, ids, gate, up, down))
                    except Exception as exc:  # noqa: BLE001 (an older torch without this layout)
                        print(f"  torch._grouped_mm unavailable here: {exc}")
                        grouped = False
                bw = active * per_expert / t / 1e9
                rows.append({"shape": name, "T": T, "active": active, "us": t * 1e6, "GBps": bw,
                             "of_copy": bw / copy, "torch_us": best_torch * 1e6, "x_torch": best_torch / t,
                             "plain_us": plain * 1e6, "four_us": four * 1e6})
                times.append((active, t))
                print(f"{name:14s} T={T:3d} active={active:4d}: {t * 1e6:8.1f} us  {bw:7.0f} GB/s "
                      f"({100 * bw / copy:5.1f}% of copy)  torch {best_torch * 1e6:8.1f} us ({best_torch / t:5.2f}x)  "
                      f"plain {plain * 1e6:7.1f} us  four launches {four * 1e6:7.1f} us")
                save()
            if len(times) >= 3:
                a = torch.tensor([p[0] for p in times], dtype=torch.float64)
                y = torch.tensor([p[1] for p in times], dtype=torch.float64)
                A = torch.stack([a, torch.ones_like(a)], 1)
                coef = torch.linalg.lstsq(A, y[:, None]).solution[:, 0]
                r2 = 1 - float(((y - A @ coef) ** 2).sum() / ((y - y.mean()) ** 2).sum())
                print(f"{name:14s} T={T:3d} linear in active experts: R^2 = {r2:.4f}")
                rows.append({"shape": name, "T": T, "r2": r2})
    results["timelines"] = timelines()
    save()
    rows += prefill_crossover()
    if save():
        print(f"wrote {pathlib.Path(os.environ['OUT']) / 'moe_experts_bench.json'}")
    return 0


def timelines() -> dict:
    """Where one call goes on the GPU's clock at the fewest experts (top-k), T = 1 and 16, per shape:
    :func:`gpu_common.timeline` of a graph holding one call (its kernels' durations in order and the
    idle time between them), e.g. gate/up against down, and what the launches between them cost."""
    out = {}
    for name, (H, I, E, K) in SHAPES.items():
        experts = torch.randn(E, 3 * I * H, device=CUDA, dtype=torch.bfloat16) / H**0.5
        for T in (1, 16):
            x = torch.randn(T, H, device=CUDA, dtype=torch.bfloat16)
            ids, weights = routing(T, K, K, E)
            call = lambda: moe_experts(x, ids, weights, experts, I)  # noqa: E731
            replay = captured(call)[0].replay if DEVICE.type == "cuda" else call
            line = out[f"{name} T={T} active={K}"] = timeline(replay)
            kernels = ", ".join(f"{n.rsplit('::', 1)[-1]} {d:.1f} us" for n, _, d in line["sequence"][:6])
            print(f"{name:14s} T={T:3d} active={K:4d}: one call {line['span_us']:.1f} us on the GPU's clock, "
                  f"{line['idle_us']:.1f} us idle; {kernels}")
        del experts
    return out


def prefill_crossover() -> list[dict]:
    """Prefill sizes at the Qwen3-30B-A3B shape, every expert active: the decode/verify kernel against
    the grouped-GEMM path (moe_experts_grouped), to set moespec.ops.moe.GROUPED_MIN_TOKENS."""
    from moespec.ops.moe import moe_experts_grouped

    name = next(iter(SHAPES))  # (Qwen3-30B-A3B's)
    H, I, E, K = SHAPES[name]
    experts = (torch.randn(E, 3 * I * H, device=CUDA, dtype=torch.bfloat16) / H**0.5)
    rows = []
    saved = os.environ.get("MOESPEC_GROUPED_MIN_TOKENS")
    os.environ["MOESPEC_GROUPED_MIN_TOKENS"] = "0"  # moe_experts: always the kernel
    try:
        for T in PREFILL:
            x = torch.randn(T, H, device=CUDA, dtype=torch.bfloat16)
            ids = torch.stack([torch.randperm(E, device=CUDA)[:K] for _ in range(T)]).to(torch.int32)
            weights = torch.full((T, K), 1.0 / K, device=CUDA)
            kernel = event_seconds(lambda: moe_experts(x, ids, weights, experts, I), 5)
            grouped = event_seconds(lambda: moe_experts_grouped(x, ids, weights, experts, I), 5)
            rows.append({"shape": name, "prefill_T": T, "kernel_us": kernel * 1e6,
                         "grouped_us": grouped * 1e6})
            print(f"prefill T={T:5d}: kernel {kernel * 1e6:9.1f} us, grouped GEMM {grouped * 1e6:9.1f} us "
                  f"({'grouped' if grouped < kernel else 'kernel'} faster)")
    finally:
        if saved is None:
            os.environ.pop("MOESPEC_GROUPED_MIN_TOKENS")
        else:
            os.environ["MOESPEC_GROUPED_MIN_TOKENS"] = saved
    return rows


def _grouped_time(x, ids, gate, up, down) -> float:
    """torch._grouped_mm over the slots sorted by expert (gate/up, then down), timed eagerly."""
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    E = gate.shape[0]
    counts = torch.bincount(flat, minlength=E)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    xs = x.repeat_interleave(ids.shape[1], 0)[order]
    wg, wu, wd = gate.transpose(1, 2).contiguous(), up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous()

    def run():
        h = F.silu(torch._grouped_mm(xs, wg, offs=offs)) * torch._grouped_mm(xs, wu, offs=offs)
        return torch._grouped_mm(h, wd, offs=offs)

    return event_seconds(run, 5)


if __name__ == "__main__":
    sys.exit(main())
