"""route_experts (native, CPU) against the plain-torch reference, its invariants, and bad input.

The reference is moespec.ops.reference.route_experts_reference: ordinary torch ops following the
semantics of cpp/include/moespec/route_experts.h. On the CPU both round the same way, so results
must be identical (ids, weights bit for bit, active, stats), for every family, policy, dtype, ISA.
Hypothesis draws T in 1..256, N in {8, 16, 64, 128, 256, 512}, k in 1..8, B in k..N; the logits
come from a seeded generator (scale and ties drawn too), so failures reproduce from the seed.
"""

from __future__ import annotations

import math

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings

from moespec._loader import native
from moespec.ops import ExpertBudget, RouterSpec, route_experts, route_experts_op
from moespec.ops.reference import route_experts_reference

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def routing_cases(draw):
    family = draw(st.sampled_from(["softmax", "deepseek_v3", "gpt_oss"]))
    n = draw(st.sampled_from([8, 16, 64, 128, 256, 512]))
    k = draw(st.integers(1, 8))
    t = draw(st.integers(1, 256))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    if family == "deepseek_v3":
        n_group = draw(st.sampled_from([g for g in (1, 2, 4, 8) if n % g == 0 and n // g >= 2]))
        topk_group = draw(st.integers(1, n_group))
        if k > topk_group * (n // n_group):
            topk_group = n_group
        spec = RouterSpec(family, k, draw(st.booleans()), n_group=n_group, topk_group=topk_group,
                          scaling=draw(st.sampled_from([1.0, 2.5])))
    else:
        spec = RouterSpec(family, k, draw(st.booleans()))
    budget = None
    if draw(st.booleans()):
        coverage = draw(st.one_of(st.none(), st.sampled_from([0.3, 0.5, 0.8, 0.95, 1.0])))
        budget = ExpertBudget(draw(st.integers(k, n)), draw(st.sampled_from(["substitution", "truncation"])), coverage,
                              draw(st.sampled_from(["probability", "gates"])))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    scale = draw(st.sampled_from([0.01, 1.0, 4.0, 20.0]))
    logits = torch.randn(t, n, generator=gen) * scale
    if draw(st.booleans()):  # coarse values: many exact ties between experts
        logits = logits.round()
    logits = logits.to(dtype)
    bias = torch.randn(n, generator=gen) * 0.1 if family == "deepseek_v3" and draw(st.booleans()) else None
    token_weights = torch.rand(t, generator=gen) if budget is not None and draw(st.booleans()) else None
    return logits, spec, budget, bias, token_weights


def _assert_same(got, want):
    ids, weights, active, stats = want
    assert torch.equal(got.ids, ids)
    assert torch.equal(got.weights, weights), f"max |d| = {(got.weights - weights).abs().max().item():.3g}"
    assert torch.equal(got.active, active)
    assert got.stats == stats


@SETTINGS
@given(routing_cases())
def test_native_equals_plain_torch_reference(case):
    logits, spec, budget, bias, token_weights = case
    got = route_experts(logits, spec, budget, bias, token_weights=token_weights)
    _assert_same(got, route_experts_reference(logits, spec, budget, bias, token_weights))


@settings(max_examples=40, deadline=None)
@given(routing_cases())
def test_every_cpu_isa_gives_the_same_routing(case):
    logits, spec, budget, bias, token_weights = case
    saved = native().cpu_isa()
    try:
        results = []
        for isa in native().supported_cpu_isas():
            native().set_cpu_isa(isa)
            results.append(route_experts(logits, spec, budget, bias, token_weights=token_weights))
    finally:
        native().set_cpu_isa(saved)
    for r in results[1:]:
        assert torch.equal(r.ids, results[0].ids) and torch.equal(r.weights, results[0].weights)
        assert r.stats == results[0].stats


@SETTINGS
@given(routing_cases())
def test_budget_invariants(case):
    logits, spec, budget, bias, token_weights = case
    if budget is None:
        budget = ExpertBudget(spec.top_k)
    T, N = logits.shape
    K = spec.top_k
    natural = route_experts(logits, spec, bias=bias)
    r = route_experts(logits, spec, budget, bias, token_weights=token_weights)
    stats = r.stats
    assert stats.natural_unique == natural.active.numel()
    assert stats.kept == r.active.numel() and stats.kept <= max(budget.max_experts, stats.natural_unique)
    used = r.ids[r.ids < N].unique()
    assert torch.equal(used.to(torch.int32), r.active)
    assert torch.all(r.active_padded[stats.kept:] == N)
    if stats.natural_unique <= budget.max_experts and budget.coverage is None:
        # the cap does not bind: the routing is exactly the natural one
        assert torch.equal(r.ids, natural.ids) and torch.equal(r.weights, natural.weights)
        assert stats.rerouted == stats.dropped == 0
    elif stats.rerouted or stats.dropped:
        assert stats.kept <= budget.max_experts
    if budget.policy == "substitution":
        assert stats.dropped == 0
        assert torch.all(r.ids < N)
        assert all(len(set(row)) == K for row in r.ids.tolist())  # exactly k distinct experts
        pairs = list(zip(r.ids.tolist(), natural.ids.tolist()))
        assert stats.rerouted == sum(len(set(row) - set(nat)) for row, nat in pairs)
        in_set = set(r.active.tolist())
        assert all(row == nat for row, nat in pairs if set(nat) <= in_set)  # fitting tokens keep theirs
    else:
        assert stats.rerouted == 0
        assert int((r.ids == N).sum()) == stats.dropped
        assert torch.all(r.weights[r.ids == N] == 0)
        # truncation only removes experts: every kept slot is a natural one
        nat_sets = [set(row) for row in natural.ids.tolist()]
        assert all(set(x for x in row if x < N) <= s for row, s in zip(r.ids.tolist(), nat_sets))
    renormalised = spec.renormalize or spec.family == "gpt_oss"
    if renormalised:
        target = spec.scaling if spec.family == "deepseek_v3" else 1.0
        # rows with kept experts whose probability mass is not lost to underflow (DeepSeek-V3
        # divides by sum + 1e-20, so a surviving sigmoid of 1e-18 does not renormalise to 1)
        kept = r.ids < N
        prob = logits.float().sigmoid() if spec.family == "deepseek_v3" else logits.float().softmax(-1)
        mass = torch.where(kept, prob.gather(1, r.ids.long().clamp(max=N - 1)), 0.0).double().sum(1)
        live = kept.any(dim=1) & ((mass > 1e-12) | torch.tensor(spec.family == "gpt_oss"))
        sums = r.weights.double().sum(dim=1)
        tol = 1e-2 if (spec.family == "gpt_oss" and logits.dtype != torch.float32) else 1e-5
        assert torch.allclose(sums[live], torch.full_like(sums[live], target), rtol=tol, atol=tol)


def test_budget_at_least_n_or_natural_union_changes_nothing():
    logits = torch.randn(10, 64)
    spec = RouterSpec("softmax", 4, True)
    plain = route_experts(logits, spec)
    for b in (64, 100, plain.stats.natural_unique):
        r = route_experts(logits, spec, ExpertBudget(b))
        assert torch.equal(r.ids, plain.ids) and torch.equal(r.weights, plain.weights)


def test_budget_equal_to_k_gives_every_token_the_same_experts():
    logits = torch.randn(50, 128)
    r = route_experts(logits, RouterSpec("softmax", 8, True), ExpertBudget(8))
    assert r.stats.kept == 8
    assert all(set(row) == set(r.active.tolist()) for row in r.ids.tolist())


def test_truncation_can_drop_a_token_entirely():
    # token 1 prefers experts 6 and 7, everyone else 0 and 1: a budget of 2 drops token 1.
    logits = torch.full((5, 8), -5.0)
    logits[:, 0], logits[:, 1] = 5.0, 4.0
    logits[1] = -5.0
    logits[1, 6], logits[1, 7] = 5.0, 4.0
    r = route_experts(logits, RouterSpec("softmax", 2, True), ExpertBudget(2, "truncation"))
    assert r.ids[1].tolist() == [8, 8] and r.weights[1].tolist() == [0.0, 0.0]
    assert r.stats.dropped == 2 and r.active.tolist() == [0, 1]
    s = route_experts(logits, RouterSpec("softmax", 2, True), ExpertBudget(2))
    assert sorted(s.ids[1].tolist()) == [0, 1] and s.stats.rerouted == 2


def test_token_weights_steer_the_budget():
    torch.manual_seed(3)
    logits = torch.randn(20, 32)
    w = torch.zeros(20)
    w[7] = 1.0  # only token 7 counts: its top-2 experts are the budget
    r = route_experts(logits, RouterSpec("softmax", 2, False), ExpertBudget(2), token_weights=w)
    assert set(r.active.tolist()) == set(logits[7].topk(2).indices.tolist())


def test_gates_score_ranks_the_experts_tokens_chose():
    # Three tokens, top-1, no renormalisation: expert 3 holds 0.3 of every token's probability but
    # is nobody's choice; the tokens choose experts 0, 1 and 2 with weights 0.5, 0.45 and 0.4.
    prob = torch.tensor([[0.5, 0.1, 0.1, 0.3], [0.1, 0.45, 0.15, 0.3], [0.2, 0.1, 0.4, 0.3]])
    logits, spec = prob.log(), RouterSpec("softmax", 1, False)
    moe_spec = route_experts(logits, spec, ExpertBudget(2, score="probability"))
    assert 3 in moe_spec.active.tolist()  # MoE-Spec keeps the summed probability's favourite
    gates = route_experts(logits, spec, ExpertBudget(2, score="gates"))
    assert gates.active.tolist() == [0, 1]  # the two heaviest choices; token 2 moves to its best of them
    assert gates.ids[:, 0].tolist() == [0, 1, 0] and gates.stats.rerouted == 1


@SETTINGS
@given(routing_cases())
def test_gates_score_keeps_every_first_choice_that_fits(case):
    logits, spec, _, bias, _ = case
    # (DeepSeek-V3 substitutes by its biased, group-free selection key, which can rank other experts
    # of the set above a token's heaviest one: there the set holds the first choices, not the slots.)
    assume(spec.family != "deepseek_v3" or (bias is None and spec.n_group == 1))
    T, N = logits.shape
    natural = route_experts(logits, spec, bias=bias)
    w = natural.weights.masked_fill(natural.ids >= N, -1.0)
    order = natural.ids.long().argsort(dim=-1)  # by id: argmax takes the lower id on equal weights
    first = natural.ids.gather(1, order).gather(1, w.gather(1, order).argmax(dim=-1, keepdim=True))[:, 0]
    distinct = first.unique()
    budget = ExpertBudget(max(spec.top_k, distinct.numel()), score="gates")
    r = route_experts(logits, spec, budget, bias)
    # each token keeps its first choice, unless another expert ties with it in the selection key
    x = logits.float()
    key = {"softmax": lambda: x.softmax(-1), "gpt_oss": lambda: x,
           "deepseek_v3": lambda: x.sigmoid() + (bias if bias is not None else 0.0)}[spec.family]()
    alone = (key == key.gather(1, first[:, None].long())).sum(dim=-1) == 1
    assert all(int(f) in row for f, row, a in zip(first, r.ids.tolist(), alone) if a)


# ---- the torch custom op ----------------------------------------------------------------------


def test_custom_op_is_registered_and_passes_opcheck():
    logits = torch.randn(6, 16)
    args = (logits, None, None, 0, 2, True, 1, 1, 1.0, 4, 0, 0.0, 0, 16)
    torch.library.opcheck(route_experts_op, args)
    ids, weights, active, stats = torch.ops.moespec.route_experts(*args)
    ref = route_experts(logits, RouterSpec("softmax", 2, True), ExpertBudget(4))
    assert torch.equal(ids, ref.ids) and torch.equal(weights, ref.weights)


def test_custom_op_traces_under_torch_compile():
    spec, budget = RouterSpec("softmax", 2, True), ExpertBudget(4)

    @torch.compile(backend="aot_eager", fullgraph=True)
    def f(x):
        return route_experts(x, spec, budget).weights * 2

    x = torch.randn(9, 16)
    assert torch.equal(f(x), route_experts(x, spec, budget).weights * 2)


# ---- bad input: a clear Python exception, never a crash -----------------------------------------


@pytest.mark.parametrize(
    "make,error,match",
    [
        (lambda: route_experts(torch.randn(4, 16, 2), RouterSpec("softmax", 2)), ValueError, "router_logits: expected a 2-d tensor"),
        (lambda: route_experts(torch.randn(16), RouterSpec("softmax", 2)), ValueError, "router_logits: expected a 2-d tensor"),
        (lambda: route_experts(torch.randn(4, 16, dtype=torch.float64), RouterSpec("softmax", 2)), ValueError, "router_logits: expected dtype float32 or bfloat16 or float16, got float64"),
        (lambda: route_experts(torch.ones(4, 16, dtype=torch.int32), RouterSpec("softmax", 2)), ValueError, "router_logits: expected dtype float32 or bfloat16 or float16, got int32"),
        (lambda: route_experts(torch.randn(4, 2000), RouterSpec("softmax", 2)), ValueError, r"number of experts N \(dim 1\) must be in \[1, 1024\], got 2000"),
        (lambda: route_experts(torch.randn(4, 16), RouterSpec("softmax", 17)), ValueError, r"spec.top_k: top_k must be in \[1, min\(N, 64\)\] with N = 16 experts, got 17"),
        (lambda: route_experts(torch.tensor([[0.0, float("nan")]]), RouterSpec("softmax", 1)), ValueError, "router_logits: non-finite value nan at token 0, expert 1"),
        (lambda: route_experts(torch.tensor([[0.0, float("inf")]]), RouterSpec("softmax", 1)), ValueError, "non-finite value inf"),
        (lambda: route_experts(torch.tensor([[0.0, float("-inf")]]), RouterSpec("softmax", 1)), ValueError, "non-finite value -inf"),
        (lambda: route_experts(torch.randn(4, 16), RouterSpec("softmax", 8), ExpertBudget(4)), ValueError, "budget.max_experts: a budget of 4 experts is below top_k=8: one token alone needs 8 experts"),
        (lambda: ExpertBudget(0), ValueError, "ExpertBudget.max_experts: expected an int >= 1"),
        (lambda: ExpertBudget(8, "drop"), ValueError, "ExpertBudget.policy"),
        (lambda: ExpertBudget(8, score="mass"), ValueError, "ExpertBudget.score: expected .probability. or .gates., got .mass."),
        (lambda: ExpertBudget(8, exact_layers=-1), ValueError, "ExpertBudget.exact_layers: expected an int >= 0, got -1"),
        (lambda: ExpertBudget(8, coverage=0.0), ValueError, r"ExpertBudget.coverage: expected a number in \(0, 1\]"),
        (lambda: ExpertBudget(8, coverage=1.5), ValueError, "ExpertBudget.coverage"),
        (lambda: ExpertBudget(8, coverage=math.nan), ValueError, "ExpertBudget.coverage"),
        (lambda: RouterSpec("sparsemixer", 2), ValueError, "RouterSpec.family"),
        (lambda: RouterSpec("softmax", 0), ValueError, "RouterSpec.top_k"),
        (lambda: RouterSpec("deepseek_v3", 2, n_group=4, topk_group=5), ValueError, "RouterSpec.topk_group"),
        (lambda: route_experts(torch.randn(4, 16), RouterSpec("softmax", 2), bias=torch.zeros(16)), ValueError, "bias: only family='deepseek_v3' takes a bias"),
        (lambda: route_experts(torch.randn(4, 16), RouterSpec("deepseek_v3", 2), bias=torch.zeros(15)), ValueError, "bias: expected size 16 in dim 0"),
        (lambda: route_experts(torch.randn(4, 16), RouterSpec("deepseek_v3", 2), bias=torch.tensor([math.inf] * 16)), ValueError, "bias: non-finite value inf at expert 0"),
        (lambda: route_experts(torch.randn(4, 16), RouterSpec("deepseek_v3", 2, n_group=3)), ValueError, "spec.n_group: n_group must divide the 16 experts, got 3"),
        (lambda: route_experts(torch.randn(4, 16), RouterSpec("softmax", 2), ExpertBudget(2), token_weights=torch.tensor([1.0, -1.0, 1.0, 1.0])), ValueError, "token_weights: must be finite and >= 0, got -1 at token 1"),
        (lambda: route_experts(torch.randn(4, 16), RouterSpec("softmax", 2), ExpertBudget(2), token_weights=torch.ones(5)), ValueError, "token_weights: expected size 4 in dim 0"),
        (lambda: route_experts(torch.randn(4, 16), "softmax"), TypeError, "spec: expected a moespec.ops.RouterSpec"),
        (lambda: route_experts([[0.0, 1.0]], RouterSpec("softmax", 1)), TypeError, "router_logits: expected a torch.Tensor"),
    ],
)
def test_bad_input_raises_a_clear_error(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_zero_tokens():
    r = route_experts(torch.empty(0, 16), RouterSpec("softmax", 2), ExpertBudget(4))
    assert r.ids.shape == (0, 2) and r.active.numel() == 0 and r.stats.natural_unique == 0


def test_cuda_tensors_without_cuda_build_name_the_option():
    if native().cuda_available():
        pytest.skip("this build has the CUDA kernels")
    from moespec._loader import require_cuda

    with pytest.raises(RuntimeError, match="MOESPEC_CUDA=ON"):
        require_cuda()


def test_transposed_and_empty_logits_route_as_their_contiguous_copies():
    """Logits whose experts are not contiguous (a transposed tensor) route as their contiguous copy;
    an empty batch from numpy (zero strides) routes to nothing."""
    import numpy as np

    spec, budget = RouterSpec("softmax", 2, True), ExpertBudget(3)
    logits = torch.randn(16, 5).t()  # [5, 16], expert stride 5
    a, b = route_experts(logits, spec, budget), route_experts(logits.contiguous(), spec, budget)
    assert torch.equal(a.ids, b.ids) and torch.equal(a.weights, b.weights) and a.stats == b.stats
    empty = route_experts(torch.from_numpy(np.zeros((0, 16), np.float32)), spec, budget)
    assert empty.ids.shape == (0, 2) and empty.stats.kept == 0
