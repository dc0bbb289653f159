# SPDX-License-Identifier: Apache-2.0
"""Context parallelism: one sequence sharded along T over the ranks of a ``torch.distributed``
process group, for every hila operator, forward and backward (docs/DISTRIBUTED.md).

Rank ``r`` holds the rows ``[a_r, b_r)`` of the sequence dimension (``shard_lens[r]`` rows; any
lengths, zero included). With ``cu_seqlens`` (global offsets, ``B == 1``) the shards cut a packed
batch: a sequence may lie inside one shard or cross any number of shard boundaries.

Protocol of one call (all ranks):

1. **Summary.** A rank whose last sequence continues on the next rank reduces that sequence's
   piece to its summary: the map from the state at the piece's start to the state at its end
   (gla: ``(rho, H_X)``; hla2: ``(rho_S, rho_Y, S_X, Z_X, Y_X)``; ahla, hla3 alike; gdn:
   ``(M, H_X)``; the log-linear operators: the same with the outer parts kept per Fenwick level
   of the piece's end). A piece that starts its sequence sends the constant map to its end state
   (initial state included).
2. **Exchange.** One ``all_gather`` of the fixed-size summaries (plus two status flags).
3. **Fold.** Each rank applies the maps of the earlier ranks holding its first sequence, in order,
   and gets the state at its first row (the carry-in).
4. **Finish.** gla and loglinear rerun the local call from the carry-in. The HLA family calls its
   primitives itself, each once: the inner ones (from a zero carry) ran in step 1; the carry's
   term is added to their outputs and states, and the outer primitive runs from the outer carry.
   gdn and loglinear_gdn ran the local call from a zero carry in step 1, together with the
   transition and the effective queries of the first piece; they add the carry's contribution
   (linear in it) to the outputs and states.

Every step is a differentiable torch operation or a differentiable hila custom op, and the exchange
is an autograd function whose backward is the mirror collective (a reduce-scatter of the
summaries' cotangents), so the backward is exact. Gradients of a replicated ``initial_state``
arrive on the rank that holds the sequence's first token (zeros elsewhere): summing them over the
group gives the gradient.

Every rank must call with the same operator, options, ``shard_lens``, ``cu_seqlens`` and initial
state positions, and every rank must back-propagate through the call when one does.
"""
from __future__ import annotations

import bisect
import dataclasses
import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from .. import ops as _ops
from .._errors import HilaError
from ..ops import State
from .ops import forward as _forward

__all__ = ["forward", "short_conv", "shard_lens", "local_sequences", "summary_elements",
           "CommStats", "last_comm", "last_halo_comm"]


# ----------------------------------------------------------------------------- communication record

@dataclasses.dataclass(frozen=True)
class CommStats:
    """What one exchange sent, per rank (the same on every rank).

    Attributes:
        what: the operator name, or ``'halo'`` for a short-convolution halo.
        world: ranks in the group.
        payload_elements: elements of one rank's summary (or halo) message, flags excluded.
        message_bytes: bytes one rank sends (payload + 2 status flags).
        received_bytes: bytes one rank receives in the forward all_gather, ``(world - 1) * message_bytes``.
        levels: Fenwick slots per outer state in the message (1 for the operators without levels).
    """

    what: str
    world: int
    payload_elements: int
    message_bytes: int
    received_bytes: int
    levels: int


last_comm: Optional[CommStats] = None
"""The exchange of the last :func:`forward` call of this process."""
last_halo_comm: Optional[CommStats] = None
"""The exchange of the last :func:`conv_halo` call of this process."""


def summary_elements(op: str, dk: int, dv: int, *, normalize: bool = False, levels: int = 1) -> int:
    """Elements of one sequence-head summary of ``op`` (what a rank sends per sequence and head).

    ``dv' = dv + 1`` with ``normalize``; ``levels`` (L) is the Fenwick slot count of the outer parts
    (log-linear operators; 1 otherwise)::

        gla, loglinear        1 + L dk dv
        hla2                  2 + dk(dk+1)/2 + 2 L dk dv'
        ahla                  2 + dk dv' + L (dk^2 + dk dv')
        hla3                  3 + dk(dk+1)/2 + dk dv' + L (2 dk dv' + dk^2 + dk(dk+1)/2)
        gdn, loglinear_gdn    dk^2 + L dk dv
    """
    t = _ops.op_traits(op)
    L = levels if t["loglinear"] else 1
    dvp = dv + 1 if normalize else dv
    return sum(math.prod(s) for s in _part_shapes(t, 1, 1, dk, dvp, L).values())


# ----------------------------------------------------------------------------- geometry

def _group_info(group) -> Tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise HilaError("hila: argument 'group': torch.distributed is not initialised "
                        "(call torch.distributed.init_process_group first)", "group")
    return dist.get_rank(group), dist.get_world_size(group)


def shard_lens(local_len: int, group=None, device=None) -> Tuple[int, ...]:
    """The shard lengths of all ranks of ``group`` from each rank's own (one small all_gather).
    ``device``: where the collective's tensors live (a CUDA device for NCCL)."""
    _, world = _group_info(group)
    mine = torch.tensor([int(local_len)], dtype=torch.int64, device=device)
    out = torch.empty(world, dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(out, mine, group=group)
    return tuple(int(x) for x in out.tolist())


@dataclasses.dataclass(frozen=True)
class _Piece:
    """Rows [start, end) (global) of sequence ``seq`` (None: every batch row of a dense batch)."""
    seq: Optional[int]
    start: int
    end: int
    seq_start: int  # global row of the sequence's first token


class _Geometry:
    """Where the shards lie: ``starts[j] = a_j``, ``ends[j] = b_j``; ``cu`` the global offsets
    (None: dense, every batch row is one sequence over [0, total))."""

    def __init__(self, rank: int, world: int, lens: Sequence[int], cu: Optional[Sequence[int]]):
        self.rank, self.world, self.lens = rank, world, tuple(int(x) for x in lens)
        self.starts = tuple(sum(self.lens[:j]) for j in range(world))
        self.ends = tuple(a + n for a, n in zip(self.starts, self.lens))
        self.total = sum(self.lens)
        self.cu = None if cu is None else tuple(int(x) for x in cu)

    def crossing(self, x: int) -> Optional[int]:
        """The sequence that runs across global row boundary x (cu[i] < x < cu[i+1]); dense: -1
        for 0 < x < total (every batch row). None when none does."""
        if self.cu is None:
            return -1 if 0 < x < self.total else None
        i = bisect.bisect_left(self.cu, x) - 1     # cu[i] < x <= cu[i+1]
        return i if 0 <= i < len(self.cu) - 1 and self.cu[i + 1] > x else None

    def seq_start(self, i: int) -> int:
        return 0 if self.cu is None else self.cu[i]

    def boundary_map(self, j: int) -> Optional[_Piece]:
        """The piece whose map rank j sends: its last sequence, when that continues after b_j.
        Dense: every rank but the last with b_j > 0 (a later rank, possibly empty, continues)."""
        b = self.ends[j]
        if self.cu is None:
            return _Piece(None, self.starts[j], b, 0) if j < self.world - 1 and b > 0 else None
        i = self.crossing(b)
        if i is None:
            return None
        return _Piece(i, max(self.starts[j], self.cu[i]), b, self.cu[i])

    def carry_chain(self, r: int) -> List[int]:
        """The ranks whose maps, applied in order, give rank r's state at a_r (empty: no carry).
        The first of them holds the sequence's start, so its map is constant."""
        a = self.starts[r]
        i = self.crossing(a) if self.cu is not None else (-1 if a > 0 else None)
        if i is None:
            return []
        s = self.seq_start(i)
        return [j for j in range(r) if self.ends[j] > s]

    def local_pieces(self) -> List[_Piece]:
        """The pieces of this rank in row order (varlen: one per sequence with rows here)."""
        a, b = self.starts[self.rank], self.ends[self.rank]
        if self.cu is None:
            return [_Piece(None, a, b, 0)]
        out = []
        for i in range(bisect.bisect_right(self.cu, a) - 1, len(self.cu) - 1):
            s, e = self.cu[i], self.cu[i + 1]
            if s >= b:
                break
            if e > a and e > s:
                out.append(_Piece(i, max(s, a), min(e, b), s))
        return out


def _host_ints(x: Tensor, name: str) -> List[int]:
    if x.dim() != 1 or x.dtype not in (torch.int32, torch.int64):
        raise HilaError(f"hila: argument '{name}': expected a 1-d int32/int64 tensor, got "
                        f"{x.dtype} of shape {tuple(x.shape)}", name)
    return [int(v) for v in x.tolist()]


def _geometry(T: int, B: int, group, lens: Optional[Sequence[int]], cu_seqlens: Optional[Tensor],
              device) -> _Geometry:
    rank, world = _group_info(group)
    if lens is None:
        lens = shard_lens(T, group, device if device is not None and device.type == "cuda" else None)
    lens = tuple(int(x) for x in lens)
    if len(lens) != world or any(n < 0 for n in lens):
        raise HilaError(f"hila: argument 'shard_lens': expected {world} non-negative lengths (one "
                        f"per rank of the group), got {list(lens)}", "shard_lens")
    if lens[rank] != T:
        raise HilaError(f"hila: argument 'shard_lens': rank {rank} holds {T} rows, but "
                        f"shard_lens[{rank}] = {lens[rank]}", "shard_lens")
    cu = None
    if cu_seqlens is not None:
        if B != 1:
            raise HilaError(f"hila: argument 'q': expected batch size 1 with cu_seqlens (packed "
                            f"sequences along T), got {B}", "q")
        cu = _host_ints(cu_seqlens, "cu_seqlens")
        if len(cu) < 1 or cu[0] != 0 or cu[-1] != sum(lens) or any(
                y < x for x, y in zip(cu, cu[1:])):
            raise HilaError("hila: argument 'cu_seqlens': expected the global offsets of the packed "
                            f"sequences (0, non-decreasing, ending at sum(shard_lens) = {sum(lens)}), "
                            f"got {cu[:8]}{'...' if len(cu) > 8 else ''}", "cu_seqlens")
    return _Geometry(rank, world, lens, cu)


def local_sequences(cu_seqlens: Tensor, shard_lens: Sequence[int], rank: int) -> List[Tuple[int, bool]]:
    """For packed input: the rows of rank ``rank``'s final state, as ``(sequence, ends_here)``
    pairs: the global sequence index and whether its last token lies in that shard (then the row
    is the sequence's final state; otherwise the state at the shard's end)."""
    geo = _Geometry(rank, len(shard_lens), shard_lens, _host_ints(cu_seqlens, "cu_seqlens"))
    return [(p.seq, geo.cu[p.seq + 1] == p.end) for p in geo.local_pieces()]


# ----------------------------------------------------------------------------- Fenwick helpers

def _bitlen(x: int) -> int:
    return int(x).bit_length()


def _slots(n: int) -> int:
    return _bitlen(n) + 1


def _live(n: int, l: int) -> bool:
    return l >= 1 and (n >> (l - 1)) & 1 == 1


def _level_groups(pa: int, pb: int, fenwick: bool) -> List[Tuple[int, int, int]]:
    """(slot, first, end) position ranges of the tokens [pa, pb) grouped by their Fenwick level in
    the state at pb: level l >= 1 holds [sigma_l(pb), sigma_l(pb) + 2^(l-1)) when bit l-1 of pb is
    set, sigma_l(n) = (n >> l) << l. Without levels: one group, slot 0."""
    if not fenwick:
        return [(0, pa, pb)] if pb > pa else []
    out = []
    for l in range(1, _bitlen(pb) + 1):
        if _live(pb, l):
            s = (pb >> l) << l
            lo, hi = max(s, pa), min(s + (1 << (l - 1)), pb)
            if lo < hi:
                out.append((l, lo, hi))
    return out


def _rekey_matrix(pa: int, pb: int, slots_in: int, slots_out: int, fenwick: bool) -> List[List[float]]:
    """[slots_out, slots_in] 0/1 matrix moving the live levels of a state at pa to their levels at
    pb >= pa: slot l -> bitlen(pb XOR sigma_l(pa)) (every token of the bucket lands in that one
    bucket of pb). Dead slots are dropped."""
    m = [[0.0] * slots_in for _ in range(slots_out)]
    if not fenwick:
        m[0][0] = 1.0
        return m
    for l in range(1, slots_in):
        if _live(pa, l):
            m[_bitlen(pb ^ ((pa >> l) << l))][l] = 1.0
    return m


def _bitlen_t(x: Tensor) -> Tensor:
    """bitlen of a non-negative int64 tensor, exactly (binary search on shifts)."""
    n = torch.zeros_like(x)
    y = x.clone()
    for s in (32, 16, 8, 4, 2, 1):
        m = (y >> s) > 0
        n = n + m.to(x.dtype) * s
        y = torch.where(m, y >> s, y)
    return n + (y > 0).to(x.dtype)


# ----------------------------------------------------------------------------- summary layout

def _rho_roles(t: dict) -> List[str]:
    """Gate roles of an operator, inner first (the column order of untied gates)."""
    return (["S"] if t["has_S"] else []) + (["P"] if t["has_P"] else []) + ["O"]


def _part_shapes(t: dict, Bs: int, H: int, dk: int, dvp: int, L: int) -> Dict[str, tuple]:
    """Shapes of one rank's summary parts (Bs sequences, H heads, L outer slots)."""
    tri = dk * (dk + 1) // 2
    if t["delta"]:
        return {"M": (Bs, H, dk, dk), "Y": (Bs, H, L, dk, dvp)}
    shapes = {"rho": (Bs, H, len(_rho_roles(t)))}
    if t["has_S"]:
        shapes["S"] = (Bs, H, tri)
    if t["has_P"]:
        shapes["P"] = (Bs, H, dk, dvp)
    shapes["Y"] = (Bs, H, L, dk, dvp)
    if t["has_S"] and t["has_P"]:
        shapes.update(Phi=(Bs, H, L, dk, dvp), Psi=(Bs, H, L, dk, dk), Omega=(Bs, H, L, tri))
    elif t["has_S"]:
        shapes["Z"] = (Bs, H, L, dk, dvp)
    elif t["has_P"]:
        shapes["R"] = (Bs, H, L, dk, dk)
    return shapes


def _pack_index(dk: int, device) -> Tuple[Tensor, Tensor]:
    """Row-major upper-triangle indices (the packed S layout) and the dense -> packed index map."""
    iu = torch.triu_indices(dk, dk, device=device)
    full = torch.empty(dk, dk, dtype=torch.int64, device=device)
    ar = torch.arange(iu.shape[1], device=device)
    full[iu[0], iu[1]] = ar
    full[iu[1], iu[0]] = ar
    return iu, full


def _pack(S: Tensor) -> Tensor:
    """[..., dk, dk] symmetric -> [..., dk(dk+1)/2] (upper triangle, row-major)."""
    iu, _ = _pack_index(S.shape[-1], S.device)
    return S[..., iu[0], iu[1]]


def _unpack(p: Tensor, dk: int) -> Tensor:
    """[..., dk(dk+1)/2] -> [..., dk, dk] symmetric. Its gradient adds both triangles into an
    off-diagonal entry, the convention of hila's packed S."""
    _, full = _pack_index(dk, p.device)
    return p[..., full]


# ----------------------------------------------------------------------------- the exchange

def _reduce_scatter_sum(grad: Tensor, group) -> Tensor:
    """Row `rank` of the sum over ranks of grad [world, n]."""
    rank, world = _group_info(group)
    out = grad.new_empty(grad.shape[1:])
    try:
        dist.reduce_scatter_tensor(out, grad.contiguous().view(-1), group=group)
    except (RuntimeError, NotImplementedError, ValueError):
        if dist.get_backend(group) == "nccl":
            raise
        total = grad.contiguous().clone()   # an older gloo without reduce_scatter
        dist.all_reduce(total, group=group)
        out = total[rank]
    return out


class _Exchange(torch.autograd.Function):
    """all_gather of one flat message per rank -> [world, n]; backward: the reduce-scatter of the
    cotangents (rank j receives the sum over ranks of the cotangent of its own message).

    ``anchors`` (the rank's differentiable inputs) make the result require a gradient on every rank
    whose call does, so every such rank runs this backward even when its message is a constant."""

    @staticmethod
    def forward(ctx, group, msg: Tensor, *anchors: Tensor) -> Tensor:
        ctx.group = group
        ctx.n_anchors = len(anchors)
        _, world = _group_info(group)
        out = msg.new_empty(world * msg.numel())
        try:
            dist.all_gather_into_tensor(out, msg.contiguous(), group=group)
        except (RuntimeError, NotImplementedError, ValueError):
            if dist.get_backend(group) == "nccl":
                raise
            dist.all_gather(list(out.view(world, -1).unbind(0)), msg.contiguous(), group=group)
        return out.view(world, msg.numel())

    @staticmethod
    def backward(ctx, grad: Tensor):
        mine = _reduce_scatter_sum(grad, ctx.group)  # collective on every rank, needed or not
        return (None, mine if ctx.needs_input_grad[1] else None) + (None,) * ctx.n_anchors


class _Tie(torch.autograd.Function):
    """Returns xs unchanged, with a (zero) dependence on ``gathered``: every output of a rank's
    call then reaches the exchange in the autograd graph, so its backward collective runs on every
    rank, also on ranks whose outputs do not depend on other ranks (rank 0)."""

    @staticmethod
    def forward(ctx, gathered: Tensor, *xs: Tensor):
        ctx.meta = (gathered.shape, gathered.dtype, gathered.device)
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        shape, dtype, device = ctx.meta
        return (torch.zeros(shape, dtype=dtype, device=device),) + grads


_ERROR_ARGS = ("q", "k", "v", "g", "lam", "beta")   # error code c: argument _ERROR_ARGS[c - 1]
_RAISED = len(_ERROR_ARGS) + 1                       # a HilaError raised on that rank


def _exchange(group, payload: Tensor, needs_grad: bool, error: Optional[Tensor],
              anchors: Sequence[Tensor], check: bool, what: str,
              pending: Optional[HilaError] = None) -> Tensor:
    """Gathers ``payload`` [n] of every rank with two status flags (needs a gradient; an input
    error code) and, with ``check``, raises on every rank alike when a rank reported an error (the
    rank's own ``pending`` error there) or the ranks disagree on gradients. Returns [world, n]."""
    flags = torch.stack([payload.new_tensor(1.0 if needs_grad else 0.0),
                         error.to(payload.dtype) if error is not None else payload.new_zeros(())])
    msg = torch.cat([payload, flags])
    anchors = [a for a in anchors if a is not None and a.requires_grad] if needs_grad else []
    gathered = _Exchange.apply(group, msg, *anchors)
    if check:
        st = gathered[:, -2:].detach().tolist()
        bad = [(j, int(e)) for j, (_, e) in enumerate(st) if e != 0]
        if pending is not None:
            raise pending
        if bad:
            j, code = bad[0]
            arg = _ERROR_ARGS[code - 1] if code < _RAISED else "q"
            why = ("raised an error" if code == _RAISED else
                   f"found a non-finite value{' or a positive gate' if arg == 'g' else ''} in '{arg}'")
            raise HilaError(f"hila: argument '{arg}': rank(s) {[b for b, _ in bad]} of the group "
                            f"rejected their inputs ({what}: rank {j} {why}); no rank continued", arg)
        grads = {bool(n) for n, _ in st}
        if len(grads) > 1:
            on = [j for j, (n, _) in enumerate(st) if n]
            raise HilaError(f"hila: argument 'q': ranks {on} of the group need a gradient of this "
                            f"{what} call and the others do not; every rank must record it for "
                            "autograd alike (its backward is a collective)", "q")
    return gathered[:, :-2]


# ----------------------------------------------------------------------------- the operator call

class _Call:
    """One sharded operator call on this rank (see the module docstring for the protocol)."""

    def __init__(self, op, q, k, v, g, lam, beta, cu_seqlens, initial_state, output_final_state,
                 group, lens, opts):
        self.op, self.t = op, _ops.op_traits(op)
        self.q, self.k, self.v, self.g, self.lam, self.beta = q, k, v, g, lam, beta
        self.group, self.opts = group, opts
        self.want_final = output_final_state
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
            raise HilaError(f"hila: argument 'q': expected q, k [B, T, G, dk] and v [B, T, H, dv], "
                            f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}", "q")
        self.B, self.T, self.G, self.dk = q.shape
        self.Hh, self.dv = v.shape[2], v.shape[3]
        if self.Hh % self.G:
            raise HilaError(f"hila: argument 'v': expected a multiple of the {self.G} q/k groups "
                            f"as heads, got {self.Hh}", "v")
        self.normalize = bool(opts["normalize"]) and self.t["hla_family"]
        self.dvp = self.dv + (1 if self.normalize else 0)
        self.R = torch.float64 if q.dtype == torch.float64 else torch.float32
        self.scale = opts["scale"] if opts["scale"] is not None else self.dk ** -0.5
        self.geo = _geometry(self.T, self.B, group, lens, cu_seqlens, q.device)
        self.dense = self.geo.cu is None
        self.N = self.B if self.dense else len(self.geo.cu) - 1
        self.init = initial_state
        if initial_state is not None:
            if len(initial_state) != 4 or initial_state[0] is None:
                raise HilaError("hila: argument 'initial_state': expected a State with pos", "initial_state")
            self.n0 = _host_ints(initial_state.pos.reshape(-1), "initial_state")
            if len(self.n0) != self.N:
                raise HilaError(f"hila: argument 'initial_state': expected {self.N} sequences, got "
                                f"{len(self.n0)}", "initial_state")
        else:
            self.n0 = [0] * self.N
        self.Bs = self.B if self.dense else 1
        self.head_group = torch.arange(self.Hh, device=q.device) // (self.Hh // self.G)

    # -- positions -------------------------------------------------------------------------

    def rows_n0(self, piece: _Piece) -> List[int]:
        """Initial position of the sequence of each summary row of a piece."""
        return list(self.n0) if piece.seq is None else [self.n0[piece.seq]]

    def abs_range(self, piece: _Piece) -> Tuple[List[int], List[int]]:
        """Absolute positions [pa, pb) of a piece per summary row."""
        n0 = self.rows_n0(piece)
        return ([x + piece.start - piece.seq_start for x in n0],
                [x + piece.end - piece.seq_start for x in n0])

    def map_levels(self) -> List[int]:
        """The outer slots a message carries: those that some rank's map can make non-zero (the
        levels of the end position that a piece's tokens fall in; every live level of the end for
        a constant map from an initial state). The others are zero in every map and not sent."""
        if not self.t["loglinear"]:
            return [0]
        out = set()
        for j in range(self.geo.world):
            p = self.geo.boundary_map(j)
            if p is None:
                continue
            for pa, pb in zip(*self.abs_range(p)):
                out.update(lv for lv, _, _ in _level_groups(pa, pb, True))
                if p.start == p.seq_start and self.init is not None:
                    out.update(lv for lv in range(1, _bitlen(pb) + 1) if _live(pb, lv))
        return sorted(out) or [0]

    def map_slots(self) -> int:
        """Outer slots of every summary: slots of the largest end position a map reaches."""
        if not self.t["loglinear"]:
            return 1
        ends = [1]
        for j in range(self.geo.world):
            p = self.geo.boundary_map(j)
            if p is not None:
                ends.append(_slots(max(self.abs_range(p)[1])))
        return max(ends)

    # -- tensors of a piece ------------------------------------------------------------------

    def rows(self, x: Optional[Tensor], piece: _Piece) -> Optional[Tensor]:
        if x is None:
            return None
        a = self.geo.starts[self.geo.rank]
        return x[:, piece.start - a:piece.end - a]

    def gate(self, g: Optional[Tensor], role: str) -> Optional[Tensor]:
        """The log-gate column [rows, n, H] of a primitive role ('S', 'P' or 'O'), None without
        gates: untied gates have one column per primitive, inner first."""
        if g is None or g.dim() == 3:
            return g
        return g[..., _rho_roles(self.t).index(role) if g.shape[-1] > 1 else 0]

    def heads(self, x: Tensor) -> Tensor:
        """[.., G, d] -> [.., H, d] (GQA: head h reads group h // (H / G))."""
        return x if self.G == self.Hh else x.index_select(2, self.head_group)

    def values(self, v: Tensor) -> Tensor:
        """V' = [V | 1] with normalize (the denominator column), else V; v's dtype."""
        return torch.cat([v, v.new_ones(v.shape[:-1] + (1,))], -1) if self.normalize else v

    # -- state conversions -------------------------------------------------------------------

    def zero_state(self, rows: int, L: int) -> Dict[str, Tensor]:
        z = lambda *s: self.q.new_zeros(s, dtype=self.R)  # noqa: E731
        st = {"Y": z(rows, self.Hh, L, self.dk, self.dvp)}
        if self.t["has_S"]:
            st["S"] = z(rows, self.Hh, self.dk, self.dk)
        if self.t["has_P"]:
            st["P"] = z(rows, self.Hh, self.dk, self.dvp)
        return st

    def from_library(self, st: State, index: Optional[List[int]] = None) -> Dict[str, Tensor]:
        """hila State rows -> internal dense parts (S unpacked, H with a slot axis)."""
        sel = (lambda x: x) if index is None else (
            lambda x: x.index_select(0, torch.tensor(index, device=x.device)))
        H = sel(st.H).to(self.R)
        out = {"Y": H if self.t["loglinear"] else H.unsqueeze(2)}
        if self.t["has_S"]:
            out["S"] = _unpack(sel(st.S).to(self.R), self.dk)
        if self.t["has_P"]:
            out["P"] = sel(st.P).to(self.R)
        return out

    def to_library(self, st: Dict[str, Tensor], pos: List[int], slots: int) -> State:
        Y = st["Y"]
        if self.t["loglinear"]:
            Y = _pad_slots(Y, slots)
        else:
            Y = Y[:, :, 0]
        return State(torch.tensor(pos, dtype=torch.int64, device=self.q.device),
                     _pack(st["S"]) if "S" in st else None, st.get("P"), Y)

    # -- maps --------------------------------------------------------------------------------

    def rekey(self, Y: Tensor, pa: List[int], pb: List[int], slots_out: int) -> Tensor:
        """Re-key the slots of Y [rows, H, Lin, dk, dv'] from positions pa to pb, per row."""
        fen = self.t["loglinear"]
        m = torch.tensor([_rekey_matrix(x, y, Y.shape[2], slots_out, fen) for x, y in zip(pa, pb)],
                         dtype=Y.dtype, device=Y.device)
        return torch.einsum("bol,bhlkv->bhokv", m, Y)

    def apply(self, mp: Dict[str, Tensor], st: Dict[str, Tensor], pa, pb, L: int) -> Dict[str, Tensor]:
        """The state at pb after a piece with map mp, from the state st at pa (L outer slots)."""
        Y = self.rekey(st["Y"], pa, pb, L)
        if self.t["delta"]:  # Y' = M rekey(Y) + P
            return {"Y": torch.einsum("bhij,bhljv->bhliv", mp["M"], Y) + mp["Y"]}
        rho = mp["rho"]
        roles = _rho_roles(self.t)
        r = {role: rho[..., i] for i, role in enumerate(roles)}
        Y = r["O"][:, :, None, None, None] * Y + mp["Y"]
        out = {}
        if self.t["has_S"] and self.t["has_P"]:   # + S Phi + Psi P + S Omega P
            S, P = st["S"], st["P"]
            Om = _unpack(mp["Omega"], self.dk)
            Y = (Y + torch.einsum("bhij,bhljv->bhliv", S, mp["Phi"])
                 + torch.einsum("bhlij,bhjv->bhliv", mp["Psi"], P)
                 + torch.einsum("bhij,bhljv->bhliv", S, torch.einsum("bhlij,bhjv->bhliv", Om, P)))
        elif self.t["has_S"]:                     # + S Z
            Y = Y + torch.einsum("bhij,bhljv->bhliv", st["S"], mp["Z"])
        elif self.t["has_P"]:                     # + R P
            Y = Y + torch.einsum("bhlij,bhjv->bhliv", mp["R"], st["P"])
        out["Y"] = Y
        if self.t["has_S"]:
            out["S"] = r["S"][:, :, None, None] * st["S"] + _unpack(mp["S"], self.dk)
        if self.t["has_P"]:
            out["P"] = r["P"][:, :, None, None] * st["P"] + mp["P"]
        return out

    def constant_map(self, state: Dict[str, Tensor], L: int) -> Dict[str, Tensor]:
        """The map of a piece that starts its sequence: every input goes to `state`."""
        shapes = _part_shapes(self.t, self.Bs, self.Hh, self.dk, self.dvp, L)
        mp = {k: self.q.new_zeros(s, dtype=self.R) for k, s in shapes.items()}
        mp["Y"] = _pad_slots(state["Y"], L)
        if "S" in state:
            mp["S"] = _pack(state["S"])
        if "P" in state:
            mp["P"] = state["P"]
        return mp

    def level_sum(self, A: Tensor, Bm: Tensor, w: Tensor, pa: List[int], pb: List[int],
                  L: int) -> Tensor:
        """sum_j w_j A_j B_j^T per Fenwick level of the state at pb: A [rows, n, H, a], Bm [rows,
        n, H, c], w [rows, n, H] (token j of a row at position pa + j) -> [rows, H, L, a, c].
        Rows at different positions (a dense batch with an initial state) are grouped."""
        rows, _, H = w.shape
        fen = self.t["loglinear"]
        groups: Dict[Tuple[int, int], List[int]] = {}
        for i, key in enumerate(zip(pa, pb)):
            groups.setdefault(key, []).append(i)
        blocks, order = [], []
        for (xa, xb), idx in groups.items():
            if len(groups) == 1:
                Ag, Bg, wg = A, Bm, w
            else:
                sel = torch.tensor(idx, device=A.device)
                Ag, Bg, wg = A.index_select(0, sel), Bm.index_select(0, sel), w.index_select(0, sel)
            slot = [A.new_zeros((len(idx), H, A.shape[-1], Bm.shape[-1]))] * L
            for lv, lo, hi in _level_groups(xa, xb, fen):
                i0, i1 = lo - xa, hi - xa           # [rows, m, H, a] x [rows, m, H, c]
                slot[lv] = torch.einsum("bnha,bnhc->bhac", Ag[:, i0:i1] * wg[:, i0:i1, :, None],
                                        Bg[:, i0:i1])
            blocks.append(torch.stack(slot, 2))
            order += idx
        if len(blocks) == 1:
            return blocks[0]
        inv = torch.empty(rows, dtype=torch.int64)
        inv[torch.tensor(order)] = torch.arange(rows)
        return torch.cat(blocks).index_select(0, inv.to(A.device))

    def piece_gates(self, piece: _Piece, rows: Tuple[int, int]) -> dict:
        """Gate sums of the time rows [rows) of a piece, in float64 [rows, n, H]: the inclusive
        cumsums b_j = sum_{s<=r<=j} g_r per role ('S', 'P', 'O'), the totals rho = e^{b_e} and the
        outer decay to the end w_j = e^{sum_{j<r<=e} gO_r} (a reverse cumsum, never a difference of
        prefix sums)."""
        g = self.g[:, rows[0]:rows[1]] if self.g is not None else None
        n = rows[1] - rows[0]
        out = {}
        for role in _rho_roles(self.t):
            x = (self.gate(g, role).to(torch.float64) if g is not None else
                 torch.zeros(self.B if self.dense else 1, n, self.Hh, dtype=torch.float64,
                             device=self.q.device))
            out[role] = x
        rev = torch.flip(torch.cumsum(torch.flip(out["O"], [1]), 1), [1])      # sum_{r >= j} gO_r
        return dict(cum={r: torch.cumsum(x, 1) for r, x in out.items()},
                    rho={r: torch.exp(x.sum(1)) for r, x in out.items()},     # [rows, H]
                    w=torch.exp(torch.cat([rev[:, 1:], rev.new_zeros(rev[:, :1].shape)], 1)))

    def scaled_q(self, rows: Tuple[int, int]) -> Tensor:
        """q^ = scale q of the time rows, per value head, compute precision [rows, n, H, dk]."""
        return self.heads(self.q[:, rows[0]:rows[1]]).to(self.R) * self.scale

    def map_parts(self, piece: _Piece, rows: Tuple[int, int], key: Tensor, val: Tensor,
                  U: Optional[Tensor], Hv: Optional[Tensor], L: int) -> Dict[str, Tensor]:
        """The action parts of a piece's map from its zero-carry quantities (docs/math/HLA.md §3.4, §5.3,
        §6.3, the outer parts per Fenwick level of the piece's end): rho, the outer state
        Y_X = sum_j w_j key_j val_j^T, and the cross terms hla2: Z = sum w e^{bS} q^ v'^T;
        ahla: R = sum w e^{bP} k q^^T; hla3: Phi = sum w e^{bS} q^ h^T, Psi = sum w e^{bP} u q^^T,
        Omega = sum w e^{bS + bP} q^ q^^T (key, val, U, Hv: the rows of the piece, zero carry)."""
        t, R = self.t, self.R
        key, val, U, Hv = (None if x is None else x.to(R) for x in (key, val, U, Hv))
        pa, pb = self.abs_range(piece)
        gt = self.piece_gates(piece, rows)
        w = gt["w"]
        mp = {"rho": torch.stack([gt["rho"][r] for r in _rho_roles(t)], -1).to(R),
              "Y": self.level_sum(key, val, w.to(R), pa, pb, L)}
        if not (t["has_S"] or t["has_P"]):
            return mp
        qh = self.scaled_q(rows)
        cS = torch.exp(gt["cum"]["S"]) if t["has_S"] else None
        cP = torch.exp(gt["cum"]["P"]) if t["has_P"] else None
        if t["has_S"] and t["has_P"]:
            mp["Phi"] = self.level_sum(qh, Hv, (w * cS).to(R), pa, pb, L)
            mp["Psi"] = self.level_sum(U, qh, (w * cP).to(R), pa, pb, L)
            mp["Omega"] = _pack(self.level_sum(qh, qh, (w * cS * cP).to(R), pa, pb, L))
        elif t["has_S"]:
            mp["Z"] = self.level_sum(qh, self.values(self.v[:, rows[0]:rows[1]]).to(R), (w * cS).to(R), pa, pb, L)
        else:
            mp["R"] = self.level_sum(self.heads(self.k[:, rows[0]:rows[1]]).to(R), qh, (w * cP).to(R),
                                     pa, pb, L)
        return mp

    # -- the call ----------------------------------------------------------------------------

    def run(self):
        global last_comm
        geo, t = self.geo, self.t
        L = self.map_slots()
        lv = self.map_levels()
        shapes = _part_shapes(t, self.Bs, self.Hh, self.dk, self.dvp, L)
        msg_shapes = _part_shapes(t, self.Bs, self.Hh, self.dk, self.dvp, len(lv))
        sizes = [math.prod(s) for s in msg_shapes.values()]
        self.levels = torch.tensor(lv, dtype=torch.int64, device=self.q.device)
        self.pieces = geo.local_pieces() if geo.lens[geo.rank] > 0 else []
        self.local_n = len(self.pieces) if not self.dense else self.B  # rows of the local call
        check = bool(self.opts["check_values"])
        anchors = [self.q, self.k, self.v, self.g, self.lam, self.beta]
        if self.init is not None:
            anchors += [self.init.S, self.init.P, self.init.H]
        needs_grad = torch.is_grad_enabled() and any(
            a is not None and a.requires_grad for a in anchors)

        # 1. summary of the continued piece (and, for the delta rule, the local call)
        error = pending = payload = local = None
        composite = t["has_S"] or t["has_P"]
        try:
            if check:
                error = self._value_error()
            if t["delta"]:
                local = self._delta_local()
            elif composite:
                local = self._inner_local()
            payload = self._summary(geo.boundary_map(geo.rank), local, L, shapes)
            if payload is not None:  # only the slots that some map fills
                payload = torch.cat([(x.index_select(2, self.levels) if key in _LEVELLED else x).reshape(-1)
                                     for key, x in payload.items()])
        except HilaError as exc:
            if not check:
                raise
            raised = self.q.new_tensor(float(_RAISED), dtype=torch.float32)
            error = raised if error is None else torch.where(error > 0, error, raised)
            pending = exc
        if payload is None:
            payload = self.q.new_zeros(sum(sizes), dtype=self.R)

        # 2. exchange
        gathered = _exchange(self.group, payload, needs_grad, error, anchors, check, self.op, pending)
        last_comm = CommStats(self.op, geo.world, payload.numel(),
                              (payload.numel() + 2) * payload.element_size(),
                              (geo.world - 1) * (payload.numel() + 2) * payload.element_size(), len(lv))

        # 3. fold the maps of the earlier ranks: the carry-in at a_r
        carry = None
        chain = geo.carry_chain(geo.rank)
        if chain:
            st = self.zero_state(self.Bs, L)
            for j in chain:
                p = geo.boundary_map(j)
                pa, pb = self.abs_range(p)
                mp = {key: x.reshape(s) for (key, s), x in
                      zip(msg_shapes.items(), torch.split(gathered[j], sizes))}
                mp = {key: (_expand_slots(x, self.levels, L) if key in _LEVELLED else x)
                      for key, x in mp.items()}
                st = self.apply(mp, st, pa, pb, L)
            carry = st

        # 4. finish
        if t["delta"]:
            o, final = self._delta_finish(local, carry)
        elif composite:
            o, final = self._composite_finish(local, carry)
        else:
            o, final = self._rerun(carry)
        outs = [o] + ([x for x in final[1:] if x is not None] if final is not None else [])
        tied = list(_Tie.apply(gathered, *outs)) if needs_grad else outs
        o = tied[0]
        if final is not None:
            it = iter(tied[1:])
            final = State(final.pos, *(None if x is None else next(it) for x in final[1:]))
        return o, (final if self.want_final else None)

    def _value_error(self) -> Tensor:
        """The error code of the first input holding a non-finite value (or, for g, a positive
        gate): 1 + its index in _ERROR_ARGS; 0 when all are fine. Computed on the device."""
        n = len(_ERROR_ARGS)
        code = self.q.new_zeros((), dtype=torch.float32)
        for i, x in enumerate((self.q, self.k, self.v, self.g, self.lam, self.beta)):
            if x is None or not x.numel():
                continue
            x = x.detach()
            bad = ~torch.isfinite(x).all() | ((x > 0).any() if i == 3 else False)
            code = torch.maximum(code, bad.to(torch.float32) * (n - i))   # the first bad one wins
        return torch.where(code > 0, n + 1 - code, code)

    # -- local rows --------------------------------------------------------------------------

    def first_rows(self) -> Tuple[int, List[int]]:
        """The continuing first piece: its time rows [0, n1) and its rows of the local states."""
        n1 = self.T if self.dense else self.pieces[0].end - self.pieces[0].start
        return n1, list(range(self.Bs))

    def last_rows(self) -> Tuple[Tuple[int, int], List[int]]:
        """The last piece: its time rows and its rows of the local states."""
        if self.dense:
            return (0, self.T), list(range(self.B))
        p = self.pieces[-1]
        a = self.geo.starts[self.geo.rank]
        return (p.start - a, p.end - a), [self.local_n - 1]

    def row_states(self, first: Optional[Dict[str, Tensor]]):
        """(positions, internal states) of the local rows at their first rows: ``first`` (the
        carry, or zeros) for a first piece that continues a sequence, the sequence's initial state
        (or zeros) for the others; None when every row starts from zeros at position 0 with no
        initial state."""
        a, pieces = self.geo.starts[self.geo.rank], self.pieces
        cont = bool(self.geo.carry_chain(self.geo.rank))
        if not cont and self.init is None:
            return None
        seqs = list(range(self.B)) if self.dense else [p.seq for p in pieces]
        pos = [self.n0[i] + (a if self.dense else pieces[j].start - pieces[j].seq_start)
               for j, i in enumerate(seqs)]
        slots = max([_slots(x) for x in pos] + [1]) if self.t["loglinear"] else 1
        parts = []
        if cont:
            parts.append(first if first is not None else self.zero_state(self.Bs, slots))
        rest = seqs[self.Bs:] if cont else seqs
        if rest:
            parts.append(self.from_library(self.init, rest) if self.init is not None
                         else self.zero_state(len(rest), slots))
        slots = max([slots] + [x["Y"].shape[2] for x in parts])
        parts = [dict(x, Y=_pad_slots(x["Y"], slots)) for x in parts]
        return pos, {key: torch.cat([x[key] for x in parts]) for key in parts[0]}

    def _local_cu(self) -> Optional[Tensor]:
        if self.dense:
            return None
        a = self.geo.starts[self.geo.rank]
        cu = [p.start - a for p in self.pieces] + [self.T]
        return torch.tensor(cu, dtype=torch.int64, device=self.q.device)

    def _final_slots(self) -> int:
        if not self.t["loglinear"]:
            return 1
        if self.dense:
            return _slots(max(self.n0) + self.geo.ends[self.geo.rank]) if self.n0 else 1
        return max([_slots(self.n0[p.seq] + p.end - p.seq_start) for p in self.pieces] + [1])

    def _call_opts(self, **over) -> dict:
        o = self.opts
        return dict(dict(form=o["form"], chunk=o["chunk"], scale=o["scale"], normalize=o["normalize"],
                         eps=o["eps"], ridge=o["ridge"], qk_l2norm=o["qk_l2norm"],
                         check_values=o["check_values"]), **over)

    def _empty_result(self, carry):
        """An empty shard: no rows; its state (dense) is the carry-in, or the initial state."""
        o = self.v.new_zeros(self.v.shape[:3] + (self.dv,))
        if not self.want_final:
            return o, None
        if not self.dense:
            shapes = _ops.state_part_shapes(self.op, 0, self.Hh, self.dk, self.dv,
                                            normalize=self.normalize, slots=1)
            z = lambda s, dt=self.R: None if s is None else self.q.new_zeros(s, dtype=dt)  # noqa: E731
            return o, State(z(shapes.pos, torch.int64), z(shapes.S), z(shapes.P), z(shapes.H))
        a = self.geo.starts[self.geo.rank]
        pos = [x + a for x in self.n0]
        slots = max(_slots(x) for x in pos) if self.t["loglinear"] and pos else 1
        if carry is not None:
            return o, self.to_library(carry, pos, slots)
        if self.init is not None:
            return o, self.init
        return o, self.to_library(self.zero_state(self.B, slots), pos, slots)

    # -- the summary sent ----------------------------------------------------------------------

    def _summary(self, piece: Optional[_Piece], local, L, shapes) -> Optional[Dict[str, Tensor]]:
        """The map of this rank's continued piece (None when it has none). A piece that starts its
        sequence sends the constant map to its end state (its initial state included)."""
        if piece is None:
            return None
        constant = piece.start == piece.seq_start
        t = self.t
        if t["delta"]:
            if constant:
                mp = {"M": self.q.new_zeros(shapes["M"], dtype=self.R), "Y": local["last_state"]}
            else:
                M, Y = local["map"]
                mp = {"M": M, "Y": Y}
            mp["Y"] = _pad_slots(mp["Y"], L)
            return mp
        if self.T == 0:   # an empty piece inside a sequence: the identity map
            mp = {key: self.q.new_zeros(s, dtype=self.R) for key, s in shapes.items()}
            mp["rho"] = torch.ones_like(mp["rho"])
            return mp
        rows, srows = self.last_rows()
        if t["has_S"] or t["has_P"]:
            key, val, U, Hv = self.outer_inputs(local, rows)
        else:
            key, val, U, Hv = self.heads(self.k[:, rows[0]:rows[1]]), \
                self.values(self.v[:, rows[0]:rows[1]]), None, None
        if not constant:
            mp = self.map_parts(piece, rows, key, val, U, Hv, L)
            if t["has_S"]:
                mp["S"] = _pack(local["S"][srows])
            if t["has_P"]:
                mp["P"] = local["P"][srows]
            return {k: mp[k] for k in shapes}
        # constant map: the state at the piece's end. The inner states (and so key, val) already
        # hold the initial state; the outer initial state decays and is re-keyed to the end.
        pa, pb = self.abs_range(piece)
        gt = self.piece_gates(piece, rows)
        st = {"Y": self.level_sum(key.to(self.R), val.to(self.R), gt["w"].to(self.R), pa, pb, L)}
        if self.init is not None:
            Y0 = self.from_library(self.init, None if piece.seq is None else [piece.seq])["Y"]
            st["Y"] = st["Y"] + self.rekey(gt["rho"]["O"].to(self.R)[:, :, None, None, None] * Y0, pa, pb, L)
        if t["has_S"]:
            st["S"] = local["S"][srows]
        if t["has_P"]:
            st["P"] = local["P"][srows]
        return self.constant_map(st, L)

    # -- gla, loglinear: rerun from the carry ------------------------------------------------

    def _rerun(self, carry):
        if self.T == 0:
            return self._empty_result(carry)
        rs = self.row_states(carry)
        init = None if rs is None else self.to_library(rs[1], rs[0], rs[1]["Y"].shape[2])
        return _forward(self.op, self.q, self.k, self.v, self.g, lam=self.lam, beta=self.beta,
                        cu_seqlens=self._local_cu(), initial_state=init,
                        output_final_state=self.want_final, final_slots=self._final_slots(),
                        **self._call_opts())

    # -- hla2, ahla, hla3 and log-linear versions: the primitives, each called once ------------

    def _inner_local(self) -> Optional[dict]:
        """The inner primitives over the local rows, a continuing first piece from a zero carry:
        U = GLA_gS(q^, K, K) (u_j = S_j q^_j) and/or H = GLA_gP(q^, K, V') (h_j = P_j^T q^_j),
        [B, T, H, dk] / [B, T, H, dv'] in the inputs' dtype (as the operator keeps them), and the
        inner final states S [N, H, dk, dk], P (state dtype)."""
        if self.T == 0:
            return None
        t = self.t
        q, k, kh, vp = self.q, self.k, self.heads(self.k), self.values(self.v)   # the inputs' dtype
        rs = self.row_states(None)
        init = None
        if rs is not None and self.init is not None:   # else every inner state starts at zero
            init = {key: x for key, x in rs[1].items() if key in ("S", "P")}
        opts = dict(cu_seqlens=self._local_cu(), output_final_state=True, scale=self.scale,
                    form="chunk", chunk=self.opts["chunk"], check_values=self.opts["check_values"])
        zpos = torch.zeros(self.local_n, dtype=torch.int64, device=self.q.device)
        g = self.g
        out = {}
        if t["has_S"] and t["has_P"] and (g is None or g.dim() == 3 or g.shape[-1] == 1):
            # tied gates: U and H in one call on [K | V'] (state [S | P])
            st = None if init is None else State(zpos, None, None, torch.cat([init["S"], init["P"]], -1))
            o, fin = _forward("gla", q, k, torch.cat([kh, vp], -1), self.gate(g, "S"), initial_state=st, **opts)
            out.update(U=o[..., :self.dk], H=o[..., self.dk:], S=fin.H[..., :self.dk], P=fin.H[..., self.dk:])
            return out
        if t["has_S"]:
            st = None if init is None else State(zpos, None, None, init["S"])
            out["U"], fin = _forward("gla", q, k, kh, self.gate(g, "S"), initial_state=st, **opts)
            out["S"] = fin.H
        if t["has_P"]:
            st = None if init is None else State(zpos, None, None, init["P"])
            out["H"], fin = _forward("gla", q, k, vp, self.gate(g, "P"), initial_state=st, **opts)
            out["P"] = fin.H
        return out

    def outer_inputs(self, inner: dict, rows: Tuple[int, int]):
        """(key, value, U, H) of the outer primitive over time rows: hla2 (U + ridge q^, V'),
        ahla (K, H), hla3 (U, H)."""
        U = inner["U"][:, rows[0]:rows[1]] if "U" in inner else None
        Hv = inner["H"][:, rows[0]:rows[1]] if "H" in inner else None
        if U is not None:
            key = ((U.to(self.R) + self.opts["ridge"] * self.scaled_q(rows)).to(U.dtype)
                   if self.opts["ridge"] else U)
        else:
            key = self.heads(self.k[:, rows[0]:rows[1]])
        val = Hv if Hv is not None else self.values(self.v[:, rows[0]:rows[1]])
        return key, val, U, Hv

    def _composite_finish(self, inner: Optional[dict], carry):
        """Adds the carry-in to the inner outputs of the first piece (u_j += e^{bS_j} S_in q^_j,
        h_j += e^{bP_j} P_in^T q^_j) and to its inner final states (rho S_in + S_X), then runs the
        outer primitive (gla, or loglinear with lam) over the local rows from the outer carry-in
        Y_in: o = GLA_gO(q^, key, value; Y_in); with normalize, o = num / (den + eps)."""
        if self.T == 0:
            return self._empty_result(carry)
        t, R = self.t, self.R
        inner = dict(inner)
        if carry is not None:
            n1, srows = self.first_rows()
            p = self.pieces[0]
            gt = self.piece_gates(p, (0, n1))
            qh = self.scaled_q((0, n1))
            for name, role, st in (("U", "S", "S"), ("H", "P", "P")):
                if name not in inner:
                    continue
                c = torch.exp(gt["cum"][role]).to(R)[..., None]             # [rows, n1, H, 1]
                add = c * torch.einsum("bthk,bhkj->bthj", qh, carry[st])     # e^{b} q^^T X_in
                x = inner[name]
                x1 = (x[:, :n1].to(R) + add).to(x.dtype)
                inner[name] = torch.cat([x1, x[:, n1:]], 1) if n1 < self.T else x1
                fin = inner[st]
                upd = gt["rho"][role].to(R)[:, :, None, None] * carry[st] + fin[:len(srows)]
                inner[st] = torch.cat([upd, fin[len(srows):]]) if fin.shape[0] > len(srows) else upd
        key, val, _, _ = self.outer_inputs(inner, (0, self.T))
        rs = self.row_states(carry)
        init = None
        if rs is not None:
            Y = rs[1]["Y"] if t["loglinear"] else rs[1]["Y"][:, :, 0]
            init = State(torch.tensor(rs[0], dtype=torch.int64, device=self.q.device), None, None, Y)
        outer = "loglinear" if t["loglinear"] else "gla"
        o, fin = _forward(outer, self.heads(self.q), key, val, self.gate(self.g, "O"), lam=self.lam,
                          cu_seqlens=self._local_cu(), initial_state=init,
                          output_final_state=self.want_final, final_slots=self._final_slots(),
                          **self._call_opts(normalize=False, ridge=0.0, scale=self.scale))
        if self.normalize:   # [num | den] = the operator on [V | 1]
            o = o.to(R)
            o = (o[..., :self.dv] / (o[..., self.dv:] + self.opts["eps"])).to(self.v.dtype)
        if not self.want_final:
            return o, None
        return o, State(fin.pos, _pack(inner["S"]) if t["has_S"] else None, inner.get("P"), fin.H)

    # -- gdn, loglinear_gdn: local call from a zero carry, then the carry's linear contribution --

    def _delta_local(self) -> dict:
        """The local call with a zero carry for a continuing first piece and, for that piece, the
        transition M = A_e ... A_s [dk, dk] and the effective queries q~_t = (A_t ... A_s)^T q^_t
        [n1, dk] (A_t = a_t (I - beta_t k_t k_t^T)): the outputs and the final state of a call from
        the initial state I with v = 0. gdn does both in one call on [V | 0] from [H_0 | I];
        loglinear_gdn (whose levels are read with different lam) with a second, gdn, call."""
        run = {}
        cont = bool(self.geo.carry_chain(self.geo.rank))
        if self.T == 0:
            if cont:  # an empty piece inside a sequence: the identity map
                eye = torch.eye(self.dk, dtype=self.R, device=self.q.device)
                run["map"] = (eye.expand(self.Bs, self.Hh, self.dk, self.dk),
                              self.q.new_zeros(self.Bs, self.Hh, 1, self.dk, self.dv, dtype=self.R))
            return run
        rs = self.row_states(None)
        eye = torch.eye(self.dk, dtype=self.R, device=self.q.device).expand(self.Bs, self.Hh, self.dk, self.dk)
        n1 = self.first_rows()[0] if cont else 0
        if cont and not self.t["loglinear"]:
            pos, st = rs
            H0 = st["Y"][:, :, 0]                                                      # [N, H, dk, dv]
            E = torch.cat([eye, eye.new_zeros((self.local_n - self.Bs,) + eye.shape[1:])])
            init = State(torch.tensor(pos, dtype=torch.int64, device=self.q.device), None, None,
                         torch.cat([H0, E], -1))
            v = torch.cat([self.v, self.v.new_zeros(self.v.shape[:3] + (self.dk,))], -1)
            o, fin = _forward("gdn", self.q, self.k, v, self.g, beta=self.beta, cu_seqlens=self._local_cu(),
                              initial_state=init, output_final_state=True, **self._call_opts())
            run["qt"] = o[:, :n1, :, self.dv:].to(self.R)
            run["M"] = fin.H[:self.Bs, :, :, self.dv:].to(self.R)
            o, final = o[..., :self.dv], State(fin.pos, None, None, fin.H[..., :self.dv])
        else:
            init = None if rs is None else self.to_library(rs[1], rs[0], rs[1]["Y"].shape[2])
            o, final = _forward(self.op, self.q, self.k, self.v, self.g, lam=self.lam, beta=self.beta,
                                cu_seqlens=self._local_cu(), initial_state=init, output_final_state=True,
                                final_slots=self._final_slots(), **self._call_opts())
            if cont:
                q, k = self.q[:, :n1], self.k[:, :n1]
                st = State(torch.zeros(self.Bs, dtype=torch.int64, device=self.q.device), None, None,
                           eye.contiguous())
                qt, fin = _forward("gdn", q, k, self.v.new_zeros(q.shape[:2] + (self.Hh, self.dk)),
                                   None if self.g is None else self.g[:, :n1], beta=self.beta[:, :n1],
                                   initial_state=st, output_final_state=True,
                                   **self._call_opts(form="chunk"))
                run["qt"], run["M"] = qt.to(self.R), fin.H
        run["o"], run["final"] = o, final
        _, last = self.last_rows()
        run["last_state"] = self.from_library(final, last)["Y"]
        if cont:
            run["map"] = (run["M"], self.from_library(final, list(range(self.Bs)))["Y"])
        return run

    def _delta_finish(self, run, carry):
        if self.T == 0:
            return self._empty_result(carry)
        o, final = run["o"], run["final"]
        if carry is None:
            return o, (final if self.want_final else None)
        p = self.pieces[0]
        pa, pb = self.abs_range(p)
        Hin = carry["Y"]                                                # [Bs, H, L, dk, dv]
        qt = run["qt"]                                                  # [Bs, n1, H, dk]
        n1 = qt.shape[1]
        corr = self._delta_reads(qt, Hin, pa, p)                        # [Bs, n1, H, dv]
        o1 = o[:, :n1] + corr.to(o.dtype)
        o = torch.cat([o1, o[:, n1:]], 1) if n1 < o.shape[1] else o1
        if not self.want_final:
            return o, None
        # final state of the first piece: + M rekey(H_in)
        slots = final.H.shape[2] if self.t["loglinear"] else 1
        add = torch.einsum("bhij,bhljv->bhliv", run["M"], self.rekey(Hin, pa, pb, slots))
        Hf = final.H if self.t["loglinear"] else final.H.unsqueeze(2)
        Hf = torch.cat([Hf[:self.Bs] + add.to(Hf.dtype), Hf[self.Bs:]], 0)
        final = State(final.pos, None, None, Hf if self.t["loglinear"] else Hf[:, :, 0])
        return o, final

    def _delta_reads(self, qt: Tensor, Hin: Tensor, pa: List[int], p: _Piece) -> Tensor:
        """sum over live levels l of the carry at pa: lam_t^{l(t, sigma_l(pa))} H_in[l]^T q~_t."""
        if not self.t["loglinear"]:
            return torch.einsum("bthk,bhkv->bthv", qt, Hin[:, :, 0])
        lam = self.rows(self.lam, p).to(self.R)                         # [Bs, n1, H, Llam]
        n1 = qt.shape[1]
        out = qt.new_zeros(qt.shape[:3] + (Hin.shape[-1],))
        ar = torch.arange(n1, dtype=torch.int64, device=qt.device)
        for key in sorted(set(pa)):
            idx = [i for i, x in enumerate(pa) if x == key]
            sel = torch.tensor(idx, device=qt.device)
            part = qt.new_zeros((len(idx),) + out.shape[1:])
            for l in range(1, Hin.shape[2]):
                if not _live(key, l):
                    continue
                lvl = _bitlen_t((ar + key) ^ ((key >> l) << l))              # [n1] read level
                lg = lam.index_select(0, sel)
                wl = torch.gather(lg, 3, lvl[None, :, None, None].expand(lg.shape[:3] + (1,)))[..., 0]
                part = part + wl[..., None] * torch.einsum(
                    "bthk,bhkv->bthv", qt.index_select(0, sel), Hin.index_select(0, sel)[:, :, l])
            out = out.index_copy(0, sel, part)
        return out


_LEVELLED = ("Y", "Z", "R", "Phi", "Psi", "Omega")  # summary parts with a slot axis (dim 2)


def _expand_slots(x: Tensor, levels: Tensor, L: int) -> Tensor:
    """x with its slot axis (dim 2) holding `levels` -> L slots, the others zero."""
    return x.new_zeros(x.shape[:2] + (L,) + x.shape[3:]).index_copy(2, levels, x)


def _pad_slots(Y: Tensor, slots: int) -> Tensor:
    """Y [rows, H, L, dk, dv] with `slots` slots (zero slots appended; never drops a slot)."""
    if Y.shape[2] >= slots:
        return Y
    return torch.cat([Y, Y.new_zeros(Y.shape[:2] + (slots - Y.shape[2],) + Y.shape[3:])], 2)


def forward(op: str, q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor] = None, *,
            lam: Optional[Tensor] = None, beta: Optional[Tensor] = None,
            cu_seqlens: Optional[Tensor] = None, initial_state: Optional[State] = None,
            output_final_state: bool = False, group=None,
            shard_lens: Optional[Sequence[int]] = None, form: str = "chunk", chunk: int = 64,
            scale: Optional[float] = None, normalize: bool = False, eps: float = 1e-6,
            ridge: float = 0.0, qk_l2norm: bool = False,
            check_values: Optional[bool] = None) -> Tuple[Tensor, Optional[State]]:
    """Differentiable ``hila.torch.forward`` of a sequence sharded along T over ``group``.

    Each rank passes its own rows: q, k [B, T_r, G, dk], v [B, T_r, H, dv], g, lam, beta likewise
    (the shard of what the single-device call takes). ``shard_lens``: every rank's T_r, the same
    list on every rank (None: gathered with one extra small all_gather). ``cu_seqlens``: the
    *global* offsets of packed sequences (B == 1), the same on every rank. ``initial_state``: the
    global initial state (all N sequences), the same on every rank.

    Returns ``(o [B, T_r, H, dv], final)``: this rank's rows of the single-device output and, with
    ``output_final_state``, the state at the end of each of its sequences (dense: the B rows at
    b_r, the global final state on the last non-empty rank; packed: one row per sequence with rows
    here, see :func:`local_sequences`). Options as in :func:`hila.torch.forward`; ``check_values``
    (None: on for CPU tensors, off on CUDA) also checks every rank's inputs before anyone
    continues (one device read per call).
    """
    if check_values is None:
        check_values = bool(getattr(q, "is_cpu", True))
    opts = dict(form=form, chunk=chunk, scale=scale, normalize=normalize, eps=eps, ridge=ridge,
                qk_l2norm=qk_l2norm, check_values=check_values)
    return _Call(op, q, k, v, g, lam, beta, cu_seqlens, initial_state, output_final_state,
                 group, shard_lens, opts).run()


# ----------------------------------------------------------------------------- short-convolution halo

def _halo(x: Tensor, width: int, group, lens, cu_seqlens) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """(cache [N_r, C, width-1], gathered tails, local cu_seqlens) of this rank's shard."""
    global last_halo_comm
    h = width - 1
    B, T, C = x.shape
    geo = _geometry(T, B, group, lens, cu_seqlens, x.device)
    r, a = geo.rank, geo.starts[geo.rank]
    pieces = geo.local_pieces() if T > 0 else []
    N = B if geo.cu is None else len(pieces)
    local_cu = None if geo.cu is None else torch.tensor(
        [p.start - a for p in pieces] + [T], dtype=torch.int64, device=x.device)
    tail = x[:, max(0, T - h):]                                                 # last <= h rows
    tail = torch.cat([tail.new_zeros(B, h - tail.shape[1], C), tail], 1)        # [B, h, C]
    needs_grad = torch.is_grad_enabled() and x.requires_grad
    gathered = _exchange(group, tail.reshape(-1), needs_grad, None, [x], False, "halo")
    last_halo_comm = CommStats("halo", geo.world, tail.numel(), (tail.numel() + 2) * tail.element_size(),
                               (geo.world - 1) * (tail.numel() + 2) * tail.element_size(), 1)
    # cache column m holds global row p = a - h + m, the (b_j - p)-th row from the end of the tail
    # of the rank j holding p; rows before the first local sequence's start are zero (index 0)
    first = 0 if geo.cu is None else (pieces[0].seq_start if pieces else a)
    idx = []
    for m in range(h):
        p = a - h + m
        if p < max(first, 0):
            idx.append(0)
            continue
        j = max(jj for jj in range(r) if geo.starts[jj] <= p < geo.ends[jj])
        idx.append(1 + j * h + h - (geo.ends[j] - p))
    table = torch.cat([gathered.new_zeros(1, B, C),                             # [1 + world h, B, C]
                       gathered.reshape(geo.world, B, h, C).transpose(1, 2).reshape(geo.world * h, B, C)])
    halo = table.index_select(0, torch.tensor(idx, dtype=torch.int64, device=x.device)).permute(1, 2, 0)
    if geo.cu is not None:  # the first local sequence only; the others start here
        halo = torch.cat([halo[:min(N, 1)], halo.new_zeros(max(N - 1, 0), C, h)])
    return halo, gathered, local_cu


def short_conv(conv, x: Tensor, *, group=None, shard_lens: Optional[Sequence[int]] = None,
               cu_seqlens: Optional[Tensor] = None) -> Tensor:
    """A :class:`hila.torch.ShortConvolution` over a sharded sequence: this rank's outputs of the
    single-device call on the whole sequence.

    x [B, T_r, C] (B == 1 with the global ``cu_seqlens``). A rank needs the ``width - 1`` inputs
    before its first row: every rank sends its last ``width - 1`` rows in one all_gather, and each
    takes its halo from the ranks before it (several when shards are shorter than the halo; zeros
    before the start of the sequence). The halo is the cache of the local call, so the gradient of
    those inputs goes back to the ranks that hold them. Returns y [B, T_r, C].
    """
    halo, gathered, local_cu = _halo(x, conv.width, group, shard_lens, cu_seqlens)
    if x.shape[1] == 0:
        y = x
    else:
        y, _ = conv(x, halo, local_cu)
    if torch.is_grad_enabled() and x.requires_grad:
        y = _Tie.apply(gathered, y)[0]
    return y
