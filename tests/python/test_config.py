"""The policy registry (python/moespec/config.py): the one parser of policy names."""

from __future__ import annotations

import pytest

from moespec.config import POLICIES, POLICY_FORMS, default_policy, parse_policy_text, policy_spec
from moespec.ops import ExpertBudget
from moespec.spec.llm import SpeculativeConfig


def test_policies_are_compositions():
    assert {n: (p.drafter, p.selector, p.verify) for n, p in POLICIES.items()} == {
        "ar": ("none", "none", "exact"), "eagle3": ("eagle3", "eagle2", "exact"),
        "eagle3+budget": ("eagle3", "eagle2", "budget"), "eco": ("eagle3", "cost_aware", "exact"),
        "eco+budget": ("eagle3", "cost_aware", "budget")}
    assert SpeculativeConfig("eagle3+budget", budget=12).spec.budgeted
    assert not SpeculativeConfig("ar").spec.speculative


@pytest.mark.parametrize("text, name, budget", [
    ("ar", "ar", None), (" eagle3 ", "eagle3", None), ("eagle3+budget", "eagle3+budget", None),
    ("eagle3+budget:16", "eagle3+budget", ExpertBudget(16)),
    ("eagle3+budget:12:truncation", "eagle3+budget", ExpertBudget(12, "truncation")),
    ("eagle3+budget:48:coverage=0.8", "eagle3+budget", ExpertBudget(48, coverage=0.8)),
    ("eagle3+budget:16:truncation:coverage=0.5", "eagle3+budget", ExpertBudget(16, "truncation", 0.5)),
    ("eagle3+budget:12:gates", "eagle3+budget", ExpertBudget(12, score="gates")),
    ("eco+budget:10:truncation:gates", "eco+budget", ExpertBudget(10, "truncation", score="gates")),
    ("eagle3+budget:48:gates:coverage=0.8:exact=1", "eagle3+budget",
     ExpertBudget(48, coverage=0.8, score="gates", exact_layers=1)),
    ("eco", "eco", None), ("eco+budget:16", "eco+budget", ExpertBudget(16)),
])
def test_parse(text, name, budget):
    spec, cap = parse_policy_text(text)
    assert spec.name == name and cap == budget


@pytest.mark.parametrize("text, match", [
    ("ecospec", "unknown policy 'ecospec'"), ("eagle3:16", "unknown policy 'eagle3:16'"), ("ar:3", "unknown policy"),
    ("eagle3+budget:x", "policy 'eagle3\\+budget:x'"), ("eagle3+budget:16:greedy", "policy 'eagle3\\+budget:16:greedy'"),
    ("eagle3+budget:16:cov=0.5", "unknown option 'cov=0.5'"), ("eagle3+budget:16:coverage=2", "ExpertBudget.coverage"),
])
def test_bad_policies(text, match):
    with pytest.raises(ValueError, match=match):
        parse_policy_text(text)


def test_defaults_and_messages():
    assert default_policy(has_draft=False) == "ar" and default_policy(has_draft=True) == "eagle3"
    assert default_policy(has_draft=True, budget=16) == "eagle3+budget"
    assert POLICY_FORMS == ("ar, eagle3, eco, eagle3+budget (with --budget) or eagle3+budget:<max experts>"
                            "[:truncation][:gates][:coverage=<0..1>][:exact=<layers>], eco+budget (with --budget) or "
                            "eco+budget:<max experts>[:truncation][:gates][:coverage=<0..1>][:exact=<layers>]")
    with pytest.raises(ValueError, match="expected one of 'ar', 'eagle3', 'eagle3\\+budget', 'eco'"):
        policy_spec("ecospec")


def test_report_schemas_name_every_registered_policy():
    import json
    from pathlib import Path

    from moespec.config import POLICY_NAMES

    schemas = Path(__file__).resolve().parents[2] / "python" / "moespec" / "bench" / "schemas"
    for name in ("report.schema.json", "compare.schema.json"):
        text = (schemas / name).read_text()
        enums = [json.loads(part.split("]")[0] + "]") for part in text.split('"policy": {"enum": ')[1:]]
        decoding = [e for e in enums if "ar" in e]  # (the budget's own "policy" enum is another field)
        assert decoding and all(tuple(e) == POLICY_NAMES for e in decoding), name


def test_vllm_budget_variable_is_a_policy_strings_budget():
    from moespec.integrations.vllm.budget import budget_from_env

    assert budget_from_env("16") == ExpertBudget(16)
    assert budget_from_env("12:truncation:gates") == ExpertBudget(12, "truncation", score="gates")
    assert budget_from_env("48:gates:coverage=0.9") == ExpertBudget(48, coverage=0.9, score="gates")
    assert budget_from_env(" ") is None
    with pytest.raises(ValueError, match="MOESPEC_BUDGET='12:fast'.*unknown option 'fast'"):
        budget_from_env("12:fast")
    with pytest.raises(ValueError, match="MOESPEC_BUDGET='12:exact=1': exact=<layers> is not supported in vLLM"):
        budget_from_env("12:exact=1")
