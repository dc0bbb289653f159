# SPDX-License-Identifier: Apache-2.0
"""hila's operators under flash-linear-attention's (fla's) names, signatures and conventions.

Drop-in replacements for ``fla.ops``: the same function names, positional order, argument names
and return value ``(o, final_state)``, on any device hila runs (CPU, CUDA), differentiable::

    from hila.torch.fla import chunk_gated_delta_rule        # instead of fla.ops.gated_delta_rule
    o, ht = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                   use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens)

| function | hila operator | form |
|---|---|---|
| ``chunk_simple_gla`` / ``fused_recurrent_simple_gla`` | ``gla`` | chunk / serial |
| ``chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule`` | ``gdn`` | chunk / serial |
| ``chunk_log_linear_attn`` / ``fused_recurrent_log_linear_attn`` | ``loglinear`` | chunk / serial |
| ``chunk_log_linear_gated_delta_rule`` / ``fused_recurrent_...`` | ``loglinear_gdn`` | chunk / serial |
| ``chunk_hla2``, ``chunk_ahla``, ``chunk_hla3`` / ``fused_recurrent_...`` | ``hla2``, ``ahla``, ``hla3`` | chunk / serial |
| ``chunk_log_linear_hla2`` (``_ahla``, ``_hla3``) / ``fused_recurrent_...`` | ``loglinear_hla2`` ... | chunk / serial |

fla's conventions, as hila applies them:

* Layout ``[B, T, H, ...]`` (sequence-first): q, k ``[B, T, H, K]``; v ``[B, T, HV, V]`` with
  ``HV % H == 0`` (value head ``i`` reads key head ``i // (HV // H)``, fla's GVA); gates ``g``,
  ``beta`` ``[B, T, HV]``; level scales ``[B, T, HV, L]``. ``head_first=True`` (the layout that
  fla has since removed) takes ``[B, H, T, ...]`` as transposed views and returns o the same way.
* Gates in log space (``g <= 0``); ``g_gamma`` ``[H]`` is a data-independent head-wise log decay.
  ``use_gate_in_kernel`` computes ``g = -exp(A_log) * softplus(g + dt_bias)``;
  ``use_beta_sigmoid_in_kernel`` takes beta as logits (``2 * sigmoid`` with ``allow_neg_eigval``).
* ``scale=None`` means ``K ** -0.5``, except for the log-linear Mamba-2 functions, which use 1 as
  fla's ``chunk_log_linear_attn`` does (pass ``scale=`` to change it).
* ``initial_state`` / final state of the first-order operators: a tensor ``[N, HV, K, V]``
  (``[N, HV, V, K]`` with ``state_v_first=True``; views, no copy), float32 (float64 for float64
  inputs; an fla state in bf16 is converted). N sequences: ``B``, or ``len(cu_seqlens) - 1``.
  The log-linear functions take and return :class:`LogLinearAttentionState`, the HLA functions a
  :class:`hila.State` (their states have several parts).
* ``cu_seqlens`` (``[N + 1]``, B == 1) packs sequences; ``cu_seqlens_cpu`` (its host copy) and
  ``max_seqlen`` spare the device reads of it.
* Serving (docs/SERVING.md): ``state_indices`` (alias ``ssm_state_indices``, int32/int64 ``[N]``)
  makes ``initial_state`` a state pool ``[num_slots, ...]`` read at those rows and written back
  in place (fla's ``inplace_final_state``), -1 marking padding rows; the pool is returned as
  the final state. One token per sequence (q ``[N, 1, ...]``, or packed with ``cu_seqlens_cpu``
  showing lengths 1, vLLM's decode call) runs hila's fused decode step (``hila.torch.step_``).
* ``fused_recurrent_*`` run hila's serial form on the CPU and its chunk form on CUDA (the CUDA
  backend has the chunk form and the decode step); both compute the same function.
* Options: ``chunk_size`` (a power of two), ``check_values`` (non-finite values and positive gates
  raise HilaError; default None: checked on the CPU, not on CUDA, as in :func:`hila.torch.forward`),
  HLA ``normalize``, ``ridge``, ``eps``.

Where fla's semantics differ from the math (docs/math/LOGLINEAR.md §12), hila follows the math
and says so: fla's log-linear state drops the top Fenwick level when a sequence ends at
``64 * 2^k`` tokens (prefill + decode is wrong there, E1), and fla treats missing level scales as
0 (E2), where hila raises HilaError naming ``level_scales``. hila's log-linear state is exact at
token granularity (one matrix per Fenwick level of the position, docs/STATES.md), so it needs no
copy of the last partial chunk (fla's ``q_prev``, ``k_prev``, ...).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import ops as _ops
from .._errors import HilaError
from ..ops import State
from .ops import forward as _forward
from .ops import step_ as _step_

__all__ = [
    "LogLinearAttentionState",
    "chunk_simple_gla", "fused_recurrent_simple_gla",
    "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule",
    "chunk_log_linear_attn", "fused_recurrent_log_linear_attn",
    "chunk_log_linear_gated_delta_rule", "fused_recurrent_log_linear_gated_delta_rule",
    "chunk_hla2", "fused_recurrent_hla2", "chunk_ahla", "fused_recurrent_ahla",
    "chunk_hla3", "fused_recurrent_hla3",
    "chunk_log_linear_hla2", "fused_recurrent_log_linear_hla2",
    "chunk_log_linear_ahla", "fused_recurrent_log_linear_ahla",
    "chunk_log_linear_hla3", "fused_recurrent_log_linear_hla3",
    "chunk_gdn", "fused_recurrent_gdn",
]


@dataclass
class LogLinearAttentionState:
    """A log-linear state under fla's name: ``ht`` ``[N, Ls, H, K, V]`` (fla's axis order, level
    before head) and ``offsets`` int64 ``[N]`` (tokens consumed per sequence).

    Unlike fla's state (chunk-level Fenwick levels plus a copy of the last partial chunk's inputs),
    this is hila's exact token-level state (docs/STATES.md): ``ht[:, l]`` is Fenwick slot ``l`` of
    the position, ``Ls = bitlen(max offset) + 1``; :meth:`to_state` and :meth:`from_state` convert
    to and from :class:`hila.State` as views (no copy).
    """

    ht: Tensor
    offsets: Tensor

    @classmethod
    def from_state(cls, state: State) -> "LogLinearAttentionState":
        return cls(ht=state.H.transpose(1, 2), offsets=state.pos)

    def to_state(self) -> State:
        """The same state as a :class:`hila.State` (H ``[N, H, Ls, K, V]``, a view of ``ht``)."""
        return State(self.offsets, None, None, self.ht.transpose(1, 2))


_FIRST_ORDER = ("gla", "gdn")
_LOGLINEAR_H_ONLY = ("loglinear", "loglinear_gdn")

_HILA_KWARGS = ("chunk_size", "head_first", "state_indices", "ssm_state_indices", "max_seqlen",
                "check_values", "cu_seqlens_cpu", "inplace_final_state", "chunk_indices",
                "transpose_state_layout", "final_slots")


def _state_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _describe(x: Any) -> str:
    return _ops._describe(x)


def _initial(op: str, s: Any, q: Tensor, state_v_first: bool, fn: str,
             pool: bool) -> Optional[Union[State, Tensor]]:
    """fla's initial_state as what hila.torch.forward takes (views; a state pool is never
    converted, since it is written in place)."""
    if s is None:
        return None
    if isinstance(s, LogLinearAttentionState):
        if op not in _LOGLINEAR_H_ONLY:
            raise HilaError(f"hila: argument 'initial_state': {fn} takes "
                            f"{'a tensor' if op in _FIRST_ORDER else 'a hila.State'}, got a "
                            "LogLinearAttentionState", "initial_state")
        return s.to_state()
    if hasattr(s, "q_prev") and hasattr(s, "ht"):
        raise HilaError("hila: argument 'initial_state': expected hila.torch.fla.LogLinearAttentionState "
                        "(exact token-level Fenwick slots), got fla's LogLinearAttentionState (chunk-level "
                        "levels plus the raw last chunk, which hila cannot take over); run the prefill "
                        "with hila to get its state", "initial_state")
    if isinstance(s, Tensor):
        if op not in _FIRST_ORDER:
            kind = "LogLinearAttentionState" if op in _LOGLINEAR_H_ONLY else "hila.State (pos, S, P, H)"
            raise HilaError(f"hila: argument 'initial_state': {fn} keeps a {kind} (the state has "
                            f"positions{'' if op in _LOGLINEAR_H_ONLY else ' and several parts'}), "
                            f"got {_describe(s)}", "initial_state")
        if s.dim() != 4:
            raise HilaError(f"hila: argument 'initial_state': expected [N, H, K, V] (or [N, H, V, K] "
                            f"with state_v_first=True), got {_describe(s)}", "initial_state")
        s = s.transpose(-1, -2) if state_v_first else s
        want = _state_dtype(q)
        return s if s.dtype == want or pool else s.to(want)
    return s


def _final(op: str, fin: Optional[State], state_v_first: bool):
    """hila's final state in fla's format."""
    if fin is None:
        return None
    if op in _FIRST_ORDER:
        return fin.H.transpose(-1, -2) if state_v_first else fin.H
    if op in _LOGLINEAR_H_ONLY:
        return LogLinearAttentionState.from_state(fin)
    return fin


def _run(op: str, form: str, fn: str, q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor] = None, *,
         beta: Optional[Tensor] = None, lam: Optional[Tensor] = None, g_gamma: Optional[Tensor] = None,
         scale: Optional[float] = None, initial_state: Any = None, output_final_state: bool = False,
         state_v_first: bool = False, cu_seqlens: Optional[Tensor] = None,
         cu_seqlens_cpu: Optional[Tensor] = None, reverse: bool = False, qk_l2norm: bool = False,
         kwargs: dict) -> Tuple[Tensor, Any]:
    """The common body of every function: fla arguments -> hila.torch.forward -> fla results."""
    opts = {n: kwargs.pop(n) for n in ("normalize", "ridge", "eps") if n in kwargs} \
        if _ops.op_traits(op)["hla_family"] else {}
    extra = {n: kwargs.pop(n) for n in _HILA_KWARGS if n in kwargs}
    if kwargs:
        raise HilaError(f"hila: argument '{next(iter(kwargs))}': {fn} does not take it (hila takes "
                        f"fla's arguments and {', '.join(_HILA_KWARGS)}"
                        f"{', normalize, ridge, eps' if opts or _ops.op_traits(op)['hla_family'] else ''})",
                        next(iter(kwargs)))
    if "transpose_state_layout" in extra:  # fla's former name of state_v_first
        state_v_first = bool(extra.pop("transpose_state_layout")) or state_v_first
    extra.pop("chunk_indices", None)  # fla's precomputed chunk table: hila builds its own
    if extra.pop("inplace_final_state", True) is not True:
        raise HilaError("hila: argument 'inplace_final_state': with state_indices the state pool is "
                        "always updated in place; expected True", "inplace_final_state")
    indices = extra.pop("state_indices", None)
    alias = extra.pop("ssm_state_indices", None)
    if alias is not None:
        if indices is not None:
            raise HilaError("hila: argument 'ssm_state_indices': pass state_indices or its alias "
                            "ssm_state_indices, not both", "ssm_state_indices")
        if alias.dim() != 1:
            raise HilaError("hila: argument 'ssm_state_indices': expected one pool row per sequence "
                            "[N]; per-token rows [N, T] (speculative decoding) are not supported, got "
                            f"{_describe(alias)}", "ssm_state_indices")
        indices = alias
    cu_seqlens_cpu = extra.pop("cu_seqlens_cpu", None) if cu_seqlens_cpu is None else cu_seqlens_cpu
    head_first = bool(extra.pop("head_first", False))
    chunk = extra.pop("chunk_size", None) or 64
    if head_first:  # [B, H, T, ...] -> [B, T, H, ...] views (other ranks as they are: the op names them)
        q, k, v, g, beta, lam = (x.transpose(1, 2) if isinstance(x, Tensor) and x.dim() >= 3 else x
                                 for x in (q, k, v, g, beta, lam))
    if g is not None and g_gamma is not None:
        raise HilaError(f"hila: argument 'g_gamma': {fn} takes g or g_gamma, not both", "g_gamma")
    if g_gamma is not None:  # [H] -> [B, T, H], a broadcast view
        if g_gamma.dim() != 1 or g_gamma.shape[0] != v.shape[2]:
            raise HilaError(f"hila: argument 'g_gamma': expected [H] = [{v.shape[2]}], got "
                            f"{_describe(g_gamma)}", "g_gamma")
        g = g_gamma.view(1, 1, -1).expand(v.shape[0], v.shape[1], -1)
    init = _initial(op, initial_state, q, state_v_first, fn, pool=indices is not None)
    if reverse:  # fla's reverse: the recurrence over each sequence read backwards
        q, k, v, g, beta, lam = (None if x is None else x.flip(1) for x in (q, k, v, g, beta, lam))
        if cu_seqlens is not None:  # the packed sequences come in reverse order
            cu_seqlens = cu_seqlens[-1] - cu_seqlens.flip(0)
            cu_seqlens_cpu = None if cu_seqlens_cpu is None else cu_seqlens_cpu[-1] - cu_seqlens_cpu.flip(0)
            if indices is not None:
                indices = indices.flip(0)
            elif init is not None:
                init = init.flip(0) if isinstance(init, Tensor) else _rows_flipped(init)
    one = _one_token_rows(q, cu_seqlens, cu_seqlens_cpu) if indices is not None and not reverse else None
    if one is not None:  # a decode step of a pool (vLLM's call): hila's fused step kernel
        tq, tk, tv, tg, tlam, tbeta = (None if x is None else one(x) for x in (q, k, v, g, lam, beta))
        o = _step_(op, tq, tk, tv, tg, lam=tlam, beta=tbeta, state=init, state_indices=indices,
                   scale=scale, qk_l2norm=qk_l2norm, check_values=extra.get("check_values"),
                   **opts)
        o = o.unsqueeze(1) if cu_seqlens is None else o.unsqueeze(0)
        return (o.transpose(1, 2) if head_first else o), initial_state
    if form == "serial" and q.device.type != "cpu":
        form = "chunk"  # the CUDA backend runs the chunk form (the same function)
    try:
        o, fin = _forward(op, q, k, v, g, lam=lam, beta=beta, cu_seqlens=cu_seqlens,
                          cu_seqlens_cpu=cu_seqlens_cpu, initial_state=init,
                          output_final_state=output_final_state, form=form, chunk=chunk,
                          scale=scale, qk_l2norm=qk_l2norm, state_indices=indices, **opts, **extra)
    except HilaError as exc:
        if exc.argument != "lam":
            raise
        raise HilaError(str(exc).replace("'lam'", "'level_scales'"), "level_scales") from None
    if reverse:
        o = o.flip(1)
        if fin is not None and cu_seqlens is not None and indices is None:
            fin = _rows_flipped(fin)
    if head_first:
        o = o.transpose(1, 2)
    if indices is not None:  # the pool, updated in place, in the caller's format
        return o, initial_state
    return o, _final(op, fin if output_final_state else None, state_v_first)


def _one_token_rows(q: Tensor, cu_seqlens: Optional[Tensor], cu_seqlens_cpu: Optional[Tensor]):
    """For a call of one token per sequence (dense [N, 1, ...], or packed with a host copy of
    cu_seqlens showing lengths 1): the function taking a tensor to its [N, ...] rows; else None."""
    if cu_seqlens is None:
        return (lambda x: x[:, 0]) if q.shape[1] == 1 else None
    if cu_seqlens_cpu is None or q.shape[0] != 1 or q.shape[1] != cu_seqlens_cpu.shape[0] - 1:
        return None
    return (lambda x: x[0]) if bool((cu_seqlens_cpu.diff() == 1).all()) else None


def _rows_flipped(st: State) -> State:
    return State(*(None if x is None else x.flip(0) for x in st))


# ----------------------------------------------------------------------------- simple GLA

def _simple_gla_gate(g: Optional[Tensor], fn: str) -> Optional[Tensor]:
    if g is not None and g.dim() == 4:
        raise HilaError(f"hila: argument 'g': {fn} takes a head-wise log gate [B, T, H], got "
                        f"{_describe(g)}; a per-key gate [B, T, H, K] is GLA's gk (fla.ops.gla), "
                        "which hila does not have", "g")
    return g


def chunk_simple_gla(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor] = None,
                     g_gamma: Optional[Tensor] = None, scale: Optional[float] = None,
                     initial_state: Optional[Tensor] = None, output_final_state: bool = False,
                     state_v_first: bool = False, cu_seqlens: Optional[Tensor] = None,
                     cu_seqlens_cpu: Optional[Tensor] = None, **kwargs) -> Tuple[Tensor, Optional[Tensor]]:
    """fla's ``chunk_simple_gla`` (hila ``gla``, chunk form): ``S_t = exp(g_t) S_{t-1} + k_t v_tᵀ``,
    ``o_t = scale · S_tᵀ q_t``. q, k ``[B, T, H, K]``; v ``[B, T, H, V]``; g ``[B, T, H]`` or
    g_gamma ``[H]`` (log space); initial_state ``[N, H, K, V]``. Returns ``(o [B, T, H, V],
    final_state [N, H, K, V] or None)``."""
    return _run("gla", "chunk", "chunk_simple_gla", q, k, v, _simple_gla_gate(g, "chunk_simple_gla"),
                g_gamma=g_gamma, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, state_v_first=state_v_first,
                cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, kwargs=kwargs)


def fused_recurrent_simple_gla(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor] = None,
                               g_gamma: Optional[Tensor] = None, scale: Optional[float] = None,
                               initial_state: Optional[Tensor] = None, output_final_state: bool = False,
                               reverse: bool = False, state_v_first: bool = False,
                               cu_seqlens: Optional[Tensor] = None,
                               **kwargs) -> Tuple[Tensor, Optional[Tensor]]:
    """fla's ``fused_recurrent_simple_gla`` (hila ``gla``, serial form); arguments as
    :func:`chunk_simple_gla`, plus ``reverse`` (each sequence read from its last token)."""
    return _run("gla", "serial", "fused_recurrent_simple_gla", q, k, v,
                _simple_gla_gate(g, "fused_recurrent_simple_gla"), g_gamma=g_gamma, scale=scale,
                initial_state=initial_state, output_final_state=output_final_state,
                state_v_first=state_v_first, cu_seqlens=cu_seqlens, reverse=reverse, kwargs=kwargs)


# ----------------------------------------------------------------------------- gated delta rule

def _gdn_gate(g: Optional[Tensor], use_gate_in_kernel: bool, A_log: Optional[Tensor],
              dt_bias: Optional[Tensor]) -> Optional[Tensor]:
    """fla's in-kernel gate: g = -exp(A_log) * softplus(g + dt_bias), at least float32."""
    if not use_gate_in_kernel:
        return g
    if A_log is None or g is None:
        raise HilaError(f"hila: argument '{'A_log' if A_log is None else 'g'}': use_gate_in_kernel=True "
                        "needs the raw gate g and A_log [HV] (and optionally dt_bias [HV])",
                        "A_log" if A_log is None else "g")
    a = g if g.dtype == torch.float64 else g.float()
    if dt_bias is not None:
        a = a + dt_bias
    return -torch.exp(A_log.to(a.dtype)) * F.softplus(a)


def _gdn_beta(beta: Optional[Tensor], v: Tensor, sigmoid: bool, allow_neg_eigval: bool) -> Tensor:
    if allow_neg_eigval and not sigmoid:
        raise HilaError("hila: argument 'allow_neg_eigval': requires use_beta_sigmoid_in_kernel=True "
                        "(beta = 2 * sigmoid(beta))", "allow_neg_eigval")
    if beta is None:  # fla: all ones
        return torch.ones_like(v[..., 0])
    if sigmoid:
        beta = torch.sigmoid(beta if beta.dtype == torch.float64 else beta.float())
        beta = beta * 2 if allow_neg_eigval else beta
    return beta


def chunk_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                           scale: Optional[float] = None, initial_state: Optional[Tensor] = None,
                           output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                           use_beta_sigmoid_in_kernel: bool = False, allow_neg_eigval: bool = False,
                           state_v_first: bool = False, cu_seqlens: Optional[Tensor] = None,
                           cu_seqlens_cpu: Optional[Tensor] = None,
                           chunk_indices: Optional[Tensor] = None, cp_context: Any = None,
                           **kwargs) -> Tuple[Tensor, Optional[Tensor]]:
    """fla's ``chunk_gated_delta_rule`` (hila ``gdn``, chunk form):
    ``S_t = exp(g_t) (I - β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ``, ``o_t = scale · S_tᵀ q_t``.
    q, k ``[B, T, H, K]``; v ``[B, T, HV, V]``; g, beta ``[B, T, HV]``; initial_state
    ``[N, HV, K, V]``. kwargs: fla's ``use_gate_in_kernel``, ``A_log``, ``dt_bias`` and hila's
    options (module docstring). Returns ``(o [B, T, HV, V], final_state or None)``."""
    if cp_context is not None:
        raise HilaError("hila: argument 'cp_context': fla's context parallelism is not supported by "
                        "hila.torch.fla (hila's context-parallel carry is its State, docs/STATES.md)",
                        "cp_context")
    g = _gdn_gate(g, kwargs.pop("use_gate_in_kernel", False), kwargs.pop("A_log", None),
                  kwargs.pop("dt_bias", None))
    beta = _gdn_beta(beta, v, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    return _run("gdn", "chunk", "chunk_gated_delta_rule", q, k, v, g, beta=beta, scale=scale,
                initial_state=initial_state, output_final_state=output_final_state,
                state_v_first=state_v_first, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                qk_l2norm=use_qk_l2norm_in_kernel, kwargs=kwargs)


def fused_recurrent_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor] = None,
                                     gk: Optional[Tensor] = None, gv: Optional[Tensor] = None,
                                     beta: Optional[Tensor] = None, scale: Optional[float] = None,
                                     initial_state: Optional[Tensor] = None,
                                     output_final_state: bool = False,
                                     use_qk_l2norm_in_kernel: bool = False,
                                     use_gate_in_kernel: bool = False, A_log: Optional[Tensor] = None,
                                     dt_bias: Optional[Tensor] = None,
                                     use_beta_sigmoid_in_kernel: bool = False,
                                     allow_neg_eigval: bool = False, state_v_first: bool = False,
                                     cu_seqlens: Optional[Tensor] = None,
                                     **kwargs) -> Tuple[Tensor, Optional[Tensor]]:
    """fla's ``fused_recurrent_gated_delta_rule`` (hila ``gdn``, serial form); arguments as
    :func:`chunk_gated_delta_rule`, in fla's positional order (``q, k, v, g, gk, gv, beta``).
    ``beta`` None means 1; ``gk`` / ``gv`` (per-key / per-value decays) are not supported."""
    for name, x in (("gk", gk), ("gv", gv)):
        if x is not None:
            hint = (" (a [B, T, HV] tensor in this position is usually beta: fla's positional order "
                    "is q, k, v, g, gk, gv, beta, so pass beta=beta)" if x.dim() == 3 and beta is None else "")
            raise HilaError(f"hila: argument '{name}': per-{'key' if name == 'gk' else 'value'} decays "
                            f"are not supported (hila's gated delta rule has one log gate g [B, T, HV] "
                            f"per head), got {_describe(x)}{hint}", name)
    g = _gdn_gate(g, use_gate_in_kernel, A_log, dt_bias)
    beta = _gdn_beta(beta, v, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    return _run("gdn", "serial", "fused_recurrent_gated_delta_rule", q, k, v, g, beta=beta,
                scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                state_v_first=state_v_first, cu_seqlens=cu_seqlens,
                qk_l2norm=use_qk_l2norm_in_kernel, kwargs=kwargs)


chunk_gdn = chunk_gated_delta_rule
fused_recurrent_gdn = fused_recurrent_gated_delta_rule


# ----------------------------------------------------------------------------- log-linear

def _log_linear_attn(form: str, name: str):
    def fn(q: Tensor, k: Tensor, v: Tensor, g: Tensor, level_scales: Tensor,
           initial_state: Optional[LogLinearAttentionState] = None, output_final_state: bool = False,
           cu_seqlens: Optional[Tensor] = None, **kwargs) -> Tuple[Tensor, Optional[LogLinearAttentionState]]:
        scale = kwargs.pop("scale", 1.0)
        return _run("loglinear", form, name, q, k, v, g, lam=level_scales, scale=scale,
                    initial_state=initial_state, output_final_state=output_final_state,
                    cu_seqlens=cu_seqlens, kwargs=kwargs)
    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = (
        f"fla's ``chunk_log_linear_attn`` (hila ``loglinear``, {form} form): log-linear Mamba-2, "
        "``o_t = Σ_s level_scales[t, ℓ(t,s)] Γ_ts (q_t·k_s) v_s`` with ``ℓ(t,s) = bitlen(t XOR s)`` "
        "(docs/math/LOGLINEAR.md). q, k ``[B, T, G, K]``; v ``[B, T, H, V]``; g ``[B, T, H]``; "
        "level_scales ``[B, T, H, L]`` with ``L >= bitlen(n0 + T - 1) + 1`` (fewer raises "
        "HilaError; fla reads missing levels as 0). scale 1 unless ``scale=`` is given. Returns "
        "``(o, LogLinearAttentionState or None)``; the state is exact at every length (fla's drops "
        "the top level at 64·2^k tokens).")
    return fn


chunk_log_linear_attn = _log_linear_attn("chunk", "chunk_log_linear_attn")
fused_recurrent_log_linear_attn = _log_linear_attn("serial", "fused_recurrent_log_linear_attn")


def _log_linear_gdn(form: str, name: str):
    def fn(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, level_scales: Tensor,
           scale: Optional[float] = None, initial_state: Optional[LogLinearAttentionState] = None,
           output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
           cu_seqlens: Optional[Tensor] = None, cu_seqlens_cpu: Optional[Tensor] = None,
           **kwargs) -> Tuple[Tensor, Optional[LogLinearAttentionState]]:
        g = _gdn_gate(g, kwargs.pop("use_gate_in_kernel", False), kwargs.pop("A_log", None),
                      kwargs.pop("dt_bias", None))
        beta = _gdn_beta(beta, v, kwargs.pop("use_beta_sigmoid_in_kernel", False),
                         kwargs.pop("allow_neg_eigval", False))
        return _run("loglinear_gdn", form, name, q, k, v, g, beta=beta, lam=level_scales,
                    scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                    cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                    qk_l2norm=use_qk_l2norm_in_kernel, kwargs=kwargs)
    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = (f"Log-linear gated delta rule (hila ``loglinear_gdn``, {form} form) under the "
                  "conventions of :func:`chunk_gated_delta_rule`, with level_scales ``[B, T, HV, L]`` "
                  "as in :func:`chunk_log_linear_attn`. Returns ``(o, LogLinearAttentionState or None)``.")
    return fn


chunk_log_linear_gated_delta_rule = _log_linear_gdn("chunk", "chunk_log_linear_gated_delta_rule")
fused_recurrent_log_linear_gated_delta_rule = _log_linear_gdn(
    "serial", "fused_recurrent_log_linear_gated_delta_rule")


# ----------------------------------------------------------------------------- HLA

def _hla(op: str, form: str, name: str):
    loglinear = _ops.op_traits(op)["loglinear"]

    def fn(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor] = None, *args, **kwargs):
        names = (("level_scales",) if loglinear else ()) + (
            "scale", "initial_state", "output_final_state", "cu_seqlens", "cu_seqlens_cpu")
        if len(args) > len(names):
            raise HilaError(f"hila: {name}() takes at most {4 + len(names)} positional arguments "
                            f"(q, k, v, g, {', '.join(names)}), got {4 + len(args)}")
        kw = dict(zip(names, args))
        for n in kw:
            if n in kwargs:
                raise HilaError(f"hila: argument '{n}': given by position and by keyword", n)
        kwargs.update(kw)
        lam = kwargs.pop("level_scales", None) if loglinear else None
        if loglinear and lam is None:
            raise HilaError(f"hila: argument 'level_scales': {name} needs level scales [B, T, H, L]",
                            "level_scales")
        return _run(op, form, name, q, k, v, g, lam=lam, scale=kwargs.pop("scale", None),
                    initial_state=kwargs.pop("initial_state", None),
                    output_final_state=kwargs.pop("output_final_state", False),
                    cu_seqlens=kwargs.pop("cu_seqlens", None),
                    cu_seqlens_cpu=kwargs.pop("cu_seqlens_cpu", None), kwargs=kwargs)
    fn.__name__ = fn.__qualname__ = name
    ll = "level_scales, " if loglinear else ""
    fn.__doc__ = (
        f"hila ``{op}`` ({form} form) under fla's conventions: ``{name}(q, k, v, g=None, {ll}scale=None, "
        "initial_state=None, output_final_state=False, cu_seqlens=None, cu_seqlens_cpu=None, "
        "normalize=False, ridge=0.0, eps=1e-6, ...)``. q, k ``[B, T, G, K]``; v ``[B, T, H, V]``; g "
        "``[B, T, H]`` (tied) or ``[B, T, H, P]`` (one log gate per primitive, inner first)"
        + ("; level_scales ``[B, T, H, L]``" if loglinear else "") +
        ". The state is a :class:`hila.State` (pos, S, P, H: docs/STATES.md). Returns "
        "``(o [B, T, H, V], State or None)``.")
    return fn


chunk_hla2 = _hla("hla2", "chunk", "chunk_hla2")
fused_recurrent_hla2 = _hla("hla2", "serial", "fused_recurrent_hla2")
chunk_ahla = _hla("ahla", "chunk", "chunk_ahla")
fused_recurrent_ahla = _hla("ahla", "serial", "fused_recurrent_ahla")
chunk_hla3 = _hla("hla3", "chunk", "chunk_hla3")
fused_recurrent_hla3 = _hla("hla3", "serial", "fused_recurrent_hla3")
chunk_log_linear_hla2 = _hla("loglinear_hla2", "chunk", "chunk_log_linear_hla2")
fused_recurrent_log_linear_hla2 = _hla("loglinear_hla2", "serial", "fused_recurrent_log_linear_hla2")
chunk_log_linear_ahla = _hla("loglinear_ahla", "chunk", "chunk_log_linear_ahla")
fused_recurrent_log_linear_ahla = _hla("loglinear_ahla", "serial", "fused_recurrent_log_linear_ahla")
chunk_log_linear_hla3 = _hla("loglinear_hla3", "chunk", "chunk_log_linear_hla3")
fused_recurrent_log_linear_hla3 = _hla("loglinear_hla3", "serial", "fused_recurrent_log_linear_hla3")
