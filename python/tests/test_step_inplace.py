# SPDX-License-Identifier: Apache-2.0
"""The fused decode step in place (hila.step_, torch.ops.hila.step_), DecodeState on a device, and
the layers' no-grad decode path that runs them: prefill + in-place decode equals the full forward
for every operator (float32 and float64), the in-place and the functional step agree, the states
the caller did not hand over stay untouched, and bad inputs raise HilaError naming the argument."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import hila  # noqa: E402
import hila.torch as ht  # noqa: E402
import hila.torch.layers as hlayers  # noqa: E402
from helpers import chunk_for, require_device  # noqa: E402

OPS = hila.OPS
TOL = {torch.float64: 1e-10, torch.float32: 1e-4}
DTYPES = (torch.float64, torch.float32)
DT_IDS = {torch.float64: "f64", torch.float32: "f32"}


def _rel(a, b):
    a, b = np.asarray(_np(a), dtype=np.float64), np.asarray(_np(b), dtype=np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def _np(x):
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def _close(a, b, tol, what=""):
    err = _rel(a, b)
    assert err <= tol, f"{what}: relative error {err:.2e} > {tol:.0e}"


def _inputs(op, B=3, T=21, G=1, H=2, dk=5, dv=3, seed=0, untied=False, normalize=False, levels=None):
    """float64 numpy inputs of a decode test (k scaled, gates in log(0.7..1), lam, beta)."""
    rng = np.random.default_rng(seed)
    t = hila.op_traits(op)
    gshape = (B, T, H, t["num_primitives"]) if untied else (B, T, H)
    x = dict(q=rng.standard_normal((B, T, G, dk)), k=rng.standard_normal((B, T, G, dk)) / np.sqrt(dk),
             v=rng.standard_normal((B, T, H, dv)), g=np.log(rng.uniform(0.7, 1.0, gshape)))
    if normalize:  # a well-conditioned denominator: nonnegative features
        x["q"], x["k"] = np.abs(x["q"]), np.abs(x["k"])
    if t["loglinear"]:
        x["lam"] = rng.uniform(-0.5, 1.5, (B, T, H, levels or hila.levels_needed(0, T)))
    if t["delta"]:
        x["beta"] = rng.uniform(0.1, 1.0, (B, T, H))
    return x


def _torch(x, device, dtype):
    """The inputs as `dtype` tensors on `device`, and their rounded values in float64 numpy (the
    reference's inputs)."""
    xt = {k: torch.from_numpy(v).to(dtype).to(device) for k, v in x.items()}
    return xt, {k: v.cpu().double().numpy() for k, v in xt.items()}


def _at(x, t):
    return {k: v[:, t] for k, v in x.items()}


def _stream(device):
    return torch.cuda.current_stream().cuda_stream if str(device).startswith("cuda") else None


def _clone(st):
    return hila.State(*(None if p is None else p.clone() for p in st))


CASES = [(op, {}) for op in OPS]
CASES += [("hla2", dict(normalize=True, ridge=0.2)), ("hla3", dict(untied=True)),
          ("loglinear_ahla", dict(untied=True, normalize=True)), ("gdn", dict(qk_l2norm=True)),
          ("loglinear_hla3", dict(G=2, H=4, scale=0.7))]


def _case_id(c):
    return c if isinstance(c, str) else "-".join(f"{k}={v}" for k, v in c.items()) or "plain"


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS.get)
@pytest.mark.parametrize("op,case", CASES, ids=_case_id)
def test_step_inplace_equals_functional_step_and_full_forward(op, case, dtype, device):
    """prefill T0 tokens (chunk form), then decode token by token with hila.step_ and
    torch.ops.hila.step_ (each on its own state, in place) and the functional torch.ops.hila.step:
    every output equals the full float64 forward over the sequence, the final states its final
    state, and the in-place states are the very tensors handed in."""
    require_device(device, op)
    case = dict(case)
    opts = {k: case.pop(k) for k in ("normalize", "ridge", "qk_l2norm", "scale") if k in case}
    x, ref_in = _torch(_inputs(op, normalize=opts.get("normalize", False), **case), device, dtype)
    T, T0, N = x["q"].shape[1], 9, x["q"].shape[0]
    full, fin = hila.forward(op, **ref_in, output_final_state=True, form="naive", **opts)
    pre = {k: v[:, :T0] for k, v in x.items()}
    o0, st0 = ht.forward(op, **pre, output_final_state=True, final_slots=hila.state_slots(T),
                         chunk=chunk_for(device, 8, op), **opts)
    tol = TOL[dtype]
    _close(o0, full[:, :T0], tol, "prefill")
    st_np, st_t, st_fun = _clone(st0), _clone(st0), _clone(st0)
    ids = [id(p) for p in st_np]
    for t in range(T0, T):
        tok = _at(x, t)
        o_np = hila.step_(op, **tok, state=st_np, stream=_stream(device), **opts)
        o_t = ht.step_(op, **tok, state=st_t, **opts)
        o_fun, st_fun = ht.step(op, **tok, state=st_fun, **opts)
        assert isinstance(o_np, torch.Tensor) and o_np.device == x["q"].device and o_np.dtype == dtype
        _close(o_np, full[:, t], tol, f"hila.step_ token {t}")
        _close(o_t, full[:, t], tol, f"ht.step_ token {t}")
        _close(o_t, o_fun, tol, f"in place vs functional, token {t}")
    assert [id(p) for p in st_np] == ids  # the same tensors, advanced
    assert st_np.pos.tolist() == st_t.pos.tolist() == st_fun.pos.tolist() == [T] * N
    for name, a, b, c, e in zip(hila.State._fields, st_np, st_t, st_fun, fin):
        if e is None:
            assert a is None and b is None and c is None, name
            continue
        if name == "pos":
            continue
        n = e.shape[2] if e.ndim == 5 else None  # a log-linear capacity may exceed the final slots
        cut = (lambda z: z[:, :, :n]) if n else (lambda z: z)  # noqa: E731
        _close(cut(a), e, tol, f"hila.step_ final {name}")
        _close(cut(b), e, tol, f"ht.step_ final {name}")
        _close(cut(c), e, tol, f"functional final {name}")


@pytest.mark.parametrize("op", ("hla3", "loglinear_hla2", "loglinear_gdn", "loglinear"))
def test_step_inplace_after_varlen_prefill(op, device):
    """sequences at different positions (a packed prefill): one in-place step matches each
    sequence's own forward; every position advances by one."""
    require_device(device, op)
    x, _ = _torch(_inputs(op, B=3, T=20), device, torch.float64)
    lens = [20, 3, 12]
    packed = {k: torch.cat([v[i:i + 1, :n] for i, n in enumerate(lens)], 1) for k, v in x.items()}
    cu = torch.tensor([0] + lens, device=device).cumsum(0)
    _, st = ht.forward(op, **packed, cu_seqlens=cu, output_final_state=True,
                       final_slots=hila.state_slots(21), chunk=chunk_for(device, 8, op))
    y, _ = _torch(_inputs(op, B=3, T=1, seed=7, levels=hila.levels_needed(0, 21)), device, torch.float64)
    o = ht.step_(op, **_at(y, 0), state=st)
    assert st.pos.tolist() == [n + 1 for n in lens]
    for i, n in enumerate(lens):
        seq = {k: np.concatenate([_np(x[k][i:i + 1, :n]), _np(y[k][i:i + 1])], 1) for k in x}
        ref, _ = hila.forward(op, **seq, form="naive")
        _close(o[i], ref[0, -1], 1e-10, f"sequence {i}")


# ----------------------------------------------------------------------------- errors

def _error_cases(device):
    x, _ = _torch(_inputs("loglinear_hla2", B=2, T=6), device, torch.float64)
    tok = _at(x, 5)
    st = ht.zero_state("loglinear_hla2", 2, 2, 5, 3, max_len=8, dtype=torch.float64, device=device)
    st = st._replace(pos=torch.tensor([5, 2], device=device))
    gla = _at(_torch(_inputs("gla", B=2, T=1), device, torch.float64)[0], 0)
    gla_st = ht.zero_state("gla", 2, 2, 5, 3, dtype=torch.float64, device=device)
    call = lambda s=st, **kw: ht.step_("loglinear_hla2", **{**tok, **kw}, state=s)  # noqa: E731
    fcall = lambda s=st, **kw: hila.step_("loglinear_hla2", **{**tok, **kw}, state=s)  # noqa: E731
    return [
        ("state H of the wrong shape", "state.H", lambda: call(st._replace(H=st.H[:, :1].contiguous()))),
        ("state S of the wrong shape", "state.S", lambda: call(st._replace(S=st.S[..., :-1].contiguous()))),
        ("state of another op", "state.S", lambda: ht.step_("gla", **gla, state=st)),
        ("state missing a part", "state.S", lambda: call(st._replace(S=None))),
        ("state too few slots", "state.H", lambda: call(st._replace(H=st.H[:, :, :3].contiguous()))),
        ("state of the wrong batch", "state.pos", lambda: ht.step_("gla", **{k: v[:1] for k, v in gla.items()},
                                                                  state=gla_st)),
        ("state float16", "state.H", lambda: call(st._replace(H=st.H.half()))),
        ("state parts of two dtypes", "state.S", lambda: call(st._replace(S=st.S.float()))),
        ("int32 positions", "state.pos", lambda: call(st._replace(pos=st.pos.int()))),
        ("no positions", "state.pos", lambda: fcall(st._replace(pos=None))),
        ("no state", "state", lambda: ht.step_("loglinear_hla2", **tok, state=None)),
        ("q of 4 dims", "q", lambda: call(q=x["q"][:, 4:6])),
        ("integer q", "q", lambda: call(q=tok["q"].int(), k=tok["k"].int())),
        ("k dtype differs", "k", lambda: call(k=tok["k"].float())),
        ("too few levels", "lam", lambda: call(lam=tok["lam"][..., :2].contiguous())),
        ("positive gate", "g", lambda: call(g=-tok["g"], check_values=True)),  # value checks: CPU default
    ]


_ERROR_NAMES = [c[0] for c in _error_cases("cpu")]


@pytest.mark.parametrize("what", _ERROR_NAMES)
def test_step_inplace_bad_input(what, device):
    require_device(device, "loglinear_hla2")
    argument, call = {c[0]: c[1:] for c in _error_cases(device)}[what]
    with pytest.raises(hila.HilaError) as e:
        call()
    assert isinstance(e.value, ValueError)
    assert e.value.argument == argument, str(e.value)
    assert str(e.value).startswith(f"hila: argument '{argument}'"), str(e.value)


def test_step_inplace_leaves_the_state_alone_on_error(device):
    """every argument is validated before anything is written: a rejected call leaves the state."""
    require_device(device, "hla2")
    x, _ = _torch(_inputs("hla2", B=2, T=1), device, torch.float64)
    st = ht.zero_state("hla2", 2, 2, 5, 3, dtype=torch.float64, device=device)
    ht.step_("hla2", **_at(x, 0), state=st)
    before = _clone(st)
    with pytest.raises(hila.HilaError):  # a positive gate (value checks are on by default on the CPU only)
        ht.step_("hla2", **{**_at(x, 0), "g": -_at(x, 0)["g"]}, state=st, check_values=True)
    for a, b in zip(st, before):
        assert a is None or torch.equal(a, b)


def test_step_inplace_read_only_and_device_mix(device):
    x = _inputs("gla", B=2, T=1)
    st = hila.State(np.zeros(2, np.int64), None, None, np.zeros((2, 2, 5, 3)))
    st.H.setflags(write=False)
    with pytest.raises(hila.HilaError) as e:
        hila.step_("gla", **_at(x, 0), state=st)
    assert e.value.argument == "state.H"
    if device == "cpu":
        if not torch.cuda.is_available():
            pytest.skip("the device mix needs a CUDA device")
        device = "cuda"
    require_device(device, "gla")
    xt, _ = _torch(x, device, torch.float64)
    host = ht.zero_state("gla", 2, 2, 5, 3, dtype=torch.float64)  # a CPU state, CUDA inputs
    with pytest.raises(hila.HilaError) as e:
        ht.step_("gla", **_at(xt, 0), state=host)
    assert e.value.argument.startswith("state."), str(e.value)
    assert "device" in str(e.value)


# ----------------------------------------------------------------------------- torch op

@pytest.mark.parametrize("op", ("hla3", "loglinear_gdn"))
def test_opcheck_step_inplace(op, device):
    require_device(device, op)
    x, _ = _torch(_inputs(op, B=2, T=1, dk=3, dv=2, levels=4), device, torch.float64)
    st = ht.zero_state(op, 2, 2, 3, 2, max_len=16, dtype=torch.float64, device=device)
    st = st._replace(pos=torch.tensor([3, 6], device=device))
    tok = [x[k][:, 0] if k in x else None for k in ("q", "k", "v", "g", "lam", "beta")]
    # hla3: the caller's position bound; loglinear_gdn: the two rows as a pool, swapped
    extra = (None, 15) if op == "hla3" else (torch.tensor([1, 0], dtype=torch.int32, device=device), -1)
    torch.library.opcheck(torch.ops.hila.step_.default,
                          (*tok, *st, op, 0.0, False, 1e-6, 0.0, False, True, *extra))


def test_compile_fullgraph_step_inplace(device):
    """torch.compile(fullgraph=True) traces decode steps through the mutating op."""
    require_device(device, "loglinear")
    x, _ = _torch(_inputs("loglinear", B=2, T=3), device, torch.float32)
    st0 = ht.zero_state("loglinear", 2, 2, 5, 3, max_len=8, device=device)

    def decode(state):
        outs = [ht.step_("loglinear", **_at(x, t), state=state) for t in range(3)]
        return torch.stack(outs, 1)

    torch._dynamo.reset()
    ref_state, got_state = _clone(st0), _clone(st0)
    ref = decode(ref_state)
    got = torch.compile(decode, fullgraph=True, backend="aot_eager")(got_state)
    _close(got, ref, 1e-6)
    assert got_state.pos.tolist() == [3, 3]
    _close(got_state.H, ref_state.H, 1e-6)


# ----------------------------------------------------------------------------- DecodeState

@pytest.mark.parametrize("op", ("gla", "hla3", "loglinear_ahla", "loglinear_gdn"))
def test_decode_state_on_device(op, device):
    """DecodeState(device=...) holds its memory on the device: stepping device tensors equals the
    full forward; state() copies to that device, view() aliases it (DLPack)."""
    require_device(device, op)
    x, ref_in = _torch(_inputs(op, T=13), device, torch.float64)
    T0, T = 5, 13
    full, fin = hila.forward(op, **ref_in, output_final_state=True, form="naive")
    _, st0 = ht.forward(op, **{k: v[:, :T0] for k, v in x.items()}, output_final_state=True,
                        chunk=chunk_for(device, 8, op))
    dec = hila.DecodeState.from_state(op, st0)  # the device of st0
    on = x["q"].device  # with its index: torch.device('cuda') != torch.device('cuda:0')
    assert dec.device == ("cpu" if on.type == "cpu" else f"cuda:{on.index}") and dec.dtype == "float64"
    blank = hila.DecodeState(op, 3, 2, 5, 3, dtype=torch.float64, device=on)
    assert blank.device == dec.device and blank.positions.tolist() == [0, 0, 0]
    for t in range(T0, T):
        o = dec.step(**_at(x, t), stream=_stream(device))
        assert isinstance(o, torch.Tensor) and o.device == x["q"].device
        _close(o, full[:, t], 1e-10, f"token {t}")
    assert dec.positions.tolist() == [T] * 3 and dec.position(1) == T
    got = dec.state()
    view = dec.view()
    for name, a, v, e in zip(hila.State._fields, got, view, fin):
        if e is None:
            assert a is None and v is None
            continue
        t = torch.from_dlpack(v)
        assert t.device == on and (a.device == on if on.type == "cuda" else isinstance(a, np.ndarray))
        if name == "pos":
            assert _np(a).tolist() == [T] * 3 and t.tolist() == [T] * 3
            continue
        n = e.shape[2] if e.ndim == 5 else None
        cut = (lambda z: z[:, :, :n]) if n else (lambda z: z)  # noqa: E731
        _close(cut(_np(a)), e, 1e-10, name)
        _close(cut(_np(t)), e, 1e-10, name)
    # the copy stays, the view follows the state
    before = _np(got.H).copy()
    dec.step(**_at(x, T - 1), stream=_stream(device))
    np.testing.assert_array_equal(_np(got.H), before)


def test_decode_state_devices():
    """device names; a bad one raises HilaError('device'); CUDA without a GPU or CUDA backend too."""
    for d in ("cpu", torch.device("cpu"), (1, 0), np.zeros(1)):
        assert hila.DecodeState("gla", 1, 1, 2, 2, device=d).device == "cpu"
    for bad in ("tpu", "cuda:x", (7, 0)):
        with pytest.raises(hila.HilaError) as e:
            hila.DecodeState("gla", 1, 1, 2, 2, device=bad)
        assert e.value.argument == "device", str(e.value)
    if not torch.cuda.is_available():  # HilaError('device') without the CUDA backend, else the
        with pytest.raises((hila.HilaError, RuntimeError), match="CUDA"):  # runtime's error
            hila.DecodeState("gla", 1, 1, 2, 2, device="cuda:0")


# ----------------------------------------------------------------------------- layers

LAYERS = {
    "hla2": lambda: ht.HLAAttention(32, num_heads=2, head_dim=8, op="hla2"),
    "hla3-untied-normalize": lambda: ht.HLAAttention(32, num_heads=2, head_dim=8, op="hla3", gates="untied",
                                                     normalize=True, use_output_gate=False),
    "loglinear_ahla": lambda: ht.HLAAttention(32, num_heads=4, num_qk_groups=2, head_dim=8,
                                              op="loglinear_ahla", max_len=40),
    "loglinear_mamba2": lambda: ht.LogLinearMamba2(32, max_len=40, state_size=8, head_dim=16, n_groups=2),
    "loglinear_gdn": lambda: ht.LogLinearGatedDeltaNet(32, max_len=40, num_heads=2, head_dim=8),
}
LAYER_OPS = {"hla2": "hla2", "hla3-untied-normalize": "hla3", "loglinear_ahla": "loglinear_ahla",
             "loglinear_mamba2": "loglinear", "loglinear_gdn": "loglinear_gdn"}


@pytest.fixture
def spy(monkeypatch):
    """Counts the layers' calls of the in-place and the functional step."""
    calls = {"step_": 0, "step": 0}

    def wrap(name, fn):
        def f(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)
        return f

    monkeypatch.setattr(hlayers, "_step_", wrap("step_", hlayers._step_))
    monkeypatch.setattr(hlayers, "_step", wrap("step", hlayers._step))
    return calls


def _layer(name, device, dtype):
    require_device(device, LAYER_OPS[name])
    torch.manual_seed(0)
    return LAYERS[name]().to(device=device, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS.get)
@pytest.mark.parametrize("name", LAYERS)
def test_layer_no_grad_decode_uses_the_fused_step(name, dtype, device, spy):
    """under no_grad a decode step runs torch.ops.hila.step_ and equals the full forward; the
    default cache is left as it was (functional), an in_place cache is advanced and returned."""
    layer = _layer(name, device, dtype)
    x = torch.randn(3, 17, 32, generator=torch.Generator().manual_seed(1), dtype=dtype).to(device)
    T0 = 6
    with torch.no_grad():
        full, _ = layer(x)
        y0, st0 = layer(x[:, :T0], use_cache=True)
        assert not st0.in_place
        keep = [t.clone() for t in st0.tensors()]
        ys, st = [y0], st0
        for t in range(T0, x.shape[1]):
            y, new = layer(x[:, t:t + 1], state=st, use_cache=True)
            assert new is not st and not new.in_place
            ys.append(y)
            st = new
        for a, b in zip(st0.tensors(), keep):  # the caller's cache is untouched
            assert torch.equal(a, b)
        assert spy == {"step_": x.shape[1] - T0, "step": 0}
        _close(torch.cat(ys, 1), full, TOL[dtype] * 10, "functional cache")
        # in place: the same object advances
        st_ip = st0.clone(in_place=True)
        ys_ip = [y0]
        for t in range(T0, x.shape[1]):
            y, new = layer(x[:, t:t + 1], state=st_ip, use_cache=True)
            assert new is st_ip
            ys_ip.append(y)
        assert st_ip.max_position == x.shape[1] and st_ip.recurrent.pos.tolist() == [x.shape[1]] * 3
        _close(torch.cat(ys_ip, 1), full, TOL[dtype] * 10, "in-place cache")
        for a, b in zip(st_ip.recurrent, st.recurrent):
            if a is not None and a.is_floating_point():
                _close(a, b, TOL[dtype], "in-place vs functional state")
        for a, b in zip(st0.tensors(), keep):  # clone() copied: st0 still untouched
            assert torch.equal(a, b)


def test_layer_decode_with_grad_stays_functional(device, spy):
    """a step that needs a gradient runs the differentiable op, also on an in_place cache, and
    gradients reach the parameters through it."""
    layer = _layer("loglinear_gdn", device, torch.float64)
    x = torch.randn(2, 5, 32, dtype=torch.float64, device=device)
    _, st = layer(x[:, :4], use_cache=True)
    st.in_place = True
    keep = [t.detach().clone() for t in st.tensors()]
    y, new = layer(x[:, 4:], state=st, use_cache=True)
    assert spy == {"step_": 0, "step": 1} and new is not st and new.in_place
    y.square().sum().backward()
    assert layer.q_proj.weight.grad is not None and torch.isfinite(layer.q_proj.weight.grad).all()
    for a, b in zip(st.tensors(), keep):
        assert torch.equal(a.detach(), b)


def test_generate_decodes_in_place_and_select_copies(device, spy):
    """HilaLM.generate advances its own cache in place; a Cache.select copy (beam search) does
    not move when the original is stepped in place. (Eager decode: a captured CUDA graph replays
    its steps without calling step_; test_torch_path checks the graph path.)"""
    require_device(device, "loglinear")
    torch.manual_seed(0)
    cfg = ht.HilaLMConfig(vocab_size=40, hidden_size=32, num_layers=2, mixer="loglinear_mamba2",
                          mixer_kwargs=dict(state_size=8, head_dim=16), max_len=32, init_std=0.2)
    model = ht.HilaLM(cfg).to(device=device, dtype=torch.float64).eval()
    prompts = [torch.tensor([1, 2, 3], device=device), torch.tensor([4], device=device)]
    out = model.generate(prompts, max_new_tokens=4, cuda_graph=False)
    assert spy["step_"] == 3 * cfg.num_layers and spy["step"] == 0
    for prompt, new in zip(prompts, out):  # greedy tokens equal recomputation
        seq = prompt
        for tok in new:
            assert int(model(seq.unsqueeze(0)).logits[0, -1].argmax()) == int(tok)
            seq = torch.cat([seq, tok.view(1)])
    with torch.no_grad():
        ids = torch.tensor([[5, 6, 7], [8, 9, 10]], device=device)
        cache = model(ids, use_cache=True).cache
        sel = cache.select(torch.tensor([1, 0], device=device))
        keep = [t.clone() for s in sel.layers for t in s.tensors()]
        cache.in_place = True
        assert cache.in_place and not sel.in_place
        out1 = model(ids[:, :1], cache=cache, use_cache=True)
        assert out1.cache.layers[0] is cache.layers[0] and cache.positions.tolist() == [4, 4]
        assert all(torch.equal(a, b) for a, b in zip((t for s in sel.layers for t in s.tensors()), keep))
        out2 = model(ids[[1, 0], :1], cache=sel, use_cache=True)
        _close(out2.logits, out1.logits[[1, 0]], 1e-10, "selected copy")
