"""What the GPU tests and timing scripts share: the source tree on sys.path, the module-level skip
without a CUDA device or a CUDA build, CUDA-event / CUDA-graph timing (medians), the device
copy bandwidth the timings are held to, the timings' JSON written as they grow, and one call's
kernel timeline (busy and idle time on the GPU's clock).

MOESPEC_GPU_SMOKE=1 runs the timing scripts on the CPU with tiny shapes (``SMOKE``, ``DEVICE``: the
timers then take the host's clock and no graph), and MOESPEC_GPU_SMOKE=virtual the same on the CPU
playing a CUDA device (tests/python/virtual_cuda.py: the scripts' CUDA branches, graphs and events),
so that tests/python/test_gpu_scripts.py finds a script's Python errors here rather than in a GPU
session's few minutes; the numbers mean nothing."""

from __future__ import annotations

import json
import os
import pathlib
import re
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
for _extra in (ROOT / "python", ROOT / "tests" / "python"):  # the source tree's moespec, the test fixtures
    if str(_extra) not in sys.path:
        sys.path.insert(0, str(_extra))


def require_cuda_build() -> None:
    """Skips the calling test module (call it at module level) without a CUDA device or without
    moespec's CUDA kernels."""
    import pytest

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device (torch.cuda.is_available() is False)", allow_module_level=True)
    from moespec._loader import native

    if not native().cuda_available():
        pytest.skip("moespec was built without CUDA kernels (configure with -DMOESPEC_CUDA=ON)",
                    allow_module_level=True)


SMOKE = os.environ.get("MOESPEC_GPU_SMOKE") in ("1", "virtual")
if os.environ.get("MOESPEC_GPU_SMOKE") == "virtual":  # the scripts' CUDA branches, on the CPU playing a
    import virtual_cuda  # CUDA device (tests/python/virtual_cuda.py) for the whole process

    _VIRTUAL = virtual_cuda.virtual_cuda()  # (kept: the patches last while it is alive)
    _VIRTUAL.__enter__()
DEVICE = torch.device("cuda" if not SMOKE or torch.cuda.is_available() else "cpu")  # where the scripts run


def profiler_activity():
    """(torch.profiler activity, torch.autograd.DeviceType) of DEVICE's kernels: the CPU's ops where this
    torch cannot trace a GPU (a smoke run)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, supported_activities

    if DEVICE.type == "cuda" and ProfilerActivity.CUDA in supported_activities():
        return ProfilerActivity.CUDA, DeviceType.CUDA
    return ProfilerActivity.CPU, DeviceType.CPU


def sync() -> None:
    """Waits for the device's work (nothing to wait for on the CPU)."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def device_name() -> str:
    return torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu (MOESPEC_GPU_SMOKE=1)"


def timed_calls(n: int) -> int:
    """How many calls a measurement times: ``n`` on a GPU, at most 2 in a smoke run (which checks that
    a script runs and what it writes, not its numbers)."""
    return min(n, 2) if SMOKE else n


def event_seconds(fn, repeats: int = 9) -> float:
    """Median seconds of ``fn`` between two CUDA events (after one untimed call); the host's clock
    in a smoke run."""
    fn()
    if SMOKE:
        return _host_median(fn, timed_calls(repeats))
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def captured(fn, calls: int = 1):
    """(graph, what the last captured call returned): ``fn`` called twice on a side stream (warm-up,
    as capture needs: the allocator's pools, lazy initialisations), then ``calls`` times captured in
    one CUDA graph (not replayed yet)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            out = fn()
    return graph, out


def graph_seconds(fn, calls: int = 20, replays: int = 5) -> float:
    """Seconds per call of ``fn`` captured ``calls`` times in one CUDA graph (median replay); in a smoke
    run the calls themselves, on the host's clock."""
    if DEVICE.type != "cuda":
        fn()
        return _host_median(fn, timed_calls(replays))
    graph, _ = captured(fn, calls)
    return event_seconds(graph.replay, replays) / calls


def _host_median(fn, repeats: int) -> float:
    from moespec.bench.roofline import _median_s  # (the CPU benches' timer)

    return _median_s(fn, repeats, warmup=0)


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """GB/s of a device-to-device copy, bytes read + written: the better of an eager copy timed by
    events and 5 copies in a graph (the yardstick is the faster: the stricter target)."""
    nbytes = min(nbytes, 1 << 20) if SMOKE else nbytes
    src = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    t = min(event_seconds(lambda: dst.copy_(src)), graph_seconds(lambda: dst.copy_(src), calls=5))
    return 2 * nbytes / t / 1e9


def results_saver(results: dict, name: str):
    """A function that writes ``results`` to $OUT/``name`` atomically (when OUT is set; returns whether
    it wrote): a timing script calls it after every row, so that one stopped by its time limit still
    brings back what ran."""
    def save() -> bool:
        out = os.environ.get("OUT")
        if not out:
            return False
        path = pathlib.Path(out) / name
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(results, indent=1))
        tmp.replace(path)
        return True
    return save


def union_length(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of [start, end) intervals (in any order; overlaps count once)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def timeline(step, first: int = 64) -> dict:
    """One call of ``step`` under torch's profiler, on the GPU's clock: ``span_us`` from its first
    kernel's start to its last kernel's end, ``busy_us`` the union of its kernels' intervals (kernels
    that overlap, as programmatic dependents do, count once), ``idle_us`` = span - busy (the GPU
    waiting inside the call: launch gaps between kernels, the host), and ``sequence``: its first
    ``first`` kernels in order as [name, start us after the first kernel's start, duration us]. What
    the call would gain from fewer kernels (a fusion) is at most its idle time plus the kernels'
    ramps. (A smoke run: the host's op intervals.)"""
    from torch.profiler import profile

    activity, kind = profiler_activity()
    sync()
    with profile(activities=[activity]) as prof:
        step()
        sync()
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == kind and e.time_range.end > e.time_range.start)
    if not spans:
        return {"span_us": 0.0, "busy_us": 0.0, "idle_us": 0.0, "sequence": []}
    busy = union_length([(start, end) for start, end, _ in spans])
    origin = spans[0][0]
    span = max(end for _, end, _ in spans) - origin

    def short(name: str) -> str:
        name = re.sub(r"\(anonymous namespace\)::|^void ", "", name)
        return name.split("(", 1)[0][:80]

    return {"span_us": span, "busy_us": busy, "idle_us": span - busy,
            "sequence": [[short(n), round(s - origin, 2), round(e - s, 2)] for s, e, n in spans[:first]]}
