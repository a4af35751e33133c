"""moe_experts on CUDA (cpp/kernels/moe_experts.cu) against the CPU op (cpp/src/moe_experts.cc) and
the plain-torch reference (moespec.ops.reference.moe_experts_reference).

The CUDA kernel sums each dot product in the warp's order, not the CPU's, so outputs are compared
within the CPU's own SIMD tolerances (cpp/include/moespec/moe_experts.h, "Precision"): a relative
1e-5 (fp32) / 4e-3 (bf16) of the output scale max |out|, plus for bf16 one bf16 ulp of the value.
Also: the 16-byte path and the scalar fallback (H not a multiple of 8, a misaligned x), dropped
(id E) and zero-weight slots, repeated ids, an unused expert full of NaN (never read), T = 0,
determinism (two calls bit-identical) and a CUDA-graph replay equal to the eager call. Every test
runs on each launch sequence (the fused pair with programmatic dependent launch, the fused pair
launched plainly (MOESPEC_PDL=0), the four launches (MOESPEC_MOE_FUSED=0)), and the fused pair gives
the four launches' bits. Seeds are fixed so that a failure reproduces. Skipped without a CUDA device or a CUDA build.
"""

from __future__ import annotations

import pytest
import torch
from gpu_common import captured, require_cuda_build

require_cuda_build()

from moespec.ops import moe_experts  # noqa: E402
from moespec.ops.reference import moe_experts_reference  # noqa: E402

CUDA = torch.device("cuda")
TOL = {torch.float32: 1e-5, torch.bfloat16: 4e-3}
LAUNCHES = {"fused": ("1", "1", "1"), "fused-late": ("1", "1", "0"), "fused-plain": ("1", "0", "1"),
            "four": ("0", "1", "1")}  # MOESPEC_MOE_FUSED, MOESPEC_PDL, MOESPEC_PDL_EARLY


@pytest.fixture(autouse=True, params=list(LAUNCHES), ids=list(LAUNCHES))
def launches(request, monkeypatch):
    """Each test once per launch sequence of the kernel (read by the CUDA entry at every call): the
    fused pair's down kernel releasing the next kernel early or after its wait ("fused-late")."""
    fused, pdl, early = LAUNCHES[request.param]
    monkeypatch.setenv("MOESPEC_MOE_FUSED", fused)
    monkeypatch.setenv("MOESPEC_PDL", pdl)
    monkeypatch.setenv("MOESPEC_PDL_EARLY", early)
    return request.param


def make(T, H, I, E, K, dtype, seed, *, drop=0.1, zero=0.1, repeats=False, experts_on="cpu"):
    """x [T, H], ids [T, K] (some E: dropped), weights [T, K] (some 0), experts [E, 3 I H] (CPU; made
    on ``experts_on`` from its own generator where that is CUDA: Qwen3's 128 experts are 600 M values,
    seconds on the host)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen).to(dtype)
    if experts_on == "cpu":
        experts = (torch.randn(E, 3 * I * H, generator=gen) / H**0.5).to(dtype)
    else:
        on = torch.Generator(experts_on).manual_seed(seed)
        experts = (torch.randn(E, 3 * I * H, generator=on, device=experts_on) / H**0.5).to(dtype)
    if repeats:
        ids = torch.randint(0, E, (T, K), generator=gen, dtype=torch.int32)
    else:
        ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).to(torch.int32) if T else \
            torch.zeros(0, K, dtype=torch.int32)
    weights = torch.rand(T, K, generator=gen)
    ids[torch.rand(T, K, generator=gen) < drop] = E
    weights[torch.rand(T, K, generator=gen) < zero] = 0.0
    return x, ids, weights, experts


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, where: str) -> None:
    got, want = got.float().cpu(), want.float()
    scale = max(float(want.abs().max()) if want.numel() else 0.0, 1e-30)
    bound = TOL[dtype] * scale
    if dtype == torch.bfloat16:
        bound = bound + want.abs() * 2.0**-8  # one bf16 ulp of the value
    err = (got - want).abs()
    assert bool((err <= bound).all()), f"{where}: max error {float(err.max())} (scale {scale})"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,H,I,E,K", [(1, 64, 32, 8, 2), (5, 128, 64, 16, 4), (16, 256, 96, 32, 8),
                                       (64, 512, 128, 64, 8), (3, 36, 20, 6, 3)])  # the last: scalar path
def test_swiglu_matches_the_cpu_op(T, H, I, E, K, dtype):
    x, ids, weights, experts = make(T, H, I, E, K, dtype, seed=T * 7 + E)
    want = moe_experts(x, ids, weights, experts, I)
    got = moe_experts(x.to(CUDA), ids.to(CUDA), weights.to(CUDA), experts.to(CUDA), I)
    assert got.device.type == "cuda" and got.dtype == dtype and got.shape == (T, H)
    assert_close(got, want, dtype, f"swiglu T={T} H={H} I={I} E={E} K={K} {dtype}")
    ref = moe_experts_reference(x, ids, weights, experts, I)
    assert_close(got, ref, dtype, "against the plain-torch reference")


@pytest.mark.parametrize("T,E", [(40, 2), (96, 4), (130, 3)])
def test_many_tokens_per_expert_take_several_passes(T, E):
    """Up to ~90 slots on one expert: the tensor-core path's n-tiles (8 tokens, 4 a pass over the
    weights) run several passes and a partial last tile; slot order and repeats as on the CPU."""
    H, I, K = 256, 64, 2
    x, ids, weights, experts = make(T, H, I, E, K, torch.bfloat16, seed=T + E, repeats=True)
    want = moe_experts(x, ids, weights, experts, I)
    got = moe_experts(x.to(CUDA), ids.to(CUDA), weights.to(CUDA), experts.to(CUDA), I)
    assert_close(got, want, torch.bfloat16, f"T={T} E={E}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpt_oss_with_biases_matches_the_cpu_op(dtype):
    T, H, I, E, K = 9, 128, 64, 16, 4
    x, ids, weights, experts = make(T, H, I, E, K, dtype, seed=3)
    biases = torch.randn(E, 2 * I + H, generator=torch.Generator().manual_seed(4))
    kw = dict(activation="gpt_oss", biases=biases, limit=1.5, alpha=1.702)
    want = moe_experts(x, ids, weights, experts, I, **kw)
    got = moe_experts(x.to(CUDA), ids.to(CUDA), weights.to(CUDA), experts.to(CUDA), I,
                      **{**kw, "biases": biases.to(CUDA)})
    assert_close(got, want, dtype, f"gpt_oss {dtype}")


def test_repeats_unused_nan_expert_misaligned_x_and_empty_batch():
    T, H, I, E, K = 12, 128, 64, 8, 4
    x, ids, weights, experts = make(T, H, I, E, K, torch.bfloat16, seed=5, repeats=True)
    ids[ids == 7] = 6  # expert 7 unused ...
    experts[7] = float("nan")  # ... and poisoned: it must never be read
    want = moe_experts(x, ids, weights, experts, I)
    big = torch.zeros(T, H + 1, dtype=torch.bfloat16, device=CUDA)
    big[:, 1:] = x.to(CUDA)  # rows 2 bytes off 16-byte alignment: the scalar path
    args = (ids.to(CUDA), weights.to(CUDA), experts.to(CUDA), I)
    for xin in (x.to(CUDA), big[:, 1:]):
        got = moe_experts(xin, *args)
        assert bool(torch.isfinite(got).all())
        assert_close(got, want, torch.bfloat16, "repeats / nan expert")
    empty = moe_experts(x[:0].to(CUDA), ids[:0].to(CUDA), weights[:0].to(CUDA), experts.to(CUDA), I)
    assert empty.shape == (0, H)


def test_deterministic_and_graph_replay_equals_eager():
    T, H, I, E, K = 16, 256, 128, 32, 8
    x, ids, weights, experts = (t.to(CUDA) for t in make(T, H, I, E, K, torch.bfloat16, seed=6))
    first = moe_experts(x, ids, weights, experts, I)
    assert torch.equal(first, moe_experts(x, ids, weights, experts, I))
    static_x = x.clone()
    graph, out = captured(lambda: moe_experts(static_x, ids, weights, experts, I))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, first)
    static_x.copy_(x * 0.5)  # new inputs through the same graph
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, moe_experts(x * 0.5, ids, weights, experts, I))


def test_routing_budget_and_experts_in_one_graph():
    """route_experts (with a budget) then moe_experts, captured together in one CUDA graph: the replay
    equals the eager pair, and the budget caps the experts the layer reads (the graph of a verify
    step's MoE layer, with no host synchronisation inside)."""
    from moespec.ops import ExpertBudget, RouterSpec, route_experts

    T, H, I, E, K, B = 16, 256, 128, 64, 8, 16
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16).to(CUDA)
    router = (torch.randn(E, H, generator=gen) * 0.1).to(CUDA)
    experts = (torch.randn(E, 3 * I * H, generator=gen) / H**0.5).to(torch.bfloat16).to(CUDA)
    spec, budget = RouterSpec("softmax", K, True), ExpertBudget(B, "substitution")

    def layer(inp):
        r = route_experts(inp.float() @ router.T, spec, budget)
        return moe_experts(inp, r.ids, r.weights, experts, I), r.ids

    want, ids = layer(x)
    assert ids[ids < E].unique().numel() <= B
    static_x = x.clone()
    graph, (out, _) = captured(lambda: layer(static_x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


def test_layers_chained_in_one_graph_equal_plain_launches(monkeypatch, launches):
    """Four MoE layers chained in one CUDA graph, each routed by route_experts on the previous layer's
    output (the routing kernel writes the ids right before the experts read them; the allocator reuses
    the layers' ids, weights and workspace memory), replayed on new inputs: the bits of the same chain
    launched eagerly as four plain launches a layer (programmatic dependent launch off). Guards the
    programmatic-dependent reads (the down kernel finds its expert before its wait) against stale
    data across layers and replays."""
    from moespec.ops import RouterSpec, route_experts

    T, H, I, E, K, L = 8, 256, 64, 64, 8, 4
    gen = torch.Generator().manual_seed(12)
    routers = [(torch.randn(E, H, generator=gen) * 0.2).to(torch.bfloat16).to(CUDA) for _ in range(L)]
    experts = [(torch.randn(E, 3 * I * H, generator=gen) / H**0.5).to(torch.bfloat16).to(CUDA) for _ in range(L)]
    spec = RouterSpec("softmax", K, True)

    def chain(x):
        for router, ex in zip(routers, experts):
            r = route_experts(torch.nn.functional.linear(x, router), spec)
            x = moe_experts(x, r.ids, r.weights, ex, I, round_weights=True) + x
        return x

    inputs = [torch.randn(T, H, generator=gen).to(torch.bfloat16).to(CUDA) for _ in range(3)]
    static_x = inputs[0].clone()
    graph, out = captured(lambda: chain(static_x))
    got = []
    for x in inputs:
        static_x.copy_(x)
        graph.replay()
        got.append(out.clone())
    torch.cuda.synchronize()
    monkeypatch.setenv("MOESPEC_MOE_FUSED", "0")
    monkeypatch.setenv("MOESPEC_PDL", "0")
    for x, g in zip(inputs, got):
        assert torch.equal(g, chain(x)), launches


@pytest.mark.parametrize("T,H,I,E,K", [(1, 256, 96, 128, 8), (7, 512, 64, 64, 8), (16, 2048, 768, 128, 8),
                                       (40, 128, 64, 8, 2), (128, 64, 32, 256, 8), (129, 64, 32, 256, 8)])
def test_fused_pair_gives_the_four_launches_bits(T, H, I, E, K, monkeypatch, launches):
    """The fused pair runs the same tensor-core passes and sums each token's slots in the same (id, k)
    order as the four launches: the same bits, with and without programmatic dependent launch, up to
    T K = 1024 slots (T = 129 with K = 8 is past it: the four launches either way)."""
    x, ids, weights, experts = (t.to(CUDA) for t in make(T, H, I, E, K, torch.bfloat16, seed=T + E, experts_on=CUDA))
    got = moe_experts(x, ids, weights, experts, I)
    monkeypatch.setenv("MOESPEC_MOE_FUSED", "0")
    assert torch.equal(got, moe_experts(x, ids, weights, experts, I)), launches


def test_round_weights_every_slot_dropped_and_a_bad_setting(monkeypatch):
    """round_weights in the kernel equals the CPU op's (and the two casts it replaces); a batch whose
    every slot is dropped gives zeros (no expert used: the fused pair's tiles have no last block);
    MOESPEC_MOE_FUSED, MOESPEC_PDL or MOESPEC_PDL_EARLY other than 1 / 0 is a clear error."""
    T, H, I, E, K = 12, 256, 64, 16, 4
    x, ids, weights, experts = make(T, H, I, E, K, torch.bfloat16, seed=9, drop=0.0, zero=0.0)
    weights = weights + 1e-3 * torch.rand(T, K, generator=torch.Generator().manual_seed(1))
    want = moe_experts(x, ids, weights, experts, I, round_weights=True)
    args = [t.to(CUDA) for t in (x, ids, weights, experts)]
    got = moe_experts(*args, I, round_weights=True)
    assert_close(got, want, torch.bfloat16, "round_weights")
    assert torch.equal(got, moe_experts(args[0], args[1], args[2].to(torch.bfloat16).float(), args[3], I))
    dropped = torch.full_like(args[1], E)
    assert torch.equal(moe_experts(args[0], dropped, args[2], args[3], I), torch.zeros_like(args[0]))
    for name in ("MOESPEC_MOE_FUSED", "MOESPEC_PDL", "MOESPEC_PDL_EARLY"):
        for switch in ("MOESPEC_MOE_FUSED", "MOESPEC_PDL", "MOESPEC_PDL_EARLY"):
            monkeypatch.setenv(switch, "1")
        monkeypatch.setenv(name, "yes")
        with pytest.raises(ValueError, match=name):
            moe_experts(*args, I)


def test_prefill_takes_the_grouped_gemm_and_matches_the_reference():
    """From GROUPED_MIN_TOKENS tokens on, bf16 SwiGLU moe_experts on CUDA runs torch's grouped GEMM
    (moe_experts_grouped): against the plain-torch reference within bf16 rounding (2e-2 of the scale),
    deterministic, and equal to the same path on the CPU within that tolerance."""
    from moespec.ops.moe import GROUPED_MIN_TOKENS, moe_experts_grouped

    T = GROUPED_MIN_TOKENS + 37
    x, ids, weights, experts = make(T, 64, 32, 16, 4, torch.bfloat16, seed=3)
    want = moe_experts_reference(x, ids, weights, experts, 32)
    args = [t.to(CUDA) for t in (x, ids, weights, experts)]
    got = moe_experts(*args, 32)
    scale = float(want.float().abs().max())
    assert float((got.cpu().float() - want.float()).abs().max()) <= 2e-2 * scale
    assert torch.equal(got, moe_experts(*args, 32))  # deterministic
    assert torch.equal(got, moe_experts_grouped(*args, 32))  # it is the grouped path
