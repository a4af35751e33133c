"""The attention blocks of the reference forward, chosen by the config: GQA (Llama, Qwen, Mixtral,
OLMoE, GPT-OSS: q/k/v projections, optional q/k norms, clip and sinks) and multi-head latent
attention (DeepSeek-V3). Each owns its cache layout (:func:`cache_shapes`): GQA caches keys and
values [Hkv, S, D]; MLA caches the compressed latent [1, S, kv_lora_rank] and the rope key
[1, S, qk_rope_head_dim] (in KVCache's k and v). MLA attends in one of two equal forms, whichever
costs fewer multiplies (:func:`mla_absorbed`): expanded, as transformers does (keys and values of
every head from every cached latent: kv_b over S slots each call), or absorbed, as vLLM and SGLang
decode (kv_b's key part folded into the queries and its value part applied to the heads' outputs:
one attention over the latent itself, which every head shares, and nothing per slot but the
attention). Decode and verify steps take the absorbed form, prefills the expanded one.

A block writes the new tokens' entries at their cache slots (``rows``, ``cols`` -> ``slots``: the
valid tokens of the padded batch) and attends over the first S slots with ``mask`` [B, 1, T, S].
Dimensions: B requests, T new tokens, S slots, H hidden, Hq/Hkv heads, D head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moespec.models.cache import KVCache
from moespec.models.config import ModelConfig
from moespec.ops.linear import linear


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, scale_fp32: bool = False) -> torch.Tensor:
    """transformers' RMSNorm: normalise in fp32, cast back, then scale (``scale_fp32``: scale in fp32,
    then cast, as GPT-OSS does)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h).to(x.dtype) if scale_fp32 else weight * h.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rope over interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek), output de-interleaved as
    transformers' apply_rotary_pos_emb_interleave returns it."""
    half = cos.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def cache_shapes(c: ModelConfig) -> tuple[tuple[int, int], tuple[int, int]]:
    """(heads, width) of the k and v caches of one layer: [Hkv, D] twice for GQA; for MLA the latent
    [1, kv_lora_rank] and the rope key [1, qk_rope_head_dim]."""
    if c.mla is not None:
        return (1, c.mla.kv_lora_rank), (1, c.mla.qk_rope_head_dim)
    return (c.num_kv_heads, c.head_dim), (c.num_kv_heads, c.head_dim)


def attention(c: ModelConfig, index: int, layer, h: torch.Tensor, cos, sin, mask, cache: KVCache, rows, cols, slots,
              S: int) -> torch.Tensor:
    """Layer ``index``'s attention of ``h`` [B, T, H] (normed) -> [B, T, H]."""
    return (_mla if c.mla is not None else _gqa)(c, index, layer, h, cos, sin, mask, cache, rows, cols, slots, S)


def _gqa(c: ModelConfig, index: int, layer, h, cos, sin, mask, cache: KVCache, rows, cols, slots, S: int):
    B, T, _ = h.shape
    D, Hq, Hkv = c.head_dim, c.num_heads, c.num_kv_heads
    q, k, v = linear(h, layer.qkv, layer.qkv_bias, cpu_kernel=False).split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    if c.qk_norm == "full":
        q, k = rms_norm(q, layer.q_norm, c.rms_norm_eps), rms_norm(k, layer.k_norm, c.rms_norm_eps)
    if c.clip_qkv is not None:
        q, k, v = (t.clamp(-c.clip_qkv, c.clip_qkv) for t in (q, k, v))
    q, k, v = q.view(B, T, Hq, D), k.view(B, T, Hkv, D), v.view(B, T, Hkv, D)
    if c.qk_norm == "per_head":
        q, k = rms_norm(q, layer.q_norm, c.rms_norm_eps), rms_norm(k, layer.k_norm, c.rms_norm_eps)
    q = rotate(q.transpose(1, 2), cos, sin)  # [B, Hq, T, D]
    k = rotate(k.transpose(1, 2), cos, sin)  # [B, Hkv, T, D]
    k_cache, v_cache = cache.k[index], cache.v[index]  # [B, Hkv, S_max, D]
    k_cache[rows, :, slots] = k[rows, :, cols]
    v_cache[rows, :, slots] = v.transpose(1, 2)[rows, :, cols]
    if layer.sinks is None:
        o = F.scaled_dot_product_attention(q, k_cache[:, :, :S], v_cache[:, :, :S], attn_mask=mask,
                                           scale=D**-0.5, enable_gqa=Hq != Hkv)  # [B, Hq, T, D]
    else:
        o = attention_with_sinks(q, k_cache[:, :, :S], v_cache[:, :, :S], mask, layer.sinks, D**-0.5)
    return linear(o.transpose(1, 2).reshape(B, T, Hq * D), layer.o, layer.o_bias, cpu_kernel=False)


def mla_scale(c: ModelConfig) -> float:
    """The softmax scale of MLA: qk_head_dim^-1/2, times mscale^2 under yarn with mscale_all_dim
    (transformers' yarn_apply_mscale)."""
    scale = c.mla.qk_head_dim ** -0.5
    if c.rope.kind == "yarn" and c.rope.mscale_all_dim:
        m = c.rope.yarn_mscale(c.rope.mscale_all_dim)
        scale = scale * m * m
    return scale


def mla_absorbed(c: ModelConfig, T: int, S: int) -> bool:
    """Whether MLA attends in the absorbed form for T new tokens over S slots: multiplies a request
    absorbed (T Hq R (nope + v) to fold kv_b into the queries and out of the outputs, T S Hq (2 R + rope)
    for the attention over the latent) <= expanded (S R Hq (nope + v) to expand every slot,
    T S Hq (nope + rope + v) for the attention). Decode and tree verify (T << S) absorb; prefill
    (T ~ S) expands."""
    m = c.mla
    R, nope, rope, vd = m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
    absorbed = T * R * (nope + vd) + T * S * (2 * R + rope)
    expanded = S * R * (nope + vd) + T * S * (nope + rope + vd)
    return absorbed <= expanded


def _mla(c: ModelConfig, index: int, layer, h, cos, sin, mask, cache: KVCache, rows, cols, slots, S: int):
    m = c.mla
    B, T, _ = h.shape
    Hq, R, nope, rope, vd = c.num_heads, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
    if layer.q_a is not None:
        q_a = rms_norm(linear(h, layer.q_a, cpu_kernel=False), layer.q_a_norm, c.rms_norm_eps)
        q = linear(q_a, layer.q, cpu_kernel=False)
    else:
        q = linear(h, layer.q, cpu_kernel=False)
    q_pass, q_rot = q.view(B, T, Hq, nope + rope).transpose(1, 2).split([nope, rope], dim=-1)  # [B, Hq, T, *]
    latent, k_rot = linear(h, layer.kv_a, cpu_kernel=False).split([R, rope], dim=-1)
    latent = rms_norm(latent, layer.kv_a_norm, c.rms_norm_eps)  # [B, T, R]
    turn = rotate_interleaved if m.rope_interleave else rotate
    q_rot, k_rot = turn(q_rot, cos, sin), turn(k_rot[:, None], cos, sin)  # [B, Hq, T, rope], [B, 1, T, rope]
    lat_cache, rot_cache = cache.k[index], cache.v[index]  # [B, 1, S_max, R], [B, 1, S_max, rope]
    lat_cache[rows, :, slots] = latent[:, None][rows, :, cols]
    rot_cache[rows, :, slots] = k_rot[rows, :, cols]
    kv_b = layer.kv_b.view(Hq, nope + vd, R)  # per head: key part [nope, R], value part [vd, R]
    if mla_absorbed(c, T, S):
        o = _mla_absorbed(c, q_pass, q_rot, kv_b, lat_cache[:, 0, :S], rot_cache[:, 0, :S], mask)
    else:
        kv = linear(lat_cache[:, 0, :S], layer.kv_b, cpu_kernel=False)
        kv = kv.view(B, S, Hq, nope + vd).transpose(1, 2)  # [B, Hq, S, *]
        k_nope, v = kv.split([nope, vd], dim=-1)
        k = torch.cat([k_nope, rot_cache[:, :, :S].expand(B, Hq, S, rope)], dim=-1)
        o = F.scaled_dot_product_attention(torch.cat([q_pass, q_rot], dim=-1), k, v, attn_mask=mask,
                                           scale=mla_scale(c))  # [B, Hq, T, vd]
    return linear(o.transpose(1, 2).reshape(B, T, Hq * vd), layer.o, layer.o_bias, cpu_kernel=False)


def _mla_absorbed(c: ModelConfig, q_pass: torch.Tensor, q_rot: torch.Tensor, kv_b: torch.Tensor, latent: torch.Tensor,
                  k_rot: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """MLA with kv_b absorbed: q_pass [B, Hq, T, nope] and q_rot [B, Hq, T, rope] (rope applied), kv_b [Hq, nope + v, R] (a view
    of the checkpoint's matrix), latent [B, S, R] and k_rot [B, S, rope] (the cache), mask bool
    [B, 1, T, S] -> [B, Hq, T, v]. Every head attends over the same latent, so the Hq T queries of a
    request are the rows of one matrix product with it (no per-head copy of the cache); arithmetic as
    transformers' eager attention (product and scale in the model dtype, softmax in fp32)."""
    m = c.mla
    B, Hq, T, nope = q_pass.shape
    vd, R, S = m.v_head_dim, m.kv_lora_rank, latent.shape[1]
    q_lat = torch.bmm(q_pass.transpose(0, 1).reshape(Hq, B * T, nope), kv_b[:, :nope])  # [Hq, B T, R]: q_nope . (W_k latent) = (q_nope W_k) . latent
    q_lat = q_lat.view(Hq, B, T, R).transpose(0, 1)
    q = torch.cat([q_lat, q_rot], dim=-1).reshape(B, Hq * T, R + m.qk_rope_head_dim)
    k = torch.cat([latent, k_rot], dim=-1)  # [B, S, R + rope]
    scores = (torch.bmm(q, k.transpose(1, 2)) * mla_scale(c)).view(B, Hq, T, S)
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1, dtype=torch.float32).to(q.dtype)
    o_lat = torch.bmm(probs.view(B, Hq * T, S), latent)  # [B, Hq T, R]
    o_lat = o_lat.view(B, Hq, T, R).permute(1, 3, 0, 2).reshape(Hq, R, B * T)
    o = torch.bmm(kv_b[:, nope:], o_lat)  # [Hq, v, B T]: W_v (probs . latent) = probs . (W_v latent)
    return o.view(Hq, vd, B, T).permute(2, 0, 3, 1)


def attention_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """Attention whose softmax has one more logit per head, the learned sink, in its denominator (GPT-OSS,
    as transformers' eager attention computes it): q [B, Hq, T, D], k, v [B, Hkv, S, D], mask bool
    [B, 1, T, S], sinks [Hq]; [B, Hq, T, D]."""
    B, Hq, T, _ = q.shape
    groups = Hq // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scale  # [B, Hq, T, S]
    scores = scores.masked_fill(~mask, float("-inf"))
    logits = torch.cat([scores, sinks.reshape(1, -1, 1, 1).expand(B, Hq, T, 1).to(scores.dtype)], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)
