# SPDX-License-Identifier: Apache-2.0
"""Host time of the pieces of one decode step on a CUDA device, in loops without synchronisation.

For each operator (N = 1 sequence, H heads of d, bf16 token, fp32 state from ``zero_state``, so with
its step counters), µs per call over ``--iters`` calls after 50 of warm-up, the device synchronised
before and after each loop (so a call costs its host time wherever the GPU keeps up, as in a decode
loop). Rows (CSV on stdout)::

    op,what,host_us

* ``step_``                      ``hila.torch.step_(op, ..., state=st, check_values=False)``
* ``step_ out=``                 the same writing into a kept ``out=`` buffer
* ``_torch_ops.step_``           the C++ road's function alone (o made in C++)
* ``_torch_ops.step_ out``       the same with the kept buffer
* ``BoundState.step caps once``  hila._C's bound-state step with the DLPack capsules made once:
  the library's StateView step (validation, lock, launch) and one nanobind call
* ``dlpack step_ out=``          ``step_`` with ``out=`` on the DLPack road (``cpp_road(False)``)
* ``torch.empty_like``           one allocation of o from Python

Run: python bench/step_pieces.py [--ops gla,gdn,hla2] [--H 16] [--d 128] [--iters 3000]
"""
import argparse
import time

import torch

import hila
import hila.torch as ht
import hila.torch.ops as hops


def per_call_us(fn, iters):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / iters * 1e6


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ops", default="gla,gdn,hla2")
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--iters", type=int, default=3000)
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("step_pieces: needs a CUDA device")
    T = hops._CPP_STEP
    dev, H, d = "cuda", a.H, a.d
    print("op,what,host_us")
    for op in a.ops.split(","):
        t = hila.op_traits(op)
        st = ht.zero_state(op, 1, H, d, d, max_len=10 ** 6, device=dev)
        bf = dict(device=dev, dtype=torch.bfloat16)
        q, k, v = (torch.randn(1, H, d, **bf) for _ in range(3))
        g = torch.full((1, H), -0.01, device=dev)
        lam = torch.rand(1, H, hila.levels_needed(0, 10 ** 6), **bf) if t["loglinear"] else None
        beta = torch.rand(1, H, **bf) if t["delta"] else None
        tok = dict(q=q, k=k, v=v, g=g, lam=lam, beta=beta)
        o = torch.empty_like(v)
        r = {}
        with torch.no_grad():
            for _ in range(5):
                ht.step_(op, **tok, state=st, check_values=False)
            spec, plan = hops._STEP_SPECS[(op, None, False, 1e-6, 0.0, False, False)]
            pos, S, P, Hs = st
            cnt = st.__dict__.get(hops._COUNTERS)
            cnt = cnt if isinstance(cnt, tuple) else (None, None)
            r["step_"] = per_call_us(lambda: ht.step_(op, **tok, state=st, check_values=False), a.iters)
            r["step_ out="] = per_call_us(lambda: ht.step_(op, **tok, state=st, check_values=False, out=o), a.iters)
            if T is not None and plan >= 0:
                r["_torch_ops.step_"] = per_call_us(
                    lambda: T(plan, q, k, v, g, lam, beta, pos, S, P, Hs, -1, cnt[0], None), a.iters)
                r["_torch_ops.step_ out"] = per_call_us(
                    lambda: T(plan, q, k, v, g, lam, beta, pos, S, P, Hs, -1, cnt[0], o), a.iters)
            prev = ht.cpp_road(False)
            try:
                for _ in range(3):
                    ht.step_(op, **tok, state=st, check_values=False)
                bound = hops._bound_state(st, pos, S, P, Hs)
                caps = [None if x is None else hops._lent(x) for x in (q, k, v, g, lam, beta)]
                stream, optr = hops._stream(q), o.data_ptr()
                if bound is not None:
                    r["BoundState.step caps once"] = per_call_us(
                        lambda: bound.step(spec.cfg, *caps, optr, stream, -1, counters=cnt[1]), a.iters)
                r["dlpack step_ out="] = per_call_us(
                    lambda: ht.step_(op, **tok, state=st, check_values=False, out=o), a.iters)
            finally:
                ht.cpp_road(prev)
            r["torch.empty_like"] = per_call_us(lambda: torch.empty_like(v), a.iters)
        for what, us in r.items():
            print(f"{op},{what},{us:.2f}", flush=True)


if __name__ == "__main__":
    main()
