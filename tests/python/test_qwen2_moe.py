"""moespec.models on Qwen2-MoE (routed experts + a sigmoid-gated shared expert) against transformers.

A tiny random Qwen2-MoE checkpoint written by transformers itself (a dense layer in the middle via
``mlp_only_layers``, both ``norm_topk_prob`` settings, shared expert gate weights large enough that
the sigmoid is far from 1/2):
- prefill + decode logits equal transformers' (fp32 within 1e-4 of the logit scale), in both the
  kernel and the reference experts; bf16 prefill with the reference experts is bit-identical;
- a verified tree equals transformers' tree pass; under an expert budget the shared expert still
  runs for every token (models_fixtures.budgeted_moe_blocks);
- configs the runtime cannot honour (sliding window, q/k/v biases) are errors naming the field.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

import moespec.models as mm
from moespec.ops import ExpertBudget

from models_fixtures import V, assert_close, check_prefill_and_decode, hf_tree_logits, reference

pytestmark = pytest.mark.usefixtures("one_thread")


def _config(norm_topk_prob: bool) -> Qwen2MoeConfig:
    # 13 experts, top-3, a shared expert of 40 (sizes off the vector width on purpose).
    return Qwen2MoeConfig(
        vocab_size=V, hidden_size=64, intermediate_size=96, moe_intermediate_size=24,
        shared_expert_intermediate_size=40, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        num_experts=13, num_experts_per_tok=3, norm_topk_prob=norm_topk_prob, mlp_only_layers=[1],
        qkv_bias=False, initializer_range=0.1, rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
        eos_token_id=2, bos_token_id=1)


@pytest.fixture(scope="module", params=[False, True], ids=["plain_topk", "norm_topk"])
def checkpoint(request, tmp_path_factory):
    torch.manual_seed(7)
    model = Qwen2MoeForCausalLM(_config(request.param))
    with torch.no_grad():  # a gate that matters: sigmoid far from 1/2, different per token
        for layer in model.model.layers:
            if hasattr(layer.mlp, "shared_expert_gate"):
                layer.mlp.shared_expert_gate.weight.normal_(0.0, 0.5)
    folder = tmp_path_factory.mktemp("qwen2_moe") / ("norm" if request.param else "plain")
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def hf(checkpoint):
    return reference(checkpoint)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_config_has_the_shared_expert(checkpoint):
    cfg = mm.read_config(checkpoint)
    assert cfg.moe.layers == (0, 2) and cfg.moe.num_experts == 13 and cfg.moe.top_k == 3
    assert cfg.moe.shared_intermediate_size == 40 and cfg.moe.intermediate_size == 24
    assert not cfg.attention_bias and cfg.qk_norm == "none"


@pytest.mark.parametrize("impl", ["kernel", "reference"])
def test_prefill_and_decode_match_transformers(checkpoint, hf, impl):
    model = mm.load(checkpoint, "fp32", taps=(0,), moe_impl=impl)
    assert model.weights.layers[0].shared_gate.shape == (1, 64)
    assert model.weights.layers[1].shared_down is None  # the dense layer
    check_prefill_and_decode(model, hf, _prompt(11, 1))


def test_bf16_reference_experts_are_bit_identical(checkpoint):
    model = mm.load(checkpoint, "bf16", moe_impl="reference")
    hf16 = reference(checkpoint, torch.bfloat16)
    prompt = _prompt(9, 2)
    got = model.prefill(model.new_cache(1, 16), [prompt], logits="all").logits[0]
    with torch.no_grad():
        want = hf16(torch.tensor([prompt])).logits[0]
    assert torch.equal(got, want)


def test_tree_verify_matches_transformers(checkpoint, hf):
    model = mm.load(checkpoint, "fp32")
    prompt, tokens, parents = _prompt(5, 3), [9, 10, 11, 12, 13, 14, 15], [-1, 0, 0, 1, 1, 2, 5]
    cache = model.new_cache(1, 32)
    model.prefill(cache, [prompt])
    assert_close(model.verify(cache, [tokens], [parents]).logits[0], hf_tree_logits(hf, prompt, tokens, parents))


@pytest.mark.parametrize("policy", ["substitution", "truncation"])
def test_budget_keeps_the_shared_expert(checkpoint, hf, policy):
    model = mm.load(checkpoint, "fp32")
    budget = ExpertBudget(3, policy)
    prompt, tokens, parents = _prompt(6, 8), [30, 31, 32, 33, 34, 35, 36, 37], [-1, 0, 0, 1, 1, 2, 3, 3]
    cache = model.new_cache(1, 32)
    model.prefill(cache, [prompt])
    out = model.verify(cache, [tokens], [parents], budget=budget)
    assert any(s.rerouted + s.dropped > 0 for s in out.expert_stats_by_layer()), "the budget should bind"
    assert_close(out.logits[0], hf_tree_logits(hf, prompt, tokens, parents, budget=budget))


@pytest.mark.parametrize(
    "edit,match",
    [
        ({"use_sliding_window": True}, "sliding-window attention is not supported"),
        ({"qkv_bias": True}, "field 'qkv_bias'"),
        ({"shared_expert_intermediate_size": None}, "required field 'shared_expert_intermediate_size'"),
    ],
)
def test_configs_the_runtime_cannot_honour_are_errors(tmp_path, checkpoint, edit, match):
    folder = shutil.copytree(checkpoint, tmp_path / "cfg")
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(edit)
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        mm.load(folder, "fp32")
