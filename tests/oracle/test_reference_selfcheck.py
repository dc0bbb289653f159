# SPDX-License-Identifier: Apache-2.0
"""Checks of the reference model itself (no hila binary needed): the GQA / varlen / state /
option assembly in reference.py agrees with the oracles' independent forms (brute-force sums,
serial recurrences, continuation, ll_varlen) and its backward agrees with central finite
differences of its forward."""
import numpy as np
import pytest

import reference as ref
from cases import FD_TOL, Problem, expected_backward, expected_fd, expected_forward, fd_problems, make_inputs, rel_err
from spec import vh, vl

TOL = 1e-10


def test_packed_symmetric_layout():
    d = 3
    M = np.arange(9.0).reshape(3, 3)
    M = M + M.T
    p = ref.pack_sym(M)
    assert p.tolist() == [M[0, 0], M[0, 1], M[0, 2], M[1, 1], M[1, 2], M[2, 2]]
    assert np.array_equal(ref.unpack_sym(p, d), M)


def _data(rng, T, d=4, dv=3, nonneg=False):
    Q, K, V = (rng.standard_normal((T, n)) for n in (d, d, dv))
    if nonneg:
        Q, K = np.abs(Q), np.abs(K)
    return Q * 0.6, K, V


def _gates(rng, T, n):
    return [np.log(rng.uniform(0.75, 1.0, T)) for _ in range(n)]


# ------------------------------------------------------------------------- HLA compositions
SERIAL = {"hla2": lambda Q, K, V, g: vh.hla2_serial(Q, K, V, *g)[0],
          "ahla": lambda Q, K, V, g: vh.ahla_serial(Q, K, V, *g)[0],
          "hla3": lambda Q, K, V, g: vh.hla3_serial(Q, K, V, *g)[0]}
BRUTE = {"hla2": lambda *a: vh.hla2_brute(*a), "ahla": lambda *a: vh.ahla_brute(*a),
         "hla3": lambda *a: vh.hla3_brute(*a)}


@pytest.mark.parametrize("kind", ["hla2", "ahla", "hla3"])
def test_hla_composition_matches_brute_and_serial(kind):
    rng = np.random.default_rng(1)
    T = 11
    Q, K, V = _data(rng, T)
    g = _gates(rng, T, len(ref.GATE_NAMES[kind]))
    st = ref.HeadState()
    o = ref.Options(scale=1.0)
    comp = ref._hla_parts(kind, Q, K, V, g, None, 1.0, st, o)["Of"]
    named, _ = ref.hla_forward(kind, Q, K, V, g, None, 1.0, st, o)
    assert rel_err(comp, BRUTE[kind](Q, K, V, *g)) < TOL
    assert rel_err(named, BRUTE[kind](Q, K, V, *g)) < TOL
    assert rel_err(comp, SERIAL[kind](Q, K, V, g)) < TOL


def _serial_states(kind, Q, K, V, g):
    """oracle serial run: outputs and final (S, P, H) in the reference's naming."""
    if kind == "hla2":
        O, S, Y = vh.hla2_serial(Q, K, V, *g)
        return O, dict(S=S, H=Y)
    if kind == "ahla":
        O, P, E = vh.ahla_serial(Q, K, V, *g)
        return O, dict(P=P, H=E)
    O, (S, P, X) = vh.hla3_serial(Q, K, V, *g)
    return O, dict(S=S, P=P, H=X)


@pytest.mark.parametrize("kind", ["hla2", "ahla", "hla3"])
def test_hla_initial_state_is_continuation(kind):
    """composition with states (S0,P0,H0) from a prefix == one serial pass over prefix + call."""
    rng = np.random.default_rng(2)
    n0, T = 7, 12
    Q, K, V = _data(rng, n0 + T)
    g = _gates(rng, n0 + T, len(ref.GATE_NAMES[kind]))
    Ofull, fin_full = _serial_states(kind, Q, K, V, g)
    _, fin_pre = _serial_states(kind, Q[:n0], K[:n0], V[:n0], [x[:n0] for x in g])
    st = ref.HeadState(n0, fin_pre.get("S"), fin_pre.get("P"), fin_pre["H"])
    O, fin = ref.hla_forward(kind, Q[n0:], K[n0:], V[n0:], [x[n0:] for x in g], None, 1.0, st, ref.Options())
    parts = ref._hla_parts(kind, Q[n0:], K[n0:], V[n0:], [x[n0:] for x in g], None, 1.0, st, ref.Options())
    assert rel_err(O, Ofull[n0:]) < TOL
    assert rel_err(parts["Of"], Ofull[n0:]) < TOL
    for part, X in fin_full.items():
        assert rel_err(getattr(fin, part), X) < TOL, part


@pytest.mark.parametrize("kind", ["hla2", "ahla", "hla3"])
def test_loglinear_hla_composition(kind):
    """LL-HLA composition == llhla*_brute (n0 = 0) and == llhla_serial continued from a prefix state."""
    rng = np.random.default_rng(3)
    op = "loglinear_" + kind
    scale = 0.7
    ng = len(ref.GATE_NAMES[kind])
    T = 10
    Q, K, V = _data(rng, T)
    g = _gates(rng, T, ng)
    lam = rng.uniform(-0.5, 1.5, (T, ref.levels_needed(0, T)))
    brute = {"hla2": vl.llhla2_brute, "ahla": vl.llahla_brute, "hla3": vl.llhla3_brute}[kind]
    O, _ = ref.hla_forward(op, Q, K, V, g, lam, scale, ref.HeadState(), ref.Options())
    assert rel_err(O, brute(Q, K, V, *g, lam, scale)) < TOL
    # continuation across a prefix of n0 tokens
    n0, T = 13, 21
    Q, K, V = _data(rng, n0 + T)
    g = _gates(rng, n0 + T, ng)
    lam = rng.uniform(-0.5, 1.5, (n0 + T, ref.levels_needed(0, n0 + T)))
    Ofull, (S, P, (n, Y)) = vl.llhla_serial(kind, Q, K, V, g, lam, scale)
    _, (S0, P0, (m, Y0)) = vl.llhla_serial(kind, Q[:n0], K[:n0], V[:n0], [x[:n0] for x in g], lam[:n0], scale)
    assert m == n0
    st = ref.HeadState(n0, S0 if "S" in ref.GATE_NAMES[kind] else None,
                       P0 if "P" in ref.GATE_NAMES[kind] else None, Y0)
    O, fin = ref.hla_forward(op, Q[n0:], K[n0:], V[n0:], [x[n0:] for x in g], lam[n0:], scale, st, ref.Options())
    assert rel_err(O, Ofull[n0:]) < TOL
    assert fin.n0 == n
    assert rel_err(ref.pad_slots(fin.H, len(Y)), Y) < TOL
    if fin.S is not None:
        assert rel_err(fin.S, S) < TOL
    if fin.P is not None:
        assert rel_err(fin.P, P) < TOL
    # and the oracle's own chunk form with the same state
    Oc, (Sc, Pc, (nc, Yc)) = vl.llhla_chunk(kind, Q[n0:], K[n0:], V[n0:], [x[n0:] for x in g], lam[n0:], 4,
                                            scale, (S0, P0, (n0, Y0)))
    assert rel_err(O, Oc) < TOL and rel_err(ref.pad_slots(fin.H, len(Yc)), Yc) < TOL


def test_normalized_hla2():
    rng = np.random.default_rng(4)
    T, eps = 14, 1e-3
    Q, K, V = _data(rng, T, nonneg=True)
    g = _gates(rng, T, 2)
    o = ref.Options(scale=1.0, normalize=True, eps=eps)
    named, _ = ref.hla_forward("hla2", Q, K, V, g, None, 1.0, ref.HeadState(), o)
    comp = ref._hla_parts("hla2", Q, K, V, g, None, 1.0, ref.HeadState(), o)["Of"]
    N, D = vh.hla2_brute(Q, K, V, *g), vh.hla2_brute(Q, K, np.ones((T, 1)), *g)[:, 0]
    assert rel_err(named, N / (D + eps)[:, None]) < TOL
    assert rel_err(comp[:, :-1] / (comp[:, -1:] + eps), N / (D + eps)[:, None]) < TOL


@pytest.mark.parametrize("op", ["hla2", "loglinear_hla2"])
def test_ridge_matches_shifted_metric(op):
    """ridge rho: S_j -> S_j + rho I in o_t = sum_j GamY[t,j] lam (q_t^T S_j q_j) v_j (with S0, Y0)."""
    rng = np.random.default_rng(5)
    T, d, rho, n0 = 12, 4, 0.37, 5
    Q, K, V = _data(rng, T)
    gS, gY = _gates(rng, T, 2)
    S0 = rng.standard_normal((d, d))
    S0 = S0 + S0.T
    ll = op.startswith("loglinear")
    lam = rng.uniform(-0.5, 1.5, (T, ref.levels_needed(n0, T))) if ll else None
    Y0 = vl.rand_state(rng, n0, d, V.shape[1]) if ll else rng.standard_normal((d, V.shape[1]))
    st = ref.HeadState(n0, S0, None, Y0)
    O, _ = ref.hla_forward(op, Q, K, V, [gS, gY], lam, 1.0, st, ref.Options(ridge=rho))
    cY = np.cumsum(gY)
    Sj = []
    S = S0.copy()
    for j in range(T):
        S = np.exp(gS[j]) * S + np.outer(K[j], K[j])
        Sj.append(S + rho * np.eye(d))
    want = np.zeros_like(O)
    for t in range(T):
        for j in range(t + 1):
            w = np.exp(cY[t] - cY[j]) * (lam[t, vl.level(n0 + t, n0 + j)] if ll else 1.0)
            want[t] += w * (Q[t] @ Sj[j] @ Q[j]) * V[j]
        if ll:
            for l in vl.live_levels(n0):
                want[t] += lam[t, vl.level(n0 + t, vl.sigma(n0, l))] * np.exp(cY[t]) * (Q[t] @ Y0[l])
        else:
            want[t] += np.exp(cY[t]) * (Q[t] @ Y0)
    assert rel_err(O, want) < TOL


def test_plain_gdn_oracle_is_loglinear_gdn_at_unit_lambda():
    rng = np.random.default_rng(6)
    T, d, dv, sc = 23, 4, 3, 0.8
    Q, K, V = vl.data(rng, T, d, dv, unit_k=True)
    beta, g = rng.uniform(0.1, 1.2, T), vl.gates(rng, T)
    H0 = rng.standard_normal((d, dv))
    st = ref.HeadState(0, None, None, H0)
    O, fin = ref.first_order_forward("gdn", Q, K, V, g, None, beta, sc, st)
    # the canonical state at n0 = 1 has a single live level (1): with lam == 1 it is the flat state
    H0c = np.zeros((2, d, dv))
    H0c[1] = H0
    lam1 = np.ones((T, ref.levels_needed(1, T)))
    Ob, Hb = vl.gdn_brute(Q, K, V, beta, g, lam1, sc, 1, H0c)
    Os, Hs = vl.gdn_serial(Q, K, V, beta, g, lam1, sc, 1, H0c)
    assert rel_err(O, Ob) < TOL and rel_err(O, Os) < TOL
    assert rel_err(fin.H, Hb.sum(0)) < TOL and rel_err(fin.H, Hs.sum(0)) < TOL


# ------------------------------------------------------------------------- CLI-layout assembly
def _expand_groups(inp, G, H):
    """the same problem with one q/k group per value head (G' = H)."""
    rep = H // G
    x = dict(inp)
    for name in ("q", "k"):
        x[name] = np.repeat(inp[name], rep, axis=2)
    return x


@pytest.mark.parametrize("op", ref.ALL_OPS)
def test_gqa_assembly(op):
    p = Problem(op, T=9, G=2, H=4, dk=3, dv=2, backward=True)
    inp = make_inputs(p)
    x = _expand_groups(inp, 2, 4)
    f, fx = ref.forward(op, inp), ref.forward(op, x)
    for k in f:
        assert rel_err(f[k], fx[k]) < TOL, k
    b, bx = ref.backward(op, inp), ref.backward(op, x)
    for name in ("dq", "dk"):
        summed = bx[name].reshape(bx[name].shape[:2] + (2, 2) + bx[name].shape[3:]).sum(3)
        assert rel_err(b[name], summed) < TOL, name
    for name in b:
        if name not in ("dq", "dk"):
            assert rel_err(b[name], bx[name]) < TOL, name


VARLEN_LENS = (0, 37, 0, 64, 65, 1)


@pytest.mark.parametrize("n0", [None, (5, 0, 64, 100, 3, 13)], ids=["nostate", "states"])
@pytest.mark.parametrize("op", ["loglinear", "loglinear_gdn"])
def test_varlen_per_sequence_matches_ll_varlen(op, n0):
    p = Problem(op, lens=VARLEN_LENS, n0=n0, G=1, H=2, dk=4, dv=3)
    inp = make_inputs(p)
    a = ref.forward(op, inp, use_ll_varlen=True)
    b = ref.forward(op, inp, use_ll_varlen=False)
    for k in a:
        assert rel_err(a[k], b[k]) < TOL, k
    assert a["ht.pos"].tolist() == [x + y for x, y in zip(p.n0s, VARLEN_LENS)]


@pytest.mark.parametrize("op", ref.ALL_OPS)
def test_varlen_equals_separate_calls(op):
    """packed sequences == each sequence alone (with an initial state each)."""
    lens, n0 = (0, 7, 0, 9, 1), (3, 0, 8, 5, 13)
    p = Problem(op, lens=lens, n0=n0, G=1, H=2, dk=3, dv=2, backward=True, dht=True)
    inp = make_inputs(p)
    f, b = ref.forward(p.op, inp), ref.backward(p.op, inp)
    cu = inp["cu_seqlens"]
    for i in range(len(lens)):
        r0, r1 = int(cu[i]), int(cu[i + 1])
        x = {}
        for k, a in inp.items():
            if k == "cu_seqlens":
                continue
            x[k] = a[i:i + 1] if (k.startswith("h0.") or k.startswith("dht.")) else a[:, r0:r1]
        fi, bi = ref.forward(p.op, x), ref.backward(p.op, x)
        assert rel_err(f["o"][:, r0:r1], fi["o"]) < TOL
        for k in ("ht.S", "ht.P"):
            if k in f:
                assert rel_err(f[k][i:i + 1], fi[k]) < TOL
        Ls = fi["ht.H"].shape[2] if fi["ht.H"].ndim == 5 else None
        hh = f["ht.H"][i:i + 1] if Ls is None else f["ht.H"][i:i + 1, :, :Ls]
        assert rel_err(hh, fi["ht.H"]) < TOL
        for k in bi:
            if k.startswith("dh0."):
                assert rel_err(b[k][i:i + 1], bi[k]) < TOL, k
            else:
                assert rel_err(b[k][:, r0:r1], bi[k]) < TOL, k


# ------------------------------------------------------------------------- backward vs finite differences
@pytest.mark.parametrize("p", fd_problems(), ids=lambda p: p.label())
def test_reference_backward_matches_finite_differences(p):
    an, fd = expected_backward(p), expected_fd(p)
    assert set(an) == set(fd)
    errs = {k: rel_err(an[k], fd[k]) for k in an}
    assert max(errs.values()) < FD_TOL, errs


def test_prefix_state_is_oracle_final_state():
    p = Problem("loglinear_hla3", T=5, n0=37, state="prefix", G=1, H=2, dk=3, dv=2)
    inp = make_inputs(p)
    assert inp["h0.pos"].tolist() == [37, 37]
    assert inp["h0.H"].shape[2] == ref.state_slots(37)
    live = ref.live_levels(37)
    for l in range(inp["h0.H"].shape[2]):
        assert np.any(inp["h0.H"][:, :, l]) == (l in live)
    assert expected_forward(p)["ht.pos"].tolist() == [42, 42]
