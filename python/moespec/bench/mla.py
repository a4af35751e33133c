"""Times one DeepSeek-V3 attention layer (multi-head latent attention) in its two forms.

    python -m moespec.bench.mla [--contexts 256 1024 4096] [--tokens 1 16] [--dtype bf16]
                                [--device cpu|cuda] [--repeats 5] [--out FOLDER]

DeepSeek-V3's attention shape (hidden 7168, 128 heads, q rank 1536, kv rank 512, no-rope 128 + rope 64,
values 128) with random weights, one request: T new tokens over S cached slots, the runtime's own
attention block (moespec.runtime.attention) with its form forced: expanded (transformers': kv_b
applied to every cached latent, then attention per head) and absorbed (kv_b folded into the queries
and out of the outputs: one attention over the latent). Forms are interleaved within each repeat; the
ratio expanded / absorbed is from one run. Also prints the form the runtime picks for (T, S)
(:func:`moespec.runtime.attention.mla_absorbed`). ``--out``: mla.json and, where matplotlib is,
mla.png (:func:`moespec.bench.plots.mla_plot`).
"""

from __future__ import annotations

import argparse
import platform
import statistics
from pathlib import Path
from types import SimpleNamespace

import torch

from moespec.bench.ops import _time_per_call
from moespec.models.config import RawConfig
from moespec.models.families.deepseek_v3 import parse_config
from moespec.models.weights import LayerWeights
from moespec.runtime import attention

DEEPSEEK_V3 = dict(  # deepseek-ai/DeepSeek-V3's config.json, the fields the attention reads (one layer)
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
    moe_intermediate_size=2048, num_hidden_layers=1, num_attention_heads=128, num_key_value_heads=128,
    n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4, n_shared_experts=1,
    routed_scaling_factor=2.5, first_k_dense_replace=0, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, rms_norm_eps=1e-6, max_position_embeddings=163840, rope_theta=10000.0)


def layer_and_config(dtype: torch.dtype, device: str):
    """A random DeepSeek-V3 attention layer (weights scaled as an initialiser would) and its config."""
    c = parse_config(RawConfig(DEEPSEEK_V3, "DeepSeek-V3 (bench)"), "DeepseekV3ForCausalLM")
    m, H, Hq = c.mla, c.hidden_size, c.num_heads
    gen = torch.Generator().manual_seed(0)

    def w(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=gen) * cols**-0.5).to(dtype).to(device)

    ones = lambda n: torch.ones(n, dtype=dtype, device=device)  # noqa: E731
    layer = LayerWeights(input_norm=ones(H), qkv=None, qkv_bias=None, q_norm=None, k_norm=None,
                         o=w(H, Hq * m.v_head_dim), o_bias=None, post_norm=ones(H), q_a=w(m.q_lora_rank, H),
                         q_a_norm=ones(m.q_lora_rank), q=w(Hq * m.qk_head_dim, m.q_lora_rank),
                         kv_a=w(m.kv_lora_rank + m.qk_rope_head_dim, H), kv_a_norm=ones(m.kv_lora_rank),
                         kv_b=w(Hq * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank))
    return c, layer


def step(c, layer, T: int, S: int, dtype: torch.dtype, device: str):
    """fn(): one call of the attention block for T new tokens at the end of S slots (the cache filled
    with random latents and rope keys)."""
    m, H = c.mla, c.hidden_size
    kw = dict(dtype=dtype, device=device)
    cache = SimpleNamespace(k=[torch.randn(1, 1, S, m.kv_lora_rank, **kw)],
                            v=[torch.randn(1, 1, S, m.qk_rope_head_dim, **kw)])
    h = torch.randn(1, T, H, **kw)
    angle = torch.rand(1, 1, T, m.qk_rope_head_dim, device=device) * 6.28
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    mask = torch.ones(1, 1, T, S, dtype=torch.bool, device=device)
    rows = torch.zeros(T, dtype=torch.long, device=device)
    cols = torch.arange(T, device=device)
    slots = cols + (S - T)

    def fn():
        with torch.no_grad():
            out = attention.attention(c, 0, layer, h, cos, sin, mask, cache, rows, cols, slots, S)
        if device == "cuda":
            torch.cuda.synchronize()
        return out

    return fn


def bench(contexts=(256, 1024, 4096), tokens=(1, 16), dtype=torch.bfloat16, device="cpu", repeats=5,
          progress=print):
    """Rows {T, S, expanded_ms, absorbed_ms, picks}: the median of ``repeats`` interleaved timings, and
    the form the runtime takes at (T, S)."""
    c, layer = layer_and_config(dtype, device)
    forced = attention.mla_absorbed
    rows = []
    try:
        for S in contexts:
            for T in tokens:
                fn = step(c, layer, T, S, dtype, device)
                times = {"expanded": [], "absorbed": []}
                for _ in range(repeats):
                    for form in times:
                        attention.mla_absorbed = lambda c_, T_, S_, a=form == "absorbed": a
                        fn()  # warm-up of this form's shapes
                        times[form].append(_time_per_call(fn, 0.05))
                attention.mla_absorbed = forced
                row = dict(T=T, S=S, expanded_ms=statistics.median(times["expanded"]) * 1e3,
                           absorbed_ms=statistics.median(times["absorbed"]) * 1e3,
                           picks="absorbed" if forced(c, T, S) else "expanded")
                rows.append(row)
                progress(f"{T:>4} {S:>6} {row['expanded_ms']:>14.2f} {row['absorbed_ms']:>14.2f} "
                         f"{row['expanded_ms'] / row['absorbed_ms']:>9.1f}x  {row['picks']}")
    finally:
        attention.mla_absorbed = forced
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="folder for mla.json and mla.png")
    args = parser.parse_args(argv)
    if min(args.contexts + args.tokens) < 1 or max(args.tokens) > min(args.contexts) or args.repeats < 1:
        parser.error("need 1 <= T <= S for every T and S, and --repeats >= 1")
    if max(args.contexts) > 1 << 17:
        parser.error(f"--contexts up to {1 << 17} slots (the expanded form holds 128 heads' keys and values)")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    device = platform.processor() or platform.machine()
    if args.device == "cuda":
        device = torch.cuda.get_device_name()
    print(f"machine: {device}, {torch.get_num_threads()} torch threads, torch {torch.__version__}; "
          f"DeepSeek-V3 attention layer, {args.dtype}, median of {args.repeats}")
    print(f"{'T':>4} {'S':>6} {'expanded (ms)':>14} {'absorbed (ms)':>14} {'exp/abs':>10}  runtime picks")
    rows = bench(tuple(args.contexts), tuple(args.tokens), dtype, args.device, args.repeats)
    if args.out is not None:
        from moespec.bench.report import write_json_atomic

        result = dict(device=device, dtype=args.dtype, threads=torch.get_num_threads(), rows=rows)
        print(f"wrote {write_json_atomic(args.out / 'mla.json', result)}")
        try:
            from moespec.bench.plots import mla_plot
            print(f"wrote {mla_plot(result, args.out / 'mla.png')}")
        except ImportError:  # (a GPU machine without matplotlib: tests/gpu/plot_results.py draws it later)
            print("matplotlib is missing: no mla.png (tests/gpu/plot_results.py draws it from mla.json)")


if __name__ == "__main__":
    main()
