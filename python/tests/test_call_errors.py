# SPDX-License-Identifier: Apache-2.0
"""Calls as users of other libraries write them: an fla-style positional call without the
operator name, extra positional arguments, a bare tensor as the state (fla's [N, H, K, V]:
accepted for gla and gdn, a clear error otherwise, never unpacked as a State), arguments of the
wrong type in the numpy API (HilaError naming the argument, never nanobind's TypeError), and
HilaLM.generate / save_pretrained with Hugging Face's argument names."""
import numpy as np
import pytest

import hila

F64 = np.float64


def _np_inputs(B=4, T=8, H=2, K=4):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((B, T, H, K)) for _ in range(3))
    return q, k, v, -rng.random((B, T, H))


def _raises(call, argument, match=None):
    with pytest.raises(hila.HilaError, match=match) as err:
        call()
    assert err.value.argument == argument, str(err.value)
    return str(err.value)


def test_numpy_api_names_the_argument():
    q, k, v, g = _np_inputs()
    msg = _raises(lambda: hila.forward(q, k, v, g), "op", "operator name")
    assert "hila.torch.fla" in msg and "[[" not in msg                      # no tensor dump
    for fn in (hila.backward, hila.step, hila.step_):
        _raises(lambda: fn(q, k, v, g), "op")
    _raises(lambda: hila.forward("gla", "abc", k, v, g), "q")
    _raises(lambda: hila.forward("gla", q, k, v, {"g": 1}), "g")
    _raises(lambda: hila.forward("gla", q, k, v, g, chunk="64"), "chunk")
    _raises(lambda: hila.forward("gla", q, k, v, g, form=3), "form")
    _raises(lambda: hila.forward("gla", q, k, v, g, scale="a"), "scale")
    _raises(lambda: hila.forward("gla", q, k, v, g, eps=None), "eps")
    _raises(lambda: hila.forward("gla", q, k, v, g, normalize="yes"), "normalize")
    _raises(lambda: hila.forward("gla", q, k, v, g, stream="s"), "stream")
    _raises(lambda: hila.forward("gla", q, k, v, g, initial_state=(np.zeros(4, np.int64), None, None, "x")),
            "initial_state.H")
    _raises(lambda: hila.forward("gdn", q, k, v, g, g), None, "positional")   # beta by position
    _raises(lambda: hila.forward("gdn", q, k, v, g, beta=g, use_qk_l2norm_in_kernel=True),
            "use_qk_l2norm_in_kernel", "qk_l2norm")
    _raises(lambda: hila.step("gla", q[:, 0], k[:, 0], v[:, 0], g[:, 0], state=None, chunk_size=8), "chunk_size")
    _raises(lambda: hila.DecodeState(q, 1, 1, 4, 4), "op")
    _raises(lambda: hila.DecodeState("gla", "4", 2, 4, 4), "batch")
    st = hila.DecodeState("gla", 4, 2, 4, 4, dtype="float64")
    _raises(lambda: st.step("abc", k[:, 0], v[:, 0], g[:, 0]), "q")
    _raises(lambda: st.load((np.zeros(4, np.int64), None, None, "x")), "state.H")


def test_numpy_api_names_torch_tensors_with_a_lazy_bit():
    """torch tensors with a lazy negation bit (their memory holds the negated values, which DLPack
    hands over without the bit) are refused by the framework-neutral API, naming the argument, in
    forward, backward, step and step_ (inputs and state parts); the same tensors resolved work."""
    torch = pytest.importorskip("torch")
    q, k, v, g = (torch.from_numpy(np.ascontiguousarray(x)) for x in _np_inputs(B=2, T=3))
    neg = lambda x: torch._neg_view(-x)  # noqa: E731  (the values of x, stored negated)
    assert torch.equal(neg(q).resolve_neg(), q)
    _raises(lambda: hila.forward("gla", neg(q), k, v, g), "q", "negation")
    _raises(lambda: hila.forward("gla", q, k, v, neg(g)), "g")
    _raises(lambda: hila.backward("gla", q, k, v, g, do=neg(v)), "do")
    st = hila.State(torch.zeros(2, dtype=torch.int64), None, None, torch.zeros(2, 2, 4, 4, dtype=torch.float64))
    _raises(lambda: hila.step("gla", q[:, 0], neg(k[:, 0]), v[:, 0], g[:, 0], state=st), "k")
    part = torch.zeros(2, 2, 4, 4, dtype=torch.float64)
    bad = hila.State(torch.zeros(2, dtype=torch.int64), None, None, torch._neg_view(part))
    msg = _raises(lambda: hila.step_("gla", q[:, 0], k[:, 0], v[:, 0], g[:, 0], state=bad), "state")
    assert "resolve_neg" in msg
    o, _ = hila.forward("gla", neg(q).resolve_neg(), k, v, g)
    o_ref, _ = hila.forward("gla", q, k, v, g)
    assert np.array_equal(np.asarray(o), np.asarray(o_ref))


def test_numpy_api_options_after_a_cached_call():
    """hila.ops caches the Config of a call's options: an option that equals a cached one (1 and
    True) or cannot be hashed (a list) is still checked and named."""
    q, k, v, g = _np_inputs()
    for cv in (True, False):
        hila.forward("gla", q, k, v, g, check_values=cv, normalize=False)
    _raises(lambda: hila.forward("gla", q, k, v, g, check_values=1), "check_values", "bool")
    _raises(lambda: hila.forward("gla", q, k, v, g, normalize=0), "normalize", "bool")
    _raises(lambda: hila.forward("gla", q, k, v, g, scale=[0.5]), "scale", "number")
    _raises(lambda: hila.step_("gla", q[:, 0], k[:, 0], v[:, 0], g[:, 0], np.zeros(2),
                               state=hila.State(np.zeros(4, np.int64), None, None, np.zeros((4, 2, 4, 4)))),
            None, "positional")


@pytest.mark.parametrize("N", [1, 4])
def test_bare_state_array(N):
    """fla's initial_state [N, H, K, V]: the state of gla and gdn (positions 0); rejected, naming
    initial_state, for operators whose state has positions or several parts. N = 4 used to be
    unpacked row by row as (pos, S, P, H)."""
    q, k, v, g = _np_inputs(B=N)
    h0 = np.random.default_rng(1).standard_normal((N, 2, 4, 4))
    beta = np.full(g.shape, 0.5)
    for op, kw in (("gla", {}), ("gdn", {"beta": beta})):
        o, fin = hila.forward(op, q, k, v, g, initial_state=h0, output_final_state=True, **kw)
        o_ref, fin_ref = hila.forward(op, q, k, v, g, output_final_state=True, **kw,
                                      initial_state=hila.State(np.zeros(N, np.int64), None, None, h0))
        np.testing.assert_array_equal(o, o_ref)
        np.testing.assert_array_equal(fin.H, fin_ref.H)
        st = hila.State(np.zeros(N, np.int64), None, None, h0.copy())
        o1, new = hila.step(op, q[:, 0], k[:, 0], v[:, 0], g[:, 0], state=h0, **{n: x[:, 0] for n, x in kw.items()})
        o2, _ = hila.step(op, q[:, 0], k[:, 0], v[:, 0], g[:, 0], state=st, **{n: x[:, 0] for n, x in kw.items()})
        np.testing.assert_array_equal(o1, o2)
    lam = np.ones(g.shape + (5,))
    for op, kw in (("hla2", {}), ("loglinear", {"lam": lam}), ("loglinear_gdn", {"lam": lam, "beta": beta})):
        msg = _raises(lambda: hila.forward(op, q, k, v, g, initial_state=h0, **kw), "initial_state",
                      "hila.State")
        assert "init.pos" not in msg
    _raises(lambda: hila.forward("gla", q, k, v, g, initial_state=h0[0]), "initial_state")   # 3-D
    _raises(lambda: hila.backward("hla2", q, k, v, g, do=v, d_final_state=h0), "d_final_state")


def test_torch_api_positional_and_state_errors():
    torch = pytest.importorskip("torch")
    import hila.torch as ht
    q, k, v, g = (torch.from_numpy(x) for x in _np_inputs())
    msg = _raises(lambda: ht.forward(q, k, v, g), "op", "operator name")
    assert "Expected a value of type" not in msg and "tensor(" not in msg
    for fn in (ht.step, ht.step_):
        _raises(lambda: fn(q[:, 0], k[:, 0], v[:, 0], g[:, 0], state=None), "op")
    _raises(lambda: ht.forward("gla", q.numpy(), k, v, g), "q", "torch.Tensor")
    _raises(lambda: ht.forward("gla", q, k, v, g, g), None, "positional")
    _raises(lambda: ht.forward("loglinear", q, k, v, g, level_scales=g), "level_scales", "lam")
    _raises(lambda: ht.step_("gla", q[:, 0], k[:, 0], v[:, 0], g[:, 0], state=None, ssm_state_indices=g),
            "ssm_state_indices", "state_indices")
    h0 = torch.randn(4, 2, 4, 4, dtype=torch.float64)
    o, fin = ht.forward("gla", q, k, v, g, initial_state=h0, output_final_state=True)
    o_ref, _ = ht.forward("gla", q, k, v, g, initial_state=hila.State(torch.zeros(4, dtype=torch.int64),
                                                                      None, None, h0))
    assert torch.equal(o, o_ref) and fin.pos.tolist() == [8] * 4
    st = h0.clone()
    o1 = ht.step_("gla", q[:, 0], k[:, 0], v[:, 0], g[:, 0], state=st)       # advances st in place
    o2, new = ht.step("gla", q[:, 0], k[:, 0], v[:, 0], g[:, 0], state=h0)
    assert torch.allclose(o1, o2, rtol=1e-12, atol=1e-13) and torch.allclose(st, new.H, rtol=1e-12, atol=1e-13)
    _raises(lambda: ht.forward("hla3", q, k, v, g, initial_state=h0), "initial_state")
    _raises(lambda: ht.step_("loglinear", q[:, 0], k[:, 0], v[:, 0], g[:, 0], lam=torch.ones(4, 2, 3,
                             dtype=torch.float64), state=h0), "state")


def test_hila_lm_generate_with_hugging_face_arguments(tmp_path):
    torch = pytest.importorskip("torch")
    import hila.torch as ht
    torch.manual_seed(0)
    lm = ht.HilaLM(ht.HilaLMConfig(vocab_size=40, hidden_size=32, num_layers=2, mixer="hla",
                                   mixer_kwargs=dict(num_heads=2, head_dim=8, op="ahla"), max_len=64,
                                   init_std=0.2)).double().eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 40, (n,), generator=g) for n in (6, 3)]
    ids = torch.zeros(2, 6, dtype=torch.long)
    mask = torch.zeros_like(ids)
    ids[0], mask[0] = prompts[0], 1
    ids[1, 3:], mask[1, 3:] = prompts[1], 1                                      # left padding
    ref = lm.generate(prompts, max_new_tokens=5)
    out = lm.generate(input_ids=ids, attention_mask=mask, max_length=11)        # 11 - 6 = 5 new
    assert all(torch.equal(a, b) for a, b in zip(out, ref))
    nucleus = lm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=True,
                          top_p=1e-9, generator=torch.Generator().manual_seed(0))
    assert all(torch.equal(a, b) for a, b in zip(nucleus, ref))                  # top token only
    sampled = lm.generate(prompts, max_new_tokens=4, temperature=0.9, top_k=5, top_p=0.8,
                          generator=torch.Generator().manual_seed(0))
    assert [len(t) for t in sampled] == [4, 4]
    for call, arg in [(lambda: lm.generate(prompts), "max_new_tokens"),
                      (lambda: lm.generate(input_ids=ids, max_length=6), "max_length"),
                      (lambda: lm.generate(prompts, input_ids=ids, max_new_tokens=2), "input_ids"),
                      (lambda: lm.generate(prompts, attention_mask=mask, max_new_tokens=2), "attention_mask"),
                      (lambda: lm.generate(input_ids=ids, attention_mask=mask[:, :3], max_new_tokens=2),
                       "attention_mask"),
                      (lambda: lm.generate(prompts, max_new_tokens=2, do_sample=True, top_p=1.5), "top_p")]:
        _raises(call, arg)
    pytest.importorskip("safetensors", reason="safetensors is not installed (HilaLM.save_pretrained writes it)")
    lm.save_pretrained(str(tmp_path))
    back = ht.HilaLM.from_pretrained(str(tmp_path))
    assert back.config == lm.config and next(back.parameters()).dtype == torch.float64
    assert all(torch.equal(a, b) for a, b in zip(lm.state_dict().values(), back.state_dict().values()))
    assert all(torch.equal(a, b) for a, b in zip(back.generate(prompts, max_new_tokens=5), ref))
    _raises(lambda: ht.HilaLM.from_pretrained(str(tmp_path / "missing")), "path")
