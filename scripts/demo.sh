#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Fresh machine -> `hila demo` on the default device (the CPU when there is no GPU). Builds only the
# library and the CLI; CUDA only for a GPU that is present (scripts/build.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh demo
bash scripts/build.sh demo
exec ./build/hila demo "$@"
