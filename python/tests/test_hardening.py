# SPDX-License-Identifier: Apache-2.0
"""The numpy API on edge cases and hostile use: T = 0 arrays, ml_dtypes bfloat16, wrong argument
types (always HilaError naming the argument, never nanobind's TypeError), decode states shared
between threads, views kept across growth, the position bound, resets and non-finite outputs."""
import threading

import numpy as np
import pytest

import hila

RNG = np.random.default_rng(0)


def _qkv(B=1, T=8, dk=4, dv=4, dtype=np.float32):
    return (RNG.standard_normal((B, T, 1, dk)).astype(dtype), RNG.standard_normal((B, T, 1, dk)).astype(dtype),
            RNG.standard_normal((B, T, 1, dv)).astype(dtype))


def _tok(dk=4, dv=4, dtype=np.float32, rng=None):
    rng = RNG if rng is None else rng
    return (rng.standard_normal((1, 1, dk)).astype(dtype), rng.standard_normal((1, 1, dk)).astype(dtype),
            rng.standard_normal((1, 1, dv)).astype(dtype))


def test_t0_numpy_arrays_work():
    """numpy 2 gives zero-size arrays all-zero strides: accepted like the CLI accepts T = 0."""
    q = np.zeros((2, 0, 1, 4), np.float32)
    for op in ("gla", "hla2", "loglinear", "gdn"):
        extra = {}
        if hila.op_traits(op)["loglinear"]:
            extra["lam"] = np.zeros((2, 0, 1, 1), np.float32)
        if hila.op_traits(op)["delta"]:
            extra["beta"] = np.zeros((2, 0, 1), np.float32)
        o, fin = hila.forward(op, q, q, q, output_final_state=True, **extra)
        assert o.shape == (2, 0, 1, 4)
        assert (fin.pos == 0).all()
        g = hila.backward(op, q, q, q, do=o, **extra)
        assert g.dq.shape == q.shape


def test_ml_dtypes_bfloat16_arrays_are_accepted():
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes is installed by scripts/setup.sh python")
    q, k, v = _qkv()
    qb, kb, vb = (x.astype(ml_dtypes.bfloat16) for x in (q, k, v))
    o, _ = hila.forward("hla2", qb, kb, vb)
    assert o.dtype == ml_dtypes.bfloat16
    ref, _ = hila.forward("hla2", *(x.astype(np.float32) for x in (qb, kb, vb)))
    np.testing.assert_allclose(o.astype(np.float32), ref, rtol=0, atol=2e-2 * np.abs(ref).max())
    grads = hila.backward("gla", qb, kb, vb, do=o)
    assert grads.dq.dtype == ml_dtypes.bfloat16 and np.isfinite(grads.dq.astype(np.float32)).all()
    st = hila.DecodeState("gla", 1, 1, 4, 4)
    out = st.step(*(x.astype(ml_dtypes.bfloat16) for x in _tok()))
    assert out.dtype == ml_dtypes.bfloat16


@pytest.mark.parametrize("call, arg", [
    (lambda q: hila.forward("gla", q, q, "abc"), "v"),
    (lambda q: hila.forward("gla", q, q, {"a": 1}), "v"),
    (lambda q: hila.forward("gla", q, q, q.astype(np.complex64)), "v"),
    (lambda q: hila.forward("gla", q, q, q, chunk="64"), "chunk"),
    (lambda q: hila.forward("gla", q, q, q, form=3), "form"),
    (lambda q: hila.forward("gla", q, q, q, stream="x"), "stream"),
    (lambda q: hila.forward("gla", q, q, q, initial_state=5), "initial_state"),
    (lambda q: hila.backward("gla", q, q, q, do=[["x"]]), "do"),
    (lambda q: hila.DecodeState("gla", "2", 1, 4, 4), "batch"),
    (lambda q: hila.DecodeState("gla", 1, 1, 4, 4.5), "dv"),
    (lambda q: hila.DecodeState("gla", 1, 1, 4, 4).reserve("x"), "max_pos"),
    (lambda q: hila.DecodeState("gla", 1, 1, 4, 4).position("a"), "seq"),
    (lambda q: hila.DecodeState("gla", 1, 1, 4, 4).step(q[:, 0], q[:, 0], "v"), "v"),
    (lambda q: hila.DecodeState("gla", 1, 1, 4, 4).load(3), "state"),
])
def test_wrong_types_are_hila_errors(call, arg):
    q = np.zeros((1, 4, 1, 4), np.float32)
    with pytest.raises(hila.HilaError) as e:
        call(q)
    assert e.value.argument == arg, str(e.value)


@pytest.mark.parametrize("op", ["gla", "loglinear", "loglinear_gdn"])
def test_threads_stepping_one_decode_state_lose_nothing(op):
    """8 threads x 100 steps of one state: every step lands. The inputs are valid for every
    operator whatever order the tests run in: seeded per thread, and for the delta rule unit keys
    (qk_l2norm) with beta 0.5, so beta |k|^2 = 0.5 keeps the state contractive (the value checks
    would reject a diverging output)."""
    t = hila.op_traits(op)
    st = hila.DecodeState(op, 1, 1, 4, 4, qk_l2norm=t["delta"])
    errors = []

    def worker(seed):
        q, k, v = _tok(rng=np.random.default_rng(seed))
        extra = {}
        if t["loglinear"]:
            extra["lam"] = np.ones((1, 1, 16), np.float32)
        if t["delta"]:
            extra["beta"] = np.full((1, 1), 0.5, np.float32)
        try:
            for _ in range(100):
                st.step(q, k, v, np.full((1, 1), -0.01, np.float32), **extra)
        except Exception as e:  # noqa: BLE001 - any error fails the test below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    assert st.position(0) == 800


def test_step_inplace_on_a_shared_state_loses_nothing():
    st = hila.State(np.zeros(1, np.int64), None, None, np.zeros((1, 1, 4, 4), np.float32))

    def worker():
        q, k, v = _tok()
        for _ in range(125):
            hila.step_("gla", q, k, v, state=st)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert int(st.pos[0]) == 1000


def test_views_survive_growth():
    """A view of a log-linear state kept across steps that grow its Fenwick slots: readable and
    writable without touching freed memory (the arrays keep the old block alive)."""
    st = hila.DecodeState("loglinear", 1, 1, 4, 4)
    lam = np.ones((1, 1, 12), np.float32)
    q, k, v = _tok()
    st.step(q, k, v, lam=lam)
    view = st.view()
    snapshot = view.H.copy()
    for _ in range(300):
        st.step(q, k, v, lam=lam)
    assert st.slots > view.H.shape[2]
    np.testing.assert_array_equal(view.H, snapshot)
    view.H[...] = 1.0  # lands in the old block
    assert np.isfinite(st.state().H).all() and not (st.state().H == 1.0).all()


def test_positions_keep_the_bound_of_forward():
    st = hila.DecodeState("gla", 1, 1, 4, 4)
    H = np.zeros((1, 1, 4, 4), np.float32)
    for bad in (2**62 + 1, 2**63 - 1):
        with pytest.raises(hila.HilaError, match="2\\^62"):
            st.load(hila.State(np.array([bad], np.int64), None, None, H))
    st.load(hila.State(np.array([2**62], np.int64), None, None, H))
    with pytest.raises(hila.HilaError) as e:
        st.step(*_tok())
    assert e.value.argument == "state.pos"
    assert st.position(0) == 2**62
    with pytest.raises(hila.HilaError) as e:
        st.reserve(-1)
    assert e.value.argument == "max_pos"


def test_float32_state_rejects_float64_inputs():
    st = hila.DecodeState("gla", 1, 1, 4, 4, dtype="float32")
    with pytest.raises(hila.HilaError) as e:
        st.step(*_tok(dtype=np.float64))
    assert e.value.argument == "state"


def test_outputs_aliasing_inputs_are_rejected():
    q, k, v = _qkv()
    o, fin = hila.forward("gla", q, k, v, output_final_state=True)
    with pytest.raises(hila.HilaError) as e:
        hila.step_("gla", q[:, 0], k[:, 0], v[:, 0], state=hila.State(fin.pos, None, None, q[:, :4].reshape(1, 1, 4, 4)))
    assert e.value.argument.startswith("state.")


@pytest.mark.parametrize("gval", [-np.inf, -1e30])
def test_reset_gates_match_serial(gval):
    q, k, v = _qkv(T=32, dtype=np.float64)
    g = np.full((1, 32, 1), -0.05)
    g[0, 5, 0] = g[0, 20, 0] = gval
    ref, _ = hila.forward("hla3", q, k, v, g, form="serial")
    for form in ("naive", "chunk", "scan"):
        o, _ = hila.forward("hla3", q, k, v, g, form=form, chunk=8)
        np.testing.assert_allclose(o, ref, rtol=0, atol=1e-12 * np.abs(ref).max())
    grads = hila.backward("hla3", q, k, v, g, do=np.ones_like(v), chunk=8)
    assert grads.dg[0, 5, 0] == 0 and grads.dg[0, 20, 0] == 0


def test_non_finite_outputs_raise():
    q, k, v = _qkv(T=16)
    with pytest.raises(hila.HilaError, match="scale") as e:
        hila.forward("gla", q, k, v, scale=1e308)
    assert e.value.argument == "o"
    with pytest.raises(hila.HilaError, match="delta rule"):
        hila.forward("gdn", q, k, v, beta=np.full((1, 16, 1), 1e30, np.float32))
    with pytest.raises(hila.HilaError) as e:
        hila.forward("hla2", q, k, v, normalize=True, eps=0.0)
    assert e.value.argument == "eps"


_Q = np.zeros((1, 4, 1, 4), np.float32)
_T = np.zeros((1, 1, 4), np.float32)
_LAM = np.ones((1, 4, 1, 3), np.float32)


def _ll_state():
    return hila.State(np.array([3], np.int64), None, None, np.zeros((1, 1, 3, 4, 4), np.float32))


@pytest.mark.parametrize("call, arg", [
    # introspection: nanobind's TypeError and out-of-range ints never escape
    (lambda: hila.state_slots(2**64), "n"),
    (lambda: hila.state_slots("x"), "n"),
    (lambda: hila.levels_needed(-1, None), "T"),
    (lambda: hila.supports(None, "chunk"), "op"),
    (lambda: hila.supports("gla", None), "form"),
    (lambda: hila.supports("gla", "chunk", []), "backward"),
    (lambda: hila.op_traits(3), "op"),
    (lambda: hila.state_shape("gla", 2**64, 1, 4, 4, 0), "N"),
    (lambda: hila.state_part_shapes("gla", float("nan"), 1, 4, 4), "N"),
    (lambda: hila.state_part_shapes("gla", 1, 1, 4, 4, slots=-1), "slots"),
    (lambda: hila.config("gla", scale=2**1100), "scale"),
    # slot counts of new states: never a negative or a 64 TiB numpy allocation
    (lambda: hila.forward("loglinear", _Q, _Q, _Q, lam=_LAM, output_final_state=True, final_slots=-1), "final_slots"),
    (lambda: hila.forward("loglinear", _Q, _Q, _Q, lam=_LAM, output_final_state=True, final_slots=2**40),
     "final_slots"),
    (lambda: hila.forward("loglinear", _Q, _Q, _Q, lam=_LAM, output_final_state=True, final_slots="x"),
     "final_slots"),
    (lambda: hila.step("loglinear", _T, _T, _T, lam=np.ones((1, 1, 4), np.float32), state=_ll_state(), out_slots=-1),
     "out_slots"),
    (lambda: hila.forward("gla", _Q, _Q, _Q, output_final_state=True, cu_seqlens=np.array([], np.int64)),
     "cu_seqlens"),
    (lambda: hila.forward("gla", _Q, _Q, _Q, output_final_state=True, cu_seqlens=[0, 2**70]), "cu_seqlens"),
    (lambda: hila.forward("gla", _Q, _Q, _Q, chunk=2**63), "chunk"),
    (lambda: hila.backward("gla", _Q, _Q, _Q, do=_Q, form=None), "form"),
    (lambda: hila.forward("gla", _Q.astype(">f4"), _Q, _Q), "q"),
    (lambda: hila.forward("gla", _Q, _Q, _Q, stream=-1), "stream"),
    (lambda: hila.DecodeState("gla", 2**64, 1, 4, 4), "batch"),
    (lambda: hila.DecodeState("gla", 1, 1, 4, 4).position(2**70), "seq"),
    (lambda: hila.DecodeState("gla", 1, 1, 4, 4).load(None), "state"),
    (lambda: hila.DecodeState("gla", 1, 1, 4, 4).step(_T, _T, _T, stream=-2**63), "stream"),
    (lambda: hila.DecodeState.from_state("gla", None), "state.H"),
    (lambda: hila.DecodeState.from_state("gla", np.zeros(3)), "state"),
])
def test_careless_arguments_are_hila_errors_naming_them(call, arg):
    with pytest.raises(hila.HilaError) as e:
        call()
    assert e.value.argument == arg, str(e.value)


def test_supports_takes_numpy_bools():
    assert hila.supports("gla", "chunk", np.bool_(True)) is True


@pytest.mark.parametrize("op", ["gla", "hla2", "loglinear", "gdn"])
def test_step_that_overflows_the_state_is_an_error(op):
    """q = 0 keeps o finite while k v^T = 1e60 overflows the float32 state: the value checks cover
    the state a step wrote (DecodeState.step and step_), as they cover forward's final state."""
    t = hila.op_traits(op)
    z, x = np.zeros((1, 1, 4), np.float32), np.full((1, 1, 4), 1e30, np.float32)
    extra = {}
    if t["loglinear"]:
        extra["lam"] = np.ones((1, 1, 4), np.float32)
    if t["delta"]:
        extra["beta"] = np.full((1, 1), 0.5, np.float32)
    part = "state.S" if t["has_S"] else "state.H"
    with pytest.raises(hila.HilaError, match="not finite") as e:
        hila.DecodeState(op, 1, 1, 4, 4).step(z, x, x, **extra)
    assert e.value.argument == part
    st = hila.DecodeState(op, 1, 1, 4, 4).state()
    with pytest.raises(hila.HilaError, match="not finite") as e:
        hila.step_(op, z, x, x, state=st, **extra)
    assert e.value.argument == part


@pytest.mark.parametrize("op", ["gla", "loglinear_gdn"])
def test_outputs_beyond_the_memory_limit_are_refused_before_allocation(op, monkeypatch):
    """T = 0 with huge B, H, dk, dv: the final state would take TiBs. Refused by name against
    hila's limit before numpy allocates (never a MemoryError, never a touched [B] temporary)."""
    monkeypatch.setenv("HILA_MAX_MEMORY", "1G")
    t = hila.op_traits(op)
    B, H = 2**31, 4
    q, v = np.zeros((B, 0, 1, 1024), np.float32), np.zeros((B, 0, H, 4096), np.float32)
    extra = {}
    if t["loglinear"]:
        extra["lam"] = np.zeros((B, 0, H, 1), np.float32)
    if t["delta"]:
        extra["beta"] = np.zeros((B, 0, H), np.float32)
    with pytest.raises(hila.HilaError) as e:
        hila.forward(op, q, q, v, output_final_state=True, **extra)
    assert e.value.argument == "final_state", str(e.value)
    q = np.zeros((1, 0, 1, 1024), np.float32)
    with pytest.raises(hila.HilaError) as e:  # a million empty sequences
        hila.forward("gla", q, q, q, cu_seqlens=np.zeros(10**6 + 1, np.int64), output_final_state=True)
    assert e.value.argument == "final_state", str(e.value)
