"""A dense projection at decode and verify sizes: ``linear`` (op ``moespec::linear``).

Native kernels (contract: cpp/include/moespec/linear.h): on the CPU cpp/src/linear.cc, on CUDA
cpp/kernels/linear.cu (bf16 on tensor cores, launched on the current stream, a programmatic
dependent of the kernel before it); both stream the weights once for all tokens, accumulate in fp32
and are batch-invariant (a token's output does not depend on the other tokens). Plain-torch
reference: ``torch.nn.functional.linear``. Used by the EAGLE-3 head's forward and, on CUDA, by every
projection of the target's forward; the target's native CPU step (cpp/src/decoder_step.cc) calls the
same C++ function directly. ``MOESPEC_CUDA_LINEAR=0`` takes torch's GEMM on CUDA (to compare).

Dimensions: T tokens, K input features, N output features.
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch
import torch.nn.functional as F

from moespec._loader import native
from moespec._tensor import view

# Rows of x above which torch's GEMM takes over (compute-bound there) for fp32, and for bf16 where
# the CPU has bf16 dot products; without them torch's bf16 GEMM is ~50x slower, so bf16 stays native.
NATIVE_MAX_ROWS = 64


def _linear_impl(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    x2 = _rows(x)
    out = torch.empty(x2.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    stream = torch.cuda.current_stream(x.device).cuda_stream if x.is_cuda else 0
    native().linear(view(x2, "x"), view(weight, "weight"), view(bias, "bias"), view(out, "out"), stream)
    return out.view(*x.shape[:-1], weight.shape[0])


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [T, K] with contiguous rows (a view where it can be)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


@torch.library.custom_op("moespec::linear", mutates_args=())
def linear_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """The torch custom op ``moespec::linear`` (see :func:`linear`)."""
    return _linear_impl(x, weight, bias)


@linear_op.register_fake
def _linear_fake(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@functools.cache
def cpu_bf16_is_fast() -> bool:
    """Whether torch's bf16 matrix products run at speed on this CPU (it has AVX512_BF16). Without
    it, oneDNN's bf16 GEMM is about 50x slower than its fp32 one (1.2 against 63 GFLOP/s a Zen 3
    core), so bf16 autocast for training only pays where this is True."""
    return bool(native().cpu_has_avx512_bf16())


def cuda_kernel_enabled() -> bool:
    """Whether projections on CUDA take moespec's kernel where it fits (MOESPEC_CUDA_LINEAR=0: torch's
    GEMM, to compare; anything else but unset or 1 is an error naming the variable)."""
    flag = os.environ.get("MOESPEC_CUDA_LINEAR", "1")
    if flag not in ("0", "1"):
        raise ValueError(f"MOESPEC_CUDA_LINEAR: expected '1' or '0', got {flag!r}")
    return flag == "1"


@functools.cache
def _cuda_kernel_runs_on(device: torch.device) -> bool:
    return bool(native().cuda_available()) and torch.cuda.get_device_capability(device)[0] >= 8


def _fits_cuda_kernel(x2: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> bool:
    """The CUDA kernel's conditions (cpp/include/moespec/linear.h) on x's rows x2 [T, K]: bf16, K a
    multiple of 32, 16-byte aligned rows, at most NATIVE_MAX_ROWS rows (more: torch's GEMM)."""
    T, K = x2.shape
    return (x2.dtype == torch.bfloat16 and weight.dtype == x2.dtype and weight.device == x2.device
            and weight.is_contiguous() and K % 32 == 0 and 0 < T <= NATIVE_MAX_ROWS
            and weight.data_ptr() % 16 == 0 and x2.data_ptr() % 16 == 0 and (T == 1 or x2.stride(0) % 8 == 0)
            and (bias is None or bias.device == x2.device and bias.dtype in (x2.dtype, torch.float32)
                 and bias.is_contiguous())
            and cuda_kernel_enabled() and _cuda_kernel_runs_on(x2.device))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
           cpu_kernel: bool = True) -> torch.Tensor:
    """``x @ weight.T + bias`` with the native kernel where it is the fast path, else torch's.

    Parameters
    ----------
    x : Tensor [..., K], float32 | bfloat16
    weight : Tensor [N, K], x's dtype, contiguous
    bias : Tensor [N], optional
    cpu_kernel : bool
        False: torch's linear on the CPU (the reference forward's own op, which the CPU tests hold
        other backends to); CUDA tensors still take the CUDA kernel.

    Returns
    -------
    Tensor [..., N] in x's dtype. The CPU kernel runs when every tensor is on the CPU, the dtype is
    float32 or bfloat16, ``weight`` is contiguous and x has at most ``NATIVE_MAX_ROWS`` rows (any
    number for bf16 on a CPU without bf16 dot products); the CUDA kernel when every tensor is on one
    GPU (sm_80+), bf16, K a multiple of 32, rows 16-byte aligned and at most ``NATIVE_MAX_ROWS``
    rows; otherwise this is ``torch.nn.functional.linear`` (same values within the kernels'
    tolerance). Not for autograd: with gradients on, torch's op runs.

    Examples
    --------
    >>> import torch, moespec
    >>> x, w = torch.randn(3, 8), torch.randn(5, 8)
    >>> torch.allclose(moespec.ops.linear(x, w), x @ w.T, atol=1e-5)
    True
    """
    rows = x.numel() // max(x.shape[-1], 1)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return F.linear(x, weight, bias)
    if x.device.type == "cuda":
        if not _fits_cuda_kernel(_rows(x), weight, bias):
            return F.linear(x, weight, bias)
    elif (not cpu_kernel or x.device.type != "cpu" or weight.device.type != "cpu"
            or x.dtype not in (torch.float32, torch.bfloat16)
            or weight.dtype != x.dtype or not weight.is_contiguous() or rows == 0
            or rows > NATIVE_MAX_ROWS and (x.dtype == torch.float32 or cpu_bf16_is_fast())
            or (bias is not None and (bias.device.type != "cpu" or bias.dtype not in (x.dtype, torch.float32)))):
        return F.linear(x, weight, bias)
    impl = linear_op if torch.compiler.is_compiling() else _linear_impl
    return impl(x, weight, bias)
