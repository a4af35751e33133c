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
a malformed value is an error when the plugin loads. The per-pass decision runs inside the opaque
custom op ``moespec_vllm::verify_budget``, so compiled models (vLLM's default, ``enforce_eager=False``)
keep it; with EPLB the budget runs in Python and needs ``enforce_eager=True``. Routers whose family
moespec does not implement (DeepSeek-V4's sqrtsoftplus, a custom routing function) are left alone.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch

from moespec.config import parse_budget_text
from moespec.ops import ExpertBudget, RouterSpec, RoutingStats, route_experts

logger = logging.getLogger("moespec.vllm")
STATS: list[RoutingStats] = []  # every budgeted routing call's statistics, in order
_STATE = {"verify": False, "passes": 0, "budget": None}  # the pass's mark, the count, the installed budget


def budget_from_env(value: Optional[str] = None) -> Optional[ExpertBudget]:
    """``MOESPEC_BUDGET`` ("16", "16:truncation", "12:gates", "48:gates:coverage=0.9": a policy string's
    budget part, :func:`moespec.config.parse_budget_text`) as an ExpertBudget; None when unset or empty."""
    value = os.environ.get("MOESPEC_BUDGET", "") if value is None else value
    if not value.strip():
        return None
    try:
        budget = parse_budget_text(value)
    except ValueError as exc:
        raise ValueError(f"MOESPEC_BUDGET={value!r}: expected B[:substitution|truncation][:gates][:coverage=<0..1>] "
                         f"({exc})") from None
    if budget.exact_layers:
        raise ValueError(f"MOESPEC_BUDGET={value!r}: exact=<layers> is not supported in vLLM (its routers are "
                         f"not told their layer); budget every layer or use moespec's runtime")
    return budget


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


@torch.library.custom_op("moespec_vllm::verify_budget", mutates_args=())
def verify_budget(router_logits: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, bias: Optional[torch.Tensor],
                  family: str, top_k: int, renormalize: bool, n_group: int, topk_group: int,
                  scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A router's (weights, ids), re-routed under the installed budget when this is a verify pass.

    Opaque to torch.compile, so a compiled model (vLLM's CPU graph, CUDA graphs of eager ops aside)
    decides at run time, per pass, from the model runner's mark; otherwise copies of its inputs."""
    budget = _STATE["budget"]
    if not _STATE["verify"] or budget is None:
        return weights.clone(), ids.clone()
    spec = RouterSpec(family, top_k, renormalize, n_group=n_group, topk_group=topk_group, scaling=scaling)
    w, i = _route_under(spec, router_logits, bias, budget)
    return w.to(weights.dtype), i.to(ids.dtype)


@verify_budget.register_fake
def _verify_budget_fake(router_logits, weights, ids, bias, family, top_k, renormalize, n_group, topk_group, scaling):
    return torch.empty_like(weights), torch.empty_like(ids)


def _route_under(spec: RouterSpec, router_logits: torch.Tensor, bias: Optional[torch.Tensor],
                 budget: ExpertBudget) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, K], ids int64 [T, K]) of the logits under the budget; a dropped slot keeps an
    expert the pass reads, at weight 0 (vLLM's CPU MoE kernel mis-computes id -1)."""
    r = route_experts(router_logits.float(), spec, budget, bias.float() if bias is not None else None,
                      check_finite=False)  # (no host sync per layer on a GPU, as vLLM's own routers)
    ids, weights = r.ids.long(), r.weights
    dropped = ids >= router_logits.shape[-1]
    ids = torch.where(dropped, r.active_padded[0].long(), ids)
    weights = torch.where(dropped, torch.zeros_like(weights), weights)
    STATS.append(r.stats)
    return weights, ids


def _wrap_routers(budget: ExpertBudget) -> None:
    """Wraps BaseRouter._select_experts, the template every vLLM FusedMoE router runs: the router's own
    routing runs first (its natural ids computed, captured and, with EPLB, recorded), then on a verify
    pass the logits are re-routed under the budget. Without EPLB through the opaque op
    :func:`verify_budget` (compiled graphs keep the per-pass decision); with EPLB in Python, the
    budgeted ids through the router's own EPLB mapping (eager models only)."""
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

    _STATE["budget"] = budget
    original = BaseRouter._select_experts
    if getattr(original, "_moespec", False):
        return

    def _select_experts(self, hidden_states, router_logits, topk_indices_dtype=None, **kwargs):
        weights, ids = original(self, hidden_states, router_logits, topk_indices_dtype, **kwargs)
        spec = router_spec(self)
        if spec is None or budget.max_experts < spec.top_k:
            return weights, ids
        bias = getattr(self, "e_score_correction_bias", None)
        if self.eplb_state is None:
            return torch.ops.moespec_vllm.verify_budget(router_logits, weights, ids, bias, spec.family, spec.top_k,
                                                        spec.renormalize, spec.n_group, spec.topk_group,
                                                        float(spec.scaling))
        if not _STATE["verify"]:
            return weights, ids
        w, budgeted = _route_under(spec, router_logits, bias, budget)
        budgeted = self._convert_indices_dtype(self._apply_eplb_mapping(budgeted.to(ids.dtype)), topk_indices_dtype)
        return w.to(weights.dtype), budgeted

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
