"""The GPU check's timing scripts (tests/gpu/bench_{runtime,moe_experts,linear,select_cost_aware}_cuda.py) run end to end
on the CPU with tiny shapes (MOESPEC_GPU_SMOKE=1, tests/gpu/gpu_common.py), and on the CPU playing a
CUDA device (MOESPEC_GPU_SMOKE=virtual): a script's Python error shows here, not in a GPU session's few
minutes of device time (where run.sh would also rerun it on its
fallback path). Each writes its JSON with every section the GPU run writes, which tests/gpu/tables.py
and tests/gpu/plot_results.py read. The numbers mean nothing on the CPU."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT / "tests" / "gpu") not in sys.path:  # (gpu_common's union_length, sanitize's cases)
    sys.path.insert(0, str(ROOT / "tests" / "gpu"))
SCRIPTS = {  # script -> its JSON and the keys the GPU run's JSON has
    "bench_runtime_cuda.py": ("runtime_bench.json", {"device", "copy_GBps", "rows", "route_us", "route_in_step_us",
                                                     "layer_ms", "eagle3_step_ms", "eagle3_step_kernels", "kernels",
                                                     "draft_round_ms"}),
    "bench_moe_experts_cuda.py": ("moe_experts_bench.json", {"device", "copy_GBps", "rows", "timelines"}),
    "bench_linear_cuda.py": ("linear_bench.json", {"device", "copy_GBps", "rows"}),
    "bench_select_cost_aware_cuda.py": ("select_bench.json", {"device", "rows"}),
}


@pytest.fixture(scope="module", params=["1", "virtual"], ids=["cpu", "virtual-cuda"])
def smoke(request, tmp_path_factory):
    """Each timing script's run, with tiny shapes, on the CPU (MOESPEC_GPU_SMOKE=1) and on the CPU
    playing a CUDA device (=virtual, tests/python/virtual_cuda.py: the scripts' CUDA branches, their
    graphs and events, with a GPU's device rules)."""
    out = tmp_path_factory.mktemp("gpu_smoke")
    env = {**os.environ, "MOESPEC_GPU_SMOKE": request.param, "OUT": str(out), "PYTHONPATH": str(ROOT / "python")}
    runs = {script: subprocess.run([sys.executable, str(ROOT / "tests" / "gpu" / script)], cwd=ROOT, env=env,
                                   capture_output=True, text=True, timeout=600) for script in SCRIPTS}
    return out, runs


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_a_timing_script_runs_and_writes_its_json(smoke, script):
    out, runs = smoke
    run = runs[script]
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    name, keys = SCRIPTS[script]
    got = json.loads((out / name).read_text())
    assert keys <= set(got) and got["rows"], sorted(got)
    lines = list(got.get("timelines", {}).values())  # the profiled calls' timelines
    if script == "bench_runtime_cuda.py":
        lines += list(got["kernels"].values()) + list(got["eagle3_step_kernels"].values())
    for k in lines:
        assert 0 < k["busy_us"] <= k["span_us"] + 1e-6 and k["idle_us"] == pytest.approx(k["span_us"] - k["busy_us"])
        assert k["sequence"] and all(len(row) == 3 and row[2] > 0 for row in k["sequence"])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 60), st.integers(1, 20)), min_size=1, max_size=12))
def test_the_timelines_busy_time_is_the_union_of_the_kernels(pairs):
    """gpu_common.union_length against counting the unit cells the intervals cover."""
    from gpu_common import union_length

    intervals = [(float(s), float(s + n)) for s, n in pairs]
    covered = {cell for s, n in pairs for cell in range(s, s + n)}
    assert union_length(intervals) == len(covered)


def _fallback_env() -> dict:
    """tests/gpu/run.sh's FALLBACK settings (the environment a failed timing script is rerun with)."""
    text = (ROOT / "tests" / "gpu" / "run.sh").read_text()
    words = text.split("FALLBACK=(", 1)[1].split(")", 1)[0].split()
    return dict(word.split("=", 1) for word in words)


def test_run_shs_later_tests_are_gpu_test_files_off_the_targets_path():
    """run.sh's LATER_TESTS (GPU test files run after the targets' timings, the others before them):
    files that exist, none of the kernels a target's timing runs (a renamed file would fail its step;
    one on the targets' path would let the targets be timed before its kernels were checked)."""
    text = (ROOT / "tests" / "gpu" / "run.sh").read_text()
    later = text.split("\nLATER_TESTS=(", 1)[1].split(")", 1)[0].split()
    assert later and all((ROOT / f).is_file() and f.startswith("tests/gpu/test_") for f in later), later
    targets_path = {"route_experts", "moe_experts", "decoder_ops", "linear", "runtime"}
    assert not [f for f in later if any(f"test_{name}_cuda.py" in f for name in targets_path)], later


def test_run_shs_only_selects_steps_by_their_names_and_refuses_a_bad_pattern(tmp_path):
    """run.sh's ONLY (a second device call's few steps): its `selected` takes the step names a pattern
    matches, every step without ONLY; a pattern bash cannot compile stops the script before it
    configures anything (it would select nothing, and the call would come back empty)."""
    run_sh = ROOT / "tests" / "gpu" / "run.sh"
    function = run_sh.read_text().split("\nselected() {", 1)[1].split("\n}\n", 1)[0]
    probe = ("selected() {" + function + "\n}\n"
             "for name in 'timing: moe_experts' 'timing: runtime steps' 'timing: linear' "
             "'GPU tests (tests/gpu/test_linear_cuda.py)' 'C++ tests (ctest)'; do\n"
             "  if selected \"$name\"; then echo \"$name\"; fi\ndone")
    picked = {only: subprocess.run(["bash", "-c", probe], env={**os.environ, "ONLY": only}, capture_output=True,
                                   text=True, check=True).stdout.splitlines()
              for only in ("timing: (moe_experts|runtime)", "test_linear", "")}
    assert picked["timing: (moe_experts|runtime)"] == ["timing: moe_experts", "timing: runtime steps"]
    assert picked["test_linear"] == ["GPU tests (tests/gpu/test_linear_cuda.py)"]
    assert len(picked[""]) == 5
    env = {**os.environ, "ONLY": "timing: (moe", "OUT": str(tmp_path)}
    done = subprocess.run(["bash", str(run_sh)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "ONLY is not a valid regular expression" in done.stderr, done.stdout + done.stderr
    assert not (tmp_path / "configure.log").exists()


@pytest.mark.parametrize("script", ["bench_runtime_cuda.py", "bench_moe_experts_cuda.py"])
def test_a_timing_script_runs_on_run_shs_fallback_path(script, tmp_path):
    """The rerun tests/gpu/run.sh makes of a timing script that failed on the defaults, with every newer
    piece switched off (its FALLBACK settings), runs too (until 2026-12-06 the runtime bench's
    fused-forward assertion stopped it at its first row)."""
    fallback = _fallback_env()
    assert fallback.get("MOESPEC_FUSED_STEP") == "0" and len(fallback) >= 5, fallback
    env = {**os.environ, **fallback, "MOESPEC_GPU_SMOKE": "virtual", "OUT": str(tmp_path),
           "PYTHONPATH": str(ROOT / "python")}
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "gpu" / script)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert json.loads((tmp_path / SCRIPTS[script][0]).read_text())["rows"]


def test_the_tables_and_plots_read_the_smoke_runs_json(smoke, tmp_path):
    out, _ = smoke
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "gpu" / "tables.py"), str(out)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.count("- target") == 5, done.stdout + done.stderr
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "gpu" / "plot_results.py"), str(out), "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert {p.name for p in tmp_path.glob("*.png")} >= {"gpu_steps.png", "gpu_moe_kernel.png", "gpu_linear.png"}


def _collected(*args: str) -> list[str]:
    """The GPU tests' ids, collected on the virtual CUDA device (tests/python/virtual_cuda.py), so that the
    modules import and parametrize as on a GPU."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "python"), str(ROOT / "tests" / "python")])}
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "virtual_cuda", "-p",
                           "no:cacheprovider", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    return [line for line in done.stdout.splitlines() if "::" in line]


def test_the_gpu_tests_collect_and_the_sanitizers_cases_select_some():
    """Every tests/gpu/test_*.py imports and parametrizes (a module-level mistake shows here, not on a
    GPU), and each -k expression of tests/gpu/sanitize.py selects tests of its file (a renamed test
    would leave the sanitizer checking nothing: pytest's exit 5, a failed step on the GPU)."""
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests" / "gpu").glob("test_*.py"))
    ids = _collected(*files)
    assert {i.split("::")[0] for i in ids} == set(files)
    from sanitize import CASES

    for path, expression in CASES.items():
        assert _collected(path, "-k", expression), f"{path}: -k {expression!r} selects no test"


def test_the_hardware_profile_script_runs_on_virtual_cuda(tmp_path):
    """tests/gpu/measure_profile.py (run.sh's "hardware profile") with tiny shapes on the virtual CUDA
    device: a profile moespec.cost.hardware reads back, written to $OUT only (not over the committed
    tests/gpu/profiles/)."""
    from moespec.cost.hardware import load_profile

    before = sorted(p.name for p in (ROOT / "tests" / "gpu" / "profiles").iterdir())
    env = {**os.environ, "MOESPEC_GPU_SMOKE": "virtual", "OUT": str(tmp_path), "PYTHONPATH": str(ROOT / "python")}
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "gpu" / "measure_profile.py")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    hw = load_profile(tmp_path / "profiles" / "gpu.json")
    assert hw.bandwidth_gbs > 0 and set(hw.expert_gbs) == {1, 2, 4, 8, 16}
    assert sorted(p.name for p in (ROOT / "tests" / "gpu" / "profiles").iterdir()) == before
