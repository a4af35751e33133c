"""EAGLE-3 speculative decoding: the "eagle3" and "eagle3+budget" policies.

One step for a batch of B requests (each request's root is its last emitted token, whose target KV
is not in the cache yet):

1. draft:   the head's distribution after the root (from the last catch-up) starts each tree; the
            head then runs depth - 1 expansion steps over the K frontier nodes of every request
            (EAGLE-2 dynamic tree, :class:`moespec.spec.tree.TreeBuilder`);
2. select:  each request keeps its ``total_tokens`` best nodes (ancestor-closed);
3. verify:  one target pass over all trees (ancestor masks, positions = length + depth), with the
            MoE-Spec expert budget per layer over the whole batch for "eagle3+budget";
4. accept:  greedy longest match plus bonus, or speculative sampling (:func:`moespec.spec.sampling.accept_trees`);
5. commit:  the target keeps the accepted path's KV; the draft catches up over the accepted path
            (target tap features of the path paired with the next tokens) and keeps those entries;
6. emit:    the accepted draft tokens and the bonus token.

Draft alignment (see :mod:`moespec.spec.eagle3`): draft entry s pairs the target features of
position s with token s + 1 and sits at draft slot and position s; a tree node at depth d >= 1 runs
at position n - 1 + d (n = draft entries) in scratch slot n + (d - 1) K + k and sees the accepted
entries, its expanded ancestors and itself.

Dimensions: B requests, K top-k (frontier size), D tree depth, S draft slots, H draft hidden,
Vd draft vocabulary.
"""

from __future__ import annotations

import os
import time
from typing import Optional

import numpy as np
import torch

from moespec._loader import native
from moespec._tensor import to_device
from moespec.models import TargetModel
from moespec.spec.draft_graph import PathFeatures, StaticCatchUp, StaticDraftRound, causal_words
from moespec.spec.eagle3 import Eagle3Head, load_eagle3
from moespec.spec.policies import Run, _cache_len, host_single_threaded
from moespec.spec.sampling import accept_trees, sample_rows
from moespec.spec.tree import TreeBuilder, default_device_core


class Eagle3Policy:
    """EAGLE-3 with an EAGLE-2 dynamic tree; with ``config.budget`` the verify pass is budgeted."""

    def __init__(self, target: TargetModel, draft, config, predictor=None):
        self.target = target
        self.head: Eagle3Head = draft if isinstance(draft, Eagle3Head) else load_eagle3(draft, target)
        self.config = config
        self.name = config.policy
        self.budget = config.budget if config.spec.budgeted else None
        if self.budget is not None and target.config.moe is None:
            raise ValueError(f"policy {config.policy!r}: the target ({target.config.architecture}) is a dense model "
                             "without MoE layers, so an expert budget has nothing to cap (use 'eagle3')")
        target.set_taps(self.head.config.aux_layers)
        self._builders: dict[int, TreeBuilder] = {}
        # draft rounds on static shapes, captured as a CUDA graph on a GPU (moespec.spec.draft_graph):
        # the default on CUDA (an H200 held replay to the eager round; the eagle3 step took 9.4 ms
        # against 20.1 eager, tests/gpu/bench_runtime_cuda.py), off on the CPU (nothing to capture);
        # MOESPEC_DRAFT_GRAPHS=1 / 0 forces it either way
        flag = os.environ.get("MOESPEC_DRAFT_GRAPHS")
        self.draft_graphs = flag == "1" if flag in ("0", "1") else target.device.type == "cuda"
        self._static: Optional[StaticDraftRound] = None
        self._catch_ups: dict[tuple, StaticCatchUp] = {}  # the steps' catch-ups of one draft cache by (B, T)
        self._levels: dict[torch.device, tuple] = {}  # the draft round's per-level constants (_level_slots)
        self.selector = None  # the cost-aware verify-set choice of the eco policies (None: EAGLE-2's)
        if config.spec.selector == "cost_aware":
            from moespec.cost.step_cost import shape_from_config
            from moespec.spec.cost_aware import CostAwareTrees, StepPricer, default_hardware

            if target.config.moe is None:
                raise ValueError(f"policy {config.policy!r}: the target ({target.config.architecture}) is dense: a "
                                 "cost-aware tree prices experts it does not have (use 'eagle3')")
            if predictor is None:
                raise ValueError(f"policy {config.policy!r} needs an expert predictor: an engine built with "
                                 "`moespec build ... --predictor <dir>` (moespec analyze predictor --out <dir>), or "
                                 "LLM(..., predictor=ExpertPredictor.load(<dir>))")
            pricer = StepPricer(shape_from_config(target.config), default_hardware(), depth=config.depth,
                                top_k=config.top_k, tokens=config.total_tokens + 1)
            self.selector = CostAwareTrees(target, predictor.to(target.device), pricer, config.total_tokens)

    @property
    def max_tree_nodes(self) -> int:
        K, D = self.config.top_k, self.config.depth
        return min(self.config.total_tokens, K + (D - 1) * K * K) + 1

    @property
    def device_selection(self) -> bool:
        """Whether the eco policies' rounds and selection stay on the target's GPU
        (:meth:`moespec.spec.cost_aware.CostAwareTrees.device_trees`: no host synchronisation until
        the acceptance; on the CPU, the native core and the host selection)."""
        return self.selector is not None and self.target.device.type != "cpu"

    @property
    def static_round(self) -> bool:
        """Whether draft rounds run on static shapes (draft graphs: EAGLE-2's selection, or a cost-aware
        one on the GPU, whose round always runs its full depth)."""
        return self.draft_graphs and (self.selector is None or self.device_selection)

    def _builder(self, batch: int) -> TreeBuilder:
        """EAGLE-2's rounds keep their trees on the target's device (a GPU's: the fused core, a kernel a
        level, no host synchronisation between levels; captured with a static round; a static round
        on the CPU: the torch core). The eco policies' rounds on the CPU build them with the native
        core for the host selection; on a GPU on the device, with total_tokens the selection's
        candidate pool (:meth:`moespec.spec.cost_aware.CostAwareTrees.candidate_cap`; until
        2026-12-06 a GPU's eco rounds built their trees on the host too, about ten synchronisations a
        step)."""
        if batch not in self._builders:
            c = self.config
            on_host = self.selector is not None and not self.device_selection
            total = c.total_tokens
            if self.device_selection:
                total = self.selector.candidate_cap(c.top_k + (c.depth - 1) * c.top_k ** 2)
            self._builders[batch] = TreeBuilder(batch, depth=c.depth, top_k=c.top_k, total_tokens=total,
                                                d2t=self.head.d2t, device="cpu" if on_host else self.target.device,
                                                core=self._static_core() if self.static_round else None)
        return self._builders[batch]

    def _static_core(self) -> str:
        """A static round's tree core (one that keeps its trees on the device): the device's default,
        the torch core on the CPU (whose default, the native core, cannot be captured)."""
        return "torch" if self.target.device.type == "cpu" else default_device_core()

    # ---- start: prefill the target, catch the draft up over the prompt -----------------------------

    @host_single_threaded
    def start(self, batch) -> Run:
        B, K, D = len(batch), self.config.top_k, self.config.depth
        cache = self.target.new_cache(B, _cache_len(batch, self.max_tree_nodes + 1))
        prompts = [r.prompt_ids for r in batch]
        out = self.target.prefill(cache, prompts)
        first = sample_rows(out.logits, [r.params for r in batch], [r.generator for r in batch])
        draft_cache = self.head.new_cache(B, _cache_len(batch, D + 2) + (D - 1) * K)
        run = Run(cache, first, extra={"draft_cache": draft_cache})
        # catch-up entry s of request b: target features of prompt position s, token s + 1
        next_tokens = [p[1:] + [f] for p, f in zip(prompts, first)]
        self._catch_up(run, next_tokens, out.hidden)
        return run

    def _catch_up(self, run: Run, next_tokens: list[list[int]], features, static: bool = False) -> None:
        """Appends entries to the draft cache (tokens [B][n_b], features: the 3 target taps [B, T, Ht]
        aligned with them, or a PathFeatures) and keeps the head's output at each request's last new entry. ``static``
        (a step's catch-up, with draft graphs, on the device): through a :class:`StaticCatchUp` bucket
        (a CUDA graph on a GPU)."""
        dc = run.extra["draft_cache"]
        num = [len(t) for t in next_tokens]
        B, T = len(num), max(num)
        dev = self.target.device
        native = self.head.runs_natively(dc)
        if T > 0 and not native and static and self.draft_graphs:
            if any(b.dc is not dc for b in self._catch_ups.values()):
                self._catch_ups.clear()  # a new run's cache: the old buckets (and the old cache) go
            bucket = self._catch_ups.get((B, T))
            if bucket is None:
                bucket = self._catch_ups[(B, T)] = StaticCatchUp(self, dc, B, T, features)
            logits, hidden = bucket.run(next_tokens, features)
        else:
            features = features.gathered() if isinstance(features, PathFeatures) else features
            tokens = to_device([t + [0] * (T - len(t)) for t in next_tokens], dev)  # [B, T]
            if T > 0 and (min(num) == T or not native):  # the native step's terms: mask words, entry j sees new 0..j
                causal = causal_words(B, T)
                j = np.arange(T)
                if native:  # every request T entries
                    lengths = np.asarray(dc.lengths, dtype=np.int64)[:, None]
                    out = self.head.forward_native(dc, tokens, self.head.features(features), lengths + j,
                                                   np.broadcast_to(j, (B, T)), causal, last_only=True)
                else:  # on the device: attention over the accepted prefix and the new entries only; padding (-1)
                    start = to_device(dc.lengths, dev, torch.long)  # entries write the discard slot
                    rel = to_device([[i if i < n else -1 for i in range(T)] for n in num], dev, torch.long)
                    out = self.head.forward_words(dc, tokens, features, start=start, positions=start[:, None] +
                                                  rel.clamp_min(0), slots=rel, words=to_device(causal, dev), span=T,
                                                  last_only=True)
            else:
                step = dc.append_inputs(num)
                out = self.head(dc, tokens, features, positions=step.positions, slots=step.slots, visible=step.visible,
                                last_only=True)
            last = to_device([max(n - 1, 0) for n in num], dev)
            logits, hidden = out.logits[:, 0], out.hidden[torch.arange(B, device=dev), last]  # [B, Vd], [B, H]
        dc.advance(num)
        if min(num) == 0 and "draft_logits" in run.extra:  # requests without new entries keep their previous output
            keep = to_device([n > 0 for n in num], dev)[:, None]
            logits = torch.where(keep, logits, run.extra["draft_logits"])
            hidden = torch.where(keep, hidden, run.extra["draft_hidden"])
        run.extra["draft_logits"], run.extra["draft_hidden"] = logits, hidden

    # ---- one step ---------------------------------------------------------------------------------

    @host_single_threaded
    def step(self, run: Run, batch) -> list[Optional[list[int]]]:
        clock = time.perf_counter()
        active = [not r.finished for r in batch]
        # a torch core's round is not read back before the verify (flags: its recorded problems, on the
        # device): the step's one copy back is the acceptance's, which checks them before the commit
        trees, flags = self._draft(run, [r.last if a else 0 for r, a in zip(batch, active)], active, deferred=True)
        verify_start = time.perf_counter()
        out = self.target.verify_trees(run.cache, [t if a else None for t, a in zip(trees, active)],
                                       budget=self.budget, read_back=flags is None, borrow=True)
        verify_s = time.perf_counter() - verify_start
        run.last_expert_stats = out.expert_stats
        # every request accepts where the logits are, all at once (one copy back per step; sampled ones
        # with uniforms from their own generators; a GPU selection's own values in the same copy)
        also = ([flags] if flags is not None else []) + (self.selector.to_read if self.selector is not None else [])
        accepted, values = accept_trees([t if a else None for t, a in zip(trees, active)], out.logits,
                                        [r.params for r in batch], [r.generator for r in batch], also=also)
        problems, values = (values[:flags.numel()], values[flags.numel():]) if flags is not None else ([], values)
        if flags is not None and not all(problems):
            run.cache.pending = None  # (the verified trees are dropped: nothing of them is committed)
            self._builder(len(batch)).raise_recorded(problems)
        self.target.commit(run.cache, [a.path if a else [] for a in accepted])
        self._catch_up(run, [a.tokens if a else [] for a in accepted], self._path_features(out.hidden, accepted),
                       static=True)
        if self.selector is not None:  # what the step cost besides its verify pass prices the next tree
            live = [b for b in range(len(batch)) if active[b]]
            self.selector.observe_step(time.perf_counter() - clock - verify_s, [trees[b] for b in live],
                                       [accepted[b].path for b in live], live, values)
            run.last_predicted_unique = self.selector.predicted_unique
        return [a.tokens if a else None for a in accepted]

    @staticmethod
    def _path_features(taps, accepted) -> PathFeatures:
        """The target tap features [B, T, Ht] of each request's accepted path, to gather (one gather
        per tap, into a static catch-up's buffers where one takes them), the index copied to the
        device once (no synchronisation). Padding repeats node 0's row: padding entries write no cache
        slot and their outputs are not read."""
        T = max(len(a.path) if a else 0 for a in accepted)
        index = to_device([(a.path if a else []) + [0] * (T - (len(a.path) if a else 0)) for a in accepted],
                          taps[0].device, torch.long)  # [B, T]
        return PathFeatures(taps, index)

    def _draft(self, run: Run, roots: list[int], active: Optional[list[bool]] = None, deferred: bool = False):
        """Builds every request's draft tree (steps 1-2); returns one DraftTree per request (those of
        inactive requests are not verified; default: all active). ``deferred``: returns the trees and
        their round's problem flags on the device, the torch core's trees not read back and not copied
        (views of the builder's buffers, their paths None: :meth:`moespec.spec.tree.TreeBuilder.deferred_trees`;
        a step uses them before its next round), or None where the round was checked on the host (the
        native core, a cost-aware choice on the host). A GPU's cost-aware choice returns the round's flags
        and leaves its own values to read back (:attr:`moespec.spec.cost_aware.CostAwareTrees.to_read`)."""
        active = [True] * len(roots) if active is None else active
        dc = run.extra["draft_cache"]
        builder = self._builder(len(roots))
        flags = None
        if self.static_round:  # static shapes: a CUDA graph on a GPU (no host synchronisation between levels)
            if self._static is None or self._static.dc is not dc or self._static.builder is not builder:
                self._static = StaticDraftRound(self, builder, dc)
            trees = self._static.run(roots, run.extra["draft_logits"], run.extra["draft_hidden"],
                                     deferred or self.device_selection)
            trees, flags = trees if deferred or self.device_selection else (trees, None)
            if self.device_selection:  # (the round's finalized trees are the candidates)
                trees = self.selector.device_trees(builder, self._static.hidden, self._static.level_hidden, active)
        elif self._host_round(dc):
            self._grow_native(builder, dc, roots, run.extra["draft_logits"], run.extra["draft_hidden"])
            trees = [t.clone() for t in builder.finalize()]
        else:
            n = to_device(dc.lengths, self.target.device, torch.long)  # [B] accepted draft entries
            level_hidden = self._grow(builder, dc, roots, run.extra["draft_logits"], run.extra["draft_hidden"], n,
                                      active)
            if self.device_selection:
                builder.finalize_device()
                trees = self.selector.device_trees(builder, run.extra["draft_hidden"], level_hidden, active)
                flags = builder.deferred_trees()[1]
            elif self.selector is not None:
                trees = self.selector.trees(builder, roots, run.extra["draft_hidden"], level_hidden, active)
            elif deferred and builder.on_device:
                builder.finalize_device()
                trees, flags = builder.deferred_trees()
            else:
                trees = [t.clone() for t in builder.finalize()]
        return (trees, flags) if deferred else trees

    def _host_round(self, dc) -> bool:
        """Whether the round runs as :meth:`_grow_native` (no selector, the head native on the host)."""
        return self.selector is None and self.head.runs_natively(dc)

    def _grow_native(self, builder: TreeBuilder, dc, roots, draft_logits: torch.Tensor,
                     draft_hidden: torch.Tensor) -> None:
        """:meth:`_grow` without a selector where the head runs natively on the host: the same levels
        and the same bits, the frontier's visibility kept as the native step's mask words (bit i: the
        scratch slot lengths[b] + i; the accepted prefix is always seen) instead of [B, K, S] tensors."""
        c, head = self.config, self.head
        B, K = len(draft_logits), c.top_k
        top = torch.log_softmax(draft_logits, dim=-1).topk(K, dim=-1)  # [B, K]
        frontier = builder.expand_root(roots, top.indices, top.values)
        H = draft_hidden.shape[-1]
        hidden = draft_hidden[:, None, :].expand(B, K, H)  # the frontier's parents' outputs
        lengths = np.asarray(dc.lengths, dtype=np.int64)
        W = ((c.depth - 1) * K + 31) // 32
        words = np.zeros((B, K, W), dtype=np.uint32)  # the frontier's masks: the root sees no scratch slot
        slot = np.arange(K)
        for d in range(1, c.depth):
            own = (d - 1) * K + slot  # [K] the level's scratch slots (past lengths[b])
            words[:, slot, own // 32] |= np.left_shift(np.uint32(1), (own % 32).astype(np.uint32))  # sees itself
            out = head.forward_native(dc, frontier.tokens, hidden, np.broadcast_to((lengths - 1 + d)[:, None], (B, K)),
                                     np.broadcast_to(own, (B, K)), words.reshape(B * K, W).view(np.int32))
            top = torch.log_softmax(out.logits, dim=-1).topk(K, dim=-1)  # [B, K, K]
            frontier = builder.expand(top.indices, top.values)
            parent = frontier.parent_slot.long()  # [B, K]
            hidden = out.hidden.gather(1, parent[:, :, None].expand(B, K, H))
            words = np.take_along_axis(words, parent.numpy()[:, :, None], 1)

    def _grow(self, builder: TreeBuilder, dc, roots, draft_logits: torch.Tensor, draft_hidden: torch.Tensor,
              n: torch.Tensor, active) -> list[torch.Tensor]:
        """expand_root from the draft's output after each root, then up to depth - 1 expansions of the
        K frontier nodes through the head (the eco policies on the CPU stop where a level cannot pay); ``n`` long
        [B]: each request's accepted draft entries, on the device. The frontier's visibility is kept as
        mask words over the scratch slots (bit i: slot n[b] + i; the accepted prefix is always seen), as
        :meth:`_grow_native` keeps it, and the head attends those slots only
        (:meth:`Eagle3Head.forward_words`). Device work only, without a selector. Returns the levels'
        frontier states (what a cost-aware choice reads)."""
        c, head = self.config, self.head
        B, K = len(draft_logits), c.top_k
        dev = self.target.device
        top = torch.log_softmax(draft_logits, dim=-1).topk(K, dim=-1)  # [B, K]
        frontier = builder.expand_root(roots, top.indices, top.values)
        level_hidden = []  # the frontier states that propose each next level (kept for a cost-aware choice)
        H = draft_hidden.shape[-1]
        hidden = draft_hidden[:, None, :].expand(B, K, H)  # the frontier's parents' outputs
        span = (c.depth - 1) * K  # scratch slots of the round
        if dev.type == "cuda" and span > native().kMaxTreeTokens:
            raise ValueError(f"speculative config: (depth - 1) * top_k = {span} scratch slots; the draft round on a "
                             f"GPU attends at most {native().kMaxTreeTokens} (tree_attention's mask rows)")
        words = torch.zeros(B, K, (span + 31) // 32, dtype=torch.int32, device=dev)  # the root sees no scratch slot
        slots, bits, offsets = self._level_slots(dev)
        # once a round, for every level: the nodes' cache slots (no padding), positions (the root's + d)
        # and rope rows
        writes = n[None, :, None] + slots[:, None, :]  # [depth - 1, B, K]
        positions = (n[None, :] + offsets[:, None])[:, :, None].expand(c.depth - 1, B, K)  # [depth - 1, B, K]
        cos, sin = (t.view(c.depth - 1, B * K, -1) for t in head.rope_rows(dc, positions))
        for d in range(1, c.depth):
            host_selection = self.selector is not None and not self.device_selection
            if host_selection and not self.selector.worth_expanding(frontier.scores, active):
                break  # no node of a deeper level can pay for it (the eco policies on the CPU)
            level_start = time.perf_counter()
            own = slots[d - 1]  # [K] the level's scratch slots, relative to n
            words |= bits[d - 1]  # each node sees itself (its own slot's bit)
            out = head.forward_words(dc, frontier.tokens.to(dev), hidden, start=n,  # (read by the embedding only)
                                     positions=positions[d - 1], slots=own.expand(B, K),
                                     words=words.view(B * K, -1), span=span, write=writes[d - 1],
                                     rope=(cos[d - 1], sin[d - 1]))
            top = torch.log_softmax(out.logits, dim=-1).topk(K, dim=-1)  # [B, K, K]
            frontier = builder.expand(top.indices, top.values)
            parent = frontier.parent_slot.long().to(dev)[:, :, None]  # [B, K, 1]
            if self.selector is not None:
                level_hidden.append(out.hidden)
            if host_selection:
                self.selector.observe_level(time.perf_counter() - level_start)
            hidden = out.hidden.gather(1, parent.expand(B, K, H))
            words = words.gather(1, parent.expand(B, K, words.shape[-1]))
        return level_hidden

    def _level_slots(self, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The draft round's per-level constants on ``dev``: slots long [depth - 1, K] (level d's nodes'
        scratch slots (d - 1) K + s), bits int32 [depth - 1, K, W] (each node's own slot as a mask
        word bit) and offsets long [depth - 1] (level d's nodes' positions past the accepted prefix,
        d - 1), made once (host-built; a captured round reads them) so that a level adds its nodes'
        bits in one launch and a round makes every level's positions in one."""
        if dev not in self._levels:
            K, levels = self.config.top_k, self.config.depth - 1
            own = np.arange(levels * K).reshape(levels, K)
            bits = np.zeros((levels, K, (levels * K + 31) // 32), dtype=np.uint32)
            ones = np.left_shift(np.uint32(1), (own % 32).astype(np.uint32))
            np.put_along_axis(bits, (own // 32)[:, :, None], ones[:, :, None], 2)
            self._levels[dev] = (to_device(own, dev, torch.long), to_device(bits.view(np.int32), dev),
                                 to_device(np.arange(levels), dev, torch.long))
        return self._levels[dev]
