# SPDX-License-Identifier: Apache-2.0
"""hila.torch.fla_layers: fla's call signature (attention_mask, past_key_values, use_cache), fla's
parameter layout for GatedDeltaNet and LogLinearMamba2 (key names and shapes written from fla's
layers), and the math of fla's layers: a randomly initialised fla-layout state dict is loaded and
the layer's output compared with a float64 reference of fla's layer written here from those
parameters (projections, short convolutions, gates, recurrence, gated norm)."""

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import hila  # noqa: E402
import hila.torch as ht  # noqa: E402
from hila.torch import fla_layers as fl  # noqa: E402
from helpers import assert_rel_close, require_device, torch_gen as _gen  # noqa: E402

F64 = torch.float64
D = 16


def _close(a, b, tol=1e-11):
    assert_rel_close(a, b, tol)


# ----------------------------------------------------------------------------- fla-layout dicts

def _fla_gdn_state_dict(hidden, head_dim, num_heads, num_v_heads, expand_v, conv_size, use_gate,
                        conv_bias, seed):
    """The parameters of fla.layers.GatedDeltaNet (names and shapes from fla's source), random."""
    g = _gen(seed)
    key_dim, HV = num_heads * head_dim, num_v_heads
    dv = int(head_dim * expand_v)
    value_dim = HV * dv
    r = lambda *s, scale=0.3: torch.randn(*s, generator=g, dtype=F64) * scale  # noqa: E731
    sd = {
        "q_proj.weight": r(key_dim, hidden), "k_proj.weight": r(key_dim, hidden),
        "v_proj.weight": r(value_dim, hidden), "a_proj.weight": r(HV, hidden),
        "b_proj.weight": r(HV, hidden),
        "A_log": torch.log(torch.rand(HV, generator=g, dtype=F64) * 15 + 0.5),
        "dt_bias": r(HV, scale=1.0),
        "q_conv1d.weight": r(key_dim, 1, conv_size, scale=0.5),
        "k_conv1d.weight": r(key_dim, 1, conv_size, scale=0.5),
        "v_conv1d.weight": r(value_dim, 1, conv_size, scale=0.5),
        "o_norm.weight": 1 + r(dv), "o_proj.weight": r(hidden, value_dim),
    }
    if conv_bias:
        sd.update({f"{n}_conv1d.bias": r(c) for n, c in (("q", key_dim), ("k", key_dim), ("v", value_dim))})
    if use_gate:
        sd["g_proj.weight"] = r(value_dim, hidden)
    return sd


def _fla_mamba2_state_dict(num_heads, head_dim, hidden, state_size, expand, n_groups, conv_kernel,
                           use_conv_bias, use_bias, D_has_hdim, seed):
    """The parameters of fla.layers.LogLinearMamba2 (names and shapes from fla's source: 15 level
    scales, MAX_NUM_LEVELS of its 16384-token maximum), random."""
    g = _gen(seed)
    inner = expand * hidden
    conv_dim = inner + 2 * n_groups * state_size
    proj = inner + conv_dim + num_heads * (15 + 1)
    r = lambda *s, scale=0.3: torch.randn(*s, generator=g, dtype=F64) * scale  # noqa: E731
    sd = {
        "in_proj.weight": r(proj, hidden), "conv1d.weight": r(conv_dim, 1, conv_kernel, scale=0.5),
        "dt_bias": r(num_heads, scale=1.0),
        "A_log": torch.log(torch.arange(1, num_heads + 1, dtype=F64) * (0.5 + torch.rand(num_heads, generator=g, dtype=F64))),
        "L": 1 + r(num_heads, 15), "norm.weight": 1 + r(inner),
        "D": 1 + r(inner if D_has_hdim else num_heads), "out_proj.weight": r(hidden, inner),
    }
    if use_conv_bias:
        sd["conv1d.bias"] = r(conv_dim)
    if use_bias:
        sd["in_proj.bias"], sd["out_proj.bias"] = r(proj), r(hidden)
    return sd


# ----------------------------------------------------------------------------- references of fla's layers

def _conv_silu(u, w, b):
    """Causal depthwise convolution (fla's ShortConvolution / conv1d, weight [C, 1, W]) + SiLU."""
    W = w.shape[-1]
    y = F.conv1d(F.pad(u.transpose(1, 2), (W - 1, 0)), w, b, groups=w.shape[0])
    return F.silu(y.transpose(1, 2))


def _ref_gated_deltanet(sd, x, num_heads, head_dim, expand_v, allow_neg_eigval=False, eps=1e-5):
    """fla's GatedDeltaNet forward, token by token in float64."""
    B, T, _ = x.shape
    HV = sd["A_log"].shape[0]
    dv = int(head_dim * expand_v)
    conv = lambda n: _conv_silu(x @ sd[f"{n}_proj.weight"].T, sd[f"{n}_conv1d.weight"],  # noqa: E731
                                sd.get(f"{n}_conv1d.bias"))
    q, k = conv("q").view(B, T, num_heads, head_dim), conv("k").view(B, T, num_heads, head_dim)
    v = conv("v").view(B, T, HV, dv)
    l2 = lambda t: t / torch.sqrt((t * t).sum(-1, keepdim=True) + 1e-6)  # noqa: E731
    q, k = l2(q) * head_dim ** -0.5, l2(k)
    beta = torch.sigmoid(x @ sd["b_proj.weight"].T) * (2 if allow_neg_eigval else 1)
    g = -torch.exp(sd["A_log"]) * F.softplus(x @ sd["a_proj.weight"].T + sd["dt_bias"])
    o = torch.zeros(B, T, HV, dv, dtype=F64)
    for b in range(B):
        for hv in range(HV):
            h = hv // (HV // num_heads)
            S = torch.zeros(head_dim, dv, dtype=F64)
            for t in range(T):
                S = S * torch.exp(g[b, t, hv])
                u = (v[b, t, hv] - S.T @ k[b, t, h]) * beta[b, t, hv]
                S = S + torch.outer(k[b, t, h], u)
                o[b, t, hv] = S.T @ q[b, t, h]
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * sd["o_norm.weight"]
    if "g_proj.weight" in sd:
        o = o * F.silu((x @ sd["g_proj.weight"].T).view(B, T, HV, dv))
    return o.reshape(B, T, -1) @ sd["o_proj.weight"].T


def _level(t, s):
    return (t ^ s).bit_length()


def _ref_log_linear_mamba2(sd, x, num_heads, head_dim, state_size, n_groups, eps=1e-5):
    """fla's LogLinearMamba2 forward as the masked-matrix sum, float64:
    y_t = Σ_{s<=t} λ_t[ℓ(t,s)] exp(Σ_{s<r<=t} g_r) (C_t·B_s) v_s with ℓ(t,s) = bitlen(t XOR s)."""
    B, T, _ = x.shape
    H, inner = num_heads, num_heads * head_dim
    conv_dim = inner + 2 * n_groups * state_size
    proj = x @ sd["in_proj.weight"].T + sd.get("in_proj.bias", 0)
    z, xBC, dt, dl = torch.split(proj, [inner, conv_dim, H, H * 15], dim=-1)
    xBC = _conv_silu(xBC, sd["conv1d.weight"], sd.get("conv1d.bias"))
    xs, Bm, Cm = torch.split(xBC, [inner, n_groups * state_size, n_groups * state_size], dim=-1)
    xs = xs.view(B, T, H, head_dim)
    Bm, Cm = Bm.view(B, T, n_groups, state_size), Cm.view(B, T, n_groups, state_size)
    dt = F.softplus(dt + sd["dt_bias"])
    g = -torch.exp(sd["A_log"]) * dt                                              # [B, T, H]
    v = xs * dt.unsqueeze(-1)
    lam = F.softplus(sd["L"] * dl.view(B, T, H, 15))
    c = g.cumsum(1)
    y = torch.zeros(B, T, H, head_dim, dtype=F64)
    for b in range(B):
        for h in range(H):
            grp = h // (H // n_groups)
            for t in range(T):
                for s in range(t + 1):
                    w = lam[b, t, h, _level(t, s)] * torch.exp(c[b, t, h] - c[b, s, h]) * (Cm[b, t, grp] @ Bm[b, s, grp])
                    y[b, t, h] += w * v[b, s, h]
    y = y + xs * sd["D"].view(H, -1)
    y = y.reshape(B, T, inner) * F.silu(z)
    gs = y.view(B, T, n_groups, inner // n_groups)
    y = (gs * torch.rsqrt(gs.pow(2).mean(-1, keepdim=True) + eps)).reshape(B, T, inner) * sd["norm.weight"]
    return y @ sd["out_proj.weight"].T + sd.get("out_proj.bias", 0)


GDN_CONFIGS = {
    "gva-gate": dict(head_dim=8, num_heads=2, num_v_heads=4, expand_v=2, use_gate=True, conv_bias=False),
    "nogate-convbias-neg": dict(head_dim=8, num_heads=2, num_v_heads=None, expand_v=1, use_gate=False,
                                conv_bias=True, allow_neg_eigval=True),
}
MAMBA2_CONFIGS = {
    "fla-defaults": dict(num_heads=4, head_dim=8, state_size=8, expand=2, n_groups=1,
                         use_conv_bias=False, use_bias=True, D_has_hdim=False),
    "groups-convbias-Dhdim": dict(num_heads=4, head_dim=8, state_size=4, expand=2, n_groups=2,
                                  use_conv_bias=True, use_bias=False, D_has_hdim=True),
}


@pytest.mark.parametrize("name", GDN_CONFIGS)
def test_gated_deltanet_loads_fla_state_dict_and_computes_fla_layer(name):
    cfg = dict(GDN_CONFIGS[name])
    neg = cfg.pop("allow_neg_eigval", False)
    layer = fl.GatedDeltaNet(hidden_size=D, conv_size=4, layer_idx=0, allow_neg_eigval=neg, **cfg).double()
    HV = cfg["num_v_heads"] or cfg["num_heads"]
    sd = _fla_gdn_state_dict(D, cfg["head_dim"], cfg["num_heads"], HV, cfg["expand_v"], 4,
                             cfg["use_gate"], cfg["conv_bias"], seed=3)
    own = layer.state_dict()
    assert {k: tuple(v.shape) for k, v in own.items()} == {k: tuple(v.shape) for k, v in sd.items()}
    layer.load_state_dict(sd)                                      # strict: every key, fla's names
    x = torch.randn(2, 13, D, generator=_gen(4), dtype=F64)
    y, none, cache = layer(x)
    assert none is None and cache is None
    _close(y, _ref_gated_deltanet(sd, x, cfg["num_heads"], cfg["head_dim"], cfg["expand_v"], neg))
    # round trip: state_dict() gives fla's layout back
    for k, v in layer.state_dict().items():
        assert torch.equal(v, sd[k]), k
    # the plain hila layer with the converted dict computes the same
    native = ht.LogLinearGatedDeltaNet(D, None, num_heads=HV, head_dim=cfg["head_dim"],
                                       expand_v=cfg["expand_v"], num_qk_groups=cfg["num_heads"],
                                       op="gdn", b_bias=False, conv_bias=cfg["conv_bias"],
                                       use_output_gate=cfg["use_gate"], scale=None,
                                       allow_neg_eigval=neg).double()
    hila_sd = fl.fla_to_hila_state_dict(sd, "GatedDeltaNet")
    native.load_state_dict(hila_sd)
    _close(native(x)[0], y, 1e-13)
    back = fl.hila_to_fla_state_dict(native.state_dict(), "GatedDeltaNet")
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)


@pytest.mark.parametrize("name", MAMBA2_CONFIGS)
def test_log_linear_mamba2_loads_fla_state_dict_and_computes_fla_layer(name):
    cfg = MAMBA2_CONFIGS[name]
    layer = fl.LogLinearMamba2(hidden_size=D, conv_kernel=4, layer_idx=0, **cfg).double()
    sd = _fla_mamba2_state_dict(cfg["num_heads"], cfg["head_dim"], D, cfg["state_size"], cfg["expand"],
                                cfg["n_groups"], 4, cfg["use_conv_bias"], cfg["use_bias"],
                                cfg["D_has_hdim"], seed=5)
    own = layer.state_dict()
    assert {k: tuple(v.shape) for k, v in own.items()} == {k: tuple(v.shape) for k, v in sd.items()}
    layer.load_state_dict(sd)
    x = torch.randn(2, 11, D, generator=_gen(6), dtype=F64)
    y, _, _ = layer(x)
    _close(y, _ref_log_linear_mamba2(sd, x, cfg["num_heads"], cfg["head_dim"], cfg["state_size"],
                                     cfg["n_groups"]))
    native = ht.LogLinearMamba2(D, 16384, state_size=cfg["state_size"], expand=cfg["expand"],
                                head_dim=cfg["head_dim"], n_groups=cfg["n_groups"],
                                bias=cfg["use_bias"], conv_bias=cfg["use_conv_bias"],
                                D_has_hdim=cfg["D_has_hdim"]).double()
    native.load_state_dict(fl.fla_to_hila_state_dict(sd, "LogLinearMamba2"))
    _close(native(x)[0], y, 1e-13)
    with pytest.raises(hila.HilaError) as err:
        fl.fla_to_hila_state_dict(sd, "Mamba3")
    assert err.value.argument == "layer"


def test_fla_layout_inside_a_model_and_unsupported_options():
    """The layout hooks work under a prefix (a layer inside a model); fla's options hila does not
    implement are HilaErrors naming them."""
    model = torch.nn.ModuleDict({"attn": fl.GatedDeltaNet(hidden_size=D, head_dim=8, num_heads=2, layer_idx=0)})
    keys = set(model.state_dict())
    assert "attn.q_conv1d.weight" in keys and "attn.A_log" in keys and "attn.gate.A_log" not in keys
    model.load_state_dict(model.state_dict())
    for make, arg in [
        (lambda: fl.GatedDeltaNet(hidden_size=D, head_dim=8, num_heads=2, use_short_conv=False), "use_short_conv"),
        (lambda: fl.GatedDeltaNet(hidden_size=D, head_dim=8, num_heads=2, mode="parallel"), "mode"),
        (lambda: fl.LogLinearMamba2(num_heads=3, head_dim=8, hidden_size=D), "num_heads"),
        (lambda: fl.LogLinearMamba2(num_heads=4, head_dim=8, hidden_size=D, rmsnorm=False), "rmsnorm"),
        (lambda: fl.LogLinearMamba2(num_heads=4, head_dim=8, hidden_size=D, hidden_act="gelu"), "hidden_act"),
        (lambda: fl.LogLinearMamba2(num_heads=4, head_dim=8, hidden_size=D, dt_limit=(0.0, 1.0)), "dt_limit"),
    ]:
        with pytest.raises(hila.HilaError) as err:
            make()
        assert err.value.argument == arg


# ----------------------------------------------------------------------------- fla's call

LAYERS = {
    "gated_deltanet": (lambda: fl.GatedDeltaNet(hidden_size=D, head_dim=8, num_heads=2, num_v_heads=4,
                                                expand_v=1, layer_idx=0), "gdn"),
    "log_linear_mamba2": (lambda: fl.LogLinearMamba2(num_heads=4, head_dim=8, hidden_size=D, state_size=8,
                                                     layer_idx=0), "loglinear"),
    "hla": (lambda: fl.HLAAttention(D, num_heads=2, head_dim=8, op="hla2", layer_idx=0), "hla2"),
    "log_linear_gdn": (lambda: fl.LogLinearGatedDeltaNet(D, 64, num_heads=2, head_dim=8, layer_idx=0),
                       "loglinear_gdn"),
}


def _layer(name, device):
    make, op = LAYERS[name]
    require_device(device, op)
    torch.manual_seed(0)
    return make().to(device=device, dtype=F64).eval()


@pytest.mark.parametrize("name", LAYERS)
def test_padding_mask_equals_each_sequence_alone(name, device):
    """Left and right padding: every sequence computes what it computes alone (the padding is
    removed, not masked), 0 at padded positions; then decode steps through past_key_values
    equal the sequences continued alone."""
    layer = _layer(name, device)
    B, T = 3, 12
    x = torch.randn(B, T, D, generator=_gen(1), dtype=F64).to(device)
    lens = [12, 5, 9]
    for side in ("left", "right"):
        mask = torch.zeros(B, T, dtype=torch.long, device=device)
        for b, n in enumerate(lens):
            mask[b, T - n:] = 1 if side == "left" else 0
            mask[b, :n] = 1 if side == "right" else mask[b, :n]
        rows = [x[b, mask[b].bool()] for b in range(B)]
        cache = ht.Cache([])
        y, none, cache2 = layer(x, attention_mask=mask, past_key_values=cache, use_cache=True)
        assert none is None and cache2 is cache and cache.get_layer_state(0) is not None
        for b in range(B):
            alone, _, _ = layer(rows[b].unsqueeze(0))
            _close(y[b, mask[b].bool()], alone[0])
            assert (y[b, ~mask[b].bool()] == 0).all()
        if side == "right":
            continue
        steps = torch.randn(B, 3, D, generator=_gen(2), dtype=F64).to(device)
        for t in range(3):
            mask = torch.cat([mask, mask.new_ones(B, 1)], 1)
            y_t, _, cache = layer(steps[:, t:t + 1], attention_mask=mask, past_key_values=cache, use_cache=True)
            for b in range(B):
                full, _, _ = layer(torch.cat([rows[b], steps[b, :t + 1]]).unsqueeze(0))
                _close(y_t[b, 0], full[0, -1])


def test_fla_call_errors_and_packed_input():
    layer = _layer("gated_deltanet", "cpu")
    x = torch.randn(2, 6, D, generator=_gen(1), dtype=F64)
    y, _, cache = layer(x, use_cache=True)                                    # a new hila Cache
    assert isinstance(cache, ht.Cache) and cache.get_layer_state(0).recurrent.pos.tolist() == [6, 6]
    bad = torch.ones(2, 7, dtype=torch.long)
    bad[1, -1] = 0
    with pytest.raises(hila.HilaError) as err:                                # padding in a decode step
        layer(x[:, :1], attention_mask=bad, past_key_values=cache, use_cache=True)
    assert err.value.argument == "attention_mask"
    with pytest.raises(hila.HilaError) as err:
        layer(x, attention_mask=torch.ones(2, 6, 6))
    assert err.value.argument == "attention_mask"
    no_idx = fl.GatedDeltaNet(hidden_size=D, head_dim=8, num_heads=2).double()
    with pytest.raises(hila.HilaError) as err:
        no_idx(x, past_key_values=ht.Cache([]))
    assert err.value.argument == "layer_idx"
    # explicit cu_seqlens (packed, B == 1) take precedence over a mask, as in fla
    cu = torch.tensor([0, 4, 6])
    packed = x[0].unsqueeze(0)
    y_p, _, _ = layer(packed, attention_mask=torch.zeros(1, 6), cu_seqlens=cu, max_seqlen=4)
    _close(y_p[:, :4], layer(packed[:, :4])[0])
    _close(y_p[:, 4:], layer(packed[:, 4:])[0])
