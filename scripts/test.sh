#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Fresh machine -> every test: GoogleTest suites, `hila verify`, the numpy-oracle tests of the CLI
# and the CMake package tests, all through CTest; the GPU tests' smoke sets on the host emulator;
# then the Python package, installed with pip and tested with pytest.
# CUDA code is compiled only for a GPU that is present, or, with HILA_CUDA_COMPILE_CHECK=1 and no
# GPU, for sm_90a and sm_80 without running it (CI: .ci/run); see scripts/cuda_target.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
bash scripts/build.sh all
(cd build && ctest --output-on-failure -j"$(nproc)" "$@")

# The CUDA backend's kernels (tensor-core path included) on the host emulator, no GPU needed: a
# smoke set of the GPU tests that checks indexing, barriers and the backend's wiring on every run
# (tools/cuda_emu; docs/DEVELOPING.md), with one exact-reset case per float32 kernel family (portable
# GLA, log-linear segment sweep, portable delta rule). The whole GPU suite runs on a machine with a GPU.
EMU_SMOKE='Shapes/CudaOps.ForwardBackwardMatchNaiveFloat64/gla_bf16_d64_T65:'\
'Shapes/CudaOps.ForwardBackwardMatchNaiveFloat64/gla_f32_d64_T65:'\
'Shapes/CudaOps.ForwardBackwardMatchNaiveFloat64/hla2_bf16_d64_T65:'\
'Shapes/CudaOps.ForwardBackwardMatchNaiveFloat64/ahla_f32_normalize_init:'\
'Shapes/CudaOps.ForwardBackwardMatchNaiveFloat64/hla3_f64_untied_normalize:'\
'Shapes/CudaLogLinear.ForwardBackwardMatchNaiveFloat64/loglinear_bf16_d64_T65:'\
'Shapes/CudaOps.ForwardBackwardMatchNaiveFloat64/gla_f16_varlen_init_fused:'\
'Shapes/CudaOps.ForwardBackwardMatchNaiveFloat64/hla2_bf16_varlen_init_fused:'\
'Shapes/CudaOps.ForwardBackwardMatchNaiveFloat64/hla3_bf16_d64_T200_mha:'\
'Shapes/CudaOps.ForwardBackwardMatchNaiveFloat64/gla_f32_d64_varlen_init_chunk16:'\
'Shapes/CudaOps.ForwardBackwardMatchNaiveFloat64/gla_f16_varlen_init_portable_chunk32:'\
'Shapes/CudaOps.ForwardBackwardMatchNaiveFloat64/ahla_bf16_mha_untied_normalize:'\
'Shapes/CudaLogLinear.ForwardBackwardMatchNaiveFloat64/loglinear_bf16_d64_T130_tree:'\
'Shapes/CudaLogLinear.ForwardBackwardMatchNaiveFloat64/loglinear_bf16_d128_T300_tree_sweep:'\
'Shapes/CudaLogLinear.ForwardBackwardMatchNaiveFloat64/loglinear_bf16_d64_T130_tree_final:'\
'Shapes/CudaLogLinearContinue.ForwardFromStateMatchesNaive/loglinear_bf16_T300_at13:'\
'Shapes/CudaDelta.ForwardBackwardMatchFloat64Oracle/gdn_f64_d32_init13_T1:'\
'Shapes/CudaDelta.ForwardBackwardMatchFloat64Oracle/loglinear_gdn_f64_d32_init13_T1:'\
'Shapes/CudaDelta.ForwardBackwardMatchFloat64Oracle/gdn_f16_init13_l2norm:'\
'Shapes/CudaDelta.ForwardBackwardMatchFloat64Oracle/loglinear_gdn_bf16_d128_T129_train_tc:'\
'Shapes/CudaDelta.ForwardBackwardMatchFloat64Oracle/gdn_bf16_dk42_dv40_gqa2_l2norm_init:'\
'CudaDeltaViews.StridedQkvWithL2NormMatchFloat64Oracle:'\
'AllOps/CudaStep.PrefillThenDecodeMatchesNaiveFloat64/gla_f16_d64:'\
'AllOps/CudaStep.PrefillThenDecodeMatchesNaiveFloat64/hla2_f16_d64:'\
'AllOps/CudaStep.PrefillThenDecodeMatchesNaiveFloat64/loglinear_f16_d64:'\
'AllOps/CudaStep.FunctionalStepInPlace/gla_bf16_d64_gqa:'\
'AllOps/CudaServing.StepWithCountersIsTheDecodeStateStep/hla2:'\
'AllOps/CudaServing.StepWithCountersIsTheDecodeStateStep/loglinear_hla3:'\
'Ops/CudaWorkspace.*/gla_bf16_in_place:CudaWorkspaceErrors.*:CudaStepErrors.*:'\
'CudaOps.UnsupportedOnDeviceIsAClearError:CudaOps.BadValuesOnDeviceAreFoundWithTheirIndex:'\
'Ops/CudaExactResets.*/gla_f32_C64:Ops/CudaExactResets.*/loglinear_f32_C64_at40:'\
'Ops/CudaExactResets.*/loglinear_gdn_f32_C64_at40'
OUT=build/emu JOBS="$(nproc)" bash tools/cuda_emu/run.sh "${HILA_EMU_FILTER:-$EMU_SMOKE}"
# The Hopper kernels (TMA + wgmma, src/cuda/gla/*_sm90.cu) on the same emulator: its host versions
# of the sm_90a pieces (tools/cuda_emu/shim/cuda/sm90_emu.h): sweeps, backward chunk kernel and
# fused forward (with its TMA stores of the chunk states), with strided views, varlen, the HLA
# gradient sums, chunks shorter than the 64-row tiles, the log-linear tree build and the tree form's
# backward chunk kernel (level reads, a final-state cotangent, an initial state) and resets; the
# delta rule's state sweeps (src/cuda/delta/sweep_sm90.cu) and loglinear_gdn's level sweeps
# (src/cuda/delta/loglinear_gdn_sm90.cu), forced by the cases.
EMU_SM90='Shapes/CudaOps.ForwardBackwardMatchNaiveFloat64/gla_bf16_d128_T65_init_sm90:'\
'Shapes/CudaOps.ForwardBackwardMatchNaiveFloat64/gla_f16_dk64_dv128_varlen_init_sm90:'\
'Shapes/CudaOps.ForwardBackwardMatchNaiveFloat64/hla2_bf16_varlen_init_sm90:'\
'Shapes/CudaOps.ForwardBackwardMatchNaiveFloat64/gla_f16_dk64_dv128_varlen_init_fused:'\
'Shapes/CudaOps.ForwardBackwardMatchNaiveFloat64/hla2_bf16_d64_T200_mha:CudaOps.FusedQkvViewsInPlace:'\
'Shapes/CudaOps.ForwardBackwardMatchNaiveFloat64/hla3_bf16_varlen_init_fused:'\
'Shapes/CudaOps.ForwardBackwardMatchNaiveFloat64/gla_f16_dk64_dv128_varlen_init_fused_chunk16:'\
'Shapes/CudaOps.ForwardBackwardMatchNaiveFloat64/hla2_bf16_varlen_init_chunk32:'\
'Shapes/CudaOps.ForwardBackwardMatchNaiveFloat64/gla_bf16_dk128_dv64_gqa4_sm90_chunk32:'\
'Shapes/CudaLogLinear.ForwardBackwardMatchNaiveFloat64/loglinear_bf16_d128_T300_tree_sweep_sm90:'\
'Shapes/CudaLogLinear.ForwardBackwardMatchNaiveFloat64/loglinear_bf16_d64_T130_tree_final:'\
'Shapes/CudaLogLinear.ForwardBackwardMatchNaiveFloat64/loglinear_bf16_d64_T300_init192_tree_final:'\
'Shapes/CudaDelta.ForwardBackwardMatchFloat64Oracle/gdn_bf16_d128_T65_sm90:'\
'Shapes/CudaDelta.ForwardBackwardMatchFloat64Oracle/loglinear_gdn_bf16_d128_T130_train_sm90:'\
'Ops/CudaResetGates.*/gla_bf16_sm90'
HILA_EMU_SM90=1 OUT=build/emu JOBS="$(nproc)" bash tools/cuda_emu/run.sh "${HILA_EMU_SM90_FILTER:-$EMU_SM90}"
# The per-call tables uploaded by kernels (the path a call under CUDA graph capture takes, here
# forced and in 16-byte pieces): varlen, a log-linear state at an unaligned position, delta rule.
EMU_UPLOAD='Shapes/CudaOps.ForwardBackwardMatchNaiveFloat64/hla2_bf16_varlen_init_fused:'\
'Ops/CudaWorkspace.ExactWorkspaceTakesNoPoolMemoryAndMatchesThePool/loglinear_bf16_varlen_at128:'\
'Shapes/CudaDelta.ForwardBackwardMatchFloat64Oracle/gdn_bf16_d128_T65'
HILA_UPLOAD_KERNEL=1 OUT=build/emu JOBS="$(nproc)" bash tools/cuda_emu/run.sh "${HILA_EMU_UPLOAD_FILTER:-$EMU_UPLOAD}"

# The Python package, with the same CUDA choice as build/ (a compile check stays in build/), and
# without the console script (the CLI is tested through CTest; scripts/wheel.sh packages it).
source scripts/cuda_target.sh
hila_cuda_target
pyargs=(-C cmake.define.HILA_BUILD_CLI=OFF)
if [ "$HILA_CUDA_MODE" = AUTO ]; then
  pyargs+=(-C cmake.define.HILA_CUDA=AUTO -C "cmake.define.HILA_CUDA_GENCODE=$HILA_CUDA_GENCODE_LIST")
else
  pyargs+=(-C cmake.define.HILA_CUDA=OFF)
fi
if command -v ccache >/dev/null 2>&1; then
  pyargs+=(-C cmake.define.CMAKE_CXX_COMPILER_LAUNCHER=ccache -C cmake.define.CMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi
PY=${PYTHON:-python3}
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} PIP_ROOT_USER_ACTION=ignore
"$PY" -m pip install -q --disable-pip-version-check --no-build-isolation "${pyargs[@]}" ./ 2>/dev/null ||
  "$PY" -m pip install -q --disable-pip-version-check --no-build-isolation --break-system-packages "${pyargs[@]}" ./
"$PY" -m pytest -q python/tests

# Fuzzing, bounded (about a minute): the safetensors reader and `hila run`'s validation under
# libFuzzer + AddressSanitizer, then the Python API under Hypothesis (tests/fuzz; longer runs:
# docs/DEVELOPING.md, Fuzzing).
bash tests/fuzz/run.sh "${HILA_FUZZ_SECONDS:-20}"
CI=${CI:-} HYPOTHESIS_EXAMPLES=${HYPOTHESIS_EXAMPLES:-200} "$PY" -m pytest -q -p no:cacheprovider tests/fuzz
