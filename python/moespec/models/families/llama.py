"""Llama (dense): the default model's base and the reference layout every family starts from."""

from __future__ import annotations

from moespec.models.config import ModelConfig, RawConfig, parse_common
from moespec.models.families.base import Family


def parse_config(cfg: RawConfig, architecture: str) -> ModelConfig:
    if cfg.get("mlp_bias", False):
        raise cfg.fail("mlp_bias", "feed-forward biases are not supported")
    if int(cfg.get("pretraining_tp", 1)) != 1:
        raise cfg.fail("pretraining_tp", "tensor-parallel pretraining splits are not supported")
    return ModelConfig(**parse_common(cfg, architecture), qk_norm="none", moe=None)


FAMILY = Family(architectures=("LlamaForCausalLM",), parse_config=parse_config)
