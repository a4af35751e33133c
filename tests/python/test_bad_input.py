"""The bad-input table (issue "Reliability"): each case is a call a user could make with one bad
thing in it, the exception type it must raise and a fragment of the message, which must name the
problem. The process stays alive (the table runs in-process) and the CLI cases exit 2 with one
line on stderr, no traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from models_fixtures import write_checkpoint
from moespec import LLM, SamplingParams, SpeculativeConfig
from moespec.engine import load_engine
from moespec.models import load
from moespec.ops import ExpertBudget, RouterSpec, moe_experts, route_experts

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_checkpoint("qwen3_moe", tmp_path_factory.mktemp("bad") / "qwen3_moe")


@pytest.fixture(scope="module")
def engine(folder, tmp_path_factory):
    from moespec.engine import build_engine

    out = tmp_path_factory.mktemp("bad_engine") / "engine"
    build_engine(folder, out, dtype="fp32", progress=False)
    return out


@pytest.fixture(scope="module")
def drafted(folder, tmp_path_factory):
    """An engine with a draft head (files listed with their sha256 in the manifest)."""
    from moespec.engine import build_engine

    root = tmp_path_factory.mktemp("bad_drafted")
    return build_engine(folder, root / "engine", draft=_head_of_another_target(folder, root / "head", hidden=64),
                        dtype="fp32", progress=False).folder


def _tamper(engine, tmp_path, edit):
    import shutil

    copy = tmp_path / "engine"
    shutil.copytree(engine, copy)
    edit(copy)
    return copy


def _truncate_weights(folder):
    path = folder / "weights.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _foreign_manifest(folder):
    m = json.loads((folder / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps({**m, "format": "other-engine"}))


def _flip_a_weight_byte(folder):  # same size, another checksum
    path = folder / "weights.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40
    path.write_bytes(bytes(data))


def _flip_a_draft_byte(folder):
    path = folder / "draft" / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40
    path.write_bytes(bytes(data))


def _head_of_another_target(folder, out, hidden=96):
    """An untrained EAGLE-3 head for a target of hidden size ``hidden`` (this one's is 64: 64 fits it)."""
    import dataclasses

    from safetensors.torch import save_file

    from moespec.models import read_config
    from moespec.spec.train import new_head

    other = dataclasses.replace(read_config(folder), hidden_size=hidden)
    head = new_head(other, torch.randn(other.vocab_size, hidden), None, seed=0)
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(head.config.to_config()))
    save_file({k: v.contiguous() for k, v in head.official_state_dict().items()}, str(out / "model.safetensors"))
    return out


def _newer_manifest(folder):
    m = json.loads((folder / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps({**m, "format_version": 99}))


X = torch.randn(4, 16)
EXPERTS = torch.randn(8, 3 * 8 * 16)
IDS = torch.zeros(4, 2, dtype=torch.int32)
W = torch.ones(4, 2)
SPEC = RouterSpec("softmax", 2, True)

OPS_CASES = [  # (name, call, exception type, message fragment)
    ("route: 1-d logits", lambda: route_experts(torch.randn(8), SPEC), ValueError, "router_logits"),
    ("route: NaN logits", lambda: route_experts(torch.full((2, 8), float("nan")), SPEC), ValueError, "non-finite"),
    ("route: inf logits", lambda: route_experts(torch.full((2, 8), float("inf")), SPEC), ValueError, "non-finite"),
    ("route: top_k > N", lambda: route_experts(torch.randn(2, 4), RouterSpec("softmax", 5)), ValueError, "top_k"),
    ("route: budget below top-k", lambda: route_experts(torch.randn(2, 8), SPEC, ExpertBudget(1)), ValueError,
     "top_k"),
    ("route: int logits", lambda: route_experts(torch.zeros(2, 8, dtype=torch.int32), SPEC), ValueError, "dtype"),
    ("budget: zero experts", lambda: ExpertBudget(0), ValueError, "max_experts"),
    ("budget: unknown policy", lambda: ExpertBudget(4, "drop"), ValueError, "policy"),
    ("router: unknown family", lambda: RouterSpec("sparsemixer", 2), ValueError, "family"),
    ("moe: ids out of range", lambda: moe_experts(X, torch.full((4, 2), 9, dtype=torch.int32), W, EXPERTS, 8),
     ValueError, "id"),
    ("moe: experts' rows are not 3 I H", lambda: moe_experts(X, IDS, W, torch.randn(8, 3 * 8 * 16 - 1), 8), ValueError,
     "intermediate_size"),
    ("moe: x and experts disagree on dtype", lambda: moe_experts(X.bfloat16(), IDS, W, EXPERTS, 8), ValueError,
     "dtype"),
    ("moe: weights of another shape", lambda: moe_experts(X, IDS, torch.ones(4, 3), EXPERTS, 8), ValueError,
     "weights"),
    ("moe: unknown activation", lambda: moe_experts(X, IDS, W, EXPERTS, 8, activation="gelu"), ValueError,
     "activation"),
]


@pytest.mark.parametrize("name,call,kind,fragment", OPS_CASES, ids=[c[0] for c in OPS_CASES])
def test_ops_refuse_bad_input_by_name(name, call, kind, fragment):
    with pytest.raises(kind, match=fragment):
        call()


def test_models_llm_and_engines_refuse_bad_input(folder, engine, drafted, tmp_path, monkeypatch):
    cases = [
        ("load: no such folder", lambda: load(tmp_path / "none", "fp32"), ValueError, "does not exist"),
        ("load: unknown dtype", lambda: load(folder, "int8"), ValueError, "dtype"),
        ("load: unknown device", lambda: load(folder, "fp32", device="tpu"), ValueError, "tpu"),
        ("load: a tap that does not exist", lambda: load(folder, "fp32", taps=(7,)), ValueError, "taps"),
        ("llm: empty prompt", lambda: LLM(folder, dtype="fp32").generate([[]]), ValueError, "at least one token"),
        ("llm: token outside the vocabulary", lambda: LLM(folder, dtype="fp32").generate([[1, 500]]), ValueError,
         "vocabulary"),
        ("llm: text without a tokenizer", lambda: LLM(folder, dtype="fp32").generate(["hi"]), ValueError,
         "no tokenizer"),
        ("llm: max_tokens beyond positions", lambda: LLM(folder, dtype="fp32").generate(
            [[1, 2]], SamplingParams(max_tokens=10**6)), ValueError, "max_position_embeddings"),
        ("llm: prompts and params disagree", lambda: LLM(folder, dtype="fp32").generate(
            [[1], [2]], [SamplingParams()] * 3), ValueError, "sampling params"),
        ("llm: unknown policy", lambda: SpeculativeConfig("medusa"), ValueError, "policy"),
        ("llm: budget without a budgeted policy", lambda: SpeculativeConfig("eagle3", budget=4), ValueError,
         "budget"),
        ("llm: eagle3 without a head", lambda: LLM(folder, dtype="fp32", speculative_config=SpeculativeConfig(
            "eagle3")), ValueError, "draft"),
        ("engine: truncated weights", lambda: load(_tamper(engine, tmp_path / "a", _truncate_weights)),
         ValueError, "weights"),
        ("engine: foreign manifest", lambda: load(_tamper(engine, tmp_path / "b", _foreign_manifest)),
         ValueError, "format"),
        ("engine: newer format version", lambda: load(_tamper(engine, tmp_path / "c", _newer_manifest)),
         ValueError, "version"),
        ("engine: weights of the right size and another checksum", lambda: load_engine(
            _tamper(engine, tmp_path / "d", _flip_a_weight_byte), verify=True), ValueError, "sha256"),
        ("engine: a tampered draft head file", lambda: load_engine(
            _tamper(drafted, tmp_path / "e", _flip_a_draft_byte), verify=True), ValueError, "draft file"),
        ("llm: a draft head for another target", lambda: LLM(folder, dtype="fp32", draft=_head_of_another_target(
            folder, tmp_path / "other_head")), ValueError, "target_hidden_size"),
        ("engine: build over its own source", lambda: __import__("moespec.engine", fromlist=["build_engine"])
         .build_engine(folder, folder, progress=False), ValueError, "would replace the source"),
    ]
    for name, call, kind, fragment in cases:
        try:
            call()
        except kind as exc:
            assert fragment in str(exc), f"{name}: {exc}"
        else:
            pytest.fail(f"{name}: no {kind.__name__}")
    monkeypatch.setenv("MOESPEC_MAX_MEMORY", "1K")  # a KV cache above the memory limit, before allocating
    with pytest.raises(ValueError, match="MOESPEC_MAX_MEMORY"):
        LLM(folder, dtype="fp32").generate([[1, 2]], SamplingParams(max_tokens=8))
    monkeypatch.setenv("MOESPEC_MAX_MEMORY", "lots")
    with pytest.raises(ValueError, match="MOESPEC_MAX_MEMORY='lots'"):
        LLM(folder, dtype="fp32").generate([[1, 2]], SamplingParams(max_tokens=8))


@pytest.mark.parametrize("argv,fragment", [
    (["generate", "--model", "{folder}", "--prompt-ids", "1,x"], "--prompt-ids"),
    (["generate", "--model", "{folder}", "--prompt-ids", "1,2", "--max-tokens", "1000000"], "max_position_embeddings"),
    (["generate", "--model", "{missing}", "--prompt-ids", "1"], "does not exist"),
    (["generate", "--model", "{folder}"], "--prompt"),
    (["generate", "--model", "{folder}", "--prompt-ids", "1", "--policy", "eagle3+budget", "--budget", "1"],
     "budget"),
    (["build", "--model", "{missing}", "--out", "{out}"], "no such file"),
    (["bench", "throughput", "--engine", "{missing}", "--dataset", "{missing}"], "does not exist"),
    (["analyze", "trace", "--engine", "{missing}", "--dataset", "{missing}", "--out", "{out}"], "does not exist"),
    (["prepare-dataset", "--out", "{out}", "mix", "--split", "held", "--num-requests", "0"], "--num-requests"),
    (["train-draft", "--target", "{missing}", "--corpus", "{missing}", "--out", "{out}"], "does not exist"),
], ids=["bad ids", "max_tokens", "missing model", "no prompt", "budget below top-k", "build: missing model",
        "bench: missing engine", "analyze: missing engine", "prepare-dataset: no requests", "train-draft: missing target"])
def test_cli_user_errors_are_one_line_and_exit_2(folder, tmp_path, argv, fragment):
    argv = [a.format(folder=folder, missing=tmp_path / "missing", out=tmp_path / "out") for a in argv]
    run = subprocess.run([sys.executable, "-m", "moespec", *argv], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "MOESPEC_NUM_THREADS": "1"})
    assert run.returncode == 2, run.stderr
    assert fragment in run.stderr and "Traceback" not in run.stderr, run.stderr
