#!/bin/bash
# SPDX-License-Identifier: Apache-2.0
# Runs the delta rule's portable kernels (src/cuda/delta/segment_portable.cu) on the host, without a
# GPU: the launches <<<...>>> become sequential block loops (emu_grid), the stand-in headers of this
# folder replace src/cuda/common.cuh and src/cuda/runtime/runtime.cuh, and the results are compared
# with the CPU float64 oracle. Checks the math and indexing of the kernels and, with threads > 1
# and TSan, missing __syncthreads (as data races); not the bf16/f16 paths (tools/cuda_emu runs every
# kernel, tensor cores included, without TSan).
#   usage: tools/cuda_host_emulation/run.sh [threads per block: 1 | 32 | 256] [extra g++ flags]
#   e.g.   run.sh 1;   run.sh 256 -fsanitize=thread -g   (needs the CPU build in build/)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
threads=${1:-1}
out=$root/build/cuda_host_emulation
mkdir -p "$out"
sed -e 's/\([a-z_]*_kernel<T>\)<<<\(.*\), kThreads, 0, s>>>(\([a-z]\));/emu_grid(\2, [\&] { \1(\3); });/' \
    "$root/src/cuda/delta/segment_portable.cu" > "$out/delta_emu.inc"
if grep -n "<<<" "$out/delta_emu.inc"; then echo "run.sh: a launch was not rewritten" >&2; exit 1; fi
g++ -std=c++20 -O1 -DEMU_THREADS="$threads" "${@:2}" -fopenmp -I"$here" -I"$out" -I"$root/src" -I"$root/include" \
    -I"$root/tools" -Wno-subobject-linkage "$here/delta_emulation.cpp" "$root/tools/problem.cpp" "$root/tools/device.cpp" \
    "$root/build/libhila.a" -o "$out/delta_emulation"
OMP_NUM_THREADS=1 "$out/delta_emulation"
