"""Qwen3-MoE: Llama attention + RMSNorm per head on q and k; softmax top-k router (norm_topk_prob)."""

from __future__ import annotations

from moespec.models.config import ModelConfig, MoeConfig, RawConfig, parse_common
from moespec.models.families.base import Family
from moespec.ops import RouterSpec


def parse_config(cfg: RawConfig, architecture: str) -> ModelConfig:
    return parse_qwen_moe(cfg, architecture, qk_norm="per_head")


def parse_qwen_moe(cfg: RawConfig, architecture: str, *, qk_norm: str, shared_intermediate_size: int = 0) -> ModelConfig:
    """The Qwen-MoE config fields (Qwen3-MoE, and Qwen2-MoE with its shared expert): experts, top-k,
    MoE layers from decoder_sparse_step and mlp_only_layers, the softmax router."""
    if cfg.get("use_sliding_window", False):
        raise cfg.fail("use_sliding_window", "sliding-window attention is not supported")
    common = parse_common(cfg, architecture)
    experts, top_k = cfg.require_any("num_experts", "num_local_experts"), cfg.require("num_experts_per_tok")
    step = int(cfg.get("decoder_sparse_step", 1))
    dense_only = set(cfg.get("mlp_only_layers", []))
    layers = tuple(i for i in range(common["num_layers"])
                   if i not in dense_only and experts > 0 and (i + 1) % step == 0)
    moe = MoeConfig(
        num_experts=experts,
        top_k=top_k,
        intermediate_size=cfg.require("moe_intermediate_size"),
        router=RouterSpec("softmax", top_k, bool(cfg.get("norm_topk_prob", False))),
        layers=layers,
        weights_in_model_dtype=True,  # the router casts its weights to the model dtype
        shared_intermediate_size=shared_intermediate_size,
    )
    return ModelConfig(**common, qk_norm=qk_norm, moe=moe)


FAMILY = Family(architectures=("Qwen3MoeForCausalLM",), parse_config=parse_config)
