"""The runtime's backends: how a :class:`moespec.models.TargetModel` runs a forward call.

One backend is chosen once, when the model is made (``TargetModel(..., backend=...)``, or the
environment variable MOESPEC_BACKEND; DESIGN.md "The next phase": one backend chosen once):

- ``"native"`` (default on the CPU for float32 and bfloat16 models): every call of up to
  ``NATIVE_MAX_TOKENS`` tokens (prefill, decode, verify) runs every decoder layer in one native call
  (:class:`moespec._native.DecoderModel`, cpp/src/decoder_step.cc): no per-op dispatch, weights
  streamed once per step, batch-invariant results (a verify pass gives a node the bits decoding it
  would). Larger calls go through the reference. (Prefill is native too because torch's bf16 GEMM
  is ~50x slower than its fp32 one on CPUs without AVX512_BF16: 1.2 GFLOP/s on a Zen 3 core.)
- ``"reference"``: the forward written in torch ops (:class:`ReferenceBackend`), the numerical
  reference the native step is tested against; with ``moe_impl="reference"`` its bf16 prefill is
  bit-identical to transformers.
- ``"graphs"``: the reference forward on static buffers per shape bucket, replayed as CUDA graphs
  on a GPU (:mod:`moespec.runtime.graphs`; on the CPU the same steps run eagerly).

A backend's ``forward(cache, seqs, parents, budget, last_only, geo=None)`` runs new tokens ``seqs[b]``
of request b at slots ``cache.lengths[b] + j`` (a tree when ``parents`` is given; ``geo``: their packed
geometry when the caller has it, as :meth:`TargetModel.verify_trees` does) and returns a
:class:`ForwardOutput`; it neither validates (the model did) nor advances the cache.

Dimensions: B requests, T new tokens (padded), P packed tokens, S attended slots, L layers, H
hidden, Hq/Hkv query and key/value heads, D head dim, V vocabulary.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F

from moespec._loader import native
from moespec._tensor import to_device, view
from moespec.models.cache import KVCache
from moespec.models.moe import moe_forward
from moespec.ops import ExpertBudget, RoutingStats
from moespec.ops.linear import linear
from moespec.ops.routing import _FAMILY_CODES, budget_codes, softmax_vector_width
from moespec.runtime.attention import attention, rms_norm, rotate  # noqa: F401 (re-exported)
from moespec.runtime.state import RopeTable, StepGeometry, new_tokens, step_geometry

if TYPE_CHECKING:
    from moespec.models.runtime import TargetModel

BACKENDS = ("native", "reference", "graphs")
NATIVE_MAX_TOKENS = native().kMaxDecoderStepTokens  # packed tokens per native call; larger calls: reference


@dataclass
class ForwardOutput:
    """What one call of prefill / decode / verify returns."""

    logits: torch.Tensor  # decode and prefill(logits="last"): [B, V]; prefill("all") and verify: [B, T, V]
    hidden: tuple[torch.Tensor, ...]  # per tap layer: the residual stream after it, [B, T, H]
    expert_stats: torch.Tensor  # int32 [MoE layers, 4]: natural unique, kept, re-routed, dropped
    num_tokens: list[int]  # [B] new tokens per request (T = max)
    # the natural routing of the call's tokens, packed request after request, when the model has an
    # observer (moespec.models.trace): ids int32 and weights float32 [MoE layers, P, K]
    routing: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def expert_stats_by_layer(self) -> list[RoutingStats]:
        return [RoutingStats(*row) for row in self.expert_stats.tolist()]


def make_backend(model: "TargetModel", name: Optional[str] = None):
    """The backend ``name`` ("native", "reference", "graphs"; default MOESPEC_BACKEND, else "graphs"
    for a model on CUDA and "native" elsewhere) for ``model``; "native" falls back to the reference
    where it cannot run (a dtype other than float32 and bfloat16, weights off the CPU,
    ``moe_impl="reference"``). Graphs are the CUDA default since an H200 held their replay to the
    eager reference (tests/gpu/test_runtime_cuda.py, 2026-12-04) and ran a verify step 2.4-5x faster
    (tests/gpu/bench_runtime_cuda.py)."""
    name = name or os.environ.get("MOESPEC_BACKEND") or ("graphs" if model.device.type == "cuda" else "native")
    if name not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {name!r}")
    reference = ReferenceBackend(model)
    if name == "graphs":
        from moespec.runtime.graphs import GraphBackend

        return GraphBackend(model, reference)
    if name == "reference" or not NativeBackend.supports(model):
        return reference
    return NativeBackend(model, reference)


# ---- reference ----------------------------------------------------------------------------------


@dataclass
class _Batch:
    """The padded inputs of one reference forward call."""

    tokens: torch.Tensor  # long [B, T]
    num: list[int]  # [B]
    starts: list[int]  # [B] committed tokens before this call
    positions: torch.Tensor  # long [B, T]
    visible: torch.Tensor  # bool [B, T, S]
    valid: torch.Tensor  # bool [B, T]
    rows: torch.Tensor  # long [P]: request of each valid token
    cols: torch.Tensor  # long [P]: its index among the request's new tokens
    slots: torch.Tensor  # long [P]: its cache slot
    weights: Optional[torch.Tensor] = None  # float32 [P]: the tokens' weights in a budget's ranking (None: all 1)


class ReferenceBackend:
    """The forward pass in torch ops, padded batches (the numerical reference)."""

    name = "reference"

    def __init__(self, model: "TargetModel"):
        self.model = model

    def forward(self, cache: KVCache, seqs: list[list[int]], parents: Optional[list[list[int]]],
                budget: Optional[ExpertBudget], last_only: bool, geo: Optional[StepGeometry] = None,
                borrow: bool = False) -> ForwardOutput:
        return self._forward(cache, self._batch(cache, seqs, parents), budget, last_only)  # (pads; geo unused)

    def _batch(self, cache: KVCache, seqs: list[list[int]], parents: Optional[list[list[int]]]) -> _Batch:
        B, T = len(seqs), max(len(s) for s in seqs)
        num = [len(s) for s in seqs]
        starts = list(cache.lengths)
        tokens = torch.tensor([s + [0] * (T - len(s)) for s in seqs])  # [B, T]
        start, count = torch.tensor(starts), torch.tensor(num)
        index = torch.arange(T)
        valid = index[None, :] < count[:, None]  # [B, T]
        S = max(s + n for s, n in zip(starts, num))
        slot = torch.arange(S)
        prefix = slot[None, :] < start[:, None]  # [B, S]
        rel = slot[None, :] - start[:, None]  # [B, S]: index among the new tokens
        in_new = (rel >= 0) & (rel < count[:, None])  # [B, S]
        if parents is None:  # sequences: causal among the new tokens
            depth = index.expand(B, T)
            new_vis = in_new[:, None, :] & (rel[:, None, :] <= index[None, :, None])  # [B, T, S]
        else:  # trees: ancestor-or-self rows, each built from its parent's row
            depth = torch.zeros(B, T, dtype=torch.long)
            padding = []
            relation = torch.zeros(B, T, T, dtype=torch.bool)  # [b, i, j]: node i sees node j
            for b, ps in enumerate(parents):
                for i, p in enumerate(ps):
                    if i and p < 0:  # a padding row (a GPU selection's copy of the root): the root's row
                        relation[b, i] = relation[b, 0]
                        padding.append((b, i))
                        continue
                    if i:
                        relation[b, i] = relation[b, p]
                        depth[b, i] = depth[b, p] + 1
                    relation[b, i, i] = True
            new_vis = torch.gather(relation, 2, rel.clamp(0, T - 1)[:, None, :].expand(B, T, S)) & in_new[:, None, :]
        visible = prefix[:, None, :] | new_vis  # [B, T, S]
        visible[:, :, 0] |= ~valid  # padded queries look at one slot (their output is discarded)
        rows, cols = valid.nonzero(as_tuple=True)
        weights = None
        if parents is not None and padding:  # (0: a budget ranks the experts of the unpadded trees)
            weight = torch.ones(B, T)
            weight[tuple(zip(*padding))] = 0.0
            weights = weight[rows, cols]
        d = self.model.device  # built on the host, moved once (CUDA: one non-blocking copy per tensor)
        return _Batch(tokens=to_device(tokens, d), num=num, starts=starts,
                      positions=to_device(start[:, None] + depth, d), visible=to_device(visible, d),
                      valid=to_device(valid, d), rows=to_device(rows, d), cols=to_device(cols, d),
                      slots=to_device(start[rows] + cols, d), weights=None if weights is None else to_device(weights, d))

    def _forward(self, cache: KVCache, batch: _Batch, budget: Optional[ExpertBudget], last_only: bool) -> ForwardOutput:
        model = self.model
        c, w = model.config, model.weights
        B, T = batch.tokens.shape
        S = batch.visible.shape[-1]
        freqs = batch.positions[..., None].float() * model.inv_freq  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        scaling = c.rope.attention_scaling  # (1 but for yarn; multiplying by 1.0 changes nothing)
        cos, sin = (emb.cos() * scaling).to(model.dtype)[:, None], (emb.sin() * scaling).to(model.dtype)[:, None]
        masks = {0: batch.visible[:, None]}  # window -> [B, 1, T, S]; 0: full attention
        for window in {c.window(i) for i in range(c.num_layers)} - {0}:
            key_pos = torch.arange(S, device=batch.positions.device).expand(B, S).clone()  # [B, S]
            key_pos[batch.rows, batch.slots] = batch.positions[batch.rows, batch.cols]  # the new tokens' own
            near = batch.positions[:, :, None] - key_pos[:, None, :] < window  # [B, T, S]
            masks[window] = (batch.visible & (near | ~batch.valid[:, :, None]))[:, None]  # (padding keeps slot 0)
        norm = lambda t, weight: rms_norm(t, weight, c.rms_norm_eps, c.norm_scale_fp32)  # noqa: E731
        x = F.embedding(batch.tokens, w.embed)  # [B, T, H]
        tapped, stats = {}, []
        trace: Optional[list] = [] if model.observer is not None and c.moe is not None else None
        for i, layer in enumerate(w.layers):
            x = x + attention(c, i, layer, norm(x, layer.input_norm), cos, sin, masks[c.window(i)], cache, batch.rows,
                              batch.cols, batch.slots, S)
            h = norm(x, layer.post_norm)
            if c.is_moe_layer(i):
                layer_budget = budget.for_layer(len(stats)) if budget is not None else None  # len: MoE layers so far
                y, layer_stats = moe_forward(h[batch.rows, batch.cols], layer, c.moe, layer_budget,  # valid tokens only
                                             model.moe_impl, trace=trace, token_weights=batch.weights)
                mlp = torch.zeros_like(h)
                mlp[batch.rows, batch.cols] = y
                stats.append(layer_stats)
            else:
                mlp = dense_mlp(h, layer)
            x = x + mlp
            if i in model.taps:
                tapped[i] = x
        if last_only:
            last = to_device([max(n - 1, 0) for n in batch.num], x.device)
            x = x[torch.arange(B, device=x.device), last]  # [B, H]
        logits = linear(norm(x, w.final_norm), w.lm_head, cpu_kernel=False)
        if last_only:
            logits = logits * batch.valid.any(dim=1, keepdim=True)  # zeros for requests without new tokens
        expert_stats = torch.stack(stats) if stats else torch.zeros(0, 4, dtype=torch.int32, device=x.device)
        routing = None
        if trace is not None:
            routing = (torch.stack([r.ids for r in trace]), torch.stack([r.weights for r in trace]).float())
        return ForwardOutput(logits=logits, hidden=tuple(tapped[t] for t in model.taps), expert_stats=expert_stats,
                             num_tokens=list(batch.num), routing=routing)


def dense_mlp(h: torch.Tensor, layer) -> torch.Tensor:
    """A dense layer's SwiGLU feed-forward: down(silu(gate h) * up h)."""
    gate, up = linear(h, layer.gate_up, cpu_kernel=False).chunk(2, dim=-1)
    return linear(F.silu(gate) * up, layer.down, cpu_kernel=False)


# ---- native -------------------------------------------------------------------------------------

_QK_NORM_CODES = {"none": 0, "per_head": 1, "full": 2}
_LAYER_FIELDS = ("input_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "o", "o_bias", "post_norm", "gate_up", "down",
                 "router", "experts", "shared_gate_up", "shared_down", "shared_gate")


class NativeBackend:
    """Every call of up to NATIVE_MAX_TOKENS tokens in one native call; see the module docstring."""

    name = "native"

    @staticmethod
    def supports(model: "TargetModel") -> bool:
        w = model.weights
        moe = model.config.moe
        c = model.config
        return (model.dtype in (torch.float32, torch.bfloat16) and w.lm_head.device.type == "cpu"
                and model.moe_impl == "kernel" and (moe is None or (moe.router.family == "softmax"
                                                                    and moe.activation == "swiglu"))
                and not c.sliding_layers and not c.attention_sinks and not c.norm_scale_fp32
                and c.rope.kind != "yarn" and c.mla is None)

    def __init__(self, model: "TargetModel", reference: ReferenceBackend):
        self.model, self.reference = model, reference
        c, w = model.config, model.weights
        moe = c.moe
        layers = []
        for layer in w.layers:
            layers.append({f: view(getattr(layer, f), f) for f in _LAYER_FIELDS if getattr(layer, f) is not None})
        self.decoder = native().DecoderModel(
            hidden=c.hidden_size, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
            vocab=c.vocab_size, eps=float(c.rms_norm_eps), qk_norm=_QK_NORM_CODES[c.qk_norm],
            clip_qkv=float(c.clip_qkv or 0.0), num_experts=moe.num_experts if moe else 0,
            expert_intermediate=moe.intermediate_size if moe else 0,
            family=_FAMILY_CODES[moe.router.family] if moe else 0, top_k=moe.top_k if moe else 1,
            renormalize=bool(moe.router.renormalize) if moe else False,
            weights_in_model_dtype=bool(moe.weights_in_model_dtype) if moe else False,
            softmax_vector_width=softmax_vector_width(), layers=layers, final_norm=view(w.final_norm, "final_norm"),
            lm_head=view(w.lm_head, "lm_head"))
        self.rope = RopeTable(model.inv_freq, model.dtype, min(c.max_position_embeddings, 4096))
        self._num_moe = len(c.moe_layers)

    def forward(self, cache: KVCache, seqs: list[list[int]], parents: Optional[list[list[int]]],
                budget: Optional[ExpertBudget], last_only: bool, geo: Optional[StepGeometry] = None,
                borrow: bool = False) -> ForwardOutput:
        num = new_tokens(seqs, geo)
        P = sum(num)
        if P > NATIVE_MAX_TOKENS:
            return self.reference.forward(cache, seqs, parents, budget, last_only)
        model, c = self.model, self.model.config
        geo = geo or step_geometry(seqs, cache.lengths, parents)
        x = model.weights.embed.index_select(0, geo.tokens)  # [P, H]
        cos, sin = self.rope.lookup(geo.positions)  # [P, D] each
        offsets = torch.tensor(geo.offsets, dtype=torch.int32)  # [B + 1]
        start = torch.tensor(cache.lengths, dtype=torch.int32)  # [B]
        mask = geo.mask  # [P, W]
        rows = [geo.offsets[b + 1] - 1 for b in range(len(seqs)) if num[b]] if last_only else list(range(P))
        logit_rows = torch.tensor(rows, dtype=torch.int32)  # [R]
        logits = torch.empty(len(rows), c.vocab_size, dtype=model.dtype)  # [R, V]
        taps = torch.tensor(model.taps, dtype=torch.int32)  # [NT]
        tap_out = torch.empty(len(model.taps), P, c.hidden_size, dtype=model.dtype)  # [NT, P, H]
        stats = torch.empty(self._num_moe, 4, dtype=torch.int32)  # [Lm, 4]
        routing = None
        if model.observer is not None and c.moe is not None:
            K = c.moe.top_k
            routing = (torch.empty(self._num_moe, P, K, dtype=torch.int32),  # [Lm, P, K]
                       torch.empty(self._num_moe, P, K, dtype=torch.float32))
        trace_views = {"trace_ids": view(routing[0], "trace_ids"),
                       "trace_weights": view(routing[1], "trace_weights")} if routing is not None else {}
        self.decoder.step(
            view(x, "x"), view(cos, "cos"), view(sin, "sin"), view(cache.k, "k_cache"), view(cache.v, "v_cache"),
            view(offsets, "offsets"), view(start, "start"), view(mask, "mask"), view(taps, "taps"),
            view(tap_out, "tap_out"), view(logit_rows, "logit_rows"), view(logits, "logits"), view(stats, "stats"),
            *budget_codes(budget), **trace_views, exact_layers=budget.exact_layers if budget is not None else 0)
        B = len(seqs)
        if last_only:
            if len(rows) < B:  # zeros for requests without new tokens
                full = logits.new_zeros(B, c.vocab_size)
                full[torch.tensor([b for b in range(B) if num[b]])] = logits
                logits = full
        else:
            logits = _pad(logits, geo.offsets, num)
        hidden = tuple(_pad(tap_out[i], geo.offsets, num) for i in range(len(model.taps)))
        return ForwardOutput(logits=logits, hidden=hidden, expert_stats=stats, num_tokens=num, routing=routing)


def _pad(packed: torch.Tensor, offsets: list[int], num: list[int]) -> torch.Tensor:
    """Packed rows [P, X] -> [B, T, X] padded with zeros (a view when B = 1)."""
    B, T = len(num), max(num)
    if B == 1:
        return packed.unsqueeze(0)
    out = packed.new_zeros(B, T, packed.shape[-1])
    for b in range(B):
        out[b, : num[b]] = packed[offsets[b] : offsets[b + 1]]
    return out
