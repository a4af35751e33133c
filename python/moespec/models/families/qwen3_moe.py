"""Qwen3-MoE: Llama attention + RMSNorm per head on q and k; softmax top-k router (norm_topk_prob)."""

from __future__ import annotations

from moespec.models.config import ModelConfig, MoeConfig, RawConfig, parse_common
from moespec.models.families.base import Family
from moespec.ops import RouterSpec


def parse_config(cfg: RawConfig, architecture: str) -> ModelConfig:
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
    )
    return ModelConfig(**common, qk_norm="per_head", moe=moe)


FAMILY = Family(architectures=("Qwen3MoeForCausalLM",), parse_config=parse_config)
