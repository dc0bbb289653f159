# SPDX-License-Identifier: Apache-2.0
"""Optional cross-check: hila's own oracles (package `oracles`) against an external copy of the
specification oracles (verify_hla.py, verify_loglinear.py; located by shared_spec.py, override
with HILA_SPEC_DIR) on random inputs. conftest.py does not collect this file when that copy is
absent (and prints why); nothing else in the suites depends on it."""
import zlib

import numpy as np
import pytest

import shared_spec
from cases import rel_err
from oracles import first_order as fo
from oracles import hla as hl
from oracles import levels as lv
from oracles.transforms import l2norm, l2norm_vjp

if shared_spec.UNAVAILABLE:   # only reached when this file is named explicitly on the command line
    pytest.skip(f"external specification oracles unavailable: {shared_spec.UNAVAILABLE}", allow_module_level=True)
vh, vl = shared_spec.vh, shared_spec.vl
TOL = 1e-10


def _close(mine, theirs):
    assert len(mine) == len(theirs)
    errs = [rel_err(a, b) for a, b in zip(mine, theirs)]
    assert max(errs) < TOL, errs


def _inputs(seed, T, d=4, dv=3, unit_k=False, nonneg=False):
    rng = np.random.default_rng(zlib.crc32(repr(seed).encode()))
    q, K, V = (rng.standard_normal((T, n)) for n in (d, d, dv))
    if nonneg:
        q, K = np.abs(q), np.abs(K)
    if unit_k:
        K = K / np.linalg.norm(K, axis=1, keepdims=True)
    return rng, 0.6 * q, K, V


def _canonical(rng, n, d, dv):
    H = np.zeros((lv.state_slots(n), d, dv))
    for l in lv.live_levels(n):
        H[l] = rng.standard_normal((d, dv))
    return H


@pytest.mark.parametrize("T", [1, 13, 40])
def test_gla(T):
    rng, q, K, V = _inputs(("gla", T), T)
    g = np.log(rng.uniform(0.75, 1, T))
    H0, dO, dH = rng.standard_normal((4, 3)), rng.standard_normal((T, 3)), rng.standard_normal((4, 3))
    _close(fo.gla(q, K, V, g, H0), (vh.gla_mat(q, K, V, g, H0), vh.gla_state(K, V, g, H0)))
    _close(fo.gla_vjp(q, K, V, g, dO, H0, dH), vh.gla_vjp(q, K, V, g, dO, H0, dH))


@pytest.mark.parametrize("kind", hl.KINDS)
def test_hla(kind):
    T = 12
    rng, q, K, V = _inputs(("hla", kind), T, nonneg=True)
    gates = [np.log(rng.uniform(0.75, 1, T)) for _ in hl.GATES[kind]]
    dO = rng.standard_normal((T, 3))
    brute = {"hla2": vh.hla2_brute, "ahla": vh.ahla_brute, "hla3": vh.hla3_brute}[kind]
    vjp = {"hla2": vh.hla2_vjp, "ahla": vh.ahla_vjp, "hla3": vh.hla3_vjp}[kind]
    _close([hl.compose(kind, q, K, V, gates)[0], hl.BRUTE[kind](q, K, V, *gates)], [brute(q, K, V, *gates)] * 2)
    r = hl.compose_vjp(kind, q, K, V, gates, dO)
    _close([r["dq"], r["dk"], r["dv"]] + r["dgates"], vjp(q, K, V, *gates, dO))
    mat = {"hla2": vh.hla2_mat, "ahla": vh.ahla_mat, "hla3": vh.hla3_mat}[kind]
    _close([hl.compose(kind, q, K, V, gates, normalize=True, eps=1e-3)[0]],
           [vh.normalized(mat, q, K, V, *gates, eps=1e-3)[0]])
    if kind == "hla2":
        r = hl.compose_vjp(kind, q, K, V, gates, dO, normalize=True, eps=1e-3)
        _close([r["dq"], r["dk"], r["dv"]] + r["dgates"], vh.hla2n_vjp(q, K, V, *gates, dO, 1e-3))
        S0 = (lambda A: A + A.T)(rng.standard_normal((4, 4)))
        Y0 = rng.standard_normal((4, 3))
        O, S, _, Y = hl.compose(kind, q, K, V, gates, S0=S0, Y0=Y0)
        _close([O, S, Y], vh.hla2_serial(q, K, V, *gates, S0=S0, Y0=Y0))


@pytest.mark.parametrize("n0,T", [(0, 1), (0, 21), (13, 9), (64, 40), ((1 << 40) - 3, 9)])
def test_loglinear(n0, T):
    rng, q, K, V = _inputs(("ll", n0, T), T)
    g = np.log(rng.uniform(0.75, 1, T))
    lam = rng.uniform(-0.5, 1.5, (T, lv.levels_needed(n0, T) + 1))
    H0 = _canonical(rng, n0, 4, 3)
    dO, dH = rng.standard_normal((T, 3)), rng.standard_normal((lv.state_slots(n0 + T), 4, 3))
    _close(fo.loglinear(q, K, V, g, lam, n0, H0), vl.llm_brute(q, K, V, g, lam, 1.0, n0, H0))
    _close(fo.loglinear_vjp(q, K, V, g, lam, dO, n0, H0, dH), vl.llm_vjp_mat(q, K, V, g, lam, dO, 1.0, n0, H0, dH))


@pytest.mark.parametrize("n0,T", [(0, 1), (0, 21), (13, 9), (64, 40)])
def test_gdn(n0, T):
    rng, q, K, V = _inputs(("gdn", n0, T), T, unit_k=True)
    g, beta = np.log(rng.uniform(0.75, 1, T)), rng.uniform(0.1, 1.2, T)
    dO = rng.standard_normal((T, 3))
    H0, dH = rng.standard_normal((4, 3)), rng.standard_normal((4, 3))
    _close(fo.gdn(q, K, V, beta, g, H0), vl.gdn_chunk_plain(q, K, V, beta, g, T, 1.0, H0))
    _close(fo.gdn_vjp(q, K, V, beta, g, dO, H0, dH), vl.gdn_plain_vjp_chunk(q, K, V, beta, g, T, dO, 1.0, H0, dH))
    lam = rng.uniform(-0.5, 1.5, (T, lv.levels_needed(n0, T)))
    Hc, dHc = _canonical(rng, n0, 4, 3), rng.standard_normal((lv.state_slots(n0 + T), 4, 3))
    _close(fo.loglinear_gdn(q, K, V, beta, g, lam, n0, Hc), vl.gdn_brute(q, K, V, beta, g, lam, 1.0, n0, Hc))
    C = 1 << (n0 + T).bit_length()          # one segment spans the call
    _close(fo.loglinear_gdn_vjp(q, K, V, beta, g, lam, dO, n0, Hc, dHc),
           vl.gdn_vjp_chunk(q, K, V, beta, g, lam, C, dO, 1.0, n0, Hc, dHc))


@pytest.mark.parametrize("kind", hl.KINDS)
def test_loglinear_hla_with_states(kind):
    n0, T = 13, 11
    rng, q, K, V = _inputs(("llhla", kind), n0 + T)
    gates = [np.log(rng.uniform(0.75, 1, n0 + T)) for _ in hl.GATES[kind]]
    lam = rng.uniform(-0.5, 1.5, (n0 + T, lv.levels_needed(0, n0 + T)))
    _, (S0, P0, (_, Y0)) = vl.llhla_serial(kind, q[:n0], K[:n0], V[:n0], [x[:n0] for x in gates], lam[:n0])
    Ot, (S, P, (_, Y)) = vl.llhla_serial(kind, q[n0:], K[n0:], V[n0:], [x[n0:] for x in gates], lam[n0:],
                                         state=(S0, P0, (n0, Y0)))
    names = hl.GATES[kind]
    O, Sm, Pm, Ym = hl.compose(kind, q[n0:], K[n0:], V[n0:], [x[n0:] for x in gates],
                               S0 if "S" in names else None, P0 if "P" in names else None, Y0,
                               lam=lam[n0:], n0=n0)
    _close([O, Ym] + ([Sm] if "S" in names else []) + ([Pm] if "P" in names else []),
           [Ot, Y] + ([S] if "S" in names else []) + ([P] if "P" in names else []))


def test_l2norm():
    rng, x, _, dy = _inputs("l2", 6, 4, 4)
    _close([l2norm(x), l2norm_vjp(x, dy)], [vl.l2norm(x), vl.l2norm_vjp(x, dy)])
