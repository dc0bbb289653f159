# SPDX-License-Identifier: Apache-2.0
"""The token mixers compared by the experiments, by name, at one model width.

hila's own layers provide most of them:

    hla2, ahla, hla3           HLAAttention(op=...)
    hla2/ahla/hla3_normalized  the same with normalize=True (the operator's [V | 1] denominator)
    loglinear_hla2             HLAAttention(op='loglinear_hla2', max_len=...)
    loglinear                  LogLinearMamba2
    loglinear_gdn              LogLinearGatedDeltaNet

The first-order bases of the two log-linear layers have no layer of their own in hila.torch, so
they are built here from the same pieces (hila.torch.modules) and ``hila.torch.forward``:

    gla    Mamba2: LogLinearMamba2 without level weights (operator gla)
    gdn    GatedDeltaNet: LogLinearGatedDeltaNet without level weights (operator gdn)

With every level weight equal to a constant c, the log-linear operators are c times their bases
(the Fenwick buckets of a query partition its whole past), and the output norms of both layers are
scale free: each base equals its log-linear layer with constant lambda, which the tests check.

    sdpa   softmax attention (torch's scaled_dot_product_attention, causal): the ceiling. It has
           the q/k/v projections and short convolutions of HLAAttention and no positional encoding
           (the convolutions give it the order of neighbouring tokens, which recall needs).

Every mixer maps x [B, T, D] -> y [B, T, D] (``forward(x)``; hila's layers return (y, state)).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._errors import HilaError
from ..torch import HLAAttention, LogLinearGatedDeltaNet, LogLinearMamba2
from ..torch import forward as hila_forward
from ..torch.modules import DecayGate, GatedRMSNorm, ShortConvolution, at_least_f32

__all__ = ["MIXERS", "DEFAULT_MIXERS", "MixerShape", "build_mixer", "Mamba2", "GatedDeltaNet",
           "SoftmaxAttention"]


@dataclass(frozen=True)
class MixerShape:
    """Head layout at model width D: heads of at most ``head_dim`` channels (H = ceil(D / head_dim),
    dk = D / H) for the attention-like mixers, Mamba-2 mixers with expand 2, head dim
    min(head_dim, 2 D) and ``state_size`` (N) shared by the heads; Gated DeltaNet value heads of
    ``expand_v`` * dk (the layer's default, 2)."""

    head_dim: int = 64
    state_size: int = 64
    expand_v: float = 2.0
    chunk_size: int = 64

    def heads(self, D: int) -> Tuple[int, int]:
        H = -(-D // self.head_dim)
        if D % H:
            raise HilaError(f"hila: argument 'dim': {D} does not split into {H} heads of at most "
                            f"{self.head_dim} channels", "dim")
        return H, D // H


class Mamba2(nn.Module):
    """Mamba-2 mixer with operator ``gla``: the layout of :class:`hila.torch.LogLinearMamba2`
    (same parameter names and initialisation) without the level weights.

    in_proj: x -> [z (E), xBC (E + 2 G N), dt (H)] with E = expand D, H = E / head_dim;
    xBC -> causal conv (width 4, SiLU, bias); q = C, k = B [B, T, G, N], v = x dt [B, T, H, P],
    g = -exp(A_log) dt, dt = softplus(dt + dt_bias), A = 1..H; y = gla(q, k, v, g, scale 1) + D x;
    out_proj(RMSNorm(y silu(z))).
    """

    def __init__(self, hidden_size: int, state_size: int = 128, expand: int = 2, head_dim: int = 64,
                 n_groups: int = 1, conv_size: int = 4, chunk_size: int = 64, norm_eps: float = 1e-5,
                 check_values: Optional[bool] = None):
        super().__init__()
        inner = expand * hidden_size
        if inner % head_dim or (inner // head_dim) % n_groups:
            raise HilaError(f"hila: argument 'head_dim': expected a divisor of expand * hidden_size = "
                            f"{inner} giving a multiple of n_groups = {n_groups} heads, got {head_dim}",
                            "head_dim")
        H = inner // head_dim
        self.inner, self.num_heads, self.head_dim = inner, H, head_dim
        self.n_groups, self.state_size = n_groups, state_size
        self.chunk_size, self.check_values = chunk_size, check_values
        conv_dim = inner + 2 * n_groups * state_size
        self.splits = (inner, conv_dim, H)
        self.in_proj = nn.Linear(hidden_size, sum(self.splits), bias=False)
        self.conv = ShortConvolution(conv_dim, conv_size, bias=True)
        self.gate = DecayGate(H, 1, A_init="arange")
        self.D = nn.Parameter(torch.ones(H))
        self.D._no_weight_decay = True
        self.norm = GatedRMSNorm(inner, group_size=inner // n_groups, eps=norm_eps, norm_before_gate=False)
        self.out_proj = nn.Linear(inner, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        z, xBC, dt = torch.split(self.in_proj(x), self.splits, dim=-1)
        xBC, _ = self.conv(xBC)
        N, G = self.state_size, self.n_groups
        xs, Bm, Cm = torch.split(xBC, (self.inner, G * N, G * N), dim=-1)
        xs = xs.unflatten(-1, (-1, self.head_dim))                                    # [B, T, H, P]
        g, dt = self.gate(dt)                                                         # [B, T, H]
        v = xs * dt.unsqueeze(-1).to(xs.dtype)
        y, _ = hila_forward("gla", Cm.unflatten(-1, (G, N)), Bm.unflatten(-1, (G, N)), v, g,
                            scale=1.0, chunk=self.chunk_size, check_values=self.check_values)
        y = y + xs * self.D.unsqueeze(-1).to(xs.dtype)
        return self.out_proj(self.norm(y.flatten(-2), z))


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet mixer with operator ``gdn``: the layout of
    :class:`hila.torch.LogLinearGatedDeltaNet` (same parameter names and initialisation) without
    the level weights.

    q, k [B, T, G, dk], v [B, T, H, dv] projections with short convolutions; beta = sigmoid(b_proj x);
    g = -exp(A_log) softplus(a_proj x + dt_bias), A ~ U(0, 16); o = gdn(q, k, v, g, beta) with q, k
    L2-normalised in the operator, scale 1; o_proj(RMSNorm_head(o) silu(g_proj x)).
    """

    def __init__(self, hidden_size: int, num_heads: int = 6, head_dim: int = 128, expand_v: float = 2.0,
                 conv_size: int = 4, chunk_size: int = 64, norm_eps: float = 1e-5,
                 check_values: Optional[bool] = None):
        super().__init__()
        dk, dv = head_dim, int(head_dim * expand_v)
        self.num_heads, self.head_dim, self.head_dim_v = num_heads, dk, dv
        self.chunk_size, self.check_values = chunk_size, check_values
        self.q_proj = nn.Linear(hidden_size, num_heads * dk, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_heads * dk, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_heads * dv, bias=False)
        self.q_conv = ShortConvolution(num_heads * dk, conv_size)
        self.k_conv = ShortConvolution(num_heads * dk, conv_size)
        self.v_conv = ShortConvolution(num_heads * dv, conv_size)
        self.b_proj = nn.Linear(hidden_size, num_heads, bias=True)
        self.a_proj = nn.Linear(hidden_size, num_heads, bias=False)
        self.gate = DecayGate(num_heads, 1, A_init=(0.0, 16.0))
        self.g_proj = nn.Linear(hidden_size, num_heads * dv, bias=False)
        self.o_norm = GatedRMSNorm(dv, eps=norm_eps, norm_before_gate=True)
        self.o_proj = nn.Linear(num_heads * dv, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        q = self.q_conv(self.q_proj(x))[0].unflatten(-1, (-1, self.head_dim))
        k = self.k_conv(self.k_proj(x))[0].unflatten(-1, (-1, self.head_dim))
        v = self.v_conv(self.v_proj(x))[0].unflatten(-1, (-1, self.head_dim_v))
        beta = torch.sigmoid(at_least_f32(self.b_proj(x)))
        g, _ = self.gate(self.a_proj(x))
        o, _ = hila_forward("gdn", q, k, v, g, beta=beta, qk_l2norm=True, scale=1.0,
                            chunk=self.chunk_size, check_values=self.check_values)
        z = self.g_proj(x).unflatten(-1, (-1, self.head_dim_v))
        return self.o_proj(self.o_norm(o, z).flatten(-2))


class SoftmaxAttention(nn.Module):
    """Causal softmax attention (torch SDPA) with HLAAttention's q/k/v projections and short
    convolutions: q, k, v [B, H, T, d] -> softmax(q kᵀ / sqrt(d) + causal mask) v -> o_proj."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, conv_size: int = 4):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        width = num_heads * head_dim
        self.q_proj = nn.Linear(hidden_size, width, bias=False)
        self.k_proj = nn.Linear(hidden_size, width, bias=False)
        self.v_proj = nn.Linear(hidden_size, width, bias=False)
        self.q_conv, self.k_conv, self.v_conv = (ShortConvolution(width, conv_size) for _ in range(3))
        self.o_proj = nn.Linear(width, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        def heads(proj, conv):  # [B, T, H d] -> [B, H, T, d]
            return conv(proj(x))[0].unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)
        o = F.scaled_dot_product_attention(heads(self.q_proj, self.q_conv), heads(self.k_proj, self.k_conv),
                                           heads(self.v_proj, self.v_conv), is_causal=True)
        return self.o_proj(o.transpose(1, 2).flatten(-2))


class _Layer(nn.Module):
    """A hila.torch layer as a plain mixer: y = layer(x)[0]."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x: Tensor) -> Tensor:
        return self.layer(x)[0]


def _hla(op: str, normalize: bool = False):
    def build(D, max_len, s: MixerShape):
        H, dk = s.heads(D)
        kw = dict(max_len=max_len) if op.startswith("loglinear") else {}
        return _Layer(HLAAttention(D, num_heads=H, head_dim=dk, op=op, normalize=normalize,
                                   chunk_size=s.chunk_size, check_values=False, **kw))
    return build


def _mamba2(loglinear: bool):
    def build(D, max_len, s: MixerShape):
        P = min(s.head_dim, 2 * D)
        if loglinear:
            return _Layer(LogLinearMamba2(D, max_len=max_len, state_size=s.state_size, head_dim=P,
                                          chunk_size=s.chunk_size, check_values=False))
        return Mamba2(D, state_size=s.state_size, head_dim=P, chunk_size=s.chunk_size, check_values=False)
    return build


def _gdn(loglinear: bool):
    def build(D, max_len, s: MixerShape):
        H, dk = s.heads(D)
        if loglinear:
            return _Layer(LogLinearGatedDeltaNet(D, max_len=max_len, num_heads=H, head_dim=dk,
                                                 expand_v=s.expand_v, chunk_size=s.chunk_size,
                                                 check_values=False))
        return GatedDeltaNet(D, num_heads=H, head_dim=dk, expand_v=s.expand_v, chunk_size=s.chunk_size,
                             check_values=False)
    return build


def _sdpa(D, max_len, s: MixerShape):
    H, dk = s.heads(D)
    return SoftmaxAttention(D, H, dk)


MIXERS: Dict[str, object] = {
    "sdpa": _sdpa,
    "gla": _mamba2(False),
    "hla2": _hla("hla2"),
    "ahla": _hla("ahla"),
    "hla3": _hla("hla3"),
    "loglinear": _mamba2(True),
    "gdn": _gdn(False),
    "loglinear_gdn": _gdn(True),
    "loglinear_hla2": _hla("loglinear_hla2"),
    "hla2_normalized": _hla("hla2", normalize=True),
    "ahla_normalized": _hla("ahla", normalize=True),
    "hla3_normalized": _hla("hla3", normalize=True),
}
# The comparison of the experiments (the normalized HLA variants run on request).
DEFAULT_MIXERS = ("sdpa", "gla", "hla2", "ahla", "hla3", "loglinear", "gdn", "loglinear_gdn",
                  "loglinear_hla2")


def build_mixer(name: str, dim: int, max_len: int, shape: MixerShape = MixerShape()) -> nn.Module:
    """The mixer ``name`` for width ``dim`` and sequences of at most ``max_len`` tokens."""
    if name not in MIXERS:
        raise HilaError(f"hila: argument 'mixer': expected one of {', '.join(MIXERS)}, got '{name}'",
                        "mixer")
    return MIXERS[name](int(dim), int(max_len), shape)
