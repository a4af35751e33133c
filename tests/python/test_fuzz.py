"""The fuzz tool (moespec.tools.fuzz) in a short run, so that it keeps working: random valid inputs
of route_experts, moe_experts and the cost-aware selection equal their references (boundary sizes
included: T = 0 from numpy's zero-stride empty arrays, k = N, B = k, all slots dropped, transposed
logits), and random invalid ones raise ValueError."""

import pytest

from moespec.tools.fuzz import run

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_short_fuzz_run_finds_nothing():
    report = run(600, seed=3, progress=False)
    assert sum(report["counts"].values()) == 600 and report["mismatches"] == 0
    assert all(n > 0 for n in report["counts"].values())
