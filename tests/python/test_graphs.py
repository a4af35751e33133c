"""The "graphs" backend's static steps (moespec.runtime.graphs) on the CPU, where they run eagerly:
the same logits, taps and expert stats as the reference backend on the same calls, buckets reused
across calls, calls outside every bucket falling back, and greedy speculation through it equal to
greedy AR. (On a GPU, tests/gpu/test_runtime_cuda.py holds graph replay against eager.)"""

from __future__ import annotations

import pytest
import torch

from models_fixtures import assert_close, write_checkpoint
from moespec import LLM, SamplingParams, SpeculativeConfig
from moespec.models import load
from moespec.ops import ExpertBudget

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = [[5, 17, 33, 64, 9], [3, 4, 120, 77, 13]]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_checkpoint("qwen3_moe", tmp_path_factory.mktemp("graphs") / "qwen3_moe")


def test_static_steps_equal_the_reference(folder):
    ref = load(folder, "fp32", taps=(0, 2))
    ref.backend_name = "reference"
    graphs = load(folder, "fp32", taps=(0, 2))
    graphs.backend_name = "graphs"
    assert graphs.backend_name == "graphs"
    caches = [m.new_cache(2, 40) for m in (ref, graphs)]
    for m, c in zip((ref, graphs), caches):
        m.prefill(c, PROMPTS)
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
    # unequal trees fit no bucket: the reference runs them, no new step
    v = [m.verify(c, [trees[0], trees[1][:2]], [[-1, 0, 0, 1], [-1, 0]]) for m, c in zip((ref, graphs), caches)]
    assert_close(v[1].logits[0], v[0].logits[0])
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
