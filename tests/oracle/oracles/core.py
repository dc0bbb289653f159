# SPDX-License-Identifier: Apache-2.0
"""The masked-matrix form shared by every first-order operator, and its hand-derived VJP.

One head, one call of T tokens, queries already scaled (q = q̂):

    O  = (D ∘ Γ ∘ Mix) diag(β) V + Σ_b diag(e^c ∘ r_b) Q̃ H0_b                [T, dv]
    Hf[slot] = Kᵀ Tm diag(β ∘ w ∘ 1[slot_s = slot]) V
             + Σ_{b: slot_b = slot} e^{c_{T-1}} (I − Kᵀ W) H0_b                [n_slots, d, dv]

    c = cumsum(g),  Γ[t, s] = e^{c_t − c_s} (s ≤ t),  w_s = e^{c_{T-1} − c_s}
    X = tril(q Kᵀ)
    delta rule (β given):  Tm = (I + tril₋₁(diag(β) K Kᵀ))⁻¹,  W = Tm diag(β) K,
                           D = X Tm,  Q̃ = q − X W
    plain (β absent):      Tm = I, W = 0, D = X, Q̃ = q, and β ≡ 1 in front of V

Mix[t, s] is the mixing weight of the pair (1 for gla / gdn, λ_t^{ℓ(t,s)} for the log-linear
operators); block b of the initial state is read by row t with weight r_b[t] and lands in final
slot slot_b; token s lands in slot slot_s. docs/math/LOGLINEAR.md §3.1 (plain), §6.2 (delta rule),
§5.1 and §6.5 (VJPs); docs/math/HLA.md §1, §7.1 (gla). The wrappers in first_order.py build Mix,
r, slot for the flat (one matrix) and the Fenwick (one matrix per level) state.
"""
from dataclasses import dataclass

import numpy as np


def decay_matrix(g):
    """Γ[t, s] = exp(c_t − c_s) for s ≤ t, 0 above the diagonal (exponents ≤ 0 when g ≤ 0)."""
    c = np.cumsum(g)
    T = len(g)
    low = np.tril(np.ones((T, T), dtype=bool))
    return np.exp(np.where(low, c[:, None] - c[None, :], -np.inf))


@dataclass
class Layout:
    """Where the mixing weights, the state reads and the state writes of one call go."""
    mix: np.ndarray          # [T, T] pair weights, read on s ≤ t only
    read: np.ndarray         # [nb, T] weight of initial block b in row t
    block_slot: list         # [nb] final slot of initial block b
    write_slot: np.ndarray   # [T] final slot of token s
    n_slots: int


def _forward_parts(q, K, V, g, lay, beta):
    T = len(q)
    c = np.cumsum(g)
    G = decay_matrix(g)
    X = np.tril(q @ K.T)
    if beta is None:
        Tm, W, D, Qt, Vb = np.eye(T), np.zeros_like(K), X, q, V
    else:
        Tm = np.linalg.inv(np.eye(T) + np.tril(beta[:, None] * (K @ K.T), -1))
        W = Tm @ (beta[:, None] * K)
        D = X @ Tm
        Qt = q - X @ W
        Vb = beta[:, None] * V
    E = G * np.tril(lay.mix)
    return dict(c=c, G=G, X=X, Tm=Tm, W=W, D=D, Qt=Qt, Vb=Vb, E=E, P=D * E,
                w=np.exp(c[-1] - c), eC=np.exp(c[-1]))


def _erase(K, W, H, delta):
    """(I − Kᵀ W) H: the product of the call's erase maps applied to a state block."""
    return H - K.T @ (W @ H) if delta else H


def forward(q, K, V, g, lay, H0, beta=None):
    """O [T, dv] and the final slots Hf [n_slots, d, dv]. H0: [nb, d, dv] initial blocks."""
    T, d = q.shape
    dv = V.shape[1]
    Hf = np.zeros((lay.n_slots, d, dv))
    if T == 0:
        for b, s in enumerate(lay.block_slot):
            Hf[s] += H0[b]
        return np.zeros((0, dv)), Hf
    f = _forward_parts(q, K, V, g, lay, beta)
    O = f["P"] @ f["Vb"]
    for b in range(len(H0)):
        O += (np.exp(f["c"]) * lay.read[b])[:, None] * (f["Qt"] @ H0[b])
    for slot in np.unique(lay.write_slot):
        y = (f["w"] * (lay.write_slot == slot))[:, None] * f["Vb"]
        Hf[slot] += K.T @ (f["Tm"] @ y)
    for b, s in enumerate(lay.block_slot):
        Hf[s] += f["eC"] * _erase(K, f["W"], H0[b], beta is not None)
    return O, Hf


def vjp(q, K, V, g, lay, H0, dO, dHf=None, beta=None):
    """Reverse mode of `forward` (docs/math/LOGLINEAR.md §5.1, §6.5). dHf: [n_slots, d, dv] or None.
       Returns dict dq, dk, dv, dg, dmix [T, T] (lower triangle), dread [nb, T], dH0 [nb, d, dv],
       dbeta (None without the delta rule)."""
    T, d = q.shape
    dv = V.shape[1]
    nb = len(H0)
    delta = beta is not None
    if dHf is None:
        dHf = np.zeros((lay.n_slots, d, dv))
    r = dict(dq=np.zeros((T, d)), dk=np.zeros((T, d)), dv=np.zeros((T, dv)), dg=np.zeros(T),
             dmix=np.zeros((T, T)), dread=np.zeros((nb, T)), dH0=np.zeros((nb, d, dv)),
             dbeta=np.zeros(T) if delta else None)
    if T == 0:
        for b, s in enumerate(lay.block_slot):
            r["dH0"][b] = dHf[s]
        return r
    f = _forward_parts(q, K, V, g, lay, beta)
    c, G, X, Tm, W, D, Qt, Vb, E, P, w, eC = (f[k] for k in
                                             ("c", "G", "X", "Tm", "W", "D", "Qt", "Vb", "E", "P", "w", "eC"))
    ec = np.exp(c)
    dc = np.zeros(T)       # gradient w.r.t. c = cumsum(g)
    dC = 0.0               # gradient w.r.t. c_{T-1} through e^{c_{T-1}} and w
    dQt = np.zeros((T, d))
    dTm = np.zeros((T, T))
    dW = np.zeros((T, d))
    # intra-call pairs: O += (D ∘ E) Vb
    dP = np.tril(dO @ Vb.T)
    dVb = P.T @ dO
    dD = dP * E
    dE = dP * D
    r["dmix"] = np.tril(dE * G)
    dG = dE * np.tril(lay.mix)
    # initial-state reads: O += diag(e^c ∘ r_b) Q̃ H0_b
    for b in range(nb):
        R = Qt @ H0[b]                                   # [T, d] x [d, dv]
        rowdot = np.sum(R * dO, 1)
        coef = ec * lay.read[b]
        dQt += coef[:, None] * (dO @ H0[b].T)
        r["dH0"][b] += Qt.T @ (coef[:, None] * dO)
        r["dread"][b] = ec * rowdot
        dc += coef * rowdot
    # final state, new tokens: Hf[slot] += Kᵀ Tm y_slot,  y_slot = diag(w ∘ 1_slot) Vb
    dw = np.zeros(T)
    for slot in np.unique(lay.write_slot):
        m = (lay.write_slot == slot).astype(float)
        y = (w * m)[:, None] * Vb
        Z = Tm @ y
        r["dk"] += Z @ dHf[slot].T
        dZ = K @ dHf[slot]                               # [T, d] x [d, dv]
        dTm += dZ @ y.T
        dy = Tm.T @ dZ
        dVb += (w * m)[:, None] * dy
        dw += m * np.sum(dy * Vb, 1)
    # final state, initial blocks: Hf[slot_b] += e^C (I − Kᵀ W) H0_b
    for b, s in enumerate(lay.block_slot):
        dF = dHf[s]
        F = _erase(K, W, H0[b], delta)
        dC += eC * np.sum(dF * F)
        r["dH0"][b] += eC * (dF - W.T @ (K @ dF) if delta else dF)
        if delta:
            WH = W @ H0[b]
            r["dk"] -= eC * (WH @ dF.T)
            dW -= eC * ((K @ dF) @ H0[b].T)
    dc -= dw * w
    dC += np.sum(dw * w)
    if delta:
        Kb = beta[:, None] * K
        # Q̃ = q − D Kb
        r["dq"] += dQt
        dD -= dQt @ Kb.T
        dKb = -D.T @ dQt
        # W = Tm Kb
        dTm += dW @ Kb.T
        dKb += Tm.T @ dW
        # D = X Tm
        dX = dD @ Tm.T
        dTm += X.T @ dD
        # Tm = (I + N)⁻¹, N = tril₋₁(diag(β) K Kᵀ)
        dN = np.tril(-Tm.T @ dTm @ Tm.T, -1)
        r["dbeta"] += np.sum(dN * (K @ K.T), 1)
        bdN = beta[:, None] * dN
        r["dk"] += bdN @ K + bdN.T @ K
        # Kb = diag(β) K, Vb = diag(β) V
        r["dk"] += beta[:, None] * dKb
        r["dbeta"] += np.sum(dKb * K, 1) + np.sum(dVb * V, 1)
        r["dv"] += beta[:, None] * dVb
    else:
        r["dq"] += dQt
        dX = dD
        r["dv"] += dVb
    # X = tril(q Kᵀ)
    dX = np.tril(dX)
    r["dq"] += dX @ K
    r["dk"] += dX.T @ q
    # Γ[t, s] = e^{c_t − c_s}
    dGG = dG * G
    dc += np.sum(dGG, 1) - np.sum(dGG, 0)
    dc[-1] += dC
    r["dg"] = np.cumsum(dc[::-1])[::-1]
    return r
