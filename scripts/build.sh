#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Configures and builds hila (library, CLI, tests) into build/.
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DHILA_BUILD_TESTS=ON -DHILA_BUILD_CLI=ON >/dev/null
cmake --build build -j"$(nproc)"
