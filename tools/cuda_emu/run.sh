#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Builds hila's CUDA backend and the GPU tests for the HOST (no GPU needed) and runs them:
#   bash tools/cuda_emu/run.sh [gtest filter]        e.g. '*CudaLogLinear*f32*'
# Kernels run on std::threads (256 per block, __syncthreads = std::barrier, one block at a time);
# WMMA is replaced by the FMA path with the same bf16/f16 operand rounding. It checks indexing,
# synchronisation, packing and the backend wiring, not speed, occupancy, or the real WMMA/smem limits
# (the shared-memory opt-in is taken as 232448 bytes, as on H100/H200). Slow: keep shapes small.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-$ROOT/build-emu}
mkdir -p "$OUT/obj"
python3 "$ROOT/tools/cuda_emu/gen.py" "$ROOT" "$OUT"
FL="-std=c++20 -O1 -pthread -fopenmp -fno-strict-aliasing -DHILA_WITH_CUDA=1 -I$ROOT/tools/cuda_emu/shim -I$ROOT/src -I$ROOT/include -I$ROOT/tools -I$ROOT/tests/cuda"
SRCS=("$OUT"/emu_*.cpp "$ROOT"/src/core/*.cpp "$ROOT"/src/cpu/*.cpp "$ROOT"/tools/problem.cpp "$ROOT"/tests/cuda/test_cuda_*.cpp)
rm -f "$OUT"/obj/*.o
printf '%s\n' "${SRCS[@]}" | xargs -P "${JOBS:-2}" -I{} sh -c 'g++ '"$FL"' -c "$1" -o "$2/obj/$(basename "$(dirname "$1")")_$(basename "$1" .cpp).o"' _ {} "$OUT"
g++ -fopenmp -pthread "$OUT"/obj/*.o -lgtest -lgtest_main -o "$OUT/hila_cuda_tests_emu"
"$OUT/hila_cuda_tests_emu" --gtest_filter="${1:-*}"
