"""Guards for vLLM bugs that the plugin's own use of vLLM runs into; each applied by :func:`register`
in every vLLM process, and each a no-op where the vLLM in use does not have the code it guards.

- vLLM's CPU oneDNN GEMM handler (``vllm._custom_ops.CPUDNNLGEMMHandler``, vLLM 0.32) frees its
  native handle in ``__del__`` with ``Tensor.item()`` and a custom op. When the cyclic garbage
  collector finds a dropped handler while torch.compile traces a model (vLLM's compile warm-up), the
  finaliser runs inside the trace: in a fake-tensor kernel (every tensor dispatched as Meta, through
  the Python dispatcher) ``item()`` fails, and formatting the failure calls ``item()`` again, until the
  worker dies of a stack overflow ("Cannot recover from stack overflow"; the engine fails to start),
  at random, as the collector runs (2 of 10 compiled EAGLE-3 starts of tests/vllm on vLLM's CPU
  build, 2026-12-04). The guard postpones a finaliser that meets a trace to the next one that runs
  outside any (or to the interpreter's exit), so nothing of it runs under the tracing state.
"""

from __future__ import annotations

import atexit

import torch

_POSTPONED: list[tuple[object, object]] = []  # (finaliser, object) met inside a trace, not yet run


def tracing() -> bool:
    """Whether torch's dispatch is in a tracing state on this thread: a dispatch or function mode
    active, the Python dispatcher on, or tensors dispatched as Meta (inside a fake-tensor kernel)."""
    C = torch._C
    return bool(C._meta_in_tls_dispatch_include() or C._len_torch_dispatch_stack() > 0
                or C._is_torch_function_mode_enabled()
                or C._dispatch_tls_is_dispatch_key_included(C.DispatchKey.PythonDispatcher))


def run_postponed() -> None:
    """Runs the finalisers postponed by :func:`finalise_outside_tracing` (outside any trace)."""
    while _POSTPONED:
        fn, obj = _POSTPONED.pop()
        fn(obj)


atexit.register(run_postponed)


def finalise_outside_tracing(fn):
    """A ``__del__`` that never runs inside a trace: met there, the object is kept (a finaliser runs
    once: Python will not call it again) and ``fn`` runs for it at the next call outside one."""

    def guarded(obj):
        if tracing():
            _POSTPONED.append((fn, obj))
            return
        run_postponed()
        fn(obj)

    guarded._moespec = True
    guarded.__wrapped__ = fn
    return guarded


def guard_onednn_handler_release() -> None:
    """Applies the oneDNN handler guard (idempotent; nothing when the class or its ``__del__`` is absent)."""
    try:
        from vllm._custom_ops import CPUDNNLGEMMHandler
    except ImportError:
        return
    release = getattr(CPUDNNLGEMMHandler, "__del__", None)
    if release is not None and not getattr(release, "_moespec", False):
        CPUDNNLGEMMHandler.__del__ = finalise_outside_tracing(release)
