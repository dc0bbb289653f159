# SPDX-License-Identifier: Apache-2.0
"""Host time of one ``hila.torch.step_`` decode call, on the CPU, next to the C++ ``hila::step``.

The tensors are tiny (N = 1 sequence, H = 1 head, dk = dv = 8, the shapes of bench/host_bench.cpp),
so the arithmetic is negligible and what is timed is the host path of a call: the Python side of
``step_`` (options, the state's bound and counters), the extension (arguments, o, locks) and the
library's validation and dispatch, on each road of the decode step (``road``: ``cpp``,
hila._torch_ops.step_ on the tensors, where that module was built; ``dlpack``, hila._C over DLPack
capsules with the state bound once; docs/PYTHON.md). Rows (CSV on stdout)::

    op,road,impl,ns_per_call

* ``step_``          ``hila.torch.step_(op, q, k, v, g, ..., state=st)`` with default arguments
* ``step_nocheck``   the same with ``check_values=False`` (what a CUDA step defaults to)
* ``python``         the ``step_nocheck`` call with the extension's step replaced by a no-op:
  the Python part alone
* ``cpp_step``       ``hila::step`` on a caller-owned state (build/hila_host_bench ``step``
  rows, check_values off; road ``-``), when ``--host-bench`` names the binary

Every number is the median over ``--reps`` batches of ``--iters`` calls. Positions are rewound
between batches (a log-linear state has the Fenwick slots of ``--iters`` steps).

Run: python bench/step_host_bench.py [--ops gla,hla2,loglinear,gdn,loglinear_gdn]
     [--host-bench build/hila_host_bench] [--reps 15] [--iters 2000]
"""
import argparse
import csv
import os
import statistics
import subprocess
import sys
import time

import torch

import hila
import hila.torch as ht

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_bench import extension_steps_off  # noqa: E402

N, H, D = 1, 1, 8


def inputs(op: str, steps: int):
    t = hila.op_traits(op)
    g = torch.Generator().manual_seed(0)
    tok = dict(q=torch.randn(N, H, D, generator=g) * D ** -0.5, k=torch.randn(N, H, D, generator=g) * D ** -0.5,
               v=torch.randn(N, H, D, generator=g), g=torch.full((N, H), -0.1))
    if t["loglinear"]:
        tok["lam"] = torch.full((N, H, hila.levels_needed(0, steps + 1)), 0.5)
    if t["delta"]:
        tok["beta"] = torch.full((N, H), 0.3)
    st = ht.zero_state(op, N, H, D, D, max_len=steps + 1)
    return tok, st


def time_ns(call, st, reps: int, iters: int) -> float:
    """Median ns per call over reps batches of iters calls; the state's positions and values are
    reset (in place) between batches, so every batch steps from position 0."""
    parts = [x for x in st if x is not None]
    res = []
    with torch.no_grad():
        for _ in range(reps):
            for x in parts:
                x.zero_()
            t0 = time.thread_time_ns()
            for _ in range(iters):
                call()
            res.append((time.thread_time_ns() - t0) / iters)
    return statistics.median(res)


def python_part(call, st, reps: int, iters: int) -> float:
    """ns per call with the extension's step (hila._torch_ops.step_; hila._C.step_inplace and
    BoundState.step) a no-op."""
    with extension_steps_off(st):
        return time_ns(call, st, reps, iters)


def cpp_rows(exe: str, ops, reps: int, iters: int) -> dict:
    out = subprocess.run([exe, "--reps", str(reps), "--iters", str(iters), "--ops", ",".join(ops)],
                         check=True, capture_output=True, text=True).stdout
    return {r["op"]: float(r["ns_per_call"]) for r in csv.DictReader(out.splitlines())
            if r["what"] == "step" and r["check_values"] == "0"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", default="gla,hla2,loglinear,gdn,loglinear_gdn")
    ap.add_argument("--host-bench", default=None, help="build/hila_host_bench, for the cpp_step rows")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--iters", type=int, default=2000)
    a = ap.parse_args()
    ops = a.ops.split(",")
    torch.set_num_threads(1)
    cpp = cpp_rows(a.host_bench, ops, a.reps, a.iters) if a.host_bench else {}
    import hila.torch.ops as hops
    roads = ("cpp", "dlpack") if hops._CPP_STEP is not None else ("dlpack",)
    w = csv.writer(sys.stdout)
    w.writerow(["op", "road", "impl", "ns_per_call"])
    prev = ht.cpp_road(False)
    try:
        for op in ops:
            for road in roads:
                ht.cpp_road(road == "cpp")
                tok, st = inputs(op, a.iters)
                rows = [("step_", lambda: ht.step_(op, **tok, state=st)),
                        ("step_nocheck", lambda: ht.step_(op, **tok, state=st, check_values=False))]
                for impl, call in rows:
                    w.writerow([op, road, impl, f"{time_ns(call, st, a.reps, a.iters):.0f}"])
                    sys.stdout.flush()
                w.writerow([op, road, "python", f"{python_part(rows[1][1], st, a.reps, a.iters):.0f}"])
            if op in cpp:
                w.writerow([op, "-", "cpp_step", f"{cpp[op]:.0f}"])
            sys.stdout.flush()
    finally:
        ht.cpp_road(prev)
    return 0


if __name__ == "__main__":
    sys.exit(main())
