# SPDX-License-Identifier: Apache-2.0
"""HilaLM: cached generation equals recomputation, training, and torch.compile(fullgraph=True)."""
import os

import pytest

torch = pytest.importorskip("torch")

import hila  # noqa: E402
import hila.torch as ht  # noqa: E402
from helpers import require_device  # noqa: E402

MIXERS = {
    "hla": dict(num_heads=2, head_dim=8, op="hla3"),
    "loglinear_mamba2": dict(state_size=8, head_dim=16),
    "loglinear_gdn": dict(num_heads=2, head_dim=8),
}
OP = {"hla": "hla3", "loglinear_mamba2": "loglinear", "loglinear_gdn": "loglinear_gdn"}


def _model(mixer, device, dtype=torch.float64, max_len=64):
    require_device(device, OP[mixer])
    torch.manual_seed(0)
    cfg = ht.HilaLMConfig(vocab_size=50, hidden_size=32, num_layers=2, mixer=mixer,
                          mixer_kwargs=MIXERS[mixer], max_len=max_len, init_std=0.2)
    return ht.HilaLM(cfg).to(device=device, dtype=dtype).eval()


@pytest.mark.parametrize("mixer", MIXERS)
def test_generate_with_cache_equals_recomputation(mixer, device):
    """greedy generate() (packed prefill of prompts of different lengths, batched decode with the
    cache) produces the tokens that full recomputation without a cache picks."""
    model = _model(mixer, device)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 50, (n,), generator=gen).to(device) for n in (7, 1, 12)]
    out = model.generate(prompts, max_new_tokens=6)
    for prompt, new in zip(prompts, out):
        seq = prompt
        for tok in new:
            logits = model(seq.unsqueeze(0)).logits[0, -1]
            assert int(logits.argmax()) == int(tok)
            seq = torch.cat([seq, tok.view(1)])
    assert [len(t) for t in out] == [6, 6, 6]


def test_generate_sampling_eos_and_limits():
    model = _model("loglinear_gdn", "cpu", dtype=torch.float32, max_len=32)
    ids = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(0))
    out = model.generate(ids, max_new_tokens=8, temperature=0.8, top_k=5,
                         generator=torch.Generator().manual_seed(1))
    assert len(out) == 2 and all(len(t) == 8 for t in out)
    first = int(model.generate(ids[:1], max_new_tokens=1)[0][0])
    stopped = model.generate(ids[:1], max_new_tokens=8, eos_token_id=first)
    assert stopped[0].tolist() == [first]
    with pytest.raises(hila.HilaError) as e:
        model.generate(ids, max_new_tokens=28)
    assert e.value.argument == "max_new_tokens"
    with pytest.raises(hila.HilaError) as e:
        ht.HilaLM(ht.HilaLMConfig(mixer="attention"))
    assert e.value.argument == "mixer"


def test_packed_training_loss_matches_separate_sequences():
    """with cu_seqlens, the loss never predicts across sequences: it equals the token-weighted
    loss of the sequences run separately."""
    model = _model("hla", "cpu")
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, 50, (n,), generator=gen) for n in (9, 4, 13)]
    cu = torch.tensor([0, 9, 13, 26])
    packed = model(torch.cat(seqs).unsqueeze(0), labels=torch.cat(seqs).unsqueeze(0), cu_seqlens=cu)
    total = sum(model(s.unsqueeze(0), labels=s.unsqueeze(0)).loss * (len(s) - 1) for s in seqs)
    assert torch.allclose(packed.loss, total / sum(len(s) - 1 for s in seqs), rtol=1e-12)


def test_training_reduces_the_loss():
    model = _model("loglinear_mamba2", "cpu", dtype=torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, 50, (4, 24), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(15):
        loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.parametrize("mixer", MIXERS)
def test_compile_fullgraph(mixer, device):
    """torch.compile(fullgraph=True) traces a whole training step (dense and packed) without a
    graph break, and gives the eager loss and gradients. Backend aot_eager (dynamo + AOT autograd
    + fake tensors); HILA_TEST_INDUCTOR=1 also generates and runs inductor code."""
    model = _model(mixer, device, dtype=torch.float32).train()
    ids = torch.randint(0, 50, (2, 20), generator=torch.Generator().manual_seed(0)).to(device)
    cu = torch.tensor([0, 9, 20], device=device)
    backends = ["aot_eager"] + (["inductor"] if os.environ.get("HILA_TEST_INDUCTOR") == "1" else [])
    for backend in backends:
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, backend=backend)
        for kw in (dict(input_ids=ids, labels=ids),
                   dict(input_ids=ids[:1], labels=ids[:1], cu_seqlens=cu, max_seqlen=11)):
            model.zero_grad()
            ref = model(**kw).loss
            ref.backward()
            ref_grads = [p.grad.clone() for p in model.parameters()]
            model.zero_grad()
            got = compiled(**kw).loss
            got.backward()
            assert torch.allclose(got, ref, rtol=1e-5, atol=1e-6), (backend, got.item(), ref.item())
            for p, g in zip(model.parameters(), ref_grads):
                assert torch.allclose(p.grad, g, rtol=1e-3, atol=1e-6), backend


def test_compile_inductor_hla():
    """one model through the default inductor backend (C++ code generation on the CPU)."""
    model = _model("hla", "cpu", dtype=torch.float32).train()
    ids = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    ref = model(ids, labels=ids).loss
    got = compiled(ids, labels=ids).loss
    got.backward()
    assert torch.allclose(got, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kw, arg", [
    (dict(vocab_size=0), "vocab_size"), (dict(hidden_size=-1), "hidden_size"), (dict(num_layers=-1), "num_layers"),
    (dict(mixer="bogus"), "mixer"), (dict(mixer_kwargs=[1]), "mixer_kwargs"),
    (dict(mixer_kwargs={"num_heads": 2, "bogus": 1}), "mixer_kwargs"),
])
def test_model_configuration_errors_name_the_field(kw, arg):
    cfg = ht.HilaLMConfig(**{**dict(vocab_size=32, hidden_size=16, num_layers=1, mixer_kwargs={"num_heads": 2}), **kw})
    with pytest.raises(hila.HilaError) as e:
        ht.HilaLM(cfg)
    assert e.value.argument == arg, str(e.value)


@pytest.mark.parametrize("ids", [
    lambda: torch.tensor([[0, 32]]), lambda: torch.tensor([[-1, 3]]), lambda: torch.rand(1, 5),
    lambda: torch.tensor([1, 2]), lambda: [[1, 2]],
])
def test_token_ids_are_checked(ids):
    """Ids outside the vocabulary, of a float dtype or another rank: HilaError('input_ids'), not
    the embedding's IndexError (on CUDA a device-side assert)."""
    model = ht.HilaLM(ht.HilaLMConfig(vocab_size=32, hidden_size=16, num_layers=1, mixer_kwargs={"num_heads": 2}))
    with pytest.raises(hila.HilaError) as e:
        model(ids())
    assert e.value.argument == "input_ids", str(e.value)
