#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU: build moespec with its CUDA kernels, run the C++
# tests, the GPU tests (CUDA against the CPU reference, tests/gpu/test_*.py), the timing tables
# of route_experts, moe_experts, linear and the runtime's steps (tests/gpu/bench_*_cuda.py), the GPU's
# hardware profile for `moespec analyze` (tests/gpu/measure_profile.py -> tests/gpu/profiles/<name>.json;
# commit it), MLA's two forms (python -m moespec.bench.mla --device cuda -> mla.json) and compute-sanitizer
# over small cases of the newest kernels (tests/gpu/sanitize.py; first, when a GPU test failed).
# DESIGN.md "What can run where".
#
#   tests/gpu/run.sh
#
# Needs: nvcc, and a python3 with torch (CUDA build), pybind11, cmake, ninja, pytest, hypothesis,
# numpy; installs nothing (such machines may have no network). Builds into build-gpu/ (the module
# lands in python/moespec, -DMOESPEC_INPLACE=ON). Environment: CUDA_ARCHS (default 90a, for the
# H100/H200), JOBS (default: all cores), TensorRT_ROOT (a folder with include/NvInfer.h: the
# TensorRT plugins are built too, and ctest runs their enqueue on the GPU, test_plugins_enqueue;
# the device machine has no TensorRT, so a device call copies the public headers into an ignored
# folder of the checkout, carries it and points TensorRT_ROOT there). Logs, summary.json (each
# step passed or failed) and the timings' JSON go to $OUT when set, else to build-gpu/logs. ONLY (a bash
# regex over the step names, as summary.json and the log print them) runs those steps alone after the
# build, for a second device call: e.g. ONLY='timing: (moe_experts|runtime)' or ONLY='test_linear'.
#
# The device call (one prepared command; up to the deadline, 565 s, on an H200):
#   mkdir -p .trt-headers && cp -r ../shared/third_party/tensorrt/include .trt-headers/   # (ignored by git)
#   run: TensorRT_ROOT=$PWD/.trt-headers tests/gpu/run.sh      carry: [".trt-headers"]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

BUILD=build-gpu
LOGS=${OUT:-$BUILD/logs}
mkdir -p "$LOGS"
PY=$(command -v python3)
log() { printf '\033[1m[tests/gpu/run.sh]\033[0m %s\n' "$*"; }
status=0  # a failing test step still lets the later steps run; the script then exits non-zero

if [[ -n "${ONLY:-}" ]]; then  # (checked before the build: a bad pattern would select nothing)
  only_rc=0
  [[ "" =~ $ONLY ]] || only_rc=$?
  if (( only_rc == 2 )); then echo "tests/gpu/run.sh: ONLY is not a valid regular expression: '$ONLY'" >&2; exit 2; fi
  log "ONLY='$ONLY': the build, then only the steps whose names it matches"
fi

trt=()
if [[ -n "${TensorRT_ROOT:-}" ]]; then
  trt=(-DMOESPEC_TENSORRT=ON -DTensorRT_ROOT="$TensorRT_ROOT")
fi
log "configure ($BUILD, CUDA architectures ${CUDA_ARCHS:-90a}${trt:+, TensorRT plugins}) -> $LOGS/configure.log"
cmake -S . -B "$BUILD" -G Ninja -DPython_EXECUTABLE="$PY" -DMOESPEC_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHS:-90a}" -DMOESPEC_INPLACE=ON -DCMAKE_BUILD_TYPE=Release -DMOESPEC_WERROR=OFF -DMOESPEC_EMULATED=OFF \
  "${trt[@]}" \
  2>&1 | tee "$LOGS/configure.log"

log "build -> $LOGS/build.log"
cmake --build "$BUILD" -j "${JOBS:-$(nproc)}" 2>&1 | tee "$LOGS/build.log"

results=()  # "name": "passed" | "failed" | "skipped", written to $LOGS/summary.json after every step
DEADLINE=${DEADLINE:-565}  # seconds since the start: later steps are skipped (the device call stops at 600)
ok=0  # whether the last step passed
last_rc=0  # its exit status
optional=0  # 1: a step skipped for time does not fail the run (the last, optional checks)
skip() {  # skip <name>: recorded as skipped for time (a failure unless the step is optional)
  log "$1: skipped ($SECONDS s of the ${DEADLINE} s are gone)"; results+=("\"$1\": \"skipped\""); ok=0
  (( optional )) || status=1
  (IFS=,; printf '{%s}\n' "${results[*]}") >"$LOGS/summary.json"
}
selected() {  # selected <name>: whether ONLY (a bash regex over step names; unset: every step) takes it
  [[ -z "${ONLY:-}" || "$1" =~ $ONLY ]]
}
step() {  # step <name> <log file> <seconds> <command...>: runs it (stopped after <seconds>: one hung
  # step must not eat the device call), logs it, records its result
  local name=$1 file=$2 limit=$3 started=$SECONDS
  shift 3
  if ! selected "$name"; then
    ok=1; last_rc=0; return  # (not asked for: neither run nor recorded)
  fi
  if (( SECONDS + 10 > DEADLINE )); then
    skip "$name"
  else
    (( limit > DEADLINE - SECONDS )) && limit=$((DEADLINE - SECONDS))
    log "$name -> $LOGS/$file (at most ${limit} s)"
    if timeout -k 5 "$limit" "$@" 2>&1 | tee -a "$LOGS/$file"; then results+=("\"$name\": \"passed\""); ok=1; last_rc=0
    else
      last_rc=${PIPESTATUS[0]}  # (124 or 137: stopped by its limit)
      results+=("\"$name\": \"failed\""); status=1; ok=0
    fi
    log "$name: $((SECONDS - started)) s"
  fi
  (IFS=,; printf '{%s}\n' "${results[*]}") >"$LOGS/summary.json"
}
# The paths measured on 2026-12-04, each newer piece switched off (README "On CUDA"): a timing that
# fails on the defaults runs once more this way, so that one broken kernel still leaves the tables.
FALLBACK=(MOESPEC_PDL=0 MOESPEC_MOE_FUSED=0 MOESPEC_FUSED_STEP=0 MOESPEC_ROUTE_FUSED=0 MOESPEC_CUDA_LINEAR=0
          MOESPEC_TREE_FUSED=0)
timing() {  # timing <name> <log file> <seconds> <script> [<its JSON in $LOGS>]
  step "timing: $1" "$2" "$3" env PYTHONPATH=python "$PY" "$4"
  if (( ok == 0 && last_rc != 124 && last_rc != 137 )); then  # (a failure, not its time limit: the JSON so far stays)
    if [[ -n "${5:-}" && -f "$LOGS/$5" ]]; then  # what the defaults wrote before failing stays, beside
      mv "$LOGS/$5" "$LOGS/${5%.json}.defaults-partial.json"
    fi
    step "timing: $1 (fallback: ${FALLBACK[*]})" "$2" "$3" env "${FALLBACK[@]}" PYTHONPATH=python "$PY" "$4"
  fi
}

step "C++ tests (ctest)" ctest.log 120 bash -c "cd '$BUILD' && ctest --output-on-failure"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee "$LOGS/pytest.log" || true
tests_failed=0
gpu_tests() {  # gpu_tests <file>...: one process a file (a crash in one does not hide the others' results)
  local file
  for file in "$@"; do
    step "GPU tests ($file)" pytest.log 120 env PYTHONPATH=python "$PY" -m pytest -q -p no:cacheprovider --durations=5 "$file"
    (( ok == 1 )) || tests_failed=1
  done
}
# the files of the kernels on the targets' path first (routing, MoE, decoder ops, linear, the runtime's
# steps), then the targets' timings, then the rest (the draft tree's and the cost-aware selection's
# kernels, which no target's timing runs), so that the targets' numbers come back within the deadline
LATER_TESTS=(tests/gpu/test_draft_tree_cuda.py tests/gpu/test_select_cost_aware_cuda.py)
first_tests=()
for file in tests/gpu/test_*.py; do
  [[ " ${LATER_TESTS[*]} " == *" $file "* ]] || first_tests+=("$file")
done
gpu_tests "${first_tests[@]}"
# compute-sanitizer over small cases of the newest kernels (tests/gpu/sanitize.py): right away when a
# GPU test failed (its report names the kernel and the line of a bad access), else last, if time is left
sanitize() {  # sanitize <tool> <seconds>
  selected "compute-sanitizer $1" || return 0
  local limit=$(( $2 < DEADLINE - SECONDS - 15 ? $2 : DEADLINE - SECONDS - 15 ))
  if (( limit < 20 )); then skip "compute-sanitizer $1"; return; fi  # (too little to start a test under it)
  step "compute-sanitizer $1" sanitizer.log $((limit + 10)) env PYTHONPATH=python "$PY" tests/gpu/sanitize.py "$1" --limit "$limit"
}
sanitized=0
if (( tests_failed )); then
  sanitize memcheck 90
  sanitized=1
fi
# the targets' timings first (the MoE kernel's, the runtime's steps), then the others
timing "moe_experts" bench_moe.log 110 tests/gpu/bench_moe_experts_cuda.py moe_experts_bench.json
timing "runtime steps" bench_runtime.log 170 tests/gpu/bench_runtime_cuda.py runtime_bench.json
gpu_tests "${LATER_TESTS[@]}"
timing "linear" bench_linear.log 45 tests/gpu/bench_linear_cuda.py linear_bench.json
timing "route_experts" bench.log 45 tests/gpu/bench_route_experts_cuda.py
step "hardware profile" profile.log 45 "$PY" tests/gpu/measure_profile.py
timing "select_cost_aware" bench_select.log 40 tests/gpu/bench_select_cost_aware_cuda.py select_bench.json
# MLA's two forms on a DeepSeek-V3 attention layer (README "Target models": the absorbed form); last,
# as the least needed of the tables
step "timing: MLA forms" bench_mla.log 40 env PYTHONPATH=python "$PY" -m moespec.bench.mla --device cuda \
  --contexts 1024 4096 16384 --tokens 1 16 --repeats 3 --out "$LOGS"

optional=1  # (skipped for time: not a failure)
if (( ! sanitized )); then
  sanitize memcheck 70
  sanitize racecheck 70
fi

if [[ $status == 0 ]]; then log "all passed; logs in $LOGS"; else log "FAILED (see above); logs in $LOGS"; fi
exit $status
