# SPDX-License-Identifier: Apache-2.0
"""Functional API of hila over any DLPack array: numpy, torch, cupy, jax, ...

Mirrors the C++ API (docs/API.md): one :func:`forward` and one :func:`backward` for every operator
and form, a decode state (:class:`DecodeState`, the stateless :func:`step`, or :func:`step_`, the
fused step in place on a caller-owned state), and the size helpers. Layouts are sequence-first, as
in FlashAttention and fla::

    q, k        [B, T, G, dk]     G query/key groups
    v           [B, T, H, dv]     H value heads, H % G == 0; head h reads group h // (H // G)
    g           [B, T, H]         log-gates <= 0 (tied), or [B, T, H, P] (untied: one column per
                                  primitive, inner first; hla2: gS, gY; ahla: gP, gE; hla3: gS, gP, gX)
    lam         [B, T, H, L]      Fenwick level weights, log-linear operators only
    beta        [B, T, H]         delta-rule step sizes, gdn and loglinear_gdn only
    cu_seqlens  [N + 1]           int32/int64 offsets of packed sequences (varlen, B == 1)
    o           [B, T, H, dv]     dtype of v

States (docs/STATES.md) are :class:`State` tuples ``(pos, S, P, H)``; see there for shapes.

Outputs are allocated by the array library of ``q`` (torch tensors give torch tensors on the same
device, numpy arrays give numpy arrays, ...); jax arrays, being immutable, get numpy outputs turned
back into jax arrays. Bad input raises :class:`hila.HilaError` (a ``ValueError``) naming the argument.

Devices: arrays carry their device into hila; CUDA arrays run on the library's CUDA backend where it
is built in and covers the call, and raise HilaError otherwise. Every call takes ``stream`` (a
``cudaStream_t`` as an int; None or 0 is the default stream), which hila.torch fills with the
caller's current CUDA stream.
"""
from __future__ import annotations

import atexit
import functools
import math
import os
from typing import Any, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from . import _C
from ._errors import HilaError

Array = Any  # any object exporting DLPack (numpy.ndarray, torch.Tensor, cupy.ndarray, jax.Array, ...)

OPS: Tuple[str, ...] = tuple(_C.op_names())
"""Operator names: gla hla2 ahla hla3 loglinear loglinear_hla2 loglinear_ahla loglinear_hla3 gdn loglinear_gdn."""
FORMS: Tuple[str, ...] = tuple(_C.form_names())
"""Form names: naive serial chunk scan."""


class _StateParts(NamedTuple):
    pos: Optional[Array]
    S: Optional[Array]
    P: Optional[Array]
    H: Optional[Array]


class State(_StateParts):
    """A recurrent state in hila's single format (docs/STATES.md), for N sequences and H value heads.

    Attributes:
        pos: int64 [N], tokens consumed per sequence (None in gradients).
        S: [N, H, dk(dk+1)/2] packed symmetric metric (hla2, hla3 and log-linear versions), else None.
        P: [N, H, dk, dv'] inner first-order state (ahla, hla3 and log-linear versions), else None.
        H: [N, H, dk, dv'] outer state, or [N, H, Ls, dk, dv'] Fenwick slots for log-linear operators.

    dv' = dv + 1 with ``normalize``. dtype float64 for float64 inputs, float32 otherwise.

    A named tuple. Its instances also carry a ``__dict__``, where ``hila.torch.step_`` keeps what it
    prepared for stepping this state again (its arrays taken over by the extension once); copies
    and pickles hold only the four parts.
    """

    def __reduce__(self):
        return (State, tuple(self))


class Grads(NamedTuple):
    """Gradients returned by :func:`backward`, each shaped like its input (None where no input).

    ``d_initial_state`` is a :class:`State` with ``pos`` None, present when an initial state was given.
    The gradient of a packed ``S`` treats its entries as independent variables (an off-diagonal
    entry stands for both S_ij and S_ji).
    """

    dq: Array
    dk: Array
    dv: Array
    dg: Optional[Array]
    dlam: Optional[Array]
    dbeta: Optional[Array]
    d_initial_state: Optional[State]


# ----------------------------------------------------------------------------- introspection

def op_traits(op: str) -> dict:
    """What ``op`` is made of: ``loglinear`` (takes lam), ``delta`` (takes beta), ``has_S``,
    ``has_P``, ``num_primitives`` (untied gate columns) and ``hla_family`` (normalize, untied)."""
    return _call_C(_C.op_traits, [("op", op, "str")], op)


_TRAITS = {name: _C.op_traits(name) for name in OPS}


def _traits(op: str) -> dict:
    t = _TRAITS.get(op)
    if t is None:
        op_traits(op)  # raises HilaError('op') listing the valid names
    return t


def supports(op: str, form: str, backward: bool = False) -> bool:
    """Whether ``form`` exists for ``op`` in that direction. Forward: all. Backward: naive and chunk
    for every operator, serial for gla/hla2/ahla/hla3, never scan."""
    if isinstance(backward, np.bool_):
        backward = bool(backward)
    return _call_C(_C.supports, [("op", op, "str"), ("form", form, "str"), ("backward", backward, "bool")],
                   op, form, backward)


def state_slots(n: int) -> int:
    """Fenwick slots of a log-linear state at position n: ``bitlen(n) + 1``."""
    return _call_C(_C.state_slots, [("n", n, "int")], n)


def levels_needed(n0: int, T: int) -> int:
    """lam levels a call over positions n0 .. n0+T-1 needs: ``bitlen(n0 + T - 1) + 1`` (0 if T == 0)."""
    return _call_C(_C.levels_needed, [("n0", n0, "int"), ("T", T, "int")], n0, T)


def state_part_shapes(op: str, N: int, H: int, dk: int, dv: int, *, normalize: bool = False,
                      slots: int = 1) -> State:
    """Shapes of the parts of a state (a :class:`State` of tuples, None for absent parts).

    ``slots`` is the Fenwick slot count of a log-linear ``H`` (see :func:`state_slots`). Pure
    Python, so it also works on symbolic sizes (torch fake tensors).
    """
    t = _traits(op)
    for name, x in (("N", N), ("H", H), ("dk", dk), ("dv", dv), ("slots", slots)):
        if isinstance(x, (bool, np.bool_)) or not hasattr(x, "__index__") or (isinstance(x, (int, np.integer)) and x < 0):
            raise HilaError(f"hila: argument '{name}': expected a size, an int >= 0, got {_describe(x)}", name)
    dvp = dv + 1 if normalize else dv
    return State(
        pos=(N,),
        S=(N, H, dk * (dk + 1) // 2) if t["has_S"] else None,
        P=(N, H, dk, dvp) if t["has_P"] else None,
        H=(N, H, slots, dk, dvp) if t["loglinear"] else (N, H, dk, dvp),
    )


def state_shape(op: str, N: int, H: int, dk: int, dv: int, max_pos: int, *,
                normalize: bool = False) -> State:
    """Shapes of the state parts for N sequences whose largest position is ``max_pos``
    (the C++ ``hila::state_shape``)."""
    d = _call_C(_C.state_shape, [(n, x, "int") for n, x in (("N", N), ("H", H), ("dk", dk), ("dv", dv),
                                                             ("max_pos", max_pos))],
                config(op, normalize=normalize), N, H, dk, dv, max_pos)
    return State(*(None if d[k] is None else tuple(d[k]) for k in State._fields))


def config(op: str, *, scale: Optional[float] = None, normalize: bool = False, eps: float = 1e-6,
           ridge: float = 0.0, qk_l2norm: bool = False, check_values: bool = True) -> _C.Config:
    """An operator configuration (``hila::OpConfig``); ``scale=None`` means ``dk ** -0.5``.

    Untied gates need no flag: they are recognised by the extra column axis of ``g``.
    """
    check_op(op)
    scale, eps, ridge = (_number(name, x) for name, x in (("scale", scale), ("eps", eps), ("ridge", ridge)))
    if scale is not None and scale == 0:
        raise HilaError("hila: argument 'scale': expected a non-zero scale (None means dk^-1/2), got 0",
                        "scale")
    flags = dict(normalize=normalize, qk_l2norm=qk_l2norm, check_values=check_values)
    for name, x in flags.items():
        if not isinstance(x, (bool, np.bool_)):
            raise HilaError(f"hila: argument '{name}': expected a bool, got {_describe(x)}", name)
    return _C.Config(op, scale=0.0 if scale is None else scale, eps=eps, ridge=ridge,
                     **{name: bool(x) for name, x in flags.items()})


def check_op(op: Any, call: str = "hila.forward") -> None:
    """Raises HilaError('op') unless ``op`` is an operator name: the usual slip is an fla-style
    call without one (``forward(q, k, v, g)``)."""
    if isinstance(op, str):
        return
    raise HilaError(f"hila: argument 'op': expected the operator name as the first argument, e.g. "
                    f"{call}('gla', q, k, v, g), one of {', '.join(OPS)}; got {_describe(op)}. "
                    "fla-style calls without an operator name are in hila.torch.fla "
                    "(chunk_simple_gla(q, k, v, g), chunk_gated_delta_rule(q, k, v, g, beta), ...)",
                    "op")


def check_call(call: str, op: Any, extra: tuple, unknown: dict) -> None:
    """The argument checks of a call that takes ``op, q, k, v, g`` positionally, ``*extra`` and
    ``**unknown`` (:func:`check_op`, :func:`check_no_extra_positional`,
    :func:`check_no_unknown_keywords`, in that order). Callers run it only when one can fail
    (``extra or unknown or not isinstance(op, str)``), so a good call pays three tests."""
    check_op(op, call)
    check_no_extra_positional(call, extra)
    check_no_unknown_keywords(call, unknown)


def check_no_extra_positional(call: str, extra: tuple) -> None:
    """Raises HilaError when a call got more positional arguments than (op, q, k, v, g): every
    other argument is keyword-only (``lam=``, ``beta=``, ``initial_state=``, ...)."""
    if extra:
        raise HilaError(f"hila: {call}() takes op, q, k, v and g positionally and every other argument "
                        f"by keyword (lam=, beta=, cu_seqlens=, initial_state=, ...), got {len(extra)} "
                        f"more positional argument(s): {', '.join(_describe(x) for x in extra)}")


_FLA_NAMES = {"use_qk_l2norm_in_kernel": "qk_l2norm", "level_scales": "lam",
              "ssm_state_indices": "state_indices (hila.torch.forward / step_)"}


def check_no_unknown_keywords(call: str, unknown: dict) -> None:
    """Raises HilaError naming the first keyword argument ``call`` does not take (with hila's name
    for fla's names)."""
    if unknown:
        name = next(iter(unknown))
        hint = f"; hila's name is {_FLA_NAMES[name]}" if name in _FLA_NAMES else ""
        raise HilaError(f"hila: argument '{name}': {call}() does not take it{hint} (fla's names and "
                        "conventions are in hila.torch.fla)", name)


def _describe(x: Any) -> str:
    """What a value is, for error messages (never its contents)."""
    kind = type(x).__name__
    article = "an" if kind[:1].lower() in "aeiou" else "a"
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"{article} {kind} of dtype {_dtype_name(x)} and shape {list(x.shape)}"
    return f"{article} {kind}" + (f" ({x!r})" if isinstance(x, (str, int, float)) else "")


def _number(name: str, x: Any) -> Optional[float]:
    if x is None and name == "scale":
        return None
    try:
        if isinstance(x, (bool, np.bool_, str, bytes)):  # float("0.5") would pass a string
            raise TypeError
        return float(x)
    except (TypeError, ValueError, OverflowError):
        raise HilaError(f"hila: argument '{name}': expected a number, got {_describe(x)}", name) from None


@functools.lru_cache(maxsize=256, typed=True)  # typed: check_values=1 is not check_values=True
def _cached_config(op, scale, normalize, eps, ridge, qk_l2norm, check_values) -> _C.Config:
    return config(op, scale=scale, normalize=normalize, eps=eps, ridge=ridge, qk_l2norm=qk_l2norm,
                  check_values=check_values)


def _config(op, scale, normalize, eps, ridge, qk_l2norm, check_values) -> _C.Config:
    """config() of a call, built once per distinct options (a Config is read-only)."""
    try:
        return _cached_config(op, scale, normalize, eps, ridge, qk_l2norm, check_values)
    except TypeError:  # an unhashable option (a list, an array): config() names it
        return config(op, scale=scale, normalize=normalize, eps=eps, ridge=ridge, qk_l2norm=qk_l2norm,
                      check_values=check_values)


atexit.register(_cached_config.cache_clear)  # no extension objects left for nanobind's exit-time leak check


# ----------------------------------------------------------------------------- array families

_FRAMEWORK_WORKSPACE = [os.environ.get("HILA_FRAMEWORK_WORKSPACE", "0") == "1"]
# Test hook (HILA_POISON_OUTPUTS=1 or tests setting it): every output and gradient that hila.ops
# and hila.torch allocate is filled with NaN (integers: their most negative value) before the
# library writes it, so any element a call left unwritten shows.
_POISON_OUTPUTS = [os.environ.get("HILA_POISON_OUTPUTS", "0") == "1"]


def _poison(x: Array) -> Array:
    """x filled with NaN (integer arrays: their most negative value); see _POISON_OUTPUTS."""
    kind = str(x.dtype)
    bad = float("nan") if "float" in kind else -(2 ** (8 * int(x.itemsize) - 1))
    if hasattr(x, "fill_"):
        x.fill_(bad)
    else:
        x.fill(bad)
    return x


def use_framework_workspace(on: bool = True) -> bool:
    """Whether CUDA calls on torch tensors take their device temporaries from torch's caching
    allocator (on) or from the device's stream-ordered pool (off, the default for now; the
    environment variable ``HILA_FRAMEWORK_WORKSPACE=1`` turns it on at import). With it on, the
    temporaries count in ``torch.cuda.memory_allocated()`` and nothing stays cached outside torch.
    Returns the previous setting."""
    prev = _FRAMEWORK_WORKSPACE[0]
    _FRAMEWORK_WORKSPACE[0] = bool(on)
    return prev


_CHECKED_BYTES = 1 << 26  # host allocations from this size on are checked against memory_limit()


def check_host_bytes(name: str, *arrays: Tuple[Optional[Sequence[int]], int]) -> None:
    """HilaError(name) when arrays of these (shape, itemsize) (None: absent) would together take
    more host memory than a hila call may (``_C.memory_limit()``: the machine's memory,
    HILA_MAX_MEMORY, hila::set_memory_limit), before numpy or torch try the allocation (a
    MemoryError, or an overcommitted block that fails when it is written)."""
    n = 0
    for shape, itemsize in arrays:
        if shape is not None:
            n += math.prod(int(d) for d in shape) * itemsize
    if n >= _CHECKED_BYTES and n > _C.memory_limit():
        shapes = " + ".join(str(list(shape)) for shape, _ in arrays if shape is not None)
        raise HilaError(f"hila: argument '{name}': needs {n} bytes of host memory for arrays of shape "
                        f"{shapes}, more than the {_C.memory_limit()} bytes hila may take (the "
                        "machine's memory, HILA_MAX_MEMORY or hila::set_memory_limit)", name)


class _Family:
    """Allocates outputs with the array library of a reference array."""

    def __init__(self, like: Array):
        self.like = like
        root = type(like).__module__.split(".")[0]
        self.torch = root == "torch"
        self.xp = None
        self.immutable = False
        if not self.torch and root != "numpy" and hasattr(like, "__array_namespace__"):
            self.xp = like.__array_namespace__()
            self.immutable = self.xp.__name__.split(".")[0] == "jax"

    def host(self) -> bool:
        """Whether the arrays of this family live in host memory (numpy, torch CPU tensors)."""
        return self.like.device.type == "cpu" if self.torch else self.xp is None or self.immutable

    def empty(self, shape: Sequence[int], dtype: str, name: str = "o") -> Array:
        """An uninitialised output ``name``: the library writes every element of each output it is
        given (outputs, final states, gradients), so none needs a fill."""
        if self.host():
            check_host_bytes(name, (shape, np.dtype(dtype).itemsize))
        if self.torch:
            import torch
            x = torch.empty(tuple(shape), dtype=getattr(torch, dtype), device=self.like.device)
        elif self.xp is not None and not self.immutable:
            x = self.xp.empty(tuple(shape), dtype=getattr(self.xp, dtype))
        else:
            x = np.empty(tuple(shape), dtype=np.dtype(dtype))
        return _poison(x) if _POISON_OUTPUTS[0] else x

    def zeros(self, shape: Sequence[int], dtype: str, name: str = "state.pos") -> Array:
        """A zero array (what must start at zero, e.g. the positions of a bare-array state)."""
        if self.host():
            check_host_bytes(name, (shape, np.dtype(dtype).itemsize))
        if self.torch:
            import torch
            return torch.zeros(tuple(shape), dtype=getattr(torch, dtype), device=self.like.device)
        if self.xp is not None and not self.immutable:
            return self.xp.zeros(tuple(shape), dtype=getattr(self.xp, dtype))
        return np.zeros(tuple(shape), dtype=np.dtype(dtype))

    def workspace(self, stream: int):
        """The allocator of a call's device temporaries (``_C.forward(workspace=...)``): torch's
        caching allocator when the call runs on torch's current stream of a CUDA device (so the
        memory is torch's, counted by torch.cuda.memory_allocated and reused in that stream's
        order); else None, and hila takes them from the device's stream-ordered pool."""
        if not _FRAMEWORK_WORKSPACE[0] or not self.torch or self.like.device.type != "cuda":
            return None
        import torch
        dev = self.like.device
        if stream != torch.cuda.current_stream(dev).cuda_stream:
            return None
        return lambda n: torch.empty(n, dtype=torch.uint8, device=dev)

    def finish(self, x: Optional[Array]) -> Optional[Array]:
        """Outputs as arrays of the caller's library (jax: numpy -> jax)."""
        return self.xp.asarray(x) if (self.immutable and x is not None) else x


def _dtype_name(x: Array) -> str:
    return str(x.dtype).rsplit(".", 1)[-1]


def _state_dtype(q: Array) -> str:
    return "float64" if _dtype_name(q) == "float64" else "float32"


def _arr(x: Optional[Array]) -> Optional[Array]:
    """Arrays pass through (nanobind reads them over DLPack); sequences become numpy arrays."""
    if x is None or hasattr(x, "__dlpack__") or hasattr(x, "__array_interface__"):
        return x
    return np.asarray(x)


def _state(s: Optional[Sequence[Optional[Array]]], name: str = "state", op: Optional[str] = None,
           grad: bool = False) -> Optional[tuple]:
    """The parts of a state argument. A bare array (fla's convention) is a state only for the
    first-order operators without levels (see :func:`as_state`); ``grad``: a cotangent (no pos)."""
    if s is None:
        return None
    if hasattr(s, "shape") or not isinstance(s, (tuple, list)):
        return _bare_state(s, name, op, grad)
    if len(s) != 4:
        raise HilaError(f"hila: argument '{name}': expected a State (pos, S, P, H), got {len(s)} items",
                        name)
    return tuple(_arr(x) for x in s)


def as_state(op: str, s: Any, name: str = "initial_state", grad: bool = False) -> Optional[State]:
    """``s`` as a :class:`State`: a State passes through; a bare array ``[N, H, dk, dv]`` (fla's
    ``initial_state``) becomes ``State(pos=zeros(N), None, None, s)`` for ``gla`` and ``gdn``,
    the operators whose whole state is that one matrix (their output does not depend on the
    position); anything else raises HilaError naming ``name``."""
    st = _state(s, name, op, grad)
    return None if st is None else State(*st)


def _bare_state(x: Any, name: str, op: Optional[str], grad: bool) -> tuple:
    t = _TRAITS.get(op) if isinstance(op, str) else None
    shape = tuple(getattr(x, "shape", ()))
    if t is not None and not (t["loglinear"] or t["has_S"] or t["has_P"]) and len(shape) == 4:
        x = _arr(x)
        return (None if grad else _Family(x).zeros((shape[0],), "int64"), None, None, x)
    why = (f"'{op}' keeps a State with positions{' and several parts' if t and (t['has_S'] or t['has_P']) else ''}"
           if t is not None and len(shape) == 4 else "a bare array is a state only as the [N, H, dk, dv] "
           "matrix of gla or gdn")
    raise HilaError(f"hila: argument '{name}': expected a hila.State (pos, S, P, H) ({why}), got "
                    f"{_describe(x)}", name)


def _stream(stream: Optional[int]) -> int:
    if stream is None:
        return 0
    if isinstance(stream, (int, np.integer)) and not isinstance(stream, (bool, np.bool_)) and 0 <= stream < 2**64:
        return int(stream)
    raise HilaError(f"hila: argument 'stream': expected a cudaStream_t as an int in [0, 2^64) (0: the "
                    f"default stream), got {_describe(stream)}", "stream")


def _required(**arrays: Any) -> None:
    """HilaError naming the first required array that is None (callers test for None first, so a
    good call pays only those tests)."""
    for name, x in arrays.items():
        if x is None:
            raise HilaError(f"hila: argument '{name}': is required, got None", name)


def _is_ml_bf16(x: Any) -> bool:
    """A numpy array of ml_dtypes' bfloat16 (numpy's DLPack export does not carry that dtype)."""
    return isinstance(x, np.ndarray) and x.dtype.name == "bfloat16"


def _bf16(x: Any) -> Any:
    """ml_dtypes bfloat16 numpy arrays (also inside state tuples) as DLPack bfloat16 arrays aliasing
    their bits (read and written in place); everything else as it is."""
    if _is_ml_bf16(x):
        if not x.flags.c_contiguous:
            x = np.ascontiguousarray(x)
        return _C._bf16_view(x.view(np.uint16))
    if isinstance(x, tuple):
        return tuple(_bf16(y) for y in x)
    return x


def _bad_array(x: Any) -> bool:
    if x is None:
        return False
    if isinstance(x, np.ndarray):
        return (x.dtype.kind not in "biuf" or not x.dtype.isnative) and not _is_ml_bf16(x)
    return not hasattr(x, "__dlpack__")


def _lazy_bit(x: Any) -> bool:
    """Whether x is a torch tensor with a lazy negation or conjugation bit set: its memory holds
    other values than it stands for, and DLPack hands over the memory without the bit."""
    is_neg = getattr(x, "is_neg", None)
    return callable(is_neg) and (is_neg() or x.is_conj())


def _check_lazy_bits(checks, args, kwargs) -> None:
    """HilaError naming the first array argument (or state part) of a call that has a lazy bit
    (see :func:`_lazy_bit`); the names come from ``kwargs`` or from ``checks``."""
    parts = lambda x: x if isinstance(x, tuple) else (x,)  # noqa: E731  (a state's parts)
    bad = next((y for a in (*args, *kwargs.values()) for y in parts(a) if y is not None and _lazy_bit(y)), None)
    if bad is None:
        return
    named = list(kwargs.items()) + [(n, x) for n, x, _ in (checks() if callable(checks) else checks)]
    name = next((n for n, x in named if any(y is bad for y in parts(x))), "array")
    raise HilaError(f"hila: argument '{name}': expected an array without torch's lazy negation or conjugation "
                    f"bit (DLPack hands over the raw memory without it: call .resolve_neg() / .resolve_conj() "
                    f"first), got one with it set", name)


def _call_C(fn, checks, *args, **kwargs):
    """Calls the extension; its (nanobind) TypeError for an argument of the wrong type becomes a
    HilaError naming the argument. ``checks``: (name, value, kind), kind 'str', 'int', 'array' or
    'state' (a tuple of arrays), or a function returning them (built only when the call failed or
    named an array with a lazy bit, see :func:`_check_lazy_bits`).

    nanobind raises that TypeError while converting the arguments, before the call runs, so a call
    that failed on an ml_dtypes bfloat16 numpy array (which numpy cannot export over DLPack) is
    retried once with those arrays as DLPack bfloat16 views: only such calls pay for the look."""
    _check_lazy_bits(checks, args, kwargs)
    try:
        return fn(*args, **kwargs)
    except TypeError as e:
        exc = e
    conv = tuple(_bf16(a) for a in args)
    conv_kw = {n: _bf16(x) for n, x in kwargs.items()}
    if any(a is not b for a, b in zip(conv, args)) or any(conv_kw[n] is not kwargs[n] for n in kwargs):
        try:
            return fn(*conv, **conv_kw)
        except TypeError as e:
            exc = e
    for name, x, kind in (checks() if callable(checks) else checks):  # name what nanobind refused
        if kind == "str" and not isinstance(x, str):
            expected = f"a string ({', '.join(FORMS)})" if name == "form" else "a string"
        elif kind == "int" and (not isinstance(x, (int, np.integer)) or isinstance(x, bool)):
            expected = "an int"
        elif kind == "int" and not -2**63 <= int(x) < 2**63:
            expected = "an int in [-2^63, 2^63)"
        elif kind == "bool" and not isinstance(x, (bool, np.bool_)):
            expected = "a bool"
        elif kind == "array" and _bad_array(x):
            expected = ("an array in the machine's byte order" if isinstance(x, np.ndarray) and x.dtype.kind
                        in "biuf" else "an array of numbers (numpy, torch, cupy, jax: anything with __dlpack__)")
        elif kind == "state" and x is not None and any(_bad_array(p) for p in x):
            part = next(f for f, p in zip(State._fields, x) if _bad_array(p))
            name, x, expected = f"{name}.{part}", x[State._fields.index(part)], "an array of numbers"
        else:
            continue
        raise HilaError(f"hila: argument '{name}': expected {expected}, got {_describe(x)}",
                        name) from None
    raise HilaError(f"hila: invalid argument types: {str(exc).splitlines()[0]}") from None


_NO_FORM = object()  # the form argument of _checks for a step, which takes no form and chunk


def _checks(form, chunk, q, k, v, g, lam, beta, cu_seqlens, **states_and_arrays) -> list:
    """The (name, value, kind) list of :func:`_call_C` for an operator call."""
    out = [] if form is _NO_FORM else [("form", form, "str"), ("chunk", chunk, "int")]
    out += [(n, x, "array") for n, x in (("q", q), ("k", k), ("v", v), ("g", g), ("lam", lam),
                                         ("beta", beta), ("cu_seqlens", cu_seqlens))]
    out += [(n, x, "state" if isinstance(x, tuple) else "array") for n, x in states_and_arrays.items()]
    return out


def _ndim(x: Optional[Array]) -> int:
    return -1 if x is None else len(x.shape)


def _max_final_position(T: int, B: int, cu_seqlens: Optional[Array], init_pos: Optional[Array]) -> int:
    """max_i (n0_i + len_i) over the sequences of a call, read from the (host) arrays; 0 when
    they cannot be read, which leaves the report of what is wrong with them to the C++ checks."""
    try:
        if cu_seqlens is None:  # every sequence has T tokens: no [B] array (B may be huge at T = 0)
            if init_pos is None:
                return int(T)
            n0 = np.asarray(init_pos, dtype=np.int64)
            return int(n0.max()) + int(T) if n0.size and n0.shape == (B,) else 0
        else:
            cu = np.asarray(cu_seqlens, dtype=np.int64)
            lens = cu[1:] - cu[:-1]
        n0 = np.zeros_like(lens) if init_pos is None else np.asarray(init_pos, dtype=np.int64)
        return int((n0 + lens).max()) if lens.size and lens.shape == n0.shape else 0
    except (TypeError, ValueError, RuntimeError, OverflowError):
        return 0


def check_slots(name: str, x: Any) -> int:
    """A Fenwick slot count argument (``final_slots``, ``out_slots``) as an int in [1, 64]: 64 slots
    hold every position up to the bound 2^62 (``state_slots(2**62)``); HilaError naming it."""
    if isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_)) and 1 <= x <= 64:
        return int(x)
    raise HilaError(f"hila: argument '{name}': expected an int in [1, 64] (Fenwick slots; 64 hold every "
                    f"position up to 2^62), got {_describe(x)}", name)


def _allocate_state(fam: _Family, op: str, N: int, H: int, dk: int, dv: int, normalize: bool,
                    slots: int, dtype: str, with_pos: bool = True) -> State:
    shapes = state_part_shapes(op, N, H, dk, dv, normalize=normalize, slots=slots)
    if fam.host():  # the parts together (each is checked again as it is allocated)
        item = np.dtype(dtype).itemsize
        check_host_bytes("final_state", (shapes.pos, 8), (shapes.S, item), (shapes.P, item), (shapes.H, item))
    return State(
        pos=fam.empty(shapes.pos, "int64", "final_state.pos") if with_pos else None,
        S=None if shapes.S is None else fam.empty(shapes.S, dtype, "final_state.S"),
        P=None if shapes.P is None else fam.empty(shapes.P, dtype, "final_state.P"),
        H=fam.empty(shapes.H, dtype, "final_state.H"),
    )


def _like_state(fam: _Family, s: Optional[Sequence[Optional[Array]]]) -> Optional[State]:
    """Arrays shaped like the S, P, H parts of s (gradients: no pos)."""
    if s is None:
        return None
    z = [None if x is None else fam.empty(tuple(x.shape), _dtype_name(x)) for x in s[1:]]
    return State(None, *z)


def _finish_state(fam: _Family, s: Optional[State]) -> Optional[State]:
    return None if s is None else State(*(fam.finish(x) for x in s))


# ----------------------------------------------------------------------------- calls

def forward(op: str, q: Array, k: Array, v: Array, g: Optional[Array] = None, *extra,
            lam: Optional[Array] = None, beta: Optional[Array] = None,
            cu_seqlens: Optional[Array] = None, initial_state: Optional[State] = None,
            output_final_state: bool = False, final_slots: Optional[int] = None,
            form: str = "chunk", chunk: int = 64, scale: Optional[float] = None,
            normalize: bool = False, eps: float = 1e-6, ridge: float = 0.0,
            qk_l2norm: bool = False, check_values: bool = True,
            stream: Optional[int] = None, **unknown) -> Tuple[Array, Optional[State]]:
    """Runs operator ``op`` over whole sequences.

    Args:
        op: one of :data:`OPS`.
        q, k: [B, T, G, dk] queries and keys (float64, float32, bfloat16 or float16).
        v: [B, T, H, dv] values, H a multiple of G.
        g: optional log-gates <= 0, [B, T, H] (tied) or [B, T, H, P] (untied, HLA family).
        lam: [B, T, H, L] level weights, log-linear operators only; L >= levels_needed(n0, T).
        beta: [B, T, H] delta-rule step sizes, gdn and loglinear_gdn only.
        cu_seqlens: int32/int64 [N + 1] offsets of packed sequences (B == 1); each sequence has
            its own positions, gates, levels and chunk alignment.
        initial_state: a :class:`State` for the N sequences (``pos`` required).
        output_final_state: also return the state after the call.
        final_slots: Fenwick slots of a log-linear final ``H``; None: exactly
            ``state_slots(max final position)``. More slots are allowed (zero capacity).
        form: ``naive`` (float64 masked matrix), ``serial``, ``chunk`` or ``scan``.
        chunk: chunk size of the chunk and scan forms, a power of two.
        scale: query scale; None: dk ** -0.5.
        normalize: HLA family: o = num / (den + eps) (the state carries dv + 1 columns).
        eps: normalize epsilon.
        ridge: hla2 / loglinear_hla2: S -> S + ridge * I.
        qk_l2norm: gdn / loglinear_gdn: L2-normalise q and k inside the operator.
        check_values: reject g > 0 and non-finite inputs (O(size) host reads).
        stream: cudaStream_t as an int for CUDA arrays (unused on the CPU).

    Returns:
        ``(o, final_state)``: o [B, T, H, dv] with the dtype of v, and a :class:`State` or None.
    """
    if extra or unknown or not isinstance(op, str):
        check_call("hila.forward", op, extra, unknown)
    if q is None or k is None or v is None:
        _required(q=q, k=k, v=v)
    cfg = _config(op, scale, normalize, eps, ridge, qk_l2norm, check_values)
    q, k, v, g, lam, beta, cu_seqlens = map(_arr, (q, k, v, g, lam, beta, cu_seqlens))
    init = _state(initial_state, "initial_state", op)
    fam = _Family(q)
    o = fam.empty(tuple(v.shape), _dtype_name(v))
    final = None
    if output_final_state and _ndim(q) == 4 and _ndim(v) == 4:
        B, T, _, dk = q.shape
        H, dv = v.shape[2], v.shape[3]
        N = B if cu_seqlens is None or _ndim(cu_seqlens) != 1 else max(cu_seqlens.shape[0] - 1, 0)
        if final_slots is None:
            final_slots = state_slots(_max_final_position(T, B, cu_seqlens, None if init is None else init[0]))
        final_slots = check_slots("final_slots", final_slots)
        final = _allocate_state(fam, op, N, H, dk, dv, normalize, final_slots, _state_dtype(q))
    st = _stream(stream)
    _call_C(_C.forward, lambda: _checks(form, chunk, q, k, v, g, lam, beta, cu_seqlens,
                                        initial_state=init), cfg,
            form, chunk, q, k, v, g, lam, beta, cu_seqlens, init, o=o, final_state=final, stream=st,
            workspace=fam.workspace(st))
    return fam.finish(o), _finish_state(fam, final)


def backward(op: str, q: Array, k: Array, v: Array, g: Optional[Array] = None, *extra, do: Array = None,
             lam: Optional[Array] = None, beta: Optional[Array] = None,
             cu_seqlens: Optional[Array] = None, initial_state: Optional[State] = None,
             d_final_state: Optional[State] = None, form: str = "chunk", chunk: int = 64,
             scale: Optional[float] = None, normalize: bool = False, eps: float = 1e-6,
             ridge: float = 0.0, qk_l2norm: bool = False, check_values: bool = True,
             stream: Optional[int] = None, **unknown) -> Grads:
    """Gradients of ``<o, do> + <final_state, d_final_state>`` with respect to every input.

    Arguments as in :func:`forward`, plus:
        do: [B, T, H, dv] cotangent of o.
        d_final_state: optional cotangent of the final state (``pos`` ignored; S, P, H shaped as
            the final state, a log-linear H with at least the slots its positions need).

    Forms with a backward: naive and chunk for every operator, serial for gla/hla2/ahla/hla3.

    Returns:
        :class:`Grads`, each gradient with the shape and dtype of its input.
    """
    if extra or unknown or not isinstance(op, str):
        check_call("hila.backward", op, extra, unknown)
    if q is None or k is None or v is None:
        _required(q=q, k=k, v=v)
    if do is None:
        raise HilaError("hila: argument 'do': is required (the cotangent of o, [B, T, H, dv]), got None", "do")
    cfg = _config(op, scale, normalize, eps, ridge, qk_l2norm, check_values)
    q, k, v, g, lam, beta, cu_seqlens, do = map(_arr, (q, k, v, g, lam, beta, cu_seqlens, do))
    init = _state(initial_state, "initial_state", op)
    dfin = _state(d_final_state, "d_final_state", op, grad=True)
    fam = _Family(q)
    empty_like = lambda x: None if x is None else fam.empty(tuple(x.shape), _dtype_name(x))  # noqa: E731
    dq, dk, dv, dg, dlam, dbeta = map(empty_like, (q, k, v, g, lam, beta))
    d_init = _like_state(fam, init)
    st = _stream(stream)
    _call_C(_C.backward, lambda: _checks(form, chunk, q, k, v, g, lam, beta, cu_seqlens, do=do,
                                         initial_state=init, d_final_state=dfin), cfg, form, chunk, q, k, v, g, lam, beta,
            cu_seqlens, init, do, dfin, dq=dq, dk=dk, dv=dv, dg=dg, dlam=dlam, dbeta=dbeta,
            d_init=d_init, stream=st, workspace=fam.workspace(st))
    f = fam.finish
    return Grads(f(dq), f(dk), f(dv), f(dg), f(dlam), f(dbeta), _finish_state(fam, d_init))


def step(op: str, q: Array, k: Array, v: Array, g: Optional[Array] = None, *extra, state: State = None,
         lam: Optional[Array] = None, beta: Optional[Array] = None, out_slots: Optional[int] = None,
         scale: Optional[float] = None, normalize: bool = False, eps: float = 1e-6,
         ridge: float = 0.0, qk_l2norm: bool = False, check_values: bool = True,
         stream: Optional[int] = None, **unknown) -> Tuple[Array, State]:
    """One decode step for N sequences on a caller-owned state (functional: returns a new state).

    Args:
        q, k: [N, G, dk]; v: [N, H, dv]; g: optional [N, H] or [N, H, P] (untied).
        lam: [N, H, L] with L >= bitlen(pos) + 1 for every sequence (log-linear operators).
        beta: [N, H] (gdn, loglinear_gdn).
        state: the :class:`State` before the token (``pos`` per sequence; sequences may sit at
            different positions).
        out_slots: Fenwick slots of the returned log-linear ``H``; None: those of ``state.H``,
            grown when a position crosses a power of two. An int must cover the new positions.

    Returns:
        ``(o, new_state)``, o [N, H, dv] with the dtype of v: what :meth:`DecodeState.step`
        computes, as a one-token forward call with ``state`` as initial state (so it runs on every
        device that forward runs on, on the caller's arrays, with no copies).
    """
    if extra or unknown or not isinstance(op, str):
        check_call("hila.step", op, extra, unknown)
    if q is None or k is None or v is None:
        _required(q=q, k=k, v=v)
    cfg = _config(op, scale, normalize, eps, ridge, qk_l2norm, check_values)
    q, k, v, g, lam, beta = map(_arr, (q, k, v, g, lam, beta))
    st = _state(state, "state", op)
    if st is None:
        raise HilaError("hila: argument 'state': is required (the state before the token), got None",
                        "state")
    fam = _Family(q)
    o = fam.empty(tuple(v.shape), _dtype_name(v))
    out = []
    for i, x in enumerate(st):
        shape = None if x is None else list(x.shape)
        if shape is not None and i == 3 and _traits(op)["loglinear"] and len(shape) == 5:
            if out_slots is None:
                out_slots = max(shape[2], state_slots(_max_final_position(1, len(st[0]), None, st[0])))
            shape[2] = check_slots("out_slots", out_slots)
        out.append(None if x is None else fam.empty(shape, _dtype_name(x), f"state_out.{State._fields[i]}"))
    _call_C(_C.step, lambda: _checks(_NO_FORM, None, q, k, v, g, lam, beta, None, state=st), cfg, q,
            k, v, g, lam, beta, st, o=o, state_out=tuple(out), stream=_stream(stream))
    return fam.finish(o), _finish_state(fam, State(*out))


def step_(op: str, q: Array, k: Array, v: Array, g: Optional[Array] = None, *extra, state: State = None,
          lam: Optional[Array] = None, beta: Optional[Array] = None, scale: Optional[float] = None,
          normalize: bool = False, eps: float = 1e-6, ridge: float = 0.0, qk_l2norm: bool = False,
          check_values: bool = True, stream: Optional[int] = None, **unknown) -> Array:
    """One fused decode step for N sequences, updating a caller-owned state IN PLACE.

    The library's decode kernel (``hila::step`` on a ``StateView``), on the device of the arrays
    (CPU, or CUDA with the CUDA backend): unlike :func:`step`, which returns a new state, it
    overwrites ``state``'s arrays (``pos`` included: every position advances by one).

    Args:
        q, k: [N, G, dk]; v: [N, H, dv]; g: optional [N, H] or [N, H, P] (untied).
        lam: [N, H, L] with L >= bitlen(pos) + 1 for every sequence (log-linear operators).
        beta: [N, H] (gdn, loglinear_gdn).
        state: the :class:`State` before the token, writable arrays of one array library on
            q's device: pos int64 [N]; S [N, H, dk(dk+1)/2]; P [N, H, dk, dv']; H [N, H, dk, dv']
            or, log-linear, [N, H, Ls, dk, dv'] with Ls >= bitlen(pos + 1) + 1 for every sequence
            (never grown here: allocate the slots of the longest sequence to come, or use
            :class:`DecodeState`). Float parts all float32 or all float64 (on CUDA: float64
            exactly for float64 inputs). Immutable arrays (jax) cannot be stepped in place.
        Other options as in :func:`forward`; ``check_values`` covers the step inputs (not the state
            passed in) and, after the step, o and the state it wrote: a step that fails that check
            raises HilaError with ``state`` already advanced (holding the values the error names).

    Returns:
        o [N, H, dv] with the dtype of v, allocated by the array library of q. The state now
        holds the state after the token.
    """
    if extra or unknown or not isinstance(op, str):
        check_call("hila.step_", op, extra, unknown)
    if q is None or k is None or v is None:
        _required(q=q, k=k, v=v)
    cfg = _config(op, scale, normalize, eps, ridge, qk_l2norm, check_values)
    q, k, v, g, lam, beta = map(_arr, (q, k, v, g, lam, beta))
    st = _state(state, "state", op)
    if st is None:
        raise HilaError("hila: argument 'state': is required (the state to advance), got None", "state")
    for name, x in zip(State._fields, st):
        if x is None:
            continue
        if getattr(getattr(x, "flags", None), "writeable", True) is False or _Family(x).immutable:
            raise HilaError(f"hila: argument 'state.{name}': expected a writable array (step_ "
                            f"updates the state in place), got a read-only {type(x).__name__}",
                            f"state.{name}")
    fam = _Family(q)
    o = fam.empty(tuple(v.shape), _dtype_name(v))
    _call_C(_C.step_inplace, lambda: _checks(_NO_FORM, None, q, k, v, g, lam, beta, None, state=st), cfg,
            q, k, v, g, lam, beta, st, o=o, stream=_stream(stream))
    return fam.finish(o)


_DLPACK_CPU, _DLPACK_CUDA = 1, 2


def _device(device: Any) -> Tuple[int, int]:
    """A DLPack device (type, id) from 'cpu', 'cuda', 'cuda:N', a torch.device, an int (CUDA
    index), a DLPack (type, id) pair or an array (its __dlpack_device__)."""
    if device is None:
        return (_DLPACK_CPU, 0)
    if hasattr(device, "__dlpack_device__"):
        device = device.__dlpack_device__()
    if isinstance(device, tuple) and len(device) == 2:
        t, i = int(device[0]), int(device[1])
        return (_DLPACK_CPU, 0) if t == 3 else (t, i)  # kDLCUDAHost is host memory
    if isinstance(device, int) and not isinstance(device, bool):
        return (_DLPACK_CUDA, device)
    text = str(device)  # torch.device('cuda', 1) -> 'cuda:1'
    kind, _, index = text.partition(":")
    if kind == "cpu" and not index:
        return (_DLPACK_CPU, 0)
    if kind == "cuda":
        if not index:
            try:  # torch's current device, as torch.zeros(device='cuda') would use
                import sys
                torch = sys.modules.get("torch")
                return (_DLPACK_CUDA, torch.cuda.current_device() if torch is not None and
                        torch.cuda.is_available() else 0)
            except Exception:  # pragma: no cover - depends on the machine
                return (_DLPACK_CUDA, 0)
        if index.isdigit():
            return (_DLPACK_CUDA, int(index))
    raise HilaError(f"hila: argument 'device': expected 'cpu', 'cuda', 'cuda:N', a torch.device or "
                    f"a DLPack (type, id) pair, got {device!r}", "device")


def _device_copy(x: Any) -> Array:
    """A copy of a DLPack array in device memory, made by the array library that can (torch, then
    cupy)."""
    try:
        import torch
        return torch.from_dlpack(x).clone()
    except ImportError:
        pass
    try:
        import cupy
        return cupy.from_dlpack(x).copy()
    except ImportError:
        raise HilaError("hila: argument 'device': copying a CUDA decode state needs torch or cupy; "
                        "use DecodeState.view() for DLPack arrays aliasing it", "device") from None


def _native_attr(name: str, doc: Optional[str] = None) -> property:
    """A read-only property that returns attribute ``name`` of the wrapped native object ``_st``."""
    return property(lambda self: getattr(self._st, name), doc=doc)


class DecodeState:
    """An owning decode state (``hila::DecodeState``) for N sequences x H heads, stepped one token
    at a time with the library's fused step. Its memory is managed by hila on its ``device``: host
    memory (``device='cpu'``, the default) or a CUDA device (``'cuda'``, ``'cuda:N'``, a
    ``torch.device``; needs the CUDA backend). Log-linear states grow one Fenwick slot per
    doubling of the position (:meth:`reserve` grows them ahead).

    Example::

        o, fin = hila.forward("hla2", q, k, v, g, output_final_state=True)   # prefill
        st = hila.DecodeState.from_state("hla2", fin)                        # on fin's device
        o_t = st.step(q_t, k_t, v_t, g_t)                                    # [N, H, dv]

    On CUDA, step inputs live on the state's device and run on ``stream`` (a ``cudaStream_t`` as
    an int; hila.torch callers pass ``torch.cuda.current_stream().cuda_stream``); :meth:`state`
    returns torch tensors (cupy arrays without torch) on that device, :meth:`view` DLPack arrays
    aliasing the state.
    """

    def __init__(self, op: str, batch: int, heads: int, dk: int, dv: int, *, dtype: str = "float32",
                 device: Any = "cpu", scale: Optional[float] = None, normalize: bool = False,
                 eps: float = 1e-6, ridge: float = 0.0, qk_l2norm: bool = False,
                 check_values: bool = True):
        """A zero state at position 0. ``dtype``: 'float32' or 'float64', the compute type of the
        inputs to come (float64 inputs need a float64 state). ``device``: 'cpu', 'cuda',
        'cuda:N', a torch.device, a DLPack (type, id) pair or an array whose device to take."""
        self._cfg = config(op, scale=scale, normalize=normalize, eps=eps, ridge=ridge,
                           qk_l2norm=qk_l2norm, check_values=check_values)
        dtype = str(dtype).rsplit(".", 1)[-1]  # also torch.float64 / np.float64
        dev_type, dev_id = _device(device)
        self._st = _call_C(_C.DecodeState, [(n, x, "int") for n, x in (("batch", batch), ("heads", heads),
                                                                        ("dk", dk), ("dv", dv))],
                           self._cfg, batch, heads, dk, dv, dtype, device_type=dev_type, device_id=dev_id)

    @classmethod
    def from_state(cls, op: str, state: State, *, device: Any = None,
                   **config_kwargs) -> "DecodeState":
        """A decode state loaded from ``state`` (e.g. a prefill's final state); sizes and dtype
        are read from ``state.H``, the device too unless ``device`` is given (the state must then
        already live there). ``config_kwargs`` as in :func:`forward` (scale, normalize, ...)."""
        st = _state(state, "state", op)
        H = None if st is None else st[3]
        if H is None or len(H.shape) < 4:
            raise HilaError("hila: argument 'state.H': expected [N, H, (Ls,) dk, dv'], got "
                            f"{None if H is None else tuple(H.shape)}", "state.H")
        dv = H.shape[-1] - (1 if config_kwargs.get("normalize") else 0)
        if device is None:
            device = H.__dlpack_device__() if hasattr(H, "__dlpack_device__") else "cpu"
        self = cls(op, H.shape[0], H.shape[1], H.shape[-2], dv, dtype=_dtype_name(H), device=device,
                   **config_kwargs)
        self.load(st)
        return self

    def step(self, q: Array, k: Array, v: Array, g: Optional[Array] = None, *,
             lam: Optional[Array] = None, beta: Optional[Array] = None,
             stream: Optional[int] = None) -> Array:
        """One token for every sequence and head: q, k [N, G, dk], v [N, H, dv], g [N, H] or
        [N, H, P], lam [N, H, L], beta [N, H], all on the state's device. Returns o [N, H, dv]
        (dtype of v, allocated by q's array library); updates the state. With value checks on, a
        step whose o or new state is not finite raises HilaError after advancing the state (which
        then holds those values: :meth:`load` a good state, or discard it)."""
        if q is None or k is None or v is None:
            _required(q=q, k=k, v=v)
        q, k, v, g, lam, beta = map(_arr, (q, k, v, g, lam, beta))
        fam = _Family(q)
        o = fam.empty(tuple(v.shape), _dtype_name(v))
        _call_C(self._st.step, lambda: _checks(_NO_FORM, None, q, k, v, g, lam, beta, None), q, k, v, g,
                lam, beta, o=o, stream=_stream(stream))
        return fam.finish(o)

    def load(self, state: State) -> None:
        """Copies ``state`` in (validated like an initial state; arrays on the state's device)."""
        st = _state(state, "state", self.op)
        if st is None:
            raise HilaError("hila: argument 'state': is required (the State to copy in), got None", "state")
        _call_C(self._st.load, [("state", st, "state")], st)

    def view(self) -> State:
        """The current state as arrays aliasing hila's memory (numpy on the CPU, DLPack arrays for
        ``torch.from_dlpack`` on CUDA). The arrays keep their memory alive: after a step, load or
        reserve that grows the state into new memory they show the state as it was (never freed
        memory). Write the state through :meth:`load`, not through these arrays."""
        return State(*self._st.view())

    def state(self) -> State:
        """A copy of the current state (log-linear H at the current capacity): numpy arrays on the
        CPU; on CUDA, torch tensors on the state's device (cupy arrays without torch)."""
        if self.on_cuda:
            return State(*(None if x is None else _device_copy(x) for x in self._st.view()))
        return State(*(None if x is None else np.array(x, copy=True) for x in self._st.view()))

    def reserve(self, max_pos: int) -> None:
        """Grows the Fenwick slot capacity so positions up to ``max_pos`` need no reallocation."""
        _call_C(self._st.reserve, [("max_pos", max_pos, "int")], max_pos)

    def position(self, seq: int) -> int:
        """Tokens consumed by sequence ``seq``."""
        return _call_C(self._st.position, [("seq", seq, "int")], seq)

    @property
    def positions(self) -> np.ndarray:
        """int64 [N] tokens consumed per sequence (a host copy, also for a CUDA state)."""
        if self.on_cuda:
            return np.array([self._st.position(i) for i in range(self.batch)], dtype=np.int64)
        return np.array(self._st.view()[0], copy=True)

    @property
    def device(self) -> str:
        """'cpu' or 'cuda:N'."""
        t, i = self._st.device
        return f"cuda:{i}" if t == _DLPACK_CUDA else "cpu"

    @property
    def on_cuda(self) -> bool:
        return self._st.device[0] == _DLPACK_CUDA

    @property
    def op(self) -> str:
        return self._cfg.op

    # Read-only views of the native state's shape and size.
    batch = _native_attr("batch")
    heads = _native_attr("heads")
    dk = _native_attr("dk")
    dv = _native_attr("dv")
    dtype = _native_attr("dtype")
    slots = _native_attr("slots", "Fenwick slot capacity (1 for operators without levels).")
    bytes_per_sequence = _native_attr(
        "bytes_per_sequence", "Bytes of state per sequence at the current capacity (all heads).")

    def __repr__(self) -> str:
        return (f"DecodeState(op='{self.op}', batch={self.batch}, heads={self.heads}, dk={self.dk}, "
                f"dv={self.dv}, dtype='{self.dtype}', device='{self.device}', slots={self.slots})")
