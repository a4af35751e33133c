"""Acceptance of a verified tree (moespec.spec.sampling): greedy walks, and speculative sampling whose
emitted tokens follow the target's processed distribution exactly (checked statistically)."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from moespec.spec.sampling import SamplingParams, accept, greedy_choice, probabilities


def test_greedy_follows_matching_children_and_adds_the_bonus():
    # root -> a(5), b(6); a -> c(7); b -> d(8)
    tokens, parents = [0, 5, 6, 7, 8], [-1, 0, 0, 1, 2]
    logits = torch.full((5, 10), -5.0)
    logits[0, 6] = 1.0  # after the root the target wants 6: node b
    logits[2, 8] = 1.0  # after b it wants 8: node d
    logits[4, 3] = 1.0  # after d it wants 3: the bonus
    got = accept(tokens, parents, logits, SamplingParams())
    assert got.path == [0, 2, 4] and got.tokens == [6, 8, 3]
    logits[0, 6], logits[0, 9] = -9.0, 1.0  # now the root's argmax (9) matches no child
    got = accept(tokens, parents, logits, SamplingParams())
    assert got.path == [0] and got.tokens == [9]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 3000), st.sampled_from([torch.bfloat16, torch.float32]),
       st.sampled_from([None, 3]), st.integers(0, 2**31 - 1))
def test_greedy_choice_is_argmax_with_ties_to_the_first(rows, vocab, dtype, levels, seed):
    # (levels: logits rounded to a few values, so most rows have several maxima; plus -inf and NaN rows)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g)
    if levels:
        x = (x * levels).round()
    x[torch.rand(rows, vocab, generator=g) < 0.1] = float("-inf")
    if rows > 1:
        x[-1, int(torch.randint(vocab, (), generator=g))] = float("nan")
    x = x.to(dtype)
    assert torch.equal(greedy_choice(x), x.argmax(dim=-1))
    assert int(greedy_choice(x[0])) == int(x[0].argmax())


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 12), st.integers(0, 2**31 - 1))
def test_greedy_acceptance_equals_autoregressive_argmax(n, seed):
    g = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    tokens = [0] + [int(torch.randint(0, 6, (1,), generator=g)) for _ in range(1, n)]
    logits = torch.randn(n, 6, generator=g)
    got = accept(tokens, parents, logits, SamplingParams())
    # replay: every emitted token is the argmax at the node before it, and it stops at the first miss
    node = 0
    for i, tok in enumerate(got.tokens):
        assert tok == int(logits[node].argmax())
        if i + 1 < len(got.path):
            node = got.path[i + 1]
            assert tokens[node] == tok and parents[node] == got.path[i]
    assert len(got.tokens) == len(got.path)


def test_probabilities_apply_temperature_top_k_and_top_p():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    p = probabilities(logits, SamplingParams(temperature=1.0))
    assert torch.allclose(p, torch.softmax(logits, -1))
    p = probabilities(logits, SamplingParams(temperature=1.0, top_k=2))
    assert p[2] == 0 and p[3] == 0 and torch.isclose(p.sum(), torch.tensor(1.0))
    p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.7))  # softmax: .64 .24 .09 .03
    assert p[0] > 0 and p[1] > 0 and p[2] == 0 and p[3] == 0
    p = probabilities(logits, SamplingParams(temperature=0.5))
    assert torch.allclose(p, torch.softmax(logits / 0.5, -1))


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4),
                                    SamplingParams(temperature=1.3, top_p=0.8)])
@pytest.mark.parametrize("batched", [False, True], ids=["accept", "accept_trees"])
@pytest.mark.parametrize("first", [(0, 1, 2), (4, 5, 2)], ids=["unlikely-first", "likeliest-first"])
def test_speculative_sampling_emits_the_targets_distribution(params, batched, first):
    """Two emitted tokens' joint distribution against the target's p(x1) p(x2 | x1), over 15000
    draws; the tree drafts unlikely tokens first, or the likeliest (then a rejected sibling's mass
    is large: the later siblings' tests must renormalise), with a duplicate-free sibling order, and
    the tolerance is 4 standard errors of a multinomial frequency. ``accept_trees``: the tree in a
    batch beside a greedy request's (its values packed into the same copy back)."""
    from moespec.spec.sampling import accept_trees

    V = 6
    g = torch.Generator().manual_seed(0)
    # root children: tokens a, b, c (first); node for token a has children 3 and a; node for b has child 5
    a, b, c = first
    tokens, parents = [9, a, b, c, 3, a, 5], [-1, 0, 0, 0, 1, 1, 2]
    logits = torch.randn(7, V, generator=g) * 1.5  # (row 0: p(4) 0.45, p(5) 0.35 at temperature 1)
    # the target distribution after token x at the root: row of the node holding x, else the
    # continuation logits below (a node not in the tree): use row 0 of a fresh table for those
    off_tree = torch.randn(V, V, generator=g) * 1.5
    node_of = {a: 1, b: 2, c: 3}

    def p_next(x1):
        row = logits[node_of[x1]] if x1 in node_of else off_tree[x1]
        return probabilities(row, params)

    p1 = probabilities(logits[0], params)
    want = torch.stack([p1[x] * p_next(x) for x in range(V)])  # [V, V]
    counts = torch.zeros(V, V)
    draws = 15000
    tree, batch = _tree(tokens, parents), torch.stack([logits, logits.flip(0)])
    for _ in range(draws):
        if batched:
            got = accept_trees([tree, tree], batch, [params, SamplingParams()], [g, None], on_host=False)[0]
        else:
            got = accept(tokens, parents, logits, params, g)
        x1 = got.tokens[0]
        if len(got.tokens) >= 2:
            x2 = got.tokens[1]
        else:  # the tree ended at the root: the next token comes from the off-tree continuation
            x2 = int(torch.multinomial(p_next(x1), 1, generator=g))
        counts[x1, x2] += 1
    freq = counts / draws
    se = (want * (1 - want) / draws).sqrt()
    assert torch.all((freq - want).abs() <= 4 * se + 1e-3), (freq - want).abs().max()


def _tree(tokens: list[int], parents: list[int]):
    """The DraftTree of node lists (parents[i] < i, node 0 the root)."""
    from moespec.spec.tree import Candidates, tree_from_selection

    n = len(tokens)
    depth = [0] * n
    for i in range(1, n):
        depth[i] = depth[parents[i]] + 1
    cands = Candidates(tokens=torch.tensor(tokens[1:], dtype=torch.long),
                       parents=torch.tensor([p - 1 for p in parents[1:]], dtype=torch.int32),
                       depth=torch.tensor(depth[1:], dtype=torch.int32), scores=torch.zeros(n - 1))
    return tree_from_selection(tokens[0], cands, range(n - 1))


@settings(max_examples=80, deadline=None)
@given(st.lists(st.one_of(st.none(), st.integers(1, 14)), min_size=1, max_size=4), st.integers(0, 2**31 - 1),
       st.booleans())
def test_batched_greedy_acceptance_equals_the_walk(sizes, seed, on_host):
    """accept_greedy_trees (the argmax and packing as on a GPU, one copy back; or the host argmax)
    gives each tree exactly accept()'s greedy path and tokens: duplicate sibling tokens (the
    lowest-index child wins), unequal sizes, requests without a tree. And accept_trees with every
    other request sampled (top-k 3) gives the greedy ones the same, and each sampled one a path down
    its tree whose tokens are its nodes' and whose bonus token has probability > 0 at the path's end,
    the same as accept() with an equally seeded generator (the batch's values read back in one copy,
    the probabilities as their bits)."""
    from moespec.spec.sampling import accept_greedy_trees, accept_trees, probabilities

    g = torch.Generator().manual_seed(seed)
    V = 4  # few tokens: matches and duplicate siblings are common
    trees, want = [], []
    T = max([n for n in sizes if n] or [1])
    logits = torch.randn(len(sizes), T, V, generator=g)
    for b, n in enumerate(sizes):
        if n is None:
            trees.append(None)
            want.append(None)
            continue
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
        tokens = [int(torch.randint(0, V, (1,), generator=g)) for _ in range(n)]
        trees.append(_tree(tokens, parents))
        want.append(accept(tokens, parents, logits[b, :n], SamplingParams()))
    got = accept_greedy_trees(trees, logits, on_host=on_host)
    for g_, w in zip(got, want):
        assert (g_ is None) == (w is None)
        if w is not None:
            assert (g_.path, g_.tokens) == (w.path, w.tokens)
    hot = SamplingParams(temperature=1.5, top_k=3)
    params = [hot if b % 2 else SamplingParams() for b in range(len(sizes))]
    mixed = accept_trees(trees, logits, params, [torch.Generator().manual_seed(seed + b) for b in range(len(sizes))],
                         on_host=on_host)
    for b, (m, w, t) in enumerate(zip(mixed, want, trees)):
        if t is None or not b % 2:
            assert (m is None and w is None) or (m.path, m.tokens) == (w.path, w.tokens)
            continue
        tokens, parents = t.tokens.tolist(), t.parents.tolist()
        n = len(tokens)
        assert m.path[0] == 0 and all(parents[c] == a for a, c in zip(m.path, m.path[1:]))
        assert m.tokens[:-1] == [tokens[c] for c in m.path[1:]]
        assert probabilities(logits[b, m.path[-1]], hot)[m.tokens[-1]] > 0
        single = accept(tokens, parents, logits[b, :n], hot, torch.Generator().manual_seed(seed + b))
        assert (m.path, m.tokens) == (single.path, single.tokens)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.sampled_from(["greedy", "hot", "top_p", "done"]), min_size=1, max_size=5), st.integers(0, 2**16),
       st.booleans())
def test_sample_rows_draws_as_sample_does_with_one_copy_back(kinds, seed, on_cuda):
    """sample_rows (a batch's first tokens and ar's decode tokens) gives each live row what sample()
    gives it with the same generator state (the greedy argmax; a sampled row's draw from its own
    generator), None for a finished row; on CUDA (the virtual device of tests/python/virtual_cuda.py)
    with one synchronisation for the whole batch (one a sampled request before 2026-12-06)."""
    import contextlib

    from virtual_cuda import virtual_cuda

    from moespec.spec.sampling import sample, sample_rows

    table = {"greedy": SamplingParams(), "hot": SamplingParams(temperature=0.8), "done": SamplingParams(),
             "top_p": SamplingParams(temperature=1.2, top_p=0.7, top_k=20)}
    params, live = [table[k] for k in kinds], [k != "done" for k in kinds]
    logits = torch.randn(len(kinds), 97, generator=torch.Generator().manual_seed(seed)) * 3

    def generators():
        return [torch.Generator().manual_seed(seed + b) for b in range(len(kinds))]

    want = [sample(logits[b], p, g) if a else None for b, (p, g, a) in enumerate(zip(params, generators(), live))]
    with virtual_cuda() if on_cuda else contextlib.nullcontext() as mode:
        rows = logits.to("cuda") if on_cuda else logits
        if on_cuda:
            del mode.syncs[:]  # (the logits' copy to the device)
        got = sample_rows(rows, params, generators(), live)
        if on_cuda:
            assert len(mode.syncs) == (1 if any(live) else 0), mode.syncs
    assert got == want
