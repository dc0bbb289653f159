# SPDX-License-Identifier: Apache-2.0
"""hila's operators as PyTorch custom ops, differentiable and traceable by torch.compile.

Four ops are registered with ``torch.library.custom_op`` (each with ``register_fake``; forward
and step with ``register_autograd``)::

    torch.ops.hila.forward    o and the final state of a whole call (any op, any form)
    torch.ops.hila.backward   every gradient of a call (naive, chunk, or serial for gla/hla2/ahla/hla3)
    torch.ops.hila.step       one decode token on a state tensor tuple (functional, differentiable)
    torch.ops.hila.step_      one decode token, the fused step kernel advancing the state tensors
                              in place (mutates pos, S, P, H; inference)

Use them through :func:`forward`, :func:`step` and :func:`step_`, which take :class:`hila.State`
tuples. Gradients flow to q, k, v, g, lam, beta and the S, P, H parts of the initial state (also
through :func:`step`). Forms without a backward (scan, and serial for the log-linear and delta
operators) are differentiated with the chunk backward, which computes the same function.

Tensors on CUDA run on the caller's current stream (``torch.cuda.current_stream()``, handed to the
C++ library); what the library cannot run on a device (docs/API.md) raises :class:`hila.HilaError`.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .. import ops as _ops
from .._errors import HilaError
from ..ops import State

__all__ = ["forward", "step", "step_", "zero_state"]

_Out5 = Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]
_Grads9 = Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]


def _host(x: Optional[Tensor]) -> Optional[Tensor]:
    """A tensor the extension can read over DLPack: no autograd history, innermost stride 1
    (incoming gradients are often expanded scalars with stride 0)."""
    if x is None:
        return None
    x = x.detach()
    return x if x.dim() == 0 or x.stride(-1) == 1 or x.size(-1) <= 1 else x.contiguous()


def _stream(t: Tensor) -> int:
    return torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else 0


def _scale(scale: float) -> Optional[float]:
    return None if scale == 0.0 else scale  # 0.0 in a schema: the default dk^-1/2


def _state_or_none(pos, S, P, H) -> Optional[State]:
    return None if pos is None and S is None and P is None and H is None else State(pos, S, P, H)


def _present(xs, like: Tensor) -> tuple:
    """Optional results as tensors (a custom op returns no None): absent is an empty tensor."""
    return tuple(like.new_empty(0) if x is None else x for x in xs)


def _state_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


# ----------------------------------------------------------------------------- hila::forward

@torch.library.custom_op("hila::forward", mutates_args=())
def _forward_op(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor], lam: Optional[Tensor],
                beta: Optional[Tensor], cu_seqlens: Optional[Tensor], init_pos: Optional[Tensor],
                init_S: Optional[Tensor], init_P: Optional[Tensor], init_H: Optional[Tensor],
                op: str, form: str, chunk: int, scale: float, normalize: bool, eps: float,
                ridge: float, qk_l2norm: bool, check_values: bool, output_final_state: bool,
                final_slots: int) -> _Out5:
    h = _host
    o, fin = _ops.forward(
        op, h(q), h(k), h(v), h(g), lam=h(lam), beta=h(beta), cu_seqlens=h(cu_seqlens),
        initial_state=_state_or_none(h(init_pos), h(init_S), h(init_P), h(init_H)),
        output_final_state=output_final_state, final_slots=final_slots, form=form, chunk=chunk,
        scale=_scale(scale), normalize=normalize, eps=eps, ridge=ridge, qk_l2norm=qk_l2norm,
        check_values=check_values, stream=_stream(q))
    return (o,) + _present(fin if fin is not None else (None,) * 4, q)


@_forward_op.register_fake
def _(q, k, v, g, lam, beta, cu_seqlens, init_pos, init_S, init_P, init_H, op, form, chunk, scale,
      normalize, eps, ridge, qk_l2norm, check_values, output_final_state, final_slots):
    o = v.new_empty(v.shape)
    if not output_final_state:
        return (o,) + _present((None,) * 4, q)
    N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    shapes = _ops.state_part_shapes(op, N, v.shape[2], q.shape[3], v.shape[3], normalize=normalize,
                                    slots=final_slots)
    dt = _state_dtype(q)
    parts = [None if s is None else q.new_empty(s, dtype=dt) for s in shapes[1:]]
    return (o, q.new_empty(shapes.pos, dtype=torch.int64)) + _present(parts, q)


def _forward_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:11])
    ctx.config = inputs[11:]


def _forward_backward(ctx, do, dpos, dS, dP, dH):
    saved = ctx.saved_tensors
    op, form, chunk, scale, normalize, eps, ridge, qk_l2norm, check_values, has_final, _ = ctx.config
    form = form if _ops.supports(op, form, True) else "chunk"
    d_final = [x if has_final and x.numel() > 0 else None for x in (dS, dP, dH)]
    grads = torch.ops.hila.backward(*saved, do, *d_final, op, form, chunk, scale, normalize, eps,
                                    ridge, qk_l2norm, check_values)
    # no gradient for absent inputs, cu_seqlens, positions and the configuration
    dq, dk, dv, dg, dlam, dbeta, dS0, dP0, dH0 = (
        None if x is None else gr for x, gr in zip(saved[:6] + saved[8:], grads))
    return (dq, dk, dv, dg, dlam, dbeta, None, None, dS0, dP0, dH0) + (None,) * 11


_forward_op.register_autograd(_forward_backward, setup_context=_forward_setup)


# ----------------------------------------------------------------------------- hila::backward

@torch.library.custom_op("hila::backward", mutates_args=())
def _backward_op(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor], lam: Optional[Tensor],
                 beta: Optional[Tensor], cu_seqlens: Optional[Tensor], init_pos: Optional[Tensor],
                 init_S: Optional[Tensor], init_P: Optional[Tensor], init_H: Optional[Tensor],
                 do: Tensor, d_final_S: Optional[Tensor], d_final_P: Optional[Tensor],
                 d_final_H: Optional[Tensor], op: str, form: str, chunk: int, scale: float,
                 normalize: bool, eps: float, ridge: float, qk_l2norm: bool,
                 check_values: bool) -> _Grads9:
    h = _host
    gr = _ops.backward(
        op, h(q), h(k), h(v), h(g), do=h(do), lam=h(lam), beta=h(beta), cu_seqlens=h(cu_seqlens),
        initial_state=_state_or_none(h(init_pos), h(init_S), h(init_P), h(init_H)),
        d_final_state=_state_or_none(None, h(d_final_S), h(d_final_P), h(d_final_H)), form=form,
        chunk=chunk, scale=_scale(scale), normalize=normalize, eps=eps, ridge=ridge,
        qk_l2norm=qk_l2norm, check_values=check_values, stream=_stream(q))
    d_init = gr.d_initial_state if gr.d_initial_state is not None else (None,) * 4
    return _present(gr[:6] + tuple(d_init[1:]), q)


@_backward_op.register_fake
def _(q, k, v, g, lam, beta, cu_seqlens, init_pos, init_S, init_P, init_H, do, d_final_S,
      d_final_P, d_final_H, op, form, chunk, scale, normalize, eps, ridge, qk_l2norm, check_values):
    like = (q, k, v, g, lam, beta, init_S, init_P, init_H)
    return _present([None if x is None else x.new_empty(x.shape) for x in like], q)


# ----------------------------------------------------------------------------- hila::step

@torch.library.custom_op("hila::step", mutates_args=())
def _step_op(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor], lam: Optional[Tensor],
             beta: Optional[Tensor], pos: Tensor, S: Optional[Tensor], P: Optional[Tensor],
             H: Tensor, op: str, scale: float, normalize: bool, eps: float, ridge: float,
             qk_l2norm: bool, check_values: bool) -> _Out5:
    h = _host
    o, st = _ops.step(
        op, h(q), h(k), h(v), h(g), state=State(h(pos), h(S), h(P), h(H)), lam=h(lam),
        beta=h(beta), out_slots=H.shape[2] if H.dim() == 5 else None, scale=_scale(scale),
        normalize=normalize, eps=eps, ridge=ridge, qk_l2norm=qk_l2norm, check_values=check_values,
        stream=_stream(q))
    return (o,) + _present(st, q)


@_step_op.register_fake
def _(q, k, v, g, lam, beta, pos, S, P, H, op, scale, normalize, eps, ridge, qk_l2norm, check_values):
    return (v.new_empty(v.shape),) + _present(
        [None if x is None else x.new_empty(x.shape) for x in (pos, S, P, H)], q)


def _step_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:10])
    ctx.config = inputs[10:]


def _step_backward(ctx, do, dpos, dS, dP, dH):
    # A step is the forward over one token with the state as initial state: its VJP is that call's.
    q, k, v, g, lam, beta, pos, S, P, H = ctx.saved_tensors
    op, scale, normalize, eps, ridge, qk_l2norm, check_values = ctx.config
    tok = lambda x: None if x is None else x.unsqueeze(1)  # noqa: E731  [N, ...] -> [N, 1, ...]
    d_final = [None if x is None else d for x, d in ((S, dS), (P, dP), (H, dH))]
    grads = torch.ops.hila.backward(
        tok(q), tok(k), tok(v), tok(g), tok(lam), tok(beta), None, pos, S, P, H, tok(do), *d_final,
        op, "chunk", 64, scale, normalize, eps, ridge, qk_l2norm, check_values)
    dq, dk, dv, dg, dlam, dbeta = (None if x is None else gr.squeeze(1)
                                   for x, gr in zip((q, k, v, g, lam, beta), grads[:6]))
    dS0, dP0, dH0 = (None if x is None else gr for x, gr in zip((S, P, H), grads[6:]))
    return (dq, dk, dv, dg, dlam, dbeta, None, dS0, dP0, dH0) + (None,) * 7


_step_op.register_autograd(_step_backward, setup_context=_step_setup)


# ----------------------------------------------------------------------------- hila::step_

@torch.library.custom_op("hila::step_", mutates_args=("pos", "S", "P", "H"))
def _step_inplace_op(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor], lam: Optional[Tensor],
                     beta: Optional[Tensor], pos: Tensor, S: Optional[Tensor], P: Optional[Tensor],
                     H: Tensor, op: str, scale: float, normalize: bool, eps: float, ridge: float,
                     qk_l2norm: bool, check_values: bool) -> Tensor:
    h = _host
    # The state is handed over as it is (detach() shares the storage): it is written in place.
    st = State(*(None if x is None else x.detach() for x in (pos, S, P, H)))
    return _ops.step_(op, h(q), h(k), h(v), h(g), state=st, lam=h(lam), beta=h(beta),
                      scale=_scale(scale), normalize=normalize, eps=eps, ridge=ridge,
                      qk_l2norm=qk_l2norm, check_values=check_values, stream=_stream(q))


@_step_inplace_op.register_fake
def _(q, k, v, g, lam, beta, pos, S, P, H, op, scale, normalize, eps, ridge, qk_l2norm, check_values):
    return v.new_empty(v.shape)


# ----------------------------------------------------------------------------- public API

def _check_call(call: str, op, extra: tuple, **tensors) -> None:
    """HilaError for an fla-style call without ``op``, extra positional arguments, or arrays that
    are not torch tensors (before torch's schema check, whose message dumps the values)."""
    _ops.check_op(op, call)
    _ops.check_no_extra_positional(call, extra)
    for name, x in tensors.items():
        if x is not None and not isinstance(x, Tensor):
            raise HilaError(f"hila: argument '{name}': expected a torch.Tensor ({call} runs the torch "
                            f"custom ops; hila.{call.rsplit('.', 1)[1]} takes numpy and other DLPack "
                            f"arrays), got {_ops._describe(x)}", name)


def _final_slots(op: str, T: int, B: int, cu_seqlens: Optional[Tensor],
                 init_pos: Optional[Tensor], max_seqlen: Optional[int] = None) -> int:
    """Slots of a log-linear final state: exact when the shapes tell (dense, no initial state);
    ``state_slots(max_seqlen)`` for packed sequences without an initial state; otherwise read from
    cu_seqlens (or its host copy) / init_pos, which torch.compile cannot trace."""
    if not _ops.op_traits(op)["loglinear"]:
        return 1
    if cu_seqlens is None and init_pos is None:
        return _ops.state_slots(T)
    if init_pos is None and max_seqlen is not None:
        return _ops.state_slots(int(max_seqlen))
    if torch.compiler.is_compiling():
        raise HilaError(
            "hila: argument 'final_slots': is required under torch.compile for a log-linear final "
            "state with cu_seqlens or an initial state (e.g. hila.state_slots(max_len)), got None",
            "final_slots")
    try:
        lens = (cu_seqlens[1:] - cu_seqlens[:-1]) if cu_seqlens is not None else torch.full((B,), T)
        n0 = init_pos.to(lens.device) if init_pos is not None else torch.zeros_like(lens)
        return _ops.state_slots(int((lens + n0).max()) if lens.numel() else 0)
    except (RuntimeError, IndexError, TypeError):
        return 1  # malformed inputs: the op reports them by name


def forward(op: str, q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor] = None, *extra,
            lam: Optional[Tensor] = None, beta: Optional[Tensor] = None,
            cu_seqlens: Optional[Tensor] = None, initial_state: Optional[State] = None,
            output_final_state: bool = False, final_slots: Optional[int] = None,
            form: str = "chunk", chunk: int = 64, scale: Optional[float] = None,
            normalize: bool = False, eps: float = 1e-6, ridge: float = 0.0,
            qk_l2norm: bool = False, check_values: bool = True,
            state_indices: Optional[Tensor] = None, cu_seqlens_cpu: Optional[Tensor] = None,
            max_seqlen: Optional[int] = None, **unknown) -> Tuple[Tensor, Optional[State]]:
    """Differentiable ``hila.forward`` on torch tensors (``torch.ops.hila.forward``).

    Shapes as in :func:`hila.forward`: q, k [B, T, G, dk]; v [B, T, H, dv]; g [B, T, H] or
    [B, T, H, P]; lam [B, T, H, L]; beta [B, T, H]; cu_seqlens [N + 1] (B == 1). Returns
    ``(o [B, T, H, dv], final_state or None)``.

    ``final_slots``: Fenwick slots of a log-linear final H. None: ``state_slots(T)`` for dense
    input without initial state, ``state_slots(max_seqlen)`` for packed input without initial
    state, else read from the data (pass it explicitly under torch.compile).

    ``initial_state`` may be a bare tensor ``[N, H, dk, dv]`` for ``gla`` and ``gdn`` (fla's
    convention; positions 0). Serving hooks (docs/SERVING.md): ``state_indices`` (int32/int64 [N])
    makes ``initial_state`` a state pool read at rows ``state_indices`` and written back there
    (row -1: a padding sequence, neither read nor written); ``cu_seqlens_cpu`` (a host copy of
    cu_seqlens) and ``max_seqlen`` spare the reads of cu_seqlens.
    """
    _check_call("hila.torch.forward", op, extra, q=q, k=k, v=v, g=g, lam=lam, beta=beta,
                cu_seqlens=cu_seqlens)
    _ops.check_no_unknown_keywords("hila.torch.forward", unknown)
    if state_indices is not None:
        from .serving import pooled_forward
        return pooled_forward(op, q, k, v, g, pool=initial_state, state_indices=state_indices, lam=lam,
                              beta=beta, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                              max_seqlen=max_seqlen, form=form, chunk=chunk, scale=scale,
                              normalize=normalize, eps=eps, ridge=ridge, qk_l2norm=qk_l2norm,
                              check_values=check_values)
    init = _ops.as_state(op, initial_state) or State(None, None, None, None)
    if output_final_state and final_slots is None:
        final_slots = _final_slots(op, q.shape[1], q.shape[0],
                                   cu_seqlens if cu_seqlens_cpu is None else cu_seqlens_cpu, init[0],
                                   max_seqlen)
    o, pos, S, P, H = torch.ops.hila.forward(
        q, k, v, g, lam, beta, cu_seqlens, *init, op, form, chunk, float(scale or 0.0), normalize,
        float(eps), float(ridge), qk_l2norm, check_values, output_final_state, int(final_slots or 1))
    if not output_final_state:
        return o, None
    t = _ops.op_traits(op)
    return o, State(pos, S if t["has_S"] else None, P if t["has_P"] else None, H)


def step(op: str, q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor] = None, *extra, state: State = None,
         lam: Optional[Tensor] = None, beta: Optional[Tensor] = None, scale: Optional[float] = None,
         normalize: bool = False, eps: float = 1e-6, ridge: float = 0.0, qk_l2norm: bool = False,
         check_values: bool = True, **unknown) -> Tuple[Tensor, State]:
    """One decode token for N sequences (``torch.ops.hila.step``), differentiable.

    q, k [N, G, dk]; v [N, H, dv]; g [N, H] or [N, H, P]; lam [N, H, L]; beta [N, H]; ``state`` the
    :class:`hila.State` before the token. Returns ``(o [N, H, dv], new_state)``; the new state has
    the shapes of ``state`` (a log-linear H keeps its slot capacity: allocate it for the longest
    sequence to come, see :func:`zero_state`).
    """
    _check_call("hila.torch.step", op, extra, q=q, k=k, v=v, g=g, lam=lam, beta=beta)
    _ops.check_no_unknown_keywords("hila.torch.step", unknown)
    state = _ops.as_state(op, state, "state")
    if state is None or state[0] is None or state[3] is None:
        raise HilaError("hila: argument 'state': expected a State with pos and H, got "
                        f"{type(state).__name__}", "state")
    o, pos, S, P, H = torch.ops.hila.step(
        q, k, v, g, lam, beta, *state, op, float(scale or 0.0), normalize, float(eps), float(ridge),
        qk_l2norm, check_values)
    return o, State(pos, S if state.S is not None else None, P if state.P is not None else None, H)


def step_(op: str, q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor] = None, *extra, state: State = None,
          lam: Optional[Tensor] = None, beta: Optional[Tensor] = None, scale: Optional[float] = None,
          normalize: bool = False, eps: float = 1e-6, ridge: float = 0.0, qk_l2norm: bool = False,
          check_values: bool = True, state_indices: Optional[Tensor] = None, **unknown) -> Tensor:
    """One fused decode token for N sequences, advancing ``state`` IN PLACE (``torch.ops.hila.step_``).

    Shapes as in :func:`step`; ``state`` is a :class:`hila.State` of tensors on q's device (a
    log-linear H with ``bitlen(pos + 1) + 1`` slots or more for every sequence: see
    :func:`zero_state`), whose pos, S, P and H are overwritten with the state after the token.
    Runs the library's decode kernel on the caller's current CUDA stream. Not differentiable (a
    backward through it raises: no autograd formula is registered): use :func:`step` for training.
    Returns o [N, H, dv].

    ``state_indices`` (int32/int64 [N], serving: docs/SERVING.md): ``state`` is a pool whose row
    ``state_indices[i]`` sequence i reads and advances; rows with index -1 are padding (output 0,
    no state touched).
    """
    _check_call("hila.torch.step_", op, extra, q=q, k=k, v=v, g=g, lam=lam, beta=beta)
    _ops.check_no_unknown_keywords("hila.torch.step_", unknown)
    if state_indices is not None:
        from .serving import pooled_step_
        return pooled_step_(op, q, k, v, g, pool=state, state_indices=state_indices, lam=lam,
                            beta=beta, scale=scale, normalize=normalize, eps=eps, ridge=ridge,
                            qk_l2norm=qk_l2norm, check_values=check_values)
    state = _ops.as_state(op, state, "state")
    if state is None or state[0] is None or state[3] is None:
        raise HilaError("hila: argument 'state': expected a State with pos and H, got "
                        f"{type(state).__name__}", "state")
    return torch.ops.hila.step_(q, k, v, g, lam, beta, *state, op, float(scale or 0.0), normalize,
                                float(eps), float(ridge), qk_l2norm, check_values)


def zero_state(op: str, batch: int, heads: int, dk: int, dv: int, *, max_len: int = 1,
               normalize: bool = False, dtype: torch.dtype = torch.float32,
               device: Optional[torch.device] = None) -> State:
    """A zero state at position 0 for ``batch`` sequences, with the Fenwick capacity of sequences
    up to ``max_len`` tokens (log-linear operators). ``dtype``: float32, or float64 for float64 inputs."""
    shapes = _ops.state_part_shapes(op, batch, heads, dk, dv, normalize=normalize,
                                    slots=_ops.state_slots(max_len))
    z = lambda s, dt=dtype: None if s is None else torch.zeros(s, dtype=dt, device=device)  # noqa: E731
    return State(z(shapes.pos, torch.int64), z(shapes.S), z(shapes.P), z(shapes.H))
