# SPDX-License-Identifier: Apache-2.0
"""The four first-order operators in masked-matrix form, with states and VJPs.

    gla            o_t = Σ_{s≤t} Γ_{t,s} (q_t·k_s) v_s + e^{c_t} H0ᵀ q_t              HLA.md §1
    loglinear      o_t = Σ_{s≤t} λ_t^{ℓ(t,s)} Γ_{t,s} (q_t·k_s) v_s + Fenwick reads    LOGLINEAR.md §3.1
    gdn            S_t = a_t (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ, o_t = S_tᵀ q_t  LOGLINEAR.md §6.1
    loglinear_gdn  the delta rule inside every Fenwick level                          LOGLINEAR.md §6.1

(docs/math/…). q is the scaled query. Flat states are one [d, dv] matrix; Fenwick states are the
canonical [bitlen(n)+1, d, dv] arrays of LOGLINEAR.md §2.5 (slot = level, dead slots zero). Every
function here builds a core.Layout and calls core.forward / core.vjp.
"""
import numpy as np

from . import core
from .levels import bitlen_array, level_matrix, levels_needed, live_levels, read_levels, sigma, state_slots


# ------------------------------------------------------------------------------ layouts
def flat_layout(T):
    """gla / gdn: Mix ≡ 1, one state matrix read with weight 1 and written to slot 0."""
    return core.Layout(mix=np.ones((T, T)), read=np.ones((1, T)), block_slot=[0],
                       write_slot=np.zeros(T, dtype=np.int64), n_slots=1)


def check_lambda(lam, n0, T):
    need = levels_needed(n0, T)
    if lam.ndim != 2 or lam.shape[0] != T or lam.shape[1] < need:
        raise ValueError(f"lam must be [T={T}, >= {need}] for positions {n0}..{n0 + T - 1}, got {lam.shape}")


def canonical_blocks(H0, n0, d, dv):
    """live levels of a canonical state at n0 and their matrices; rejects missing slots and
       non-zero dead slots (LOGLINEAR.md §2.5, §11)."""
    live = live_levels(n0)
    if H0 is None:
        return live, np.zeros((len(live), d, dv))
    H0 = np.asarray(H0, dtype=np.float64)
    if H0.ndim != 3 or H0.shape[1:] != (d, dv) or H0.shape[0] < state_slots(n0):
        raise ValueError(f"state at position {n0} must be [>= {state_slots(n0)}, {d}, {dv}], got {H0.shape}")
    dead = [l for l in range(H0.shape[0]) if l not in live and np.any(H0[l])]
    if dead:
        raise ValueError(f"state at position {n0} is not canonical: non-zero dead slots {dead}")
    return live, np.stack([H0[l] for l in live]) if live else np.zeros((0, d, dv))


def fenwick_layout(lam, n0, T, live):
    """log-linear: Mix[t, s] = λ_t^{ℓ(t,s)}; block l (live at n0) is read at level ℓ(t, σ_l(n0))
       and lands in slot ℓ(n, σ_l(n0)); token s lands in slot ℓ(n, s), n = n0 + T (LOGLINEAR.md §2.4)."""
    n = n0 + T
    LV = level_matrix(n0, T)
    mix = np.where(LV >= 0, np.take_along_axis(lam, np.clip(LV, 0, None), 1), 0.0) if T else np.zeros((0, 0))
    rows = np.arange(T)
    read = np.array([lam[rows, read_levels(n0, T, l)] for l in live]).reshape(len(live), T)
    pos = np.arange(T, dtype=np.int64) + np.int64(n0)
    write = bitlen_array(np.int64(n) ^ pos)
    block = [int(bitlen_array(np.int64(n) ^ np.int64(sigma(n0, l)))) for l in live]
    return core.Layout(mix=mix, read=read, block_slot=block, write_slot=write, n_slots=state_slots(n)), LV


def _scatter_lam(lam, n0, T, live, LV, dmix, dread):
    """dλ[t, l] = Σ_{s: ℓ(t,s)=l} dMix[t, s] + Σ_{b: ℓ(t, σ_b(n0)) = l} dr_b[t]; 0 on unread entries."""
    dlam = np.zeros_like(lam)
    rows = np.repeat(np.arange(T), T)
    low = LV.ravel() >= 0
    np.add.at(dlam, (rows[low], LV.ravel()[low]), dmix.ravel()[low])
    for b, l in enumerate(live):
        np.add.at(dlam, (np.arange(T), read_levels(n0, T, l)), dread[b])
    return dlam


def _slots(dHn, n_slots, d, dv):
    """cotangent of the final state over exactly n_slots slots (extra slots are structurally zero
       outputs, so their cotangents are dropped; missing ones are zero)."""
    out = np.zeros((n_slots, d, dv))
    if dHn is not None:
        k = min(n_slots, dHn.shape[0])
        out[:k] = dHn[:k]
    return out


# ------------------------------------------------------------------------------ flat: gla, gdn
def _flat(q, K, V, g, H0, beta):
    d, dv = K.shape[1], V.shape[1]
    H0 = np.zeros((d, dv)) if H0 is None else np.asarray(H0, dtype=np.float64)
    O, Hf = core.forward(q, K, V, g, flat_layout(len(q)), H0[None], beta)
    return O, Hf[0]


def _flat_vjp(q, K, V, g, dO, H0, dHT, beta):
    d, dv = K.shape[1], V.shape[1]
    H0 = np.zeros((d, dv)) if H0 is None else np.asarray(H0, dtype=np.float64)
    dHf = None if dHT is None else np.asarray(dHT, dtype=np.float64)[None]
    return core.vjp(q, K, V, g, flat_layout(len(q)), H0[None], dO, dHf, beta)


def gla(q, K, V, g, H0=None):
    """(O [T, dv], H_T [d, dv]) of gated linear attention with initial state H0 (HLA.md §1)."""
    return _flat(q, K, V, g, H0, None)


def gla_vjp(q, K, V, g, dO, H0=None, dHT=None):
    """VJP of (O, H_T) w.r.t. (q, K, V, g, H0) for cotangents (dO, dH_T) (HLA.md §7.1)."""
    r = _flat_vjp(q, K, V, g, dO, H0, dHT, None)
    return r["dq"], r["dk"], r["dv"], r["dg"], r["dH0"][0]


def gdn(q, K, V, beta, g, H0=None):
    """(O, S_T) of Gated DeltaNet with initial state H0 (LOGLINEAR.md §6.1, UT form §6.2)."""
    return _flat(q, K, V, g, H0, np.asarray(beta, dtype=np.float64))


def gdn_vjp(q, K, V, beta, g, dO, H0=None, dHT=None):
    """VJP of (O, S_T): dq, dK, dV, dβ, dg, dH0 (LOGLINEAR.md §6.5 at λ ≡ 1, flat state)."""
    r = _flat_vjp(q, K, V, g, dO, H0, dHT, np.asarray(beta, dtype=np.float64))
    return r["dq"], r["dk"], r["dv"], r["dbeta"], r["dg"], r["dH0"][0]


# ------------------------------------------------------------------------------ Fenwick: loglinear, loglinear_gdn
def _fenwick(q, K, V, g, lam, n0, H0, beta):
    T, d = q.shape
    dv = V.shape[1]
    check_lambda(lam, n0, T)
    live, blocks = canonical_blocks(H0, n0, d, dv)
    lay, _ = fenwick_layout(lam, n0, T, live)
    return core.forward(q, K, V, g, lay, blocks, beta)


def _fenwick_vjp(q, K, V, g, lam, dO, n0, H0, dHn, beta):
    T, d = q.shape
    dv = V.shape[1]
    check_lambda(lam, n0, T)
    live, blocks = canonical_blocks(H0, n0, d, dv)
    lay, LV = fenwick_layout(lam, n0, T, live)
    r = core.vjp(q, K, V, g, lay, blocks, dO, _slots(dHn, lay.n_slots, d, dv), beta)
    r["dlam"] = _scatter_lam(lam, n0, T, live, LV, r["dmix"], r["dread"])
    dH0 = np.zeros((state_slots(n0) if H0 is None else H0.shape[0], d, dv))
    for b, l in enumerate(live):
        dH0[l] = r["dH0"][b]
    r["dH0"] = dH0
    return r


def loglinear(q, K, V, g, lam, n0=0, H0=None):
    """(O, H_n) of log-linear Mamba-2 from the canonical state H0 at n0; H_n: [bitlen(n)+1, d, dv]
       at n = n0 + T (LOGLINEAR.md §3.1, §3.4)."""
    return _fenwick(q, K, V, g, lam, n0, H0, None)


def loglinear_vjp(q, K, V, g, lam, dO, n0=0, H0=None, dHn=None):
    """dq, dK, dV, dg, dλ, dH0 (shape of H0, zero on dead slots) (LOGLINEAR.md §5.1)."""
    r = _fenwick_vjp(q, K, V, g, lam, dO, n0, H0, dHn, None)
    return r["dq"], r["dk"], r["dv"], r["dg"], r["dlam"], r["dH0"]


def loglinear_gdn(q, K, V, beta, g, lam, n0=0, H0=None):
    """(O, H_n) of log-linear Gated DeltaNet (LOGLINEAR.md §6.1, UT form §6.2)."""
    return _fenwick(q, K, V, g, lam, n0, H0, np.asarray(beta, dtype=np.float64))


def loglinear_gdn_vjp(q, K, V, beta, g, lam, dO, n0=0, H0=None, dHn=None):
    """dq, dK, dV, dβ, dg, dλ, dH0 (LOGLINEAR.md §6.5)."""
    r = _fenwick_vjp(q, K, V, g, lam, dO, n0, H0, dHn, np.asarray(beta, dtype=np.float64))
    return r["dq"], r["dk"], r["dv"], r["dbeta"], r["dg"], r["dlam"], r["dH0"]
