"""moespec's vLLM plugin on vLLM's CPU build: the EAGLE-3 classes it registers, and greedy outputs
against stock vLLM and against moespec's own runtime, on a tiny random Mixtral (the default model's
family) written by transformers, in fp32, eager (no compilation)."""

from __future__ import annotations

import pytest
import torch

PROMPTS = [[5, 17, 33, 64, 9, 21], [3, 4, 120, 77, 13]]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny random Mixtral with head_dim 64 (vLLM's CPU attention takes no smaller head)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=128, hidden_size=128, intermediate_size=64, num_hidden_layers=4,
                           num_attention_heads=2, num_key_value_heads=1, num_local_experts=8, num_experts_per_tok=2,
                           initializer_range=0.1, max_position_embeddings=128, bos_token_id=1, eos_token_id=2)
    out = tmp_path_factory.mktemp("vllm") / "mixtral"
    MixtralForCausalLM(config).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def head(folder, tmp_path_factory):
    """A random EAGLE-3 head for the target, in the official folder format vLLM loads."""
    from moespec.models import load
    from moespec.spec.train import _write_head, new_head

    target = load(folder, "fp32")
    out = tmp_path_factory.mktemp("head")
    _write_head(new_head(target.config, target.weights.embed, None, seed=0, aux_layers=(0, 1, 2)), out, {})
    return out


def generate(folder, speculative=None, max_tokens: int = 12) -> list[list[int]]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=str(folder), tokenizer=None, skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
              max_model_len=64, max_num_seqs=2, speculative_config=speculative, seed=0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS],
                        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False))
    del llm
    return [list(o.outputs[0].token_ids) for o in outs]


def test_the_plugin_registers_eagle3_classes():
    from vllm import ModelRegistry
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    for arch in ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "OlmoeForCausalLM"):
        cls = ModelRegistry._try_load_model_cls(arch)
        assert cls.__module__ == "moespec.integrations.vllm.eagle3" and cls.supports_eagle3, arch


def test_vllm_greedy_equals_moespec(folder):
    """vLLM (with the plugin: the EAGLE-3 class, unused without a draft) == moespec's runtime, greedy fp32."""
    from moespec import LLM, SamplingParams

    want = [o.outputs[0].token_ids for o in LLM(str(folder), dtype="fp32").generate(
        PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True))]
    assert generate(folder) == want


def test_vllm_eagle3_through_the_plugin_equals_ar(folder, head):
    """vLLM's EAGLE-3 (chain drafts) on the plugin's Mixtral class: greedy output == greedy ar."""
    want = generate(folder)
    got = generate(folder, {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3})
    assert got == want


def _budget_run(folder, head, budget: str):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "MOESPEC_BUDGET": budget, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).parent), str(Path(__file__).parents[1] / "python")])}
    run = subprocess.run([sys.executable, str(Path(__file__).parent / "budget_run.py"), str(folder), str(head)],
                         env=env, capture_output=True, text=True, timeout=600)
    return run, (json.loads(run.stdout.strip().splitlines()[-1]) if run.returncode == 0 else None)


def test_a_binding_budget_caps_every_verify_pass(folder, head):
    """MOESPEC_BUDGET=3 (of 8 experts, top-2): every budgeted routing call (verify passes only: 4
    tokens each, 2 MoE layers... as many calls as layers x verify passes) keeps at most 3 experts and
    some would have used more; a budget of 8 (all experts) changes nothing: the output is greedy ar's."""
    run, got = _budget_run(folder, head, "3")
    assert run.returncode == 0, run.stderr[-3000:]
    stats = got["stats"]
    assert stats and all(kept <= 3 for _, kept, _, _ in stats) and any(natural > 3 for natural, _, _, _ in stats)
    assert len(stats) % 4 == 0  # 4 MoE layers per verify pass: whole passes only (prefill and decode untouched)
    run, free = _budget_run(folder, head, "8")
    assert run.returncode == 0, run.stderr[-3000:]
    assert free["outputs"] == generate(folder) and all(kept == natural for natural, kept, _, _ in free["stats"])


def test_a_bad_budget_is_an_error_at_engine_start(folder, head):
    run, _ = _budget_run(folder, head, "many")
    assert run.returncode != 0 and "MOESPEC_BUDGET='many'" in run.stderr
