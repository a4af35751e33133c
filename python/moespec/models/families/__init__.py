"""Model families: each file holds only what one architecture does differently.

A family maps a Hugging Face ``architectures[0]`` name to (a) a parser from its raw config to
:class:`~moespec.models.config.ModelConfig` and (b) the names of its tensors in a checkpoint
(:class:`~moespec.models.families.base.TensorNames`). Adding an architecture is one new file here
and one line in ``_FAMILIES``.
"""

from __future__ import annotations

from moespec.models.families import deepseek_v3, gpt_oss, llama, mixtral, olmoe, qwen2_moe, qwen3_moe
from moespec.models.families.base import Family, TensorNames

_FAMILIES: tuple[Family, ...] = (llama.FAMILY, qwen3_moe.FAMILY, qwen2_moe.FAMILY, mixtral.FAMILY, olmoe.FAMILY,
                                gpt_oss.FAMILY, deepseek_v3.FAMILY)
BY_ARCHITECTURE: dict[str, Family] = {arch: f for f in _FAMILIES for arch in f.architectures}


def family_for(architecture: str) -> Family:
    """The family of a checkpoint's ``architectures[0]``; ValueError naming the supported ones."""
    try:
        return BY_ARCHITECTURE[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {architecture!r}: moespec runs {', '.join(sorted(BY_ARCHITECTURE))}"
        ) from None


__all__ = ["BY_ARCHITECTURE", "Family", "TensorNames", "family_for"]
