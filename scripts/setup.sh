#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Installs what one command needs on a fresh Debian/Ubuntu machine; already-installed packages are
# skipped (idempotent).
#   bash scripts/setup.sh demo    the demo (scripts/demo.sh): cmake, g++, CLI11, nlohmann-json
#   bash scripts/setup.sh test    every test (scripts/test.sh): also GoogleTest, pkg-config, clang 16
#                                 with libFuzzer (the fuzz run), and from the package index numpy,
#                                 safetensors, pytest, nanobind, scikit-build-core, torch,
#                                 transformers (hila.hf), hypothesis and ml_dtypes (tests/fuzz),
#                                 tqdm and matplotlib (hila.experiments)
#   bash scripts/setup.sh wheel   the wheel (scripts/wheel.sh): the demo's packages, pip and venv
set -euo pipefail
what=${1:-demo}

debs=(cmake g++ make nlohmann-json3-dev libcli11-dev)
pips=()
case "$what" in
  demo) ;;
  test | python)  # `python`: the name this mode had before
    # clang 16 for the fuzz targets (clang 14 lacks _Float16 on x86-64), with libFuzzer,
    # AddressSanitizer and its OpenMP runtime
    debs+=(libgtest-dev pkg-config python3 python3-pip clang-16 libclang-rt-16-dev libomp-16-dev)
    pips=(numpy safetensors pytest nanobind scikit-build-core torch transformers hypothesis ml_dtypes
          tqdm matplotlib) ;;
  wheel) debs+=(python3 python3-pip python3-venv) ;;
  *) echo "setup.sh: expected demo, test or wheel, got '$what'" >&2; exit 2 ;;
esac

missing=()
for p in "${debs[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  echo "setup: installing Debian packages: ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# Python packages (test only). torch from PyPI brings its CUDA libraries: about 3 minutes and 5 GB
# on a fresh machine.
if ((${#pips[@]})); then
  PY=${PYTHON:-python3}
  mods=(numpy safetensors pytest nanobind scikit_build_core torch transformers hypothesis ml_dtypes
        tqdm matplotlib)
  if ! "$PY" -c "import $(IFS=,; echo "${mods[*]}")" >/dev/null 2>&1; then
    echo "setup: installing Python packages: ${pips[*]}"
    "$PY" -m pip install -q --disable-pip-version-check "${pips[@]}" 2>/dev/null ||
      "$PY" -m pip install -q --disable-pip-version-check --break-system-packages "${pips[@]}"
  fi
fi
