"""The one cached loader of the native module ``moespec._native``."""

from __future__ import annotations

import functools
from types import ModuleType


@functools.cache
def native() -> ModuleType:
    """Returns ``moespec._native``; raises ImportError saying how to build it when it is missing."""
    try:
        from moespec import _native
    except ImportError as exc:  # pragma: no cover - exercised only on a broken install
        raise ImportError(
            "moespec's native module moespec._native is not built or does not load "
            f"({exc}). Run ./build.sh in the repository (or `pip install .`) to build it."
        ) from exc
    return _native


def require_cuda() -> None:
    """Raises RuntimeError naming the build option when the native module has no CUDA kernels."""
    if not native().cuda_available():
        raise RuntimeError(
            "moespec was built without CUDA kernels: rebuild with -DMOESPEC_CUDA=ON "
            "(./build.sh does so when nvcc is on PATH) to run on GPU tensors"
        )
