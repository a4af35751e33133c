"""Qwen2-MoE: Llama attention (q/k/v biases switchable by ``qkv_bias``, no o_proj bias); softmax top-k
router (norm_topk_prob) plus a shared expert whose output is scaled by sigmoid(shared_expert_gate . x);
MoE layers chosen by decoder_sparse_step and mlp_only_layers as in Qwen3-MoE. The embedded default
model (:mod:`moespec.default_model`) is one."""

from __future__ import annotations

from moespec.models.config import ModelConfig, MoeConfig, RawConfig, parse_common
from moespec.models.families.base import Family
from moespec.ops import RouterSpec


def parse_config(cfg: RawConfig, architecture: str) -> ModelConfig:
    if cfg.get("use_sliding_window", False):
        raise cfg.fail("use_sliding_window", "sliding-window attention is not supported")
    if cfg.get("qkv_bias", True):
        # The runtime's attention_bias means q/k/v *and* o_proj biases; Qwen2-MoE has no o_proj bias.
        raise cfg.fail("qkv_bias", "q/k/v biases without an o_proj bias are not supported yet (set it to false)")
    common = parse_common(cfg, architecture)
    experts, top_k = cfg.require("num_experts"), cfg.require("num_experts_per_tok")
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
        shared_intermediate_size=cfg.require("shared_expert_intermediate_size"),
    )
    return ModelConfig(**common, qk_norm="none", moe=moe)


FAMILY = Family(architectures=("Qwen2MoeForCausalLM",), parse_config=parse_config)
