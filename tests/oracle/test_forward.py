# SPDX-License-Identifier: Apache-2.0
"""`hila run` forward (outputs and final states) vs the float64 oracles, max rel. error <= 1e-10."""
import pytest

import reference as ref
from cases import Problem, check, edge_problems, forward_forms, params, shape_problems, varlen_problems

FEW_FORMS = forward_forms(chunks=(4, 16), scan_chunks=(16,))


@pytest.mark.parametrize("p,form,chunk", params(shape_problems(), forward_forms()))
def test_forward(hila, p, form, chunk):
    """every op x form x chunk size x T x (G = 1, 2; H = 4), B = 2, no initial state, tied gates."""
    check(hila, p, form, chunk)


def _options():
    out = []
    for T in (5, 65):
        out += [Problem(op, T=T, untied=True) for op in ref.HLA_OPS]
        out += [Problem("hla2", T=T, normalize=True, positive=True, eps=1e-6),
                Problem("hla2", T=T, normalize=True, positive=True, eps=0.25, G=1),
                Problem("hla2", T=T, normalize=True, positive=True, untied=True, eps=1e-3)]
        out += [Problem(op, T=T, normalize=True, positive=True, eps=1e-3) for op in ref.HLA_OPS if op != "hla2"]
        out += [Problem(op, T=T, ridge=0.3) for op in ref.RIDGE_OPS]
        out += [Problem(op, T=T, ridge=0.3, normalize=True, positive=True, eps=1e-3) for op in ref.RIDGE_OPS]
        out += [Problem("hla2", T=T, ridge=0.7, untied=True, G=1)]
        out += [Problem(op, T=T, qk_l2norm=True) for op in ref.DELTA_OPS]
    out += [Problem(op, T=65, scale=0.83) for op in ref.ALL_OPS]
    out += [Problem(op, T=37, extra_levels=2) for op in ref.LOGLINEAR_OPS]
    out += [Problem(op, T=33, gated=False) for op in ref.ALL_OPS]
    return out


@pytest.mark.parametrize("p,form,chunk", params(_options(), FEW_FORMS))
def test_forward_options(hila, p, form, chunk):
    """untied gates (HLA ops), normalize (HLA ops), ridge (hla2, loglinear_hla2), qk_l2norm (gdn ops),
       explicit --scale, extra lam levels, no g tensor (ungated)."""
    check(hila, p, form, chunk)


def _states():
    out = []
    for op in ref.ALL_OPS:
        n0s = (13, 64) if ref.is_loglinear(op) else (13,)
        for n0 in n0s:
            for T in (1, 5, 65):
                out.append(Problem(op, T=T, n0=n0))
        if op in ref.HLA_OPS:
            out.append(Problem(op, T=37, n0=n0s[-1], untied=True))
    out += [Problem("hla2", T=40, n0=13, normalize=True, positive=True, state="prefix"),
            Problem("loglinear_hla2", T=40, n0=64, normalize=True, positive=True, state="prefix"),
            Problem("hla2", T=40, n0=13, ridge=0.3),
            Problem("loglinear_hla2", T=40, n0=13, ridge=0.3),
            Problem("gdn", T=40, n0=13, qk_l2norm=True),
            Problem("loglinear_gdn", T=40, n0=64, qk_l2norm=True)]
    out += [Problem(op, T=20, n0=21, extra_slots=2) for op in ref.LOGLINEAR_OPS]
    # positions where the Fenwick state crosses a power of two
    out += [Problem("loglinear", T=T, n0=n0, G=1) for n0, T in ((63, 1), (63, 2), (127, 3), (96, 33))]
    return out


@pytest.mark.parametrize("p,form,chunk", params(_states(), FEW_FORMS))
def test_forward_initial_state(hila, p, form, chunk):
    """random initial state (canonical Fenwick state at n0 for log-linear ops; S, P, H parts)."""
    check(hila, p, form, chunk)


@pytest.mark.parametrize("p,form,chunk", params(varlen_problems(), FEW_FORMS))
def test_forward_varlen(hila, p, form, chunk):
    """packed sequences (cu_seqlens, B = 1) with zero-length ones, without and with initial states."""
    check(hila, p, form, chunk)


@pytest.mark.parametrize("p,form,chunk", params(edge_problems(), FEW_FORMS))
def test_forward_edges(hila, p, form, chunk):
    """T = 0, positions near 2^40, per-row positions in a batch, dk != dv both ways."""
    check(hila, p, form, chunk)
