"""A dense projection at decode and verify sizes: ``linear`` (op ``moespec::linear``).

Native kernel: cpp/src/linear.cc (contract: cpp/include/moespec/linear.h): weights streamed once
for all tokens, fp32 accumulation, batch-invariant (a token's output does not depend on the other
tokens). Plain-torch reference: ``torch.nn.functional.linear``. Used by the EAGLE-3 head's forward;
the target's native step (cpp/src/decoder_step.cc) calls the same C++ function directly.

Dimensions: T tokens, K input features, N output features.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F

from moespec._loader import native
from moespec._tensor import view

# Rows of x above which torch's GEMM takes over (compute-bound there) for fp32, and for bf16 where
# the CPU has bf16 dot products; without them torch's bf16 GEMM is ~50x slower, so bf16 stays native.
NATIVE_MAX_ROWS = 64


def _linear_impl(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], weight.shape[0], dtype=x.dtype)
    native().linear(view(x2, "x"), view(weight, "weight"), view(bias, "bias"), view(out, "out"))
    return out.view(*x.shape[:-1], weight.shape[0])


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


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x @ weight.T + bias`` with the native kernel where it is the fast path, else torch's.

    Parameters
    ----------
    x : Tensor [..., K], float32 | bfloat16
    weight : Tensor [N, K], x's dtype, contiguous
    bias : Tensor [N], optional

    Returns
    -------
    Tensor [..., N] in x's dtype. The native kernel runs when every tensor is on the CPU, the dtype
    is float32 or bfloat16, ``weight`` is contiguous and x has at most ``NATIVE_MAX_ROWS`` rows (any
    number for bf16 on a CPU without bf16 dot products); otherwise this is
    ``torch.nn.functional.linear`` (same values within the kernel's tolerance).

    Examples
    --------
    >>> import torch, moespec
    >>> x, w = torch.randn(3, 8), torch.randn(5, 8)
    >>> torch.allclose(moespec.ops.linear(x, w), x @ w.T, atol=1e-5)
    True
    """
    rows = x.numel() // max(x.shape[-1], 1)
    if (x.device.type != "cpu" or weight.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16)
            or weight.dtype != x.dtype or not weight.is_contiguous() or rows == 0
            or rows > NATIVE_MAX_ROWS and (x.dtype == torch.float32 or cpu_bf16_is_fast())
            or (bias is not None and (bias.device.type != "cpu" or bias.dtype not in (x.dtype, torch.float32)))
            or torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        return F.linear(x, weight, bias)
    impl = linear_op if torch.compiler.is_compiling() else _linear_impl
    return impl(x, weight, bias)
