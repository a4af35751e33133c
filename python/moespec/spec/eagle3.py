"""The EAGLE-3 draft head: weights, a preallocated draft KV cache, one forward for both catch-up and
tree expansion, the training-time-test forward, and a loader for local checkpoints; its typed
config is :mod:`moespec.spec.eagle3_config` (re-exported here).

Implements DESIGN.md "Speculative decoding (EAGLE-3)" (the draft head and its checkpoints);
REFERENCE.md section 3: 1.2 (head), 1.3 (taps), 1.6 (draft KV), 1.8 (checkpoint format). Counterparts:
SafeAILab/EAGLE ``eagle/model/cnets.py`` (inference) and ``eagle/traineagle3/cnets.py`` (training);
the trainer is :mod:`moespec.spec.train`, the tests ``tests/python/test_eagle3.py``.

The layer (``midlayer``), for input token ids ``x`` and input features ``h`` [.., H]::

    a = cat(input_layernorm(embed(x)), hidden_norm(h))          # [.., 2H]
    h = h + o_proj(attention(q_proj(a), k_proj(a), v_proj(a)))   # residual = the un-normalised h
    h = h + mlp(post_attention_layernorm(h))                     # SwiGLU
    logits = lm_head(norm(h))                                    # [.., Vd], draft vocabulary

``h`` is ``fc(cat(f_low, f_mid, f_high))`` for target features (catch-up) and the draft's own
previous *output* ``h`` — before the final ``norm`` — for tree expansion (EAGLE's ``out_hidden``;
``topK_genrate`` feeds ``out_hidden[:, out_ids]`` back and applies ``norm`` only for the logits).
Draft id ``i`` is target id ``i + d2t[i]``.

Alignment (as EAGLE, which shifts ``input_ids`` left by one): draft entry ``s`` pairs the target's tap
features ``f_s`` of token ``x_s`` with the *next* token ``x_{s+1}`` and predicts ``x_{s+2}``; it sits at
draft cache slot ``s`` with rope position ``s``. A tree node at depth ``d >= 1`` below the last
catch-up entry ``n - 1`` has position ``n - 1 + d``. Example (one request, one draft round)::

    head = load_eagle3(folder, target)
    target.set_taps(head.config.aux_layers)
    cache = head.new_cache(batch=1, max_len=4096)
    # catch-up over accepted entries s in [cache.lengths[0], n): tokens x_{s+1}, target features f_s
    step = cache.append_inputs([len(new)])
    out = head(cache, next_tokens, features, positions=step.positions, slots=step.slots,
               visible=step.visible)                          # logits [1, T, Vd], hidden [1, T, H]
    cache.advance([len(new)])
    # expansion step d over K frontier nodes: tokens [1, K], hidden = their parents' out.hidden,
    # positions n - 1 + d, scratch slots n + (d - 1) K + k, visible = slots [0, n) + the node's
    # expanded ancestors + itself (EAGLE's growing tree_mask). Scratch slots are overwritten by the
    # next catch-up, so the accepted prefix (EAGLE's stable_kv) survives unchanged.

Dimensions: B requests, T new tokens, S attended slots, H draft hidden, Ht target hidden, Hq/Hkv
query and key/value heads, D head dim, I intermediate, V target vocabulary, Vd draft vocabulary,
K unrolled training-time-test steps, L target layers.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Literal, Optional, Sequence, Union

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file as load_safetensors
from torch import nn

from moespec._loader import native
from moespec._tensor import to_device, view
from moespec.models.config import ModelConfig
from moespec.models.runtime import TargetModel, rms_norm, rotate
from moespec.ops import decoder as decoder_ops
from moespec.ops.linear import linear
from moespec.ops.routing import softmax_vector_width
from moespec.runtime.state import RopeTable
from moespec.spec.draft_cache import DraftCache, DraftOutput, StepInputs  # noqa: F401 (re-exported)
from moespec.spec.eagle3_config import Eagle3Config, default_aux_layers  # noqa: F401 (re-exported)


DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp32": torch.float32}

# What the features argument of a forward may be: the three target taps (as TargetModel returns
# them, or concatenated) or the draft's own output hidden states.
Features = Union[torch.Tensor, Sequence[torch.Tensor]]


# ---- configuration: moespec.spec.eagle3_config (re-exported) ----------------------------------

# ---- weights ------------------------------------------------------------------------------------


class _Proj(nn.Module):
    """A bias-free projection stored as ``weight`` [out, in] (nn.Linear's name, no init)."""

    def __init__(self, out_features: int, in_features: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(out_features, in_features, dtype=dtype))


class _Norm(nn.Module):
    def __init__(self, size: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))


class _Attention(nn.Module):
    def __init__(self, c: Eagle3Config, dtype: torch.dtype):
        super().__init__()
        H, D = c.hidden_size, c.head_dim
        self.q_proj = _Proj(c.num_heads * D, 2 * H, dtype)
        self.k_proj = _Proj(c.num_kv_heads * D, 2 * H, dtype)
        self.v_proj = _Proj(c.num_kv_heads * D, 2 * H, dtype)
        self.o_proj = _Proj(H, c.num_heads * D, dtype)


class _Mlp(nn.Module):
    def __init__(self, c: Eagle3Config, dtype: torch.dtype):
        super().__init__()
        self.gate_proj = _Proj(c.intermediate_size, c.hidden_size, dtype)
        self.up_proj = _Proj(c.intermediate_size, c.hidden_size, dtype)
        self.down_proj = _Proj(c.hidden_size, c.intermediate_size, dtype)


class _MidLayer(nn.Module):
    def __init__(self, c: Eagle3Config, dtype: torch.dtype):
        super().__init__()
        self.hidden_norm = _Norm(c.hidden_size, dtype)
        self.input_layernorm = _Norm(c.hidden_size, dtype)
        self.self_attn = _Attention(c, dtype)
        self.post_attention_layernorm = _Norm(c.hidden_size, dtype)
        self.mlp = _Mlp(c, dtype)


def expected_shapes(c: Eagle3Config) -> dict[str, tuple[int, ...]]:
    """Official tensor names of a head and their shapes (``d2t``/``t2d`` only with a reduced vocabulary)."""
    H, D, Hq, Hkv, I = c.hidden_size, c.head_dim, c.num_heads, c.num_kv_heads, c.intermediate_size
    shapes = {
        "fc.weight": (H, 3 * c.target_hidden_size),
        "midlayer.hidden_norm.weight": (H,),
        "midlayer.input_layernorm.weight": (H,),
        "midlayer.self_attn.q_proj.weight": (Hq * D, 2 * H),
        "midlayer.self_attn.k_proj.weight": (Hkv * D, 2 * H),
        "midlayer.self_attn.v_proj.weight": (Hkv * D, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, Hq * D),
        "midlayer.post_attention_layernorm.weight": (H,),
        "midlayer.mlp.gate_proj.weight": (I, H),
        "midlayer.mlp.up_proj.weight": (I, H),
        "midlayer.mlp.down_proj.weight": (H, I),
        "norm.weight": (H,),
        "lm_head.weight": (c.draft_vocab_size, H),
    }
    if c.draft_vocab_size < c.vocab_size:
        shapes.update({"d2t": (c.draft_vocab_size,), "t2d": (c.vocab_size,)})
    return shapes


# ---- the head -----------------------------------------------------------------------------------


class Eagle3Head(nn.Module):
    """An EAGLE-3 draft head (REFERENCE.md 1.2). Parameter and buffer names are the official ones,
    so ``state_dict()`` is an official checkpoint (``embed`` is not in it: it is the target's).

    Parameters
    ----------
    config : Eagle3Config
    embed : Tensor [V, H]
        Token embedding, frozen (the target's unless the checkpoint has its own).
    d2t : Tensor int64 [Vd], optional
        Draft id -> target id offsets (target = id + d2t[id]); zeros (identity) by default.
    dtype : torch.dtype
        Parameters are zero-initialised projections and unit norms; load or train them.
    """

    def __init__(self, config: Eagle3Config, embed: torch.Tensor, d2t: Optional[torch.Tensor] = None, *,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        c = config
        if tuple(embed.shape) != (c.vocab_size, c.hidden_size):
            raise ValueError(f"Eagle3Head: embed has shape {tuple(embed.shape)}, expected "
                             f"{(c.vocab_size, c.hidden_size)} (vocab_size, hidden_size)")
        if d2t is None:
            d2t = torch.zeros(c.draft_vocab_size, dtype=torch.long)
        d2t = d2t.to(torch.long).reshape(-1)
        if d2t.numel() != c.draft_vocab_size:
            raise ValueError(f"Eagle3Head: d2t has {d2t.numel()} entries, expected "
                             f"draft_vocab_size={c.draft_vocab_size}")
        target_ids = torch.arange(c.draft_vocab_size) + d2t  # [Vd]
        if int(target_ids.min()) < 0 or int(target_ids.max()) >= c.vocab_size:
            raise ValueError(f"Eagle3Head: d2t maps draft ids to target ids {int(target_ids.min())}.."
                             f"{int(target_ids.max())}, outside [0, {c.vocab_size})")
        if target_ids.unique().numel() != c.draft_vocab_size:
            raise ValueError("Eagle3Head: d2t maps two draft ids to the same target id")
        self.config = c
        self.register_buffer("embed", embed.detach().to(dtype), persistent=False)  # [V, H]
        self.fc = _Proj(c.hidden_size, 3 * c.target_hidden_size, dtype)
        self.midlayer = _MidLayer(c, dtype)
        self.norm = _Norm(c.hidden_size, dtype)
        self.lm_head = _Proj(c.draft_vocab_size, c.hidden_size, dtype)
        self.register_buffer("d2t", d2t)  # int64 [Vd]
        t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
        t2d[target_ids] = True
        self.register_buffer("t2d", t2d)  # bool [V]: target ids in the draft vocabulary
        # float32 [D/2]; a plain attribute, not a buffer, so that module.to(bf16) cannot round it
        self._inv_freq = c.rope.inv_freq(c.head_dim)
        self._fused_weights: dict[str, tuple] = {}  # inference copies of q/k/v and gate/up, see _fused
        self._packing: dict[tuple, tuple] = {}  # forward_words' tree-attention geometry per (B, T, span)
        self._rope_tables: dict[tuple, torch.Tensor] = {}  # forward_words' cos and sin per slot, see rope_rows
        self._native: Optional[tuple] = None  # (weights key, DecoderModel, RopeTable), see _native_model
        self._params_list: Optional[list[torch.Tensor]] = None  # the parameters, listed once (_native_model)
        self.native_step = True  # inference on the CPU through the native step (False: the torch ops)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def official_state_dict(self) -> dict[str, torch.Tensor]:
        """The tensors an official checkpoint holds (no embed; no d2t/t2d with the full vocabulary)."""
        names = expected_shapes(self.config)
        return {k: v.detach() for k, v in self.state_dict().items() if k in names}

    def new_cache(self, batch: int, max_len: int) -> DraftCache:
        """A draft KV cache for ``batch`` requests of up to ``max_len`` entries (accepted prefix and the
        expansion scratch): k and v are [batch, Hkv, max_len + 1, D] in the head's dtype (the last slot
        takes padding's writes, see :class:`DraftCache`)."""
        if batch < 1 or max_len < 1:
            raise ValueError(f"new_cache: batch and max_len must be >= 1, got batch={batch}, max_len={max_len}")
        c = self.config
        shape = (batch, c.num_kv_heads, max_len + 1, c.head_dim)
        device = self.fc.weight.device
        return DraftCache(torch.zeros(shape, dtype=self.dtype, device=device),
                          torch.zeros(shape, dtype=self.dtype, device=device), [0] * batch)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target token ids of draft ids (any shape): ``id + d2t[id]``."""
        return draft_ids + self.d2t[draft_ids]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 [.., Vd]: ``lm_head(norm(hidden))`` for output hidden states [.., H] (at inference the
        norm is the decoder op: one launch on CUDA instead of the reference's five)."""
        eps = self.config.rms_norm_eps
        normed = rms_norm(hidden, self.norm.weight, eps) if torch.is_grad_enabled() else \
            decoder_ops.rms_norm(hidden, self.norm.weight, eps)[1]
        return linear(normed, self.lm_head.weight).float()

    @torch.inference_mode()
    def forward(self, cache: DraftCache, tokens: torch.Tensor, hidden: Features, *, positions: torch.Tensor,
                slots: torch.Tensor, visible: torch.Tensor, last_only: bool = False) -> DraftOutput:
        """Runs T new entries per request through the head over its cache (catch-up and expansion).
        Inference mode (no autograd); training goes through :meth:`ttt_forward`.

        Parameters
        ----------
        cache : DraftCache
            k/v [B, Hkv, S_max + 1, D] (the last slot: padding's writes); the new entries' keys and
            values are written at ``slots`` *before* attention, so an entry can see itself and any
            other new entry ``visible`` allows.
        tokens : long [B, T]
            The token of each entry (for catch-up entry s: x_{s+1}).
        hidden : target features or draft hidden states
            Catch-up: the three target taps, a sequence of [B, T, Ht] tensors (``ForwardOutput.hidden``
            with taps = ``config.aux_layers``) or their concatenation [B, T, 3 Ht]; they go through
            ``fc``. Expansion: the parents' output hidden states [B, T, H] (``DraftOutput.hidden``),
            fc skipped. A tensor is told apart by its width; when 3 Ht == H pass the taps as a sequence.
        positions : long [B, T]
            Rope positions.
        slots : long [B, T]
            Cache slot of each entry, < S_max; -1 marks padding (nothing written). Checked on the CPU
            (ValueError); on a GPU a slot >= S_max is not checked (that would synchronise the
            stream) and its entry is not written.
        visible : bool [B, T, S], S <= S_max
            Which cache slots each entry attends. A row with no visible slot sees slot 0 (padding).
        last_only : bool
            Logits of each request's last real entry only (its last with slot >= 0; a catch-up reads
            no other): ``logits`` [B, 1, Vd], undefined values for a request without one. The lm_head
            over a prompt's every entry was most of a prompt catch-up.

        Returns
        -------
        DraftOutput
            ``logits`` float32 [B, T, Vd] over the draft vocabulary (map ids with :meth:`to_target`),
            ``hidden`` [B, T, H]: outputs before the final norm, the next expansion's input.
        """
        c = self.config
        B, T = tokens.shape
        if cache.batch != B:
            raise ValueError(f"forward: tokens has {B} requests, the cache holds {cache.batch}")
        for name, t, shape in (("positions", positions, (B, T)), ("slots", slots, (B, T))):
            if tuple(t.shape) != shape:
                raise ValueError(f"forward: {name} has shape {tuple(t.shape)}, expected {shape}")
        S = visible.shape[-1]
        if visible.dtype != torch.bool or tuple(visible.shape[:2]) != (B, T) or S > cache.max_len:
            raise ValueError(f"forward: visible must be bool [B={B}, T={T}, S <= {cache.max_len}], got "
                             f"{visible.dtype} {tuple(visible.shape)}")
        if slots.device.type == "cpu" and int(slots.max()) >= cache.max_len:  # (a GPU: unchecked, see below)
            raise ValueError(f"forward: slot {int(slots.max())} is outside the cache (max_len={cache.max_len})")
        h = self._features(hidden, allow_own=True)
        if self.runs_natively(cache):
            out = self._native_forward(cache, tokens, h, positions, slots, visible, last_only)
            if out is not None:
                return out
        residual, x = self._inputs(tokens, h)
        # every entry writes, with no host synchronisation: padding (slot -1), and on a GPU slots past the
        # cache (not checked there: a check would synchronise), go to the discard slot max_len
        write = torch.where((slots >= 0) & (slots < cache.max_len), slots, cache.max_len)  # [B, T]
        q = self._attention_inputs(cache, x, positions, write).view(B, T, -1, c.head_dim).transpose(1, 2)
        mask = visible.clone()
        mask[:, :, 0] |= ~visible.any(dim=-1)
        o = F.scaled_dot_product_attention(q, cache.k[:, :, :S], cache.v[:, :, :S], attn_mask=mask[:, None],
                                           scale=c.head_dim ** -0.5, enable_gqa=c.num_heads != c.num_kv_heads)
        return self._outputs(self._finish(residual, o), slots, last_only)

    def _outputs(self, out: torch.Tensor, slots: torch.Tensor, last_only: bool,
                 last: Optional[torch.Tensor] = None) -> DraftOutput:
        """The layer's output [B, T, H] with its logits (``last_only``: each request's last entry with
        slot >= 0; ``last`` long [B]: those entries, where the caller has them)."""
        if last_only:
            if last is None:
                last = ((slots >= 0).sum(1) - 1).clamp_min(0)  # [B]
            rows = out.gather(1, last[:, None, None].expand(-1, 1, out.shape[-1]))  # [B, 1, H]
            return DraftOutput(logits=self.logits(rows), hidden=out)
        return DraftOutput(logits=self.logits(out), hidden=out)

    @torch.inference_mode()
    def forward_words(self, cache: DraftCache, tokens: torch.Tensor, hidden: Features, *, start: torch.Tensor,
                      positions: torch.Tensor, slots: torch.Tensor, words: torch.Tensor, span: int,
                      last_only: bool = False, write: Optional[torch.Tensor] = None,
                      rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                      last: Optional[torch.Tensor] = None) -> DraftOutput:
        """:meth:`forward_native`'s terms on the device, through the decoder ops (the norms, rope + cache
        writes and a tree attention over the accepted prefix and the words' slots only: a few launches,
        the kernels on CUDA): T entries per request at slots start[b] + slots (``start`` long [B] on the
        entries' device: a static buffer in a captured round; ``slots`` long [B, T], relative; -1: a
        padding entry, written to the discard slot), each seeing the accepted prefix [0, start[b]) and the
        slots start[b] + i for the bits i < span of its row of ``words`` int32 [B T, W]. Positions long
        [B, T]. Where the caller has them: ``write`` long [B, T], the absolute cache slots start + slots
        (padding: the discard slot ``cache.max_len``; a draft round's levels make theirs once a round,
        the catch-up on the host: not three launches a call), ``rope`` the entries' cos and sin [B T, D]
        (:meth:`rope_rows` of ``positions``), ``last`` long [B] each request's last entry with a slot.
        Returns as :meth:`forward` (``last_only``: each request's last entry with a slot). Where
        the head runs natively (the CPU) the call is :meth:`forward_native`'s (``start`` = the cache's
        lengths, no padding)."""
        c = self.config
        B, T = tokens.shape
        h = self._features(hidden, allow_own=True)
        if self.runs_natively(cache):  # (the CPU: the native step, whose start is the cache's lengths)
            return self.forward_native(cache, tokens, h, positions.numpy(), slots.numpy(), words.numpy(), last_only)
        residual, x = self._inputs(tokens, h)
        if write is None:
            write = torch.where(slots >= 0, start[:, None] + slots, cache.max_len)  # padding (-1): the discard slot
        key = (B, T, span, x.device)
        bounds = range(0, B * T + 1, T)  # T entries a request
        if key not in self._packing:  # (made on a round's eager run, before a capture; kept: a graph reads them)
            self._packing[key] = (to_device(list(bounds), x.device, torch.long),
                                  to_device(decoder_ops.attention_groups(bounds), x.device),
                                  to_device([span] * B, x.device, torch.long),
                                  to_device([b for b in range(B) for _ in range(T)], x.device, torch.long))
        offsets, groups, spans, requests = self._packing[key]
        q = self._attention_inputs(cache, x, positions, write, requests, rope)  # [B T, Hq, D]
        o = decoder_ops.tree_attention(q, cache.k, cache.v, start, offsets, groups, words, c.head_dim ** -0.5,
                                       spans=spans, bounds=bounds)  # (the torch version: no read back, capturable)
        return self._outputs(self._finish(residual, o.view(B, T, -1, c.head_dim).transpose(1, 2)), slots, last_only,
                             last)

    def _attention_inputs(self, cache: DraftCache, x: torch.Tensor, positions: torch.Tensor,
                          write: torch.Tensor, requests: Optional[torch.Tensor] = None,
                          rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        """q [B T, Hq, D] of the entries x [B, T, 2H], their k and v written at the cache slots ``write``
        [B, T] (rope and the writes: one launch on CUDA). ``requests`` (long [B T], each entry's request)
        is given where the positions lie within the cache and a tree's scratch beyond it
        (:meth:`forward_words`): rope then comes from a table (:meth:`rope_rows`), or the caller's ``rope``."""
        c, a = self.config, self.midlayer.self_attn
        B, T, _ = x.shape
        if requests is None:
            cos, sin = (t.reshape(B * T, c.head_dim) for t in self._rope(positions, x))
            requests = torch.arange(B, device=write.device)[:, None].expand(B, T).reshape(-1)
        else:
            cos, sin = rope if rope is not None else self.rope_rows(cache, positions)
        return decoder_ops.attention_inputs(
            linear(x, self._fused("qkv", a.q_proj, a.k_proj, a.v_proj)).reshape(B * T, -1), None, None, cos, sin,
            cache.k, cache.v, requests, write.reshape(-1), num_heads=c.num_heads,
            num_kv_heads=c.num_kv_heads, qk_norm="none", eps=c.rms_norm_eps, clip=None)

    def rope_rows(self, cache: DraftCache, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """cos, sin [B T, D] at ``positions`` [B, T] (any shape of B T entries): :meth:`_rope`'s values in
        the head's dtype (a table of every position of the cache and a tree's scratch beyond it, made with
        its ops on the cache's device), in two launches (clamp, one gather) instead of seven. Tables are
        kept: a captured round reads them."""
        n = cache.max_len + native().kMaxTreeTokens + 1  # (beyond: padding entries only)
        dev = cache.k.device
        key = (dev, self.dtype, n)
        if key not in self._rope_tables:
            like = torch.empty(0, dtype=self.dtype, device=dev)
            self._rope_tables[key] = torch.stack(self._rope(torch.arange(n, device=dev), like))  # [2, n, D]
        rows = self._rope_tables[key].index_select(1, positions.reshape(-1).clamp(0, n - 1))  # [2, B T, D]
        return rows.unbind(0)

    def runs_natively(self, cache: DraftCache) -> bool:
        """Whether calls over ``cache`` run through the native step (:meth:`forward_native` needs it)."""
        return self.native_step and cache.k.device.type == "cpu" and self.dtype in (torch.float32, torch.bfloat16)

    @torch.inference_mode()
    def forward_native(self, cache: DraftCache, tokens: torch.Tensor, hidden: torch.Tensor, positions: np.ndarray,
                       slots: np.ndarray, mask: np.ndarray, last_only: bool = False) -> DraftOutput:
        """:meth:`forward` in the native step's own terms (where :meth:`runs_natively`): T real entries
        per request, without the ``visible`` tensor to check and pack again. The draft round's levels
        and the catch-up call it (:mod:`moespec.spec.eagle3_policy`): forward's checks and packing were
        most of a call's host time.

        tokens long [B, T] (target ids), hidden [B, T, H] (the parents' outputs, or ``fc`` of the
        target's features: :meth:`features`), positions int [B, T], slots int [B, T]: each entry's cache
        slot relative to its request's accepted length (>= 0), mask int32 [B * T, W]: bit i of an
        entry's words = it sees slot lengths[b] + i (it sees the accepted prefix [0, lengths[b])
        always). Returns logits float32 [B, T, Vd] ([B, 1, Vd] of each request's last entry with
        ``last_only``) and hidden [B, T, H]."""
        B, T = tokens.shape
        P = B * T
        top = int(slots.max()) + max(cache.lengths)
        if int(slots.min()) < 0 or top >= cache.max_len:
            raise ValueError(f"forward_native: slots must lie in [0, max_len - lengths) (max_len={cache.max_len}), "
                             f"got a slot {top}")
        if mask.dtype != np.int32 or mask.ndim != 2 or mask.shape[0] != P:
            raise ValueError(f"forward_native: mask must be int32 [{P}, W], got {mask.dtype} {mask.shape}")
        decoder, rope = self._native_model()
        x = hidden.reshape(P, -1).to(self.dtype, copy=True)  # [P, H] in/out (a copy: never the caller's)
        cos, sin = rope.lookup(torch.from_numpy(np.array(positions, dtype=np.int64).reshape(P)))  # (copies)
        logit_rows = torch.arange(T - 1 if last_only else 0, P, T if last_only else 1, dtype=torch.int32)
        logits = self._native_call(decoder, cache, x, cos, sin, self.embed.index_select(0, tokens.reshape(P)),
                                   torch.arange(0, P + 1, T, dtype=torch.int32), torch.from_numpy(mask),
                                   torch.from_numpy(np.array(slots, dtype=np.int32).reshape(P)), logit_rows)
        return DraftOutput(logits=logits.view(B, 1 if last_only else T, -1), hidden=x.view(B, T, -1))

    @torch.inference_mode()
    def features(self, taps: Features) -> torch.Tensor:
        """``fc`` of the target's features (three taps [B, T, Ht] or their concatenation): the hidden
        input of a catch-up entry (in inference mode, as :meth:`forward`: the same kernel)."""
        return self._features(taps, allow_own=False)

    def _native_call(self, decoder, cache: DraftCache, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     embed: torch.Tensor, offsets: torch.Tensor, mask: torch.Tensor, slots: torch.Tensor,
                     logit_rows: torch.Tensor) -> torch.Tensor:
        """One native step over packed entries (x [P, H]: in/out); the logits float32 [R, Vd] of logit_rows."""
        start = torch.tensor(cache.lengths, dtype=torch.int32)
        logits = torch.empty(logit_rows.shape[0], self.config.draft_vocab_size)  # float32: bf16 values, widened
        # (every tensor a local or an argument: alive while the native call reads it)
        decoder.step(view(x, "x"), view(cos, "cos"), view(sin, "sin"), view(cache.k.unsqueeze(0), "k_cache"),
                     view(cache.v.unsqueeze(0), "v_cache"), view(offsets, "offsets"),
                     view(start, "start"), view(mask, "mask"), None, None,
                     view(logit_rows, "logit_rows"), view(logits, "logits"), None, 0, 0, 0.0, 0,
                     slots=view(slots, "slots"), embed=view(embed, "embed"))
        return logits

    def ttt_forward(self, tokens: torch.Tensor, features: Features, steps: int) -> list[DraftOutput]:
        """EAGLE-3's training-time test over whole sequences: ``steps`` unrolled draft steps (autograd on).

        ``tokens`` long [B, T] are x_0..x_{T-1}, ``features`` the target taps of those tokens
        ([B, T, 3 Ht] or three [B, T, Ht]). Step j at row t takes token x_{t+1+j} (0 past the end),
        features ``fc(f_t)`` for j = 0 and the step j-1 output of row t otherwise, and predicts
        x_{t+2+j}; it has rope position t + j and attends the step-0 keys of rows 0..t (the
        teacher-forced prefix) plus the keys of its own chain, steps 1..j of row t. That is exactly
        what a depth-j tree node sees at inference (SafeAILab/EAGLE ``traineagle3/cnets.py`` after
        its 2025-09 fix). Rows t > T - 2 - j have no target and are the caller's to mask.

        Returns ``steps`` DraftOutputs, logits float32 [B, T, Vd] and hidden [B, T, H].
        """
        if steps < 1:
            raise ValueError(f"ttt_forward: steps must be >= 1, got {steps}")
        B, T = tokens.shape
        h = self._features(features, allow_own=False)  # [B, T, H]
        row = torch.arange(T, device=tokens.device)
        causal = row[None, :] <= row[:, None]  # [T, T]
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        outs = []
        for j in range(steps):
            shifted = torch.zeros_like(tokens)  # [B, T]
            shifted[:, : max(T - 1 - j, 0)] = tokens[:, 1 + j:]
            residual, x = self._inputs(shifted, h)
            q, k, v = self._qkv(x, (row + j).expand(B, T))
            keys.append(k)
            values.append(v)
            h = self._finish(residual, self._chain_attention(q, keys, values, causal))
            outs.append(DraftOutput(logits=self.logits(h), hidden=h))
        return outs

    # ---- internals ------------------------------------------------------------------------------

    def _features(self, hidden: Features, allow_own: bool) -> torch.Tensor:
        c = self.config
        if isinstance(hidden, (list, tuple)):
            if len(hidden) != 3:
                raise ValueError(f"features: expected the 3 target taps, got {len(hidden)} tensors")
            hidden = torch.cat(tuple(hidden), dim=-1)
        elif allow_own and hidden.shape[-1] == c.hidden_size:
            return hidden.to(self.dtype)  # the draft's own output hidden states
        if hidden.shape[-1] != 3 * c.target_hidden_size:
            own = f"{c.hidden_size} (draft hidden states) or " if allow_own else ""
            raise ValueError(f"features: last dimension is {hidden.shape[-1]}, expected {own}"
                             f"3 x {c.target_hidden_size} (target taps)")
        return linear(hidden.to(self.dtype), self.fc.weight)

    def _inputs(self, tokens: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual [B, T, H] and the attention input cat(norm(embed), norm(h)) [B, T, 2H]."""
        m, eps = self.midlayer, self.config.rms_norm_eps
        norm = rms_norm if torch.is_grad_enabled() else lambda t, w, e: decoder_ops.rms_norm(t, w, e)[1]  # noqa: E731
        normed = norm(h, m.hidden_norm.weight, eps)
        emb = norm(F.embedding(tokens, self.embed), m.input_layernorm.weight, eps)
        residual = normed if self.config.norm_before_residual else h
        return residual, torch.cat((emb, normed), dim=-1)

    def _qkv(self, x: torch.Tensor, positions: torch.Tensor):
        """Roped q [B, Hq, T, D] and k [B, Hkv, T, D], and v [B, Hkv, T, D]."""
        c, a = self.config, self.midlayer.self_attn
        B, T, _ = x.shape
        D = c.head_dim
        if torch.is_grad_enabled():  # training: the parameters themselves, for autograd
            q, k, v = (linear(x, p.weight) for p in (a.q_proj, a.k_proj, a.v_proj))
        else:  # inference: one projection over the three (same values: each output row is its own)
            q, k, v = linear(x, self._fused("qkv", a.q_proj, a.k_proj, a.v_proj)).split(
                [c.num_heads * D, c.num_kv_heads * D, c.num_kv_heads * D], dim=-1)
        q = q.view(B, T, c.num_heads, D).transpose(1, 2)
        k = k.view(B, T, c.num_kv_heads, D).transpose(1, 2)
        v = v.view(B, T, c.num_kv_heads, D).transpose(1, 2)
        cos, sin = (t[:, None] for t in self._rope(positions, x))  # [B, 1, T, D]
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def _rope(self, positions: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, T, D] at ``positions`` [B, T], in x's dtype and on its device."""
        if self._inv_freq.device != x.device:
            self._inv_freq = self._inv_freq.to(x.device)
        freqs = positions.to(x.device)[..., None].float() * self._inv_freq  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    def _finish(self, residual: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """Attention output [B, Hq, T, D] -> o_proj, residual, SwiGLU MLP, residual: [B, T, H]."""
        m, eps = self.midlayer, self.config.rms_norm_eps
        B, _, T, _ = o.shape
        attended = linear(o.transpose(1, 2).reshape(B, T, -1), m.self_attn.o_proj.weight)
        if torch.is_grad_enabled():
            h = residual + attended
            x = rms_norm(h, m.post_attention_layernorm.weight, eps)
        else:  # the residual add and the norm: one launch on CUDA
            h, x = decoder_ops.rms_norm(attended, m.post_attention_layernorm.weight, eps, residual=residual)
        if torch.is_grad_enabled():
            gate, up = linear(x, m.mlp.gate_proj.weight), linear(x, m.mlp.up_proj.weight)
        else:
            gate, up = linear(x, self._fused("gate_up", m.mlp.gate_proj, m.mlp.up_proj)).chunk(2, dim=-1)
        return h + linear(F.silu(gate) * up, m.mlp.down_proj.weight)

    def _fused(self, name: str, *projections: _Proj) -> torch.Tensor:
        """The projections' weights stacked [sum out, in] for inference, made once and made again
        whenever one of them changes (a new tensor, or an in-place update such as an optimizer step)."""
        key = tuple((p.weight.data_ptr(), p.weight._version) for p in projections)
        cached = self._fused_weights.get(name)
        if cached is None or cached[0] != key:
            cached = (key, torch.cat([p.weight.detach() for p in projections]).contiguous())
            self._fused_weights[name] = cached
        return cached[1]

    def _native_model(self):
        """The layer as a one-layer ``moespec._native.DecoderModel`` (cpp/include/moespec/decoder_step.h:
        a layer with an embed_norm), made again whenever a parameter changes, with its rope table."""
        if self._params_list is None:  # (the head's module tree is fixed once built; parameters may change)
            self._params_list = [p for m in self.modules() for p in m._parameters.values() if p is not None]
        key = [(p.data_ptr(), p._version) for p in self._params_list]
        if self._native is None or self._native[0] != key:
            c, m = self.config, self.midlayer
            a = m.self_attn
            layer = {"input_norm": m.hidden_norm.weight, "embed_norm": m.input_layernorm.weight,
                     "qkv": self._fused("qkv", a.q_proj, a.k_proj, a.v_proj), "o": a.o_proj.weight,
                     "post_norm": m.post_attention_layernorm.weight,
                     "gate_up": self._fused("gate_up", m.mlp.gate_proj, m.mlp.up_proj), "down": m.mlp.down_proj.weight}
            decoder = native().DecoderModel(
                hidden=c.hidden_size, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                vocab=c.draft_vocab_size, eps=float(c.rms_norm_eps), qk_norm=0, clip_qkv=0.0, num_experts=0,
                expert_intermediate=0, family=0, top_k=1, renormalize=False, weights_in_model_dtype=False,
                softmax_vector_width=softmax_vector_width(),
                layers=[{k: view(v.detach(), k) for k, v in layer.items()}],
                final_norm=view(self.norm.weight.detach(), "final_norm"),
                lm_head=view(self.lm_head.weight.detach(), "lm_head"), norm_before_residual=c.norm_before_residual)
            rope = RopeTable(self._inv_freq.cpu(), self.dtype, min(c.max_position_embeddings, 4096))
            self._native = (key, decoder, rope)
        return self._native[1], self._native[2]

    def _native_forward(self, cache: DraftCache, tokens: torch.Tensor, h: torch.Tensor, positions: torch.Tensor,
                        slots: torch.Tensor, visible: torch.Tensor, last_only: bool) -> Optional[DraftOutput]:
        """:meth:`forward` in one native call over the packed entries (padding, slot -1, skipped), or None
        when ``visible`` is not of the native step's form: each entry sees its request's whole accepted
        prefix [0, lengths[b]), slots past it by a bit mask, and at least one slot."""
        B, T = tokens.shape
        S = visible.shape[-1]
        # the geometry on the host with numpy (a step's few small arrays: numpy's calls cost a tenth
        # of torch's, which were a third of a draft-head call here)
        vis, sl = visible.numpy(), slots.numpy()  # bool [B, T, S], long [B, T]
        lengths = np.asarray(cache.lengths, dtype=np.int64)  # [B]
        valid = sl >= 0  # [B, T]
        prefix = np.arange(S)[None, :] < lengths[:, None]  # [B, S]
        if not ((((vis | ~prefix[:, None, :]).all(-1) & vis.any(-1)) | ~valid).all()
                and not ((sl < lengths[:, None]) & valid).any()):
            return None
        counts = valid.sum(1)
        offsets_np = np.zeros(B + 1, dtype=np.int32)
        offsets_np[1:] = counts.cumsum()
        P = int(offsets_np[-1])
        if P == B * T:  # every entry is real (always with one request): a reshape packs them
            rows = cols = None

            def packed(t: torch.Tensor) -> torch.Tensor:
                return t.reshape(P, *t.shape[2:])
        else:
            rows_np, cols_np = np.nonzero(valid)  # packed entries, request by request
            rows, cols = torch.from_numpy(rows_np), torch.from_numpy(cols_np)

            def packed(t: torch.Tensor) -> torch.Tensor:
                return t[rows, cols]
        width = max(1, S - int(lengths.min()))
        W = (width + 31) // 32
        # mask bit i of an entry = it sees slot lengths[b] + i (little-endian bits of int32 words)
        bits = np.zeros((B, T, 32 * W), dtype=bool)
        for b, n in enumerate(cache.lengths):
            if n < S:
                bits[b, :, : S - n] = vis[b, :, n:]
        bits = bits.reshape(B * T, 32 * W) if rows is None else bits[rows_np, cols_np]
        words = torch.from_numpy(np.packbits(bits, axis=-1, bitorder="little").view(np.int32))  # [P, W]
        rel_np = (sl - lengths[:, None]).astype(np.int32)
        rel = torch.from_numpy(rel_np.reshape(-1) if rows is None else rel_np[rows_np, cols_np])
        offsets = torch.from_numpy(offsets_np)
        decoder, rope = self._native_model()
        x = packed(h).to(self.dtype, copy=True).contiguous()  # [P, H] in/out: the residual (a copy: never h)
        cos, sin = rope.lookup(packed(positions))
        if last_only:  # each request's last packed entry (any row for one without entries)
            logit_rows = torch.from_numpy(np.maximum(offsets_np[1:] - 1, 0))
        else:
            logit_rows = torch.arange(P, dtype=torch.int32)
        logits = self._native_call(decoder, cache, x, cos, sin, self.embed.index_select(0, packed(tokens)), offsets,
                                   words, rel, logit_rows)
        if last_only:
            out_logits = logits[:, None]  # [B, 1, Vd]
        if P == B * T:
            return DraftOutput(logits=out_logits if last_only else logits.view(B, T, -1),
                               hidden=x.view(B, T, -1))
        out_hidden = x.new_zeros(B, T, x.shape[-1])
        out_hidden[rows, cols] = x
        if not last_only:
            out_logits = logits.new_zeros(B, T, logits.shape[-1], dtype=torch.float32)
            out_logits[rows, cols] = logits
        return DraftOutput(logits=out_logits, hidden=out_hidden)

    def _chain_attention(self, q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                         causal: torch.Tensor) -> torch.Tensor:
        """Step len(keys)-1 of the training-time test: q [B, Hq, T, D] attends the step-0 keys
        causally and, per row, that row's keys of steps 1.. (a diagonal each, so O(T^2 + T K))."""
        c = self.config
        groups, scale = c.num_heads // c.num_kv_heads, c.head_dim ** -0.5
        expand = (lambda t: t.repeat_interleave(groups, dim=1)) if groups > 1 else (lambda t: t)
        T = q.shape[2]
        scores = [(q @ expand(keys[0]).transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))]  # [B, Hq, T, T]
        scores += [(q * expand(k)).sum(-1, keepdim=True) * scale for k in keys[1:]]  # [B, Hq, T, 1] each
        weights = torch.cat(scores, dim=-1).float().softmax(dim=-1).to(q.dtype)  # [B, Hq, T, T + j]
        o = weights[..., :T] @ expand(values[0])
        for i, v in enumerate(values[1:]):
            o = o + weights[..., T + i, None] * expand(v)
        return o  # [B, Hq, T, D]


# ---- loading ------------------------------------------------------------------------------------


def _read_tensors(folder: Path) -> tuple[dict[str, torch.Tensor], Path]:
    """All tensors of the head's weight file (pytorch_model.bin first, as EAGLE, then model.safetensors)."""
    binary, safe = folder / "pytorch_model.bin", folder / "model.safetensors"
    if binary.is_file():
        try:
            tensors = torch.load(binary, map_location="cpu", weights_only=True)
        except Exception as exc:  # pickle, zip and torch errors all mean the same thing here
            raise ValueError(f"{binary}: cannot read the weights ({type(exc).__name__}: {exc})") from None
        if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
            raise ValueError(f"{binary}: expected a dict of tensors (a state dict)")
        return tensors, binary
    if safe.is_file():
        try:
            return load_safetensors(str(safe)), safe
        except (SafetensorError, OSError, ValueError) as exc:
            raise ValueError(f"{safe}: cannot read the weights ({exc})") from None
    raise ValueError(f"{folder}: no pytorch_model.bin or model.safetensors (the EAGLE-3 head's weights)")


def _official_name(name: str) -> str:
    """Maps SpecForge / vLLM names (layers.0.*, draft_id_to_target_id, a model. prefix) to official ones."""
    if name.startswith("model."):
        name = name[len("model."):]
    if name.startswith("layers.0."):
        name = "midlayer." + name[len("layers.0."):]
    return {"draft_id_to_target_id": "d2t"}.get(name, name)


def load_eagle3(folder: Union[str, Path], target: Union[TargetModel, ModelConfig], *,
                embed: Optional[torch.Tensor] = None, dtype: Optional[Literal["bf16", "fp32"]] = None) -> Eagle3Head:
    """Loads an EAGLE-3 head from a local folder for ``target``.

    The folder holds ``config.json`` and ``pytorch_model.bin`` (torch.load, weights_only) or
    ``model.safetensors``, with official names (``midlayer.*``, ``fc``, ``norm``, ``lm_head``,
    ``d2t``, ``t2d``) or SpecForge/vLLM ones (``layers.0.*``, ``draft_id_to_target_id``). Tensors
    the head does not use are ignored (EAGLE loads with strict=False).

    Parameters
    ----------
    target : TargetModel or ModelConfig
        The target the head drafts for; its embedding is used when the checkpoint has no
        ``embed_tokens.weight``. With a ModelConfig pass that embedding [V, H] as ``embed``.
    dtype : {"bf16", "fp32"}, optional
        Default: the TargetModel's dtype, else fp32.

    Raises ValueError naming the problem: missing folder, config or weights, unreadable file, a
    missing or mis-shaped tensor, a hidden size or vocabulary that does not match the target.
    """
    folder = Path(folder)
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"load_eagle3: dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if isinstance(target, TargetModel):
        target_config = target.config
        embed = target.weights.embed if embed is None else embed
        torch_dtype = DTYPES[dtype] if dtype is not None else target.dtype
    else:
        target_config = target
        torch_dtype = DTYPES[dtype] if dtype is not None else torch.float32
    if not folder.is_dir():
        raise ValueError(f"EAGLE-3 folder {str(folder)!r} does not exist or is not a folder")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{folder}: no config.json (not an EAGLE-3 checkpoint folder)")
    try:
        raw = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{config_path}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{config_path}: expected a JSON object")
    config = Eagle3Config.from_config(raw, target_config, str(config_path))
    found, path = _read_tensors(folder)
    tensors = {_official_name(k): v for k, v in found.items()}

    def take(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in tensors:
            raise ValueError(f"{path}: tensor {name!r} is missing")
        t = tensors[name]
        if tuple(t.shape) != shape:
            raise ValueError(f"{path}: tensor {name!r} has shape {tuple(t.shape)}, expected {shape}")
        return t

    if "fc.bias" in tensors:
        raise ValueError(f"{path}: has fc.bias, which EAGLE-1 heads have; this loader reads EAGLE-3 heads only")
    unknown = sorted(k for k in tensors if k.startswith("midlayer.") and k not in expected_shapes(config)
                     and ".rotary_emb." not in k)  # old checkpoints may carry rope caches; rope comes from config
    if unknown:  # e.g. q/k norms or biases of a variant layer: ignoring them would silently change the numerics
        raise ValueError(f"{path}: tensors {', '.join(unknown[:4])} are not part of the EAGLE-3 layer this loader "
                         f"implements (Llama-style: no biases, no q/k norms)")
    V, H = config.vocab_size, config.hidden_size
    if "embed_tokens.weight" in tensors:
        embed = take("embed_tokens.weight", (V, H))
    elif embed is None:
        raise ValueError(f"{path}: no embed_tokens.weight; pass the target's embedding (embed=) or a TargetModel")
    elif tuple(embed.shape) != (V, H):
        raise ValueError(f"{path}: no embed_tokens.weight, and the target's embedding has shape "
                         f"{tuple(embed.shape)} where the head needs {(V, H)}")
    if config.draft_vocab_size < V or "d2t" in tensors:  # a full vocabulary needs no d2t (EAGLE deletes it)
        d2t = take("d2t", (config.draft_vocab_size,))
        if d2t.is_floating_point():
            raise ValueError(f"{path}: tensor 'd2t' has dtype {d2t.dtype}, expected an integer type")
        if "t2d" in tensors:
            take("t2d", (V,))
    else:
        d2t = None
    try:
        head = Eagle3Head(config, embed, d2t, dtype=torch_dtype)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    with torch.no_grad():
        params = dict(head.named_parameters())
        for name, shape in expected_shapes(config).items():
            if name in params:
                t = take(name, shape)
                if not t.is_floating_point():
                    raise ValueError(f"{path}: tensor {name!r} has dtype {t.dtype}, expected a float type")
                params[name].copy_(t)
    return head.to(embed.device).eval().requires_grad_(False)  # on the target's device


def init_weights(head: Eagle3Head, seed: int) -> Eagle3Head:
    """Random initial weights for training, from ``seed`` alone (no global RNG): projections
    uniform in +-1/sqrt(fan_in) (nn.Linear's default range), norms one."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):  # hidden_norm, input_layernorm, post_attention_layernorm, norm
                p.fill_(1.0)
            else:
                bound = 1.0 / math.sqrt(p.shape[1])
                p.copy_(torch.rand(p.shape, generator=gen, dtype=torch.float32).mul_(2 * bound).sub_(bound))
    return head


__all__ = [
    "DraftCache", "DraftOutput", "Eagle3Config", "Eagle3Head", "StepInputs", "default_aux_layers",
    "expected_shapes", "init_weights", "load_eagle3",
]
