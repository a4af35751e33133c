"""The EAGLE-3 draft head's typed configuration (:class:`Eagle3Config`): parsed once from an official,
SpecForge or vLLM speculators ``config.json`` for a target, and written back in SpecForge's layout;
the feature layers (``eagle_aux_hidden_state_layer_ids``: "input of layer j", moespec's taps are
output-of-layer indices). The head itself is :mod:`moespec.spec.eagle3`, which re-exports these."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from moespec.models.config import ModelConfig, RawConfig, RopeConfig, parse_rope


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low/mid/high taps in moespec's "output of layer i" indexing: ``(1, L//2 - 1, L - 4)``.

    That is EAGLE's and vLLM's ``{2, L//2, L-3}`` in their "input of layer j" indexing (REFERENCE.md
    1.3). Targets of ``L <= 5`` layers (tiny test models) have no such triple; they get the first,
    middle and last layer, ``(0, L//2, L - 1)``.
    """
    if num_layers < 1:
        raise ValueError(f"default_aux_layers: num_layers must be >= 1, got {num_layers}")
    if num_layers <= 5:
        return (0, num_layers // 2, num_layers - 1)
    return (1, num_layers // 2 - 1, num_layers - 4)


def _rope_scaling(rope: RopeConfig) -> Optional[dict[str, Any]]:
    """The HF 4.x ``rope_scaling`` dict of a RopeConfig (None for plain rope); parse_rope reads it."""
    if rope.kind == "default":
        return None
    if rope.kind == "linear":
        return {"rope_type": "linear", "factor": rope.factor}
    return {"rope_type": "llama3", "factor": rope.factor, "low_freq_factor": rope.low_freq_factor,
            "high_freq_factor": rope.high_freq_factor, "original_max_position_embeddings": rope.original_max_position}


def _flatten(raw: dict[str, Any]) -> dict[str, Any]:
    """vLLM speculators configs nest the layer config under ``transformer_layer_config``."""
    inner = raw.get("transformer_layer_config")
    if not isinstance(inner, dict):
        return raw
    keep = ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids", "eagle_config",
            "norm_before_residual")
    return {**inner, **{k: raw[k] for k in keep if k in raw}}


@dataclass(frozen=True)
class Eagle3Config:
    """Shape and arithmetic of an EAGLE-3 head, plus which target layers feed it."""

    hidden_size: int  # H
    intermediate_size: int  # I
    num_heads: int  # Hq
    num_kv_heads: int  # Hkv
    head_dim: int  # D
    rms_norm_eps: float
    rope: RopeConfig
    vocab_size: int  # V, the target's vocabulary
    draft_vocab_size: int  # Vd
    target_hidden_size: int  # Ht
    aux_layers: tuple[int, int, int]  # low, mid, high target layers whose *output* feeds fc (0-based)
    norm_before_residual: bool = False  # vLLM variant: the residual is hidden_norm(h), not h
    max_position_embeddings: int = 4096

    def __post_init__(self):
        sizes = dict(hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                     num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                     vocab_size=self.vocab_size, draft_vocab_size=self.draft_vocab_size,
                     target_hidden_size=self.target_hidden_size)
        for name, value in sizes.items():
            if int(value) < 1:
                raise ValueError(f"Eagle3Config: {name} must be >= 1, got {value}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"Eagle3Config: num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"Eagle3Config: draft_vocab_size={self.draft_vocab_size} exceeds "
                             f"vocab_size={self.vocab_size}")
        if len(self.aux_layers) != 3 or any(int(i) < 0 for i in self.aux_layers):
            raise ValueError(f"Eagle3Config: aux_layers must be three layer indices >= 0, got {self.aux_layers}")

    @classmethod
    def from_config(cls, raw: dict[str, Any], target: ModelConfig, source: str = "config.json") -> "Eagle3Config":
        """Parses an EAGLE-3 ``config.json`` (official, SpecForge or vLLM speculators) for ``target``.

        Taps come from ``eagle_aux_hidden_state_layer_ids`` (top level or under ``eagle_config``,
        vLLM's "input of layer j" convention, converted to output of layer j - 1), else
        :func:`default_aux_layers`. A missing ``draft_vocab_size`` means the full vocabulary; a
        missing ``target_hidden_size`` means the head's own hidden size. ValueError names the field.
        """
        raw = _flatten(raw)
        cfg = RawConfig(raw, source)
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise cfg.fail("hidden_act", f"only 'silu' is supported, got {act!r}")
        if int(cfg.get("num_hidden_layers", 1)) != 1:
            raise cfg.fail("num_hidden_layers", f"an EAGLE-3 head has one layer, got {raw['num_hidden_layers']}")
        hidden = cfg.require("hidden_size")
        heads = cfg.require("num_attention_heads")
        vocab = cfg.require("vocab_size") if "vocab_size" in raw else target.vocab_size
        if vocab != target.vocab_size:
            raise cfg.fail("vocab_size", f"the head is for a vocabulary of {vocab}, the target has {target.vocab_size}")
        if "target_hidden_size" in raw and raw["target_hidden_size"] is not None:
            target_hidden = cfg.require("target_hidden_size")
            if target_hidden != target.hidden_size:
                raise cfg.fail("target_hidden_size", f"the head expects target hidden size {target_hidden}, "
                                                     f"the target model has {target.hidden_size}")
        else:
            target_hidden = hidden
            if hidden != target.hidden_size:
                raise cfg.fail("hidden_size", f"the head has hidden size {hidden} and no target_hidden_size, so it "
                                              f"expects a target of hidden size {hidden}; the target has "
                                              f"{target.hidden_size}")
        draft_vocab = cfg.require("draft_vocab_size") if raw.get("draft_vocab_size") is not None else vocab
        return cls(
            hidden_size=hidden,
            intermediate_size=cfg.require("intermediate_size"),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads", heads)),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=parse_rope(cfg),
            vocab_size=vocab,
            draft_vocab_size=draft_vocab,
            target_hidden_size=target_hidden,
            aux_layers=_aux_layers(cfg, target.num_layers),
            norm_before_residual=bool(cfg.get("norm_before_residual", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", target.max_position_embeddings)),
        )

    def to_config(self) -> dict[str, Any]:
        """The ``config.json`` of this head in SpecForge's EAGLE-3 layout (what from_config reads).

        ``eagle_aux_hidden_state_layer_ids`` is written in vLLM's "input of layer j" convention:
        ``aux_layers[i] + 1`` (top level and under ``eagle_config``).
        """
        ids = [int(i) + 1 for i in self.aux_layers]
        return {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": 1,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope.theta,
            "rope_scaling": _rope_scaling(self.rope),
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "tie_word_embeddings": False,
            "norm_before_residual": self.norm_before_residual,
            "eagle_aux_hidden_state_layer_ids": ids,
            "eagle_config": {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": ids},
        }


def _aux_layers(cfg: RawConfig, num_layers: int) -> tuple[int, int, int]:
    key = "eagle_aux_hidden_state_layer_ids"
    top = cfg.raw.get(key)
    nested = (cfg.raw.get("eagle_config") or {}).get(key) if isinstance(cfg.raw.get("eagle_config"), dict) else None
    if top is not None and nested is not None and list(top) != list(nested):
        raise cfg.fail(key, f"top level says {list(top)}, eagle_config says {list(nested)}")
    ids = top if top is not None else nested
    if ids is None:
        return default_aux_layers(num_layers)
    if not isinstance(ids, (list, tuple)) or len(ids) != 3 or not all(isinstance(j, int) for j in ids):
        raise cfg.fail(key, f"expected three layer ids, got {ids!r}")
    for j in ids:  # "input of layer j" = output of layer j - 1; j = L is the last layer's output
        if not 1 <= j <= num_layers:
            raise cfg.fail(key, f"layer id {j} is outside [1, {num_layers}] for a target of {num_layers} layers "
                                f"(ids name the input of layer j; 0, the embedding output, is not supported)")
    return tuple(j - 1 for j in ids)
