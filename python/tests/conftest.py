# SPDX-License-Identifier: Apache-2.0
"""pytest configuration of the Python package's suite.

    python -m pytest -q python/tests              (after `pip install .`)

The float64 numpy oracles come from ``<repo>/../shared/spec`` (``HILA_SPEC_DIR`` overrides), loaded
through the oracle suite's own modules in ``tests/oracle`` (spec.py, reference.py, cases.py), so
both suites compare against the same reference. Without the oracles the tests that need them are
skipped with the reason printed; the torch tests are skipped (reason printed) without torch.

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
sys.path.insert(0, str(REPO / "tests" / "oracle"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import spec  # noqa: E402  (tests/oracle/spec.py: locates and loads the oracles)

try:
    import torch  # noqa: F401
    TORCH = None
except ImportError as exc:  # pragma: no cover - depends on the machine
    TORCH = f"torch is not installed ({exc})"


def pytest_report_header(config):
    import hila
    lines = [f"hila {hila.__version__} from {Path(hila.__file__).parent}",
             f"oracles: {spec.spec_dir()}" + (f" -- {spec.UNAVAILABLE}" if spec.UNAVAILABLE else "")]
    if TORCH:
        lines.append(f"torch tests skipped: {TORCH}")
    else:
        import torch
        lines.append(f"torch {torch.__version__}, devices: {', '.join(devices())}")
    return lines


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    for why in (spec.UNAVAILABLE, TORCH and f"torch tests skipped: {TORCH}"):
        if why:
            terminalreporter.write_line(why, yellow=True)


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
    """(cases, reference) modules of tests/oracle; skips when the oracles are unavailable."""
    if spec.UNAVAILABLE:
        pytest.skip(spec.UNAVAILABLE)
    import cases
    import reference
    return cases, reference
