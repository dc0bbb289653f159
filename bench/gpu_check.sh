#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# On the GPU machine: run the CUDA tests, compute-sanitizer (memcheck, racecheck) on a small case,
# and the hila benchmark. Binaries are built on the development machine into $BIN (default .dev/bin)
# with `cmake -S . -B build-cuda -DHILA_CUDA=ON && cmake --build build-cuda`, and carried.
# Logs go to $OUT (or ./gpu-out).
set -uo pipefail
BIN=${BIN:-.dev/bin}
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="${BIN}/lib:${LD_LIBRARY_PATH:-}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
echo "== tests"
"$BIN/hila_cuda_tests" 2>&1 | tee "$OUT/tests.log" | grep -E "rel err|FAILED|PASSED|SKIPPED|tests ran" | tail -200
echo "== compute-sanitizer"
for tool in memcheck racecheck; do
  compute-sanitizer --tool $tool --error-exitcode 9 "$BIN/hila_cuda_tests" \
    --gtest_filter='*gla_bf16_d64_T65:*gla_f32_d64_varlen_init:*hla3_bf16_d64_T65:*hla2_f32_normalize_init' >"$OUT/sanitizer_$tool.log" 2>&1
  echo "$tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer_$tool.log" | tail -1)"
done
echo "== bench"
"$BIN/hila_bench" ${BENCH_ARGS:-} | tee "$OUT/hila_bench.csv"
