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
* :mod:`hila.torch.models`: :class:`HilaLM`, a small decoder-only language model with ``generate()``
  and ``save_pretrained()`` (Hugging Face's checkpoint layout; :mod:`hila.hf` has the transformers
  model).
* :mod:`hila.torch.fla`: the operators under fla's function names and conventions;
  :mod:`hila.torch.fla_layers`: the layers with fla's call signature (and fla's parameter layout
  for GatedDeltaNet and LogLinearMamba2).
* :mod:`hila.torch.serving`: state pools for serving engines (``state_indices``), ``get_state_shape``.
"""
from .._errors import HilaError
from ..ops import State
from .cache import Cache, LayerState
from .layers import HLAAttention, LogLinearGatedDeltaNet, LogLinearMamba2
from .models import HilaLM, HilaLMConfig, LMOutput
from .modules import DecayGate, GatedRMSNorm, LevelWeights, ShortConvolution
from .ops import cpp_road, eager_fast_path, forward, step, step_, zero_state
from .serving import allocate_state_pool, get_state_shape, reset_state_rows
from . import fla, fla_layers  # noqa: E402  (after the ops they wrap)

__all__ = [
    "Cache", "DecayGate", "GatedRMSNorm", "HLAAttention", "HilaError", "HilaLM", "HilaLMConfig",
    "LMOutput", "LayerState", "LevelWeights", "LogLinearGatedDeltaNet", "LogLinearMamba2",
    "ShortConvolution", "State", "allocate_state_pool", "cpp_road", "eager_fast_path", "fla", "fla_layers",
    "forward", "get_state_shape", "reset_state_rows", "step", "step_", "zero_state",
]
