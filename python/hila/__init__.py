# SPDX-License-Identifier: Apache-2.0
"""hila: sub-quadratic attention beyond first order.

Higher-order linear attention (hla2, ahla, hla3), log-linear attention (loglinear and the
log-linear HLA operators) and (log-linear) Gated DeltaNet, each in four forms (naive, serial,
chunk, scan), forward and backward, with decode states.

``hila`` (this module) is the functional API over any DLPack array (see :mod:`hila.ops`);
``hila.torch`` has the PyTorch custom ops, layers and a small language model.
"""
from . import _C
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

__version__: str = _C.__version__  # the library's version (project(hila VERSION) in CMakeLists.txt)


def build_info() -> dict:
    """What this build of hila contains, fixed when it was compiled.

    Keys: ``version``; ``cuda`` (the CUDA backend is compiled in), ``cuda_version`` (the CUDA
    toolkit it was built with), ``cuda_archs`` (device code such as ``sm_90a``, ``sm_80``, and PTX
    such as ``compute_90``, which the driver compiles for newer GPUs), ``cuda_gencode`` (the nvcc
    flags); ``openmp``, ``openmp_version``; ``compiler``; ``build_type``.
    """
    return _C.build_info()


def cuda_available() -> bool:
    """Whether hila can run on a CUDA device here: the CUDA backend is compiled in (see
    :func:`build_info`) and the CUDA runtime finds a device (which needs a driver that supports
    the ``cuda_version`` hila was built with). ``hila._C.cuda_device_count()`` gives the count
    and, when it is 0, the CUDA runtime's reason."""
    return _C.cuda_device_count()[0] > 0


__all__ = [
    "FORMS", "OPS", "DecodeState", "Grads", "HilaError", "State", "backward", "config", "forward",
    "levels_needed", "op_traits", "state_part_shapes", "state_shape", "state_slots", "step",
    "step_", "supports", "use_framework_workspace", "__version__", "build_info", "cuda_available",
]
