# SPDX-License-Identifier: Apache-2.0
"""Decode caches: what a hila layer carries from one call to the next.

A layer's cache is constant-size for the HLA operators and O(log T) for the log-linear ones (the
Fenwick slots are allocated once for the ``max_len`` the layer was built for): no KV cache grows.
Sequences in a batch may sit at different positions (after a packed, variable-length prefill).

Decode steps and the cache's memory. A one-token call that needs no gradient (``torch.no_grad()``,
or no input, parameter or state requiring grad) runs the library's fused step kernel
(``torch.ops.hila.step_``), which advances a state in place. What it advances depends on the
cache's ``in_place`` flag:

* ``in_place=False`` (the default; what a layer call returns): the layer API stays functional.
  The step advances a copy of the recurrent state and returns a new :class:`LayerState`; the one
  passed in, and every tensor of it, still holds the state before the token, so a caller may keep
  it (branching, retrying a token, comparing) and continue from it again.
* ``in_place=True``: the passed :class:`LayerState` itself advances: its recurrent and
  convolution tensors are overwritten and the same object is returned, with the new position.
  No state copy per token and no new cache tensors, so a decode step can be captured in a CUDA
  graph and replayed; what an inference loop that owns its cache wants (``HilaLM.generate`` sets
  it on the cache of its own prefill). A caller must not keep such a cache to return to:
  take a copy first (``select``, which copies, or ``clone``). Tensors of it saved for a backward
  pass (a prefill run with grad) make that backward fail with autograd's in-place error.

A step that needs a gradient always runs the differentiable functional op (``torch.ops.hila.step``)
and never writes to the cache it is given, whatever the flag.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import List, Optional, Tuple

from torch import Tensor

from ..ops import State
from .ops import _with_counters

__all__ = ["LayerState", "Cache"]


@dataclass
class LayerState:
    """The cache of one mixer layer for N sequences.

    Attributes:
        recurrent: the operator state, a :class:`hila.State` (pos [N], S, P, H).
        conv: the short-convolution caches, ``[N, C, W - 1]`` each, in the layer's order.
        max_position: an upper bound of the positions, kept as a Python int so the
            ``max_len`` check of log-linear layers needs no device synchronisation.
        in_place: whether a no-grad decode step advances this cache itself (see the module
            docstring); False: it is left as it is and a new LayerState is returned.
    """

    recurrent: State
    conv: Tuple[Tensor, ...] = ()
    max_position: int = 0
    in_place: bool = False

    def tensors(self) -> List[Tensor]:
        return [x for x in (*self.recurrent, *self.conv) if x is not None]

    def select(self, index: Tensor) -> "LayerState":
        """The cache of sequences ``index`` (int64 [N'], any order, repeats allowed): a copy,
        with this cache's ``in_place`` flag."""
        pick = lambda x: None if x is None else x.index_select(0, index)  # noqa: E731
        return replace(self, recurrent=_with_counters(State(*(pick(x) for x in self.recurrent))),
                       conv=tuple(pick(c) for c in self.conv))

    def clone(self, in_place: Optional[bool] = None) -> "LayerState":
        """A copy of the cache (new tensors); ``in_place`` None keeps this cache's flag."""
        cp = lambda x: None if x is None else x.clone()  # noqa: E731
        return replace(self, recurrent=_with_counters(State(*(cp(x) for x in self.recurrent))),
                       conv=tuple(cp(c) for c in self.conv),
                       in_place=self.in_place if in_place is None else in_place)


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

    def get_layer_state(self, layer_idx: int) -> Optional[LayerState]:
        """The cache of layer ``layer_idx``, None before its first call (the call of layers with
        fla's signature, :mod:`hila.torch.fla_layers`)."""
        return self.layers[layer_idx] if layer_idx < len(self.layers) else None

    def set_layer_state(self, layer_idx: int, state: Optional[LayerState]) -> None:
        """Stores the cache of layer ``layer_idx`` (the list grows as needed)."""
        if layer_idx >= len(self.layers):
            self.layers.extend([None] * (layer_idx + 1 - len(self.layers)))
        self.layers[layer_idx] = state

    @property
    def positions(self) -> Optional[Tensor]:
        """int64 [N] tokens consumed per sequence (None before prefill)."""
        first = next((s for s in self.layers if s is not None), None)
        return None if first is None else first.recurrent.pos

    def select(self, index: Tensor) -> "Cache":
        """Keeps (and reorders) sequences ``index``: beam search, dropping finished sequences.
        A copy: stepping it (also in place) leaves this cache as it is."""
        return Cache([None if s is None else s.select(index) for s in self.layers])

    def clone(self, in_place: Optional[bool] = None) -> "Cache":
        """A copy of every layer's cache; ``in_place`` None keeps each layer's flag."""
        return Cache([None if s is None else s.clone(in_place) for s in self.layers])

    @property
    def in_place(self) -> bool:
        """Whether no-grad decode steps advance this cache's layers in place (module docstring)."""
        present = [s for s in self.layers if s is not None]
        return bool(present) and all(s.in_place for s in present)

    @in_place.setter
    def in_place(self, value: bool) -> None:
        for s in self.layers:
            if s is not None:
                s.in_place = bool(value)

    def nbytes(self) -> int:
        """Bytes held by the cache (all layers and sequences)."""
        return sum(t.numel() * t.element_size() for s in self.layers if s is not None
                   for t in s.tensors())
