"""Decoding policies as compositions, in one registry (DESIGN.md "The next phase": one typed
decoding config, parsed once).

A policy is a drafter (``none`` or ``eagle3``) x a tree selector (``eagle2``: the best
``total_tokens`` candidates; ``cost_aware``: EcoSpec's, :mod:`moespec.spec.cost_aware`) x a verify
routing (``exact``, or ``budget``: MoE-Spec's expert budget on every verify pass). Policy names,
their parsing (``eagle3+budget:16[:truncation]``), the default policy of a command and the default
draft tree live here and nowhere else; the CLI, the engine manifest and the LLM API all produce a
:class:`moespec.spec.llm.SpeculativeConfig` through them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

Drafter = Literal["none", "eagle3"]
Selector = Literal["none", "eagle2", "cost_aware"]
VerifyRouting = Literal["exact", "budget"]


@dataclass(frozen=True)
class PolicySpec:
    name: str
    drafter: Drafter
    selector: Selector
    verify: VerifyRouting

    @property
    def speculative(self) -> bool:
        return self.drafter != "none"

    @property
    def budgeted(self) -> bool:
        return self.verify == "budget"


POLICIES: dict[str, PolicySpec] = {p.name: p for p in (
    PolicySpec("ar", "none", "none", "exact"),
    PolicySpec("eagle3", "eagle3", "eagle2", "exact"),
    PolicySpec("eagle3+budget", "eagle3", "eagle2", "budget"),
    PolicySpec("eco", "eagle3", "cost_aware", "exact"),
    PolicySpec("eco+budget", "eagle3", "cost_aware", "budget"),
)}
POLICY_NAMES = tuple(POLICIES)
POLICY_FORMS = ", ".join(n for n in POLICY_NAMES if not POLICIES[n].budgeted) + ", " + ", ".join(
    f"{n} (with --budget) or {n}:<max experts>[:truncation][:gates][:coverage=<0..1>][:exact=<layers>]" for n in POLICY_NAMES
    if POLICIES[n].budgeted)

# The draft tree of a SpeculativeConfig when none is given (EAGLE-2's expansion: depth levels,
# top_k branching, total_tokens nodes kept); engines carry their own (the default engine's:
# moespec.default_model.pipeline.TreeSettings).
DEFAULT_TREE = {"depth": 6, "top_k": 8, "total_tokens": 32}


def policy_spec(name: str) -> PolicySpec:
    """The registered policy ``name``; ValueError listing the names."""
    spec = POLICIES.get(name)
    if spec is None:
        raise ValueError(f"unknown policy {name!r}: expected one of {', '.join(map(repr, POLICY_NAMES))}")
    return spec


def default_policy(*, has_draft: bool, budget: Optional[object] = None) -> str:
    """A command's policy when none is named: the budgeted EAGLE-3 policy with a budget, EAGLE-3
    with a draft head, else plain decoding."""
    if budget is not None:
        return "eagle3+budget"
    return "eagle3" if has_draft else "ar"


def parse_policy_text(text: str):
    """``name`` or ``name:<budget>`` -> (PolicySpec, ExpertBudget or None), the budget part as
    :func:`parse_budget_text` reads it."""
    name, _, arg = text.strip().partition(":")
    spec = POLICIES.get(name)
    if spec is None or (arg and not spec.budgeted):
        raise ValueError(f"unknown policy {text!r}: expected {POLICY_FORMS}")
    if not arg:
        return spec, None
    try:
        return spec, parse_budget_text(arg)
    except ValueError as exc:
        raise ValueError(f"policy {text!r}: {exc}") from None


def parse_budget_text(text: str):
    """``<max experts>[:<budget policy>][:<score>][:coverage=<tau>][:exact=<n>]`` -> ExpertBudget (the
    budget part of a policy string, and vLLM's ``MOESPEC_BUDGET``); the score is ``probability``
    (MoE-Spec's, the default) or ``gates`` (ExpertBudget.score), ``coverage`` MoE-Spec's probability
    mode, ``exact`` ExpertBudget.exact_layers. ValueError naming the bad part."""
    from moespec.ops import ExpertBudget

    size, *options = text.strip().split(":")
    mode, coverage, score, exact = "substitution", None, "probability", 0
    for option in options:
        key, eq, value = option.partition("=")
        if eq and key == "coverage":
            coverage = float(value)
        elif eq and key == "exact":
            exact = int(value)
        elif not eq and option in ("substitution", "truncation"):
            mode = option
        elif not eq and option in ("probability", "gates"):
            score = option
        else:
            raise ValueError(f"unknown option {option!r} (expected truncation, substitution, gates, probability, "
                             f"coverage=<0..1> or exact=<layers>)")
    return ExpertBudget(int(size), mode, coverage, score, exact)
