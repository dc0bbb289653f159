# SPDX-License-Identifier: Apache-2.0
"""Reference model of `hila run` in the CLI tensor layout, assembled from the float64 oracles.

Everything the oracles (package `oracles`, written from docs/math/HLA.md and docs/math/LOGLINEAR.md)
do per head ([T, d] arrays) is lifted here to the batched, sequence-first layout of the CLI: GQA
(value head h reads q/k group h // (H // G); dq/dk sum over the heads of a group), varlen packing
(cu_seqlens, B == 1), tied/untied gates, initial/final states in the CLI's packed formats, and the
optional transforms (normalize, ridge, qk_l2norm, scale).

Oracles used per head:
  gla, gdn                 first_order.gla / gdn and their *_vjp (flat state H0, cotangent dH_T)
  loglinear, loglinear_gdn first_order.loglinear / loglinear_gdn and *_vjp (canonical Fenwick state)
  hla2/ahla/hla3 and the   hla.compose / compose_vjp: inner gla primitives, outer gla or loglinear
  loglinear_hla* ops       (HLA.md §2, §7.2; LOGLINEAR.md §7), with states S, P, Y, ridge, normalize
  qk_l2norm                transforms.l2norm / l2norm_vjp
  finite differences       transforms.fd_grad
Every oracle is checked against independent forms (plain sums, serial recurrences, finite
differences) in test_reference_selfcheck.py, which also checks this assembly.
"""
from dataclasses import dataclass, field

import numpy as np

from oracles import first_order as fo
from oracles import hla as hl
from oracles.levels import levels_needed, live_levels, state_slots  # noqa: F401  (used by cases.py)
from oracles.transforms import fd_grad, l2norm, l2norm_vjp

# ------------------------------------------------------------------------------ op tables
GLA_FAMILY = ("gla", "hla2", "ahla", "hla3")
LOGLINEAR_OPS = ("loglinear", "loglinear_hla2", "loglinear_ahla", "loglinear_hla3", "loglinear_gdn")
ALL_OPS = ("gla", "hla2", "ahla", "hla3", "loglinear", "loglinear_hla2", "loglinear_ahla",
           "loglinear_hla3", "gdn", "loglinear_gdn")
HLA_KIND = {"hla2": "hla2", "ahla": "ahla", "hla3": "hla3",
            "loglinear_hla2": "hla2", "loglinear_ahla": "ahla", "loglinear_hla3": "hla3"}
HLA_OPS = tuple(HLA_KIND)
DELTA_OPS = ("gdn", "loglinear_gdn")
RIDGE_OPS = ("hla2", "loglinear_hla2")
# untied gate columns, inner primitives first (docs/math/HLA.md §2)
GATE_NAMES = hl.GATES
STATE_PARTS = {"gla": ("H",), "hla2": ("S", "H"), "ahla": ("P", "H"), "hla3": ("S", "P", "H"),
               "loglinear": ("H",), "loglinear_hla2": ("S", "H"), "loglinear_ahla": ("P", "H"),
               "loglinear_hla3": ("S", "P", "H"), "gdn": ("H",), "loglinear_gdn": ("H",)}


def num_primitives(op):
    return len(GATE_NAMES[HLA_KIND[op]]) if op in HLA_KIND else 1


def is_loglinear(op):
    return op in LOGLINEAR_OPS


# ------------------------------------------------------------------------------ packing
def pack_sym(M):
    """row-major upper triangle: (0,0),(0,1)..(0,d-1),(1,1),..."""
    return M[np.triu_indices(M.shape[-1])]


def unpack_sym(p, d):
    M = np.zeros((d, d))
    iu = np.triu_indices(d)
    M[iu] = p
    M[(iu[1], iu[0])] = p
    return M


def unpack_upper(p, d):
    """a packed cotangent c as the (non-symmetric) matrix D with <D, S> = sum_{i<=j} c_ij S_ij."""
    M = np.zeros((d, d))
    M[np.triu_indices(d)] = p
    return M


def pack_grad_sym(G):
    """gradient w.r.t. the packed entries of S = unpack_sym(p): G_ij + G_ji (i<j), G_ii."""
    return pack_sym(G + G.T - np.diag(np.diag(G)))


def pad_slots(X, Ls):
    """zero-pad (or check-and-trim zeros of) the slot axis 0 of a [Ls', d, dv] array."""
    if X.shape[0] == Ls:
        return X
    if X.shape[0] > Ls:
        assert not np.any(X[Ls:]), "non-zero state slot dropped"
        return X[:Ls]
    return np.concatenate([X, np.zeros((Ls - X.shape[0],) + X.shape[1:])], 0)


# ------------------------------------------------------------------------------ options
@dataclass(frozen=True)
class Options:
    scale: float = None          # None: dk^-1/2
    normalize: bool = False
    eps: float = 1e-6
    ridge: float = 0.0
    qk_l2norm: bool = False


# ------------------------------------------------------------------------------ per-head state
@dataclass
class HeadState:
    n0: int = 0
    S: np.ndarray = None   # dense d x d
    P: np.ndarray = None   # d x dv'
    H: np.ndarray = None   # d x dv' or [Ls, d, dv'] (log-linear)


@dataclass
class HeadGrads:
    dq: np.ndarray = None
    dk: np.ndarray = None
    dv: np.ndarray = None
    dgates: list = field(default_factory=list)   # one per primitive
    dlam: np.ndarray = None
    dbeta: np.ndarray = None
    dS0: np.ndarray = None   # dense gradient w.r.t. the dense S0
    dP0: np.ndarray = None
    dH0: np.ndarray = None


# ------------------------------------------------------------------------------ HLA family (plain and log-linear)
def _hla_args(op, lam, st, o):
    return dict(S0=st.S, P0=st.P, Y0=st.H, lam=lam if is_loglinear(op) else None, n0=st.n0,
                ridge=o.ridge, normalize=o.normalize, eps=o.eps)


def hla_forward(op, Q, K, V, gates, lam, scale, st, o):
    O, S, P, Y = hl.compose(HLA_KIND[op], scale * Q, K, V, gates, **_hla_args(op, lam, st, o))
    return O, HeadState(st.n0 + len(Q), S, P, Y)


def hla_backward(op, Q, K, V, gates, lam, scale, st, dO, dst, o):
    r = hl.compose_vjp(HLA_KIND[op], scale * Q, K, V, gates, dO, dS=dst.S, dP=dst.P, dY=dst.H,
                       **_hla_args(op, lam, st, o))
    return HeadGrads(dq=scale * r["dq"], dk=r["dk"], dv=r["dv"], dgates=r["dgates"], dlam=r["dlam"],
                     dS0=r["dS0"], dP0=r["dP0"], dH0=r["dY0"])


# ------------------------------------------------------------------------------ first-order ops
def first_order_forward(op, Q, K, V, g, lam, beta, scale, st):
    q = scale * Q
    if op == "gla":
        O, HT = fo.gla(q, K, V, g, st.H)
    elif op == "loglinear":
        O, HT = fo.loglinear(q, K, V, g, lam, st.n0, st.H)
    elif op == "gdn":
        O, HT = fo.gdn(q, K, V, beta, g, st.H)
    elif op == "loglinear_gdn":
        O, HT = fo.loglinear_gdn(q, K, V, beta, g, lam, st.n0, st.H)
    else:
        raise ValueError(op)
    return O, HeadState(st.n0 + len(Q), None, None, HT)


def first_order_backward(op, Q, K, V, g, lam, beta, scale, st, dO, dst):
    q = scale * Q
    G = HeadGrads()
    if op == "gla":
        dq, G.dk, G.dv, dg, G.dH0 = fo.gla_vjp(q, K, V, g, dO, st.H, dst.H)
    elif op == "loglinear":
        dq, G.dk, G.dv, dg, G.dlam, G.dH0 = fo.loglinear_vjp(q, K, V, g, lam, dO, st.n0, st.H, dst.H)
    elif op == "gdn":
        dq, G.dk, G.dv, G.dbeta, dg, G.dH0 = fo.gdn_vjp(q, K, V, beta, g, dO, st.H, dst.H)
    elif op == "loglinear_gdn":
        dq, G.dk, G.dv, G.dbeta, dg, G.dlam, G.dH0 = fo.loglinear_gdn_vjp(q, K, V, beta, g, lam, dO, st.n0,
                                                                         st.H, dst.H)
    else:
        raise ValueError(op)
    G.dq = scale * dq
    G.dgates = [dg]
    return G


# ------------------------------------------------------------------------------ per-head dispatch
def head_forward(op, Q, K, V, gates, lam, beta, scale, st, o):
    if o.qk_l2norm:
        Q, K = l2norm(Q), l2norm(K)
    if op in HLA_KIND:
        return hla_forward(op, Q, K, V, gates, lam, scale, st, o)
    return first_order_forward(op, Q, K, V, gates[0], lam, beta, scale, st)


def head_backward(op, Q, K, V, gates, lam, beta, scale, st, dO, dst, o):
    Qr, Kr = Q, K
    if o.qk_l2norm:
        Q, K = l2norm(Q), l2norm(K)
    if op in HLA_KIND:
        G = hla_backward(op, Q, K, V, gates, lam, scale, st, dO, dst, o)
    else:
        G = first_order_backward(op, Q, K, V, gates[0], lam, beta, scale, st, dO, dst)
    if o.qk_l2norm:
        G.dq, G.dk = l2norm_vjp(Qr, G.dq), l2norm_vjp(Kr, G.dk)
    return G


# ------------------------------------------------------------------------------ CLI layout
def _sequences(inp):
    B, T = inp["q"].shape[:2]
    cu = inp.get("cu_seqlens")
    if cu is None:
        return [(b, 0, T) for b in range(B)]
    assert B == 1
    return [(0, int(cu[i]), int(cu[i + 1])) for i in range(len(cu) - 1)]


def _head_inputs(op, inp, b, r0, r1, h, rep):
    grp = h // rep
    Q = inp["q"][b, r0:r1, grp]
    K = inp["k"][b, r0:r1, grp]
    V = inp["v"][b, r0:r1, h]
    P = num_primitives(op)
    g = inp.get("g")
    if g is None:      # ungated: every log-gate 0
        gates = [np.zeros(r1 - r0)] * P
    else:
        gates = [g[b, r0:r1, h, p] for p in range(P)] if g.ndim == 4 else [g[b, r0:r1, h]] * P
    lam = inp["lam"][b, r0:r1, h] if "lam" in inp else None
    beta = inp["beta"][b, r0:r1, h] if "beta" in inp else None
    return Q, K, V, gates, lam, beta


def _head_state(inp, prefix, i, h, dk):
    """HeadState of sequence i, head h from tensors `prefix`.S/P/H (and pos)."""
    st = HeadState()
    if prefix + ".pos" in inp:
        st.n0 = int(inp[prefix + ".pos"][i])
    if prefix + ".S" in inp:
        p = inp[prefix + ".S"][i, h]
        st.S = unpack_sym(p, dk) if prefix == "h0" else unpack_upper(p, dk)
    if prefix + ".P" in inp:
        st.P = inp[prefix + ".P"][i, h].copy()
    if prefix + ".H" in inp:
        st.H = inp[prefix + ".H"][i, h].copy()
    return st


def forward(op, inp, o=Options()):
    """Expected forward outputs {o, ht.pos, ht.S, ht.P, ht.H} for CLI inputs `inp`."""
    q, v = inp["q"], inp["v"]
    B, T, G, dk = q.shape
    H, dv = v.shape[2], v.shape[3]
    rep = H // G
    scale = o.scale if o.scale is not None else dk ** -0.5
    seqs = _sequences(inp)
    N = len(seqs)
    out = {"o": np.zeros((B, T, H, dv))}
    finals = [[None] * H for _ in range(N)]
    for i, (b, r0, r1) in enumerate(seqs):
        for h in range(H):
            Q, K, V, gates, lam, beta = _head_inputs(op, inp, b, r0, r1, h, rep)
            st = _head_state(inp, "h0", i, h, dk)
            O, fin = head_forward(op, Q, K, V, gates, lam, beta, scale, st, o)
            out["o"][b, r0:r1, h] = O
            finals[i][h] = fin
    out["ht.pos"] = np.array([finals[i][0].n0 for i in range(N)], dtype=np.int64)
    parts = STATE_PARTS[op]
    if "S" in parts:
        out["ht.S"] = np.stack([np.stack([pack_sym(finals[i][h].S) for h in range(H)]) for i in range(N)])
    if "P" in parts:
        out["ht.P"] = np.stack([np.stack([finals[i][h].P for h in range(H)]) for i in range(N)])
    if is_loglinear(op):
        Ls = max(max(finals[i][0].H.shape[0] for i in range(N)), state_slots(max(out["ht.pos"])))
        out["ht.H"] = np.stack([np.stack([pad_slots(finals[i][h].H, Ls) for h in range(H)])
                                for i in range(N)])
    else:
        out["ht.H"] = np.stack([np.stack([finals[i][h].H for h in range(H)]) for i in range(N)])
    return out


def backward(op, inp, o=Options()):
    """Expected gradients {dq, dk, dv, dg, dlam, dbeta, dh0.S, dh0.P, dh0.H} for CLI inputs `inp`
       (cotangents: `do` and optional `dht.S/P/H`)."""
    q, v = inp["q"], inp["v"]
    B, T, G, dk = q.shape
    H = v.shape[2]
    rep = H // G
    scale = o.scale if o.scale is not None else dk ** -0.5
    seqs = _sequences(inp)
    out = {"dq": np.zeros_like(q), "dk": np.zeros_like(inp["k"]), "dv": np.zeros_like(v)}
    for name in ("g", "lam", "beta"):
        if name in inp:
            out["d" + name] = np.zeros_like(inp[name])
    for part in "SPH":
        if "h0." + part in inp:
            out["dh0." + part] = np.zeros_like(inp["h0." + part])
    untied = "g" in inp and inp["g"].ndim == 4
    for i, (b, r0, r1) in enumerate(seqs):
        for h in range(H):
            grp = h // rep
            Q, K, V, gates, lam, beta = _head_inputs(op, inp, b, r0, r1, h, rep)
            st = _head_state(inp, "h0", i, h, dk)
            dst = _head_state(inp, "dht", i, h, dk)
            dO = inp["do"][b, r0:r1, h]
            Gr = head_backward(op, Q, K, V, gates, lam, beta, scale, st, dO, dst, o)
            out["dq"][b, r0:r1, grp] += Gr.dq
            out["dk"][b, r0:r1, grp] += Gr.dk
            out["dv"][b, r0:r1, h] = Gr.dv
            if untied:
                for p, dgp in enumerate(Gr.dgates):
                    out["dg"][b, r0:r1, h, p] = dgp
            elif "dg" in out:
                out["dg"][b, r0:r1, h] = sum(Gr.dgates)
            if "dlam" in out:
                out["dlam"][b, r0:r1, h] = Gr.dlam
            if "dbeta" in out:
                out["dbeta"][b, r0:r1, h] = Gr.dbeta
            if "dh0.S" in out:
                out["dh0.S"][i, h] = pack_grad_sym(Gr.dS0)
            if "dh0.P" in out:
                out["dh0.P"][i, h] = Gr.dP0
            if "dh0.H" in out:
                X = Gr.dH0
                out["dh0.H"][i, h] = pad_slots(X, out["dh0.H"].shape[2]) if X.ndim == 3 else X
    return out


def loss(op, inp, o=Options()):
    """Scalar L = <o, do> + sum_parts <ht.X, dht.X>, whose gradient `backward` returns."""
    f = forward(op, inp, o)
    L = float(np.sum(f["o"] * inp["do"]))
    for part in "SPH":
        if "dht." + part in inp:
            A, D = f["ht." + part], inp["dht." + part]
            if A.ndim == 5 and A.shape[2] != D.shape[2]:
                Ls = max(A.shape[2], D.shape[2])
                A = np.stack([np.stack([pad_slots(x, Ls) for x in row]) for row in A])
                D = np.stack([np.stack([pad_slots(x, Ls) for x in row]) for row in D])
            L += float(np.sum(A * D))
    return L


GRAD_OF = {"dq": "q", "dk": "k", "dv": "v", "dg": "g", "dlam": "lam", "dbeta": "beta",
           "dh0.S": "h0.S", "dh0.P": "h0.P", "dh0.H": "h0.H"}


def fd_backward(op, inp, o=Options(), h=1e-6):
    """Central finite differences of `loss` (transforms.fd_grad) w.r.t. every differentiable
       input. Dead (structurally zero) Fenwick slots of h0.H are masked, so they get gradient 0."""
    names = [n for n in GRAD_OF.values() if n in inp]
    mask = None
    if "h0.H" in inp and inp["h0.H"].ndim == 5:
        mask = np.zeros(inp["h0.H"].shape[:3] + (1, 1))
        for i, n0 in enumerate(inp["h0.pos"]):
            for l in live_levels(n0):
                if l < mask.shape[2]:
                    mask[i, :, l] = 1.0

    def f(*arrays):
        x = dict(inp)
        x.update(zip(names, arrays))
        if mask is not None:
            x["h0.H"] = x["h0.H"] * mask
        return loss(op, x, o)

    grads = fd_grad(f, [np.array(inp[n], dtype=np.float64) for n in names], h)
    inv = {v: k for k, v in GRAD_OF.items()}
    return {inv[n]: gr for n, gr in zip(names, grads)}
