"""How good the derived default MoE is, against the dense SmolLM2 it came from.

Measures (:func:`report` returns them as a dict and prints a table):
- held-out perplexity of the dense model and the MoE, plays, code and chat separately, on fixed
  windows of the held-out split (:mod:`moespec.default_model.corpus`), both run by transformers;
- greedy continuations of a few chat prompts (the tokenizer's chat template), dense and MoE;
- the byte profile (bf16 weights): what one decode token reads (dense weights + K experts a layer),
  what a verify pass touching every expert reads, and their ratio;
- routing statistics of the MoE on the held-out windows: per layer, the expert-usage entropy
  (of the share of routing slots each expert receives, divided by log N: 1 = every expert equally
  used) and the mean number of unique routed experts a batch of 60 consecutive tokens (a verify
  batch) needs versus one token (always K); and, over the layers, the unique experts of batches of
  1, 4, 8, 16, 32 and 64 consecutive tokens against what independent tokens with the same
  per-expert usage would need (sum over experts of 1 - (1 - K share_e)^T): co-routing is the gap.
  The 60-token counts are checked against moespec's runtime, whose prefill reports each MoE
  layer's unique experts;
- with ``--engine``, the engine's draft head on held-out chat prompts at its default tree: the
  acceptance length and the share of steps that accepted at least d draft tokens, per depth d; and
  teacher-forced on the same continuations, its top-1 / top-k agreement with the target by draft
  step and the share of the target's tokens outside its draft vocabulary
  (:func:`moespec.spec.train.head_agreement`).

    python -m moespec.default_model.report --model build/default-moe --cache build/cache/default-model

Dimensions: B windows, L window length, N experts, K top-k.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

import moespec.models as mm
from moespec.bench.roofline import byte_profile
from moespec.default_model.corpus import Corpus, prompt_set_texts, sample_windows
from moespec.default_model.derive import SHAKESPEARE, THREADS, gguf_path, input_path, load_teacher

PROMPTS = (
    "What is the capital of France?",
    "Write a Python function that returns the factorial of n.",
    "Who wrote Romeo and Juliet?",
    "Give me three tips for staying healthy.",
)
VERIFY_TOKENS = 60  # tokens of one verify batch in the routing statistics
HELD_SEEDS = {"plays": 101, "code": 102, "chat": 103}  # held-out windows (the derive step samples the fitting split only)


@torch.no_grad()
def perplexity(model: nn.Module, windows: torch.Tensor, batch: int = 4) -> float:
    """exp(mean next-token negative log-likelihood) over windows [B, L] (each window from its start)."""
    nll, count = 0.0, 0
    for i in range(0, len(windows), batch):
        x = windows[i : i + batch]
        logits = model(x).logits[:, :-1].float()  # [b, L - 1, V]
        nll += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum").item()
        count += x[:, 1:].numel()
    return math.exp(nll / count)


@torch.no_grad()
def continuation(model: nn.Module, tokenizer: Any, prompt: str, max_new_tokens: int) -> str:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


@torch.no_grad()
def routed_experts(moe: nn.Module, windows: torch.Tensor, batch: int = 4) -> torch.Tensor:
    """The top-K experts every token of ``windows`` [B, L] is routed to in each MoE layer: long
    [layers, B, L, K] (from the routers of transformers' Qwen2-MoE blocks)."""
    captured: list[list[torch.Tensor]] = []
    hooks = []
    for layer in moe.model.layers:
        found: list[torch.Tensor] = []
        captured.append(found)
        hooks.append(layer.mlp.gate.register_forward_hook(lambda _m, _i, out, found=found: found.append(out[2])))
    try:
        for i in range(0, len(windows), batch):
            moe(windows[i : i + batch])
    finally:
        for h in hooks:
            h.remove()
    B, L = windows.shape
    return torch.stack([torch.cat(found).view(B, L, -1) for found in captured])


def routing_stats(ids: torch.Tensor, num_experts: int, verify_tokens: int = VERIFY_TOKENS) -> dict[str, Any]:
    """Per-layer usage entropy and unique experts per ``verify_tokens``-token chunk, from ids [layers, B, L, K]."""
    layers, B, L, K = ids.shape
    counts = torch.stack([torch.bincount(ids[l].reshape(-1), minlength=num_experts) for l in range(layers)]).float()
    share = counts / counts.sum(1, keepdim=True)  # [layers, N]
    entropy = -(share * share.clamp_min(1e-12).log()).sum(1) / math.log(num_experts)
    chunks = ids[:, :, : (L // verify_tokens) * verify_tokens].reshape(layers, B, L // verify_tokens, verify_tokens * K)
    unique = torch.tensor([[[len(set(c.tolist())) for c in row] for row in layer] for layer in chunks]).float()
    return {"entropy": entropy.tolist(), "unique_verify": unique.mean((1, 2)).tolist(),
            "unique_one_token": float(K), "verify_tokens": verify_tokens,
            "max_share": share.max(1).values.tolist()}


BATCH_TOKENS = (1, 4, 8, 16, 32, 64)  # verify batch sizes of the co-routing table


def unique_vs_independent(ids: torch.Tensor, num_experts: int, sizes: Sequence[int] = BATCH_TOKENS) -> dict[str, list]:
    """Mean over layers of the unique experts of ``T``-token chunks of consecutive tokens, measured and
    as independent tokens with the layer's usage shares would need, for each T in ``sizes``."""
    layers, B, L, K = ids.shape
    measured, independent = [], []
    for T in sizes:
        per_layer_m, per_layer_i = [], []
        for l in range(layers):
            chunks = ids[l, :, : (L // T) * T].reshape(B * (L // T), T * K)
            per_layer_m.append(sum(len(set(c.tolist())) for c in chunks) / len(chunks))
            q = (torch.bincount(ids[l].reshape(-1), minlength=num_experts).double() / (B * L)).clamp(max=1.0)
            per_layer_i.append(float((1 - (1 - q) ** T).sum()))
        measured.append(sum(per_layer_m) / layers)
        independent.append(sum(per_layer_i) / layers)
    return {"tokens": list(sizes), "measured": measured, "independent": independent}


def _layout(config: Any) -> dict[str, int]:
    """N, K, m, S of a Qwen2-MoE or Mixtral config."""
    mixtral = getattr(config, "num_local_experts", None) is not None
    return {"num_experts": config.num_local_experts if mixtral else config.num_experts,
            "top_k": config.num_experts_per_tok,
            "expert_size": config.intermediate_size if mixtral else config.moe_intermediate_size,
            "shared_size": 0 if mixtral else config.shared_expert_intermediate_size}


def runtime_unique(model: Any, window: torch.Tensor, verify_tokens: int = VERIFY_TOKENS) -> list[int]:
    """Unique experts per MoE layer that moespec's runtime (``model``, a TargetModel) reports for the
    first ``verify_tokens`` tokens of ``window`` in one prefill."""
    out = model.prefill(model.new_cache(1, verify_tokens), [window[:verify_tokens].tolist()])
    return [s.natural_unique for s in out.expert_stats_by_layer()]


def acceptance_by_depth(lengths: Sequence[int], depth: int) -> list[float]:
    """Share of speculation steps that accepted at least d draft tokens, d = 1 .. ``depth`` (a step
    emits its accepted tokens + 1, ``lengths``)."""
    n = max(len(lengths), 1)
    return [sum(length - 1 >= d for length in lengths) / n for d in range(1, depth + 1)]


def head_acceptance(engine: str | Path, prompts: Sequence[str], max_tokens: int) -> dict[str, Any]:
    """The engine's draft head at its default tree, greedy, over ``prompts``: acceptance length
    (tokens per step) and :func:`acceptance_by_depth`."""
    from moespec.spec.llm import LLM
    from moespec.spec.sampling import SamplingParams

    from moespec.spec.train import head_agreement

    llm = LLM(engine)
    outs = llm.generate(list(prompts), SamplingParams(max_tokens=max_tokens), use_tqdm=False)
    lengths = [n for o in outs for n in o.stats.acceptance_lengths]
    tree = llm.speculative_config
    # teacher-forced on the same continuations (greedy eagle3 emits the target's greedy tokens)
    sequences = [o.prompt_token_ids + o.outputs[0].token_ids for o in outs]
    agreement = head_agreement(llm.target, llm.policy.head, sequences, [len(o.prompt_token_ids) for o in outs],
                               top_k=tree.top_k)
    return {"tree": {"depth": tree.depth, "top_k": tree.top_k, "total_tokens": tree.total_tokens},
            "prompts": len(prompts), "steps": len(lengths), "acceptance_length": sum(lengths) / max(len(lengths), 1),
            "at_least": acceptance_by_depth(lengths, tree.depth), "agreement": agreement}


def report(model_dir: str | Path, *, cache_dir: str | Path, windows: int = 16, window: int = 512,
           max_new_tokens: int = 48, prompts: Sequence[str] = PROMPTS, print_table: bool = True,
           engine: Optional[str | Path] = None, head_prompts: int = 24) -> dict[str, Any]:
    """Dense vs MoE on the held-out split; see the module docstring; with ``engine``, also its head's
    acceptance on ``head_prompts`` held-out chat prompts (64 tokens each). Returns a JSON-able dict."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(THREADS)
    clock = time.perf_counter()
    model_dir, cache_dir = Path(model_dir), Path(cache_dir)
    dense, tokenizer = load_teacher(gguf_path(cache_dir))
    moe = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, experts_implementation="eager").eval()
    corpus = Corpus.load(input_path(SHAKESPEARE, cache_dir))
    texts = {"plays": corpus.held["plays"], "code": corpus.held["code"],
             "chat": {"prompt-sets": "\n".join(prompt_set_texts(tokenizer, "held"))}}
    held = {d: sample_windows(tokenizer, files, windows, window, HELD_SEEDS[d]) for d, files in texts.items()}
    ppl = {d: {"dense": perplexity(dense, w), "moe": perplexity(moe, w)} for d, w in held.items()}
    for v in ppl.values():
        v["ratio"] = v["moe"] / v["dense"]
    samples = [{"prompt": p, "dense": continuation(dense, tokenizer, p, max_new_tokens),
                "moe": continuation(moe, tokenizer, p, max_new_tokens)} for p in prompts]
    ids = torch.cat([routed_experts(moe, w) for w in held.values()], dim=1)  # [layers, 3B, L, K]
    layout = _layout(moe.config)
    routing = routing_stats(ids, layout["num_experts"])
    routing["batches"] = unique_vs_independent(ids, layout["num_experts"])
    runtime = mm.load(model_dir, "fp32")
    check = runtime_unique(runtime, held["plays"][0])
    want = [len(set(ids[l, 0, :VERIFY_TOKENS].reshape(-1).tolist())) for l in range(ids.shape[0])]
    routing["runtime_agrees"] = check == want
    result = {"perplexity": ppl, "samples": samples, "routing": routing, "layout": layout,
              "bytes": byte_profile(runtime, bytes_per_weight=2),  # bf16, as the engine
              "held_out_tokens_per_domain": windows * window}
    if engine is not None:
        chat = prompt_set_texts(tokenizer, "held", answers=False)
        result["head"] = head_acceptance(engine, chat[:: max(1, len(chat) // head_prompts)][:head_prompts], 64)
    result["seconds"] = round(time.perf_counter() - clock, 1)
    if print_table:
        print_report(result)
    return result


def print_report(r: dict[str, Any]) -> None:
    print(f"{'held-out':<8} {'dense ppl':>10} {'MoE ppl':>10} {'ratio':>7}")
    for d, v in r["perplexity"].items():
        print(f"{d:<8} {v['dense']:>10.2f} {v['moe']:>10.2f} {v['ratio']:>7.3f}")
    rt, lay = r["routing"], r["layout"]
    print(f"\nrouting (N={lay['num_experts']}, K={lay['top_k']}, m={lay['expert_size']}, shared={lay['shared_size']}): "
          f"per layer, usage entropy / log N and unique experts for {rt['verify_tokens']} tokens vs 1 token "
          f"({rt['unique_one_token']:.0f}); runtime agrees: {rt['runtime_agrees']}")
    print(f"{'layer':>5} {'entropy':>8} {'max share':>9} {'unique@' + str(rt['verify_tokens']):>10}")
    for i, (e, s, u) in enumerate(zip(rt["entropy"], rt["max_share"], rt["unique_verify"])):
        print(f"{i:>5} {e:>8.3f} {s:>9.3f} {u:>10.1f}")
    n = len(rt["entropy"])
    print(f"{'mean':>5} {sum(rt['entropy']) / n:>8.3f} {sum(rt['max_share']) / n:>9.3f} {sum(rt['unique_verify']) / n:>10.1f}")
    bt = rt["batches"]
    print("\nunique experts of a batch of T consecutive tokens (mean over layers): measured / independent tokens")
    print("  ".join(f"T={t}: {m:.1f} / {i:.1f}" for t, m, i in zip(bt["tokens"], bt["measured"], bt["independent"])))
    b = r["bytes"]
    print(f"\nbytes (bf16): a decode token reads {b['decode_mb']:.0f} MB, a verify touching every expert "
          f"{b['full_union_mb']:.0f} MB ({b['ratio']:.2f}x); routed experts {100 * b['expert_share']:.0f}% of the weights")
    if "head" in r:
        h = r["head"]
        print(f"\nhead (tree {h['tree']}, {h['prompts']} held-out chat prompts, greedy): acceptance length "
              f"{h['acceptance_length']:.2f}; steps accepting >= d draft tokens: "
              + "  ".join(f"d={d + 1}: {v:.2f}" for d, v in enumerate(h["at_least"])))
        a = h["agreement"]
        print(f"  teacher-forced on those continuations ({a['rows']} positions): top-1 / top-{a['top_k']} agreement "
              "by step " + "  ".join(f"{j}: {t1:.2f} / {tk:.2f}" for j, (t1, tk) in enumerate(zip(a["top1"], a["topk"])))
              + f"; the target's token outside the draft vocabulary: {a['outside_vocab']:.3f}")
    for s in r["samples"]:
        print(f"\n> {s['prompt']}\n  dense: {s['dense']!r}\n  MoE:   {s['moe']!r}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m moespec.default_model.report", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, type=Path, help="the derived MoE folder (Mixtral or Qwen2-MoE)")
    p.add_argument("--cache", type=Path, default=Path(__file__).resolve().parents[3] / "build" / "cache" / "default-model")
    p.add_argument("--windows", type=int, default=16, help="held-out windows per domain")
    p.add_argument("--engine", type=Path, help="an engine folder of this MoE: also its head's acceptance per depth")
    p.add_argument("--json", type=Path, help="also write the result here")
    args = p.parse_args(argv)
    result = report(args.model, cache_dir=args.cache, windows=args.windows, engine=args.engine)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
