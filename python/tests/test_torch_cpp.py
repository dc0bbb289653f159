# SPDX-License-Identifier: Apache-2.0
"""The C++ road of ``hila.torch.forward``'s plain training call (the extension hila._torch_ops: the
libtorch op ``torch.ops.hila_cpp.forward`` with a C++ autograd function, docs/PYTHON.md, "Host
overhead") against the Python road (the ``torch.autograd.Function`` ``_Plain``):

* o and every gradient equal bit for bit, for every operator, float32 and float64, every form,
  subsets of the inputs requiring grad, grouped queries (G < H), untied gates, without gates, with
  the options (scale, normalize, ridge, qk_l2norm), and without gradients (no grad / inference);
* each road really runs (the op shows in the profile only on the C++ road, and o.grad_fn is the
  C++ node);
* bad input is the same HilaError (message and argument) on both roads, in forward and in
  backward; a non-tensor argument is named; double backward is refused;
* strided inputs and cotangents are read like the Python road reads them (contiguous copies);
* the torch ops themselves (forward with the options, forward_plan on a numbered configuration):
  their results, schema, Meta kernel, and the CPU kernel under inference mode.

Skipped, with the reason, where hila._torch_ops was not built (no torch at build time) or does
not import.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch.profiler import ProfilerActivity, profile  # noqa: E402

import hila  # noqa: E402
import hila.torch as ht  # noqa: E402
import hila.torch.ops as hops  # noqa: E402
from helpers import chunk_for, device_problem, torch_inputs  # noqa: E402

pytestmark = pytest.mark.skipif(hops._CPP_OP is None, reason=f"no C++ road: {hops._CPP_WHY}")

OPS = hila.OPS
FORMS = ("naive", "serial", "chunk", "scan")


@pytest.fixture
def roads(request):
    """run(road, fn): fn() on the "python" or "cpp" road of the direct eager road."""
    prev_fast = ht.eager_fast_path(True)
    prev_cpp = ht.cpp_road(True)

    def run(road, fn):
        ht.cpp_road(road == "cpp")
        try:
            return fn()
        finally:
            ht.cpp_road(True)

    request.addfinalizer(lambda: (ht.eager_fast_path(prev_fast), ht.cpp_road(prev_cpp)))
    return run


def _inputs(op, dtype, drop=(), device="cpu", **kw):
    x, _, _ = torch_inputs(op, device, **kw)
    return {k: v.detach().to(dtype) for k, v in x.items() if k not in drop}


def _step(op, x, needs, do, **opts):
    """o.grad_fn's class name, o and the gradients of the inputs in ``needs`` (a fresh set of
    leaves), for one forward + autograd.grad."""
    leaves = {k: v.clone().requires_grad_(k in needs) for k, v in x.items()}
    o, fin = ht.forward(op, **leaves, **opts)
    assert fin is None
    wrt = [leaves[k] for k in x if k in needs]
    grads = torch.autograd.grad(o, wrt, do) if wrt else ()
    return (None if o.grad_fn is None else type(o.grad_fn).__name__), [o.detach()] + list(grads)


def _same(roads, op, x, needs, do, **opts):
    """The two roads' results of one step are equal to the bit; each road ran its own function."""
    fn_py, py = roads("python", lambda: _step(op, x, needs, do, **opts))
    fn_cpp, cpp = roads("cpp", lambda: _step(op, x, needs, do, **opts))
    if needs:
        assert (fn_py, fn_cpp) == ("_PlainBackward", "CppFunction"), (fn_py, fn_cpp)
    assert len(py) == len(cpp) == 1 + len(needs)
    for i, (a, b) in enumerate(zip(py, cpp)):
        assert a.dtype == b.dtype and a.shape == b.shape, (i, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.isfinite(a).all(), f"{op} result {i} is not finite"
        assert torch.equal(a, b), f"{op} {sorted(needs)} {opts}: result {i} differs between the roads"


def _needs_sets(x):
    names = list(x)
    extra = [k for k in ("lam", "beta") if k in x]
    return [set(names), {"q"}, {"v", "g"}, {"k"} | set(extra), set()]


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64), ids=("f32", "f64"))
@pytest.mark.parametrize("op", OPS)
def test_roads_equal_for_every_operator(op, dtype, roads):
    """every operator, grouped queries (G=1 < H=2 and G=H=2), subsets of requires_grad."""
    for G, H in ((1, 2), (2, 2)):
        x = _inputs(op, dtype, B=2, T=13, G=G, H=H, dk=4, dv=3)
        do = torch.randn(x["v"].shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(dtype)
        for needs in _needs_sets(x):
            _same(roads, op, x, needs, do, chunk=4)


@pytest.mark.parametrize("workspace", (False, True), ids=("pool", "framework_workspace"))
@pytest.mark.parametrize("op", OPS)
def test_roads_equal_on_the_device(op, workspace, device, roads, request):
    """on every device of the run (CUDA where torch sees one): float32 and float64, all inputs and
    a subset requiring grad, on the current stream and on a side stream, with the device
    temporaries from hila's pool and from torch's allocator (hila.use_framework_workspace): equal
    results, or the same HilaError where the device does not run the call."""
    chunk = chunk_for(device, 4, op)
    why = device_problem(device, op, "chunk", chunk)
    if why:
        pytest.skip(why)
    prev = hila.use_framework_workspace(workspace)
    request.addfinalizer(lambda: hila.use_framework_workspace(prev))
    streams = [None] + ([torch.cuda.Stream(device)] if device == "cuda" else [])
    for dtype in (torch.float32, torch.float64):
        x = _inputs(op, dtype, device=device, B=2, T=70, G=1, H=2, dk=8, dv=4)
        do = torch.randn(x["v"].shape, generator=torch.Generator().manual_seed(8), dtype=torch.float64).to(device, dtype)
        for needs in (set(x), {"k", "g"}):
            for stream in streams:
                outcome = {}
                for road in ("python", "cpp"):
                    with torch.cuda.stream(stream) if stream is not None else torch.enable_grad():
                        try:
                            outcome[road] = roads(road, lambda: _step(op, x, needs, do, chunk=chunk))
                        except hila.HilaError as e:
                            outcome[road] = ("HilaError", str(e), e.argument)
                    if stream is not None:
                        stream.synchronize()
                py, cpp = outcome["python"], outcome["cpp"]
                if py[0] == "HilaError":
                    assert py == cpp, (dtype, py, cpp)
                    continue
                assert (py[0], cpp[0]) == ("_PlainBackward", "CppFunction")
                for i, (a, b) in enumerate(zip(py[1], cpp[1])):
                    assert a.device == b.device and torch.isfinite(a).all(), (dtype, i)
                    assert torch.equal(a, b), f"{op} {dtype} {sorted(needs)} stream={stream}: result {i} differs"


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("op", ("gla", "hla3", "loglinear_ahla", "gdn", "loglinear_gdn"))
def test_roads_equal_for_every_form(op, form, roads):
    """scan and the serial forms without a backward are differentiated with the chunk backward
    on both roads."""
    if not hila.supports(op, form):
        pytest.skip(f"{op} has no {form} form")
    x = _inputs(op, torch.float64, B=1, T=9, H=2, dk=3, dv=2)
    do = torch.randn(x["v"].shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    _same(roads, op, x, set(x), do, form=form, chunk=4)


@pytest.mark.parametrize("op,opts", [
    ("hla2", dict(normalize=True, eps=1e-3, ridge=0.25, scale=0.7)),
    ("ahla", dict(normalize=True)),
    ("gdn", dict(qk_l2norm=True)),
    ("loglinear_gdn", dict(qk_l2norm=True, scale=1.5)),
    ("gla", dict(check_values=False)),
    ("loglinear_hla2", dict(check_values=1, normalize=0)),   # flags 0 / 1 as bools, as on the Python road
])
def test_roads_equal_with_options(op, opts, roads):
    x = _inputs(op, torch.float32, B=2, T=11, H=2, dk=4, dv=3)
    do = torch.randn(x["v"].shape, generator=torch.Generator().manual_seed(5)).float()
    _same(roads, op, x, set(x), do, chunk=8, **opts)


@pytest.mark.parametrize("op", ("gla", "hla2", "hla3", "loglinear_ahla", "gdn"))
def test_roads_equal_with_untied_gates_and_without_gates(op, roads):
    """untied gates g [B, T, H, P] and g absent: equal results where the operator takes them,
    else the same HilaError on both roads."""
    do = torch.randn(2, 10, 2, 2, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    for x in (_inputs(op, torch.float64, B=2, T=10, H=2, dk=3, dv=2, untied=hila.op_traits(op)["num_primitives"] > 1),
              _inputs(op, torch.float64, drop=("g",), B=2, T=10, H=2, dk=3, dv=2)):
        outcome = {}
        for road in ("python", "cpp"):
            try:
                outcome[road] = roads(road, lambda: _step(op, x, set(x), do, chunk=4))[1]
            except hila.HilaError as e:
                outcome[road] = (str(e), e.argument)
        if isinstance(outcome["python"], tuple):
            assert outcome["python"] == outcome["cpp"]
        else:
            assert len(outcome["python"]) == len(outcome["cpp"]) == 1 + len(x)
            assert all(torch.equal(a, b) for a, b in zip(outcome["python"], outcome["cpp"]))


def test_roads_equal_without_gradients(roads):
    """no input requiring grad, torch.no_grad and inference mode: o alone, no autograd node."""
    x = _inputs("loglinear_hla3", torch.float32, B=2, T=12, H=2, dk=4, dv=3)
    ref = roads("python", lambda: ht.forward("loglinear_hla3", **x, chunk=4)[0])
    for ctx in (torch.enable_grad, torch.no_grad, torch.inference_mode):
        with ctx():
            o = roads("cpp", lambda: ht.forward("loglinear_hla3", **x, chunk=4)[0])
        assert o.grad_fn is None and torch.equal(o, ref), ctx
    leaves = {k: v.clone().requires_grad_() for k, v in x.items()}
    with torch.no_grad():
        o = roads("cpp", lambda: ht.forward("loglinear_hla3", **leaves, chunk=4)[0])
    assert o.grad_fn is None and torch.equal(o, ref)


def test_strided_inputs_and_cotangents(roads):
    """transposed inputs (innermost stride not 1) and an expanded cotangent (stride 0) are read
    from contiguous copies on both roads; an unused output costs no backward."""
    x = _inputs("hla2", torch.float64, B=1, T=10, G=2, H=2, dk=3, dv=2)
    xt = {k: (v.transpose(-1, -2).contiguous().transpose(-1, -2) if v.dim() == 4 else v) for k, v in x.items()}
    assert not xt["q"].is_contiguous()

    def run():
        leaves = {k: v.clone().requires_grad_() if k != "q" else
                  v.detach().transpose(-1, -2).contiguous().transpose(-1, -2).requires_grad_()
                  for k, v in xt.items()}
        o, _ = ht.forward("hla2", **leaves, chunk=4)
        return [o.detach()] + list(torch.autograd.grad(o.sum(), list(leaves.values())))

    py, cpp = roads("python", run), roads("cpp", run)
    assert all(torch.equal(a, b) for a, b in zip(py, cpp))


def test_the_cpp_road_runs_the_op(roads):
    x = _inputs("gla", torch.float32, B=1, T=8, H=2, dk=4, dv=3)
    leaves = {k: v.clone().requires_grad_() for k, v in x.items()}
    seen = {}
    for road in ("python", "cpp"):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            roads(road, lambda: torch.autograd.grad(ht.forward("gla", **leaves)[0].sum(), list(leaves.values())))
        seen[road] = {e.name for e in prof.events()}
    assert "hila_cpp::forward_plan" in seen["cpp"] and "hila_cpp::forward_plan" not in seen["python"]
    o = roads("cpp", lambda: ht.forward("gla", **leaves)[0])
    assert o.grad_fn.name() == "torch::autograd::CppNode<hila_cpp::PlainFunction>", o.grad_fn.name()


def _outcome(roads, road, fn):
    try:
        roads(road, fn)
    except hila.HilaError as e:
        return type(e), str(e), e.argument
    return None


@pytest.mark.parametrize("case", ["shape", "op", "form", "chunk", "dtype", "gate", "nan", "d_o", "non_tensor",
                                  "eps"])
def test_errors_are_the_same_hila_errors(case, roads):
    """bad input raises the same HilaError (class, message, argument) on both roads, in forward
    and (a NaN cotangent with value checks on) in backward through autograd.grad."""
    x = _inputs("gla", torch.float32, B=2, T=6, H=2, dk=4, dv=3)
    leaves = {k: v.clone().requires_grad_() for k, v in x.items()}
    opts, arg = {}, case
    if case == "shape":
        leaves["k"] = leaves["k"].detach()[:, :5].requires_grad_()
        arg = "k"
    elif case == "op":
        opts["op"] = "glx"
    elif case == "form":
        opts["form"] = "fast"
    elif case == "chunk":
        opts["chunk"] = 3
    elif case == "dtype":
        leaves["v"] = leaves["v"].detach().to(torch.int16)
        arg = "v"
    elif case == "gate":
        leaves["g"] = leaves["g"].detach().abs().requires_grad_()
        arg = "g"
    elif case == "nan":
        leaves["q"] = leaves["q"].detach().clone()
        leaves["q"][1, 2, 0, 1] = float("nan")
        arg = "q"
    elif case == "non_tensor":
        leaves["k"] = leaves["k"].detach().numpy()
        arg = "k"
    elif case == "eps":
        opts["eps"] = "small"
    op = opts.pop("op", "gla")

    def call():
        o, _ = ht.forward(op, **leaves, **opts)
        do = torch.full_like(o, float("nan")) if case == "d_o" else torch.ones_like(o)
        torch.autograd.grad(o, [t for t in leaves.values() if isinstance(t, torch.Tensor) and t.requires_grad], do)

    py, cpp = _outcome(roads, "python", call), _outcome(roads, "cpp", call)
    assert py is not None and py == cpp, (py, cpp)
    assert py[2] == arg, py


def test_double_backward_is_refused(roads):
    x = _inputs("gla", torch.float64)
    leaves = {k: v.clone().requires_grad_() for k, v in x.items()}
    o = roads("cpp", lambda: ht.forward("gla", **leaves)[0])
    assert type(o.grad_fn).__name__ == "CppFunction"
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(o.square().sum(), [leaves["q"]], create_graph=True)


def test_the_torch_op():
    """torch.ops.hila_cpp.forward called directly: the Python road's o; a Meta kernel (shapes
    only); the CPU kernel under inference mode; the road switch refuses nothing it has."""
    x = _inputs("gdn", torch.float32, B=1, T=8, H=2, dk=4, dv=3)
    args = ("gdn", "chunk", 64, 0.0, False, 1e-6, 0.0, True, True)
    o = torch.ops.hila_cpp.forward(x["q"], x["k"], x["v"], x["g"], None, x["beta"], *args)
    prev = ht.cpp_road(False)
    try:
        ref, _ = ht.forward("gdn", **x, qk_l2norm=True)
    finally:
        ht.cpp_road(prev)
    assert torch.equal(o, ref)
    meta = {k: v.to("meta") for k, v in x.items()}
    om = torch.ops.hila_cpp.forward(meta["q"], meta["k"], meta["v"], meta["g"], None, meta["beta"], *args)
    assert om.device.type == "meta" and om.shape == x["v"].shape and om.dtype == x["v"].dtype
    with torch.inference_mode():
        oi = torch.ops.hila_cpp.forward(x["q"], x["k"], x["v"], x["g"], None, x["beta"], *args)
    assert torch.equal(oi, ref)
    n = torch.ops.hila_cpp.plan(*args)
    assert n >= 0 and torch.ops.hila_cpp.plan(*args) == n
    assert torch.equal(torch.ops.hila_cpp.forward_plan(x["q"], x["k"], x["v"], x["g"], None, x["beta"], n), ref)
    with pytest.raises(RuntimeError, match="no plan"):
        torch.ops.hila_cpp.forward_plan(x["q"], x["k"], x["v"], x["g"], None, x["beta"], 1 << 40)
    schema = str(torch.ops.hila_cpp.forward.default._schema)
    assert schema.startswith("hila_cpp::forward(Tensor q, Tensor k, Tensor v, Tensor? g, Tensor? lam, Tensor? beta, str op")


def test_cpp_road_switch():
    prev = ht.cpp_road(False)
    try:
        assert ht.cpp_road(True) is False
        assert ht.cpp_road(prev) is True
    finally:
        ht.cpp_road(prev)


def test_plans_follow_the_options(roads):
    """the C++ op's cache of configurations (more distinct options than it keeps) never mixes two
    calls' options: every call equals the Python road's."""
    x = _inputs("hla2", torch.float64, B=1, T=6, H=1, dk=2, dv=2)
    for i in range(300):
        opts = dict(scale=0.5 + i / 1000, normalize=bool(i % 2), chunk=2 ** (1 + i % 3))
        py = roads("python", lambda: ht.forward("hla2", **x, **opts)[0])
        cpp = roads("cpp", lambda: ht.forward("hla2", **x, **opts)[0])
        assert torch.equal(py, cpp), opts
    assert np.isfinite(cpp.numpy()).all()


def _in_subprocess(code, env=None):
    import os
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, **(env or {})}, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


_PYTHON_ROAD_WORKS = """
import torch, hila.torch as ht, hila.torch.ops as h
print(repr(h._CPP_WHY))
assert h._CPP_OP is None
q = torch.randn(1, 8, 1, 4, dtype=torch.float64, requires_grad=True)
o, _ = ht.forward("gla", q, q, q, -torch.rand(1, 8, 1, dtype=torch.float64) - 0.1)
assert type(o.grad_fn).__name__ == "_PlainBackward"
torch.autograd.grad(o.sum(), [q])
try:
    ht.cpp_road(True)
except RuntimeError as e:
    assert "not available" in str(e)
else:
    raise AssertionError("cpp_road(True) without the module")
"""


def test_env_switch_and_another_torch_take_the_python_road():
    """HILA_TORCH_CPP=0, and a torch of another version than the module's build (its ABI may
    differ): hila.torch imports, runs the Python road, and says why."""
    out = _in_subprocess(_PYTHON_ROAD_WORKS, {"HILA_TORCH_CPP": "0"})
    assert "HILA_TORCH_CPP=0" in out, out
    out = _in_subprocess("import torch; torch.__version__ = '0.0.1'\n" + _PYTHON_ROAD_WORKS)
    assert "built against torch" in out and "0.0.1" in out, out
