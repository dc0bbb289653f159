# SPDX-License-Identifier: Apache-2.0
"""pytest configuration of the oracle suite.

    python -m pytest -q tests/oracle --hila-bin build/hila      (or env HILA_BIN)
    HILA_SPEC_DIR=/path/to/spec                                  (default: <repo>/../shared/spec)
"""
import os
import sys
from pathlib import Path

# the oracles invert and multiply small matrices: OpenBLAS threading only slows them down
for _v in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import spec  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--hila-bin", action="store", default=None,
                     help="path of the hila executable (default: env HILA_BIN, then <repo>/build/hila)")


def _hila_path(config):
    p = config.getoption("--hila-bin") or os.environ.get("HILA_BIN")
    return Path(p) if p else spec.REPO_ROOT / "build" / "hila"


def pytest_collection_modifyitems(config, items):
    if spec.UNAVAILABLE:
        mark = pytest.mark.skip(reason=spec.UNAVAILABLE)
        for item in items:
            item.add_marker(mark)


def pytest_report_header(config):
    lines = [f"hila binary: {_hila_path(config)}", f"oracles: {spec.spec_dir()}"]
    if spec.UNAVAILABLE:
        lines.append(spec.UNAVAILABLE)
    return lines


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if spec.UNAVAILABLE:
        terminalreporter.write_line(f"oracle suite skipped: {spec.UNAVAILABLE}", yellow=True)
    elif not _hila_path(config).exists():
        terminalreporter.write_line(f"CLI tests skipped: no hila binary at {_hila_path(config)} "
                                    "(pass --hila-bin or set HILA_BIN)", yellow=True)


@pytest.fixture(scope="session")
def hila_bin(request):
    path = _hila_path(request.config)
    if not path.exists():
        if request.config.getoption("--hila-bin") or os.environ.get("HILA_BIN"):
            pytest.fail(f"hila binary {path} does not exist")
        pytest.skip(f"no hila binary at {path} (pass --hila-bin or set HILA_BIN)")
    return path


@pytest.fixture
def hila(hila_bin, tmp_path):
    from hila_cli import Hila
    return Hila(hila_bin, tmp_path)
