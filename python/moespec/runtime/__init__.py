"""The runtime under :class:`moespec.models.TargetModel`: backends (native decoder step, torch
reference) chosen once per model, and the native backend's step state. See
:mod:`moespec.runtime.backend`."""

from moespec.runtime.backend import BACKENDS, NATIVE_MAX_TOKENS, ForwardOutput, NativeBackend, ReferenceBackend, make_backend

__all__ = ["BACKENDS", "NATIVE_MAX_TOKENS", "ForwardOutput", "NativeBackend", "ReferenceBackend", "make_backend"]
