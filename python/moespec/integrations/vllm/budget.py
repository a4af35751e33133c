"""MoE-Spec's expert budget inside vLLM: on verify forward passes only, per MoE layer over the whole
batch, through moespec's ``route_experts`` op (DESIGN.md "Expert budget").

Two hooks, installed by :func:`install` in every vLLM process that loads the plugin:

- the model runner's ``execute_model`` marks a pass as a verify pass when every scheduled request
  brings draft tokens and nothing else (``1 + len(drafts)`` tokens each: no prefill chunk); mixed
  batches (a prefill beside verifies) and plain decode run unbudgeted, so prefill and decode are
  never budgeted;
- ``BaseRouter._select_experts``, the template of every vLLM FusedMoE router
  (``vllm/model_executor/layers/fused_moe/router/``), on a verify pass re-routes the pass's router
  logits with ``moespec.ops.route_experts`` under the budget and hands the result to the router's
  own EPLB mapping (the natural ids are computed and captured first: the logical-id capture and
  EPLB's load record see the unbudgeted routing). A slot the budget drops (truncation) keeps an
  expert the pass already reads at weight 0 (vLLM's CPU MoE kernel mis-computes id -1).

Every budgeted routing call appends its :class:`moespec.ops.RoutingStats` to :data:`STATS` and,
every ``MOESPEC_BUDGET_LOG`` passes (default 0: never), logs the mean kept and natural experts.
Configuration: ``MOESPEC_BUDGET`` = ``B`` or ``B:substitution`` / ``B:truncation`` (unset: off);
a malformed value is an error when the plugin loads. The router state is Python, so on the CPU
the budget needs ``enforce_eager=True`` (vLLM's compiled CPU graph freezes it; an opaque custom op
is the next step). Routers whose family moespec does not implement (DeepSeek-V4's sqrtsoftplus, a
custom routing function) are left alone.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch

from moespec.ops import ExpertBudget, RouterSpec, RoutingStats, route_experts

logger = logging.getLogger("moespec.vllm")
STATS: list[RoutingStats] = []  # every budgeted routing call's statistics, in order
_STATE = {"verify": False, "passes": 0}


def budget_from_env(value: Optional[str] = None) -> Optional[ExpertBudget]:
    """``MOESPEC_BUDGET`` ("16", "16:truncation") as an ExpertBudget; None when unset or empty."""
    value = os.environ.get("MOESPEC_BUDGET", "") if value is None else value
    if not value.strip():
        return None
    count, _, policy = value.strip().partition(":")
    try:
        return ExpertBudget(int(count), policy or "substitution")
    except ValueError as exc:
        raise ValueError(f"MOESPEC_BUDGET={value!r}: expected B or B:substitution|truncation ({exc})") from None


def router_spec(router) -> Optional[RouterSpec]:
    """The RouterSpec of a vLLM router (softmax top-k, or DeepSeek's sigmoid grouped top-k); None for
    routing moespec does not implement."""
    if getattr(router, "custom_routing_function", None) is not None:
        return None
    scoring = getattr(router, "scoring_func", "softmax")
    top_k, renormalize = int(router.top_k), bool(getattr(router, "renormalize", True))
    if scoring == "softmax" and not getattr(router, "use_grouped_topk", False):
        return RouterSpec("softmax", top_k, renormalize)
    if scoring == "sigmoid":
        return RouterSpec("deepseek_v3", top_k, renormalize, n_group=int(router.num_expert_group or 1),
                          topk_group=int(router.topk_group or 1),
                          scaling=float(getattr(router, "routed_scaling_factor", 1.0)))
    return None


def budgeted_routing(router, router_logits: torch.Tensor, budget: ExpertBudget, ids_dtype) -> Optional[tuple]:
    """(weights float32 [T, K], ids [T, K]) of ``router_logits`` under ``budget``, or None where the
    router's family is not moespec's."""
    spec = router_spec(router)
    if spec is None or budget.max_experts < spec.top_k:
        return None
    bias = getattr(router, "e_score_correction_bias", None)
    r = route_experts(router_logits.float(), spec, budget, bias.float() if bias is not None else None)
    ids, weights = r.ids.long(), r.weights
    dropped = ids >= router_logits.shape[-1]
    if bool(dropped.any()):  # keep the slot on an expert the pass reads, at weight 0
        ids = torch.where(dropped, r.active_padded[0].long(), ids)
        weights = torch.where(dropped, torch.zeros_like(weights), weights)
    STATS.append(r.stats)
    return weights, ids.to(ids_dtype or torch.int32)


def _wrap_routers(budget: ExpertBudget) -> None:
    """Wraps BaseRouter._select_experts, the template every vLLM FusedMoE router runs: on a verify pass
    the pass's logits are re-routed under the budget and go through the router's own EPLB mapping and
    index dtype (the natural ids were computed, captured and, with EPLB, recorded first)."""
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

    original = BaseRouter._select_experts
    if getattr(original, "_moespec", False):
        return

    def _select_experts(self, hidden_states, router_logits, topk_indices_dtype=None, **kwargs):
        weights, ids = original(self, hidden_states, router_logits, topk_indices_dtype, **kwargs)
        if not _STATE["verify"]:
            return weights, ids
        out = budgeted_routing(self, router_logits, budget, ids.dtype)
        if out is None:
            return weights, ids
        budgeted = self._convert_indices_dtype(self._apply_eplb_mapping(out[1]), topk_indices_dtype)
        return out[0].to(weights.dtype), budgeted

    _select_experts._moespec = True
    BaseRouter._select_experts = _select_experts


def is_verify_pass(scheduler_output) -> bool:
    """Every scheduled request brings draft tokens and nothing else (1 + drafts tokens each)."""
    drafts = scheduler_output.scheduled_spec_decode_tokens
    scheduled = scheduler_output.num_scheduled_tokens
    return bool(scheduled) and all(r in drafts and n == 1 + len(drafts[r]) for r, n in scheduled.items())


def install(budget: Optional[ExpertBudget]) -> None:
    """Installs both hooks for ``budget`` (None: nothing to do). Idempotent."""
    if budget is None:
        return
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    _wrap_routers(budget)
    original = GPUModelRunner.execute_model
    if getattr(original, "_moespec", False):
        return
    every = int(os.environ.get("MOESPEC_BUDGET_LOG", "0") or 0)

    def execute_model(self, scheduler_output, *args, **kwargs):
        _STATE["verify"] = is_verify_pass(scheduler_output)
        try:
            return original(self, scheduler_output, *args, **kwargs)
        finally:
            if _STATE["verify"]:
                _STATE["passes"] += 1
                if every and _STATE["passes"] % every == 0 and STATS:
                    recent = STATS[-every:]
                    logger.info("moespec budget %s: %d verify passes, kept %.1f of %.1f natural experts a layer",
                                budget, _STATE["passes"], sum(s.kept for s in recent) / len(recent),
                                sum(s.natural_unique for s in recent) / len(recent))
            _STATE["verify"] = False

    execute_model._moespec = True
    GPUModelRunner.execute_model = execute_model
