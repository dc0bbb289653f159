#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Builds the libFuzzer targets (clang, AddressSanitizer + fuzzer instrumentation of the library and
# the CLI's reader) into build-fuzz/ and runs each for SECONDS (default 25) from a seed corpus of
# valid inputs (tests/fuzz/seeds.py) plus the corpus of earlier runs in build-fuzz/corpus/.
# A crash, leak, sanitizer report, timeout (> 20 s per input) or an input that ends in an
# exception other than SafetensorsError / hila::Error stops it with a non-zero exit; the input is
# saved as build-fuzz/<target>-crash-* (replay: build-fuzz/tests/fuzz/<target> FILE).
#   bash tests/fuzz/run.sh [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/../.."
SECS=${1:-25}
# clang 15 or newer: the library uses _Float16, which clang 14 does not take on x86-64.
export CC=${CC_FUZZ:-clang-16} CXX=${CXX_FUZZ:-clang++-16}
cmake -S . -B build-fuzz -DHILA_FUZZ=ON -DHILA_CUDA=OFF -DHILA_BUILD_TESTS=OFF -DHILA_BUILD_CLI=OFF \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS="-O1 -fno-omit-frame-pointer -fsanitize=address,fuzzer-no-link" \
  >/dev/null
cmake --build build-fuzz -j"$(nproc)" --target fuzz_safetensors fuzz_run
python3 tests/fuzz/seeds.py build-fuzz/seeds
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:allocator_may_return_null=1} OMP_NUM_THREADS=1
status=0
for t in safetensors run; do
  mkdir -p "build-fuzz/corpus/$t"
  echo "fuzz_$t: ${SECS} s"
  rc=0
  "build-fuzz/tests/fuzz/fuzz_$t" -max_total_time="$SECS" -rss_limit_mb=3072 -timeout=20 -max_len=16384 \
    -print_final_stats=1 -artifact_prefix="build-fuzz/fuzz_$t-" "build-fuzz/corpus/$t" "build-fuzz/seeds/$t" \
    >"build-fuzz/fuzz_$t.log" 2>&1 || rc=$?
  grep -E "^(#[0-9]+ +DONE|stat::number_of_executed_units|stat::peak_rss_mb)" "build-fuzz/fuzz_$t.log" || true
  if [ "$rc" -ne 0 ]; then
    echo "fuzz_$t FAILED (exit $rc):"
    grep -A40 -E "^==[0-9]+==|deadly signal|Test unit written|uncaught" "build-fuzz/fuzz_$t.log" | head -80
    status=1
  fi
done
exit $status
