# SPDX-License-Identifier: Apache-2.0
"""Decode caches: what a hila layer carries from one call to the next.

A layer's cache is constant-size for the HLA operators and O(log T) for the log-linear ones (the
Fenwick slots are allocated once for the ``max_len`` the layer was built for): no KV cache grows.
Sequences in a batch may sit at different positions (after a packed, variable-length prefill).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import List, Optional, Tuple

from torch import Tensor

from ..ops import State

__all__ = ["LayerState", "Cache"]


@dataclass
class LayerState:
    """The cache of one mixer layer for N sequences.

    Attributes:
        recurrent: the operator state, a :class:`hila.State` (pos [N], S, P, H).
        conv: the short-convolution caches, ``[N, C, W - 1]`` each, in the layer's order.
        max_position: an upper bound of the positions, kept as a Python int so the
            ``max_len`` check of log-linear layers needs no device synchronisation.
    """

    recurrent: State
    conv: Tuple[Tensor, ...] = ()
    max_position: int = 0

    def tensors(self) -> List[Tensor]:
        return [x for x in (*self.recurrent, *self.conv) if x is not None]

    def select(self, index: Tensor) -> "LayerState":
        """The cache of sequences ``index`` (int64 [N'], any order, repeats allowed)."""
        pick = lambda x: None if x is None else x.index_select(0, index)  # noqa: E731
        return replace(self, recurrent=State(*(pick(x) for x in self.recurrent)),
                       conv=tuple(pick(c) for c in self.conv))


@dataclass
class Cache:
    """The decode cache of a model: one :class:`LayerState` per mixer layer (None before prefill)."""

    layers: List[Optional[LayerState]] = field(default_factory=list)

    @classmethod
    def empty(cls, num_layers: int) -> "Cache":
        return cls([None] * num_layers)

    def __getitem__(self, i: int) -> Optional[LayerState]:
        return self.layers[i]

    def __setitem__(self, i: int, state: Optional[LayerState]) -> None:
        self.layers[i] = state

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def positions(self) -> Optional[Tensor]:
        """int64 [N] tokens consumed per sequence (None before prefill)."""
        first = next((s for s in self.layers if s is not None), None)
        return None if first is None else first.recurrent.pos

    def select(self, index: Tensor) -> "Cache":
        """Keeps (and reorders) sequences ``index``: beam search, dropping finished sequences."""
        return Cache([None if s is None else s.select(index) for s in self.layers])

    def nbytes(self) -> int:
        """Bytes held by the cache (all layers and sequences)."""
        return sum(t.numel() * t.element_size() for s in self.layers if s is not None
                   for t in s.tensors())
