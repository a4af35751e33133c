"""vLLM stock against vLLM + moespec on the same requests, one policy per process (vLLM loads its
plugins once per process, so each budget needs a fresh one):

    .venv-vllm/bin/python -m moespec.integrations.vllm.bench --model <HF folder> --draft <EAGLE-3 folder> \\
        --dataset build/bench/default-mix.jsonl [--policies ar,eagle3,eagle3+budget:16] [--num-requests 9]

Each policy runs every request greedily, one at a time (batch 1, as ``moespec bench compare`` runs
them), in bf16, eager (the budget's hook is Python: see :mod:`moespec.integrations.vllm.budget`),
with ``--draft-tokens`` drafts per step (a chain: vLLM 0.32 builds no trees). Prints tokens/s,
the ratio to ``ar``, the acceptance length (output tokens / target steps) and, for budgets, the
kept and natural experts a layer; ``--json`` writes the rows. "ar" is vLLM stock (no speculation),
"eagle3" vLLM's EAGLE-3 through the plugin's class, "eagle3+budget:B" the same with MOESPEC_BUDGET=B,
"eco" (and "eco+budget:B") vLLM's EAGLE-3 with the drafts per batch size that moespec's cost model
chooses (:mod:`moespec.cost.schedule`: vLLM's ``num_speculative_tokens_per_batch_size``) from this
machine's ``--hardware`` profile and the acceptance ``eagle3`` measured earlier in the same run
(or ``--acceptance``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence


def _requests(dataset: Path, n: int) -> list[dict]:
    rows = [json.loads(line) for line in dataset.read_text().splitlines() if line.strip()]
    return rows[:n]


def _one_policy(args) -> dict:
    """Runs inside the policy's own process (MOESPEC_BUDGET already set by the parent)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine here: the budget's statistics are readable
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from moespec.integrations.vllm.budget import STATS

    spec = None if args.policy == "ar" else {"method": "eagle3", "model": str(args.draft),
                                             "num_speculative_tokens": args.draft_tokens}
    if args.schedule:  # eco: the cost model's drafts per batch size
        schedule = json.loads(args.schedule)
        spec.update(num_speculative_tokens=schedule["num_speculative_tokens"],
                    num_speculative_tokens_per_batch_size=[tuple(r) for r in
                                                           schedule["num_speculative_tokens_per_batch_size"]])
    llm = LLM(model=str(args.model), dtype="bfloat16", enforce_eager=True, max_model_len=args.max_len,
              max_num_seqs=1, speculative_config=spec, seed=0, disable_log_stats=False)
    requests = _requests(args.dataset, args.num_requests)
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, detokenize=False)
    llm.generate([TokensPrompt(prompt_token_ids=requests[0]["input_ids"])], warm, use_tqdm=False)
    STATS.clear()
    before = _spec_counts(llm)
    tokens, seconds, outputs = 0, 0.0, []
    for r in requests:
        params = SamplingParams(max_tokens=int(r["output_tokens"]), temperature=0.0, ignore_eos=True, detokenize=False)
        start = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=r["input_ids"])], params, use_tqdm=False)
        seconds += time.perf_counter() - start
        ids = list(out[0].outputs[0].token_ids)
        outputs.append(ids)
        tokens += len(ids)
    after = _spec_counts(llm)
    drafts, accepted = after[0] - before[0], after[1] - before[1]
    row = {"policy": args.policy, "tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
           "outputs": outputs}
    if spec is not None and drafts:
        k = spec["num_speculative_tokens_per_batch_size"][0][2] if args.schedule else args.draft_tokens
        row["acceptance_length"] = 1 + accepted / (drafts / k)  # per verify step (batch 1: K of batch 1)
        row["drafts"] = k
    if STATS:
        row["kept"] = sum(s.kept for s in STATS) / len(STATS)
        row["natural"] = sum(s.natural_unique for s in STATS) / len(STATS)
    return row


def _spec_counts(llm) -> tuple[float, float]:
    """(draft tokens proposed, draft tokens accepted) so far, from vLLM's metrics."""
    drafts = accepted = 0.0
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_draft_tokens":
            drafts += m.value
        elif m.name == "vllm:spec_decode_num_accepted_tokens":
            accepted += m.value
    return drafts, accepted


def eco_schedule(args, rows: list[dict], budget: Optional[int]) -> dict:
    """moespec's drafts-per-batch-size schedule for the target (batch 1 is what this bench runs)."""
    from moespec.cost.hardware import hardware
    from moespec.cost.schedule import draft_schedule
    from moespec.cost.speedup import transfer
    from moespec.cost.step_cost import shape_from_config
    from moespec.models import read_config

    acceptance = args.acceptance
    if acceptance is None:
        measured = next((r for r in rows if r["policy"] == "eagle3" and "acceptance_length" in r), None)
        if measured is None:
            raise ValueError("needs --acceptance or an eagle3 policy earlier in --policies (its measured acceptance)")
        acceptance = min(measured["acceptance_length"], args.draft_tokens + 1)
    shape = shape_from_config(read_config(args.model), args.model.name)
    return draft_schedule(shape, hardware(str(args.hardware)), transfer(shape.num_experts, shape.top_k),
                          acceptance=acceptance, depth=args.draft_tokens, max_batch=1,
                          max_drafts=args.max_drafts, context=256, budget=budget)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m moespec.integrations.vllm.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True, help="the target, a Hugging Face folder")
    p.add_argument("--draft", type=Path, required=True, help="an EAGLE-3 head folder")
    p.add_argument("--dataset", type=Path, required=True, help="moespec prepare-dataset JSONL (input_ids, output_tokens)")
    p.add_argument("--policies", default="ar,eagle3,eagle3+budget:16")
    p.add_argument("--num-requests", type=int, default=9)
    p.add_argument("--draft-tokens", type=int, default=2, help="drafts per step (default 2: the default tree's depth)")
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--hardware", default="build/bench/hardware.json",
                   help="eco: this machine's profile (moespec analyze profile) or h200, ...")
    p.add_argument("--acceptance", type=float, help="eco: tokens per step at --draft-tokens drafts (default: what "
                                                    "eagle3 measured in this run)")
    p.add_argument("--max-drafts", type=int, default=4, help="eco: most drafts the schedule may choose")
    p.add_argument("--json", type=Path, help="write the rows here")
    p.add_argument("--policy", help=argparse.SUPPRESS)  # (internal: run one policy in this process)
    p.add_argument("--schedule", help=argparse.SUPPRESS)  # (internal: eco's schedule, JSON)
    args = p.parse_args(argv)
    if args.policy is not None:
        print("MOESPEC_ROW " + json.dumps(_one_policy(args)), flush=True)
        return 0
    rows = []
    for policy in [x.strip() for x in args.policies.split(",") if x.strip()]:
        budget = policy.split("+budget:")[1] if "+budget:" in policy else ""
        if policy != "ar" and not policy.startswith(("eagle3", "eco")):
            print(f"error: unknown policy {policy!r} (ar, eagle3, eagle3+budget:B, eco, eco+budget:B)", file=sys.stderr)
            return 2
        env = {**os.environ, "MOESPEC_BUDGET": budget}
        cmd = [sys.executable, "-m", "moespec.integrations.vllm.bench", *(argv or sys.argv[1:]), "--policy",
               policy]
        if policy.startswith("eco"):
            try:
                schedule = eco_schedule(args, rows, int(budget) if budget else None)
            except ValueError as exc:
                print(f"error: {policy}: {exc}", file=sys.stderr)
                return 2
            print(f"[vllm bench] {policy}: drafts per batch size {schedule['num_speculative_tokens_per_batch_size']}",
                  file=sys.stderr, flush=True)
            cmd += ["--schedule", json.dumps({k: schedule[k] for k in ("num_speculative_tokens",
                                                                      "num_speculative_tokens_per_batch_size")})]
        print(f"[vllm bench] {policy} ...", file=sys.stderr, flush=True)
        run = subprocess.run(cmd, env=env, capture_output=True, text=True)
        line = next((x for x in run.stdout.splitlines() if x.startswith("MOESPEC_ROW ")), None)
        if run.returncode != 0 or line is None:
            print(run.stderr[-4000:], file=sys.stderr)
            return 1
        rows.append(json.loads(line[len("MOESPEC_ROW "):]))
    ar = next((r for r in rows if r["policy"] == "ar"), rows[0])
    print(f"{'policy':20s} {'tok/s':>8s} {'x ar':>7s} {'AL':>6s} {'experts':>8s} {'natural':>8s} {'same as ar':>10s}")
    for r in rows:
        same = sum(a == b for a, b in zip(r["outputs"], ar["outputs"]))
        print(f"{r['policy']:20s} {r['tok_s']:8.2f} {r['tok_s'] / ar['tok_s']:7.3f} "
              f"{r.get('acceptance_length', 1.0):6.2f} {r.get('kept', float('nan')):8.2f} "
              f"{r.get('natural', float('nan')):8.2f} {same:>5d}/{len(r['outputs'])}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
