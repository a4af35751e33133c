"""moespec.ops.linear (native kernel, cpp/src/linear.cc) against torch.nn.functional.linear, on every
ISA the machine has, and its fallbacks.

Error bounds, relative to the output's scale (max |reference|): fp32 1e-5 (other summation
orders); bf16 8e-3 (both sides sum in fp32 from the same bf16 inputs and round once: the results
may land one bf16 rounding step apart). Hypothesis draws T, K, N off the SIMD widths, bias or not.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings

from moespec._loader import native
from moespec._tensor import view
from moespec.ops import linear, linear_op
from moespec.ops.linear import NATIVE_MAX_ROWS

TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3}


@st.composite
def cases(draw):
    T = draw(st.sampled_from([1, 2, 3, 5, 16, 17, 33, 64]))
    K = draw(st.sampled_from([1, 7, 32, 65, 130]))
    N = draw(st.sampled_from([1, 5, 16, 99, 257]))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    bias = draw(st.sampled_from([None, "same", "fp32"]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    x = torch.randn(T, K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(dtype)
    b = None if bias is None else torch.randn(N, generator=g).to(dtype if bias == "same" else torch.float32)
    return x, w, b


def _check(got, x, w, b):
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    scale = want.abs().max().item()
    err = (got.float() - want).abs().max().item()
    assert got.dtype == x.dtype and got.shape == want.shape
    assert err <= TOL[x.dtype] * scale + 1e-30, f"max |d| = {err:.3g}, scale {scale:.3g}"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_native_linear_matches_torch_on_every_isa(case):
    x, w, b = case
    saved = native().cpu_isa()
    try:
        for isa in native().supported_cpu_isas():
            native().set_cpu_isa(isa)
            _check(linear(x, w, b), x, w, b)
    finally:
        native().set_cpu_isa(saved)


def test_a_row_alone_equals_the_row_in_a_batch():
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(33, 200, generator=g).bfloat16(), torch.randn(301, 200, generator=g).bfloat16()
    batch = linear(x, w)
    for t in (0, 17, 32):
        assert torch.equal(linear(x[t : t + 1], w)[0], batch[t])


def test_leading_dims_and_fallbacks():
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(2, 3, 40, generator=g), torch.randn(24, 40, generator=g)
    assert linear(x, w).shape == (2, 3, 24)
    _check(linear(x, w).reshape(6, 24), x.reshape(6, 40), w, None)
    big = torch.randn(NATIVE_MAX_ROWS + 1, 40, generator=g)  # torch's GEMM beyond the native sizes
    assert torch.equal(linear(big, w), F.linear(big, w))
    half = x.half()
    assert torch.equal(linear(half, w.half()), F.linear(half, w.half()))
    wp = torch.randn(40, 24, generator=g).t()  # a non-contiguous weight
    assert torch.equal(linear(x, wp), F.linear(x, wp))
    p = torch.nn.Parameter(w.clone())  # autograd: torch's op, so gradients flow
    linear(x, p).sum().backward()
    assert p.grad is not None


def test_cpu_kernel_false_is_torchs_op(monkeypatch):
    """The model forwards' projections (cpu_kernel=False) stay torch's op on the CPU: the reference
    forward the CPU tests hold every backend to. The native kernel is made to fail, so that taking it
    shows."""
    g = torch.Generator().manual_seed(6)
    x, w, b = torch.randn(3, 64, generator=g).bfloat16(), torch.randn(40, 64, generator=g).bfloat16(), None

    def fail(*args):
        raise AssertionError("the native kernel ran")

    monkeypatch.setattr(native(), "linear", fail)
    assert torch.equal(linear(x, w, b, cpu_kernel=False), F.linear(x, w, b))
    with pytest.raises(AssertionError, match="native kernel ran"):
        linear(x, w, b)


def test_the_cuda_switch_is_read_strictly(monkeypatch):
    from moespec.ops.linear import cuda_kernel_enabled

    assert cuda_kernel_enabled()
    monkeypatch.setenv("MOESPEC_CUDA_LINEAR", "0")
    assert not cuda_kernel_enabled()
    monkeypatch.setenv("MOESPEC_CUDA_LINEAR", "off")
    with pytest.raises(ValueError, match="MOESPEC_CUDA_LINEAR"):
        cuda_kernel_enabled()


def test_custom_op_passes_opcheck():
    g = torch.Generator().manual_seed(5)
    x, w, b = torch.randn(3, 16, generator=g), torch.randn(8, 16, generator=g), torch.randn(8, generator=g)
    torch.library.opcheck(linear_op, (x, w, b), test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("make, match", [
    (lambda: (torch.randn(2, 8), torch.randn(4, 8).bfloat16(), None), "x's dtype"),
    (lambda: (torch.randn(2, 8), torch.randn(4, 8), torch.randn(5)), "bias"),
])
def test_bad_input_raises_a_clear_error(make, match):
    x, w, b = make()
    out = torch.empty(2, 4)
    with pytest.raises(ValueError, match=match):
        native().linear(view(x, "x"), view(w, "weight"), view(b, "bias"), view(out, "out"))
