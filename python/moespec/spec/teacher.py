"""The target's side of head training: what a training step needs from the target for its windows.

A step of :func:`moespec.spec.train.train_draft` needs, for each of its B windows of T tokens, the
target's tap features and its next-token distribution. Computing them (a B x T prefill of the
target) is most of a step's time on a CPU (default engine, 8 x 256 tokens: ~9 s of ~12), and a run
of several epochs computes the same windows again and again. :class:`TeacherCache` computes every
window once and keeps what the loss reads on disk: the features and the logits restricted to the
draft vocabulary in the target's own dtype (bf16 or fp32: the bits the prefill returned, so the
loss is the one the step would compute), and the target's argmax over the whole vocabulary. The
native step is batch-invariant (a token's outputs do not depend on the other tokens of its call),
so a cached run trains the same head as an uncached one, bit for bit; the torch reference is not
guaranteed to be.

Layout of a cache folder: ``features.bin`` [W, T, F], ``logits.bin`` [W, T, Vd] (raw, the target's
dtype), ``argmax.bin`` int32 [W, T] and ``manifest.json`` (its key, shapes, and how many windows are
done: an interrupted build continues where it stopped). Dimensions: W windows, T tokens a window,
F = 3 H feature width, V / Vd target / draft vocabulary.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from tqdm import tqdm

from moespec.bench.report import write_json_atomic

MANIFEST = "manifest.json"
FILES = ("features.bin", "logits.bin", "argmax.bin")
FORMAT = 1
_STORAGE = {torch.bfloat16: (np.int16, 2), torch.float32: (np.float32, 4)}  # raw bits on disk
SPARE_BYTES = 1 << 30  # free disk a cache leaves


class NoRoomError(ValueError):
    """The disk lacks the room a cache needs (raised before anything is written)."""


@dataclass
class TeacherBatch:
    """The target's outputs on a batch of windows: what the training-time-test loss reads."""

    features: torch.Tensor  # float32 [B, T, F]: the taps' hidden states, concatenated
    logits: torch.Tensor  # float32 [B, T, Vd]: row p's logits (the distribution of token p + 1), draft vocabulary
    argmax: torch.Tensor  # int64 [B, T]: row p's argmax over the whole vocabulary


def run_teacher(target, cache, tokens: torch.Tensor, t2d: torch.Tensor, *, raw: bool = False):
    """The target's outputs on ``tokens`` [B, T] (one prefill into the reset ``cache``, taps already
    set): a :class:`TeacherBatch`, or with ``raw`` the (features, logits, argmax) in the target's dtype."""
    cache.reset()
    out = target.prefill(cache, tokens, logits="all")
    features = torch.cat(out.hidden, dim=-1)  # [B, T, F]
    logits = out.logits[..., t2d]  # [B, T, Vd] (t2d: bool [V], draft ids ascending with target ids)
    argmax = out.logits.float().argmax(dim=-1)  # [B, T]
    if raw:
        return features, logits, argmax
    return TeacherBatch(features.float().clone(), logits.float().clone(), argmax.clone())  # out of inference mode


class TeacherCache:
    """Every window's teacher outputs, computed once (:meth:`open`) and read per step (:meth:`batch`)."""

    def __init__(self, folder: Path, manifest: dict):
        self.folder = folder
        self.manifest = manifest
        W, T, F, Vd = (manifest[k] for k in ("windows", "seq_len", "features", "draft_vocab"))
        dtype = getattr(torch, manifest["dtype"])
        storage = _STORAGE[dtype][0]
        mode = "r+" if manifest["done"] < W else "r"
        self._dtype = dtype
        self._features = np.memmap(folder / FILES[0], dtype=storage, mode=mode, shape=(W, T, F))
        self._logits = np.memmap(folder / FILES[1], dtype=storage, mode=mode, shape=(W, T, Vd))
        self._argmax = np.memmap(folder / FILES[2], dtype=np.int32, mode=mode, shape=(W, T))

    @staticmethod
    def key(identity: dict, t2d: torch.Tensor) -> str:
        """A digest of what the outputs depend on: ``identity`` (target, corpus, dtype, taps, ...) and
        the draft vocabulary."""
        h = hashlib.sha256(json.dumps(identity, sort_keys=True).encode())
        h.update(t2d.to(torch.uint8).numpy().tobytes())
        return h.hexdigest()[:16]

    @staticmethod
    def size_bytes(windows: int, seq_len: int, features: int, draft_vocab: int, dtype: torch.dtype) -> int:
        return windows * seq_len * ((features + draft_vocab) * _STORAGE[dtype][1] + 4)

    @classmethod
    def open(cls, folder: Path, *, target, cache, windows: torch.Tensor, t2d: torch.Tensor, identity: dict,
             progress: bool = True) -> "TeacherCache":
        """The cache in ``folder`` for these ``windows`` (long [W, T]), built or completed here (prefills
        of ``cache.batch`` windows into ``cache``, with a progress bar) unless a finished one with the same
        key is there. ValueError when the disk lacks the room (the size is known before anything is
        written)."""
        W, T = windows.shape
        dtype = target.dtype
        if dtype not in _STORAGE:
            raise ValueError(f"teacher cache: the target's dtype {dtype} is not one it stores (bf16, fp32)")
        F = len(target.taps) * target.config.hidden_size
        Vd = int(t2d.sum())
        manifest = {"format": FORMAT, "key": cls.key(identity, t2d), "windows": int(W), "seq_len": int(T),
                    "features": F, "draft_vocab": Vd, "dtype": str(dtype).removeprefix("torch."), "done": 0}
        old = _read_manifest(folder)
        if old is not None and all(old.get(k) == v for k, v in manifest.items() if k != "done"):
            manifest["done"] = int(old["done"])
        else:
            need = cls.size_bytes(W, T, F, Vd, dtype)
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(folder).free
            if need + SPARE_BYTES > free:
                shutil.rmtree(folder, ignore_errors=True)
                raise NoRoomError(f"teacher cache: {W} windows of {T} tokens need {need / 2**30:.1f} GiB in {folder}, "
                                 f"{free / 2**30:.1f} GiB are free; pass teacher_cache=False (--no-teacher-cache)")
            for name, width in zip(FILES, (F * _STORAGE[dtype][1], Vd * _STORAGE[dtype][1], 4)):
                with open(folder / name, "wb") as f:
                    f.truncate(W * T * width)  # sparse until written
            write_json_atomic(folder / MANIFEST, manifest)
        self = cls(folder, manifest)
        if manifest["done"] < W:
            self._fill(target, cache, windows, t2d, progress)
        return self

    def _fill(self, target, cache, windows: torch.Tensor, t2d: torch.Tensor, progress: bool) -> None:
        W = windows.shape[0]
        bar = tqdm(total=W, initial=self.manifest["done"], desc="teacher", unit="window", disable=not progress,
                   dynamic_ncols=True)
        with torch.inference_mode():
            for w0 in range(self.manifest["done"], W, cache.batch):
                w1 = min(w0 + cache.batch, W)
                rows = torch.arange(w0, w0 + cache.batch).clamp(max=w1 - 1)  # the last batch repeats its last window
                features, logits, argmax = (x[: w1 - w0] for x in run_teacher(target, cache, windows[rows], t2d, raw=True))
                self._features[w0:w1] = _raw(features)
                self._logits[w0:w1] = _raw(logits)
                self._argmax[w0:w1] = argmax.to(torch.int32).numpy()
                for m in (self._features, self._logits, self._argmax):
                    m.flush()
                self.manifest["done"] = w1
                write_json_atomic(self.folder / MANIFEST, self.manifest)  # after the data: a crash loses one batch
                bar.update(w1 - w0)
        bar.close()

    def batch(self, index: torch.Tensor) -> TeacherBatch:
        """The outputs of windows ``index`` (long [B])."""
        i = index.numpy()
        features, logits = (torch.from_numpy(np.ascontiguousarray(m[i])).view(self._dtype).float()
                            for m in (self._features, self._logits))  # (bf16's bits are stored as int16)
        return TeacherBatch(features, logits, torch.from_numpy(self._argmax[i].astype(np.int64)))

    def remove(self) -> None:
        self._features = self._logits = self._argmax = None  # (unmaps them)
        shutil.rmtree(self.folder, ignore_errors=True)


def _raw(x: torch.Tensor) -> np.ndarray:
    """The bits of ``x`` as numpy stores them (bf16 as int16)."""
    return (x.view(torch.int16) if x.dtype == torch.bfloat16 else x).contiguous().numpy()


def _read_manifest(folder: Path) -> Optional[dict]:
    try:
        m = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        return None
    if not all((folder / f).is_file() for f in FILES):
        return None
    return m
