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

Two roads reach the same C++ calls:

* **eager** (the default outside torch.compile): :func:`forward` and :func:`step` run a
  ``torch.autograd.Function`` that calls the extension directly, and :func:`step_` calls it
  directly. Per call this is one configuration lookup (cached per operator and options), one
  ``torch.empty`` per output and gradient (every one of them is fully written by the library: no
  fills), DLPack capsules of the tensors (``torch.utils.dlpack.to_dlpack``: no Python-level
  ``__dlpack__`` and no stream handshake, since the call's stream is passed explicitly), and no
  reads of device tensors. Gradients are computed only for inputs that need them, and an unused
  output costs nothing in backward (no zero cotangents are materialised).
  The plain training call (no ``cu_seqlens``, initial or final state, or host copies) goes one step
  further where the extension hila._torch_ops was built (with torch at build time): it is one call
  of the libtorch op ``torch.ops.hila_cpp.forward_plan``, whose autograd function is C++ (no
  Python autograd.Function, no DLPack capsules); see :func:`cpp_road`. There, too, the decode
  loop's :func:`step_` is one call of ``hila._torch_ops.step_``, which takes the tensors
  themselves.
* **the custom ops**: under torch.compile / torch.export, fake or meta tensors, an active
  ``TorchDispatchMode``, torch.func transforms, or when turned off with :func:`eager_fast_path`.
  They run the same calls with the same arguments, so both roads give bitwise identical results.

Tensors on CUDA run on the caller's current stream (handed to the C++ library); what the library
cannot run on a device (docs/API.md) raises :class:`hila.HilaError`.
"""
from __future__ import annotations

import atexit
import functools
import numbers
import os
from typing import Optional, Tuple

import torch
from torch import Tensor
from torch.utils.dlpack import to_dlpack as _capsule

from .. import _C
from .. import ops as _ops
from .._errors import HilaError
from ..ops import State

__all__ = ["cpp_road", "eager_fast_path", "forward", "step", "step_", "zero_state"]

_Out5 = Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]
_Grads9 = Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]
_NO_STATE = State(None, None, None, None)
_NO_PARTS = (None, None, None)  # S, P, H of no state

# ----------------------------------------------------------------------------- which road

_FAST = [True]
_PLAIN = (Tensor, torch.nn.Parameter)  # exact types: subclasses (fake tensors, ...) take the ops
_is_compiling = torch.compiler.is_compiling
# Private torch functions read once; when one is missing its check is skipped (it then answers
# "no mode, no transform").
_dispatch_depth = getattr(torch._C, "_len_torch_dispatch_stack", lambda: 0)
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def eager_fast_path(enabled: bool = True) -> bool:
    """Whether eager calls of :func:`forward`, :func:`step` and :func:`step_` take the direct road
    to the extension (on, the default) or the registered custom ops (off). Both give identical
    results; the custom ops cost more host time per call. Returns the previous setting."""
    prev = _FAST[0]
    _FAST[0] = bool(enabled)
    return prev


# The C++ road of the plain call (hila._torch_ops, python/src/torch_ops.cpp): the raw callable
# of torch.ops.hila_cpp.forward_plan.default (the plain call on a configuration numbered once per
# distinct options by torch.ops.hila_cpp.plan, see _cpp_plan), or None where the module was not
# built or does not import (e.g. under another torch than the build's); HILA_TORCH_CPP=0 in the
# environment at import leaves it off. _CPP_WHY: why it is not available ("" when it is).
# _CPP_STEP: hila._torch_ops.step_, the C++ road of the decode loop's step_ (see _fast_step_).
def _load_cpp():
    if os.environ.get("HILA_TORCH_CPP", "1") == "0":
        return None, None, "turned off by HILA_TORCH_CPP=0"
    try:
        from .. import _torch_ops  # registers torch.ops.hila_cpp.*
        return torch.ops.hila_cpp.forward_plan.default._op, _torch_ops.step_, ""
    except ImportError as e:  # not built (no torch at build time), or built for another torch
        return None, None, f"hila._torch_ops does not import: {e}"
    except (AttributeError, OSError, RuntimeError) as e:
        return None, None, f"hila._torch_ops does not load: {e}"


_CPP_OP, _CPP_STEP, _CPP_WHY = _load_cpp()
_CPP = [_CPP_OP]


def cpp_road(enabled: bool = True) -> bool:
    """Whether the plain training call on the direct road (see :func:`eager_fast_path`) runs the
    libtorch op ``torch.ops.hila_cpp.forward_plan`` with its C++ autograd function, and the decode
    loop's :func:`step_` the C++ function ``hila._torch_ops.step_`` (on, the default where
    hila._torch_ops was built), or the Python ``torch.autograd.Function`` and the DLPack calls of
    hila._C (off). Both give bitwise identical results; the C++ road costs less host time per
    call. Returns the previous
    setting; turning it on where the module is not available raises RuntimeError with the reason
    (``HILA_TORCH_CPP=0`` in the environment turns it off at import)."""
    prev = _CPP[0] is not None
    if enabled and _CPP_OP is None:
        raise RuntimeError(f"hila.torch.cpp_road: the C++ road is not available ({_CPP_WHY})")
    _CPP[0] = _CPP_OP if enabled else None
    return prev


def _direct(q) -> bool:
    """Whether a call on q runs through the direct eager road (see the module docstring)."""
    return (_FAST[0] and not _is_compiling() and type(q) in _PLAIN and not q.is_meta
            and _dispatch_depth() == 0 and not _functorch_active())


# ----------------------------------------------------------------------------- the calls

class _Spec:
    """What a call's options decide, built once per distinct options: the C++ configuration, the
    operator's traits and the form its backward runs (chunk where the form has none)."""

    __slots__ = ("op", "form", "bwd_form", "chunk", "cfg", "has_S", "has_P", "normalize", "bounds_steps")

    def __init__(self, op, form, chunk, scale, normalize, eps, ridge, qk_l2norm, check_values):
        normalize, qk_l2norm, check_values = map(_flag, (normalize, qk_l2norm, check_values))
        self.cfg = _ops.config(op, scale=None if scale == 0.0 else scale, normalize=normalize,
                               eps=eps, ridge=ridge, qk_l2norm=qk_l2norm,
                               check_values=check_values)  # HilaError('op', 'scale', ...)
        t = _ops._traits(op)
        _check_chunk(chunk)
        self.op, self.form, self.chunk = op, form, int(chunk)
        self.bwd_form = form if _ops.supports(op, form, True) else "chunk"  # HilaError('form')
        self.has_S, self.has_P, self.normalize = t["has_S"], t["has_P"], bool(normalize)
        # a step_ of these options without max_position passes the bound of the state's capacity
        # where the State's positions are known on the host (see _position_bound)
        self.bounds_steps = bool(t["loglinear"]) and check_values is False


def _check_chunk(chunk) -> None:
    """HilaError('chunk') unless chunk is an int of int64 (the library checks its value)."""
    if isinstance(chunk, bool) or not isinstance(chunk, numbers.Integral) or not -2**63 <= chunk < 2**63:
        raise HilaError(f"hila: argument 'chunk': expected an int in [-2^63, 2^63), got {_ops._describe(chunk)}",
                        "chunk")


def _check_custom_op_call(form, chunk, normalize, eps, ridge, qk_l2norm, check_values) -> None:
    """The types of a call's options, for the custom-op road (meta tensors, torch.compile, dispatch
    modes), before torch's schema check (whose error names no argument): HilaError naming the option.
    Pure Python (Dynamo traces it); the op itself checks the values, as :class:`_Spec` does."""
    if not isinstance(form, str):
        raise HilaError(f"hila: argument 'form': expected a string ({', '.join(_ops.FORMS)}), got "
                        f"{_ops._describe(form)}", "form")
    _check_chunk(chunk)
    for name, x in (("eps", eps), ("ridge", ridge)):
        _ops._number(name, x)
    for name, x in (("normalize", normalize), ("qk_l2norm", qk_l2norm), ("check_values", check_values)):
        if not isinstance(_flag(x), bool):
            raise HilaError(f"hila: argument '{name}': expected a bool, got {_ops._describe(x)}", name)


def _flag(x):
    """A flag option: 0 and 1 (the numbers the cache of :func:`_spec` cannot tell from False and
    True, and which the custom ops' bool arguments take) as bools; anything else as it is (a
    non-bool is then a HilaError naming the option)."""
    return bool(x) if isinstance(x, numbers.Number) and (x == 0 or x == 1) else x


@functools.lru_cache(maxsize=256)
def _spec(op: str, form: str, chunk: int, scale: float, normalize: bool, eps: float, ridge: float,
          qk_l2norm: bool, check_values: bool) -> _Spec:
    return _Spec(op, form, chunk, scale, normalize, eps, ridge, qk_l2norm, check_values)


atexit.register(_spec.cache_clear)  # no extension objects left for nanobind's exit-time leak check


def _stream(t: Tensor) -> int:
    if not t.is_cuda:
        return 0
    if _raw_stream is not None:
        return _raw_stream(t.get_device())
    return torch.cuda.current_stream(t.device).cuda_stream


def _needs_copy(x: Tensor) -> bool:
    """Whether the library cannot read x in place: its innermost stride is not 1 (the test of
    :func:`_in`, written out there to spare a call per tensor)."""
    return not x.is_contiguous() and x.dim() and x.stride(-1) != 1 and x.size(-1) > 1


def _in(x: Optional[Tensor]):
    """A DLPack capsule of input x (None stays None), as the library reads it in place: resolved
    (see :func:`_resolved`), innermost stride 1, else a contiguous copy
    (incoming gradients are often expanded scalars, stride 0)."""
    if x is None:
        return None
    x = _resolved(x)
    if not x.is_contiguous() and x.dim() and x.stride(-1) != 1 and x.size(-1) > 1:
        x = x.contiguous()
    return _capsule(x)


def _resolved(x: Tensor) -> Tensor:
    """x with a lazy negation or conjugation applied (a copy): torch's DLPack export passes the raw
    memory without those bits."""
    return x.resolve_neg().resolve_conj() if x.is_neg() or x.is_conj() else x


def _lent(x: Tensor):
    """A DLPack capsule of input x as it is, but resolved (see :func:`_resolved`)."""
    return _capsule(_resolved(x))


def _cap(x: Optional[Tensor]):
    """A DLPack capsule of x (None stays None): what the extension reads without a copy."""
    return None if x is None else _capsule(x)


def _caps(parts) -> Optional[tuple]:
    """A state's parts as capsules of inputs, or None when there are none."""
    if parts is None or all(x is None for x in parts):
        return None
    return tuple(_in(x) for x in parts)


_POISON = _ops._POISON_OUTPUTS  # test hook: new outputs filled with NaN (see hila.ops)


_CONTIGUOUS = torch.contiguous_format


def _empty_like(x: Tensor) -> Tensor:
    """An output or gradient shaped like x: uninitialised, the library writes every element."""
    y = torch.empty_like(x, memory_format=_CONTIGUOUS)
    return _ops._poison(y) if _POISON[0] else y


def _workspace(q: Tensor):
    """torch's caching allocator for the call's device temporaries when asked for
    (hila.use_framework_workspace); None: the device's stream-ordered pool."""
    if not _ops._FRAMEWORK_WORKSPACE[0] or not q.is_cuda:
        return None
    dev = q.device
    return lambda n: torch.empty(n, dtype=torch.uint8, device=dev)


def _state_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _new_state(spec: _Spec, q: Tensor, v: Tensor, N: int, slots: int) -> State:
    """An uninitialised final state for N sequences (the library writes every element)."""
    shapes = _ops.state_part_shapes(spec.op, N, v.shape[2], q.shape[3], v.shape[3],
                                    normalize=spec.normalize, slots=slots)
    dt, dev = _state_dtype(q), q.device
    checked = dev.type == "cpu" and not _is_compiling()  # (symbolic sizes under torch.compile)
    if checked:  # the parts together
        _ops.check_host_bytes("final_state", (shapes.pos, 8), *((x, dt.itemsize) for x in shapes[1:]))

    def e(name, s, dtype=dt):
        if s is not None and checked:
            _ops.check_host_bytes(f"final_state.{name}", (s, dtype.itemsize))
        x = None if s is None else torch.empty(s, dtype=dtype, device=dev)
        return _ops._poison(x) if x is not None and _POISON[0] else x

    return State(e("pos", shapes.pos, torch.int64), e("S", shapes.S), e("P", shapes.P), e("H", shapes.H))


def _forward_call(spec: _Spec, q, k, v, g, lam, beta, cu, init, want_final: bool,
                  final_slots: int, cu_host=None, pos_host=None) -> Tuple[Tensor, Optional[State]]:
    """hila::forward: o [B, T, H, dv] and the final state (None unless asked for). cu_host /
    pos_host: host copies of cu_seqlens and of the initial positions (no device read)."""
    o = _empty_like(v)
    fin = None
    if want_final and q.dim() == 4 and v.dim() == 4:  # else the library names the bad shape
        N = q.shape[0] if cu is None or cu.dim() != 1 else max(cu.shape[0] - 1, 0)  # (the library names a
        fin = _new_state(spec, q, v, N, final_slots)                                # bad cu_seqlens)
    try:
        _C.forward(spec.cfg, spec.form, spec.chunk, _in(q), _in(k), _in(v), _in(g),
                   None if lam is None else _in(lam), None if beta is None else _in(beta),
                   None if cu is None else _in(cu), None if init is None else _caps(init),
                   o=_capsule(o), final_state=None if fin is None else tuple(_cap(x) for x in fin),
                   stream=_stream(q), workspace=_workspace(q),
                   cu_seqlens_host=None if cu_host is None else _capsule(cu_host),
                   init_pos_host=None if pos_host is None else _capsule(pos_host))
    except HilaError as e:
        _host_names(e)
    return o, fin


_HOST_NAMES = {"cu_seqlens_host": "cu_seqlens_cpu", "init_pos_host": "init_pos_cpu"}


def _host_names(e: HilaError):
    """Re-raises e with the library's names of the host copies as hila.torch names them."""
    new = _HOST_NAMES.get(e.argument)
    if new is None:
        raise e
    raise HilaError(str(e).replace(f"'{e.argument}'", f"'{new}'", 1), new) from None


def _pooled_forward_call(spec: _Spec, q, k, v, g, lam, beta, cu, idx, pool: State, cu_host=None,
                         pos_host=None) -> Tensor:
    """hila::forward on a state pool (state_indices): sequence i from row idx[i] of ``pool``, its
    final state written back there in place; returns o (0 at the tokens of padding sequences)."""
    o = _empty_like(v)
    try:
        _C.forward(spec.cfg, spec.form, spec.chunk, _in(q), _in(k), _in(v), _in(g), _in(lam), _in(beta),
                   _in(cu), tuple(_cap(x) for x in pool), o=_capsule(o),
                   final_state=tuple(_cap(x) for x in pool), stream=_stream(q), workspace=_workspace(q),
                   cu_seqlens_host=_cap(cu_host), init_pos_host=_cap(pos_host), state_indices=_cap(idx))
    except HilaError as e:
        _host_names(e)
    torch.autograd.graph.increment_version([x for x in pool if x is not None])
    return o


def _backward_call(spec: _Spec, q, k, v, g, lam, beta, cu, init, do, d_final, final_shapes,
                   needs, cu_host=None, pos_host=None) -> tuple:
    """hila::backward: the gradients (dq, dk, dv, dg, dlam, dbeta, dS0, dP0, dH0), each None
    where its input is absent or ``needs`` (9 flags) says it is not wanted. ``do`` and the parts
    of ``d_final`` may be None (unused outputs): zeros then stand for them (only when another
    cotangent is present; final_shapes are the shapes of the final state's parts)."""
    dfin = None
    if d_final is not None and any(x is not None for x in d_final):
        dt = _state_dtype(q)
        dfin = (None,) + tuple(None if s is None else _in(d) if d is not None else
                               _capsule(torch.zeros(s, dtype=dt, device=q.device))
                               for d, s in zip(d_final, final_shapes))
    if do is None:
        do = torch.zeros_like(v)  # only the final state was used
    inputs = (q, k, v, g, lam, beta) + (tuple(init[1:]) if init is not None else _NO_PARTS)
    grads = tuple(_empty_like(x) if x is not None and need else None for x, need in zip(inputs, needs))
    dq, dk, dv, dg, dlam, dbeta, dS0, dP0, dH0 = grads
    d_init = None
    if init is not None and (dS0 is not None or dP0 is not None or dH0 is not None):
        d_init = (None, _cap(dS0), _cap(dP0), _cap(dH0))
    # (absent arguments are passed as None without a call: a tiny call's host time counts)
    try:
        _C.backward(spec.cfg, spec.bwd_form, spec.chunk, _in(q), _in(k), _in(v), _in(g),
                    None if lam is None else _in(lam), None if beta is None else _in(beta),
                    None if cu is None else _in(cu), None if init is None else _caps(init), _in(do),
                    dfin, dq=None if dq is None else _capsule(dq),
                    dk=None if dk is None else _capsule(dk), dv=None if dv is None else _capsule(dv),
                    dg=None if dg is None else _capsule(dg), dlam=None if dlam is None else _capsule(dlam),
                    dbeta=None if dbeta is None else _capsule(dbeta), d_init=d_init,
                    stream=_stream(q), workspace=_workspace(q),
                    cu_seqlens_host=None if cu_host is None else _capsule(cu_host),
                    init_pos_host=None if pos_host is None else _capsule(pos_host))
    except HilaError as e:
        _host_names(e)
    return grads


def _step_call(spec: _Spec, q, k, v, g, lam, beta, state) -> Tuple[Tensor, State]:
    """The functional decode step (a one-token forward from `state`): o and a new state shaped
    like `state` (a log-linear H keeps its slot capacity)."""
    o = _empty_like(v)
    out = State(*(None if x is None else _empty_like(x) for x in state))
    _C.step(spec.cfg, _in(q), _in(k), _in(v), _in(g), _in(lam), _in(beta),
            tuple(_in(x) for x in state), o=_capsule(o), state_out=tuple(_cap(x) for x in out),
            stream=_stream(q))
    return o, out


def _step_inplace_call(spec: _Spec, q, k, v, g, lam, beta, pos, S, P, H, state_indices=None,
                       max_position: int = -1, counters: Optional[Tensor] = None,
                       out: Optional[Tensor] = None) -> Tensor:
    """The fused decode step advancing (pos, S, P, H) in place (a pool's rows state_indices);
    returns o [N, H, dv]: ``out`` where given (checked by :func:`_check_out`), else a new tensor.
    counters: the State's step counters (see _counters), or None."""
    o = _empty_like(v) if out is None else out
    try:
        _C.step_inplace(spec.cfg, _in(q), _in(k), _in(v), _in(g), _in(lam), _in(beta),
                        (_cap(pos), _cap(S), _cap(P), _cap(H)), o=_capsule(o), stream=_stream(q),
                        state_indices=_cap(state_indices), max_position=int(max_position),
                        counters=_cap(counters))
    except HilaError as e:
        raise _as_out(e, out) from None
    # what the kernel wrote behind autograd's back: saved copies of these tensors are now stale
    torch.autograd.graph.increment_version([x for x in (pos, S, P, H, out) if x is not None])
    return o


def _check_out(out, v) -> None:
    """step_'s ``out``: a tensor like v's ([N, H, dv], v's dtype and device) that autograd does not
    track (step_ writes it in place); HilaError naming 'out' otherwise. The library checks the
    rest where it writes out itself (strides, overlap with the inputs and the state)."""
    if not isinstance(out, Tensor):
        raise HilaError(f"hila: argument 'out': expected a tensor or None, got {type(out).__name__}", "out")
    if out.requires_grad:
        raise HilaError("hila: argument 'out': expected a tensor that does not require grad (step_ writes it in "
                        "place and is not differentiable), got one that does", "out")
    if isinstance(v, Tensor) and (out.shape != v.shape or out.dtype != v.dtype or out.device != v.device):
        raise HilaError(f"hila: argument 'out': expected a tensor like v ({list(v.shape)}, {v.dtype}, on "
                        f"{v.device}), got {list(out.shape)}, {out.dtype}, on {out.device}", "out")
    if _needs_copy(out):
        raise HilaError(f"hila: argument 'out': expected innermost stride 1, got strides {list(out.stride())}", "out")


def _as_out(e: HilaError, out) -> HilaError:
    """The library's error ``e``, naming 'out' where it is about o and the caller gave ``out``."""
    if out is None or e.argument != "o":
        return e
    return HilaError(str(e).replace("argument 'o'", "argument 'out'", 1), "out")


def _no_double_backward() -> None:
    if torch.is_grad_enabled():
        raise RuntimeError("hila: the backward of hila's operators is not differentiable "
                           "(create_graph=True / double backward is not supported)")


# ----------------------------------------------------------------------------- eager road

class _Forward(torch.autograd.Function):
    """hila::forward for eager calls; backward hila::backward (see the module docstring)."""

    @staticmethod
    def forward(ctx, spec, want_final, final_slots, hosts, q, k, v, g, lam, beta, cu, pos, S, P, H):
        init = None if pos is None and S is None and P is None and H is None else (pos, S, P, H)
        o, fin = _forward_call(spec, q, k, v, g, lam, beta, cu, init, want_final, final_slots, *hosts)
        ctx.spec, ctx.hosts = spec, hosts
        ctx.final_shapes = None if fin is None else tuple(None if x is None else x.shape for x in fin[1:])
        ctx.save_for_backward(q, k, v, g, lam, beta, cu, pos, S, P, H)
        ctx.set_materialize_grads(False)
        return (o,) + (tuple(fin) if fin is not None else _NO_STATE)

    @staticmethod
    def backward(ctx, do, _dpos, dS, dP, dH):
        _no_double_backward()
        q, k, v, g, lam, beta, cu, pos, S, P, H = ctx.saved_tensors
        n = ctx.needs_input_grad
        init = None if pos is None and S is None and P is None and H is None else (pos, S, P, H)
        if do is None and dS is None and dP is None and dH is None:
            return (None,) * 15
        d = _backward_call(ctx.spec, q, k, v, g, lam, beta, cu, init, do, (dS, dP, dH),
                           ctx.final_shapes, n[4:10] + n[12:15], *ctx.hosts)
        return (None, None, None, None) + d[:6] + (None, None) + d[6:]


class _Plain(torch.autograd.Function):
    """:class:`_Forward` for the plain call (no cu_seqlens, initial or final state, or host
    copies): o alone, from q, k, v, g, lam, beta, so autograd handles 7 arguments and one output
    instead of 15 and five."""

    @staticmethod
    def forward(ctx, spec, q, k, v, g, lam, beta):
        o, _ = _forward_call(spec, q, k, v, g, lam, beta, None, None, False, 1)
        ctx.spec = spec
        ctx.save_for_backward(q, k, v, g, lam, beta)
        ctx.set_materialize_grads(False)
        return o

    @staticmethod
    def backward(ctx, do):
        _no_double_backward()
        if do is None:
            return (None,) * 7
        q, k, v, g, lam, beta = ctx.saved_tensors
        d = _backward_call(ctx.spec, q, k, v, g, lam, beta, None, None, do, None, None,
                           ctx.needs_input_grad[1:7] + _NO_STATE_GRADS)
        return (None,) + d[:6]


_NO_STATE_GRADS = (False,) * 3


class _Step(torch.autograd.Function):
    """The functional decode step for eager calls: one-token forward; backward hila::backward."""

    @staticmethod
    def forward(ctx, spec, q, k, v, g, lam, beta, pos, S, P, H):
        o, out = _step_call(spec, q, k, v, g, lam, beta, (pos, S, P, H))
        ctx.spec = spec
        ctx.save_for_backward(q, k, v, g, lam, beta, pos, S, P, H)
        ctx.set_materialize_grads(False)
        return (o,) + tuple(out)

    @staticmethod
    def backward(ctx, do, _dpos, dS, dP, dH):
        # A step is the forward over one token with the state as initial state: its VJP is that call's.
        _no_double_backward()
        q, k, v, g, lam, beta, pos, S, P, H = ctx.saved_tensors
        n = ctx.needs_input_grad
        if do is None and dS is None and dP is None and dH is None:
            return (None,) * 11
        tok = lambda x: None if x is None else x.unsqueeze(1)  # noqa: E731  [N, ...] -> [N, 1, ...]
        shapes = tuple(None if x is None else x.shape for x in (S, P, H))
        d = _backward_call(ctx.spec, tok(q), tok(k), tok(v), tok(g), tok(lam), tok(beta), None,
                           (pos, S, P, H), tok(do), (dS, dP, dH), shapes, n[1:7] + n[8:11])
        squeeze = lambda x: None if x is None else x.squeeze(1)  # noqa: E731
        return (None,) + tuple(squeeze(x) for x in d[:6]) + (None,) + d[6:]


# ----------------------------------------------------------------------------- hila::forward

def _scale(scale: float) -> Optional[float]:
    return None if scale == 0.0 else scale  # 0.0 in a schema: the default dk^-1/2


def _present(xs, like: Tensor) -> tuple:
    """Optional results as tensors (a custom op returns no None): absent is an empty tensor."""
    return tuple(like.new_empty(0) if x is None else x for x in xs)


def _init_or_none(pos, S, P, H) -> Optional[tuple]:
    return None if pos is None and S is None and P is None and H is None else (pos, S, P, H)


@torch.library.custom_op("hila::forward", mutates_args=())
def _forward_op(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor], lam: Optional[Tensor],
                beta: Optional[Tensor], cu_seqlens: Optional[Tensor], init_pos: Optional[Tensor],
                init_S: Optional[Tensor], init_P: Optional[Tensor], init_H: Optional[Tensor],
                op: str, form: str, chunk: int, scale: float, normalize: bool, eps: float,
                ridge: float, qk_l2norm: bool, check_values: bool, output_final_state: bool,
                final_slots: int, cu_seqlens_cpu: Optional[Tensor] = None,
                init_pos_cpu: Optional[Tensor] = None) -> _Out5:
    spec = _spec(op, form, chunk, scale, normalize, eps, ridge, qk_l2norm, check_values)
    o, fin = _forward_call(spec, q, k, v, g, lam, beta, cu_seqlens,
                           _init_or_none(init_pos, init_S, init_P, init_H), output_final_state,
                           final_slots, cu_seqlens_cpu, init_pos_cpu)
    return (o,) + _present(fin if fin is not None else _NO_STATE, q)


@_forward_op.register_fake
def _(q, k, v, g, lam, beta, cu_seqlens, init_pos, init_S, init_P, init_H, op, form, chunk, scale,
      normalize, eps, ridge, qk_l2norm, check_values, output_final_state, final_slots,
      cu_seqlens_cpu=None, init_pos_cpu=None):
    o = v.new_empty(v.shape)
    if not output_final_state:
        return (o,) + _present(_NO_STATE, q)
    N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    shapes = _ops.state_part_shapes(op, N, v.shape[2], q.shape[3], v.shape[3], normalize=normalize,
                                    slots=final_slots)
    dt = _state_dtype(q)
    parts = [None if s is None else q.new_empty(s, dtype=dt) for s in shapes[1:]]
    return (o, q.new_empty(shapes.pos, dtype=torch.int64)) + _present(parts, q)


def _forward_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:11])
    ctx.config = inputs[11:22]
    ctx.hosts = inputs[22:24]  # host copies of cu_seqlens and the initial positions
    ctx.final_shapes = tuple(x.shape for x in output[2:])
    ctx.set_materialize_grads(False)


def _forward_backward(ctx, do, dpos, dS, dP, dH):
    saved = ctx.saved_tensors
    op, form, chunk, scale, normalize, eps, ridge, qk_l2norm, check_values, has_final, _ = ctx.config
    form = form if _ops.supports(op, form, True) else "chunk"
    if do is None:  # only the final state was used
        do = torch.zeros_like(saved[2])
    d_final = [None] * 3
    if has_final and any(d is not None for d in (dS, dP, dH)):  # zeros for the unused parts
        t, dt = _ops._traits(op), _state_dtype(saved[0])
        d_final = [None if not has else d if d is not None else
                   torch.zeros(s, dtype=dt, device=saved[0].device)
                   for has, d, s in zip((t["has_S"], t["has_P"], True), (dS, dP, dH), ctx.final_shapes)]
    grads = torch.ops.hila.backward(*saved, do, *d_final, op, form, chunk, scale, normalize, eps,
                                    ridge, qk_l2norm, check_values, *ctx.hosts)
    # no gradient for absent inputs, cu_seqlens, positions, the configuration and the host copies
    dq, dk, dv, dg, dlam, dbeta, dS0, dP0, dH0 = (
        None if x is None else gr for x, gr in zip(saved[:6] + saved[8:], grads))
    return (dq, dk, dv, dg, dlam, dbeta, None, None, dS0, dP0, dH0) + (None,) * 13


_forward_op.register_autograd(_forward_backward, setup_context=_forward_setup)


# ----------------------------------------------------------------------------- hila::backward

@torch.library.custom_op("hila::backward", mutates_args=())
def _backward_op(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor], lam: Optional[Tensor],
                 beta: Optional[Tensor], cu_seqlens: Optional[Tensor], init_pos: Optional[Tensor],
                 init_S: Optional[Tensor], init_P: Optional[Tensor], init_H: Optional[Tensor],
                 do: Tensor, d_final_S: Optional[Tensor], d_final_P: Optional[Tensor],
                 d_final_H: Optional[Tensor], op: str, form: str, chunk: int, scale: float,
                 normalize: bool, eps: float, ridge: float, qk_l2norm: bool,
                 check_values: bool, cu_seqlens_cpu: Optional[Tensor] = None,
                 init_pos_cpu: Optional[Tensor] = None) -> _Grads9:
    spec = _spec(op, form, chunk, scale, normalize, eps, ridge, qk_l2norm, check_values)
    d_final = (d_final_S, d_final_P, d_final_H)
    grads = _backward_call(spec, q, k, v, g, lam, beta, cu_seqlens,
                           _init_or_none(init_pos, init_S, init_P, init_H), do, d_final,
                           tuple(None if x is None else x.shape for x in d_final), (True,) * 9,
                           cu_seqlens_cpu, init_pos_cpu)
    return _present(grads, q)


@_backward_op.register_fake
def _(q, k, v, g, lam, beta, cu_seqlens, init_pos, init_S, init_P, init_H, do, d_final_S,
      d_final_P, d_final_H, op, form, chunk, scale, normalize, eps, ridge, qk_l2norm, check_values,
      cu_seqlens_cpu=None, init_pos_cpu=None):
    like = (q, k, v, g, lam, beta, init_S, init_P, init_H)
    return _present([None if x is None else x.new_empty(x.shape) for x in like], q)


# ----------------------------------------------------------------------------- hila::step

@torch.library.custom_op("hila::step", mutates_args=())
def _step_op(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor], lam: Optional[Tensor],
             beta: Optional[Tensor], pos: Tensor, S: Optional[Tensor], P: Optional[Tensor],
             H: Tensor, op: str, scale: float, normalize: bool, eps: float, ridge: float,
             qk_l2norm: bool, check_values: bool) -> _Out5:
    spec = _spec(op, "chunk", 64, scale, normalize, eps, ridge, qk_l2norm, check_values)
    o, st = _step_call(spec, q, k, v, g, lam, beta, (pos, S, P, H))
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
        op, "chunk", 64, scale, normalize, eps, ridge, qk_l2norm, check_values, None, None)
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
                     qk_l2norm: bool, check_values: bool, state_indices: Optional[Tensor] = None,
                     max_position: int = -1) -> Tensor:
    spec = _spec(op, "chunk", 64, scale, normalize, eps, ridge, qk_l2norm, check_values)
    return _step_inplace_call(spec, q, k, v, g, lam, beta, pos, S, P, H, state_indices, max_position)


@_step_inplace_op.register_fake
def _(q, k, v, g, lam, beta, pos, S, P, H, op, scale, normalize, eps, ridge, qk_l2norm, check_values,
      state_indices=None, max_position=-1):
    return v.new_empty(v.shape)


# ----------------------------------------------------------------------------- hila::forward_pool_

@torch.library.custom_op("hila::forward_pool_", mutates_args=("pos", "S", "P", "H"))
def _forward_pool_op(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor], lam: Optional[Tensor],
                     beta: Optional[Tensor], cu_seqlens: Optional[Tensor], state_indices: Tensor,
                     pos: Tensor, S: Optional[Tensor], P: Optional[Tensor], H: Tensor, op: str, form: str,
                     chunk: int, scale: float, normalize: bool, eps: float, ridge: float,
                     qk_l2norm: bool, check_values: bool, cu_seqlens_cpu: Optional[Tensor],
                     init_pos_cpu: Optional[Tensor]) -> Tensor:
    spec = _spec(op, form, chunk, scale, normalize, eps, ridge, qk_l2norm, check_values)
    return _pooled_forward_call(spec, q, k, v, g, lam, beta, cu_seqlens, state_indices,
                                State(pos, S, P, H), cu_seqlens_cpu, init_pos_cpu)


@_forward_pool_op.register_fake
def _(q, k, v, g, lam, beta, cu_seqlens, state_indices, pos, S, P, H, op, form, chunk, scale, normalize,
      eps, ridge, qk_l2norm, check_values, cu_seqlens_cpu, init_pos_cpu):
    return v.new_empty(v.shape)


# ----------------------------------------------------------------------------- public API

def _not_a_tensor(call: str, tensors: dict) -> Optional[HilaError]:
    """The HilaError for the first array of ``tensors`` (name -> value) that is not a torch tensor
    (before torch's schema check, whose message dumps the values), or None."""
    for name, x in tensors.items():
        if x is not None and not isinstance(x, Tensor):
            return HilaError(f"hila: argument '{name}': expected a torch.Tensor ({call} runs the torch "
                             f"custom ops; hila.{call.rsplit('.', 1)[1]} takes numpy and other DLPack "
                             f"arrays), got {_ops._describe(x)}", name)
    return None


def _check_call(call: str, op, extra: tuple, unknown: dict, **tensors) -> None:
    """HilaError for an fla-style call without ``op``, extra positional arguments, arrays that are
    not torch tensors, or unknown keywords. The direct road runs it only when a cheap test says
    something is wrong (``extra``, ``unknown``, ``op`` not a string); its array checks run when
    the road failed on an argument (:func:`_reraise`)."""
    _ops.check_op(op, call)
    _ops.check_no_extra_positional(call, extra)
    err = _not_a_tensor(call, tensors)
    if err is not None:
        raise err
    _ops.check_no_unknown_keywords(call, unknown)


def _reraise(call: str, state_name: str, state, **tensors):
    """In an ``except`` of the direct road (AttributeError / TypeError: an argument that is not a
    tensor): the HilaError naming it, else the original exception."""
    if state is not None:
        tensors.update((f"{state_name}.{f}", x) for f, x in zip(State._fields, state))
    err = _not_a_tensor(call, tensors)
    if err is not None:
        raise err from None
    meta = next((n for n, x in tensors.items() if isinstance(x, Tensor) and x.is_meta), None)
    if meta is not None:  # DLPack's BufferError: a meta tensor has no data to run on
        raise HilaError(f"hila: argument '{meta}': expected a tensor with data (on the device of q), got a "
                        "meta tensor", meta) from None
    raise


def _check_state_parts(call: str, state_name: str, state, **tensors) -> None:
    """Before a custom op (whose schema check dumps the values): HilaError for a part of the state,
    or one of ``tensors``, that is not a torch tensor, or that is a meta tensor where q is not or the
    reverse (the op would then run its shape function and return uninitialized memory)."""
    tensors.update((f"{state_name}.{f}", x) for f, x in zip(State._fields, state))
    err = _not_a_tensor(call, tensors)
    if err is not None:
        raise err
    q = tensors.get("q")
    for name, x in tensors.items():
        if x is not None and q is not None and x.is_meta != q.is_meta:
            raise HilaError(f"hila: argument '{name}': expected a tensor on q's device ({q.device}), got one on "
                            f"{x.device}", name)


def _as_state(op: str, s, name: str) -> Optional[State]:
    """A state argument as a State: a State passes through; else :func:`hila.ops.as_state` (a
    4-sequence, fla's bare [N, H, dk, dv] tensor for gla / gdn, or HilaError naming ``name``)."""
    return s if type(s) is State else _ops.as_state(op, s, name)


def _final_slots(op: str, T: int, B: int, cu_seqlens: Optional[Tensor],
                 init_pos: Optional[Tensor], max_seqlen: Optional[int] = None) -> int:
    """Slots of a log-linear final state: exact when the shapes tell (dense, no initial state);
    ``state_slots(max_seqlen)`` for packed sequences without an initial state; otherwise read from
    cu_seqlens (or its host copy) / init_pos, which torch.compile cannot trace."""
    if not _ops._traits(op)["loglinear"]:
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


def _host_copy(cu: Optional[Tensor], cu_cpu: Optional[Tensor]) -> Optional[Tensor]:
    """cu_seqlens_cpu as the library's host copy of cu_seqlens (its dtype); None without both."""
    if cu is None or cu_cpu is None or not isinstance(cu_cpu, Tensor) or not isinstance(cu, Tensor):
        return None
    return cu_cpu if cu_cpu.dtype == cu.dtype else cu_cpu.to(cu.dtype)


def _pooled_forward(op, q, k, v, g, lam, beta, cu, cu_host, pool, state_indices, init_pos_cpu, direct,
                    form, chunk, scale, normalize, eps, ridge, qk_l2norm, check_values):
    """forward(..., initial_state=pool, state_indices=rows): the library reads the rows and writes
    the final states back in place (docs/SERVING.md); returns (o, pool)."""
    from .serving import gathered_forward, prepare_pool
    N = q.shape[0] if cu is None else cu.shape[0] - 1
    given = pool
    st, idx, bare, in_place = prepare_pool(op, pool, state_indices, q, N, "initial_state")
    scale = _scale_arg(scale)
    if not in_place:  # (its padding rows copy a real row: the caller's positions do not apply)
        o = gathered_forward(op, q, k, v, g, pool=st, idx=idx, bare=bare, N=N, lam=lam, beta=beta,
                             cu_seqlens=cu, cu_seqlens_cpu=cu_host, form=form, chunk=chunk,
                             scale=scale or None, normalize=normalize, eps=eps, ridge=ridge,
                             qk_l2norm=qk_l2norm, check_values=check_values)
        return o, given
    pos_host = init_pos_cpu
    if bare:  # gla / gdn pools keep no positions: every sequence starts at 0
        st = State(torch.zeros(st.H.shape[0], dtype=torch.int64, device=st.H.device), None, None, st.H)
        if pos_host is None:
            pos_host = torch.zeros(N, dtype=torch.int64)
    if direct:
        try:
            spec = _spec(op, form, chunk, scale, normalize, eps, ridge, qk_l2norm, check_values)
            return _pooled_forward_call(spec, q, k, v, g, lam, beta, cu, idx, st, cu_host, pos_host), given
        except (AttributeError, TypeError, BufferError):
            _reraise("hila.torch.forward", "initial_state", st, k=k, v=v, g=g, lam=lam, beta=beta,
                     cu_seqlens=cu)
    _check_custom_op_call(form, chunk, normalize, eps, ridge, qk_l2norm, check_values)
    _check_state_parts("hila.torch.forward", "initial_state", st, q=q, k=k, v=v, g=g, lam=lam, beta=beta,
                       cu_seqlens=cu)
    o = torch.ops.hila.forward_pool_(q, k, v, g, lam, beta, cu, idx, *st, op, form, chunk, scale, normalize,
                                     float(eps), float(ridge), qk_l2norm, check_values, cu_host, pos_host)
    return o, given


def _scale_arg(scale) -> float:
    """The scale option as the custom ops take it: 0.0 for None or 0 (dk^-1/2), else a float
    (HilaError naming 'scale' for what is not a number)."""
    x = _ops._number("scale", scale)
    return 0.0 if x is None else x


def _default_checks(q) -> bool:
    """What ``check_values=None`` (the default of hila.torch) means for a call on q: the value
    checks on for CPU tensors (a host pass over inputs and outputs), off for device tensors, where
    every check is a device scan plus one synchronisation (docs/PYTHON.md, "Value checks")."""
    return getattr(q, "is_cpu", True)


def _requires_grad(*xs) -> bool:
    return any(x is not None and x.requires_grad for x in xs)


def _check_state(state) -> None:
    if state is None or state[0] is None or state[3] is None:
        raise HilaError("hila: argument 'state': expected a State with pos and H, got "
                        f"{type(state).__name__}", "state")


@functools.lru_cache(maxsize=256)
def _cpp_plan(op, form, chunk, scale, normalize, eps, ridge, qk_l2norm, check_values,
              framework_workspace) -> int:
    """The number of the C++ configuration of a plain call's options (torch.ops.hila_cpp.plan),
    the options checked first as the Python road checks them (:func:`_scale_arg`, then
    :func:`_spec`: HilaError naming a bad one); -1 where the C++ side numbers no more
    configurations (the call then takes the Python road)."""
    scale = _scale_arg(scale)
    spec = _spec(op, form, chunk, scale, normalize, eps, ridge, qk_l2norm, check_values)
    return torch.ops.hila_cpp.plan(op, form, spec.chunk, float(scale), spec.normalize, float(eps),
                                   float(ridge), bool(_flag(qk_l2norm)), bool(_flag(check_values)),
                                   bool(framework_workspace))


atexit.register(_cpp_plan.cache_clear)


def forward(op: str, q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor] = None, *extra,
            lam: Optional[Tensor] = None, beta: Optional[Tensor] = None,
            cu_seqlens: Optional[Tensor] = None, initial_state: Optional[State] = None,
            output_final_state: bool = False, final_slots: Optional[int] = None,
            form: str = "chunk", chunk: int = 64, scale: Optional[float] = None,
            normalize: bool = False, eps: float = 1e-6, ridge: float = 0.0,
            qk_l2norm: bool = False, check_values: Optional[bool] = None,
            state_indices: Optional[Tensor] = None, cu_seqlens_cpu: Optional[Tensor] = None,
            max_seqlen: Optional[int] = None, init_pos_cpu: Optional[Tensor] = None,
            **unknown) -> Tuple[Tensor, Optional[State]]:
    """Differentiable ``hila.forward`` on torch tensors (``torch.ops.hila.forward``).

    Shapes as in :func:`hila.forward`: q, k [B, T, G, dk]; v [B, T, H, dv]; g [B, T, H] or
    [B, T, H, P]; lam [B, T, H, L]; beta [B, T, H]; cu_seqlens [N + 1] (B == 1). Returns
    ``(o [B, T, H, dv], final_state or None)``.

    ``final_slots``: Fenwick slots of a log-linear final H. None: ``state_slots(T)`` for dense
    input without initial state, ``state_slots(max_seqlen)`` for packed input without initial
    state, else read from the data (one device read, none with ``cu_seqlens_cpu``; pass it
    explicitly under torch.compile, and to spare the read).

    ``check_values``: scan the inputs (and initial state) for non-finite values and positive
    gates before computing, and the outputs for non-finite values after. None (the default): on
    for CPU tensors, off for CUDA tensors, where each scanned tensor costs a device scan and a
    synchronisation; True checks on every device (debugging), False nowhere.

    ``initial_state`` may be a bare tensor ``[N, H, dk, dv]`` for ``gla`` and ``gdn`` (fla's
    convention; positions 0). Serving hooks (docs/SERVING.md): ``state_indices`` (int32/int64 [N])
    makes ``initial_state`` a state pool read at rows ``state_indices`` and written back there
    (row -1: a padding sequence, neither read nor written; inference only). Host copies that spare
    device reads (each a synchronisation on CUDA): ``cu_seqlens_cpu`` (of cu_seqlens) and
    ``max_seqlen``; ``init_pos_cpu`` (int64 [N] on the CPU: the positions the sequences start
    from, with ``state_indices`` those of their pool rows, 0 for padding). With
    ``check_values=False`` the library trusts them; with ``check_values=True`` it compares them
    with the device's copies.
    """
    if (_CPP[0] is not None and cu_seqlens is None and initial_state is None and not output_final_state
            and state_indices is None and init_pos_cpu is None and not extra and not unknown
            and type(op) is str and _direct(q) and not _POISON[0]):
        try:
            plan = _cpp_plan(op, form, chunk, scale, normalize, eps, ridge, qk_l2norm,
                             q.is_cpu if check_values is None else check_values,
                             _ops._FRAMEWORK_WORKSPACE[0])
        except TypeError:  # an unhashable option: the general road names it
            plan = -1
        if plan >= 0:
            try:
                return _CPP[0](q, k, v, g, lam, beta, plan), None
            except (RuntimeError, TypeError):  # torch's schema check of an argument that is not a tensor
                _reraise("hila.torch.forward", "initial_state", None, k=k, v=v, g=g, lam=lam, beta=beta)
    direct = _direct(q)
    if extra or unknown or not direct or not isinstance(op, str):
        _check_call("hila.torch.forward", op, extra, unknown, q=q, k=k, v=v, g=g, lam=lam, beta=beta,
                    cu_seqlens=cu_seqlens)
    cu_host = _host_copy(cu_seqlens, cu_seqlens_cpu)
    if check_values is None:
        check_values = _default_checks(q)
    if state_indices is not None:
        return _pooled_forward(op, q, k, v, g, lam, beta, cu_seqlens, cu_host, initial_state,
                               state_indices, init_pos_cpu, direct, form, chunk, scale, normalize,
                               eps, ridge, qk_l2norm, check_values)
    init = _NO_STATE if initial_state is None else _as_state(op, initial_state, "initial_state")
    pos_host = init_pos_cpu
    if pos_host is None and init[0] is not None and isinstance(initial_state, Tensor):
        pos_host = torch.zeros(init[0].shape[0], dtype=torch.int64)  # a bare state: positions 0
    if output_final_state and final_slots is None:
        final_slots = _final_slots(op, q.shape[1], q.shape[0],
                                   cu_seqlens if cu_seqlens_cpu is None else cu_seqlens_cpu,
                                   init[0] if pos_host is None else pos_host, max_seqlen)
    elif output_final_state and not isinstance(final_slots, torch.SymInt):
        final_slots = _ops.check_slots("final_slots", final_slots)
    scale = _scale_arg(scale)
    if direct:
        try:
            spec = _spec(op, form, chunk, scale, normalize, eps, ridge, qk_l2norm, check_values)
            if torch.is_grad_enabled() and _requires_grad(q, k, v, g, lam, beta, *init):
                if (not output_final_state and cu_seqlens is None and init is _NO_STATE
                        and cu_host is None and pos_host is None):
                    return _Plain.apply(spec, q, k, v, g, lam, beta), None
                o, pos, S, P, H = _Forward.apply(spec, output_final_state, int(final_slots or 1),
                                                 (cu_host, pos_host), q, k, v, g, lam, beta,
                                                 cu_seqlens, *init)
                return o, (_with_counters(State(pos, S, P, H)) if output_final_state else None)
            if init[0] is None and init[1] is None and init[2] is None and init[3] is None:
                init = None
            o, fin = _forward_call(spec, q, k, v, g, lam, beta, cu_seqlens, init, output_final_state,
                                   int(final_slots or 1), cu_host, pos_host)
            return o, (None if fin is None else _with_counters(fin))
        except (AttributeError, TypeError, BufferError):
            _reraise("hila.torch.forward", "initial_state", init, k=k, v=v, g=g, lam=lam, beta=beta,
                     cu_seqlens=cu_seqlens)
    _check_custom_op_call(form, chunk, normalize, eps, ridge, qk_l2norm, check_values)
    _check_state_parts("hila.torch.forward", "initial_state", init, q=q, k=k, v=v, g=g, lam=lam, beta=beta,
                       cu_seqlens=cu_seqlens)
    o, pos, S, P, H = torch.ops.hila.forward(
        q, k, v, g, lam, beta, cu_seqlens, *init, op, form, chunk, scale, normalize,
        float(eps), float(ridge), qk_l2norm, check_values, output_final_state, int(final_slots or 1),
        cu_host, pos_host)
    if not output_final_state:
        return o, None
    t = _ops._traits(op)
    return o, _with_counters(State(pos, S if t["has_S"] else None, P if t["has_P"] else None, H))


def step(op: str, q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor] = None, *extra, state: State = None,
         lam: Optional[Tensor] = None, beta: Optional[Tensor] = None, scale: Optional[float] = None,
         normalize: bool = False, eps: float = 1e-6, ridge: float = 0.0, qk_l2norm: bool = False,
         check_values: Optional[bool] = None, **unknown) -> Tuple[Tensor, State]:
    """One decode token for N sequences (``torch.ops.hila.step``), differentiable.

    q, k [N, G, dk]; v [N, H, dv]; g [N, H] or [N, H, P]; lam [N, H, L]; beta [N, H]; ``state`` the
    :class:`hila.State` before the token (a bare [N, H, dk, dv] tensor for gla / gdn). Returns
    ``(o [N, H, dv], new_state)``; the new state has the shapes of ``state`` (a log-linear H keeps
    its slot capacity: allocate it for the longest sequence to come, see :func:`zero_state`).
    ``check_values`` as in :func:`forward` (None: on for CPU tensors, off on CUDA).
    """
    direct = _direct(q)
    if extra or unknown or not direct or not isinstance(op, str):
        _check_call("hila.torch.step", op, extra, unknown, q=q, k=k, v=v, g=g, lam=lam, beta=beta)
    if check_values is None:
        check_values = _default_checks(q)
    state = _as_state(op, state, "state")
    _check_state(state)
    scale = _scale_arg(scale)
    if direct:
        try:
            spec = _spec(op, "chunk", 64, scale, normalize, eps, ridge, qk_l2norm, check_values)
            if not (torch.is_grad_enabled() and _requires_grad(q, k, v, g, lam, beta, *state)):
                return _step_call(spec, q, k, v, g, lam, beta, tuple(state))
            o, pos, S, P, H = _Step.apply(spec, q, k, v, g, lam, beta, *state)
        except (AttributeError, TypeError, BufferError):
            _reraise("hila.torch.step", "state", state, k=k, v=v, g=g, lam=lam, beta=beta)
    else:
        _check_custom_op_call("chunk", 64, normalize, eps, ridge, qk_l2norm, check_values)
        _check_state_parts("hila.torch.step", "state", state, q=q, k=k, v=v, g=g, lam=lam, beta=beta)
        o, pos, S, P, H = torch.ops.hila.step(
            q, k, v, g, lam, beta, *state, op, scale, normalize, float(eps), float(ridge),
            qk_l2norm, check_values)
    return o, State(pos, S if state.S is not None else None, P if state.P is not None else None, H)


def step_(op: str, q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor] = None, *extra, state: State = None,
          lam: Optional[Tensor] = None, beta: Optional[Tensor] = None, scale: Optional[float] = None,
          normalize: bool = False, eps: float = 1e-6, ridge: float = 0.0, qk_l2norm: bool = False,
          check_values: Optional[bool] = None, state_indices: Optional[Tensor] = None,
          max_position: Optional[int] = None, out: Optional[Tensor] = None, **unknown) -> Tensor:
    """One fused decode token for N sequences, advancing ``state`` IN PLACE (``torch.ops.hila.step_``).

    Shapes as in :func:`step`; ``state`` is a :class:`hila.State` of tensors on q's device (a
    log-linear H with ``bitlen(pos + 1) + 1`` slots or more for every sequence: see
    :func:`zero_state`), whose pos, S, P and H are overwritten with the state after the token.
    Runs the library's decode kernel on the caller's current CUDA stream. Not differentiable (a
    backward through it raises: no autograd formula is registered): use :func:`step` for training.
    ``check_values`` scans the step's inputs (None, the default: on the CPU only; True on CUDA
    too, at one synchronisation per scanned input). Returns o [N, H, dv].

    ``state_indices`` (int32/int64 [N], serving: docs/SERVING.md): ``state`` is a pool whose row
    ``state_indices[i]`` sequence i reads and advances; rows with index -1 are padding (output 0,
    no state touched).

    ``max_position``: the caller's bound on the positions the step starts from (e.g. a layer's
    ``max_len - 1``). With it, and ``check_values=False``, a CUDA step reads nothing back to the
    host for any operator (the log-linear ones otherwise read their positions: λ levels and
    Fenwick slots depend on them), so it can be captured in a CUDA graph; the state must have the
    slots of ``max_position + 1`` and lam ``bitlen(max_position) + 1`` levels. A sequence whose
    position lies outside ``[0, max_position]`` then gets NaN in its row of o and its state is left
    unchanged (with ``check_values=True``, and on the CPU, it is a HilaError instead). Without
    ``max_position`` (and without ``state_indices``), a log-linear CUDA step on a State whose
    positions hila.torch knows (from :func:`zero_state` and its own steps, read once after ``pos``
    was written) passes the bound of the state's capacity itself and reads nothing back either
    (docs/PYTHON.md, "Host overhead"); results are the same as after reading the positions.

    ``out``: a tensor like v ([N, H, dv], v's dtype and device, innermost stride 1, not requiring
    grad, overlapping no input and no state part) that the step writes o into and returns, as
    ``out=`` of torch's functions: a decode loop that keeps one output buffer spares an allocation
    per step. Every element is written; a bad ``out`` is a HilaError naming it (the registered
    operator's road, under torch.compile or a dispatch mode, writes a new o into it with
    ``copy_``, so there an ``out`` that overlaps an input is not an error).
    """
    if not (extra or unknown) and state_indices is None and type(state) is State and _direct(q):
        o = _fast_step_(op, q, k, v, g, lam, beta, state, scale, normalize, eps, ridge, qk_l2norm,
                        check_values, -1 if max_position is None else max_position, out)
        if o is not None:
            return o
    direct = _direct(q)
    if extra or unknown or not direct or not isinstance(op, str):
        _check_call("hila.torch.step_", op, extra, unknown, q=q, k=k, v=v, g=g, lam=lam, beta=beta)
    if out is not None:
        _check_out(out, v)
    mp = -1 if max_position is None else max_position
    idx = None
    owner = state  # the State whose step counters a direct step passes (see _counters)
    if check_values is None:
        check_values = _default_checks(q)
    if state_indices is not None:
        from .serving import gathered_step_, prepare_pool
        state, idx, bare, in_place = prepare_pool(op, state, state_indices, q, q.shape[0], "state")
        if not in_place:
            o = gathered_step_(op, q, k, v, g, pool=state, idx=idx, bare=bare, lam=lam, beta=beta,
                               scale=scale, normalize=normalize, eps=eps, ridge=ridge,
                               qk_l2norm=qk_l2norm, check_values=check_values, max_position=max_position)
            return o if out is None else _copied_out(out, o)
        if bare:  # gla / gdn pools keep no positions: zeros stand in for them
            state = State(torch.zeros(state.H.shape[0], dtype=torch.int64, device=state.H.device), None, None,
                          state.H)
    else:
        state = _as_state(op, state, "state")
    _check_state(state)
    scale = _scale_arg(scale)
    if direct:
        try:
            if idx is not None or not (torch.is_grad_enabled() and _requires_grad(q, k, v, g, lam, beta, *state)):
                spec = _spec(op, "chunk", 64, scale, normalize, eps, ridge, qk_l2norm, check_values)
                cnt = _counters(owner, state.pos, state.H, q) if type(owner) is State else None
                return _step_inplace_call(spec, q, k, v, g, lam, beta, *state, idx, mp,
                                          None if cnt is None else cnt[0], out)
        except (AttributeError, TypeError, BufferError):
            _reraise("hila.torch.step_", "state", state, k=k, v=v, g=g, lam=lam, beta=beta)
    _check_custom_op_call("chunk", 64, normalize, eps, ridge, qk_l2norm, check_values)
    _check_state_parts("hila.torch.step_", "state", state, q=q, k=k, v=v, g=g, lam=lam, beta=beta)
    o = torch.ops.hila.step_(q, k, v, g, lam, beta, *state, op, scale, normalize,
                             float(eps), float(ridge), qk_l2norm, check_values, idx, int(mp))
    return o if out is None else _copied_out(out, o)


def _copied_out(out: Tensor, o: Tensor) -> Tensor:
    """``out`` holding o: the roads that make o themselves (the registered operator, serving pools
    gathered into a scratch state). The direct roads write ``out`` itself."""
    with torch.no_grad():
        return out.copy_(o)


# (op, scale, normalize, eps, ridge, qk_l2norm, check_values) -> (_Spec, the number of its C++
# configuration for hila._torch_ops.step_, or -1 where that road is off or numbers no more)
_STEP_SPECS: dict = {}
atexit.register(_STEP_SPECS.clear)
_CONTIGUOUS = torch.contiguous_format
# torch.autograd.graph.increment_version without its wrapper (it takes a tuple of tensors); the
# wrapper where this torch has no such function.
_increment_version = getattr(torch._C, "_increment_version", torch.autograd.graph.increment_version)
_grad_enabled = torch.is_grad_enabled


def _step_spec(op, scale, normalize, eps, ridge, qk_l2norm, check_values):
    """(_Spec, C++ configuration number or -1) of a step's options (see _STEP_SPECS); a bad
    option is a HilaError naming it, as on the general road."""
    scale = _scale_arg(scale)
    spec = _spec(op, "chunk", 64, scale, normalize, eps, ridge, qk_l2norm, check_values)
    plan = -1
    if _CPP_STEP is not None:
        plan = _cpp_plan(op, "chunk", 64, scale, normalize, eps, ridge, qk_l2norm, check_values, False)
    return spec, plan


def _fast_step_(op, q, k, v, g, lam, beta, state, scale, normalize, eps, ridge, qk_l2norm,
                check_values, max_position, out) -> Optional[Tensor]:
    """The decode loop's call of :func:`step_` (a State of plain tensors, no gradient needed, no
    serving indices, on the direct road) with the least host work: the configuration from a dict
    keyed by the options as given, then
    * on the C++ road (:func:`cpp_road`, where hila._torch_ops was built): one call of
      ``hila._torch_ops.step_`` with the tensors themselves, which makes o, runs the step and
      advances the state parts' autograd versions in C++;
    * otherwise one ``torch.empty_like`` for o (or the caller's ``out``), and for a bound state
      (see :func:`_bound_state`) one DLPack capsule per input lent to the extension (read in place,
      not consumed) and o's data pointer (o made here is contiguous, shaped, typed and placed like
      v; an ``out`` is checked by :func:`_check_out` first).
    Both run the same hila::step on the same arguments. Returns None where it does not apply (or
    an argument is not a tensor), and the caller then takes the general road, which names what is
    wrong. Inputs whose innermost stride is not 1 are not copied here: the library rejects them
    while validating, before it writes anything, and the general road then runs the call on
    contiguous copies."""
    pos, S, P, H = state
    if pos is None or H is None:
        return None
    try:
        if _grad_enabled() and _requires_grad(q, k, v, g, lam, beta, S, P, H):
            return None
        if check_values is None:
            check_values = q.is_cpu
        key = (op, scale, normalize, eps, ridge, qk_l2norm, check_values)
        got = _STEP_SPECS.get(key)  # TypeError for an unhashable option: the general road names it
        if got is None:
            if not isinstance(op, str):
                return None
            got = _step_spec(op, scale, normalize, eps, ridge, qk_l2norm, check_values)
            if len(_STEP_SPECS) >= 256:
                _STEP_SPECS.clear()
            _STEP_SPECS[key] = got
        spec, plan = got
        top = None  # the largest position before this step, where _position_bound knows it
        if max_position < 0 and spec.bounds_steps and (pos.is_cuda or _BOUND_ON_CPU[0]):
            top, max_position = _position_bound(state, pos, H, lam, q)
        if plan >= 0 and _CPP[0] is not None and not _POISON[0]:
            # the State's counters as made (hila._torch_ops.step_ drops them where they are too
            # small for this step or on another device, as _counters does)
            cnt = state.__dict__.get(_COUNTERS)
            if cnt is True:
                cnt = _counters(state, pos, H, q)
            o = _CPP_STEP(plan, q, k, v, g, lam, beta, pos, S, P, H, max_position,
                          None if cnt is None else cnt[0], out)
            if top is not None:
                _keep_positions(state, pos, top + 1)
            return o
        cnt = _counters(state, pos, H, q)
        if out is None:
            o = torch.empty_like(v) if v.is_contiguous() else torch.empty_like(v, memory_format=_CONTIGUOUS)
        else:
            _check_out(out, v)
            o = out
        if _POISON[0]:
            _ops._poison(o)
        # (a bound state's step takes o as the data pointer of a contiguous tensor like v)
        bound = _bound_state(state, pos, S, P, H) if out is None or out.is_contiguous() else None
        if bound is not None:
            bound.step(spec.cfg, _lent(q), _lent(k), _lent(v), None if g is None else _lent(g),
                       None if lam is None else _lent(lam), None if beta is None else _lent(beta),
                       o.data_ptr(), _stream(q), max_position, counters=None if cnt is None else cnt[1])
        else:
            _C.step_inplace(spec.cfg, _lent(q), _lent(k), _lent(v),
                            None if g is None else _lent(g), None if lam is None else _lent(lam),
                            None if beta is None else _lent(beta),
                            (_capsule(pos), None if S is None else _capsule(S), None if P is None else _capsule(P),
                             _capsule(H)), o=_capsule(o), stream=_stream(q), max_position=max_position,
                            counters=None if cnt is None else _capsule(cnt[0]))
    except (AttributeError, TypeError, BufferError):  # an argument that is not a tensor (or has no
        return None  # data: meta), an unhashable option: nothing was written, the general road names it
    except HilaError as e:
        if not all(x is None or (isinstance(x, Tensor) and not _needs_copy(x))
                   for x in (q, k, v, g, lam, beta)):
            return None  # rejected while validating: the general road copies (or names) these inputs
        raise _as_out(e, out) from None
    # what the kernel wrote behind autograd's back: saved copies of these tensors are now stale
    _increment_version(tuple(x for x in (pos, S, P, H, out) if x is not None))
    if top is not None:
        _keep_positions(state, pos, top + 1)
    return o


# ----------------------------------------------------------------------------- step counters
#
# A step on a caller-owned state runs the library's DecodeState step (same tiling, one launch:
# the kernel's last block of a sequence advances its position, and the metric-S operators split
# their columns into tiles) when it is given step counters (StepParams::counters): int32 device
# memory, zero-filled once, that every step leaves zero again. A State that hila made for decoding
# (zero_state, a forward's final state) owns them: its __dict__ holds True until its first CUDA
# step_ on the direct road, which makes a zero tensor of step_counters_size(max(rows, N), H)
# elements on the state's device, kept with a DLPack capsule the extension reads in place at every
# step. They live as long as the State object (never replaced: a captured graph that read them
# keeps reading memory the State holds), and copies and pickles of a State hold only its four
# parts. A step whose N needs more than they hold, a State without them (made by the user, an
# older pickle), CPU states, and the custom ops' road (torch.compile, dispatch modes) step without
# counters, as a StateView step does: the same function (docs/PYTHON.md).

_COUNTERS = "_hila_counters"  # key in a State's __dict__: True (to be made) or
#                               (tensor, its capsule, its elements, its device index)
_COUNTERS_ON_CPU = [False]    # test hook: counters for CPU states too (the CPU library ignores them)


def _with_counters(state: State) -> State:
    """Marks ``state`` as one of hila's decode states: its first CUDA step_ makes its counters."""
    state.__dict__[_COUNTERS] = True
    return state


def _counters(state: State, pos: Tensor, H: Tensor, q: Tensor):
    """(counters tensor, its lent capsule, ...) for a step of q.shape[0] sequences on ``state``, or None
    where the state owns none (see the comment above) or they are too small for this call."""
    c = state.__dict__.get(_COUNTERS)
    if c is None:
        return None
    try:
        if c is True:
            if not (H.is_cuda or _COUNTERS_ON_CPU[0]) or H.dim() < 2 or pos.dim() != 1:
                return None  # the library names a bad shape
            n = max(pos.shape[0], q.shape[0])
            t = torch.zeros(n + n * H.shape[1], dtype=torch.int32, device=H.device)  # step_counters_size
            c = (t, _capsule(t), t.numel(), t.get_device())
            state.__dict__[_COUNTERS] = c
        N = q.shape[0]
        if N + N * H.shape[1] > c[2] or H.get_device() != c[3]:
            return None
    except (AttributeError, IndexError, TypeError):  # not tensors: the library names them
        return None
    return c


def _share_counters(src: State, dst: State) -> State:
    """``dst`` (a copy of ``src``'s parts, stepped in ``src``'s place) uses ``src``'s counters."""
    c = src.__dict__.get(_COUNTERS)
    if c is not None:
        dst.__dict__[_COUNTERS] = c
    return dst


# ----------------------------------------------------------------------------- position bound
#
# A log-linear step without max_position needs the largest position of the state on the host (its
# Fenwick slots and lam levels are checked against it): the library reads the positions back, a
# device-to-host copy and a synchronisation per CUDA step. A State that hila.torch made
# (zero_state) or stepped keeps, in its __dict__, an upper bound of its positions together with
# the data pointer and autograd version counter of its pos, which every in-place write through
# torch (fill_, copy_, zero_, indexing, the hila.torch calls that write pos, on pos or any view of
# its memory) advances. While both are unchanged the bound holds, and the step passes
# max_position = the largest position the state's slots and lam's levels can step from
# (_capacity), which is at least every real position: the library then reads nothing, and the
# kernel runs exactly as it would after reading (it only compares each position with the bound).
# Where the bound is not known (pos written, re-pointed, a State made elsewhere), the positions
# are read once here (the synchronisation the library would make) and the bound kept from then on.
# Positions outside [0, capacity] get max_position -1: the library reads them and names the error.
# The bound decides only whether the capacity is passed, never the kernel's arithmetic: a bound
# that went stale without a version change (writes through .data or DLPack, CUDA graph replays)
# cannot change a step of positions the state can take.

_POSITIONS = "_hila_pos"  # the key, in a State's __dict__, of (pos data pointer, pos._version, bound)
_BOUND_ON_CPU = [False]   # test hook: the bound on CPU tensors too (the CPU library reads anyway)
_MAX_POSITION = (1 << 62) - 1  # the largest position a step may start from (hila::kMaxPosition - 1)
_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: False)


def _capacity(slots: int, levels: int) -> int:
    """The largest position a log-linear step can start from with ``slots`` Fenwick slots in H
    (state_slots(p + 1) = bitlen(p + 1) + 1 <= slots) and ``levels`` lam levels (bitlen(p) + 1 <=
    levels); -1 when there is none."""
    if slots < 2 or levels < 1:
        return -1
    return min((1 << (slots - 1)) - 2, (1 << (levels - 1)) - 1, _MAX_POSITION)


def _keep_positions(state: State, pos: Tensor, top: int) -> None:
    """Records ``top`` as the largest position of ``state`` (pos as it is now); dropped during a
    CUDA graph capture, where the step is recorded, not run."""
    if pos.is_cuda and _capturing():
        state.__dict__.pop(_POSITIONS, None)
    else:
        state.__dict__[_POSITIONS] = (pos.data_ptr(), pos._version, top)


def _position_bound(state: State, pos: Tensor, H: Tensor, lam: Optional[Tensor], q: Tensor):
    """(the largest position of ``state``, the max_position to pass) for a log-linear step_ without
    max_position: (None, -1) where the positions are not known to lie in [0, capacity] (the library
    then reads them, as without this bound). See the comment above. A lam or H of another shape
    than the library takes gets the bound of what shape it has: the library names it, before
    comparing anything with the bound."""
    try:
        version = pos._version
        kept = state.__dict__.get(_POSITIONS)
        if kept is not None and kept[1] == version and kept[0] == pos.data_ptr():
            top = kept[2]
        else:
            if ((pos.is_cuda and _capturing()) or pos.dtype != torch.int64 or pos.dim() != 1
                    or pos.numel() == 0 or pos.device != q.device):
                return None, -1  # the library names what is wrong (or that it cannot read under capture)
            p = pos.tolist()  # the one read back
            if min(p) < 0:
                return None, -1
            top = max(p)
        cap = _capacity(H.shape[2], lam.shape[2])
    except (IndexError, RuntimeError):  # fewer dimensions; an inference tensor has no _version
        return None, -1
    return (top, cap) if top <= cap else (None, -1)  # (cap = -1: no position fits)


_BOUND = "_hila_step"  # the key, in a State's __dict__, of what _bound_state keeps there


def _bound_state(state: State, pos, S, P, H):
    """The extension's binding of ``state`` (``_C.BoundState``: its tensors taken over DLPack once,
    so a step converts only the token's tensors), made at the second step of the same State object
    and kept in its ``__dict__``; None at the first step (a State stepped once, e.g. the copy a
    functional layer step makes, is not worth binding) and after its tensors were re-pointed.

    What is kept: (data pointers of the parts, binding, their storages). The pointers are compared
    before each use: a part whose memory changed (``set_``, ``resize_``, ``.data =``) makes a new
    binding. The storages are held so that memory the parts left cannot be freed and handed to
    another tensor at the same address while the binding lives (equal pointers then mean the same
    memory)."""
    ptrs = ((pos.data_ptr(), H.data_ptr()) if S is None and P is None else
            (pos.data_ptr(), None if S is None else S.data_ptr(), None if P is None else P.data_ptr(),
             H.data_ptr()))
    kept = state.__dict__.get(_BOUND)
    if kept is not None and kept[0] == ptrs:
        if kept[1] is not None:
            return kept[1]
        parts = (pos, S, P, H)
        bound = _C.BoundState(tuple(None if x is None else _capsule(x) for x in parts))
        state.__dict__[_BOUND] = (ptrs, bound, tuple(x.untyped_storage() for x in parts if x is not None))
        return bound
    state.__dict__[_BOUND] = (ptrs, None, ())
    return None


def _graph_capturable(op: str) -> bool:
    """Whether a decode step of ``op`` (``step_`` with ``check_values=False``, and for the
    log-linear operators ``max_position``, which the layers pass) can be captured in a CUDA graph:
    it then reads and writes device memory only. Every operator's can."""
    return op in _ops.OPS


def zero_state(op: str, batch: int, heads: int, dk: int, dv: int, *, max_len: int = 1,
               normalize: bool = False, dtype: torch.dtype = torch.float32,
               device: Optional[torch.device] = None) -> State:
    """A zero state at position 0 for ``batch`` sequences, with the Fenwick capacity of sequences
    up to ``max_len`` tokens (log-linear operators). ``dtype``: float32, or float64 for float64 inputs."""
    if dtype not in (torch.float32, torch.float64):
        raise HilaError(f"hila: argument 'dtype': expected torch.float32 or torch.float64 (the dtypes of "
                        f"states), got {dtype!r}", "dtype")
    concrete = not any(isinstance(x, torch.SymInt) for x in (batch, heads, dk, dv, max_len))
    if concrete:
        _ops.state_shape(op, batch, heads, dk, dv, max_len, normalize=normalize)  # HilaError naming a bad size
    shapes = _ops.state_part_shapes(op, batch, heads, dk, dv, normalize=normalize,
                                    slots=_ops.state_slots(max_len))
    if concrete and (device is None or str(device).split(":")[0] == "cpu"):  # host memory: hila's limit
        _ops.check_host_bytes("state", (shapes.pos, 8), *((x, dtype.itemsize) for x in shapes[1:]))
    z = lambda s, dt=dtype: None if s is None else torch.zeros(s, dtype=dt, device=device)  # noqa: E731
    st = _with_counters(State(z(shapes.pos, torch.int64), z(shapes.S), z(shapes.P), z(shapes.H)))
    if not st.pos.is_inference():
        st.__dict__[_POSITIONS] = (st.pos.data_ptr(), st.pos._version, 0)  # every position is 0
    return st
