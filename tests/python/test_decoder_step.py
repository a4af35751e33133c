"""The native backend (one native call per step: cpp/src/decoder_step.cc) against the reference
backend (the torch forward, itself tested against transformers in test_models_runtime.py), on
every family's tiny random checkpoint.

- fp32: prefill, decode, tree verify and commit agree within 1e-5 of the logit scale (measured:
  about 1e-6; only summation orders differ);
- bf16: both sides round every op's result to bf16 at the same points but sum in different orders,
  so values land a bf16 rounding step apart (typically 0.5-1% of the logit scale after a few
  layers), and on these random models a near-tie in a router can flip one expert, which moves a
  logit by several percent, on either side. So the test takes the fp32 model as the truth: native
  bf16 is within 2x the reference bf16's error of it (+ 2% of the logit scale), and within 6e-2 of
  the reference bf16 when both routed alike;
- batch invariance, exactly: a verified tree node's logits are bit-identical to decoding its path
  token by token, and a request's results do not depend on the other requests of its batch;
- budgets: the same expert statistics as the reference; bad step arguments are ValueErrors.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, given, settings

import moespec.models as mm
from moespec.models import KVCache, TargetModel
from moespec.ops import ExpertBudget

from models_fixtures import FAMILIES, MOE_FAMILIES, V, assert_close, write_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")
TOL = {"fp32": 1e-5, "bf16": 6e-2}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {f: write_checkpoint(f, root / f) for f in FAMILIES}


@pytest.fixture(scope="module")
def pairs(checkpoints):
    """(native, reference) models sharing one set of weights, per (family, dtype)."""
    out = {}
    for family, path in checkpoints.items():
        for dtype in ("fp32", "bf16"):
            native = mm.load(path, dtype, taps=(0,))
            assert native.backend_name == "native"
            out[family, dtype] = native, TargetModel(native.config, native.weights, taps=(0,), backend="reference")
    return out


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _copy(cache: KVCache) -> KVCache:
    return KVCache(cache.k.clone(), cache.v.clone(), list(cache.lengths))


def _steps(model: TargetModel, truth_tokens: list[int]) -> list[torch.Tensor]:
    """Logits and tap 0 of: a prefill, 3 decode steps, a tree verify, a commit and a decode."""
    cache = model.new_cache(1, 64)
    out = model.prefill(cache, [_prompt(9, 1)], logits="all")
    got = [out.logits[0], out.hidden[0][0]]
    for token in truth_tokens:
        got.append(model.decode(cache, [token]).logits[0])
    tree, parents = [truth_tokens[-1] + 1, 5, 9, 17, 33, 65], [-1, 0, 0, 1, 1, 3]
    out = model.verify(cache, [tree], [parents])
    got += [out.logits[0], out.hidden[0][0], out.expert_stats]
    model.commit(cache, [[0, 1, 3]])
    got.append(model.decode(cache, [7]).logits[0])
    return got


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


@pytest.mark.parametrize("family", FAMILIES)
def test_native_fp32_steps_match_the_reference(family, pairs):
    native, ref = pairs[family, "fp32"]
    tokens = [11, 12, 13]
    for a, b in zip(_steps(native, tokens), _steps(ref, tokens)):
        if a.is_floating_point():
            assert_close(a, b, TOL["fp32"])
        else:
            assert torch.equal(a, b)  # expert stats


@pytest.mark.parametrize("family", FAMILIES)
def test_native_bf16_is_as_close_to_fp32_as_the_reference_bf16(family, pairs):
    """Against the fp32 model as the truth: the native bf16 steps stay within 2x the reference bf16
    steps' error + 2% of the logit scale, and within TOL["bf16"] of the reference bf16 itself, unless
    the two routed some token differently (then only the first bound holds)."""
    tokens = [11, 12, 13]
    truth = _steps(pairs[family, "fp32"][1], tokens)
    native, ref = (_steps(m, tokens) for m in pairs[family, "bf16"])
    same_routing = torch.equal(native[6], ref[6])
    for i, (t, a, b) in enumerate(zip(truth, native, ref)):
        if not t.is_floating_point():
            continue
        assert _rel(a, t) <= 2 * _rel(b, t) + 0.02, f"step {i}: native {_rel(a, t):.3g}, reference {_rel(b, t):.3g}"
        if same_routing:
            assert _rel(a, b) <= TOL["bf16"], f"step {i}"


def _random_tree(draw, size: int) -> list[int]:
    return [-1] + [draw(st.integers(0, i - 1)) for i in range(1, size)]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_tree_node_gets_the_bits_of_decoding_its_path(pairs, data):
    family = data.draw(st.sampled_from(FAMILIES))
    dtype = data.draw(st.sampled_from(["fp32", "bf16"]))
    native, _ = pairs[family, dtype]
    size = data.draw(st.integers(1, 20))
    parents = _random_tree(data.draw, size)
    tree = [data.draw(st.integers(3, V - 1)) for _ in range(size)]
    cache = native.new_cache(1, 64)
    native.prefill(cache, [_prompt(data.draw(st.integers(1, 12)), 2)])
    base = _copy(cache)
    verified = native.verify(cache, [tree], [parents]).logits[0]  # [T, V]
    cache.pending = None
    for node in data.draw(st.lists(st.integers(0, size - 1), min_size=1, max_size=3, unique=True)):
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        c = _copy(base)
        for i in reversed(path):
            logits = native.decode(c, [tree[i]]).logits[0]
        assert torch.equal(logits, verified[node]), f"{family} {dtype}: node {node} (path {path[::-1]})"


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_request_does_not_depend_on_its_batch(pairs, dtype):
    native, _ = pairs["qwen2_moe", dtype]
    prompts = [_prompt(5, 3), _prompt(11, 4), _prompt(2, 5)]
    cache = native.new_cache(3, 64)
    native.prefill(cache, prompts)
    together = native.verify(cache, [[7, 8, 9], [10], []], [[-1, 0, 1], [-1], []])
    for b, (tree, parents) in enumerate([([7, 8, 9], [-1, 0, 1]), ([10], [-1])]):
        alone = native.new_cache(1, 64)
        native.prefill(alone, [prompts[b]])
        out = native.verify(alone, [tree], [parents])
        assert torch.equal(out.logits[0], together.logits[b, : len(tree)])
        assert torch.equal(out.hidden[0][0], together.hidden[0][b, : len(tree)])


def test_long_prompts_do_not_depend_on_their_batch_or_the_threads(pairs):
    """Prompts long enough for the step's row-parallel loops (32 rows and more) and several attention
    tasks per request, each of which reads only the slots its rows see: a batch's prefill and the
    verify after it give each request the bits it gets alone, and the same bits on one native thread
    and on three."""
    from moespec.ops import num_threads, set_num_threads

    native, _ = pairs["qwen2_moe", "bf16"]
    prompts = [_prompt(40, 11), _prompt(70, 12), _prompt(3, 13)]
    trees = [([7, 8, 9], [-1, 0, 1]), ([10, 11], [-1, 0]), ([12], [-1])]
    saved, runs = num_threads(), []
    try:
        for threads in (1, 3):
            set_num_threads(threads)
            cache = native.new_cache(3, 96)
            first = native.prefill(cache, prompts, logits="all")
            together = native.verify(cache, [t for t, _ in trees], [p for _, p in trees])
            for b, (tree, parents) in enumerate(trees):
                alone = native.new_cache(1, 96)
                n = len(prompts[b])
                assert torch.equal(native.prefill(alone, [prompts[b]], logits="all").logits[0], first.logits[b, :n])
                assert torch.equal(native.verify(alone, [tree], [parents]).logits[0], together.logits[b, : len(tree)])
            runs.append((first.logits, together.logits))
    finally:
        set_num_threads(saved)
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("policy,score,exact", [("substitution", "probability", 0), ("truncation", "probability", 0),
                                                ("substitution", "gates", 1)])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_budgeted_verify_matches_the_reference(family, policy, score, exact, pairs):
    native, ref = pairs[family, "fp32"]
    E, K = native.config.moe.num_experts, native.config.moe.top_k
    budget = ExpertBudget(max(K, E // 3), policy, score=score, exact_layers=exact)
    cn, cr = native.new_cache(2, 64), ref.new_cache(2, 64)
    prompts = [_prompt(6, 6), _prompt(4, 7)]
    native.prefill(cn, prompts)
    ref.prefill(cr, prompts)
    trees, parents = [[3, 4, 5, 6, 7], [8, 9, 10]], [[-1, 0, 0, 1, 2], [-1, 0, 1]]
    a = native.verify(cn, trees, parents, budget=budget)
    b = ref.verify(cr, trees, parents, budget=budget)
    assert torch.equal(a.expert_stats, b.expert_stats)
    assert (a.expert_stats[exact:, 1] <= budget.max_experts).all()
    assert torch.equal(a.expert_stats[:exact, 1], a.expert_stats[:exact, 0])  # the exact layers keep their experts
    assert_close(a.logits[0, :5], b.logits[0, :5])
    assert_close(a.logits[1, :3], b.logits[1, :3])


def test_long_prefills_and_calls_above_the_native_limit(pairs, monkeypatch):
    import moespec.runtime.backend as backend

    native, ref = pairs["qwen3_moe", "fp32"]
    prompt = _prompt(150, 8)  # natively: several mask words per row
    cn, cr = native.new_cache(1, 200), ref.new_cache(1, 200)
    assert_close(native.prefill(cn, [prompt], logits="all").logits, ref.prefill(cr, [prompt], logits="all").logits)
    assert_close(native.decode(cn, [5]).logits, ref.decode(cr, [5]).logits)
    monkeypatch.setattr(backend, "NATIVE_MAX_TOKENS", 16)  # larger calls: the reference's torch ops
    cn, cr = native.new_cache(1, 40), ref.new_cache(1, 40)
    assert torch.equal(native.prefill(cn, [prompt[:20]]).logits, ref.prefill(cr, [prompt[:20]]).logits)


def test_profile_names_every_phase(pairs):
    native, _ = pairs["qwen2_moe", "bf16"]
    decoder = native.backend.decoder
    cache = native.new_cache(1, 32)
    native.prefill(cache, [_prompt(4, 9)])
    decoder.set_profiling(True)
    decoder.reset_profile()
    try:
        native.decode(cache, [3])
        phases = decoder.profile()
    finally:
        decoder.set_profiling(False)
    assert set(phases) >= {"qkv", "attention", "routed experts", "shared expert", "final norm+lm_head"}
    assert phases["routed experts"] > 0 and phases["attention"] > 0 and phases["dense mlp"] == 0


def test_backend_choice(checkpoints, monkeypatch):
    path = checkpoints["mixtral"]
    assert mm.load(path, "fp32").backend_name == "native"
    assert mm.load(path, "fp32", moe_impl="reference").backend_name == "reference"  # transformers' rounding
    monkeypatch.setenv("MOESPEC_BACKEND", "reference")
    model = mm.load(path, "fp32")
    assert model.backend_name == "reference"
    model.backend_name = "native"
    assert model.backend_name == "native"
    with pytest.raises(ValueError, match="backend: expected one of"):
        model.backend_name = "gpu"
    monkeypatch.setenv("MOESPEC_BACKEND", "fast")
    with pytest.raises(ValueError, match="backend: expected one of"):
        mm.load(path, "fp32")


def test_bad_step_arguments_are_value_errors(pairs):
    from moespec._tensor import view

    native, _ = pairs["qwen3_moe", "fp32"]
    c = native.config
    decoder = native.backend.decoder
    cache = native.new_cache(1, 8)
    P, H, D = 2, c.hidden_size, c.head_dim

    alive = []  # the tensors of the descriptors, alive until the test ends

    def args(**edit):
        a = dict(x=torch.zeros(P, H), cos=torch.ones(P, D), sin=torch.zeros(P, D), k_cache=cache.k, v_cache=cache.v,
                 offsets=torch.tensor([0, P], dtype=torch.int32), start=torch.tensor([0], dtype=torch.int32),
                 mask=torch.tensor([[1], [3]], dtype=torch.int32), taps=None, tap_out=None,
                 logit_rows=torch.tensor([1], dtype=torch.int32), logits=torch.empty(1, c.vocab_size),
                 stats=torch.empty(len(c.moe_layers), 4, dtype=torch.int32))
        a.update(edit)
        alive.append(a)
        return [view(v, k) for k, v in a.items()] + [0, 0, 0.0, 0]

    decoder.step(*args())  # a valid call runs
    for edit, match in [
        (dict(x=torch.zeros(P, H + 1)), "x"),
        (dict(x=torch.zeros(P, H).bfloat16()), "x"),
        (dict(cos=torch.ones(P, D + 2)), "cos"),
        (dict(offsets=torch.tensor([0, P + 1], dtype=torch.int32)), "offsets"),
        (dict(start=torch.tensor([7], dtype=torch.int32)), "start"),  # 7 + 2 > 8 slots
        (dict(logit_rows=torch.tensor([2], dtype=torch.int32)), "logit_rows"),
        (dict(stats=torch.empty(1, 3, dtype=torch.int32)), "stats"),
        (dict(k_cache=torch.zeros(1, 1, 1, 8, D)), "k_cache"),
    ]:
        with pytest.raises(ValueError, match=match):
            decoder.step(*args(**edit))
    with pytest.raises(ValueError, match="budget.max_experts"):
        decoder.step(*args()[:-4], c.moe.top_k - 1, 0, 0.0, 0)


def test_float32_logits_of_a_bf16_model_are_its_bf16_logits_widened(pairs):
    """The step writes logits in the model's dtype or, into a float32 buffer, those values widened
    exactly (what the EAGLE-3 head reads: no conversion afterwards); a float16 buffer is refused."""
    from moespec._tensor import view

    native, _ = pairs["qwen3_moe", "bf16"]
    c = native.config
    P, H, D = 2, c.hidden_size, c.head_dim
    x = torch.randn(P, H, generator=torch.Generator().manual_seed(0)).bfloat16()

    def step(logits):
        cache = native.new_cache(1, 8)
        a = dict(x=x.clone(), cos=torch.ones(P, D).bfloat16(), sin=torch.zeros(P, D).bfloat16(), k_cache=cache.k,
                 v_cache=cache.v, offsets=torch.tensor([0, P], dtype=torch.int32),
                 start=torch.tensor([0], dtype=torch.int32), mask=torch.tensor([[1], [3]], dtype=torch.int32),
                 taps=None, tap_out=None, logit_rows=torch.tensor([0, 1], dtype=torch.int32), logits=logits,
                 stats=torch.empty(len(c.moe_layers), 4, dtype=torch.int32))
        native.backend.decoder.step(*[view(v, k) for k, v in a.items()], 0, 0, 0.0, 0)
        return logits

    bf16, f32 = step(torch.empty(P, c.vocab_size, dtype=torch.bfloat16)), step(torch.empty(P, c.vocab_size))
    assert torch.equal(bf16.float(), f32)
    with pytest.raises(ValueError, match="logits"):
        step(torch.empty(P, c.vocab_size, dtype=torch.float16))


def test_steps_from_two_threads_are_serialized(pairs):
    import threading

    native, _ = pairs["qwen2_moe", "bf16"]
    prompts = [_prompt(7, 10), _prompt(5, 11)]
    want = []
    for prompt in prompts:
        cache = native.new_cache(1, 64)
        native.prefill(cache, [prompt])
        want.append([native.decode(cache, [t]).logits for t in (3, 4, 5, 6)])
    got = [None, None]

    def run(i):
        cache = native.new_cache(1, 64)
        native.prefill(cache, [prompts[i]])
        got[i] = [native.decode(cache, [t]).logits for t in (3, 4, 5, 6)]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(2):
        assert all(torch.equal(a, b) for a, b in zip(got[i], want[i]))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), top_k=st.integers(1, 3), depth=st.integers(1, 4), total=st.integers(1, 40))
def test_verify_trees_equals_verify_of_their_lists(pairs, seed, top_k, depth, total):
    """verify_trees reads the draft trees' own tensors (packed masks, depths): the same logits, taps,
    stats and pending tree as verify of their token and parent lists, on both backends, with the trees
    read back at the call or not (read_back=False: the pending parents read back when commit looks);
    a None tree adds no tokens."""
    from moespec.spec.tree import TreeBuilder

    g = torch.Generator().manual_seed(seed)
    builder = TreeBuilder(3, depth=depth, top_k=top_k, total_tokens=total)
    builder.expand_root(torch.randint(0, V, (3,), generator=g), torch.randint(0, V, (3, top_k), generator=g),
                        -torch.rand(3, top_k, generator=g))
    while builder.can_expand:
        builder.expand(torch.randint(0, V, (3, top_k, top_k), generator=g), -torch.rand(3, top_k, top_k, generator=g))
    trees = [t.clone() for t in builder.finalize()]
    trees[1] = None
    for model, read_back in zip(pairs["qwen2_moe", "fp32"], (False, True)):  # (the reference pads the lists)
        caches = [model.new_cache(3, 128) for _ in range(2)]
        for c in caches:
            model.prefill(c, [_prompt(5, 1), _prompt(3, 2), _prompt(9, 3)])
        a = model.verify_trees(caches[0], [t.clone() if t is not None else None for t in trees],
                               budget=ExpertBudget(4), read_back=read_back)
        assert all(t is None or (t.host is not None) == read_back for t in caches[0].pending.parents.trees)
        b = model.verify(caches[1], [t.tokens.tolist() if t is not None else [] for t in trees],
                         [t.parents.tolist() if t is not None else [] for t in trees], budget=ExpertBudget(4))
        assert torch.equal(a.logits, b.logits) and torch.equal(a.expert_stats, b.expert_stats)
        assert all(torch.equal(x, y) for x, y in zip(a.hidden, b.hidden))
        assert caches[0].pending.parents == caches[1].pending.parents
        assert torch.equal(caches[0].k, caches[1].k)


def test_verify_trees_checks_token_ids_or_clamps_them_unread(pairs):
    """A tree with a token id outside the vocabulary: verify_trees names it when it reads the trees
    back; with read_back=False (its caller checks the ids, as eagle3's step does with its deferred
    round) the id is clamped on the device, so no embedding lookup goes out of range, and the call
    reads nothing back."""
    from moespec.spec.tree import DraftTree, pack_mask

    model = pairs["qwen2_moe", "fp32"][0]
    tokens = torch.tensor([5, V + 3, 7])
    tree = DraftTree(tokens=tokens, parents=torch.tensor([-1, 0, 1], dtype=torch.int32),
                     depth=torch.tensor([0, 1, 2], dtype=torch.int32),
                     mask_words=pack_mask(torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=torch.bool)),
                     paths=torch.tensor([[0, 1, 2]], dtype=torch.int32), scores=torch.zeros(3),
                     candidates=torch.tensor([-1, 0, 1], dtype=torch.int32))
    cache = model.new_cache(1, 32)
    model.prefill(cache, [_prompt(5, 1)])
    with pytest.raises(ValueError, match=f"verify_trees: tree 0 has token ids outside the vocabulary \\[0, {V}\\)"):
        model.verify_trees(cache, [tree])
    unread = DraftTree(*(getattr(tree, f) for f in ("tokens", "parents", "depth", "mask_words", "paths", "scores",
                                                    "candidates")))
    out = model.verify_trees(cache, [unread], read_back=False)
    assert unread.host is None and torch.isfinite(out.logits).all()
    model.commit(cache, [[0, 1]])  # (commit reads the parents back)
    assert unread.host == ([5, V + 3, 7], [-1, 0, 1]) and cache.lengths == [7]
