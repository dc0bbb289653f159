# SPDX-License-Identifier: Apache-2.0
"""Type stubs of hila._C, the nanobind extension (internal: use hila.ops or hila.torch).

Every array argument is any object exporting DLPack (numpy, torch, cupy, jax, ...), read over
DLPack without a copy; outputs are written in place. Layouts and shapes are those of hila.ops:
q, k [B, T, G, dk]; v, o [B, T, H, dv]; g [B, T, H] or [B, T, H, P]; lam [B, T, H, L];
beta [B, T, H]; cu_seqlens [N + 1]; per-token calls drop T. A state is a tuple
(pos [N] int64, S [N, H, dk(dk+1)/2], P [N, H, dk, dv'], H [N, H, (Ls,) dk, dv']) with None for
absent parts. ``stream`` is a cudaStream_t as an int (0: the default stream). Errors raise
hila.HilaError (a ValueError) naming the argument.
"""
from typing import Any, Callable, Optional, Tuple

Array = Any
StateIn = Tuple[Optional[Array], Optional[Array], Optional[Array], Optional[Array]]

class Config:
    """hila::OpConfig. ``scale=0``: dk^-1/2. Untied gates are recognised by g's extra axis."""

    def __init__(self, op: str, *, scale: float = 0.0, normalize: bool = False, eps: float = 1e-06,
                 ridge: float = 0.0, qk_l2norm: bool = False, check_values: bool = True) -> None: ...
    @property
    def op(self) -> str: ...
    @property
    def scale(self) -> float: ...
    @property
    def normalize(self) -> bool: ...
    @property
    def eps(self) -> float: ...
    @property
    def ridge(self) -> float: ...
    @property
    def qk_l2norm(self) -> bool: ...
    @property
    def check_values(self) -> bool: ...

def forward(cfg: Config, form: str, chunk: int, q: Array, k: Array, v: Array, g: Optional[Array],
            lam: Optional[Array], beta: Optional[Array], cu_seqlens: Optional[Array],
            init: Optional[StateIn], *, o: Array, final_state: Optional[StateIn] = None,
            stream: int = 0, workspace: Optional[Callable[[int], Array]] = None) -> None:
    """hila::forward: writes o [B, T, H, dv] and, when given, final_state. workspace(nbytes): a
    byte array on the call's device for its temporaries (None: the device's stream-ordered pool)."""

def backward(cfg: Config, form: str, chunk: int, q: Array, k: Array, v: Array, g: Optional[Array],
             lam: Optional[Array], beta: Optional[Array], cu_seqlens: Optional[Array],
             init: Optional[StateIn], d_o: Array, d_final: Optional[StateIn], *,
             dq: Optional[Array] = None, dk: Optional[Array] = None, dv: Optional[Array] = None,
             dg: Optional[Array] = None, dlam: Optional[Array] = None, dbeta: Optional[Array] = None,
             d_init: Optional[StateIn] = None, o: Optional[Array] = None,
             final_state: Optional[StateIn] = None, stream: int = 0,
             workspace: Optional[Callable[[int], Array]] = None) -> None:
    """hila::backward: writes the given gradient outputs (shaped as their inputs), o (required)
    and final_state. workspace: as in forward."""

def step(cfg: Config, q: Array, k: Array, v: Array, g: Optional[Array], lam: Optional[Array],
         beta: Optional[Array], state: StateIn, *, o: Array, state_out: StateIn,
         stream: int = 0) -> None:
    """One decode token on a caller-owned state: q, k [N, G, dk], v [N, H, dv], g [N, H] or
    [N, H, P], lam [N, H, L], beta [N, H]; writes o [N, H, dv] and state_out (shaped as state; a
    log-linear H with the slots of the new positions)."""

def _workspace_span(a: Array) -> Tuple[str, int]:
    """Internal (tests): how a workspace array from an allocator is read: (device, bytes)."""

def _bf16_view(a: Array) -> Array:
    """Internal (hila.ops): a C-contiguous uint16 host array holding bfloat16 bits (ml_dtypes'
    bfloat16 viewed as uint16) as a DLPack bfloat16 array aliasing it."""

def step_inplace(cfg: Config, q: Array, k: Array, v: Array, g: Optional[Array], lam: Optional[Array],
                 beta: Optional[Array], state: StateIn, *, o: Array, stream: int = 0) -> None:
    """hila::step(StepParams, StateView): one fused decode token on a caller-owned state, advanced
    in place (pos, S, P, H; writable arrays on q's device, a log-linear H with bitlen(pos + 1) + 1
    slots or more): q, k [N, G, dk], v [N, H, dv], g [N, H] or [N, H, P], lam [N, H, L],
    beta [N, H]; writes o [N, H, dv]. Errors name q, ..., o, state.pos, state.S, state.P, state.H."""

class BoundState:
    """A caller-owned state (pos, S, P, H) taken over once (the arrays are held while this object
    lives) for many in-place steps; each step is step_inplace's, with the same validation, lock and
    errors. The arrays must keep pointing at the same memory (hila.torch checks their data
    pointers before each step)."""

    def __init__(self, state: StateIn) -> None: ...
    def step(self, cfg: Config, q: Array, k: Array, v: Array, g: Optional[Array], lam: Optional[Array],
             beta: Optional[Array], o: Array, stream: int) -> None:
        """step_inplace(cfg, q, k, v, g, lam, beta, <the bound state>, o=o, stream=stream)."""

class DecodeState:
    """hila::DecodeState: an owning decode state for N sequences x H heads, in host memory or on a
    CUDA device (DLPack device type 1: CPU, 2: CUDA)."""

    def __init__(self, cfg: Config, N: int, H: int, dk: int, dv: int, dtype: str = "float32", *,
                 device_type: int = 1, device_id: int = 0) -> None: ...
    def step(self, q: Array, k: Array, v: Array, g: Optional[Array], lam: Optional[Array],
             beta: Optional[Array], *, o: Array, stream: int = 0) -> None:
        """One token for every sequence; writes o [N, H, dv]."""
    def load(self, state: StateIn) -> None: ...
    def view(self) -> Tuple[Any, Optional[Any], Optional[Any], Any]:
        """(pos, S, P, H) aliasing the state: numpy arrays in host memory, DLPack ndarrays (for
        torch.from_dlpack) on CUDA. The arrays keep their memory alive: after a step, load or
        reserve that grows the state into new memory they show the state as it was."""
    def reserve(self, max_pos: int) -> None: ...
    def position(self, seq: int) -> int: ...
    @property
    def config(self) -> Config: ...
    @property
    def batch(self) -> int: ...
    @property
    def heads(self) -> int: ...
    @property
    def dk(self) -> int: ...
    @property
    def dv(self) -> int: ...
    @property
    def slots(self) -> int: ...
    @property
    def dtype(self) -> str: ...
    @property
    def bytes_per_sequence(self) -> int: ...
    @property
    def device(self) -> Tuple[int, int]:
        """The DLPack device (type, id): (1, 0) for the CPU, (2, index) for CUDA."""

def op_names() -> list[str]: ...
def form_names() -> list[str]: ...
def op_traits(op: str) -> dict: ...
def supports(op: str, form: str, backward: bool) -> bool: ...
def state_shape(cfg: Config, N: int, H: int, dk: int, dv: int, max_pos: int) -> dict:
    """{'pos': [N], 'S': [...] or None, 'P': [...] or None, 'H': [...]}"""
def memory_limit() -> int:
    """Bytes of host memory a hila call may take (``hila::memory_limit``: the smallest of
    set_memory_limit, HILA_MAX_MEMORY, the machine's memory and its cgroup limit)."""

def state_slots(n: int) -> int: ...
def levels_needed(n0: int, T: int) -> int: ...

__version__: str

_api: object
"""Internal: a PyCapsule ("hila._C._api") holding the table of C++ calls hila._torch_ops makes
through this module's library (python/src/ext_api.h)."""

def build_info() -> dict:
    """hila::build_info(): {'version': str, 'cuda': bool, 'cuda_version': str, 'cuda_archs':
    list[str], 'cuda_gencode': str, 'openmp': bool, 'openmp_version': str, 'compiler': str,
    'build_type': str}."""

def cuda_device_count() -> Tuple[int, str]:
    """hila::cuda_device_count(): (CUDA devices this process can use, and when 0 the reason)."""
