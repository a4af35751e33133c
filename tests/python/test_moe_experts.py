"""moe_experts (native CPU kernel) against the plain-torch reference, on every ISA the machine has.

Error bounds, relative to the output's scale (max |reference|):
- fp32 weights: 1e-5 (the kernel sums dot products in other orders than torch's GEMM);
- bf16 weights: 8e-3, two bf16 ulps (2^-8 each): both sides compute in fp32 from the same bf16
  inputs, but the AVX-512 BF16 instructions multiply bf16 pairs and sum them in their own order, so
  the bf16-rounded hidden activations and the bf16 output can land one rounding step apart.
Hypothesis draws T, H and I that are not multiples of the SIMD width, E, K, dropped slots, experts
with no tokens, zero weights, both activations, both dtypes.
"""

from __future__ import annotations

import os

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from moespec._loader import native
from moespec.ops import moe_experts, moe_experts_op, num_threads, scratch_bytes, set_num_threads, set_scratch_retain
from moespec.ops.moe import grouped_fits, moe_experts_grouped
from moespec.ops.reference import moe_experts_reference

TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3}


@st.composite
def cases(draw):
    T = draw(st.sampled_from([0, 1, 2, 3, 7, 16, 17, 40, 64, 130]))
    H = draw(st.sampled_from([8, 16, 33, 64, 100, 130]))
    I = draw(st.sampled_from([4, 17, 32, 48, 96]))
    E = draw(st.sampled_from([1, 2, 5, 8, 16]))
    K = draw(st.integers(1, min(E, 4)))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    activation = draw(st.sampled_from(["swiglu", "gpt_oss"]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    experts = (torch.randn(E, 3 * I * H, generator=g) / H**0.5).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32) if T else \
        torch.zeros(0, K, dtype=torch.int32)
    drop = torch.rand(T, K, generator=g) < draw(st.sampled_from([0.0, 0.3, 1.0]))
    ids[drop] = E  # dropped slots (1.0: every slot of every token)
    weights = torch.rand(T, K, generator=g)
    weights[torch.rand(T, K, generator=g) < 0.1] = 0.0
    biases = torch.randn(E, 2 * I + H, generator=g) if activation == "gpt_oss" and draw(st.booleans()) else None
    return x, ids, weights, experts, I, activation, biases


def _check(got, want, dtype):
    assert got.shape == want.shape and got.dtype == want.dtype
    if want.numel() == 0:
        return
    scale = max(want.float().abs().max().item(), 1e-6)
    err = (got.float() - want.float()).abs().max().item()
    assert err <= TOL[dtype] * scale, f"max |d| = {err:.3g} at scale {scale:.3g}"


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_kernel_matches_plain_torch_on_every_isa(case):
    x, ids, weights, experts, I, activation, biases = case
    want = moe_experts_reference(x, ids, weights, experts, I, activation=activation, biases=biases)
    saved = native().cpu_isa()
    try:
        for isa in native().supported_cpu_isas():
            native().set_cpu_isa(isa)
            got = moe_experts(x, ids, weights, experts, I, activation=activation, biases=biases)
            _check(got, want, experts.dtype)
    finally:
        native().set_cpu_isa(saved)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_grouped_gemm_path_matches_plain_torch(case):
    """The prefill path (torch's grouped GEMM, which moe_experts takes on CUDA from GROUPED_MIN_TOKENS
    tokens on) runs on the CPU too: bf16 SwiGLU against the reference, to bf16 rounding (the gate/up
    products are rounded once more than the kernel rounds them: 2e-2 of the scale)."""
    x, ids, weights, experts, I, activation, biases = case
    if activation != "swiglu" or x.shape[0] == 0:
        return
    if not grouped_fits(x.shape[1], I):
        with pytest.raises(ValueError, match="multiples of 8"):
            moe_experts_grouped(x.to(torch.bfloat16), ids, weights, experts.to(torch.bfloat16), I)
        return
    x, experts = x.to(torch.bfloat16), experts.to(torch.bfloat16)
    want = moe_experts_reference(x, ids, weights, experts, I)
    got = moe_experts_grouped(x, ids, weights, experts, I)
    assert got.shape == want.shape and got.dtype == want.dtype
    scale = max(want.float().abs().max().item(), 1e-6)
    assert (got.float() - want.float()).abs().max().item() <= 2e-2 * scale


def test_tokens_with_every_slot_dropped_get_zero():
    E, H, I = 4, 16, 8
    x, experts = torch.randn(3, H), torch.randn(E, 3 * I * H)
    ids = torch.tensor([[0, 1], [E, E], [2, E]], dtype=torch.int32)
    out = moe_experts(x, ids, torch.ones(3, 2), experts, I)
    assert torch.all(out[1] == 0) and torch.any(out[0] != 0)
    grouped = moe_experts_grouped(x.bfloat16(), ids, torch.ones(3, 2), experts.bfloat16(), I)  # (weights 1, ids E)
    assert torch.all(grouped[1] == 0) and torch.any(grouped[0] != 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_weights_equals_the_callers_two_casts(dtype):
    """round_weights=True rounds each weight to x's dtype inside the kernel: the same bits as the
    runtime's former `weights.to(x.dtype).float()` (no effect on fp32); in bf16 a weight that rounds
    to 0 is a zero-weight slot, so its NaN expert is never read."""
    T, E, H, I, K = 9, 6, 64, 32, 3
    g = torch.Generator().manual_seed(5)
    x = torch.randn(T, H, generator=g).to(dtype)
    experts = (torch.randn(E, 3 * I * H, generator=g) / H**0.5).to(dtype)
    ids = torch.stack([torch.randperm(E - 1, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    weights = torch.rand(T, K, generator=g) + 1e-3 * torch.rand(T, K, generator=g)  # not bf16 numbers
    if dtype == torch.bfloat16:
        ids[0, 0], weights[0, 0] = E - 1, 1e-45  # the smallest fp32 subnormal: 0 in bf16
        experts[E - 1] = float("nan")
    got = moe_experts(x, ids, weights, experts, I, round_weights=True)
    cast = weights.to(dtype).float()
    assert torch.equal(got, moe_experts(x, ids, cast, experts, I))
    if dtype == torch.float32:
        assert torch.equal(got, moe_experts(x, ids, weights, experts, I))
    else:
        assert bool(torch.isfinite(got).all()) and not torch.equal(cast, weights)
        assert bool(torch.isnan(moe_experts(x, ids, weights, experts, I)[0]).all())  # unrounded: read


def test_results_do_not_depend_on_the_thread_count():
    g = torch.Generator().manual_seed(0)
    E, H, I, T = 8, 96, 40, 33
    x, experts = torch.randn(T, H, generator=g).bfloat16(), torch.randn(E, 3 * I * H, generator=g).bfloat16()
    ids = torch.randint(0, E, (T, 2), generator=g).to(torch.int32)
    weights = torch.rand(T, 2, generator=g)
    saved = num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            set_num_threads(n)
            outs.append(moe_experts(x, ids, weights, experts, I))
    finally:
        set_num_threads(saved)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_streaming_and_tiled_schedules_give_the_same_bits(case):
    """Up to 64 tokens the kernel streams contiguous row ranges (the activation and the weighted sum as
    passes of their own); MOESPEC_MOE_SCHEDULE=tiled forces the tiled tasks: every element the same bits."""
    x, ids, weights, experts, I, activation, biases = case
    streamed = moe_experts(x, ids, weights, experts, I, activation=activation, biases=biases)
    os.environ["MOESPEC_MOE_SCHEDULE"] = "tiled"
    try:
        tiled = moe_experts(x, ids, weights, experts, I, activation=activation, biases=biases)
    finally:
        del os.environ["MOESPEC_MOE_SCHEDULE"]
    assert torch.equal(streamed, tiled)


def test_unknown_schedule_is_a_value_error(monkeypatch):
    monkeypatch.setenv("MOESPEC_MOE_SCHEDULE", "fast")
    x, experts = torch.randn(2, 8).bfloat16(), torch.randn(1, 3 * 4 * 8).bfloat16()
    with pytest.raises(ValueError, match="MOESPEC_MOE_SCHEDULE: expected 'auto' or 'tiled', got 'fast'"):
        moe_experts(x, torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, 1), experts, 4)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_scratch_above_the_retain_limit_is_released_after_the_call():
    # 640 tokens x 8 experts x I 4096: the staged h alone is 5120 rows x 4096 fp32 = 80 MiB.
    T, H, I, E, K = 640, 16, 4096, 8, 8
    g = torch.Generator().manual_seed(0)
    x, experts = torch.randn(T, H, generator=g), torch.randn(E, 3 * I * H, generator=g) / 4
    ids = torch.arange(K, dtype=torch.int32).repeat(T, 1)
    weights = torch.full((T, K), 1 / K)
    h_bytes = T * K * I * 4
    want = moe_experts_reference(x, ids, weights, experts, I)
    saved = set_scratch_retain(1 << 20)
    try:
        before_bytes, before_rss = scratch_bytes(), _resident_bytes()
        out = moe_experts(x, ids, weights, experts, I)
        # The call's buffers (this thread's, now freed) held >= 80 MiB: no more than 3 of 1 MiB remain,
        # and the process's memory (an independent count) did not keep them.
        assert scratch_bytes() - before_bytes <= 3 << 20
        assert _resident_bytes() - before_rss < h_bytes // 2
        set_scratch_retain(1 << 30)  # a limit above the call: the next call keeps its buffers
        kept = moe_experts(x, ids, weights, experts, I)
        assert scratch_bytes() >= h_bytes
    finally:
        set_scratch_retain(saved)
    moe_experts(x[:1], ids[:1], weights[:1], experts, I)  # the default limit (64 MiB): released again
    assert scratch_bytes() - before_bytes <= 3 << 20
    assert torch.equal(out, kept)
    assert (out - want).abs().max() <= TOL[torch.float32] * want.abs().max()
    with pytest.raises(ValueError, match="byte count"):
        set_scratch_retain(-1)


def test_custom_op_passes_opcheck():
    E, H, I = 4, 16, 8
    args = (torch.randn(5, H), torch.randint(0, E + 1, (5, 2), dtype=torch.int32), torch.rand(5, 2),
            torch.randn(E, 3 * I * H), None, I, 0, 7.0, 1.702, False)
    torch.library.opcheck(moe_experts_op, args)


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: moe_experts(torch.randn(2, 8), torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, 1),
                             torch.randn(3, 3 * 4 * 8).bfloat16(), 4), "x: x's dtype must equal experts' dtype bfloat16"),
        (lambda: moe_experts(torch.randn(2, 8), torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, 1),
                             torch.randn(3, 3 * 4 * 8), 4), "ids: expected dtype int32"),
        (lambda: moe_experts(torch.randn(2, 8), torch.tensor([[0], [5]], dtype=torch.int32), torch.ones(2, 1),
                             torch.randn(3, 3 * 4 * 8), 4), "ids"),
        (lambda: moe_experts(torch.randn(2, 8), torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, 2),
                             torch.randn(3, 3 * 4 * 8), 4), "weights"),
        (lambda: moe_experts(torch.randn(2, 8), torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, 1),
                             torch.randn(3, 3 * 4 * 8), 5), "intermediate_size"),
        (lambda: moe_experts(torch.randn(2, 8), torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, 1),
                             torch.randn(3, 3 * 4 * 8), 4, biases=torch.zeros(3, 16)), "biases"),
        (lambda: moe_experts(torch.randn(2, 8), torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, 1),
                             torch.randn(3, 3 * 4 * 8), 4, activation="relu"), "activation"),
        (lambda: moe_experts(torch.randn(2, 8, 1), torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, 1),
                             torch.randn(3, 3 * 4 * 8), 4), "x: expected a 2-d tensor"),
    ],
)
def test_bad_input_raises_a_clear_error(make, match):
    with pytest.raises(ValueError, match=match):
        make()
