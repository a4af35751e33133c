"""Times moespec's runtime against transformers' forward on the same random Qwen3-MoE checkpoint.

    python -m moespec.bench.runtime [--sizes tiny,mid] [--repeats 5] [--prompt 128]

For each size it writes a random checkpoint with transformers (in a temporary folder; nothing is
downloaded), loads it in both runtimes in bf16 and times, interleaved so that machine noise hits
both alike: a prefill of the prompt, one decode step after it, and verify steps of T = 16 and 64
tokens (a chain; transformers runs the same tokens through its KV cache, its closest equivalent).
transformers uses its default experts implementation (grouped_mm) and its DynamicCache, cropped
back after each step. Prints median milliseconds and transformers / moespec ratios from one run.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

SIZES = {
    "tiny": dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=16, num_experts_per_tok=4,
                 vocab_size=1024),
    "mid": dict(hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512, num_hidden_layers=4,
                num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=64, num_experts_per_tok=8,
                vocab_size=32000),
}


def _write(folder: Path, size: str) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(**SIZES[size], norm_topk_prob=True, initializer_range=0.05)
    Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).save_pretrained(folder)


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def bench(size: str, repeats: int, prompt_len: int) -> list[tuple[str, float, float]]:
    import moespec.models as mm
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / size
        _write(folder, size)
        ours = mm.load(folder, "bf16")
        theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    V = ours.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, V, (prompt_len,), generator=gen).tolist()
    cache = ours.new_cache(1, prompt_len + 80)
    ours.prefill(cache, [prompt])
    with torch.inference_mode():
        hf_cache = theirs(torch.tensor([prompt]), use_cache=True).past_key_values

    def ours_prefill():
        cache.lengths[0] = 0
        ours.prefill(cache, [prompt])

    def ours_step(tokens):
        def run():
            if len(tokens) == 1:
                ours.decode(cache, tokens)
            else:
                ours.verify(cache, [tokens], [[-1] + list(range(len(tokens) - 1))])
                cache.pending = None
            cache.lengths[0] = prompt_len
        return run

    @torch.inference_mode()
    def hf_prefill():
        theirs(torch.tensor([prompt]), use_cache=True)

    def hf_step(tokens):
        @torch.inference_mode()
        def run():
            theirs(torch.tensor([tokens]), cache=hf_cache, use_cache=True)
            hf_cache.crop(-len(tokens))  # back to the prompt
        return run

    cases = [("prefill", ours_prefill, hf_prefill)]
    for T in (1, 16, 64):
        tokens = torch.randint(3, V, (T,), generator=gen).tolist()
        cases.append(("decode step" if T == 1 else f"verify T={T}", ours_step(tokens), hf_step(tokens)))
    for _, a, b in cases:  # warm-up
        a(), b()
    rows = []
    for name, a, b in tqdm(cases, desc=f"{size} model", leave=False):
        ta, tb = [], []
        for _ in range(repeats):
            ta.append(_median_ms(a, 1))
            tb.append(_median_ms(b, 1))
        rows.append((name, statistics.median(ta), statistics.median(tb)))
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="tiny,mid")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompt", type=int, default=128)
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; bf16; prompt {args.prompt} tokens; "
          f"median of {args.repeats}")
    for size in args.sizes.split(","):
        s = SIZES[size]
        print(f"\n{size}: Qwen3-MoE, {s['num_hidden_layers']} layers, hidden {s['hidden_size']}, "
              f"{s['num_experts']} experts, top-{s['num_experts_per_tok']}, expert size {s['moe_intermediate_size']}")
        print(f"{'step':<14}{'moespec (ms)':>14}{'transformers (ms)':>19}{'transformers/moespec':>22}")
        for name, ours, theirs in bench(size, args.repeats, args.prompt):
            print(f"{name:<14}{ours:>14.2f}{theirs:>19.2f}{theirs / ours:>21.2f}x")


if __name__ == "__main__":
    main()
