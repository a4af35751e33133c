"""Qwen2-MoE: Llama attention (q/k/v biases switchable by ``qkv_bias``, no o_proj bias); softmax top-k
router (norm_topk_prob) plus a shared expert whose output is scaled by sigmoid(shared_expert_gate . x);
MoE layers chosen by decoder_sparse_step and mlp_only_layers as in Qwen3-MoE. The embedded default
model (:mod:`moespec.default_model`) is one."""

from __future__ import annotations

from moespec.models.config import ModelConfig, RawConfig
from moespec.models.families.base import Family
from moespec.models.families.qwen3_moe import parse_qwen_moe


def parse_config(cfg: RawConfig, architecture: str) -> ModelConfig:
    if cfg.get("qkv_bias", True):
        # The runtime's attention_bias means q/k/v *and* o_proj biases; Qwen2-MoE has no o_proj bias.
        raise cfg.fail("qkv_bias", "q/k/v biases without an o_proj bias are not supported yet (set it to false)")
    return parse_qwen_moe(cfg, architecture, qk_norm="none",
                          shared_intermediate_size=cfg.require("shared_expert_intermediate_size"))


FAMILY = Family(architectures=("Qwen2MoeForCausalLM",), parse_config=parse_config)
