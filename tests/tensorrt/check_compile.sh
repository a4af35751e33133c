#!/usr/bin/env bash
# Compile check of the TensorRT plugins (DESIGN.md "What can run where"): configures a fresh build
# of this repository with CUDA and TensorRT on, builds libmoespec_trt_plugins.so and its unit test,
# checks the library's exported entry points and runs the test (ctest -R plugin). Needs no GPU and
# no libnvinfer: TensorRT_ROOT may be a full SDK or a folder holding only include/ from the public
# NVIDIA/TensorRT repository (kept outside this repository, never committed).
#
# Usage: TensorRT_ROOT=/path/to/trt tests/tensorrt/check_compile.sh [TensorRT_ROOT]
#   env BUILD_DIR   build folder (default: a new temporary folder); an existing build is
#                   reconfigured from scratch (cmake --fresh), its other files are kept
#   env JOBS        parallel build jobs (default: number of CPUs)
# Uses cmake (and ninja, when present) from PATH; nvcc from PATH or CUDACXX.
set -euo pipefail

trt_root="${1:-${TensorRT_ROOT:-}}"
if [[ -z "${trt_root}" || ! -f "${trt_root}/include/NvInfer.h" ]]; then
  echo "check_compile.sh: give TensorRT_ROOT (env or first argument): a folder with include/NvInfer.h" >&2
  exit 2
fi
trt_root="$(cd "${trt_root}" && pwd)"
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
build="${BUILD_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/moespec-trt-check.XXXXXX")}"
jobs="${JOBS:-$(nproc 2>/dev/null || echo 4)}"
generator=()
if command -v ninja >/dev/null 2>&1; then
  generator=(-G Ninja)
fi

echo "== configure ${repo} in ${build} (TensorRT_ROOT=${trt_root})"
cmake --fresh -S "${repo}" -B "${build}" "${generator[@]}" \
  -DMOESPEC_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="80;90a" \
  -DMOESPEC_TENSORRT=ON -DTensorRT_ROOT="${trt_root}" \
  -DMOESPEC_PYTHON=OFF -DMOESPEC_BUILD_TESTS=ON

echo "== build moespec_trt_plugins test_route_experts_plugin test_moe_experts_plugin test_tree_select_plugin"
cmake --build "${build}" --target moespec_trt_plugins test_route_experts_plugin test_moe_experts_plugin test_tree_select_plugin -j "${jobs}"

echo "== exported entry points"
lib="$(find "${build}" -name 'libmoespec_trt_plugins.so' -print -quit)"
if [[ -z "${lib}" ]]; then
  echo "check_compile.sh: libmoespec_trt_plugins.so not found under ${build}" >&2
  exit 1
fi
exported="$(nm -D --defined-only "${lib}" | awk '$2 == "T" {print $3}')"
for symbol in getCreators setLoggerFinder; do
  if ! grep -qx "${symbol}" <<<"${exported}"; then
    echo "check_compile.sh: ${lib} does not export ${symbol}" >&2
    exit 1
  fi
done
if grep -qx initMoespecPlugins <<<"${exported}"; then
  echo "${lib}: getCreators setLoggerFinder initMoespecPlugins (linked against libnvinfer)"
else
  echo "${lib}: getCreators setLoggerFinder (headers-only: no libnvinfer, no initMoespecPlugins)"
fi
echo "${lib}: $(wc -l <<<"${exported}") exported functions"

echo "== test"
ctest --test-dir "${build}" -R plugin --output-on-failure
