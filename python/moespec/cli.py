"""The ``moespec`` command line: ``moespec generate``, ``moespec build`` and ``moespec train-draft``.

    moespec generate --model <folder> [--draft <EAGLE-3 folder>] [--policy ar|eagle3|eagle3+budget|eco|eco+budget]
                     [--budget B] [--depth D] [--top-k K] [--total-tokens M] [--dtype bf16|fp32]
                     [--max-tokens N] [--temperature T] [--top-p P] [--top-k-sampling K] [--seed S]
                     [--stream] (--prompt TEXT | --prompt-ids 1,2,3) ...
    moespec build --model <HF folder | GGUF file | default> [--draft <EAGLE-3 folder>] --out <engine folder>
                  [--dtype bf16|fp32] [--policy ...] [--depth D] [--top-k K] [--total-tokens M] [--budget B] [--force]
    moespec train-draft --target <folder> --corpus <files...> --out <folder> [...]
    moespec bench throughput|latency|compare --engine <folder> --dataset <jsonl> [...]
    moespec bench roofline --engine <folder> [...]
    moespec analyze trace|fit|predict|validate|profile|speedup|calibrate ...
    moespec prepare-dataset --out <file.jsonl> [--tokenizer <folder>] [--seed 420] <source> [...] ...

Configuration flows one way: flags -> typed configs (SpeculativeConfig, SamplingParams) -> LLM.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from moespec.config import DEFAULT_TREE, POLICY_NAMES, default_policy, policy_spec


def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text with a target model and an optional EAGLE-3 draft head")
    p.add_argument("--model", required=True, help="target checkpoint folder or engine folder (moespec build)")
    p.add_argument("--draft", help="EAGLE-3 draft head folder")
    p.add_argument("--policy", choices=POLICY_NAMES, help="default: eagle3+budget with --budget, eagle3 with a draft, "
                                                          "else ar")
    p.add_argument("--budget", type=int, help="max unique experts per MoE layer on verify passes (eagle3+budget)")
    p.add_argument("--depth", type=int, default=DEFAULT_TREE["depth"])
    p.add_argument("--top-k", type=int, default=DEFAULT_TREE["top_k"], help="draft tree branching")
    p.add_argument("--total-tokens", type=int, default=DEFAULT_TREE["total_tokens"],
                   help="draft tree nodes besides the root")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda[:i]: where the model runs")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k-sampling", type=int, default=0)
    p.add_argument("--seed", type=int)
    p.add_argument("--stream", action="store_true", help="print tokens as they are accepted (one prompt)")
    p.add_argument("--prompt", action="append", default=[], help="a text prompt (repeatable)")
    p.add_argument("--prompt-ids", action="append", default=[], help="a prompt as comma-separated token ids")
    p.add_argument("--debug", action="store_true", help="show the traceback of an error")


def _generate(args) -> int:
    from moespec import LLM, SamplingParams, SpeculativeConfig

    try:
        ids = [[int(t) for t in s.split(",") if t.strip()] for s in args.prompt_ids]
    except ValueError:
        raise ValueError(f"--prompt-ids: expected comma-separated integers, got {args.prompt_ids!r}") from None
    prompts = list(args.prompt) + ids
    if not prompts:
        raise ValueError("give at least one --prompt or --prompt-ids")
    from moespec.engine import is_engine_folder

    policy = args.policy or default_policy(has_draft=args.draft is not None, budget=args.budget)
    spec = SpeculativeConfig(policy, depth=args.depth, top_k=args.top_k, total_tokens=args.total_tokens,
                             budget=args.budget if policy_spec(policy).budgeted else None)
    if is_engine_folder(args.model) and not (args.policy or args.budget or args.draft):
        spec = None  # the engine's own draft head and default policy
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k_sampling, seed=args.seed)
    llm = LLM(args.model, draft=args.draft, speculative_config=spec, dtype=args.dtype, device=args.device)
    policy = llm.speculative_config.policy
    if args.stream:
        if len(prompts) != 1:
            raise ValueError("--stream takes one prompt")
        shown = 0
        for out in llm.generate_stream(prompts[0], params):
            completion = out.outputs[0]
            piece = completion.text[shown:] if llm.tokenizer else " ".join(map(str, completion.token_ids[shown:]))
            shown = len(completion.text) if llm.tokenizer else len(completion.token_ids)
            print(piece, end="" if llm.tokenizer else " ", flush=True)
        print()
        outputs = [out]
    else:
        outputs = llm.generate(prompts, params)
        for out in outputs:
            c = out.outputs[0]
            print(c.text if llm.tokenizer else " ".join(map(str, c.token_ids)))
    for out in outputs:
        s = out.stats
        print(f"[{policy}] {len(out.outputs[0].token_ids)} tokens in {s.decode_steps} steps, mean acceptance length "
              f"{s.mean_acceptance_length:.2f}, {s.wall_time:.2f} s", file=sys.stderr)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "build":
        from moespec.engine.build import main as build_main

        return build_main(argv[1:])
    if argv and argv[0] == "bench":
        from moespec.bench.run import main as bench_main

        return bench_main(argv[1:])
    if argv and argv[0] == "train-draft":
        from moespec.spec.train import main as train_main

        return train_main(argv[1:])
    if argv and argv[0] == "analyze":
        from moespec.cost.analyze import main as analyze_main

        return analyze_main(argv[1:])
    if argv and argv[0] == "export-hf":
        from moespec.engine.export_hf import main as export_main

        return export_main(argv[1:])
    if argv and argv[0] == "prepare-dataset":
        from moespec.data.datasets import main as prepare_main

        return prepare_main(argv[1:])
    parser = argparse.ArgumentParser(prog="moespec", description="expert-aware speculative decoding for MoE models")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    sub.add_parser("train-draft", help="train an EAGLE-3 draft head (see moespec train-draft --help)")
    sub.add_parser("build", help="build an engine folder (see moespec build --help)")
    sub.add_parser("bench", help="trtllm-bench-style benchmarks: throughput, latency, compare, roofline "
                                 "(see moespec bench --help)")
    sub.add_parser("analyze", help="routing traces, the IPF coactivation model, the cost model of speculation "
                                   "(see moespec analyze --help)")
    sub.add_parser("export-hf", help="write an engine as a Hugging Face checkpoint folder (see moespec export-hf --help)")
    sub.add_parser("prepare-dataset", help="write a trtllm-bench JSON Lines dataset (see moespec prepare-dataset --help)")
    args = parser.parse_args(argv)
    if args.command == "generate":
        return run_command("moespec generate", lambda: _generate(args), args.debug)
    return 2


def run_command(name: str, body, debug: bool = False) -> int:
    """The CLI's error contract: a user error (ValueError, a missing file) is one line on stderr naming
    it and exit status 2; Ctrl-C is exit status 130; any other exception is an internal error, exit
    status 1, its traceback shown with --debug."""
    try:
        return body()
    except (ValueError, FileNotFoundError, NotADirectoryError) as exc:
        if debug:
            raise
        print(f"{name}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 (the contract: never a bare traceback without --debug)
        if debug:
            raise
        print(f"{name}: internal error: {type(exc).__name__}: {exc} (run with --debug for the traceback)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
