# SPDX-License-Identifier: Apache-2.0
"""hila.ops (the numpy-level functional API) against the float64 numpy oracles, the decode API,
the size helpers and the errors. Needs numpy only (no torch)."""
import numpy as np
import pytest

import hila
from helpers import run_backward, run_forward

OPS = hila.OPS
HLA = ("hla2", "ahla", "hla3", "loglinear_hla2", "loglinear_ahla", "loglinear_hla3")
LOGLINEAR = tuple(op for op in OPS if hila.op_traits(op)["loglinear"])
FORWARD_FORMS = (("naive", None), ("serial", None), ("chunk", 16), ("scan", 8))


def backward_forms(op):
    return [(f, c) for f, c in (("naive", None), ("chunk", 16), ("serial", None))
            if hila.supports(op, f, backward=True)]


def check(oracles, p, out, backward=False):
    cases, _ = oracles
    exp = dict(cases.expected_forward(p)) if not backward else dict(cases.expected_backward(p))
    cases.compare(out, exp, lambda name: cases.BWD_TOL if backward else cases.FWD_TOL,
                  where=f"[{p.label()}]")


# ----------------------------------------------------------------------------- forward

@pytest.mark.parametrize("form,chunk", FORWARD_FORMS, ids=lambda x: str(x))
@pytest.mark.parametrize("op", OPS)
def test_forward_every_op_and_form(oracles, op, form, chunk):
    """T = 37 (not a multiple of the chunk), B = 2, GQA G = 2 < H = 4; o and the final state."""
    cases, _ = oracles
    p = cases.Problem(op, T=37)
    check(oracles, p, run_forward(p, cases.make_inputs(p), form, chunk))


def _option_problems():
    from cases import Problem
    out = [Problem(op, T=21, untied=True) for op in HLA]
    out += [Problem(op, T=21, normalize=True, positive=True, eps=1e-3) for op in HLA]
    out += [Problem(op, T=21, ridge=0.3) for op in ("hla2", "loglinear_hla2")]
    out += [Problem(op, T=21, qk_l2norm=True) for op in ("gdn", "loglinear_gdn")]
    out += [Problem(op, T=21, scale=0.83, G=1) for op in ("gla", "hla3", "loglinear", "gdn")]
    out += [Problem(op, T=21, gated=False) for op in ("hla2", "loglinear_gdn")]
    out += [Problem(op, T=21, extra_levels=2) for op in LOGLINEAR]
    return out


def _params(make):
    """Problems built from tests/oracle/cases.py, with their labels as ids."""
    return [pytest.param(p, id=p.label()) for p in make()]


@pytest.mark.parametrize("p", _params(_option_problems))
@pytest.mark.parametrize("form,chunk", (("chunk", 8), ("serial", None)), ids=("chunk8", "serial"))
def test_forward_options(oracles, p, form, chunk):
    """untied gates, normalize, ridge, qk_l2norm, explicit scale, ungated, extra lam levels."""
    cases, _ = oracles
    check(oracles, p, run_forward(p, cases.make_inputs(p), form, chunk))


def _state_problems():
    from cases import Problem
    out = []
    for op in OPS:
        n0 = 45 if op in LOGLINEAR else 13
        out += [Problem(op, T=20, n0=n0), Problem(op, T=1, n0=n0 + 19)]
        out.append(Problem(op, lens=(0, 17, 3, 1), n0=(5, 0, 64, 100)))
    out += [Problem(op, T=20, n0=9, untied=True) for op in HLA]
    out += [Problem("hla2", T=20, n0=13, normalize=True, positive=True, state="prefix"),
            Problem("loglinear_hla3", T=20, n0=33, normalize=True, positive=True, state="prefix"),
            Problem("loglinear", T=20, n0=13, extra_slots=2)]
    return out


@pytest.mark.parametrize("p", _params(_state_problems))
@pytest.mark.parametrize("form,chunk", (("chunk", 8), ("scan", 4), ("serial", None)),
                         ids=("chunk8", "scan4", "serial"))
def test_forward_states_and_varlen(oracles, p, form, chunk):
    """initial states at arbitrary positions (log-linear: crossing powers of two), T = 1,
    varlen batches with empty sequences and per-sequence positions, extra state slots."""
    cases, _ = oracles
    check(oracles, p, run_forward(p, cases.make_inputs(p), form, chunk))


def test_forward_float32(oracles):
    """float32 inputs compute in float32 (float32 outputs and states), close to the oracle."""
    cases, ref = oracles
    for op in OPS:
        p = cases.Problem(op, T=33, n0=21)
        inp = cases.make_inputs(p)
        out = run_forward(p, inp, "chunk", 16, convert=lambda x: x.astype(np.float32) if x.dtype == np.float64 else x)
        assert out["o"].dtype == np.float32 and out["ht.H"].dtype == np.float32
        exp = cases.expected_forward(p)
        for name in ("o", "ht.H"):
            assert cases.rel_err(*cases._align_slots(out[name].astype(np.float64), exp[name])) < 2e-5, (op, name)


# ----------------------------------------------------------------------------- backward

def _backward_problems():
    from cases import Problem
    out = []
    for op in OPS:
        n0 = 45 if op in LOGLINEAR else 13
        out += [Problem(op, T=21, backward=True), Problem(op, T=21, n0=n0, dht=True, backward=True)]
    out += [Problem(op, T=13, untied=True, n0=6, dht=True, backward=True) for op in HLA]
    out += [Problem("hla2", T=13, normalize=True, positive=True, eps=1e-3, backward=True),
            Problem("loglinear_ahla", T=13, normalize=True, positive=True, eps=1e-3, n0=5,
                    state="prefix", dht=True, backward=True),
            Problem("hla2", T=13, ridge=0.3, n0=4, dht=True, backward=True),
            Problem("gdn", T=13, qk_l2norm=True, n0=3, dht=True, backward=True),
            Problem("loglinear_gdn", lens=(0, 9, 4), n0=(2, 9, 0), dht=True, backward=True),
            Problem("hla3", lens=(5, 0, 11), backward=True),
            Problem("loglinear", T=13, scale=0.7, G=1, backward=True)]
    return out


def _backward_cases():
    return [pytest.param(p, form, id=f"{p.label()}-{form}") for p in _backward_problems()
            for form in ("naive", "chunk", "serial") if hila.supports(p.op, form, backward=True)]


@pytest.mark.parametrize("p,form", _backward_cases())
def test_backward(oracles, p, form):
    """every gradient (q, k, v, g, lam, beta, initial state) against the analytic VJP oracles,
    with final-state cotangents; every form that has a backward (hila.supports)."""
    cases, _ = oracles
    check(oracles, p, run_backward(p, cases.make_inputs(p), form, 8), backward=True)


# ----------------------------------------------------------------------------- decode

def _decode_inputs(op, B=3, T=23, G=1, H=2, dk=5, dv=3, seed=0, levels=None):
    rng = np.random.default_rng(seed)
    t = hila.op_traits(op)
    x = dict(q=rng.standard_normal((B, T, G, dk)), k=rng.standard_normal((B, T, G, dk)) / np.sqrt(dk),
             v=rng.standard_normal((B, T, H, dv)), g=np.log(rng.uniform(0.7, 1.0, (B, T, H))))
    if t["loglinear"]:
        x["lam"] = rng.uniform(-0.5, 1.5, (B, T, H, levels or hila.levels_needed(0, T)))
    if t["delta"]:
        x["beta"] = rng.uniform(0.1, 1.0, (B, T, H))
    return x


def _at(x, sl):
    return {k: v[:, sl] for k, v in x.items()}


@pytest.mark.parametrize("op", OPS)
def test_decode_state_continues_prefill(op):
    """prefill T0 tokens (chunk), then DecodeState.step and the functional hila.step token by
    token: the outputs equal one forward over the whole sequence, the states the final state."""
    x = _decode_inputs(op)
    T, T0 = x["q"].shape[1], 9
    full, fin = hila.forward(op, **x, output_final_state=True, form="naive")
    o0, st0 = hila.forward(op, **_at(x, slice(0, T0)), output_final_state=True)
    np.testing.assert_allclose(o0, full[:, :T0], rtol=0, atol=1e-12)
    dec = hila.DecodeState.from_state(op, st0)
    st = st0
    for t in range(T0, T):
        tok = _at(x, t)
        o_obj = dec.step(**tok)
        o_fun, st = hila.step(op, **tok, state=st)
        np.testing.assert_allclose(o_obj, full[:, t], rtol=0, atol=1e-12)
        np.testing.assert_allclose(o_fun, o_obj, rtol=0, atol=1e-13)
    assert list(dec.positions) == [T] * 3 and list(st.pos) == [T] * 3
    for a, b, c in zip(dec.state(), st, fin):
        if c is None:
            assert a is None and b is None
            continue
        n = c.shape[2] if c.ndim == 5 else None  # log-linear capacity may exceed the final slots
        np.testing.assert_allclose(a[:, :, :n] if n else a, c, rtol=0, atol=1e-12)
        np.testing.assert_allclose(b[:, :, :n] if n else b, c, rtol=0, atol=1e-12)


@pytest.mark.parametrize("op", OPS)
def test_step_inplace_continues_prefill(op):
    """hila.step_ on numpy arrays: the fused step advances the caller's state arrays in place
    (pos included); outputs and final state equal one forward over the whole sequence."""
    x = _decode_inputs(op)
    T, T0 = x["q"].shape[1], 9
    full, fin = hila.forward(op, **x, output_final_state=True, form="naive")
    _, st = hila.forward(op, **_at(x, slice(0, T0)), output_final_state=True, final_slots=hila.state_slots(T))
    arrays = [id(a) for a in st]
    for t in range(T0, T):
        o = hila.step_(op, **_at(x, t), state=st)
        assert isinstance(o, np.ndarray) and o.shape == x["v"][:, t].shape
        np.testing.assert_allclose(o, full[:, t], rtol=0, atol=1e-12)
    assert [id(a) for a in st] == arrays and list(st.pos) == [T] * 3
    for a, c in zip(st, fin):
        if c is None:
            assert a is None
            continue
        n = c.shape[2] if c.ndim == 5 else None
        np.testing.assert_allclose(a[:, :, :n] if n else a, c, rtol=0, atol=1e-12)


@pytest.mark.parametrize("op", ("hla3", "loglinear_hla2", "loglinear_gdn"))
def test_decode_after_varlen_prefill(op):
    """a packed prefill of sequences of different lengths leaves each at its own position; one
    batched decode step then matches each sequence's own forward."""
    x = _decode_inputs(op, B=3, T=20)
    lens = [20, 3, 12]
    packed = {k: np.concatenate([v[i:i + 1, :n] for i, n in enumerate(lens)], 1) for k, v in x.items()}
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    _, st = hila.forward(op, **packed, cu_seqlens=cu, output_final_state=True)
    assert list(st.pos) == lens
    y = _decode_inputs(op, B=3, T=1, seed=7, levels=hila.levels_needed(0, 21))
    dec = hila.DecodeState.from_state(op, st)
    o = dec.step(**_at(y, 0))
    for i, n in enumerate(lens):
        seq = {k: np.concatenate([x[k][i:i + 1, :n], y[k][i:i + 1]], 1) for k in x}
        ref, _ = hila.forward(op, **seq, form="naive")
        np.testing.assert_allclose(o[i], ref[0, -1], rtol=0, atol=1e-12)


def test_decode_state_reserve_and_sizes():
    st = hila.DecodeState("loglinear", 2, 3, 4, 5)
    assert st.slots == 2 and st.dtype == "float32" and st.positions.tolist() == [0, 0]
    st.reserve(1000)
    assert st.slots == hila.state_slots(1000) == 11
    assert st.bytes_per_sequence == 3 * 11 * 4 * 5 * 4 + 8
    assert "loglinear" in repr(st)
    s = st.state()
    assert s.S is None and s.P is None and s.H.shape == (2, 3, 11, 4, 5)


# ----------------------------------------------------------------------------- helpers

@pytest.mark.parametrize("op", OPS)
def test_state_shapes_agree(op):
    for normalize in ((False, True) if hila.op_traits(op)["hla_family"] else (False,)):
        for max_pos in (0, 1, 7, 8, 1000):
            c = hila.state_shape(op, 3, 4, 5, 6, max_pos, normalize=normalize)
            py = hila.state_part_shapes(op, 3, 4, 5, 6, normalize=normalize, slots=hila.state_slots(max_pos))
            assert c == py


def test_sizes_and_support_table():
    assert [hila.state_slots(n) for n in (0, 1, 2, 3, 4, 1 << 20)] == [1, 2, 3, 3, 4, 22]
    assert hila.levels_needed(0, 0) == 0 and hila.levels_needed(0, 16384) == 15
    assert hila.levels_needed(13, 3) == 5
    for op in OPS:
        t = hila.op_traits(op)
        assert t["loglinear"] == op.startswith("loglinear")
        assert all(hila.supports(op, f) for f in hila.FORMS)
        assert not hila.supports(op, "scan", backward=True)
        assert hila.supports(op, "serial", backward=True) == (op in ("gla", "hla2", "ahla", "hla3"))


def test_strided_and_read_only_inputs():
    """inputs with strided outer dimensions (slices) and read-only arrays need no copy."""
    x = _decode_inputs("hla2", B=4, T=30)
    ro = {k: v.copy() for k, v in x.items()}
    for v in ro.values():
        v.setflags(write=False)
    ref, _ = hila.forward("hla2", **{k: np.ascontiguousarray(v[::2, 3:]) for k, v in x.items()})
    got, _ = hila.forward("hla2", **{k: v[::2, 3:] for k, v in ro.items()})
    np.testing.assert_array_equal(got, ref)


def test_torch_tensors_through_the_array_api():
    """hila.forward on torch CPU tensors returns torch tensors (outputs allocated by torch)."""
    torch = pytest.importorskip("torch")
    x = _decode_inputs("loglinear", B=2, T=9)
    o_np, st_np = hila.forward("loglinear", **x, output_final_state=True)
    o_t, st_t = hila.forward("loglinear", **{k: torch.from_numpy(v) for k, v in x.items()},
                             output_final_state=True)
    assert isinstance(o_t, torch.Tensor) and isinstance(st_t.H, torch.Tensor) and st_t.pos.dtype == torch.int64
    np.testing.assert_array_equal(o_t.numpy(), o_np)
    np.testing.assert_array_equal(st_t.H.numpy(), st_np.H)


# ----------------------------------------------------------------------------- errors

def _bad_calls():
    x = _decode_inputs("loglinear", B=2, T=9)
    g = x["g"]
    q, k, v, lam = x["q"], x["k"], x["v"], x["lam"]
    ll = lambda **kw: hila.forward("loglinear", **{**x, **kw})  # noqa: E731
    _, st = hila.forward("loglinear", **x, output_final_state=True)
    y = _decode_inputs("hla2", B=2, T=9)
    nan = q.copy()
    nan[1, 2, 0, 3] = np.nan
    return [
        ("unknown op", "op", lambda: hila.forward("hla4", q, k, v)),
        ("unknown form", "form", lambda: ll(form="blocked")),
        ("chunk not a power of two", "chunk", lambda: ll(chunk=48)),
        ("k shape", "k", lambda: ll(k=k[:, :8])),
        ("v heads not a multiple of G", "v", lambda: hila.forward("gla", q.repeat(2, 2), k.repeat(2, 2),
                                                                 v[:, :, :1].repeat(3, 2))),
        ("integer q", "q", lambda: ll(q=q.astype(np.int32), k=k.astype(np.int32))),
        ("dtype mismatch", "k", lambda: ll(k=k.astype(np.float32))),
        ("positive gate", "g", lambda: ll(g=-g)),
        ("NaN input", "q", lambda: ll(q=nan)),
        ("lam missing", "lam", lambda: hila.forward("loglinear", q, k, v, g)),
        ("too few levels", "lam", lambda: ll(lam=lam[..., :3])),
        ("lam on a plain op", "lam", lambda: hila.forward("gla", q, k, v, g, lam=lam)),
        ("beta missing", "beta", lambda: hila.forward("gdn", q, k, v, g)),
        ("normalize on gla", "normalize", lambda: hila.forward("gla", q, k, v, g, normalize=True)),
        ("ridge on ahla", "ridge", lambda: hila.forward("ahla", **y, ridge=0.1)),
        ("qk_l2norm on hla2", "qk_l2norm", lambda: hila.forward("hla2", **y, qk_l2norm=True)),
        ("zero scale", "scale", lambda: ll(scale=0.0)),
        ("cu_seqlens with B > 1", "cu_seqlens", lambda: ll(cu_seqlens=np.array([0, 4, 9]))),
        ("cu_seqlens not ending at T", "cu_seqlens", lambda: hila.forward(
            "loglinear", **{n: a[:1] for n, a in x.items()}, cu_seqlens=np.array([0, 4, 8]))),
        ("cu_seqlens decreasing", "cu_seqlens", lambda: hila.forward(
            "loglinear", **{n: a[:1] for n, a in x.items()}, cu_seqlens=np.array([0, 5, 4, 9]))),
        ("float cu_seqlens", "cu_seqlens", lambda: hila.forward(
            "loglinear", **{n: a[:1] for n, a in x.items()}, cu_seqlens=np.array([0.0, 9.0]))),
        ("state without pos", "init.pos", lambda: ll(initial_state=st._replace(pos=None))),
        ("state of the wrong shape", "init.H", lambda: ll(initial_state=st._replace(H=st.H[:, :1]))),
        ("non-canonical state", "init.H", lambda: ll(initial_state=st._replace(H=st.H + 1))),
        ("innermost stride", "q", lambda: ll(q=np.asfortranarray(q))),
        ("scan backward", "form", lambda: hila.backward("loglinear", **x, do=v, form="scan")),
        ("do shape", "d_o", lambda: hila.backward("loglinear", **x, do=v[:, :3])),
        ("step state of another op", "state.S", lambda: hila.step("hla2", **_at(y, 0), state=st)),
        ("step with too few levels", "lam", lambda: hila.step("loglinear", **{
            **_at(x, 0), "lam": lam[:, 0, :, :2]}, state=st)),
        ("step q of 4 dims", "q", lambda: hila.step("loglinear", **{**_at(x, 0), "q": q}, state=st)),
        ("step_ state of another op", "state.S", lambda: hila.step_("hla2", **_at(y, 0), state=st)),
        ("step_ state with too few slots", "state.H", lambda: hila.step_("loglinear", **_at(x, 0), state=st._replace(
            pos=np.array([8, 9]), H=st.H[:, :, :4].copy()))),
        ("step_ without state", "state", lambda: hila.step_("loglinear", **_at(x, 0), state=None)),
        ("step_ read-only state", "state.H", lambda: hila.step_("loglinear", **_at(x, 0), state=st._replace(
            H=np.broadcast_to(st.H, st.H.shape)))),
        ("step_ q of 4 dims", "q", lambda: hila.step_("loglinear", **{**_at(x, 0), "q": q}, state=st)),
        ("decode state device", "device", lambda: hila.DecodeState("gla", 1, 1, 2, 2, device="npu:0")),
        ("decode state dtype", "dtype", lambda: hila.DecodeState("gla", 1, 1, 2, 2, dtype="float16")),
        ("decode state sizes", "N/H/dk/dv", lambda: hila.DecodeState("gla", 0, 1, 2, 2)),
        ("decode step shapes", "q", lambda: hila.DecodeState("gla", 3, 2, 5, 3).step(**{
            n: a[:, 0] for n, a in _decode_inputs("gla", B=2, T=1).items()})),
    ]


@pytest.mark.parametrize("what,argument,call", [pytest.param(*c, id=c[0]) for c in _bad_calls()])
def test_bad_input_raises_hila_error(what, argument, call):
    with pytest.raises(hila.HilaError) as e:
        call()
    assert isinstance(e.value, ValueError)
    assert e.value.argument == argument, str(e.value)
    assert str(e.value).startswith(f"hila: argument '{argument}'"), str(e.value)


def test_hila_error_pickles():
    import pickle
    e = pickle.loads(pickle.dumps(hila.HilaError("hila: argument 'q': bad", "q")))
    assert isinstance(e, hila.HilaError) and e.argument == "q" and str(e) == "hila: argument 'q': bad"
