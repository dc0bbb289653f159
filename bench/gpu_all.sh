#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# One call on a GPU machine: CUDA tests, compute-sanitizer, the Python suite on CUDA, and the
# benchmark with its anchors in the same run. The binaries (hila_cuda_tests, hila_bench, hila) are
# built beforehand (see docs/PERFORMANCE.md) and given in $BIN, or as an xz archive $BINS_TAR that is
# unpacked there; fla wheels in $WHL; the Python extension as an archive $PY_TAR.
#   STAGES="tests demo sanitizer python bench anchors" BIN=bin WHL=whl bash bench/gpu_all.sh
# Stage `tests`: TEST_SHARDS=4 runs four gtest shards side by side; TESTS_TIMEOUT (default 300 s) each.
# Stage `sanitizer`: memcheck and racecheck (SAN_TOOLS) side by side; SAN_FILTER replaces its default test filter, SAN_EXTRA ("pattern:pattern") adds to it.
# Other head shapes: BENCH_ARGS="--H 48 --dk 128 --dv 64 --G 1" ANCHOR_ARGS="--H 48 --dk 128 --dv 64" (the
# log-linear paper's configuration; anchors sections ANCHORS="ceil sdpa fla fla_loglinear fla_gdn").
# Prefill and continuation (forwards with states) rows too: BENCH_ARGS="--prefill".
# fla's Triton compiles: SAVE_TRITON_CACHE=1 writes $OUT/triton_cache.tgz; given as TRITON_CACHE_TAR
# (default .dev/triton_cache.tgz) it is unpacked before the anchors of a later call.
# Stage `ab`: the same benchmark under several settings (AB_ENVS, default the sm_90a kernels off /
# backward only / all), AB_OPS on AB_SHAPES (with BENCH_ARGS); ab.csv and a ms table per setting. A setting
# "tar:FILE" runs the hila_bench of another build instead (FILE an archive like BINS_TAR, e.g. the
# binaries of the previous commit): AB_ENVS="tar:bins_base.tar.xz;default". AB_ROUNDS=2 repeats the
# settings in turn (interleaved rounds; the table shows each round's column). AB_DECODE=1 also
# times the decode step under each setting (AB_DECODE_OPS, AB_BATCHES, AB_POSITIONS): ab_decode.csv
# and a µs table.
# What comes back in $OUT (default ./gpu-out), refreshed after every stage so that a run cut short
# still has it: summary.txt, logs.tgz (every log), hila.csv, anchors.csv, decode.csv, ab.csv and
# the report (bench.csv, bench.png, table.md). Logs are written under $LOGS (not $OUT).
set -uo pipefail
BIN=${BIN:-.dev/bin}
WHL=${WHL:-.dev/whl}
OUT=${OUT:-gpu-out}
LOGS=${LOGS:-/tmp/hila-gpu-logs}
STAGES=${STAGES:-tests sanitizer python bench anchors}
SHAPES=${SHAPES:-32:1024,8:4096,2:16384,1:65536}
OPS=${OPS:-gla,hla2,ahla,hla3}
mkdir -p "$OUT" "$LOGS"
# the binaries may come as one xz archive (three stripped binaries are ~100 MB, the archive ~12 MB):
# unpacked into $BIN first
BINS_TAR=${BINS_TAR:-.dev/bins.tar.xz}
if [ -f "$BINS_TAR" ]; then mkdir -p "$BIN" && tar xJf "$BINS_TAR" -C "$BIN"; fi
OUT_ABS=$(cd "$OUT" && pwd)
export LD_LIBRARY_PATH="${BIN}/lib:${LD_LIBRARY_PATH:-}"
has() { [[ " $STAGES " == *" $1 "* ]]; }
# one summary line per stage, kept in $OUT/summary.txt; the logs re-archived after each stage
note() {
  echo "$*" | tee -a "$OUT/summary.txt"
  tar czf "$OUT_ABS/logs.tgz" -C "$LOGS" . 2>/dev/null || true
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$LOGS/gpu.txt" >"$OUT/summary.txt"
if has tests; then
  t0=$SECONDS
  # TEST_SHARDS processes side by side (gtest sharding; the float64 CPU oracles dominate the time)
  n=${TEST_SHARDS:-1} pids=()
  for i in $(seq 0 $((n - 1))); do
    GTEST_TOTAL_SHARDS=$n GTEST_SHARD_INDEX=$i timeout ${TESTS_TIMEOUT:-300} "$BIN/hila_cuda_tests" ${GTEST_ARGS:-} \
      >"$LOGS/tests_$i.log" 2>&1 &
    pids+=($!)
  done
  rc=0
  for p in "${pids[@]}"; do wait $p || rc=$?; done
  cat "$LOGS"/tests_*.log >"$LOGS/tests.log"
  grep -E "^\[  FAILED  \]|Failure|rel err.*(NaN|nan)" "$LOGS/tests.log" | head -60
  note "tests rc=$rc passed $(grep -hoE '^\[  PASSED  \] [0-9]+' "$LOGS"/tests_*.log | awk '{s+=$NF} END {print s+0}')" \
    "failed $(grep -hoE '^\[  FAILED  \] [0-9]+ test' "$LOGS"/tests_*.log | awk '{s+=$4} END {print s+0}') ($((SECONDS - t0)) s)"
fi
if has demo; then  # the CLI's main job on the GPU (needs $BIN/hila, the CLI built with CUDA)
  timeout 300 "$BIN/hila" demo --device cuda --T ${DEMO_T:-1024} --decode 16 >"$LOGS/demo.log" 2>&1
  rc=$?
  tail -14 "$LOGS/demo.log"
  note "demo rc=$rc"
fi
if has sanitizer; then
  for tool in ${SAN_TOOLS:-memcheck racecheck}; do  # side by side
    (timeout ${SAN_TIMEOUT:-240} compute-sanitizer --tool $tool --error-exitcode 9 "$BIN/hila_cuda_tests" \
      --gtest_filter="${SAN_FILTER:-*gla_bf16_d64_T65:*gla_bf16_d128_T65_fused:*gla_bf16_d128_T65_init_sm90:*gla_f16_dk64_dv128_varlen_init_sm90:*gla_f16_varlen_init_fused:*gla_f32_d64_varlen_init:*hla3_bf16_d64_T65:*hla2_f32_normalize_init:*loglinear_bf16_d64_T130_tree:*loglinear_bf16_d64_T300_init192_tree_final:*Continue*loglinear_bf16_T300_at13:*CudaDelta.*/gdn_bf16_d128_T65:*CudaDelta.*/gdn_bf16_dk40_dv72_ungated_gqa2_init200:*CudaDelta.*/loglinear_gdn_bf16_d128_T129_train_tc:*CudaDelta.*/loglinear_gdn_bf16_dk40_dv72_ungated_gqa2_train_tc:*CudaDelta.*/gdn_bf16_d128_T65_sm90:*CudaDelta.*/gdn_f16_d64_varlen_init_sm90}${SAN_EXTRA:+:$SAN_EXTRA}" \
      >"$LOGS/sanitizer_$tool.log" 2>&1
     echo $? >"$LOGS/sanitizer_$tool.rc") &
  done
  wait
  for tool in ${SAN_TOOLS:-memcheck racecheck}; do
    note "$tool rc=$(cat "$LOGS/sanitizer_$tool.rc") $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$LOGS/sanitizer_$tool.log" | tail -1)"
  done
fi
if has python; then  # pytest on CUDA, 8 workers: the extension from $PY_TAR (built beforehand for this
  # GPU and this machine's Python, see docs/PERFORMANCE.md), else built here (PY_GENCODE, all cores)
  t0=$SECONDS
  PY_TAR=${PY_TAR:-.dev/py312.tar.xz}
  if [ -f "$PY_TAR" ]; then
    mkdir -p /tmp/hpy && tar xJf "$PY_TAR" -C /tmp/hpy && rm -rf /tmp/hsite && mv /tmp/hpy/* /tmp/hsite
  else
    CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) timeout 420 python3 -m pip install -q --no-build-isolation --no-deps --no-compile \
      --target /tmp/hsite -Ccmake.define.HILA_CUDA=ON -Ccmake.define.HILA_BUILD_CLI=OFF \
      "-Ccmake.define.HILA_CUDA_GENCODE=${PY_GENCODE:--gencode=arch=compute_90a,code=sm_90a}" \
      -Cbuild-dir=/tmp/hbuild . >"$LOGS/pybuild.log" 2>&1
  fi
  PYTHONPATH=/tmp/hsite HILA_TEST_DEVICES=cuda timeout ${PYTEST_TIMEOUT:-300} \
    python3 -m pytest -q -n ${PYTEST_WORKERS:-8} --maxfail=10 -p no:cacheprovider python/tests ${PYTEST_ARGS:-} \
    >"$LOGS/pytest.log" 2>&1
  rc=$?
  grep -E "^(E  |FAILED|ERROR)|Error|error:" "$LOGS/pytest.log" | head -40
  tail -3 "$LOGS/pytest.log"
  note "python(cuda) rc=$rc $(tail -1 "$LOGS/pytest.log") ($((SECONDS - t0)) s)"
fi
if has profile; then  # per-kernel GPU time of one forward + backward (ncu), for the limiter analysis
  for shp in ${PROFILE_SHAPES:-8:4096 1:65536}; do
    timeout 200 ncu --csv --metrics gpu__time_duration.sum "$BIN/hila_bench" --reps 1 --warmup 0 --ops ${PROFILE_OPS:-gla} \
      --shapes "$shp" >"$LOGS/ncu_${shp/:/x}.csv" 2>"$LOGS/ncu.err"
    python3 bench/ncu_summary.py "$LOGS/ncu_${shp/:/x}.csv" "$shp"
  done
fi
if has ncu; then  # stall reasons and throughputs of the main kernels (one launch each)
  timeout 240 ncu --kernel-name regex:"${NCU_KERNELS:-sweep_kernel|output_kernel|bwd_chunk_kernel}" --launch-skip ${NCU_SKIP:-6} \
    --launch-count ${NCU_COUNT:-3} --section SpeedOfLight --section Occupancy --section WarpStateStats \
    --section MemoryWorkloadAnalysis --section LaunchStats "$BIN/hila_bench" --reps 1 --warmup 1 --ops ${NCU_OPS:-gla} \
    --shapes ${NCU_SHAPE:-8:4096} >"$LOGS/ncu_detail.txt" 2>&1
  grep -E "^  [a-z_:]+.*(sweep|output|bwd_chunk)|Duration|Memory Throughput|DRAM Throughput|Compute \(SM\)|Achieved Occupancy|Registers Per|Shared Memory Config|Warp Cycles Per Issued|Stall|stall|L1/TEX Hit|L2 Hit|Block Limit" "$LOGS/ncu_detail.txt" | head -90
fi
if has bench; then  # BENCH_SETS: "ops@shapes;ops@shapes" (default: OPS@SHAPES)
  IFS=';' read -ra sets <<<"${BENCH_SETS:-$OPS@$SHAPES}"
  first=1
  for set in "${sets[@]}"; do
    timeout 240 "$BIN/hila_bench" --reps ${REPS:-10} --ops "${set%@*}" --shapes "${set#*@}" ${BENCH_ARGS:-} \
      >"$LOGS/hila_part.csv" 2>>"$LOGS/hila_bench.err"
    note "bench ${set%@*} rc=$?"
    if [ $first = 1 ]; then cat "$LOGS/hila_part.csv" >"$OUT/hila.csv"; first=0; else tail -n +2 "$LOGS/hila_part.csv" >>"$OUT/hila.csv"; fi
  done
  rm -f "$LOGS/hila_part.csv"
fi
if has ab; then  # the same binary under each setting of AB_ENVS ("VAR=value ..." per setting, ";"-separated; "default" = none)
  IFS=';' read -ra envs <<<"${AB_ENVS:-HILA_GLA_SM90=0;HILA_GLA_SM90=bwd;HILA_GLA_SM90=1}"
  first=1
  for round in $(seq 1 ${AB_ROUNDS:-1}); do
    k=0
    for e in "${envs[@]}"; do
      k=$((k + 1))
      bench="$BIN/hila_bench" lbl=${e:-default}
      if [[ $e == tar:* ]]; then  # another build's binaries, unpacked once
        dir="${AB_BINS:-/tmp/hila-ab-bins}/$k"  # not under $LOGS: logs.tgz must stay small
        [ -x "$dir/hila_bench" ] || { mkdir -p "$dir" && tar xJf "${e#tar:}" -C "$dir"; }
        bench="$dir/hila_bench" e="" lbl=$(basename "${lbl#tar:}")
      fi
      [ "$e" = default ] && e=""  # "default": no setting
      env $e timeout 240 "$bench" --reps ${REPS:-10} --ops "${AB_OPS:-gla,hla2}" --shapes "${AB_SHAPES:-$SHAPES}" ${BENCH_ARGS:-} \
        >"$LOGS/ab_part.csv" 2>>"$LOGS/ab.err"
      note "ab [$lbl] round $round rc=$?"
      if [ $first = 1 ]; then sed -n '1s/^/env,/p' "$LOGS/ab_part.csv" >"$OUT/ab.csv"; first=0; fi
      lbl=${lbl// /+}; lbl=${lbl//,/|}  # one CSV field
      [ ${AB_ROUNDS:-1} -gt 1 ] && lbl="$lbl@r$round"
      tail -n +2 "$LOGS/ab_part.csv" | sed "s/^/${lbl},/" >>"$OUT/ab.csv"
    done
  done
  python3 - "$OUT/ab.csv" <<'PY'  # ms per (op, B, T, direction), one column per setting
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
envs = list(dict.fromkeys(r["env"] for r in rows))
key = lambda r: (r["op"], r["B"], r["T"], r["direction"])
cells = {(key(r), r["env"]): r["ms"] for r in rows}
print("op,B,T,direction," + ",".join(envs))
for k in dict.fromkeys(key(r) for r in rows if r["direction"] in ("fwd", "fwdbwd")):
    print(",".join(k) + "," + ",".join("%.3f" % float(cells[(k, e)]) if (k, e) in cells else "-" for e in envs))
PY
  if [ "${AB_DECODE:-0}" = 1 ]; then  # the decode step under the same settings (hila_bench --decode)
    first=1
    for round in $(seq 1 ${AB_ROUNDS:-1}); do
      k=0
      for e in "${envs[@]}"; do
        k=$((k + 1))
        bench="$BIN/hila_bench" lbl=${e:-default}
        if [[ $e == tar:* ]]; then
          bench="${AB_BINS:-/tmp/hila-ab-bins}/$k/hila_bench" e="" lbl=$(basename "${lbl#tar:}")
        fi
        [ "$e" = default ] && e=""
        env $e timeout 240 "$bench" --decode --reps ${REPS:-20} --ops "${AB_DECODE_OPS:-gla,hla2,loglinear,loglinear_gdn}" \
          --batches "${AB_BATCHES:-1,16,256}" --positions "${AB_POSITIONS:-4096,65536}" >"$LOGS/ab_part.csv" 2>>"$LOGS/ab.err"
        note "ab decode [$lbl] round $round rc=$?"
        if [ $first = 1 ]; then sed -n '1s/^/env,/p' "$LOGS/ab_part.csv" >"$OUT/ab_decode.csv"; first=0; fi
        lbl=${lbl// /+}; lbl=${lbl//,/|}
        [ ${AB_ROUNDS:-1} -gt 1 ] && lbl="$lbl@r$round"
        tail -n +2 "$LOGS/ab_part.csv" | sed "s/^/${lbl},/" >>"$OUT/ab_decode.csv"
      done
    done
    python3 - "$OUT/ab_decode.csv" <<'PY'  # µs per step per (op, N, pos), one column per setting
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
envs = list(dict.fromkeys(r["env"] for r in rows))
key = lambda r: (r["op"], r["N"], r["pos"])
cells = {(key(r), r["env"]): r["us_per_step"] for r in rows}
print("op,N,pos," + ",".join(envs))
for k in dict.fromkeys(key(r) for r in rows):
    print(",".join(k) + "," + ",".join("%.2f" % float(cells[(k, e)]) if (k, e) in cells else "-" for e in envs))
PY
  fi
fi
if has decode; then
  timeout 200 "$BIN/hila_bench" --decode --reps 20 --batches 1,16,256 --positions ${DECODE_POSITIONS:-4096,65536} \
    >"$OUT/decode.csv" 2>"$LOGS/decode.err"
  note "decode rc=$? $(grep -i copy "$LOGS/decode.err" | tail -1)"
  cat "$OUT/decode.csv"
fi
if has anchors; then  # each section under its own time limit, so that a slow one loses only its own rows
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$WHL"/*.whl && export PYTHONPATH=/tmp/site
  # Triton's compiled kernels: most of fla's first-call time (minutes per operator family). A cache
  # from an earlier call (TRITON_CACHE_TAR, e.g. one SAVE_TRITON_CACHE=1 returned) is unpacked first.
  export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
  mkdir -p "$TRITON_CACHE_DIR"
  [ -f "${TRITON_CACHE_TAR:-.dev/triton_cache.tgz}" ] && tar xzf "${TRITON_CACHE_TAR:-.dev/triton_cache.tgz}" -C "$TRITON_CACHE_DIR"
  first=1
  for sec in ${ANCHORS:-ceil sdpa fla}; do
    timeout ${ANCHOR_TIMEOUT:-240} python3 bench/anchors.py --shapes "$SHAPES" ${ANCHOR_ARGS:-} $sec >"$LOGS/anchors_part.csv" 2>>"$LOGS/anchors.err"
    note "anchors $sec rc=$? $(tail -1 "$LOGS/anchors.err")"
    if [ $first = 1 ]; then cat "$LOGS/anchors_part.csv" >"$OUT/anchors.csv"; first=0; else tail -n +2 "$LOGS/anchors_part.csv" >>"$OUT/anchors.csv"; fi
  done
  if [ "${SAVE_TRITON_CACHE:-0}" = 1 ]; then  # into $OUT, for TRITON_CACHE_TAR of a later call
    tar czf "$OUT/triton_cache.tgz" -C "$TRITON_CACHE_DIR" .
    note "triton cache $(du -h "$OUT/triton_cache.tgz" | cut -f1) (TRITON_CACHE_TAR of a later call)"
  fi
fi
if [ -s "$OUT/hila.csv" ]; then
  python3 bench/report.py "$OUT/bench.csv" "$OUT/bench.png" "$OUT/table.md" "$OUT/hila.csv" \
    $( [ -s "$OUT/anchors.csv" ] && echo "$OUT/anchors.csv") >"$LOGS/report.log" 2>&1 || tail -3 "$LOGS/report.log"
  cat "$OUT/table.md" 2>/dev/null || cat "$OUT/hila.csv"
fi
note "done"
echo "== summary"; cat "$OUT/summary.txt"
