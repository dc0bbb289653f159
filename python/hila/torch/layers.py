# SPDX-License-Identifier: Apache-2.0
"""Token mixers built on hila's operators: drop-in replacements for an attention block's mixer.

    HLAAttention            hla2 / ahla / hla3 (or their log-linear versions)
    LogLinearMamba2         Mamba-2 with log-linear attention (Guo et al. 2025)
    LogLinearGatedDeltaNet  Gated DeltaNet with log-linear attention

Every layer maps ``x [B, T, D] -> y [B, T, D]`` and has the same call::

    y, state = layer(x, state=None, cu_seqlens=None, max_seqlen=None, use_cache=False)

* ``mode='chunk'`` runs the chunk form (training, prefill); ``mode='recurrent'`` the serial form.
* ``use_cache=True`` returns a :class:`LayerState`; passing it back continues the sequences: a
  one-token call (T == 1, no cu_seqlens) is a decode step, a longer call a chunked prefill.
* A decode step that needs no gradient (``torch.no_grad()``, or nothing requiring grad) runs the
  fused step kernel (``torch.ops.hila.step_``): by default on a copy of the state, so the cache
  passed in is left as it was; on the cache itself when its ``in_place`` flag is set (and
  ``use_cache=True``), which then returns that same, advanced, LayerState (see
  :mod:`hila.torch.cache`). A step that needs a gradient runs the differentiable
  ``torch.ops.hila.step``.
* ``check_values`` (the operator's scan for non-finite values and positive gates): None, the
  default, checks on the CPU and not on CUDA, where every scanned tensor costs a device scan and a
  synchronisation; True checks on every device (debugging), False nowhere. Decode steps never
  scan: a model is checked once, at its prefill.
* ``cu_seqlens`` (int32/int64 [N + 1], with B == 1) packs N sequences of different lengths; the
  state then has N rows, and decoding continues with ``x [N, 1, D]``. ``max_seqlen`` (a Python
  int) spares log-linear layers a device read for their ``max_len`` check.
* ``cp_group`` (a ``torch.distributed`` process group) shards the sequence dimension over its
  ranks (context parallelism, :mod:`hila.torch.distributed`): each rank passes its rows of x (and
  the global ``cu_seqlens``) and gets its rows of y. ``cp_shard_lens`` lists every rank's row
  count (None: one small all_gather). No state or cache with it.

Log-linear layers are built for ``max_len`` tokens: they have ``levels_needed(0, max_len)`` level
weights and raise :class:`hila.HilaError` for longer sequences (never silently dropping levels).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor, nn

from .. import ops as _ops
from .._errors import HilaError
from ..ops import State
from . import distributed as _dist
from .cache import LayerState
from .modules import DecayGate, GatedRMSNorm, LevelWeights, ShortConvolution, at_least_f32
from .ops import forward as _forward
from .ops import step as _step
from .ops import _share_counters
from .ops import step_ as _step_

__all__ = ["HLAAttention", "LogLinearMamba2", "LogLinearGatedDeltaNet"]

_MODES = {"chunk": "chunk", "recurrent": "serial"}


def _check_sizes(optional=(), **sizes) -> None:
    """HilaError naming the first size argument of a layer that is not an int >= 1 (or None, for
    the names in ``optional``: unset)."""
    for name, x in sizes.items():
        if not (x is None and name in optional) and (isinstance(x, bool) or not isinstance(x, int) or x < 1):
            raise HilaError(f"hila: argument '{name}': expected an int >= 1, got {_ops._describe(x)}", name)


class _Call:
    """One call of a mixer: decides decode step vs. whole-sequence form, runs the short
    convolutions and the operator with their caches, and assembles the new LayerState."""

    def __init__(self, layer: "_Mixer", x: Tensor, state: Optional[LayerState],
                 cu_seqlens: Optional[Tensor], max_seqlen: Optional[int], use_cache: bool,
                 cp_group=None, cp_shard_lens=None, cu_seqlens_cpu: Optional[Tensor] = None):
        p = next(layer.parameters())
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != layer.hidden_size:
            raise HilaError(f"hila: argument 'x': expected a tensor [B, T, {layer.hidden_size}] (hidden_size "
                            f"{layer.hidden_size}), got {_ops._describe(x)}", "x")
        if x.device != p.device or not x.is_floating_point() or (
                x.dtype != p.dtype and not torch.is_autocast_enabled(x.device.type)):
            raise HilaError(f"hila: argument 'x': expected {p.dtype} on {p.device} (the layer's parameters; "
                            f"or autocast), got {x.dtype} on {x.device}", "x")
        if cu_seqlens is not None and x.shape[0] != 1:
            raise HilaError("hila: argument 'x': expected batch size 1 with cu_seqlens (packed "
                            f"sequences along T), got {tuple(x.shape)}", "x")
        if state is not None:
            n, got = state.recurrent.pos.shape[0], x.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
            if n != got:
                raise HilaError(f"hila: argument 'state': expected a cache of the input's {got} "
                                f"sequences, got one of {n}", "state")
        self.layer, self.state, self.cu, self.use_cache = layer, state, cu_seqlens, use_cache
        self.cu_cpu = cu_seqlens_cpu if cu_seqlens is not None else None
        self.cp = self._context_parallel(x, cp_group, cp_shard_lens)
        self.decode = state is not None and cu_seqlens is None and x.shape[1] == 1
        self.conv_caches = []
        prev = state.max_position if state is not None else 0
        if cu_seqlens is not None:
            span = max_seqlen
        else:  # with cp_group, the whole sequence over the ranks
            span = x.shape[1] if self.cp is None else sum(self.cp["shard_lens"])
        if span is None and not torch.compiler.is_compiling():
            cu = cu_seqlens if self.cu_cpu is None else self.cu_cpu  # the host copy: no device read
            span = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
        # Under torch.compile without max_seqlen the bound is unknown: the operator still refuses
        # lam with too few levels for a sequence.
        self.end = None if span is None else prev + span
        if layer.levels is not None and self.end is not None:
            layer.levels.check(self.end)

    def _context_parallel(self, x: Tensor, group, lens) -> Optional[dict]:
        """The sharding of a context-parallel call (cp_group given), else None."""
        if group is None:
            return None
        if self.state is not None or self.use_cache:
            raise HilaError("hila: argument 'cp_group': a context-parallel call takes no state and "
                            "returns no cache (state=None, use_cache=False)", "cp_group")
        lens = _dist.shard_lens(x.shape[1], group, x.device) if lens is None else tuple(lens)
        return dict(group=group, shard_lens=lens, cu_seqlens=self.cu)

    def conv(self, conv: Optional[ShortConvolution], x: Tensor) -> Tensor:
        """The next short convolution of the layer over x [B, T, C] (identity when None)."""
        if conv is None:
            return x
        if self.cp is not None:  # the halo comes from the earlier ranks
            return _dist.short_conv(conv, x, **self.cp)
        cache = self.state.conv[len(self.conv_caches)] if self.state is not None else None
        if self.decode:  # the new cache as a view of the step's window: see result()
            y, new = conv.step(x[:, 0], cache, copy=False)
            y = y.unsqueeze(1)
        else:
            y, new = conv(x, cache, self.cu, output_cache=self.use_cache)
        self.conv_caches.append(new)
        return y

    def mix(self, q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor] = None,
            lam: Optional[Tensor] = None, beta: Optional[Tensor] = None, **options) -> Tensor:
        """The layer's operator over q, k [B, T, G, dk], v [B, T, H, dv] -> o [B, T, H, dv].

        A decode step runs without value checks: its inputs come from a model whose prefill was
        checked (``check_values``), and a check costs a device synchronisation per input on CUDA
        (which would also keep the step out of a CUDA graph). The fused step passes the layer's
        bound ``max_position = max_len - 1`` (when the layer has a max_len), so that no operator's
        step reads its positions on the host: a decode step can be captured in a CUDA graph."""
        layer = self.layer
        if self.decode:
            rec = self.state.recurrent
            q, k, v = q[:, 0], k[:, 0], v[:, 0]
            g = None if g is None else g[:, 0]
            lam = None if lam is None else lam[:, 0]
            beta = None if beta is None else beta[:, 0]
            options["check_values"] = False
            if _needs_grad(q, k, v, g, lam, beta, *rec):
                o, self.recurrent = _step(layer.op, q, k, v, g, lam=lam, beta=beta, state=rec, **options)
            else:  # the fused kernel, in place: on the cache itself, or on a copy (module docstring)
                if not self.in_place:  # the copy steps with the cache's step counters (hila.torch.ops)
                    rec = _share_counters(rec, State(*(None if x is None else
                                                       x.clone(memory_format=torch.contiguous_format)
                                                       for x in rec)))
                bound = None if layer.max_len is None else int(layer.max_len) - 1
                o = _step_(layer.op, q, k, v, g, lam=lam, beta=beta, state=rec, max_position=bound,
                           **options)
                self.recurrent = rec
            return o.unsqueeze(1)
        options.setdefault("check_values", layer.check_values)
        if self.cp is not None:
            o, _ = _dist.forward(layer.op, q, k, v, g, lam=lam, beta=beta, form=layer.form,
                                 chunk=layer.chunk_size, **self.cp, **options)
            return o
        o, self.recurrent = _forward(
            layer.op, q, k, v, g, lam=lam, beta=beta, cu_seqlens=self.cu, cu_seqlens_cpu=self.cu_cpu,
            initial_state=self.state.recurrent if self.state is not None else None,
            output_final_state=self.use_cache, final_slots=layer.state_slots, form=layer.form,
            chunk=layer.chunk_size, **options)
        return o

    @property
    def in_place(self) -> bool:
        """Whether a no-grad decode step advances the given cache itself."""
        return self.decode and self.use_cache and self.state.in_place

    def result(self, y: Tensor) -> Tuple[Tensor, Optional[LayerState]]:
        if not self.use_cache:
            return y, None
        end = self.end if self.end is not None else (self.state.max_position if self.state else 0)
        flag = self.state.in_place if self.state is not None else False
        if self.in_place and self.recurrent is self.state.recurrent:  # advanced in place
            for cache, new in zip(self.state.conv, self.conv_caches):  # the same tensors advance
                cache.copy_(new)
            self.state.max_position = end
            return y, self.state
        conv = tuple(c.contiguous() for c in self.conv_caches)  # decode: copies of window views
        return y, LayerState(self.recurrent, conv, end, flag)


def _needs_grad(*tensors: Optional[Tensor]) -> bool:
    """Whether autograd records a call on these tensors (grad mode on and one requires grad)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


class _Mixer(nn.Module):
    """What every hila layer has: operator, mode, chunk size and (log-linear) level weights."""

    def __init__(self, op: str, mode: str, chunk_size: int, heads: int, max_len: Optional[int],
                 layer_idx: Optional[int], check_values: Optional[bool]):
        super().__init__()
        self.check_values = check_values
        if mode not in _MODES:
            raise HilaError(f"hila: argument 'mode': expected 'chunk' or 'recurrent', got '{mode}'", "mode")
        self.traits = _ops.op_traits(op)  # raises HilaError('op') for unknown names
        self.op, self.mode, self.form = op, mode, _MODES[mode]
        self.chunk_size, self.layer_idx = chunk_size, layer_idx
        self.levels = LevelWeights(heads, max_len) if self.traits["loglinear"] else None
        self.max_len = max_len
        # Fenwick capacity of the cached state: decoding up to max_len never reallocates.
        self.state_slots = _ops.state_slots(max_len) if self.levels is not None else 1

    def forward(self, x: Tensor, state: Optional[LayerState] = None,
                cu_seqlens: Optional[Tensor] = None, max_seqlen: Optional[int] = None,
                use_cache: bool = False, cp_group=None, cp_shard_lens=None,
                cu_seqlens_cpu: Optional[Tensor] = None) -> Tuple[Tensor, Optional[LayerState]]:
        """x [B, T, D] -> (y [B, T, D], LayerState or None). See the module docstring."""
        return self._mix(_Call(self, x, state, cu_seqlens, max_seqlen, use_cache, cp_group,
                               cp_shard_lens, cu_seqlens_cpu), x)

    def _qkv_projections(self, hidden_size: int, num_heads: int, num_qk_groups: Optional[int],
                         dk: int, dv: int) -> int:
        """Head sizes and q_proj, k_proj [D -> G dk], v_proj [D -> H dv] with G = num_qk_groups (a
        divisor of H, default H); returns G (layers with q/k/v projections)."""
        G = num_qk_groups or num_heads
        if num_heads % G:
            raise HilaError(f"hila: argument 'num_qk_groups': expected a divisor of num_heads = "
                            f"{num_heads}, got {G}", "num_qk_groups")
        self.num_heads, self.num_qk_groups, self.head_dim, self.head_dim_v = num_heads, G, dk, dv
        self.q_proj = nn.Linear(hidden_size, G * dk, bias=False)
        self.k_proj = nn.Linear(hidden_size, G * dk, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_heads * dv, bias=False)
        return G

    def _output_layers(self, hidden_size: int, use_output_gate: bool, norm_eps: float) -> None:
        """l_proj [D -> H L] (log-linear only), g_proj [D -> H dv] (the output gate, optional), the
        per-head o_norm and o_proj [H dv -> D] (layers with q/k/v projections)."""
        H, dv = self.num_heads, self.head_dim_v
        self.l_proj = nn.Linear(hidden_size, H * self.levels.levels, bias=False) if self.levels else None
        self.g_proj = nn.Linear(hidden_size, H * dv, bias=False) if use_output_gate else None
        self.o_norm = GatedRMSNorm(dv, eps=norm_eps, norm_before_gate=True)
        self.o_proj = nn.Linear(H * dv, hidden_size, bias=False)

    def _lam(self, x: Tensor) -> Optional[Tensor]:
        """Level weights lam [B, T, H, L] from l_proj(x); None without levels."""
        return self.levels(self.l_proj(x)) if self.levels is not None else None

    def _output(self, call: _Call, x: Tensor, o: Tensor) -> Tuple[Tensor, Optional[LayerState]]:
        """o [B, T, H, dv] -> y [B, T, D]: o_norm gated by silu(g_proj(x)) per head, then o_proj."""
        z = _heads(self.g_proj(x), self.head_dim_v) if self.g_proj is not None else None
        return call.result(self.o_proj(self.o_norm(o, z).flatten(-2)))

    def _qkv(self, call: _Call, x: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """q, k [B, T, G, dk] and v [B, T, H, dv]: projection, short convolution, split into heads
        (layers with q/k/v projections: HLAAttention, LogLinearGatedDeltaNet)."""
        q = _heads(call.conv(self.q_conv, self.q_proj(x)), self.head_dim)
        k = _heads(call.conv(self.k_conv, self.k_proj(x)), self.head_dim)
        v = _heads(call.conv(self.v_conv, self.v_proj(x)), self.head_dim_v)
        return q, k, v

    def extra_repr(self) -> str:
        s = f"op={self.op}, mode={self.mode}, chunk_size={self.chunk_size}"
        return s + (f", max_len={self.max_len}, levels={self.levels.levels}" if self.levels is not None else "")


def _heads(x: Tensor, d: int) -> Tensor:
    return x.unflatten(-1, (-1, d))


class HLAAttention(_Mixer):
    """Higher-order linear attention mixer (hla2, ahla, hla3; or loglinear_hla2/ahla/hla3 with ``max_len``).

    x -> q, k (G groups of head_dim), v (H heads of head_dim_v) projections, each through an
    optional short convolution (width ``conv_size``, SiLU); q and k RMS-normalised per head
    (``qk_norm``); data-dependent log-gates ``g = -exp(A_log) softplus(a_proj(x) + dt_bias)``, one
    per head (``gates='tied'``) or one per primitive (``'untied'``); the operator; an RMSNorm of
    each head's output gated by ``silu(g_proj(x))`` (``use_output_gate``); o_proj.

    Args:
        hidden_size: D.
        num_heads: H value heads.
        head_dim: dk of q and k (default 64).
        head_dim_v: dv (default head_dim).
        num_qk_groups: G query/key groups, a divisor of H (default H).
        op: 'hla2', 'ahla', 'hla3', 'loglinear_hla2', 'loglinear_ahla' or 'loglinear_hla3'.
        mode: 'chunk' or 'recurrent'.
        normalize, ridge, scale: operator options (see hila.forward).
        max_len: longest sequence, required by the log-linear versions.
    """

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int = 64,
                 head_dim_v: Optional[int] = None, num_qk_groups: Optional[int] = None,
                 op: str = "hla2", mode: str = "chunk", chunk_size: int = 64,
                 use_short_conv: bool = True, conv_size: int = 4, qk_norm: bool = True,
                 gates: str = "tied", normalize: bool = False, ridge: float = 0.0,
                 scale: Optional[float] = None, use_output_gate: bool = True,
                 norm_eps: float = 1e-5, max_len: Optional[int] = None,
                 check_values: Optional[bool] = None, layer_idx: Optional[int] = None):
        _check_sizes(hidden_size=hidden_size, num_heads=num_heads, head_dim=head_dim, head_dim_v=head_dim_v,
                     num_qk_groups=num_qk_groups, chunk_size=chunk_size, conv_size=conv_size, max_len=max_len,
                     optional=("head_dim_v", "num_qk_groups", "max_len"))
        super().__init__(op, mode, chunk_size, num_heads, max_len, layer_idx, check_values)
        self.hidden_size = hidden_size
        if not self.traits["hla_family"]:
            raise HilaError(f"hila: argument 'op': expected an HLA operator (hla2, ahla, hla3 or a "
                            f"loglinear_ version), got '{op}'", "op")
        if gates not in ("tied", "untied"):
            raise HilaError(f"hila: argument 'gates': expected 'tied' or 'untied', got '{gates}'", "gates")
        dk, dv = head_dim, head_dim_v or head_dim
        G = self._qkv_projections(hidden_size, num_heads, num_qk_groups, dk, dv)
        self.options = dict(normalize=normalize, ridge=ridge, scale=scale)
        conv = (lambda c: ShortConvolution(c, conv_size)) if use_short_conv else (lambda c: None)
        self.q_conv, self.k_conv, self.v_conv = conv(G * dk), conv(G * dk), conv(num_heads * dv)
        self.q_norm = nn.RMSNorm(dk, eps=norm_eps) if qk_norm else None
        self.k_norm = nn.RMSNorm(dk, eps=norm_eps) if qk_norm else None
        cols = self.traits["num_primitives"] if gates == "untied" else 1
        self.a_proj = nn.Linear(hidden_size, num_heads * cols, bias=False)
        self.gate = DecayGate(num_heads, cols)
        self._output_layers(hidden_size, use_output_gate, norm_eps)

    def _mix(self, call: _Call, x: Tensor) -> Tuple[Tensor, Optional[LayerState]]:
        """x [B, T, D] -> call.result(y [B, T, D]): the layer's projections around call.mix."""
        q, k, v = self._qkv(call, x)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        g, _ = self.gate(self.a_proj(x))
        lam = self._lam(x)
        o = call.mix(q, k, v, g, lam=lam, **self.options)
        return self._output(call, x, o)


class LogLinearMamba2(_Mixer):
    """Log-linear Mamba-2 mixer (Guo et al. 2025), as in the authors' and fla's layers.

    ``in_proj`` maps x to ``[z (inner), xBC (inner + 2 G N), dt (H), dl (H L)]`` with
    inner = expand * D, H = inner / head_dim heads, G = n_groups, N = state_size and
    L = levels_needed(0, max_len); xBC goes through a short convolution (width 4, SiLU, bias);
    the operator runs with q = C, k = B (G groups), v = x * dt, g = -exp(A_log) dt with
    dt = softplus(dt + dt_bias) and A = 1..H, lam = softplus(L * dl) and scale 1; then the skip
    D * x, ``RMSNorm(y * silu(z))`` and ``out_proj``.

    ``bias`` (in_proj, out_proj), ``conv_bias``, ``D_has_hdim`` (D per channel, [H * head_dim]) and
    ``norm_before_gate`` select fla's variants (hila.torch.fla_layers.LogLinearMamba2 sets fla's
    defaults: biases on the projections, none on the convolution).
    """

    def __init__(self, hidden_size: int, max_len: int, state_size: int = 128, expand: int = 2,
                 head_dim: int = 64, n_groups: int = 1, conv_size: int = 4, mode: str = "chunk",
                 chunk_size: int = 64, A_init="arange", dt_min: float = 1e-3, dt_max: float = 0.1,
                 dt_init_floor: float = 1e-4, norm_eps: float = 1e-5, check_values: Optional[bool] = None,
                 layer_idx: Optional[int] = None, bias: bool = False, conv_bias: bool = True,
                 D_has_hdim: bool = False, norm_before_gate: bool = False):
        _check_sizes(hidden_size=hidden_size, max_len=max_len, state_size=state_size, expand=expand,
                     head_dim=head_dim, n_groups=n_groups, conv_size=conv_size, chunk_size=chunk_size)
        inner = expand * hidden_size
        if inner % head_dim:
            raise HilaError(f"hila: argument 'head_dim': expected a divisor of expand * hidden_size "
                            f"= {inner}, got {head_dim}", "head_dim")
        H = inner // head_dim
        if H % n_groups:
            raise HilaError(f"hila: argument 'n_groups': expected a divisor of the {H} heads, got "
                            f"{n_groups}", "n_groups")
        super().__init__("loglinear", mode, chunk_size, H, max_len, layer_idx, check_values)
        self.hidden_size = hidden_size
        self.inner, self.num_heads, self.head_dim = inner, H, head_dim
        self.n_groups, self.state_size = n_groups, state_size
        conv_dim = inner + 2 * n_groups * state_size
        self.splits = (inner, conv_dim, H, H * self.levels.levels)
        self.in_proj = nn.Linear(hidden_size, sum(self.splits), bias=bias)
        self.conv = ShortConvolution(conv_dim, conv_size, bias=conv_bias)
        self.gate = DecayGate(H, 1, A_init=A_init, dt_min=dt_min, dt_max=dt_max,
                              dt_init_floor=dt_init_floor)
        self.D = nn.Parameter(torch.ones(inner if D_has_hdim else H))                # [H] or [H * P]
        self.D._no_weight_decay = True
        self.norm = GatedRMSNorm(inner, group_size=inner // n_groups, eps=norm_eps,
                                 norm_before_gate=norm_before_gate)
        self.out_proj = nn.Linear(inner, hidden_size, bias=bias)

    def _mix(self, call: _Call, x: Tensor) -> Tuple[Tensor, Optional[LayerState]]:
        """x [B, T, D] -> call.result(y [B, T, D]): the layer's projections around call.mix."""
        z, xBC, dt, dl = torch.split(self.in_proj(x), self.splits, dim=-1)
        xBC = call.conv(self.conv, xBC)
        xs, Bm, Cm = torch.split(xBC, (self.inner, self.n_groups * self.state_size,
                                       self.n_groups * self.state_size), dim=-1)
        xs = _heads(xs, self.head_dim)                                                 # [B, T, H, P]
        g, dt = self.gate(dt)                                                          # [B, T, H]
        v = (xs * dt.unsqueeze(-1).to(xs.dtype))
        y = call.mix(_heads(Cm, self.state_size), _heads(Bm, self.state_size), v, g,
                     lam=self.levels(dl), scale=1.0)
        y = y + xs * self.D.view(self.num_heads, -1).to(xs.dtype)
        return call.result(self.out_proj(self.norm(y.flatten(-2), z)))


class LogLinearGatedDeltaNet(_Mixer):
    """Log-linear Gated DeltaNet mixer, as in the log-linear authors' layer.

    q, k (G groups of head_dim) and v (H heads of expand_v * head_dim) projections, each with a
    short convolution (width 4, SiLU); ``beta = sigmoid(b_proj(x))``;
    ``g = -exp(A_log) softplus(a_proj(x) + dt_bias)`` with A ~ U(0, 16) and dt in [1e-3, 0.1];
    q and k L2-normalised inside the operator, scale 1; ``lam = softplus(L * l_proj(x))``; the
    operator loglinear_gdn; an RMSNorm per head gated by ``silu(g_proj(x))``; o_proj.

    ``op='gdn'`` is Gated DeltaNet without levels (``max_len`` may then be None; no l_proj);
    ``b_bias``, ``conv_bias``, ``use_output_gate`` (False: plain RMSNorm, no g_proj), ``scale``
    (None: head_dim^-1/2) and ``allow_neg_eigval`` (beta = 2 sigmoid) select fla's variants
    (hila.torch.fla_layers.GatedDeltaNet sets fla's GatedDeltaNet defaults).
    """

    def __init__(self, hidden_size: int, max_len: int, num_heads: int = 6, head_dim: int = 128,
                 expand_v: float = 2.0, num_qk_groups: Optional[int] = None, conv_size: int = 4,
                 mode: str = "chunk", chunk_size: int = 64, A_init=(0.0, 16.0),
                 dt_min: float = 1e-3, dt_max: float = 0.1, dt_init_floor: float = 1e-4,
                 norm_eps: float = 1e-5, check_values: Optional[bool] = None, layer_idx: Optional[int] = None,
                 op: str = "loglinear_gdn", b_bias: bool = True, conv_bias: bool = False,
                 use_output_gate: bool = True, scale: Optional[float] = 1.0,
                 allow_neg_eigval: bool = False):
        if op not in ("loglinear_gdn", "gdn"):
            raise HilaError(f"hila: argument 'op': expected 'loglinear_gdn' or 'gdn' (Gated DeltaNet "
                            f"without levels), got '{op}'", "op")
        _check_sizes(hidden_size=hidden_size, max_len=max_len, num_heads=num_heads, head_dim=head_dim,
                     num_qk_groups=num_qk_groups, conv_size=conv_size, chunk_size=chunk_size,
                     optional=("num_qk_groups", "max_len"))
        super().__init__(op, mode, chunk_size, num_heads, max_len, layer_idx, check_values)
        self.hidden_size = hidden_size
        self.scale, self.allow_neg_eigval = scale, allow_neg_eigval
        dk, dv = head_dim, int(head_dim * expand_v) if isinstance(expand_v, (int, float)) else 0
        _check_sizes(**{"head_dim * expand_v": dv})
        G = self._qkv_projections(hidden_size, num_heads, num_qk_groups, dk, dv)
        self.q_conv = ShortConvolution(G * dk, conv_size, bias=conv_bias)
        self.k_conv = ShortConvolution(G * dk, conv_size, bias=conv_bias)
        self.v_conv = ShortConvolution(num_heads * dv, conv_size, bias=conv_bias)
        self.b_proj = nn.Linear(hidden_size, num_heads, bias=b_bias)
        self.a_proj = nn.Linear(hidden_size, num_heads, bias=False)
        self.gate = DecayGate(num_heads, 1, A_init=A_init, dt_min=dt_min, dt_max=dt_max,
                              dt_init_floor=dt_init_floor)
        self._output_layers(hidden_size, use_output_gate, norm_eps)

    def _mix(self, call: _Call, x: Tensor) -> Tuple[Tensor, Optional[LayerState]]:
        """x [B, T, D] -> call.result(y [B, T, D]): the layer's projections around call.mix."""
        q, k, v = self._qkv(call, x)
        beta = torch.sigmoid(at_least_f32(self.b_proj(x)))
        beta = beta * 2.0 if self.allow_neg_eigval else beta
        g, _ = self.gate(self.a_proj(x))
        lam = self._lam(x)
        o = call.mix(q, k, v, g, lam=lam, beta=beta, qk_l2norm=True, scale=self.scale)
        return self._output(call, x, o)
