# SPDX-License-Identifier: Apache-2.0
"""pytest configuration of the CLI hardening tests: `--hila-bin PATH` (or env HILA_BIN)."""
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))


def pytest_addoption(parser):
    parser.addoption("--hila-bin", action="store", default=None, help="path of the hila executable")


@pytest.fixture(scope="session")
def hila_bin(request):
    p = request.config.getoption("--hila-bin") or os.environ.get("HILA_BIN")
    path = Path(p) if p else Path(__file__).resolve().parents[2] / "build" / "hila"
    if not path.exists():
        pytest.fail(f"no hila binary at {path} (pass --hila-bin or set HILA_BIN)")
    return path
