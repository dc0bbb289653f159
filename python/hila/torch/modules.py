# SPDX-License-Identifier: Apache-2.0
"""Building blocks shared by hila's layers: the short convolution (with its own decode cache),
the gated RMSNorm, the data-dependent decay gate and the log-linear level weights.

Shapes: ``B`` batch, ``T`` tokens, ``N`` sequences (B, or len(cu_seqlens) - 1 for packed input),
``H`` heads, ``C`` channels.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import ops as _ops
from .._errors import HilaError

__all__ = ["ShortConvolution", "GatedRMSNorm", "DecayGate", "LevelWeights", "sequence_index", "at_least_f32"]


def at_least_f32(x: Tensor) -> Tensor:
    """x in float32, or float64 when it is float64 (gates and norms are not computed in 16 bits).
    x itself when it is one of them (no conversion op: a decode step is dispatch-bound)."""
    return x if x.dtype in _F32_F64 else x.float()


_F32_F64 = (torch.float32, torch.float64)


def _as(x: Tensor, dtype: torch.dtype) -> Tensor:
    """x in dtype, without an op when it already is."""
    return x if x.dtype == dtype else x.to(dtype)


def sequence_index(cu_seqlens: Tensor, T: int) -> Tuple[Tensor, Tensor]:
    """For packed tokens 0..T-1: the sequence of each token and its first token, both int64 [T]."""
    t = torch.arange(T, device=cu_seqlens.device)
    seq = torch.searchsorted(cu_seqlens[1:].to(torch.int64), t, right=True)
    return seq, cu_seqlens.to(torch.int64)[seq]


class ShortConvolution(nn.Module):
    """Causal depthwise convolution of width W followed by SiLU, over [B, T, C].

    The decode cache of a sequence is its last W - 1 inputs, ``[N, C, W - 1]`` (oldest first),
    kept across calls: ``forward`` continues from a cache (prefill in pieces) and returns the new
    one, ``step`` advances it by one token. Packed sequences (``cu_seqlens``) never see each other.
    """

    def __init__(self, channels: int, width: int = 4, bias: bool = False):
        super().__init__()
        if width < 1:
            raise HilaError(f"hila: argument 'width': expected >= 1, got {width}", "width")
        self.channels, self.width = channels, width
        self.weight = nn.Parameter(torch.empty(channels, width))
        self.bias = nn.Parameter(torch.zeros(channels)) if bias else None
        bound = 1.0 / math.sqrt(width)  # nn.Conv1d's default for a depthwise kernel
        nn.init.uniform_(self.weight, -bound, bound)

    def zero_cache(self, N: int, dtype: torch.dtype, device=None) -> Tensor:
        return torch.zeros(N, self.channels, self.width - 1, dtype=dtype, device=device)

    def forward(self, x: Tensor, cache: Optional[Tensor] = None, cu_seqlens: Optional[Tensor] = None,
                output_cache: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
        """x [B, T, C] (B == 1 with cu_seqlens); cache [N, C, W-1] or None (zeros).
        Returns (y [B, T, C], new cache [N, C, W-1] or None)."""
        W = self.width
        if cu_seqlens is None:
            hist = cache.transpose(1, 2) if cache is not None else x.new_zeros(x.shape[0], W - 1, x.shape[2])
            xp = torch.cat([hist.to(x.dtype), x], dim=1)                                # [B, W-1+T, C]
            if x.shape[1] == 0:
                y = x
            else:
                y = F.conv1d(xp.transpose(1, 2), self.weight.unsqueeze(1), self.bias, groups=self.channels)
                y = F.silu(y.transpose(1, 2))
            return y, (xp[:, xp.shape[1] - (W - 1):].transpose(1, 2).contiguous() if output_cache else None)
        return self._varlen(x, cache, cu_seqlens, output_cache)

    def _varlen(self, x, cache, cu_seqlens, output_cache):
        # Tap d reads token t - d of t's own sequence, or, before its start, the sequence's cache.
        W, T = self.width, x.shape[1]
        xs = x[0]                                                                     # [T, C]
        seq, start = sequence_index(cu_seqlens, T)
        t = torch.arange(T, device=x.device)
        hist = None if cache is None or W == 1 else cache.transpose(1, 2).reshape(-1, self.channels).to(x.dtype)

        def read(src, seq_of, start_of):
            """x at positions src of sequences seq_of (cache entries before their start)."""
            inside = src >= start_of
            val = xs[src.clamp(min=0)]
            if hist is None:
                return val * inside.unsqueeze(1)
            h = hist[seq_of * (W - 1) + (W - 1 - (start_of - src)).clamp(0, W - 2)]
            return torch.where(inside.unsqueeze(1), val, h)

        y = sum(read(t - d, seq, start) * self.weight[:, W - 1 - d] for d in range(W))
        if self.bias is not None:
            y = y + self.bias
        y = F.silu(y).unsqueeze(0)
        if not output_cache or W == 1:
            return y, (x.new_zeros(cu_seqlens.shape[0] - 1, self.channels, 0) if output_cache else None)
        cu = cu_seqlens.to(torch.int64)
        N = cu.shape[0] - 1
        ends = cu[1:, None] - (W - 1) + torch.arange(W - 1, device=x.device)            # [N, W-1]
        seqs = torch.arange(N, device=x.device)[:, None].expand_as(ends)
        new = read(ends.reshape(-1), seqs.reshape(-1), cu[:-1, None].expand_as(ends).reshape(-1))
        return y, new.reshape(N, W - 1, self.channels).transpose(1, 2).contiguous()

    def step(self, x: Tensor, cache: Tensor, copy: bool = True) -> Tuple[Tensor, Tensor]:
        """One token: x [N, C], cache [N, C, W-1]. Returns (y [N, C], new cache [N, C, W-1]);
        ``copy=False`` returns the new cache as a view of the step's window [N, C, W] (no copy:
        for a caller that copies it where it belongs, e.g. into ``cache`` itself)."""
        window = torch.cat([_as(cache, x.dtype), x.unsqueeze(-1)], dim=-1)            # [N, C, W]
        y = (window * self.weight).sum(-1)
        if self.bias is not None:
            y = y + self.bias
        new = window[..., 1:]
        return F.silu(y), (new.contiguous() if copy else new)


class GatedRMSNorm(nn.Module):
    """RMSNorm with a SiLU gate over groups of ``group_size`` channels of the last dimension.

    ``norm_before_gate=True`` (Gated DeltaNet, fla's FusedRMSNormGated): ``rms(x) * w * silu(z)``;
    ``False`` (Mamba-2's RMSNormGated): ``rms(x * silu(z)) * w``. Computed in at least float32.
    """

    def __init__(self, dim: int, group_size: Optional[int] = None, eps: float = 1e-5,
                 norm_before_gate: bool = True):
        super().__init__()
        self.group_size = group_size or dim
        if dim % self.group_size:
            raise HilaError(f"hila: argument 'group_size': expected a divisor of dim = {dim}, got "
                            f"{self.group_size}", "group_size")
        self.eps, self.norm_before_gate = eps, norm_before_gate
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor, z: Optional[Tensor] = None) -> Tensor:
        """x, z [..., dim] -> [..., dim] (dtype of x). z None: plain RMSNorm."""
        y = at_least_f32(x)
        if z is not None and not self.norm_before_gate:
            y = y * F.silu(at_least_f32(z))
        # y / sqrt(mean(y^2) + eps) over each group of group_size channels (one fused op where torch has it)
        y = F.rms_norm(y.unflatten(-1, (-1, self.group_size)), (self.group_size,), eps=self.eps).flatten(-2)
        y = y * self.weight
        if z is not None and self.norm_before_gate:
            y = y * F.silu(at_least_f32(z))
        return _as(y, x.dtype)


class DecayGate(nn.Module):
    """The data-dependent log-gate of Mamba-2 and Gated DeltaNet, per head (and per primitive with
    untied HLA gates): ``g = -exp(A_log) * softplus(a + dt_bias) <= 0``.

    ``A_init``: ``"arange"`` (A = 1..H, Mamba-2 / log-linear Mamba-2) or a range ``(lo, hi)`` for
    A ~ U(lo, hi) (Gated DeltaNet: (0, 16)). ``dt_bias`` is the inverse softplus of dt drawn
    log-uniformly in [dt_min, dt_max] (floored at dt_init_floor). Both have ``_no_weight_decay``.
    """

    def __init__(self, heads: int, columns: int = 1, A_init: Union[str, Tuple[float, float]] = (0.0, 16.0),
                 dt_min: float = 1e-3, dt_max: float = 0.1, dt_init_floor: float = 1e-4):
        super().__init__()
        self.heads, self.columns = heads, columns
        if A_init == "arange":
            A = torch.arange(1, heads + 1, dtype=torch.float32)[:, None].expand(heads, columns)
        else:
            lo, hi = A_init
            A = torch.empty(heads, columns).uniform_(lo, hi).clamp_(min=1e-4)
        self.A_log = nn.Parameter(torch.log(A).contiguous())
        dt = torch.exp(torch.rand(heads, columns) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        dt = dt.clamp(min=dt_init_floor)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        self.A_log._no_weight_decay = True
        self.dt_bias._no_weight_decay = True

    def forward(self, a: Tensor) -> Tuple[Tensor, Tensor]:
        """a [..., H * columns] -> (g, dt), at least float32, [..., H] (one column) or [..., H, columns];
        dt = softplus(a + dt_bias) (Mamba-2 scales its values by it)."""
        a = at_least_f32(a).unflatten(-1, (self.heads, self.columns))
        dt = F.softplus(a + self.dt_bias)
        g = -torch.exp(self.A_log) * dt
        return (g.squeeze(-1), dt.squeeze(-1)) if self.columns == 1 else (g, dt)


class LevelWeights(nn.Module):
    """Log-linear level weights ``lam = softplus(L * dl)`` with ``L [H, levels]`` initialised to
    ones (``_no_weight_decay``). ``levels = levels_needed(0, max_len)``: a layer built for
    ``max_len`` tokens sees every Fenwick level of such a sequence, and refuses longer ones.
    """

    def __init__(self, heads: int, max_len: int):
        super().__init__()
        if max_len is None or max_len < 1:
            raise HilaError("hila: argument 'max_len': expected the longest sequence the layer will "
                            f"see (>= 1; log-linear layers size their levels by it), got {max_len}",
                            "max_len")
        self.heads, self.max_len = heads, int(max_len)
        self.levels = _ops.levels_needed(0, self.max_len)
        self.L = nn.Parameter(torch.ones(heads, self.levels))
        self.L._no_weight_decay = True

    def forward(self, dl: Tensor) -> Tensor:
        """dl [..., H * levels] -> lam [..., H, levels] (at least float32)."""
        return F.softplus(self.L * at_least_f32(dl).unflatten(-1, (self.heads, self.levels)))

    def check(self, end: int) -> None:
        """Raises past max_len; ``end`` is (an upper bound of) the positions a call reaches."""
        if end > self.max_len:
            raise HilaError(f"hila: argument 'max_len': this layer was built for sequences of at most "
                            f"{self.max_len} tokens, got one reaching {end}", "max_len")
