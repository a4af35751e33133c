"""Target models: loading local checkpoints and the runtime forward pass (prefill, decode, verify).

Example::

    model = moespec.models.load("path/to/Qwen3MoeForCausalLM-folder", dtype="bf16", taps=(2, 23, 44))
    cache = model.new_cache(batch=2, max_len=512)
    out = model.prefill(cache, [[1, 2, 3], [4, 5]])          # logits [2, V] of each last token
    out = model.decode(cache, [7, 8])                        # one token each, logits [2, V]
    out = model.verify(cache, tokens=[[9, 10, 11], [12]], parents=[[-1, 0, 0], [-1]],
                       budget=moespec.ops.ExpertBudget(16))  # one tree each; logits [2, 3, V]
    model.commit(cache, [[0, 2], [0]])                       # keep root + node 2, and the root

Supported architectures: see :data:`moespec.models.families.BY_ARCHITECTURE`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Sequence

import torch

from moespec.models.cache import KVCache
from moespec.models.checkpoint import Checkpoint
from moespec.models.config import ModelConfig, MoeConfig, RawConfig, RopeConfig
from moespec.models.families import BY_ARCHITECTURE, family_for
from moespec.models.runtime import ForwardOutput, TargetModel
from moespec.models.weights import ModelWeights, load_weights

DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp32": torch.float32}


def read_config(path: str | Path) -> ModelConfig:
    """The typed config of a checkpoint folder (reads config.json only)."""
    ckpt = Checkpoint(path)
    return _parse(ckpt)


def _parse(ckpt: Checkpoint) -> ModelConfig:
    raw = RawConfig(ckpt.config, str(ckpt.folder / "config.json"))
    archs = raw.get("architectures") or []
    if not archs:
        raise raw.fail("architectures", "missing: cannot tell which model family this is")
    family = family_for(archs[0])
    return family.parse_config(raw, archs[0])


def check_device(device) -> "torch.device":
    """``device`` as a torch.device the runtime can run on: "cpu", or "cuda[:i]" where torch sees that
    GPU (ValueError naming the problem otherwise). On CUDA the model runs the reference backend (torch
    ops) with moespec's CUDA routing and expert kernels."""
    import torch

    try:
        d = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device: {device!r} is not a device (expected 'cpu' or 'cuda[:i]')") from exc
    if d.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: torch sees no CUDA device on this machine (torch.cuda.is_available() "
                             f"is False; this torch is {torch.__version__})")
        if d.index is not None and d.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif d.type != "cpu":
        raise ValueError(f"device {device!r}: moespec runs on 'cpu' or 'cuda', not {d.type!r}")
    return d


def load(path: str | Path, dtype: Literal["bf16", "fp32"] = "bf16", *, taps: Sequence[int] = (),
         moe_impl: str | None = None, progress: bool = False, device="cpu") -> TargetModel:
    """Loads a local Hugging Face checkpoint folder (config.json + safetensors, single or sharded).

    The weights are converted once into the runtime layout (:mod:`moespec.models.weights`) in
    ``dtype``. An unknown architecture, a missing or mis-shaped tensor or a config the runtime cannot
    honour raises ValueError naming it. ``moe_impl`` picks the experts implementation
    ("kernel" or "reference", see :mod:`moespec.models.moe`). ``device``: "cpu" (default) or
    "cuda[:i]" (see :func:`check_device`): weights, caches and every call's tensors live there.
    """
    if dtype not in DTYPES:
        raise ValueError(f"load: dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    device = check_device(device)
    from moespec.engine import is_engine_folder, load_engine  # here: moespec.engine imports moespec.models

    if is_engine_folder(path):
        return load_engine(path, dtype=dtype, taps=taps, moe_impl=moe_impl, device=device)[0]
    ckpt = Checkpoint(path)
    config = _parse(ckpt)
    family = BY_ARCHITECTURE[config.architecture]
    weights = load_weights(ckpt, config, family.names, DTYPES[dtype], progress=progress).to(device)
    return TargetModel(config, weights, taps=taps, moe_impl=moe_impl)


__all__ = [
    "Checkpoint", "ForwardOutput", "KVCache", "ModelConfig", "ModelWeights", "MoeConfig", "RopeConfig",
    "TargetModel", "check_device", "load", "read_config",
]
