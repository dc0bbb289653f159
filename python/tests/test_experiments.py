# SPDX-License-Identifier: Apache-2.0
"""hila.experiments: the task generators (positions of keys, values, queries and needles; labels
ignored elsewhere), the first-order mixers against hila's log-linear layers, every mixer's
training step, the CSV bookkeeping, and the smoke preset end to end on the CPU (accuracy well
above chance, CSV rows, report table and PNGs)."""
import csv
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("matplotlib", reason="the report of hila.experiments needs matplotlib")

import hila  # noqa: E402
import hila.torch as ht  # noqa: E402
from hila.experiments import cli, data, mixers, runner, train  # noqa: E402
from hila.experiments.model import RecallLM  # noqa: E402
from hila.experiments.train import RunConfig  # noqa: E402

IGN = data.IGNORE


@pytest.mark.parametrize("random_non_queries", [False, True])
def test_mqar_layout(random_non_queries):
    n, T, K, V = 64, 64, 8, 128
    ids, labels = data.mqar(n, T, K, vocab_size=V, seed=3, random_non_queries=random_non_queries)
    assert ids.shape == labels.shape == (n, T) and ids.dtype == labels.dtype == torch.int64
    assert int(ids.min()) >= 0 and int(ids.max()) < V
    for i in range(n):
        keys, values = ids[i, 0:2 * K:2].tolist(), ids[i, 1:2 * K:2].tolist()
        assert len(set(keys)) == K and all(1 <= k < V // 2 for k in keys)
        assert len(set(values)) == K and all(V // 2 <= v < V for v in values)
        pos = (labels[i] != IGN).nonzero().flatten().tolist()
        assert len(pos) == K and all(p >= 2 * K and (p - 2 * K) % 2 == 0 for p in pos)
        # each key is asked once; its label is its own value
        assert sorted(ids[i, pos].tolist()) == sorted(keys)
        pair = dict(zip(keys, values))
        assert all(labels[i, p].item() == pair[ids[i, p].item()] for p in pos)
        assert (labels[i, :2 * K] == IGN).all()
        rest = [t for t in range(2 * K, T) if t not in pos]
        if not random_non_queries:
            assert (ids[i, rest] == 0).all()
    # Zoology's power law (a = 0.01) puts most queries right after the pairs
    first_gap = (labels[:, 2 * K] != IGN).float().mean().item()
    assert first_gap > 0.5, first_gap
    again, _ = data.mqar(n, T, K, vocab_size=V, seed=3, random_non_queries=random_non_queries)
    other, _ = data.mqar(n, T, K, vocab_size=V, seed=4, random_non_queries=random_non_queries)
    assert torch.equal(ids, again) and not torch.equal(ids, other)


def test_mqar_arguments():
    assert data.pairs_for_length(256) == 16 and data.pairs_for_length(512) == 64
    for kw, arg in [(dict(num_pairs=17), "num_pairs"), (dict(seq_len=63), "seq_len"),
                    (dict(vocab_size=9), "vocab_size"), (dict(power_a=0.0), "power_a")]:
        args = dict(n=2, seq_len=64, num_pairs=4, vocab_size=128)
        args.update(kw)
        with pytest.raises(hila.HilaError) as e:
            data.mqar(**args)
        assert e.value.argument == arg
    with pytest.raises(hila.HilaError) as e:
        data.pairs_for_length(300)
    assert e.value.argument == "seq_len"


@pytest.mark.parametrize("haystack", data.HAYSTACKS)
@pytest.mark.parametrize("needles,depth", [(1, None), (1, 0.0), (1, 1.0), (3, 0.5), (4, None)])
def test_niah_layout(needles, depth, haystack):
    n, T, V = 48, 96, 64
    b = data.niah(n, T, needles, vocab_size=V, seed=5, depth=depth, haystack=haystack)
    H = T - data.QUERY_LEN * needles
    assert b.inputs.shape == b.labels.shape == b.depth.shape == b.needle.shape == (n, T)
    assert int(b.inputs.max()) < V
    # markers only where they belong: NEEDLE in the haystack once per needle, QUERY in the tail
    assert ((b.inputs[:, :H] == data.NEEDLE).sum(1) == needles).all()
    assert not (b.inputs[:, :H] == data.QUERY).any() and not (b.inputs[:, H:] == data.NEEDLE).any()
    qkeys = [H + data.QUERY_LEN * j + 1 for j in range(needles)]
    assert (b.inputs[:, [q - 1 for q in qkeys]] == data.QUERY).all()
    mask = b.labels != IGN
    assert mask[:, qkeys].all() and mask.sum() == n * needles
    assert torch.isnan(b.depth[~mask]).all() and (b.needle[~mask] == -1).all()
    for i in range(n):
        starts = (b.inputs[i, :H] == data.NEEDLE).nonzero().flatten().tolist()
        assert all(s % data.NEEDLE_LEN == 0 for s in starts)
        pair = {b.inputs[i, s + 1].item(): (b.inputs[i, s + 2].item(), s) for s in starts}
        assert len(pair) == needles and all(data.NIAH_FIRST_KEY <= k for k in pair)
        asked = set()
        for q in qkeys:
            value, s = pair[b.inputs[i, q].item()]          # the query's key is a needle's key
            assert b.labels[i, q].item() == value
            assert abs(b.depth[i, q].item() - s / (H - data.NEEDLE_LEN)) < 1e-12
            asked.add(b.needle[i, q].item())
        assert asked == set(range(needles))
        if depth is not None:
            probe = [q for q in qkeys if b.needle[i, q].item() == 0][0]
            slots = H // data.NEEDLE_LEN
            assert abs(b.depth[i, probe].item() - depth) <= 1.0 / (slots - 1) + 1e-12
    pos, target = data.labelled(b.labels)
    assert pos.tolist() == [qkeys] * n and torch.equal(target, b.labels[:, qkeys])
    assert torch.equal(b.pos, pos) and torch.equal(b.target, target)
    # the token ranges: needles' keys and values in theirs, the rest of the haystack in its own
    ranges = data.niah_vocab(V, haystack)
    inside = lambda t, r: (t >= r[0]) & (t < r[1])  # noqa: E731
    starts = b.inputs[:, :H] == data.NEEDLE
    key_at = torch.zeros_like(starts)
    key_at[:, 1:] = starts[:, :-1]
    value_at = torch.zeros_like(starts)
    value_at[:, 2:] = starts[:, :-2]
    assert inside(b.inputs[:, :H][key_at], ranges["keys"]).all()
    assert inside(b.inputs[:, :H][value_at], ranges["values"]).all()
    assert inside(b.inputs[:, qkeys], ranges["keys"]).all() and inside(b.target, ranges["values"]).all()
    rest = b.inputs[:, :H][~(starts | key_at | value_at)]
    assert inside(rest, ranges["haystack"]).all()
    if haystack == "filler":       # a key or a value occurs only in its needle (and the key in its query)
        assert not (inside(rest, ranges["keys"]) | inside(rest, ranges["values"])).any()
    else:                          # keys and values are also the haystack's tokens
        assert inside(rest, ranges["keys"]).any() and inside(rest, ranges["values"]).any()
    again = data.niah(n, T, needles, vocab_size=V, seed=5, depth=depth, haystack=haystack)
    other = data.niah(n, T, needles, vocab_size=V, seed=6, depth=depth, haystack=haystack)
    assert torch.equal(b.inputs, again.inputs) and torch.equal(b.labels, again.labels)
    assert not torch.equal(b.inputs, other.inputs)


def test_niah_vocab_and_arguments():
    """The filler split: keys, values and filler disjoint, in [NIAH_FIRST_KEY, V), a third each;
    "kv": keys and values a half each, the haystack both. Errors name the argument."""
    for V in (64, 65, 66, 8192):
        r = data.niah_vocab(V, "filler")
        assert r["keys"][0] == data.NIAH_FIRST_KEY and r["keys"][1] == r["values"][0]
        assert r["values"][1] == r["haystack"][0] and r["haystack"][1] == V
        t = (V - data.NIAH_FIRST_KEY) // 3
        assert r["keys"][1] - r["keys"][0] == r["values"][1] - r["values"][0] == t
        assert r["haystack"][1] - r["haystack"][0] >= t
        kv = data.niah_vocab(V, "kv")
        assert kv["haystack"] == (kv["keys"][0], kv["values"][1]) and kv["keys"][1] == kv["values"][0]
    assert data.niah_vocab(8192) == data.niah_vocab(8192, "kv")
    assert data.niah_vocab(8192, "filler") == dict(keys=(3, 2732), values=(2732, 5461), haystack=(5461, 8192))
    # "kv" is the default: the same examples with and without the argument
    a, b = data.niah(4, 64, 2, vocab_size=64, seed=1), data.niah(4, 64, 2, vocab_size=64, seed=1, haystack="kv")
    assert all(torch.equal(x.nan_to_num(-1), y.nan_to_num(-1)) for x, y in zip(a, b))
    # 10 needles need 10 keys: 3 + 2 * 10 tokens with "kv", 3 + 3 * 10 with "filler"
    data.niah(2, 64, 10, vocab_size=23)
    data.niah(2, 64, 10, vocab_size=33, haystack="filler")
    for kw, arg in [(dict(haystack="text"), "haystack"), (dict(haystack="filler", vocab_size=32), "vocab_size"),
                    (dict(vocab_size=22), "vocab_size"), (dict(num_needles=0), "num_needles"),
                    (dict(seq_len=49), "seq_len"), (dict(depth=1.5), "depth"), (dict(n=0), "n")]:
        args = dict(n=2, seq_len=64, num_needles=10, vocab_size=64)
        args.update(kw)
        with pytest.raises(hila.HilaError) as e:
            data.niah(**args)
        assert e.value.argument == arg, (kw, e.value.argument)
    with pytest.raises(hila.HilaError) as e:
        data.niah_vocab(64, "Filler")
    assert e.value.argument == "haystack"


def test_labelled_needs_equal_counts():
    labels = torch.full((2, 8), IGN)
    labels[0, 3] = 5
    with pytest.raises(hila.HilaError) as e:
        data.labelled(labels)
    assert e.value.argument == "labels"


def _copy(dst, src, drop=()):
    """Loads src's parameters into dst by name, cut to dst's shapes (rows of in_proj)."""
    own = dst.state_dict()
    for name, p in src.state_dict().items():
        if name in own and not any(name.startswith(d) for d in drop):
            own[name] = p[tuple(slice(0, s) for s in own[name].shape)].clone()
    dst.load_state_dict(own)


def test_mamba2_is_loglinear_mamba2_with_constant_levels():
    """lam = softplus(0) at every level makes loglinear ln(2) x gla, which the output RMSNorm
    (eps 0) and a zero skip D cannot tell apart."""
    torch.manual_seed(0)
    kw = dict(state_size=8, head_dim=16, chunk_size=16, norm_eps=0.0)
    ll = ht.LogLinearMamba2(32, max_len=64, **kw).double()
    plain = mixers.Mamba2(32, **kw).double()
    with torch.no_grad():
        ll.in_proj.weight[sum(plain.splits):] = 0          # dl = 0
        ll.D.zero_()
    _copy(plain, ll)
    x = torch.randn(2, 50, 32, dtype=torch.float64)
    y, ref = plain(x), ll(x)[0]
    err = ((y - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-10, err


def test_gated_deltanet_is_loglinear_gdn_with_constant_levels():
    torch.manual_seed(0)
    kw = dict(num_heads=2, head_dim=8, chunk_size=16, norm_eps=0.0)
    ll = ht.LogLinearGatedDeltaNet(32, max_len=64, **kw).double()
    with torch.no_grad():
        ll.l_proj.weight.zero_()                           # lam = softplus(0) at every level
    plain = mixers.GatedDeltaNet(32, **kw).double()
    _copy(plain, ll)
    x = torch.randn(2, 50, 32, dtype=torch.float64)
    y, ref = plain(x), ll(x)[0]
    err = ((y - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-10, err


@pytest.mark.parametrize("name", list(mixers.MIXERS))
def test_every_mixer_trains(name):
    """One step of every mixer in the model: finite loss and gradients everywhere, parameters move."""
    torch.manual_seed(0)
    shape = mixers.MixerShape(head_dim=8, state_size=8, chunk_size=16)
    model = RecallLM(64, 16, name, max_len=32, shape=shape)
    ids, labels = data.mqar(4, 32, 4, vocab_size=64, seed=1)
    pos, target = data.labelled(labels)
    loss, hits = model.loss(ids, pos, target)
    assert hits.shape == (4, 4) and torch.isfinite(loss)
    loss.backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname
    mixer_grads = [p.grad.abs().sum().item() for n, p in model.named_parameters() if ".mixer." in n]
    assert sum(mixer_grads) > 0


@pytest.mark.parametrize("name", list(mixers.MIXERS))
def test_every_model_is_causal(name):
    """Changing the token at position t changes no hidden state before t and changes the one at t
    (float64): no mixer, convolution included, reads ahead, and every one reads the current token."""
    torch.manual_seed(0)
    shape = mixers.MixerShape(head_dim=8, state_size=8, chunk_size=16)
    model = RecallLM(64, 16, name, max_len=48, shape=shape).double()
    ids = torch.randint(1, 64, (2, 48))
    other = ids.clone()
    other[:, 30] = (other[:, 30] + 5) % 64
    with torch.no_grad():
        diff = (model.hidden(ids) - model.hidden(other)).abs().amax(-1)                   # [2, 48]
    assert diff[:, :30].max().item() == 0.0, diff[:, :30].max().item()
    assert diff[:, 30].min().item() > 1e-6


def test_build_mixer_errors():
    with pytest.raises(hila.HilaError) as e:
        mixers.build_mixer("mamba", 16, 32)
    assert e.value.argument == "mixer"
    assert mixers.MixerShape(head_dim=64).heads(96) == (2, 48)
    with pytest.raises(hila.HilaError) as e:
        mixers.build_mixer("hla2", 130, 32, mixers.MixerShape(head_dim=64))  # 3 heads of 43.3
    assert e.value.argument == "dim"


def test_csv_rows_append_and_grow_columns(tmp_path):
    path = tmp_path / "sub" / "r.csv"
    runner.append_rows(path, [dict(key="a", acc=0.5)])
    runner.append_rows(path, [dict(key="b", acc=0.25)])
    runner.append_rows(path, [dict(key="c", acc=1.0, extra="x")])
    rows = runner.read_rows(path)
    assert [r["key"] for r in rows] == ["a", "b", "c"] and rows[0]["extra"] == "" and rows[2]["extra"] == "x"
    assert runner.done_keys(path) == {"a", "b", "c"}


def test_grid_spec():
    assert runner.parse_grid("mixers=gla,hla2 dims=16;lrs=1e-3,3e-3") == dict(
        mixers=["gla", "hla2"], dims=["16"], lrs=["1e-3", "3e-3"])
    with pytest.raises(hila.HilaError) as e:
        runner.parse_grid("widths=16")
    assert e.value.argument == "grid"
    runs = runner.grid("mqar", ["gla", "sdpa"], [16, 64], [256], [0, 1], [1e-3], vocab=8192)
    assert len(runs) == 8 and len({r.key() for r in runs}) == 8
    assert runs[0].dim == 64 and all(r.pairs == 16 for r in runs)
    niah = runner.grid("niah", ["gla"], [64], [1024, 2048], [0], [1e-3], needles=[1, 4])
    assert [(r.seq_len, r.lengths, r.needles) for r in niah] == [(2048, "1024,2048", 1),
                                                                 (2048, "1024,2048", 4)]
    with pytest.raises(hila.HilaError) as e:
        RunConfig(task="mqar", mixer="gla", dim=16, seq_len=256, lr=0.0)
    assert e.value.argument == "lr"


def test_gpu_presets_cover_the_table():
    """mqar --preset gpu-budget: every default mixer x 4 dims x 2 lengths x 2 seeds x its learning
    rates, tied embeddings; niah --preset gpu-small: every mixer at D = 64, learning rate 1e-2. A
    grid with per-mixer learning rates (FAMILY_LRS: one per family) must name one for every mixer."""
    preset = cli.PRESETS["mqar"]["gpu-budget"]
    runs = cli._runs("mqar", cli._parser().parse_args(["mqar", "--preset", "gpu-budget"]))
    assert len(runs) == 9 * 4 * 2 * 2 * len(preset["lrs"]) and len({r.key() for r in runs}) == len(runs)
    assert {r.mixer for r in runs} == set(mixers.DEFAULT_MIXERS) and all(r.tie_embeddings for r in runs)
    assert {(r.seq_len, r.pairs) for r in runs} == {(256, 16), (512, 64)}
    runs = cli._runs("mqar", cli._parser().parse_args(["mqar", "--preset", "gpu-budget", "--no-tie-embeddings",
                                                       "--lrs", "1e-3"]))
    assert not any(r.tie_embeddings for r in runs) and {r.lr for r in runs} == {1e-3}
    runs = cli._runs("niah", cli._parser().parse_args(["niah", "--preset", "gpu-small"]))
    assert len(runs) == 9 and len({r.key() for r in runs}) == 9
    assert {r.mixer for r in runs} == set(mixers.DEFAULT_MIXERS) and {r.lr for r in runs} == {1e-2}
    assert set(cli.FAMILY_LRS) == set(mixers.MIXERS)
    runs = runner.grid("niah", ["sdpa", "gla"], [64], [1024], [0], cli.FAMILY_LRS)
    assert sorted((r.mixer, r.lr) for r in runs) == [("gla", 3e-3), ("sdpa", 1e-3)]
    with pytest.raises(hila.HilaError) as e:
        runner.grid("mqar", ["gla", "sdpa"], [16], [256], [0], {"gla": [1e-3]})
    assert e.value.argument == "lrs"


def test_rows_written_before_a_setting_existed_keep_their_runs(tmp_path):
    """A CSV written before tie_embeddings existed (blank cells, keys without it) still marks its
    runs done, reads back with the value those runs had (a separate head), and gets the new column
    appended without shifting its rows."""
    cfg = RunConfig(task="mqar", mixer="gla", dim=16, seq_len=32, lr=3e-3, pairs=4, vocab=32,
                    tie_embeddings=False)
    old_key = "|".join(part for part in cfg.key().split("|") if not part.startswith("tie_embeddings="))
    assert cfg.key() == old_key                          # the value of the older rows is implied
    assert "tie_embeddings=True" in RunConfig(task="mqar", mixer="gla", dim=16, seq_len=64, lr=3e-3).key()
    path = tmp_path / "mqar.csv"
    path.write_text(f"key,mixer,acc\n{old_key},gla,0.5\n")
    assert runner.done_keys(path) == {cfg.key()}
    assert runner.read_rows(path)[0]["tie_embeddings"] == "False"
    runner.append_rows(path, [dict(key="b", mixer="sdpa", acc=1.0, tie_embeddings=True)])
    rows = runner.read_rows(path)
    assert [(r["mixer"], r["acc"], r["tie_embeddings"]) for r in rows] == [("gla", "0.5", "False"),
                                                                           ("sdpa", "1.0", "True")]
    # niah's later settings (train_lengths, eval_needles, haystack): the finished runs of the niah
    # grid written before them (every default mixer, N = 1 and 4, 1K-8K tokens, 1000 steps of 16)
    # keep their keys
    small = Path(__file__).resolve().parents[2] / "experiments" / "results" / "gpu-small" / "niah.csv"
    if small.exists():
        runs = runner.grid("niah", list(mixers.DEFAULT_MIXERS), [64], [1024, 2048, 4096, 8192], [0], cli.FAMILY_LRS,
                           needles=[1, 4], vocab=8192, steps=1000, batch=16, eval_examples=32, eval_every=250,
                           depths="0,0.2,0.4,0.6,0.8,1")
        done = runner.done_keys(small)
        assert done and done <= {r.key() for r in runs}
        assert all(r["eval_needles"] == "" and r["haystack"] == "kv" for r in runner.read_rows(small))
    smoke = Path(__file__).resolve().parents[2] / "experiments" / "results" / "cpu-smoke" / "mqar.csv"
    if smoke.exists():  # the repository's smoke results: every run of their command is done
        args = cli._parser().parse_args(["mqar", "--preset", "smoke", "--seeds", "0,1", "--mixers",
                                         ",".join(mixers.MIXERS)])
        assert {r.key() for r in cli._runs("mqar", args)} <= runner.done_keys(smoke)


def test_tied_head_is_the_embedding():
    """tie_embeddings: one matrix for the embedding and the head (the logit of v is h . E[v]),
    counted once; a separate head otherwise."""
    tied = RecallLM(64, 16, "sdpa", 32, tie_embeddings=True)
    free = RecallLM(64, 16, "sdpa", 32, tie_embeddings=False)
    assert tied.head.weight is tied.embed.weight and free.head.weight is not free.embed.weight
    assert free.num_params() - tied.num_params() == 64 * 16
    ids, labels = data.mqar(2, 32, 4, vocab_size=64, seed=0)
    pos, target = data.labelled(labels)
    h = tied.hidden(ids).gather(1, pos.unsqueeze(-1).expand(-1, -1, 16))
    assert torch.allclose(tied.scored(ids, pos), h @ tied.embed.weight.T)


def test_worker_threads():
    """Workers on GPUs run one torch thread each (their host work is one thread launching
    kernels); CPU workers share the cores."""
    import os
    assert runner.worker_threads(["cuda:0", "cuda:1"], 12) == 1
    assert runner.worker_threads(["cpu"], 2) == max(1, (os.cpu_count() or 1) // 2)


def test_training_loop_synchronizes_only_at_log_points(monkeypatch):
    """On CUDA the training loop reads the device (synchronises) at its log points and
    evaluations only: under torch.cuda.set_sync_debug_mode("error") a run whose evaluations and
    log reads are allowed to synchronise completes, and the log reads number steps / log_every."""
    if not torch.cuda.is_available():
        pytest.skip("checks CUDA synchronisations: needs a CUDA device")
    reads = []
    tolist = torch.Tensor.tolist

    def allowed(fn):
        def call(*a, **k):
            prev = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode(0)
            try:
                return fn(*a, **k)
            finally:
                torch.cuda.set_sync_debug_mode(prev)
        return call

    def counted_tolist(self):
        reads.append(1)
        return allowed(tolist)(self)

    optimizer = train._optimizer

    def optimizer_then_check(*args):  # built after the model and the data: the loop starts next
        opt = optimizer(*args)
        torch.cuda.set_sync_debug_mode("error")
        return opt

    monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)
    monkeypatch.setattr(train, "_sync", allowed(train._sync))
    monkeypatch.setattr(train._MQAR, "evaluate", allowed(train._MQAR.evaluate))
    monkeypatch.setattr(train, "_optimizer", optimizer_then_check)
    cfg = RunConfig(task="mqar", mixer="gla", dim=16, seq_len=64, lr=1e-3, pairs=4, vocab=64, steps=60,
                    batch=8, train_examples=64, eval_examples=16, eval_every=30, head_dim=16, state_size=16)
    dev = torch.device("cuda", torch.cuda.current_device())
    prev = torch.cuda.get_sync_debug_mode()
    try:
        rows = train.run(cfg, device=dev, progress=False)
    finally:
        torch.cuda.set_sync_debug_mode(prev)
    assert rows[0]["status"] == "ok"
    assert len(reads) == cfg.steps // max(1, min(100, cfg.steps // 20)), len(reads)


def test_smoke_preset_learns_mqar_and_reports(tmp_path):
    """The smoke preset (a tiny MQAR: vocabulary 32, T = 32, 4 pairs; one hla3 model, about a
    minute on a 2-core CPU): accuracy far above chance, one CSV row per run, a second call skips
    them, and the report writes its table and plot."""
    out = tmp_path / "results"
    args = ["mqar", "--preset", "smoke", "--out", str(out), "--no-progress"]
    assert cli.main(args) == 0
    rows = runner.read_rows(out / "mqar.csv")
    assert [r["mixer"] for r in rows] == cli.PRESETS["mqar"]["smoke"]["mixers"]
    dev = train.resolve_device("auto")  # the device the run chose: CUDA where torch sees a GPU
    for r in rows:
        # chance: 1 / 16 values (1 / 4 for a model that knows only which values are in context)
        assert r["status"] == "ok" and float(r["acc"]) >= 0.8, (r["mixer"], r["acc"], r["curve"])
        assert float(r["wall_s"]) > 0 and r["curve"].count(":") >= 2
        if dev.type == "cpu":
            assert r["device"].startswith("cpu ("), r["device"]
        else:
            assert r["device"] == torch.cuda.get_device_name(dev), r["device"]
    assert cli.main(args) == 0
    assert len(runner.read_rows(out / "mqar.csv")) == len(rows)          # nothing redone
    assert cli.main(["report", "--results", str(out)]) == 0
    table = (out / "mqar.md").read_text()
    for r in rows:
        assert f"| {r['mixer']} | " in table
    assert (out / "mqar.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_niah_smoke_and_heatmap(tmp_path):
    """The needle smoke preset runs, writes one row per (length, depth) cell, and the report draws
    its heatmaps."""
    out = tmp_path / "results"
    assert cli.main(["niah", "--preset", "smoke", "--out", str(out)]) == 0  # with its progress bar
    rows = runner.read_rows(out / "niah.csv")
    preset = cli.PRESETS["niah"]["smoke"]
    lengths, depths = preset["lengths"], preset["depths"].split(",")
    assert sorted((int(r["eval_len"]), float(r["depth"])) for r in rows) == sorted(
        (T, float(d)) for T in lengths for d in depths)
    assert all(0.0 <= float(r["cell_acc"]) <= 1.0 for r in rows)
    assert cli.main(["report", "--results", str(out)]) == 0
    assert "| gla |" in (out / "niah.md").read_text()
    assert (out / "niah_n1.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_without_results_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        cli.main(["report", "--results", str(tmp_path)])


def test_parallel_workers_and_time_limit(tmp_path):
    """Runs in spawned worker processes append their rows in the parent; a spent time limit
    starts nothing."""
    out = tmp_path / "mqar.csv"
    runs = runner.grid("mqar", ["gla", "sdpa"], [16], [16], [0], [1e-3], pairs=2, vocab=16, steps=3, batch=4,
                       train_examples=8, eval_examples=4, eval_every=3)
    assert runner.execute(runs, out, parallel=2, devices=["cpu"], time_limit=0.0, progress=False) == 0
    assert not out.exists()
    assert runner.execute(runs, out, parallel=2, devices=["cpu"], progress=False, threads=1) == 0
    rows = runner.read_rows(out)
    assert sorted(r["mixer"] for r in rows) == ["gla", "sdpa"] and all(r["status"] == "ok" for r in rows)


def test_out_of_memory_errors_are_recognised():
    """The three ways a failed device allocation reaches a worker's traceback text."""
    assert runner.out_of_memory("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 34.00 MiB.")
    assert runner.out_of_memory("torch.AcceleratorError: CUDA error: out of memory")
    assert runner.out_of_memory("hila._errors.HilaError: hila: argument 'memory': could not allocate 16777216 "
                                "bytes (16.0 MiB) of device memory on cuda:0 for a temporary of the call")
    assert not runner.out_of_memory("ValueError: expected a positive dim")
    assert not runner.out_of_memory(None)


def test_after_out_of_memory_allows_one_run_fewer_until_alone():
    assert runner.after_out_of_memory(limit=24, alone=False, retries=0, max_retries=24) == 23
    assert runner.after_out_of_memory(limit=2, alone=False, retries=3, max_retries=24) == 1
    # a run that failed beside others after the limit already came down to 1: retried alone
    assert runner.after_out_of_memory(limit=1, alone=False, retries=0, max_retries=24) == 1
    assert runner.after_out_of_memory(limit=1, alone=True, retries=0, max_retries=24) is None  # failed alone
    assert runner.after_out_of_memory(limit=8, alone=False, retries=24, max_retries=24) is None  # retried enough


def _oom_once_worker(cfg, devices, progress, cuda_graph):
    """A worker whose first attempt at each run fails as a failed device allocation does, and
    whose later attempts train (the runs of test_runs_out_of_memory_are_retried_with_fewer_at_once);
    HILA_TEST_OOM_DIR holds a marker per attempted run, HILA_TEST_OOM_ALWAYS=1 fails every attempt."""
    import os
    marker = Path(os.environ["HILA_TEST_OOM_DIR"]) / cfg.mixer
    if os.environ.get("HILA_TEST_OOM_ALWAYS") == "1" or not marker.exists():
        marker.touch()
        return None, "Traceback (most recent call last):\ntorch.OutOfMemoryError: CUDA out of memory.\n"
    return runner._run_one(cfg, devices, progress, cuda_graph)


@pytest.mark.parametrize("always", [False, True])
def test_runs_out_of_memory_are_retried_with_fewer_at_once(tmp_path, monkeypatch, capsys, always):
    """A run that fails for device memory goes back to the queue and the grid goes on with one run
    fewer at once; a run that still fails alone is a failure, and its rows are not written."""
    monkeypatch.setenv("HILA_TEST_OOM_DIR", str(tmp_path))  # the spawned workers inherit it
    monkeypatch.setenv("HILA_TEST_OOM_ALWAYS", "1" if always else "0")
    out = tmp_path / "mqar.csv"
    runs = runner.grid("mqar", ["gla", "sdpa"], [16], [16], [0], [1e-3], pairs=2, vocab=16, steps=3, batch=4,
                       train_examples=8, eval_examples=4, eval_every=3)
    failures = runner.execute(runs, out, parallel=2, devices=["cpu"], progress=False, threads=1,
                              worker=_oom_once_worker)
    err = capsys.readouterr().err
    assert "ran out of device memory; queued again, at most 1 runs at once" in err
    if always:
        assert failures == 2 and not out.exists()  # both failed alone at last
        assert err.count("failed:") == 2
    else:
        assert failures == 0
        assert sorted(r["mixer"] for r in runner.read_rows(out)) == ["gla", "sdpa"]


def _slow_worker(cfg, devices, progress, cuda_graph):
    """A worker that waits a second before training (test_parallel_runs_report_their_starts_and_a_heartbeat)."""
    import time
    time.sleep(1.0)
    return runner._run_one(cfg, devices, progress, cuda_graph)


def test_parallel_runs_report_their_starts_and_a_heartbeat(tmp_path, capsys):
    """With several processes each start is printed, and the runs still going at every heartbeat
    without a finished run."""
    out = tmp_path / "mqar.csv"
    runs = runner.grid("mqar", ["gla", "sdpa"], [16], [16], [0], [1e-3], pairs=2, vocab=16, steps=3, batch=4,
                       train_examples=8, eval_examples=4, eval_every=3)
    assert runner.execute(runs, out, parallel=2, devices=["cpu"], progress=False, threads=1, worker=_slow_worker,
                          heartbeat=0.2) == 0
    err = capsys.readouterr().err
    assert err.count("hila.experiments: started ") == 2
    assert "2 running after" in err and "0 finished: " in err
    assert len(runner.read_rows(out)) == 2


def test_progress_lines_without_tqdm(capsys):
    from hila.experiments import train
    bar = train._Lines(20, "run", True)
    bar.set_postfix(dict(loss="1.0"))
    for _ in range(20):
        bar.update(1)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 10 and err[-1].startswith("run: 20/20") and "loss=1.0" in err[-1]


def _curve_losses(row):
    return [float(c.split(":")[1]) for c in row["curve"].split()]


@pytest.mark.parametrize("mixer", ["sdpa", "gla", "hla2", "loglinear", "gdn", "loglinear_gdn"])
def test_cuda_graph_steps_train_as_eager_steps(mixer):
    """Training steps replayed from a CUDA graph make the same updates as the eager steps: the
    same loss curve (to float rounding of a different cuBLAS workspace, amplified over 40 Adam
    steps), one graph for the run, and the row says that graphs ran."""
    if not torch.cuda.is_available():
        pytest.skip("captures CUDA graphs: needs a CUDA device")
    cfg = dict(task="mqar", mixer=mixer, dim=32, seq_len=64, lr=3e-3, pairs=8, vocab=128, steps=40,
               batch=16, train_examples=256, eval_examples=64, eval_every=10, head_dim=16, state_size=16)
    eager = train.run(RunConfig(**cfg), device="cuda", progress=False)[0]
    graphed = train.run(RunConfig(**cfg), device="cuda", progress=False, cuda_graph=True)[0]
    assert eager["cuda_graph"] is False and graphed["cuda_graph"] is True
    assert graphed["status"] == "ok", graphed["curve"]
    a, b = _curve_losses(eager), _curve_losses(graphed)
    assert len(a) == len(b) == 4
    for x, y in zip(a, b):
        assert abs(x - y) <= 2e-3 * abs(x), (mixer, a, b)
    print(f"{mixer}: ms/step eager {eager['ms_per_step']} graphed {graphed['ms_per_step']}")


def test_cuda_graph_one_graph_per_training_length():
    """niah trains on several lengths: one graph per length, each replayed with its own inputs; the
    run's evaluation cells are all finite accuracies."""
    if not torch.cuda.is_available():
        pytest.skip("captures CUDA graphs: needs a CUDA device")
    cfg = RunConfig(task="niah", mixer="gla", dim=32, seq_len=64, lengths="32,64", depths="0,1", lr=3e-3,
                    vocab=64, steps=30, batch=8, eval_examples=8, eval_every=30, head_dim=16, state_size=16)
    dev = torch.device("cuda", torch.cuda.current_device())
    seen = []
    init = train._GraphedSteps.__init__

    def spy(self, *a):
        init(self, *a)
        seen.append(self)
    try:
        train._GraphedSteps.__init__ = spy
        rows = train.run(cfg, device=dev, progress=False, cuda_graph=True)
    finally:
        train._GraphedSteps.__init__ = init
    assert len(seen) == 1 and seen[0].graphs == 2, [s.graphs for s in seen]
    assert len(rows) == 4 and all(0.0 <= r["cell_acc"] <= 1.0 for r in rows)


def test_cuda_graph_is_eager_on_the_cpu():
    """``cuda_graph`` changes nothing on the CPU: the same rows as without it, marked as eager."""
    cfg = dict(task="mqar", mixer="gla", dim=16, seq_len=16, lr=3e-3, pairs=2, vocab=16, steps=6,
               batch=4, train_examples=16, eval_examples=4, eval_every=3, head_dim=8, state_size=8)
    a = train.run(RunConfig(**cfg), device="cpu", progress=False)[0]
    b = train.run(RunConfig(**cfg), device="cpu", progress=False, cuda_graph=True)[0]
    assert a["cuda_graph"] is False and b["cuda_graph"] is False
    assert a["curve"] == b["curve"] and a["acc"] == b["acc"]


# ---- niah: training lengths, evaluated needle counts, haystack --------------------------------

_NIAH_NEW = ("train_lengths", "eval_needles", "haystack")


def _niah_cfg(**kw):
    args = dict(task="niah", mixer="gla", dim=16, seq_len=64, lr=3e-3, lengths="64,128", vocab=64)
    args.update(kw)
    return RunConfig(**args)


def test_niah_run_config_fields_and_keys():
    """train_lengths, eval_needles and haystack: at their implied values ("" , "", "kv": today's
    runs) left out of the key, so the keys of the rows written before them are unchanged; set, in
    the key; normalised to one spelling per experiment; seq_len covers every length."""
    assert {k: train.IMPLIED[k] for k in _NIAH_NEW} == dict(train_lengths="", eval_needles="", haystack="kv")
    cfg = _niah_cfg(needles=4)
    assert not any(f"{k}=" in cfg.key() for k in _NIAH_NEW)
    assert cfg.train_length_list() == [64, 128] and cfg.eval_needle_list() == [4] and cfg.seq_len == 128
    # the defaults spelled out are the same experiment
    same = _niah_cfg(needles=4, train_lengths="64,128", eval_needles="4", haystack="kv")
    assert (same.train_lengths, same.eval_needles, same.key()) == ("", "", cfg.key())
    new = _niah_cfg(needles=12, train_lengths=[96], eval_needles=(1, 4), haystack="filler")
    assert (new.train_lengths, new.eval_needles, new.haystack) == ("96", "1,4", "filler")
    assert new.train_length_list() == [96] and new.length_list() == [64, 128] and new.eval_needle_list() == [1, 4]
    parts = new.key().split("|")
    assert parts[-3:] == ["train_lengths=96", "eval_needles=1,4", "haystack=filler"]
    old = "|".join(p for p in parts[:-3])
    assert old == _niah_cfg(needles=12).key()           # the other fields keep their places
    assert _niah_cfg(lengths="64", train_lengths="256").seq_len == 256
    assert _niah_cfg(train_lengths="64, 96").train_lengths == "64,96"
    assert _niah_cfg(lengths="256", eval_needles="1,30").eval_needle_list() == [1, 30]   # 30 keys: fits
    assert _niah_cfg(lengths="256", eval_needles="20", haystack="filler").eval_needle_list() == [20]
    assert "train T96" in new.label() and "filler" in new.label()


@pytest.mark.parametrize("kw,arg", [
    (dict(train_lengths="abc"), "train_lengths"), (dict(train_lengths="64,0"), "train_lengths"),
    (dict(train_lengths="1.5"), "train_lengths"), (dict(eval_needles="x"), "eval_needles"),
    (dict(eval_needles="0"), "eval_needles"),
    (dict(needles=16, train_lengths="64"), "train_lengths"),          # 64 tokens hold 12 needles at most
    (dict(needles=16, lengths="128", train_lengths="128", eval_needles="30"), "eval_needles"),
    (dict(needles=30), "lengths"),
    (dict(needles=0), "needles"),
    (dict(haystack="text"), "haystack"),
    (dict(haystack="filler", lengths="256", eval_needles="1,21"), "vocab"),   # (64 - 3) // 3 = 20 keys
    (dict(lengths="256", eval_needles="1,31"), "vocab"),                      # (64 - 3) // 2 = 30 keys
])
def test_niah_run_config_errors(kw, arg):
    with pytest.raises(hila.HilaError) as e:
        _niah_cfg(**kw)
    assert e.value.argument == arg, (kw, e.value.argument, str(e.value))


def test_niah_settings_are_not_mqar_settings():
    for name, value in dict(train_lengths="64", eval_needles="2", haystack="filler").items():
        with pytest.raises(hila.HilaError) as e:
            RunConfig(task="mqar", mixer="gla", dim=16, seq_len=64, lr=3e-3, **{name: value})
        assert e.value.argument == name


def test_niah_tail_appends_haystack_after_the_queries():
    """tail: the layout of seq_len - tail tokens (same seed: the same tokens, labels and query
    positions), then tail haystack tokens with no label."""
    for haystack in data.HAYSTACKS:
        a = data.niah(8, 64, 4, 64, seed=3, haystack=haystack, tail=10)
        b = data.niah(8, 54, 4, 64, seed=3, haystack=haystack)
        assert a.inputs.shape == (8, 64) and torch.equal(a.inputs[:, :54], b.inputs)
        assert torch.equal(a.labels[:, :54], b.labels) and (a.labels[:, 54:] == data.IGNORE).all()
        assert torch.equal(a.pos, b.pos) and torch.equal(a.target, b.target)
        assert (a.needle[:, 54:] == -1).all() and a.depth[:, 54:].isnan().all()
        lo, hi = data.niah_vocab(64, haystack)["haystack"]
        assert ((a.inputs[:, 54:] >= lo) & (a.inputs[:, 54:] < hi)).all()
    for bad in (-1, 64):
        with pytest.raises(hila.HilaError) as e:
            data.niah(2, 64, 4, 64, tail=bad)
        assert e.value.argument == "tail"


def _query_levels(task, steps):
    """Fenwick levels bitlen(t XOR s) between each query key t and its needle's value s over the
    training batches of ``steps`` steps (filler haystack: a key occurs only in its needle and its
    query)."""
    levels = set()
    for step in range(1, steps + 1):
        ids, pos, _ = task.batch(step)
        for row, qs in zip(ids.tolist(), pos.tolist()):
            for t in qs:
                s = row.index(row[t]) + 1                       # the needle's value
                levels.add((t ^ s).bit_length())
    return levels


def test_niah_train_tail_puts_needles_at_every_level_of_their_queries():
    """With the queries ending every training sequence (256 tokens, 16 needles: the aligned block
    [224, 256)) each needle is at level 6 or above of its query; a random tail of up to 32 tokens
    after the queries moves the block, and the needles take levels 3-5 as well (a value is at
    least 2 tokens before its query's key: level 2 needs the needle right before the first query,
    level 1 never occurs). The tail is in the key, the label and niah only."""
    kw = dict(task="niah", mixer="gla", dim=16, seq_len=256, lr=1e-2, needles=16, haystack="filler",
              vocab=8192, batch=8, depths="0,1")
    plain, tailed = RunConfig(**kw), RunConfig(**kw, train_tail=32)
    assert "train_tail" not in plain.key() and tailed.key().endswith("|train_tail=32")
    assert "tail32" in tailed.label()
    dev = torch.device("cpu")
    assert min(_query_levels(train._NIAH(plain, dev), 20)) >= 6
    assert {3, 4, 5} <= _query_levels(train._NIAH(tailed, dev), 20)
    with pytest.raises(hila.HilaError) as e:
        RunConfig(task="mqar", mixer="gla", dim=16, seq_len=64, lr=3e-3, train_tail=4)
    assert e.value.argument == "train_tail"
    for bad, arg in ((dict(train_tail=-1), "train_tail"), (dict(train_tail=200), "lengths")):
        with pytest.raises(hila.HilaError) as e:
            RunConfig(**kw, **bad)
        assert e.value.argument == arg
    runs = cli._runs("niah", cli._parser().parse_args(["niah", "--preset", "smoke", "--train-tail", "8"]))
    assert {r.train_tail for r in runs} == {8}


def test_niah_trains_at_train_lengths_and_evaluates_every_needle_count(monkeypatch):
    """Training batches at train_lengths with the training needles and haystack; one cell per
    (needle count evaluated, length, depth) with its eval_needles; sequences longer than the
    training length evaluated in proportionally smaller batches."""
    calls, hits = [], []
    niah, score = data.niah, train._hits

    def spy(n, seq_len, num_needles, *a, **k):
        calls.append((seq_len, num_needles, k.get("haystack"), k.get("depth")))
        return niah(n, seq_len, num_needles, *a, **k)

    def spy_hits(model, ids, pos, target, batch):
        hits.append((ids.shape[1], batch))
        return score(model, ids, pos, target, batch)

    monkeypatch.setattr(train.data, "niah", spy)
    monkeypatch.setattr(train, "_hits", spy_hits)
    cfg = RunConfig(task="niah", mixer="gla", dim=16, seq_len=64, lengths="32,64", train_lengths="32",
                    needles=4, eval_needles="1,2", haystack="filler", depths="0,1", lr=3e-3, vocab=64,
                    steps=3, batch=4, eval_examples=4, eval_every=3, head_dim=8, state_size=8)
    rows = train.run(cfg, device="cpu", progress=False)
    assert [c for c in calls if c[3] is None] == [(32, 4, "filler", None)] * 3
    assert [c for c in calls if c[3] is not None] == [(T, N, "filler", d) for N in (1, 2) for T in (32, 64)
                                                      for d in (0.0, 1.0)]
    assert sorted(set(hits)) == [(32, 4), (64, 2)]
    assert [(r["eval_needles"], r["eval_len"], r["depth"]) for r in rows] == [
        (N, T, d) for N in (1, 2) for T in (32, 64) for d in (0.0, 1.0)]
    assert all(r["key"] == cfg.key() and "eval_needles=1,2" in r["key"] for r in rows)
    assert all(r["needles"] == 4 and r["train_lengths"] == "32" and r["haystack"] == "filler" for r in rows)
    # the runs of today's settings: one cell per (length, depth), at the run's needles
    calls.clear()
    rows = train.run(RunConfig(**dict(dataclasses_asdict(cfg), train_lengths="", eval_needles="",
                                      haystack="kv", needles=2)), device="cpu", progress=False)
    assert [(r["eval_needles"], r["eval_len"]) for r in rows] == [(2, 32), (2, 32), (2, 64), (2, 64)]
    assert sorted({c[0] for c in calls if c[3] is None}) <= [32, 64] and {c[2] for c in calls} == {"kv"}


def dataclasses_asdict(cfg):
    import dataclasses
    return dataclasses.asdict(cfg)


def _niah_rows(cfg, accs, outcome=None):
    """Rows of a finished niah run as train.run writes them: accs {(eval_needles, T, depth): acc}."""
    base = dict(dataclasses_asdict(cfg), key=cfg.key(), status="ok", acc=0.5, best_acc=0.5, final_loss=1.0,
                curve="1:1.0:0.5", params=1, ms_per_step=10.0, wall_s=1.0, device="cpu (1 torch thread)",
                cuda_graph=False, matmul="fp32", torch="x", finished="now", **(outcome or {}))
    return [dict(base, eval_needles=N, eval_len=T, depth=d, cell_acc=a, cell_acc_all=a)
            for (N, T, d), a in accs.items()]


def test_niah_report_groups_cells_by_needles_evaluated(tmp_path):
    """One run evaluated at N = 1 and 4 gives a table and a heatmap per N, every mixer in both
    (each at its best learning rate); rows written before eval_needles existed (blank cells)
    count as evaluated at their run's needles, under their own setting."""
    from hila.experiments import report
    path = tmp_path / "niah.csv"
    old = _niah_cfg(needles=1, lengths="64", depths="0,1")
    old_rows = _niah_rows(old, {(1, 64, 0.0): 0.0, (1, 64, 1.0): 0.0})
    for r in old_rows:                                      # as written before the new columns
        for name in _NIAH_NEW:
            del r[name]
    runner.append_rows(path, old_rows)
    new = dict(needles=12, lengths="64,128", train_lengths="64", eval_needles="1,4", haystack="filler",
               depths="0,1", vocab=256)

    def accs(a1, a4):
        return {(N, T, d): (a1 if N == 1 else a4) * (1.0 if T == 64 else 0.5) for N in (1, 4) for T in (64, 128)
                for d in (0.0, 1.0)}
    runner.append_rows(path, _niah_rows(_niah_cfg(mixer="sdpa", lr=1e-3, **new), accs(1.0, 0.8)))
    runner.append_rows(path, _niah_rows(_niah_cfg(mixer="gla", lr=3e-3, **new), accs(0.6, 0.4)))
    runner.append_rows(path, _niah_rows(_niah_cfg(mixer="gla", lr=1e-2, **new), accs(0.9, 0.2)))
    rows = runner.read_rows(path)
    assert [report.eval_needles_of(r) for r in rows[:2]] == [1, 1] and rows[0]["eval_needles"] == ""
    groups, meta = report.niah_cells(rows)
    by_n = sorted((n, sorted(ms)) for (_, n), ms in groups.items())
    assert by_n == [(1, ["gla"]), (1, ["gla", "sdpa"]), (4, ["gla", "sdpa"])]
    (g1,) = [g for g in groups if g[1] == 1 and "sdpa" in groups[g]]
    (g4,) = [g for g in groups if g[1] == 4]
    assert dict(g1[0])["needles"] == "12" and dict(g1[0])["haystack"] == "filler"
    assert groups[g1]["sdpa"][(64, 0.0)] == 100.0 and groups[g1]["sdpa"][(128, 1.0)] == 50.0
    assert groups[g4]["sdpa"][(64, 1.0)] == 80.0
    # gla's best learning rate per needle count: 1e-2 at N = 1 (0.9 > 0.6), 3e-3 at N = 4 (0.4 > 0.2)
    assert meta[g1]["gla"]["lr"] == "0.01" and groups[g1]["gla"][(64, 0.0)] == 90.0
    assert meta[g4]["gla"]["lr"] == "0.003" and groups[g4]["gla"][(64, 0.0)] == 40.0
    assert cli.main(["report", "--results", str(tmp_path)]) == 0
    md = (tmp_path / "niah.md").read_text()
    assert md.count("## N = 1 needle evaluated") == 2 and md.count("## N = 4 needles evaluated") == 1
    assert "| sdpa | 100.0 | 50.0 | 75.0 | 0.001 | 10.0 |" in md
    assert "| gla | 90.0 | 45.0 | 67.5 | 0.01 | 10.0 |" in md and "| gla | 40.0 | 20.0 | 30.0 | 0.003 | 10.0 |" in md
    for name in ("niah_1_n1.png", "niah_2_n1.png", "niah_2_n4.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert f"`{name}`" in md


def test_niah_cli_flags_and_gpu_small_preset():
    """--train-lengths, --eval-needles and --haystack reach the runs; niah --preset gpu-small trains
    every default mixer at 256 tokens with 16 needles in a filler haystack (64K tokens per step,
    learning rate 1e-2) and evaluates it at 256 and 1K-8K tokens with 1 and 4 needles."""
    parse = cli._parser().parse_args
    runs = cli._runs("niah", parse(["niah", "--preset", "smoke", "--train-lengths", "32", "--eval-needles",
                                    "1,2", "--haystack", "filler", "--needles", "4"]))
    assert [(r.train_lengths, r.eval_needles, r.haystack, r.needles) for r in runs] == [("32", "1,2", "filler", 4)]
    runs = cli._runs("niah", parse(["niah", "--preset", "smoke"]))
    assert all((r.train_lengths, r.eval_needles, r.haystack) == ("", "", "kv") for r in runs)
    for bad in (["--haystack", "text"], ["--train-lengths", "a"], ["--eval-needles", "1.5"]):
        with pytest.raises(SystemExit):
            parse(["niah"] + bad)
    with pytest.raises(SystemExit):
        parse(["mqar", "--haystack", "filler"])
    runs = cli._runs("niah", parse(["niah", "--preset", "gpu-small"]))
    assert sorted(r.mixer for r in runs) == sorted(mixers.DEFAULT_MIXERS) and len({r.key() for r in runs}) == 9
    assert {r.lr for r in runs} == {1e-2}
    for r in runs:
        assert (r.dim, r.needles, r.train_lengths, r.eval_needles, r.haystack) == (64, 16, "256", "1,4", "filler")
        assert r.length_list() == [256, 1024, 2048, 4096, 8192] and r.seq_len == 8192
        assert r.depth_list() == [0, 0.2, 0.4, 0.6, 0.8, 1] and r.seed == 0 and r.vocab == 8192
        assert r.batch * max(r.train_length_list()) == 65536 and r.steps == 1500 and r.eval_examples == 32
    # --train-lengths overrides the preset's
    runs = cli._runs("niah", parse(["niah", "--preset", "gpu-small", "--train-lengths", "512,1024"]))
    assert {r.train_lengths for r in runs} == {"512,1024"}


def test_cli_replays_cuda_graphs_by_default(monkeypatch, tmp_path):
    """``--cuda-graph`` is on by default (graphs on CUDA devices; the CPU runs eagerly either way)
    and ``--no-cuda-graph`` turns it off; the flag reaches the runner."""
    from hila.experiments import cli
    seen = []
    monkeypatch.setattr(cli, "execute", lambda runs, out, **kw: seen.append(kw["cuda_graph"]) or 0)
    base = ["mqar", "--preset", "smoke", "--out", str(tmp_path), "--no-progress"]
    assert cli._parser().parse_args(base).cuda_graph is True
    assert cli._parser().parse_args(base + ["--no-cuda-graph"]).cuda_graph is False
    assert cli.main(base) == 0 and cli.main(base + ["--no-cuda-graph"]) == 0
    assert seen == [True, False]


class _Stop(Exception):
    """Stands for a run stopped part-way (a killed worker, a caller's timeout)."""


def _stop_at(monkeypatch, task_cls, at):
    batch = task_cls.batch

    def stopping(self, step):
        if step == at:
            raise _Stop(step)
        return batch(self, step)
    monkeypatch.setattr(task_cls, "batch", stopping)


_SAME = ("acc", "best_acc", "final_loss", "curve", "status")


@pytest.mark.parametrize("task", ["mqar", "niah"])
def test_a_stopped_run_resumes_from_its_checkpoint_to_the_same_rows(tmp_path, monkeypatch, capsys, task):
    """A run stopped between two logging points goes on from its last checkpoint and ends with the
    rows of the run that was never stopped (same data order, optimizer state and loss sums): the
    curve, the final loss and accuracy agree exactly on the CPU."""
    if task == "mqar":
        cfg = RunConfig(task="mqar", mixer="gla", dim=16, seq_len=32, lr=3e-3, pairs=4, vocab=32, steps=60,
                        batch=8, train_examples=64, eval_examples=16, eval_every=20, head_dim=16, state_size=16)
        cls = train._MQAR
    else:
        cfg = _niah_cfg(steps=60, batch=4, eval_examples=4, eval_every=20, depths="0,1", train_lengths="64,128")
        cls = train._NIAH
    whole = train.run(cfg, device="cpu", progress=False)
    ck = tmp_path / "ck.pt"
    with monkeypatch.context() as m:
        _stop_at(m, cls, 44)  # log points every 3 steps: the last save is after step 42
        with pytest.raises(_Stop):
            train.run(cfg, device="cpu", progress=False, checkpoint=ck, checkpoint_seconds=0)
    saved = train.load_checkpoint(ck, cfg.key())
    assert saved["step"] == 42 and saved["curve"] == [c for c in whole[0]["curve"].split() if int(c.split(":")[0]) <= 40]
    capsys.readouterr()
    resumed = train.run(cfg, device="cpu", progress=False, checkpoint=ck, checkpoint_seconds=0)
    assert "resuming after step 42" in capsys.readouterr().err
    assert len(resumed) == len(whole)
    for a, b in zip(resumed, whole):
        assert {k: a[k] for k in _SAME} == {k: b[k] for k in _SAME}
        assert a.get("cell_acc") == b.get("cell_acc")
    assert float(resumed[0]["ms_per_step"]) > 0 and float(resumed[0]["wall_s"]) > 0


def test_checkpoints_of_other_runs_or_unreadable_are_ignored(tmp_path, capsys):
    cfg = RunConfig(task="mqar", mixer="gla", dim=16, seq_len=32, lr=3e-3, pairs=4, vocab=32, steps=6,
                    batch=4, train_examples=16, eval_examples=8, eval_every=3, head_dim=16, state_size=16)
    ck = tmp_path / "ck.pt"
    assert train.load_checkpoint(ck, cfg.key()) is None  # none yet
    torch.save(dict(key="another run", step=3), ck)
    assert train.load_checkpoint(ck, cfg.key()) is None
    assert "another run's" in capsys.readouterr().err
    ck.write_bytes(b"not a checkpoint")
    assert train.load_checkpoint(ck, cfg.key()) is None
    assert "unreadable" in capsys.readouterr().err
    rows = train.run(cfg, device="cpu", progress=False, checkpoint=ck, checkpoint_seconds=0)  # trains from step 1
    assert rows[0]["status"] == "ok" and rows[0]["curve"].split()[0].startswith("3:")
    # this run's key, but a state the model cannot take (written by other code): trains from step 1
    state = train.load_checkpoint(ck, cfg.key())
    state["model"] = {"no such parameter": torch.zeros(1)}
    torch.save(state, ck)
    again = train.run(cfg, device="cpu", progress=False, checkpoint=ck, checkpoint_seconds=0)
    assert "does not fit this run" in capsys.readouterr().err
    assert {k: again[0][k] for k in _SAME} == {k: rows[0][k] for k in _SAME}
    with pytest.raises(hila.HilaError) as e:
        train.run(cfg, device="cpu", progress=False, checkpoint=ck, checkpoint_seconds=-1)
    assert e.value.argument == "checkpoint_seconds"


def test_runner_resumes_a_stopped_run_and_removes_its_checkpoint(tmp_path, monkeypatch, capsys):
    out = tmp_path / "mqar.csv"
    runs = runner.grid("mqar", ["gla"], [16], [32], [0], [3e-3], pairs=4, vocab=32, steps=30, batch=8,
                       train_examples=32, eval_examples=8, eval_every=10, head_dim=16, state_size=16)
    with monkeypatch.context() as m:
        _stop_at(m, train._MQAR, 17)
        assert runner.execute(runs, out, devices=["cpu"], progress=False, checkpoint_seconds=0) == 1  # a failure
    ck = runner.checkpoint_path(tmp_path / "checkpoints", runs[0])
    assert ck.exists() and not out.exists()
    capsys.readouterr()
    assert runner.execute(runs, out, devices=["cpu"], progress=False, checkpoint_seconds=0) == 0
    assert "resuming after step 16" in capsys.readouterr().err  # (30 steps: a log point at every step)
    assert not ck.exists() and [r["status"] for r in runner.read_rows(out)] == ["ok"]
    with pytest.raises(hila.HilaError):
        runner.execute(runs, out, devices=["cpu"], progress=False, checkpoint_seconds=-5)


def test_cli_checkpoint_flags(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(cli, "execute", lambda runs, out, **kw: seen.append(kw["checkpoint_seconds"]) or 0)
    base = ["mqar", "--preset", "smoke", "--out", str(tmp_path), "--no-progress"]
    assert cli.main(base) == 0 and cli.main(base + ["--checkpoint-seconds", "5"]) == 0
    assert cli.main(base + ["--no-checkpoints"]) == 0
    assert seen == [60.0, 5.0, None]
    with pytest.raises(SystemExit):
        cli.main(base + ["--checkpoint-seconds", "-1"])


def test_a_stopped_cuda_graph_run_resumes(tmp_path, monkeypatch):
    """On CUDA, with the steps replayed from graphs (the default): the resumed run loads the
    capturable optimizer's state (its learning rates back on the device), captures its graph again
    and finishes with the full curve (CUDA's embedding backward is not bitwise reproducible, so the
    points after the resume are not compared)."""
    if not torch.cuda.is_available():
        pytest.skip("captures CUDA graphs: needs a CUDA device")
    cfg = RunConfig(task="mqar", mixer="gla", dim=16, seq_len=32, lr=3e-3, pairs=4, vocab=32, steps=60,
                    batch=8, train_examples=64, eval_examples=16, eval_every=20, head_dim=16, state_size=16)
    ck = tmp_path / "ck.pt"
    with monkeypatch.context() as m:
        _stop_at(m, train._MQAR, 44)
        with pytest.raises(_Stop):
            train.run(cfg, device="cuda", progress=False, cuda_graph=True, checkpoint=ck, checkpoint_seconds=0)
    before = train.load_checkpoint(ck, cfg.key())["curve"]
    rows = train.run(cfg, device="cuda", progress=False, cuda_graph=True, checkpoint=ck, checkpoint_seconds=0)
    r = rows[0]
    assert r["status"] == "ok" and r["cuda_graph"] is True and float(r["ms_per_step"]) > 0
    assert [c.split(":")[0] for c in r["curve"].split()] == ["20", "40", "60"]
    assert r["curve"].split()[:2] == before


def test_cli_list_names_the_runs_a_checkpoint_resumes(tmp_path, monkeypatch, capsys):
    base = ["mqar", "--grid", "mixers=gla dims=16 lengths=32 seeds=0 lrs=0.003", "--pairs", "4", "--vocab", "32",
            "--steps", "30", "--batch", "8", "--train-examples", "32", "--eval-examples", "8", "--eval-every", "10",
            "--head-dim", "16", "--state-size", "16", "--out", str(tmp_path), "--no-progress", "--device", "cpu",
            "--checkpoint-seconds", "0"]
    with monkeypatch.context() as m:
        _stop_at(m, train._MQAR, 12)
        assert cli.main(base) == 1
    capsys.readouterr()
    assert cli.main(base + ["--list"]) == 0
    assert capsys.readouterr().out.strip().endswith("(resumes after step 11)")
    assert cli.main(base) == 0
    capsys.readouterr()
    assert cli.main(base + ["--list"]) == 0
    assert capsys.readouterr().out.startswith("done  ")
