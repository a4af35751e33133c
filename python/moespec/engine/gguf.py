"""GGUF sources for ``moespec build``: a GGUF file becomes a temporary Hugging Face folder, which the
build then reads like any other checkpoint.

transformers reads the GGUF: its config parser (``AutoConfig.from_pretrained(..., gguf_file=)``), its
tensor reader and dequantizer (``load_gguf_checkpoint``, which also undoes llama.cpp's q/k row
permutation and renames tensors to the transformers names) and its tokenizer converter
(``AutoTokenizer.from_pretrained(..., gguf_file=)``). ``AutoModelForCausalLM.from_pretrained(gguf_file=)``
is not used: it requires ``accelerate`` and its GGUF-quantized model refuses ``save_pretrained``;
``load_gguf_checkpoint`` yields the same tensors (checked on SmolLM2-135M Q4_1). Quantized weights are
dequantized once, straight to the build dtype.

Needs the ``gguf`` package (requirements.txt pins it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

MAGIC = b"GGUF"


def is_gguf_file(path: Path) -> bool:
    """True for a file that starts with the GGUF magic (the content decides, not the file name)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


def _need_gguf():
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise ValueError("building from a GGUF file needs the gguf package: pip install gguf==0.19.0") from None
    return gguf


def gguf_metadata(path: Path) -> dict[str, Any]:
    """Provenance of a GGUF file: its general.* and architecture keys (not the tokenizer's arrays), the
    GGUF version and a histogram of its tensor types (e.g. {"Q4_1": 181, "F32": 61})."""
    gguf = _need_gguf()
    reader = gguf.GGUFReader(str(path))
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.") or key.startswith("GGUF.tensor") or key.startswith("GGUF.kv"):
            continue
        try:
            value = field.contents()
        except Exception:  # an odd field type must not fail the build: it is provenance only
            continue
        if hasattr(value, "tolist"):  # numpy scalars and arrays
            value = value.tolist()
        if isinstance(value, (str, int, float, bool)) or (isinstance(value, list) and len(value) <= 16):
            try:
                json.dumps(value)
            except (TypeError, ValueError):
                continue
            meta[key] = value
    types: dict[str, int] = {}
    for t in reader.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    return {"metadata": meta, "tensor_types": types, "tensors": len(reader.tensors)}


def gguf_to_hf(path: Path, out: Path, dtype: torch.dtype, *, progress: bool = False) -> dict[str, Any]:
    """Writes ``out`` as a Hugging Face folder (config.json, model.safetensors, tokenizer files) holding
    the GGUF file's model dequantized to ``dtype``. Returns notes for the build provenance."""
    _need_gguf()
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from moespec.engine.tensors import write_safetensors

    folder, name = path.parent, path.name
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name, local_files_only=True)
    except (ValueError, KeyError, OSError) as exc:
        raise ValueError(f"{path}: transformers cannot read this GGUF file's model config ({exc})") from None
    with torch.device("meta"):  # names and shapes only: nothing is allocated
        skeleton = AutoModelForCausalLM.from_config(config)
    config.architectures = [type(skeleton).__name__]
    # (its own tqdm bar, "Converting and de-quantizing GGUF tensors", shows even when progress is off)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton, torch_dtype=dtype)["tensors"]
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    write_safetensors(out / "model.safetensors", {k: v.contiguous() for k, v in tensors.items()},
                      metadata={"format": "pt"}, progress=progress, desc="writing dequantized GGUF")
    del tensors
    notes: dict[str, Any] = {"reader": "transformers load_gguf_checkpoint", "architecture": config.architectures[0]}
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
        tokenizer.save_pretrained(out)
    except Exception as exc:  # a model without a usable tokenizer still builds (token-id prompts)
        notes["tokenizer_error"] = f"{type(exc).__name__}: {exc}"
    return notes
