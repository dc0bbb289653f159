# SPDX-License-Identifier: Apache-2.0
"""hila.torch custom ops: values against the oracles, float64 gradcheck (inputs and states, also
through a decode step), torch.library.opcheck, device handling and errors."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import hila  # noqa: E402
import hila.torch as ht  # noqa: E402
from helpers import chunk_for, device_problem, require_device, run_forward  # noqa: E402
from helpers import torch_inputs as _inputs  # noqa: E402

OPS = hila.OPS
LOGLINEAR = tuple(op for op in OPS if hila.op_traits(op)["loglinear"])


@pytest.mark.parametrize("op", OPS)
def test_forward_matches_oracle(oracles, op, device):
    """torch.ops.hila.forward on `device` (float64) with a varlen batch and initial states."""
    chunk = chunk_for(device, 8, op)
    require_device(device, op, "chunk", chunk)
    cases, _ = oracles
    p = cases.Problem(op, lens=(7, 0, 150), n0=(3, 9, 40))
    conv = lambda x: torch.from_numpy(np.array(x)).to(device)  # noqa: E731
    out = run_forward(p, cases.make_inputs(p), "chunk", chunk, forward=ht.forward, convert=conv)
    out = {k: v.cpu().numpy() if isinstance(v, torch.Tensor) else v for k, v in out.items()}
    cases.compare(out, cases.expected_forward(p), lambda _: cases.FWD_TOL, where=p.label())


# ----------------------------------------------------------------------------- gradcheck

def _gradcheck(fn, leaves):
    assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=False)


GRAD_CASES = [(op, dict()) for op in OPS]
GRAD_CASES += [(op, dict(n0=[5, 13] if op in LOGLINEAR else [3, 6])) for op in OPS]
GRAD_CASES += [(op, dict(untied=True, n0=[2, 6])) for op in ("hla2", "ahla", "hla3", "loglinear_hla3")]
GRAD_CASES += [("hla2", dict(normalize=True)), ("loglinear_hla2", dict(ridge=0.3, n0=[4, 9])),
               ("gdn", dict(qk_l2norm=True, n0=[2, 3])), ("loglinear_gdn", dict(qk_l2norm=True)),
               ("hla3", dict(G=2, H=4, scale=0.8)), ("gla", dict(form="serial")),
               ("loglinear", dict(form="scan")), ("ahla", dict(form="naive"))]


@pytest.mark.parametrize("op,case", GRAD_CASES, ids=lambda c: c if isinstance(c, str) else
                         "-".join(f"{k}={v}" for k, v in c.items()) or "plain")
def test_gradcheck(op, case, device):
    """float64 gradcheck of o and the final state w.r.t. q, k, v, g, lam, beta and the initial
    state (chunk size 4 so that several chunks are crossed)."""
    case = dict(case)
    form = case.pop("form", "chunk")
    chunk = chunk_for(device, 4, op)
    require_device(device, op, form, chunk)
    opts = {k: case.pop(k) for k in ("normalize", "ridge", "qk_l2norm", "scale") if k in case}
    x, state, mask = _inputs(op, device, **case)
    names = list(x)
    leaves = list(x.values()) + ([s for s in state[1:] if s is not None] if state else [])
    if opts.get("normalize"):  # a well-conditioned denominator: nonnegative features
        x["q"].data.abs_(), x["k"].data.abs_()

    def fn(*args):
        kw = dict(zip(names, args[:len(names)]))
        init = None
        if state:
            it = iter(args[len(names):])
            parts = [None if s is None else next(it) for s in state[1:]]
            if mask is not None:
                parts[2] = parts[2] * mask
            init = hila.State(state[0], *parts)
        o, fin = ht.forward(op, **kw, initial_state=init, output_final_state=True, form=form,
                            chunk=chunk, **opts)
        return (o,) + tuple(p for p in fin[1:] if p is not None)

    _gradcheck(fn, leaves)


@pytest.mark.parametrize("op", ("hla2", "hla3", "loglinear", "loglinear_gdn"))
def test_gradcheck_step(op, device):
    """the decode step is differentiable: o and the new state w.r.t. the token and the state."""
    require_device(device, op, "serial")
    x, state, mask = _inputs(op, device, T=1, n0=[5, 11])
    tok = {k: v[:, 0].detach().requires_grad_() for k, v in x.items()}
    names, parts = list(tok), [s for s in state[1:] if s is not None]

    def fn(*args):
        kw = dict(zip(names, args[:len(names)]))
        it = iter(args[len(names):])
        st = [None if s is None else next(it) for s in state[1:]]
        if mask is not None:
            st[2] = st[2] * mask
        o, new = ht.step(op, **kw, state=hila.State(state[0], *st))
        return (o,) + tuple(p for p in new[1:] if p is not None)

    _gradcheck(fn, list(tok.values()) + parts)


def test_gradcheck_varlen(device):
    chunk = chunk_for(device, 4, "loglinear_hla2")
    require_device(device, "loglinear_hla2", "chunk", chunk)
    x, _, _ = _inputs("loglinear_hla2", device, B=1, T=12)
    cu = torch.tensor([0, 5, 5, 12], device=device)
    names = list(x)
    _gradcheck(lambda *a: ht.forward("loglinear_hla2", **dict(zip(names, a)), cu_seqlens=cu,
                                     output_final_state=True, chunk=chunk)[1].H, list(x.values()))


def test_gradients_flow_into_bfloat16_inputs(device):
    require_device(device, "hla2")
    x, _, _ = _inputs("hla2", device, T=20)
    xb = {k: v.detach().to(torch.bfloat16).requires_grad_() if k != "g" else v for k, v in x.items()}
    o, _ = ht.forward("hla2", **xb)
    assert o.dtype == torch.bfloat16
    o.float().square().sum().backward()
    assert xb["q"].grad.dtype == torch.bfloat16 and torch.isfinite(xb["q"].grad.float()).all()
    assert x["g"].grad.dtype == torch.float64


# ----------------------------------------------------------------------------- opcheck

def _opcheck_forward_cases(device):
    x, state, _ = _inputs("hla3", device, n0=[3, 6])
    y, _, _ = _inputs("loglinear_gdn", device, B=1, T=9)
    cu = torch.tensor([0, 4, 9], device=device)
    # the host copies of the initial positions and of cu_seqlens (CPU tensors beside device ones)
    hla3 = (x["q"], x["k"], x["v"], x["g"], None, None, None, *state,
            "hla3", "chunk", 4, 0.0, False, 1e-6, 0.0, False, True, True, 1, None, state[0].cpu())
    gdn = (y["q"], y["k"], y["v"], y["g"], y["lam"], y["beta"], cu, None, None, None, None,
           "loglinear_gdn", "chunk", 4, 0.5, False, 1e-6, 0.0, True, True, True, 5, cu.cpu(), None)
    return {"hla3-state": hla3, "loglinear_gdn-varlen": gdn}


@pytest.mark.parametrize("which", ("hla3-state", "loglinear_gdn-varlen"))
def test_opcheck_forward(which, device):
    require_device(device, "hla3" if which.startswith("hla3") else "loglinear_gdn", "chunk", 4)
    torch.library.opcheck(torch.ops.hila.forward.default, _opcheck_forward_cases(device)[which])


def test_opcheck_backward(device):
    require_device(device, "loglinear_hla2", "chunk", 4)
    x, state, mask = _inputs("loglinear_hla2", device, n0=[3, 6])
    x = {k: v.detach() for k, v in x.items()}
    state = [s if s is None else s.detach() for s in state]
    state[3] = state[3] * mask
    do = torch.randn_like(x["v"])
    dS = torch.randn_like(state[1])
    dH = torch.zeros(2, 2, hila.state_slots(13), 3, 2, dtype=torch.float64, device=device)
    torch.library.opcheck(torch.ops.hila.backward.default, (
        x["q"], x["k"], x["v"], x["g"], x["lam"], None, None, *state, do, dS, None, dH,
        "loglinear_hla2", "chunk", 4, 0.0, False, 1e-6, 0.0, False, True, None, state[0].cpu()))


def test_opcheck_forward_pool(device):
    """the pooled forward (state_indices, the pool written in place) as a custom op"""
    require_device(device, "loglinear", "chunk", 4)
    y, _, _ = _inputs("loglinear", device, B=1, T=9)
    cu = torch.tensor([0, 4, 9], device=device)
    pool = ht.allocate_state_pool("loglinear", 3, 2, 3, 2, max_len=16, dtype=torch.float64, device=device)
    idx = torch.tensor([2, 0], dtype=torch.int32, device=device)
    torch.library.opcheck(torch.ops.hila.forward_pool_.default, (
        *(y[k].detach() for k in ("q", "k", "v", "g", "lam")), None, cu, idx, *pool,
        "loglinear", "chunk", 4, 0.0, False, 1e-6, 0.0, False, True, cu.cpu(), None))


@pytest.mark.parametrize("op", ("ahla", "loglinear"))
def test_opcheck_step(op, device):
    require_device(device, op, "serial")
    x, _, _ = _inputs(op, device, T=1)
    st = ht.zero_state(op, 2, 2, 3, 2, max_len=16, dtype=torch.float64, device=device)
    tok = [x[k][:, 0] if k in x else None for k in ("q", "k", "v", "g", "lam", "beta")]
    torch.library.opcheck(torch.ops.hila.step.default, (*tok, *st, op, 0.0, False, 1e-6, 0.0, False, True))


# ----------------------------------------------------------------------------- devices and errors

def test_device_support(device):
    """A device this build runs gives results; any other raises HilaError naming the argument."""
    z = torch.full((1, 2, 1, 2), 0.5, device=device)
    why = device_problem(device, "gla")
    if why is None:
        o, _ = ht.forward("gla", z, z, z)
        assert o.device == z.device and torch.isfinite(o).all()
        return
    with pytest.raises(hila.HilaError) as e:
        ht.forward("gla", z, z, z)
    assert e.value.argument, str(e.value)
    if "no CUDA backend" in str(e.value):
        assert e.value.argument == "q", str(e.value)


def test_meta_tensors_use_the_fake_kernels():
    q = torch.empty(2, 9, 1, 4, device="meta")
    v = torch.empty(2, 9, 3, 5, device="meta")
    o, fin = ht.forward("loglinear_hla3", q, q, v, torch.empty(2, 9, 3, device="meta"),
                        lam=torch.empty(2, 9, 3, 4, device="meta"), output_final_state=True)
    assert o.shape == v.shape and fin.S.shape == (2, 3, 10) and fin.P.shape == (2, 3, 4, 5)
    assert fin.H.shape == (2, 3, hila.state_slots(9), 4, 5) and fin.pos.dtype == torch.int64


def test_torch_states_beyond_the_memory_limit_are_refused(monkeypatch):
    """zero_state and a forward's final state: the parts together against hila's limit, before
    torch allocates (each part alone fits: 2 x 0.75 GiB under a 1 GiB limit)."""
    monkeypatch.setenv("HILA_MAX_MEMORY", "1G")
    with pytest.raises(hila.HilaError) as e:
        ht.zero_state("ahla", 3 * 2**16, 1, 32, 32)
    assert e.value.argument == "state", str(e.value)
    q = torch.zeros(2**20, 0, 1, 4096)
    with pytest.raises(hila.HilaError) as e:
        ht.forward("gla", q, q, q, output_final_state=True)
    assert e.value.argument == "final_state", str(e.value)


def test_fla_head_first_with_a_wrong_rank_is_a_named_error():
    import hila.torch.fla as fla
    q = torch.randn(1, 1, 1, 2, dtype=torch.float64)
    with pytest.raises(hila.HilaError) as e:
        fla.chunk_simple_gla(q, q, q, -torch.rand(1, 1, dtype=torch.float64), head_first=True)
    assert e.value.argument == "g", str(e.value)


@pytest.mark.parametrize("call, arg", [
    (lambda t: ht.forward("loglinear", t, t, t, lam=torch.ones(1, 4, 1, 3), output_final_state=True,
                          final_slots=-1), "final_slots"),
    (lambda t: ht.forward("gla", t, t, t, chunk=2**64), "chunk"),
    (lambda t: ht.forward("gla", t, t, t, chunk=None), "chunk"),
    (lambda t: ht.forward("gla", t, t, t, form=None), "form"),
    (lambda t: ht.forward("hla2", t, t, t, initial_state=ht.zero_state("hla2", 1, 1, 4, 4, device="meta")),
     "initial_state.pos"),
    (lambda t: ht.zero_state("gla", 1, float("nan"), 4, 4), "H"),
    (lambda t: ht.zero_state("gla", 2**63 - 1, 1, 4, 4), "state"),
    (lambda t: ht.zero_state("gla", 1, -7, 4, 4), "state"),
    (lambda t: ht.zero_state("gla", 1, 1, 4, 4, dtype=torch.float16), "dtype"),
    (lambda t: ht.zero_state(3, 1, 1, 4, 4), "op"),
    # the custom-op road (q on meta): options and devices checked before torch's schema check, and a
    # CPU tensor next to a meta q is not run through the shape function (uninitialized output)
    (lambda t: ht.forward("gla", t.to("meta"), t, t), "k"),
    (lambda t: ht.forward("gla", *[t.to("meta")] * 3, chunk="3"), "chunk"),
    (lambda t: ht.forward("gla", *[t.to("meta")] * 3, eps="x"), "eps"),
    (lambda t: ht.step("gla", *[t[:, 0].to("meta")] * 3, state=ht.zero_state("gla", 1, 1, 4, 4)), "state.pos"),
    (lambda t: ht.step_("gla", *[t[:, 0].to("meta")] * 3, state=ht.zero_state("gla", 1, 1, 4, 4)), "state.pos"),
])
def test_torch_careless_arguments_are_hila_errors(call, arg):
    """Options and states a careless caller passes: HilaError naming them, never torch's or
    nanobind's TypeError / RuntimeError, DLPack's BufferError (meta tensors) or a huge allocation."""
    with pytest.raises(hila.HilaError) as e:
        call(torch.zeros(1, 4, 1, 4))
    assert e.value.argument == arg, str(e.value)


def test_torch_errors():
    x, _, _ = _inputs("loglinear", "cpu")
    with pytest.raises(hila.HilaError, match="argument 'lam'") as e:
        ht.forward("loglinear", x["q"], x["k"], x["v"], x["g"])
    assert e.value.argument == "lam"
    with pytest.raises(hila.HilaError) as e:
        ht.forward("loglinear", **x, form="bogus")
    assert e.value.argument == "form"
    with pytest.raises(hila.HilaError) as e:
        ht.step("loglinear", x["q"][:, 0], x["k"][:, 0], x["v"][:, 0], state=None)
    assert e.value.argument == "state"
    st = ht.zero_state("loglinear", 2, 2, 3, 2, max_len=3)  # capacity for 3 tokens
    st = st._replace(pos=torch.tensor([3, 0]))
    with pytest.raises(hila.HilaError, match="slots") as e:
        ht.step("loglinear", *(x[k][:, 0].detach().float() for k in ("q", "k", "v", "g")), state=st,
                lam=x["lam"][:, 0].detach())
    assert e.value.argument == "state_out.H"
    with torch.no_grad():
        o, _ = ht.forward("loglinear", **{k: v.detach() for k, v in x.items()})
    assert o.shape == x["v"].shape
