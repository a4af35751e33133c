"""The cost-aware selection's plain-Python reference (python/moespec/spec/cost_aware.py), by hypothesis:
ancestor-closed, EAGLE-2's selection at zero cost, a node inside the buffer costs only its token,
and every chosen node paid for itself when it was chosen."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from moespec.spec.cost_aware import SelectionCosts, marginal_cost, select_cost_aware, select_cost_aware_native


@st.composite
def candidates(draw):
    C = draw(st.integers(1, 24))
    L, K, N = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(4, 9))
    parents, depth, scores = [], [], []
    for c in range(C):
        p = draw(st.integers(-1, c - 1)) if c else -1
        parents.append(p)
        depth.append(1 if p < 0 else depth[p] + 1)
        step = float(np.float32(draw(st.floats(-3.0, 0.0, allow_nan=False))))
        scores.append((scores[p] if p >= 0 else 0.0) + step)
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    predicted = np.stack([np.stack([rng.choice(N, K, replace=False) for _ in range(L)]) for _ in range(C)])
    buffer = rng.random((L, N)) < 0.3
    return parents, depth, scores, predicted, buffer


def _eagle2(parents, depth, scores, total):
    order = sorted(range(len(parents)), key=lambda c: (-scores[c], depth[c], c))
    return sorted(order[:total])


@settings(max_examples=150, deadline=None)
@given(candidates(), st.integers(1, 30), st.sampled_from([0.0, 0.125, 0.5, 1.0]), st.sampled_from([0.0, 0.0625, 0.25]))
def test_selection_invariants(cands, total, token_s, expert_s):
    parents, depth, scores, predicted, buffer = cands
    L = predicted.shape[1]
    costs = SelectionCosts(1.0, token_s, np.full(L, expert_s))
    chosen = select_cost_aware(parents, depth, scores, predicted, buffer, costs, total)
    assert len(chosen) <= min(total, len(parents)) and len(set(chosen)) == len(chosen)
    seen = set()
    buf = buffer.copy()
    for c in chosen:  # ancestor-closed, in order, and every node paid for itself when it was chosen
        assert parents[c] < 0 or parents[c] in seen
        gain = math.exp(scores[c]) - marginal_cost(predicted[c], buf, costs)
        assert gain > 0 or (token_s == 0 and expert_s == 0)
        seen.add(c)
        for layer in range(L):
            buf[layer, predicted[c, layer]] = True
    zero = SelectionCosts(1.0, 0.0, np.zeros(L))
    assert sorted(select_cost_aware(parents, depth, scores, predicted, buffer, zero, total)) == \
        _eagle2(parents, depth, scores, total)
    # the C++ tree core chooses the same nodes in the same order
    assert select_cost_aware_native(parents, depth, scores, predicted, buffer, costs, total) == chosen
    assert select_cost_aware_native(parents, depth, scores, predicted, buffer, zero, total) == \
        select_cost_aware(parents, depth, scores, predicted, buffer, zero, total)


def test_a_node_inside_the_buffer_costs_only_its_token():
    predicted = np.array([[1, 3], [0, 2]])
    buffer = np.zeros((2, 5), dtype=bool)
    buffer[0, [1, 3]] = buffer[1, [0, 2, 4]] = True
    costs = SelectionCosts(1.0, 0.25, np.array([0.5, 2.0]))
    assert marginal_cost(predicted, buffer, costs) == 0.25
    buffer[1, 2] = False
    assert marginal_cost(predicted, buffer, costs) == 0.25 + 2.0


def test_cheap_branch_wins_over_a_likelier_expensive_one():
    """Two children of the root: the likelier one needs 2 new experts, the other none; with room for
    one node and experts priced above the difference in value, the cost-aware rule takes the cheap one."""
    parents, depth, scores = [-1, -1], [1, 1], [math.log(0.6), math.log(0.5)]
    predicted = np.array([[[3, 4]], [[0, 1]]])
    buffer = np.zeros((1, 5), dtype=bool)
    buffer[0, [0, 1]] = True
    costs = SelectionCosts(1.0, 0.0, np.array([0.1]))
    assert select_cost_aware(parents, depth, scores, predicted, buffer, costs, 1) == [1]
    assert select_cost_aware(parents, depth, scores, predicted, buffer, SelectionCosts(1.0, 0.0, np.zeros(1)), 1) == [0]


def test_native_selection_names_bad_arguments():
    import pytest

    costs = SelectionCosts(1.0, 0.0, np.zeros(1))
    buffer = np.zeros((1, 4), dtype=bool)
    with pytest.raises(ValueError, match="parents"):
        select_cost_aware_native([1, -1], [1, 1], [0.0, 0.0], np.zeros((2, 1, 1)), buffer, costs, 2)
    with pytest.raises(ValueError, match="predicted"):
        select_cost_aware_native([-1], [1], [0.0], np.full((1, 1, 1), 4), buffer, costs, 1)
    with pytest.raises(ValueError, match="total_tokens"):
        select_cost_aware_native([-1], [1], [0.0], np.zeros((1, 1, 1)), buffer, costs, 0)
    with pytest.raises(ValueError, match="scores"):
        select_cost_aware_native([-1], [1], [float("nan")], np.zeros((1, 1, 1)), buffer, costs, 1)


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
    zero = SelectionCosts(1.0, 0.0, np.zeros(1))
    for b in range(B):
        c = builder.candidates(b)
        chosen = select_cost_aware_native(c.parents.numpy(), c.depth.numpy(), c.scores.numpy(),
                                          np.zeros((len(c.tokens), 1, 1)), np.zeros((1, 2), dtype=bool), zero, M)
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
    dense = write_checkpoint("llama", tmp_path / "llama")
    with pytest.raises(ValueError, match="is dense"):
        LLM(dense, draft=_head_folder(tmp_path / "dense_draft", mm.load(dense, "bf16")),
            speculative_config=SpeculativeConfig("eco"))
