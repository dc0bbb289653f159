# SPDX-License-Identifier: Apache-2.0
"""pytest configuration of the Python package's suite.

    python -m pytest -q python/tests              (after `pip install .`)

The float64 numpy oracles are the repository's own (``tests/oracle/oracles``), used through the
oracle suite's modules in ``tests/oracle`` (reference.py, cases.py), so both suites compare against
the same reference. The torch tests are skipped (reason printed) without torch.

Torch tests are parametrized by ``device``: the CPU, and CUDA when torch sees a GPU
(``HILA_TEST_DEVICES=cpu,cuda`` overrides). On a device that this build of hila cannot run, the
numerical tests skip (reason printed) and the device-error test checks the HilaError instead.
"""
import os
import sys
from pathlib import Path

for _v in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):  # the oracles multiply tiny matrices
    os.environ.setdefault(_v, "1")

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
ORACLE_DIR = REPO / "tests" / "oracle"
sys.path.insert(0, str(ORACLE_DIR))
sys.path.insert(0, str(Path(__file__).resolve().parent))

try:
    import torch  # noqa: F401
    TORCH = None
except ImportError as exc:  # pragma: no cover - depends on the machine
    TORCH = f"torch is not installed ({exc})"


def pytest_report_header(config):
    import hila
    lines = [f"hila {hila.__version__} from {Path(hila.__file__).parent}",
             f"oracles: {ORACLE_DIR / 'oracles'}"]
    if TORCH:
        lines.append(f"torch tests skipped: {TORCH}")
    else:
        import torch
        lines.append(f"torch {torch.__version__}, devices: {', '.join(devices())}")
        import hila.torch.ops as hops
        lines.append("hila.torch plain call: C++ road (hila._torch_ops)" if hops._CPP_OP is not None else
                     f"hila.torch plain call: Python road only, C++ road tests skipped ({hops._CPP_WHY})")
    return lines


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if TORCH:
        terminalreporter.write_line(f"torch tests skipped: {TORCH}", yellow=True)


def pytest_sessionfinish(session, exitstatus):
    # "no tests collected" (exit 5) means the suite did not run: a failure, never a silent pass.
    if exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def devices():
    env = os.environ.get("HILA_TEST_DEVICES")
    if env:
        return [d.strip() for d in env.split(",") if d.strip()]
    import torch
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def pytest_generate_tests(metafunc):
    """Every test taking ``device`` runs on each device of ``devices()``."""
    if "device" in metafunc.fixturenames:
        metafunc.parametrize("device", [] if TORCH else devices())


@pytest.fixture
def oracles():
    """(cases, reference) modules of tests/oracle."""
    import cases
    import reference
    return cases, reference
