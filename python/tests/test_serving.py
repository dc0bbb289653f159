# SPDX-License-Identifier: Apache-2.0
"""Serving hooks: a state pool read and written through state_indices (-1: padding rows) by
hila.torch.forward (prefill) and hila.torch.step_ (decode) equals per-sequence calls bit for bit;
get_state_shape / allocate_state_pool / reset_state_rows; cu_seqlens_cpu and max_seqlen; the
fla functions' ssm_state_indices; errors. On CUDA, the pooled decode step inside a CUDA graph."""
import pytest

torch = pytest.importorskip("torch")

import hila  # noqa: E402
import hila.torch as ht  # noqa: E402
from hila.torch import fla  # noqa: E402
from helpers import chunk_for, require_device, torch_gen as _gen  # noqa: E402

F64 = torch.float64
H, DK, DV, L = 2, 8, 4, 8          # L: level weights, enough for positions < 128




def _inputs(op, shape_qk, shape_v, gate_shape, seed, device, dtype=F64):
    t = hila.op_traits(op)
    r = lambda *s, k=0: torch.randn(*s, generator=_gen(seed + k), dtype=F64).to(device=device, dtype=dtype)  # noqa: E731
    kw = dict(q=r(*shape_qk), k=r(*shape_qk, k=1), v=r(*shape_v, k=2),
              g=-torch.rand(*gate_shape, generator=_gen(seed + 3), dtype=F64).to(device=device, dtype=dtype))
    if t["loglinear"]:
        kw["lam"] = torch.rand(*gate_shape, L, generator=_gen(seed + 4), dtype=F64).to(device=device, dtype=dtype)
    if t["delta"]:
        kw["beta"] = torch.rand(*gate_shape, generator=_gen(seed + 5), dtype=F64).to(device=device, dtype=dtype)
        kw["qk_l2norm"] = True
    return kw


def _rows(kw, index):
    return {k: (v[index] if torch.is_tensor(v) else v) for k, v in kw.items()}


def _row_state(pool, r):
    return hila.State(*(None if x is None else x[r:r + 1].clone() for x in pool))


def _assert_rows_equal(pool, r, st):
    for a, b in zip(pool, st):
        if a is not None:
            assert torch.equal(a[r], b[0])


@pytest.mark.parametrize("op", hila.OPS)
def test_pooled_prefill_and_decode_equal_per_sequence_calls(op, device):
    """16 requests in a pool of 24 rows: a packed prefill of 12 of them, then decode steps of
    batches with -1 padding rows (as a CUDA-graph batch size pads them), in changing orders and
    with requests joining: every output and every pool row equals the per-sequence calls exactly;
    rows no request names never change."""
    require_device(device, op)
    chunk = chunk_for(device, 8, op)
    slots, n_req = 24, 16
    pool = ht.allocate_state_pool(op, slots, H, DK, DV, max_len=128, dtype=F64, device=device)
    assert tuple(pool.H.shape[1:]) == ht.get_state_shape(op, H, DK, DV, 128).H
    gen = _gen(0)
    row_of = torch.randperm(slots, generator=gen)[:n_req]                       # request -> pool row
    ref = {}                                                                      # request -> State
    # prefill requests 0..11 (lengths 1..23), packed, one of them of length 0
    lens = [int(n) for n in torch.randint(1, 24, (12,), generator=gen)]
    lens[5] = 0
    cu = torch.tensor([0] + lens).cumsum(0)
    kw = _inputs(op, (1, int(cu[-1]), H, DK), (1, int(cu[-1]), H, DV), (1, int(cu[-1]), H), 1, device)
    rows = row_of[:12].to(device=device, dtype=torch.int32)
    o, out_pool = ht.forward(op, **kw, cu_seqlens=cu.to(device), cu_seqlens_cpu=cu, max_seqlen=max(lens),
                             initial_state=pool, state_indices=rows, chunk=chunk)
    assert out_pool is pool
    for i, n in enumerate(lens):
        s = int(cu[i])
        seq = {k: (v[:, s:s + n] if torch.is_tensor(v) else v) for k, v in kw.items()}
        o_i, fin = ht.forward(op, **seq, output_final_state=True, final_slots=pool.H.shape[2], chunk=chunk)
        assert torch.equal(o[:, s:s + n], o_i)
        _assert_rows_equal(pool, int(row_of[i]), fin)
        ref[i] = fin
    untouched = [r for r in range(slots) if r not in row_of.tolist()]
    before_untouched = [tuple(None if x is None else x[r].clone() for x in pool) for r in untouched]
    # decode: 5 steps, batches of 8 with padding, requests 12..15 join at step 2 (reset rows)
    for step in range(5):
        if step == 2:
            new = row_of[12:].to(device)
            ht.reset_state_rows(pool, new)
            for i in range(12, 16):
                ref[i] = _row_state(pool, int(row_of[i]))
        live = list(range(16 if step >= 2 else 12))
        pick = [live[int(j)] for j in torch.randperm(len(live), generator=gen)[:6]]
        batch = pick[:3] + [-1] + pick[3:] + [-1]                                 # 8 rows, 2 padding
        idx = torch.tensor([int(row_of[i]) if i >= 0 else -1 for i in batch], dtype=torch.int32, device=device)
        tok = _inputs(op, (8, H, DK), (8, H, DV), (8, H), 100 + step, device)
        o = ht.step_(op, **tok, state=pool, state_indices=idx)
        for j, i in enumerate(batch):
            if i < 0:
                assert (o[j] == 0).all()
                continue
            o_i = ht.step_(op, **_rows(tok, slice(j, j + 1)), state=ref[i])
            assert torch.equal(o[j], o_i[0]), (op, step, j)
            _assert_rows_equal(pool, int(row_of[i]), ref[i])
    for r, before in zip(untouched, before_untouched):
        for a, b in zip(pool, before):
            if a is not None:
                assert torch.equal(a[r], b)


def test_all_padding_batch_leaves_the_pool_alone(device):
    require_device(device, "loglinear")
    pool = ht.allocate_state_pool("loglinear", 4, H, DK, DV, max_len=64, dtype=F64, device=device)
    pool.H.normal_(generator=None)
    pool.pos.copy_(torch.tensor([0, 3, 5, 8], device=device))
    for x, p in zip(pool.H, pool.pos.tolist()):  # canonical: only the live slots of each position
        for slot in range(x.shape[1]):
            if slot == 0 or not (p >> (slot - 1)) & 1:
                x[:, slot] = 0
    before = [x.clone() for x in (pool.pos, pool.H)]
    tok = _inputs("loglinear", (3, H, DK), (3, H, DV), (3, H), 7, device)
    o = ht.step_("loglinear", **tok, state=pool, state_indices=torch.full((3,), -1, device=device))
    assert (o == 0).all()
    assert torch.equal(pool.pos, before[0]) and torch.equal(pool.H, before[1])


def test_fla_functions_with_ssm_state_indices(device):
    """vLLM's GDN call: fused_recurrent_gated_delta_rule on packed one-token sequences with the
    pool as initial_state and ssm_state_indices; the pool ([slots, HV, V, K], V-first) is updated
    in place and returned; padding rows untouched."""
    require_device(device, "gdn")
    slots, N = 6, 4
    pool = torch.randn(slots, H, DV, DK, generator=_gen(1), dtype=F64).to(device)
    before = pool.clone()
    idx = torch.tensor([4, -1, 0, 2], dtype=torch.int32, device=device)
    kw = _inputs("gdn", (1, N, H, DK), (1, N, H, DV), (1, N, H), 3, device)
    kw.pop("qk_l2norm")
    cu = torch.arange(N + 1, device=device)
    o, fin = fla.fused_recurrent_gated_delta_rule(**kw, initial_state=pool, output_final_state=True,
                                                  use_qk_l2norm_in_kernel=True, state_v_first=True,
                                                  cu_seqlens=cu, ssm_state_indices=idx)
    assert fin is pool
    for i, r in enumerate(idx.tolist()):
        if r < 0:
            assert (o[0, i] == 0).all()
            continue
        tok = {k: v[:, i:i + 1] for k, v in kw.items()}
        o_i, h_i = fla.fused_recurrent_gated_delta_rule(**tok, initial_state=before[r:r + 1],
                                                        output_final_state=True, state_v_first=True,
                                                        use_qk_l2norm_in_kernel=True)
        assert torch.equal(o[0, i], o_i[0, 0])
        assert torch.equal(pool[r], h_i[0])
    for r in (1, 3, 5):
        assert torch.equal(pool[r], before[r])


@pytest.mark.parametrize("layout", ["dense", "packed"])
def test_fla_one_token_pool_call_runs_the_step_kernel(layout, device):
    """One token per sequence with a pool (q [N, 1, ...], or packed with cu_seqlens_cpu showing
    lengths 1): hila's fused decode step, bit for bit what hila.torch.step_ gives each row."""
    require_device(device, "gdn")
    slots, N = 5, 4
    pool = torch.randn(slots, H, DK, DV, generator=_gen(2), dtype=F64).to(device)
    before = pool.clone()
    idx = torch.tensor([3, 0, -1, 1], device=device)
    kw = _inputs("gdn", (N, 1, H, DK), (N, 1, H, DV), (N, 1, H), 9, device)
    kw.pop("qk_l2norm")
    extra = {}
    if layout == "packed":
        kw = {n: x.transpose(0, 1) for n, x in kw.items()}                      # [1, N, ...]
        cu = torch.arange(N + 1)
        extra = dict(cu_seqlens=cu.to(device), cu_seqlens_cpu=cu)
    o, fin = fla.fused_recurrent_gated_delta_rule(**kw, initial_state=pool, ssm_state_indices=idx,
                                                  use_qk_l2norm_in_kernel=True, **extra)
    assert fin is pool
    for i, r in enumerate(idx.tolist()):
        row = o[i, 0] if layout == "dense" else o[0, i]
        if r < 0:
            assert (row == 0).all() and all(torch.equal(pool[j], before[j]) for j in (2, 4))
            continue
        tok = {n: x[i] if layout == "dense" else x[0, i:i + 1] for n, x in kw.items()}   # [1, ...]
        st = hila.State(torch.zeros(1, dtype=torch.int64, device=device), None, None, before[r:r + 1].clone())
        o_i = ht.step_("gdn", tok["q"], tok["k"], tok["v"], tok["g"], beta=tok["beta"], state=st,
                       qk_l2norm=True)
        assert torch.equal(row, o_i[0]) and torch.equal(pool[r], st.H[0])


def test_host_copies_of_cu_seqlens_give_the_same_call():
    """cu_seqlens_cpu / max_seqlen: the same outputs and state, the final slots from the host
    numbers (no read of cu_seqlens), also for fla's chunk_log_linear_attn."""
    lens = [7, 19, 2]
    cu = torch.tensor([0] + lens).cumsum(0)
    kw = _inputs("loglinear", (1, 28, H, DK), (1, 28, H, DV), (1, 28, H), 5, "cpu")
    o1, f1 = ht.forward("loglinear", **kw, cu_seqlens=cu, output_final_state=True)
    o2, f2 = ht.forward("loglinear", **kw, cu_seqlens=cu, cu_seqlens_cpu=cu.clone(), output_final_state=True)
    o3, f3 = ht.forward("loglinear", **kw, cu_seqlens=cu, max_seqlen=19, output_final_state=True)
    for o, f in ((o2, f2), (o3, f3)):
        assert torch.equal(o, o1) and all(torch.equal(a, b) for a, b in zip(f, f1) if a is not None)
    assert f1.H.shape[2] == hila.state_slots(19)


def test_state_pool_errors():
    pool = ht.allocate_state_pool("gla", 4, H, DK, DV, max_len=1, dtype=F64)
    tok = _inputs("gla", (2, H, DK), (2, H, DV), (2, H), 1, "cpu")
    for idx, why in [(torch.tensor([1, 1]), "distinct"), (torch.tensor([0, 4]), "distinct"),
                     (torch.tensor([-2, 0]), "distinct"), (torch.tensor([0.0, 1.0]), "int32"),
                     (torch.tensor([0, 1, 2]), "one row per sequence")]:
        with pytest.raises(hila.HilaError, match=why) as err:
            ht.step_("gla", **tok, state=pool, state_indices=idx)
        assert err.value.argument == "state_indices"
    with pytest.raises(hila.HilaError) as err:  # the pool must hold the state dtype of the inputs
        ht.step_("gla", **{k: v.float() for k, v in tok.items()}, state=pool,
                 state_indices=torch.tensor([0, 1]))
    assert err.value.argument == "state.H"
    with pytest.raises(hila.HilaError) as err:
        ht.forward("gla", **_inputs("gla", (2, 3, H, DK), (2, 3, H, DV), (2, 3, H), 1, "cpu"),
                   state_indices=torch.tensor([0, 1]))
    assert err.value.argument == "initial_state"
    with pytest.raises(hila.HilaError) as err:
        ht.allocate_state_pool("gla", 4, H, DK, DV, max_len=1, dtype=torch.bfloat16)
    assert err.value.argument == "dtype"
    assert ht.get_state_shape("loglinear_hla3", 3, 4, 5, 1000, normalize=True) == hila.State(
        (), (3, 10), (3, 4, 6), (3, hila.state_slots(1000), 4, 6))


@pytest.mark.parametrize("op", hila.OPS)
def test_pooled_decode_in_a_cuda_graph(op, device):
    """The pooled decode step of 64 requests (8 of them padding rows) captured in a CUDA graph and
    replayed for 3 tokens equals per-sequence decode bit for bit, for every operator: the step
    reads nothing back to the host (check_values=False, and max_position for the log-linear
    ones), which a capture would refuse."""
    if device != "cuda":
        pytest.skip("CUDA graphs need a CUDA device (this test captures a pooled decode step)")
    require_device(device, op)
    N, slots, max_len, steps = 64, 80, 64, 3
    pool = ht.allocate_state_pool(op, slots, H, DK, DV, max_len=max_len, dtype=torch.float32, device=device)
    gen = torch.Generator(device=device).manual_seed(5)
    pool.H.normal_(generator=gen)
    if pool.S is not None:
        pool.S.normal_(generator=gen)
    if pool.P is not None:
        pool.P.normal_(generator=gen)
    # rows at different positions, room for `steps` more tokens (dead Fenwick slots are never read)
    pool.pos.copy_(torch.randint(0, max_len - steps, (slots,), generator=gen, device=device))
    idx = torch.randperm(slots, device=device, generator=gen)[:N].to(torch.int32)
    idx[::9] = -1
    toks = [_inputs(op, (N, H, DK), (N, H, DV), (N, H), 11 + t, device, dtype=torch.float32)
            for t in range(steps)]
    ref = hila.State(*(None if x is None else x.clone() for x in pool))
    static = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in toks[0].items()}
    bound = dict(check_values=False, max_position=max_len - 1)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the graph, on a copy of the pool
        ht.step_(op, **static, state=hila.State(*(None if x is None else x.clone() for x in pool)),
                 state_indices=idx, **bound)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o = ht.step_(op, **static, state=pool, state_indices=idx, **bound)
    outs = []
    for t in range(steps):
        for k, v in toks[t].items():
            if torch.is_tensor(v):
                static[k].copy_(v)
        graph.replay()
        outs.append(o.clone())
    torch.cuda.synchronize()
    for j, r in enumerate(idx.tolist()):
        if r < 0:
            assert all((x[j] == 0).all() for x in outs)
            continue
        st = _row_state(ref, r)
        for t in range(steps):
            o_j = ht.step_(op, **_rows(toks[t], slice(j, j + 1)), state=st, check_values=False)
            assert torch.equal(outs[t][j], o_j[0]), (op, j, t)
        _assert_rows_equal(pool, r, st)
    untouched = sorted(set(range(slots)) - set(idx.tolist()))
    for x, y in zip(pool, ref):
        if x is not None:
            assert torch.equal(x[untouched], y[untouched])
