# SPDX-License-Identifier: Apache-2.0
"""pytest configuration of the oracle suite.

    python -m pytest -q tests/oracle --hila-bin build/hila      (or env HILA_BIN)

The float64 oracles are the package `oracles` beside this file. HILA_SPEC_DIR optionally names an
external copy of the specification oracles for the cross-check in test_shared_spec.py.
"""
import os
import sys
from pathlib import Path

# the oracles invert and multiply small matrices: OpenBLAS threading only slows them down
for _v in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import pytest

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

import shared_spec  # noqa: E402

# The optional cross-check is not collected at all without the external oracles, so that a run
# without them has no skipped tests; the reason is printed in the header and the summary.
collect_ignore = ["test_shared_spec.py"] if shared_spec.UNAVAILABLE else []


def pytest_addoption(parser):
    parser.addoption("--hila-bin", action="store", default=None,
                     help="path of the hila executable (default: env HILA_BIN, then <repo>/build/hila)")


def _hila_path(config):
    p = config.getoption("--hila-bin") or os.environ.get("HILA_BIN")
    return Path(p) if p else REPO_ROOT / "build" / "hila"


def _crosscheck_line():
    if shared_spec.UNAVAILABLE:
        return f"cross-check against external specification oracles not run: {shared_spec.UNAVAILABLE}"
    return f"cross-check against external specification oracles in {shared_spec.spec_dir()}"


def pytest_report_header(config):
    return [f"hila binary: {_hila_path(config)}", f"oracles: {HERE / 'oracles'}", _crosscheck_line()]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    terminalreporter.write_line(_crosscheck_line(), yellow=bool(shared_spec.UNAVAILABLE))
    if not _hila_path(config).exists():
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
