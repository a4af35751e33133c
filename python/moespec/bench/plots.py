"""PNG plots of ``moespec bench compare`` (matplotlib, Agg: no display needed).

- :func:`pareto_plot`: speed-up against quality (the quality proxy ``d logp``, or where it was not
  computed the agreement with the unbudgeted greedy output), one point per policy; the budget
  sweep's Pareto front (no other point is both faster and more faithful) joined.
- :func:`experts_plot`: unique experts per MoE layer per verify step by policy: the mean over layers
  (bars: kept, outlined: natural) and, beside it, each layer's mean kept count.

Both take the ``policies`` rows of the compare JSON (:mod:`moespec.bench.run`). The GPU check's
timings (tests/gpu/run.sh's JSON; tests/gpu/plot_results.py draws them on a machine with matplotlib):

- :func:`gpu_steps_plot`: the runtime's verify step time against the unique experts a layer read
  (eager, graphs, graphs of the reference forward where timed, the roofline), and step / roofline by T;
- :func:`gpu_moe_plot`: the MoE kernel's share of the copy bandwidth against active experts, by
  shape and T, with the 70% target, and its speed-up over the best torch path;
- :func:`gpu_linear_plot`: the dense projection kernel's share of the copy bandwidth against T;
- :func:`mla_plot`: ``python -m moespec.bench.mla``'s DeepSeek-V3 attention layer in MLA's two forms
  against the cached slots (CPU or GPU).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence, Union


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points not dominated by another (x and y both at least as large, one larger),
    ordered by x descending (y then ascending)."""
    order = sorted(range(len(points)), key=lambda i: (-points[i][0], -points[i][1]))
    front, best = [], float("-inf")
    for i in order:
        if points[i][1] > best:
            front.append(i)
            best = points[i][1]
    return front


def pareto_plot(rows: Sequence[dict[str, Any]], path: Union[str, Path], *, baseline: str = "ar") -> Path:
    """Speed-up over ``baseline`` ("ar" or "eagle3") against the quality proxy ``logprob_delta`` (d logp:
    the reference continuation's mean log-probability under the policy's budget minus under none),
    or, when a row lacks it (an interrupted run), the token match rate (agreement up to the first
    divergence with the reference output); one labelled point per policy."""
    plt = _pyplot()
    key = f"speedup_vs_{baseline}"
    rows = [r for r in rows if r[key] is not None]
    quality = "logprob_delta" if all(r.get("logprob_delta") is not None for r in rows) else "token_match_rate"
    points = [(r[quality], r[key]) for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    for r, (x, y) in zip(rows, points):
        style = dict(marker="o", color="tab:blue") if r["budget"] is not None else dict(marker="s", color="tab:gray")
        ax.scatter([x], [y], zorder=3, **style)
        ax.annotate(r["label"], (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
    front = pareto_front(points)
    if len(front) > 1:
        ax.plot([points[i][0] for i in front], [points[i][1] for i in front], "--", color="tab:red", zorder=2,
                label="Pareto front")
        ax.legend(loc="lower left", fontsize=8)
    ax.axhline(1.0, color="black", linewidth=0.6)
    ax.set_xlabel("quality proxy d logp (per token; 0: exact)" if quality == "logprob_delta"
                  else "token match rate with the unbudgeted greedy output")
    ax.set_ylabel(f"speed-up over {baseline} (output tokens/s)")
    ax.set_title("Expert budget sweep: speed-up against quality")
    ax.grid(alpha=0.3)
    return _save(plt, fig, path)


def experts_plot(rows: Sequence[dict[str, Any]], layers: dict[str, Sequence[float]], path: Union[str, Path]) -> Path:
    """Left: mean kept (filled) and natural (outlined) unique experts per layer per verify step by
    policy (hatched: estimated, for policies whose steps are not recorded; a cross: the cost-aware
    selector's prediction, eco policies). Right: ``layers[label]``,
    each MoE layer's mean kept unique experts, one line per policy that recorded them."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10.5, 4.2))
    labels = [r["label"] for r in rows]
    x = list(range(len(rows)))
    kept = [r["kept_unique_per_layer"] or 0.0 for r in rows]
    natural = [r["natural_unique_per_layer"] or 0.0 for r in rows]
    left.bar(x, natural, width=0.6, fill=False, edgecolor="black", label="natural")
    left.bar(x, kept, width=0.6, color="tab:blue", alpha=0.8, label="kept")
    estimated = [i for i, r in enumerate(rows) if r["experts_estimated"]]
    if estimated:
        left.bar(estimated, [kept[i] for i in estimated], width=0.6, color="white", edgecolor="tab:blue", hatch="//",
                 label="kept (estimated)")
    guessed = [i for i, r in enumerate(rows) if r.get("predicted_unique_per_layer") is not None]
    if guessed:
        left.scatter(guessed, [rows[i]["predicted_unique_per_layer"] for i in guessed], marker="x", color="tab:red",
                     zorder=3, label="predicted (eco)")
    left.set_xticks(x, labels, rotation=30, ha="right", fontsize=8)
    left.set_ylabel("unique experts per MoE layer per step")
    left.set_title("Mean over layers and steps")
    left.legend(fontsize=8)
    for label, values in layers.items():
        if values:
            right.plot(range(len(values)), values, marker="o", label=label)
    from matplotlib.ticker import MaxNLocator

    right.xaxis.set_major_locator(MaxNLocator(integer=True))
    right.set_xlabel("MoE layer")
    right.set_ylabel("mean kept unique experts per verify step")
    right.set_title("By layer")
    if any(layers.values()):
        right.legend(fontsize=8)
    right.grid(alpha=0.3)
    return _save(plt, fig, path)


def gpu_steps_plot(bench: dict[str, Any], path: Union[str, Path]) -> Path:
    """``bench``: tests/gpu/bench_runtime_cuda.py's runtime_bench.json."""
    plt = _pyplot()
    rows = bench["rows"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    both = any("graphs_reference_forward_ms" in r for r in rows)  # (runs since the fused forward time both)
    series = [("ms", "eager (reference backend)", "o"), ("graphs_reference_forward_ms", "graphs, reference forward", "s"),
              ("graphs_ms", "graphs (fused forward)" if both else "graphs", "D"),
              ("replay_ms", "the graph's replay alone (no host work)", "v"),
              ("roofline_ms", "roofline (bytes / copy bandwidth)", "_")]
    for key, label, marker in series:
        points = sorted((r["unique"], r[key]) for r in rows if key in r and r[key] == r[key])  # (NaN: no graph)
        if points:
            left.scatter(*zip(*points), marker=marker, label=label, s=30)
    left.set_yscale("log")
    left.set_xlabel("unique experts a layer read (verify of T tokens, budget off or B)")
    left.set_ylabel("step time, ms")
    left.set_title(f"Verify steps, {bench.get('device', 'GPU')}")
    left.legend(fontsize=8)
    left.grid(alpha=0.3)
    for budget in sorted({r["budget"] for r in rows}, key=lambda b: (b is not None, b or 0)):
        own = sorted((r["T"], r["graphs_ms"] / r["roofline_ms"]) for r in rows if r["budget"] == budget)
        right.plot(*zip(*own), marker="o", label="budget off" if budget is None else f"budget {budget}")
    right.axhline(1.15, color="gray", linestyle="--", label="target: within 15% of the roofline")
    right.set_xscale("log", base=2)
    right.set_xlabel("T (new tokens in the verify pass)")
    right.set_ylabel("graphs step / roofline")
    right.set_title("Distance to the roofline")
    right.legend(fontsize=8)
    right.grid(alpha=0.3)
    return _save(plt, fig, path)


def gpu_moe_plot(bench: dict[str, Any], path: Union[str, Path]) -> Path:
    """``bench``: tests/gpu/bench_moe_experts_cuda.py's moe_experts_bench.json."""
    plt = _pyplot()
    rows = [r for r in bench["rows"] if "active" in r]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    styles = dict(zip(sorted({r["T"] for r in rows}), ("o:", "s-.", "D-", "^--", "v-", "x-")))
    for color, shape in zip(("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple"),
                            dict.fromkeys(r["shape"] for r in rows)):  # a colour a shape, a style a T
        for T in sorted({r["T"] for r in rows if r["shape"] == shape}):
            own = sorted((r["active"], r["of_copy"], r["x_torch"]) for r in rows if r["shape"] == shape and r["T"] == T)
            x = [o[0] for o in own]
            left.plot(x, [100 * o[1] for o in own], styles.get(T, "o-"), color=color, label=f"{shape} T={T}")
            right.plot(x, [o[2] for o in own], styles.get(T, "o-"), color=color, label=f"{shape} T={T}")
    left.axhline(70, color="gray", linestyle="--", label="target at T <= 16: 70%")
    right.axhline(1.5, color="gray", linestyle="--", label="target: 1.5x")
    for ax, label, title in ((left, "% of the device copy bandwidth", "Bytes of the active experts / time"),
                             (right, "best torch path / moespec", "Against torch's grouped_mm and a per-expert loop")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("active experts")
        ax.set_ylabel(label)
        ax.set_title(f"{title}, {bench.get('device', 'GPU')}" if ax is left else title, fontsize=10)
        ax.grid(alpha=0.3)
    left.legend(fontsize=6, ncol=2)
    right.legend(fontsize=6, ncol=2)
    return _save(plt, fig, path)


def gpu_linear_plot(bench: dict[str, Any], path: Union[str, Path]) -> Path:
    """``bench``: tests/gpu/bench_linear_cuda.py's linear_bench.json: % of the copy bandwidth against
    T, moespec's kernel (solid) and torch's GEMM (dotted), a colour a projection."""
    plt = _pyplot()
    rows = bench["rows"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:gray")
    for color, shape in zip(colors, dict.fromkeys(r["shape"] for r in rows)):
        own = sorted((r["T"], r["of_copy"], r["torch_of_copy"]) for r in rows if r["shape"] == shape)
        ts = [o[0] for o in own]
        ax.plot(ts, [100 * o[1] for o in own], "o-", color=color, label=f"{shape}: moespec")
        ax.plot(ts, [100 * o[2] for o in own], "x:", color=color, label=f"{shape}: torch")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens T")
    ax.set_ylabel("% of the device copy bandwidth")
    ax.set_title(f"Dense projections: weight bytes / time, {bench.get('device', 'GPU')}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    return _save(plt, fig, path)


def mla_plot(result: dict, path) -> Path:
    """``result``: python -m moespec.bench.mla's mla.json: a DeepSeek-V3 attention layer's time against
    the cached slots S, a colour per T, MLA's expanded form dotted and its absorbed form solid."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    rows = result["rows"]
    for T, color in zip(sorted({r["T"] for r in rows}), ("tab:blue", "tab:orange", "tab:green", "tab:red")):
        mine = sorted((r for r in rows if r["T"] == T), key=lambda r: r["S"])
        S = [r["S"] for r in mine]
        ax.plot(S, [r["expanded_ms"] for r in mine], "x:", color=color, label=f"T={T}: expanded (transformers)")
        ax.plot(S, [r["absorbed_ms"] for r in mine], "o-", color=color, label=f"T={T}: absorbed")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("cached slots S")
    ax.set_ylabel("ms per attention layer")
    ax.set_title(f"DeepSeek-V3 attention (MLA), {result['dtype']}, {result['device']}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(plt, fig, path)


def _save(plt: Any, fig: Any, path: Union[str, Path]) -> Path:
    """Lays out, writes atomically (creating the folder) and closes ``fig``; returns the path."""
    import os

    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")
    try:
        fig.savefig(tmp, dpi=120)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
        plt.close(fig)
    return path
