# SPDX-License-Identifier: Apache-2.0
"""Device temporaries from the caller's framework: ``_C.forward/backward(workspace=alloc)`` asks
``alloc(nbytes)`` for a byte array on the call's device (CUDA only; the CPU needs none), hila.ops
and hila.torch pass torch's caching allocator when the call runs on torch's current stream, the
results equal those of the pool path, and an allocator that returns too little is a HilaError."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import hila  # noqa: E402
from hila import _C  # noqa: E402
from helpers import assert_switch, require_device  # noqa: E402


def _inputs(device, dtype=torch.float32, B=2, T=130, H=4, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, d, generator=g).to(dtype).to(device)
    k = (torch.randn(B, T, H, d, generator=g) / d ** 0.5).to(dtype).to(device)
    v = torch.randn(B, T, H, d, generator=g).to(dtype).to(device)
    gate = torch.log(torch.rand(B, T, H, generator=g) * 0.3 + 0.7).to(device)
    return q, k, v, gate


def _call(q, k, v, gate, workspace, backward=False):
    cfg = hila.config("hla2")
    o = torch.zeros_like(v)
    if not backward:
        _C.forward(cfg, "chunk", 64, q, k, v, gate, None, None, None, None, o=o, workspace=workspace)
        return [o]
    do = torch.ones_like(v)
    dq, dk, dv, dg = (torch.zeros_like(x) for x in (q, k, v, gate))
    _C.backward(cfg, "chunk", 64, q, k, v, gate, None, None, None, None, do, None, dq=dq, dk=dk, dv=dv,
                dg=dg, o=o, workspace=workspace)
    return [o, dq, dk, dv, dg]


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_allocator_is_asked_on_cuda_only_and_matches_the_pool(device, backward):
    require_device(device, "hla2")
    q, k, v, gate = _inputs(device)
    asked = []

    def alloc(n):
        asked.append(n)
        return torch.empty(n, dtype=torch.uint8, device=device)

    got = _call(q, k, v, gate, alloc, backward)
    want = _call(q, k, v, gate, None, backward)
    if device == "cpu":
        assert asked == [], "the CPU backend needs no device workspace"
    else:
        assert len(asked) == 1 and asked[0] > 0, asked
    for a, b in zip(got, want):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_allocator_returning_too_little_is_an_error(device):
    require_device(device, "hla2")
    if device == "cpu":
        pytest.skip("the CPU backend never asks for a workspace")
    q, k, v, gate = _inputs(device)
    with pytest.raises(hila.HilaError) as e:
        _call(q, k, v, gate, lambda n: torch.empty(n // 2, dtype=torch.uint8, device=device))
    assert e.value.argument == "workspace"
    with pytest.raises(hila.HilaError) as e:
        _call(q, k, v, gate, lambda n: torch.empty(n, dtype=torch.uint8))  # host memory
    assert e.value.argument == "workspace"


def test_allocator_returning_none_uses_the_pool(device):
    require_device(device, "hla2")
    q, k, v, gate = _inputs(device)
    got = _call(q, k, v, gate, lambda n: None)
    want = _call(q, k, v, gate, None)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)


def test_torch_tensors_take_their_temporaries_from_torch(device, request):
    """hila.forward on CUDA torch tensors (what hila.torch's ops call): torch's allocator serves
    the output and the workspace, so torch's peak grows by more than the output (the existing
    torch-op tests check the results of this path against the oracles)."""
    require_device(device, "hla2")
    if device == "cpu":
        pytest.skip("the CPU backend never asks for a workspace")
    q, k, v, gate = _inputs(device, torch.bfloat16, B=2, T=300, H=4, d=64)
    prev = hila.use_framework_workspace(True)
    request.addfinalizer(lambda: hila.use_framework_workspace(prev))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    o, _ = hila.forward("hla2", q, k, v, gate)
    torch.cuda.synchronize()
    grew = torch.cuda.max_memory_allocated() - base
    assert grew > o.numel() * o.element_size() + 65536, f"torch's peak grew by {grew} bytes only"
    want = _call(q, k, v, gate, None)[0]
    torch.testing.assert_close(o, want, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32, torch.bfloat16])
def test_allocator_arrays_are_read_as_bytes(device, dtype):
    """The binding reads what an allocator returns as (device, bytes), whatever its dtype."""
    if device != "cpu" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    a = torch.empty(1000, dtype=dtype, device=device)
    dev, n = _C._workspace_span(a)
    assert n == 1000 * a.element_size()
    assert dev == ("cpu" if device == "cpu" else f"cuda:{a.device.index or 0}")
    with pytest.raises(hila.HilaError) as e:
        _C._workspace_span(torch.empty(10, 10, dtype=dtype, device=device).t())
    assert e.value.argument == "workspace"
    with pytest.raises(hila.HilaError) as e:
        _C._workspace_span("not an array")
    assert e.value.argument == "workspace"
    assert _C._workspace_span(np.empty(64, dtype=np.uint8)) == ("cpu", 64)


def test_framework_workspace_switch():
    assert_switch(hila.use_framework_workspace, default=False)


def test_numpy_calls_need_no_workspace():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 20, 2, 4)) for _ in range(3))
    o, _ = hila.forward("gla", q, k, v, chunk=4)
    assert np.isfinite(o).all()
