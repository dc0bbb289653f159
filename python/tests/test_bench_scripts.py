# SPDX-License-Identifier: Apache-2.0
"""The benchmark scripts that the GPU runs take their numbers from, run small on the CPU so that
they cannot rot between device calls: bench/dg_accuracy.py (gradient errors against the float64
reference; hila's rows only, without fla), bench/torch_bench.py (its CPU smoke run, and the
kernel targets' table and plot from earlier runs' CSVs) and bench/experiment_step.py (the training
step of hila.experiments' models, timed and profiled)."""
import csv
import importlib.util
import math
import sys
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


def test_torch_bench_cpu_smoke_with_l2norm_times_every_operator(tmp_path, monkeypatch):
    # --l2norm applies to the gdn operators only; the others run as usual in the same call
    monkeypatch.setattr(sys, "argv", ["torch_bench.py", "--device", "cpu", "--quick", "--sections", "train",
                                      "--ops", "gla,hla2,gdn,loglinear_gdn", "--l2norm", "--out", str(tmp_path)])
    _load("torch_bench").main()
    with open(tmp_path / "torch_bench.csv") as f:
        rows = list(csv.DictReader(f))
    timed = {(r["op"], r["direction"]) for r in rows if r["impl"] == "hila_torch" and float(r["ms"]) > 0}
    assert timed == {(op, d) for op in ("gla", "hla2", "gdn", "loglinear_gdn") for d in ("fwd", "fwdbwd")}


def test_torch_bench_targets_form_ratios_within_one_run(tmp_path, monkeypatch, capsys):
    def run(path, cells):
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["section", "op", "B", "T", "direction", "impl", "ms"])
            w.writeheader()
            for (op, impl), ms in cells.items():
                w.writerow(dict(section="train", op=op, B=8, T=4096, direction="fwdbwd", impl=impl, ms=ms))
    run(tmp_path / "a.csv", {("gdn", "hila_torch"): 3.0, ("gdn", "fla_guard_lifted"): 4.0,
                             ("loglinear_gdn", "hila_torch"): 10.0})
    run(tmp_path / "b.csv", {("gla", "hila_torch"): 1.0, ("loglinear", "hila_torch"): 3.0,
                             ("hla2", "hila_torch"): 2.0})  # no fla row here: no hla2 ratio
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["torch_bench.py", "--targets", f"one={tmp_path / 'a.csv'}",
                                      f"two={tmp_path / 'b.csv'}", "--out", str(out)])
    _load("torch_bench").main()
    table = (out / "targets.md").read_text()
    assert "| gdn / fla chunk_gated_delta_rule | one | 8 × 4096 | 3.000 | 4.000 | 0.75× (met) | ≤ 0.8× |" in table
    assert "| loglinear_gdn / fla chunk_gated_delta_rule | one | 8 × 4096 | 10.000 | 4.000 | 2.50× | ≤ 2.0× |" in table
    assert "| loglinear / hila gla | two | 8 × 4096 | 3.000 | 1.000 | 3.00× | ≤ 2.0× |" in table
    assert "hla2" not in table
    assert (out / "targets.png").stat().st_size > 0


def test_torch_bench_kernel_names_and_table():
    tb = _load("torch_bench")
    assert tb.kernel_name("void hila::cuda::gdn::(anonymous namespace)::wy_bwd_kernel<__nv_bfloat16>"
                          "(hila::cuda::GlaArgs<__nv_bfloat16>, WyBwdArgs<__nv_bfloat16>)") == "wy_bwd_kernel"
    assert tb.kernel_name("chunk_gated_delta_rule_fwd_kernel_h_blockdim64") == "chunk_gated_delta_rule_fwd_kernel_h_blockdim64"
    assert tb.kernel_name("Memset (Device)") == "Memset"
    base = dict(section="kernels", op="gdn", B=8, T=4096, direction="fwdbwd", note="n")
    rows = [dict(base, impl="hila_torch", kernel=f"k{i}", launches=1.0, ms=float(i + 1)) for i in range(14)]
    table = tb.tables(rows)
    assert "gdn 8x4096, hila_torch (n): 105.000 ms GPU time" in table
    assert "| k13 | 1 | 14.000 | 13% |" in table  # sorted by time, the largest first
    assert "| 2 others | 2 | 3.000 | 3% |" in table  # k0, k1 folded


def test_torch_bench_kernels_section_skips_without_cuda(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["torch_bench.py", "--device", "cpu", "--quick", "--sections", "kernels",
                                      "--ops", "gdn", "--out", str(tmp_path)])
    _load("torch_bench").main()
    assert "kernels: needs a CUDA device" in capsys.readouterr().err


def test_experiment_step_times_each_mixer_and_finds_hila_in_the_profile(capsys):
    _load("experiment_step").main(["--mixers", "gla,hla2", "--dim", "16", "--seq-len", "64", "--batch", "4",
                                   "--steps", "1", "--top", "3", "--device", "cpu"])
    out, err = capsys.readouterr()
    lines = out.strip().splitlines()
    head = lines[0].split(",")
    rows = [dict(zip(head, line.split(","))) for line in lines[1:]]
    assert [r["mixer"] for r in rows] == ["gla", "hla2"]
    for r in rows:
        assert r["graph_ms"] == ""  # CUDA graphs only on CUDA
        eager, total, own = float(r["eager_ms"]), float(r["profiled_ms"]), float(r["hila_ms"])
        assert eager > 0 and 0 < own < total, r
    assert err.count(" ms  x") == 6  # the --top table: three ops per mixer


def test_experiment_step_rejects_a_bad_size():
    with pytest.raises(SystemExit):
        _load("experiment_step").main(["--dim", "0", "--device", "cpu"])
