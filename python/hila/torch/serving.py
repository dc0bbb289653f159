# SPDX-License-Identifier: Apache-2.0
"""Serving hooks: operator calls on rows of a state pool, as serving engines run them.

A serving engine (vLLM, SGLang, ...) keeps the recurrent states of all live requests in one
preallocated *pool* and runs each batch through per-request row indices (vLLM's
``state_batch_indices`` / fla's ``ssm_state_indices``)::

    pool = allocate_state_pool("loglinear", num_slots, H, dk, dv, max_len=32768)   # once
    reset_state_rows(pool, new_rows)                                                 # admission
    o, _ = hila.torch.forward(op, q, k, v, g, lam=lam, cu_seqlens=cu, initial_state=pool,
                              state_indices=rows, cu_seqlens_cpu=cu_host, max_seqlen=m)  # prefill
    o_t = hila.torch.step_(op, q_t, k_t, v_t, g_t, lam=lam_t, state=pool,
                           state_indices=rows, max_position=32767)                   # decode

Sequence ``i`` of the call reads its initial state from pool row ``state_indices[i]`` and writes
its state after the call back to that row, in place. A row index of -1 marks a padding sequence
(a batch padded to a captured CUDA-graph size): it reads and writes no row and its output is 0.

The library addresses the pool itself (``hila::ForwardParams::state_indices`` /
``hila::StepParams::state_indices``): the decode kernel reads and writes the rows in place, and a
prefill gathers the rows it reads on the device and writes the final states back; nothing is read
back to the host (the positions of a pooled prefill excepted, unless ``init_pos_cpu`` gives them),
so a pooled decode step can be captured in a CUDA graph. Each real row is computed by the same
kernel as an unpooled call of that row alone.

Contract: indices of real rows are distinct and ``< num_slots``. On the CPU, and on CUDA whenever
the library reads the indices anyway (``check_values=True``, or a log-linear step without
``max_position``), they are checked (HilaError naming ``state_indices``); otherwise a row outside
``[-1, num_slots)`` gives NaN outputs and writes nothing, and duplicates are the engine's to avoid.

fla's V-first pools (``state_v_first``: ``[num_slots, HV, V, K]``, seen through a transposed view)
have no contiguous rows in hila's layout; their rows are gathered into hila's layout with
``index_select`` and written back with ``index_copy_`` (device operations only, still no host read).
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from .. import ops as _ops
from .._errors import HilaError
from ..ops import State

__all__ = ["get_state_shape", "allocate_state_pool", "reset_state_rows"]


def get_state_shape(op: str, num_heads: int, head_k_dim: int, head_v_dim: int, max_len: int, *,
                    normalize: bool = False) -> State:
    """Shapes of one request's state (no pool axis): a :class:`hila.State` of tuples, None for
    the parts ``op`` lacks. ``pos`` is ``()`` (one int64), ``S`` ``(H, dk(dk+1)/2)``, ``P``
    ``(H, dk, dv')``, ``H`` ``(H, dk, dv')`` or, log-linear, ``(H, Ls, dk, dv')`` with
    ``Ls = state_slots(max_len)``: the Fenwick capacity of a request of up to ``max_len`` tokens.
    ``dv' = dv + 1`` with ``normalize``. A pool of ``num_slots`` rows puts ``num_slots`` in front
    of each (:func:`allocate_state_pool`). Float parts are float32 (float64 for float64 models)."""
    if max_len is None or int(max_len) < 0:
        raise HilaError(f"hila: argument 'max_len': expected the longest request in tokens (>= 0), "
                        f"got {max_len}", "max_len")
    shapes = _ops.state_part_shapes(op, 1, num_heads, head_k_dim, head_v_dim, normalize=normalize,
                                    slots=_ops.state_slots(int(max_len)))
    return State(*(None if s is None else tuple(s[1:]) for s in shapes))


def allocate_state_pool(op: str, num_slots: int, num_heads: int, head_k_dim: int, head_v_dim: int,
                        max_len: int, *, normalize: bool = False,
                        dtype: torch.dtype = torch.float32,
                        device: Optional[torch.device] = None) -> State:
    """A zero pool of ``num_slots`` request states (shapes of :func:`get_state_shape` with
    ``num_slots`` in front): every row at position 0. ``dtype``: float32, or float64 for float64
    inputs."""
    if dtype not in (torch.float32, torch.float64):
        raise HilaError(f"hila: argument 'dtype': expected torch.float32 or torch.float64 (states are "
                        f"kept in fp32 or fp64), got {dtype}", "dtype")
    one = get_state_shape(op, num_heads, head_k_dim, head_v_dim, max_len, normalize=normalize)
    z = lambda s, dt=dtype: None if s is None else torch.zeros((num_slots, *s), dtype=dt,  # noqa: E731
                                                               device=device)
    return State(z(one.pos, torch.int64), z(one.S), z(one.P), z(one.H))


def reset_state_rows(pool: State, rows: Tensor) -> None:
    """Zeroes pool rows ``rows`` (int [M], device tensor; no host read): the state of a new
    request at position 0. A pool row is read as the initial state of every call that names it,
    so a row handed to a new request is reset first."""
    rows = rows.to(device=pool.H.device, dtype=torch.int64)
    for x in pool:
        if x is not None:
            x.index_fill_(0, rows, 0)


def _indices(state_indices, N: int, device: torch.device) -> Tensor:
    """state_indices as the library takes them: int32 [N] on the pool's device (an int64 tensor is
    converted on the device; the library names any other misuse)."""
    if not isinstance(state_indices, Tensor) or state_indices.dim() != 1 or \
            state_indices.dtype not in (torch.int32, torch.int64):
        raise HilaError("hila: argument 'state_indices': expected an int32 or int64 tensor [N] of "
                        f"pool rows (-1: padding), got {_ops._describe(state_indices)}", "state_indices")
    if state_indices.shape[0] != N:
        raise HilaError(f"hila: argument 'state_indices': expected one row per sequence of the call "
                        f"({N}), got {state_indices.shape[0]}", "state_indices")
    if state_indices.device != device:
        raise HilaError(f"hila: argument 'state_indices': expected a tensor on the pool's device "
                        f"{device}, got {state_indices.device}", "state_indices")
    return state_indices if state_indices.dtype == torch.int32 else state_indices.to(torch.int32)


def _pool(op: str, pool, name: str) -> Tuple[State, bool]:
    """The pool as a State, and whether it is bare: a [P, H, dk, dv] tensor is a pool of gla / gdn
    states, whose positions (which those operators do not read) hila keeps nowhere: a zero
    position per row stands in for them."""
    if pool is None:
        raise HilaError(f"hila: argument '{name}': expected the state pool (a hila.State, or a "
                        f"[num_slots, H, dk, dv] tensor for gla / gdn) with state_indices, got None", name)
    st = _ops.as_state(op, pool, name)
    for field, x in zip(State._fields, st):
        if x is not None and not isinstance(x, Tensor):
            raise HilaError(f"hila: argument '{name}.{field}': expected a torch.Tensor, got "
                            f"{_ops._describe(x)}", f"{name}.{field}")
    return st, hasattr(pool, "shape")


def _check_pool_dtype(pool: State, q: Tensor, name: str) -> None:
    want = torch.float64 if q.dtype == torch.float64 else torch.float32
    for field, x in zip(State._fields[1:], pool[1:]):
        if x is not None and x.dtype != want:
            raise HilaError(f"hila: argument '{name}.{field}': expected {want} (the state dtype of "
                            f"{q.dtype} inputs), got {x.dtype}", f"{name}.{field}")


def _in_place(pool: State) -> bool:
    """Whether the library can address the pool's rows in place: every part's innermost stride is
    1 (fla's V-first pools, transposed views, are not)."""
    return all(x is None or x.dim() == 0 or x.shape[-1] <= 1 or x.stride(-1) == 1 for x in pool)


def prepare_pool(op: str, pool, state_indices, q: Tensor, N: int, name: str):
    """(pool State, int32 indices, bare, in_place) for a pooled call of N sequences on q's
    device (hila.torch.forward / step_ with state_indices)."""
    st, bare = _pool(op, pool, name)
    _check_pool_dtype(st, q, name)
    idx = _indices(state_indices, N, st.H.device)
    return st, idx, bare, _in_place(st)


# ----------------------------------------------------------------------------- V-first pools
# The rows of a pool the kernels cannot address in place are gathered into hila's layout and
# written back with device operations. A padding row is computed as a copy of the first real row
# (same inputs, same state) and writes that row's result to that row, so every write to a pool row
# carries the same bits and duplicate indices in the scatter are harmless; with no real row every
# write puts back the untouched row that was read.

class _Plan(NamedTuple):
    """Where each of the N sequences of a gathered call reads and writes (all device tensors)."""
    valid: Tensor      # bool [N], state_indices >= 0
    any_valid: Tensor  # bool [], one real row at least
    src: Tensor        # int64 [N], the sequence whose result row i writes: i, or the first real one
    tgt: Tensor        # int64 [N], the pool row that row i reads and writes
    tgt_ext: Tensor    # int64 [N + 1], tgt and one more read of tgt[0], kept untouched


def _plan(idx: Tensor, N: int, pool_rows: int, device: torch.device) -> _Plan:
    idx = idx.to(torch.int64)
    if idx.device.type == "cpu":  # host memory: the contract can be checked without a sync
        real = idx[idx >= 0]
        if bool((idx < -1).any()) or bool((real >= pool_rows).any()) or real.unique().numel() != real.numel():
            raise HilaError(f"hila: argument 'state_indices': expected distinct pool rows in "
                            f"[0, {pool_rows}) or -1 (padding), got {idx.tolist()}", "state_indices")
    valid = idx >= 0
    first = valid.to(torch.int32).argmax()          # the first real row (0 when there is none)
    src = torch.where(valid, torch.arange(N, device=device), first)
    tgt = idx.index_select(0, src).clamp(min=0)     # padding: the first real row's pool row; none: 0
    return _Plan(valid, valid.any(), src, tgt, torch.cat([tgt, tgt[:1]]))


def _gather(pool: State, plan: _Plan, N: int) -> State:
    """Rows tgt_ext of every part ([N + 1, ...], new tensors); positions 0 where the pool keeps none."""
    rows = [None if x is None else x.index_select(0, plan.tgt_ext) for x in pool]
    if rows[0] is None:
        rows[0] = torch.zeros(N + 1, dtype=torch.int64, device=plan.tgt.device)
    return State(*rows)


def _scatter(pool: State, rows: State, new: State, plan: _Plan, N: int) -> None:
    """pool[tgt[i]] = new[src[i]] for every part, or, with no real row, the untouched rows[N]."""
    for part, r, x in zip(pool, rows, new):
        if part is None:
            continue
        val = torch.where(plan.any_valid, x.index_select(0, plan.src), r[N:])
        part.index_copy_(0, plan.tgt, val)


def gathered_step_(op: str, q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor], *, pool: State,
                   idx: Tensor, bare: bool, lam: Optional[Tensor] = None,
                   beta: Optional[Tensor] = None, **options) -> Tensor:
    """hila.torch.step_ on a pool whose rows the library cannot address in place."""
    from .ops import step_
    N = q.shape[0]
    if bare:
        pool = State(None, None, None, pool.H)
    plan = _plan(idx, N, pool.H.shape[0], pool.H.device)
    pick = lambda t: None if t is None else t.index_select(0, plan.src)  # noqa: E731
    rows = _gather(pool, plan, N)
    work = State(*(None if r is None else r[:N] for r in rows))      # views: step_ writes into rows
    o = step_(op, pick(q), pick(k), pick(v), pick(g), state=work, lam=pick(lam), beta=pick(beta),
              **options)
    _scatter(pool, rows, work, plan, N)
    return torch.where(plan.valid.view(N, 1, 1), o, o.new_zeros(()))


def gathered_forward(op: str, q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor], *, pool: State,
                     idx: Tensor, bare: bool, N: int, lam: Optional[Tensor] = None,
                     beta: Optional[Tensor] = None, cu_seqlens: Optional[Tensor] = None,
                     **options) -> Tensor:
    """hila.torch.forward on a pool whose rows the library cannot address in place; returns o."""
    from .ops import forward
    from .modules import sequence_index
    if bare:
        pool = State(None, None, None, pool.H)
    plan = _plan(idx, N, pool.H.shape[0], pool.H.device)
    rows = _gather(pool, plan, N)
    init = State(*(None if r is None else r[:N] for r in rows))
    slots = pool.H.shape[2] if _ops.op_traits(op)["loglinear"] and pool.H.dim() == 5 else None
    pos_cpu = torch.zeros(N, dtype=torch.int64) if bare else None  # a bare pool: every row at 0
    o, fin = forward(op, q, k, v, g, lam=lam, beta=beta, cu_seqlens=cu_seqlens, initial_state=init,
                     output_final_state=True, final_slots=slots, init_pos_cpu=pos_cpu, **options)
    _scatter(pool, rows, fin, plan, N)
    if cu_seqlens is None:
        keep = plan.valid.view(N, 1, 1, 1)
    else:
        seq, _ = sequence_index(cu_seqlens, q.shape[1])
        keep = plan.valid.index_select(0, seq).view(1, -1, 1, 1)
    return torch.where(keep, o, o.new_zeros(()))
