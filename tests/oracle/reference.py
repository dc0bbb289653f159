# SPDX-License-Identifier: Apache-2.0
"""Reference model of `hila run` in the CLI tensor layout, assembled from the float64 oracles.

Everything the oracles do per head ([T, d] arrays) is lifted here to the batched, sequence-first
layout of the CLI: GQA (value head h reads q/k group h // (H // G); dq/dk sum over the heads of a
group), varlen packing (cu_seqlens, B == 1), tied/untied gates, initial/final states in the
CLI's packed formats, and the optional transforms (normalize, ridge, qk_l2norm, scale).

Oracles used per head (see HLA_SPEC.md / LOGLINEAR_SPEC.md):
  gla             gla_mat / gla_state / gla_vjp (with H0 and dH_T)
  hla2/ahla/hla3  hla2_mat / ahla_mat / hla3_mat and their *_vjp (no state, no ridge);
                  hla2_serial(S0, Y0) for hla2 with a state; otherwise the composition of
                  gla_mat / gla_vjp primitives (HLA_SPEC S0, S7.2), e.g. AHLA = GLA(q,K,GLA(q,K,V;P0);E0)
  normalize       normalized(op, ...) forward, hla2n_vjp backward (chain rule of S7.2 otherwise)
  loglinear       llm_brute / llm_vjp_mat;  varlen forward: ll_varlen
  loglinear_hla*  inner gla_mat + outer llm_brute (LOGLINEAR_SPEC S7), backward gla_vjp + llm_vjp_mat
  gdn             gdn_chunk_plain / gdn_plain_vjp_chunk with one chunk spanning the call
  loglinear_gdn   gdn_brute / gdn_vjp_chunk;  varlen forward: ll_varlen
  qk_l2norm       l2norm / l2norm_vjp
test_reference_selfcheck.py verifies each assembly against the other oracles (brute forms,
serial forms, finite differences).
"""
from dataclasses import dataclass, field

import numpy as np

from spec import vh, vl

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
# untied gate columns, inner primitives first (HLA_SPEC S2)
GATE_NAMES = {"hla2": ("S", "Y"), "ahla": ("P", "E"), "hla3": ("S", "P", "X")}
STATE_PARTS = {"gla": ("H",), "hla2": ("S", "H"), "ahla": ("P", "H"), "hla3": ("S", "P", "H"),
               "loglinear": ("H",), "loglinear_hla2": ("S", "H"), "loglinear_ahla": ("P", "H"),
               "loglinear_hla3": ("S", "P", "H"), "gdn": ("H",), "loglinear_gdn": ("H",)}


def num_primitives(op):
    return len(GATE_NAMES[HLA_KIND[op]]) if op in HLA_KIND else 1


def is_loglinear(op):
    return op in LOGLINEAR_OPS


def state_slots(n):
    return int(n).bit_length() + 1


def levels_needed(n0, T):
    return 0 if T == 0 else int(n0 + T - 1).bit_length() + 1


def live_levels(n):
    n = int(n)
    return [l for l in range(1, n.bit_length() + 1) if (n >> (l - 1)) & 1]


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


def next_pow2(n):
    return 1 << max(int(n - 1).bit_length(), 0)


# ------------------------------------------------------------------------------ options
@dataclass(frozen=True)
class Options:
    scale: float = None          # None: dk^-1/2
    normalize: bool = False
    eps: float = 1e-6
    ridge: float = 0.0
    qk_l2norm: bool = False


# ------------------------------------------------------------------------------ GLA primitive wrappers (T == 0 safe)
def gla_fwd(Q, K, V, g, H0=None):
    if len(Q) == 0:
        return np.zeros((0, V.shape[1])), (np.zeros((K.shape[1], V.shape[1])) if H0 is None else H0.copy())
    return vh.gla_mat(Q, K, V, g, H0), vh.gla_state(K, V, g, H0)


def gla_bwd(Q, K, V, g, dO, H0=None, dHT=None):
    """VJP of (O, H_T); returns dQ, dK, dV, dg, dH0."""
    d, dv = K.shape[1], V.shape[1]
    if len(Q) == 0:
        dH0 = np.zeros((d, dv)) if dHT is None else dHT.copy()
        z = np.zeros((0,))
        return np.zeros((0, d)), np.zeros((0, d)), np.zeros((0, dv)), z, dH0
    return vh.gla_vjp(Q, K, V, g, dO, H0, dHT)


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


def _norm_split(Of, eps):
    N, D = Of[:, :-1], Of[:, -1]
    return N / (D + eps)[:, None]


def _norm_cotangent(Of, dO, eps):
    N, D = Of[:, :-1], Of[:, -1]
    dN = dO / (D + eps)[:, None]
    dD = -np.sum(dO * N, 1) / (D + eps) ** 2
    return np.hstack([dN, dD[:, None]])


# ------------------------------------------------------------------------------ HLA family (plain and log-linear)
def _hla_parts(op, Q, K, V, gates, lam, scale, st, o):
    """Forward intermediates of the GLA compositions. Returns dict with qh, U, Hh, key, val, Of,
       and final states S, P, Y."""
    kind, ll = HLA_KIND[op], is_loglinear(op)
    qh = scale * Q
    Vx = vh.ones_col(V) if o.normalize else V
    names = GATE_NAMES[kind]
    gd = dict(zip(names, gates))
    r = dict(qh=qh, Vx=Vx)
    if "S" in names:
        r["U"], r["S"] = gla_fwd(qh, K, K, gd["S"], st.S)
    if "P" in names:
        r["Hh"], r["P"] = gla_fwd(qh, K, Vx, gd["P"], st.P)
    if kind == "hla2":
        r["key"], r["val"] = r["U"] + o.ridge * qh, Vx
    elif kind == "ahla":
        r["key"], r["val"] = K, r["Hh"]
    else:
        r["key"], r["val"] = r["U"], r["Hh"]
    go = gates[-1]
    if ll:
        r["Of"], r["Y"] = vl.llm_brute(qh, r["key"], r["val"], go, lam, 1.0, st.n0, st.H)
    else:
        r["Of"], r["Y"] = gla_fwd(qh, r["key"], r["val"], go, st.H)
    return r


def hla_forward(op, Q, K, V, gates, lam, scale, st, o):
    kind, ll = HLA_KIND[op], is_loglinear(op)
    r = _hla_parts(op, Q, K, V, gates, lam, scale, st, o)
    fin = HeadState(st.n0 + len(Q), r.get("S"), r.get("P"), r["Y"])
    Of = r["Of"]
    # named oracles for the output where they apply directly (assembly verified in the selfcheck)
    if not ll and len(Q) > 0 and o.ridge == 0 and st.S is None and st.P is None and st.H is None:
        qh = r["qh"]
        mat = {"hla2": vh.hla2_mat, "ahla": vh.ahla_mat, "hla3": vh.hla3_mat}[kind]
        if o.normalize:
            return vh.normalized(mat, qh, K, V, *gates, eps=o.eps)[0], fin
        return mat(qh, K, V, *gates), fin
    if kind == "hla2" and not ll and len(Q) > 0 and o.ridge == 0:
        S0 = st.S if st.S is not None else np.zeros((K.shape[1],) * 2)
        Of, _, _ = vh.hla2_serial(r["qh"], K, r["Vx"], gates[0], gates[1], S0=S0, Y0=st.H)
    return (_norm_split(Of, o.eps) if o.normalize else Of), fin


def hla_backward(op, Q, K, V, gates, lam, scale, st, dO, dst, o):
    kind, ll = HLA_KIND[op], is_loglinear(op)
    T, dv = len(Q), V.shape[1]
    if not ll and T > 0 and o.ridge == 0 and st.S is None and st.P is None and st.H is None \
            and dst.S is None and dst.P is None and dst.H is None:
        # no states: the named composition VJP oracles
        qh = scale * Q
        if kind == "hla2" and o.normalize:
            dqh, dK, dV, *dg = vh.hla2n_vjp(qh, K, V, *gates, dO, o.eps)
        elif not o.normalize:
            fn = {"hla2": vh.hla2_vjp, "ahla": vh.ahla_vjp, "hla3": vh.hla3_vjp}[kind]
            dqh, dK, dV, *dg = fn(qh, K, V, *gates, dO)
        else:
            dqh = None
        if dqh is not None:
            return HeadGrads(dq=scale * dqh, dk=dK, dv=dV, dgates=list(dg))
    r = _hla_parts(op, Q, K, V, gates, lam, scale, st, o)
    qh = r["qh"]
    names = GATE_NAMES[kind]
    gd = dict(zip(names, gates))
    dOf = _norm_cotangent(r["Of"], dO, o.eps) if o.normalize else dO
    go = gates[-1]
    G = HeadGrads()
    if ll:
        dq_o, dkey, dval, dgo, G.dlam, G.dH0 = vl.llm_vjp_mat(qh, r["key"], r["val"], go, lam, dOf, 1.0,
                                                              st.n0, st.H, dst.H)
    else:
        dq_o, dkey, dval, dgo, G.dH0 = gla_bwd(qh, r["key"], r["val"], go, dOf, st.H, dst.H)
    dqh = dq_o.copy()
    dK = np.zeros_like(K)
    dgate = {}
    dgate[names[-1]] = dgo
    if kind == "hla2":
        dU, dVx = dkey, dval
        dqh += o.ridge * dU
    elif kind == "ahla":
        dK += dkey
        dHh = dval
    else:
        dU, dHh = dkey, dval
    if "S" in names:
        a, b_key, b_val, dgate["S"], G.dS0 = gla_bwd(qh, K, K, gd["S"], dU, st.S, dst.S)
        dqh += a
        dK += b_key + b_val
    if "P" in names:
        a, b, dVx, dgate["P"], G.dP0 = gla_bwd(qh, K, r["Vx"], gd["P"], dHh, st.P, dst.P)
        dqh += a
        dK += b
    G.dq, G.dk, G.dv = scale * dqh, dK, dVx[:, :dv]
    G.dgates = [dgate[n] for n in names]
    return G


# ------------------------------------------------------------------------------ first-order ops
def first_order_forward(op, Q, K, V, g, lam, beta, scale, st):
    T = len(Q)
    n = st.n0 + T
    if op == "gla":
        O, HT = gla_fwd(scale * Q, K, V, g, st.H)
    elif op == "loglinear":
        O, HT = vl.llm_brute(Q, K, V, g, lam, scale, st.n0, st.H)
    elif op == "gdn":
        O, HT = vl.gdn_chunk_plain(Q, K, V, beta, g, max(T, 1), scale, st.H)
        if st.H is None and T == 0:
            HT = np.zeros((K.shape[1], V.shape[1]))
    elif op == "loglinear_gdn":
        O, HT = vl.gdn_brute(Q, K, V, beta, g, lam, scale, st.n0, st.H)
    else:
        raise ValueError(op)
    return O, HeadState(n, None, None, HT)


def first_order_backward(op, Q, K, V, g, lam, beta, scale, st, dO, dst):
    T = len(Q)
    G = HeadGrads()
    if op == "gla":
        dqh, G.dk, G.dv, dg, G.dH0 = gla_bwd(scale * Q, K, V, g, dO, st.H, dst.H)
        G.dq = scale * dqh
    elif op == "loglinear":
        G.dq, G.dk, G.dv, dg, G.dlam, G.dH0 = vl.llm_vjp_mat(Q, K, V, g, lam, dO, scale, st.n0, st.H, dst.H)
    elif op == "gdn":
        G.dq, G.dk, G.dv, G.dbeta, dg, G.dH0 = vl.gdn_plain_vjp_chunk(Q, K, V, beta, g, max(T, 1), dO, scale,
                                                                     st.H, dst.H)
        if T == 0 and dst.H is None:
            G.dH0 = np.zeros((K.shape[1], V.shape[1]))
    elif op == "loglinear_gdn":
        C = next_pow2(st.n0 + T + 1)   # one segment: the whole call (matrix/UT form per segment)
        G.dq, G.dk, G.dv, G.dbeta, dg, G.dlam, G.dH0 = vl.gdn_vjp_chunk(Q, K, V, beta, g, lam, C, dO, scale,
                                                                       st.n0, st.H, dst.H)
    else:
        raise ValueError(op)
    G.dgates = [dg]
    return G


# ------------------------------------------------------------------------------ per-head dispatch
def head_forward(op, Q, K, V, gates, lam, beta, scale, st, o):
    if o.qk_l2norm:
        Q, K = vl.l2norm(Q), vl.l2norm(K)
    if op in HLA_KIND:
        return hla_forward(op, Q, K, V, gates, lam, scale, st, o)
    return first_order_forward(op, Q, K, V, gates[0], lam, beta, scale, st)


def head_backward(op, Q, K, V, gates, lam, beta, scale, st, dO, dst, o):
    Qr, Kr = Q, K
    if o.qk_l2norm:
        Q, K = vl.l2norm(Q), vl.l2norm(K)
    if op in HLA_KIND:
        G = hla_backward(op, Q, K, V, gates, lam, scale, st, dO, dst, o)
    else:
        G = first_order_backward(op, Q, K, V, gates[0], lam, beta, scale, st, dO, dst)
    if o.qk_l2norm:
        G.dq, G.dk = vl.l2norm_vjp(Qr, G.dq), vl.l2norm_vjp(Kr, G.dk)
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


def forward(op, inp, o=Options(), use_ll_varlen=True):
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
    if use_ll_varlen and "cu_seqlens" in inp and op in ("loglinear", "loglinear_gdn"):
        # packed oracle (LOGLINEAR_SPEC S4)
        for h in range(H):
            Q, K, V, gates, lam, beta = _head_inputs(op, inp, 0, 0, T, h, rep)
            if o.qk_l2norm:
                Q, K = vl.l2norm(Q), vl.l2norm(K)
            states0 = None
            if "h0.H" in inp:
                states0 = [(int(inp["h0.pos"][i]), inp["h0.H"][i, h]) for i in range(N)]
            O, fin = vl.ll_varlen("mamba2" if op == "loglinear" else "gdn", Q, K, V, gates[0], lam,
                                  inp["cu_seqlens"], 16, scale, states0, beta)
            out["o"][0, :, h] = O
            for i, (n, Hf) in enumerate(fin):
                finals[i][h] = HeadState(n, None, None, Hf)
    else:
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
    f = forward(op, inp, o, use_ll_varlen=False)
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
    """Central finite differences of `loss` (via the oracles' fd_grad) w.r.t. every differentiable
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

    grads = vl.fd_grad(f, [np.array(inp[n], dtype=np.float64) for n in names], h)
    inv = {v: k for k, v in GRAD_OF.items()}
    return {inv[n]: gr for n, gr in zip(names, grads)}
