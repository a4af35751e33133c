"""The "graphs" backend's static steps (moespec.runtime.graphs) on the CPU, where they run eagerly:
the same logits, taps and expert stats as the reference backend on the same calls, buckets reused
across calls, calls outside every bucket falling back, and greedy speculation through it equal to
greedy AR. (On a GPU, tests/gpu/test_runtime_cuda.py holds graph replay against eager.)"""

from __future__ import annotations

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
    assert sorted((k[2], k[3], k[4]) for k in steps) == [(2, 1, None), (2, 4, budget)]
    # unequal trees fit no bucket: they run eagerly (the fused forward on their packed tokens), no new step
    v = [m.verify(c, [trees[0], trees[1][:2]], [[-1, 0, 0, 1], [-1, 0]], budget=budget)
         for m, c in zip((ref, graphs), caches)]
    assert_close(v[1].logits[0], v[0].logits[0])
    assert_close(v[1].logits[1, :2], v[0].logits[1, :2])
    assert_close(v[1].hidden[1][1, :2], v[0].hidden[1][1, :2])
    assert torch.equal(v[1].expert_stats, v[0].expert_stats)
    assert len(graphs.backend.steps) == 2


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
    every replayed round gives the trees of the same round run eagerly, and greedy eagle3 through it
    equals greedy ar, after an eager-draft run on the same target (as tests/gpu/bench_runtime_cuda.py
    runs it). (Regression: the first finalize read the ok flags of the capture, which a capture does not
    compute: "root_tokens: expected token ids in [0, 2^31) ..." on an H200.)"""
    from fake_graph import fake_capture
    from moespec.spec import draft_graph, eagle3_policy
    from moespec.spec.eagle3_policy import Eagle3Policy
    from moespec.spec.llm import _Request
    from moespec.spec.train import new_head
    from moespec.spec.tree import TreeBuilder

    target = load(folder, "fp32")
    target.backend_name = "graphs"
    head = new_head(target.config, target.weights.embed, None, seed=0)
    head.native_step = False  # the torch ops, as on a GPU (a fake capture records no native call)
    monkeypatch.setattr(importlib.import_module("moespec.ops.linear"), "NATIVE_MAX_ROWS", 0)  # (F.linear)
    params = SamplingParams(max_tokens=14, ignore_eos=True)
    prompts = PROMPTS[:batch]
    want = [o.outputs[0].token_ids for o in LLM(load(folder, "fp32")).generate(prompts, params)]
    monkeypatch.setattr(draft_graph, "capture", fake_capture)
    monkeypatch.setattr(draft_graph.StaticDraftRound, "capture_on", ("cuda", "cpu"))

    def gpu_like_builder(*args, **kwargs):  # the torch core, its value checks deferred to the finalize
        builder = TreeBuilder(*args, **{**kwargs, "core": "torch"})
        builder._core.check_now = False
        return builder

    monkeypatch.setattr(eagle3_policy, "TreeBuilder", gpu_like_builder)
    replayed = []

    def generate(graphs: str) -> tuple[list[list[int]], Eagle3Policy]:
        monkeypatch.setenv("MOESPEC_DRAFT_GRAPHS", graphs)
        policy = Eagle3Policy(target, head, SpeculativeConfig("eagle3", depth=4, top_k=4, total_tokens=8))
        requests = [_Request(i, None, list(p), params, set()) for i, p in enumerate(prompts)]
        run = policy.start(requests)
        for r, first in zip(requests, run.first_tokens):
            r.output.append(first)
        while min(len(r.output) for r in requests) < params.max_tokens:
            for r, emitted in zip(requests, policy.step(run, requests)):
                r.output.extend(emitted)
            static = policy._static
            if static is not None and static.graph.replays:  # the same inputs again, eagerly: the same trees
                trees = [t.clone() for t in static.builder.finalize_host()]
                static._round()
                for a, b in zip(trees, static.builder.finalize_host()):
                    for name in ("tokens", "parents", "depth", "mask_words", "paths", "scores"):
                        assert torch.equal(getattr(a, name), getattr(b, name)), name
                replayed.append(static.graph.replays)
        return [r.output[: params.max_tokens] for r in requests], policy

    assert generate("0")[0] == want
    outputs, policy = generate("1")
    assert outputs == want and replayed, "no round was replayed"
    static = policy._static
    logits, hidden = static.logits.clone(), static.hidden.clone()
    with pytest.raises(ValueError, match=r"^root_tokens: expected token ids .*\(checked at finalize"):
        static.run([-3] * batch, logits, hidden)  # a replay writes the round's flags
    assert len(static.run([7] * batch, logits, hidden)) == batch  # and the next replay rewrites them
