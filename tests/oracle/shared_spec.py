# SPDX-License-Identifier: Apache-2.0
"""Optional: an external copy of the specification oracles (verify_hla.py, verify_loglinear.py),
used only by test_shared_spec.py to cross-check hila's own oracles (package `oracles`) against
them. Nothing else in the test suites needs it.

The directory is ``$HILA_SPEC_DIR`` if set, else ``<repo>/../shared/spec``. When it (or an oracle
file) is missing, ``vh`` and ``vl`` are None and ``UNAVAILABLE`` holds the reason.
"""
import importlib.util
import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def spec_dir() -> Path:
    env = os.environ.get("HILA_SPEC_DIR")
    return Path(env) if env else (REPO_ROOT.parent / "shared" / "spec")


def _load(path: Path, name: str):
    s = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(s)
    s.loader.exec_module(mod)
    return mod


vh = vl = None
UNAVAILABLE = None
_dir = spec_dir()
try:
    if not _dir.is_dir():
        raise FileNotFoundError(f"directory {_dir} does not exist (set HILA_SPEC_DIR)")
    for f in ("verify_hla.py", "verify_loglinear.py"):
        if not (_dir / f).is_file():
            raise FileNotFoundError(f"{_dir / f} is missing")
    vh = _load(_dir / "verify_hla.py", "hila_shared_verify_hla")
    vl = _load(_dir / "verify_loglinear.py", "hila_shared_verify_loglinear")
except Exception as exc:  # noqa: BLE001 - any failure to load them means "no cross-check"
    vh = vl = None
    UNAVAILABLE = str(exc)
