"""The "graphs" backend's static steps (moespec.runtime.graphs) on the CPU, where they run eagerly:
the same logits, taps and expert stats as the reference backend on the same calls, buckets reused
across calls, calls outside every bucket falling back, and greedy speculation through it equal to
greedy AR. (On a GPU, tests/gpu/test_runtime_cuda.py holds graph replay against eager.)"""

from __future__ import annotations

import collections
import functools
import importlib

import pytest
import torch

from models_fixtures import FAMILIES, assert_close, write_checkpoint
from moespec import LLM, SamplingParams, SpeculativeConfig
from moespec.models import load
from moespec.ops import ExpertBudget

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = [[5, 17, 33, 64, 9], [3, 4, 120, 77, 13]]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from test_gpt_oss import write as write_gpt_oss

    root = tmp_path_factory.mktemp("graphs")
    return {**{family: write_checkpoint(family, root / family) for family in FAMILIES},
            "gpt_oss": write_gpt_oss(root / "gpt_oss")}


@pytest.fixture(scope="module")
def folder(folders):
    return folders["qwen3_moe"]


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "reference-forward"])
@pytest.mark.parametrize("family", FAMILIES + ["gpt_oss"])
def test_static_steps_equal_the_reference(folders, family, fused, monkeypatch):
    """Both forwards of the graph steps (moespec.runtime.fused, where the model fits it, and the
    reference forward on static buffers) against the reference backend, for every family: per-head and
    full q/k norms, clip, a qkv bias, a shared expert, dense layers, GQA with one kv head, and GPT-OSS's
    sliding windows, sinks, yarn rope and fp32 norm scale (its window of 4 is shorter than the calls'
    contexts)."""
    monkeypatch.setenv("MOESPEC_FUSED_STEP", "1" if fused else "0")
    folder = folders[family]
    ref = load(folder, "fp32", taps=(0, 1))
    ref.backend_name = "reference"
    graphs = load(folder, "fp32", taps=(0, 1))
    graphs.backend_name = "graphs"
    assert graphs.backend_name == "graphs"
    assert (graphs.backend.fused is not None) == fused  # (every fixture family fits the fused forward)
    caches = [m.new_cache(2, 40) for m in (ref, graphs)]
    first = [m.prefill(c, PROMPTS) for m, c in zip((ref, graphs), caches)]  # (graphs: eagerly, fused where it fits)
    assert_close(first[1].logits, first[0].logits)
    tokens = [7, 11]
    budget = ExpertBudget(5)
    for step in range(4):  # decode (T = 1): one bucket, reused
        d = [m.decode(c, tokens) for m, c in zip((ref, graphs), caches)]
        assert_close(d[1].logits, d[0].logits)
        assert_close(d[1].hidden[1], d[0].hidden[1])
        assert torch.equal(d[1].expert_stats, d[0].expert_stats)
        tokens = [int(t) for t in d[0].logits.argmax(-1)]
    trees = [[tokens[0], 3, 4, 5], [tokens[1], 6, 7, 8]]
    for parents in ([[-1, 0, 0, 1]] * 2, [[-1, 0, 1, 2], [-1, 0, 0, 0]]):  # two trees of T = 4: one bucket
        v = [m.verify(c, trees, parents, budget=budget) for m, c in zip((ref, graphs), caches)]
        assert_close(v[1].logits, v[0].logits)
        assert torch.equal(v[1].expert_stats, v[0].expert_stats)
        for m, c in zip((ref, graphs), caches):
            m.commit(c, [[0, 1], [0]])
        assert caches[1].lengths == caches[0].lengths
        for b, n in enumerate(caches[0].lengths):  # the committed entries
            assert_close(caches[1].k[:, b, :, :n], caches[0].k[:, b, :, :n])
            assert_close(caches[1].v[:, b, :, :n], caches[0].v[:, b, :, :n])
    steps = graphs.backend.steps
    assert sorted((k[3], k[4], k[5]) for k in steps) == [(2, 1, None), (2, 4, budget)]
    # unequal trees fit no bucket: they run eagerly (the fused forward on their packed tokens), no new step
    v = [m.verify(c, [trees[0], trees[1][:2]], [[-1, 0, 0, 1], [-1, 0]], budget=budget)
         for m, c in zip((ref, graphs), caches)]
    assert_close(v[1].logits[0], v[0].logits[0])
    assert_close(v[1].logits[1, :2], v[0].logits[1, :2])
    assert_close(v[1].hidden[1][1, :2], v[0].hidden[1][1, :2])
    assert torch.equal(v[1].expert_stats, v[0].expert_stats)
    assert len(graphs.backend.steps) == 2


def test_buckets_go_with_their_cache_and_the_least_recently_used_makes_room(folder, monkeypatch):
    """A long-lived model serving run after run (each with its own cache): a run's buckets are dropped
    once its cache is gone (they held neither it nor its memory), and with the table full the least
    recently used bucket makes room, so new shapes still get a bucket (and the steps stay right)."""
    import gc

    from moespec.runtime import graphs as graphs_module

    monkeypatch.setattr(graphs_module, "MAX_BUCKETS", 2)
    ref, graphs = load(folder, "fp32"), load(folder, "fp32")
    ref.backend_name, graphs.backend_name = "reference", "graphs"
    backend = graphs.backend
    for run in range(3):  # three runs one after the other, each decoding with its own cache
        caches = [m.new_cache(1, 32) for m in (ref, graphs)]
        for m, c in zip((ref, graphs), caches):
            m.prefill(c, [PROMPTS[0]])
        for token in (7, 8):
            d = [m.decode(c, [token]) for m, c in zip((ref, graphs), caches)]
            assert_close(d[1].logits, d[0].logits)
        assert [s.cache for s in backend.steps.values()] == [caches[1]], f"run {run}: only its own bucket"
        del caches, c, d  # (c: the loop variable)
        gc.collect()
    cache = graphs.new_cache(1, 32)
    assert all(s.cache is None for s in backend.steps.values())  # the last run's bucket: its cache gone
    graphs.prefill(cache, [PROMPTS[0]])
    graphs.decode(cache, [7])
    assert [s.cache for s in backend.steps.values()] == [cache]  # (the dead one dropped on the way)
    keys = []
    for T in (2, 3, 2, 4):  # chains of T tokens: buckets (1, 2), (1, 3), (1, 2) again, then (1, 4)
        graphs.verify(cache, [list(range(5, 5 + T))], [[-1] + list(range(T - 1))])
        cache.pending = None
        keys.append(sorted(k[4] for k in backend.steps))
    # T=3 evicts the decode bucket (least recently used); T=2 again is a hit and becomes the most
    # recent; T=4 then evicts T=3
    assert keys == [[1, 2], [2, 3], [2, 3], [2, 4]]
    want = ref.new_cache(1, 32)
    ref.prefill(want, [PROMPTS[0]])
    ref.decode(want, [7])
    v = [m.verify(c, [[5, 6, 7, 8]], [[-1, 0, 1, 2]]) for m, c in ((ref, want), (graphs, cache))]
    assert_close(v[1].logits, v[0].logits)


def test_greedy_speculation_through_graphs_equals_ar(folder):
    from moespec.spec.train import new_head

    target = load(folder, "fp32")
    target.backend_name = "graphs"
    head = new_head(target.config, target.weights.embed, None, seed=0)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(load(folder, "fp32")).generate(PROMPTS, params)]
    config = SpeculativeConfig("eagle3", depth=3, top_k=3, total_tokens=6)
    llm = LLM(target, draft=head, speculative_config=config, max_batch_size=2)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == want


@pytest.mark.parametrize("batch", [1, 2])
def test_draft_rounds_replayed_from_a_captured_graph_equal_the_eager_rounds(folder, batch, monkeypatch):
    """MOESPEC_DRAFT_GRAPHS=1 as on a GPU (moespec.spec.draft_graph), on the CPU: the round captured into
    fake_graph's stand-in for a CUDA graph (ops recorded, not run, at the capture) and the tree core's
    value checks deferred to the finalize. The first round's trees and problems are its eager run's,
    every replayed round gives the trees of the same round run eagerly, so does every replayed catch-up
    (moespec.spec.draft_graph.StaticCatchUp: the head's output after each accepted path), the head's
    output after each step's catch-up is the eager-draft run's (so the paths' features are), and greedy
    eagle3 through them equals greedy ar, after an eager-draft run on the same target (as tests/gpu/bench_runtime_cuda.py
    runs it). (Regression: the first finalize read the ok flags of the capture, which a capture does not
    compute: "root_tokens: expected token ids in [0, 2^31) ..." on an H200.)"""
    from moespec.spec.eagle3_policy import Eagle3Policy
    from moespec.spec.llm import _Request

    params = SamplingParams(max_tokens=14, ignore_eos=True)
    prompts = PROMPTS[:batch]
    want = [o.outputs[0].token_ids for o in LLM(load(folder, "fp32")).generate(prompts, params)]
    target, head = _gpu_like_paths(folder, monkeypatch)
    replayed = []

    def generate(graphs: str) -> tuple[list[list[int]], Eagle3Policy]:
        monkeypatch.setenv("MOESPEC_DRAFT_GRAPHS", graphs)
        heads[graphs] = []  # the head's output after each step's catch-up
        policy = Eagle3Policy(target, head, SpeculativeConfig("eagle3", depth=4, top_k=4, total_tokens=8))
        requests = [_Request(i, None, list(p), params, set()) for i, p in enumerate(prompts)]
        run = policy.start(requests)
        for r, first in zip(requests, run.first_tokens):
            r.output.append(first)
        while min(len(r.output) for r in requests) < params.max_tokens:
            for r, emitted in zip(requests, policy.step(run, requests)):
                r.output.extend(emitted)
            heads[graphs].append(run.extra["draft_logits"].clone())
            static = policy._static
            if static is not None and static.graph.replays:  # the same inputs again, eagerly: the same trees
                trees = [t.clone() for t in static.builder.finalize_host()]
                static._round()
                for a, b in zip(trees, static.builder.finalize_host()):
                    for name in ("tokens", "parents", "depth", "mask_words", "paths", "scores"):
                        assert torch.equal(getattr(a, name), getattr(b, name)), name
                replayed.append(static.graph.replays)
            for bucket in policy._catch_ups.values():  # the steps' catch-ups: replay == the same call eagerly
                if bucket.graph is not None and bucket.graph.replays > seen.get(id(bucket), 0):
                    seen[id(bucket)] = bucket.graph.replays
                    got = tuple(t.clone() for t in bucket.out)
                    for a, b in zip(got, bucket._call()):
                        assert torch.equal(a, b), "a replayed catch-up"
        return [r.output[: params.max_tokens] for r in requests], policy

    seen, heads = {}, {}  # catch-up bucket -> the replays checked; MOESPEC_DRAFT_GRAPHS -> draft logits a step

    assert generate("0")[0] == want
    outputs, policy = generate("1")
    assert outputs == want and replayed, "no round was replayed"
    assert seen, "no catch-up was replayed"
    # the static catch-up (its path features gathered into its buffers) leaves the head where the eager
    # one does, step after step (greedy outputs cannot tell: they do not depend on the draft)
    assert len(heads["0"]) == len(heads["1"])
    for step, (a, b) in enumerate(zip(heads["0"], heads["1"])):
        assert_close(b, a, 1e-4)  # (step by step)
    static = policy._static
    logits, hidden = static.logits.clone(), static.hidden.clone()
    with pytest.raises(ValueError, match=r"^root_tokens: expected token ids .*\(checked at finalize"):
        static.run([-3] * batch, logits, hidden)  # a replay writes the round's flags
    assert len(static.run([7] * batch, logits, hidden)) == batch  # and the next replay rewrites them


def _gpu_like_paths(folder, monkeypatch, core: str = "fused"):
    """A target (graphs backend) and a random head on the code paths a GPU takes, on the CPU: the
    head's torch ops (a fake capture records no native call), F.linear, draft graphs captured into
    fake_graph's stand-in, and the tree core ``core`` (a GPU's default: the fused one) with its value
    checks deferred."""
    from fake_graph import fake_capture
    from moespec.spec import draft_graph, eagle3_policy
    from moespec.spec.train import new_head
    from moespec.spec.tree import TreeBuilder

    target = load(folder, "fp32")
    target.backend_name = "graphs"
    head = new_head(target.config, target.weights.embed, None, seed=0)
    head.native_step = False
    monkeypatch.setattr(importlib.import_module("moespec.ops.linear"), "NATIVE_MAX_ROWS", 0)
    monkeypatch.setattr(draft_graph, "capture", fake_capture)
    monkeypatch.setattr(draft_graph.StaticDraftRound, "capture_on", ("cuda", "cpu"))
    monkeypatch.setattr(draft_graph.StaticCatchUp, "capture_on", ("cuda", "cpu"))

    def gpu_like_builder(*args, **kwargs):
        builder = TreeBuilder(*args, **{**kwargs, "core": core})
        builder._core.check_now = False
        assert builder._core.kernels == (core == "fused")
        return builder

    monkeypatch.setattr(eagle3_policy, "TreeBuilder", gpu_like_builder)
    monkeypatch.setenv("MOESPEC_DRAFT_GRAPHS", "1")
    return target, head


HOST_READS = ("tolist", "item", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__")


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "greedy+sampled"])
def test_an_eagle3_step_reads_the_device_back_once(folder, sampled, monkeypatch):
    """An eagle3 step on a GPU's code paths (draft graphs, the torch tree core, the graphs backend,
    the argmax where the logits are), on the CPU: every host read of a tensor's values (tolist, item,
    numpy, cpu, bool/int/float) is counted, but those in the CPU bodies of moespec's decoder kernels
    and of the uniforms a sampled request draws on the host from its generator: one a step, the
    acceptance's copy back (the round's problem flags, the trees' tokens and parents, the argmax
    choices and the sampled tree's token probabilities and bonus draws together). Until 2026-12-06 a
    step read back three times (the round's shapes at the finalize, the trees' tokens for the
    verify's checks, then the acceptance), and a sampled request twice more (its tree, its logits):
    on a GPU each a synchronisation (tests/gpu/test_runtime_cuda.py counts them there)."""
    from moespec.spec import eagle3_policy
    from moespec.spec.eagle3_policy import Eagle3Policy

    target, head = _gpu_like_paths(folder, monkeypatch)
    monkeypatch.setattr(eagle3_policy, "accept_trees",
                        functools.partial(eagle3_policy.accept_trees, on_host=False))
    params = [SamplingParams(max_tokens=40, ignore_eos=True),
              SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.8 if sampled else 0.0, top_p=0.9, seed=3)]
    policy = Eagle3Policy(target, head, SpeculativeConfig("eagle3", depth=4, top_k=4, total_tokens=8))
    _, _, step = started(policy, params)
    step()  # (the capture)
    steps = 4
    reads = _host_reads(monkeypatch, step, steps)
    assert sum(reads.values()) == steps, dict(reads)
    assert policy._static.graph.replays == steps


def started(policy, params, prompts=PROMPTS) -> tuple:
    """Requests of ``prompts`` (``params[i]`` each) started on ``policy``; returns (run, requests, step),
    step() running one step and appending what it emitted."""
    from moespec.spec.llm import _Request

    requests = [_Request(i, None, list(p), q, set()) for i, (p, q) in enumerate(zip(prompts, params))]
    run = policy.start(requests)
    for r, first in zip(requests, run.first_tokens):
        r.output.append(first)

    def step():
        for r, emitted in zip(requests, policy.step(run, requests)):
            r.output.extend(emitted)

    return run, requests, step


def _host_reads(monkeypatch, step, steps: int) -> collections.Counter:
    """Runs ``step()`` ``steps`` times counting every host read of a tensor's values (HOST_READS), but
    those in the CPU bodies of moespec's decoder kernels and of the uniforms drawn on the host
    (torch.rand: a request's generator); {"name at file:line": count}."""
    import traceback

    reads, draws = collections.Counter(), set()  # draws: the host uniforms' storage
    kept = []  # (the draws themselves, alive: a later tensor at a freed draw's address would go uncounted)

    def counted(name, fn):
        def read(self, *args, **kwargs):
            stack = traceback.extract_stack()[:-1]
            if not any(f.filename.endswith("moespec/ops/decoder.py") for f in stack) and \
                    self.untyped_storage().data_ptr() not in draws:  # (a kernel's CPU body, a host draw)
                reads[f"{name} at {stack[-1].filename.rsplit('/', 1)[-1]}:{stack[-1].lineno}"] += 1
            return fn(self, *args, **kwargs)
        return read

    def rand(*args, **kwargs):
        t = torch_rand(*args, **kwargs)
        draws.add(t.untyped_storage().data_ptr())
        kept.append(t)
        return t

    torch_rand = torch.rand
    with monkeypatch.context() as patch:
        patch.setattr(torch, "rand", rand)
        for name in HOST_READS:
            patch.setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
        for _ in range(steps):
            step()
    return reads


def test_the_captured_round_and_catch_up_read_nothing_back(folder, monkeypatch):
    """What a GPU captures of an eagle3 step (the draft round, the catch-up) reads no tensor back on
    the host, the torch versions of the decoder ops included (a GPU's MOESPEC_FUSED_STEP=0, the CPU's
    bodies here): a capture refuses the synchronisation. Until 2026-12-06 the torch tree attention
    read its packing offsets back (tolist), so a GPU run with MOESPEC_FUSED_STEP=0 failed at its
    first draft-round capture."""
    import traceback

    from moespec.spec.eagle3_policy import Eagle3Policy

    target, head = _gpu_like_paths(folder, monkeypatch)
    policy = Eagle3Policy(target, head, SpeculativeConfig("eagle3", depth=4, top_k=4, total_tokens=8))
    run, requests, step = started(policy, [SamplingParams(max_tokens=40, ignore_eos=True)] * 2)
    reads = collections.Counter()

    def counted(name, fn):
        def read(self, *args, **kwargs):
            stack = traceback.extract_stack()[:-1]
            if any(f.filename.endswith("moespec/spec/draft_graph.py") and f.name in ("_round", "_call") for f in stack):
                reads[f"{name} at {stack[-1].filename.rsplit('/', 1)[-1]}:{stack[-1].lineno}"] += 1
            return fn(self, *args, **kwargs)
        return read

    with monkeypatch.context() as patch:
        for name in HOST_READS:
            patch.setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
        for _ in range(3):  # (the captures, then replays)
            step()
    assert policy._static.graph is not None and policy._catch_ups
    assert not reads, dict(reads)


def test_a_greedy_ar_step_reads_the_device_back_once(folder, monkeypatch):
    """Plain decoding of a batch on the graphs backend, with the argmax as a GPU takes it: one host
    read a step (the batch's tokens in one copy), not one a request (2026-12-06)."""
    from moespec.spec import policies, sampling

    target = load(folder, "fp32")
    target.backend_name = "graphs"
    monkeypatch.setattr(sampling, "greedy_choice", lambda logits: logits.max(dim=-1).indices)
    _, requests, step = started(policies.ARPolicy(target), [SamplingParams(max_tokens=20, ignore_eos=True)] * 2)
    reads = _host_reads(monkeypatch, step, 4)
    assert sum(reads.values()) == 4, dict(reads)
    want = [o.outputs[0].token_ids[:5] for o in LLM(load(folder, "fp32")).generate(
        PROMPTS, SamplingParams(max_tokens=5, ignore_eos=True))]
    assert [r.output for r in requests] == want


def test_a_deferred_rounds_problem_is_raised_by_the_step_before_its_commit(folder, monkeypatch):
    """A step's draft round is read back with its acceptance (no copy of its own): a problem the
    round recorded on the device (here a NaN draft log-probability, as a broken head gives) is raised
    by that step, naming the argument, before anything of the verified trees is committed."""
    from moespec.spec import eagle3_policy
    from moespec.spec.eagle3_policy import Eagle3Policy

    target, head = _gpu_like_paths(folder, monkeypatch)
    monkeypatch.setattr(eagle3_policy, "accept_trees",
                        functools.partial(eagle3_policy.accept_trees, on_host=False))
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    policy = Eagle3Policy(target, head, SpeculativeConfig("eagle3", depth=3, top_k=2, total_tokens=4))
    run, _, step = started(policy, [params] * 2)
    step()
    lengths = list(run.cache.lengths)
    run.extra["draft_logits"] = torch.full_like(run.extra["draft_logits"], float("nan"))
    with pytest.raises(ValueError, match=r"^logprobs: expected log-probabilities .*\(checked at finalize"):
        step()
    assert run.cache.lengths == lengths and run.cache.pending is None


def test_a_static_catch_up_equals_the_eager_one(folder, monkeypatch):
    """moespec.spec.draft_graph.StaticCatchUp (the step's catch-up, a CUDA graph a (B, T) bucket on a
    GPU) on the CPU with fake_graph's stand-in for a capture: the same calls on two draft caches, one
    eager and one through the buckets (captured at their first call, replayed after), give the same
    head outputs and the same cache entries, bit for bit, call after call: paths of 1-3 entries,
    padded requests, a request without entries. (Greedy speculation's output cannot tell: it does not
    depend on what the draft computes.)"""
    from fake_graph import fake_capture
    from moespec.spec import draft_graph
    from moespec.spec.eagle3_policy import Eagle3Policy
    from moespec.spec.train import new_head

    target = load(folder, "fp32")
    head = new_head(target.config, target.weights.embed, None, seed=0)
    head.native_step = False  # the torch ops, as on a GPU
    monkeypatch.setattr(importlib.import_module("moespec.ops.linear"), "NATIVE_MAX_ROWS", 0)  # (F.linear)
    monkeypatch.setattr(draft_graph, "capture", fake_capture)
    monkeypatch.setattr(draft_graph.StaticCatchUp, "capture_on", ("cuda", "cpu"))
    monkeypatch.setenv("MOESPEC_DRAFT_GRAPHS", "1")
    assert_static_catch_up_equals_eager(Eagle3Policy(target, head, SpeculativeConfig("eagle3", depth=3, top_k=2,
                                                                                       total_tokens=4)))


def assert_static_catch_up_equals_eager(policy) -> None:
    """The catch-up calls below on two draft caches of ``policy``'s head (on the target's device), one
    eagerly and one through the static buckets, give the same outputs and cache entries, bit for bit;
    every bucket is replayed at least once (tests/gpu/test_runtime_cuda.py runs this on CUDA graphs)."""
    from moespec.spec import draft_graph
    from moespec.spec.policies import Run

    head, dev = policy.head, policy.target.device
    B, Ht, V = 2, policy.target.config.hidden_size, policy.target.config.vocab_size
    runs = [Run(None, [0] * B, extra={"draft_cache": head.new_cache(B, 40)}) for _ in range(2)]
    gen = torch.Generator().manual_seed(0)
    replays = collections.Counter()  # bucket -> calls that found its graph made (a CUDA graph counts nothing)
    run_bucket = draft_graph.StaticCatchUp.run

    def counted(bucket, *args, **kwargs):
        replays[id(bucket)] += bucket.graph is not None
        return run_bucket(bucket, *args, **kwargs)

    draft_graph.StaticCatchUp.run = counted
    try:
        _catch_up_calls(policy, runs, gen, B, Ht, V, dev)
    finally:
        draft_graph.StaticCatchUp.run = run_bucket
    buckets = policy._catch_ups
    assert sorted(buckets) == [(2, 1), (2, 2), (2, 3)]
    assert all(replays[id(b)] >= 1 for b in buckets.values()), "every bucket replayed at least once"


def _catch_up_calls(policy, runs, gen, B, Ht, V, dev) -> None:
    """Catch-ups of B requests with 0-3 entries each, eagerly on runs[0] and statically on runs[1]."""
    for n in ([2, 2], [3, 1], [1, 3], [2, 2], [3, 1], [0, 2], [1, 1], [3, 3], [1, 3], [1, 0]):
        T = max(n)
        tokens = [torch.randint(0, V, (k,), generator=gen).tolist() for k in n]
        features = tuple(torch.randn(B, T, Ht, generator=gen).to(dev, policy.target.dtype) for _ in range(3))
        for run, static in zip(runs, (False, True)):
            policy._catch_up(run, tokens, features, static=static)
        eager, replayed = (r.extra for r in runs)
        assert torch.equal(eager["draft_logits"], replayed["draft_logits"]), n
        assert torch.equal(eager["draft_hidden"], replayed["draft_hidden"]), n
        a, b = (r.extra["draft_cache"] for r in runs)
        assert a.lengths == b.lengths
        for request, length in enumerate(a.lengths):
            assert torch.equal(a.k[:, request, :, :length], b.k[:, request, :, :length]), n
            assert torch.equal(a.v[:, request, :, :length], b.v[:, request, :, :length]), n


def test_the_draft_rounds_kernel_count_on_a_gpus_paths(tmp_path):
    """python -m moespec.tools.count_kernels: a static draft round (depth 4, top-k 4, 8 nodes) and a
    catch-up on the GPU's code paths stay within the kernels they had after 2026-12-05's trims (297
    and 45 before: the head's logits norm, its rope table, the levels' constant mask bits and the
    deferred checks reduced into their flags), with moespec's ops counted as their kernels and no
    plain-torch body counted; and the step's own launches besides its graphs, at B = 1 and 8."""
    import json

    from moespec.tools import count_kernels

    got = count_kernels.count(depth=4, top_k=4, nodes=8)
    assert got["round"]["kernels"] <= 90 and got["catch_up"]["kernels"] <= 25, got
    # the fused tree core (a GPU's default): a level and a finalize one kernel each (239 kernels a round
    # on the torch core's ops; 297 before 2026-12-05)
    assert got["round"]["ops"]["draft_tree_expand"] == 4 and got["round"]["ops"]["draft_tree_finalize"] == 1
    assert count_kernels.count(depth=4, top_k=4, nodes=8, tree_core="torch")["round"]["kernels"] <= 250
    # the verify graph of the 2-layer model: 11 kernels a layer (norm, q/k/v, inputs, attention + combine, o,
    # norm, router, routing, the MoE pair) and 6 besides (33 when tokens, positions and slots were copied
    # out of the packed inputs and cos and sin gathered apart)
    verify = got["verify"]["ops"]
    assert got["verify"]["kernels"] <= 30 and verify["[moe_experts]"] == 4 and verify["[route_experts]"] == 2, verify
    # the step besides its three graphs: 41 before the trees were left uncopied and the verify's
    # geometry and the acceptance's copy back made in a few launches for any B (2026-12-06)
    # (27 and 33 before the verify's logits and taps were borrowed from its graph's buffers, not copied)
    assert got["step"]["kernels"] <= 25 and got["step"]["graphs"] == ["catch_up", "round", "verify"], got["step"]
    assert count_kernels.count(depth=4, top_k=4, nodes=8, batch=8)["step"]["kernels"] <= 31  # (110 before)
    for name in ("round", "catch_up"):
        ops = got[name]["ops"]
        assert ops["[linear]"] >= 6 and ops["[rms_norm]"] >= 3 and ops["[tree_attention]"] >= 2, ops
        assert not {"pow", "rsqrt", "mean", "scaled_dot_product_attention", "nonzero"} & set(ops), ops  # (bodies, checks)
    out = tmp_path / "counts.json"
    assert count_kernels.main(["--json", str(out)]) == 0
    assert json.loads(out.read_text())["round"]["kernels"] == got["round"]["kernels"]
    with pytest.raises(SystemExit):
        count_kernels.main(["--depth", "0"])


def test_a_borrowed_verify_returns_the_buckets_buffers(folder, monkeypatch):
    """verify_trees(borrow=True) on the graphs backend (its steps "captured" into a stand-in whose replay
    reruns the step and writes the results into the captured call's outputs, as a CUDA graph's replay
    rewrites its static buffers): the same logits and taps as a copied call, as views of the bucket's
    buffers (the next call of the bucket rewrites them: what eagle3's step relies on using them before
    its next verify), the expert stats copied either way."""
    from moespec.runtime import graphs
    from moespec.spec.tree import TreeBuilder

    class Rerun:
        def __init__(self, fn, out):
            self.fn, self.out = fn, out

        def replay(self):
            new = self.fn()
            for static, value in zip((self.out.logits, *self.out.hidden, self.out.expert_stats),
                                     (new.logits, *new.hidden, new.expert_stats)):
                static.copy_(value)

    def rerun_capture(fn, pool=None):
        out = fn()
        return Rerun(fn, out), out

    monkeypatch.setattr(graphs, "capture", rerun_capture)
    monkeypatch.setattr(graphs.StaticStep, "capture_on", ("cuda", "cpu"))

    target = load(folder, "fp32")
    target.set_taps([0])
    target.backend_name = "graphs"
    V = target.config.vocab_size
    g = torch.Generator().manual_seed(5)
    runs = []
    for _ in range(2):
        builder = TreeBuilder(2, depth=3, top_k=2, total_tokens=6)
        builder.expand_root(torch.randint(0, V, (2,), generator=g), torch.randint(0, V, (2, 2), generator=g),
                            -torch.rand(2, 2, generator=g))
        while builder.can_expand:
            builder.expand(torch.randint(0, V, (2, 2, 2), generator=g), -torch.rand(2, 2, 2, generator=g))
        runs.append([t.clone() for t in builder.finalize()])
    cache = target.new_cache(2, 64)
    target.prefill(cache, [PROMPTS[0], PROMPTS[1]])

    def verify(trees, borrow):
        out = target.verify_trees(cache, trees, borrow=borrow)
        cache.pending = None
        return out

    copied = verify(runs[0], False)
    borrowed = verify(runs[0], True)
    assert torch.equal(borrowed.logits, copied.logits) and torch.equal(borrowed.hidden[0], copied.hidden[0])
    stats, kept = borrowed.expert_stats.clone(), copied.logits.clone()
    other = verify(runs[1], False)
    assert not torch.equal(other.logits, kept)
    assert torch.equal(borrowed.logits, other.logits) and torch.equal(borrowed.hidden[0], other.hidden[0])  # rewritten
    assert torch.equal(copied.logits, kept) and torch.equal(borrowed.expert_stats, stats)  # copies stay
