#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The benchmark of docs/PERFORMANCE.md, run on the GPU machine after bench/gpu_check.sh has built
# nothing (binaries are carried in $BIN) and with fla wheels in $WHL:
#   BIN=.dev/bin WHL=.dev/whl bash bench/gpu_bench.sh
set -uo pipefail
BIN=${BIN:-.dev/bin}
WHL=${WHL:-.dev/whl}
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="${BIN}/lib:${LD_LIBRARY_PATH:-}"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$WHL"/*.whl && export PYTHONPATH=/tmp/site
"$BIN/hila_bench" --reps 10 > "$OUT/hila.csv"
python3 bench/anchors.py > "$OUT/anchors.csv" 2> "$OUT/anchors.err"
python3 bench/report.py "$OUT/bench.csv" "$OUT/bench.png" "$OUT/table.md" "$OUT/hila.csv" "$OUT/anchors.csv"
cat "$OUT/anchors.err" | tail -5
cat "$OUT/table.md"
