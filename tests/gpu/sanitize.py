"""The newest CUDA kernels under compute-sanitizer, for tests/gpu/run.sh: a few small cases of the GPU
tests that reach each kernel moespec wrote (the decoder ops, the linear kernel, the fused routing,
the MoE kernel's fused pair and its four launches, the draft tree's level and finalize kernels, the
cost-aware selection and its trees) run under one sanitizer tool, whose report names
any out-of-bounds or misaligned access (memcheck) or shared-memory hazard (racecheck) with the kernel
and the line. Hypothesis tests are left out (their deadlines do not hold at the sanitizer's speed).

    python3 tests/gpu/sanitize.py memcheck|racecheck [--limit SECONDS]   (in all; default 60)

Exit status: 0 when the tool ran and found nothing (or cannot run on this machine: it says so, as on
a gVisor machine, "Device not supported"), 1 when it reported errors or a test failed.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
CASES = {  # test file -> -k expression: a few small cases reaching every kernel of the file, bf16 (dtype1)
    "tests/gpu/test_moe_experts_cuda.py": "fused-1-256 or fused-7-512 or fused-40-128 or fused-129 or fused-96-4 or "
                                          "four-7-512 or (gpt_oss and fused-dtype1)",
    "tests/gpu/test_decoder_ops_cuda.py": "dtype1 and (True-False-7-2048 or None-per_head-32-4-128 or 0-False-num2 or "
                                          "128-True-num3 or with_spans)",
    "tests/gpu/test_linear_cuda.py": "2048-5120 or 64-8200 or 2048-128 or test_rows_do_not_depend",
    "tests/gpu/test_route_experts_cuda.py": "test_both_launch_paths_at_verify_sizes",
    "tests/gpu/test_draft_tree_cuda.py": "[1-fused] or [2-fused] or [10-fused] or (bad_value and fused)",
    "tests/gpu/test_select_cost_aware_cuda.py": "request_by_request[1] or request_by_request[2] or "
                                                "tree_from_selection[3] or buffer-in-global-memory",
}
UNAVAILABLE = ("Device not supported", "Target application terminated before first instrumented API call")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tool", choices=["memcheck", "racecheck"])
    parser.add_argument("--limit", type=float, default=60, help="seconds in all, shared by the test files")
    args = parser.parse_args(argv)
    sanitizer = shutil.which("compute-sanitizer")
    if sanitizer is None:
        print("compute-sanitizer is not on the PATH: nothing checked")
        return 0
    failed, clock = [], time.monotonic()
    for left, (path, expression) in zip(range(len(CASES), 0, -1), CASES.items()):
        limit = (args.limit - (time.monotonic() - clock)) / left
        command = [sanitizer, "--tool", args.tool, "--error-exitcode", "3", "--print-limit", "20",
                   sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", path, "-k", expression]
        print("$", " ".join(command[:3]), "...", path, "-k", repr(expression), flush=True)
        process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   start_new_session=True)  # (its own group: a stop takes the test process too)
        try:
            text, _ = process.communicate(timeout=max(limit, 1.0))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            print(f"{path}: stopped after {limit:.0f} s (not a finding: the sanitizer is slow)")
            continue
        print(text[-6000:])
        if any(line in text for line in UNAVAILABLE):
            print(f"compute-sanitizer cannot run on this machine ({args.tool}): nothing checked")
            return 0
        if process.returncode != 0:
            failed.append(f"{path} (exit {process.returncode}{': sanitizer errors' if process.returncode == 3 else ''})")
    print(f"{args.tool}: " + ("clean" if not failed else "FAILED: " + ", ".join(failed)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
