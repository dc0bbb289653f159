# SPDX-License-Identifier: Apache-2.0
"""Higher-order linear attention: hla2, ahla, hla3 and their log-linear versions (docs/math/HLA.md
§2–§7, §9; docs/math/LOGLINEAR.md §7).

Three independent forms, checked against each other in test_reference_selfcheck.py:
* `brute`: the definitions as plain triple sums over token indices (no state, n0 = 0);
* `masked`: the masked-matrix forms (no state);
* `serial`: the per-token recurrences, from arbitrary states (S, P and the outer state Y; Y is a
  flat [d, dv] matrix, or a canonical Fenwick state for the log-linear operators);
and the form the reference model uses, `compose` / `compose_vjp`: the operators as compositions of
the first-order primitives (inner gla, outer gla or loglinear), with states, ridge and normalize,
and the VJP as the composition of the primitives' VJPs (HLA.md §7.2). `hla2_serial_adjoint` is the
reverse-time adjoint of HLA.md §7.3, an independent VJP of hla2.

Gates are untied: one log-gate vector per primitive, inner first (HLA.md §2); tied gates pass the
same vector for each. q is the scaled query everywhere.
"""
import numpy as np

from .core import decay_matrix
from .first_order import gla, gla_vjp, loglinear, loglinear_vjp
from .levels import level, level_matrix
from .recurrences import fenwick_step

GATES = {"hla2": ("S", "Y"), "ahla": ("P", "E"), "hla3": ("S", "P", "X")}   # inner first, outer last
KINDS = tuple(GATES)


def ones_col(V):
    """[V | 1]: the value with the denominator column of normalize (HLA.md §4)."""
    return np.hstack([V, np.ones((V.shape[0], 1))])


# ------------------------------------------------------------------------------ definitions (triple sums)
def _lam(lam, t, s):
    return 1.0 if lam is None else lam[t, level(t, s)]


def hla2_brute(q, K, V, gS, gY, lam=None):
    """o_t = Σ_{i≤j≤t} λ_t^{ℓ(t,j)} Γ^Y_{t,j} Γ^S_{j,i} (q_t·k_i)(q_j·k_i) v_j   (λ ≡ 1 when lam is None)."""
    T = len(q)
    GS, GY = decay_matrix(gS), decay_matrix(gY)
    O = np.zeros((T, V.shape[1]))
    for t in range(T):
        for j in range(t + 1):
            for i in range(j + 1):
                O[t] += _lam(lam, t, j) * GY[t, j] * GS[j, i] * (q[t] @ K[i]) * (q[j] @ K[i]) * V[j]
    return O


def ahla_brute(q, K, V, gP, gE, lam=None):
    """o_t = Σ_{j≤i≤t} λ_t^{ℓ(t,i)} Γ^E_{t,i} Γ^P_{i,j} (q_t·k_i)(q_i·k_j) v_j."""
    T = len(q)
    GP, GE = decay_matrix(gP), decay_matrix(gE)
    O = np.zeros((T, V.shape[1]))
    for t in range(T):
        for i in range(t + 1):
            for j in range(i + 1):
                O[t] += _lam(lam, t, i) * GE[t, i] * GP[i, j] * (q[t] @ K[i]) * (q[i] @ K[j]) * V[j]
    return O


def hla3_brute(q, K, V, gS, gP, gX, lam=None):
    """o_t = Σ_{u≤t} Σ_{i≤u} Σ_{j≤u} λ_t^{ℓ(t,u)} Γ^X_{t,u} Γ^S_{u,i} Γ^P_{u,j} (q_t·k_i)(q_u·k_i)(q_u·k_j) v_j."""
    T = len(q)
    GS, GP, GX = decay_matrix(gS), decay_matrix(gP), decay_matrix(gX)
    O = np.zeros((T, V.shape[1]))
    for t in range(T):
        for u in range(t + 1):
            for i in range(u + 1):
                for j in range(u + 1):
                    O[t] += (_lam(lam, t, u) * GX[t, u] * GS[u, i] * GP[u, j]
                             * (q[t] @ K[i]) * (q[u] @ K[i]) * (q[u] @ K[j]) * V[j])
    return O


BRUTE = {"hla2": hla2_brute, "ahla": ahla_brute, "hla3": hla3_brute}


# ------------------------------------------------------------------------------ masked-matrix forms
def _outer_mask(g, lam):
    """Γ ∘ Λ of the outer primitive, Λ[t, s] = λ_t^{ℓ(t,s)} (1 without λ)."""
    G = decay_matrix(g)
    if lam is None:
        return G
    LV = level_matrix(0, len(g))
    return G * np.where(LV >= 0, np.take_along_axis(lam, np.clip(LV, 0, None), 1), 0.0)


def hla2_masked(q, K, V, gS, gY, lam=None):
    """O = (Γ^Y ∘ Λ ∘ (W (Γ^S ∘ W)ᵀ)) V,  W = tril(q Kᵀ)   (HLA.md §3.1)."""
    W = np.tril(q @ K.T)
    return (_outer_mask(gY, lam) * (W @ (decay_matrix(gS) * W).T)) @ V


def ahla_masked(q, K, V, gP, gE, lam=None):
    """O = (Γ^E ∘ Λ ∘ q Kᵀ) ((Γ^P ∘ q Kᵀ) V)   (HLA.md §5.1)."""
    A = q @ K.T
    return (_outer_mask(gE, lam) * A) @ ((decay_matrix(gP) * A) @ V)


def hla3_masked(q, K, V, gS, gP, gX, lam=None):
    """O = (Γ^X ∘ Λ ∘ (W (Γ^S ∘ W)ᵀ)) (Γ^P ∘ W) V   (HLA.md §6.1)."""
    W = np.tril(q @ K.T)
    return (_outer_mask(gX, lam) * (W @ (decay_matrix(gS) * W).T)) @ ((decay_matrix(gP) * W) @ V)


MASKED = {"hla2": hla2_masked, "ahla": ahla_masked, "hla3": hla3_masked}


# ------------------------------------------------------------------------------ serial recurrences
def serial(kind, q, K, V, gates, S0=None, P0=None, Y0=None, lam=None, n0=0, ridge=0.0):
    """Per-token recurrences (HLA.md §3.2, §5.2, §6.2; LOGLINEAR.md §7):
         S ← a^S S + k kᵀ;  P ← a^P P + k vᵀ;  u = S q + ρ q;  h = Pᵀ q
         outer (key, value) = (u, v) hla2, (k, h) ahla, (u, h) hla3:
           flat:      Y ← a Y + key valueᵀ,  o = Yᵀ q
           Fenwick:   one decode step of loglinear at position n0 + t (lam given)
       Returns (O, S, P, Y) with the final states (S / P None where the operator has none)."""
    T, d = q.shape
    dv = V.shape[1]
    g = dict(zip(GATES[kind], gates))
    S = np.zeros((d, d)) if S0 is None else np.array(S0, dtype=np.float64)
    P = np.zeros((d, dv)) if P0 is None else np.array(P0, dtype=np.float64)
    if Y0 is not None:
        Y = np.array(Y0, dtype=np.float64)
    else:
        Y = np.zeros((d, dv)) if lam is None else np.zeros((int(n0).bit_length() + 1, d, dv))
    O = np.zeros((T, dv))
    out_gate = g[GATES[kind][-1]]
    for t in range(T):
        k = K[t]
        if "S" in g:
            S = np.exp(g["S"][t]) * S + np.outer(k, k)
        if "P" in g:
            P = np.exp(g["P"][t]) * P + np.outer(k, V[t])
        key = S @ q[t] + ridge * q[t] if kind != "ahla" else k
        val = V[t] if kind == "hla2" else P.T @ q[t]
        if lam is None:
            Y = np.exp(out_gate[t]) * Y + np.outer(key, val)
            O[t] = q[t] @ Y
        else:
            O[t], Y = fenwick_step(n0 + t, Y, q[t], key, val, out_gate[t], lam[t])
    return O, (S if "S" in g else None), (P if "P" in g else None), Y


def hla2_serial_adjoint(q, K, V, gS, gY, dO, S0=None, Y0=None, dST=None, dYT=None):
    """Reverse-time adjoint of the hla2 recurrence (HLA.md §7.3), from the stored states:
         Ȳ_t = q_t do_tᵀ + a^Y_{t+1} Ȳ_{t+1};  ū_t = Ȳ_t v_t;  dv_t = Ȳ_tᵀ u_t
         S̄_t = ū_t q_tᵀ + a^S_{t+1} S̄_{t+1};  dq_t = Y_t do_t + S_t ū_t;  dk_t = (S̄_t + S̄_tᵀ) k_t
         dg^Y_t = a^Y_t ⟨Ȳ_t, Y_{t−1}⟩;  dg^S_t = a^S_t ⟨S̄_t, S_{t−1}⟩
       with the final-state cotangents as Ȳ_T, S̄_T (a_T := 1) and dY0 = a^Y_0 Ȳ_0, dS0 = a^S_0 S̄_0
       (the dense gradient w.r.t. S0). Returns dq, dK, dV, dgS, dgY, dS0, dY0."""
    T, d = q.shape
    dv = V.shape[1]
    aS, aY = np.exp(gS), np.exp(gY)
    S = np.zeros((d, d)) if S0 is None else np.array(S0, dtype=np.float64)
    Y = np.zeros((d, dv)) if Y0 is None else np.array(Y0, dtype=np.float64)
    Ss, Ys, Us = [S], [Y], []
    for t in range(T):
        S = aS[t] * S + np.outer(K[t], K[t])
        u = S @ q[t]
        Y = aY[t] * Y + np.outer(u, V[t])
        Ss.append(S)
        Ys.append(Y)
        Us.append(u)
    dq, dK, dV = np.zeros_like(q), np.zeros_like(K), np.zeros_like(V)
    dgS, dgY = np.zeros(T), np.zeros(T)
    Yb = np.zeros((d, dv)) if dYT is None else np.array(dYT, dtype=np.float64)   # a_{t+1} Ȳ_{t+1}
    Sb = np.zeros((d, d)) if dST is None else np.array(dST, dtype=np.float64)
    for t in reversed(range(T)):
        Yb = np.outer(q[t], dO[t]) + Yb
        ub = Yb @ V[t]
        dV[t] = Yb.T @ Us[t]
        Sb = np.outer(ub, q[t]) + Sb
        dq[t] = Ys[t + 1] @ dO[t] + Ss[t + 1] @ ub
        dK[t] = (Sb + Sb.T) @ K[t]
        dgY[t] = aY[t] * np.sum(Yb * Ys[t])
        dgS[t] = aS[t] * np.sum(Sb * Ss[t])
        Yb, Sb = aY[t] * Yb, aS[t] * Sb
    return dq, dK, dV, dgS, dgY, Sb, Yb


# ------------------------------------------------------------------------------ composition of primitives
def _outer(q, key, val, g, lam, n0, Y0):
    if lam is None:
        return gla(q, key, val, g, Y0)
    return loglinear(q, key, val, g, lam, n0, Y0)


def _parts(kind, q, K, V, gates, S0, P0, Y0, lam, n0, ridge, normalize):
    """forward intermediates: inner outputs U, Hh, outer key / value, un-normalized O', final states."""
    g = dict(zip(GATES[kind], gates))
    Vx = ones_col(V) if normalize else V
    r = dict(Vx=Vx, S=None, P=None)
    if "S" in g:
        r["U"], r["S"] = gla(q, K, K, g["S"], S0)                  # u_j = S_j q_j
    if "P" in g:
        r["Hh"], r["P"] = gla(q, K, Vx, g["P"], P0)                # h_j = P_jᵀ q_j
    r["key"], r["val"] = {"hla2": lambda: (r["U"] + ridge * q, Vx),
                          "ahla": lambda: (K, r["Hh"]),
                          "hla3": lambda: (r["U"], r["Hh"])}[kind]()
    r["Of"], r["Y"] = _outer(q, r["key"], r["val"], gates[-1], lam, n0, Y0)
    return r


def compose(kind, q, K, V, gates, S0=None, P0=None, Y0=None, lam=None, n0=0, ridge=0.0,
            normalize=False, eps=1e-6):
    """hla2 = OUT(q, U + ρq, V), ahla = OUT(q, K, H), hla3 = OUT(q, U, H) with U = GLA_gS(q, K, K; S0),
       H = GLA_gP(q, K, V; P0), OUT = GLA_gout(·; Y0), or loglinear(·; λ, n0, Y0) when lam is given
       (HLA.md §0, §2, §3.2; LOGLINEAR.md §7). normalize: run on [V | 1], o = num / (den + eps) (HLA.md §4).
       Returns (O, S, P, Y): the output and the final states."""
    r = _parts(kind, q, K, V, gates, S0, P0, Y0, lam, n0, ridge, normalize)
    Of = r["Of"]
    O = Of[:, :-1] / (Of[:, -1:] + eps) if normalize else Of
    return O, r["S"], r["P"], r["Y"]


def normalize_cotangent(Of, dO, eps):
    """o = N / (D + ε) with [N | D] = O':  dN = dO / (D + ε),  dD = −Σ_cols(dO ∘ N) / (D + ε)²."""
    N, D = Of[:, :-1], Of[:, -1]
    return np.hstack([dO / (D + eps)[:, None], (-np.sum(dO * N, 1) / (D + eps) ** 2)[:, None]])


def compose_vjp(kind, q, K, V, gates, dO, S0=None, P0=None, Y0=None, dS=None, dP=None, dY=None,
                lam=None, n0=0, ridge=0.0, normalize=False, eps=1e-6):
    """VJP of (O, S, P, Y) = compose(...) for cotangents (dO, dS, dP, dY) (HLA.md §7.2): the outer
       primitive's VJP, then the inner ones' with the cotangents of U and H. Returns a dict with
       dq, dk, dv, dgates (list, inner first), dlam (None without lam), dS0 (dense), dP0, dY0."""
    r = _parts(kind, q, K, V, gates, S0, P0, Y0, lam, n0, ridge, normalize)
    g = dict(zip(GATES[kind], gates))
    dOf = normalize_cotangent(r["Of"], dO, eps) if normalize else dO
    out = dict(dlam=None, dS0=None, dP0=None)
    if lam is None:
        dq, dkey, dval, dgo, out["dY0"] = gla_vjp(q, r["key"], r["val"], gates[-1], dOf, Y0, dY)
    else:
        dq, dkey, dval, dgo, out["dlam"], out["dY0"] = loglinear_vjp(q, r["key"], r["val"], gates[-1], lam,
                                                                     dOf, n0, Y0, dY)
    dK = np.zeros_like(K)
    dgate = {GATES[kind][-1]: dgo}
    if kind == "hla2":
        dU, dVx = dkey, dval
        dq = dq + ridge * dU
    elif kind == "ahla":
        dK += dkey
        dH = dval
    else:
        dU, dH = dkey, dval
    if "S" in g:
        a, b_key, b_val, dgate["S"], out["dS0"] = gla_vjp(q, K, K, g["S"], dU, S0, dS)
        dq, dK = dq + a, dK + b_key + b_val
    if "P" in g:
        a, b, dVx, dgate["P"], out["dP0"] = gla_vjp(q, K, r["Vx"], g["P"], dH, P0, dP)
        dq, dK = dq + a, dK + b
    out.update(dq=dq, dk=dK, dv=dVx[:, :V.shape[1]], dgates=[dgate[n] for n in GATES[kind]])
    return out
