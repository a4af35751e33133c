"""The attention half of a decoder layer in few launches: ``rms_norm`` (with the residual add),
``attention_inputs`` (clip, q/k norm, rope, the cache writes) and ``tree_attention`` (a tree-masked
attention over packed requests that reads only the slots a request uses), for the runtime's fused
forward (:mod:`moespec.runtime.fused`) and the EAGLE-3 head on the device.

On CUDA each is a kernel of cpp/kernels/decoder_ops.cu (contract: cpp/include/moespec/decoder_ops.h),
launched on the current stream with no host synchronisation and no allocation but its output and
scratch from torch's allocator (so a graph captures it). On the CPU (and with MOESPEC_FUSED_STEP=0)
each runs its plain-torch version below: the reference forward's own ops (moespec.runtime.attention),
which tests/gpu/test_decoder_ops_cuda.py holds the kernels to, and which the CPU tests run the graph
steps and the draft head through.

Dimensions: P tokens packed request after request, B requests, G groups of tree_attention, H hidden,
Hq/Hkv query and key-value heads, D head dim, S_max cache slots, W mask words per row.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from moespec._loader import native, require_cuda
from moespec._tensor import view
from moespec.runtime.attention import rms_norm as _rms_norm_reference
from moespec.runtime.attention import attention_with_sinks, rotate

QK_NORM_CODES = {"none": 0, "per_head": 1, "full": 2}


def _kernel(t: torch.Tensor) -> bool:
    """Whether a call on ``t`` runs the CUDA kernel (else the torch version)."""
    return t.device.type == "cuda" and enabled()


def _stream(t: torch.Tensor) -> int:
    require_cuda()
    return torch.cuda.current_stream(t.device).cuda_stream


def enabled() -> bool:
    """Whether the runtime uses these ops where they fit (MOESPEC_FUSED_STEP=0: the reference's ops)."""
    return os.environ.get("MOESPEC_FUSED_STEP", "1") != "0"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, residual: Optional[torch.Tensor] = None,
             scale_fp32: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' RMSNorm of ``s = x`` or, with ``residual``, ``s = x + residual`` (rounded to the
    dtype, as torch's add is): returns ``(s, weight * norm(s))``, both [..., H] in x's dtype.
    ``scale_fp32``: the scale in fp32, then rounded (GPT-OSS)."""
    if not _kernel(x):
        s = x if residual is None else x + residual
        return s, _rms_norm_reference(s, weight, eps, scale_fp32)
    H = x.shape[-1]
    x2 = x.reshape(-1, H).contiguous()
    r2 = None if residual is None else residual.reshape(-1, H).contiguous()
    out = torch.empty_like(x2)
    s = x2 if residual is None else torch.empty_like(x2)
    native().rms_norm(view(x2, "x"), view(r2, "residual"), view(weight, "weight"), view(out, "out"),
                      view(None if r2 is None else s, "sum"), float(eps), bool(scale_fp32), _stream(x))
    return s.view(x.shape), out.view(x.shape)


def attention_inputs(qkv: torch.Tensor, q_norm: Optional[torch.Tensor], k_norm: Optional[torch.Tensor],
                     cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     rows: torch.Tensor, slots: torch.Tensor, *, num_heads: int, num_kv_heads: int, qk_norm: str,
                     eps: float, clip: Optional[float]) -> torch.Tensor:
    """From a layer's q/k/v projection ``qkv`` [P, (Hq + 2 Hkv) D] (after its bias): q and k clipped
    to ``clip`` and normed (``qk_norm``: "none", "per_head" with [D] weights, "full" with [Hq D] and
    [Hkv D]; the reference's order: a full norm before the clip, a per-head one after it), rope with
    ``cos``, ``sin`` [P, D], and k, v written to ``k_cache``, ``v_cache`` [B, Hkv, S_max, D] at
    (``rows``, ``slots``) (long [P]: request and slot of each token). Returns q [P, Hq, D]."""
    P = qkv.shape[0]
    Hq, Hkv = num_heads, num_kv_heads
    D = k_cache.shape[-1]
    if qk_norm not in QK_NORM_CODES:
        raise ValueError(f"qk_norm: expected one of {tuple(QK_NORM_CODES)}, got {qk_norm!r}")
    if _kernel(qkv):
        q = qkv.new_empty(P, Hq, D)
        native().attention_inputs(view(qkv, "qkv"), view(q_norm, "q_norm"), view(k_norm, "k_norm"), view(cos, "cos"),
                                  view(sin, "sin"), view(k_cache, "k_cache"), view(v_cache, "v_cache"),
                                  view(rows, "rows"), view(slots, "slots"), view(q, "q"), int(Hq), int(Hkv),
                                  QK_NORM_CODES[qk_norm], float(eps), float(clip or 0.0), _stream(qkv))
        return q
    q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    if qk_norm == "full":
        q, k = _rms_norm_reference(q, q_norm, eps), _rms_norm_reference(k, k_norm, eps)
    if clip:
        q, k, v = (t.clamp(-clip, clip) for t in (q, k, v))
    q, k, v = q.reshape(P, Hq, D), k.reshape(P, Hkv, D), v.reshape(P, Hkv, D)
    if qk_norm == "per_head":
        q, k = _rms_norm_reference(q, q_norm, eps), _rms_norm_reference(k, k_norm, eps)
    q, k = rotate(q, cos[:, None], sin[:, None]), rotate(k, cos[:, None], sin[:, None])
    k_cache[rows, :, slots] = k
    v_cache[rows, :, slots] = v
    return q


def visible_slots(start: torch.Tensor, words: torch.Tensor, S: int, spans: Optional[torch.Tensor] = None) -> torch.Tensor:
    """bool [B, T, S]: which of the first S cache slots each token sees: the committed slots
    [0, start[b]) and the new slot start[b] + j (j < spans[b], default T) where bit j % 32 of word
    j // 32 of its row of ``words`` [B, T, W] (int32 or sign-extended int64) is set."""
    B, T, W = words.shape
    rel = torch.arange(S, device=start.device)[None, :] - start[:, None]  # [B, S]: index among the new slots
    r = rel.clamp(0, 32 * W - 1)
    word = torch.gather(words.long(), 2, (r // 32)[:, None, :].expand(B, T, S))  # [B, T, S]
    bit = ((word >> (r % 32)[:, None, :]) & 1).bool()
    span = torch.full((B, 1), T, device=start.device) if spans is None else spans[:, None]
    return (rel < 0)[:, None, :] | (((rel >= 0) & (rel < span))[:, None, :] & bit)


def attention_groups(offsets: Sequence[int]) -> torch.Tensor:
    """int32 [G, 3]: tree_attention's blocks for requests whose tokens are the rows
    [offsets[b], offsets[b + 1]): each request's rows in runs of at most 8, as (request, first row,
    count)."""
    n = native().kTreeGroupTokens
    rows = [(b, p, min(n, end - p)) for b, (begin, end) in enumerate(zip(offsets[:-1], offsets[1:]))
            for p in range(begin, end, n)]
    return torch.tensor(rows, dtype=torch.int32).view(len(rows), 3)


def tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: torch.Tensor,
                   offsets: torch.Tensor, groups: torch.Tensor, words: torch.Tensor, scale: float, *,
                   spans: Optional[torch.Tensor] = None, positions: Optional[torch.Tensor] = None, window: int = 0,
                   sinks: Optional[torch.Tensor] = None, bounds: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Attention of the packed tokens q [P, Hq, D] (request b's are the rows [offsets[b],
    offsets[b + 1]), ``offsets`` long [B + 1]; ``groups``: :func:`attention_groups` of them) over
    k_cache, v_cache [B, Hkv, S_max, D]: token p of request b sees the committed slots [0, start[b])
    and its request's new slot start[b] + j where bit j % 32 of word j // 32 of its row of ``words``
    [P, W] (int32) is set (:func:`visible_slots`; j < spans[b], ``spans`` long [B], default: the
    request's token count: the draft head's levels see scratch slots past their own); with ``window`` > 0 only those whose position is
    less than ``window`` behind its own (``positions`` long [P]; a committed slot's position is its
    index); ``sinks`` [Hq]: each head's sink logit in every softmax's denominator (GPT-OSS). Softmax
    in fp32 (with sinks: as :func:`moespec.runtime.attention.attention_with_sinks` computes it).
    Returns [P, Hq, D]. On CUDA only slots below start[b] + (its token count) are read. ``bounds``:
    ``offsets`` on the host, where the caller has them: the torch version (MOESPEC_FUSED_STEP=0 on
    CUDA) reads them instead of copying ``offsets`` back, a synchronisation that a CUDA graph's
    capture refuses (the draft head's captured round and catch-up pass them)."""
    P, Hq, D = q.shape
    if window and positions is None:
        raise ValueError("positions: needed with a sliding window")
    if _kernel(q):
        out = torch.empty_like(q)
        nbytes = native().tree_attention_workspace_size(P, groups.shape[0], Hq, D, k_cache.shape[2])
        workspace = torch.empty(nbytes, dtype=torch.uint8, device=q.device) if nbytes else None
        native().tree_attention(view(q, "q"), view(k_cache, "k_cache"), view(v_cache, "v_cache"), view(start, "start"),
                                view(offsets, "offsets"), view(groups, "groups"), view(spans, "spans"),
                                view(words, "mask"),
                                view(positions if window else None, "positions"), view(sinks, "sinks"),
                                view(out, "out"), float(scale), int(window), view(workspace, "workspace"), _stream(q))
        return out
    S, out = k_cache.shape[2], torch.zeros_like(q)
    bounds = offsets.tolist() if bounds is None else list(bounds)
    if len(bounds) != offsets.shape[0]:
        raise ValueError(f"bounds: {len(bounds)} host offsets for {offsets.shape[0]} on the device")
    for b, (begin, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        if end > begin:
            out[begin:end] = _attend_request(q[begin:end], k_cache[b:b + 1], v_cache[b:b + 1], start[b:b + 1],
                                             words[begin:end], scale, None if positions is None else
                                             positions[begin:end], window, sinks, S,
                                             None if spans is None else spans[b:b + 1])
    return out


def _attend_request(q, k, v, start, words, scale, positions, window, sinks, S, spans):
    """One request's tokens q [T, Hq, D] over its cache k, v [1, Hkv, S, D] (the CPU version)."""
    T = q.shape[0]
    mask = visible_slots(start, words[None], S, spans)  # [1, T, S]
    if window:
        key_pos = torch.arange(S, device=q.device)  # [S]: a committed slot's position is its index
        new = int(start) + torch.arange(T, device=q.device)
        inside = new < S
        key_pos[new[inside]] = positions[inside]  # the new tokens' own
        mask = mask & (positions[None, :, None] - key_pos[None, None, :] < window)
    qt = q.transpose(0, 1)[None]  # [1, Hq, T, D]
    if sinks is not None:
        o = attention_with_sinks(qt, k, v, mask[:, None], sinks, scale)
    else:
        o = F.scaled_dot_product_attention(qt, k, v, attn_mask=mask[:, None], scale=scale,
                                           enable_gqa=q.shape[1] != k.shape[1])  # [1, Hq, T, D]
    return o[0].transpose(0, 1)
