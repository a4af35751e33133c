"""The cost-aware drafts-per-batch-size schedule (moespec.cost.schedule; vLLM's
num_speculative_tokens_per_batch_size): its ranges are a schedule vLLM accepts, each priced batch
gets the K that maximises the predicted speed-up, and the limits are checked."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from moespec.cost.hardware import hardware
from moespec.cost.relations import Group
from moespec.cost.schedule import batch_grid, draft_schedule, per_level_acceptance
from moespec.cost.shapes import shape
from moespec.cost.speedup import transfer
from moespec.cost.step_cost import draft_seconds, step_cost

SHAPE = shape("olmoe-1b-7b")
HW = hardware("h200")
ROUTING = transfer(SHAPE.num_experts, SHAPE.top_k)


def _vllm_accepts(ranges, max_batch):
    """vLLM 0.32's rules (spec_decode/dynamic/utils.py), restated: sorted, non-overlapping inclusive
    ranges from batch 1, K >= 0; here also contiguous up to max_batch."""
    assert ranges[0][0] == 1 and ranges[-1][1] == max_batch
    for (a0, a1, ka), (b0, _, kb) in zip(ranges, ranges[1:]):
        assert a0 <= a1 and b0 == a1 + 1 and ka != kb
    assert all(k >= 0 for _, _, k in ranges)


@pytest.mark.parametrize("acceptance,budget", [(1.9, None), (2.6, None), (2.2, 16)])
def test_schedule_takes_the_fastest_k_at_every_priced_batch(acceptance, budget):
    s = draft_schedule(SHAPE, HW, ROUTING, acceptance=acceptance, depth=2, max_batch=48, max_drafts=5,
                       context=512, budget=budget)
    _vllm_accepts(s["num_speculative_tokens_per_batch_size"], 48)
    a = per_level_acceptance(acceptance, 2)
    for row in s["rows"]:
        B = row["batch"]
        # the speed-up of each K restated from the cost model's parts
        t_ar = step_cost(SHAPE, HW, tokens=B, requests=B, context=512,
                         unique=ROUTING.predict([Group.chain(1)] * B, "ipf")).seconds
        for p in row["prices"][1:]:
            k = p["drafts"]
            assert p["acceptance"] == pytest.approx(sum(a**d for d in range(k + 1)))
            assert budget is None or p["unique"] <= budget
            assert p["step_ms"] / 1e3 > draft_seconds(SHAPE, HW, depth=k, top_k=1, requests=B)
            assert p["speedup"] == pytest.approx(p["acceptance"] * t_ar / (p["step_ms"] / 1e3))
        best = max(p["speedup"] for p in row["prices"])
        assert row["speedup"] == best
        assert row["drafts"] == min(p["drafts"] for p in row["prices"] if p["speedup"] == best)
        K = next(k for first, last, k in s["num_speculative_tokens_per_batch_size"] if first <= B <= last)
        assert K == row["drafts"]
    assert s["num_speculative_tokens"] == max(1, max(r["drafts"] for r in s["rows"]))


def test_no_acceptance_means_no_drafts():
    s = draft_schedule(SHAPE, HW, ROUTING, acceptance=1.0, depth=2, max_batch=16, max_drafts=3)
    assert s["num_speculative_tokens_per_batch_size"] == [[1, 16, 0]]


def test_per_level_acceptance_inverts_the_chain_sum():
    for al, depth in [(1.0, 1), (1.5, 1), (2.05, 4), (2.9, 2)]:
        a = per_level_acceptance(al, depth)
        assert sum(a**d for d in range(depth + 1)) == pytest.approx(al, abs=1e-9)


def test_batch_grid_starts_at_one_and_ends_at_max():
    assert batch_grid(5) == [1, 2, 3, 4, 5]
    g = batch_grid(100)
    assert g[:8] == list(range(1, 9)) and g[-1] == 100 and g == sorted(set(g))


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_batch=0), "max_batch"), (dict(max_drafts=99), "max_drafts"), (dict(budget=2), "budget"),
    (dict(acceptance=3.5), "acceptance"), (dict(depth=0), "depth"), (dict(context=-1), "context"),
])
def test_bad_arguments_name_themselves(kwargs, match):
    args = dict(acceptance=2.0, depth=2) | kwargs
    with pytest.raises(ValueError, match=match):
        draft_schedule(SHAPE, HW, ROUTING, **args)


def test_cli_writes_the_schedule_and_its_plot(tmp_path):
    out = tmp_path / "schedule.json"
    run = subprocess.run([sys.executable, "-m", "moespec", "analyze", "schedule", "--shape", "mixtral-8x7b",
                          "--hardware", "h200", "--acceptance", "2.0", "--max-batch", "16", "--max-drafts", "3",
                          "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    s = json.loads(out.read_text())
    _vllm_accepts(s["num_speculative_tokens_per_batch_size"], 16)
    assert out.with_suffix(".png").stat().st_size > 1000
    assert "num_speculative_tokens_per_batch_size" in run.stdout
    bad = subprocess.run([sys.executable, "-m", "moespec", "analyze", "schedule", "--shape", "mixtral-8x7b",
                          "--acceptance", "9"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "acceptance" in bad.stderr and "Traceback" not in bad.stderr
