# SPDX-License-Identifier: Apache-2.0
"""PyTorch integration of hila.

* :mod:`hila.torch.ops`: ``torch.ops.hila.{forward,backward,step,step_}`` custom ops (autograd,
  fake tensors, torch.compile) and their wrappers :func:`forward`, :func:`step`, :func:`step_`
  (in place), :func:`zero_state`; eager calls take a direct road to the same kernels
  (:func:`eager_fast_path`).
* :mod:`hila.torch.layers`: :class:`HLAAttention`, :class:`LogLinearMamba2`,
  :class:`LogLinearGatedDeltaNet`, drop-in token mixers with decode caches.
* :mod:`hila.torch.modules`: their shared pieces (short convolution, gated RMSNorm, decay gate,
  level weights).
* :mod:`hila.torch.models`: :class:`HilaLM`, a small decoder-only language model with ``generate()``.
"""
from .._errors import HilaError
from ..ops import State
from .cache import Cache, LayerState
from .layers import HLAAttention, LogLinearGatedDeltaNet, LogLinearMamba2
from .models import HilaLM, HilaLMConfig, LMOutput
from .modules import DecayGate, GatedRMSNorm, LevelWeights, ShortConvolution
from .ops import eager_fast_path, forward, step, step_, zero_state

__all__ = [
    "Cache", "DecayGate", "GatedRMSNorm", "HLAAttention", "HilaError", "HilaLM", "HilaLMConfig",
    "LMOutput", "LayerState", "LevelWeights", "LogLinearGatedDeltaNet", "LogLinearMamba2",
    "ShortConvolution", "State", "eager_fast_path", "forward", "step", "step_", "zero_state",
]
