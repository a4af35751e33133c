"""``moespec analyze``: routing traces, the IPF coactivation model and the cost model of speculation.

    moespec analyze trace    --engine <folder> --dataset <jsonl> [--policy ar|eagle3|eagle3+budget:B]
                             [--max-batch-size B] [--num-requests N] [--skip N] --out trace.npz
    moespec analyze fit      --trace trace.npz [more.npz ...] --out model.json
    moespec analyze predict  --model model.json --requests B --tree <depth,top_k,total | chain:n> [--json out.json]
    moespec analyze validate --model model.json --trace held_out.npz [more.npz ...] [--json out.json]
    moespec analyze predictor --trace trace.npz [...] [--history 1,4,16] [--json out.json]
    moespec analyze predictor --engine <folder> --dataset <jsonl> [--train-requests 36] [--steps 300] [--out dir]
    moespec analyze profile  --out cpu.json
    moespec analyze speedup  --shape <name|all> --hardware <h200|h100-sxm|b200|profile.json> [--model model.json]
                             [--batch 1,2,4,...] [--tree ...] [--acceptance AL] [--out-dir DIR]
    moespec analyze calibrate --engine <folder> --profile cpu.json [--json out.json]

Every command turns a user error into one line on stderr naming the argument or file and exit
status 2 (see README "moespec analyze"). Outputs are written atomically.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np


# ---- trace ---------------------------------------------------------------------------------------


def record_trace(engine_folder: str, dataset: str, *, policy: Optional[str] = None, max_batch_size: int = 4,
                 num_requests: Optional[int] = None, skip: int = 0, progress: bool = True):
    """Runs the dataset's requests on the engine with a routing observer; returns the Trace."""
    from tqdm import tqdm

    import moespec
    from moespec.bench.run import Sampling, load_requests, make_llm, open_engine, parse_policy, tree_settings
    from moespec.models.trace import RoutingObserver

    if skip < 0:
        raise ValueError(f"--skip must be >= 0, got {skip}")
    if max_batch_size < 1:
        raise ValueError(f"--max-batch-size must be >= 1, got {max_batch_size}")
    engine = open_engine(engine_folder)
    moe = engine.target.config.moe
    if moe is None:
        raise ValueError(f"engine {engine_folder}: the model has no MoE layer to trace")
    requests = load_requests(dataset, engine)[skip:]
    requests = requests[: num_requests or None]
    if not requests:
        raise ValueError(f"dataset {dataset}: no requests left after --skip {skip}")
    tree = tree_settings(engine)
    choice = parse_policy(policy, engine, tree)
    llm = make_llm(engine, choice, max_batch_size)
    observer = RoutingObserver()
    engine.target.observer = observer
    sampling = Sampling()
    try:
        bar = tqdm(total=len(requests), desc=f"trace ({choice.label})", disable=not progress)
        for start in range(0, len(requests), max_batch_size):
            batch = requests[start : start + max_batch_size]
            observer.requests = list(range(start + skip, start + skip + len(batch)))
            llm.generate([r.input_ids for r in batch], [sampling.params(r) for r in batch])
            bar.update(len(batch))
        bar.close()
    finally:
        engine.target.observer = None
    meta = {"model": str(engine.folder), "dataset": str(dataset), "policy": choice.label,
            "tree": tree if choice.config.spec.speculative else None, "max_batch_size": max_batch_size,
            "requests": len(requests), "skip": skip, "moespec_version": moespec.__version__}
    return observer.trace(num_experts=moe.num_experts, top_k=moe.top_k, layers=engine.target.config.moe_layers,
                          meta=meta)


# ---- validation ----------------------------------------------------------------------------------


def validate_model(model, trace, *, progress: bool = True) -> dict[str, Any]:
    """Every decode and verify pass of ``trace``: measured unique experts per layer against the
    three predictors, grouped by (pass size, batch size)."""
    from tqdm import tqdm

    from moespec.cost.coactivation import PREDICTORS
    from moespec.cost.relations import group_census, pass_groups

    if trace.num_experts != model.num_experts or trace.top_k != model.top_k or list(trace.layers) != model.layers:
        raise ValueError(f"the trace ({trace.num_experts} experts, top-{trace.top_k}, layers {list(trace.layers)}) is "
                         f"not of the model's routing ({model.num_experts}, top-{model.top_k}, layers {model.layers})")
    passes = [(a, b) for a, b in trace.passes() if trace.kind[a] > 0]
    if not passes:
        raise ValueError("the trace has no decode or verify pass to validate on")
    cache: dict[tuple, dict[str, np.ndarray]] = {}
    groups_of: dict[tuple, list] = {}
    rows = []
    for a, b in tqdm(passes, desc="validate", disable=not progress):
        parent = np.where(trace.parent[a:b] >= 0, trace.parent[a:b] - a, -1)
        groups = pass_groups(trace.request[a:b], parent)
        key = tuple(sorted((g.n, tuple(sorted(group_census(g).items()))) for g in groups))
        if key not in cache:
            cache[key] = {p: model.predict(groups, p) for p in PREDICTORS}
        ids = trace.ids[a:b]  # [n, L, K]
        measured = np.array([len(np.unique(ids[:, layer])) for layer in range(ids.shape[1])], dtype=np.float64)
        size, batch = b - a, len(groups)
        groups_of.setdefault((int(trace.kind[a]), size, batch), []).append(len(rows))
        rows.append((measured, cache[key]))
    table = []
    for (kind, size, batch), idx in sorted(groups_of.items()):
        meas = np.stack([rows[i][0] for i in idx])  # [passes, L]
        entry = {"kind": "decode" if kind == 1 else "verify", "tokens": size, "requests": batch, "passes": len(idx),
                 "measured": float(meas.mean())}
        for p in PREDICTORS:
            pred = np.stack([rows[i][1][p] for i in idx])
            entry[p] = float(pred.mean())
            entry[f"{p}_error_pct"] = 100 * float(abs(pred.mean() - meas.mean()) / meas.mean())
            entry[f"{p}_pass_mape_pct"] = 100 * float((np.abs(pred - meas) / meas).mean())
        table.append(entry)
    summary = {}
    for p in PREDICTORS:
        weights = np.array([t["passes"] for t in table], dtype=np.float64)
        errs = np.array([t[f"{p}_error_pct"] for t in table])
        summary[p] = {"mean_error_pct": float((weights * errs).sum() / weights.sum()),
                      "max_error_pct_at_4plus": max((t[f"{p}_error_pct"] for t in table if t["tokens"] >= 4),
                                                    default=None),
                      "pass_mape_pct": float(np.mean([abs(r[1][p] - r[0]).sum() / r[0].sum() for r in rows]) * 100)}
    return {"table": table, "summary": summary, "passes": len(rows), "shapes": len(cache)}


def format_validation(result: dict[str, Any]) -> str:
    lines = [f"{result['passes']} decode/verify passes, {result['shapes']} distinct shapes; unique experts per layer "
             f"(mean over passes and layers); error = |mean predicted - mean measured| / measured",
             f"{'kind':<7}{'tokens':>7}{'reqs':>5}{'passes':>7}{'measured':>10}"
             f"{'ipf':>8}{'err%':>6}{'indep':>8}{'err%':>6}{'uniform':>9}{'err%':>6}"]
    for t in result["table"]:
        lines.append(f"{t['kind']:<7}{t['tokens']:>7}{t['requests']:>5}{t['passes']:>7}{t['measured']:>10.2f}"
                     f"{t['ipf']:>8.2f}{t['ipf_error_pct']:>6.1f}{t['independent']:>8.2f}"
                     f"{t['independent_error_pct']:>6.1f}{t['uniform']:>9.2f}{t['uniform_error_pct']:>6.1f}")
    s = result["summary"]
    lines.append("")
    for p in ("ipf", "independent", "uniform"):
        worst = s[p]["max_error_pct_at_4plus"]
        lines.append(f"{p:<12} mean error {s[p]['mean_error_pct']:5.2f}% (pass-weighted), worst at >= 4 tokens "
                     f"{worst if worst is None else f'{worst:.2f}%'}, per-pass MAPE {s[p]['pass_mape_pct']:.2f}%")
    return "\n".join(lines)


# ---- the trained expert predictor ------------------------------------------------------------------


def train_and_report(engine_folder: str, dataset: Optional[str], *, train_requests: int, steps: int,
                     out: Optional[str]) -> dict[str, Any]:
    """Trains the expert predictor on the first ``train_requests`` prompts of the dataset and reports
    its recall on the others against the static top-k and the history-1 baseline; with
    ``train_requests`` 0, the engine's own predictor on every prompt (the static top-k then counts
    the prompts themselves: in-sample, an upper bound for it)."""
    import time

    from moespec.bench.run import load_requests, open_engine
    from moespec.spec.expert_predictor import predictor_samples, recall, top_experts, train_predictor

    if dataset is None:
        raise ValueError("predictor --engine needs --dataset")
    engine = open_engine(engine_folder)
    if engine.head is None:
        raise ValueError(f"engine {engine_folder} has no EAGLE-3 draft head: the predictor reads its hidden state")
    if engine.target.config.moe is None:
        raise ValueError(f"engine {engine_folder}: the target is dense (no MoE layer to predict)")
    requests = load_requests(dataset, engine)
    if not 0 <= train_requests < len(requests):
        raise ValueError(f"--train-requests must be in [0, {len(requests) - 1}] (the rest are held out; 0: the "
                         f"engine's own predictor), got {train_requests}")
    moe = engine.target.config.moe
    start = time.perf_counter()
    Xh, Yh, Hh = predictor_samples(engine.target, engine.head, [r.input_ids for r in requests[train_requests:]])
    if train_requests:
        X, Y, _ = predictor_samples(engine.target, engine.head, [r.input_ids for r in requests[:train_requests]])
    else:
        from moespec.engine.folder import engine_predictor

        X, Y = Xh, Yh
        predictor = engine_predictor(engine_folder, engine.target.config)
        if predictor is None:
            raise ValueError(f"engine {engine_folder} has no expert predictor to evaluate (--train-requests 0)")
    collected = time.perf_counter() - start
    if train_requests:
        predictor = train_predictor(X, Y, moe.num_experts, steps=steps,
                                    meta={"engine": str(engine_folder), "dataset": str(dataset),
                                          "train_requests": train_requests})
    trained = time.perf_counter() - start - collected if train_requests else 0.0
    counts = np.stack([np.bincount(Y[:, layer].reshape(-1), minlength=moe.num_experts) for layer in range(Y.shape[1])])
    static = top_experts(counts.astype(np.float64), moe.top_k)[None]
    import torch

    H = engine.target.config.hidden_size
    with torch.no_grad():
        pred = predictor.predict(Xh[:, :H], Xh[:, H:], moe.top_k).numpy()
    result = {"engine": str(engine_folder), "train_samples": int(len(X)), "held_out_samples": int(len(Xh)),
              "recall": {"trained": recall(pred, Yh), "static_top_k": recall(np.broadcast_to(static, Yh.shape), Yh),
                         "history_1": recall(Hh, Yh)},
              "chance": moe.top_k / moe.num_experts, "collect_s": collected, "train_s": trained,
              "predictor": predictor.meta}
    if out:
        predictor.save(out)
        result["out"] = out
    return result


def format_trained(r: dict[str, Any]) -> str:
    rc = r["recall"]
    what = (f"expert predictor trained on {r['train_samples']} samples ({r['collect_s']:.0f} s to collect, "
            f"{r['train_s']:.0f} s to train)" if r["train_s"] > 0 else "the engine's expert predictor")
    text = (f"{what}; held-out recall of a node's true top-k over {r['held_out_samples']} "
            f"samples: trained {rc['trained']:.3f}, static top-k {rc['static_top_k']:.3f}, history-1 "
            f"{rc['history_1']:.3f}, chance {r['chance']:.3f}")
    return text + (f"\nwrote {r['out']}" if r.get("out") else "")


# ---- predict -------------------------------------------------------------------------------------


def predict_pass(model, requests: int, tree: str) -> dict[str, Any]:
    from moespec.cost.coactivation import PREDICTORS
    from moespec.cost.relations import parse_tree

    if not 1 <= requests <= 4096:
        raise ValueError(f"--requests must be in [1, 4096], got {requests}")
    group = parse_tree(tree)
    groups = [group] * requests
    out: dict[str, Any] = {"layers": model.layers, "requests": requests, "tree": tree, "tokens": group.n * requests,
                           "parents": list(group.parents) if group.parents is not None else None}
    for p in PREDICTORS:
        per_layer = model.predict(groups, p)
        out[p] = per_layer.tolist()
        out[f"{p}_total"] = float(per_layer.sum())
    return out


def format_prediction(r: dict[str, Any]) -> str:
    lines = [f"{r['requests']} request(s) x {r['tree']} = {r['tokens']} tokens per pass; expected unique experts",
             f"{'layer':>6}{'ipf':>9}{'independent':>13}{'uniform':>9}"]
    for i, layer in enumerate(r["layers"]):
        lines.append(f"{layer:>6}{r['ipf'][i]:>9.2f}{r['independent'][i]:>13.2f}{r['uniform'][i]:>9.2f}")
    lines.append(f"{'total':>6}{r['ipf_total']:>9.1f}{r['independent_total']:>13.1f}{r['uniform_total']:>9.1f}")
    return "\n".join(lines)


# ---- the command line ----------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moespec analyze", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("trace", help="record the natural routing of real requests (.npz)")
    t.add_argument("--engine", required=True)
    t.add_argument("--dataset", required=True, help="trtllm-bench JSON Lines (moespec prepare-dataset)")
    t.add_argument("--policy", help="ar, eagle3 or eagle3+budget:<B> (default: the engine's)")
    t.add_argument("--max-batch-size", type=int, default=4)
    t.add_argument("--num-requests", type=int, help="requests to run (default: all)")
    t.add_argument("--skip", type=int, default=0, help="dataset requests to skip first (a held-out slice)")
    t.add_argument("--out", required=True)
    f = sub.add_parser("fit", help="marginals, relation overlaps and the IPF model of a trace (.json)")
    f.add_argument("--trace", required=True, nargs="+", help="one or more traces (combined)")
    f.add_argument("--out", required=True)
    r = sub.add_parser("predict", help="expected unique experts of a verify or decode pass")
    r.add_argument("--model", required=True)
    r.add_argument("--requests", type=int, default=1)
    r.add_argument("--tree", default="chain:1", help="depth,top_k,total_tokens or chain:n (default chain:1)")
    r.add_argument("--json", help="also write the prediction here")
    v = sub.add_parser("validate", help="predictions against a held-out trace's measured unique experts")
    v.add_argument("--model", required=True)
    v.add_argument("--trace", required=True, nargs="+", help="one or more held-out traces")
    v.add_argument("--json", help="also write the table here")
    e = sub.add_parser("predictor", help="expert predictors (EcoSpec): the history baseline on a trace, or train one "
                                         "on an engine and report held-out recall")
    e.add_argument("--trace", nargs="+", help="traces for the history predictor's recall")
    e.add_argument("--history", default="1,4,16", help="verified tokens the history predictor looks back on")
    e.add_argument("--engine", help="train the predictor for this engine (with --dataset)")
    e.add_argument("--dataset", help="prompts: the first --train-requests train, the rest are held out")
    e.add_argument("--train-requests", type=int, default=36,
                   help="prompts the predictor trains on (the rest are held out); 0: evaluate the engine's own")
    e.add_argument("--steps", type=int, default=300)
    e.add_argument("--out", help="write the trained predictor to this folder")
    e.add_argument("--json")
    from moespec.cost.cost_cli import add_parsers

    add_parsers(sub)
    for s in sub.choices.values():
        s.add_argument("--no-progress", action="store_true")
        s.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


def _write_json(path: str, obj: Any) -> None:
    from moespec.bench.report import write_json_atomic

    write_json_atomic(Path(path), obj)
    print(f"wrote {path}")


def _run(args) -> int:
    from moespec.cost.coactivation import CoactivationModel
    from moespec.models.trace import concat_traces, load_trace, save_trace

    progress = not args.no_progress
    if args.command == "trace":
        trace = record_trace(args.engine, args.dataset, policy=args.policy, max_batch_size=args.max_batch_size,
                             num_requests=args.num_requests, skip=args.skip, progress=progress)
        save_trace(args.out, trace)
        kinds = {k: int((trace.kind == i).sum()) for i, k in enumerate(("prefill", "decode", "verify"))}
        print(f"wrote {args.out}: {trace.num_rows} rows in {len(trace.passes())} passes {kinds}, "
              f"{len(trace.layers)} MoE layers, top-{trace.top_k} of {trace.num_experts}")
    elif args.command == "fit":
        model = CoactivationModel.fit(concat_traces([load_trace(t) for t in args.trace]))
        model.save(args.out)
        print(model.summary())
        print(f"wrote {args.out}")
    elif args.command == "predict":
        result = predict_pass(CoactivationModel.load(args.model), args.requests, args.tree)
        print(format_prediction(result))
        if args.json:
            _write_json(args.json, result)
    elif args.command == "validate":
        result = validate_model(CoactivationModel.load(args.model), concat_traces([load_trace(t) for t in args.trace]),
                                progress=progress)
        print(format_validation(result))
        if args.json:
            _write_json(args.json, result)
    elif args.command == "predictor":
        from moespec.cost.cost_cli import _ints
        from moespec.spec.expert_predictor import format_recall, predictor_recall

        if bool(args.trace) == bool(args.engine):
            raise ValueError("predictor: give --trace (the history baseline) or --engine with --dataset (train one)")
        if args.trace:
            result = predictor_recall(concat_traces([load_trace(t) for t in args.trace]),
                                      _ints(args.history, "history"))
            print(format_recall(result))
        else:
            result = train_and_report(args.engine, args.dataset, train_requests=args.train_requests,
                                      steps=args.steps, out=args.out)
            print(format_trained(result))
        if args.json:
            _write_json(args.json, result)
    else:
        from moespec.cost.cost_cli import run

        return run(args)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _run(args)
    except (ValueError, OSError) as exc:
        if args.debug:
            raise
        print(f"moespec analyze {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
