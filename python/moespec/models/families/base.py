"""What a model family provides: its config parser and where its tensors live in a checkpoint."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from moespec.models.config import ModelConfig, RawConfig


@dataclass(frozen=True)
class TensorNames:
    """Names of a family's tensors in a Hugging Face checkpoint; ``{i}`` is the layer, ``{e}`` the expert.

    The defaults are the Llama/Qwen layout; families override what differs.
    """

    embed: str = "model.embed_tokens.weight"
    final_norm: str = "model.norm.weight"
    lm_head: str = "lm_head.weight"
    attn: str = "model.layers.{i}.self_attn."  # + q_proj / k_proj / v_proj / o_proj (.weight, .bias)
    q_norm: str = "model.layers.{i}.self_attn.q_norm.weight"
    k_norm: str = "model.layers.{i}.self_attn.k_norm.weight"
    input_norm: str = "model.layers.{i}.input_layernorm.weight"
    post_norm: str = "model.layers.{i}.post_attention_layernorm.weight"
    mlp: str = "model.layers.{i}.mlp."  # dense feed-forward: + gate_proj / up_proj / down_proj .weight
    moe: str = "model.layers.{i}.mlp."  # MoE block: + router, experts
    router: str = "gate.weight"
    expert: str = "experts.{e}.{proj}.weight"  # per-expert (legacy) layout on disk
    expert_proj: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    fused_gate_up: str = "experts.gate_up_proj"  # transformers 5's fused [E, 2I, H] layout
    fused_down: str = "experts.down_proj"  # [E, H, I]
    shared_expert: str = "shared_expert."  # + gate/up/down_proj .weight (Qwen2-MoE; DeepSeek: shared_experts.)


@dataclass(frozen=True)
class Family:
    architectures: tuple[str, ...]
    parse_config: Callable[[RawConfig, str], ModelConfig]
    names: TensorNames = TensorNames()
