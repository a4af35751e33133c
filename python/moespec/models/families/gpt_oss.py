"""GPT-OSS: GQA attention with q/k/v/o biases, a learned sink logit per head, sliding-window attention
on the layers ``layer_types`` names; every layer MoE with a biased router (top-k on the logits,
softmax over the k) and clamped SwiGLU experts with biases (``swiglu_limit``, ``swiglu_alpha``);
RMSNorm scaling in float32; YaRN rope. Experts load from the checkpoint's interleaved, transposed
tensors or their MXFP4 blocks (:func:`moespec.models.weights.dequantize_mxfp4`)."""

from __future__ import annotations

from moespec.models.config import ModelConfig, MoeConfig, RawConfig, parse_common
from moespec.models.families.base import Family, TensorNames
from moespec.ops import RouterSpec

LAYER_TYPES = ("sliding_attention", "full_attention")


def parse_config(cfg: RawConfig, architecture: str) -> ModelConfig:
    common = parse_common(cfg, architecture)
    L = common["num_layers"]
    types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(L)]
    if len(types) != L or any(t not in LAYER_TYPES for t in types):
        raise cfg.fail("layer_types", f"expected {L} entries of {LAYER_TYPES}, got {types!r}")
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    window = int(cfg.get("sliding_window") or 0)
    if sliding and window < 1:
        raise cfg.fail("sliding_window", f"layers {list(sliding)} slide, so a window >= 1 is required, got {window}")
    top_k = cfg.require("num_experts_per_tok")
    moe = MoeConfig(
        num_experts=cfg.require_any("num_local_experts", "num_experts"),
        top_k=top_k,
        intermediate_size=common["intermediate_size"],
        router=RouterSpec("gpt_oss", top_k),
        layers=tuple(range(L)),
        weights_in_model_dtype=True,  # the router's softmax runs in the model dtype
        activation="gpt_oss",
        expert_biases=True,
        router_bias=True,
        swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
    )
    common["attention_bias"] = bool(cfg.get("attention_bias", True))
    return ModelConfig(**common, qk_norm="none", moe=moe, sliding_window=window if sliding else 0,
                       sliding_layers=sliding, attention_sinks=True, norm_scale_fp32=True)


FAMILY = Family(
    architectures=("GptOssForCausalLM",),
    parse_config=parse_config,
    names=TensorNames(router="router.weight"),
)
