# SPDX-License-Identifier: Apache-2.0
"""hila's layers with fla's call signature, and fla's parameter layout where fla has the layer.

Every layer here is a hila layer (:mod:`hila.torch.layers`) called as fla's layers are::

    o, _, past_key_values = layer(hidden_states, attention_mask=None, past_key_values=None,
                                  use_cache=False, output_attentions=False, **kwargs)

* ``attention_mask`` ``[B, T_total]`` (1: token, 0: padding; fla's convention, its last T columns
  cover this call): padded tokens are removed and the sequences run packed (``cu_seqlens``),
  as fla's GatedDeltaNet does. This is exact for left or right padding: each sequence starts at
  position 0 with a zero state, and no convolution window reaches into padding (fla's Mamba-2
  layers instead mask the padded inputs, which leaves the padding in the positions that the
  log-linear levels are built on). The output is 0 at padded tokens. Without padding in the call
  no copy is made. A one-token call with a cache (decode) needs every row to be a token.
* ``past_key_values``: a cache with ``get_layer_state`` / ``set_layer_state``
  (:class:`hila.torch.Cache`, or :class:`hila.hf.HilaCache` inside transformers); the layer reads
  and stores its :class:`~hila.torch.LayerState` under ``layer_idx``. With ``use_cache=True`` and
  no cache a new :class:`hila.torch.Cache` is returned.
* kwargs: ``cu_seqlens`` (packed input, B == 1; it takes precedence over attention_mask, as in
  fla) and ``max_seqlen``; others (``position_ids``, ...) are ignored, as fla's layers do.

Parameter layout. :class:`LogLinearMamba2` and :class:`GatedDeltaNet` have fla's constructor
arguments and defaults, and their ``state_dict()`` / ``load_state_dict()`` use fla's key names and
shapes, so an fla checkpoint of the layer loads as it is (hila-layout dicts load too).
:func:`fla_to_hila_state_dict` / :func:`hila_to_fla_state_dict` convert between fla's layout and
the plain hila layers' (``hila.torch.layers``). fla has no HLA layer and no log-linear Gated
DeltaNet layer: :class:`HLAAttention` and :class:`LogLinearGatedDeltaNet` keep hila's names.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from .. import ops as _ops
from .._errors import HilaError
from . import layers as _layers
from .cache import Cache

__all__ = ["HLAAttention", "LogLinearMamba2", "GatedDeltaNet", "LogLinearGatedDeltaNet",
           "fla_to_hila_state_dict", "hila_to_fla_state_dict", "unpad", "repad"]


# ----------------------------------------------------------------------------- padding

def unpad(hidden_states: Tensor, attention_mask: Tensor) -> Tuple[Tensor, Tensor, Tensor, int]:
    """The tokens of a padded batch, packed: ``(x [1, total, D], indices [total], cu_seqlens
    [B + 1] int32, max_seqlen)``. ``attention_mask`` [B, T] (nonzero: token), any padding side.
    One host read (the token count), as fla's ``get_unpad_data``."""
    B, T = attention_mask.shape
    keep = attention_mask.reshape(-1) != 0
    indices = keep.nonzero().squeeze(-1)                                          # [total]
    lens = (attention_mask != 0).sum(-1, dtype=torch.int32)                       # [B]
    cu = torch.nn.functional.pad(lens.cumsum(0, dtype=torch.int32), (1, 0))
    x = hidden_states.reshape(B * T, *hidden_states.shape[2:]).index_select(0, indices).unsqueeze(0)
    return x, indices, cu, int(lens.max()) if B else 0


def repad(x: Tensor, indices: Tensor, B: int, T: int) -> Tensor:
    """Inverse of :func:`unpad`: ``x [1, total, ...] -> [B, T, ...]``, 0 at the padding."""
    out = x.new_zeros(B * T, *x.shape[2:])
    return out.index_copy(0, indices, x[0]).view(B, T, *x.shape[2:])


class _FlaCall:
    """fla's layer call over a hila layer's ``forward(x, state, cu_seqlens, max_seqlen, use_cache)``."""

    def forward(self, hidden_states: Tensor, attention_mask: Optional[Tensor] = None,
                past_key_values=None, use_cache: Optional[bool] = False,
                output_attentions: Optional[bool] = False, **kwargs):
        """``hidden_states [B, T, D] -> (o [B, T, D], None, past_key_values)`` (module docstring)."""
        B, T = hidden_states.shape[:2]
        state = None
        if past_key_values is not None:
            if self.layer_idx is None:
                raise HilaError(f"hila: argument 'layer_idx': {type(self).__name__} needs a layer_idx "
                                "to find its state in past_key_values, got None", "layer_idx")
            state = past_key_values.get_layer_state(self.layer_idx)
        cu_seqlens, max_seqlen = kwargs.get("cu_seqlens"), kwargs.get("max_seqlen")
        x, indices = hidden_states, None
        if attention_mask is not None and cu_seqlens is None:
            if attention_mask.dim() != 2 or attention_mask.shape[0] != B or attention_mask.shape[1] < T:
                raise HilaError("hila: argument 'attention_mask': expected a 0/1 padding mask [B, >= T] "
                                f"for hidden_states {list(hidden_states.shape)}, got "
                                f"{_ops._describe(attention_mask)}", "attention_mask")
            mask = attention_mask[:, attention_mask.shape[1] - T:]
            if not bool((mask != 0).all()):  # one host read, as fla's unpadding
                if state is not None and T == 1 and cu_seqlens is None:
                    raise HilaError("hila: argument 'attention_mask': a decode step (one token with a "
                                    "cache) needs a token in every row; padding belongs before the "
                                    "prompt (left padding)", "attention_mask")
                x, indices, cu_seqlens, max_seqlen = unpad(hidden_states, mask)
        y, new = super().forward(x, state, cu_seqlens, max_seqlen, bool(use_cache))
        if indices is not None:
            y = repad(y, indices, B, T)
        if use_cache:
            if past_key_values is None:
                past_key_values = Cache([])
            past_key_values.set_layer_state(self.layer_idx if self.layer_idx is not None else 0, new)
        return y, None, past_key_values


# ----------------------------------------------------------------------------- fla's parameter layout

# (fla name, hila name, kind): "same", "conv" (fla [C, 1, W] <-> hila [C, W]) or
# "column" (fla [H] <-> hila DecayGate [H, 1]).
_LAYOUTS: Dict[str, List[Tuple[str, str, str]]] = {
    "LogLinearMamba2": [
        ("conv1d.weight", "conv.weight", "conv"), ("conv1d.bias", "conv.bias", "same"),
        ("dt_bias", "gate.dt_bias", "column"), ("A_log", "gate.A_log", "column"),
        ("L", "levels.L", "same"),
    ],
    "GatedDeltaNet": [
        *((f"{n}_conv1d.{w}", f"{n}_conv.{w}", "conv" if w == "weight" else "same")
          for n in "qkv" for w in ("weight", "bias")),
        ("dt_bias", "gate.dt_bias", "column"), ("A_log", "gate.A_log", "column"),
    ],
}


def _convert(state_dict: dict, layer: str, prefix: str, to_hila: bool) -> dict:
    if layer not in _LAYOUTS:
        raise HilaError(f"hila: argument 'layer': expected one of {', '.join(_LAYOUTS)} (the layers "
                        f"fla has), got '{layer}'", "layer")
    out = dict(state_dict)
    for fla_name, hila_name, kind in _LAYOUTS[layer]:
        src, dst = (fla_name, hila_name) if to_hila else (hila_name, fla_name)
        x = out.pop(prefix + src, None)
        if x is None:
            continue
        if kind == "conv":
            x = x.squeeze(1) if to_hila else x.unsqueeze(1)
        elif kind == "column":
            x = x.unsqueeze(-1) if to_hila else x.squeeze(-1)
        out[prefix + dst] = x
    return out


def fla_to_hila_state_dict(state_dict: dict, layer: str, prefix: str = "") -> dict:
    """An fla-layout state dict of ``layer`` ('LogLinearMamba2' or 'GatedDeltaNet', keys under
    ``prefix``) in the layout of the hila layer (``hila.torch.layers.LogLinearMamba2``, or
    ``LogLinearGatedDeltaNet(op='gdn')``): conv weights ``[C, 1, W] -> [C, W]``, ``A_log`` and
    ``dt_bias`` ``[H] -> gate.* [H, 1]``, ``L -> levels.L``. Other keys pass through; tensors are
    views of the input's."""
    return _convert(state_dict, layer, prefix, True)


def hila_to_fla_state_dict(state_dict: dict, layer: str, prefix: str = "") -> dict:
    """The inverse of :func:`fla_to_hila_state_dict`."""
    return _convert(state_dict, layer, prefix, False)


class _FlaLayout:
    """state_dict() in fla's layout; load_state_dict() takes fla's or hila's layout."""

    _fla_layout: str

    def _install_layout_hooks(self) -> None:
        layout = self._fla_layout

        def save(module, state_dict, prefix, local_metadata):
            converted = _convert(state_dict, layout, prefix, False)
            state_dict.clear()
            state_dict.update(converted)

        def load(module, state_dict, prefix, *args):
            converted = _convert(state_dict, layout, prefix, True)
            state_dict.clear()
            state_dict.update(converted)

        post = getattr(self, "register_state_dict_post_hook", None) or self._register_state_dict_hook
        post(save)
        if hasattr(self, "register_load_state_dict_pre_hook"):
            self.register_load_state_dict_pre_hook(load)
        else:  # pragma: no cover - torch < 2.5
            self._register_load_state_dict_pre_hook(load, with_module=True)


# ----------------------------------------------------------------------------- layers

class HLAAttention(_FlaCall, _layers.HLAAttention):
    """:class:`hila.torch.layers.HLAAttention` with fla's call signature (fla has no HLA layer:
    same constructor and parameter names as the hila layer)."""


class LogLinearGatedDeltaNet(_FlaCall, _layers.LogLinearGatedDeltaNet):
    """:class:`hila.torch.layers.LogLinearGatedDeltaNet` with fla's call signature (the
    log-linear authors' layer; fla has none: hila's constructor and parameter names)."""


class LogLinearMamba2(_FlaLayout, _FlaCall, _layers.LogLinearMamba2):
    """fla's ``fla.layers.LogLinearMamba2`` on hila: the same constructor arguments and defaults,
    fla's parameter layout in ``state_dict()`` (``in_proj``, ``conv1d.weight [C, 1, W]``,
    ``dt_bias [H]``, ``A_log [H]``, ``L [H, 15]``, ``norm.weight``, ``D``, ``out_proj``), fla's
    call. The layer is built for ``max_len = 16384`` tokens, which fla's 15 level scales cover
    (longer sequences raise HilaError; fla silently drops the early levels there).

    ``num_heads * head_dim`` must equal ``expand * hidden_size``. Not supported (HilaError):
    ``rmsnorm=False``, a ``dt_limit`` other than ``(0, inf)``, activations other than SiLU.
    ``backend`` is accepted and ignored (hila has one implementation per device).
    """

    _fla_layout = "LogLinearMamba2"

    def __init__(self, num_heads: int, head_dim: int = 64, hidden_size: int = 2048,
                 state_size: int = 128, expand: int = 2, n_groups: int = 1, conv_kernel: int = 4,
                 conv_init: Optional[float] = None, use_conv_bias: bool = False,
                 hidden_act: str = "silu", rmsnorm: bool = True, D_has_hdim: bool = False,
                 norm_before_gate: bool = False, chunk_size: int = 64,
                 dt_limit: Tuple[float, float] = (0.0, float("inf")), dt_min: float = 0.001,
                 dt_max: float = 0.1, dt_init_floor: float = 1e-4, use_bias: bool = True,
                 norm_eps: float = 1e-5, layer_idx: Optional[int] = None, backend: str = "cuda",
                 max_len: int = 16384, mode: str = "chunk", check_values: Optional[bool] = None):
        if num_heads * head_dim != int(expand * hidden_size):
            raise HilaError(f"hila: argument 'num_heads': expected num_heads * head_dim = expand * "
                            f"hidden_size = {int(expand * hidden_size)}, got {num_heads} * {head_dim}",
                            "num_heads")
        for name, got, ok, what in (
                ("hidden_act", hidden_act, hidden_act in ("silu", "swish"), "'silu'"),
                ("rmsnorm", rmsnorm, rmsnorm is True, "True"),
                ("dt_limit", dt_limit, tuple(dt_limit) == (0.0, float("inf")), "(0.0, inf)")):
            if not ok:
                raise HilaError(f"hila: argument '{name}': expected {what} (the variant hila "
                                f"implements), got {got!r}", name)
        super().__init__(hidden_size, max_len, state_size=state_size, expand=expand,
                         head_dim=head_dim, n_groups=n_groups, conv_size=conv_kernel, mode=mode,
                         chunk_size=chunk_size, dt_min=dt_min, dt_max=dt_max,
                         dt_init_floor=dt_init_floor, norm_eps=norm_eps, check_values=check_values,
                         layer_idx=layer_idx, bias=use_bias, conv_bias=use_conv_bias,
                         D_has_hdim=D_has_hdim, norm_before_gate=norm_before_gate)
        if conv_init is not None:
            nn.init.uniform_(self.conv.weight, -conv_init, conv_init)
        self._install_layout_hooks()


class GatedDeltaNet(_FlaLayout, _FlaCall, _layers.LogLinearGatedDeltaNet):
    """fla's ``fla.layers.GatedDeltaNet`` on hila (operator ``gdn``): the same constructor
    arguments and defaults (``num_heads`` q/k heads, ``num_v_heads`` value heads, GVA), fla's
    parameter layout in ``state_dict()`` (``q_proj``, ``k_proj``, ``v_proj``, ``a_proj``,
    ``b_proj`` (no bias), ``A_log [HV]``, ``dt_bias [HV]``, ``{q,k,v}_conv1d.weight [C, 1, W]``,
    ``g_proj``, ``o_norm.weight``, ``o_proj``) and fla's math: q, k L2-normalised in the operator,
    scale ``head_dim^-1/2``, ``beta = sigmoid(b_proj(x))`` (x2 with ``allow_neg_eigval``),
    ``g = -exp(A_log) softplus(a_proj(x) + dt_bias)``, output ``o_norm(o, g_proj(x))``.

    ``mode``: 'chunk' or 'fused_recurrent' (hila's serial form). ``use_short_conv=False`` is not
    supported (HilaError).
    """

    _fla_layout = "GatedDeltaNet"

    def __init__(self, hidden_size: int = 2048, expand_v: float = 2, head_dim: int = 256,
                 num_heads: int = 6, num_v_heads: Optional[int] = None, mode: str = "chunk",
                 use_gate: bool = True, use_short_conv: bool = True, allow_neg_eigval: bool = False,
                 conv_size: int = 4, conv_bias: bool = False, layer_idx: Optional[int] = None,
                 norm_eps: float = 1e-5, check_values: Optional[bool] = None, **kwargs):
        if not use_short_conv:
            raise HilaError("hila: argument 'use_short_conv': expected True (hila's Gated DeltaNet "
                            "layers always have the short convolutions), got False", "use_short_conv")
        if mode not in ("chunk", "fused_recurrent"):
            raise HilaError(f"hila: argument 'mode': expected 'chunk' or 'fused_recurrent', got "
                            f"'{mode}'", "mode")
        HV = num_v_heads if num_v_heads is not None else num_heads
        if not math.isclose(head_dim * expand_v, int(head_dim * expand_v)):
            raise HilaError(f"hila: argument 'expand_v': expected head_dim * expand_v to be an integer, "
                            f"got {head_dim} * {expand_v}", "expand_v")
        super().__init__(hidden_size, None, num_heads=HV, head_dim=head_dim, expand_v=expand_v,
                         num_qk_groups=num_heads, conv_size=conv_size,
                         mode="chunk" if mode == "chunk" else "recurrent", norm_eps=norm_eps,
                         check_values=check_values, layer_idx=layer_idx, op="gdn", b_bias=False,
                         conv_bias=conv_bias, use_output_gate=use_gate, scale=None,
                         allow_neg_eigval=allow_neg_eigval)
        self._install_layout_hooks()
