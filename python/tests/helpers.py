# SPDX-License-Identifier: Apache-2.0
"""Shared helpers of the Python suite: hila calls on the oracle suite's problems (tests/oracle
cases.py inputs, in the CLI's tensor names), the device probe of the torch tests and their float64
inputs with initial states."""
import functools

import numpy as np
import pytest

import hila

STATE_KEYS = ("pos", "S", "P", "H")


def options(p):
    """hila keyword options of an oracle Problem."""
    return dict(scale=p.scale, normalize=p.normalize, eps=p.eps, ridge=p.ridge, qk_l2norm=p.qk_l2norm)


def state_from(inp, prefix):
    """A hila.State from the CLI tensors `prefix`.pos/S/P/H (None when there are none)."""
    parts = [inp.get(f"{prefix}.{k}") for k in STATE_KEYS]
    return None if all(x is None for x in parts) else hila.State(*parts)


def state_to(out, prefix, st):
    for k, x in zip(STATE_KEYS, st if st is not None else ()):
        if x is not None:
            out[f"{prefix}.{k}"] = host(x)


def call_kwargs(inp, convert=lambda x: x):
    kw = {name: convert(inp[name]) for name in ("lam", "beta", "cu_seqlens") if name in inp}
    init = state_from(inp, "h0")
    if init is not None:
        kw["initial_state"] = hila.State(*(None if x is None else convert(x) for x in init))
    return kw


def assert_rel_close(a, b, tol):
    """a and b (torch tensors) of one shape, a finite and max|a - b| / max|b| <= tol."""
    assert a.shape == b.shape, (a.shape, b.shape)
    assert bool(a.isfinite().all())
    err = (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)
    assert err <= tol, f"relative error {err:.2e} > {tol:.0e}"


def assert_switch(switch, default):
    """switch(on) sets a process-wide flag and returns its previous value; checked both ways,
    `default` last, and the flag restored afterwards."""
    prev = switch(not default)
    try:
        assert switch(default) is (not default)
        assert switch(prev) is default
    finally:
        switch(prev)


def torch_gen(seed):
    """A CPU torch.Generator seeded with `seed`."""
    import torch
    return torch.Generator().manual_seed(seed)


def host(x):
    """A host numpy array of x (numpy, or a torch tensor on any device)."""
    return x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)


def run_forward(p, inp, form, chunk, forward=hila.forward, convert=lambda x: x):
    """hila forward of oracle problem p; outputs named as the oracle's (o, ht.*)."""
    o, fin = forward(p.op, convert(inp["q"]), convert(inp["k"]), convert(inp["v"]),
                     convert(inp["g"]) if "g" in inp else None, output_final_state=True,
                     form=form, chunk=chunk or 64, **call_kwargs(inp, convert), **options(p))
    out = {"o": host(o)}
    state_to(out, "ht", fin)
    return out


def run_backward(p, inp, form, chunk):
    """hila.backward of oracle problem p; gradients named as the oracle's (dq, ..., dh0.*)."""
    dfin = state_from(inp, "dht")
    gr = hila.backward(p.op, inp["q"], inp["k"], inp["v"], inp.get("g"), do=inp["do"],
                       d_final_state=dfin, form=form, chunk=chunk or 64, **call_kwargs(inp),
                       **options(p))
    out = {n: getattr(gr, n) for n in ("dq", "dk", "dv", "dg", "dlam", "dbeta")
           if getattr(gr, n) is not None}
    state_to(out, "dh0", gr.d_initial_state)
    return out


@functools.lru_cache(maxsize=None)
def device_problem(device, op, form="chunk", chunk=64):
    """None when hila runs `op` in that form on torch device `device`, else why not (the
    HilaError text): the CUDA backend covers a subset of operators, forms and chunk sizes."""
    import torch
    if device == "cuda" and not torch.cuda.is_available():
        return "torch sees no CUDA device"
    t = hila.op_traits(op)
    B, T, H, d = 1, 3, 1, 4
    z = lambda *s: torch.full(s, 0.5, device=device)  # noqa: E731
    kw = {}
    if t["loglinear"]:
        kw["lam"] = z(B, T, H, 3)
    if t["delta"]:
        kw["beta"] = z(B, T, H)
    try:
        from hila.torch import forward
        forward(op, z(B, T, H, d), z(B, T, H, d), z(B, T, H, d), -z(B, T, H), form=form, chunk=chunk, **kw)
    except hila.HilaError as exc:
        return f"hila cannot run {op} (form {form}, chunk {chunk}) on {device}: {exc}"
    return None


def require_device(device, op="gla", form="chunk", chunk=64):
    why = device_problem(device, op, form, chunk)
    if why:
        pytest.skip(why)


def chunk_for(device, cpu_chunk, op="gla"):
    """Small chunks (several per test sequence) on the CPU, and on CUDA for the GLA family (any
    power of two up to 64 there); the CUDA log-linear and delta kernels' fixed chunk of 64."""
    if device == "cpu":
        return cpu_chunk
    t = hila.op_traits(op)
    return 64 if t["loglinear"] or t["delta"] else cpu_chunk


def torch_inputs(op, device, B=2, T=7, G=1, H=2, dk=3, dv=2, untied=False, seed=0, n0=None):
    """Torch inputs of a call of `op` on `device`: float64 leaves requiring grad (g kept <= -0.05
    so that perturbations stay valid gates), plus an initial state at positions n0 whose dead
    Fenwick slots are masked: (inputs, [pos, S, P, H] or None, mask of H's live slots or None)."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    t = hila.op_traits(op)
    r = lambda *s, lo=None, hi=None: (torch.rand(*s, generator=gen, dtype=torch.float64) * (hi - lo) + lo  # noqa: E731
                                      if lo is not None else torch.randn(*s, generator=gen, dtype=torch.float64))
    x = dict(q=r(B, T, G, dk), k=r(B, T, G, dk) / dk ** 0.5, v=r(B, T, H, dv),
             g=r(*((B, T, H, t["num_primitives"]) if untied else (B, T, H)), lo=-0.4, hi=-0.05))
    n0 = n0 or [0] * B
    if t["loglinear"]:
        x["lam"] = r(B, T, H, hila.levels_needed(0, max(n0) + T), lo=-0.5, hi=1.5)
    if t["delta"]:
        x["beta"] = r(B, T, H, lo=0.1, hi=1.0)
    x = {k: v.to(device).requires_grad_() for k, v in x.items()}
    state, mask = None, None
    if any(n0):
        shapes = hila.state_part_shapes(op, B, H, dk, dv, slots=hila.state_slots(max(n0)))
        parts = [None if s is None else (0.5 * r(*s)).to(device).requires_grad_() for s in shapes[1:]]
        state = [torch.tensor(n0, device=device)] + parts
        if t["loglinear"]:
            mask = torch.zeros(shapes.H[:3] + (1, 1), dtype=torch.float64, device=device)
            for i, n in enumerate(n0):
                for lvl in range(1, int(n).bit_length() + 1):
                    if (n >> (lvl - 1)) & 1:
                        mask[i, :, lvl] = 1
    return x, state, mask
