"""Zero-copy tensor descriptors for the native module.

A torch tensor crosses into C++ as ``(data_ptr, dtype_code, shape, strides, device_type,
device_index)``; the C++ side wraps it in a ``moespec::TensorView`` (cpp/include/moespec/tensor_view.h)
without copying. The caller keeps the tensor alive for the duration of the call.
"""

from __future__ import annotations

import torch

# Codes of moespec::DType.
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 0,
    torch.bfloat16: 1,
    torch.float16: 2,
    torch.int32: 3,
    torch.int64: 4,
    torch.uint8: 5,
    torch.float64: 6,
}


def view(t: torch.Tensor | None, name: str):
    """Descriptor of ``t`` for the native module (None stays None)."""
    if t is None:
        return None
    try:
        code = DTYPE_CODES[t.dtype]
    except (KeyError, AttributeError):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}") from None
        allowed = ", ".join(str(d).removeprefix("torch.") for d in DTYPE_CODES)
        raise ValueError(f"{name}: dtype {t.dtype} is not supported by moespec kernels (supported: {allowed})") from None
    if t.is_cuda:
        return (t.data_ptr(), code, t.shape, t.stride(), 1, t.get_device())
    if not t.is_cpu:
        raise ValueError(f"{name}: tensors on {t.device.type} are not supported (cpu or cuda)")
    return (t.data_ptr(), code, t.shape, t.stride(), 0, 0)


def to_device(data, device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``data`` (host values: a list, or a CPU tensor) as a tensor on ``device``, without a stream
    synchronisation: a blocking copy to a GPU (``torch.tensor(..., device=...)``, ``.to(device)``)
    waits for the stream to drain, so on CUDA the values go through pinned memory and a
    non-blocking copy (a truly asynchronous DMA; torch's pinned-memory cache keeps the block until
    the copy is done). On other devices: a plain conversion."""
    t = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return _pinned(t).to(device, non_blocking=True)


def _pinned(t: torch.Tensor) -> torch.Tensor:
    """A pinned copy of host tensor ``t`` for an asynchronous DMA (a caller's tensor that is pinned
    already is copied too: the caller may write it again before the DMA has read it)."""
    return (t.clone() if t.is_pinned() else t).pin_memory()


def copy_from_host(dest: torch.Tensor, data) -> torch.Tensor:
    """Writes ``data`` (host values: a list, or a CPU tensor of dest's shape) into ``dest`` in one copy
    and without a stream synchronisation: on CUDA one DMA straight from pinned memory into ``dest``
    (no device temporary, no device-to-device copy; torch's pinned-memory cache keeps the block until
    the DMA has read it), elsewhere a plain copy. Returns ``dest``."""
    t = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dest.dtype)
    if dest.device.type != "cuda" or t.device.type != "cpu":
        return dest.copy_(t)
    return dest.copy_(_pinned(t), non_blocking=True)
