#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Fresh machine -> `hila demo` on the default device (the CPU when there is no GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
exec ./build/hila demo "$@"
