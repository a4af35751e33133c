"""Training an EAGLE-3 draft head for a moespec target: ``moespec train-draft`` and :func:`train_draft`.

Implements DESIGN.md "Speculative decoding (EAGLE-3)" ("train heads for our own targets"), following
SafeAILab/EAGLE ``eagle/traineagle3`` (REFERENCE.md section 3): the head is teacher-forced on the
target's tap hidden states and unrolled for ``ttt_steps`` training-time-test steps
(:meth:`moespec.spec.eagle3.Eagle3Head.ttt_forward`); step j's loss is the cross-entropy of the draft
logits against the target's next-token distribution restricted to the draft vocabulary, over
positions whose target argmax is in the draft vocabulary, weighted 0.8^j. The output folder is an
EAGLE-3 checkpoint :func:`moespec.spec.eagle3.load_eagle3` reads.

Data: the corpus files' token ids are concatenated (no separators) and cut into windows of
``seq_len`` tokens; the windows are visited in a fresh seeded permutation every epoch, so the batch
of a step depends only on (seed, step) and a resumed run sees the same batches.

Resuming: ``out_dir/checkpoint.pt`` holds the head, the AdamW state, the step, the torch RNG state
and the run's arguments; a rerun with the same arguments continues from it (bit-identical to an
uninterrupted run on the same machine and thread count), a finished run is a no-op.

Dimensions: B batch, T sequence length, V target vocabulary, Vd draft vocabulary, K ttt steps.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal, Optional, Sequence

import torch
from safetensors.torch import save_file
from tqdm import tqdm

import moespec.models as mm
from moespec.models.config import ModelConfig
from moespec.spec.eagle3 import Eagle3Config, Eagle3Head, default_aux_layers, init_weights, load_eagle3
from moespec.spec.teacher import NoRoomError, TeacherBatch, TeacherCache, run_teacher

CHECKPOINT = "checkpoint.pt"
CHECKPOINT_VERSION = 1
TEACHER_CACHE = "teacher-cache"  # out_dir's folder of the target's outputs on every window (spec/teacher.py)
STEP_WEIGHT = 0.8  # EAGLE-3: step j's loss weighs 0.8^j
GRAD_CLIP = 0.5  # EAGLE-3's gradient clipping norm
BETAS = (0.9, 0.95)  # EAGLE-3's AdamW betas
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass
class TrainResult:
    out_dir: Path
    step: int  # steps done in total (== steps when finished)
    loss: float  # the last step's weighted loss
    start_step: int  # where this run started (0, or the checkpoint it resumed from)
    losses: list[float] = field(default_factory=list)  # this run's per-step weighted losses
    accuracy: list[float] = field(default_factory=list)  # this run's per-step step-0 top-1 agreement
    already_finished: bool = False


# ---- corpus and draft vocabulary ----------------------------------------------------------------


def _has_tokenizer(folder: Path) -> bool:
    return any((folder / name).is_file() for name in TOKENIZER_FILES)


def read_corpus(paths: Sequence[str | Path], target_folder: str | Path, vocab_size: int) -> list[list[int]]:
    """Token ids of each document of the corpus files.

    ``.jsonl``: one JSON object per line with an ``input_ids`` list (or a ``text`` string, tokenized);
    ``.ids``: whitespace-separated ids, one document per line; anything else: a text document,
    tokenized with the target folder's tokenizer (transformers AutoTokenizer, local files only).
    """
    if not paths:
        raise ValueError("corpus: no files given")
    target_folder = Path(target_folder)
    tokenizer = None

    def tokenize(text: str, where: str) -> list[int]:
        nonlocal tokenizer
        if tokenizer is None:
            if not _has_tokenizer(target_folder):
                raise ValueError(f"{where}: text needs the target's tokenizer, but {target_folder} has none "
                                 f"({', '.join(TOKENIZER_FILES)}); give token ids as .jsonl ('input_ids') or .ids")
            from transformers import AutoTokenizer

            try:
                tokenizer = AutoTokenizer.from_pretrained(str(target_folder), local_files_only=True)
            except Exception as exc:  # transformers raises many types for a broken tokenizer folder
                raise ValueError(f"{target_folder}: cannot load the tokenizer ({exc})") from None
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    docs: list[list[int]] = []
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise ValueError(f"corpus file {str(path)!r} does not exist")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"corpus file {path}: not UTF-8 text ({exc})") from None
        if path.suffix == ".jsonl":
            for n, line in enumerate(text.splitlines(), start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{n}: not valid JSON ({exc})") from None
                if isinstance(row, dict) and isinstance(row.get("input_ids"), list):
                    ids = row["input_ids"]
                    if not all(isinstance(t, int) for t in ids):
                        raise ValueError(f"{path}:{n}: input_ids must be a list of integers")
                elif isinstance(row, dict) and isinstance(row.get("text"), str):
                    ids = tokenize(row["text"], f"{path}:{n}")
                else:
                    raise ValueError(f"{path}:{n}: expected an object with an 'input_ids' list or a 'text' string")
                docs.append(ids)
        elif path.suffix == ".ids":
            for n, line in enumerate(text.splitlines(), start=1):
                try:
                    ids = [int(t) for t in line.split()]
                except ValueError:
                    raise ValueError(f"{path}:{n}: expected whitespace-separated integer token ids") from None
                if ids:
                    docs.append(ids)
        else:
            docs.append(tokenize(text, str(path)))
    for ids in docs:
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"corpus: token id {bad[0]} is outside the target's vocabulary [0, {vocab_size})")
    return docs


def draft_vocabulary(stream: torch.Tensor, vocab_size: int, draft_vocab_size: int) -> Optional[torch.Tensor]:
    """The target ids of the draft vocabulary, ascending: the ``draft_vocab_size`` most frequent ids of
    ``stream`` (ties: smaller id first; ids never seen fill up in id order). None for the full
    vocabulary (draft_vocab_size >= V). Draft id i is target id ``used[i]``, so ``d2t = used - i``."""
    if draft_vocab_size >= vocab_size:
        return None
    counts = torch.bincount(stream.long(), minlength=vocab_size)  # [V]
    order = torch.argsort(-counts, stable=True)  # descending count, ascending id within ties
    return order[:draft_vocab_size].sort().values  # [Vd]


# ---- one training step --------------------------------------------------------------------------


def ttt_loss(head: Eagle3Head, tokens: torch.Tensor, teacher: TeacherBatch,
             steps: int) -> tuple[torch.Tensor, list[float], list[float]]:
    """The weighted training-time-test loss of one batch, and per step its loss and top-1 agreement.

    ``tokens`` long [B, T]; ``teacher``: the target's outputs on them (row p: the target's distribution
    of token p + 1). Step j row t predicts x_{t+2+j}: its soft label is softmax of the target logits
    of row t + 1 + j restricted to the draft vocabulary; rows whose target argmax is not in the draft
    vocabulary are left out (as EAGLE-3). The loss of a step is the mean over its rows; agreement
    counts every row (a target argmax outside the draft vocabulary is a miss).
    """
    T = tokens.shape[1]
    outs = head.ttt_forward(tokens, teacher.features, steps)
    total = torch.zeros((), dtype=torch.float32)
    losses, agreement = [], []
    for j, out in enumerate(outs):
        n = T - 1 - j  # rows with a target
        if n <= 0:
            break
        want = teacher.argmax[:, 1 + j:]  # [B, n]
        keep = head.t2d[want]  # [B, n]
        soft = teacher.logits[:, 1 + j:].softmax(dim=-1)  # [B, n, Vd]
        logp = out.logits[:, :n].float().log_softmax(dim=-1)  # [B, n, Vd]
        ce = -(soft * logp).sum(dim=-1)  # [B, n]
        loss = (ce * keep).sum() / keep.sum().clamp(min=1)
        total = total + STEP_WEIGHT**j * loss
        losses.append(loss.item())
        agreement.append((head.to_target(out.logits[:, :n].argmax(dim=-1)) == want).float().mean().item())
    return total, losses, agreement


@torch.no_grad()
def head_agreement(target, head: Eagle3Head, sequences: Sequence[Sequence[int]], starts: Sequence[int], *,
                   steps: int = 3, top_k: int = 4) -> dict:
    """Teacher-forced agreement of ``head`` with ``target`` on ``sequences`` (token ids: a prompt and
    what the target generated after it, from index ``starts[b]`` on), by training-time-test step.

    Step j at row t (target taps of token t, the true tokens up to t + 1 + j, its own outputs for
    steps 1..j) predicts token t + 2 + j; a row counts where that token is generated (index >=
    ``starts[b]``). Returns ``top1[j]`` and ``topk[j]`` (the target's argmax there is the head's first /
    among its ``top_k`` best), ``outside_vocab`` (the share of those argmaxes the draft vocabulary
    lacks: no head can propose them) and ``rows`` (positions counted at step 0). On the target's own
    greedy continuations the argmax is the generated token, so top1[0] is the acceptance rate of a
    first draft token that a chain of depth 1 would see at every position.
    """
    if len(sequences) != len(starts):
        raise ValueError(f"head_agreement: {len(sequences)} sequences but {len(starts)} starts")
    target.set_taps(head.config.aux_layers)
    hits = torch.zeros(2, steps, dtype=torch.float64)  # [top-1 / top-k, step]
    rows = torch.zeros(steps, dtype=torch.float64)
    outside = 0.0
    for seq, start in zip(sequences, starts):
        T = len(seq)
        if not 2 <= start < T:
            raise ValueError(f"head_agreement: a start must lie in [2, len(sequence)), got {start} for {T} tokens")
        tokens = torch.tensor([list(seq)], device=target.device)  # [1, T]
        cache = target.new_cache(1, T)
        out = target.prefill(cache, tokens.tolist(), logits="all")
        want = out.logits[0].float().argmax(dim=-1)  # [T]: row p -> the target's argmax for token p + 1
        drafts = head.ttt_forward(tokens, torch.cat(out.hidden, dim=-1).float(), steps)
        for j, d in enumerate(drafts):
            r = torch.arange(start - 2 - j, T - 2 - j, device=tokens.device)  # rows predicting tokens start..T-1
            r = r[r >= 0]
            w = want[r + 1 + j]  # [n]
            best = head.to_target(d.logits[0, r].topk(min(top_k, d.logits.shape[-1]), dim=-1).indices)  # [n, k]
            hits[0, j] += (best[:, 0] == w).sum().item()
            hits[1, j] += (best == w[:, None]).any(dim=-1).sum().item()
            rows[j] += len(r)
            if j == 0:
                outside += (~head.t2d[w]).sum().item()
    share = hits / rows.clamp(min=1)
    return {"steps": steps, "top_k": top_k, "top1": share[0].tolist(), "topk": share[1].tolist(),
            "outside_vocab": outside / max(rows[0].item(), 1.0), "rows": int(rows[0].item())}


# ---- the trainer --------------------------------------------------------------------------------


def new_head(target: ModelConfig, embed: torch.Tensor, used: Optional[torch.Tensor], *, seed: int,
             aux_layers: Optional[Sequence[int]] = None, intermediate_size: Optional[int] = None) -> Eagle3Head:
    """An untrained fp32 head shaped like the target's attention (EAGLE-3's choice): H, heads, head
    dim and rope of the target; the target's dense feed-forward width (3 H if it has none); draft
    vocabulary ``used`` (target ids, ascending; None = full); weights from ``seed``."""
    config = Eagle3Config(
        hidden_size=target.hidden_size,
        intermediate_size=intermediate_size or target.intermediate_size or 3 * target.hidden_size,
        num_heads=target.num_heads,
        num_kv_heads=target.num_kv_heads,
        head_dim=target.head_dim,
        rms_norm_eps=target.rms_norm_eps,
        rope=target.rope,
        vocab_size=target.vocab_size,
        draft_vocab_size=target.vocab_size if used is None else len(used),
        target_hidden_size=target.hidden_size,
        aux_layers=tuple(int(i) for i in (aux_layers or default_aux_layers(target.num_layers))),
        max_position_embeddings=target.max_position_embeddings,
    )
    d2t = None if used is None else used - torch.arange(len(used))
    return init_weights(Eagle3Head(config, embed.float(), d2t, dtype=torch.float32), seed)


def _batch_windows(step: int, batch_size: int, num_windows: int, seed: int) -> torch.Tensor:
    """long [B]: the windows of a step; epoch e visits all windows in permutation(seed, e)."""
    first = step * batch_size
    out, perms = [], {}
    for g in range(first, first + batch_size):
        epoch = g // num_windows
        if epoch not in perms:
            gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
            perms[epoch] = torch.randperm(num_windows, generator=gen)
        out.append(perms[epoch][g % num_windows])
    return torch.stack(out)


def learning_rate(lr: float, step: int, steps: int, decay_steps: int) -> float:
    """The learning rate of 0-based ``step`` of ``steps``: ``lr``, and over the last ``decay_steps``
    steps a linear decay, lr (steps - step) / (decay_steps + 1) (never zero: the last step moves too).
    A constant rate then a short linear cool-down (warmup-stable-decay without the warmup: Adam's
    bias correction already damps the first steps) ends a compute-bound run nearer a minimum than a
    constant rate does."""
    if decay_steps <= 0 or step < steps - decay_steps:
        return lr
    return lr * (steps - step) / (decay_steps + 1)


def _use_teacher_cache(choice: Optional[bool], steps: int, batch_size: int, num_windows: int) -> bool:
    """Whether a run of ``steps`` more steps caches the teacher (``choice``; None: when it revisits windows)."""
    if choice is not None:
        return bool(choice)
    return steps * batch_size > num_windows


def _atomic_save(obj, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _write_head(head: Eagle3Head, out: Path, provenance: dict) -> None:
    config = head.config.to_config()
    config["torch_dtype"] = "float32"
    config["moespec"] = provenance
    tensors = {k: v.contiguous() for k, v in head.official_state_dict().items()}
    tmp = out / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _restore(path: Path, args: dict, steps: int, head: Eagle3Head,
             optimizer: torch.optim.Optimizer) -> tuple[int, float]:
    """Loads head, optimizer and RNG state from a checkpoint written with the same ``args``;
    returns its step and loss."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle, zip and torch errors alike
        raise ValueError(f"{path}: cannot read the checkpoint ({type(exc).__name__}: {exc}); "
                         f"delete it or pass resume=False (--no-resume)") from None
    if not isinstance(ckpt, dict) or ckpt.get("version") != CHECKPOINT_VERSION:
        raise ValueError(f"{path}: not a version-{CHECKPOINT_VERSION} train-draft checkpoint")
    for k in sorted(set(args) | set(ckpt["args"])):
        if ckpt["args"].get(k) != args.get(k):
            raise ValueError(f"{path} was written with {k}={ckpt['args'].get(k)!r}, this run has {k}={args.get(k)!r}; "
                             f"use another output folder or pass resume=False (--no-resume) to start over")
    if int(ckpt["step"]) > steps:
        raise ValueError(f"{path} is at step {ckpt['step']}, beyond steps={steps}")
    head.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    torch.set_rng_state(ckpt["rng"])
    return int(ckpt["step"]), float(ckpt["loss"])


def train_draft(
    target_path: str | Path,
    corpus_paths: Sequence[str | Path],
    out_dir: str | Path,
    *,
    steps: int = 2000,
    ttt_steps: int = 7,
    draft_vocab_size: int = 32000,
    lr: float = 3e-4,
    batch_size: int = 8,
    seq_len: int = 256,
    seed: int = 0,
    resume: bool = True,
    progress: bool = True,
    dtype: Literal["fp32", "bf16"] = "fp32",
    checkpoint_every: int = 100,
    aux_layers: Optional[Sequence[int]] = None,
    moe_impl: Optional[str] = None,
    amp: bool = False,
    callback: Optional[Callable[[int, float], None]] = None,
    init: Optional[str | Path] = None,
    teacher_cache: Optional[bool] = None,
    lr_decay_steps: int = 0,
) -> TrainResult:
    """Trains an EAGLE-3 head for the target at ``target_path`` and writes it to ``out_dir``.

    Parameters
    ----------
    steps : total optimizer steps (a resumed run continues up to it).
    ttt_steps : unrolled draft steps per position (EAGLE-3: 7).
    draft_vocab_size : draft vocabulary, the most frequent corpus ids; >= V keeps the full vocabulary.
    lr, batch_size, seq_len, seed : AdamW learning rate (betas 0.9/0.95, clip 0.5; constant but for
        ``lr_decay_steps``), sequences per step, tokens per sequence, seed of the initial weights and of
        the data order.
    lr_decay_steps : the last this many steps take the learning rate linearly down to zero (0: constant
        throughout; :func:`learning_rate`). A run with a decay resumes only to the same ``steps``.
    resume : continue from ``out_dir/checkpoint.pt`` when present (same arguments required).
    dtype : the target's dtype for the teacher pass; the head always trains in fp32.
    checkpoint_every : steps between checkpoints (one is also written at the end).
    aux_layers : target layers (moespec's output-of-layer indexing) feeding the head; default
        :func:`moespec.spec.eagle3.default_aux_layers`.
    moe_impl : the target's MoE implementation (:func:`moespec.models.load`).
    amp : run the head's forward and backward under bf16 autocast (weights, optimizer and losses stay
        fp32); about twice as fast on CPUs with bf16 instructions.
    callback : called as ``callback(step, loss)`` after every step (step counts from 1).
    init : a trained head's folder to start from (fine-tuning): its weights, draft vocabulary, feature
        layers and widths; ``draft_vocab_size`` and ``aux_layers`` are then ignored. The optimizer starts
        fresh.
    teacher_cache : compute the target's outputs on every window once, before the steps, and read them
        from ``out_dir/teacher-cache`` (:class:`moespec.spec.teacher.TeacherCache`; removed when the run
        ends) instead of a prefill per step. None (default): when the run visits windows more than once
        (steps x batch_size > the corpus's windows). The same head either way with the native target
        (batch-invariant). Without the room on disk it needs: ValueError when asked for (True), the
        per-step prefill by default (None).

    Returns a TrainResult. ValueError for bad arguments, corpus files, or a checkpoint written with
    other arguments.
    """
    for name, value, low in (("steps", steps, 1), ("ttt_steps", ttt_steps, 1), ("lr_decay_steps", lr_decay_steps, 0),
                             ("draft_vocab_size", draft_vocab_size, 1), ("batch_size", batch_size, 1),
                             ("seq_len", seq_len, 2), ("checkpoint_every", checkpoint_every, 1)):
        if int(value) < low:
            raise ValueError(f"train_draft: {name} must be >= {low}, got {value}")
    if not (lr > 0 and math.isfinite(lr)):
        raise ValueError(f"train_draft: lr must be a positive number, got {lr}")
    if dtype not in ("fp32", "bf16"):
        raise ValueError(f"train_draft: dtype must be 'fp32' or 'bf16', got {dtype!r}")
    target_path, out = Path(target_path), Path(out_dir)
    target = mm.load(target_path, dtype, moe_impl=moe_impl)
    c = target.config
    start_from = None
    if init is not None:
        # (ValueError naming what is wrong with a bad one)
        start_from = load_eagle3(init, c, embed=target.weights.embed.float(), dtype="fp32")
        start_from.train().requires_grad_(True)
        aux_layers = start_from.config.aux_layers
    taps = tuple(int(i) for i in (aux_layers or default_aux_layers(c.num_layers)))
    target.set_taps(taps)  # ValueError for a layer the target does not have

    docs = read_corpus(corpus_paths, target_path, c.vocab_size)
    stream = torch.tensor([t for d in docs for t in d], dtype=torch.long)  # [N tokens]
    num_windows = stream.numel() // seq_len
    if num_windows < 1:
        raise ValueError(f"corpus: {stream.numel()} tokens, fewer than one sequence of seq_len={seq_len}")
    windows = stream[: num_windows * seq_len].view(num_windows, seq_len)  # [W, T]
    if start_from is not None:
        head = start_from
    else:
        used = draft_vocabulary(stream, c.vocab_size, draft_vocab_size)
        head = new_head(c, target.weights.embed, used, seed=seed, aux_layers=taps)
    optimizer = torch.optim.AdamW(head.parameters(), lr=lr, betas=BETAS, weight_decay=0.0)

    args = {
        "target": str(target_path.resolve()), "corpus": [str(Path(p).resolve()) for p in corpus_paths],
        "corpus_tokens": int(stream.numel()), "ttt_steps": ttt_steps, "draft_vocab_size": head.config.draft_vocab_size,
        "lr": lr, "batch_size": batch_size, "seq_len": seq_len, "seed": seed, "dtype": dtype, "aux_layers": list(taps),
        "amp": amp, "init": None if init is None else str(Path(init).resolve()),
    }
    if lr_decay_steps:  # (absent when constant: checkpoints of constant runs stay resumable)
        args.update(lr_decay_steps=lr_decay_steps, steps=steps)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_path = out / CHECKPOINT
    start, last_loss = 0, float("nan")
    if resume and ckpt_path.is_file():
        start, last_loss = _restore(ckpt_path, args, steps, head, optimizer)
        if start == steps and (out / "model.safetensors").is_file() and (out / "config.json").is_file():
            print(f"train-draft: {out} is already trained to step {steps} (loss {last_loss:.4f}); nothing to do")
            return TrainResult(out, start, last_loss, start, already_finished=True)

    def save(step: int, loss: float) -> None:
        _atomic_save({"version": CHECKPOINT_VERSION, "step": step, "loss": loss, "args": args,
                      "model": head.state_dict(), "optimizer": optimizer.state_dict(),
                      "rng": torch.get_rng_state()}, ckpt_path)

    result = TrainResult(out, start, last_loss, start)
    cache = target.new_cache(batch_size, seq_len)  # allocated once, reset every step
    store = None
    if _use_teacher_cache(teacher_cache, steps - start, batch_size, num_windows):
        identity = {k: args[k] for k in ("target", "corpus", "corpus_tokens", "seq_len", "dtype", "aux_layers")}
        identity["moe_impl"] = moe_impl
        try:
            store = TeacherCache.open(out / TEACHER_CACHE, target=target, cache=cache, windows=windows, t2d=head.t2d,
                                      identity=identity, progress=progress)
        except NoRoomError as exc:
            if teacher_cache:  # asked for: an error; by default: the per-step prefill
                raise
            print(f"train-draft: {exc}; running without it (a prefill per step)", file=sys.stderr)
    head.train()
    bar = tqdm(total=steps, initial=start, desc="train-draft", disable=not progress, dynamic_ncols=True)
    for step in range(start, steps):
        index = _batch_windows(step, batch_size, num_windows, seed)  # [B]
        tokens = windows[index]  # [B, T]
        teacher = store.batch(index) if store is not None else run_teacher(target, cache, tokens, head.t2d)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(lr, step, steps, lr_decay_steps)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            loss, _, agreement = ttt_loss(head, tokens, teacher, ttt_steps)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), GRAD_CLIP)
        optimizer.step()
        result.step, result.loss = step + 1, loss.item()
        result.losses.append(result.loss)
        result.accuracy.append(agreement[0])
        bar.update(1)
        bar.set_postfix(loss=f"{result.loss:.4f}", acc=f"{agreement[0]:.3f}")
        if (step + 1) % checkpoint_every == 0 or step + 1 == steps:
            save(step + 1, result.loss)
        if callback is not None:
            callback(step + 1, result.loss)
    bar.close()
    if store is not None:
        store.remove()  # (GiBs for a real corpus; a longer rerun builds it again)

    provenance = {
        "target": str(target_path.resolve()), "target_architecture": c.architecture,
        "corpus": args["corpus"], "corpus_tokens": args["corpus_tokens"], "steps": result.step,
        "ttt_steps": ttt_steps, "batch_size": batch_size, "seq_len": seq_len, "lr": lr, "seed": seed,
        "final_loss": result.loss, "aux_layers": list(taps), **({} if init is None else {"init": args["init"]}),
        "aux_layers_note": "aux_layers: target layers whose output feeds the head (moespec indexing); "
                           "eagle_aux_hidden_state_layer_ids = aux_layers + 1 (vLLM: input of layer j)",
    }
    head.eval()
    _write_head(head, out, provenance)
    if progress:
        print(f"train-draft: wrote {out} (step {result.step}, loss {result.loss:.4f})")
    return result


# ---- command line -------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moespec train-draft",
                                description="Train an EAGLE-3 draft head for a target model on a local corpus.")
    p.add_argument("--target", required=True, help="target model folder (Hugging Face layout)")
    p.add_argument("--corpus", required=True, nargs="+",
                   help="corpus files: text (needs the target's tokenizer), .jsonl with input_ids, or .ids")
    p.add_argument("--out", required=True, help="output folder: the EAGLE-3 head and checkpoint.pt")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--draft-vocab", type=int, default=32000, help="draft vocabulary size (>= V: full vocabulary)")
    p.add_argument("--ttt-steps", type=int, default=7, help="unrolled training-time-test steps")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr-decay-steps", type=int, default=0, metavar="N",
                   help="the last N steps take the learning rate linearly down to zero (default 0: constant)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="the target's dtype")
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--aux-layers", type=int, nargs=3, default=None, metavar="I",
                   help="target layers whose outputs feed the head (0-based, output-of-layer indexing)")
    p.add_argument("--moe-impl", choices=("kernel", "reference"), default=None,
                   help="the target's MoE experts implementation (default: $MOESPEC_MOE_IMPL, else kernel)")
    p.add_argument("--amp", action="store_true", help="bf16 autocast for the head (fp32 weights and optimizer)")
    p.add_argument("--init", default=None, metavar="HEAD",
                   help="fine-tune: start from this trained EAGLE-3 head folder (its weights, draft vocabulary and "
                        "feature layers; --draft-vocab and --aux-layers are then ignored)")
    p.add_argument("--teacher-cache", action=argparse.BooleanOptionalAction, default=None,
                   help="compute the target's outputs on every window once, on disk in OUT/teacher-cache "
                        "(default: when the run visits windows more than once)")
    p.add_argument("--no-resume", action="store_true", help="ignore an existing checkpoint and start over")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``moespec train-draft`` (also ``python -m moespec.spec.train``). Returns the exit status."""
    a = _parser().parse_args(argv)
    try:
        train_draft(a.target, a.corpus, a.out, steps=a.steps, ttt_steps=a.ttt_steps, draft_vocab_size=a.draft_vocab,
                    lr=a.lr, batch_size=a.batch_size, seq_len=a.seq_len, seed=a.seed, resume=not a.no_resume,
                    progress=not a.quiet, dtype=a.dtype, checkpoint_every=a.checkpoint_every, aux_layers=a.aux_layers,
                    moe_impl=a.moe_impl, amp=a.amp, init=a.init,
                    teacher_cache=a.teacher_cache, lr_decay_steps=a.lr_decay_steps)
    except ValueError as exc:
        print(f"moespec train-draft: error: {exc}", file=sys.stderr)
        return 2  # the CLI contract: a user error is exit status 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
