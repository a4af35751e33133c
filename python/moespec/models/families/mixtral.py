"""Mixtral: Llama attention; every layer MoE (block_sparse_moe, w1/w3/w2); top-k always renormalised,
routing weights kept in fp32."""

from __future__ import annotations

from moespec.models.config import ModelConfig, MoeConfig, RawConfig, parse_common
from moespec.models.families.base import Family, TensorNames
from moespec.ops import RouterSpec


def parse_config(cfg: RawConfig, architecture: str) -> ModelConfig:
    if cfg.get("sliding_window") is not None:
        raise cfg.fail("sliding_window", "sliding-window attention is not supported (set it to null)")
    common = parse_common(cfg, architecture)
    top_k = cfg.require("num_experts_per_tok")
    moe = MoeConfig(
        num_experts=cfg.require_any("num_local_experts", "num_experts"),
        top_k=top_k,
        intermediate_size=common["intermediate_size"],
        router=RouterSpec("softmax", top_k, True),
        layers=tuple(range(common["num_layers"])),
        weights_in_model_dtype=False,  # fp32 routing weights scale the expert outputs
    )
    return ModelConfig(**common, qk_norm="none", moe=moe)


FAMILY = Family(
    architectures=("MixtralForCausalLM",),
    parse_config=parse_config,
    names=TensorNames(moe="model.layers.{i}.block_sparse_moe.", expert_proj=("w1", "w3", "w2")),
)
