"""Typed configuration of a target model, parsed once from a checkpoint's ``config.json``.

Every family file (:mod:`moespec.models.families`) turns its raw config dict into a
:class:`ModelConfig`; nothing downstream reads the raw dict. A config the runtime cannot honour
(an unknown activation, a rope scaling it does not implement, sliding-window attention) is a
``ValueError`` naming the field.

Dimensions: L layers, H hidden, Hq query heads, Hkv key/value heads, D head dim, I intermediate
size, E experts, K top-k, V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch

from moespec.ops import RouterSpec


@dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding: ``default``, ``linear`` (position interpolation), ``llama3`` or
    ``yarn`` (NTK-by-parts interpolation with its attention scale, GPT-OSS and DeepSeek-V3)."""

    theta: float
    kind: Literal["default", "linear", "llama3", "yarn"] = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: Optional[float] = None  # yarn: cos/sin scale; None: from factor (and mscale)
    mscale: float = 0.0
    mscale_all_dim: float = 0.0

    def yarn_mscale(self, m: float = 1.0) -> float:
        """yarn's 0.1 m ln(factor) + 1 (1 for factor <= 1), as transformers' get_mscale computes it."""
        return 1.0 if self.factor <= 1 else 0.1 * m * math.log(self.factor) + 1.0

    @property
    def attention_scaling(self) -> float:
        """The factor cos and sin are multiplied by (1 but for yarn), as transformers computes it."""
        if self.kind != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return float(self.yarn_mscale(self.mscale) / self.yarn_mscale(self.mscale_all_dim))
        return self.yarn_mscale()

    def inv_freq(self, head_dim: int) -> torch.Tensor:
        """float32 [D/2], computed as transformers computes it (same ops, same rounding)."""
        if self.kind == "yarn":
            return self._yarn_inv_freq(head_dim)
        inv = 1.0 / (self.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim))
        if self.kind == "linear":
            inv = inv / self.factor
        elif self.kind == "llama3":
            low_wavelen = self.original_max_position / self.low_freq_factor
            high_wavelen = self.original_max_position / self.high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = torch.where(wavelen > low_wavelen, inv / self.factor, inv)
            smooth = (self.original_max_position / wavelen - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor
            )
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
            inv = torch.where(medium, smoothed, scaled)
        return inv

    def _yarn_inv_freq(self, dim: int) -> torch.Tensor:
        base, factor = self.theta, self.factor

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(self.original_max_position / (rotations * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
        extrapolation = 1 - ramp
        return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


@dataclass(frozen=True)
class MoeConfig:
    """The MoE feed-forward of a model."""

    num_experts: int  # E
    top_k: int  # K
    intermediate_size: int  # I of one expert
    router: RouterSpec
    layers: tuple[int, ...]  # decoder layers whose feed-forward is MoE
    weights_in_model_dtype: bool  # routing weights cast to the model dtype before scaling (Qwen3, OLMoE)
    # Is of the shared expert that every token runs beside the routed ones, its output scaled by
    # sigmoid(shared_gate . x) (Qwen2-MoE); 0: no shared expert.
    shared_intermediate_size: int = 0
    activation: Literal["swiglu", "gpt_oss"] = "swiglu"  # gpt_oss: clamped SwiGLU (limit, alpha) with biases
    expert_biases: bool = False  # gate, up and down biases per expert (GPT-OSS)
    router_bias: bool = False  # a bias on the router logits (GPT-OSS)
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    shared_gated: bool = True  # the shared expert's output scaled by sigmoid(shared_gate . x) (Qwen2-MoE)
    router_fp32: bool = False  # router logits from float32 x and weights (DeepSeek-V3)
    score_bias: bool = False  # deepseek_v3's e_score_correction_bias on the selection scores


@dataclass(frozen=True)
class MlaConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): queries through an optional low-rank projection,
    keys and values from one compressed latent (cached with the rope key, not full keys and values).
    The head dimension splits into a no-rope part and a rope part (D of the model is the rope part)."""

    q_lora_rank: Optional[int]  # None: a full-rank q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # the rope dims come in interleaved pairs (DeepSeek's checkpoints)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelConfig:
    """Everything the runtime needs to know about a target model's shape and arithmetic."""

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense feed-forward size (dense layers; 0 if every layer is MoE)
    rms_norm_eps: float
    rope: RopeConfig
    qk_norm: Literal["none", "per_head", "full"]  # Qwen3: RMSNorm per head; OLMoE: over the projection
    attention_bias: bool
    clip_qkv: Optional[float]
    tie_word_embeddings: bool
    max_position_embeddings: int
    moe: Optional[MoeConfig]
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: Optional[int] = None
    sliding_window: int = 0  # W of the sliding layers: a token sees keys less than W positions back
    sliding_layers: tuple[int, ...] = ()  # layers with sliding-window attention (GPT-OSS's layer_types)
    attention_sinks: bool = False  # one learned logit per head in every softmax's denominator (GPT-OSS)
    norm_scale_fp32: bool = False  # RMSNorm scales in float32, then casts (GPT-OSS); else casts, then scales
    mla: Optional[MlaConfig] = None  # multi-head latent attention instead of GQA (DeepSeek-V3)

    def window(self, layer: int) -> int:
        """The sliding window of ``layer``: W, or 0 for full attention."""
        return self.sliding_window if layer in self.sliding_layers else 0

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer in self.moe.layers

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return self.moe.layers if self.moe is not None else ()


class RawConfig:
    """Typed access to a raw ``config.json`` dict with errors that name the field."""

    def __init__(self, raw: dict[str, Any], source: str = "config.json"):
        self.raw = raw
        self.source = source

    def get(self, key: str, default: Any = None) -> Any:
        value = self.raw.get(key, default)
        return default if value is None else value

    def require(self, key: str, kind: type = int) -> Any:
        if key not in self.raw or self.raw[key] is None:
            raise ValueError(f"{self.source}: required field '{key}' is missing")
        value = self.raw[key]
        try:
            return kind(value)
        except (TypeError, ValueError):
            raise ValueError(f"{self.source}: field '{key}' must be {kind.__name__}, got {value!r}") from None

    def require_any(self, *keys: str) -> int:
        """The first of ``keys`` present (configs name some fields differently across versions)."""
        for key in keys:
            if self.raw.get(key) is not None:
                return self.require(key)
        raise ValueError(f"{self.source}: required field '{keys[0]}' is missing")

    def fail(self, key: str, message: str) -> ValueError:
        return ValueError(f"{self.source}: field '{key}': {message}")


def parse_rope(cfg: RawConfig) -> RopeConfig:
    """Rope settings from transformers 5's ``rope_parameters`` or 4.x's ``rope_theta``/``rope_scaling``."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling")
    if scaling:
        params = {**params, **scaling}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "yarn":
        return RopeConfig(
            theta, "yarn", factor=float(params["factor"]),
            original_max_position=int(params.get("original_max_position_embeddings") or 4096),
            beta_fast=float(params.get("beta_fast") or 32.0), beta_slow=float(params.get("beta_slow") or 1.0),
            truncate=bool(params.get("truncate", True)),
            attention_factor=None if params.get("attention_factor") is None else float(params["attention_factor"]),
            mscale=float(params.get("mscale") or 0.0), mscale_all_dim=float(params.get("mscale_all_dim") or 0.0))
    if float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))) != 1.0:
        raise cfg.fail("partial_rotary_factor", "partial rotary embeddings are not supported")
    if kind == "default":
        return RopeConfig(theta)
    if kind == "linear":
        return RopeConfig(theta, "linear", factor=float(params["factor"]))
    if kind == "llama3":
        return RopeConfig(
            theta,
            "llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position=int(params.get("original_max_position_embeddings", 8192)),
        )
    raise cfg.fail("rope_parameters", f"rope_type={kind!r} is not supported (supported: default, linear, llama3, "
                                      f"yarn)")


def parse_common(cfg: RawConfig, architecture: str) -> dict[str, Any]:
    """The fields every decoder family shares, as ModelConfig keyword arguments."""
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise cfg.fail("hidden_act", f"only 'silu' feed-forwards are supported, got {act!r}")
    hidden = cfg.require("hidden_size")
    heads = cfg.require("num_attention_heads")
    head_dim = cfg.get("head_dim") or hidden // heads
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((int(eos),) if eos is not None else ())
    return dict(
        architecture=architecture,
        model_type=cfg.require("model_type", str),
        vocab_size=cfg.require("vocab_size"),
        hidden_size=hidden,
        num_layers=cfg.require("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads", heads)),
        head_dim=int(head_dim),
        intermediate_size=int(cfg.get("intermediate_size", 0)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope=parse_rope(cfg),
        attention_bias=bool(cfg.get("attention_bias", False)),
        clip_qkv=cfg.get("clip_qkv"),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        eos_token_ids=eos_ids,
        bos_token_id=cfg.get("bos_token_id"),
    )
