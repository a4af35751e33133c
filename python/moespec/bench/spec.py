"""Speculative decoding on a small MoE built here: ar vs eagle3 vs eagle3+budget, in one run.

    python -m moespec.bench.spec [--prompts 8] [--max-tokens 48] [--work build/bench/spec]

Until the embedded default model lands (issue #6), this builds its own small target and head,
deterministically and offline:
1. a random Qwen3-MoE checkpoint written by transformers (8 layers, hidden 512, 64 experts, top-8,
   bf16; larger init than usual so that its greedy continuations are predictable);
2. a corpus of its own sampled continuations (temperature 0.7), and an EAGLE-3 head trained on it
   with ``moespec train-draft`` (both cached under --work);
3. greedy generation of the same prompts under ``ar``, ``eagle3`` and ``eagle3+budget`` with
   B in {N/8, N/4, N/2}, the policies interleaved prompt by prompt so that machine noise hits all.
Prints tokens/s, acceptance length (tokens per target step), the mean unique experts per layer per
verify step (natural and kept) and the speed-ups over ``ar`` and ``eagle3``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

TARGET = dict(vocab_size=1024, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=8,
              num_attention_heads=8, num_key_value_heads=2, head_dim=64, num_experts=64, num_experts_per_tok=8,
              norm_topk_prob=True, initializer_range=0.06)
TREE = dict(depth=4, top_k=4, total_tokens=16)  # small trees suit a CPU, where drafting is not free


def build(work: Path) -> tuple[Path, Path]:
    """The target checkpoint and a trained head (made once, then reused)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from moespec import LLM, SamplingParams
    from moespec.spec.train import train_draft

    target, head, corpus = work / "target", work / "head", work / "corpus.jsonl"
    if not (target / "config.json").exists():
        torch.manual_seed(0)
        Qwen3MoeForCausalLM(Qwen3MoeConfig(**TARGET)).to(torch.bfloat16).save_pretrained(target)
    if not corpus.exists():
        llm = LLM(str(target), dtype="bf16")
        gen = torch.Generator().manual_seed(1)
        lines = []
        for i in tqdm(range(48), desc="sampling a corpus from the target"):
            prompt = torch.randint(3, TARGET["vocab_size"], (6,), generator=gen).tolist()
            out = llm.generate([prompt], SamplingParams(max_tokens=64, temperature=0.7, seed=i, ignore_eos=True))
            lines.append(json.dumps({"input_ids": prompt + out[0].outputs[0].token_ids}))
        corpus.write_text("\n".join(lines) + "\n")
    if not (head / "model.safetensors").exists():
        train_draft(target, [corpus], head, steps=300, seq_len=48, batch_size=8, lr=3e-3, seed=0)
    return target, head


def main(argv=None) -> None:
    from moespec import LLM, SamplingParams, SpeculativeConfig
    import moespec.models as mm

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--work", default="build/bench/spec")
    args = parser.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    target_path, head_path = build(work)
    target = mm.load(target_path, "bf16")
    N = target.config.moe.num_experts
    configs = {"ar": SpeculativeConfig("ar"), "eagle3": SpeculativeConfig("eagle3", **TREE)}
    for b in (N // 8, N // 4, N // 2):
        configs[f"eagle3+budget:{b}"] = SpeculativeConfig("eagle3+budget", budget=b, **TREE)
    llms = {name: LLM(target, draft=None if name == "ar" else str(head_path), speculative_config=c)
            for name, c in configs.items()}
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, TARGET["vocab_size"], (6,), generator=gen).tolist() for _ in range(args.prompts)]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    for llm in llms.values():  # warm-up
        llm.generate([prompts[0]], SamplingParams(max_tokens=4, ignore_eos=True))
    totals = {name: {"tokens": 0, "time": 0.0, "steps": 0, "natural": [], "kept": []} for name in llms}
    for prompt in tqdm(prompts, desc="policies, interleaved"):
        for name, llm in llms.items():
            start = time.perf_counter()
            out = llm.generate([prompt], params)[0]
            t = totals[name]
            t["time"] += time.perf_counter() - start
            t["tokens"] += len(out.outputs[0].token_ids)
            t["steps"] += out.stats.decode_steps + 1  # + the prefill, which emits the first token
            for s in out.stats.expert_stats:
                t["natural"].append(s[:, 0].float().mean().item())
                t["kept"].append(s[:, 1].float().mean().item())
    print(f"\nsmall MoE built here: Qwen3-MoE, {TARGET['num_hidden_layers']} layers, hidden {TARGET['hidden_size']}, "
          f"{N} experts, top-{TARGET['num_experts_per_tok']}, bf16; {args.prompts} prompts x {args.max_tokens} "
          f"tokens, greedy; tree depth {TREE['depth']}, top-k {TREE['top_k']}, {TREE['total_tokens']} nodes; "
          f"torch threads {torch.get_num_threads()}")
    print(f"{'policy':<20}{'tok/s':>8}{'accept len':>12}{'experts/layer/verify':>23}{'vs ar':>8}{'vs eagle3':>11}")
    rate = {n: t["tokens"] / t["time"] for n, t in totals.items()}
    for name, t in totals.items():
        experts = (f"{sum(t['natural']) / len(t['natural']):.1f} -> {sum(t['kept']) / len(t['kept']):.1f}"
                   if t["kept"] else "-")
        print(f"{name:<20}{rate[name]:>8.1f}{t['tokens'] / t['steps']:>12.2f}{experts:>23}"
              f"{rate[name] / rate['ar']:>7.2f}x{rate[name] / rate['eagle3']:>10.2f}x")


if __name__ == "__main__":
    main()
