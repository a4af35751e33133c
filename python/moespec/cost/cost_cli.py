"""``moespec analyze profile | speedup | calibrate``: hardware profiles, predicted speed-up, calibration.

    moespec analyze profile   --out cpu.json [--engine <folder>] [--repeats 5] [--matrix-mib 128]
    moespec analyze speedup   --shape <name,...|all> --hardware <h200|h100-sxm|b200|profile.json>
                              [--model model.json] [--batch 1,2,4,...,64] [--tree 2,4,4] [--acceptance AL | trace.npz]
                              [--context 1024] [--out-dir build/analyze/speedup]
    moespec analyze calibrate --engine <folder> --profile cpu.json [--context 128] [--repeats 5] [--json out.json]
    moespec analyze schedule  --shape <name> | --engine <folder>  --hardware <h200|...|profile.json> [--model m.json]
                              --acceptance AL [--depth 2] [--max-batch 64] [--max-drafts 7] [--context 1024]
                              [--budget B] [--out schedule.json]     (vLLM's drafts-per-batch-size schedule)
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

CALIBRATION_SIZES = (1, 2, 4, 8, 16, 32, 64)


def add_parsers(sub) -> None:
    p = sub.add_parser("profile", help="measure this machine's bandwidth, matrix kernel and step overhead (.json)")
    p.add_argument("--out", required=True)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--matrix-mib", type=int, default=128, help="size of the timed bf16 matrix (beyond the caches)")
    p.add_argument("--engine", help="time the kernels at this engine's hidden size and expert shape")
    s = sub.add_parser("speedup", help="predicted speed-up against batch size and tree size (table + PNG)")
    s.add_argument("--shape", default="all", help="catalogue names, comma-separated, or all")
    s.add_argument("--hardware", default="h200", help="h100-sxm, h200, b200 or a profile .json")
    s.add_argument("--model", help="coactivation model.json whose routing statistics are transferred (default: "
                                   "synthetic)")
    s.add_argument("--batch", default="1,2,4,8,16,32,64")
    s.add_argument("--tree", default="2,4,4", help="depth,top_k,total_tokens or chain:n")
    s.add_argument("--acceptance", default="2.5", help="tokens per speculative step, or a trace to measure it on")
    s.add_argument("--context", type=int, default=1024, help="cached tokens per request")
    s.add_argument("--out-dir", default="build/analyze/speedup")
    d = sub.add_parser("schedule", help="cost-optimal chain drafts per batch size: vLLM's "
                                        "num_speculative_tokens_per_batch_size (table + JSON + PNG)")
    where = d.add_mutually_exclusive_group(required=True)
    where.add_argument("--shape", help="a catalogue name (moespec analyze speedup --shape all lists them)")
    where.add_argument("--engine", help="an engine folder (its model's shape)")
    d.add_argument("--hardware", default="h200", help="h100-sxm, h200, b200 or a profile .json")
    d.add_argument("--model", help="coactivation model.json whose routing statistics are transferred (default: "
                                   "synthetic)")
    d.add_argument("--acceptance", type=float, required=True, help="tokens per step measured with --depth drafts")
    d.add_argument("--depth", type=int, default=2, help="chain drafts the acceptance was measured with")
    d.add_argument("--max-batch", type=int, default=64)
    d.add_argument("--max-drafts", type=int, default=7)
    d.add_argument("--context", type=int, default=1024, help="cached tokens per request")
    d.add_argument("--budget", type=int, help="MoE-Spec's expert cap on verify passes (acceptance measured under it)")
    d.add_argument("--out", help="write the schedule JSON here (and a PNG beside it)")
    c = sub.add_parser("calibrate", help="the cost model against measured decode and verify steps")
    c.add_argument("--engine", required=True)
    c.add_argument("--profile", required=True, help="this machine's profile (moespec analyze profile)")
    c.add_argument("--context", type=int, default=128)
    c.add_argument("--repeats", type=int, default=5)
    c.add_argument("--json")


def _ints(text: str, name: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--{name}: expected comma-separated integers, got {text!r}") from None
    if not out:
        raise ValueError(f"--{name}: give at least one value")
    return out


def run(args) -> int:
    from moespec.bench.report import write_json_atomic

    if args.command == "profile":
        from moespec.cost.hardware import measure_cpu, save_profile

        if not 1 <= args.repeats <= 100:
            raise ValueError(f"--repeats must be in [1, 100], got {args.repeats}")
        hidden, experts, model = 2048, None, None
        if args.engine:
            from moespec.engine import load_engine

            model = load_engine(args.engine)[0]
            config = model.config
            if config.moe is None:
                raise ValueError(f"--engine {args.engine}: the model has no MoE layer")
            hidden, experts = config.hidden_size, (config.moe.num_experts, config.moe.intermediate_size,
                                                   config.hidden_size)
        hw = measure_cpu(repeats=args.repeats, matrix_mib=args.matrix_mib, hidden=hidden, experts=experts,
                         engine=model, progress=not args.no_progress)
        save_profile(args.out, hw)
        print(f"read bandwidth {hw.bandwidth_gbs:.1f} GB/s, peak {hw.peak_tflops * 1e3:.0f} GFLOP/s, step overhead "
              f"{hw.step_overhead_us:.0f} us, per token and layer besides weights {hw.token_layer_us:.1f} us"
              f"\nbf16 matrix kernel, GB/s of weights at M tokens: "
              + ", ".join(f"M={m}: {v:.1f}" for m, v in hw.matrix_gbs.items())
              + ("\nMoE kernel, GB/s of expert weights at m tokens per expert: "
                 + ", ".join(f"m={m}: {v:.1f}" for m, v in hw.expert_gbs.items()) if hw.expert_gbs else "")
              + f"\nwrote {args.out}")
        return 0
    if args.command == "speedup":
        result = speedup(args)
        write_json_atomic(Path(args.out_dir) / "speedup.json", result)
        print(format_speedup(result))
        print(f"\nwrote {args.out_dir}/speedup.json, speedup_batch.png, speedup_tree.png")
        return 0
    if args.command == "schedule":
        result = schedule(args)
        from moespec.cost.schedule import format_schedule

        print(format_schedule(result))
        if args.out:
            write_json_atomic(Path(args.out), result)
            schedule_plot(result, Path(args.out).with_suffix(".png"))
            print(f"wrote {args.out} and {Path(args.out).with_suffix('.png')}")
        return 0
    if args.command == "calibrate":
        result = calibrate(args.engine, args.profile, context=args.context, repeats=args.repeats,
                           progress=not args.no_progress)
        print(format_calibration(result))
        if args.json:
            write_json_atomic(Path(args.json), result)
            print(f"wrote {args.json}")
        return 0
    raise ValueError(f"unknown command {args.command}")


# ---- speedup --------------------------------------------------------------------------------------


def speedup(args) -> dict[str, Any]:
    from moespec.cost.coactivation import CoactivationModel
    from moespec.cost.hardware import hardware
    from moespec.cost.shapes import CATALOGUE, shape
    from moespec.cost.speedup import (_label, acceptance_from_trace, predict_speedup, scaled_acceptance,
                                      speedup_plot, transfer, tree_group, tree_sizes)

    hw = hardware(args.hardware)
    names = list(CATALOGUE) if args.shape == "all" else [x.strip() for x in args.shape.split(",") if x.strip()]
    shapes = [shape(n) for n in names]
    batches = _ints(args.batch, "batch")
    if args.context < 0 or args.context > 1_000_000:
        raise ValueError(f"--context must be in [0, 1000000], got {args.context}")
    if Path(args.acceptance).suffix == ".npz":
        from moespec.models.trace import load_trace

        acceptance, acceptance_source = acceptance_from_trace(load_trace(args.acceptance)), args.acceptance
    else:
        try:
            acceptance, acceptance_source = float(args.acceptance), "given"
        except ValueError:
            raise ValueError(f"--acceptance: expected a number or a trace .npz, got {args.acceptance!r}") from None
    model = CoactivationModel.load(args.model) if args.model else None
    by_batch, by_tree, routing_label = {}, {}, None
    for s in shapes:
        routing = transfer(s.num_experts, s.top_k, model)
        routing_label = _label(routing)
        by_batch[s.name] = predict_speedup(s, hw, batches=batches, tree=args.tree, acceptance=acceptance,
                                           context=args.context, routing=routing)
        rows, base_depth = [], tree_group(args.tree)[1]
        for tree in tree_sizes(64):
            al = scaled_acceptance(acceptance, base_depth, tree_group(tree)[1])
            row = predict_speedup(s, hw, batches=[1], tree=tree, acceptance=al, context=args.context,
                                  routing=routing)[0]
            rows.append(dict(row, tree=tree, acceptance=al))
        by_tree[s.name] = rows
    out = Path(args.out_dir)
    title = (f"{hw.name}: {hw.bandwidth_gbs:.0f} GB/s, {hw.peak_tflops:.0f} TFLOP/s; tree {args.tree}, "
             f"AL {acceptance:.2f}, context {args.context}; {routing_label}")
    speedup_plot(by_batch, out / "speedup_batch.png", title=title)
    speedup_plot(by_tree, out / "speedup_tree.png",
                 title=title.replace(f"tree {args.tree}, AL {acceptance:.2f}",
                                     f"batch 1, AL {acceptance:.2f} at depth {tree_group(args.tree)[1]}, "
                                     "per-level acceptance held"),
                 x_key="tree_tokens", x_label="draft tree tokens per request (root included)")
    return {"hardware": hw.to_json(), "tree": args.tree, "acceptance": acceptance, "acceptance_source":
            acceptance_source, "context": args.context, "routing": routing_label, "by_batch": by_batch,
            "by_tree": by_tree}


def format_speedup(r: dict[str, Any]) -> str:
    lines = [f"hardware {r['hardware']['name']}; tree {r['tree']}; acceptance {r['acceptance']:.2f} "
             f"({r['acceptance_source']}); context {r['context']}; {r['routing']}",
             f"{'shape':<20}{'batch':>6}{'U ar':>7}{'U ver':>7}{'ar ms':>8}{'ver ms':>8}{'draft':>7}"
             f"{'x ipf':>7}{'x indep':>8}"]
    for name, rows in r["by_batch"].items():
        for row in rows:
            a, b = row["ipf"], row["independent"]
            lines.append(f"{name:<20}{row['batch']:>6}{a['unique_ar']:>7.1f}{a['unique_verify']:>7.1f}"
                         f"{a['ar_ms']:>8.3f}{a['verify_ms']:>8.3f}{a['draft_ms']:>7.3f}{a['speedup']:>7.2f}"
                         f"{b['speedup']:>8.2f}")
        pays = {p: [row["batch"] for row in rows if row[p]["speedup"] >= 1] for p in ("ipf", "independent")}
        lines.append(f"{'':<20}speculation pays (>= 1x) at batch {pays['ipf'] or 'none'} (IPF), "
                     f"{pays['independent'] or 'none'} (independence)")
    return "\n".join(lines)


# ---- schedule -------------------------------------------------------------------------------------


def schedule(args) -> dict[str, Any]:
    from moespec.cost.coactivation import CoactivationModel
    from moespec.cost.hardware import hardware
    from moespec.cost.schedule import draft_schedule
    from moespec.cost.shapes import shape
    from moespec.cost.speedup import transfer

    if args.engine:
        from moespec.cost.step_cost import shape_from_config
        from moespec.engine.folder import config_from_dict, read_manifest

        folder = Path(args.engine)
        target = shape_from_config(config_from_dict(read_manifest(folder)["config"]), folder.name)
    else:
        target = shape(args.shape)
    model = CoactivationModel.load(args.model) if args.model else None
    return draft_schedule(target, hardware(args.hardware), transfer(target.num_experts, target.top_k, model),
                          acceptance=args.acceptance, depth=args.depth, max_batch=args.max_batch,
                          max_drafts=args.max_drafts, context=args.context, budget=args.budget)


def schedule_plot(r: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    batches = [row["batch"] for row in r["rows"]]
    for k in range(r["max_drafts"] + 1):
        top.plot(batches, [row["prices"][k]["speedup"] for row in r["rows"]], marker=".", label=f"K={k}")
    top.set_ylabel("predicted x plain decoding")
    top.legend(ncol=4, fontsize=7)
    bottom.step(batches, [row["drafts"] for row in r["rows"]], where="post")
    bottom.set_ylabel("drafts chosen")
    bottom.set_xlabel("batch (requests)")
    bottom.set_xscale("log", base=2)
    top.set_title(f"{r['shape']} on {r['hardware']}: AL {r['acceptance']:.2f} at {r['depth']} drafts"
                  + (f", budget {r['budget']}" if r["budget"] else ""), fontsize=9)
    tmp = path.with_name(path.name + ".part.png")
    fig.savefig(tmp, dpi=110, bbox_inches="tight")
    plt.close(fig)
    tmp.replace(path)


# ---- calibrate ------------------------------------------------------------------------------------


def calibrate(engine_folder: str, profile: str, *, context: int, repeats: int, progress: bool = True) -> dict:
    """Decode and verify steps of CALIBRATION_SIZES tokens (chains after a ``context``-token prompt)
    timed on this machine, each predicted by the cost model from the unique experts it routed."""
    from tqdm import tqdm

    from moespec.bench.roofline import _prompt
    from moespec.bench.run import open_engine
    from moespec.cost.hardware import hardware
    from moespec.cost.step_cost import shape_from_config, step_cost

    if not 1 <= context <= 4096 or not 1 <= repeats <= 100:
        raise ValueError(f"--context must be in [1, 4096] and --repeats in [1, 100], got {context} and {repeats}")
    hw = hardware(profile)
    engine = open_engine(engine_folder)
    target = engine.target
    shape = shape_from_config(target.config, Path(engine_folder).name)
    prompt = _prompt(engine, context)
    cache = target.new_cache(1, context + max(CALIBRATION_SIZES) + 1)
    target.prefill(cache, [prompt])
    rows = []
    for T in tqdm(CALIBRATION_SIZES, desc="calibrate", disable=not progress, leave=False):
        tokens = [(7 * i + 3) % target.config.vocab_size for i in range(T)]
        times, stats = [], None
        for i in range(repeats + 1):
            start = time.perf_counter()
            if T == 1:
                out = target.decode(cache, tokens)
            else:
                out = target.verify(cache, [tokens], [[-1] + list(range(T - 1))])
                cache.pending = None
            elapsed = time.perf_counter() - start
            cache.lengths[0] = context
            if i:
                times.append(elapsed)
            stats = out.expert_stats
        unique = stats[:, 0].float().tolist()
        cost = step_cost(shape, hw, tokens=T, requests=1, context=context, unique=unique,
                         bytes_per_weight=target.weights.lm_head.element_size())
        measured = statistics.median(times)
        rows.append({"tokens": T, "step": "decode" if T == 1 else "verify", "measured_ms": measured * 1e3,
                     "predicted_ms": cost.seconds * 1e3, "error_pct": 100 * (cost.seconds - measured) / measured,
                     "unique_per_layer": sum(unique) / len(unique), "mb": cost.bytes / 1e6,
                     "parts_ms": {"overhead": cost.overhead_s * 1e3, "dense": cost.dense_s * 1e3,
                                  "experts": cost.experts_s * 1e3, "attention": cost.attention_s * 1e3}})
    mae = sum(abs(r["error_pct"]) for r in rows) / len(rows)
    return {"engine": str(engine_folder), "profile": hw.to_json(), "context": context, "steps": rows,
            "mean_abs_error_pct": mae}


def format_calibration(r: dict[str, Any]) -> str:
    lines = [f"engine {r['engine']}, profile {r['profile']['name']} ({r['profile']['source']}), context {r['context']}",
             f"{'step':<8}{'T':>4}{'U/layer':>9}{'MB':>8}{'measured ms':>13}{'predicted ms':>14}{'error':>8}"
             f"   predicted = overhead + dense + experts + attention"]
    for s in r["steps"]:
        p = s["parts_ms"]
        lines.append(f"{s['step']:<8}{s['tokens']:>4}{s['unique_per_layer']:>9.1f}{s['mb']:>8.0f}"
                     f"{s['measured_ms']:>13.2f}{s['predicted_ms']:>14.2f}{s['error_pct']:>+7.1f}%"
                     f"   {p['overhead']:.2f} + {p['dense']:.2f} + {p['experts']:.2f} + {p['attention']:.2f}")
    lines.append(f"mean absolute error {r['mean_abs_error_pct']:.1f}% of the measured step time")
    return "\n".join(lines)
