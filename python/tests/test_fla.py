# SPDX-License-Identifier: Apache-2.0
"""hila.torch.fla: fla's documented call examples (the docstrings of fla.ops.simple_gla,
fla.ops.gated_delta_rule and the way fla.layers.LogLinearMamba2 calls chunk_log_linear_attn), at
test sizes and in float64, against the native API hila.torch.forward; fla's conventions (state
layouts, gates in the kernel, GVA, head_first, reverse, g_gamma); the log-linear state at the
64·2^k lengths where fla's drops a level; the HLA functions; the errors."""
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import hila  # noqa: E402
import hila.torch as ht  # noqa: E402
from hila.torch import fla  # noqa: E402
from helpers import assert_rel_close, chunk_for, require_device, torch_gen as _gen  # noqa: E402

F64 = torch.float64


def _close(a, b, tol=1e-12):
    assert_rel_close(a, b, tol)


def _randn(*shape, seed, device, dtype=F64):
    return torch.randn(*shape, generator=_gen(seed), dtype=F64).to(device=device, dtype=dtype)


def _flat(x):
    """fla's `rearrange(x, 'b t ... -> 1 (b t) ...')`."""
    return x.reshape(1, x.shape[0] * x.shape[1], *x.shape[2:])


def _state(H, N):
    return hila.State(torch.zeros(N, dtype=torch.int64, device=H.device), None, None, H)


# ----------------------------------------------------------------------------- simple GLA

def test_chunk_simple_gla_docstring_example(device):
    """fla's chunk_simple_gla example: equal-length batch, then the same tokens packed with
    cu_seqlens; both equal the native gla call."""
    require_device(device, "gla")
    B, T, H, K, V = 4, 50, 4, 16, 8
    q, k = _randn(B, T, H, K, seed=1, device=device), _randn(B, T, H, K, seed=2, device=device)
    v = _randn(B, T, H, V, seed=3, device=device)
    g = F.logsigmoid(_randn(B, T, H, seed=4, device=device))
    o, ht_ = fla.chunk_simple_gla(q, k, v, g, initial_state=None, output_final_state=True)
    o_ref, fin = ht.forward("gla", q, k, v, g, output_final_state=True)
    _close(o, o_ref)
    _close(ht_, fin.H)
    assert ht_.shape == (B, H, K, V) and ht_.dtype == F64
    q, k, v, g = map(_flat, (q, k, v, g))
    cu_seqlens = q.new_tensor([0, T, 2 * T, 3 * T, 4 * T], dtype=torch.long)
    o_var, ht_var = fla.chunk_simple_gla(q, k, v, g, initial_state=None, output_final_state=True,
                                         cu_seqlens=cu_seqlens)
    _close(o_var, _flat(o_ref))
    _close(ht_var, ht_)


def test_fused_recurrent_simple_gla_docstring_example(device):
    """fla's fused_recurrent_simple_gla example with h0. Its docstring draws g as [B, T, H, K] (a
    per-key gate, which is GLA's gk): that is a clear HilaError; with the head-wise g [B, T, H]
    the example equals the native call, dense and packed."""
    require_device(device, "gla")
    B, T, H, K, V = 4, 37, 4, 8, 8
    q, k = _randn(B, T, H, K, seed=1, device=device), _randn(B, T, H, K, seed=2, device=device)
    v = _randn(B, T, H, V, seed=3, device=device)
    h0 = _randn(B, H, K, V, seed=5, device=device)
    g_per_key = F.logsigmoid(_randn(B, T, H, K, seed=4, device=device))
    with pytest.raises(hila.HilaError, match="head-wise") as err:
        fla.fused_recurrent_simple_gla(q, k, v, g_per_key, initial_state=h0, output_final_state=True)
    assert err.value.argument == "g"
    g = F.logsigmoid(_randn(B, T, H, seed=4, device=device))
    o, ht_ = fla.fused_recurrent_simple_gla(q, k, v, g, initial_state=h0, output_final_state=True)
    form = "serial" if device == "cpu" else "chunk"
    o_ref, fin = ht.forward("gla", q, k, v, g, initial_state=_state(h0, B), output_final_state=True,
                            form=form)
    _close(o, o_ref)
    _close(ht_, fin.H)
    cu_seqlens = torch.tensor([0, T, 2 * T, 3 * T, 4 * T], device=device)
    o_var, ht_var = fla.fused_recurrent_simple_gla(*map(_flat, (q, k, v, g)), initial_state=h0,
                                                   output_final_state=True, cu_seqlens=cu_seqlens)
    _close(o_var, _flat(o_ref), 1e-11)
    _close(ht_var, ht_, 1e-11)


def test_simple_gla_conventions(device):
    """g_gamma [H], state_v_first (views of the state), head_first, reverse (dense and packed),
    scale, chunk_size and the host copy of cu_seqlens."""
    require_device(device, "gla")
    B, T, H, K, V = 2, 21, 3, 8, 4
    q, k = _randn(B, T, H, K, seed=1, device=device), _randn(B, T, H, K, seed=2, device=device)
    v = _randn(B, T, H, V, seed=3, device=device)
    g_gamma = -torch.rand(H, generator=_gen(4), dtype=F64).to(device)
    h0 = _randn(B, H, V, K, seed=5, device=device)                      # V-first
    o, hT = fla.chunk_simple_gla(q, k, v, g_gamma=g_gamma, scale=0.3, initial_state=h0,
                                 output_final_state=True, state_v_first=True, chunk_size=8)
    g = g_gamma.expand(B, T, H)
    o_ref, fin = ht.forward("gla", q, k, v, g.contiguous(), scale=0.3, output_final_state=True,
                            initial_state=_state(h0.transpose(-1, -2).contiguous(), B))
    _close(o, o_ref)
    _close(hT, fin.H.transpose(-1, -2))
    assert hT.shape == (B, H, V, K)
    # head_first: [B, H, T, ...] in, o [B, H, T, V] out
    o_hf, _ = fla.chunk_simple_gla(*(x.transpose(1, 2) for x in (q, k, v, g)), head_first=True)
    _close(o_hf.transpose(1, 2), ht.forward("gla", q, k, v, g.contiguous())[0])
    # reverse: the recurrence from each sequence's last token
    o_rev, h_rev = fla.fused_recurrent_simple_gla(q, k, v, g, reverse=True, output_final_state=True)
    flip = lambda x: x.flip(1).contiguous()  # noqa: E731
    o_ref, fin = ht.forward("gla", flip(q), flip(k), flip(v), flip(g), output_final_state=True)
    _close(o_rev, o_ref.flip(1), 1e-11)
    _close(h_rev, fin.H, 1e-11)
    lens = [5, 16]
    cu = torch.tensor([0, 5, 21], device=device)
    packed = [torch.cat([x[0, :5], x[1, :16]]).unsqueeze(0) for x in (q, k, v, g)]
    o_p, h_p = fla.fused_recurrent_simple_gla(*packed, reverse=True, output_final_state=True,
                                              cu_seqlens=cu, cu_seqlens_cpu=cu.cpu())
    for i, (s, n) in enumerate(zip((0, 5), lens)):
        seq = [x[:, s:s + n] for x in packed]
        o_i, h_i = fla.fused_recurrent_simple_gla(*seq, reverse=True, output_final_state=True)
        _close(o_p[:, s:s + n], o_i, 1e-11)
        _close(h_p[i:i + 1], h_i, 1e-11)


def test_simple_gla_bf16_and_grads():
    """bf16 inputs with a bf16 state (fla's style: converted to the fp32 state); gradients reach
    q, k, v, g_gamma and the initial state through the views."""
    B, T, H, K, V = 2, 19, 2, 8, 8
    q, k, v = (_randn(B, T, H, K, seed=s, device="cpu") for s in (1, 2, 3))
    g = F.logsigmoid(_randn(B, T, H, seed=4, device="cpu"))
    h0 = _randn(B, H, K, V, seed=5, device="cpu")
    o16, h16 = fla.chunk_simple_gla(*(x.bfloat16() for x in (q, k, v, g)), initial_state=h0.bfloat16(),
                                    output_final_state=True)
    o64, h64 = fla.chunk_simple_gla(q, k, v, g, initial_state=h0.bfloat16().double(),
                                    output_final_state=True)
    assert o16.dtype == torch.bfloat16 and h16.dtype == torch.float32
    _close(o16.double(), o64, 5e-2)
    _close(h16.double(), h64, 5e-2)
    g_gamma = -torch.rand(H, generator=_gen(6), dtype=F64)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g_gamma, h0)]

    def f(q, k, v, g_gamma, h0):
        o, hT = fla.chunk_simple_gla(q, k, v, g_gamma=g_gamma, initial_state=h0.transpose(-1, -2),
                                     output_final_state=True, state_v_first=True)
        return o, hT
    assert torch.autograd.gradcheck(f, leaves, atol=1e-8, rtol=1e-6)


# ----------------------------------------------------------------------------- gated delta rule

def test_chunk_gated_delta_rule_docstring_example(device):
    """fla's chunk_gated_delta_rule example (GVA: HV = 2 H; k L2-normalised; h0), in float64
    against the native gdn call, then packed with cu_seqlens; and once in bf16 as written."""
    require_device(device, "gdn")
    B, T, H, HV, K, V = 2, 40, 2, 4, 16, 8
    q = _randn(B, T, H, K, seed=1, device=device)
    k = F.normalize(_randn(B, T, H, K, seed=2, device=device), p=2, dim=-1)
    v = _randn(B, T, HV, V, seed=3, device=device)
    beta = torch.rand(B, T, HV, generator=_gen(4), dtype=F64).to(device).sigmoid()
    g = F.logsigmoid(torch.rand(B, T, HV, generator=_gen(5), dtype=F64).to(device))
    h0 = _randn(B, HV, K, V, seed=6, device=device)
    o, ht_ = fla.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_ref, fin = ht.forward("gdn", q, k, v, g, beta=beta, initial_state=_state(h0, B),
                            output_final_state=True)
    _close(o, o_ref)
    _close(ht_, fin.H)
    q, k, v, beta, g = map(_flat, (q, k, v, beta, g))
    cu_seqlens = q.new_tensor([0, T, 2 * T], dtype=torch.long)
    o_var, ht_var = fla.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                               output_final_state=True, cu_seqlens=cu_seqlens)
    _close(o_var, _flat(o_ref), 1e-11)
    _close(ht_var, ht_, 1e-11)
    o16, h16 = fla.chunk_gated_delta_rule(*(x.bfloat16() for x in (q, k, v, g, beta)),
                                          initial_state=h0.bfloat16(), output_final_state=True,
                                          cu_seqlens=cu_seqlens)
    assert o16.dtype == torch.bfloat16 and h16.dtype == torch.float32
    _close(o16.double(), o_var, 1e-1)


def test_fused_recurrent_gated_delta_rule_docstring_example(device):
    """fla's fused_recurrent example passes beta positionally, where fla's signature has gk
    (q, k, v, g, gk, gv, beta): hila says so (HilaError naming gk). With beta= it equals the
    native call; beta=None means ones."""
    require_device(device, "gdn")
    B, T, H, HV, K, V = 2, 23, 2, 4, 8, 8
    q = _randn(B, T, H, K, seed=1, device=device)
    k = F.normalize(_randn(B, T, H, K, seed=2, device=device), p=2, dim=-1)
    v = _randn(B, T, HV, V, seed=3, device=device)
    g = F.logsigmoid(torch.rand(B, T, HV, generator=_gen(5), dtype=F64).to(device))
    beta = torch.rand(B, T, HV, generator=_gen(4), dtype=F64).to(device).sigmoid()
    h0 = _randn(B, HV, K, V, seed=6, device=device)
    with pytest.raises(hila.HilaError, match="beta=beta") as err:
        fla.fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert err.value.argument == "gk"
    o, ht_ = fla.fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta, initial_state=h0,
                                                  output_final_state=True)
    form = "serial" if device == "cpu" else "chunk"
    o_ref, fin = ht.forward("gdn", q, k, v, g, beta=beta, initial_state=_state(h0, B),
                            output_final_state=True, form=form)
    _close(o, o_ref)
    _close(ht_, fin.H)
    o1, _ = fla.fused_recurrent_gated_delta_rule(q, k, v, g)
    _close(o1, ht.forward("gdn", q, k, v, g, beta=torch.ones_like(g), form=form)[0])


def test_gated_delta_rule_in_kernel_options():
    """fla's GatedDeltaNet call: raw gate with A_log / dt_bias in the kernel, beta logits with
    sigmoid (and 2 sigmoid with allow_neg_eigval), q/k L2 norm in the kernel, V-first state;
    gradients reach A_log and dt_bias."""
    B, T, H, K, V = 2, 17, 2, 8, 16
    q, k = _randn(B, T, H, K, seed=1, device="cpu"), _randn(B, T, H, K, seed=2, device="cpu")
    v = _randn(B, T, H, V, seed=3, device="cpu")
    a, b = _randn(B, T, H, seed=4, device="cpu"), _randn(B, T, H, seed=5, device="cpu")
    A_log = torch.log(torch.rand(H, generator=_gen(6), dtype=F64) * 16).requires_grad_()
    dt_bias = _randn(H, seed=7, device="cpu").requires_grad_()
    for fn in (fla.chunk_gated_delta_rule, fla.fused_recurrent_gated_delta_rule):
        for neg in (False, True):
            o, hT = fn(q, k, v, g=a, beta=b, A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=True,
                       use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                       allow_neg_eigval=neg, state_v_first=True, output_final_state=True)
            g = -torch.exp(A_log) * F.softplus(a + dt_bias)
            beta = torch.sigmoid(b) * (2 if neg else 1)
            form = "chunk" if fn is fla.chunk_gated_delta_rule else "serial"
            o_ref, fin = ht.forward("gdn", q, k, v, g, beta=beta, qk_l2norm=True, form=form,
                                    output_final_state=True)
            _close(o, o_ref)
            _close(hT, fin.H.transpose(-1, -2))
    o.sum().backward()
    assert A_log.grad is not None and torch.isfinite(A_log.grad).all() and A_log.grad.abs().sum() > 0
    assert dt_bias.grad is not None and dt_bias.grad.abs().sum() > 0
    with pytest.raises(hila.HilaError) as err:
        fla.chunk_gated_delta_rule(q, k, v, a, b, allow_neg_eigval=True)
    assert err.value.argument == "allow_neg_eigval"
    with pytest.raises(hila.HilaError) as err:
        fla.chunk_gated_delta_rule(q, k, v, a, b, use_gate_in_kernel=True)
    assert err.value.argument == "A_log"


# ----------------------------------------------------------------------------- log-linear

def _mamba2_inputs(B, T, H, N, P, L, seed, device):
    """The tensors fla.layers.LogLinearMamba2 hands to chunk_log_linear_attn: q = C, k = B
    [B, T, 1, N], v = x * dt, g = A * dt, level_scales = softplus(L * dl)."""
    C, Bm = _randn(B, T, 1, N, seed=seed, device=device), _randn(B, T, 1, N, seed=seed + 1, device=device)
    x = _randn(B, T, H, P, seed=seed + 2, device=device)
    dt = F.softplus(_randn(B, T, H, seed=seed + 3, device=device) - 1)
    A = -torch.arange(1, H + 1, dtype=F64, device=device)
    lam = F.softplus(torch.ones(H, L, dtype=F64, device=device) * _randn(B, T, H, L, seed=seed + 4, device=device))
    return C, Bm, x * dt.unsqueeze(-1), A * dt, lam


def test_chunk_log_linear_attn_as_fla_layer_calls_it(device):
    require_device(device, "loglinear")
    q, k, v, g, lam = _mamba2_inputs(2, 45, 3, 16, 8, 15, seed=1, device=device)
    o, st = fla.chunk_log_linear_attn(q=q, k=k, v=v, g=g, level_scales=lam, initial_state=None,
                                      output_final_state=True, cu_seqlens=None)
    o_ref, fin = ht.forward("loglinear", q, k, v, g, lam=lam, scale=1.0, output_final_state=True)
    _close(o, o_ref)
    assert isinstance(st, fla.LogLinearAttentionState)
    assert st.ht.shape == (2, 7, 3, 16, 8) and st.offsets.tolist() == [45, 45]
    _close(st.to_state().H, fin.H)
    assert st.to_state().H.data_ptr() == st.ht.data_ptr()  # a view, no copy
    with pytest.raises(hila.HilaError) as err:  # fla reads missing levels as 0; hila refuses
        fla.chunk_log_linear_attn(q, k, v, g, lam[..., :5])
    assert err.value.argument == "level_scales"


@pytest.mark.parametrize("n", [64, 128, 256, 100])
def test_log_linear_state_is_exact_where_fla_drops_a_level(n, device):
    """Prefill of n tokens, then decode through the returned state, one token per call: equals
    the whole sequence in one call, also at n = 64·2^k (docs/math/LOGLINEAR.md §12 E1)."""
    require_device(device, "loglinear")
    extra = 3
    q, k, v, g, lam = _mamba2_inputs(1, n + extra, 2, 8, 4, 10, seed=7, device=device)
    o_full, _ = fla.chunk_log_linear_attn(q, k, v, g, lam)
    o, st = fla.chunk_log_linear_attn(q[:, :n], k[:, :n], v[:, :n], g[:, :n], lam[:, :n],
                                      output_final_state=True)
    outs = [o]
    for t in range(n, n + extra):
        o, st = fla.chunk_log_linear_attn(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1],
                                          lam[:, t:t + 1], initial_state=st, output_final_state=True)
        outs.append(o)
    _close(torch.cat(outs, 1), o_full, 1e-11)
    assert st.offsets.tolist() == [n + extra]


def test_log_linear_gated_delta_rule_and_fla_state_errors():
    B, T, H, K, V = 2, 30, 2, 8, 8
    q, k, v = (_randn(B, T, H, K, seed=s, device="cpu") for s in (1, 2, 3))
    g = F.logsigmoid(_randn(B, T, H, seed=4, device="cpu"))
    beta = torch.rand(B, T, H, generator=_gen(5), dtype=F64)
    lam = torch.rand(B, T, H, 6, generator=_gen(6), dtype=F64)
    for fn, form in ((fla.chunk_log_linear_gated_delta_rule, "chunk"),
                     (fla.fused_recurrent_log_linear_gated_delta_rule, "serial")):
        o, st = fn(q, k, v, g, beta, lam, output_final_state=True, use_qk_l2norm_in_kernel=True)
        o_ref, fin = ht.forward("loglinear_gdn", q, k, v, g, lam=lam, beta=beta, qk_l2norm=True,
                                form=form, output_final_state=True)
        _close(o, o_ref)
        _close(st.to_state().H, fin.H)

    class FlaState:  # the fields of fla's LogLinearAttentionState
        ht = offsets = q_prev = k_prev = v_prev = g_prev = level_scales_prev = None
    with pytest.raises(hila.HilaError, match="chunk-level") as err:
        fla.chunk_log_linear_attn(q, k, v, g, lam, initial_state=FlaState())
    assert err.value.argument == "initial_state"
    with pytest.raises(hila.HilaError) as err:  # a bare tensor is no log-linear state
        fla.chunk_log_linear_attn(q, k, v, g, lam, initial_state=torch.zeros(B, H, K, V, dtype=F64))
    assert err.value.argument == "initial_state"


# ----------------------------------------------------------------------------- HLA

@pytest.mark.parametrize("op", ["hla2", "ahla", "hla3", "loglinear_hla2", "loglinear_ahla", "loglinear_hla3"])
def test_hla_functions_equal_native(op, device):
    require_device(device, op)
    B, T, G, H, K, V = 2, 26, 1, 2, 8, 4
    q, k = _randn(B, T, G, K, seed=1, device=device), _randn(B, T, G, K, seed=2, device=device)
    v = _randn(B, T, H, V, seed=3, device=device)
    P = hila.op_traits(op)["num_primitives"]
    g = F.logsigmoid(_randn(B, T, H, P, seed=4, device=device))                   # untied gates
    loglinear = hila.op_traits(op)["loglinear"]
    lam = torch.rand(B, T, H, 7, generator=_gen(5), dtype=F64).to(device) if loglinear else None
    name = op.replace("loglinear_", "log_linear_")
    chunk_fn, rec_fn = getattr(fla, f"chunk_{name}"), getattr(fla, f"fused_recurrent_{name}")
    args = (q, k, v, g) + ((lam,) if loglinear else ())
    kw = (dict(normalize=True, chunk_size=chunk_for(device, 8, op)) if op.endswith("hla3")
          else dict(ridge=0.1 if "hla2" in op else 0.0))
    o, st = chunk_fn(*args, output_final_state=True, **kw)
    o_ref, fin = ht.forward(op, q, k, v, g, lam=lam, output_final_state=True, form="chunk",
                            chunk=kw.pop("chunk_size", 64), **kw)
    _close(o, o_ref)
    for a, b in zip(st, fin):
        assert (a is None) == (b is None)
        if a is not None:
            _close(a.double(), b.double())
    # continue from the state, serial form
    o2, _ = rec_fn(*args, initial_state=st, **kw)
    form = "serial" if device == "cpu" else "chunk"
    _close(o2, ht.forward(op, q, k, v, g, lam=lam, initial_state=fin, form=form, **kw)[0], 1e-11)
    with pytest.raises(hila.HilaError) as err:  # several parts: no bare-tensor state
        chunk_fn(*args, initial_state=torch.zeros(B, H, K, V, dtype=F64, device=device))
    assert err.value.argument == "initial_state"


def test_fla_argument_errors():
    B, T, H, K = 1, 8, 2, 4
    q = _randn(B, T, H, K, seed=1, device="cpu")
    g = -torch.rand(B, T, H, dtype=F64)
    for call, arg in [
        (lambda: fla.chunk_simple_gla(q, q, q, g, no_such_option=1), "no_such_option"),
        (lambda: fla.chunk_simple_gla(q, q, q, g, g_gamma=-torch.rand(H, dtype=F64)), "g_gamma"),
        (lambda: fla.chunk_gated_delta_rule(q, q, q, g, g, cp_context=object()), "cp_context"),
        (lambda: fla.fused_recurrent_gated_delta_rule(q, q, q, g, gv=q), "gv"),
        (lambda: fla.chunk_simple_gla(q, q, q, g, initial_state=torch.zeros(B, H, K), output_final_state=True),
         "initial_state"),
        (lambda: fla.chunk_simple_gla(q, q, q, g, ssm_state_indices=torch.zeros(B, T, dtype=torch.int32),
                                      initial_state=torch.zeros(3, H, K, K, dtype=F64)), "ssm_state_indices"),
        (lambda: fla.chunk_hla2(q, q, q, g, 1.0, None, False, None, None, "extra"), None),
    ]:
        with pytest.raises(hila.HilaError) as err:
            call()
        assert err.value.argument == arg, str(err.value)
