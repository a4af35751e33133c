"""route_experts on CUDA (cpp/kernels/route_experts.cu) against the CPU op (cpp/src/route_experts.cc).

The CPU op defines the semantics; the CUDA op uses the same arithmetic (detail/route_math.h), so:
- softmax and gpt_oss: ids identical (same slot order), active and stats identical, weights bit for
  bit identical, except gpt_oss with bfloat16/float16 logits, whose weights may differ by 1 ulp of
  that dtype (the CPU uses libm's expf there, the GPU (float)exp(double));
- deepseek_v3: the CPU's slot order is std::nth_element's, the GPU's (value desc, id asc), so each
  row is compared as a set of ids, and the weights matched by id within rtol 2e-6 (the renormalising
  sum runs in slot order: two orders of K <= 8 positive terms differ by at most 2 (K - 1) half-ulps,
  ~8e-7, plus 1 ulp where the CPU's sigmoid uses libm's expf); active and stats identical.
Logits have distinct values in each row (ties decide the top-k slot order by implementation
detail); test_ties_* checks the GPU's documented tie rule (lower id first) on purpose-made ties.
Seeds are fixed so that a failure reproduces. Skipped without a CUDA device or a CUDA build.
"""

from __future__ import annotations

import functools

import pytest
import torch
from gpu_common import captured, require_cuda_build

require_cuda_build()

from moespec._loader import native  # noqa: E402
import hypothesis.strategies as st  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402

from moespec._tensor import view  # noqa: E402
from moespec.ops import ExpertBudget, RouterSpec, route_experts  # noqa: E402

# T tokens, N experts, K top-k, B budget.
SEED = 1234
T_SIZES = (1, 7, 64, 256)
N_SIZES = (8, 64, 128, 256, 512)
K_SIZES = (1, 2, 4, 8)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CUDA = torch.device("cuda")

FAMILIES = {
    "softmax": lambda k: RouterSpec("softmax", k, False),
    "softmax_renormalize": lambda k: RouterSpec("softmax", k, True),
    "deepseek_v3_grouped": lambda k: RouterSpec("deepseek_v3", k, True, n_group=8, topk_group=4, scaling=2.5),
    "deepseek_v3": lambda k: RouterSpec("deepseek_v3", k, True, n_group=1, topk_group=1),
    "gpt_oss": lambda k: RouterSpec("gpt_oss", k),
}

BUDGETS = {
    "none": lambda k, n: None,
    "substitution": lambda k, n: ExpertBudget(max(k, n // 8), "substitution"),
    "truncation": lambda k, n: ExpertBudget(max(k, n // 8), "truncation"),
    "coverage": lambda k, n: ExpertBudget(max(k, n // 4), "substitution", coverage=0.6),
    "coverage_truncation": lambda k, n: ExpertBudget(n, "truncation", coverage=0.5),
    "gates": lambda k, n: ExpertBudget(max(k, n // 8), "substitution", score="gates"),
    "gates_coverage_truncation": lambda k, n: ExpertBudget(n, "truncation", coverage=0.6, score="gates"),
}


def _pool(dtype: torch.dtype) -> torch.Tensor:
    """Every value of `dtype` with magnitude in [1/16, 4], as float32 (1536 for bfloat16)."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    values = bits.view(dtype).float()
    return values[(values.abs() >= 0.0625) & (values.abs() <= 4.0)]


@functools.lru_cache(maxsize=64)
def make_logits(T: int, N: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[T, N] CPU logits of `dtype`, distinct within each row (ties make the slot order ambiguous).

    Cached (the callers only read them)."""
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.float32:
        return torch.randn(T, N, generator=gen) * 2.0  # [T, N]; fp32 ties: probability ~0
    pool = _pool(dtype)
    pick = torch.rand(T, pool.numel(), generator=gen).argsort(dim=1)[:, :N]  # [T, N] distinct
    return pool[pick].to(dtype)  # exact: pool values are representable


def make_bias(N: int, seed: int) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(seed + 1)) * 0.1  # [N]


def on_cuda(x):
    return None if x is None else x.to(CUDA)


def assert_same_routing(got, want, spec: RouterSpec, dtype: torch.dtype, where: str) -> None:
    """`got` (CUDA) equals `want` (CPU) up to the documented differences (module docstring)."""
    ids, weights = got.ids.cpu(), got.weights.cpu()
    assert torch.equal(got.stats_tensor.cpu(), want.stats_tensor), f"{where}: stats {got.stats} != {want.stats}"
    assert torch.equal(got.active_padded.cpu(), want.active_padded), f"{where}: active differs"
    if spec.family == "deepseek_v3":
        ids_sorted, perm = ids.sort(dim=1)  # dropped slots (id N) last
        want_sorted, want_perm = want.ids.sort(dim=1)
        assert torch.equal(ids_sorted, want_sorted), f"{where}: id sets differ"
        torch.testing.assert_close(weights.gather(1, perm), want.weights.gather(1, want_perm), rtol=2e-6, atol=0,
                                   msg=lambda m: f"{where}: weights by id: {m}")
        return
    assert torch.equal(ids, want.ids), f"{where}: ids differ in {(ids != want.ids).any(1).sum()} rows"
    if spec.family == "gpt_oss" and dtype != torch.float32:  # 1 ulp of the logits' dtype
        torch.testing.assert_close(weights, want.weights, rtol=torch.finfo(dtype).eps, atol=2.0**-24,
                                   msg=lambda m: f"{where}: weights: {m}")
    else:
        assert torch.equal(weights, want.weights), (
            f"{where}: weights differ, max |d| = {(weights - want.weights).abs().max().item():.3g}")


def check(logits, spec, budget=None, bias=None, token_weights=None, where=""):
    want = route_experts(logits, spec, budget, bias, token_weights=token_weights)
    got = route_experts(on_cuda(logits), spec, budget, on_cuda(bias), token_weights=on_cuda(token_weights))
    assert_same_routing(got, want, spec, logits.dtype, where)
    return got, want


@pytest.mark.parametrize("budget_name", list(BUDGETS))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_cuda_equals_cpu(family, dtype, budget_name):
    capped = 0
    for T in T_SIZES:
        for N in N_SIZES:
            if family == "deepseek_v3_grouped" and N < 16:  # 8 groups of at least 2 experts
                continue
            for k in K_SIZES:
                spec = FAMILIES[family](k)
                budget = BUDGETS[budget_name](k, N)
                seed = SEED + 1000 * T + N
                logits = make_logits(T, N, dtype, seed)
                bias = make_bias(N, seed) if spec.family == "deepseek_v3" else None
                _, want = check(logits, spec, budget, bias, where=f"T={T} N={N} k={k}")
                capped += want.stats.rerouted + want.stats.dropped > 0
    if budget_name != "none":
        assert capped > 0, "no case re-routed a slot: the budget cases test nothing"


@pytest.mark.parametrize("policy", ["substitution", "truncation"])
@pytest.mark.parametrize("family", ["softmax_renormalize", "deepseek_v3_grouped", "gpt_oss"])
def test_token_weights(family, policy):
    gen = torch.Generator().manual_seed(SEED)
    for T, N, k in [(7, 64, 4), (64, 128, 8), (256, 256, 8), (64, 512, 2)]:
        spec = FAMILIES[family](k)
        logits = make_logits(T, N, torch.float32, SEED + T + N)
        token_weights = torch.rand(T, generator=gen)  # [T]
        token_weights[torch.rand(T, generator=gen) < 0.2] = 0.0  # pruned tokens weigh nothing
        bias = make_bias(N, SEED) if spec.family == "deepseek_v3" else None
        for budget in (ExpertBudget(max(k, N // 8), policy), ExpertBudget(N, policy, coverage=0.7)):
            check(logits, spec, budget, bias, token_weights, where=f"T={T} N={N} k={k} {budget}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("family", ["softmax", "softmax_renormalize", "gpt_oss"])
def test_ties_take_the_lower_id_first(family, dtype):
    """Integer logits tie often: the GPU orders (value desc, id asc); the CPU follows std's
    partial_sort/nth_element. The selected values and the weights agree slot by slot anyway."""
    gen = torch.Generator().manual_seed(SEED)
    for T, N, k in [(64, 8, 4), (64, 64, 8), (64, 256, 8), (7, 512, 1)]:
        logits = torch.randint(-3, 4, (T, N), generator=gen).to(dtype)  # [T, N]
        spec = FAMILIES[family](k)
        want = route_experts(logits, spec)
        got = route_experts(logits.to(CUDA), spec)
        ids = got.ids.cpu().long()
        values = logits.float().gather(1, ids)  # [T, K]
        assert torch.equal(values, logits.float().gather(1, want.ids.long())), "selected values differ"
        if spec.family == "gpt_oss" and dtype != torch.float32:
            torch.testing.assert_close(got.weights.cpu(), want.weights, rtol=torch.finfo(dtype).eps, atol=2.0**-24)
        else:
            assert torch.equal(got.weights.cpu(), want.weights)
        # (value desc, id asc) along the slots...
        later = (values[:, :-1] > values[:, 1:]) | ((values[:, :-1] == values[:, 1:]) & (ids[:, :-1] < ids[:, 1:]))
        assert bool(later.all()), "CUDA slots are not ordered by (value desc, id asc)"
        # ...and at the boundary the lowest ids among the tied values win.
        last_value, last_id = values[:, -1:], ids[:, -1:]
        unselected = torch.ones(T, N, dtype=torch.bool).scatter_(1, ids, False)
        tied_lower = unselected & (logits.float() == last_value) & (torch.arange(N) < last_id)
        assert not bool(tied_lower.any()), "a tied expert with a lower id was passed over"


@pytest.mark.parametrize("score", ["probability", "gates"])
@pytest.mark.parametrize("N", [8, 256, 512], ids=lambda n: f"N{n}")  # ranks counted up to 256, sorted beyond
def test_tied_budget_scores_admit_the_lower_id(N, score):
    """Experts lo < hi whose budget scores (and first-choice marks) tie exactly, ahead of the rest: a
    budget of one admits lo, as the CPU's stable order does, and every token routes to it."""
    lo, mid, hi = 2, N // 2, N - 3
    if score == "gates":  # two tokens mirror each other: each chooses one of lo, hi with weight 1
        logits = torch.full((2, N), -4.0)  # [T, N]
        logits[0, lo], logits[0, hi], logits[1, lo], logits[1, hi] = 3.0, 1.0, 1.0, 3.0
    else:  # two equal rows tie lo and hi (the same values summed in the same order); a third chooses mid
        logits = torch.full((3, N), -4.0)
        logits[:2, lo], logits[:2, hi] = 3.0, 3.0
        logits[2] = 0.0
        logits[2, mid] = 1.0
    spec = RouterSpec("softmax", 1, True)
    for budget in (ExpertBudget(1, score=score), ExpertBudget(1, "truncation", score=score)):
        got, want = check(logits, spec, budget, where=f"N={N} {budget}")
        assert set(want.active_padded.tolist()) - {N} == {lo}, "the CPU's set is not the lower id"
        assert got.stats_tensor.tolist()[:2] == [2, 1]


def test_zero_tokens():
    spec = RouterSpec("softmax", 4, True)
    logits = torch.empty(0, 64)
    got = route_experts(logits.to(CUDA), spec, ExpertBudget(8))
    assert got.ids.shape == (0, 4) and got.weights.shape == (0, 4)
    assert torch.equal(got.active_padded.cpu(), torch.full((64,), 64, dtype=torch.int32))
    assert torch.equal(got.stats_tensor.cpu(), torch.zeros(4, dtype=torch.int32))


def test_strided_rows_and_odd_sizes():
    """Rows with a stride larger than N; N not a multiple of 32; K up to 64; N = 1024."""
    for T, N, k, dtype in [(5, 33, 3, torch.float32), (13, 100, 64, torch.bfloat16), (3, 1024, 64, torch.float16),
                           (9, 1, 1, torch.float32), (2, 1000, 17, torch.float32)]:
        wide = make_logits(T, N + 7, dtype, SEED + N)
        logits = wide[:, 3:N + 3]  # [T, N], row stride N + 7
        B = max(k, N // 3)
        for spec in (RouterSpec("softmax", k, True), RouterSpec("gpt_oss", k)):
            for budget in (None, ExpertBudget(B), ExpertBudget(B, "truncation", coverage=0.9)):
                check(logits, spec, budget, where=f"T={T} N={N} k={k} {spec} {budget}")


def test_bias_absent_and_scaling():
    for n_group, topk_group in [(1, 1), (4, 2), (16, 3)]:
        spec = RouterSpec("deepseek_v3", 6, False, n_group=n_group, topk_group=topk_group, scaling=1.5)
        logits = make_logits(37, 128, torch.float32, SEED + n_group)
        for budget in (None, ExpertBudget(12), ExpertBudget(12, "truncation")):
            check(logits, spec, budget, None, where=f"groups {n_group}/{topk_group} {budget}")


@pytest.mark.parametrize("fused", ["1", "0"], ids=["one_launch", "four_launches"])
def test_both_launch_paths_at_verify_sizes(fused, monkeypatch):
    """Decode and verify sizes take the one-block kernel; MOESPEC_ROUTE_FUSED=0 the four launches:
    both equal the CPU op."""
    monkeypatch.setenv("MOESPEC_ROUTE_FUSED", fused)
    for family in ("softmax_renormalize", "deepseek_v3_grouped", "gpt_oss"):
        for T in (1, 16, 64):
            for N in (64, 128, 256):
                spec = FAMILIES[family](8)
                for budget_name in ("none", "substitution", "truncation", "coverage", "gates"):
                    seed = SEED + 7 * T + N
                    logits = make_logits(T, N, torch.bfloat16, seed)
                    bias = make_bias(N, seed) if spec.family == "deepseek_v3" else None
                    check(logits, spec, BUDGETS[budget_name](8, N), bias, where=f"{family} T={T} N={N} {budget_name}")


@st.composite
def routing_cases(draw):
    family = draw(st.sampled_from(["softmax", "deepseek_v3", "gpt_oss"]))
    n = draw(st.sampled_from([8, 16, 48, 64, 128, 160, 256, 512]))
    k = draw(st.integers(1, 8))
    t = draw(st.integers(1, 300))
    dtype = draw(st.sampled_from(DTYPES))
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
        budget = ExpertBudget(draw(st.integers(k, n + 4)), draw(st.sampled_from(["substitution", "truncation"])),
                              coverage, draw(st.sampled_from(["probability", "gates"])))
    seed = draw(st.integers(0, 2**31 - 1))
    logits = make_logits(t, n, dtype, seed)
    bias = make_bias(n, seed) if family == "deepseek_v3" and draw(st.booleans()) else None
    token_weights = None
    if budget is not None and draw(st.booleans()):
        token_weights = torch.rand(t, generator=torch.Generator().manual_seed(seed + 2))  # [T]
    return logits, spec, budget, bias, token_weights


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(routing_cases())
def test_cuda_equals_cpu_hypothesis(case):
    logits, spec, budget, bias, token_weights = case
    check(logits, spec, budget, bias, token_weights, where=f"{spec} {budget}")


@pytest.mark.parametrize("family", ["softmax_renormalize", "deepseek_v3_grouped", "gpt_oss"])
def test_cuda_graph_capture_and_replay(family):
    """One capture, replays with new logits copied into the static input: each equals the CPU op."""
    T, N, k = 48, 128, 8
    spec = FAMILIES[family](k)
    budget = ExpertBudget(16)
    bias = make_bias(N, SEED) if spec.family == "deepseek_v3" else None
    static_logits = make_logits(T, N, torch.bfloat16, SEED).to(CUDA)  # [T, N]
    static_bias = on_cuda(bias)
    graph, out = captured(lambda: route_experts(static_logits, spec, budget, static_bias))
    for seed in range(SEED + 1, SEED + 6):
        logits = make_logits(T, N, torch.bfloat16, seed)
        static_logits.copy_(logits)
        graph.replay()
        torch.cuda.synchronize()
        want = route_experts(logits, spec, budget, bias)
        assert want.stats.rerouted > 0, "the budget should bind for this case"
        assert_same_routing(out, want, spec, torch.bfloat16, where=f"replay seed {seed}")


def test_workspace_too_small_is_a_value_error():
    T, N, k = 4, 64, 2
    logits = torch.randn(T, N, device=CUDA)
    ids = torch.empty(T, k, dtype=torch.int32, device=CUDA)
    weights = torch.empty(T, k, device=CUDA)
    active = torch.empty(N, dtype=torch.int32, device=CUDA)
    stats = torch.empty(4, dtype=torch.int32, device=CUDA)
    need = native().route_experts_workspace_size(T, N, k)
    workspace = torch.empty(need - 1, dtype=torch.uint8, device=CUDA)
    with pytest.raises(ValueError, match="workspace"):
        native().route_experts(view(logits, "router_logits"), None, None, view(ids, "ids"), view(weights, "weights"),
                               view(active, "active"), view(stats, "stats"), 0, k, True, 1, 1, 1.0, 0, 0, 0.0, 0, 8,
                               view(workspace, "workspace"), torch.cuda.current_stream().cuda_stream)


@pytest.mark.parametrize("where", ["logits", "bias", "token_weights"])
def test_non_finite_input_is_a_value_error_as_on_the_cpu(where):
    T, N = 9, 64
    g = torch.Generator().manual_seed(SEED)
    logits, bias, tw = torch.randn(T, N, generator=g), torch.randn(N, generator=g), torch.rand(T, generator=g)
    spec = RouterSpec("deepseek_v3", 4, True, n_group=1, topk_group=1) if where == "bias" else RouterSpec("softmax", 4)
    if where == "logits":
        logits[3, 5] = float("nan")
    elif where == "bias":
        bias[5] = float("inf")
    else:
        tw[2] = float("nan")
    args = dict(bias=bias if where == "bias" else None, token_weights=tw if where == "token_weights" else None)
    budget = ExpertBudget(8)
    with pytest.raises(ValueError, match="non-finite|must be finite"):  # (the CPU checks token_weights first)
        route_experts(logits, spec, budget, **args)
    cuda = {k: (v.to(CUDA) if v is not None else None) for k, v in args.items()}
    with pytest.raises(ValueError, match=f"non-finite.*at {T if where == 'bias' else 1} of {T} tokens"):
        route_experts(logits.to(CUDA), spec, budget, **cuda)
    r = route_experts(logits.to(CUDA), spec, budget, **cuda, check_finite=False)  # no sync, no check, no crash
    torch.cuda.synchronize()
    assert int(r.ids.min()) >= 0 and int(r.ids.max()) <= N
    clean = route_experts(torch.randn(T, N, device=CUDA), spec, budget)  # the count is per call
    assert clean.ids.shape == (T, 4)
