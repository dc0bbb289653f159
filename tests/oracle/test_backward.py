# SPDX-License-Identifier: Apache-2.0
"""`hila run --backward` gradients vs the float64 VJP oracles, max rel. error <= 1e-9.

Oracles (tests/oracle/oracles): gla, gdn, loglinear, loglinear_gdn: first_order.*_vjp (the
hand-derived VJP of the masked-matrix form, docs/math/LOGLINEAR.md §5.1, §6.5);  the HLA family and
its log-linear versions: hla.compose_vjp, the composition of the primitives' VJPs with states,
ridge and normalize (docs/math/HLA.md §7.2);  qk_l2norm: transforms.l2norm_vjp. The oracles and
the assembly are checked against finite differences in test_reference_selfcheck.py.
"""
import pytest

import reference as ref
from cases import Problem, backward_forms, check, edge_problems, params, shape_problems, varlen_problems


def _few_forms(p):
    return backward_forms(p.op, chunks=(4, 16))


@pytest.mark.parametrize("p,form,chunk", params(shape_problems(backward=True), lambda p: backward_forms(p.op)))
def test_backward(hila, p, form, chunk):
    """every op x backward form x chunk size x T x (G = 1, 2; H = 4), B = 2, tied gates."""
    check(hila, p, form, chunk)


def _options():
    out = []
    for T in (5, 65):
        out += [Problem(op, T=T, untied=True, backward=True) for op in ref.HLA_OPS]
        out += [Problem("hla2", T=T, normalize=True, positive=True, eps=1e-6, backward=True),
                Problem("hla2", T=T, normalize=True, positive=True, eps=0.25, untied=True, G=1, backward=True)]
        out += [Problem(op, T=T, normalize=True, positive=True, eps=1e-3, backward=True)
                for op in ref.HLA_OPS if op != "hla2"]
        out += [Problem(op, T=T, ridge=0.3, backward=True) for op in ref.RIDGE_OPS]
        out += [Problem(op, T=T, ridge=0.3, normalize=True, positive=True, eps=1e-3, backward=True)
                for op in ref.RIDGE_OPS]
        out += [Problem(op, T=T, qk_l2norm=True, backward=True) for op in ref.DELTA_OPS]
    out += [Problem(op, T=65, scale=0.83, backward=True) for op in ref.ALL_OPS]
    out += [Problem(op, T=37, extra_levels=2, backward=True) for op in ref.LOGLINEAR_OPS]
    out += [Problem(op, T=33, gated=False, backward=True) for op in ref.ALL_OPS]
    out += [Problem(op, T=33, dht=True, backward=True) for op in ref.ALL_OPS]    # dht without h0
    return out


@pytest.mark.parametrize("p,form,chunk", params(_options(), _few_forms))
def test_backward_options(hila, p, form, chunk):
    """untied gates, normalize, ridge, qk_l2norm, final-state cotangent without h0, --scale, extra (unread) lam levels (dlam == 0 there),
       no g tensor (ungated: no dg)."""
    check(hila, p, form, chunk)


def _states():
    out = []
    for op in ref.ALL_OPS:
        n0s = (13, 64) if ref.is_loglinear(op) else (13,)
        for n0 in n0s:
            for T in (1, 5, 65):
                out.append(Problem(op, T=T, n0=n0, dht=True, backward=True))
            out.append(Problem(op, T=40, n0=n0, backward=True))           # h0 without final cotangent
        if op in ref.HLA_OPS:
            out.append(Problem(op, T=37, n0=n0s[-1], untied=True, dht=True, backward=True))
    out += [Problem("hla2", T=40, n0=13, normalize=True, positive=True, state="prefix", dht=True, backward=True),
            Problem("loglinear_hla2", T=40, n0=64, normalize=True, positive=True, state="prefix", dht=True,
                    backward=True),
            Problem("hla2", T=40, n0=13, ridge=0.3, dht=True, backward=True),
            Problem("loglinear_hla2", T=40, n0=13, ridge=0.3, dht=True, backward=True),
            Problem("gdn", T=40, n0=13, qk_l2norm=True, dht=True, backward=True),
            Problem("loglinear_gdn", T=40, n0=64, qk_l2norm=True, dht=True, backward=True)]
    out += [Problem(op, T=20, n0=21, extra_slots=2, dht=True, backward=True) for op in ref.LOGLINEAR_OPS]
    return out


@pytest.mark.parametrize("p,form,chunk", params(_states(), _few_forms))
def test_backward_initial_state(hila, p, form, chunk):
    """initial state h0 and final-state cotangents dht: gradients incl. dh0.S/P/H."""
    check(hila, p, form, chunk)


def _dead_slots():
    return [Problem(op, T=T, n0=n0, dht=True, dead_dht=True, backward=True, G=1)
            for op in ("loglinear", "loglinear_hla3", "loglinear_gdn") for n0, T in ((13, 5), (64, 40))]


@pytest.mark.parametrize("p,form,chunk", params(_dead_slots(), _few_forms))
def test_backward_dead_slot_cotangent_ignored(hila, p, form, chunk):
    """cotangents on Fenwick slots that are structurally zero in the final state change nothing."""
    check(hila, p, form, chunk)


@pytest.mark.parametrize("p,form,chunk", params(varlen_problems(backward=True), _few_forms))
def test_backward_varlen(hila, p, form, chunk):
    """packed sequences, with zero-length ones, with and without initial states and cotangents."""
    check(hila, p, form, chunk)


@pytest.mark.parametrize("p,form,chunk", params(edge_problems(backward=True), _few_forms))
def test_backward_edges(hila, p, form, chunk):
    """T = 0 (dh0 = dht re-keyed), positions near 2^40, per-row positions, dk != dv both ways."""
    check(hila, p, form, chunk)
