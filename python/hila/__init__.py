# SPDX-License-Identifier: Apache-2.0
"""hila: sub-quadratic attention beyond first order.

Higher-order linear attention (hla2, ahla, hla3), log-linear attention (loglinear and the
log-linear HLA operators) and (log-linear) Gated DeltaNet, each in four forms (naive, serial,
chunk, scan), forward and backward, with decode states.

``hila`` (this module) is the functional API over any DLPack array (see :mod:`hila.ops`);
``hila.torch`` has the PyTorch custom ops, layers and a small language model.
"""
from ._errors import HilaError
from .ops import (
    FORMS,
    OPS,
    DecodeState,
    Grads,
    State,
    backward,
    config,
    forward,
    levels_needed,
    op_traits,
    state_part_shapes,
    state_shape,
    state_slots,
    step,
    step_,
    supports,
    use_framework_workspace,
)

__version__ = "0.1.0"

__all__ = [
    "FORMS", "OPS", "DecodeState", "Grads", "HilaError", "State", "backward", "config", "forward",
    "levels_needed", "op_traits", "state_part_shapes", "state_shape", "state_slots", "step",
    "step_", "supports", "use_framework_workspace", "__version__",
]
