"""Draft trees (moespec.spec.TreeBuilder over its two cores: the native DraftTreeBatch and the torch
core of moespec.spec.tree_device, which a GPU runs) against a plain-Python EAGLE-2 reference, the
tree contract's invariants, and bad input; every test runs on both cores.

The reference below follows EAGLE's cnets.Model.topK_genrate (REFERENCE.md 3, section 1.4) in
gpt-fast style, with the tie rule of cpp/include/moespec/draft_tree.h: ranking by (score desc,
depth asc, candidate index asc); scores are float32 sums, so trees must be identical. Hypothesis
draws K in 1..10, depth 1..8, total_tokens 1..80, B in 1..3; the log-prob tables come from a seeded
generator (with coarse values and all-equal tables for ties, -inf and tiny positive values drawn
too), so failures reproduce from the seed.
"""

from __future__ import annotations

import doctest

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, given, settings

import moespec.spec.tree
from moespec.spec import DraftTree, TreeBuilder, unpack_mask
from moespec.spec.tree import pack_mask

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CORES = pytest.mark.parametrize("core", ["native", "torch", "fused"])  # (fused: the kernels' block code)


# ---- plain-Python reference (one request) ------------------------------------------------------

def eagle2_reference(root: int, root_tokens, root_logprobs, level_tokens, level_logprobs, total_tokens: int):
    """EAGLE-2's dynamic tree: returns (frontiers, tree) where each frontier is a list of
    (candidate index, token, parent slot, score) and tree a dict of plain lists."""
    K = len(root_tokens)
    tok = [int(t) for t in root_tokens]
    parent = [-1] * K
    depth = [1] * K
    scores = root_logprobs.float().clamp(max=0)  # [K]
    all_scores = [scores]
    order = torch.sort(scores, descending=True, stable=True).indices.tolist()  # stable: ties by index
    frontier, slots = order, [-1] * K
    frontiers = [[(c, tok[c], s, scores[c].item()) for c, s in zip(frontier, slots)]]
    for toks, lps in zip(level_tokens, level_logprobs):
        base = len(tok)
        cu = all_scores_at(all_scores, frontier)[:, None] + lps.float().clamp(max=0)  # [K, K]
        for s in range(K):
            for j in range(K):
                tok.append(int(toks[s, j]))
                parent.append(frontier[s])
                depth.append(depth[frontier[s]] + 1)
        all_scores.append(cu.flatten())
        best = torch.sort(cu.flatten(), descending=True, stable=True).indices[:K].tolist()
        frontier, slots = [base + i for i in best], [i // K for i in best]
        frontiers.append([(c, tok[c], s, cu.flatten()[c - base].item()) for c, s in zip(frontier, slots)])
    score = torch.cat(all_scores).tolist()  # [C]
    C = len(tok)
    ranked = sorted(range(C), key=lambda i: (-score[i], depth[i], i))
    selected = sorted(ranked[:total_tokens])
    node_of = {c: n + 1 for n, c in enumerate(selected)}
    tree = {
        "tokens": [root] + [tok[c] for c in selected],
        "parents": [-1] + [0 if parent[c] < 0 else node_of[parent[c]] for c in selected],
        "depth": [0] + [depth[c] for c in selected],
        "scores": [0.0] + [score[c] for c in selected],
        "candidates": [-1] + selected,
    }
    return frontiers, tree


def all_scores_at(all_scores, idx):
    return torch.cat(all_scores)[torch.tensor(idx)]


def ancestors_or_self(parents: list[int], i: int) -> set[int]:
    out = set()
    while i >= 0:
        out.add(i)
        i = parents[i]
    return out


def leaf_paths(parents: list[int]) -> list[list[int]]:
    """Root-to-leaf node paths, lexicographic."""
    is_parent = set(parents[1:])
    paths = [sorted(ancestors_or_self(parents, n)) for n in range(len(parents)) if n not in is_parent]
    return sorted(paths)


def check_contract(tree: DraftTree, total_tokens: int, num_candidates: int) -> None:
    parents, depth = tree.parents.tolist(), tree.depth.tolist()
    m = min(total_tokens, num_candidates)
    assert tree.num_nodes == m + 1
    assert parents[0] == -1 and depth[0] == 0 and tree.candidates[0] == -1
    cands = tree.candidates.tolist()
    for n in range(1, m + 1):
        assert 0 <= parents[n] < n, "parents are earlier nodes"
        assert depth[n] == depth[parents[n]] + 1
        assert cands[parents[n]] < cands[n], "candidates are in creation order"
    want_mask = torch.zeros(m + 1, m + 1, dtype=torch.bool)
    for i in range(m + 1):
        for j in ancestors_or_self(parents, i):  # ancestor closure: every ancestor is a node
            want_mask[i, j] = True
    assert torch.equal(tree.mask(), want_mask)
    assert tree.mask_words.shape == (m + 1, (m + 32) // 32)
    assert not unpack_mask(tree.mask_words, 32 * tree.mask_words.shape[1])[:, m + 1:].any()  # padding bits
    paths = leaf_paths(parents)
    width = max(depth) + 1
    assert tree.paths.shape == (len(paths), width)
    assert tree.paths.tolist() == [p + [-1] * (width - len(p)) for p in paths]


# ---- cases -----------------------------------------------------------------------------------------

@st.composite
def tree_cases(draw, top_k=(1, 10), depths=(1, 8), totals=(1, 80)):
    k = draw(st.integers(*top_k))
    depth = draw(st.integers(*depths))
    total = draw(st.integers(*totals))
    batch = draw(st.integers(1, 3))
    levels = draw(st.integers(1, depth))
    style = draw(st.sampled_from(["continuous", "coarse", "equal"]))
    p_inf = draw(st.sampled_from([0.0, 0.05, 0.5]))
    p_tiny = draw(st.sampled_from([0.0, 0.1]))
    token_dtype = draw(st.sampled_from([torch.int64, torch.int32]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))

    def logprobs(*shape):
        x = -8.0 * torch.rand(*shape, generator=gen)
        if style == "coarse":  # many exact ties
            x = x.round()
        elif style == "equal":
            x = torch.full(shape, -float(torch.randint(0, 3, (), generator=gen)))
        x[torch.rand(*shape, generator=gen) < p_tiny] = 5e-4  # the rounding of a log-softmax: counts as 0
        x[torch.rand(*shape, generator=gen) < p_inf] = -float("inf")
        return x

    def tokens(*shape):
        return torch.randint(0, 1000, shape, generator=gen, dtype=token_dtype)

    roots = tokens(batch)
    first = (tokens(batch, k), logprobs(batch, k))
    steps = [(tokens(batch, k, k), logprobs(batch, k, k)) for _ in range(levels - 1)]
    return k, depth, total, roots, first, steps


@CORES
@SETTINGS
@given(case=tree_cases())
def test_trees_equal_the_eagle2_reference_at_every_level(core, case):
    check_against_the_reference(core, case)


@CORES
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=tree_cases(top_k=(1, 3), depths=(9, 24), totals=(30, 400)))
def test_deep_and_large_trees_equal_the_reference(core, case):
    # (the torch core packs several path columns into one sort key: deep trees need several keys,
    # large ones several mask words and rounds of pointer doubling)
    check_against_the_reference(core, case)


def check_against_the_reference(core, case):
    k, depth, total, roots, (tok0, lp0), steps = case
    builder = TreeBuilder(roots.shape[0], depth=depth, top_k=k, total_tokens=total, core=core)
    frontiers = [builder.expand_root(roots, tok0, lp0).clone()]  # clones: the builder reuses its buffers
    trees = [[t.clone() for t in builder.finalize()]]
    for toks, lps in steps:
        frontiers.append(builder.expand(toks, lps).clone())
        trees.append([t.clone() for t in builder.finalize()])
    assert builder.levels == len(steps) + 1
    assert builder.can_expand == (builder.levels < depth)
    for b in range(roots.shape[0]):
        want_frontiers, _ = eagle2_reference(int(roots[b]), tok0[b], lp0[b], [s[0][b] for s in steps],
                                             [s[1][b] for s in steps], total)
        for level, (got, want) in enumerate(zip(frontiers, want_frontiers), start=1):
            assert got.depth == level
            assert got.index[b].tolist() == [w[0] for w in want]
            assert got.tokens[b].tolist() == [w[1] for w in want]
            assert got.parent_slot[b].tolist() == [w[2] for w in want]
            assert got.scores[b].tolist() == [w[3] for w in want]
        for level in range(1, len(steps) + 2):
            _, want = eagle2_reference(int(roots[b]), tok0[b], lp0[b], [s[0][b] for s in steps[:level - 1]],
                                       [s[1][b] for s in steps[:level - 1]], total)
            tree = trees[level - 1][b]
            num_candidates = k + (level - 1) * k * k
            check_contract(tree, total, num_candidates)
            assert tree.tokens.dtype == torch.int64
            assert tree.tokens.tolist() == want["tokens"]
            assert tree.parents.tolist() == want["parents"]
            assert tree.depth.tolist() == want["depth"]
            assert tree.scores.tolist() == want["scores"]
            assert tree.candidates.tolist() == want["candidates"]
        cands = builder.candidates(b)
        for n, c in enumerate(trees[-1][b].candidates.tolist()[1:], start=1):
            assert cands.tokens[c] == trees[-1][b].tokens[n]
            assert cands.scores[c] == trees[-1][b].scores[n]
            assert cands.depth[c] == trees[-1][b].depth[n]


@CORES
def test_hand_worked_tree_and_the_docstring_example(core):
    builder = TreeBuilder(2, depth=3, top_k=2, total_tokens=4, core=core)
    builder.expand_root(torch.tensor([100, 1]), torch.tensor([[5, 6], [1, 1]]),
                        torch.tensor([[-0.1, -1.0], [0.0, 0.0]]))
    builder.expand(torch.tensor([[[7, 8], [9, 10]], [[1, 1], [1, 1]]]),
                   torch.tensor([[[-0.2, -3.0], [-0.05, -0.5]], [[0.0, 0.0], [0.0, 0.0]]]))
    builder.expand(torch.tensor([[[11, 12], [13, 14]], [[1, 1], [1, 1]]]),
                   torch.tensor([[[-0.1, -2.0], [-0.01, -0.02]], [[0.0, 0.0], [0.0, 0.0]]]))
    tree, ties = builder.finalize()
    assert tree.tokens.tolist() == [100, 5, 6, 7, 11]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 3]
    assert tree.mask_words.flatten().tolist() == [1, 3, 5, 11, 27]
    assert tree.paths.tolist() == [[0, 1, 3, 4], [0, 2, -1, -1]]
    assert ties.candidates.tolist() == [-1, 0, 1, 2, 3]  # all scores 0: shallow first, then early
    assert ties.parents.tolist() == [-1, 0, 0, 1, 1]
    failures, _ = doctest.testmod(moespec.spec.tree)
    assert failures == 0


@CORES
def test_d2t_maps_draft_ids_to_target_ids(core):
    gen = torch.Generator().manual_seed(3)
    d2t = torch.randint(0, 500, (100,), generator=gen)
    tok0, lp0 = torch.randint(0, 100, (2, 4), generator=gen), -torch.rand(2, 4, generator=gen)
    tok1, lp1 = torch.randint(0, 100, (2, 4, 4), generator=gen), -torch.rand(2, 4, 4, generator=gen)
    mapped = TreeBuilder(2, depth=2, top_k=4, total_tokens=9, d2t=d2t, core=core)
    plain = TreeBuilder(2, depth=2, top_k=4, total_tokens=9, core=core)
    f = mapped.expand_root([3, 4], tok0, lp0)
    assert torch.equal(f.tokens, torch.gather(tok0 + d2t[tok0], 1, f.index.long()))
    plain.expand_root([3, 4], tok0 + d2t[tok0], lp0)
    mapped.expand(tok1, lp1)
    plain.expand(tok1 + d2t[tok1], lp1)
    for a, b in zip(mapped.finalize(), plain.finalize()):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
        assert a.tokens[0] in (3, 4)  # roots are target ids already
    with pytest.raises(ValueError, match=r"tokens: draft ids must lie in \[0, 100\)"):
        mapped.expand_root([3, 4], tok0 + 100, lp0)
    with pytest.raises(ValueError, match="d2t: expected an int64 tensor"):
        TreeBuilder(1, top_k=2, d2t=d2t.int())


@CORES
def test_wide_masks_use_the_sign_bit_and_trees_are_views_until_clone(core):
    builder = TreeBuilder(1, depth=3, top_k=8, total_tokens=70, core=core)
    builder.expand_root([0], torch.arange(8)[None], torch.zeros(1, 8))
    builder.expand(torch.zeros(1, 8, 8, dtype=torch.int64), torch.full((1, 8, 8), -1.0))
    tree = builder.finalize()[0]
    assert tree.num_nodes == 71 and tree.mask_words.shape == (71, 3)
    assert tree.mask_words[31, 0] < 0  # bit 31 of word 0: node 31 sees itself
    kept = tree.clone()
    check_contract(kept, 70, 72)
    builder.expand_root([5], torch.arange(8)[None], torch.zeros(1, 8))
    again = builder.finalize()[0]
    assert again.num_nodes == 9 and kept.num_nodes == 71 and kept.tokens[0] == 0
    assert again.tokens[0] == 5


@CORES
def test_bad_input_raises_value_error_naming_the_argument(core):
    for kwargs, name in [(dict(depth=0), "depth"), (dict(top_k=0), "top_k"), (dict(top_k=65), "top_k"),
                         (dict(total_tokens=0), "total_tokens"), (dict(total_tokens=5000), "total_tokens"),
                         (dict(depth=2.5), "depth")]:
        with pytest.raises(ValueError, match=f"^{name}: "):
            TreeBuilder(1, core=core, **kwargs)
    with pytest.raises(ValueError, match="^batch: "):
        TreeBuilder(0, core=core)
    builder = TreeBuilder(2, depth=2, top_k=3, total_tokens=5, core=core)
    good_tok, good_lp = torch.zeros(2, 3, dtype=torch.int64), torch.full((2, 3), -1.0)
    with pytest.raises(ValueError, match="^expand: the trees have no root yet"):
        builder.expand(torch.zeros(2, 3, 3, dtype=torch.int64), torch.zeros(2, 3, 3))
    with pytest.raises(ValueError, match="^finalize: "):
        builder.finalize()
    cases = [
        (dict(logprobs=torch.tensor([[-1.0, float("nan"), -1.0], [-1.0] * 3])), r"^logprobs: .*got nan at \[0, 1\]"),
        (dict(logprobs=torch.tensor([[-1.0] * 3, [-1.0, -1.0, 0.01]])), r"^logprobs: .*got 0.01 at \[1, 2\]"),
        (dict(logprobs=torch.tensor([[-1.0] * 3, [float("inf"), -1.0, -1.0]])), "^logprobs: .*got inf"),
        (dict(logprobs=torch.full((2, 4), -1.0)), "^logprobs: expected size 3 in dim 1"),
        (dict(logprobs=torch.full((2, 3), -1, dtype=torch.int32)), "^logprobs: expected dtype float32"),
        (dict(tokens=torch.tensor([[0, 1, 2], [0, -1, 2]])), r"^tokens: expected token ids in \[0, 2\^31\)"),
        (dict(tokens=torch.zeros(2, 3, dtype=torch.float32)), "^tokens: expected dtype int32 or int64"),
        (dict(tokens=torch.zeros(3, 3, dtype=torch.int64)), "^tokens: expected size 2 in dim 0"),
        (dict(roots=[1, 2, 3]), "^root_tokens: expected size 2 in dim 0"),
        (dict(roots=[1, -2]), r"^root_tokens: expected a token id in \[0, 2\^31\), got -2 at \[1\]"),
    ]
    for change, message in cases:
        args = dict(roots=[1, 2], tokens=good_tok, logprobs=good_lp) | change
        with pytest.raises(ValueError, match=message):
            builder.expand_root(args["roots"], args["tokens"], args["logprobs"])
        assert builder.levels == 0, "a failed call changes nothing"
    frontier = builder.expand_root([1, 2], torch.tensor([[4, 5, 6], [7, 8, 9]]), good_lp.double())
    before = frontier.tokens.clone()
    with pytest.raises(ValueError, match=r"^logprobs: .*at \[1, 2, 0\]"):
        bad = torch.full((2, 3, 3), -1.0)
        bad[1, 2, 0] = float("nan")
        builder.expand(torch.zeros(2, 3, 3, dtype=torch.int64), bad)
    assert builder.levels == 1 and torch.equal(frontier.tokens, before)
    builder.expand(torch.zeros(2, 3, 3, dtype=torch.int64), torch.full((2, 3, 3), -1.0))
    with pytest.raises(ValueError, match="^expand: the trees already have depth=2 levels"):
        builder.expand(torch.zeros(2, 3, 3, dtype=torch.int64), torch.full((2, 3, 3), -1.0))
    with pytest.raises(ValueError, match=r"^b: expected a request index in \[0, 2\)"):
        builder.candidates(2)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 100), st.integers(0, 2**16))
def test_pack_mask_inverts_unpack_mask(n, seed):
    bits = torch.rand(3, n, generator=torch.Generator().manual_seed(seed)) < 0.5
    words = pack_mask(bits)
    assert words.dtype == torch.int32 and words.shape == (3, (n + 31) // 32)
    assert torch.equal(unpack_mask(words, n), bits)


@pytest.mark.parametrize("core", ["torch", "fused"])
def test_the_torch_core_defers_value_checks_off_the_cpu_to_the_finalize(core):
    # (a GPU's builder checks values at finalize; check_now=False runs that path on the CPU; the fused
    # core's kernels map the draft ids and record the flags themselves)
    d2t = torch.zeros(10, dtype=torch.int64)
    good_tok, good_lp = torch.zeros(1, 2, dtype=torch.int64), torch.full((1, 2), -1.0)
    for change, message in [(dict(lp=torch.tensor([[-1.0, float("nan")]])), "^logprobs: expected log-probabilities"),
                            (dict(lp=torch.tensor([[-1.0, 0.5]])), "^logprobs: "),
                            (dict(roots=[-3]), r"^root_tokens: expected token ids in \[0, 2\^31\)"),
                            (dict(tok=torch.tensor([[1, 10]])), r"^tokens: expected draft ids in \[0, V_draft\)"),
                            (dict(level_tok=torch.tensor([[[0, 1], [2, -1]]])), "^tokens: expected draft ids")]:
        builder = TreeBuilder(1, depth=2, top_k=2, total_tokens=3, d2t=d2t, core=core)
        builder._core.check_now = False
        args = dict(roots=[1], tok=good_tok, lp=good_lp, level_tok=torch.zeros(1, 2, 2, dtype=torch.int64)) | change
        builder.expand_root(args["roots"], args["tok"], args["lp"])  # no error yet
        builder.expand(args["level_tok"], torch.full((1, 2, 2), -1.0))
        with pytest.raises(ValueError, match=message + ".*checked at finalize"):
            builder.finalize()
        builder.expand_root([1], good_tok, good_lp)  # a new round forgets the last one's problems
        assert builder.finalize()[0].num_nodes == 3


def test_the_core_follows_the_device_and_the_native_core_is_the_cpus_only():
    assert TreeBuilder(1, top_k=2)._core is None  # the CPU: native
    assert TreeBuilder(1, top_k=2, core="torch")._core is not None
    with pytest.raises(ValueError, match="^core: expected 'native' \\(the CPU only\\), 'torch' or 'fused'"):
        TreeBuilder(1, top_k=2, device="cuda", core="native")
    with pytest.raises(ValueError, match="^core: "):
        TreeBuilder(1, top_k=2, core="gpu")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=tree_cases(top_k=(1, 16), depths=(1, 6), totals=(1, 120)), vocab=st.integers(1, 50))
def test_the_tree_kernels_with_deferred_checks_and_d2t_give_the_native_cores_trees(case, vocab):
    # (a GPU's path: the level kernel maps the draft ids through d2t and records the flags; the
    # finalize kernel builds the trees; the CPU runs the same block code with one thread)
    k, depth, total, roots, (tok0, lp0), steps = case
    d2t = torch.randint(0, 1000, (vocab,), generator=torch.Generator().manual_seed(vocab))
    B = roots.shape[0]
    native_core = TreeBuilder(B, depth=depth, top_k=k, total_tokens=total, d2t=d2t)
    fused = TreeBuilder(B, depth=depth, top_k=k, total_tokens=total, d2t=d2t, core="fused")
    fused._core.check_now = False
    assert fused._core.kernels
    levels = [(tok0 % vocab, lp0)] + [(t % vocab, lp) for t, lp in steps]
    for level, (toks, lps) in enumerate(levels):
        got, want = ((b.expand_root(roots, toks, lps) if level == 0 else b.expand(toks, lps)).clone()
                     for b in (fused, native_core))
        for name in ("index", "tokens", "parent", "parent_slot", "scores"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (level, name)
        fused_trees = fused.finalize()
        for g, w in zip(fused_trees, native_core.finalize()):
            for name in ("tokens", "parents", "depth", "scores", "candidates", "mask_words", "paths"):
                assert torch.equal(getattr(g, name), getattr(w, name)), (level, name)


def test_the_tree_kernels_fall_back_to_torch_ops_beyond_their_bounds_and_the_default_core(monkeypatch):
    from moespec._loader import native
    from moespec.spec.tree import default_device_core

    assert TreeBuilder(1, top_k=16, depth=2, core="fused")._core.kernels
    assert not TreeBuilder(1, top_k=17, depth=2, core="fused")._core.kernels  # (top_k > 16: torch ops)
    assert not TreeBuilder(1, top_k=16, depth=18, core="fused")._core.kernels  # (16 + 16 * 256 > 4096 candidates)
    monkeypatch.setenv("MOESPEC_TREE_FUSED", "0")
    assert default_device_core() == "torch"
    monkeypatch.setenv("MOESPEC_TREE_FUSED", "1")
    assert default_device_core() == ("fused" if native().cuda_available() else "torch")
    monkeypatch.setenv("MOESPEC_TREE_FUSED", "yes")
    with pytest.raises(ValueError, match="^MOESPEC_TREE_FUSED: expected '1' or '0', got 'yes'"):
        default_device_core()


def test_the_tree_kernels_name_a_bad_argument():
    from moespec._loader import native
    from moespec._tensor import view

    B, K, S = 2, 3, 12
    i64, i32, f32 = (dict(dtype=d) for d in (torch.int64, torch.int32, torch.float32))
    args = dict(tokens=torch.zeros(B, K, **i64), logprobs=torch.zeros(B, K, **f32), roots=torch.zeros(B, **i64),
                d2t=None, cand_tokens=torch.zeros(B, S, **i64), cand_parent=torch.zeros(B, S, **i32),
                score=torch.zeros(B, S, **f32), root=torch.zeros(B, **i64), frontier=torch.zeros(B, K, **i64),
                out_index=torch.zeros(B, K, **i32), out_tokens=torch.zeros(B, K, **i64),
                out_parent=torch.zeros(B, K, **i32), out_parent_slot=torch.zeros(B, K, **i32),
                out_scores=torch.zeros(B, K, **f32), ok=torch.zeros(3, dtype=torch.uint8))

    def expand(base=0, **change):
        a = args | change
        native().draft_tree_expand(*(view(t, n) for n, t in a.items()), base, 1e-3, 0)

    expand()  # the good call
    for change, message in [(dict(tokens=torch.zeros(B, K, **i32)), "^tokens: "),
                            (dict(logprobs=torch.zeros(B, K + 1, **f32)), "^logprobs: "),
                            (dict(frontier=torch.zeros(B, 17, **i64)), r"^frontier: expected K in \[1, 16\]"),
                            (dict(score=torch.zeros(B, 2, **f32)), "^score: expected room for 3 candidates"),
                            (dict(cand_parent=torch.zeros(B, S, **i64)), "^cand_parent: "),
                            (dict(ok=torch.zeros(2, dtype=torch.uint8)), r"^ok: expected \[F\], F >= 3"),
                            (dict(out_scores=torch.zeros(B, K, **f32).t().contiguous().t()), "^out_scores: "),
                            (dict(score=torch.zeros(1, S, **f32).expand(B, S)), "^score: expected rows that do not overlap"),
                            (dict(cand_tokens=torch.zeros(B, 2 * S, **i64)[:, :S]), "^cand_tokens: expected the candidate")]:
        with pytest.raises(ValueError, match=message):
            expand(**change)
    with pytest.raises(ValueError, match="^base: expected K <= base <= S - K\\^2"):
        expand(base=2, roots=None, tokens=torch.zeros(B, K * K, **i64), logprobs=torch.zeros(B, K * K, **f32))
    N = 4
    out = dict(score=args["score"], cand_parent=args["cand_parent"], cand_tokens=args["cand_tokens"],
               root=args["root"], scratch=torch.zeros(B, 2 * S + 6 * N, **i32), tokens=torch.zeros(B, N, **i64),
               parents=torch.zeros(B, N, **i32), depth=torch.zeros(B, N, **i32), scores=torch.zeros(B, N, **f32),
               candidates=torch.zeros(B, N, **i32), mask=torch.zeros(B, N, 1, **i32),
               paths=torch.zeros(B, N - 1, 3, **i32), num_leaves=torch.zeros(B, **i32),
               max_depth=torch.zeros(B, **i32))

    def finalize(C=K + K * K, **change):
        native().draft_tree_finalize(*(view(t, n) for n, t in (out | change).items()), C, K, 0)

    finalize()
    for change, message in [(dict(C=0), r"^num_candidates: expected an int in \[1, 12\]"),
                            (dict(C=13), "^num_candidates: "),
                            (dict(scratch=torch.zeros(B, 10, **i32)), r"^scratch: expected \[B, >= 2 C \+ 6 N"),
                            (dict(mask=torch.zeros(B, N, 2, **i32)), "^mask: "),
                            (dict(paths=torch.zeros(B, N - 1, 2, **i32)), "^paths: "),
                            (dict(tokens=torch.zeros(B, 14, **i64)), r"^tokens: expected N in \[2, C \+ 1"),
                            (dict(mask=torch.zeros(B, N, 2, **i32)[:, :, :1].expand(B, N, 1).as_strided((B, N, 1), (N, 0, 1))),
                             "^mask: expected rows that do not overlap")]:
        with pytest.raises(ValueError, match=message):
            finalize(**change)
