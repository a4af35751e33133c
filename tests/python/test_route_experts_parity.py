"""route_experts against transformers' own router modules (the pinned transformers 5.24).

Each family's router module is built from a tiny config inside the test, fed random hidden
states, and its outputs are the reference: identical expert ids and bit-identical fp32 weights;
in bf16 the same ids and the weights transformers' rounding order gives (Qwen3-MoE/OLMoE cast the
fp32 weights to bf16, Mixtral and DeepSeek-V3 keep fp32, GPT-OSS softmaxes in bf16).
"""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config, GptOssConfig, MixtralConfig, OlmoeConfig, Qwen3MoeConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from moespec._loader import native
from moespec.ops import RouterSpec, route_experts

H = 48  # hidden size of the tiny routers


def _router(family: str, n_experts: int, top_k: int, norm: bool, seed: int):
    torch.manual_seed(seed)
    if family == "qwen3_moe":
        cfg = Qwen3MoeConfig(hidden_size=H, num_experts=n_experts, num_experts_per_tok=top_k, norm_topk_prob=norm)
        module = Qwen3MoeTopKRouter(cfg)
    elif family == "olmoe":
        cfg = OlmoeConfig(hidden_size=H, num_experts=n_experts, num_experts_per_tok=top_k, norm_topk_prob=norm)
        module = OlmoeTopKRouter(cfg)
    elif family == "mixtral":
        cfg = MixtralConfig(hidden_size=H, num_local_experts=n_experts, num_experts_per_tok=top_k)
        module = MixtralTopKRouter(cfg)
    elif family == "deepseek_v3":
        n_group = 8 if n_experts % 8 == 0 and n_experts // 8 >= 2 else 1
        cfg = DeepseekV3Config(hidden_size=H, n_routed_experts=n_experts, num_experts_per_tok=top_k,
                               n_group=n_group, topk_group=max(1, n_group // 2), norm_topk_prob=norm,
                               routed_scaling_factor=2.5)
        module = DeepseekV3TopkRouter(cfg)
        module.e_score_correction_bias.copy_(torch.randn(n_experts) * 0.05)
    elif family == "gpt_oss":
        cfg = GptOssConfig(hidden_size=H, num_local_experts=n_experts, num_experts_per_tok=top_k)
        module = GptOssTopKRouter(cfg)
        with torch.no_grad():
            module.bias.copy_(torch.randn(n_experts) * 0.5)
    else:
        raise AssertionError(family)
    with torch.no_grad():
        module.weight.normal_(0.0, 0.5)
    return cfg, module.eval()


CASES = [
    # family, N, K, renormalise
    ("qwen3_moe", 128, 8, True),
    ("qwen3_moe", 64, 4, False),
    ("qwen3_moe", 7, 1, True),
    ("olmoe", 64, 8, False),
    ("olmoe", 16, 3, True),
    ("mixtral", 8, 2, True),
    ("mixtral", 33, 5, True),
    ("deepseek_v3", 64, 8, True),
    ("deepseek_v3", 256, 8, True),
    ("deepseek_v3", 24, 6, False),
    ("gpt_oss", 32, 4, True),
    ("gpt_oss", 128, 4, True),
    ("gpt_oss", 9, 7, True),
]


def _run_both(family, n_experts, top_k, norm, tokens, dtype, seed):
    cfg, module = _router(family, n_experts, top_k, norm, seed)
    if dtype == torch.bfloat16 and family != "deepseek_v3":  # transformers keeps DeepSeek-V3's router fp32
        module = module.to(torch.bfloat16)
    hidden = torch.randn(tokens, H, dtype=dtype)
    with torch.no_grad():
        logits, want_weights, want_ids = module(hidden)
    spec = RouterSpec.from_config(cfg)
    bias = module.e_score_correction_bias if family == "deepseek_v3" else None
    got = route_experts(logits, spec, bias=bias)
    return spec, got, want_ids, want_weights


@pytest.mark.parametrize("family,n_experts,top_k,norm", CASES)
@pytest.mark.parametrize("tokens", [1, 5, 64, 127])
def test_fp32_ids_and_weights_are_bit_identical(family, n_experts, top_k, norm, tokens):
    _, got, want_ids, want_weights = _run_both(family, n_experts, top_k, norm, tokens, torch.float32, seed=tokens)
    assert torch.equal(got.ids, want_ids.to(torch.int32)), "expert ids differ from transformers"
    assert want_weights.dtype == torch.float32
    assert torch.equal(got.weights, want_weights), (
        f"weights differ: max |d| = {(got.weights - want_weights).abs().max().item():.3g}"
    )


@pytest.mark.parametrize("family,n_experts,top_k,norm", CASES)
@pytest.mark.parametrize("tokens", [3, 64])
def test_bf16_ids_and_weights_follow_transformers_rounding(family, n_experts, top_k, norm, tokens):
    _, got, want_ids, want_weights = _run_both(family, n_experts, top_k, norm, tokens, torch.bfloat16, seed=100 + tokens)
    assert torch.equal(got.ids, want_ids.to(torch.int32))
    # transformers' bf16 weights: Qwen3/OLMoE cast to bf16, GPT-OSS softmaxes in bf16, Mixtral and
    # DeepSeek-V3 stay fp32. Ours are fp32 from the same order of operations.
    assert torch.equal(got.weights.to(want_weights.dtype), want_weights)
    if want_weights.dtype == torch.float32 or family == "gpt_oss":
        assert torch.equal(got.weights, want_weights.float())


def test_from_config_reads_every_family():
    assert RouterSpec.from_config(Qwen3MoeConfig(num_experts_per_tok=8, norm_topk_prob=True)) == RouterSpec("softmax", 8, True)
    assert RouterSpec.from_config(OlmoeConfig(num_experts_per_tok=8)).renormalize is False
    assert RouterSpec.from_config(MixtralConfig(num_experts_per_tok=2)) == RouterSpec("softmax", 2, True)
    ds = RouterSpec.from_config(DeepseekV3Config(n_group=8, topk_group=4, num_experts_per_tok=8))
    assert (ds.family, ds.n_group, ds.topk_group, ds.scaling) == ("deepseek_v3", 8, 4, 2.5)
    assert RouterSpec.from_config({"model_type": "gpt_oss", "num_experts_per_tok": 4}).family == "gpt_oss"
    with pytest.raises(ValueError, match="unknown MoE architecture model_type='llama'"):
        RouterSpec.from_config({"model_type": "llama", "num_experts_per_tok": 2})


@pytest.mark.skipif("avx2" not in native().supported_cpu_isas(), reason="this CPU has no AVX2: PyTorch cannot use its AVX2 kernels")
def test_parity_holds_with_torchs_avx2_kernels_too():
    """PyTorch picks its AVX2 kernels on CPUs without AVX-512 (8-lane reductions): run the fp32
    parity tests in a process where ATEN_CPU_CAPABILITY=avx2 forces that choice."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "fp32 or bf16"],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "passed" in result.stdout
