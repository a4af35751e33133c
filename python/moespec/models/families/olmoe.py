"""OLMoE: RMSNorm over the whole q and k projections (not per head), optional clip_qkv; every layer
MoE with a softmax top-k router (norm_topk_prob, off in OLMoE-1B-7B)."""

from __future__ import annotations

from moespec.models.config import ModelConfig, MoeConfig, RawConfig, parse_common
from moespec.models.families.base import Family
from moespec.ops import RouterSpec


def parse_config(cfg: RawConfig, architecture: str) -> ModelConfig:
    common = parse_common(cfg, architecture)
    top_k = cfg.require("num_experts_per_tok")
    moe = MoeConfig(
        num_experts=cfg.require_any("num_experts", "num_local_experts"),
        top_k=top_k,
        intermediate_size=common["intermediate_size"],
        router=RouterSpec("softmax", top_k, bool(cfg.get("norm_topk_prob", False))),
        layers=tuple(range(common["num_layers"])),
        weights_in_model_dtype=True,
    )
    return ModelConfig(**common, qk_norm="full", moe=moe)


FAMILY = Family(architectures=("OlmoeForCausalLM",), parse_config=parse_config)
