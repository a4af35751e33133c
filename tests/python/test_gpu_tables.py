"""tests/gpu/tables.py (the GPU check's README tables and target verdicts) on the 2026-12-04 H200
results kept in tests/gpu/results/: the verdicts the README states for that run (MoE kernel 37-68%
of copy with 8-16 experts, 1.49x torch at Mixtral T = 16, R^2 >= 0.9994; routing 6.1% of a layer;
verify 9.65x the roofline at T = 1), and a folder without results."""

from __future__ import annotations

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS = ROOT / "tests" / "gpu" / "results" / "h200-2026-12-04"


def _tables():
    spec = importlib.util.spec_from_file_location("gpu_tables", ROOT / "tests" / "gpu" / "tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_verdicts_of_the_first_h200_run(capsys):
    tables = _tables()
    assert tables.main([str(RESULTS)]) == 0
    out = capsys.readouterr().out
    assert "- target >= 70% of copy at T <= 16: missed at 14 of 24 points (lowest 37%: qwen3-30b-a3b T = 16, " \
           "8 experts)" in out
    assert "- target >= 1.5x the best torch path: missed (lowest 1.49x: mixtral-8x7b T = 16, 8 experts)" in out
    assert "- target R^2 >= 0.98 (time linear in active experts): met (lowest 0.9994)" in out
    assert "- target routing + budget < 3% of a verify layer: missed (the op alone in a graph 23.2 us of a 378 us " \
           "layer = 6.1%)" in out
    assert "- target verify within 15% of the roofline at T <= 16: missed (worst 9.65x at T = 1, budget off)" in out
    assert "| qwen3-30b-a3b | 16 | 8 | 49.7 | 1520 | 37% | 139.3 | 2.81x |  |  |" in out  # (the README's row)
    assert out.count("\n| 64 |") == 4 and "draft round (top-k 8, depth 6, 32 nodes): B=1 torch 3.405 ms" in out


def test_a_folder_without_results(tmp_path, capsys):
    assert _tables().main([str(tmp_path)]) == 2
    assert "no moe_experts_bench.json" in capsys.readouterr().err


def test_the_routing_verdict_takes_the_share_inside_the_step(tmp_path, capsys):
    import json

    bench = json.loads((RESULTS / "runtime_bench.json").read_text()) | {"route_in_step_us": 9.0}
    (tmp_path / "runtime_bench.json").write_text(json.dumps(bench))
    assert _tables().main([str(tmp_path)]) == 0
    assert "- target routing + budget < 3% of a verify layer: met (inside the captured step 9.0 us a layer = 2.4%; " \
           "the op alone in a graph 23.2 us" in capsys.readouterr().out
