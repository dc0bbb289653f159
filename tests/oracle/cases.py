# SPDX-License-Identifier: Apache-2.0
"""Problem descriptions, deterministic input generation, cached oracle results and comparison.

A `Problem` is everything about a `hila run` call except the form and chunk size, so the oracle
result is computed once per problem and shared by all forms (functools.lru_cache).
"""
import dataclasses
import functools
import zlib
from dataclasses import dataclass

import numpy as np

import reference as ref

FWD_TOL = 1e-10      # max relative error, forward outputs and final states
BWD_TOL = 1e-9       # gradients vs the analytic VJP oracles
FD_TOL = 1e-7        # gradients vs central finite differences of the oracle forward
FWD_KEYS = ("o", "ht.S", "ht.P", "ht.H")
REL_FLOOR = 1e-4     # denominator floor of rel_err


@dataclass(frozen=True)
class Problem:
    op: str
    T: int = 16                  # ignored when lens is given
    lens: tuple = None           # varlen: packed sequence lengths (B = 1)
    B: int = 2
    G: int = 2
    H: int = 4
    dk: int = 6
    dv: int = 4
    untied: bool = False
    gated: bool = True           # False: no g tensor (all log-gates 0)
    n0: object = None            # initial state position(s): int, tuple per sequence, or None
    state: str = "random"        # "random" (arbitrary canonical state) or "prefix" (oracle final state)
    normalize: bool = False
    eps: float = 1e-6
    ridge: float = 0.0
    qk_l2norm: bool = False
    scale: float = None
    extra_levels: int = 0        # lam columns beyond the levels needed (ignored by the op)
    extra_slots: int = 0         # log-linear h0.H: zero Fenwick slots beyond those its position needs
    backward: bool = False
    dht: bool = False            # cotangents of the final state
    dead_dht: bool = False       # ... also non-zero on dead (structurally zero) Fenwick slots
    positive: bool = False       # nonnegative q, k (well-conditioned normalization)
    seed: int = 0

    # ------------------------------------------------------------------ derived
    @property
    def varlen(self):
        return self.lens is not None

    @property
    def batch(self):
        return 1 if self.varlen else self.B

    @property
    def total_T(self):
        return int(sum(self.lens)) if self.varlen else self.T

    @property
    def seq_lens(self):
        return list(self.lens) if self.varlen else [self.T] * self.B

    @property
    def n0s(self):
        n = len(self.seq_lens)
        if self.n0 is None:
            return [0] * n
        return list(self.n0) if isinstance(self.n0, tuple) else [self.n0] * n

    @property
    def dvp(self):
        return self.dv + 1 if self.normalize else self.dv

    @property
    def options(self):
        return ref.Options(scale=self.scale, normalize=self.normalize, eps=self.eps, ridge=self.ridge,
                           qk_l2norm=self.qk_l2norm)

    def cli_options(self):
        a = []
        if self.scale is not None:
            a += ["--scale", repr(self.scale)]
        if self.normalize:
            a += ["--normalize", "--eps", repr(self.eps)]
        if self.ridge:
            a += ["--ridge", repr(self.ridge)]
        if self.untied:
            a += ["--gates", "untied"]
        if self.qk_l2norm:
            a.append("--qk-l2norm")
        return a

    def label(self):
        s = [self.op, f"lens{'_'.join(map(str, self.lens))}" if self.varlen else f"T{self.T}",
             f"G{self.G}H{self.H}"]
        if (self.dk, self.dv) != (6, 4):
            s.append(f"dk{self.dk}dv{self.dv}")
        if self.B != 2 and not self.varlen:
            s.append(f"B{self.B}")
        if self.n0 is not None:
            s.append("n0_" + ("_".join(map(str, self.n0)) if isinstance(self.n0, tuple) else str(self.n0)))
        for flag, name in ((not self.gated, "nogates"), (self.untied, "untied"), (self.normalize, "norm"), (self.qk_l2norm, "l2norm"),
                           (self.dht, "dht"), (self.dead_dht, "deaddht")):
            if flag:
                s.append(name)
        if self.ridge:
            s.append(f"ridge{self.ridge}")
        if self.scale is not None:
            s.append(f"scale{self.scale}")
        if self.extra_levels:
            s.append(f"L+{self.extra_levels}")
        if self.extra_slots:
            s.append(f"slots+{self.extra_slots}")
        return "-".join(s)


def _rng(p):
    return np.random.default_rng(zlib.crc32(repr(p).encode()))


def _state_parts(p):
    return ref.STATE_PARTS[p.op]


@functools.lru_cache(maxsize=None)
def make_inputs(p: Problem):
    """Deterministic CLI inputs for problem p (read-only arrays; copy before modifying)."""
    rng = _rng(dataclasses.replace(p, backward=False, dht=False, dead_dht=False))
    B, T, G, H, dk, dv = p.batch, p.total_T, p.G, p.H, p.dk, p.dv
    inp = {}
    q = rng.standard_normal((B, T, G, dk))
    k = rng.standard_normal((B, T, G, dk))
    if p.positive:
        q, k = np.abs(q), np.abs(k)
    if p.op in ref.DELTA_OPS:
        if p.qk_l2norm:       # rows of varied norm: the op normalizes them
            q *= rng.uniform(0.3, 3.0, (B, T, G, 1))
            k *= rng.uniform(0.3, 3.0, (B, T, G, 1))
        else:                 # unit keys keep a_t (I - beta k k^T) a contraction
            k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    inp["q"], inp["k"] = q, k
    inp["v"] = rng.standard_normal((B, T, H, dv))
    P = ref.num_primitives(p.op)
    gshape = (B, T, H, P) if p.untied else (B, T, H)
    g = np.log(rng.uniform(0.75, 1.0, gshape))
    if p.gated:
        inp["g"] = g
    if ref.is_loglinear(p.op):
        L = max([ref.levels_needed(n0, n) for n0, n in zip(p.n0s, p.seq_lens)] + [1]) + p.extra_levels
        inp["lam"] = rng.uniform(-0.5, 1.5, (B, T, H, L))
    if p.op in ref.DELTA_OPS:
        inp["beta"] = rng.uniform(0.1, 1.2, (B, T, H))
    if p.varlen:
        inp["cu_seqlens"] = np.concatenate([[0], np.cumsum(p.lens)]).astype(np.int64)
    if p.n0 is not None:
        inp.update(_initial_state(p, rng))
    if p.backward:
        inp["do"] = rng.standard_normal((B, T, H, dv))
        if p.dht:
            inp.update(_final_cotangent(p, rng))
    for a in inp.values():
        a.setflags(write=False)
    return inp


def _initial_state(p, rng):
    N, H, dk, dvp = len(p.seq_lens), p.H, p.dk, p.dvp
    n0s = p.n0s
    if p.state == "prefix":
        # the oracle's own final state after a random prefix of n0 tokens (positive features)
        if p.varlen:
            pre = dataclasses.replace(p, lens=tuple(n0s), n0=None, backward=False, dht=False,
                                      dead_dht=False, seed=p.seed + 1)
        else:
            pre = dataclasses.replace(p, T=n0s[0], n0=None, backward=False, dht=False, dead_dht=False,
                                      seed=p.seed + 1)
        f = expected_forward(pre)
        return {"h0." + k[3:]: f[k].copy() for k in f if k.startswith("ht.")}
    st = {"h0.pos": np.array(n0s, dtype=np.int64)}
    parts = _state_parts(p)
    if "S" in parts:
        st["h0.S"] = 0.5 * rng.standard_normal((N, H, dk * (dk + 1) // 2))
    if "P" in parts:
        st["h0.P"] = 0.5 * rng.standard_normal((N, H, dk, dvp))
    if ref.is_loglinear(p.op):
        Ls = ref.state_slots(max(n0s)) + p.extra_slots
        Hs = np.zeros((N, H, Ls, dk, dvp))
        for i, n0 in enumerate(n0s):
            for l in ref.live_levels(n0):
                Hs[i, :, l] = 0.5 * rng.standard_normal((H, dk, dvp))
        st["h0.H"] = Hs
    else:
        st["h0.H"] = 0.5 * rng.standard_normal((N, H, dk, dvp))
    return st


def _final_cotangent(p, rng):
    N, H, dk, dvp = len(p.seq_lens), p.H, p.dk, p.dvp
    parts = _state_parts(p)
    ct = {}
    if "S" in parts:
        ct["dht.S"] = rng.standard_normal((N, H, dk * (dk + 1) // 2))
    if "P" in parts:
        ct["dht.P"] = rng.standard_normal((N, H, dk, dvp))
    if ref.is_loglinear(p.op):
        ns = [n0 + n for n0, n in zip(p.n0s, p.seq_lens)]
        Ls = ref.state_slots(max(ns))
        D = rng.standard_normal((N, H, Ls, dk, dvp))
        if not p.dead_dht:
            for i, n in enumerate(ns):
                live = ref.live_levels(n)
                for l in range(Ls):
                    if l not in live:
                        D[i, :, l] = 0.0
        ct["dht.H"] = D
    else:
        ct["dht.H"] = rng.standard_normal((N, H, dk, dvp))
    return ct


@functools.lru_cache(maxsize=None)
def expected_forward(p: Problem):
    return ref.forward(p.op, make_inputs(p), p.options)


@functools.lru_cache(maxsize=None)
def expected_backward(p: Problem):
    return ref.backward(p.op, make_inputs(p), p.options)


@functools.lru_cache(maxsize=None)
def expected_fd(p: Problem):
    return ref.fd_backward(p.op, make_inputs(p), p.options)


# ------------------------------------------------------------------------------ comparison
def rel_err(a, b):
    """max|a-b| / max(max|b|, REL_FLOOR): the oracles' max-norm relative error. The floor only
       matters for tensors that are exactly zero in exact arithmetic, where the oracle carries
       roundoff (e.g. dg at T = 1 without a state: q.dq - k.dk = O(1e-16)); all inputs and
       outputs of the suite are O(0.1 .. 100)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.size == 0:
        return 0.0
    den = max(float(np.max(np.abs(b))), REL_FLOOR)
    return float(np.max(np.abs(a - b))) / den


def _align_slots(a, b):
    """log-linear states may carry a different number of (zero) Fenwick slots (axis 2)."""
    if a.ndim == 5 and b.ndim == 5 and a.shape[2] != b.shape[2] and a.shape[:2] == b.shape[:2] \
            and a.shape[3:] == b.shape[3:]:
        Ls = max(a.shape[2], b.shape[2])
        pad = lambda x: np.concatenate(  # noqa: E731
            [x, np.zeros(x.shape[:2] + (Ls - x.shape[2],) + x.shape[3:])], 2)
        return pad(a), pad(b)
    return a, b


def compare(out, expected, tolerances, where=""):
    """Assert hila's outputs match; one message listing every tensor's error."""
    lines, bad = [], False
    for name, exp in expected.items():
        tol = tolerances(name)
        if name not in out:
            lines.append(f"  {name:8s} MISSING from hila output (has {sorted(out)})")
            bad = True
            continue
        got = out[name]
        if name.endswith(".pos"):
            ok = got.dtype == np.int64 and got.shape == exp.shape and np.array_equal(got, exp)
            lines.append(f"  {name:8s} {'ok ' if ok else 'BAD'} got {got.tolist()} want {exp.tolist()} "
                         f"({got.dtype})")
            bad |= not ok
            continue
        if got.dtype != np.float64:
            lines.append(f"  {name:8s} BAD dtype {got.dtype} (want float64)")
            bad = True
            continue
        allow_slots = name == "ht.H"
        g2, e2 = _align_slots(got, exp) if allow_slots else (got, exp)
        if g2.shape != e2.shape:
            lines.append(f"  {name:8s} BAD shape {got.shape} (want {exp.shape})")
            bad = True
            continue
        if not np.all(np.isfinite(g2)):
            lines.append(f"  {name:8s} BAD non-finite values ({int(np.sum(~np.isfinite(g2)))} entries)")
            bad = True
            continue
        err = rel_err(g2, e2)
        ok = err <= tol
        loc = ""
        if not ok:
            idx = np.unravel_index(np.argmax(np.abs(g2 - e2)), e2.shape)
            loc = f"  worst at {tuple(int(i) for i in idx)}: got {g2[idx]:.6g} want {e2[idx]:.6g}"
        lines.append(f"  {name:8s} {'ok ' if ok else 'BAD'} rel err {err:.2e} (tol {tol:.0e}){loc}")
        bad |= not ok
    if bad:
        raise AssertionError(f"hila disagrees with the oracle {where}\n" + "\n".join(lines))
    return lines


def _tol(grad_tol):
    return lambda name: FWD_TOL if (name == "o" or name.startswith("ht.")) else grad_tol


def check(hila, p: Problem, form: str, chunk=None, *, fd=False):
    """Run hila on problem p with the given form and compare against the oracle.
       fd=True: gradients against central finite differences of the oracle forward."""
    inp = make_inputs(p)
    out = hila.run(p.op, form, inp, backward=p.backward, chunk=chunk, options=p.cli_options())
    exp = dict(expected_forward(p))
    if p.backward:
        if fd:
            exp.update(expected_fd(p))
        else:
            exp.update(expected_backward(p))
        # the forward outputs of a backward run are optional
        for k in FWD_KEYS + ("ht.pos",):
            if k not in out:
                exp.pop(k, None)
    compare(out, exp, _tol(FD_TOL if fd else BWD_TOL),
            where=f"[{p.label()} form={form} chunk={chunk}]\n  cmd: {out.cmd}")


# ------------------------------------------------------------------------------ finite-difference problems
def fd_problems():
    """tiny problems (T <= 12, d <= 4) covering every op and option, with states and cotangents."""
    small = dict(B=1, G=1, H=2, dk=3, dv=2, backward=True)
    out = []
    for op in ref.ALL_OPS:
        n0 = 13 if ref.is_loglinear(op) else 5
        out.append(Problem(op, T=9, **small))
        out.append(Problem(op, T=9, n0=n0, dht=True, **small))
    for op in ref.HLA_OPS:
        out.append(Problem(op, T=8, untied=True, n0=6, dht=True, **small))
    out += [Problem("hla2", T=9, normalize=True, positive=True, eps=1e-3, **small),
            Problem("hla2", T=9, normalize=True, positive=True, eps=1e-3, n0=4, state="prefix", dht=True, **small),
            Problem("loglinear_hla2", T=9, normalize=True, positive=True, eps=1e-3, n0=5, state="prefix",
                    dht=True, **small),
            Problem("ahla", T=8, normalize=True, positive=True, eps=1e-3, n0=3, state="prefix", dht=True, **small),
            Problem("hla3", T=8, normalize=True, positive=True, eps=1e-3, **small),
            Problem("loglinear_ahla", T=8, normalize=True, positive=True, eps=1e-3, **small),
            Problem("loglinear_hla3", T=8, normalize=True, positive=True, eps=1e-3, n0=6, state="prefix", dht=True,
                    **small),
            Problem("hla2", T=9, ridge=0.3, n0=4, dht=True, **small),
            Problem("hla2", T=8, ridge=0.3, normalize=True, positive=True, eps=1e-3, **small),
            Problem("loglinear_hla2", T=9, ridge=0.3, n0=8, dht=True, **small),
            Problem("gdn", T=9, qk_l2norm=True, n0=3, dht=True, **small),
            Problem("loglinear_gdn", T=9, qk_l2norm=True, n0=5, dht=True, **small),
            Problem("loglinear", T=7, n0=6, dht=True, dead_dht=True, extra_levels=1, **small),
            Problem("loglinear_gdn", lens=(0, 5, 3), n0=(2, 9, 0), dht=True, **small),
            Problem("hla3", T=6, G=1, H=2, B=2, dk=2, dv=2, scale=0.9, backward=True)]
    return out




# ------------------------------------------------------------------------------ forward and backward problem sets
# test_forward.py and test_backward.py run the same shapes, packed sequences and edge cases; the
# backward sets are the forward ones with backward=True and, where a state comes in or out, a
# final-state cotangent (dht).
T_VALUES = (1, 5, 64, 65, 100)
VARLEN_LENS = (0, 37, 0, 64, 65, 1)
VARLEN_N0 = (5, 0, 64, 100, 3, 13)


def _backward_kw(backward, dht=False):
    return dict(backward=True, **({"dht": True} if dht else {})) if backward else {}


def shape_problems(backward=False):
    """every op x T x (G = 1, 2; H = 4), B = 2, no initial state, tied gates."""
    kw = _backward_kw(backward)
    return [Problem(op, T=T, G=G, **kw) for op in ref.ALL_OPS for T in T_VALUES for G in (1, 2)]


def varlen_problems(backward=False):
    """packed sequences (cu_seqlens, B = 1) with zero-length ones, without and with initial states."""
    out = []
    for op in ref.ALL_OPS:
        out += [Problem(op, lens=VARLEN_LENS, **_backward_kw(backward)),
                Problem(op, lens=VARLEN_LENS, n0=VARLEN_N0, **_backward_kw(backward, dht=True))]
    return out


def edge_problems(backward=False):
    """T = 0, positions near 2^40, per-row positions in a batch, dk != dv both ways."""
    kw = _backward_kw(backward, dht=True)
    out = [Problem(op, T=0, n0=13, **kw) for op in ref.ALL_OPS]                       # empty call: ht == h0
    out += [Problem(op, T=9, n0=(1 << 40) - 3, G=1, **kw) for op in ref.LOGLINEAR_OPS]  # int64 positions, 42 levels
    out += [Problem(op, T=21, n0=(13, 64), **kw) for op in ref.LOGLINEAR_OPS]          # batch rows at different positions
    out += [Problem(op, T=65, dk=dk, dv=dv, n0=13, **kw) for op in ref.ALL_OPS for dk, dv in ((8, 3), (3, 8))]
    return out


# ------------------------------------------------------------------------------ test matrices
def forward_forms(chunks=(4, 16, 64), scan_chunks=(4, 16, 64)):
    """(form, chunk) pairs of the forward pass: naive, serial, chunk C, scan C."""
    return ([("naive", None), ("serial", None)] + [("chunk", c) for c in chunks]
            + [("scan", c) for c in scan_chunks])


def backward_forms(op, chunks=(4, 16, 64)):
    """(form, chunk) pairs with a backward: naive, chunk C, and serial for the GLA family."""
    f = [("naive", None)] + [("chunk", c) for c in chunks]
    if op in ref.GLA_FAMILY:
        f.append(("serial", None))
    return f


def form_id(form, chunk):
    return form if chunk is None else f"{form}{chunk}"


def params(problems, forms):
    """pytest params (problem, form, chunk) with ids '<problem>-<form>'; forms: list or fn(problem)."""
    import pytest
    out = []
    for p in problems:
        for form, chunk in (forms(p) if callable(forms) else forms):
            out.append(pytest.param(p, form, chunk, id=f"{p.label()}-{form_id(form, chunk)}"))
    return out
