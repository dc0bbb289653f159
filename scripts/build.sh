#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Configures and builds hila into build/:
#   bash scripts/build.sh demo    the library and the CLI (what `hila demo` needs)
#   bash scripts/build.sh [all]   also the tests (GoogleTest suites, CTest registrations) and, with
#                                 the CUDA backend, the GPU tests and the benchmark
# CUDA: scripts/cuda_target.sh (a GPU's own architecture, HILA_CUDA_COMPILE_CHECK=1, else none).
# ccache is used when it is installed. Extra configure arguments: HILA_CMAKE_ARGS.
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
source scripts/cuda_target.sh
hila_cuda_target

args=(-DCMAKE_BUILD_TYPE=Release -DHILA_BUILD_CLI=ON "-DHILA_CUDA=$HILA_CUDA_MODE")
[ -n "$HILA_CUDA_GENCODE_LIST" ] && args+=("-DHILA_CUDA_GENCODE=$HILA_CUDA_GENCODE_LIST")
case "$what" in
  demo) args+=(-DHILA_BUILD_TESTS=OFF -DHILA_BUILD_BENCH=OFF); targets=(--target hila_cli) ;;
  all) args+=(-DHILA_BUILD_TESTS=ON -DHILA_BUILD_BENCH=ON); targets=() ;;
  *) echo "build.sh: expected 'demo' or 'all', got '$what'" >&2; exit 2 ;;
esac
if command -v ccache >/dev/null 2>&1; then
  args+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi
# shellcheck disable=SC2206
args+=(${HILA_CMAKE_ARGS:-})

echo "build: $HILA_CUDA_REASON"
mkdir -p build
if ! cmake -S . -B build "${args[@]}" >build/configure.log 2>&1; then
  cat build/configure.log >&2
  exit 1
fi
grep -E "^-- hila: CUDA backend" build/configure.log | sed 's/^-- /build: /' || true
cmake --build build -j"$(nproc)" "${targets[@]}"
