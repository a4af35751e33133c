"""The runtime's weight layout, and its conversion from a Hugging Face checkpoint.

Layout (what the forward pass and, later, engine folders use):
- attention: q, k and v projections fused into one ``qkv`` matrix [(Hq + 2 Hkv) D, H] (one GEMM);
- dense feed-forward: ``gate_up`` [2 I, H] (gate rows, then up rows) and ``down`` [H, I];
- MoE feed-forward: the router [E, H] and **one contiguous block per expert**,
  ``experts`` [E, 3 I H] = for each expert its gate [I, H], up [I, H] and down [H, I], row-major,
  so reading one expert is one sequential read (DESIGN.md "Contracts", engine folder);
- a shared expert (Qwen2-MoE), when the config has one: ``shared_gate_up`` [2 Is, H], ``shared_down``
  [H, Is] and its gate ``shared_gate`` [1, H];
- GPT-OSS: attention ``sinks`` [Hq], ``router_bias`` [E] and ``expert_biases`` [E, 2 I + H] (gate, up,
  down), its experts converted from the checkpoint's interleaved, transposed ``gate_up_proj`` [E, H,
  2 I] and ``down_proj`` [E, I, H], or from their MXFP4 blocks and scales (:func:`dequantize_mxfp4`).
Every tensor's shape is checked against the config; a missing or mis-shaped tensor is a ValueError
naming it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional, Union

import torch
from tqdm import tqdm

from moespec.models.checkpoint import Checkpoint
from moespec.models.config import ModelConfig
from moespec.models.families.base import TensorNames


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [H]
    qkv: Optional[torch.Tensor]  # [(Hq + 2 Hkv) D, H] (None: MLA)
    qkv_bias: Optional[torch.Tensor]  # [(Hq + 2 Hkv) D]
    q_norm: Optional[torch.Tensor]  # [D] (per_head) or [Hq D] (full)
    k_norm: Optional[torch.Tensor]  # [D] (per_head) or [Hkv D] (full)
    o: torch.Tensor  # [H, Hq D]
    o_bias: Optional[torch.Tensor]  # [H]
    post_norm: torch.Tensor  # [H]
    gate_up: Optional[torch.Tensor] = None  # dense: [2 I, H]
    down: Optional[torch.Tensor] = None  # dense: [H, I]
    router: Optional[torch.Tensor] = None  # MoE: [E, H]
    experts: Optional[torch.Tensor] = None  # MoE: [E, 3 I H]
    shared_gate_up: Optional[torch.Tensor] = None  # MoE with a shared expert: [2 Is, H]
    shared_down: Optional[torch.Tensor] = None  # [H, Is]
    shared_gate: Optional[torch.Tensor] = None  # [1, H]: the sigmoid gate of the shared expert's output
    sinks: Optional[torch.Tensor] = None  # [Hq]: attention sink logits (GPT-OSS)
    router_bias: Optional[torch.Tensor] = None  # [E] (GPT-OSS)
    expert_biases: Optional[torch.Tensor] = None  # [E, 2 I + H]: each expert's gate, up and down biases (GPT-OSS)
    score_bias: Optional[torch.Tensor] = None  # [E]: DeepSeek-V3's e_score_correction_bias
    # MLA (DeepSeek-V3): q_a [Rq, H] + q_a_norm [Rq] + q [Hq (nope + rope), Rq] (or q [Hq (nope + rope), H]
    # without a q rank), kv_a [R + rope, H], kv_a_norm [R], kv_b [Hq (nope + v), R]; o is [H, Hq v]
    q_a: Optional[torch.Tensor] = None
    q_a_norm: Optional[torch.Tensor] = None
    q: Optional[torch.Tensor] = None
    kv_a: Optional[torch.Tensor] = None
    kv_a_norm: Optional[torch.Tensor] = None
    kv_b: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        # A one-row F.linear takes a GEMV path whose summation order depends on the weight's address
        # alignment; a fresh allocation (64-byte aligned, H elements) makes the gate bit-reproducible
        # whether the tensor came from a checkpoint or an engine's memory map.
        if self.shared_gate is not None:
            self.shared_gate = self.shared_gate.clone()

    def float32(self, name: str) -> Optional[torch.Tensor]:
        """The tensor ``name`` in float32, converted once and kept (not a field: engines and copies do
        not see it): the MoE layer reads its biases at every call, which in a captured step would be a
        conversion kernel a layer."""
        t = getattr(self, name)
        if t is None or t.dtype == torch.float32:
            return t
        kept = self.__dict__.setdefault("_float32", {})
        if name not in kept or kept[name][0] is not t:
            kept[name] = (t, t.float())
        return kept[name][1]

    def expert_gate_up(self, intermediate: int) -> torch.Tensor:
        """View [E, 2 I, H] of every expert's gate and up rows (no copy)."""
        E, block = self.experts.shape
        H = block // (3 * intermediate)
        return self.experts.as_strided((E, 2 * intermediate, H), (block, H, 1))

    def expert_down(self, intermediate: int) -> torch.Tensor:
        """View [E, H, I] of every expert's down matrix (no copy)."""
        E, block = self.experts.shape
        H = block // (3 * intermediate)
        return self.experts.as_strided((E, H, intermediate), (block, intermediate, 1),
                                       self.experts.storage_offset() + 2 * intermediate * H)  # (offsets are absolute)


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [V, H]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H] (the embedding itself when tied)
    dtype: torch.dtype = field(default=torch.float32)

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def to(self, device: Union[str, torch.device]) -> "ModelWeights":
        """These weights on ``device`` (every tensor moved once; tied embeddings stay one tensor)."""
        device = torch.device(device)
        if device == self.device:
            return self
        moved: dict[int, torch.Tensor] = {}

        def move(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            if t is None:
                return None
            if id(t) not in moved:
                moved[id(t)] = t.to(device)
            return moved[id(t)]

        layers = [dataclasses.replace(layer, **{f.name: move(getattr(layer, f.name)) for f in dataclasses.fields(layer)
                                                if isinstance(getattr(layer, f.name), torch.Tensor)})
                  for layer in self.layers]
        return ModelWeights(move(self.embed), layers, move(self.final_norm), move(self.lm_head), self.dtype)


class _Reader:
    """Fetches tensors by name with shape checks, converted to the runtime dtype."""

    def __init__(self, ckpt: Checkpoint, dtype: torch.dtype):
        self.ckpt, self.dtype = ckpt, dtype

    def __call__(self, name: str, shape: tuple[int, ...], dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        t = self.ckpt.get(name)
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"{self.ckpt.folder}: tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")
        if not t.is_floating_point():
            raise ValueError(f"{self.ckpt.folder}: tensor {name!r} has dtype {t.dtype}, expected a float type")
        return t.to(dtype or self.dtype).contiguous()

    def optional(self, name: str, shape: tuple[int, ...]) -> Optional[torch.Tensor]:
        return self(name, shape) if name in self.ckpt else None


FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # e2m1


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, name: str = "tensor") -> torch.Tensor:
    """MXFP4 (OCP microscaling, as GPT-OSS checkpoints store experts) -> float32 [..., G * 32]:
    ``blocks`` uint8 [..., G, 16] hold 32 e2m1 values per group (low nibble first), ``scales`` uint8
    [..., G] one power-of-two exponent per group (bias 127). ValueError naming ``name`` for shapes that
    do not match."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{name}: MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"{name}: MXFP4 blocks must be [..., G, 16] with scales [..., G], got blocks "
                         f"{tuple(blocks.shape)} and scales {tuple(scales.shape)}")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1).flatten(-2)  # [..., G, 32]
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)
    return values.flatten(-2)


def _gpt_oss_experts(read: _Reader, ckpt: Checkpoint, prefix: str, E: int, I: int,
                     H: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT-OSS experts -> ([E, 3 I H] blocks, [E, 2 I + H] biases): gate_up_proj [E, H, 2 I] holds gate
    and up interleaved (gate in even columns), down_proj [E, I, H]; or their MXFP4 ``_blocks``/``_scales``
    ([E, 2 I, H / 32, 16] and [E, H, I / 32, 16], stored transposed)."""
    def weight(name: str, shape: tuple[int, int, int]) -> torch.Tensor:
        if prefix + name + "_blocks" in ckpt:
            rows, cols = shape[2], shape[1]
            blocks, scales = ckpt.get(prefix + name + "_blocks"), ckpt.get(prefix + name + "_scales")
            if tuple(blocks.shape) != (E, rows, cols // 32, 16):
                raise ValueError(f"{ckpt.folder}: tensor {prefix + name + '_blocks'!r} has shape "
                                 f"{tuple(blocks.shape)}, "
                                 f"expected {(E, rows, cols // 32, 16)} (MXFP4: 16 bytes per 32 values)")
            return dequantize_mxfp4(blocks, scales, prefix + name).transpose(1, 2)  # [E, cols, rows]
        return read(prefix + name, shape, torch.float32)

    gate_up, down = weight("gate_up_proj", (E, H, 2 * I)), weight("down_proj", (E, I, H))
    out = torch.empty(E, 3, I, H, dtype=read.dtype)
    out[:, 0] = gate_up[:, :, 0::2].transpose(1, 2)
    out[:, 1] = gate_up[:, :, 1::2].transpose(1, 2)
    out = out.reshape(E, 3 * I * H)
    out[:, 2 * I * H:] = down.transpose(1, 2).reshape(E, H * I).to(read.dtype)
    gate_up_bias = read(prefix + "gate_up_proj_bias", (E, 2 * I))
    biases = torch.cat([gate_up_bias[:, 0::2], gate_up_bias[:, 1::2], read(prefix + "down_proj_bias", (E, H))], dim=1)
    return out, biases


def _experts(read: _Reader, ckpt: Checkpoint, names: TensorNames, prefix: str, E: int, I: int, H: int) -> torch.Tensor:
    """[E, 3 I H]: each expert's gate, up, down as one contiguous block."""
    out = torch.empty(E, 3 * I * H, dtype=read.dtype)
    fused = prefix + names.fused_gate_up
    if fused in ckpt:  # transformers 5's fused 3-D layout
        gate_up = read(fused, (E, 2 * I, H))
        down = read(prefix + names.fused_down, (E, H, I))
        out[:, : 2 * I * H] = gate_up.reshape(E, -1)
        out[:, 2 * I * H :] = down.reshape(E, -1)
        return out
    gate_name, up_name, down_name = names.expert_proj
    for e in range(E):
        expert = prefix + names.expert.replace("{e}", str(e))
        out[e, : I * H] = read(expert.format(proj=gate_name), (I, H)).reshape(-1)
        out[e, I * H : 2 * I * H] = read(expert.format(proj=up_name), (I, H)).reshape(-1)
        out[e, 2 * I * H :] = read(expert.format(proj=down_name), (H, I)).reshape(-1)
    return out


def _gqa_layer(read: _Reader, cfg: ModelConfig, names: TensorNames, i: int) -> LayerWeights:
    H, D, Hq, Hkv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    attn = names.attn.format(i=i)
    q = read(attn + "q_proj.weight", (Hq * D, H))
    k = read(attn + "k_proj.weight", (Hkv * D, H))
    v = read(attn + "v_proj.weight", (Hkv * D, H))
    bias = None
    if cfg.attention_bias:
        bias = torch.cat([read(attn + f"{p}_proj.bias", (n * D,)) for p, n in (("q", Hq), ("k", Hkv), ("v", Hkv))])
    q_norm = k_norm = None
    if cfg.qk_norm == "per_head":
        q_norm, k_norm = read(names.q_norm.format(i=i), (D,)), read(names.k_norm.format(i=i), (D,))
    elif cfg.qk_norm == "full":
        q_norm, k_norm = read(names.q_norm.format(i=i), (Hq * D,)), read(names.k_norm.format(i=i), (Hkv * D,))
    return LayerWeights(
        input_norm=read(names.input_norm.format(i=i), (H,)), qkv=torch.cat([q, k, v]), qkv_bias=bias,
        q_norm=q_norm, k_norm=k_norm, o=read(attn + "o_proj.weight", (H, Hq * D)),
        o_bias=read(attn + "o_proj.bias", (H,)) if cfg.attention_bias else None,
        post_norm=read(names.post_norm.format(i=i), (H,)))


def _mla_layer(read: _Reader, cfg: ModelConfig, names: TensorNames, i: int) -> LayerWeights:
    """DeepSeek-V3's attention tensors (q_a_proj, q_a_layernorm, q_b_proj or q_proj, kv_a_proj_with_mqa,
    kv_a_layernorm, kv_b_proj, o_proj)."""
    m, H, Hq = cfg.mla, cfg.hidden_size, cfg.num_heads
    if cfg.attention_bias:
        raise ValueError(f"{read.ckpt.folder}: MLA with attention_bias is not supported")
    attn = names.attn.format(i=i)
    layer = LayerWeights(input_norm=read(names.input_norm.format(i=i), (H,)), qkv=None, qkv_bias=None, q_norm=None,
                         k_norm=None, o=read(attn + "o_proj.weight", (H, Hq * m.v_head_dim)), o_bias=None,
                         post_norm=read(names.post_norm.format(i=i), (H,)))
    if m.q_lora_rank is not None:
        layer.q_a = read(attn + "q_a_proj.weight", (m.q_lora_rank, H))
        layer.q_a_norm = read(attn + "q_a_layernorm.weight", (m.q_lora_rank,))
        layer.q = read(attn + "q_b_proj.weight", (Hq * m.qk_head_dim, m.q_lora_rank))
    else:
        layer.q = read(attn + "q_proj.weight", (Hq * m.qk_head_dim, H))
    layer.kv_a = read(attn + "kv_a_proj_with_mqa.weight", (m.kv_lora_rank + m.qk_rope_head_dim, H))
    layer.kv_a_norm = read(attn + "kv_a_layernorm.weight", (m.kv_lora_rank,))
    layer.kv_b = read(attn + "kv_b_proj.weight", (Hq * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank))
    return layer


def load_weights(ckpt: Checkpoint, cfg: ModelConfig, names: TensorNames, dtype: torch.dtype,
                 progress: bool = False) -> ModelWeights:
    """Reads and converts every tensor the runtime needs (shape-checked) into its layout."""
    read = _Reader(ckpt, dtype)
    H, Hq, V = cfg.hidden_size, cfg.num_heads, cfg.vocab_size
    layers = []
    for i in tqdm(range(cfg.num_layers), desc="loading layers", disable=not progress, leave=False):
        attn = names.attn.format(i=i)
        layer = _mla_layer(read, cfg, names, i) if cfg.mla is not None else _gqa_layer(read, cfg, names, i)
        if cfg.attention_sinks:
            layer.sinks = read(attn + "sinks", (Hq,))
        if cfg.is_moe_layer(i):
            moe = names.moe.format(i=i)
            E, I = cfg.moe.num_experts, cfg.moe.intermediate_size
            layer.router = read(moe + names.router, (E, H))
            if cfg.moe.router_bias:
                layer.router_bias = read(moe + names.router.replace("weight", "bias"), (E,))
            if cfg.moe.score_bias:  # (in the model dtype, as every engine tensor; the routing adds it in float32)
                layer.score_bias = read(moe + names.router.replace("weight", "e_score_correction_bias"), (E,))
            if cfg.moe.activation == "gpt_oss":
                layer.experts, layer.expert_biases = _gpt_oss_experts(read, ckpt, moe + "experts.", E, I, H)
            else:
                layer.experts = _experts(read, ckpt, names, moe, E, I, H)
            Is = cfg.moe.shared_intermediate_size
            if Is:  # Qwen2-MoE (gated) and DeepSeek-V3 (not): the family names the shared expert
                shared = moe + names.shared_expert
                layer.shared_gate_up = torch.cat([read(shared + "gate_proj.weight", (Is, H)),
                                                  read(shared + "up_proj.weight", (Is, H))])
                layer.shared_down = read(shared + "down_proj.weight", (H, Is))
                if cfg.moe.shared_gated:
                    layer.shared_gate = read(moe + "shared_expert_gate.weight", (1, H)).clone()  # see __post_init__
        else:
            mlp, I = names.mlp.format(i=i), cfg.intermediate_size
            layer.gate_up = torch.cat([read(mlp + "gate_proj.weight", (I, H)), read(mlp + "up_proj.weight", (I, H))])
            layer.down = read(mlp + "down_proj.weight", (H, I))
        layers.append(layer)
    embed = read(names.embed, (V, H))
    if cfg.tie_word_embeddings or names.lm_head not in ckpt:
        if not cfg.tie_word_embeddings:
            raise ValueError(f"{ckpt.folder}: tensor {names.lm_head!r} is missing (and tie_word_embeddings is false)")
        lm_head = embed
    else:
        lm_head = read(names.lm_head, (V, H))
    return ModelWeights(embed=embed, layers=layers, final_norm=read(names.final_norm, (H,)), lm_head=lm_head,
                        dtype=dtype)


def hf_tensors(cfg: ModelConfig, w: ModelWeights, names: TensorNames) -> dict[str, torch.Tensor]:
    """The inverse of :func:`load_weights`: the runtime weights under the family's Hugging Face names
    (experts in the per-expert layout, GPT-OSS's interleaved ``gate_up_proj``), views where they can be.
    Loading the result with :func:`load_weights` gives the same tensors."""
    H, Hq, Hkv, D = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    out: dict[str, torch.Tensor] = {names.embed: w.embed, names.final_norm: w.final_norm}
    if not cfg.tie_word_embeddings:
        out[names.lm_head] = w.lm_head
    for i, layer in enumerate(w.layers):
        attn = names.attn.format(i=i)
        out[names.input_norm.format(i=i)] = layer.input_norm
        out[names.post_norm.format(i=i)] = layer.post_norm
        out[attn + "o_proj.weight"] = layer.o
        if layer.o_bias is not None:
            out[attn + "o_proj.bias"] = layer.o_bias
        if cfg.mla is not None:
            m = cfg.mla
            if m.q_lora_rank is not None:
                out.update({attn + "q_a_proj.weight": layer.q_a, attn + "q_a_layernorm.weight": layer.q_a_norm,
                            attn + "q_b_proj.weight": layer.q})
            else:
                out[attn + "q_proj.weight"] = layer.q
            out.update({attn + "kv_a_proj_with_mqa.weight": layer.kv_a, attn + "kv_a_layernorm.weight": layer.kv_a_norm,
                        attn + "kv_b_proj.weight": layer.kv_b})
        else:
            q, k, v = layer.qkv.split([Hq * D, Hkv * D, Hkv * D])
            out.update({attn + "q_proj.weight": q, attn + "k_proj.weight": k, attn + "v_proj.weight": v})
            if layer.qkv_bias is not None:
                for p, b in zip("qkv", layer.qkv_bias.split([Hq * D, Hkv * D, Hkv * D])):
                    out[attn + f"{p}_proj.bias"] = b
        if layer.q_norm is not None:
            out[names.q_norm.format(i=i)], out[names.k_norm.format(i=i)] = layer.q_norm, layer.k_norm
        if layer.sinks is not None:
            out[attn + "sinks"] = layer.sinks
        if layer.experts is None:
            mlp, I = names.mlp.format(i=i), cfg.intermediate_size
            out.update({mlp + "gate_proj.weight": layer.gate_up[:I], mlp + "up_proj.weight": layer.gate_up[I:],
                        mlp + "down_proj.weight": layer.down})
            continue
        moe, E, I = names.moe.format(i=i), cfg.moe.num_experts, cfg.moe.intermediate_size
        out[moe + names.router] = layer.router
        if layer.router_bias is not None:
            out[moe + names.router.replace("weight", "bias")] = layer.router_bias
        if layer.score_bias is not None:
            out[moe + names.router.replace("weight", "e_score_correction_bias")] = layer.score_bias
        gate_up, down = layer.expert_gate_up(I), layer.expert_down(I)  # [E, 2I, H], [E, H, I]
        if cfg.moe.activation == "gpt_oss":
            interleaved = torch.empty(E, H, 2 * I, dtype=gate_up.dtype)
            interleaved[:, :, 0::2], interleaved[:, :, 1::2] = gate_up[:, :I].transpose(1, 2), gate_up[:, I:].transpose(1, 2)
            b = layer.expert_biases
            bias = torch.empty(E, 2 * I, dtype=b.dtype)
            bias[:, 0::2], bias[:, 1::2] = b[:, :I], b[:, I:2 * I]
            out.update({moe + "experts.gate_up_proj": interleaved, moe + "experts.down_proj": down.transpose(1, 2),
                        moe + "experts.gate_up_proj_bias": bias, moe + "experts.down_proj_bias": b[:, 2 * I:]})
        else:
            gate_name, up_name, down_name = names.expert_proj
            for e in range(E):
                expert = moe + names.expert.replace("{e}", str(e))
                out.update({expert.format(proj=gate_name): gate_up[e, :I], expert.format(proj=up_name): gate_up[e, I:],
                            expert.format(proj=down_name): down[e]})
        if layer.shared_gate_up is not None:
            shared, Is = moe + names.shared_expert, cfg.moe.shared_intermediate_size
            out.update({shared + "gate_proj.weight": layer.shared_gate_up[:Is],
                        shared + "up_proj.weight": layer.shared_gate_up[Is:], shared + "down_proj.weight": layer.shared_down})
            if layer.shared_gate is not None:
                out[moe + "shared_expert_gate.weight"] = layer.shared_gate
    return out
