# SPDX-License-Identifier: Apache-2.0
"""hila.torch layers and their shared pieces: prefill + decode equals the full forward, chunked
prefill, packed (varlen) batches, recurrent mode, max_len, caches and errors."""
import pytest

torch = pytest.importorskip("torch")

import hila  # noqa: E402
import hila.torch as ht  # noqa: E402
from helpers import assert_rel_close, require_device  # noqa: E402

D = 32
LAYERS = {
    "hla2": lambda **kw: ht.HLAAttention(D, num_heads=2, head_dim=8, op="hla2", **kw),
    "ahla-gqa-noconv": lambda **kw: ht.HLAAttention(D, num_heads=4, num_qk_groups=2, head_dim=8, head_dim_v=4,
                                                   op="ahla", use_short_conv=False, **kw),
    "hla3-untied-normalize": lambda **kw: ht.HLAAttention(D, num_heads=2, head_dim=8, op="hla3", gates="untied",
                                                         normalize=True, use_output_gate=False, **kw),
    "loglinear_hla2-ridge": lambda **kw: ht.HLAAttention(D, num_heads=2, head_dim=8, op="loglinear_hla2",
                                                        ridge=0.1, max_len=48, **kw),
    "loglinear_mamba2": lambda **kw: ht.LogLinearMamba2(D, max_len=48, state_size=8, head_dim=16, n_groups=2, **kw),
    "loglinear_gdn": lambda **kw: ht.LogLinearGatedDeltaNet(D, max_len=48, num_heads=2, head_dim=8, **kw),
}


def _layer(name, device, dtype=torch.float64, **kw):
    torch.manual_seed(0)
    op = {"loglinear_mamba2": "loglinear", "loglinear_gdn": "loglinear_gdn"}.get(name, name.split("-")[0])
    require_device(device, op)
    return LAYERS[name](**kw).to(device=device, dtype=dtype)


def _x(device, B=3, T=29, dtype=torch.float64, seed=1):
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed), dtype=dtype).to(device)


def _close(a, b, tol=1e-11):
    assert_rel_close(a, b, tol)


@pytest.mark.parametrize("name", LAYERS)
def test_prefill_then_decode_equals_full_forward(name, device):
    layer = _layer(name, device)
    x = _x(device)
    full, _ = layer(x)
    T0 = 11
    y, st = layer(x[:, :T0], use_cache=True)
    ys = [y]
    for t in range(T0, x.shape[1]):
        y, st = layer(x[:, t:t + 1], state=st, use_cache=True)
        ys.append(y)
    _close(torch.cat(ys, 1), full)
    assert st.max_position == x.shape[1] and st.recurrent.pos.tolist() == [x.shape[1]] * 3


@pytest.mark.parametrize("name", LAYERS)
def test_chunked_prefill(name, device):
    layer = _layer(name, device)
    x = _x(device)
    full, fin = layer(x, use_cache=True)
    y1, st = layer(x[:, :5], use_cache=True)
    y2, st = layer(x[:, 5:], state=st, use_cache=True)
    _close(torch.cat([y1, y2], 1), full)
    for a, b in zip(fin.recurrent, st.recurrent):
        assert (a is None) == (b is None)
        if a is not None and a.is_floating_point():
            _close(a, b)


@pytest.mark.parametrize("name", LAYERS)
def test_recurrent_mode(name, device):
    """mode='recurrent' (the serial form) computes what mode='chunk' does."""
    full, _ = _layer(name, device)(_x(device))
    rec = _layer(name, device, mode="recurrent")
    require_device(device, rec.op, "serial")
    _close(rec(_x(device))[0], full)


@pytest.mark.parametrize("name", LAYERS)
def test_varlen_batch_equals_separate_sequences(name, device):
    """packed sequences (with an empty one) give each sequence's own output and cache; decoding
    then continues every sequence at its own position."""
    layer = _layer(name, device)
    lens = [13, 0, 2, 21]
    xs = [_x(device, B=1, T=n, seed=10 + i) for i, n in enumerate(lens)]
    cu = torch.tensor([0] + lens, device=device).cumsum(0)
    y, st = layer(torch.cat(xs, 1), cu_seqlens=cu, use_cache=True)
    assert st.recurrent.pos.tolist() == lens and st.max_position == max(lens)
    nxt = _x(device, B=4, T=1, seed=99)
    y_dec, _ = layer(nxt, state=st, use_cache=True)
    for i, (n, xi) in enumerate(zip(lens, xs)):
        ref, _ = layer(torch.cat([xi, nxt[i:i + 1]], 1))
        if n:
            _close(y[:, cu[i]:cu[i + 1]], ref[:, :n])
        _close(y_dec[i], ref[0, n:])


@pytest.mark.parametrize("name", ["hla2", "loglinear_gdn"])
def test_training_step_and_low_precision(name, device):
    """gradients reach every parameter; bfloat16 activations run (states stay float32)."""
    layer = _layer(name, device, dtype=torch.float32)
    x = _x(device, dtype=torch.float32).requires_grad_()
    y, _ = layer(x)
    y.square().mean().backward()
    missing = [n for n, p in layer.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not missing and torch.isfinite(x.grad).all()
    layer = layer.to(torch.bfloat16)
    xb = x.detach().to(torch.bfloat16)
    y, st = layer(xb, use_cache=True)
    y2, st = layer(xb[:, :1], state=st, use_cache=True)
    assert y.dtype == torch.bfloat16 and st.recurrent.H.dtype == torch.float32 and torch.isfinite(y2.float()).all()


def test_log_linear_layers_refuse_sequences_past_max_len():
    layer = _layer("loglinear_gdn", "cpu")
    assert layer.levels.levels == hila.levels_needed(0, 48) == 7
    with pytest.raises(hila.HilaError) as e:
        layer(_x("cpu", B=1, T=49))
    assert e.value.argument == "max_len"
    _, st = layer(_x("cpu", B=1, T=48), use_cache=True)
    with pytest.raises(hila.HilaError, match="at most 48 tokens"):
        layer(_x("cpu", B=1, T=1), state=st)
    cu = torch.tensor([0, 10, 59])
    with pytest.raises(hila.HilaError, match="at most 48 tokens"):
        layer(_x("cpu", B=1, T=59), cu_seqlens=cu)
    layer(_x("cpu", B=1, T=59), cu_seqlens=torch.tensor([0, 30, 59]))  # packed: each under max_len


def test_value_checks():
    """non-finite activations raise HilaError at the operator; check_values=False skips the scan."""
    x = _x("cpu", B=1, T=6)
    y, _ = _layer("hla2", "cpu")(x)
    _close(_layer("hla2", "cpu", check_values=False)(x)[0], y)
    x[0, 3, 5] = float("nan")
    with pytest.raises(hila.HilaError, match="finite") as e:
        _layer("hla2", "cpu")(x)
    assert e.value.argument == "q"


def test_layer_errors():
    with pytest.raises(hila.HilaError) as e:
        ht.HLAAttention(D, num_heads=2, op="gdn")
    assert e.value.argument == "op"
    with pytest.raises(hila.HilaError) as e:
        ht.HLAAttention(D, num_heads=2, op="loglinear_hla2")
    assert e.value.argument == "max_len"
    with pytest.raises(hila.HilaError) as e:
        ht.HLAAttention(D, num_heads=3, num_qk_groups=2)
    assert e.value.argument == "num_qk_groups"
    with pytest.raises(hila.HilaError) as e:
        ht.LogLinearMamba2(D, max_len=64, head_dim=24)
    assert e.value.argument == "head_dim"
    with pytest.raises(hila.HilaError) as e:
        ht.LogLinearGatedDeltaNet(D, max_len=64, mode="fused")
    assert e.value.argument == "mode"
    layer = _layer("hla2", "cpu")
    with pytest.raises(hila.HilaError) as e:
        layer(_x("cpu", B=2, T=8), cu_seqlens=torch.tensor([0, 8, 16]))
    assert e.value.argument == "x"
    _, st = layer(_x("cpu", B=2, T=8), use_cache=True)
    with pytest.raises(hila.HilaError) as e:  # a cache of 2 sequences cannot continue 3
        layer(_x("cpu", B=3, T=1), state=st)
    assert e.value.argument == "state"


@pytest.mark.parametrize("make, arg", [
    (lambda: ht.HLAAttention(D, 0, head_dim=4), "num_heads"),
    (lambda: ht.HLAAttention(D, 2, head_dim=4, chunk_size=None), "chunk_size"),
    (lambda: ht.LogLinearMamba2(D, max_len=64, head_dim=0), "head_dim"),
    (lambda: ht.LogLinearMamba2(D, max_len=64, expand=None), "expand"),
    (lambda: ht.LogLinearGatedDeltaNet(None, max_len=64, num_heads=2, head_dim=4), "hidden_size"),
    (lambda: ht.LogLinearGatedDeltaNet(D, max_len=1.5, num_heads=2, head_dim=4), "max_len"),
])
def test_layer_sizes_are_checked(make, arg):
    """Sizes that are not ints >= 1: HilaError naming them, not a ZeroDivisionError or torch's
    TypeError from inside the constructor."""
    with pytest.raises(hila.HilaError) as e:
        make()
    assert e.value.argument == arg, str(e.value)


@pytest.mark.parametrize("x", [
    lambda: torch.randn(5, D), lambda: torch.randn(1, 5, D - 1), lambda: torch.randn(2, 3, 5, D),
    lambda: torch.randn(1, 5, D, dtype=torch.float64), lambda: torch.ones(1, 5, D, dtype=torch.int64),
    lambda: torch.randn(1, 5, D, device="meta"), lambda: "x",
])
def test_layer_inputs_are_checked(x):
    """x of another rank, hidden size, dtype or device than the layer's: HilaError('x'), not
    torch's RuntimeError from the first projection."""
    layer = ht.HLAAttention(D, 2, head_dim=4)
    with pytest.raises(hila.HilaError) as e:
        layer(x())
    assert e.value.argument == "x", str(e.value)


def test_layer_runs_under_autocast():
    layer = ht.HLAAttention(D, 2, head_dim=4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, _ = layer(torch.randn(1, 5, D, dtype=torch.bfloat16))
    assert y.shape == (1, 5, D) and torch.isfinite(y.float()).all()


def test_cache_select_and_size():
    layer = _layer("loglinear_mamba2", "cpu")
    x = _x("cpu", B=3, T=9)
    _, st = layer(x, use_cache=True)
    cache = ht.Cache([st])
    sub = cache.select(torch.tensor([2, 0]))
    y_sub, _ = layer(x[[2, 0], :1], state=sub[0])
    y_all, _ = layer(x[:, :1], state=st)
    _close(y_sub, y_all[[2, 0]])
    assert cache.nbytes() == sum(t.numel() * t.element_size() for t in st.tensors()) > 0
    assert cache.positions.tolist() == [9, 9, 9]


# ----------------------------------------------------------------------------- shared pieces

def test_short_convolution_cache_and_varlen():
    torch.manual_seed(0)
    conv = ht.ShortConvolution(6, width=4, bias=True).double()
    x = torch.randn(1, 12, 6, dtype=torch.float64)
    lens = [5, 0, 2, 5]
    cu = torch.tensor([0] + lens).cumsum(0)
    y, cache = conv(x, cu_seqlens=cu, output_cache=True)
    pieces = [x[:, cu[i]:cu[i + 1]] for i in range(4)]
    for i, xi in enumerate(pieces):
        yi, ci = conv(xi, output_cache=True)
        if lens[i]:
            _close(y[:, cu[i]:cu[i + 1]], yi)
        assert torch.allclose(cache[i:i + 1], ci, rtol=0, atol=1e-15)  # an empty sequence: zeros
    # continuing from a cache: varlen and dense agree with the unsplit sequence
    more = torch.randn(1, 7, 6, dtype=torch.float64)
    y2, _ = conv(more, cache=cache[3:4], cu_seqlens=torch.tensor([0, 7]), output_cache=True)
    ref, _ = conv(torch.cat([pieces[3], more], 1))
    _close(y2, ref[:, 5:])
    y3, _ = conv.step(more[0, :1], cache[3:4])
    _close(y3, ref[0, 5:6])


def test_gated_rmsnorm_and_gates():
    n = ht.GatedRMSNorm(8, group_size=4, norm_before_gate=False).double()
    x, z = torch.randn(3, 8, dtype=torch.float64), torch.randn(3, 8, dtype=torch.float64)
    y = (x * torch.nn.functional.silu(z)).view(3, 2, 4)
    ref = (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + n.eps)).view(3, 8)
    _close(n(x, z), ref)
    gate = ht.DecayGate(4, 2, A_init="arange")
    g, dt = gate(torch.randn(5, 8))
    assert g.shape == (5, 4, 2) and (g < 0).all() and (dt > 0).all()
    assert gate.A_log._no_weight_decay and gate.dt_bias._no_weight_decay
    lev = ht.LevelWeights(4, max_len=16384)
    assert lev.levels == 15 and lev(torch.zeros(2, 4 * 15)).shape == (2, 4, 15)
