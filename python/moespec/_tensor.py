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
}


def view(t: torch.Tensor | None, name: str):
    """Descriptor of ``t`` for the native module (None stays None)."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    code = DTYPE_CODES.get(t.dtype)
    if code is None:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in DTYPE_CODES)
        raise ValueError(f"{name}: dtype {t.dtype} is not supported by moespec kernels (supported: {allowed})")
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}: tensors on {t.device.type} are not supported (cpu or cuda)")
    is_cuda = t.device.type == "cuda"
    return (t.data_ptr(), code, tuple(t.shape), t.stride(), 1 if is_cuda else 0, t.device.index or 0 if is_cuda else 0)
