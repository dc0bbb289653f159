# SPDX-License-Identifier: Apache-2.0
"""hila.hf: AutoModelForCausalLM.from_config(HilaConfig) -> train step -> save_pretrained ->
from_pretrained -> generate; generate (greedy, left-padded batch) equals HilaLM.generate token for
token; sampling, beam search, labels with padding, logits_to_keep, the cache; checkpoints shared
with HilaLM.save_pretrained. Skipped (reason printed) without transformers."""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", reason="transformers is not installed (the optional 'hf' extra: "
                    "pip install 'hila[hf]')")
pytest.importorskip("safetensors", reason="safetensors is not installed (checkpoints are safetensors files)")

import transformers  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

import hila  # noqa: E402
import hila.hf as hh  # noqa: E402
import hila.torch as ht  # noqa: E402

VOCAB = 61
MIXERS = {
    "hla": dict(num_heads=2, head_dim=8, op="hla2"),
    "loglinear_mamba2": dict(state_size=8, head_dim=16),
    "loglinear_gdn": dict(num_heads=2, head_dim=8),
}


def _config(mixer, **kw):
    return hh.HilaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, mixer=mixer,
                         mixer_kwargs=MIXERS[mixer], max_len=64, init_std=0.2, pad_token_id=0,
                         eos_token_id=None, **kw)


def _padded(prompts, side="left"):
    T = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        sl = slice(T - len(p), T) if side == "left" else slice(0, len(p))
        ids[i, sl], mask[i, sl] = p, 1
    return ids, mask


def _prompts(seed, lens=(5, 11, 1)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=g) for n in lens]


@pytest.mark.parametrize("mixer", MIXERS)
def test_from_config_train_save_load_generate(mixer, tmp_path):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(mixer))
    assert isinstance(model, hh.HilaForCausalLM) and model.config.model_type == "hila"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(1, VOCAB, (4, 24), generator=torch.Generator().manual_seed(1))
    model.train()
    before = [p.detach().clone() for p in model.parameters()]
    loss = model(input_ids=ids, labels=ids).loss
    assert torch.isfinite(loss)
    loss.backward()
    opt.step()
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()) if p.grad is not None)
    model.eval()
    model.save_pretrained(tmp_path)
    assert AutoConfig.from_pretrained(tmp_path).model_type == "hila"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(loaded, hh.HilaForCausalLM)
    for (n, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), n
    prompts = _prompts(2)
    ids, mask = _padded(prompts)
    out = loaded.generate(input_ids=ids, attention_mask=mask, max_new_tokens=7, do_sample=False)
    assert out.shape == (3, ids.shape[1] + 7) and torch.equal(out[:, :ids.shape[1]], ids)
    ref = loaded.model.generate(prompts, max_new_tokens=7)                   # HilaLM's greedy decode
    assert torch.equal(out[:, ids.shape[1]:], torch.stack(ref))


@pytest.mark.parametrize("mixer", ["hla", "loglinear_gdn"])
def test_generate_matches_recomputation_and_hila_lm(mixer):
    """float64: the cached generate equals generate without a cache (every step a packed prefill
    of the whole padded batch), greedy and with beam search; right padding in HilaLM.generate's
    input_ids form gives HilaLM the same prompts."""
    torch.manual_seed(0)
    model = hh.HilaForCausalLM(_config(mixer)).double().eval()
    prompts = _prompts(3)
    ids, mask = _padded(prompts)
    greedy = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6)
    nocache = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, use_cache=False)
    assert torch.equal(greedy, nocache)
    beams = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, num_beams=3,
                           do_sample=False)
    beams_nocache = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, num_beams=3,
                                   do_sample=False, use_cache=False)
    assert torch.equal(beams, beams_nocache)
    dense = torch.stack([p[:1].repeat(4) for p in prompts])                     # no padding, no mask
    plain = model.generate(dense, max_new_tokens=4)
    assert torch.equal(plain[:, 4:], torch.stack(model.model.generate(dense, max_new_tokens=4)))
    loss, logits = model(input_ids=dense, labels=dense, return_dict=False)[:2]
    assert torch.equal(logits, model(input_ids=dense).logits)
    rids, rmask = _padded(prompts, side="right")
    lm_out = model.model.generate(input_ids=rids, attention_mask=rmask, max_length=rids.shape[1] + 6)
    assert torch.equal(torch.stack(lm_out), greedy[:, ids.shape[1]:])


def test_sampling_arguments():
    torch.manual_seed(0)
    model = hh.HilaForCausalLM(_config("hla")).eval()
    ids, mask = _padded(_prompts(4))
    greedy = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    nucleus = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=True,
                             top_p=1e-9)                                    # keeps the top token only
    assert torch.equal(greedy, nucleus)
    torch.manual_seed(1)
    out = model.generate(input_ids=ids, attention_mask=mask, max_length=ids.shape[1] + 4,
                         do_sample=True, temperature=0.7, top_k=10, top_p=0.9)
    assert out.shape == (3, ids.shape[1] + 4)
    assert ((out >= 0) & (out < VOCAB)).all()


def test_forward_padding_labels_logits_to_keep_and_cache():
    torch.manual_seed(0)
    model = hh.HilaForCausalLM(_config("loglinear_mamba2")).double().eval()
    prompts = _prompts(5, (9, 4))
    ids, mask = _padded(prompts)
    labels = ids.masked_fill(mask == 0, -100)
    out = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=True)
    logits, cache = out.logits, getattr(out, "cache", None) or out.past_key_values
    assert isinstance(cache, hh.HilaCache) and cache.get_seq_length() == ids.shape[1]
    # each row's logits are those of its prompt alone; 0 at padding
    total, count = 0.0, 0
    for b, p in enumerate(prompts):
        alone = model.model(p.unsqueeze(0)).logits[0]
        got = logits[b, mask[b].bool()]
        assert torch.allclose(got, alone, rtol=0, atol=1e-12)
        assert (logits[b, ~mask[b].bool()] == 0).all()
        total = total + torch.nn.functional.cross_entropy(alone[:-1], p[1:], reduction="sum")
        count += len(p) - 1
    assert torch.allclose(out.loss.double(), total / count, rtol=1e-6, atol=0)  # the loss is fp32
    kept = model(input_ids=ids, attention_mask=mask, logits_to_keep=2).logits
    # the head's product over the kept rows alone may round otherwise than over all rows (BLAS blocking)
    assert torch.allclose(kept, logits[:, -2:], rtol=0, atol=1e-12)
    # the cache: decode one token through it, then beam reordering copies rows
    nxt = torch.tensor([[3], [4]])
    step = model(input_ids=nxt, attention_mask=torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1),
                 cache=cache, use_cache=True)
    for b, p in enumerate(prompts):
        alone = model.model(torch.cat([p, nxt[b]]).unsqueeze(0)).logits[0, -1]
        assert torch.allclose(step.logits[b, -1], alone, rtol=0, atol=1e-12)
    pos = cache.get_layer_state(0).recurrent.pos.clone()
    cache.reorder_cache(torch.tensor([1, 1]))
    assert cache.get_layer_state(0).recurrent.pos.tolist() == [int(pos[1])] * 2
    with pytest.raises(hila.HilaError):
        cache.crop(-1)
    bad = torch.ones(2, ids.shape[1] + 2, dtype=torch.long)
    bad[0, -1] = 0
    with pytest.raises(hila.HilaError) as err:
        model(input_ids=nxt, attention_mask=bad, cache=cache)
    assert err.value.argument == "attention_mask"


def test_checkpoints_shared_with_hila_lm(tmp_path):
    torch.manual_seed(0)
    lm = ht.HilaLM(ht.HilaLMConfig(vocab_size=VOCAB, hidden_size=32, num_layers=2, mixer="loglinear_gdn",
                                   mixer_kwargs=MIXERS["loglinear_gdn"], max_len=64))
    lm.save_pretrained(tmp_path / "lm")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "lm")
    assert isinstance(hf, hh.HilaForCausalLM) and hf.config.to_lm_config() == lm.config
    for (n, a), b in zip(lm.state_dict().items(), hf.model.state_dict().values()):
        assert torch.equal(a, b), n
    hf.save_pretrained(tmp_path / "hf")
    back = ht.HilaLM.from_pretrained(str(tmp_path / "hf"))
    assert back.config == lm.config
    for (n, a), b in zip(lm.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a, b), n
    assert transformers.__version__  # the version the suite ran with is in the pytest header


def test_careless_configs_and_inputs_are_hila_errors():
    with pytest.raises(hila.HilaError) as e:
        hh.HilaConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, mixer_kwargs=[1])
    assert e.value.argument == "mixer_kwargs"
    with pytest.raises(hila.HilaError) as e:
        hh.HilaForCausalLM(hh.HilaConfig(vocab_size=VOCAB, hidden_size=-1, num_hidden_layers=1))
    assert e.value.argument == "hidden_size"
    model = hh.HilaForCausalLM(hh.HilaConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1,
                                             mixer_kwargs={"num_heads": 2, "head_dim": 8}))
    for ids in (torch.tensor([[0, VOCAB]]), torch.tensor([1, 2]), torch.rand(1, 3)):
        with pytest.raises(hila.HilaError) as e:
            model(input_ids=ids)
        assert e.value.argument == "input_ids"
