#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Host cost of a tiny training step on the CPU: ``hila.torch.forward`` + ``torch.autograd.grad``
next to a causal ``torch.nn.functional.scaled_dot_product_attention`` forward + backward on
tensors of the same size (docs/PERFORMANCE.md, "CPU: tiny calls").

Per operator: q, k, v float32 [B, T, H, d] (SDPA: [B, H, T, d]), gates and the operator's other
inputs (lam, beta) as hila.torch takes them, every input requiring grad; one step is the forward
and the gradients of all inputs for a random cotangent of o. hila runs as a user calls it
(chunk form, ``check_values`` on) and, in the column ``nocheck``, with ``check_values=False``.
The two are timed in alternating blocks (so both see the same machine load), per call with
``time.perf_counter``, after a warm-up; the table gives medians in microseconds per step.

Threads: ``--threads 0`` (default) leaves torch and OpenMP as a user has them; ``--threads N``
sets OMP_NUM_THREADS before torch and hila load and ``torch.set_num_threads(N)``. Without
``--threads``, both runs are made (the second in a subprocess with 1 thread).

    python bench/cpu_tiny_bench.py                       # default threads, then 1 thread
    python bench/cpu_tiny_bench.py --threads 1 --ops gla --reps 5000
    HILA_TORCH_CPP=0 python bench/cpu_tiny_bench.py      # the Python road of the plain call
    python bench/cpu_tiny_bench.py --device cuda --threads 0   # on a GPU (each step synchronised)

hila.torch.forward's plain call runs on the C++ road (hila._torch_ops) where that module was
built; the header line says which road ran (docs/PYTHON.md, "The C++ road of the plain call").
"""
import argparse
import os
import subprocess
import sys


def parse():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", default="gla,hla2,loglinear,gdn")
    ap.add_argument("--shape", default="1x64x2x16", help="B x T x H x d")
    ap.add_argument("--reps", type=int, default=3000, help="timed steps per implementation")
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--block", type=int, default=50, help="steps per alternating block")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda: each step then ends with a synchronisation")
    return ap.parse_args()


def main():
    args = parse()
    if args.threads is None:  # both thread settings, each in a clean process
        for n in (0, 1):
            cmd = [sys.executable, __file__, "--threads", str(n)] + [
                a for a in sys.argv[1:]]
            sys.stdout.flush()
            subprocess.run(cmd, check=True)
        return
    if args.threads > 0:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import time
    import statistics

    import torch
    import hila
    import hila.torch as ht
    import torch.nn.functional as F

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    B, T, H, d = (int(x) for x in args.shape.lower().split("x"))
    gen = torch.Generator().manual_seed(0)
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def rnd(*s, lo=None, hi=None):
        x = torch.randn(*s, generator=gen) if lo is None else torch.rand(*s, generator=gen) * (hi - lo) + lo
        return x.to(dev).requires_grad_()

    sq = [rnd(B, H, T, d) for _ in range(3)]
    sdo = torch.randn(B, H, T, d, generator=gen).to(dev)

    def sdpa_step():
        o = F.scaled_dot_product_attention(*sq, is_causal=True)
        torch.autograd.grad(o, sq, sdo)
        sync()

    def hila_step_fn(op, check_values):
        t = hila.op_traits(op)
        x = dict(q=rnd(B, T, H, d) * d ** -0.5, k=rnd(B, T, H, d) * d ** -0.5, v=rnd(B, T, H, d),
                 g=rnd(B, T, H, lo=-0.1, hi=0.0))
        if t["loglinear"]:
            x["lam"] = rnd(B, T, H, hila.levels_needed(0, T), lo=0.25, hi=1.5)
        if t["delta"]:
            x["beta"] = rnd(B, T, H, lo=0.0, hi=1.0)
        x = {k: v.detach().requires_grad_() for k, v in x.items()}
        leaves = list(x.values())
        do = torch.randn(B, T, H, d, generator=gen).to(dev)

        def step():
            o, _ = ht.forward(op, **x, check_values=check_values)
            torch.autograd.grad(o, leaves, do)
            sync()
        return step

    def timed(fns, reps):
        """Alternating blocks of each fn; per-call times (us) per fn."""
        out = [[] for _ in fns]
        clock = time.perf_counter
        for _ in range(0, reps, args.block):
            for i, fn in enumerate(fns):
                ts = out[i]
                for _ in range(args.block):
                    t0 = clock()
                    fn()
                    ts.append((clock() - t0) * 1e6)
        return [statistics.median(ts) for ts in out]

    import hila.torch.ops as hops
    road = "C++ (hila._torch_ops)" if hops._CPP[0] is not None else f"Python ({hops._CPP_WHY or 'cpp_road off'})"
    print(f"# shape B x T x H x d = {args.shape}, float32, {dev}, torch {torch.__version__}, "
          f"torch threads {torch.get_num_threads()}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, "
          f"{args.reps} steps (median), plain call's road: {road}")
    print(f"{'op':<10} {'hila_us':>9} {'nocheck_us':>10} {'sdpa_us':>9} {'ratio':>6}")
    for op in args.ops.split(","):
        fns = [hila_step_fn(op, True), hila_step_fn(op, False), sdpa_step]
        for fn in fns:
            for _ in range(args.warmup):
                fn()
        h, hn, s = timed(fns, args.reps)
        print(f"{op:<10} {h:9.1f} {hn:10.1f} {s:9.1f} {h / s:6.2f}", flush=True)


if __name__ == "__main__":
    main()
