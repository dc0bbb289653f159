# SPDX-License-Identifier: Apache-2.0
"""Independent forms of the first-order operators, to check the masked-matrix forms against:

* serial recurrences, one token at a time (the decode step; docs/math/HLA.md §1,
  docs/math/LOGLINEAR.md §3.2, §6.3), and
* the definitions written as plain sums over token pairs, with the delta rule's transition
  products formed explicitly as d×d matrices (LOGLINEAR.md §3.1, §6.1).

q is the scaled query. Slow by design: use with small T.
"""
import numpy as np

from .levels import ctz, level, live_levels, sigma, state_slots


# ------------------------------------------------------------------------------ serial
def gla_serial(q, K, V, g, H0=None):
    """H_t = a_t H_{t−1} + k_t v_tᵀ, o_t = H_tᵀ q_t. Returns (O, H_T)."""
    T, d = q.shape
    H = np.zeros((d, V.shape[1])) if H0 is None else np.array(H0, dtype=np.float64)
    O = np.zeros((T, V.shape[1]))
    for t in range(T):
        H = np.exp(g[t]) * H + np.outer(K[t], V[t])
        O[t] = q[t] @ H
    return O, H


def gdn_serial(q, K, V, beta, g, H0=None):
    """S_t = a_t (S_{t−1} − β_t k_t (k_tᵀ S_{t−1})) + β_t k_t v_tᵀ, o_t = S_tᵀ q_t. Returns (O, S_T)."""
    T, d = q.shape
    S = np.zeros((d, V.shape[1])) if H0 is None else np.array(H0, dtype=np.float64)
    O = np.zeros((T, V.shape[1]))
    for t in range(T):
        S = np.exp(g[t]) * (S - beta[t] * np.outer(K[t], K[t] @ S)) + beta[t] * np.outer(K[t], V[t])
        O[t] = q[t] @ S
    return O, S


def fenwick_step(t, H, q, k, v, g, lam_t, beta=None):
    """One decode step at position t on the canonical state H (LOGLINEAR.md §3.2; §6.3 with β):
         1. grow H to bitlen(t+1)+1 slots
         2. every live level: H[l] ← a_t H[l]  (delta rule: a_t (I − β k kᵀ) H[l])
         3. o = λ^0 β (q·k) v + Σ_live λ^l H[l]ᵀ q            (β ≡ 1 without the delta rule)
         4. r = ctz(t+1): H[r+1] = β k vᵀ + Σ_{l=1..r} H[l];  H[1..r] = 0
       Returns (o, H at t+1)."""
    t = int(t)
    if len(lam_t) < t.bit_length() + 1:
        raise ValueError(f"lam_t has {len(lam_t)} levels, position {t} needs {t.bit_length() + 1}")
    slots = state_slots(t + 1)
    if H.shape[0] < slots:
        H = np.concatenate([H, np.zeros((slots - H.shape[0],) + H.shape[1:])])
    H = H.copy()
    b = 1.0 if beta is None else beta
    o = lam_t[0] * b * (q @ k) * v
    for l in live_levels(t):
        if beta is not None:
            H[l] = H[l] - beta * np.outer(k, k @ H[l])
        H[l] = np.exp(g) * H[l]
        o = o + lam_t[l] * (q @ H[l])
    r = ctz(t + 1)
    H[r + 1] = b * np.outer(k, v) + H[1:r + 1].sum(0)
    H[1:r + 1] = 0.0
    return o, H


def fenwick_serial(q, K, V, g, lam, n0=0, H0=None, beta=None):
    """Decode steps over positions n0 … n0+T−1 (loglinear; loglinear_gdn with β). Returns (O, H_n)."""
    T, d = q.shape
    dv = V.shape[1]
    H = np.zeros((state_slots(n0), d, dv)) if H0 is None else np.array(H0, dtype=np.float64)
    O = np.zeros((T, dv))
    for i in range(T):
        O[i], H = fenwick_step(n0 + i, H, q[i], K[i], V[i], g[i], lam[i], None if beta is None else beta[i])
    return O, H


# ------------------------------------------------------------------------------ definitions as sums
def loglinear_loop(q, K, V, g, lam, n0=0, H0=None):
    """o_t = Σ_{n0≤s≤t} λ_t^{ℓ(t,s)} Γ_{t,s} (q_t·k_s) v_s + e^{c_t} Σ_{l live at n0} λ_t^{ℓ(t,σ_l(n0))} H0[l]ᵀ q_t."""
    T = len(q)
    c = np.cumsum(g)
    O = np.zeros((T, V.shape[1]))
    for i in range(T):
        t = n0 + i
        for j in range(i + 1):
            O[i] += lam[i, level(t, n0 + j)] * np.exp(c[i] - c[j]) * (q[i] @ K[j]) * V[j]
        if H0 is not None:
            for l in live_levels(n0):
                O[i] += lam[i, level(t, sigma(n0, l))] * np.exp(c[i]) * (q[i] @ H0[l])
    return O


def delta_loop(q, K, V, beta, g, lam=None, n0=0, H0=None):
    """o_t = Σ_s λ_t^{ℓ(t,s)} q_tᵀ (A_t ⋯ A_{s+1}) β_s k_s v_sᵀ + Σ_l λ_t^{ℓ(t,σ_l(n0))} q_tᵀ (A_t ⋯ A_{n0}) H0[l],
       A_r = a_r (I − β_r k_r k_rᵀ) as explicit d×d matrices. lam None: λ ≡ 1 and a flat H0 [d, dv]."""
    T, d = q.shape
    O = np.zeros((T, V.shape[1]))
    for i in range(T):
        t = n0 + i
        for j in range(i + 1):
            prod = np.eye(d)
            for r in range(j + 1, i + 1):
                prod = np.exp(g[r]) * (np.eye(d) - beta[r] * np.outer(K[r], K[r])) @ prod
            w = 1.0 if lam is None else lam[i, level(t, n0 + j)]
            O[i] += w * (q[i] @ prod @ (beta[j] * K[j])) * V[j]
        if H0 is not None:
            prod = np.eye(d)
            for r in range(i + 1):
                prod = np.exp(g[r]) * (np.eye(d) - beta[r] * np.outer(K[r], K[r])) @ prod
            if lam is None:
                O[i] += q[i] @ prod @ H0
            else:
                for l in live_levels(n0):
                    O[i] += lam[i, level(t, sigma(n0, l))] * (q[i] @ prod @ H0[l])
    return O


# ------------------------------------------------------------------------------ packed sequences
def varlen_serial(q, K, V, g, lam, cu, n0s=None, H0s=None, beta=None):
    """Packed sequences (LOGLINEAR.md §4) by decode steps over the packed rows: sequence i owns rows
       cu[i] … cu[i+1]−1 at its own positions n0_i + (row − cu[i]), with its own gates and its own
       Fenwick state (H0s[i] at n0s[i], or empty); a zero-length sequence keeps its initial state.
       loglinear (beta None) or loglinear_gdn. Returns (O [rows, dv], [(n_i, H_i)])."""
    N = len(cu) - 1
    d, dv = K.shape[1], V.shape[1]
    O = np.zeros((len(q), dv))
    finals = []
    for i in range(N):
        t = 0 if n0s is None else int(n0s[i])
        H = np.zeros((state_slots(t), d, dv)) if H0s is None else np.array(H0s[i], dtype=np.float64)
        for row in range(int(cu[i]), int(cu[i + 1])):
            O[row], H = fenwick_step(t, H, q[row], K[row], V[row], g[row], lam[row],
                                     None if beta is None else beta[row])
            t += 1
        finals.append((t, H))
    return O, finals
