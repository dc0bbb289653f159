#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Fresh machine -> every test: GoogleTest suites, `hila verify`, and the numpy-oracle tests of
# the CLI, all through CTest; then the Python package, installed with pip and tested with pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh python
bash scripts/build.sh
(cd build && ctest --output-on-failure -j"$(nproc)" "$@")

PY=${PYTHON:-python3}
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} PIP_ROOT_USER_ACTION=ignore
"$PY" -m pip install -q --disable-pip-version-check --no-build-isolation ./ 2>/dev/null ||
  "$PY" -m pip install -q --disable-pip-version-check --no-build-isolation --break-system-packages ./
"$PY" -m pytest -q python/tests
