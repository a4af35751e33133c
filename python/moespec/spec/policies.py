"""Decoding policies: objects with ``start(batch)`` and ``step(run, batch)``, no if-ladders in the loop.

- :class:`ARPolicy` ("ar"): plain autoregressive decoding, one target decode per token.
- :class:`Eagle3Policy` ("eagle3", "eagle3+budget"): EAGLE-3 speculative decoding. One step:
  draft (EAGLE-2 dynamic tree from the draft head) -> select tree -> verify (one target pass over
  every request's tree, with the MoE-Spec expert budget for "eagle3+budget") -> accept -> commit
  (target and draft caches keep only the accepted path) -> emit.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from moespec.models import KVCache, TargetModel
from moespec.spec.sampling import accept, sample_rows


@dataclass
class Run:
    """The state of a batch between steps."""

    cache: KVCache
    first_tokens: list[int]
    last_expert_stats: Optional[torch.Tensor] = None  # int32 [MoE layers, 4] of the last verify step
    # float [MoE layers]: the cost-aware selector's expected unique experts of the last verify step (eco policies)
    last_predicted_unique: Optional[Any] = None
    extra: dict[str, Any] = field(default_factory=dict)


def host_single_threaded(method):
    """Runs a policy's ``start`` / ``step`` with torch on one CPU thread when the target is on the CPU
    (the caller's thread count restored after). The heavy work of a step is native and runs on
    moespec's own pool; torch's ops there are small (argmax, tree bookkeeping, gathers), and with two
    OpenMP threads each of them leaves a worker spinning on a core the native kernels are about to
    use (measured on the 2-core VM: an eagle3+budget:16 step 12% shorter with torch on one thread,
    interleaved runs; README, "Where a step's time goes")."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if self.target.device.type != "cpu":
            return method(self, *args, **kwargs)
        saved = torch.get_num_threads()
        if saved != 1:
            torch.set_num_threads(1)
        try:
            return method(self, *args, **kwargs)
        finally:
            if saved != 1:
                torch.set_num_threads(saved)

    return wrapper


def _cache_len(batch, margin: int) -> int:
    return max(len(r.prompt_ids) + r.params.max_tokens for r in batch) + margin


class ARPolicy:
    """Plain autoregressive decoding."""

    name = "ar"

    def __init__(self, target: TargetModel):
        self.target = target

    @host_single_threaded
    def start(self, batch) -> Run:
        cache = self.target.new_cache(len(batch), _cache_len(batch, 2))
        out = self.target.prefill(cache, [r.prompt_ids for r in batch])
        return Run(cache, sample_rows(out.logits, [r.params for r in batch], [r.generator for r in batch]))

    @host_single_threaded
    def step(self, run: Run, batch) -> list[Optional[list[int]]]:
        out = self.target.decode(run.cache, [None if r.finished else r.last for r in batch])
        run.last_expert_stats = out.expert_stats  # what the decode step's MoE layers read
        # the greedy requests' tokens in one argmax and one copy back (on a GPU, one synchronisation a
        # step, not one a request); sampled ones draw with their generators as sample() does
        tokens = sample_rows(out.logits, [r.params for r in batch], [r.generator for r in batch],
                             [not r.finished for r in batch])
        return [None if t is None else [t] for t in tokens]


def make_policy(target: TargetModel, draft, config, model_path: Optional[Path] = None, predictor=None):
    """The policy object for a SpeculativeConfig (``predictor``: the expert predictor a cost-aware
    tree needs; default: the one shipped in the engine folder ``model_path``, if any)."""
    if not config.spec.speculative:
        return ARPolicy(target)
    if draft is None:
        raise ValueError(f"policy {config.policy!r} needs an EAGLE-3 draft head (LLM(..., draft=<folder>))")
    from moespec.spec.eagle3_policy import Eagle3Policy

    if config.spec.selector == "cost_aware" and predictor is None and model_path is not None:
        from moespec.engine import is_engine_folder
        from moespec.engine.folder import engine_predictor

        if is_engine_folder(model_path):
            predictor = engine_predictor(model_path, target.config)
    return Eagle3Policy(target, draft, config, predictor=predictor)


__all__ = ["ARPolicy", "Run", "accept", "host_single_threaded", "make_policy"]
