"""moespec.models against transformers on tiny random checkpoints that transformers itself writes.

- prefill + 8 decode steps equal transformers' forward for every family (fp32: max |d| <= 1e-4 of
  the logit scale; bf16: see test_bf16_*);
- a verified tree's logits equal transformers' (custom 4-D ancestor mask) and decoding each node's
  path token by token with our own runtime (hypothesis over tree shapes);
- commit keeps exactly the accepted path; budgets B >= N change nothing, B < N equal transformers
  with its MoE blocks routed by the plain-torch reference of the budget semantics;
- batched requests of different lengths equal each request alone; bad input raises clear errors.
"""

from __future__ import annotations

import json
import shutil

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, given, settings

import moespec.models as mm
from moespec.ops import ExpertBudget

from models_fixtures import (
    FAMILIES, MOE_FAMILIES, V, assert_close, check_prefill_and_decode, hf_routing_near_tie, hf_tree_logits, reference,
    write_checkpoint,
)

pytestmark = pytest.mark.usefixtures("one_thread")
# A decode step attends one query over the cache, where transformers recomputes the whole sequence:
# the attention sums then run over differently shaped GEMMs, so bf16 logits may differ by a few bf16
# ulps (1 ulp = 2^-8 relative): we accept 2% of the logit scale.
BF16_DECODE_TOL = 2e-2


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {f: write_checkpoint(f, root / f) for f in FAMILIES}


@pytest.fixture(scope="session")
def models(checkpoints):
    return {f: mm.load(p, "fp32", taps=(0,)) for f, p in checkpoints.items()}


@pytest.fixture(scope="session")
def refs(checkpoints):
    return {f: reference(p) for f, p in checkpoints.items()}


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---- prefill and decode ---------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_and_decode_match_transformers(family, models, refs):
    model, hf = models[family], refs[family]
    check_prefill_and_decode(model, hf, _prompt(11, 1))


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_matches_transformers_bf16(family, checkpoints):
    """bf16 with the reference experts: the runtime performs transformers' operations in their order
    and dtype (RMSNorm in fp32, routing weights cast as each family does, eager experts' per-expert
    index_add_ in bf16), so prefill logits are bit-identical to transformers' eager bf16 forward."""
    model = mm.load(checkpoints[family], "bf16", moe_impl="reference")
    hf = reference(checkpoints[family], torch.bfloat16)
    prompt = _prompt(9, 2)
    cache = model.new_cache(1, 32)
    got = model.prefill(cache, [prompt], logits="all").logits[0]
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0]
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want)
    seq = list(prompt)
    for token in (5, 17, 33, 64):
        seq.append(token)
        got = model.decode(cache, [token]).logits[0]
        with torch.no_grad():
            want = hf(torch.tensor([seq])).logits[0, -1]
        assert_close(got, want, tol=BF16_DECODE_TOL)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_bf16_kernel_experts_stay_close_to_transformers(family, checkpoints):
    """The default (native kernel) experts accumulate in fp32 where transformers' eager experts round
    every expert's contribution to bf16, so bf16 logits differ by a few bf16 ulps: we accept
    BF16_DECODE_TOL of the logit scale, and the same greedy token at >= 80% of positions."""
    model = mm.load(checkpoints[family], "bf16")
    assert model.moe_impl == "kernel"
    hf = reference(checkpoints[family], torch.bfloat16)
    prompt = _prompt(9, 2)
    got = model.prefill(model.new_cache(1, 32), [prompt], logits="all").logits[0]
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0]
    assert_close(got, want, tol=BF16_DECODE_TOL)
    assert (got.float().argmax(-1) == want.float().argmax(-1)).float().mean() >= 0.8


def test_moe_impl_switch(checkpoints):
    model = mm.load(checkpoints["olmoe"], "fp32")
    prompt = _prompt(6, 5)
    kernel = model.prefill(model.new_cache(1, 8), [prompt]).logits
    model.moe_impl = "reference"
    assert_close(kernel, model.prefill(model.new_cache(1, 8), [prompt]).logits, tol=1e-5)
    with pytest.raises(ValueError, match="moe_impl: expected one of"):
        model.moe_impl = "fast"


def test_sharded_checkpoint_loads_the_same_weights(tmp_path, checkpoints, models):
    folder = write_checkpoint("qwen3_moe", tmp_path / "sharded", max_shard_size="100KB")
    assert (folder / "model.safetensors.index.json").is_file()
    sharded = mm.load(folder, "fp32", taps=(0,))
    prompt = _prompt(5, 3)
    a = sharded.prefill(sharded.new_cache(1, 8), [prompt]).logits
    b = models["qwen3_moe"].prefill(models["qwen3_moe"].new_cache(1, 8), [prompt]).logits
    assert torch.equal(a, b)


def test_batch_of_prompts_of_different_lengths_equals_each_alone(models):
    model = models["qwen3_moe"]
    prompts = [_prompt(n, 10 + n) for n in (3, 12, 7)]
    cache = model.new_cache(3, 32)
    batched = model.prefill(cache, prompts, logits="all")
    step = model.decode(cache, [5, 6, 7])
    for b, p in enumerate(prompts):
        alone_cache = model.new_cache(1, 32)
        alone = model.prefill(alone_cache, [p], logits="all")
        assert_close(batched.logits[b, : len(p)], alone.logits[0], tol=1e-5)
        assert_close(step.logits[b], model.decode(alone_cache, [5 + b]).logits[0], tol=1e-5)
    assert cache.lengths == [4, 13, 8]


# ---- tree verify and commit -------------------------------------------------------------------------


@st.composite
def trees(draw, max_nodes=12):
    n = draw(st.integers(1, max_nodes))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens = [draw(st.integers(3, V - 1)) for _ in range(n)]
    return tokens, parents


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(family=st.sampled_from(FAMILIES), tree=trees(), prompt_len=st.integers(1, 9))
def test_tree_logits_equal_decoding_each_path(family, tree, prompt_len, models, refs):
    model, hf = models[family], refs[family]
    tokens, parents = tree
    prompt = _prompt(prompt_len, prompt_len)
    cache = model.new_cache(1, 32)
    model.prefill(cache, [prompt])
    got = model.verify(cache, [tokens], [parents]).logits[0]  # [T, V]
    assert_close(got, hf_tree_logits(hf, prompt, tokens, parents))
    for node in range(len(tokens)):
        path, j = [], node
        while j >= 0:
            path.insert(0, tokens[j])
            j = parents[j]
        path_cache = model.new_cache(1, 32)
        model.prefill(path_cache, [prompt])
        for t in path:
            last = model.decode(path_cache, [t]).logits[0]
        assert_close(got[node], last, tol=1e-5)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(family=st.sampled_from(FAMILIES), tree=trees(), data=st.data())
def test_commit_keeps_the_accepted_path(family, tree, data, models, refs):
    model, hf = models[family], refs[family]
    tokens, parents = tree
    leaf = data.draw(st.integers(0, len(tokens) - 1))
    path_nodes, j = [], leaf
    while j >= 0:
        path_nodes.insert(0, j)
        j = parents[j]
    prompt = _prompt(6, 4)
    cache = model.new_cache(1, 48)
    model.prefill(cache, [prompt])
    model.verify(cache, [tokens], [parents])
    model.commit(cache, [path_nodes])
    assert cache.lengths == [len(prompt) + len(path_nodes)]
    follow = [7, 8, 9]
    got = [model.decode(cache, [t]).logits[0] for t in follow]
    seq = prompt + [tokens[n] for n in path_nodes]
    fresh_cache = model.new_cache(1, 48)
    model.prefill(fresh_cache, [seq])
    for t, g in zip(follow, got):
        assert_close(g, model.decode(fresh_cache, [t]).logits[0], tol=1e-5)
        seq.append(t)
        if not hf_routing_near_tie(hf, seq):  # (a near-tie's expert follows the summation order)
            with torch.no_grad():
                assert_close(g, hf(torch.tensor([seq])).logits[0, -1])


def test_batched_trees_equal_each_tree_alone(models):
    model = models["mixtral"]
    prompts = [_prompt(4, 1), _prompt(9, 2)]
    trees_ = [([10, 11, 12, 13], [-1, 0, 0, 2]), ([20, 21], [-1, 0])]
    cache = model.new_cache(2, 32)
    model.prefill(cache, prompts)
    batched = model.verify(cache, [t for t, _ in trees_], [p for _, p in trees_]).logits
    for b, (prompt, (tokens, parents)) in enumerate(zip(prompts, trees_)):
        alone = model.new_cache(1, 32)
        model.prefill(alone, [prompt])
        assert_close(batched[b, : len(tokens)], model.verify(alone, [tokens], [parents]).logits[0], tol=1e-5)


# ---- expert budget --------------------------------------------------------------------------------


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_budget_at_least_n_is_the_exact_verify(family, models):
    model = models[family]
    E = model.config.moe.num_experts
    prompt, tokens, parents = _prompt(5, 7), [9, 10, 11, 12, 13, 14], [-1, 0, 0, 1, 1, 2]
    outs = []
    for budget in (None, ExpertBudget(E), ExpertBudget(E + 5, "truncation")):
        cache = model.new_cache(1, 32)
        model.prefill(cache, [prompt])
        outs.append(model.verify(cache, [tokens], [parents], budget=budget))
    for o in outs[1:]:
        assert torch.equal(o.logits, outs[0].logits)
        assert torch.equal(o.expert_stats, outs[0].expert_stats)
    assert all(s.rerouted == s.dropped == 0 and s.kept == s.natural_unique for s in outs[0].expert_stats_by_layer())


@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("policy,score,exact", [("substitution", "probability", 0), ("truncation", "probability", 0),
                                                ("substitution", "gates", 0), ("truncation", "gates", 1)])
def test_budget_equals_the_reference_semantics_layer_by_layer(family, policy, score, exact, models, refs):
    model, hf = models[family], refs[family]
    K = model.config.moe.top_k
    budget = ExpertBudget(K if exact else max(K, 3), policy, score=score, exact_layers=exact)  # (binds after exact)
    prompt = _prompt(6, 8)
    tokens, parents = [30, 31, 32, 33, 34, 35, 36, 37], [-1, 0, 0, 1, 1, 2, 3, 3]
    cache = model.new_cache(1, 32)
    model.prefill(cache, [prompt])
    out = model.verify(cache, [tokens], [parents], budget=budget)
    record: list = []
    want = hf_tree_logits(hf, prompt, tokens, parents, budget=budget, record=record)
    assert_close(out.logits[0], want)
    stats = out.expert_stats_by_layer()
    assert stats == record  # natural, kept, re-routed and dropped per MoE layer
    assert all(s.kept <= budget.max_experts for s in stats[exact:])
    assert all(s.kept == s.natural_unique and s.rerouted == s.dropped == 0 for s in stats[:exact])
    assert any(s.rerouted + s.dropped > 0 for s in stats), "the budget should bind on this tree"


def test_prefill_and_decode_never_budget(models):
    out = models["olmoe"].prefill(models["olmoe"].new_cache(1, 16), [_prompt(8, 9)])
    assert all(s.kept == s.natural_unique and s.rerouted == s.dropped == 0 for s in out.expert_stats_by_layer())
    assert out.expert_stats.shape == (2, 4)


# ---- bad input ----------------------------------------------------------------------------------------


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_and_misshaped_tensors_are_named(tmp_path, checkpoints):
    from safetensors.torch import load_file, save_file

    folder = _copy(checkpoints["qwen3_moe"], tmp_path / "bad")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.2.mlp.experts.3.up_proj.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"tensor 'model.layers.2.mlp.experts.3.up_proj.weight' is missing"):
        mm.load(folder, "fp32")
    tensors["model.layers.2.mlp.experts.3.up_proj.weight"] = torch.zeros(32, 63)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"has shape \(32, 63\), expected \(32, 64\)"):
        mm.load(folder, "fp32")


@pytest.mark.parametrize(
    "edit,match",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture 'GPT2LMHeadModel'"),
        ({"architectures": None}, "architectures"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "factor": 4.0}}, "rope_type='longrope' is not supported"),
        ({"use_sliding_window": True}, "sliding-window attention is not supported"),
        ({"num_hidden_layers": None}, "required field 'num_hidden_layers' is missing"),
    ],
)
def test_configs_the_runtime_cannot_honour_are_errors(tmp_path, checkpoints, edit, match):
    folder = _copy(checkpoints["qwen3_moe"], tmp_path / "cfg")
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(edit)
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        mm.load(folder, "fp32")


def test_missing_and_corrupt_files(tmp_path, checkpoints):
    with pytest.raises(ValueError, match="does not exist"):
        mm.load(tmp_path / "nowhere")
    folder = _copy(checkpoints["llama"], tmp_path / "corrupt")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 3])
    with pytest.raises(ValueError, match="cannot read"):
        mm.load(folder, "fp32")
    (folder / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no model.safetensors or model.safetensors.index.json"):
        mm.load(folder, "fp32")
    (folder / "config.json").unlink()
    with pytest.raises(ValueError, match="no config.json"):
        mm.load(folder, "fp32")
    with pytest.raises(ValueError, match="dtype must be one of"):
        mm.load(checkpoints["llama"], "int8")


def test_runtime_misuse_is_an_error(models):
    model = models["llama"]
    cache = model.new_cache(2, 8)
    with pytest.raises(ValueError, match="cache overflow: request 1 holds 0 tokens, 9 more exceed max_len=8"):
        model.prefill(cache, [[5], list(range(3, 12))])
    with pytest.raises(ValueError, match="got 1 requests, the cache holds 2"):
        model.prefill(cache, [[5]])
    with pytest.raises(ValueError, match=f"token id {V} outside the vocabulary"):
        model.prefill(cache, [[5], [V]])
    with pytest.raises(ValueError, match="no tokens to run"):
        model.prefill(cache, [[], []])
    with pytest.raises(ValueError, match="no verified tree is pending"):
        model.commit(cache, [[0], [0]])
    model.prefill(cache, [[5, 6], [7]])
    with pytest.raises(ValueError, match="parents must be earlier nodes"):
        model.verify(cache, [[1, 2], [3]], [[-1, 1], [-1]])
    with pytest.raises(ValueError, match="its parent must be -1"):
        model.verify(cache, [[1, 2], [3]], [[0, 0], [-1]])
    model.verify(cache, [[1, 2, 3], [4]], [[-1, 0, 0], [-1]])
    with pytest.raises(ValueError, match="a verified tree is pending"):
        model.decode(cache, [1, 2])
    with pytest.raises(ValueError, match="node 2 is not a child of node 1"):
        model.commit(cache, [[0, 1, 2], [0]])
    model.commit(cache, [[0, 2], [0]])
    assert cache.lengths == [4, 2]
    with pytest.raises(ValueError, match="taps: layer 7 does not exist"):
        model.set_taps([7])


# ---- devices (the CUDA runtime's host side; tests/gpu/test_runtime_cuda.py runs it on a GPU) --------


def test_devices_are_checked_and_weights_move_as_one(tmp_path):
    """``device`` is validated with a message naming it (models.load and LLM); ModelWeights.to moves every tensor once
    (a tied lm_head stays the embedding itself; "meta" stands in for a GPU here); a model on the CPU
    given device="cpu" explicitly is the default one."""
    import dataclasses

    from moespec import LLM

    with pytest.raises(ValueError, match="'tpu'"):
        mm.check_device("tpu")
    with pytest.raises(ValueError, match="not a device"):
        mm.check_device("cuda:x")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            mm.check_device("cuda")
        with pytest.raises(ValueError, match="no CUDA device"):
            mm.load(write_checkpoint("qwen3_moe", tmp_path / "q"), "fp32", device="cuda")
        with pytest.raises(ValueError, match="no CUDA device"):
            LLM(write_checkpoint("qwen3_moe", tmp_path / "r"), device="cuda")
    src = write_checkpoint("qwen3_moe", tmp_path / "src")
    model = mm.load(src, "fp32", device="cpu")
    assert model.device == torch.device("cpu") and model.new_cache(1, 4).k.device.type == "cpu"
    w = model.weights
    assert w.to("cpu") is w
    meta = w.to("meta")
    tensors = [meta.embed, meta.final_norm, meta.lm_head] + [getattr(layer, f.name) for layer in meta.layers
                                                             for f in dataclasses.fields(layer)
                                                             if isinstance(getattr(layer, f.name), torch.Tensor)]
    assert all(t.device.type == "meta" for t in tensors) and meta.device.type == "meta"
    assert (meta.lm_head is meta.embed) == (w.lm_head is w.embed)
    assert w.embed.device.type == "cpu"  # the original is untouched


def test_a_layers_float32_tensors_are_converted_once():
    """LayerWeights.float32: the float32 form of a tensor (the MoE layer's biases at every call), made
    once and kept while the tensor is the same object, not a dataclass field (engines and copies do not
    see it); float32 tensors and None as they are."""
    import dataclasses

    from moespec.models.weights import LayerWeights

    H = 4
    biases = torch.randn(2, 6).to(torch.bfloat16)
    layer = LayerWeights(input_norm=torch.ones(H), qkv=None, qkv_bias=None, q_norm=None, k_norm=None,
                         o=torch.ones(H, H), o_bias=None, post_norm=torch.ones(H), expert_biases=biases,
                         score_bias=torch.zeros(2))
    first = layer.float32("expert_biases")
    assert first.dtype == torch.float32 and torch.equal(first, biases.float())
    assert layer.float32("expert_biases") is first  # kept
    assert layer.float32("score_bias") is layer.score_bias and layer.float32("router") is None
    layer.expert_biases = biases * 2  # a new tensor: converted again
    assert torch.equal(layer.float32("expert_biases"), (biases * 2).float())
    assert "_float32" not in {f.name for f in dataclasses.fields(layer)}
