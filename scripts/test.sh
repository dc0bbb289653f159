#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Fresh machine -> every test: GoogleTest suites, `hila verify`, and the numpy-oracle tests of
# the CLI, all through CTest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
cd build
ctest --output-on-failure -j"$(nproc)" "$@"
