# SPDX-License-Identifier: Apache-2.0
"""Checks of the oracles and of the reference model themselves (no hila binary needed).

1. Fenwick levels: the level table, bucket partitions, exact integer counts (LOGLINEAR.md §2).
2. Every masked-matrix forward (package `oracles`) against independent forms: the definitions as
   plain sums (with explicit d×d transition products for the delta rule) and the serial
   recurrences (decode steps), with initial states, continuation, and the λ ≡ 1 reductions.
3. Every hand-derived VJP against central finite differences of its forward, and the hla2
   composition VJP against the reverse-time adjoint of HLA.md §7.3.
4. The CLI-layout assembly in reference.py: GQA, varlen, states, options, and its backward against
   finite differences of its forward.
"""
import zlib

import numpy as np
import pytest

import reference as ref
from cases import FD_TOL, Problem, expected_backward, expected_fd, expected_forward, fd_problems, make_inputs, rel_err
from oracles import first_order as fo
from oracles import hla as hl
from oracles import levels as lv
from oracles import recurrences as rc
from oracles.transforms import fd_grad, l2norm, l2norm_vjp

TOL = 1e-10       # forms of the same forward (observed 1e-16 .. 1e-14)
FD = 1e-7         # VJP vs central differences, h = 1e-6 (observed 1e-10 .. 1e-9)


def _rng(*key):
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def _data(rng, T, d=3, dv=2, unit_k=False, nonneg=False):
    q, K, V = (rng.standard_normal((T, n)) for n in (d, d, dv))
    if nonneg:
        q, K = np.abs(q), np.abs(K)
    if unit_k:
        K = K / np.linalg.norm(K, axis=1, keepdims=True)
    return 0.6 * q, K, V


def _gates(rng, T, n=1):
    g = [np.log(rng.uniform(0.75, 1.0, T)) for _ in range(n)]
    return g[0] if n == 1 else g


def _canonical(rng, n, d, dv, extra=0):
    H = np.zeros((lv.state_slots(n) + extra, d, dv))
    for l in lv.live_levels(n):
        H[l] = rng.standard_normal((d, dv))
    return H


def _lam(rng, n0, T, extra=0):
    return rng.uniform(-0.5, 1.5, (T, lv.levels_needed(n0, T) + extra))


# ============================================================================ 1. levels
def test_level_table():
    """ℓ(t, s) = bitlen(t XOR s) for T = 8 (LOGLINEAR.md §2.1)."""
    want = ["0", "10", "220", "2210", "33330", "333310", "3333220", "33332210"]
    LV = lv.level_matrix(0, 8)
    assert ["".join(str(LV[t, s]) for s in range(t + 1)) for t in range(8)] == want
    assert np.all(LV[np.triu_indices(8, 1)] == -1)


@pytest.mark.parametrize("n", list(range(0, 140)) + [(1 << 40) - 3, (1 << 40), (1 << 49) + 1, (1 << 62) + 5])
def test_buckets_partition_the_past(n):
    """B_l(n), l live, partition [0, n) and hold exactly the s < n with ℓ(n, s) = l (LOGLINEAR.md §2.2)."""
    live = lv.live_levels(n)
    assert len(live) == bin(n).count("1")
    assert lv.state_slots(n) == (len(bin(n)) - 2 if n else 0) + 1
    sizes = 0
    for l in live:
        B = lv.bucket(n, l)
        sizes += len(B)
        assert B.start % (1 << l) == 0 and B.stop <= n
        for s in (B.start, B.stop - 1):
            assert lv.level(n, s) == l
        if n < 1 << 12:
            assert all(lv.level(n, s) == l for s in B)
    assert sizes == n
    if n < 1 << 12:
        assert sorted(s for l in live for s in lv.bucket(n, l)) == list(range(n))


def test_level_counts_are_exact_integers():
    """L(n0, T) = bitlen(n0+T−1)+1 where float log2 is wrong (LOGLINEAR.md §2.3)."""
    assert [lv.levels_needed(0, T) for T in (0, 1, 2, 3, 16384, 16385)] == [0, 1, 2, 3, 15, 16]
    assert lv.levels_needed(0, (1 << 29) + 1) == 31 and lv.levels_needed((1 << 49), 2) == 51
    assert lv.levels_needed((1 << 62) - 1, 1) == 63
    big = np.array([(1 << 49) + 1, (1 << 62) + 3, 0, 1], dtype=np.int64)
    assert lv.bitlen_array(big).tolist() == [50, 63, 0, 1]


@pytest.mark.parametrize("n", [1, 5, 8, 13, 64, 100, 255])
def test_rekey_nesting(n):
    """for t ≥ n and s ∈ B_l(n): ℓ(t, s) = ℓ(t, σ_l(n)) (LOGLINEAR.md §2.4)."""
    for l in lv.live_levels(n):
        for t in range(n, n + 70):
            assert {lv.level(t, s) for s in lv.bucket(n, l)} == {lv.level(t, lv.sigma(n, l))}


# ============================================================================ 2. first-order forwards
@pytest.mark.parametrize("T", [1, 2, 7, 20])
def test_gla_and_gdn_masked_equal_serial_and_definition(T):
    rng = _rng(10, T)
    q, K, V = _data(rng, T, unit_k=True)
    g = _gates(rng, T)
    beta = rng.uniform(0.1, 1.2, T)
    H0 = rng.standard_normal((3, 2))
    O, HT = fo.gla(q, K, V, g, H0)
    Os, Hs = rc.gla_serial(q, K, V, g, H0)
    lam1 = np.ones((T, lv.levels_needed(0, T)))
    Odef = rc.loglinear_loop(q, K, V, g, lam1) + np.exp(np.cumsum(g))[:, None] * (q @ H0)
    assert rel_err(O, Os) < TOL and rel_err(HT, Hs) < TOL and rel_err(O, Odef) < TOL
    O, HT = fo.gdn(q, K, V, beta, g, H0)
    Os, Hs = rc.gdn_serial(q, K, V, beta, g, H0)
    assert rel_err(O, Os) < TOL and rel_err(HT, Hs) < TOL
    assert rel_err(O, rc.delta_loop(q, K, V, beta, g, None, 0, H0)) < TOL


POSITIONS = [(0, 1), (0, 20), (5, 11), (13, 1), (63, 2), (64, 9), (96, 33), ((1 << 40) - 3, 9)]


@pytest.mark.parametrize("n0,T", POSITIONS)
@pytest.mark.parametrize("delta", [False, True], ids=["loglinear", "loglinear_gdn"])
def test_loglinear_masked_equals_serial_and_definition(delta, n0, T):
    """masked form == decode steps == plain sums, from a random canonical state at n0; the final
       state is canonical at n0 + T (slots bitlen(n)+1, non-zero exactly on the live levels)."""
    rng = _rng(11, n0 % 1000, T, delta)
    q, K, V = _data(rng, T, unit_k=delta)
    g = _gates(rng, T)
    beta = rng.uniform(0.1, 1.2, T) if delta else None
    lam = _lam(rng, n0, T, extra=1)
    H0 = _canonical(rng, n0, 3, 2)
    if delta:
        O, Hn = fo.loglinear_gdn(q, K, V, beta, g, lam, n0, H0)
        Odef = rc.delta_loop(q, K, V, beta, g, lam, n0, H0)
    else:
        O, Hn = fo.loglinear(q, K, V, g, lam, n0, H0)
        Odef = rc.loglinear_loop(q, K, V, g, lam, n0, H0)
    Os, Hs = rc.fenwick_serial(q, K, V, g, lam, n0, H0, beta)
    n = n0 + T
    assert Hn.shape == (lv.state_slots(n), 3, 2) and Hs.shape == Hn.shape
    assert rel_err(O, Os) < TOL and rel_err(O, Odef) < TOL and rel_err(Hn, Hs) < TOL
    assert [l for l in range(len(Hn)) if np.any(Hn[l])] == lv.live_levels(n)


@pytest.mark.parametrize("delta", [False, True], ids=["loglinear", "loglinear_gdn"])
def test_loglinear_continuation(delta):
    """calls that pass the state along (empty calls and calls across powers of two included) equal
       one call (LOGLINEAR.md §3.4)."""
    rng = _rng(12, delta)
    T = 140
    q, K, V = _data(rng, T, unit_k=delta)
    g = _gates(rng, T)
    beta = rng.uniform(0.1, 1.2, T) if delta else None
    lam = _lam(rng, 0, T)

    def run(a, b, n0, H0):
        s = slice(a, b)
        if delta:
            return fo.loglinear_gdn(q[s], K[s], V[s], beta[s], g[s], lam[s], n0, H0)
        return fo.loglinear(q[s], K[s], V[s], g[s], lam[s], n0, H0)

    Ofull, Hfull = run(0, T, 0, None)
    H, outs = None, []
    for a, b in ((0, 13), (13, 13), (13, 64), (64, 65), (65, 128), (128, 140)):
        O, H = run(a, b, a, H)
        outs.append(O)
    assert rel_err(np.concatenate(outs), Ofull) < TOL and rel_err(H, Hfull) < TOL


@pytest.mark.parametrize("delta", [False, True], ids=["loglinear", "loglinear_gdn"])
def test_loglinear_at_unit_lambda_is_the_flat_operator(delta):
    """λ ≡ 1: the Fenwick state is a split of the flat state (sum over levels)."""
    rng = _rng(13, delta)
    n0, T = 13, 23
    q, K, V = _data(rng, T, unit_k=delta)
    g = _gates(rng, T)
    beta = rng.uniform(0.1, 1.2, T)
    H0 = _canonical(rng, n0, 3, 2)
    lam1 = np.ones((T, lv.levels_needed(n0, T)))
    if delta:
        O, Hn = fo.loglinear_gdn(q, K, V, beta, g, lam1, n0, H0)
        Of, HT = fo.gdn(q, K, V, beta, g, H0.sum(0))
    else:
        O, Hn = fo.loglinear(q, K, V, g, lam1, n0, H0)
        Of, HT = fo.gla(q, K, V, g, H0.sum(0))
    assert rel_err(O, Of) < TOL and rel_err(Hn.sum(0), HT) < TOL


def test_empty_call_returns_the_initial_state():
    rng = _rng(14)
    z = np.zeros((0, 3))
    H0 = _canonical(rng, 13, 3, 2, extra=1)
    for O, H in (fo.loglinear(z, z, np.zeros((0, 2)), np.zeros(0), np.zeros((0, 0)), 13, H0),
                 fo.loglinear_gdn(z, z, np.zeros((0, 2)), np.zeros(0), np.zeros(0), np.zeros((0, 0)), 13, H0)):
        assert O.shape == (0, 2) and np.array_equal(H, H0[:lv.state_slots(13)])
    Hf = rng.standard_normal((3, 2))
    assert np.array_equal(fo.gla(z, z, np.zeros((0, 2)), np.zeros(0), Hf)[1], Hf)


def test_bad_lambda_and_state_are_rejected():
    rng = _rng(15)
    q, K, V = _data(rng, 9)
    g = _gates(rng, 9)
    with pytest.raises(ValueError, match="lam"):
        fo.loglinear(q, K, V, g, np.ones((9, lv.levels_needed(8, 9) - 1)), 8, None)
    H0 = _canonical(rng, 13, 3, 2)
    H0[2] = 1.0                                  # bit 1 of 13 is clear: dead slot
    with pytest.raises(ValueError, match="canonical"):
        fo.loglinear(q, K, V, g, np.ones((9, 6)), 13, H0)
    with pytest.raises(ValueError, match="state"):
        fo.loglinear(q, K, V, g, np.ones((9, 6)), 13, H0[:3])


@pytest.mark.parametrize("delta", [False, True], ids=["loglinear", "loglinear_gdn"])
def test_varlen_serial_equals_per_sequence_masked(delta):
    """packed rows with zero-length sequences and per-sequence positions (LOGLINEAR.md §4)."""
    rng = _rng(16, delta)
    lens, n0s = (0, 37, 0, 64, 65, 1), (5, 0, 64, 100, 3, 13)
    cu = np.concatenate([[0], np.cumsum(lens)])
    T = int(cu[-1])
    q, K, V = _data(rng, T, unit_k=delta)
    g = _gates(rng, T)
    beta = rng.uniform(0.1, 1.2, T) if delta else None
    lam = rng.uniform(-0.5, 1.5, (T, max(lv.levels_needed(a, b) for a, b in zip(n0s, lens))))
    H0s = [_canonical(rng, n0, 3, 2) for n0 in n0s]
    O, finals = rc.varlen_serial(q, K, V, g, lam, cu, n0s, H0s, beta)
    for i, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        s = slice(int(a), int(b))
        if delta:
            Oi, Hi = fo.loglinear_gdn(q[s], K[s], V[s], beta[s], g[s], lam[s], n0s[i], H0s[i])
        else:
            Oi, Hi = fo.loglinear(q[s], K[s], V[s], g[s], lam[s], n0s[i], H0s[i])
        assert rel_err(O[s], Oi) < TOL
        assert finals[i][0] == n0s[i] + lens[i] and rel_err(ref.pad_slots(finals[i][1], len(Hi)), Hi) < TOL


# ============================================================================ 3. first-order VJPs
def _loss_check(fwd, vjp_out, arrays, dO, dstate, mask=None):
    """every VJP output against central differences of L = <O, dO> + <state, dstate>."""
    def L(*a):
        a = list(a)
        if mask is not None:
            a[-1] = a[-1] * mask
        O, S = fwd(*a)
        if S.ndim == 3:                      # Fenwick state: compare over the cotangent's slots
            S = ref.pad_slots(S, len(dstate))
        return float(np.sum(O * dO) + np.sum(S * dstate))
    fd = fd_grad(L, arrays)
    errs = [rel_err(a, b) for a, b in zip(vjp_out, fd)]
    assert max(errs) < FD, errs


@pytest.mark.parametrize("T", [1, 9])
def test_gla_and_gdn_vjp_match_finite_differences(T):
    rng = _rng(20, T)
    q, K, V = _data(rng, T, unit_k=True)
    g = _gates(rng, T)
    beta = rng.uniform(0.1, 1.2, T)
    H0, dO, dHT = rng.standard_normal((3, 2)), rng.standard_normal((T, 2)), rng.standard_normal((3, 2))
    _loss_check(fo.gla, fo.gla_vjp(q, K, V, g, dO, H0, dHT), [q, K, V, g, H0], dO, dHT)
    _loss_check(fo.gdn, fo.gdn_vjp(q, K, V, beta, g, dO, H0, dHT), [q, K, V, beta, g, H0], dO, dHT)


@pytest.mark.parametrize("n0,T", [(0, 1), (0, 11), (6, 9), (13, 12), (8, 0), (63, 3)])
@pytest.mark.parametrize("delta", [False, True], ids=["loglinear", "loglinear_gdn"])
def test_loglinear_vjp_matches_finite_differences(delta, n0, T):
    """dq, dk, dv, (dβ), dg, dλ, dH0 with a state and a final-state cotangent; one λ column beyond
       the levels read gets gradient 0; cotangents on dead final slots change nothing."""
    rng = _rng(21, n0, T, delta)
    q, K, V = _data(rng, T, unit_k=delta)
    g = _gates(rng, T)
    beta = rng.uniform(0.1, 1.2, T)
    lam = _lam(rng, n0, T, extra=1) if T else np.zeros((0, 0))
    H0 = _canonical(rng, n0, 3, 2)
    n = n0 + T
    dO = rng.standard_normal((T, 2))
    dHn = rng.standard_normal((lv.state_slots(n), 3, 2))
    mask = np.zeros((len(H0), 1, 1))
    mask[lv.live_levels(n0)] = 1.0
    live_n = np.zeros((len(dHn), 1, 1))
    live_n[lv.live_levels(n)] = 1.0
    if delta:
        out = fo.loglinear_gdn_vjp(q, K, V, beta, g, lam, dO, n0, H0, dHn)
        again = fo.loglinear_gdn_vjp(q, K, V, beta, g, lam, dO, n0, H0, dHn * live_n)
        _loss_check(lambda q_, K_, V_, b_, g_, l_, H_: fo.loglinear_gdn(q_, K_, V_, b_, g_, l_, n0, H_),
                    out, [q, K, V, beta, g, lam, H0], dO, dHn, mask)
        dlam = out[5]
    else:
        out = fo.loglinear_vjp(q, K, V, g, lam, dO, n0, H0, dHn)
        again = fo.loglinear_vjp(q, K, V, g, lam, dO, n0, H0, dHn * live_n)
        _loss_check(lambda q_, K_, V_, g_, l_, H_: fo.loglinear(q_, K_, V_, g_, l_, n0, H_),
                    out, [q, K, V, g, lam, H0], dO, dHn, mask)
        dlam = out[4]
    for a, b in zip(out, again):
        assert np.array_equal(a, b)
    if T:
        assert not np.any(dlam[:, -1])


# ============================================================================ HLA family
def _hla_inputs(rng, kind, T, nonneg=False):
    q, K, V = _data(rng, T, nonneg=nonneg)
    return q, K, V, _gates(rng, T, len(hl.GATES[kind]))


@pytest.mark.parametrize("ll", [False, True], ids=["plain", "loglinear"])
@pytest.mark.parametrize("kind", hl.KINDS)
def test_hla_sums_masked_serial_and_composition_agree(kind, ll):
    """untied gates, no state: triple sums == masked matrices == recurrences == GLA compositions."""
    rng = _rng(30, kind, ll)
    T = 11 if kind == "hla3" else 14
    q, K, V, gates = _hla_inputs(rng, kind, T)
    lam = _lam(rng, 0, T) if ll else None
    want = hl.BRUTE[kind](q, K, V, *gates, lam=lam)
    assert rel_err(hl.MASKED[kind](q, K, V, *gates, lam=lam), want) < TOL
    assert rel_err(hl.serial(kind, q, K, V, gates, lam=lam)[0], want) < TOL
    assert rel_err(hl.compose(kind, q, K, V, gates, lam=lam)[0], want) < TOL


def test_hla_tied_gates_telescope():
    """tied gates: hla2 weight Γ_{t,i}, ahla Γ_{t,j}, hla3 Γ_{t,i} Γ_{u,j} (HLA.md §2)."""
    rng = _rng(31)
    T = 9
    q, K, V = _data(rng, T)
    g = _gates(rng, T)
    G = np.exp(np.cumsum(g)[:, None] - np.cumsum(g)[None, :])
    o2, oa, o3 = (np.zeros((T, 2)) for _ in range(3))
    for t in range(T):
        for j in range(t + 1):
            for i in range(j + 1):
                o2[t] += G[t, i] * (q[t] @ K[i]) * (q[j] @ K[i]) * V[j]
                oa[t] += G[t, i] * (q[t] @ K[j]) * (q[j] @ K[i]) * V[i]
        for u in range(t + 1):
            for i in range(u + 1):
                for j in range(u + 1):
                    o3[t] += G[t, i] * G[u, j] * (q[t] @ K[i]) * (q[u] @ K[i]) * (q[u] @ K[j]) * V[j]
    assert rel_err(hl.compose("hla2", q, K, V, [g, g])[0], o2) < TOL
    assert rel_err(hl.compose("ahla", q, K, V, [g, g])[0], oa) < TOL
    assert rel_err(hl.compose("hla3", q, K, V, [g, g, g])[0], o3) < TOL


@pytest.mark.parametrize("ll", [False, True], ids=["plain", "loglinear"])
@pytest.mark.parametrize("kind", hl.KINDS)
def test_hla_initial_state_is_continuation(kind, ll):
    """composition from the states (S, P, Y) of a prefix == one recurrence over prefix + call,
       outputs and every final state; hla2 with ridge (LOGLINEAR.md §7 for the log-linear ops)."""
    rng = _rng(32, kind, ll)
    n0, T = 13, 21
    q, K, V, gates = _hla_inputs(rng, kind, n0 + T)
    lam = _lam(rng, 0, n0 + T) if ll else None
    ridge = 0.3 if kind == "hla2" else 0.0
    cut = lambda x, s: None if x is None else x[s]  # noqa: E731
    pre, post = slice(0, n0), slice(n0, None)
    Of, Sf, Pf, Yf = hl.serial(kind, q, K, V, gates, lam=lam, ridge=ridge)
    _, S0, P0, Y0 = hl.serial(kind, q[pre], K[pre], V[pre], [x[pre] for x in gates], lam=cut(lam, pre), ridge=ridge)
    O, S, P, Y = hl.compose(kind, q[post], K[post], V[post], [x[post] for x in gates], S0, P0, Y0,
                            lam=cut(lam, post), n0=n0, ridge=ridge)
    assert rel_err(O, Of[post]) < TOL and rel_err(Y, Yf) < TOL
    for a, b in ((S, Sf), (P, Pf)):
        assert (a is None) == (b is None) and (a is None or rel_err(a, b) < TOL)
    O2 = hl.serial(kind, q[post], K[post], V[post], [x[post] for x in gates], S0, P0, Y0, lam=cut(lam, post),
                   n0=n0, ridge=ridge)[0]
    assert rel_err(O2, Of[post]) < TOL


@pytest.mark.parametrize("ll", [False, True], ids=["hla2", "loglinear_hla2"])
def test_ridge_is_the_shifted_metric(ll):
    """ridge ρ: S_j → S_j + ρI in o_t = Σ_j Γ^Y_{t,j} λ (q_tᵀ S_j q_j) v_j, with states S0, Y0."""
    rng = _rng(33, ll)
    T, d, rho, n0 = 12, 3, 0.37, 5
    q, K, V = _data(rng, T)
    gS, gY = _gates(rng, T, 2)
    S0 = rng.standard_normal((d, d))
    S0 = S0 + S0.T
    lam = _lam(rng, n0, T) if ll else None
    Y0 = _canonical(rng, n0, d, 2) if ll else rng.standard_normal((d, 2))
    O = hl.compose("hla2", q, K, V, [gS, gY], S0=S0, Y0=Y0, lam=lam, n0=n0, ridge=rho)[0]
    cY = np.cumsum(gY)
    Sj, S = [], S0.copy()
    for j in range(T):
        S = np.exp(gS[j]) * S + np.outer(K[j], K[j])
        Sj.append(S + rho * np.eye(d))
    want = np.zeros_like(O)
    for t in range(T):
        for j in range(t + 1):
            w = np.exp(cY[t] - cY[j]) * (lam[t, lv.level(n0 + t, n0 + j)] if ll else 1.0)
            want[t] += w * (q[t] @ Sj[j] @ q[j]) * V[j]
        if ll:
            for l in lv.live_levels(n0):
                want[t] += lam[t, lv.level(n0 + t, lv.sigma(n0, l))] * np.exp(cY[t]) * (q[t] @ Y0[l])
        else:
            want[t] += np.exp(cY[t]) * (q[t] @ Y0)
    assert rel_err(O, want) < TOL


@pytest.mark.parametrize("kind", hl.KINDS)
def test_normalize_is_the_ratio_of_two_sums(kind):
    """o_t = num_t / (den_t + ε), den = the operator with v ≡ 1 (HLA.md §4); nonnegative features."""
    rng = _rng(34, kind)
    T, eps = 10, 1e-3
    q, K, V, gates = _hla_inputs(rng, kind, T, nonneg=True)
    N = hl.BRUTE[kind](q, K, V, *gates)
    D = hl.BRUTE[kind](q, K, np.ones((T, 1)), *gates)[:, 0]
    assert np.all(D > 0)
    assert rel_err(hl.compose(kind, q, K, V, gates, normalize=True, eps=eps)[0], N / (D + eps)[:, None]) < TOL


HLA_VJP_CASES = [dict(), dict(states=True), dict(ll=True), dict(ll=True, states=True),
                 dict(normalize=True), dict(normalize=True, states=True, ll=True)]


@pytest.mark.parametrize("case", HLA_VJP_CASES, ids=lambda c: "-".join(c) or "plain")
@pytest.mark.parametrize("kind", hl.KINDS)
def test_hla_composition_vjp_matches_finite_differences(kind, case):
    """dq, dk, dv, every gate, dλ, and the dense gradients of S0, P0, Y0 (with cotangents of every
       final state); ridge on hla2."""
    rng = _rng(35, kind, *sorted(case))
    T, d, dv = 7, 3, 2
    ll, st, nz = case.get("ll", False), case.get("states", False), case.get("normalize", False)
    q, K, V, gates = _hla_inputs(rng, kind, T, nonneg=nz)
    n0 = 6 if st else 0
    dvp = dv + 1 if nz else dv
    lam = _lam(rng, n0, T) if ll else None
    ridge = 0.3 if kind == "hla2" else 0.0
    names = hl.GATES[kind]
    S0 = (lambda A: A + A.T)(rng.uniform(0, 0.5, (d, d))) if st and "S" in names else None
    P0 = rng.uniform(0, 0.5, (d, dvp)) if st and "P" in names else None
    Y0 = (np.abs(_canonical(rng, n0, d, dvp)) if ll else rng.uniform(0, 0.5, (d, dvp))) if st else None
    dO = rng.standard_normal((T, dv))
    Yn = lv.state_slots(n0 + T) if ll else None
    dS = rng.standard_normal((d, d)) if "S" in names else None
    dP = rng.standard_normal((d, dvp)) if "P" in names else None
    dY = rng.standard_normal((Yn, d, dvp) if ll else (d, dvp))
    kw = dict(lam=lam, n0=n0, ridge=ridge, normalize=nz, eps=1e-3)
    out = hl.compose_vjp(kind, q, K, V, gates, dO, S0, P0, Y0, dS, dP, dY, **kw)
    args = [q, K, V] + list(gates) + ([lam] if ll else []) + [x for x in (S0, P0, Y0) if x is not None]
    mask = np.zeros((len(Y0), 1, 1)) if (ll and st) else None
    if mask is not None:
        mask[lv.live_levels(n0)] = 1.0

    def L(*a):
        a = list(a)
        q_, K_, V_ = a[:3]
        gs = a[3:3 + len(names)]
        rest = a[3 + len(names):]
        lam_ = rest.pop(0) if ll else None
        S0_ = rest.pop(0) if S0 is not None else None
        P0_ = rest.pop(0) if P0 is not None else None
        Y0_ = rest.pop(0) if Y0 is not None else None
        if mask is not None:
            Y0_ = Y0_ * mask
        O, S, P, Y = hl.compose(kind, q_, K_, V_, gs, S0_, P0_, Y0_, **{**kw, "lam": lam_})
        val = np.sum(O * dO) + np.sum(ref.pad_slots(Y, Yn) * dY if ll else Y * dY)
        val += (np.sum(S * dS) if S is not None else 0.0) + (np.sum(P * dP) if P is not None else 0.0)
        return float(val)

    fd = fd_grad(L, args)
    an = [out["dq"], out["dk"], out["dv"]] + out["dgates"] + ([out["dlam"]] if ll else []) + \
        [out[k] for k, x in (("dS0", S0), ("dP0", P0), ("dY0", Y0)) if x is not None]
    errs = [rel_err(a, b) for a, b in zip(an, fd)]
    assert len(an) == len(fd) and max(errs) < FD, errs


def test_hla2_serial_adjoint_equals_composition_vjp():
    """the reverse-time adjoint (HLA.md §7.3) == the composition of GLA VJPs, with states and
       final-state cotangents. S0 is symmetric: the two dense gradients of S0 agree up to a
       transpose (u = S q vs u = Sᵀ q), so their symmetric parts are compared."""
    rng = _rng(36)
    T, d, dv = 17, 4, 3
    q, K, V = _data(rng, T, d, dv)
    gS, gY = _gates(rng, T, 2)
    S0 = (lambda A: A + A.T)(rng.standard_normal((d, d)))
    Y0, dO = rng.standard_normal((d, dv)), rng.standard_normal((T, dv))
    dS, dY = rng.standard_normal((d, d)), rng.standard_normal((d, dv))
    adj = hl.hla2_serial_adjoint(q, K, V, gS, gY, dO, S0, Y0, dS, dY)
    c = hl.compose_vjp("hla2", q, K, V, [gS, gY], dO, S0=S0, Y0=Y0, dS=dS, dY=dY)
    sym = lambda A: A + A.T  # noqa: E731
    for a, b in zip(adj[:5] + (sym(adj[5]), adj[6]), [c["dq"], c["dk"], c["dv"]] + c["dgates"] + [sym(c["dS0"]), c["dY0"]]):
        assert rel_err(a, b) < TOL


# ============================================================================ transforms
def test_l2norm_vjp_and_fd_helper():
    rng = _rng(40)
    x, dy = rng.standard_normal((5, 4)) * rng.uniform(0.3, 3, (5, 1)), rng.standard_normal((5, 4))
    fd = fd_grad(lambda a: float(np.sum(l2norm(a) * dy)), [x])[0]
    assert rel_err(l2norm_vjp(x, dy), fd) < FD
    assert rel_err(np.linalg.norm(l2norm(x), axis=1), np.sqrt(np.sum(x * x, 1) / (np.sum(x * x, 1) + 1e-6))) < TOL
    A = rng.standard_normal((4, 4))           # fd_grad itself: gradient of xᵀ A x is (A + Aᵀ) x
    v = rng.standard_normal(4)
    assert rel_err(fd_grad(lambda a: float(a @ A @ a), [v])[0], (A + A.T) @ v) < FD


# ============================================================================ 4. CLI-layout assembly
def test_packed_symmetric_layout():
    d = 3
    M = np.arange(9.0).reshape(3, 3)
    M = M + M.T
    p = ref.pack_sym(M)
    assert p.tolist() == [M[0, 0], M[0, 1], M[0, 2], M[1, 1], M[1, 2], M[2, 2]]
    assert np.array_equal(ref.unpack_sym(p, d), M)


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


@pytest.mark.parametrize("n0", [None, (5, 0, 64, 100, 3, 13)], ids=["nostate", "states"])
@pytest.mark.parametrize("op", ["loglinear", "loglinear_gdn"])
def test_varlen_assembly_matches_packed_decode(op, n0):
    """reference.forward on packed inputs == decode steps over the packed rows (varlen_serial)."""
    lens = (0, 37, 0, 64, 65, 1)
    p = Problem(op, lens=lens, n0=n0, G=1, H=2, dk=4, dv=3)
    inp = make_inputs(p)
    f = ref.forward(op, inp)
    scale = 4 ** -0.5
    for h in range(2):
        H0s = None if n0 is None else [inp["h0.H"][i, h] for i in range(len(lens))]
        O, finals = rc.varlen_serial(scale * inp["q"][0, :, 0], inp["k"][0, :, 0], inp["v"][0, :, h],
                                     inp["g"][0, :, h], inp["lam"][0, :, h], inp["cu_seqlens"], p.n0s, H0s,
                                     inp["beta"][0, :, h] if "beta" in inp else None)
        assert rel_err(f["o"][0, :, h], O) < TOL
        for i, (n, Hn) in enumerate(finals):
            assert f["ht.pos"][i] == n
            assert rel_err(ref.pad_slots(Hn, f["ht.H"].shape[2]), f["ht.H"][i, h]) < TOL


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
