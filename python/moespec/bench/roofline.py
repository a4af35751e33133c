"""``moespec bench roofline``: does a step cost what its bytes cost? One run, one table, one plot.

    moespec bench roofline --engine <folder> [--context 128] [--repeats 7] [--budget B]
                           [--out-dir build/bench/roofline]

In one process it measures
1. this machine: the read-only stream bandwidth (the best of a float32 and an int64 sum over a
   1 GiB buffer, ``--stream-gib``; and a copy counted once) and the matmul throughput (the best of
   torch's bf16 and fp32 GEMMs and moespec's bf16 ``linear`` on compute-bound shapes);
2. the engine's steps after a ``--context``-token prompt: the decode step, verify steps of
   T in {2, 4, 8, 16, 32, 64} tokens (a chain) without and with an expert budget, a draft step (the
   head's whole EAGLE-2 tree of the engine's depth and branching) and an eagle3 step (draft, verify,
   accept, commit, catch-up) with a 16-node tree;
and prints for each the bytes it reads (dense weights + the unique experts it touched + KV cache),
its FLOPs, the median time, the achieved GB/s and its share of the roofline
``max(bytes / bandwidth, FLOPs / peak)`` (100% = at the roofline). The decode step is split by
phase (the native step's own clock) and into native time and host time (Python, dispatch,
allocation: the call minus its native step), and so are verify steps of 2, 17 and 33 tokens. Writes ``roofline.json`` (atomically) and
``roofline.png`` (step time against tokens, the roofline drawn) into ``--out-dir``.

Dimensions: T tokens of a step, S context, L layers, H hidden, V vocabulary.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

VERIFY_SIZES = (2, 4, 8, 16, 32, 64)


def _median_s(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# ---- the machine ----------------------------------------------------------------------------------


def stream_bandwidth(gib: float = 1.0, repeats: int = 5) -> dict[str, float]:
    """GB/s (1e9 bytes/s) of reading a ``gib`` GiB buffer: float32 sum, int64 sum, copy (bytes once)."""
    n = int(gib * 2**30) // 4
    buf = torch.ones(n, dtype=torch.float32)
    nbytes = buf.numel() * 4
    out = {
        "read_f32_sum": nbytes / _median_s(lambda: buf.sum(), repeats) / 1e9,
        "read_i64_sum": nbytes / _median_s(lambda: buf.view(torch.int64).sum(), repeats) / 1e9,
    }
    dst = torch.empty_like(buf)
    out["copy"] = nbytes / _median_s(lambda: dst.copy_(buf), repeats) / 1e9
    out["read"] = max(out["read_f32_sum"], out["read_i64_sum"])
    return out


def matmul_peak(repeats: int = 5) -> dict[str, float]:
    """GFLOP/s of matrix products: torch's bf16 GEMM (512^3), its fp32 GEMM (1024^3: a bf16 product
    on a CPU without bf16 dot products runs on the fp32 FMAs, so this is the machine's real ceiling
    there) and moespec's bf16 ``linear`` (64 x 2048 x 4096). The peak is the best of the three."""
    from moespec.ops import linear

    g = torch.Generator().manual_seed(0)
    out = {}
    for name, n, dtype in (("torch_gemm_bf16", 512, torch.bfloat16), ("torch_gemm_fp32", 1024, torch.float32)):
        a, b = torch.randn(n, n, generator=g).to(dtype), torch.randn(n, n, generator=g).to(dtype)
        out[name] = 2 * n**3 / _median_s(lambda: a @ b, repeats) / 1e9
    x = torch.randn(64, 2048, generator=g).bfloat16()
    w = torch.randn(4096, 2048, generator=g).bfloat16()
    out["moespec_linear_t64"] = 2 * 64 * 2048 * 4096 / _median_s(lambda: linear(x, w), repeats) / 1e9
    out["peak"] = max(out.values())
    return out


# ---- what a step reads and computes ---------------------------------------------------------------


def step_cost(model, tokens: int, context: int, kept: Optional[Sequence[float]]) -> dict[str, float]:
    """Bytes and FLOPs of one step of ``tokens`` new tokens after ``context`` cached ones.

    ``kept``: unique experts per MoE layer this step read (from its expert stats); the routed
    experts' FLOPs count each token's top-k slots. Dense bytes: every projection, norm and the
    lm_head once; the embedding rows of the tokens. KV: every layer reads its S + T slots of k and v
    and writes T.
    """
    c, w = model.config, model.weights
    es = w.lm_head.element_size()
    T, S = tokens, context + tokens
    dense = w.lm_head.numel() + w.final_norm.numel()
    for layer in w.layers:
        for f in ("input_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "o", "o_bias", "post_norm", "gate_up", "down",
                  "router", "shared_gate_up", "shared_down", "shared_gate"):
            t = getattr(layer, f)
            dense += t.numel() if t is not None else 0
    expert_params = 0
    flops_experts = 0.0
    if c.moe is not None:
        per_expert = 3 * c.moe.intermediate_size * c.hidden_size
        expert_params = per_expert * sum(kept or [])
        flops_experts = 2.0 * T * c.moe.top_k * per_expert * len(c.moe_layers)
    kv = c.num_layers * c.num_kv_heads * c.head_dim * 2 * (S + T)
    attn_flops = 4.0 * T * S * c.num_heads * c.head_dim * c.num_layers
    return {
        "bytes_dense": float((dense + T * c.hidden_size) * es),
        "bytes_experts": float(expert_params * es),
        "bytes_kv": float(kv * es),
        "bytes": float((dense + T * c.hidden_size + expert_params + kv) * es),
        "flops": 2.0 * T * dense + flops_experts + attn_flops,
    }


def byte_profile(model, bytes_per_weight: Optional[int] = None) -> Optional[dict[str, float]]:
    """The premise in bytes (weights only, no KV): what one decode token reads (its top-k experts),
    what a verify pass touching every expert reads, their ratio and the routed experts' share of the
    weights; in the model's dtype, or at ``bytes_per_weight`` a weight. None for a dense model."""
    c = model.config
    if c.moe is None:
        return None
    layers = len(c.moe_layers)
    scale = (bytes_per_weight or model.weights.lm_head.element_size()) / model.weights.lm_head.element_size()
    decode = step_cost(model, 1, 0, [float(c.moe.top_k)] * layers)
    full = step_cost(model, 1, 0, [float(c.moe.num_experts)] * layers)
    mb = lambda cost: (cost["bytes"] - cost["bytes_kv"]) * scale / 1e6  # noqa: E731
    return {"decode_mb": mb(decode), "full_union_mb": mb(full), "ratio": mb(full) / mb(decode),
            "expert_share": full["bytes_experts"] / (full["bytes"] - full["bytes_kv"])}


def _row(name: str, tokens: int, seconds: float, cost: dict[str, float], machine: dict[str, Any],
         kept: Optional[float] = None) -> dict[str, Any]:
    bw, peak = machine["bandwidth_gbs"] * 1e9, machine["peak_gflops"] * 1e9
    roof = max(cost["bytes"] / bw, cost["flops"] / peak)
    return {"step": name, "tokens": tokens, "ms": seconds * 1e3, "mb": cost["bytes"] / 1e6,
            "mb_experts": cost["bytes_experts"] / 1e6, "gflop": cost["flops"] / 1e9,
            "gbs": cost["bytes"] / seconds / 1e9, "roofline_ms": roof * 1e3, "pct_roofline": 100.0 * roof / seconds,
            "bound": "memory" if cost["bytes"] / bw >= cost["flops"] / peak else "compute", "experts_per_layer": kept}


# ---- the engine's steps ---------------------------------------------------------------------------


# A fixed text for the steps' context: with real text the draft head is accepted as in use, so the
# eagle3 step's catch-up and tokens per step are representative (after random tokens the head is
# never right). Cut or repeated to the context length; random tokens when the engine has no tokenizer.
_CONTEXT_TEXT = (
    "def binary_search(items, target):\n"
    "    \"\"\"Return the index of target in the sorted list items, or -1 if it is absent.\"\"\"\n"
    "    low, high = 0, len(items) - 1\n"
    "    while low <= high:\n"
    "        middle = (low + high) // 2\n"
    "        if items[middle] == target:\n"
    "            return middle\n"
    "        if items[middle] < target:\n"
    "            low = middle + 1\n"
    "        else:\n"
    "            high = middle - 1\n"
    "    return -1\n\n\n"
    "def merge_sort(items):\n"
    "    \"\"\"Return a sorted copy of items.\"\"\"\n"
)


def _prompt(engine, context: int) -> list[int]:
    if engine.tokenizer is None:
        gen = torch.Generator().manual_seed(0)
        return torch.randint(3, engine.target.config.vocab_size, (context,), generator=gen).tolist()
    ids = engine.tokenizer(_CONTEXT_TEXT)["input_ids"]
    return (ids * (context // len(ids) + 1))[-context:]


def measure_steps(engine, *, context: int, repeats: int, budget: Optional[int], machine: dict[str, Any],
                  progress: bool = True) -> dict[str, Any]:
    from tqdm import tqdm

    from moespec.ops import ExpertBudget

    target = engine.target
    c = target.config
    prompt = _prompt(engine, context)
    if engine.head is not None:
        target.set_taps(engine.head.config.aux_layers)
    cache = target.new_cache(1, context + 160)
    target.prefill(cache, [prompt])
    moe = c.moe is not None
    N = c.moe.num_experts if moe else 0
    budget = budget if budget is not None else (N // 2 if moe else None)
    rows, stats_of = [], {}

    def decode():
        out = target.decode(cache, [int(prompt[-1])])
        cache.lengths[0] = context
        stats_of["decode"] = out.expert_stats

    def verify(T: int, b: Optional[ExpertBudget], key: str):
        tokens = torch.randint(3, c.vocab_size, (T,), generator=torch.Generator().manual_seed(T)).tolist()
        parents = [-1] + list(range(T - 1))

        def run():
            out = target.verify(cache, [tokens], [parents], budget=b)
            cache.pending = None
            stats_of[key] = out.expert_stats
        return run

    cases = [("decode", 1, decode, "decode")]
    for T in VERIFY_SIZES:
        cases.append((f"verify T={T}", T, verify(T, None, f"v{T}"), f"v{T}"))
        if moe and budget is not None and budget < N:
            cases.append((f"verify T={T} budget {budget}", T, verify(T, ExpertBudget(budget), f"b{T}"), f"b{T}"))
    for name, T, fn, key in tqdm(cases, desc="roofline: target steps", disable=not progress, leave=False):
        seconds = _median_s(fn, repeats)
        kept = stats_of[key][:, 1].float().tolist() if moe else None
        rows.append(_row(name, T, seconds, step_cost(target, T, context, kept), machine,
                         sum(kept) / len(kept) if kept else None))

    splits = _step_splits(target, cache, context, repeats)
    if engine.head is not None:
        rows.extend(_speculative_steps(engine, prompt, repeats, machine, progress))
    return {"context": context, "budget": budget, "steps": rows, "splits": splits}


SPLIT_SIZES = (1, 2, 17, 33)  # steps whose time is split by phase: decode, and verify of 2, 17, 33 tokens


def _step_splits(target, cache, context: int, repeats: int) -> dict[str, Any]:
    """Per step size of SPLIT_SIZES: the time by phase (the native step's own clock) and native
    against host time (the call minus its native step: Python, dispatch, allocation)."""
    backend = target.backend
    if backend.name != "native":
        return {"backend": backend.name}
    decoder = backend.decoder
    native_seconds: list[float] = []
    original = decoder.step

    def timed(*args, **kwargs):
        start = time.perf_counter()
        original(*args, **kwargs)
        native_seconds.append(time.perf_counter() - start)

    out: dict[str, Any] = {"backend": "native", "steps": {}}
    decoder.set_profiling(True)
    backend.decoder = _Wrapped(decoder, timed)
    try:
        for T in SPLIT_SIZES:
            tokens = [(7 * i + 3) % target.config.vocab_size for i in range(T)]
            parents = [-1] + list(range(T - 1))
            total = []
            native_seconds.clear()
            decoder.reset_profile()
            for _ in range(repeats + 1):
                start = time.perf_counter()
                if T == 1:
                    target.decode(cache, tokens)
                else:
                    target.verify(cache, [tokens], [parents])
                    cache.pending = None
                total.append(time.perf_counter() - start)
                cache.lengths[0] = context
            phases = {k: v / (repeats + 1) * 1e3 for k, v in decoder.profile().items()}
            step_ms, native_ms = statistics.median(total) * 1e3, statistics.median(native_seconds) * 1e3
            out["steps"]["decode" if T == 1 else f"verify T={T}"] = {
                "step_ms": step_ms, "native_ms": native_ms, "host_ms": step_ms - native_ms,
                "host_share": (step_ms - native_ms) / step_ms, "phases_ms": phases}
    finally:
        backend.decoder = decoder
        decoder.set_profiling(False)
    return out


class _Wrapped:
    """A DecoderModel whose step goes through ``fn`` (timing), everything else passed through."""

    def __init__(self, decoder, fn):
        self._decoder, self.step = decoder, fn

    def __getattr__(self, name):
        return getattr(self._decoder, name)


def _speculative_steps(engine, prompt: list[int], repeats: int, machine: dict[str, Any], progress: bool):
    """The draft step (the head's whole tree) and an eagle3 step with a 16-node tree."""
    from moespec.spec.eagle3_policy import Eagle3Policy
    from moespec.spec.llm import SpeculativeConfig, _Request
    from moespec.spec.sampling import SamplingParams

    from moespec.bench.run import tree_settings

    tree = tree_settings(engine)
    depth, top_k = tree["depth"], tree["top_k"]
    out = []
    for total in (16,):
        config = SpeculativeConfig("eagle3", depth=depth, top_k=top_k, total_tokens=total)
        policy = Eagle3Policy(engine.target, engine.head, config)
        request = _Request(0, None, list(prompt), SamplingParams(max_tokens=repeats * 8 + 16, ignore_eos=True), set())
        run = policy.start([request])
        request.output.append(run.first_tokens[0])
        draft = _median_s(lambda: policy._draft(run, [request.last]), repeats)
        out.append(_row(f"draft step (depth {depth}, top-{top_k})", 0, draft,
                        {"bytes": 1.0, "bytes_experts": 0.0, "flops": 0.0}, machine))
        out[-1].update(mb=None, gbs=None, roofline_ms=None, pct_roofline=None, bound=None)
        times, sizes = [], []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            emitted = policy.step(run, [request])
            times.append(time.perf_counter() - start)
            request.output.extend(emitted[0])
            sizes.append(len(emitted[0]))
        step = statistics.median(times[1:])
        out.append({"step": f"eagle3 step ({total}-node tree)", "tokens": total + 1, "ms": step * 1e3, "mb": None,
                    "mb_experts": None, "gflop": None, "gbs": None, "roofline_ms": None, "pct_roofline": None,
                    "bound": None, "experts_per_layer": None,
                    "accepted_mean": sum(sizes[1:]) / max(len(sizes) - 1, 1)})
    return out


# ---- report -------------------------------------------------------------------------------------


def format_roofline(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [
        f"machine: read {m['bandwidth_gbs']:.1f} GB/s (f32 sum {m['stream']['read_f32_sum']:.1f}, i64 sum "
        f"{m['stream']['read_i64_sum']:.1f}, copy {m['stream']['copy']:.1f}), bf16 peak {m['peak_gflops']:.0f} GFLOP/s "
        f"(torch GEMM bf16 {m['matmul']['torch_gemm_bf16']:.0f} / fp32 {m['matmul']['torch_gemm_fp32']:.0f}, moespec "
        f"linear bf16 T=64 {m['matmul']['moespec_linear_t64']:.0f}); "
        f"{m['threads']} threads, CPU ISA {m['cpu_isa']}",
        f"engine: {result['engine']} ({result['dtype']}), backend {result['backend']}, context {result['context']} "
        f"tokens, budget {result['budget']}",
        "",
        f"{'step':<28}{'T':>4}{'ms':>9}{'MB':>9}{'GFLOP':>8}{'GB/s':>8}{'roof ms':>9}{'% roof':>8}  bound   experts",
        "-" * 100,
    ]
    decode_ms = next(r["ms"] for r in result["steps"] if r["step"] == "decode")
    for r in result["steps"]:
        if r["mb"] is None:
            extra = f"  = {r['ms'] / decode_ms:.2f} decode steps"
            if "accepted_mean" in r:
                extra += f", {r['accepted_mean']:.2f} tokens/step"
            lines.append(f"{r['step']:<28}{r['tokens'] or '':>4}{r['ms']:>9.2f}{extra}")
            continue
        experts = f"{r['experts_per_layer']:.1f}" if r["experts_per_layer"] is not None else "-"
        lines.append(f"{r['step']:<28}{r['tokens']:>4}{r['ms']:>9.2f}{r['mb']:>9.1f}{r['gflop']:>8.2f}{r['gbs']:>8.1f}"
                     f"{r['roofline_ms']:>9.2f}{r['pct_roofline']:>7.0f}%  {r['bound']:<7} {experts}")
    splits = result["splits"]
    if splits.get("backend") == "native":
        names = list(next(iter(splits["steps"].values()))["phases_ms"])
        lines += ["", "where a step goes (ms; native phases by the step's own clock, host = the call minus the native step)",
                  f"{'step':<14}{'total':>7}{'host':>7}" + "".join(f"{n:>{max(len(n), 6) + 1}}" for n in names)]
        for name, sp in splits["steps"].items():
            lines.append(f"{name:<14}{sp['step_ms']:>7.2f}{sp['host_ms']:>7.2f}"
                         + "".join(f"{sp['phases_ms'][n]:>{max(len(n), 6) + 1}.2f}" for n in names))
    return "\n".join(lines)


def roofline_plot(result: dict[str, Any], path: Path) -> Path:
    from moespec.bench.plots import _pyplot, _save

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, pick, style in (("no budget", lambda r: "budget" not in r["step"], "o-"),
                               (f"budget {result['budget']}", lambda r: "budget" in r["step"], "s--")):
        pts = [r for r in result["steps"] if r["mb"] is not None and pick(r)]
        if pts:
            ax.plot([r["tokens"] for r in pts], [r["ms"] for r in pts], style, label=f"measured, {label}")
            ax.plot([r["tokens"] for r in pts], [r["roofline_ms"] for r in pts], style[0] + ":", alpha=0.6,
                    label=f"roofline, {label}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens in the step (decode = 1, verify chains)")
    ax.set_ylabel("step time (ms)")
    m = result["machine"]
    ax.set_title(f"{result['engine']}: step time vs roofline\n(read {m['bandwidth_gbs']:.0f} GB/s, bf16 "
                 f"{m['peak_gflops']:.0f} GFLOP/s, {m['threads']} threads)", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def run_roofline(engine_folder: str, *, context: int = 128, repeats: int = 7, budget: Optional[int] = None,
                 dtype: Optional[str] = None, stream_gib: float = 1.0, progress: bool = True) -> dict[str, Any]:
    from moespec._loader import native
    from moespec.bench.run import open_engine

    if context < 1 or repeats < 1:
        raise ValueError(f"roofline: --context and --repeats must be >= 1, got {context} and {repeats}")
    if not 0 < stream_gib <= 16:
        raise ValueError(f"roofline: --stream-gib must be in (0, 16], got {stream_gib}")
    engine = open_engine(engine_folder, dtype)
    if budget is not None and engine.target.config.moe is not None and budget < engine.target.config.moe.top_k:
        raise ValueError(f"roofline: --budget {budget} is below top_k={engine.target.config.moe.top_k}")
    stream = stream_bandwidth(stream_gib)
    matmul = matmul_peak()
    machine = {"bandwidth_gbs": stream["read"], "peak_gflops": matmul["peak"], "stream": stream, "matmul": matmul,
               "threads": native().num_threads(), "torch_threads": torch.get_num_threads(),
               "cpu_isa": native().cpu_isa()}
    steps = measure_steps(engine, context=context, repeats=repeats, budget=budget, machine=machine,
                          progress=progress)
    return {"engine": Path(engine_folder).name, "dtype": str(engine.target.dtype).removeprefix("torch."),
            "backend": engine.target.backend_name, "machine": machine, **steps}


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="moespec bench roofline", description=__doc__.splitlines()[0])
    p.add_argument("--engine", required=True, help="engine folder (moespec build)")
    p.add_argument("--context", type=int, default=128, help="prompt tokens before the measured steps")
    p.add_argument("--repeats", type=int, default=7, help="timed repeats per step (median)")
    p.add_argument("--budget", type=int, help="expert budget of the budgeted verify steps (default N/2)")
    p.add_argument("--dtype", choices=("bf16", "fp32"))
    p.add_argument("--stream-gib", type=float, default=1.0, help="size of the bandwidth test's buffer (GiB)")
    p.add_argument("--out-dir", default="build/bench/roofline")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    try:
        result = run_roofline(args.engine, context=args.context, repeats=args.repeats, budget=args.budget,
                              dtype=args.dtype, stream_gib=args.stream_gib, progress=not args.no_progress)
    except ValueError as exc:
        print(f"moespec bench roofline: error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out_dir)
    from moespec.bench.report import write_json_atomic

    write_json_atomic(out / "roofline.json", result)
    roofline_plot(result, out / "roofline.png")
    print(format_roofline(result))
    print(f"\nwrote {out / 'roofline.json'} and {out / 'roofline.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
