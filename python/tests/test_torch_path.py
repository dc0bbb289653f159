# SPDX-License-Identifier: Apache-2.0
"""The eager road of hila.torch and its decode path (docs/PYTHON.md, "Host overhead"):

* a training step (forward + backward) runs no fill and no copy: its aten ops, counted with
  torch.profiler, are one ``empty`` per output and gradient;
* every output is fully written by the library: with the allocations poisoned (NaN), results
  equal the float64 naive form and are finite;
* the direct road and the registered custom ops give bitwise identical results (also with the
  serving hooks and fla's bare states) and name the same misused arguments;
* decode steps run no value checks and no host reads; ``HilaLM.generate`` gives the same tokens
  with and without its CUDA-graph decode; on a CUDA device a layer's decode step captured in a
  CUDA graph and replayed for 32 tokens equals eager decode to the bit (skipped, with the reason,
  elsewhere).
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch.profiler import ProfilerActivity, profile  # noqa: E402

import hila  # noqa: E402
import hila.torch as ht  # noqa: E402
import hila.torch.layers as hlayers  # noqa: E402
import hila.torch.ops as hops  # noqa: E402
from helpers import assert_switch, chunk_for, require_device, torch_inputs  # noqa: E402

OPS = hila.OPS
FILLS = {"aten::zeros", "aten::zeros_like", "aten::zero_", "aten::fill_", "aten::full", "aten::ones",
         "aten::new_zeros", "aten::full_like", "aten::ones_like"}
COPIES = {"aten::copy_", "aten::contiguous", "aten::clone", "aten::_to_copy", "aten::to",
          "aten::cat", "aten::stack"}
HOST_READS = {"aten::item", "aten::_local_scalar_dense", "aten::tolist"}
ALLOCS = {"aten::empty_like", "aten::empty", "aten::empty_strided"}  # empty_like calls empty


def _setflag(request, flags, value):
    """Sets a module's one-item flag list for the rest of the test."""
    prev = flags[0]
    flags[0] = value
    request.addfinalizer(lambda: flags.__setitem__(0, prev))


def _aten_ops(fn):
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return [e.name for e in prof.events() if e.name.startswith("aten::")]


def _float_inputs(op, device, dtype=torch.float32, **kw):
    """Leaves of `dtype` requiring grad (gates and the state stay float32/64 as hila takes them)."""
    x, state, mask = torch_inputs(op, device, **kw)
    x = {k: (v.detach().to(dtype) if k != "g" else v.detach().float()).requires_grad_() for k, v in x.items()}
    return x, state, mask


# ----------------------------------------------------------------------------- no fills, no copies

def _plain_road(request, road):
    """The plain training call's road for the rest of the test: "python" (the autograd.Function
    _Plain) or "cpp" (hila._torch_ops; skipped, with the reason, where it is not available)."""
    if road == "cpp" and hops._CPP_OP is None:
        pytest.skip(f"no C++ road: {hops._CPP_WHY}")
    prev = ht.cpp_road(road == "cpp")
    request.addfinalizer(lambda: ht.cpp_road(prev))


def _step_road(request, road):
    """The decode step's road for the rest of the test: "dlpack" (hila._C's step_inplace and
    BoundState over DLPack capsules) or "cpp" (hila._torch_ops.step_ on the tensors; skipped, with
    the reason, where it is not available). Both are cpp_road's switch."""
    if road == "cpp" and hops._CPP_STEP is None:
        pytest.skip(f"no C++ road: {hops._CPP_WHY}")
    prev = ht.cpp_road(road == "cpp")
    request.addfinalizer(lambda: ht.cpp_road(prev))


STEP_ROADS = ("dlpack", "cpp")


@pytest.mark.parametrize("road", ("python", "cpp"))
@pytest.mark.parametrize("op", OPS)
def test_training_step_runs_no_fills_or_copies(op, road, device, request):
    """one forward + autograd.grad: only the output and one gradient per input are allocated
    (torch.empty), nothing is filled, copied or converted, and no device value is read (on both
    roads of the plain call)."""
    require_device(device, op, "chunk", chunk_for(device, 16, op))
    _plain_road(request, road)
    x, _, _ = _float_inputs(op, device, B=2, T=40, H=2, dk=8, dv=8)
    do = torch.randn_like(x["v"])

    def step():
        o, _ = ht.forward(op, **x, chunk=chunk_for(device, 16, op), check_values=False)
        torch.autograd.grad(o, list(x.values()), do)

    step()  # first-call work (configuration cache) outside the count
    names = _aten_ops(step)
    bad = [n for n in names if n in FILLS | COPIES | HOST_READS]
    assert not bad, f"{op}: {bad} in {names}"
    assert set(names) <= ALLOCS and names.count("aten::empty_like") == 1 + len(x), names


@pytest.mark.parametrize("op", ("hla3", "loglinear_hla2", "gdn"))
def test_training_step_with_states_runs_no_fills_or_copies(op, device):
    """with an initial state (requiring grad) and every part of the final state in the loss."""
    require_device(device, op, "chunk", chunk_for(device, 4, op))
    x, state, mask = _float_inputs(op, device, T=9, n0=[3, 6])
    parts = [None if s is None else s.detach().float().requires_grad_() for s in state[1:]]
    if mask is not None:
        with torch.no_grad():
            parts[2] *= mask.float()
    init = hila.State(state[0], *parts)
    leaves = list(x.values()) + [p for p in parts if p is not None]
    o, fin = ht.forward(op, **x, initial_state=init, output_final_state=True,
                        final_slots=hila.state_slots(9 + 6), chunk=chunk_for(device, 4, op),
                        check_values=False)
    outs = [o] + [p for p in fin[1:] if p is not None]
    cots = [torch.randn_like(t) for t in outs]

    def step():
        o, fin = ht.forward(op, **x, initial_state=init, output_final_state=True,
                            final_slots=hila.state_slots(9 + 6), chunk=chunk_for(device, 4, op),
                            check_values=False)
        torch.autograd.grad([o] + [p for p in fin[1:] if p is not None], leaves, cots)

    names = _aten_ops(step)
    bad = [n for n in names if n in FILLS | COPIES | HOST_READS]
    assert not bad, f"{op}: {bad} in {names}"


def test_decode_step_allocates_only_its_output(device):
    require_device(device, "hla2")
    x, _, _ = torch_inputs("hla2", device, T=1)
    tok = {k: v.detach()[:, 0] for k, v in x.items()}
    st = ht.zero_state("hla2", 2, 2, 3, 2, dtype=torch.float64, device=device)
    with torch.no_grad():
        ht.step_("hla2", **tok, state=st, check_values=False)
        names = _aten_ops(lambda: ht.step_("hla2", **tok, state=st, check_values=False))
    assert set(names) <= ALLOCS and names.count("aten::empty_like") == 1, names


def test_packed_prefill_reads_no_device_values(device):
    """a layer's packed prefill with max_seqlen and the functional forward with final_slots read
    no device value from Python (no aten item / _local_scalar_dense; the library's own reads of
    cu_seqlens are not aten ops)."""
    require_device(device, "loglinear_gdn")
    layer = ht.LogLinearGatedDeltaNet(32, max_len=40, num_heads=2, head_dim=8, check_values=False).to(device)
    x = torch.randn(1, 21, 32, device=device)
    cu = torch.tensor([0, 5, 21], device=device)
    with torch.no_grad():
        names = _aten_ops(lambda: layer(x, cu_seqlens=cu, max_seqlen=16, use_cache=True))
    assert not [n for n in names if n in HOST_READS], names
    y, _, _ = torch_inputs("loglinear", device, B=1, T=21)
    y = {k: v.detach() for k, v in y.items()}
    names = _aten_ops(lambda: ht.forward("loglinear", **y, cu_seqlens=cu, output_final_state=True,
                                         final_slots=hila.state_slots(16), check_values=False,
                                         chunk=chunk_for(device, 8, "loglinear")))
    assert not [n for n in names if n in HOST_READS], names


# ----------------------------------------------------------------------------- poisoned outputs

POISON_CASES = [(op, dict(n0=[5, 13] if hila.op_traits(op)["loglinear"] else [3, 6])) for op in OPS]
POISON_CASES += [("hla3", dict(untied=True, normalize=True)), ("loglinear_gdn", dict(varlen=True)),
                 ("hla2", dict(varlen=True, G=2, H=4)), ("gla", dict())]


def _case_id(c):
    return c if isinstance(c, str) else "-".join(f"{k}={v}" for k, v in c.items()) or "plain"


def _run(op, x, state, mask, form, chunk, cu, opts):
    """o, the final state's parts and every gradient of one call (loss: a fixed random
    projection of o and of the final state), through hila.torch."""
    parts = None
    if state is not None:
        parts = [None if s is None else s for s in state[1:]]
        if mask is not None:
            parts[2] = parts[2] * mask
    init = None if state is None else hila.State(state[0], *parts)
    o, fin = ht.forward(op, **x, initial_state=init, output_final_state=True, cu_seqlens=cu,
                        form=form, chunk=chunk, **opts)
    outs = [o] + [p for p in fin[1:] if p is not None]
    gen = torch.Generator().manual_seed(11)
    loss = sum((t * torch.randn(t.shape, generator=gen, dtype=t.dtype).to(t.device)).sum() for t in outs)
    leaves = list(x.values()) + ([s for s in state[1:] if s is not None] if state else [])
    grads = torch.autograd.grad(loss, leaves)
    return [t.detach() for t in outs] + [fin.pos] + list(grads)


def _on_cpu(x, state, mask, cu):
    """CPU copies of a case's inputs (float tensors as new leaves requiring grad as the originals
    do): the float64 naive reference runs on the CPU backend, the only one with that form."""
    leaf = lambda t: t.detach().cpu().requires_grad_(t.requires_grad)  # noqa: E731
    xs = {k: leaf(v) for k, v in x.items()}
    st = None if state is None else [None if s is None else (s.cpu() if not s.is_floating_point() else leaf(s))
                                     for s in state]
    return xs, st, None if mask is None else mask.cpu(), None if cu is None else cu.cpu()


@pytest.mark.parametrize("road", ("direct", "custom_op"))
@pytest.mark.parametrize("op,case", POISON_CASES, ids=_case_id)
def test_poisoned_outputs_are_fully_written(op, case, road, device, request):
    """every allocation of hila.ops / hila.torch is filled with NaN before the call: the chunk
    form's outputs, final state and gradients are finite and equal the float64 naive form."""
    chunk = chunk_for(device, 4, op)
    require_device(device, op, "chunk", chunk)
    case = dict(case)
    opts = {k: case.pop(k) for k in ("normalize",) if k in case}
    varlen = case.pop("varlen", False)
    x, state, mask = torch_inputs(op, device, B=1 if varlen else 2, T=12, **case)
    if opts.get("normalize"):
        with torch.no_grad():
            x["q"].abs_(), x["k"].abs_()
    cu = torch.tensor([0, 5, 5, 12], device=device) if varlen else None
    _setflag(request, hila.ops._POISON_OUTPUTS, True)
    _setflag(request, hops._FAST, road == "direct")
    got = _run(op, x, state, mask, "chunk", chunk, cu, opts)
    _setflag(request, hops._FAST, True)
    xc, sc, mc, cuc = _on_cpu(x, state, mask, cu)  # the naive form runs on the CPU backend only
    want = _run(op, xc, sc, mc, "naive", chunk, cuc, opts)
    for i, (a, b) in enumerate(zip(got, want)):
        b = b.to(a.device)
        if not a.is_floating_point():
            assert torch.equal(a, b), (i, a, b)
            continue
        assert torch.isfinite(a).all(), f"result {i} has unwritten (NaN) elements"
        err = float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))
        assert err <= 1e-9, f"result {i}: relative error {err:.2e}"


def test_poisoned_decode_outputs_are_fully_written(device, request):
    """the functional step's new state and o, and the in-place step's o, with poisoned
    allocations, equal the float64 naive forward over the sequence."""
    require_device(device, "loglinear_hla3")
    op = "loglinear_hla3"
    x, _, _ = torch_inputs(op, device, T=9)
    x = {k: v.detach() for k, v in x.items()}
    full = ht.forward(op, **{k: v.cpu() for k, v in x.items()}, form="naive")[0].to(device)  # CPU-only form
    _setflag(request, hila.ops._POISON_OUTPUTS, True)
    _, st = ht.forward(op, **{k: v[:, :7] for k, v in x.items()}, output_final_state=True,
                       final_slots=hila.state_slots(16), chunk=chunk_for(device, 4, op))
    assert all(torch.isfinite(p).all() for p in st[1:] if p is not None)
    o7, st8 = ht.step(op, **{k: v[:, 7] for k, v in x.items()}, state=st)
    o8 = ht.step_(op, **{k: v[:, 8] for k, v in x.items()}, state=st8)
    for t, o in ((7, o7), (8, o8)):
        assert torch.isfinite(o).all()
        err = float((o - full[:, t]).abs().max() / full[:, t].abs().max())
        assert err <= 1e-10, (t, err)
    # hila.ops (numpy arrays) allocates through the same hook
    o_np, fin_np = hila.forward(op, *(x[k].cpu().numpy() for k in ("q", "k", "v", "g")),
                                lam=x["lam"].cpu().numpy(), output_final_state=True, chunk=4)
    want = full.cpu().numpy()
    assert abs(o_np - want).max() <= 1e-10 * abs(want).max()
    assert all(np.isfinite(p).all() for p in fin_np[1:] if p is not None)


# ----------------------------------------------------------------------------- both roads

ROAD_CASES = [("gla", dict()), ("hla2", dict(n0=[3, 6])), ("loglinear_ahla", dict(n0=[5, 13])),
              ("gdn", dict(varlen=True)), ("loglinear_gdn", dict(n0=[2, 9]))]


@pytest.mark.parametrize("op,case", ROAD_CASES, ids=_case_id)
def test_direct_road_equals_custom_ops(op, case, device, request):
    """forward, final state and gradients through the direct road equal those through
    torch.ops.hila.* bit for bit, and each road really runs (the custom op shows in the profile
    only on its own road)."""
    chunk = chunk_for(device, 4, op)
    require_device(device, op, "chunk", chunk)
    case = dict(case)
    varlen = case.pop("varlen", False)
    x, state, mask = torch_inputs(op, device, B=1 if varlen else 2, T=12, **case)
    cu = torch.tensor([0, 7, 12], device=device) if varlen else None
    results, seen = {}, {}
    for road in ("direct", "custom_op"):
        _setflag(request, hops._FAST, road == "direct")
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            results[road] = _run(op, x, state, mask, "chunk", chunk, cu, {})
        seen[road] = {e.name for e in prof.events()}
    assert "hila::forward" not in seen["direct"] and "hila::backward" not in seen["direct"]
    assert "hila::forward" in seen["custom_op"] and "hila::backward" in seen["custom_op"]
    for i, (a, b) in enumerate(zip(results["direct"], results["custom_op"])):
        assert torch.equal(a, b), f"result {i} differs between the roads"


@pytest.mark.parametrize("road", ("python", "cpp"))
@pytest.mark.parametrize("op", ("gla", "hla2", "loglinear_ahla", "gdn", "loglinear_gdn"))
def test_plain_training_call_equals_the_other_roads(op, road, device, request):
    """a call without states (the direct road's plain autograd function, o alone: _Plain, or the
    C++ one of hila._torch_ops): o and the gradients of the inputs that need them equal, bit for
    bit, those of the custom ops and of the same call returning a final state (the general
    autograd function)."""
    chunk = chunk_for(device, 4, op)
    require_device(device, op, "chunk", chunk)
    _plain_road(request, road)
    plain_fn = "_PlainBackward" if road == "python" else "CppFunction"
    x, _, _ = torch_inputs(op, device, B=2, T=12)
    names = list(x)
    gen = torch.Generator().manual_seed(5)

    def run(road, final, needs, do):
        leaves = {k: v.detach().requires_grad_(k in needs) for k, v in x.items()}
        _setflag(request, hops._FAST, road == "direct")
        o, fin = ht.forward(op, **leaves, chunk=chunk, output_final_state=final)
        assert (fin is not None) == final
        grads = torch.autograd.grad(o, [leaves[k] for k in names if k in needs], do)
        return type(o.grad_fn).__name__, [o.detach()] + list(grads)

    for needs in (set(names), {"q"}, {"v", "g"}):
        do = torch.randn(x["v"].shape, generator=gen, dtype=torch.float64).to(device)
        fn, plain = run("direct", False, needs, do)
        assert fn == plain_fn, fn
        for other_road, final in (("custom_op", False), ("direct", True)):
            fn, other = run(other_road, final, needs, do)
            assert fn not in ("_PlainBackward", "CppFunction"), (other_road, final, fn)
            for i, (a, b) in enumerate(zip(plain, other)):
                assert torch.equal(a, b), f"{other_road} final={final} needs={sorted(needs)}: result {i} differs"


@pytest.mark.parametrize("op", ("hla3", "loglinear_gdn"))
def test_decode_roads_equal(op, device, request):
    """step (differentiable: o, new state, gradients) and step_ (in place) give the same bits on
    both roads."""
    require_device(device, op)
    x, state, mask = torch_inputs(op, device, T=1, n0=[5, 11])
    tok = {k: v.detach()[:, 0].requires_grad_() for k, v in x.items()}
    parts = [None if s is None else s.detach() for s in state[1:]]
    if mask is not None:
        parts[2] = parts[2] * mask
    out = {}
    for road in ("direct", "custom_op"):
        _setflag(request, hops._FAST, road == "direct")
        leaves = [p.clone().requires_grad_() for p in parts if p is not None]
        it = iter(leaves)
        st = hila.State(state[0], *[None if p is None else next(it) for p in parts])
        o, new = ht.step(op, **tok, state=st)
        outs = [o] + [p for p in new[1:] if p is not None]
        grads = torch.autograd.grad(sum(t.square().sum() for t in outs), list(tok.values()) + leaves)
        st_ip = hila.State(state[0].clone(), *[None if p is None else p.clone() for p in parts])
        with torch.no_grad():
            o_ip = ht.step_(op, **{k: v.detach() for k, v in tok.items()}, state=st_ip)
        out[road] = [t.detach() for t in outs] + list(grads) + [o_ip] + [p for p in st_ip if p is not None]
    for i, (a, b) in enumerate(zip(out["direct"], out["custom_op"])):
        assert torch.equal(a, b), f"result {i} differs between the roads"


@pytest.mark.parametrize("op", ["gla", "loglinear_gdn"])
def test_serving_hooks_and_bare_states_equal_on_both_roads(request, op):
    """The keywords of the serving hooks (state_indices with a padding row, cu_seqlens_cpu,
    max_seqlen) and fla's bare [N, H, dk, dv] state (gla) take the direct road with results equal
    to the custom ops' bit for bit; the gradient to a bare initial state is that of its State."""
    x, _, _ = torch_inputs(op, "cpu", B=1, T=9, H=2, dk=4, dv=3)
    x = {k: v.detach() for k, v in x.items()}
    cu = torch.tensor([0, 4, 9])
    t = hila.op_traits(op)
    out = {}
    for road in ("direct", "custom_op"):
        _setflag(request, hops._FAST, road == "direct")
        pool = ht.allocate_state_pool(op, 4, 2, 4, 3, max_len=16, dtype=torch.float64)
        rows = torch.tensor([2, 0])
        o, _ = ht.forward(op, **x, cu_seqlens=cu, initial_state=pool, state_indices=rows,
                          cu_seqlens_cpu=cu.clone(), max_seqlen=5, check_values=False)
        o_fin, fin = ht.forward(op, **x, cu_seqlens=cu, cu_seqlens_cpu=cu.clone(), max_seqlen=5,
                                output_final_state=True)
        tok = {k: v[0, :3] for k, v in x.items()}                      # 3 decode rows, one padding
        o_t = ht.step_(op, **tok, state=pool, state_indices=torch.tensor([0, -1, 2]))
        res = [o, o_fin, o_t] + [p for p in pool + fin if p is not None]
        if not t["loglinear"]:
            h0 = torch.randn(2, 2, 4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(3),
                             requires_grad=True)
            o_b, fin_b = ht.forward(op, **x, cu_seqlens=cu, initial_state=h0, output_final_state=True)
            (dh0,) = torch.autograd.grad(o_b.square().sum() + fin_b.H.sum(), [h0])
            h0s = h0.detach().clone().requires_grad_()
            o_s, fin_s = ht.forward(op, **x, cu_seqlens=cu, output_final_state=True,
                                    initial_state=hila.State(torch.zeros(2, dtype=torch.int64), None, None, h0s))
            (dh0s,) = torch.autograd.grad(o_s.square().sum() + fin_s.H.sum(), [h0s])
            assert torch.equal(o_b, o_s) and torch.equal(dh0, dh0s)
            res += [o_b.detach(), dh0]
        out[road] = res
    assert len(out["direct"]) == len(out["custom_op"])
    for i, (a, b) in enumerate(zip(out["direct"], out["custom_op"])):
        assert torch.equal(a, b), f"result {i} differs between the roads"
    assert not out["direct"][2][1].any()                                # the padding row's output


@pytest.mark.parametrize("road", ["direct", "custom_op"])
@pytest.mark.parametrize("grad", [False, True])
def test_arguments_that_are_not_tensors_are_named_on_both_roads(request, road, grad):
    """A numpy array or a list among the tensors of a hila.torch call (q a tensor) is a HilaError
    naming it on either road, with or without gradients (the direct road checks only when the
    call failed on it; the custom ops before their schema check). Flags take 0/1 as bools on
    both roads (as the custom ops' bool arguments do) and refuse anything else by name."""
    _setflag(request, hops._FAST, road == "direct")
    x, _, _ = torch_inputs("gla", "cpu", B=2, T=5, H=2, dk=4, dv=3)
    if not grad:
        x = {k: v.detach() for k, v in x.items()}
    tok = {k: v[:, 0] for k, v in x.items()}
    st = lambda: ht.zero_state("gla", 2, 2, 4, 3, dtype=torch.float64)  # noqa: E731

    def named(call, argument):
        with pytest.raises(hila.HilaError) as err:
            call()
        assert err.value.argument == argument, str(err.value)
        assert "torch.Tensor" in str(err.value) and "Expected a value of type" not in str(err.value)

    named(lambda: ht.forward("gla", x["q"], x["k"].detach().numpy(), x["v"], x["g"]), "k")
    named(lambda: ht.forward("gla", x["q"], x["k"], x["v"], x["g"].tolist()), "g")
    bad_state = hila.State(torch.zeros(2, dtype=torch.int64), None, None, np.zeros((2, 2, 4, 3)))
    named(lambda: ht.forward("gla", **x, initial_state=bad_state), "initial_state.H")
    named(lambda: ht.step("gla", **{**tok, "v": tok["v"].detach().numpy()}, state=st()), "v")
    named(lambda: ht.step_("gla", **{**tok, "v": tok["v"].detach().numpy()}, state=st()), "v")
    named(lambda: ht.step_("gla", **tok, state=bad_state), "state.H")
    for flag in (1, True, 0):
        ht.forward("gla", **x, check_values=flag)
    with pytest.raises(hila.HilaError) as err:
        ht.forward("gla", **x, check_values=2) if road == "direct" else hila.forward(
            "gla", *(v.detach().numpy() for v in x.values()), check_values=2)
    assert err.value.argument == "check_values"


# ----------------------------------------------------------------------------- value checks by default

@pytest.mark.parametrize("road", ("direct", "custom_op"))
def test_default_checks_values_on_the_cpu(road, request):
    """check_values=None (the default of hila.torch) checks CPU tensors: a positive gate or a NaN
    input is a HilaError naming it, in forward (also with gradients), step and step_; an explicit
    False skips the scan."""
    _setflag(request, hops._FAST, road == "direct")
    x, _, _ = torch_inputs("gla", "cpu", B=2, T=5, H=2, dk=4, dv=3)
    bad_g = {**x, "g": x["g"].detach().abs().requires_grad_()}
    bad_q = {**x, "q": x["q"].detach().clone()}
    bad_q["q"][1, 2, 0, 1] = float("nan")
    for bad, arg in ((bad_g, "g"), (bad_q, "q")):
        for leaves in (bad, {k: v.detach() for k, v in bad.items()}):
            with pytest.raises(hila.HilaError) as e:
                ht.forward("gla", **leaves)
            assert e.value.argument == arg, str(e.value)
        tok = {k: v.detach()[:, 2] for k, v in bad.items()}
        for call in (lambda: ht.step("gla", **tok, state=ht.zero_state("gla", 2, 2, 4, 3, dtype=torch.float64)),
                     lambda: ht.step_("gla", **tok, state=ht.zero_state("gla", 2, 2, 4, 3, dtype=torch.float64))):
            with pytest.raises(hila.HilaError) as e:
                call()
            assert e.value.argument == arg, str(e.value)
    o, _ = ht.forward("gla", **{k: v.detach() for k, v in bad_g.items()}, check_values=False)
    assert o.shape == x["v"].shape
    assert hops._default_checks(torch.empty(1)) and not hops._default_checks(torch.empty(1, device="meta"))


def _host_runs_ahead(fn, device):
    """Whether fn() returns while the GPU is still busy with earlier work (a spin kernel of 10^9
    clock cycles, about half a second): it then waited for nothing, i.e. neither torch nor hila
    synchronised the device inside it. torch.cuda.set_sync_debug_mode("error") also raises on
    torch's own synchronising calls (hila's are not torch's, hence the spin)."""
    torch.cuda.synchronize(device)
    spin = torch.cuda.Event(enable_timing=False)
    torch.cuda._sleep(1_000_000_000)
    spin.record()
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    finally:
        torch.cuda.set_sync_debug_mode(prev)
    ahead = not spin.query()
    torch.cuda.synchronize(device)
    return ahead


@pytest.mark.parametrize("op", ("gla", "hla2", "gdn", "loglinear_gdn"))
def test_default_training_calls_do_not_synchronize_on_cuda(op, device):
    """On CUDA the defaults of hila.torch (check_values=None: no value scans there) let a forward
    + backward, and a layer's training call, run without a device synchronisation: the host gets
    back before the GPU has finished earlier work."""
    if not device.startswith("cuda"):
        pytest.skip("checks device synchronisation: needs a CUDA device")
    require_device(device, op)
    x, _, _ = _float_inputs(op, device, dtype=torch.bfloat16, B=2, T=128, H=2, dk=32, dv=32)
    do = torch.randn_like(x["v"])

    def train_step():
        o, _ = ht.forward(op, **x, qk_l2norm=hila.op_traits(op)["delta"])
        torch.autograd.grad(o, list(x.values()), do)

    train_step()  # first-call work (configuration, kernel loading) outside the check
    assert _host_runs_ahead(train_step, device), f"{op}: a default forward + backward synchronised"
    if op in ("hla2", "loglinear_gdn"):
        torch.manual_seed(0)
        layer = (ht.HLAAttention(64, num_heads=2, head_dim=32, op="hla2") if op == "hla2" else
                 ht.LogLinearGatedDeltaNet(64, max_len=256, num_heads=2, head_dim=32)).to(device)
        xl = torch.randn(2, 128, 64, device=device, requires_grad=True)

        def layer_step():
            y, _ = layer(xl)
            y.square().mean().backward()

        layer_step()
        assert _host_runs_ahead(layer_step, device), f"{op}: a default layer call synchronised"


@pytest.mark.parametrize("op", ("gla", "hla2", "loglinear", "gdn", "loglinear_gdn"))
def test_bare_decode_steps_do_not_synchronize_on_cuda(op, device):
    """On CUDA, step_ with default arguments and no max_position on a State that hila.torch made
    and stepped reads nothing back: a log-linear one passes its capacity bound (after pos is
    written, the positions are read once), so the steps run ahead of the GPU and a CUDA graph can
    capture one; the graph's replays then give eager's o and state, to the bit."""
    if not device.startswith("cuda"):
        pytest.skip("checks device synchronisation: needs a CUDA device")
    require_device(device, op)
    t = hila.op_traits(op)
    N, H, d = 2, 2, 32
    g = torch.Generator(device=device).manual_seed(0)
    tok = dict(q=torch.randn(N, H, d, device=device, generator=g, dtype=torch.bfloat16) * d ** -0.5,
               k=torch.randn(N, H, d, device=device, generator=g, dtype=torch.bfloat16) * d ** -0.5,
               v=torch.randn(N, H, d, device=device, generator=g, dtype=torch.bfloat16),
               g=torch.full((N, H), -0.05, device=device))
    if t["loglinear"]:
        tok["lam"] = torch.rand(N, H, hila.levels_needed(0, 512), device=device, generator=g, dtype=torch.bfloat16)
    if t["delta"]:
        tok["beta"] = torch.full((N, H), 0.5, device=device, dtype=torch.bfloat16)
    st = ht.zero_state(op, N, H, d, d, max_len=512, device=device)

    def steps(state, n=4):
        with torch.no_grad():
            for _ in range(n):
                ht.step_(op, **tok, state=state)

    steps(st, 2)  # the State bound to the extension (its second step)
    assert _host_runs_ahead(lambda: steps(st), device), f"{op}: a bare step_ synchronised"
    with torch.no_grad():
        st.pos.fill_(100)
    steps(st, 1)  # the positions read once (log-linear)
    assert _host_runs_ahead(lambda: steps(st), device), f"{op}: a bare step_ synchronised after pos was written"
    torch.cuda.synchronize(device)
    eager = hila.State(*(None if x is None else x.clone() for x in st))  # at position 105
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        o = ht.step_(op, **tok, state=st)  # recorded, not run
    assert hops._POSITIONS not in st.__dict__ or not t["loglinear"]  # a captured step keeps no bound
    outs = []
    for _ in range(3):
        graph.replay()
        outs.append(o.clone())
    with torch.no_grad():
        eager_outs = [ht.step_(op, **tok, state=eager) for _ in range(3)]
    assert st.pos.tolist() == [108, 108]
    assert all(torch.equal(a, b) for a, b in zip(outs, eager_outs))
    assert all(a is None or torch.equal(a, b) for a, b in zip(st, eager))
    with torch.no_grad():
        o_next = ht.step_(op, **tok, state=st)  # eager after the replays: positions read again
        o_ref = ht.step_(op, **tok, state=eager)
    assert torch.equal(o_next, o_ref) and all(a is None or torch.equal(a, b) for a, b in zip(st, eager))


@pytest.mark.parametrize("op", ("gla", "gdn"))
def test_large_training_call_in_a_cuda_graph_equals_eager(op, device):
    """forward + backward of a call whose tensors take more than 1/512 of the device's memory
    (such a call plans its temporaries against the device's free memory), captured in a CUDA graph
    with torch.cuda.graph and replayed, gives the outputs and gradients of eager calls: the call
    asks the device nothing inside the capture. Outputs are poisoned before each replay."""
    if not device.startswith("cuda"):
        pytest.skip("CUDA graphs need a CUDA device")
    require_device(device, op)
    H, d = 4, 64
    per_token = 2 * H * d * 4  # bf16 q, k, v, o
    need = torch.cuda.get_device_properties(device).total_memory // 512
    T = -(-2 * need // per_token // 64) * 64  # twice the bytes of the threshold
    gen = torch.Generator(device=device).manual_seed(0)
    x = dict(q=torch.randn(1, T, H, d, device=device, generator=gen, dtype=torch.bfloat16) * d ** -0.5,
             k=torch.randn(1, T, H, d, device=device, generator=gen, dtype=torch.bfloat16) * d ** -0.5,
             v=torch.randn(1, T, H, d, device=device, generator=gen, dtype=torch.bfloat16),
             g=torch.empty(1, T, H, device=device).uniform_(-0.05, 0.0, generator=gen))
    if op == "gdn":
        x["q"], x["k"] = torch.nn.functional.normalize(x["q"], dim=-1), torch.nn.functional.normalize(x["k"], dim=-1)
        x["beta"] = torch.rand(1, T, H, device=device, generator=gen, dtype=torch.bfloat16)
    do = torch.randn(1, T, H, d, device=device, generator=gen, dtype=torch.bfloat16)

    def call(leaves):
        o, _ = ht.forward(op, **leaves)
        return (o, *torch.autograd.grad(o, tuple(leaves.values()), do))

    eager = call({k: v.detach().requires_grad_() for k, v in x.items()})
    # the captured call's own leaves, first used on the side stream (torch's recipe: autograd
    # keeps, per leaf, the stream it first met it on, and a leaf first met on the default stream
    # would make the capture sync that legacy stream)
    leaves = {k: v.detach().clone().requires_grad_() for k, v in x.items()}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call(leaves)  # warm-up on the capture's stream
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = call(leaves)
    for _ in range(2):
        for t in outs:
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for name, a, b in zip(("o", *leaves), outs, eager):  # the same kernels: equal up to the
            # order of atomic sums (a few units in the last place of a bf16 element at most)
            assert torch.isfinite(a).all(), (op, name)
            err = float((a.float() - b.float()).abs().max() / b.float().abs().max())
            assert err <= 1e-2, (op, name, err)


def test_strided_step_inputs_take_the_general_road(request):
    """step_ on inputs whose innermost stride is not 1 (which the decode fast path passes as they
    are, and the library refuses before writing anything) gives the result of contiguous inputs,
    bit for bit, advancing the state once."""
    x, _, _ = torch_inputs("hla2", "cpu", T=1, dk=4, dv=3)
    tok = {k: v.detach()[:, 0] for k, v in x.items()}
    wide = torch.stack([tok["q"], torch.zeros_like(tok["q"])], -1)       # [N, G, dk, 2]
    strided = {**tok, "q": wide[..., 0]}                                  # innermost stride 2
    assert strided["q"].stride(-1) == 2 and torch.equal(strided["q"], tok["q"])
    a = ht.zero_state("hla2", 2, 2, 4, 3, dtype=torch.float64)
    b = ht.zero_state("hla2", 2, 2, 4, 3, dtype=torch.float64)
    with torch.no_grad():
        oa = ht.step_("hla2", **tok, state=a)
        ob = ht.step_("hla2", **strided, state=b)
    assert torch.equal(oa, ob) and b.pos.tolist() == [1, 1]
    assert all(p is None or torch.equal(p, r) for p, r in zip(a, b))
    with pytest.raises(hila.HilaError) as e:   # an option the fast path cannot hash: named as before
        ht.step_("hla2", **tok, state=b, scale=[0.5])
    assert e.value.argument == "scale"


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64), ids=("f32", "f64"))
@pytest.mark.parametrize("op", OPS)
def test_step_roads_give_the_same_bits(op, dtype, device, request):
    """The decode loop's step_ on the C++ road (hila._torch_ops.step_ on the tensors) gives the
    bits of the DLPack road (hila._C) and of the custom op, for o and every state part, over 9
    tokens from a state at positions 5 and 9, with GQA (G = 1, H = 2), untied gates, strided
    inputs (q a slice of a wider tensor), max_position or not; on both roads a state part saved for
    autograd is stale afterwards (version advanced) and o is a new contiguous tensor."""
    require_device(device, op)
    _step_road(request, "cpp")
    x, state, mask = torch_inputs(op, device, T=9, n0=[5, 9], untied=hila.op_traits(op)["num_primitives"] > 1)
    x = {k: v.detach().to(dtype) if k != "g" else v.detach() for k, v in x.items()}
    parts = [None if s is None else s.detach().clone().to(dtype) for s in state[1:]]
    if mask is not None:  # dead slots zero, and the slots of a step from max_position = 31
        H = parts[2] * mask.to(dtype)
        parts[2] = torch.cat([H, H.new_zeros(H.shape[:2] + (hila.state_slots(32) - H.shape[2],) + H.shape[3:])], 2)
    roads = {r: hila.State(state[0].clone(), *(None if p is None else p.clone() for p in parts))
             for r in ("cpp", "dlpack", "custom_op")}
    for t in range(9):
        tok = {k: v[:, t] for k, v in x.items()}
        tok["q"] = torch.cat([tok["q"], tok["q"]], -1)[..., :tok["q"].shape[-1]]  # strided
        kw = dict(max_position=31) if t % 2 else {}
        outs = {}
        with torch.no_grad():
            for r, st in roads.items():
                versions = [None if p is None else p._version for p in st]
                ht.cpp_road(r == "cpp")
                _setflag(request, hops._FAST, r != "custom_op")
                outs[r] = ht.step_(op, **tok, state=st, check_values=False, **kw)
                assert all(p is None or p._version > v for p, v in zip(st, versions)), r
        _setflag(request, hops._FAST, True)
        ht.cpp_road(True)
        assert outs["cpp"].is_contiguous() and outs["cpp"].dtype == x["v"].dtype
        for r in ("dlpack", "custom_op"):
            assert torch.equal(outs["cpp"], outs[r]), (r, t)
            assert all(a is None or torch.equal(a, b) for a, b in zip(roads["cpp"], roads[r])), (r, t)
        assert torch.isfinite(outs["cpp"]).all()
    assert roads["cpp"].pos.tolist() == [14, 18]


@pytest.mark.parametrize("road", ("python", "cpp"))
def test_lazily_negated_inputs_are_read_as_their_values(road, device, request):
    """An input with torch's lazy negation bit (torch._neg_view; also what .imag of a conjugated
    complex tensor gives), whose memory holds -x, is read as x on every road of forward, backward
    and step_ (torch's DLPack export drops the bit, so hila applies it first): the outputs and
    gradients equal those of the resolved tensor, to the bit."""
    require_device(device, "gdn")
    _plain_road(request, road)
    _step_road(request, "cpp" if road == "cpp" else "dlpack")
    x, _, _ = torch_inputs("gdn", device, T=9)
    x = {k: v.detach() for k, v in x.items()}
    neg = torch._neg_view(-x["q"])  # the values of q, stored negated
    assert neg.is_neg() and torch.equal(neg.resolve_neg(), x["q"])
    do = torch.randn_like(x["v"])

    def grads(q):
        leaves = {**x, "q": q}
        leaves = {k: v.requires_grad_() if v.is_leaf else v for k, v in leaves.items()}
        o, _ = ht.forward("gdn", **leaves)
        return (o, *torch.autograd.grad(o, (leaves["k"], leaves["v"]), do))

    base = {k: v.clone() for k, v in x.items()}
    ref = grads(base["q"].clone().requires_grad_())
    got = grads(torch._neg_view(-x["q"].clone()).requires_grad_())
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    sts = [ht.zero_state("gdn", 2, 2, 3, 2, dtype=torch.float64, device=device) for _ in range(2)]
    with torch.no_grad():
        for t in range(3):
            tok = {k: v[:, t] for k, v in x.items()}
            o_ref = ht.step_("gdn", **tok, state=sts[0])
            o = ht.step_("gdn", **{**tok, "q": torch._neg_view(-tok["q"]), "beta": torch._neg_view(-tok["beta"])},
                         state=sts[1])
            assert torch.equal(o, o_ref), t
    assert all(a is None or torch.equal(a, b) for a, b in zip(*sts))


@pytest.mark.parametrize("op", ("gla", "hla3", "loglinear_gdn"))
def test_bound_state_steps_follow_the_state_memory(op, device, request):
    """On the DLPack road, from its second step, a State stepped by step_ is bound to the extension
    once (hila.torch keeps the binding in the State's __dict__): 6 steps give the custom op's bits;
    a part re-pointed at other memory (.data =, set_) is rebound before the next step, which reads
    and advances the new memory; copies and pickles of a State carry no binding."""
    import copy
    import pickle
    require_device(device, op)
    _step_road(request, "dlpack")
    x, state, mask = torch_inputs(op, device, T=6, n0=[5, 9])  # positions up to 15: 5 Fenwick slots
    x = {k: v.detach() for k, v in x.items()}
    parts = [None if s is None else s.detach().clone() for s in state[1:]]
    if mask is not None:
        parts[2] = parts[2] * mask
    st = hila.State(state[0].clone(), *parts)
    ref = hila.State(*(None if p is None else p.clone() for p in st))
    with torch.no_grad():
        for t in range(6):
            tok = {k: v[:, t] for k, v in x.items()}
            o = ht.step_(op, **tok, state=st)
            _setflag(request, hops._FAST, False)
            o_ref = ht.step_(op, **tok, state=ref)
            _setflag(request, hops._FAST, True)
            assert torch.equal(o, o_ref), t
            if t == 2:
                assert isinstance(st.__dict__[hops._BOUND][1], hila._C.BoundState)
                st.H.data = st.H.clone()                      # new memory, same values
                st.pos.set_(st.pos.clone())
                ref.H.mul_(1.0)
        assert st.__dict__[hops._BOUND][1] is not None        # rebound after the re-pointing
    for a, b in zip(st, ref):
        assert (a is None and b is None) or torch.equal(a, b)
    for other in (copy.copy(st), copy.deepcopy(st), pickle.loads(pickle.dumps(st))):
        assert type(other) is hila.State and not other.__dict__ and other.pos.tolist() == st.pos.tolist()


def _bound_loglinear_gdn(device):
    """A loglinear_gdn state stepped twice, its next token, and its binding to the extension (None
    on the C++ road, which binds nothing)."""
    x, _, _ = torch_inputs("loglinear_gdn", device, T=3, dk=4, dv=3)
    x = {k: v.detach() for k, v in x.items()}
    st = ht.zero_state("loglinear_gdn", 2, 2, 4, 3, max_len=8, dtype=torch.float64, device=device)
    with torch.no_grad():
        for t in range(2):
            ht.step_("loglinear_gdn", **{k: v[:, t] for k, v in x.items()}, state=st)
    bound = st.__dict__.get(hops._BOUND, (None, None))[1]
    assert isinstance(bound, hila._C.BoundState) == (hops._CPP[0] is None)
    return st, {k: v[:, 2] for k, v in x.items()}, bound


def _bad_bound_tokens(tok, device):
    """(what, argument, token) of step_ inputs the bound fast path must reject, naming them."""
    other = "cpu" if str(device).startswith("cuda") else ("cuda" if torch.cuda.is_available() else None)
    cases = [
        ("k of another head dim", "k", {**tok, "k": tok["k"][..., :3]}),
        ("q of 4 dims", "q", {**tok, "q": tok["q"][:, None]}),
        ("k of another batch", "k", {**tok, "k": tok["k"][:1]}),
        ("v of another dtype", "v", {**tok, "v": tok["v"].float()}),
        ("integer q", "q", {**tok, "q": tok["q"].long(), "k": tok["k"].long()}),
        ("g of another shape", "g", {**tok, "g": tok["g"][:, :1]}),
        ("lam of too few levels", "lam", {**tok, "lam": tok["lam"][..., :2]}),
        ("no beta", "beta", {**tok, "beta": None}),
        ("beta of another shape", "beta", {**tok, "beta": tok["beta"][:1]}),
    ]
    if other is not None:
        cases.append(("v on another device", "v", {**tok, "v": tok["v"].to(other)}))
    return cases


@pytest.mark.parametrize("road", STEP_ROADS)
@pytest.mark.parametrize("what", [c[0] for c in _bad_bound_tokens(
    {k: torch.zeros(2, 2, 4) for k in ("q", "k", "v", "g", "lam", "beta")}, "cpu")])
def test_bound_step_rejects_bad_inputs(what, road, device, request):
    """A decode loop's step, on a bound state (lent DLPack capsules, o by pointer) or on the C++
    road (the tensors themselves), checks every input as step_inplace does: a wrong shape, dtype or
    device is a HilaError naming the argument, the state untouched, and the binding stays in use."""
    require_device(device, "loglinear_gdn")
    _step_road(request, road)
    st, tok, bound = _bound_loglinear_gdn(device)
    cases = {c[0]: c[1:] for c in _bad_bound_tokens(tok, device)}
    if what not in cases:
        pytest.skip(f"{what}: needs a second device")
    argument, bad = cases[what]
    before = [None if p is None else p.clone() for p in st]
    with torch.no_grad(), pytest.raises(hila.HilaError) as e:
        ht.step_("loglinear_gdn", **bad, state=st)
    assert e.value.argument == argument, str(e.value)
    assert all(a is None or torch.equal(a, b) for a, b in zip(st, before))
    assert st.__dict__.get(hops._BOUND, (None, None))[1] is bound
    with torch.no_grad():
        ht.step_("loglinear_gdn", **tok, state=st)  # the same binding steps on
    assert st.pos.tolist() == [3, 3] and st.__dict__.get(hops._BOUND, (None, None))[1] is bound


def test_bound_step_strided_and_lent_arguments(device, request):
    """The bound step reads strided inputs (outer strides of a slice, a transposed v) in place and
    writes a contiguous o; its arguments are read from DLPack capsules left unconsumed, and what is
    not an unused capsule, or a null o, is a HilaError naming the argument."""
    from torch.utils.dlpack import to_dlpack
    require_device(device, "loglinear_gdn")
    _step_road(request, "dlpack")
    st, tok, bound = _bound_loglinear_gdn(device)
    ref = hila.State(*(None if p is None else p.clone() for p in st))
    qs = torch.cat([tok["q"], torch.full_like(tok["q"], float("nan"))], -1)[..., :4]  # strides (8, 8, 1)
    vt = tok["v"].transpose(0, 1).contiguous().transpose(0, 1)  # [N, H, dv], strides (dv, N dv, 1)
    assert not qs.is_contiguous() and not vt.is_contiguous() and torch.equal(vt, tok["v"])
    with torch.no_grad():
        o = ht.step_("loglinear_gdn", **{**tok, "q": qs, "v": vt}, state=st)
        o_ref = ht.step_("loglinear_gdn", **tok, state=ref)
    assert st.__dict__[hops._BOUND][1] is bound
    assert o.is_contiguous() and torch.equal(o, o_ref)
    assert all(a is None or torch.equal(a, b) for a, b in zip(st, ref))
    spec = hops._spec("loglinear_gdn", "chunk", 64, 0.0, False, 1e-6, 0.0, False, False)
    o = torch.empty_like(tok["v"])
    args = [to_dlpack(tok[k]) for k in ("q", "k", "v", "g", "lam", "beta")]
    used = to_dlpack(tok["k"])
    torch.from_dlpack(used)  # consumed: renamed "used_dltensor"
    for i, name, arg in ((0, "q", tok["q"]), (1, "k", used), (3, "g", "g")):
        bad = list(args)
        bad[i] = arg
        with pytest.raises(hila.HilaError) as e:
            bound.step(spec.cfg, *bad, o.data_ptr(), 0, -1)
        assert e.value.argument == name, str(e.value)
    with pytest.raises(hila.HilaError) as e:
        bound.step(spec.cfg, *args, 0, 0, -1)
    assert e.value.argument == "o"
    assert st.pos.tolist() == [3, 3]  # nothing stepped by the rejected calls
    bound.step(spec.cfg, *args, o.data_ptr(), 0, -1)  # the capsules were lent, not used up
    assert st.pos.tolist() == [4, 4] and torch.isfinite(o).all()


def test_step_capacity_bound():
    """_capacity(slots, levels) is the largest position a log-linear step can start from: the
    step to p + 1 fits the slots (state_slots(p + 1) <= slots) and lam has the levels of p
    (bitlen(p) + 1 <= levels), and p + 1 misses one of them."""
    fits = lambda p, slots, levels: hila.state_slots(p + 1) <= slots and p.bit_length() + 1 <= levels  # noqa: E731
    for slots in range(0, 12):
        for levels in range(0, 12):
            cap = hops._capacity(slots, levels)
            assert cap == -1 or fits(cap, slots, levels), (slots, levels, cap)
            assert not fits(cap + 1, slots, levels), (slots, levels, cap)
    assert hops._capacity(80, 80) == (1 << 62) - 1  # the library's bound on positions


def _spy_steps(monkeypatch, seen, counters=None):
    """Records the max_position (in ``seen``) and, given a list, the step counters (in
    ``counters``) of every in-place step on both roads of the decode loop: hila._C's (see
    _BoundSpy) and hila._torch_ops.step_ (the counters tensor, or None)."""
    monkeypatch.setattr(hops, "_C", _BoundSpy(hops._C, seen, counters))
    real = hops._CPP_STEP
    if real is not None:
        def cpp_step(*a):
            seen.append(a[11])
            if counters is not None:
                counters.append(a[12])
            return real(*a)
        monkeypatch.setattr(hops, "_CPP_STEP", cpp_step)


class _BoundSpy:
    """hila._C with the max_position of every in-place step recorded (unbound and bound steps), and
    the step counters passed in ``counters`` when given a list: a tensor (unbound steps), the capsule
lent (bound steps), or None."""

    def __init__(self, real, seen, counters=None):
        self._real, self._seen, self._counters = real, seen, counters

    def __getattr__(self, name):
        real, seen, counters = self._real, self._seen, self._counters
        if name == "step_inplace":
            def step_inplace(*a, **k):
                seen.append(k.get("max_position", -1))
                if counters is not None:
                    c = k.get("counters")
                    counters.append(None if c is None else torch.from_dlpack(c))
                    k["counters"] = None if c is None else counters[-1]
                return real.step_inplace(*a, **k)
            return step_inplace
        if name == "BoundState":
            class Bound:
                def __init__(self, parts):
                    self.b = real.BoundState(parts)

                def step(self, *a, **k):
                    seen.append(a[-1])
                    if counters is not None:
                        counters.append(k.get("counters"))  # the capsule lent (None: no counters)
                    return self.b.step(*a, **k)
            return Bound
        return getattr(real, name)


@pytest.mark.parametrize("road", STEP_ROADS)
@pytest.mark.parametrize("op", ("loglinear", "loglinear_gdn", "loglinear_hla2"))
def test_step_position_bound_follows_the_state(op, road, device, request, monkeypatch):
    """A log-linear step_ without max_position passes the capacity bound exactly while the State's
    kept largest position holds: from zero_state and its own steps, the positions re-read once
    after any write to pos (indexing, fill_, zero_, set_, a pool step through state_indices, the
    custom op), none kept by copies, pickles and a forward's final state; positions outside
    [0, capacity] pass no bound (the library names the error as before). Every step's o and
    state equal, to the bit, those of the custom op, which never passes a bound; the kept bound is
    the true largest position after every step."""
    import copy
    import pickle
    require_device(device, op)
    _step_road(request, road)
    if not str(device).startswith("cuda"):
        _setflag(request, hops._BOUND_ON_CPU, True)  # the CPU library reads positions anyway
    N, H, dk, dv = 2, 2, 4, 3
    x, _, _ = torch_inputs(op, device, B=N, T=24, H=H, dk=dk, dv=dv)
    x = {k: v.detach() for k, v in x.items()}
    x["lam"] = x["lam"][..., :1].expand(-1, -1, -1, 5).contiguous()  # 5 levels: positions <= 15
    st = ht.zero_state(op, N, H, dk, dv, max_len=12, dtype=torch.float64, device=device)  # 5 slots
    cap = hops._capacity(st.H.shape[2], 5)
    assert cap == 14
    ref = hila.State(*(None if p is None else p.clone() for p in st))
    seen = []
    _spy_steps(monkeypatch, seen)
    clock = iter(range(10 ** 6))

    def step(expect, state=None, **kw):
        """One step of `state` (st) and of ref through the custom op; `expect` is the bound passed."""
        state = st if state is None else state
        tok = {k: v[:, next(clock) % 24] for k, v in x.items()}
        top = max(ref.pos.tolist())
        with torch.no_grad():
            o = ht.step_(op, **tok, state=state, check_values=False, **kw)
            passed = seen[-1]
            _setflag(request, hops._FAST, False)
            o_ref = ht.step_(op, **tok, state=ref, check_values=False, **kw)
            _setflag(request, hops._FAST, True)
        assert passed == expect and (expect == -1 or expect >= top), (passed, expect, top)
        assert torch.equal(o, o_ref)
        assert all(a is None or torch.equal(a, b) for a, b in zip(state, ref))
        if expect >= 0 and not kw:
            assert state.__dict__[hops._POSITIONS][2] == max(state.pos.tolist())

    def fails(argument):
        tok = {k: v[:, 0] for k, v in x.items()}
        with torch.no_grad(), pytest.raises(hila.HilaError) as e:
            ht.step_(op, **tok, state=st, check_values=False)
        assert e.value.argument == argument and seen[-1] == -1, str(e.value)

    assert st.__dict__[hops._POSITIONS][2] == 0
    for _ in range(3):
        step(cap)                            # from zero_state: nothing read
    with torch.no_grad():
        st.pos[1] = 9
        ref.pos[1] = 9
    step(cap)                                # re-read after an indexed write: [4, 10]
    for _ in range(5):
        step(cap)                            # the last one from [8, 14], the capacity
    assert st.pos.tolist() == [9, 15]
    fails("state.H")                         # 15 > capacity: no bound, the library's error
    with torch.no_grad():
        st.pos.zero_()                       # a reset
        ref.pos.zero_()
    step(cap)
    st.pos.set_(st.pos.clone())              # re-pointed
    step(cap)
    with torch.no_grad():
        st.pos.fill_(5)
        ref.pos.fill_(5)
    step(cap)
    step(-1, state_indices=torch.tensor([1, -1], device=device))  # a pool step: row 1 only
    assert st.pos.tolist() == [6, 7]
    step(cap)                                # positions re-read after the pool step
    _setflag(request, hops._FAST, False)
    with torch.no_grad():
        ht.step_(op, **{k: v[:, 0] for k, v in x.items()}, state=st, check_values=False)
        ht.step_(op, **{k: v[:, 0] for k, v in x.items()}, state=ref, check_values=False)
    _setflag(request, hops._FAST, True)
    step(cap)                                # re-read after the custom op's step
    with torch.no_grad():
        st.pos[0] = -1
    fails("state.pos")                       # a negative position: no bound, the library's error
    with torch.no_grad():
        st.pos[0] = ref.pos[0]
    step(cap)
    for other in (copy.copy(st), pickle.loads(pickle.dumps(st))):
        assert hops._POSITIONS not in other.__dict__
    tok = {k: v[:, :3] for k, v in x.items()}
    with torch.no_grad():
        _, fin = ht.forward(op, **tok, output_final_state=True, final_slots=5)
    assert hops._POSITIONS not in fin.__dict__
    ref = hila.State(*(None if p is None else p.clone() for p in fin))
    step(cap, state=fin)                     # its positions (3) read once
    assert fin.__dict__[hops._POSITIONS][2] == 4
    step(cap, state=fin)


def test_step_position_bound_under_inference_mode(request, monkeypatch):
    """Inference tensors keep no version counter: zero_state keeps no bound, and their steps pass
    none (the library reads the positions)."""
    _setflag(request, hops._BOUND_ON_CPU, True)
    seen = []
    _spy_steps(monkeypatch, seen)
    x, _, _ = torch_inputs("loglinear", "cpu", B=1, T=2, H=1, dk=2, dv=2)
    with torch.inference_mode():
        st = ht.zero_state("loglinear", 1, 1, 2, 2, max_len=4, dtype=torch.float64)
        assert hops._POSITIONS not in st.__dict__
        for t in range(2):
            ht.step_("loglinear", **{k: v[:, t] for k, v in x.items()}, state=st, check_values=False)
    assert seen == [-1, -1] and st.pos.tolist() == [2]


def _counters_of(state):
    c = state.__dict__.get(hops._COUNTERS)
    return c if c is None or c is True else c[0]


@pytest.mark.parametrize("road", STEP_ROADS)
@pytest.mark.parametrize("op", ("hla2", "loglinear_gdn"))
def test_states_own_step_counters(op, road, device, request, monkeypatch):
    """The step counters a State owns (hila.torch.ops, "step counters"): zero_state, a forward's
    final state and a layer cache's copies are marked, and their first step_ on the direct road
    makes them (int32 zeros of step_counters_size(max(rows, N), H) = n (1 + H) elements on the
    state's device; on a CUDA device only: CPU states never make them) and passes them at every
    step (unbound and bound on the DLPack road; on the C++ road), left zero; States the user
    built, copies and pickles own none; a pool step of more sequences than they count and the
    custom ops' road pass none. Every step equals, to the bit, the same step without counters (the
    custom op)."""
    import copy
    import pickle
    require_device(device, op)
    _step_road(request, road)
    cuda = str(device).startswith("cuda")
    N, H, dk, dv = 2, 2, 4, 3
    x, _, _ = torch_inputs(op, device, B=N, T=12, H=H, dk=dk, dv=dv)
    x = {k: v.detach() for k, v in x.items()}
    st = ht.zero_state(op, N, H, dk, dv, max_len=16, dtype=torch.float64, device=device)
    assert st.__dict__[hops._COUNTERS] is True           # marked, nothing made yet
    seen, passed = [], []
    _spy_steps(monkeypatch, seen, passed)
    clock = iter(range(10 ** 6))

    def step(state, rows=None, **kw):
        """A step of `state` and of a copy through the custom op (no counters): equal to the bit.
        rows: the sequences of x the call's sequences take their inputs from (a pool step)."""
        t = next(clock) % 12
        tok = {k: v[:, t] if rows is None else v[rows, t] for k, v in x.items()}
        ref = hila.State(*(None if p is None else p.clone() for p in state))
        with torch.no_grad():
            o = ht.step_(op, **tok, state=state, check_values=False, max_position=15, **kw)
            got = passed[-1]
            _setflag(request, hops._FAST, False)
            o_ref = ht.step_(op, **tok, state=ref, check_values=False, max_position=15, **kw)
            _setflag(request, hops._FAST, True)
        assert passed[-1] is None                         # the custom ops' road passes none
        assert torch.equal(o, o_ref)
        assert all(a is None or torch.equal(a, b) for a, b in zip(state, ref))
        return got

    # CPU states make no counters (the CPU library would not use them)
    if not cuda:
        for _ in range(2):
            assert step(st) is None
        assert st.__dict__[hops._COUNTERS] is True
        _setflag(request, hops._COUNTERS_ON_CPU, True)    # the plumbing on the CPU (ignored there)
    def owned(got, state):
        """Whether a step passed `state`'s counters: the tensor (unbound) or its capsule (bound)."""
        kept = state.__dict__[hops._COUNTERS]
        return got is kept[1] or (isinstance(got, torch.Tensor) and got.data_ptr() == kept[0].data_ptr())

    fresh = ht.zero_state(op, N, H, dk, dv, max_len=16, dtype=torch.float64, device=device)
    dlpack = road == "dlpack"
    for state in (st, fresh):  # stepped before (on the CPU), or not
        first = hops._BOUND not in state.__dict__          # never stepped: its first step is unbound
        got = step(state)                                 # the first step makes them
        c = _counters_of(state)
        assert c.dtype == torch.int32 and c.device == state.H.device and c.shape == (N * (1 + H),)
        assert owned(got, state)
        assert isinstance(got, torch.Tensor) == (first or not dlpack)  # unbound at a first step
        for _ in range(2):
            assert owned(step(state), state) and _counters_of(state) is c  # made once
        if dlpack:
            assert state.__dict__[hops._BOUND][1] is not None  # bound
        assert owned(step(state), state)
        assert not c.any()                                # left zero
    # a pool step: the counters of the pool's State; more sequences than they count: none
    c = _counters_of(st)
    assert owned(step(st, state_indices=torch.tensor([1, -1], device=device)), st)
    assert step(st, rows=[0, 1, 0], state_indices=torch.tensor([1, -1, 0], device=device)) is None
    assert _counters_of(st) is c and not c.any()
    # copies and pickles hold the four parts only; a State the user built owns none
    for other in (copy.copy(st), pickle.loads(pickle.dumps(st)), hila.State(*st)):
        assert hops._COUNTERS not in other.__dict__
        assert step(other) is None
    # a forward's final state is marked
    with torch.no_grad():
        _, fin = ht.forward(op, **{k: v[:, :3] for k, v in x.items()}, output_final_state=True,
                            final_slots=6)
    assert fin.__dict__[hops._COUNTERS] is True
    assert owned(step(fin), fin) and not _counters_of(fin).any()


def test_layer_cache_copies_share_the_step_counters(device, request):
    """A layer's decode step on a functional cache (in_place False) steps a copy of the state with
    the counters of the cache's State (made once, not per token); LayerState.clone and select make
    marked States of their own."""
    require_device(device, "hla2")
    if not str(device).startswith("cuda"):
        _setflag(request, hops._COUNTERS_ON_CPU, True)
    torch.manual_seed(0)
    layer = ht.HLAAttention(32, num_heads=2, head_dim=8, op="hla2").to(device).eval()
    x = torch.randn(2, 6, 32, device=device)
    with torch.no_grad():
        _, st = layer(x[:, :4], use_cache=True)
        assert st.recurrent.__dict__[hops._COUNTERS] is True
        _, st1 = layer(x[:, 4:5], state=st, use_cache=True)
        c = _counters_of(st1.recurrent)
        assert isinstance(c, torch.Tensor) and not c.any()
        assert st.recurrent.__dict__[hops._COUNTERS] is True  # the cache passed in is untouched
        _, st2 = layer(x[:, 5:6], state=st1, use_cache=True)
        assert _counters_of(st2.recurrent) is c
    for other in (st2.clone(), st2.select(torch.tensor([1, 0], device=device))):
        assert other.recurrent.__dict__[hops._COUNTERS] is True


def test_bad_step_counters_are_named():
    """StepParams::counters through the extension: validated (dtype, one dimension, size, device,
    aliasing) on the CPU too, where they are not used; good ones leave the step's result as it is."""
    op, N, H, dk, dv = "hla2", 2, 2, 4, 3
    x, _, _ = torch_inputs(op, "cpu", B=N, T=1, H=H, dk=dk, dv=dv)
    tok = {k: v.detach()[:, 0] for k, v in x.items()}
    cfg = hops._spec(op, "chunk", 64, 0.0, False, 1e-6, 0.0, False, False).cfg
    need = hila._C.step_counters_size(N, H)
    assert need == N + N * H

    def run(counters):
        st = ht.zero_state(op, N, H, dk, dv, dtype=torch.float64)
        o = torch.empty_like(tok["v"])
        hila._C.step_inplace(cfg, *(hops._cap(tok.get(n)) for n in ("q", "k", "v", "g", "lam", "beta")),
                             tuple(hops._cap(p) for p in st), o=hops._capsule(o),
                             counters=hops._cap(counters))
        return o, st

    o_ref, st_ref = run(None)
    good = torch.zeros(need + 3, dtype=torch.int32)
    o, st = run(good)
    assert torch.equal(o, o_ref) and all(a is None or torch.equal(a, b) for a, b in zip(st, st_ref))
    assert not good.any()
    for bad in (torch.zeros(need, dtype=torch.int64), torch.zeros(need - 1, dtype=torch.int32),
                torch.zeros(1, need, dtype=torch.int32), torch.zeros(2 * need, dtype=torch.int32)[::2]):
        with pytest.raises(hila.HilaError) as e:
            run(bad)
        assert e.value.argument == "counters", str(e.value)


@pytest.mark.parametrize("road", STEP_ROADS)
def test_bound_and_unbound_steps_of_one_state_lose_nothing(road, request):
    """Threads stepping one State (on the DLPack road bound from its second step: the binding's
    lock) and threads stepping the same tensors through fresh State objects (never bound:
    step_inplace's lock of the same positions) serialize on one lock: every step lands. On the C++
    road every step takes that lock through hila._C's table."""
    import threading
    _step_road(request, road)
    st = ht.zero_state("gla", 1, 1, 4, 4)
    tok = dict(q=torch.full((1, 1, 4), 0.1), k=torch.full((1, 1, 4), 0.1), v=torch.ones(1, 1, 4),
               g=torch.full((1, 1), -0.01))
    errors = []

    def worker(fresh):
        try:
            with torch.no_grad():
                for _ in range(200):
                    ht.step_("gla", **tok, state=hila.State(*st) if fresh else st)
        except Exception as e:  # noqa: BLE001 - any error fails the test below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i % 2 == 1,)) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    assert isinstance(st.__dict__.get(hops._BOUND, (None, None))[1], hila._C.BoundState) == (road == "dlpack")
    assert st.pos.tolist() == [1600]


def test_fast_path_switch():
    assert_switch(ht.eager_fast_path, default=True)


def test_meta_and_fake_tensors_take_the_custom_ops():
    from torch._subclasses.fake_tensor import FakeTensorMode
    q = torch.empty(2, 9, 1, 4, device="meta")
    assert not hops._direct(q)
    with FakeTensorMode():
        f = torch.empty(2, 9, 1, 4)
        assert not hops._direct(f)
        o, _ = ht.forward("gla", f, f, f)
        assert o.shape == f.shape
    assert hops._direct(torch.empty(2, 9, 1, 4))


def test_double_backward_is_refused():
    x, _, _ = torch_inputs("gla", "cpu")
    o, _ = ht.forward("gla", **x)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(o.square().sum(), [x["q"]], create_graph=True)


# ----------------------------------------------------------------------------- decode

@pytest.fixture
def step_calls(monkeypatch):
    """The keyword arguments of the layers' in-place step calls."""
    calls = []

    def spy(*a, **kw):
        calls.append(kw)
        return ht.step_(*a, **kw)

    monkeypatch.setattr(hlayers, "_step_", spy)
    return calls


def test_layer_decode_steps_skip_value_checks(device, step_calls):
    """a layer built with check_values=True checks its prefill, not its decode steps."""
    require_device(device, "hla2")
    layer = ht.HLAAttention(32, num_heads=2, head_dim=8, op="hla2", check_values=True).to(device)
    x = torch.randn(2, 6, 32, device=device)
    with torch.no_grad():
        _, st = layer(x[:, :5], use_cache=True)
        layer(x[:, 5:], state=st, use_cache=True)
    assert len(step_calls) == 1 and step_calls[0]["check_values"] is False


def test_in_place_decode_keeps_every_cache_tensor(device):
    """an in_place cache advances through the same tensors (what a CUDA graph replays)."""
    require_device(device, "hla2")
    layer = ht.HLAAttention(32, num_heads=2, head_dim=8, op="hla2").to(device)
    x = torch.randn(2, 9, 32, device=device)
    with torch.no_grad():
        full, _ = layer(x)
        _, st = layer(x[:, :5], use_cache=True)
        st.in_place = True
        ptrs = [t.data_ptr() for t in st.tensors()]
        ys = [layer(x[:, t:t + 1], state=st, use_cache=True)[0] for t in range(5, 9)]
    assert [t.data_ptr() for t in st.tensors()] == ptrs
    err = float((torch.cat(ys, 1) - full[:, 5:]).abs().max() / full.abs().max())
    assert err <= 1e-5, err


def _lm(mixer, device, dtype=torch.float32):
    kw = {"hla": dict(num_heads=2, head_dim=8, op="hla2"),
          "loglinear_gdn": dict(num_heads=2, head_dim=8)}[mixer]
    torch.manual_seed(0)
    cfg = ht.HilaLMConfig(vocab_size=64, hidden_size=32, num_layers=3, mixer=mixer, mixer_kwargs=kw,
                          max_len=128, init_std=0.2)
    return ht.HilaLM(cfg).to(device=device, dtype=dtype).eval()


@pytest.mark.parametrize("mixer", ("hla", "loglinear_gdn"))
def test_generate_graph_switch_gives_the_same_tokens(mixer, device, step_calls):
    """greedy tokens with cuda_graph=True (default) and False are identical. On CUDA with a
    capturable model (every model: the log-linear layers pass max_position) the graph replays
    the steps (the layers' Python runs for the first two decode steps only); on the CPU both
    decode eagerly."""
    require_device(device, "hla2" if mixer == "hla" else "loglinear_gdn")
    model = _lm(mixer, device)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 64, (n,), generator=gen).to(device) for n in (7, 1, 12)]
    n = 40
    eager = model.generate(prompts, max_new_tokens=n, cuda_graph=False)
    eager_steps = len(step_calls)
    del step_calls[:]
    graph = model.generate(prompts, max_new_tokens=n)
    for a, b in zip(eager, graph):
        assert torch.equal(a, b), (a.tolist(), b.tolist())
    layers = model.config.num_layers
    assert eager_steps == (n - 1) * layers
    replayed = device.startswith("cuda") and model.decode_graph_capturable
    assert len(step_calls) == (2 * layers if replayed else (n - 1) * layers), len(step_calls)
    assert model.decode_graph_capturable


GRAPH_LAYERS = {
    "hla2": lambda: ht.HLAAttention(64, num_heads=4, head_dim=16, op="hla2"),
    "ahla-gqa": lambda: ht.HLAAttention(64, num_heads=4, num_qk_groups=2, head_dim=16, op="ahla"),
    "hla3-untied-normalize": lambda: ht.HLAAttention(64, num_heads=2, head_dim=16, op="hla3", gates="untied",
                                                     normalize=True),
    "loglinear_gdn": lambda: ht.LogLinearGatedDeltaNet(64, max_len=128, num_heads=2, head_dim=16),
    "loglinear_hla2": lambda: ht.HLAAttention(64, num_heads=2, head_dim=16, op="loglinear_hla2", max_len=128),
    "loglinear-mamba2": lambda: ht.LogLinearMamba2(64, max_len=128, state_size=16, head_dim=16),
}


@pytest.mark.parametrize("name", GRAPH_LAYERS)
def test_layer_decode_step_in_a_cuda_graph_equals_eager(name, device):
    """a layer's decode step captured in a CUDA graph (static input, in-place cache) and replayed
    for 32 tokens gives the outputs and states of eager decode, bit for bit."""
    if not device.startswith("cuda"):
        pytest.skip("CUDA graphs need a CUDA device")
    torch.manual_seed(0)
    layer = GRAPH_LAYERS[name]().to(device).eval()
    require_device(device, layer.op)
    assert hops._graph_capturable(layer.op)
    N, T0, steps = 3, 11, 32
    x = torch.randn(N, T0 + steps, 64, device=device)
    with torch.no_grad():
        _, st = layer(x[:, :T0], use_cache=True)
        st_eager, st_graph = st.clone(in_place=True), st.clone(in_place=True)
        eager = torch.cat([layer(x[:, t:t + 1], state=st_eager, use_cache=True)[0]
                           for t in range(T0, T0 + steps)], 1)
        xin = x[:, T0:T0 + 1].clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: the first token, eagerly
            first, _ = layer(xin, state=st_graph, use_cache=True)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            yout, _ = layer(xin, state=st_graph, use_cache=True)
        ys = [first]
        for t in range(T0 + 1, T0 + steps):
            xin.copy_(x[:, t:t + 1])
            graph.replay()
            ys.append(yout.clone())
        got = torch.cat(ys, 1)
    torch.cuda.synchronize()
    assert torch.equal(got, eager), float((got - eager).abs().max())
    for a, b in zip(st_graph.tensors(), st_eager.tensors()):
        assert torch.equal(a, b)
    assert st_graph.recurrent.pos.tolist() == [T0 + steps] * N


@pytest.mark.parametrize("road", STEP_ROADS + ("custom_op",))
def test_in_place_step_invalidates_saved_state_tensors(road, device, request):
    """a tensor of the state saved for a backward and then advanced by step_ makes that backward
    fail with autograd's in-place error (the step bumps the version counters), on every road."""
    require_device(device, "hla2")
    _setflag(request, hops._FAST, road != "custom_op")
    if road != "custom_op":
        _step_road(request, road)
    x, _, _ = torch_inputs("hla2", device, T=1)
    tok = {k: v.detach()[:, 0] for k, v in x.items()}
    st = ht.zero_state("hla2", 2, 2, 3, 2, dtype=torch.float64, device=device)
    w = torch.ones_like(st.H, requires_grad=True)
    y = (st.H * w).sum()  # saves st.H
    with torch.no_grad():
        ht.step_("hla2", **tok, state=st)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


@pytest.mark.parametrize("road", STEP_ROADS + ("custom_op",))
@pytest.mark.parametrize("op", OPS)
def test_step_out_is_written_and_returned(op, road, device, request):
    """step_(..., out=buf) writes o into buf (poisoned first: every element is written) and returns
    buf itself, with the bits of a step without it, the state advanced the same, buf's autograd
    version advanced; also for an out that is a slice of a wider buffer (innermost stride 1)."""
    require_device(device, op)
    _setflag(request, hops._FAST, road != "custom_op")
    if road != "custom_op":
        _step_road(request, road)
    x, state, mask = torch_inputs(op, device, T=3, n0=[2, 5])
    x = {k: v.detach() for k, v in x.items()}
    parts = [None if s is None else s.detach().clone() for s in state[1:]]
    if mask is not None:  # dead slots zero, and the slots of the steps to come
        H = parts[2] * mask.to(parts[2].dtype)
        parts[2] = torch.cat([H, H.new_zeros(H.shape[:2] + (hila.state_slots(16) - H.shape[2],) + H.shape[3:])], 2)
    a = hila.State(state[0].clone(), *(None if p is None else p.clone() for p in parts))
    b = hila.State(state[0].clone(), *(None if p is None else p.clone() for p in parts))
    wide = torch.full(x["v"].shape[:1] + x["v"].shape[2:-1] + (x["v"].shape[-1] + 3,), float("nan"),
                      dtype=x["v"].dtype, device=device)
    for t in range(3):
        tok = {k: v[:, t] for k, v in x.items()}
        buf = torch.full_like(tok["v"], float("nan")) if t != 1 else wide[..., :tok["v"].shape[-1]]
        version = buf._version
        with torch.no_grad():
            ref = ht.step_(op, **tok, state=a)
            got = ht.step_(op, **tok, state=b, out=buf)
        assert got is buf and buf._version > version
        assert torch.equal(got, ref), (op, road, t)
        assert all(p is None or torch.equal(p, r) for p, r in zip(b, a))
    assert torch.isnan(wide[..., x["v"].shape[-1]:]).all()  # nothing beside the slice is written


@pytest.mark.parametrize("road", STEP_ROADS)
def test_step_bad_out_is_named_and_writes_nothing(road, device, request):
    """a bad out (not a tensor, another shape or dtype, requiring grad, innermost stride 2, the
    memory of v or of the state) is a HilaError naming 'out', and the state is not advanced."""
    require_device(device, "hla2")
    _step_road(request, road)
    x, _, _ = torch_inputs("hla2", device, T=1)
    tok = {k: v.detach()[:, 0] for k, v in x.items()}
    st = ht.zero_state("hla2", 2, 2, 3, 2, dtype=torch.float64, device=device)
    v = tok["v"]
    bad = {"list": [0.0], "shape": v.new_zeros(2, 2, 3), "dtype": v.float(),
           "grad": torch.zeros_like(v, requires_grad=True),
           "stride": torch.zeros(v.shape + (2,), dtype=v.dtype, device=device)[..., 0],
           "v": v, "state": st.S.view(-1)[:v.numel()].view(v.shape)}
    for name, out in bad.items():
        with torch.no_grad(), pytest.raises(hila.HilaError) as e:
            ht.step_("hla2", **tok, state=st, out=out)
        assert e.value.argument == "out" and "'out'" in str(e.value), (name, str(e.value))
        assert st.pos.tolist() == [0, 0], name


def test_cpp_step_leaves_out_counters_that_do_not_fit(device, request):
    """hila._torch_ops.step_ given step counters with fewer than N + N * H elements (or none of
    the state's device) steps without them, as the DLPack road's _counters decides, instead of the
    library's error about them; the result equals a step without counters, to the bit."""
    if hops._CPP_STEP is None:
        pytest.skip(f"no C++ road: {hops._CPP_WHY}")
    require_device(device, "gla")
    x, _, _ = torch_inputs("gla", device, T=1)
    tok = {k: v.detach()[:, 0] for k, v in x.items()}
    a = ht.zero_state("gla", 2, 2, 3, 2, dtype=torch.float64, device=device)
    b = ht.zero_state("gla", 2, 2, 3, 2, dtype=torch.float64, device=device)
    spec, plan = hops._step_spec("gla", None, False, 1e-6, 0.0, False, False)
    small = torch.zeros(5, dtype=torch.int32, device=device)     # N + N * H = 6 needed
    elsewhere = torch.zeros(6, dtype=torch.int32)                 # (on the CPU: fits, ignored there)
    for cnt in (small, elsewhere):
        with torch.no_grad():
            ref = hops._CPP_STEP(plan, tok["q"], tok["k"], tok["v"], tok["g"], None, None, *a, -1, None, None)
            got = hops._CPP_STEP(plan, tok["q"], tok["k"], tok["v"], tok["g"], None, None, *b, -1, cnt, None)
        assert torch.equal(got, ref) and all(p is None or torch.equal(p, r) for p, r in zip(b, a))
        assert int(cnt.abs().sum()) == 0
    with pytest.raises(hila.HilaError) as e:   # counters that fit are the library's to check
        hops._CPP_STEP(plan, tok["q"], tok["k"], tok["v"], tok["g"], None, None, *b, -1,
                       torch.zeros(6, dtype=torch.int64, device=device), None)
    assert e.value.argument == "counters"
