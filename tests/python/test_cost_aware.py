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
