"""EAGLE-3's draft round and the step's catch-up on static shapes, replayed as CUDA graphs on a GPU.

A draft round (:meth:`moespec.spec.eagle3_policy.Eagle3Policy._grow`: expand_root, depth - 1 head
levels over the K frontier nodes, the tree core's finalize) is a fixed sequence of a few hundred
small kernels whose shapes depend only on (B, K, depth) (the head attends the accepted prefix and
the scratch slots its mask words name, the lengths read on the device): so it can be captured once
and replayed, one launch instead of hundreds, as the target's decode and verify steps are
(:mod:`moespec.runtime.graphs`). Per round, the inputs that change (each request's root token and
accepted length, the head's output after its root) are copied into static buffers, the round
replays, and the tree builder's host half (:meth:`moespec.spec.tree.TreeBuilder.finalize_host`:
the round's one copy back) turns the buffers into trees.

The first round of a (cache, builder) pair runs eagerly (that round's result) and, on CUDA, is then
captured; the head writes its levels' K/V into the same scratch slots each time, so capturing
changes nothing. A capture computes nothing, so whatever the host reads after a round (the tree
buffers, the tree core's ok flags) is allocated once and written in place: the first round's values
are its eager run's, later ones the replay's. On the CPU nothing is captured: the same static round
runs eagerly, which is what the CPU tests hold against the dynamic round
(tests/python/test_spec_decoding.py); tests/python/test_graphs.py replays it from a CPU stand-in for
a graph (tests/python/fake_graph.py), and tests/gpu/test_runtime_cuda.py holds replay against it on
a GPU (an H200 did, 2026-12-04). The default on CUDA; ``MOESPEC_DRAFT_GRAPHS=0`` turns it off,
``=1`` runs the static round on the CPU too. The eco policies, whose tree choice runs on the host,
keep the dynamic round.

The catch-up after a step's verify (:meth:`moespec.spec.eagle3_policy.Eagle3Policy._catch_up`: the
head over each request's accepted path, at most depth + 1 entries, padded to the longest) is the
same kind of call: a few dozen kernels whose shapes depend only on (B, T), which an H200 ran in 3.1
ms of an eagle3 step's 10.4 eagerly (2026-12-04, tests/gpu/bench_runtime_cuda.py "eagle3 step").
:class:`StaticCatchUp` holds one (draft cache, B, T) bucket of it: the tokens, each request's first
new slot and the entries' relative slots (-1: padding) arrive in one host-to-device copy, the target
features of the paths are copied into static buffers, and the head's call replays; its output after
each request's last entry is cloned out (the next replay rewrites the graph's buffers).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from moespec._tensor import copy_from_host, to_device
from moespec.runtime.graphs import capture

if TYPE_CHECKING:
    from moespec.spec.eagle3 import DraftCache
    from moespec.spec.eagle3_policy import Eagle3Policy
    from moespec.spec.tree import TreeBuilder


class StaticDraftRound:
    """One (draft cache, tree builder) pair's draft round on static buffers (see the module docstring)."""

    capture_on = ("cuda",)  # device types whose rounds are captured (the CPU tests add "cpu" with a fake graph)

    def __init__(self, policy: "Eagle3Policy", builder: "TreeBuilder", dc: "DraftCache"):
        if builder._core is None:
            raise ValueError("StaticDraftRound: needs the torch tree core (the native core finalizes on the host)")
        self.policy, self.builder, self.dc = policy, builder, dc
        B, dev, head = builder.batch, builder.device, policy.head
        self.inputs = torch.zeros(2, B, dtype=torch.long, device=dev)  # (both in one copy a round)
        self.roots, self.lengths = self.inputs  # [B] each request's last accepted token, its accepted draft entries
        self.logits = torch.zeros(B, head.config.draft_vocab_size, dtype=torch.float32, device=dev)  # [B, Vd]
        self.hidden = torch.zeros(B, head.config.hidden_size, dtype=head.dtype, device=dev)  # [B, H]
        self.graph = None
        self.level_hidden: list[torch.Tensor] = []  # the levels' frontier states (a cost-aware choice reads them)

    def run(self, roots: list[int], draft_logits: torch.Tensor, draft_hidden: torch.Tensor, deferred: bool = False):
        """This round's trees (clones) for ``roots`` and the head's output after them; ``deferred``:
        the trees without their copy back, as views of the builder's buffers (valid until the next
        round), and the round's problem flags on the device
        (:meth:`moespec.spec.tree.TreeBuilder.deferred_trees`)."""
        dev = self.roots.device
        copy_from_host(self.inputs, [list(roots), list(self.dc.lengths)])
        self.logits.copy_(draft_logits)
        self.hidden.copy_(draft_hidden)
        if self.graph is not None:
            self.graph.replay()
        else:
            self._round()
            if dev.type in self.capture_on:
                self._capture()
                if self.level_hidden:  # (made inside the capture, which computes nothing: a replay fills them)
                    self.graph.replay()
        if deferred:  # (views: the step reads them before the next round rewrites the buffers)
            return self.builder.deferred_trees()
        return [t.clone() for t in self.builder.finalize_host()]

    def _round(self) -> None:
        self.level_hidden = self.policy._grow(self.builder, self.dc, self.roots, self.logits, self.hidden, self.lengths,
                                              None)  # (captured: the graph's own buffers, rewritten by each replay)
        self.builder.finalize_device()

    def _capture(self) -> None:
        self.graph, _ = capture(self._round)


def causal_words(B: int, T: int) -> np.ndarray:
    """int32 [B T, W] mask words of T new entries per request, entry j seeing new entries 0..j."""
    j = np.arange(T)
    causal = np.packbits(j[None, :] <= j[:, None], axis=-1, bitorder="little")
    return np.tile(np.pad(causal, ((0, 0), (0, -causal.shape[1] % 4))).view(np.int32), (B, 1))


class PathFeatures:
    """The target tap features [B, T, Ht] of each request's accepted path, not gathered yet: ``taps``
    the verify pass's [B, n, Ht], ``index`` long [B, T] the paths' nodes (padding repeats node 0).
    A :class:`StaticCatchUp` gathers them straight into its static buffers (one launch a tap);
    :meth:`gathered` makes them."""

    def __init__(self, taps: tuple[torch.Tensor, ...], index: torch.Tensor):
        self.taps, self.index = taps, index

    def _index(self, h: torch.Tensor) -> torch.Tensor:
        return self.index[:, :, None].expand(-1, -1, h.shape[-1])

    def gathered(self) -> tuple[torch.Tensor, ...]:
        return tuple(h.gather(1, self._index(h)) for h in self.taps)

    def into(self, out: tuple[torch.Tensor, ...]) -> None:
        for h, o in zip(self.taps, out):
            torch.gather(h, 1, self._index(h), out=o)


class StaticCatchUp:
    """One (draft cache, B requests, T entries) bucket of the step's catch-up on static buffers (see
    the module docstring): the first call runs eagerly (its result) and, on CUDA, is then captured;
    later calls copy their inputs in and replay."""

    capture_on = ("cuda",)  # device types whose calls are captured (the CPU tests add "cpu" with a fake graph)

    def __init__(self, policy: "Eagle3Policy", dc: "DraftCache", batch: int, tokens: int, features):
        self.policy, self.dc = policy, dc
        features = features.taps if isinstance(features, PathFeatures) else features  # (their widths and dtypes)
        B, T, dev = batch, tokens, features[0].device
        # the call's inputs, made on the host and copied in one DMA: tokens, relative slots, positions and
        # cache slots [B, T] each, then the starts and each request's last entry [B] each
        self.packed = torch.zeros(4 * B * T + 2 * B, dtype=torch.long, device=dev)
        self.features = tuple(torch.zeros(B, T, f.shape[-1], dtype=f.dtype, device=dev) for f in features)
        self.words = to_device(causal_words(B, T), dev)
        self.graph = None
        self.out: tuple[torch.Tensor, torch.Tensor] = ()

    def run(self, tokens: list[list[int]], features) -> tuple[torch.Tensor, torch.Tensor]:
        """The head's logits [B, Vd] and hidden state [B, H] after each request's last new entry
        (tokens[b]: its n_b <= T entries, at least one request with T; features: the 3 target taps
        [B, T, Ht] aligned with them, or a :class:`PathFeatures` gathered into the static buffers).
        Appends the entries' K/V at the cache's lengths (the caller advances them)."""
        B, T = self.features[0].shape[:2]
        starts, discard = list(self.dc.lengths), self.dc.max_len
        host = [t + [0] * (T - len(t)) for t in tokens] + [list(range(len(t))) + [-1] * (T - len(t)) for t in tokens] + \
            [[s + i if i < len(t) else s for i in range(T)] for s, t in zip(starts, tokens)] + \
            [[s + i if i < len(t) else discard for i in range(T)] for s, t in zip(starts, tokens)]
        copy_from_host(self.packed, [v for row in host for v in row] + starts + [max(len(t) - 1, 0) for t in tokens])
        if isinstance(features, PathFeatures):
            features.into(self.features)
        else:
            for static, f in zip(self.features, features):
                static.copy_(f)
        if self.graph is not None:
            self.graph.replay()
            out = self.out
        else:
            out = self._call()
            if self.packed.device.type in self.capture_on:
                self.graph, self.out = capture(self._call)
        return out[0].clone(), out[1].clone()

    def _call(self) -> tuple[torch.Tensor, torch.Tensor]:
        B, T = self.features[0].shape[:2]
        tokens, rel, positions, write = self.packed[:4 * B * T].view(4, B, T)
        start, last = self.packed[4 * B * T:].view(2, B)
        out = self.policy.head.forward_words(self.dc, tokens, self.features, start=start, positions=positions,
                                             slots=rel, words=self.words, span=T, last_only=True, write=write,
                                             last=last)
        return out.logits[:, 0], out.hidden.gather(1, last[:, None, None].expand(B, 1, out.hidden.shape[-1]))[:, 0]
