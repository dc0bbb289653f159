#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Host emulation of hila's CUDA backend (no GPU needed): builds src/cuda/**/*.cu (rewritten by gen.py)
# and the GPU tests (tests/cuda/test_cuda_*.cpp) as host C++ and runs them:
#   bash tools/cuda_emu/run.sh ['gtest filter' [more gtest flags]]
#   e.g. bash tools/cuda_emu/run.sh 'Shapes/CudaOps.ForwardBackwardMatchNaiveFloat64/gla_bf16_d64_T65'
#        bash tools/cuda_emu/run.sh '' --gtest_list_tests        (build, then list the tests)
# Env: OUT (build dir, default build-emu), JOBS (parallel compiles, default 2), CXX (g++), SHIM
#      (shim directory, default tools/cuda_emu/shim: a modified copy for fault injection),
#      HILA_EMU_CP_ASYNC=eager (cp.async lands at issue rather than at wait_group); at run time
#      HILA_EMU_SM90=1 runs the sm_90a kernels (TMA + wgmma, shim/cuda/sm90_emu.h).
# Each CUDA thread is a std::thread (one block at a time, __syncthreads = std::barrier); warps run
# their 32 lanes in lock-step at warp operations (per-warp barrier + scratch), which emulates
# __shfl*_sync / __ballot_sync, mma.sync m16n8k16 (bf16, f16; fp32 accumulators) and ldmatrix x4
# (.trans) with the PTX fragment layouts, so the tensor-core kernels (src/cuda/gla/*_sm80.cu) run as
# written. cp.async is queued per thread and lands at wait_group (src_bytes zero-fill honoured).
# smem_gemm's WMMA is replaced by the FMA path with the same bf16/f16 operand rounding. Dynamic
# shared memory is poisoned (0xff) at every block start; device allocations are poisoned too.
# It checks indexing, fragment wiring, synchronisation, packing and the backend wiring - not speed,
# occupancy, bank conflicts, register limits, real concurrency between blocks, memory-model races
# or the WMMA path (the opt-in shared memory is taken as 232448 bytes, as on H100/H200).
# Incremental (make, with header dependencies); slow to run: keep shapes small.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-$ROOT/build-emu}
CXX=${CXX:-g++}
SHIM=${SHIM:-$ROOT/tools/cuda_emu/shim}
mkdir -p "$OUT/obj"
python3 "$ROOT/tools/cuda_emu/gen.py" "$ROOT" "$OUT" >/dev/null
FL="-std=c++20 -O1 -g0 -pthread -fopenmp -fno-strict-aliasing -DHILA_WITH_CUDA=1 -DHILA_CUDA_EMU=1 -I$SHIM -I$ROOT/src -I$ROOT/include -I$ROOT/tools -I$ROOT/tests/cuda"
echo "$CXX $FL" >"$OUT/flags.new"  # objects are rebuilt when the compiler, flags or shim change
cmp -s "$OUT/flags.new" "$OUT/flags" || mv "$OUT/flags.new" "$OUT/flags"
mapfile -t CUDA_CPP < <(find "$ROOT/src/cuda" -name '*.cpp' | sort)  # plain C++ of the backend (runtime/config.cpp)
SRCS=("$OUT"/emu_*.cpp "${CUDA_CPP[@]}" "$ROOT"/src/api/*.cpp "$ROOT"/src/core/*.cpp "$ROOT"/src/cpu/*.cpp "$ROOT"/tools/problem.cpp
      "$ROOT"/tools/device.cpp "$ROOT"/tests/cuda/test_cuda_*.cpp)
{
  echo "BIN := $OUT/hila_cuda_tests_emu"
  objs=()
  for s in "${SRCS[@]}"; do
    o="$OUT/obj/$(basename "$(dirname "$s")")_$(basename "$s" .cpp).o"
    objs+=("$o")
    printf '%s: %s %s\n\t%s %s -MMD -MP -c %s -o %s\n' "$o" "$s" "$OUT/flags" "$CXX" "$FL" "$s" "$o"
  done
  printf '$(BIN): %s\n\t%s -fopenmp -pthread %s -lgtest -lgtest_main -o $(BIN)\n' "${objs[*]}" "$CXX" "${objs[*]}"
  echo '-include $(wildcard '"$OUT"'/obj/*.d)'
} >"$OUT/Makefile"
make -s -f "$OUT/Makefile" -j"${JOBS:-2}" "$OUT/hila_cuda_tests_emu"
"$OUT/hila_cuda_tests_emu" --gtest_filter="${1:-*}" "${@:2}"
