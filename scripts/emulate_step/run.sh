#!/usr/bin/env bash
# Runs the CUDA decode-step kernel of src/cuda/step.cu on the host (one OS thread per CUDA thread,
# __syncthreads as std::barrier, float/double only) against hila's CPU step, for every operator,
# with and without the DecodeState counters. A check for machines without a GPU; it exercises the
# kernel's indexing, reductions and Fenwick logic, not the compiler or the hardware.
# Usage: scripts/emulate_step/run.sh [build dir of a CPU build, default build]   (add "quick" for one mode)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
build=${1:-$root/build}
out=$(mktemp -d)
python3 - "$root/src/cuda/step.cu" "$out/kernel_body.inc" <<'PY'
import sys
s = open(sys.argv[1]).read()
body = s[s.index('constexpr int kThreads = 256;'):s.index('template <class T>\nvoid launch_step(')]
body = body.replace('extern __shared__ __align__(16) unsigned char smem_raw[];', 'unsigned char* smem_raw = emu::smem;')
body = body.replace('__shared__ int s_last;', 'static int s_last;')
open(sys.argv[2], 'w').write(body)
PY
g++ -std=c++20 -O1 -fopenmp -I"$out" -I"$root/include" -I"$root/src" "$here/emulate_step.cpp" \
  "$build/libhila.a" -o "$out/emulate_step" -lpthread
"$out/emulate_step" "${@:2}"
