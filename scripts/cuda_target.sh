# SPDX-License-Identifier: Apache-2.0
# Sourced by scripts/build.sh and scripts/test.sh: which CUDA code a build on this machine compiles.
# Nothing is compiled for a GPU architecture that is not run here, unless CI asks for the check:
#   a GPU is present (nvidia-smi lists one)  HILA_CUDA=AUTO for that GPU's architecture only
#                                            (compute capability 9.0 -> sm_90a, the TMA + wgmma
#                                            kernels); CPU-only, said so, where nvcc is missing
#   no GPU, HILA_CUDA_COMPILE_CHECK=1        HILA_CUDA=ON for sm_90a and sm_80: the CUDA sources
#                                            compiled by nvcc (fails without it), never run (CI)
#   no GPU                                   HILA_CUDA=OFF
# Sets HILA_CUDA_MODE (ON, OFF or AUTO), HILA_CUDA_GENCODE_LIST (nvcc flags, ;-separated) and
# HILA_CUDA_REASON (one line for the log).
hila_cuda_target() {
  local caps cc arch
  caps=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | tr -d ' \r' | sort -u) || caps=""
  HILA_CUDA_GENCODE_LIST=""
  for cc in $caps; do
    [[ "$cc" =~ ^[0-9]+\.[0-9]+$ ]] || continue
    arch=${cc/./}
    [ "$arch" = 90 ] && arch=90a  # Hopper: the sm_90a kernels (TMA, wgmma) need the 'a' target
    HILA_CUDA_GENCODE_LIST+="${HILA_CUDA_GENCODE_LIST:+;}-gencode=arch=compute_${arch},code=sm_${arch}"
  done
  if [ -n "$HILA_CUDA_GENCODE_LIST" ]; then
    HILA_CUDA_MODE=AUTO
    HILA_CUDA_REASON="GPU present (compute capability $(echo $caps)): CUDA code for the architecture(s) present only"
  elif [ "${HILA_CUDA_COMPILE_CHECK:-0}" = 1 ]; then
    HILA_CUDA_MODE=ON
    HILA_CUDA_GENCODE_LIST="-gencode=arch=compute_90a,code=sm_90a;-gencode=arch=compute_80,code=sm_80"
    HILA_CUDA_REASON="no GPU, HILA_CUDA_COMPILE_CHECK=1: CUDA sources compiled for sm_90a and sm_80, not run"
  else
    HILA_CUDA_MODE=OFF
    HILA_CUDA_REASON="no GPU: CPU backend only (HILA_CUDA_COMPILE_CHECK=1 compiles the CUDA sources too)"
  fi
}
