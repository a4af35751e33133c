"""The cost-aware selection's plain-Python reference (python/moespec/spec/cost_aware.py) and the C++
tree core, by hypothesis: ancestor-closed, EAGLE-2's selection at zero cost, a node inside the buffer
costs only its token, every chosen node lowered the step's time per token when it was chosen, and the
two implementations choose the same nodes in the same order with the same buffer, S and A."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moespec.spec.cost_aware import (SelectionCosts, add_to_buffer, marginal_cost, select_cost_aware,
                                     select_cost_aware_native)


@st.composite
def candidates(draw):
    C = draw(st.integers(1, 24))
    L, K, N = draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.integers(4, 9))
    parents, depth, scores = [], [], []
    for c in range(C):
        p = draw(st.integers(-1, c - 1)) if c else -1
        parents.append(p)
        depth.append(1 if p < 0 else depth[p] + 1)
        step = float(np.float32(draw(st.floats(-3.0, 0.0, allow_nan=False))))
        scores.append((scores[p] if p >= 0 else 0.0) + step)
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    repeats = draw(st.booleans())  # ids may repeat within a layer's prediction (counted once)
    predicted = np.stack([np.stack([rng.choice(N, K, replace=repeats) for _ in range(L)]) for _ in range(C)])
    soft = draw(st.booleans())
    predicted_p = rng.random((C, L, K)).astype(np.float32) if soft else None
    buffer = (rng.random((L, N)) * (rng.random((L, N)) < 0.3) if soft else rng.random((L, N)) < 0.3)
    return parents, depth, scores, predicted, predicted_p, buffer.astype(np.float32)


def _eagle2(parents, depth, scores, total):
    order = sorted(range(len(parents)), key=lambda c: (-scores[c], depth[c], c))
    return sorted(order[:total])


@settings(max_examples=200, deadline=None)
@given(candidates(), st.integers(1, 30), st.sampled_from([0.0, 0.125, 0.5, 1.0]),
       st.sampled_from([0.0, 0.0625, 0.25]), st.sampled_from([0.0, 0.5, 2.0, 8.0]), st.sampled_from([1.0, 2.5]))
def test_selection_invariants(cands, total, token_s, expert_s, step_s, accepted):
    parents, depth, scores, predicted, predicted_p, buffer = cands
    scores = [float(np.float32(x)) for x in scores]
    L = predicted.shape[1]
    costs = SelectionCosts(token_s, np.full(L, expert_s))
    ref_buffer = buffer.copy()
    chosen, S, A = select_cost_aware(parents, depth, scores, predicted, predicted_p, ref_buffer, costs, total,
                                     step_s=step_s, accepted=accepted)
    assert len(chosen) <= min(total, len(parents)) and len(set(chosen)) == len(chosen)
    seen, buf, s, a = set(), buffer.copy(), step_s, accepted
    for c in chosen:  # ancestor-closed, in order, and every node lowered S / A when it was chosen
        assert parents[c] < 0 or parents[c] in seen
        p = None if predicted_p is None else predicted_p[c]
        cost = marginal_cost(predicted[c], p, buf, costs)
        gain = s / a * math.exp(scores[c]) - cost
        assert gain > 0 or (token_s == 0 and expert_s == 0)
        if gain > 0:
            assert (s + cost) / (a + math.exp(scores[c])) < s / a
        seen.add(c)
        s, a = s + cost, a + math.exp(scores[c])
        add_to_buffer(buf, predicted[c], p)
    assert np.array_equal(buf, ref_buffer) and math.isclose(S, s) and math.isclose(A, a)
    zero = SelectionCosts(0.0, np.zeros(L))
    zero_chosen = select_cost_aware(parents, depth, scores, predicted, predicted_p, buffer.copy(), zero, total,
                                    step_s=step_s, accepted=accepted).chosen
    assert sorted(zero_chosen) == _eagle2(parents, depth, scores, total)
    # the C++ tree core chooses the same nodes in the same order, with the same buffer, S and A
    native_buffer = buffer.copy()
    got = select_cost_aware_native(parents, depth, scores, predicted, predicted_p, native_buffer, costs, total,
                                   step_s=step_s, accepted=accepted)
    assert got.chosen == chosen and np.array_equal(native_buffer, ref_buffer)
    assert math.isclose(got.step_s, S, rel_tol=1e-12, abs_tol=1e-12) and math.isclose(got.accepted, A, rel_tol=1e-12)
    assert select_cost_aware_native(parents, depth, scores, predicted, predicted_p, buffer.copy(), zero, total,
                                    step_s=step_s, accepted=accepted).chosen == zero_chosen


def test_a_node_inside_the_buffer_costs_only_its_token():
    predicted = np.array([[1, 3], [0, 2]])
    buffer = np.zeros((2, 5), dtype=np.float32)
    buffer[0, [1, 3]] = buffer[1, [0, 2, 4]] = 1.0
    costs = SelectionCosts(0.25, np.array([0.5, 2.0]))
    assert marginal_cost(predicted, None, buffer, costs) == 0.25
    buffer[1, 2] = 0.0
    assert marginal_cost(predicted, None, buffer, costs) == 0.25 + 2.0
    # soft: an expert predicted with probability 0.5, already read with probability 0.5, costs a quarter
    buffer[1, 2] = 0.5
    assert marginal_cost(predicted, np.array([[1.0, 1.0], [1.0, 0.5]], np.float32), buffer, costs) == 0.25 + 0.5


def test_cheap_branch_wins_over_a_likelier_expensive_one():
    """Two children of the root: the likelier one needs 2 new experts, the other none; with room for
    one node and experts priced above the difference in value, the cost-aware rule takes the cheap one."""
    parents, depth, scores = [-1, -1], [1, 1], [math.log(0.6), math.log(0.5)]
    predicted = np.array([[[3, 4]], [[0, 1]]])
    buffer = np.zeros((1, 5), dtype=np.float32)
    buffer[0, [0, 1]] = 1.0

    def pick(costs):
        return select_cost_aware(parents, depth, scores, predicted, None, buffer.copy(), costs, 1, step_s=1.0).chosen

    assert pick(SelectionCosts(0.0, np.array([0.1]))) == [1]
    assert pick(SelectionCosts(0.0, np.zeros(1))) == [0]


def test_a_dearer_step_keeps_more_nodes():
    """The value of an accepted token is the step's time per token S / A: the same chain of nodes
    (acceptance 0.8, 0.64, 0.51, ...; each one new expert at 0.1) is kept deeper when the step costs more."""
    C = 6
    parents, depth = [-1] + list(range(C - 1)), list(range(1, C + 1))
    scores = [math.log(0.8) * (d) for d in depth]
    predicted = np.arange(C).reshape(C, 1, 1)
    costs = SelectionCosts(0.0, np.array([0.1]))

    def kept(step_s):
        buffer = np.zeros((1, C), dtype=np.float32)
        return len(select_cost_aware(parents, depth, scores, predicted, None, buffer, costs, C, step_s=step_s).chosen)

    assert kept(0.05) == 0 and 0 < kept(0.2) < kept(1.0) <= C
    assert kept(1.0) == len(select_cost_aware_native(parents, depth, scores, predicted, None,
                                                     np.zeros((1, C), np.float32), costs, C, step_s=1.0).chosen)


def test_acceptance_calibration_learns_an_underconfident_head():
    """Before any outcome the map is EAGLE-2's exp(s); fed nodes accepted with probability
    sqrt(exp(s)) (a head that says 0.2 where 0.45 is true) it raises mid-range acceptance, stays
    increasing (a child never outranks its parent) and keeps -inf."""
    from moespec.spec.cost_aware import AcceptanceCalibration

    cal = AcceptanceCalibration(refit_every=1)
    grid = np.log(np.array([0.01, 0.05, 0.1, 0.2, 0.4, 0.7, 0.95]))
    assert np.allclose(np.exp(cal.log_accept(grid)), np.exp(grid), rtol=1e-5)
    rng = np.random.default_rng(0)
    for _ in range(40):
        s = np.log(rng.uniform(0.01, 0.9, 64))
        cal.observe(s, rng.random(64) < np.sqrt(np.exp(s)))
    a = np.exp(cal.log_accept(grid))
    assert 0.35 < a[3] < 0.55 and 0.5 < a[4] < 0.75  # true 0.45 and 0.63
    assert (np.diff(a) > 0).all() and cal.beta > 0
    assert cal.log_accept([-np.inf])[0] == -np.inf and len(cal.x) == 2560


def test_native_selection_names_bad_arguments():
    costs = SelectionCosts(0.0, np.zeros(1))

    def call(parents, scores, predicted, total=1, predicted_p=None, buffer=None, **kw):
        buffer = np.zeros((1, 4), dtype=np.float32) if buffer is None else buffer
        return select_cost_aware_native(parents, [1] * len(parents), scores, predicted, predicted_p, buffer, costs,
                                        total, **{"step_s": 1.0, **kw})

    with pytest.raises(ValueError, match="parents"):
        call([1, -1], [0.0, 0.0], np.zeros((2, 1, 1)), 2)
    with pytest.raises(ValueError, match="predicted"):
        call([-1], [0.0], np.full((1, 1, 1), 4))
    with pytest.raises(ValueError, match="total_tokens"):
        call([-1], [0.0], np.zeros((1, 1, 1)), 0)
    with pytest.raises(ValueError, match="scores"):
        call([-1], [float("nan")], np.zeros((1, 1, 1)))
    with pytest.raises(ValueError, match="predicted_p"):
        call([-1], [0.0], np.zeros((1, 1, 1)), predicted_p=np.full((1, 1, 1), 1.5, np.float32))
    with pytest.raises(ValueError, match="predicted_p"):
        call([-1], [0.0], np.zeros((1, 1, 1)), predicted_p=np.ones((1, 1, 2), np.float32))
    with pytest.raises(ValueError, match="buffer"):
        call([-1], [0.0], np.zeros((1, 1, 1)), buffer=np.full((1, 4), 2.0, np.float32))
    with pytest.raises(ValueError, match="buffer"):
        call([-1], [0.0], np.zeros((1, 1, 1)), buffer=np.zeros((1, 4), dtype=bool))
    with pytest.raises(ValueError, match="accepted"):
        call([-1], [0.0], np.zeros((1, 1, 1)), accepted=0.0)
    with pytest.raises(ValueError, match="step_s"):
        call([-1], [0.0], np.zeros((1, 1, 1)), step_s=-1.0)


# ---- the eco policies --------------------------------------------------------------------------------


def test_tree_from_selection_equals_eagle2s_tree_at_zero_cost():
    """The cost-aware tree built from a selection is the native builder's own tree when the selection
    is EAGLE-2's (zero costs): same tokens, parents, depths, masks and paths."""
    import torch

    from moespec.spec.tree import TreeBuilder, tree_from_selection

    gen = torch.Generator().manual_seed(3)
    B, K, D, M = 2, 3, 3, 7
    builder = TreeBuilder(B, depth=D, top_k=K, total_tokens=M)
    top = torch.log_softmax(torch.randn(B, 50, generator=gen), -1).topk(K)
    builder.expand_root([11, 12], top.indices, top.values)
    for _ in range(D - 1):
        top = torch.log_softmax(torch.randn(B, K, 50, generator=gen), -1).topk(K)
        builder.expand(top.indices, top.values)
    want = [t.clone() for t in builder.finalize()]
    zero = SelectionCosts(0.0, np.zeros(1))
    for b in range(B):
        c = builder.candidates(b)
        chosen = select_cost_aware_native(c.parents.numpy(), c.depth.numpy(), c.scores.numpy(),
                                          np.zeros((len(c.tokens), 1, 1)), None, np.zeros((1, 2), np.float32), zero,
                                          M, step_s=1.0).chosen
        got = tree_from_selection([11, 12][b], c, chosen)
        for name in ("tokens", "parents", "depth", "mask_words", "paths", "candidates"):
            assert torch.equal(getattr(got, name), getattr(want[b], name)), name
        assert torch.allclose(got.scores, want[b].scores)


def test_eco_policies_are_lossless_and_need_a_predictor(tmp_path):
    """Greedy eco and eco+budget (budget >= N) equal greedy ar token for token, batches included (the
    selection only chooses which drafted nodes are verified); clear errors without a predictor and on a
    dense target."""
    import sys
    from pathlib import Path

    import pytest
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from models_fixtures import write_checkpoint
    from test_bench import _head_folder

    import moespec.models as mm
    from moespec import LLM, SamplingParams, SpeculativeConfig
    from moespec.engine import build_engine
    from moespec.spec.expert_predictor import ExpertPredictor

    src = write_checkpoint("qwen3_moe", tmp_path / "source")
    draft = _head_folder(tmp_path / "draft", mm.load(src, "bf16"))
    torch.manual_seed(0)
    ExpertPredictor(torch.randn(2, 16, 128), torch.zeros(2, 16), torch.zeros(128), torch.ones(128)).save(tmp_path / "p")
    engine = build_engine(src, tmp_path / "engine", draft=draft, predictor=tmp_path / "p", progress=False).folder
    prompts = [[5, 17, 33, 64, 9], [3, 4, 120, 77, 13, 50, 8], [101, 2, 77]]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(engine, speculative_config=SpeculativeConfig("ar")).generate(
        prompts, params)]
    for policy, extra in (("eco", {}), ("eco+budget", {"budget": 16})):
        config = SpeculativeConfig(policy, depth=3, top_k=3, total_tokens=6, **extra)
        got = LLM(engine, speculative_config=config, max_batch_size=2).generate(prompts, params)
        assert [o.outputs[0].token_ids for o in got] == want, policy
    plain = build_engine(src, tmp_path / "plain", draft=draft, progress=False).folder
    with pytest.raises(ValueError, match="needs an expert predictor"):
        LLM(plain, speculative_config=SpeculativeConfig("eco"))
    with pytest.raises(ValueError, match="needs an expert predictor"):
        build_engine(src, tmp_path / "eco-without", draft=draft, speculation={"policy": "eco"}, progress=False)
    eco_engine = build_engine(src, tmp_path / "eco-engine", draft=draft, predictor=tmp_path / "p", progress=False,
                              speculation={"policy": "eco", "depth": 3, "top_k": 3, "total_tokens": 6}).folder
    default = LLM(eco_engine)  # the engine's default policy
    assert default.speculative_config.policy == "eco"
    assert [o.outputs[0].token_ids for o in default.generate(prompts, params)] == want
    dense = write_checkpoint("llama", tmp_path / "llama")
    with pytest.raises(ValueError, match="is dense"):
        LLM(dense, draft=_head_folder(tmp_path / "dense_draft", mm.load(dense, "bf16")),
            speculative_config=SpeculativeConfig("eco"))


def test_the_draft_stops_when_a_deeper_level_cannot_pay():
    """worth_expanding at S / A = 50 ms, a draft level of 4 ms and a token of 2 ms: a frontier whose
    best node's children cannot pay their token, or whose nodes together cannot pay the level, stops
    the draft; inactive requests do not count; nothing stops before both times are measured."""
    from types import SimpleNamespace

    import torch

    from moespec.spec.cost_aware import CostAwareTrees

    target = SimpleNamespace(config=SimpleNamespace(moe=SimpleNamespace(num_experts=8, top_k=2)))
    predictor = SimpleNamespace(check_target=lambda config: None)
    trees = CostAwareTrees(target, predictor, SimpleNamespace(costs=SelectionCosts(0.002, np.zeros(1))), 8)

    def worth(*rows, active=None):
        scores = torch.log(torch.tensor(rows, dtype=torch.float32))
        return trees.worth_expanding(scores, [True] * len(rows) if active is None else active)

    assert worth([0.01, 0.01])  # nothing measured yet
    trees.rate, trees.level_s = 0.05, 0.004
    assert worth([0.5, 0.1])
    assert not worth([0.03, 0.01])  # 50 ms x 0.03 < 2 ms: no child pays its token
    assert not worth([0.05, 0.05])  # each child might pay its token, all together not the level
    assert not worth([0.03, 0.01], [0.9, 0.9], active=[True, False])
    assert worth([0.03, 0.01], [0.9, 0.9], active=[False, True])


def test_predictor_scores_native_bf16_equal_fp32_within_rounding():
    """Tree-sized inputs go through the native bf16 linear; their logits equal the plain fp32 ones
    within bf16 rounding, and the top experts agree wherever the margin exceeds it."""
    import torch

    from moespec.spec.expert_predictor import ExpertPredictor

    gen = torch.Generator().manual_seed(0)
    L, N, H = 3, 16, 24
    predictor = ExpertPredictor(torch.randn(L, N, 2 * H, generator=gen) * 0.2, torch.randn(L, N, generator=gen),
                                torch.randn(2 * H, generator=gen), torch.rand(2 * H, generator=gen) + 0.5)
    h, e = torch.randn(70, H, generator=gen), torch.randn(70, H, generator=gen)
    small = predictor.scores(h[:20], e[:20])  # native bf16
    exact = predictor.scores(h, e)[:20]  # 70 rows: fp32
    x = (torch.cat([h[:20], e[:20]], -1) - predictor.mean) / predictor.std
    want = torch.einsum("cd,lnd->cln", x, predictor.weight) + predictor.bias  # plain torch
    assert torch.allclose(exact, want, atol=1e-4)
    scale = x.abs().sum(-1).max() * predictor.weight.abs().max()
    assert (small - want).abs().max() <= 0.02 * scale


def test_the_cuda_batch_selection_names_what_is_wrong_off_the_gpu():
    """select_cost_aware_cuda and tree_from_selection_cuda take CUDA tensors (their results are checked
    on a GPU by tests/gpu/test_select_cost_aware_cuda.py); CPU tensors are refused by name, not
    crashed on."""
    import torch

    from moespec.spec.cost_aware import select_cost_aware_cuda

    z = torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises((ValueError, RuntimeError), match="parents|CUDA"):
        select_cost_aware_cuda(z, z + 1, torch.zeros(1, 2), torch.tensor([2], dtype=torch.int32),
                               torch.zeros(1, 2, 1, 1, dtype=torch.int32), None, torch.zeros(1, 4),
                               SelectionCosts(0.0, np.zeros(1)), 2, torch.tensor([1.0, 1.0], dtype=torch.float64))
    from moespec.spec.cost_aware import tree_from_selection_cuda

    with pytest.raises((ValueError, RuntimeError), match="selected|CUDA"):
        tree_from_selection_cuda(z, torch.tensor([1], dtype=torch.int32), z - 1, z, torch.zeros(1, dtype=torch.int32), 2)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**16), depth=st.integers(1, 3), top_k=st.integers(1, 3), total=st.integers(1, 8),
       inactive=st.booleans())
def test_the_gpu_selection_chooses_the_host_selections_trees(seed, depth, top_k, total, inactive):
    """CostAwareTrees.device_trees (the eco policies on a GPU: the round's candidates, the experts'
    prediction, select_cost_aware_cuda and tree_from_selection_cuda, on the virtual CUDA device of
    tests/python/virtual_cuda.py, whose kernels are the CPU selection and tree_from_selection) gives
    the trees of the host selection (CostAwareTrees.trees on the native core's round) for the same
    draft and the same opening S, padded to min(total_tokens, C) + 1 rows with copies of the root (parent -1,
    depth 0, the root's mask row); its values read back give the host's expected unique experts."""
    from types import SimpleNamespace

    import torch
    from hypothesis import assume
    from virtual_cuda import virtual_cuda

    from moespec.spec.cost_aware import CostAwareTrees
    from moespec.spec.expert_predictor import ExpertPredictor
    from moespec.spec.tree import TreeBuilder

    B, L, N, H, V = 3, 2, 8, 32, 50
    C = top_k + (depth - 1) * top_k ** 2
    assume(C <= 4 * total)  # (the GPU round keeps the best 4 x total_tokens candidates: here all of them)
    gen = torch.Generator().manual_seed(seed)
    embed = torch.randn(V, H, generator=gen)
    predictor = ExpertPredictor(torch.randn(L, N, 2 * H, generator=gen) * 0.3, torch.randn(L, N, generator=gen),
                                torch.zeros(2 * H), torch.ones(2 * H))
    config = SimpleNamespace(hidden_size=H, moe=SimpleNamespace(layers=list(range(L)), num_experts=N, top_k=2))
    costs = SelectionCosts(0.002, np.full(L, 0.004))
    pricer = SimpleNamespace(costs=costs, base_s=lambda requests, unique, rest_s=None: 0.03 + 0.002 * float(np.sum(unique)))
    roots = torch.randint(0, V, (B,), generator=gen)
    root_hidden = torch.randn(B, H, generator=gen)
    levels = [(torch.randint(0, V, (B, top_k), generator=gen), -torch.rand(B, top_k, generator=gen) * 2)]
    levels += [(torch.randint(0, V, (B, top_k, top_k), generator=gen), -torch.rand(B, top_k, top_k, generator=gen) * 2)
               for _ in range(depth - 1)]
    level_hidden = [torch.randn(B, top_k, H, generator=gen) for _ in range(depth - 1)]
    active = [True, not inactive, True]

    def round_on(builder, to):
        builder.expand_root(to(roots), *(to(t) for t in levels[0]))
        for tokens, logprobs in levels[1:]:
            builder.expand(to(tokens), to(logprobs))
        return builder

    host = CostAwareTrees(SimpleNamespace(weights=SimpleNamespace(embed=embed), config=config), predictor, pricer, total)
    host_builder = round_on(TreeBuilder(B, depth=depth, top_k=top_k, total_tokens=total), lambda t: t)
    want = host.trees(host_builder, roots.tolist(), root_hidden, level_hidden, active)
    with virtual_cuda():
        def cuda(t):
            return t.to("cuda")

        gpu = CostAwareTrees(SimpleNamespace(weights=SimpleNamespace(embed=cuda(embed)), config=config),
                             predictor.to("cuda"), pricer, total)
        gpu.root_unique = host.root_unique  # (the GPU's S opens at the last step's roots: here the host's)
        builder = round_on(TreeBuilder(B, depth=depth, top_k=top_k, total_tokens=gpu.candidate_cap(C), device="cuda"),
                           cuda)
        builder.finalize_device()
        got = gpu.device_trees(builder, cuda(root_hidden), [cuda(h) for h in level_hidden], active)
        got = [{k: getattr(t, k).cpu() for k in ("tokens", "parents", "depth", "mask_words", "scores", "candidates")}
               for t in got]
        read = torch.cat([t.reshape(-1).long() for t in gpu.to_read]).tolist()
    live = [b for b in range(B) if active[b]]
    for b, (g, w) in enumerate(zip(got, want)):
        n = w.num_nodes
        assert g["tokens"].shape[0] == min(total, C) + 1
        for k in ("tokens", "parents", "depth", "scores", "candidates"):
            assert torch.equal(g[k][:n].to(getattr(w, k).dtype), getattr(w, k)), (b, k)
        assert torch.equal(g["mask_words"][:n, :w.mask_words.shape[1]], w.mask_words), b
        assert (g["tokens"][n:] == int(roots[b])).all() and (g["parents"][n:] == -1).all()
        assert (g["depth"][n:] == 0).all() and (g["mask_words"][n:, 0] == 1).all()
        assert (g["mask_words"][n:, 1:] == 0).all()
    gpu.observe_step(0.1, paths=[[0]] * len(live), trees=[None] * len(live), live=live, read=read)
    np.testing.assert_allclose(gpu.predicted_unique, host.predicted_unique, rtol=1e-5)
    np.testing.assert_allclose(gpu.root_unique, host.root_unique, rtol=1e-5)
