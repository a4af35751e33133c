"""linear on CUDA (cpp/kernels/linear.cu) against a float64 product of the same bf16 inputs, and
moespec.ops.linear's choice between the kernel and torch's GEMM.

The kernel sums in fp32 in its own order and rounds once to bf16, so each element is within 1e-3
of the output scale plus one bf16 ulp of the value of the float64 product. Beyond the values: every
element is written (the output is poisoned with NaN first), a token's row does not depend on the
other tokens of the call (batch invariance: the same bits alone, in a call of 5 and of 40), two calls
and a replayed CUDA graph give the same bits, programmatic dependent launch changes nothing
(MOESPEC_PDL=0), both block widths (8 warps below 512 row tiles, 4 from there) and last tiles of
fewer than 16 rows are covered, and strided rows of x are read at their stride. Skipped without a
CUDA device or a CUDA build.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gpu_common import captured, require_cuda_build
from hypothesis import given, settings
from hypothesis import strategies as st

require_cuda_build()

from moespec._loader import native  # noqa: E402
from moespec._tensor import view  # noqa: E402
from moespec.ops.linear import NATIVE_MAX_ROWS, linear  # noqa: E402

CUDA = torch.device("cuda")


def inputs(T: int, K: int, N: int, bias: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=gen).to(torch.bfloat16)
    w = (torch.randn(N, K, generator=gen) / K**0.5).to(torch.bfloat16)
    b = None if bias == "none" else torch.randn(N, generator=gen).to(
        torch.bfloat16 if bias == "bf16" else torch.float32)
    return x, w, b


def kernel(x: torch.Tensor, w: torch.Tensor, b) -> torch.Tensor:
    """The native call itself, into an output poisoned with NaN (every element must be written)."""
    out = torch.full((x.shape[0], w.shape[0]), float("nan"), dtype=torch.bfloat16, device=CUDA)
    native().linear(view(x, "x"), view(w, "weight"), view(b, "bias"), view(out, "out"),
                    torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    return out


def assert_close_to_float64(got: torch.Tensor, x, w, b) -> None:
    want = x.double() @ w.double().T + (b.double() if b is not None else 0.0)
    got = got.double().cpu()
    assert not got.isnan().any(), "an element was not written"
    scale = float(want.abs().max())
    bound = 1e-3 * scale + want.abs() * 2.0**-7
    err = (got - want).abs()
    assert bool((err <= bound).all()), f"max error {float(err.max())} at scale {scale}"


@settings(max_examples=40, deadline=None)
@given(T=st.integers(1, 64), K=st.sampled_from([32, 96, 256, 2048]), N=st.integers(1, 300),
       bias=st.sampled_from(["none", "bf16", "fp32"]), seed=st.integers(0, 2**16))
def test_matches_a_float64_product(T, K, N, bias, seed):
    x, w, b = inputs(T, K, N, bias, seed)
    got = kernel(x.to(CUDA), w.to(CUDA), None if b is None else b.to(CUDA))
    assert_close_to_float64(got, x, w, b)


@pytest.mark.parametrize("K,N", [(2048, 5120), (4096, 2048), (2048, 128), (4096, 8), (2048, 32000), (64, 8200)])
def test_model_shapes_and_both_block_widths(K, N):
    """Qwen3-30B-A3B's q/k/v, o and router, Mixtral's router (one tile of 8 rows), a 32k lm_head and
    a grid just past the 8-warp bound (513 tiles, the last of 8 rows)."""
    for T in (1, 16, 64):
        x, w, b = inputs(T, K, N, "none", T + N)
        assert_close_to_float64(kernel(x.to(CUDA), w.to(CUDA), None), x, w, b)


def test_rows_do_not_depend_on_the_other_tokens():
    x, w, b = inputs(40, 2048, 1000, "fp32", 7)
    x, w, b = x.to(CUDA), w.to(CUDA), b.to(CUDA)
    full = kernel(x, w, b)
    assert torch.equal(kernel(x[:5], w, b), full[:5]), "5 tokens (one n-tile) against 40 (eight)"
    for t in (0, 4, 39):
        assert torch.equal(kernel(x[t:t + 1], w, b), full[t:t + 1]), f"token {t} alone"
    assert torch.equal(kernel(x, w, b), full), "a second call"


def test_strided_rows_and_programmatic_launch_off(monkeypatch):
    x, w, b = inputs(9, 512, 200, "bf16", 3)
    wide = torch.randn(9, 512 + 64).to(torch.bfloat16).to(CUDA)
    wide[:, :512] = x.to(CUDA)
    strided = wide[:, :512]  # row stride 576 elements
    got = kernel(strided, w.to(CUDA), b.to(CUDA))
    assert_close_to_float64(got, x, w, b)
    monkeypatch.setenv("MOESPEC_PDL", "0")
    assert torch.equal(kernel(strided, w.to(CUDA), b.to(CUDA)), got)


def test_graph_replay_equals_eager():
    x, w, b = inputs(16, 2048, 640, "none", 11)
    x, w = x.to(CUDA), w.to(CUDA)
    eager = linear(x, w)
    static_x = x.clone()
    graph, out = captured(lambda: linear(static_x, w))
    static_x.copy_(x * 2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, linear(x * 2, w))
    static_x.copy_(x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def test_the_op_takes_torchs_gemm_where_the_kernel_does_not_fit(monkeypatch):
    """More than NATIVE_MAX_ROWS rows, fp32, K not a multiple of 32, a misaligned x and
    MOESPEC_CUDA_LINEAR=0 give torch's own bits; the kernel's rows are batch-invariant, torch's
    need not be, which is how the two are told apart below."""
    gen = torch.Generator().manual_seed(5)
    w = (torch.randn(256, 2048, generator=gen) / 45).to(torch.bfloat16).to(CUDA)
    x = torch.randn(NATIVE_MAX_ROWS + 1, 2048, generator=gen).to(torch.bfloat16).to(CUDA)
    assert torch.equal(linear(x, w), F.linear(x, w)), "65 rows: torch's GEMM"
    assert torch.equal(linear(x.float(), w.float()), F.linear(x.float(), w.float())), "fp32: torch's GEMM"
    x48, w48 = x[:, :48].contiguous(), w[:, :48].contiguous()
    assert torch.equal(linear(x48, w48), F.linear(x48, w48)), "K = 48: torch's GEMM"
    flat = torch.randn(1 + 4 * 2048, generator=gen).to(torch.bfloat16).to(CUDA)
    odd = flat[1:].view(4, 2048)  # 2 bytes past a 16-byte boundary
    assert torch.equal(linear(odd, w), F.linear(odd, w)), "misaligned x: torch's GEMM"
    small = x[:4]
    assert torch.equal(linear(small, w), kernel(small, w, None)), "4 rows: the kernel"
    monkeypatch.setenv("MOESPEC_CUDA_LINEAR", "0")
    assert torch.equal(linear(small, w), F.linear(small, w)), "MOESPEC_CUDA_LINEAR=0: torch's GEMM"
    monkeypatch.setenv("MOESPEC_CUDA_LINEAR", "yes")
    with pytest.raises(ValueError, match="MOESPEC_CUDA_LINEAR"):
        linear(small, w)
