# SPDX-License-Identifier: Apache-2.0
"""The benchmark scripts that the GPU runs take their numbers from, run small on the CPU so that
they cannot rot between device calls: bench/dg_accuracy.py (gradient errors against the float64
reference; hila's rows only, without fla)."""
import importlib.util
import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("gates", ["logsig16", "g1em3"])
def test_dg_accuracy_rows_are_bf16_accurate(capsys, gates):
    _load("dg_accuracy").main(["--Ts", "64,130", "--H", "2", "--d", "32", "--gates", gates, "--device", "cpu"])
    lines = capsys.readouterr().out.strip().splitlines()
    head = lines[0].split(",")
    rows = [dict(zip(head, line.split(","))) for line in lines[1:]]
    assert [(r["impl"], r["op"], r["T"]) for r in rows] == [
        ("hila", op, T) for op in ("gla", "gdn") for T in ("64", "130")]
    for r in rows:
        errs = {c: float(r[c]) for c in ("o", "dq", "dk", "dv", "dg") + (("dbeta",) if r["op"] == "gdn" else ())}
        # bf16 inputs and outputs against float64 on the same inputs: about 2^-9; dg is fp32 here
        assert all(math.isfinite(e) and e < 1e-2 for e in errs.values()), r
        assert errs["dg"] < 1e-4, r
