"""An engine's weights file: the runtime layout as one flat safetensors file, written streaming, read
back memory-mapped.

Implements the weights part of DESIGN.md "Contracts" -> "Engine folder". The layout is exactly what
:class:`moespec.models.weights.ModelWeights` holds, one tensor per field, named

    layers.{i}.experts       [E, 3 I H]   MoE layers: each expert's gate [I, H], up [I, H], down [H, I]
    layers.{i}.router        [E, H]
    layers.{i}.shared_gate_up [2 Is, H]   the shared expert (Qwen2-MoE), with shared_down [H, Is] and
                                          its output gate shared_gate [1, H]
    layers.{i}.input_norm    [H]          and qkv, qkv_bias, q_norm, k_norm, o, o_bias, post_norm,
    layers.{i}.gate_up       [2 I, H]     gate_up, down for dense layers (None fields are absent)
    layers.{i}.sinks         [Hq]         GPT-OSS: attention sinks, router_bias [E], expert_biases [E, 2 I + H]
    embed                    [V, H]
    final_norm               [H]
    lm_head                  [V, H]       absent when the embeddings are tied

The file is standard safetensors (``safetensors.safe_open`` reads it) with two layout choices: the
data starts at a multiple of :data:`ALIGN` bytes, and all ``layers.*.experts`` tensors come first, so
every expert block starts at a page-aligned offset whenever an expert's size is a multiple of 4096
bytes (one expert = one aligned sequential read). Reading maps the whole file once
(``torch.UntypedStorage.from_file``, MAP_PRIVATE: copy-on-write, pages read on first touch) and
every tensor is a view into that one mapping: nothing is copied or concatenated.

Dimensions: L layers, H hidden, Hq/Hkv query and key/value heads, D head dim, I intermediate size
(dense or of one expert), Is shared-expert intermediate size, E experts, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Iterable, Optional

import torch
from tqdm import tqdm

from moespec.models.config import ModelConfig
from moespec.models.weights import LayerWeights, ModelWeights

ALIGN = 4096  # the data section starts at a multiple of this (a page)
DTYPE_NAMES: dict[torch.dtype, str] = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16"}
DTYPES_BY_NAME: dict[str, torch.dtype] = {v: k for k, v in DTYPE_NAMES.items()}
LAYER_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(LayerWeights))


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor an engine of ``config`` holds, in file order (experts first)."""
    c = config
    H, D, Hq, Hkv, V = c.hidden_size, c.head_dim, c.num_heads, c.num_kv_heads, c.vocab_size
    shapes: dict[str, tuple[int, ...]] = {}
    for i in c.moe_layers:
        shapes[f"layers.{i}.experts"] = (c.moe.num_experts, 3 * c.moe.intermediate_size * H)
    for i in range(c.num_layers):
        p = f"layers.{i}."
        shapes[p + "input_norm"] = (H,)
        m = c.mla
        if m is not None:  # DeepSeek-V3's latent attention
            if m.q_lora_rank is not None:
                shapes[p + "q_a"], shapes[p + "q_a_norm"] = (m.q_lora_rank, H), (m.q_lora_rank,)
                shapes[p + "q"] = (Hq * m.qk_head_dim, m.q_lora_rank)
            else:
                shapes[p + "q"] = (Hq * m.qk_head_dim, H)
            shapes[p + "kv_a"], shapes[p + "kv_a_norm"] = (m.kv_lora_rank + m.qk_rope_head_dim, H), (m.kv_lora_rank,)
            shapes[p + "kv_b"] = (Hq * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)
        else:
            shapes[p + "qkv"] = ((Hq + 2 * Hkv) * D, H)
        if c.attention_bias:
            shapes[p + "qkv_bias"] = ((Hq + 2 * Hkv) * D,)
        if c.qk_norm == "per_head":
            shapes[p + "q_norm"], shapes[p + "k_norm"] = (D,), (D,)
        elif c.qk_norm == "full":
            shapes[p + "q_norm"], shapes[p + "k_norm"] = (Hq * D,), (Hkv * D,)
        shapes[p + "o"] = (H, Hq * (m.v_head_dim if m is not None else D))
        if c.attention_bias:
            shapes[p + "o_bias"] = (H,)
        shapes[p + "post_norm"] = (H,)
        if c.attention_sinks:
            shapes[p + "sinks"] = (Hq,)
        if c.is_moe_layer(i):
            shapes[p + "router"] = (c.moe.num_experts, H)
            if c.moe.router_bias:
                shapes[p + "router_bias"] = (c.moe.num_experts,)
            if c.moe.expert_biases:
                shapes[p + "expert_biases"] = (c.moe.num_experts, 2 * c.moe.intermediate_size + H)
            Is = c.moe.shared_intermediate_size
            if Is:  # the shared expert (Qwen2-MoE: gated; DeepSeek-V3)
                shapes[p + "shared_gate_up"], shapes[p + "shared_down"] = (2 * Is, H), (H, Is)
                if c.moe.shared_gated:
                    shapes[p + "shared_gate"] = (1, H)
            if c.moe.score_bias:
                shapes[p + "score_bias"] = (c.moe.num_experts,)
        else:
            shapes[p + "gate_up"] = (2 * c.intermediate_size, H)
            shapes[p + "down"] = (H, c.intermediate_size)
    shapes["embed"] = (V, H)
    shapes["final_norm"] = (H,)
    if not c.tie_word_embeddings:
        shapes["lm_head"] = (V, H)
    return shapes


def flatten(config: ModelConfig, weights: ModelWeights) -> dict[str, torch.Tensor]:
    """The runtime weights as engine tensors, in file order; ValueError if the runtime holds a tensor
    the engine layout does not know (or lacks one it expects): the two layouts must not drift."""
    found: dict[str, torch.Tensor] = {"embed": weights.embed, "final_norm": weights.final_norm}
    if weights.lm_head is not weights.embed:
        found["lm_head"] = weights.lm_head
    for i, layer in enumerate(weights.layers):
        for name in LAYER_FIELDS:
            t = getattr(layer, name)
            if t is not None:
                found[f"layers.{i}.{name}"] = t
    shapes = expected_shapes(config)
    if set(found) != set(shapes):
        extra, missing = sorted(set(found) - set(shapes)), sorted(set(shapes) - set(found))
        raise ValueError(f"the runtime weights and the engine layout disagree: runtime-only tensors {extra[:4]}, "
                         f"engine-only tensors {missing[:4]} (update moespec.engine.tensors.expected_shapes)")
    out = {}
    for name, shape in shapes.items():
        t = found[name]
        if tuple(t.shape) != shape or t.dtype != weights.dtype:
            raise ValueError(f"runtime tensor {name!r} is {t.dtype} {tuple(t.shape)}, the engine layout expects "
                             f"{weights.dtype} {shape}")
        out[name] = t
    return out


def unflatten(config: ModelConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> ModelWeights:
    """ModelWeights over engine tensors (no copies; lm_head is the embedding when tied)."""
    layers = []
    for i in range(config.num_layers):
        fields = {name: tensors.get(f"layers.{i}.{name}") for name in LAYER_FIELDS}
        layers.append(LayerWeights(**fields))
    embed = tensors["embed"]
    return ModelWeights(embed=embed, layers=layers, final_norm=tensors["final_norm"],
                        lm_head=tensors.get("lm_head", embed), dtype=dtype)


# ---- writing ------------------------------------------------------------------------------------


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], *, metadata: Optional[dict[str, str]] = None,
                      progress: bool = False, desc: str = "writing weights") -> str:
    """Writes ``tensors`` (in dict order) as one safetensors file, streaming one tensor at a time (no
    second copy of the model in memory), fsyncs it and returns the sha256 of the whole file."""
    header: dict[str, object] = {}
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in DTYPE_NAMES:
            raise ValueError(f"write_safetensors: tensor {name!r} has dtype {t.dtype}, not one of {list(DTYPE_NAMES)}")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-(8 + len(blob)) % ALIGN)  # the spec allows trailing spaces; the data starts aligned
    digest = hashlib.sha256()
    bar = tqdm(total=8 + len(blob) + offset, desc=desc, unit="B", unit_scale=True, disable=not progress, leave=False)
    with open(path, "wb") as f:
        for chunk in (struct.pack("<Q", len(blob)), blob):
            f.write(chunk)
            digest.update(chunk)
        bar.update(8 + len(blob))
        for t in tensors.values():
            data = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
            f.write(memoryview(data))
            digest.update(memoryview(data))
            bar.update(data.nbytes)
        f.flush()
        os.fsync(f.fileno())
    bar.close()
    return digest.hexdigest()


# ---- reading ------------------------------------------------------------------------------------


@dataclasses.dataclass
class Header:
    """A parsed and checked safetensors header."""

    tensors: dict[str, dict]  # name -> {"dtype", "shape", "data_offsets"}, in file order
    data_start: int  # byte offset of the data section
    file_size: int


def read_header(path: Path) -> Header:
    """Parses and checks a safetensors header without reading the data: JSON, dtypes, shapes, and that
    the tensors tile the data section exactly up to the end of the file (catches truncation)."""
    size = path.stat().st_size
    hint = "a truncated or damaged file (an interrupted copy?): copy or rebuild the engine folder"
    with open(path, "rb") as f:
        start = f.read(8)
        if len(start) < 8:
            raise ValueError(f"{path}: corrupt weights file: {size} bytes, too short for a safetensors header ({hint})")
        n = struct.unpack("<Q", start)[0]
        if 8 + n > size:
            raise ValueError(f"{path}: corrupt weights file: the header claims {n} bytes, the file holds {size} "
                             f"({hint})")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: corrupt weights file: the safetensors header is not JSON ({exc}; {hint})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: corrupt weights file: the safetensors header is not a JSON object ({hint})")
    header.pop("__metadata__", None)
    spans = []
    for name, info in header.items():
        try:
            dtype = DTYPES_BY_NAME[info["dtype"]]
            shape = [int(d) for d in info["shape"]]
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: corrupt weights file: bad header entry for {name!r} ({exc!r})") from None
        numel = 1
        for d in shape:
            numel *= d
        if end - begin != numel * dtype.itemsize:
            raise ValueError(f"{path}: corrupt weights file: tensor {name!r} spans {end - begin} bytes, its shape "
                             f"{tuple(shape)} needs {numel * dtype.itemsize}")
        spans.append((begin, end, name))
    position = 0
    for begin, end, name in sorted(spans):
        if begin != position:
            raise ValueError(f"{path}: corrupt weights file: tensor {name!r} starts at {begin}, expected {position}")
        position = end
    data_start = 8 + n
    if data_start + position != size:
        what = "truncated" if data_start + position > size else "has trailing bytes"
        raise ValueError(f"{path}: corrupt weights file ({what}): the header describes {data_start + position} "
                         f"bytes, the file holds {size} ({hint})")
    order = sorted(header, key=lambda k: header[k]["data_offsets"][0])
    return Header({k: header[k] for k in order}, data_start, size)


def map_tensors(path: Path, header: Header, names: Optional[Iterable[str]] = None) -> dict[str, torch.Tensor]:
    """Views of the file's tensors over one private memory map of the whole file (no copies).

    The mapping is copy-on-write: writing to a tensor changes this process's pages, never the file.
    """
    storage = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=header.file_size)
    whole = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (header.file_size,))  # [file bytes]
    out = {}
    for name in header.tensors if names is None else names:
        info = header.tensors[name]
        begin, end = (header.data_start + int(x) for x in info["data_offsets"])
        dtype = DTYPES_BY_NAME[info["dtype"]]
        if begin % dtype.itemsize:
            raise ValueError(f"{path}: tensor {name!r} starts at byte {begin}, not a multiple of its element size")
        out[name] = whole[begin:end].view(dtype).view(tuple(info["shape"]))
    return out


def file_sha256(path: Path, *, progress: bool = False, desc: Optional[str] = None) -> str:
    """sha256 of a file, read in 16 MiB chunks."""
    digest = hashlib.sha256()
    size = path.stat().st_size
    with open(path, "rb") as f, tqdm(total=size, desc=desc or f"hashing {path.name}", unit="B", unit_scale=True,
                                     disable=not progress, leave=False) as bar:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()
