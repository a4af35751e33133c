"""The ``"graphs"`` backend: decode and verify steps replayed as CUDA graphs, per shape bucket.

A step's shape is a bucket ``(batch B, new tokens T per request, budget)``: every
request of the call brings exactly T tokens (decode: T = 1; an eagle3 tree of ``total_tokens``
nodes: T = total_tokens + 1). The first call of a bucket allocates its static inputs once (tokens
and positions [B, T], the attention mask [B, T, S_max] over the whole cache, the cache slots
[B T]), runs the reference forward on them eagerly (that call's result) and, on CUDA, captures the
same forward into a ``torch.cuda.CUDAGraph`` (one memory pool for all buckets); later calls of the
bucket copy their packed inputs (token ids, positions, the trees' packed mask words: one small
host-to-device copy) into a static buffer and replay; the mask and slots are built from that buffer
inside the graph: one copy and one launch a step, no per-op dispatch, no host synchronisation
inside the step (routing, budget and experts run in moespec's CUDA ops, which allocate from torch's
allocator and run on the current stream). Prefill, and calls that fit no
bucket (unequal tree sizes, trees over ``max_tokens`` nodes, an observer recording routing), run
eagerly: through the fused forward on their packed tokens where it takes them
(:func:`moespec.runtime.fused.eager_forward`: up to 256 tokens a request, no observer), else the
reference forward.

The forward is :class:`moespec.runtime.fused.FusedForward` where the model fits it (the reference
forward's semantics with the attention half of each layer in moespec's decoder ops: a few launches
a layer, attention over the used slots only, the cache length read on the device), else
:class:`moespec.runtime.backend.ReferenceBackend`'s on a batch whose index tensors are the static
buffers, whose attention covers all S_max slots with a mask (the price of a fixed shape). On the
CPU there are no graphs: the same static steps run eagerly, which is what the CPU tests hold against
the reference path (tests/python/test_graphs.py); tests/gpu/test_runtime_cuda.py holds graph replay
against eager on a GPU.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Optional

import torch

from moespec._tensor import copy_from_host, to_device
from moespec.models.cache import KVCache
from moespec.ops import ExpertBudget
from moespec.ops.decoder import attention_groups, visible_slots
from moespec.runtime.fused import FusedForward, PackedStep, eager_forward, fits_eager
from moespec.runtime.fused import supports as fused_supports
from moespec.runtime.state import StepGeometry, new_tokens, step_geometry

if TYPE_CHECKING:
    from moespec.models.runtime import TargetModel
    from moespec.runtime.backend import ForwardOutput, ReferenceBackend

MAX_BUCKETS = 32  # buckets held per model (each holds a graph and its static buffers); the least
# recently used one makes room for a new one, and a bucket goes with its cache


class StaticStep:
    """One bucket: static inputs over one cache, the forward on them, and its graph (on CUDA)."""

    capture_on = ("cuda",)  # device types whose steps are captured (the CPU tests add "cpu" with a fake graph)

    def __init__(self, reference: "ReferenceBackend", cache: KVCache, batch: int, tokens: int,
                 budget: Optional[ExpertBudget], pool=None, fused: Optional[FusedForward] = None):
        from moespec.runtime.backend import _Batch

        self.reference, self.budget, self.fused = reference, budget, fused
        self._cache = weakref.ref(cache)  # (a bucket must not keep a finished run's cache alive)
        device = reference.model.device
        B, T, S = batch, tokens, cache.max_len
        long = dict(dtype=torch.long, device=device)
        self.batch = _Batch(tokens=torch.zeros(B, T, **long), num=[T] * B, starts=[0] * B,
                            positions=torch.zeros(B, T, **long),  # (the fused forward needs no [B, T, S] mask)
                            visible=torch.zeros(B, T, S if fused is None else 1, dtype=torch.bool, device=device),
                            valid=torch.ones(B, T, dtype=torch.bool, device=device),
                            rows=torch.arange(B, **long).repeat_interleave(T), cols=torch.arange(T, **long).repeat(B),
                            slots=torch.zeros(B * T, **long),
                            weights=None if budget is None else torch.ones(B * T, device=device))
        self.weighted = False  # whether batch.weights holds a call's weights (else all 1)
        self.pool = pool
        self.packed: Optional[torch.Tensor] = None  # long: the call's geometry, copied in by load()
        self.words = 0  # packed mask words per token
        self.mask_words: Optional[torch.Tensor] = None  # int32 [B, T, W]: the fused forward's mask rows
        # the fused forward's fixed geometry: B requests of T tokens each
        self.offsets = torch.arange(0, B * T + 1, T, **long)
        self.groups = to_device(attention_groups(list(range(0, B * T + 1, T))), device)  # (no stream sync)
        self.graph = None
        self.out: Optional["ForwardOutput"] = None

    @property
    def cache(self) -> Optional[KVCache]:
        """The cache the bucket's graph reads and writes (None once it is gone: the bucket is dropped)."""
        return self._cache()

    def load(self, geo: "StepGeometry", starts: list[int]) -> None:
        """Copies one call's packed geometry (token ids, positions, each request's first new slot, the
        new tokens' cache slots, the trees' packed mask words) into the static ``packed`` buffer, in one
        host-to-device copy. The fused forward reads the first four as they lie there and the mask rows
        from one conversion (the reference forward's inputs are built from it, :meth:`_unpack`), inside
        the graph on CUDA: a call launches the copy and the replay, nothing else."""
        T = self.batch.tokens.shape[1]
        host = torch.cat([geo.tokens.long(), geo.positions.long(),
                          to_device(starts + [s + t for s in starts for t in range(T)], geo.tokens.device, torch.long),
                          geo.mask.long().reshape(-1)])  # (on the host, or on the GPU for the device tree cores' trees)
        if self.packed is None:
            self.words = geo.mask.shape[1]
            self.packed = torch.empty(host.numel(), dtype=torch.long, device=self.batch.tokens.device)
            B, T = self.batch.tokens.shape
            self.mask_words = torch.empty(B, T, self.words, dtype=torch.int32, device=self.packed.device)
        copy_from_host(self.packed, host)
        weights = self.batch.weights
        if weights is not None and (geo.weights is not None or self.weighted):  # (a budget's token weights)
            if geo.weights is None:
                weights.fill_(1.0)
            elif geo.weights.device == weights.device:
                weights.copy_(geo.weights)
            else:
                copy_from_host(weights, geo.weights)
            self.weighted = geo.weights is not None

    def _unpack(self) -> tuple[torch.Tensor, ...]:
        """From ``packed``: tokens and positions long [B T], each request's first new slot long [B] and
        the new tokens' cache slots long [B T] (views), and the mask rows (the fused forward's int32
        words, one conversion; or the reference forward's inputs copied into its batch, with the mask
        over every cache slot: committed slots, then ancestor-or-self among the new tokens)."""
        b = self.batch
        B, T = b.tokens.shape
        P = B * T
        tokens, positions = self.packed[:P], self.packed[P: 2 * P]
        start, slots = self.packed[2 * P: 2 * P + B], self.packed[2 * P + B: 3 * P + B]
        words = self.packed[3 * P + B:].view(B, T, self.words)  # int32 words sign-extended: bits 0..31 as they were
        if self.fused is not None:
            self.mask_words.copy_(words)
        else:
            b.tokens.copy_(tokens.view(B, T))
            b.positions.copy_(positions.view(B, T))
            b.slots.copy_(slots)
            b.visible.copy_(visible_slots(start, words, self.cache.max_len))
        return tokens, positions, start, slots

    def run(self) -> "ForwardOutput":
        """The forward on the loaded inputs: eagerly the first time (capturing it on CUDA), then replayed."""
        if self.graph is not None:
            self.graph.replay()
            return self.out
        out = self._forward()
        if self.batch.tokens.device.type in self.capture_on:
            self._capture()
        return out

    def _forward(self) -> "ForwardOutput":
        tokens, positions, start, slots = self._unpack()
        b = self.batch
        if self.fused is None:
            return self.reference._forward(self.cache, b, self.budget, last_only=False)
        B, T = b.tokens.shape
        packed = PackedStep(tokens=tokens, positions=positions, start=start, offsets=self.offsets,
                            groups=self.groups, words=self.mask_words.view(B * T, -1), rows=b.rows, slots=slots,
                            weights=b.weights)
        out = self.fused(self.cache, packed, self.budget)
        out.logits, out.num_tokens = out.logits.view(B, T, -1), [T] * B
        out.hidden = tuple(t.view(B, T, -1) for t in out.hidden)
        return out

    def _capture(self) -> None:
        """Captures the forward (its K/V writes go to the slots already written by the eager run, with
        the same values, so capturing changes nothing)."""
        self.graph, self.out = capture(self._forward, self.pool)


def capture(fn, pool=None) -> tuple:
    """A ``torch.cuda.CUDAGraph`` of ``fn()`` (after a warm-up call on a side stream, as torch's graph
    docs ask) and what the captured call returned; ``pool``: the memory pool to share."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out


class GraphBackend:
    """See the module docstring. ``max_tokens``: the largest T a bucket takes (longer calls, such as a
    long prefill, run the reference as they are)."""

    name = "graphs"

    def __init__(self, model: "TargetModel", reference: "ReferenceBackend", max_tokens: int = 128):
        self.model, self.reference, self.max_tokens = model, reference, max_tokens
        self.steps: dict[tuple, StaticStep] = {}
        self.pool = torch.cuda.graph_pool_handle() if model.device.type == "cuda" else None
        self.fused = FusedForward(model) if fused_supports(model) else None  # (moespec.runtime.fused)

    def eager(self, cache: KVCache, seqs: list[list[int]], parents: Optional[list[list[int]]],
              budget: Optional[ExpertBudget], last_only: bool, geo=None) -> "ForwardOutput":
        """A call no bucket takes: the fused forward on its packed tokens where it fits (unequal
        trees, prompts of up to kMaxTreeTokens tokens), else the reference forward."""
        if self.fused is not None and fits_eager(self.model, new_tokens(seqs, geo)):
            return eager_forward(self.fused, cache, seqs, parents, budget, last_only, geo)
        return self.reference.forward(cache, seqs, parents, budget, last_only)

    def _make_room(self) -> None:
        """Drops the buckets whose cache is gone (a finished run's), then, while the table is full, the
        least recently used one (its graph and static buffers go back to the pool)."""
        for key in [k for k, step in self.steps.items() if step.cache is None]:
            del self.steps[key]
        while len(self.steps) >= MAX_BUCKETS:
            del self.steps[next(iter(self.steps))]

    def forward(self, cache: KVCache, seqs: list[list[int]], parents: Optional[list[list[int]]],
                budget: Optional[ExpertBudget], last_only: bool, geo=None, borrow: bool = False) -> "ForwardOutput":
        """``borrow``: a bucket's logits and taps are returned as views of its static buffers (valid until
        the bucket's next call), not copied out (a verify's logits [B, T, V]: 78 MB at B = 8, T = 32 and
        a 152k vocabulary); the expert stats are copied either way."""
        from moespec.runtime.backend import ForwardOutput

        num = new_tokens(seqs, geo)
        T = num[0]
        if (self.model.observer is not None or any(n != T for n in num) or not 1 <= T <= self.max_tokens
                or (parents is None and T > 1)):  # (prefill runs eagerly: decode and tree verify are the steps)
            return self.eager(cache, seqs, parents, budget, last_only, geo)
        # (sequences and trees of one T share a step: the mask is an input)
        key = (id(cache), cache.k.data_ptr(), tuple(cache.k.shape), len(seqs), T, budget, self.model.taps)
        step = self.steps.pop(key, None)
        if step is None or step.cache is not cache:  # (new, or another cache that took a gone one's id)
            self._make_room()
            step = StaticStep(self.reference, cache, len(seqs), T, budget, self.pool, self.fused)
        self.steps[key] = step  # (last: the most recently used)
        step.load(geo if geo is not None else step_geometry(seqs, cache.lengths, parents), list(cache.lengths))
        out = step.run()
        logits = out.logits[:, -1] if last_only else out.logits  # every request has T tokens
        copy = (lambda t: t) if borrow else torch.clone
        return ForwardOutput(logits=copy(logits), hidden=tuple(copy(h) for h in out.hidden),
                             expert_stats=out.expert_stats.clone(), num_tokens=num, routing=None)
