"""The coactivation model (python/moespec/cost/relations.py, coactivation.py).

References written independently here: pair classes by walking ancestors, overlap counts by
enumerating pairs, Monte-Carlo unique experts of synthetic traces with known structure, and the
fitted density's moments integrated on a grid of our own.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moespec.cost.coactivation import CoactivationModel, expected_unique, fit_maxent
from moespec.cost.relations import (Group, canonical_tree, census, group_census, parse_tree,
                                    trace_pair_statistics)
from moespec.models.trace import Trace


def _classify(parents, i, j):
    """The class of nodes i < j of one tree, by walking up from j."""
    if parents[j] == i:
        return "parent"
    if parents[i] == parents[j] and parents[i] >= 0:
        return "sibling"
    up, d = parents[j], 1
    while up >= 0:
        if up == i:
            return "ancestor"
        up, d = parents[up], d + 1
    return "cousin"


trees = st.integers(1, 14).flatmap(lambda n: st.tuples(*[st.integers(0, max(i - 1, 0)) for i in range(n)]))


@settings(max_examples=60, deadline=None)
@given(trees)
def test_tree_census_equals_pair_enumeration(raw):
    parents = (-1,) + tuple(raw[1:])
    want = {r: 0 for r in ("parent", "sibling", "ancestor", "cousin")}
    for i, j in itertools.combinations(range(len(parents)), 2):
        want[_classify(parents, i, j)] += 1
    got = group_census(Group.tree(parents))
    assert {r: got[r] for r in want} == want and sum(got.values()) == len(parents) * (len(parents) - 1) // 2


@pytest.mark.parametrize("n, want", [(1, (0, 0, 0, 0)), (2, (1, 0, 0, 0)), (10, (9, 8, 25, 3)), (12, (11, 10, 35, 10))])
def test_chain_census(n, want):
    c = group_census(Group.chain(n))
    assert (c["seq1"], c["seq2"], c["seq4"], c["seq8"]) == want


def test_cross_pairs_and_bad_groups():
    assert census([Group.chain(3), Group.chain(2), Group.chain(1)])["cross"] == 3 * 2 + 3 * 1 + 2 * 1
    with pytest.raises(ValueError, match="earlier nodes"):
        Group.tree((-1, 1))
    with pytest.raises(ValueError, match="chain:<n>"):
        parse_tree("chain:x")
    with pytest.raises(ValueError, match="depth,top_k,total_tokens"):
        parse_tree("2,4")


@pytest.mark.parametrize("depth, top_k, total", [(2, 4, 4), (3, 4, 8), (6, 8, 32), (1, 3, 3), (4, 2, 10)])
def test_canonical_tree_shape(depth, top_k, total):
    parents = canonical_tree(depth, top_k, total)
    depths = [0] * len(parents)
    for i, p in enumerate(parents[1:], 1):
        assert 0 <= p < i
        depths[i] = depths[p] + 1
    assert len(parents) == min(total, sum(top_k ** d for d in range(1, depth + 1))) + 1
    assert max(depths) <= depth
    assert max(sum(1 for q in parents if q == p) for p in range(len(parents))) <= top_k


# ---- statistics of a trace against pair enumeration ---------------------------------------------


def _synthetic_trace(rng, *, N, K, L, requests, tokens, strength, tree=None):
    """Requests whose tokens share a per-request preference over experts (Plackett-Luce: a token's
    top-K of request logits + Gumbel noise); ``strength`` 0 = independent uniform routing. One
    prefill pass per request, or verify passes of ``tree`` (parents) when given."""
    ids, pass_id, request, position, parent = [], [], [], [], []
    row = 0
    for r in range(requests):
        pref = strength * rng.gumbel(size=(L, N))
        n = len(tree) if tree is not None else tokens
        for t in range(n):
            ids.append(np.argsort(-(pref + rng.gumbel(size=(L, N))), axis=1)[:, :K])
            pass_id.append(r)
            request.append(r)
            if tree is None:
                position.append(t)
                parent.append(-1)
            else:
                depth, p = 0, tree[t]
                while p >= 0:
                    depth, p = depth + 1, tree[p]
                position.append(depth)
                parent.append(row - t + tree[t] if tree[t] >= 0 else -1)
            row += 1
    R = len(ids)
    return Trace(np.stack(ids), np.ones((R, L, K)) / K, pass_id, np.full(R, 0 if tree is None else 2, np.int8),
                 request, position, parent, N, K, np.arange(L))


def test_pair_statistics_equal_enumeration():
    rng = np.random.default_rng(3)
    tree = (-1, 0, 0, 1, 1, 2, 0)
    t = _synthetic_trace(rng, N=7, K=2, L=2, requests=5, tokens=0, strength=1.0, tree=tree)
    chains = _synthetic_trace(rng, N=7, K=2, L=2, requests=3, tokens=13, strength=1.0)
    for trace, kinds in ((t, ("parent", "sibling", "ancestor", "cousin")), (chains, ("seq1", "seq2", "seq4", "seq8"))):
        stats = trace_pair_statistics(trace)
        want = {r: np.zeros((2, 7)) for r in kinds}
        pairs = {r: 0 for r in kinds}
        for a, b in trace.passes():
            for i, j in itertools.combinations(range(a, b), 2):
                if trace.parent[a] >= 0 or trace.kind[a] == 2:
                    r = _classify(tuple(p - a if p >= 0 else -1 for p in trace.parent[a:b]), i - a, j - a)
                else:
                    d = abs(int(trace.position[j]) - int(trace.position[i]))
                    r = "seq1" if d == 1 else "seq2" if d == 2 else "seq4" if d < 8 else "seq8"
                pairs[r] += 1
                for layer in range(2):
                    for e in set(trace.ids[i, layer]) & set(trace.ids[j, layer]):
                        want[r][layer, e] += 1
        for r in kinds:
            assert stats.pairs[r] == pairs[r]
            np.testing.assert_allclose(stats.co[r], want[r])


# ---- the model against Monte-Carlo truth --------------------------------------------------------


def _mc_unique(rng, *, N, K, L, strength, groups, passes=3000):
    """Mean unique experts per layer of passes of the synthetic generator."""
    total = 0.0
    for _ in range(passes):
        rows = []
        for g in groups:
            pref = strength * rng.gumbel(size=(L, N))
            rows += [np.argsort(-(pref + rng.gumbel(size=(L, N))), axis=1)[:, :K] for _ in range(g.n)]
        ids = np.stack(rows)
        total += np.mean([len(np.unique(ids[:, layer])) for layer in range(L)])
    return total / passes


def test_independent_uniform_routing_gives_the_uniform_formula():
    N, K = 32, 4
    model = CoactivationModel(N, K, [0, 1], np.full((2, N), K / N), {r: np.ones((2, N)) for r in _RELATIONS()},
                              {r: 10 for r in _RELATIONS()}, {})
    for groups in ([Group.chain(8)], [parse_tree("3,4,8")] * 3, [Group.chain(1)] * 5):
        n = sum(g.n for g in groups)
        uniform = N * (1 - (1 - K / N) ** n)
        np.testing.assert_allclose(expected_unique(model, groups), uniform, rtol=1e-6)
        np.testing.assert_allclose(model.predict(groups, "uniform"), uniform)


def _RELATIONS():
    from moespec.cost.relations import RELATIONS

    return RELATIONS


@pytest.mark.parametrize("tree", [(-1, 0, 0, 1, 1), (-1, 0, 1, 2, 3, 0, 5, 0)])
def test_strong_co_routing_ipf_within_3_percent_independence_off_by_10(tree):
    """Fitted on one synthetic trace (trees), predicted for passes of 1 and 2 such requests and for
    chains, against Monte-Carlo passes of the same generator."""
    rng = np.random.default_rng(0)
    N, K, L, strength = 24, 3, 2, 1.0
    fit_trace = _synthetic_trace(rng, N=N, K=K, L=L, requests=1500, tokens=0, strength=strength, tree=tree)
    model = CoactivationModel.fit(fit_trace)
    for groups in ([Group.tree(tree)], [Group.tree(tree)] * 2):
        truth = _mc_unique(rng, N=N, K=K, L=L, strength=strength, groups=groups)
        ipf = expected_unique(model, groups).mean()
        independent = model.predict(groups, "independent").mean()
        assert abs(ipf / truth - 1) < 0.03, (ipf, truth)
        assert abs(independent / truth - 1) > 0.10, (independent, truth)


def test_fit_matches_its_constraints():
    """The fitted density's E[pi] and E[pi^2], integrated on a fine uniform grid of our own (not the
    solver's quadrature), equal the targets; with cross coupling the solver's own moments do."""
    rng = np.random.default_rng(1)
    E = 40
    p = rng.uniform(0.02, 0.4, E)
    q = p * p + rng.uniform(0.05, 0.6, E) * p * (1 - p)
    fit = fit_maxent([6], [1], p, q[None], p * p)
    assert fit.residual < 1e-6
    grid = (np.arange(200_000) + 0.5) / 200_000
    for e in range(E):
        w = np.exp(fit.a[0, e] * grid + fit.b[0, e] * grid**2)
        w /= w.sum()
        np.testing.assert_allclose([(w * grid).sum(), (w * grid**2).sum()], [p[e], q[e]], rtol=1e-5)
        np.testing.assert_allclose(1 - fit.p_none[e], 1 - (w * (1 - grid) ** 6).sum(), rtol=1e-5)
    for lift in (0.97, 1.03):  # weak cross-request (anti-)co-routing, as measured on the default engine
        fit = fit_maxent([4, 2], [2, 1], p[:8], np.stack([q[:8], q[:8]]), lift * p[:8] ** 2)
        assert fit.residual < 1e-5 and (np.sign(fit.c) == np.sign(lift - 1)).all()


def test_weak_coupling_matches_the_exact_joint_fit():
    rng = np.random.default_rng(2)
    N, L = 12, 1
    p = rng.dirichlet(np.ones(N)) * 3
    lifts = {r: np.full((L, N), 1.4) for r in _RELATIONS()}
    for cross in (0.97, 1.03):
        lifts["cross"] = np.full((L, N), cross)
        model = CoactivationModel(N, 3, [0], p[None], lifts, {r: 1 for r in _RELATIONS()}, {})
        groups = [parse_tree("2,4,4")] * 3
        exact = expected_unique(model, groups, cross="exact")
        linear = expected_unique(model, groups)
        none = expected_unique(model, groups, cross="none")
        assert abs(linear / exact - 1) < 0.003 and abs(none / exact - 1) > abs(linear / exact - 1)


def test_model_file_round_trip_and_errors(tmp_path):
    rng = np.random.default_rng(4)
    model = CoactivationModel.fit(_synthetic_trace(rng, N=9, K=2, L=3, requests=20, tokens=6, strength=1.0))
    path = model.save(tmp_path / "m.json")
    back = CoactivationModel.load(path)
    np.testing.assert_allclose(back.marginals, model.marginals)
    groups = [Group.chain(5)] * 2
    np.testing.assert_allclose(expected_unique(back, groups), expected_unique(model, groups))
    (tmp_path / "bad.json").write_text('{"format": "moespec-coactivation", "version": 1, "num_experts": 9}')
    with pytest.raises(ValueError, match="missing or malformed"):
        CoactivationModel.load(tmp_path / "bad.json")
    (tmp_path / "v.json").write_text('{"format": "moespec-coactivation", "version": 99}')
    with pytest.raises(ValueError, match="version 99"):
        CoactivationModel.load(tmp_path / "v.json")
    with pytest.raises(ValueError, match="does not exist"):
        CoactivationModel.load(tmp_path / "none.json")
    with pytest.raises(ValueError, match="predictor"):
        model.predict(groups, "magic")


# ---- the zero-training expert predictor (spec/expert_predictor.py) ------------------------------


def _decode_trace(ids: np.ndarray, N: int) -> Trace:
    """One request: a 1-token prefill, then one decode pass per token."""
    R, L, K = ids.shape
    return Trace(ids, np.ones((R, L, K)) / K, np.arange(R), np.r_[0, np.ones(R - 1)].astype(np.int8), np.zeros(R),
                 np.arange(R), -np.ones(R), N, K, np.arange(L))


def test_history_predictor_recall_bounds():
    from moespec.spec.expert_predictor import history_scores, predictor_recall, top_experts

    rng = np.random.default_rng(5)
    N, K, L, R = 16, 2, 3, 400
    same = np.broadcast_to(rng.choice(N, K, replace=False), (R, L, K)).copy()  # every token routes alike
    r = predictor_recall(_decode_trace(same, N), (1, 4))
    assert r["histories"]["1"]["node_recall"] == 1.0 and r["histories"]["4"]["node_recall"] == 1.0
    independent = np.stack([[rng.choice(N, K, replace=False) for _ in range(L)] for _ in range(R)])
    r = predictor_recall(_decode_trace(independent, N), (1, 8))
    for h in ("1", "8"):
        assert abs(r["histories"][h]["node_recall"] - K / N) < 0.03  # chance: nothing to predict from
    scores = history_scores(np.array([[[3, 1]], [[1, 2]]]), np.array([[[0.6, 0.4]], [[0.5, 0.5]]]), 4, decay=0.5)
    np.testing.assert_allclose(scores, [[0.0, 0.5 * 0.4 + 0.5, 0.5, 0.5 * 0.6]])  # the newest token weighs 1
    assert top_experts(scores, 2).tolist() == [[1, 2]]
    assert top_experts(np.array([[0.0, 1.0, 1.0]]), 1).tolist() == [[1]]  # ties: the lower id
