"""moespec.spec.teacher: the target's outputs on every training window, computed once.

Against an independent reference, the per-step prefill of :func:`train_draft` (the uncached path):

- a cached batch equals the target's prefill on the same windows, bit for bit, for the native step
  in bf16 and fp32 (batch-invariant) — any windows, any batch composition;
- a head trained with the cache equals one trained without it, bit for bit (native target), and the
  cache is gone when the run ends;
- an interrupted build continues from its manifest (the windows after it are computed again, the
  ones before are not), another corpus or dtype rebuilds, and a disk without room is refused by name
  before anything is written.

Tiny random Qwen3-MoE target written by transformers (models_fixtures).
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings, strategies as st

import moespec.models as mm
import moespec.spec.teacher as teacher_mod
from moespec.spec.eagle3 import default_aux_layers
from moespec.spec.teacher import MANIFEST, TeacherCache, run_teacher
from moespec.spec.train import TEACHER_CACHE, train_draft

from models_fixtures import V, write_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

W, T = 12, 16


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("teacher")
    path = write_checkpoint("qwen3_moe", root / "target")
    windows = torch.randint(0, V, (W, T), generator=torch.Generator().manual_seed(0))
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[torch.randperm(V, generator=torch.Generator().manual_seed(1))[: V // 2]] = True
    return dict(root=root, path=path, windows=windows, t2d=t2d)


def _target(path, dtype):
    target = mm.load(path, dtype)  # the native step (the default backend on the CPU)
    target.set_taps(default_aux_layers(target.config.num_layers))
    return target


def _open(setup, target, folder, identity=None, batch_size=5):
    return TeacherCache.open(folder, target=target, cache=target.new_cache(batch_size, T), windows=setup["windows"],
                             t2d=setup["t2d"], identity=identity or {"corpus": "a"}, progress=False)


@pytest.fixture(scope="module", params=["bf16", "fp32"])
def built(setup, request):
    target = _target(setup["path"], request.param)
    return target, _open(setup, target, setup["root"] / f"cache-{request.param}")


@settings(max_examples=12, deadline=None)
@given(index=st.lists(st.integers(0, W - 1), min_size=1, max_size=4))
def test_a_cached_batch_is_the_prefill_of_its_windows(setup, built, index):
    target, store = built
    index = torch.tensor(index)
    got = store.batch(index)
    with torch.inference_mode():
        want = run_teacher(target, target.new_cache(len(index), T), setup["windows"][index], setup["t2d"])
    full = target.prefill(target.new_cache(len(index), T), setup["windows"][index], logits="all").logits.float()
    assert torch.equal(got.features, want.features)
    assert torch.equal(got.logits, want.logits) and got.logits.shape[-1] == int(setup["t2d"].sum())
    assert torch.equal(got.argmax, want.argmax) and torch.equal(got.argmax, full.argmax(-1))
    assert torch.equal(want.logits, full[..., setup["t2d"]])  # the draft vocabulary's columns, in id order


def test_an_interrupted_build_continues_and_another_key_rebuilds(setup, built, tmp_path):
    target, store = built
    folder = tmp_path / "cache"
    calls = []
    real = teacher_mod.run_teacher

    def counting(target, cache, tokens, t2d, raw=False):
        calls.append(tokens.shape[0])
        return real(target, cache, tokens, t2d, raw=raw)

    teacher_mod.run_teacher = counting
    try:
        _open(setup, target, folder)
        assert len(calls) == 3  # batches of 5, 5 and 2 windows
        manifest = json.loads((folder / MANIFEST).read_text())
        manifest["done"] = 5  # as if stopped after the first batch: what follows is garbage
        (folder / MANIFEST).write_text(json.dumps(manifest))
        with open(folder / "argmax.bin", "r+b") as f:
            f.seek(5 * T * 4)
            f.write(b"\xff" * ((W - 5) * T * 4))
        calls.clear()
        again = _open(setup, target, folder)
        assert len(calls) == 2  # only the windows after the manifest's: 5-9, 10-11
        everything = torch.arange(W)
        assert torch.equal(again.batch(everything).argmax, store.batch(everything).argmax)
        calls.clear()
        _open(setup, target, folder)
        assert calls == []  # finished, same key: nothing computed
        _open(setup, target, folder, identity={"corpus": "b"})
        assert len(calls) == 3  # another corpus: built anew
    finally:
        teacher_mod.run_teacher = real


def test_no_room_on_disk_is_refused_before_writing(setup, monkeypatch, tmp_path):
    target = _target(setup["path"], "bf16")
    monkeypatch.setattr(teacher_mod.shutil, "disk_usage", lambda _: type("u", (), {"free": 1 << 20})())
    with pytest.raises(ValueError, match=r"teacher cache: 12 windows of 16 tokens need .* GiB .* free"):
        _open(setup, target, tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def test_a_head_trained_from_the_cache_is_the_head_trained_without_it(setup, tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    with open(corpus, "w") as f:
        for row in setup["windows"].tolist():
            f.write(json.dumps({"input_ids": row}) + "\n")
    args = dict(steps=6, ttt_steps=2, draft_vocab_size=48, lr=3e-3, batch_size=4, seq_len=T, seed=0, progress=False,
                dtype="bf16")  # 6 x 4 windows of 12: each visited twice
    seen = []
    real = TeacherCache.batch

    def spy(self, index):
        seen.append(self.folder.is_dir())
        return real(self, index)

    TeacherCache.batch = spy
    try:
        cached = train_draft(setup["path"], [corpus], tmp_path / "cached", teacher_cache=None, **args)  # auto: on
    finally:
        TeacherCache.batch = real
    plain = train_draft(setup["path"], [corpus], tmp_path / "plain", teacher_cache=False, **args)
    assert seen == [True] * 6 and not (tmp_path / "cached" / TEACHER_CACHE).exists()
    assert cached.losses == plain.losses and cached.accuracy == plain.accuracy
    a = torch.load(tmp_path / "cached" / "checkpoint.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "plain" / "checkpoint.pt", weights_only=True)["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_without_room_the_default_trains_uncached_and_an_explicit_cache_is_refused(setup, monkeypatch, tmp_path,
                                                                                   capsys):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"input_ids": setup["windows"].reshape(-1).tolist()}) + "\n")
    monkeypatch.setattr(teacher_mod.shutil, "disk_usage", lambda _: type("u", (), {"free": 1 << 20})())
    args = dict(steps=4, ttt_steps=2, draft_vocab_size=48, batch_size=4, seq_len=T, progress=False, dtype="bf16")
    result = train_draft(setup["path"], [corpus], tmp_path / "auto", **args)  # 16 windows of 12: auto is on
    assert result.step == 4 and not (tmp_path / "auto" / TEACHER_CACHE).exists()
    assert "running without it (a prefill per step)" in capsys.readouterr().err
    with pytest.raises(ValueError, match="teacher cache: 12 windows"):
        train_draft(setup["path"], [corpus], tmp_path / "asked", teacher_cache=True, **args)
