# SPDX-License-Identifier: Apache-2.0
"""Property-based fuzzing of the Python API (Hypothesis): random operators, forms, shapes (zero
sizes included), dtypes, strides, gates (resets: -inf and huge negative values), options and
deliberately wrong arguments. Properties:

* every call ends in a result or a HilaError naming an argument: never another exception type, a
  crash or a hang;
* with value checks on, a result is finite, and the chunk, scan and naive forms agree with the
  serial form (relative 2e-5 in float32, 1e-10 in float64, resets included);
* decode steps on a DecodeState equal the forward over the same tokens.

Examples per test: HYPOTHESIS_EXAMPLES (default 60); `HYPOTHESIS_EXAMPLES=2000 pytest ...` for a
longer campaign (docs/DEVELOPING.md, Fuzzing).
"""
import os

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is installed by scripts/setup.sh python")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import hila  # noqa: E402

EXAMPLES = int(os.environ.get("HYPOTHESIS_EXAMPLES", "60"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=os.environ.get("CI") == "true",
                    suppress_health_check=list(HealthCheck))


def _expect_hila_error_or_result(fn):
    try:
        return fn()
    except hila.HilaError as e:
        assert e.argument is None or isinstance(e.argument, str)
        return None


@st.composite
def problems(draw):
    op = draw(st.sampled_from(hila.OPS))
    t = hila.op_traits(op)
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    B = draw(st.integers(0, 2))
    T = draw(st.integers(0, 20))
    G = draw(st.integers(1, 2))
    H = G * draw(st.integers(1, 2))
    dk = draw(st.integers(1, 5))
    dv = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    scale = 1 / np.sqrt(dk)
    q = (rng.standard_normal((B, T, G, dk)) * scale).astype(dtype)
    k = (rng.standard_normal((B, T, G, dk)) * scale).astype(dtype)
    v = rng.standard_normal((B, T, H, dv)).astype(dtype)
    g = rng.uniform(np.log(0.7), 0, (B, T, H)).astype(dtype)
    # resets and huge negative gates at random tokens
    n_resets = draw(st.integers(0, 3))
    for _ in range(n_resets):
        if B and T:
            val = draw(st.sampled_from([-np.inf, -1e30, -6e36, -1e9, -1e6, -800.0, -120.0]))
            g[rng.integers(B), rng.integers(T), :] = val
    kw = {}
    if t["loglinear"]:
        kw["lam"] = rng.uniform(0.2, 1.2, (B, T, H, hila.levels_needed(0, max(T, 1)))).astype(dtype)
    if t["delta"]:
        kw["beta"] = rng.uniform(0, 1, (B, T, H)).astype(dtype)
        kw["qk_l2norm"] = draw(st.booleans())
    if t["hla_family"]:
        kw["normalize"] = draw(st.booleans())
        if kw["normalize"]:  # nonnegative features keep the denominator positive
            q, k = np.abs(q), np.abs(k)
    chunk = draw(st.sampled_from([1, 2, 4, 8]))
    return op, q, k, v, g, kw, chunk


def _close(a, b, dtype):
    # float32: ordinary rounding of a cancelling sum reaches ~1e-6 of a small output on its own
    # (the exact-reset bounds, 1e-6 / 1e-12, are asserted on controlled problems in test_resets.cpp)
    tol = 1e-10 if dtype == np.float64 else 2e-5
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.isfinite(a).all() and np.isfinite(b).all()
    ref = max(np.abs(b).max(initial=0), 1e-30)
    err = np.abs(a - b).max(initial=0) / ref
    assert err <= tol * max(1, a.size ** 0.5), err


@SETTINGS
@given(problems())
def test_forms_agree_with_serial(problem):
    op, q, k, v, g, kw, chunk = problem
    ref = _expect_hila_error_or_result(lambda: hila.forward(op, q, k, v, g, form="serial",
                                                            output_final_state=True, **kw))
    if ref is None:
        return
    for form in ("chunk", "scan", "naive"):
        got = hila.forward(op, q, k, v, g, form=form, chunk=chunk, output_final_state=True, **kw)
        _close(got[0], ref[0], q.dtype)
        _close(got[1].H, ref[1].H, q.dtype)
    if hila.supports(op, "chunk", backward=True):
        do = np.ones_like(v)
        grads = _expect_hila_error_or_result(lambda: hila.backward(op, q, k, v, g, do=do, chunk=chunk, **kw))
        if grads is not None:
            for x in grads[:6]:
                assert x is None or np.isfinite(x).all()
            reset = np.exp(g.astype(np.float64)) == 0
            if grads.dg is not None and reset.any():
                assert (grads.dg[reset] == 0).all()


@SETTINGS
@given(problems(), st.integers(0, 40))
def test_decode_matches_forward(problem, reserve):
    op, q, k, v, g, kw, _ = problem
    if q.shape[0] == 0 or q.shape[1] == 0:
        return
    B, T = q.shape[:2]
    ref = _expect_hila_error_or_result(lambda: hila.forward(op, q, k, v, g, form="serial", **kw))
    if ref is None:
        return
    o_ref = ref[0]
    opts = {x: kw[x] for x in ("normalize", "qk_l2norm") if x in kw}
    st_ = hila.DecodeState(op, B, v.shape[2], q.shape[3], v.shape[3], dtype=str(q.dtype), **opts)
    st_.reserve(reserve)
    for t in range(T):
        extra = {}
        if "lam" in kw:
            extra["lam"] = kw["lam"][:, t]
        if "beta" in kw:
            extra["beta"] = kw["beta"][:, t]
        o = st_.step(q[:, t], k[:, t], v[:, t], g[:, t], **extra)
        _close(o, o_ref[:, t], q.dtype)
    assert all(st_.position(i) == T for i in range(B))


def _junk():
    return st.one_of(st.none(), st.integers(-3, 3), st.floats(allow_nan=True), st.text(max_size=3),
                     st.lists(st.floats(allow_nan=True), max_size=3),
                     st.builds(lambda s, d: np.zeros(s, d),
                               st.lists(st.integers(0, 3), min_size=0, max_size=6),
                               st.sampled_from([np.float32, np.float64, np.int8, np.uint16, np.complex64,
                                                np.bool_, np.int64])))


@SETTINGS
@given(st.sampled_from(hila.OPS), st.sampled_from(["q", "k", "v", "g", "lam", "beta", "cu_seqlens", "chunk",
                                                     "form", "scale", "eps", "initial_state", "stream"]),
       _junk())
def test_wrong_arguments_are_hila_errors(op, name, junk):
    q = np.zeros((1, 3, 1, 2), np.float32)
    args = {"q": q, "k": q, "v": q}
    kw = {name: junk}
    try:
        if name in args:
            args[name] = junk
            hila.forward(op, args["q"], args["k"], args["v"])
        else:
            hila.forward(op, q, q, q, **kw)
    except hila.HilaError:
        pass
    except TypeError as e:  # only Python's own signature errors (never nanobind's)
        assert "incompatible function arguments" not in str(e), e
        raise


@SETTINGS
@given(st.sampled_from(hila.OPS), st.integers(-2, 70), st.integers(-5, 2**63 - 1))
def test_decode_state_positions_and_reserve(op, reserve, pos):
    st_ = hila.DecodeState(op, 1, 1, 2, 2)
    _expect_hila_error_or_result(lambda: st_.reserve(reserve))
    view = st_.view()
    H = np.zeros_like(view.H)
    S = None if view.S is None else np.zeros_like(view.S)
    P = None if view.P is None else np.zeros_like(view.P)
    if hila.op_traits(op)["loglinear"] and 0 <= pos <= 2**62:
        H = np.zeros((1, 1, hila.state_slots(pos), 2, 2), np.float32)
    loaded = _expect_hila_error_or_result(lambda: st_.load(hila.State(np.array([pos], np.int64), S, P, H)) or True)
    if loaded:
        assert 0 <= pos <= 2**62
        assert st_.position(0) == pos
