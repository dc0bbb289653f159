# SPDX-License-Identifier: Apache-2.0
"""Gradient accuracy of hila and fla in one run, on the same inputs: the relative error (max-norm,
max |x - ref| / max |ref|) of o, dq, dk, dv, dg (and dbeta for gdn) against a float64 reference,
hila's CPU chunk form in float64 on the same bf16-rounded inputs.

    python bench/dg_accuracy.py [--ops gla,gdn] [--Ts 1024,4096,65536] [--H 4] [--d 128]
                                [--gates logsig16|g1em3] [--device cuda]

gla is compared with fla's chunk_simple_gla, gdn with fla's chunk_gated_delta_rule (q and k
l2-normalised before rounding, so neither side normalises). Inputs: q, k, v, dO ~ N(0, 1) (q, k
times d^-1/2 for gla), rounded to bf16; log-gates g = logsigmoid(randn) / 16 or -1e-3 (fp32); beta
= sigmoid(randn). CSV rows on stdout:
    impl,op,B,T,H,d,gates,o,dq,dk,dv,dg,dbeta,dg_ratio
dg_ratio = err(dg) / max(err(dq), err(dk), err(dv)), the ratio hila's CUDA tests bound by 1.5.
fla's gated backward is refused on Hopper with Triton < 3.7.1 because that compiler produces wrong
gradients there; the guard is then lifted (bench/anchors.py, fla_impl) and the rows say
impl=fla_guard_lifted: such errors describe that build, not fla's algorithm. Without fla (or
with --device cpu, a smoke run of the script itself) only hila's rows are printed.
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F

import hila.torch as ht


def make_inputs(op, B, T, H, d, gates, seed):
    """float64 inputs on the CPU, q/k/v/dO already rounded to bf16 values."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    q, k, v, do = r(B, T, H, d), r(B, T, H, d), r(B, T, H, d), r(B, T, H, d)
    if op == "gdn":
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    else:
        q, k = q * d**-0.5, k * d**-0.5
    q, k, v, do = [x.bfloat16().double() for x in (q, k, v, do)]
    g = F.logsigmoid(r(B, T, H)) / 16 if gates == "logsig16" else torch.full((B, T, H), -1e-3, dtype=torch.float64)
    g = g.float().double()  # the fp32 gates both implementations take
    beta = torch.sigmoid(r(B, T, H)).bfloat16().double() if op == "gdn" else None
    return dict(q=q, k=k, v=v, g=g, beta=beta, do=do)


def run(fn, x, dtype, device):
    """fn(q, k, v, g, beta) -> o on copies of x; returns o and the gradients (float64, CPU)."""
    leaves = {n: (x[n].to(device, torch.float32 if n == "g" and dtype != torch.float64 else dtype)
                  .detach().requires_grad_()) for n in ("q", "k", "v", "g", "beta") if x[n] is not None}
    o = fn(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves.get("beta"))
    o.backward(x["do"].to(device, o.dtype))
    out = {"o": o.detach().double().cpu()}
    out.update({"d" + n: t.grad.double().cpu() for n, t in leaves.items()})
    return out


def hila_fn(op, d):
    def fn(q, k, v, g, beta):
        return ht.forward(op, q, k, v, g, beta=beta, scale=d**-0.5, check_values=False)[0]
    return fn


def fla_fn(op, d):
    if op == "gla":
        from fla.ops.simple_gla import chunk_simple_gla
        return lambda q, k, v, g, beta: chunk_simple_gla(q, k, v, g, scale=d**-0.5)[0]
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    return lambda q, k, v, g, beta: chunk_gated_delta_rule(q, k, v, g, beta, scale=d**-0.5)[0]


def errors(got, ref):
    e = {n: ((got[n] - ref[n]).abs().max() / ref[n].abs().max().clamp_min(1e-300)).item() for n in ref}
    e["dg_ratio"] = e["dg"] / max(e["dq"], e["dk"], e["dv"])
    return e


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ops", default="gla,gdn")
    ap.add_argument("--Ts", default="1024,4096,65536")
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--H", type=int, default=4)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--gates", default="logsig16", choices=["logsig16", "g1em3"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=7)
    a = ap.parse_args(argv)
    impls = [("hila", hila_fn)]
    if a.device == "cuda":
        try:
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            from anchors import fla_impl
            impls.append((fla_impl(), fla_fn))
        except ImportError as e:
            print(f"# fla not importable ({e}): hila rows only", file=sys.stderr)
    cols = ["o", "dq", "dk", "dv", "dg", "dbeta", "dg_ratio"]
    print("impl,op,B,T,H,d,gates," + ",".join(cols), flush=True)
    for op in a.ops.split(","):
        for T in (int(t) for t in a.Ts.split(",")):
            x = make_inputs(op, a.B, T, a.H, a.d, a.gates, a.seed)
            ref = run(hila_fn(op, a.d), x, torch.float64, "cpu")  # the CPU chunk form in float64
            for impl, make in impls:
                e = errors(run(make(op, a.d), x, torch.bfloat16, a.device), ref)
                vals = ",".join(f"{e[c]:.3e}" if c in e else "" for c in cols)
                print(f"{impl},{op},{a.B},{T},{a.H},{a.d},{a.gates},{vals}", flush=True)
                if a.device == "cuda":
                    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
