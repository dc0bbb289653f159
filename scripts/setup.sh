#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Installs what hila needs to build and test on a fresh Debian/Ubuntu machine:
# the compiler toolchain, GoogleTest, nlohmann-json and CLI11 from Debian packages, and from the
# package index the Python packages of the oracle tests (numpy, safetensors, pytest) and of the
# Python package (nanobind, scikit-build-core to build it; torch to test hila.torch; tqdm and
# matplotlib to test hila.experiments).
# Idempotent: already-installed packages are skipped.
set -euo pipefail

debs=(cmake g++ make libgtest-dev nlohmann-json3-dev libcli11-dev python3 python3-pip)
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

PY=${PYTHON:-python3}
if ! "$PY" -c "import numpy, safetensors, pytest" >/dev/null 2>&1; then
  echo "setup: installing Python packages: numpy safetensors pytest"
  "$PY" -m pip install -q --disable-pip-version-check numpy safetensors pytest 2>/dev/null ||
    "$PY" -m pip install -q --disable-pip-version-check --break-system-packages numpy safetensors pytest
fi
# The Python package's toolchain and test dependencies, only with `setup.sh python` (the test
# command): torch from PyPI brings its CUDA libraries, about 3 minutes and 5 GB on a fresh machine.
if [ "${1:-}" = "python" ] && ! "$PY" -c "import nanobind, scikit_build_core, torch" >/dev/null 2>&1; then
  echo "setup: installing Python packages: nanobind scikit-build-core torch"
  "$PY" -m pip install -q --disable-pip-version-check nanobind scikit-build-core torch 2>/dev/null ||
    "$PY" -m pip install -q --disable-pip-version-check --break-system-packages nanobind scikit-build-core torch
fi
if [ "${1:-}" = "python" ] && ! "$PY" -c "import tqdm, matplotlib" >/dev/null 2>&1; then
  echo "setup: installing Python packages: tqdm matplotlib"
  "$PY" -m pip install -q --disable-pip-version-check tqdm matplotlib 2>/dev/null ||
    "$PY" -m pip install -q --disable-pip-version-check --break-system-packages tqdm matplotlib
fi
