# SPDX-License-Identifier: Apache-2.0
"""Context parallelism (hila.torch.distributed) on the CPU with gloo: 2, 3 and 4 spawned ranks.

Every operator's sharded forward (outputs, final states) and backward (gradients of q, k, v, g,
lam, beta and the initial state) is compared with the single-process call on the whole sequence,
in float64 (<= 1e-10) and float32 (<= 1e-5), relative to the largest entry of the reference:
unequal shards, a shard of length 1, an empty shard, initial states at different positions,
untied gates, grouped q/k, packed sequences crossing one or several shard boundaries, lying inside
one shard or empty. Plus: calls where only some inputs (or none) need a gradient, the communicated
bytes against the sizes of docs/DISTRIBUTED.md (independent of T, or O(log T) with levels), and
the layers with ``cp_group`` (short-convolution halo, parameter gradients).

One process group per world size runs every case (spawning is the slow part); each rank writes
its errors to a JSON file that the test then checks.

On a machine with 4 GPUs, ``HILA_TEST_CP_DEVICE=cuda`` runs the same cases with NCCL, one GPU per
rank (chunk size 64, which the CUDA backend takes for every operator).
"""
import json
import os
import tempfile
import traceback
import zlib

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("this torch build has no torch.distributed with gloo", allow_module_level=True)

import hila  # noqa: E402
import hila.torch as ht  # noqa: E402
from hila.torch import distributed as hd  # noqa: E402

OPS = hila.OPS
TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2}
CUDA = os.environ.get("HILA_TEST_CP_DEVICE", "cpu") == "cuda"
CHUNK = 64 if CUDA else 4
DEVICE = ["cpu"]  # this rank's device (set by the worker)
H, G, DK, DV = 2, 1, 3, 4

# (shard lengths, global cu_seqlens of the packed configuration) per world size. 2: unequal
# shards, a sequence inside each shard and one crossing; 3: a length-1 shard inside a sequence
# that crosses two boundaries; 4: an empty shard, a sequence crossing three boundaries and ending
# exactly at a shard boundary, a sequence starting exactly at one.
GEOMETRY = {
    2: dict(dense=[[17, 13], [1, 29]], cu=[0, 5, 5, 21, 30], varlen=[17, 13]),
    3: dict(dense=[[9, 1, 20], [0, 16, 14]], cu=[0, 4, 12, 12, 25, 30], varlen=[9, 1, 20]),
    4: dict(dense=[[6, 0, 1, 23], [8, 8, 7, 7]], cu=[0, 2, 7, 7, 30], varlen=[6, 0, 1, 23]),
}


# ----------------------------------------------------------------------------- problems

def _problem(op, *, seed, dtype, T=30, B=2, cu=None, n0=None, untied=False, normalize=False,
             grads=("q", "k", "v", "g", "lam", "beta", "init")):
    """Global inputs (identical on every rank: same seed) and the loss weights."""
    gen = torch.Generator().manual_seed(seed)
    t = hila.op_traits(op)
    r = lambda *s, lo=None, hi=None: (torch.rand(*s, generator=gen, dtype=torch.float64) * (hi - lo) + lo  # noqa: E731
                                      if lo is not None else torch.randn(*s, generator=gen, dtype=torch.float64))
    if cu is not None:
        B = 1
    N = B if cu is None else len(cu) - 1
    x = dict(q=r(B, T, G, DK), k=r(B, T, G, DK) / DK ** 0.5, v=r(B, T, H, DV),
             g=r(*((B, T, H, t["num_primitives"]) if untied else (B, T, H)), lo=-0.4, hi=-0.05))
    if normalize:  # a well-conditioned denominator: nonnegative features
        x["q"], x["k"] = x["q"].abs(), x["k"].abs()
    n0 = n0 or [0] * N
    lens = [T] * N if cu is None else [cu[i + 1] - cu[i] for i in range(N)]
    if t["loglinear"]:
        x["lam"] = r(B, T, H, hila.levels_needed(0, max(a + n for a, n in zip(n0, lens))), lo=-0.5, hi=1.5)
    if t["delta"]:
        x["beta"] = r(B, T, H, lo=0.1, hi=1.0)
    init = None
    if any(n0):
        dvp = DV + 1 if normalize else DV
        shapes = hila.state_part_shapes(op, N, H, DK, DV, normalize=normalize, slots=hila.state_slots(max(n0)))
        parts = [None if s is None else 0.5 * r(*s) for s in shapes[1:]]
        if t["loglinear"]:  # canonical: only the live Fenwick slots of each position
            mask = torch.zeros(shapes.H[:3] + (1, 1), dtype=torch.float64)
            for i, n in enumerate(n0):
                for lvl in range(1, int(n).bit_length() + 1):
                    if (n >> (lvl - 1)) & 1:
                        mask[i, :, lvl] = 1
            parts[2] = parts[2] * mask
        init = [torch.tensor(n0)] + parts
        assert parts[2].shape[-1] == dvp
    x = {k: v.to(dtype) for k, v in x.items()}
    init = None if init is None else [init[0]] + [None if p is None else p.to(
        torch.float64 if dtype == torch.float64 else torch.float32) for p in init[1:]]
    o_w = r(B, T, H, DV).to(dtype).to(DEVICE[0])
    return dict(op=op, x=x, init=init, cu=cu, o_w=o_w, gen=gen, normalize=normalize, grads=grads,
                seq_lens=lens, dtype=dtype)


def _leaves(p, rows=None):
    """Fresh leaf tensors of the problem (rows: this rank's slice of T)."""
    sl = (lambda v: v) if rows is None else (lambda v: v[:, rows[0]:rows[1]])
    dev = DEVICE[0]
    xs = {k: sl(v).to(dev, copy=True).requires_grad_(k in p["grads"]) for k, v in p["x"].items()}
    init = None
    if p["init"] is not None:
        init = hila.State(p["init"][0].to(dev, copy=True),
                          *(None if s is None else s.to(dev, copy=True).requires_grad_("init" in p["grads"])
                            for s in p["init"][1:]))
    return xs, init


def _final_weights(p, fin):
    """Weights of the final-state term of the loss (one tensor per float part, fixed by the seed)."""
    gen = torch.Generator().manual_seed(1234)
    return [None if s is None else torch.randn(s.shape, generator=gen, dtype=torch.float64).to(s.device, s.dtype)
            for s in fin[1:]]


def _pad_slots(h, slots):
    if h.shape[2] >= slots:
        return h
    return torch.cat([h, h.new_zeros(h.shape[:2] + (slots - h.shape[2],) + h.shape[3:])], 2)


def _reference(p, opts):
    xs, init = _leaves(p)
    cu = None if p["cu"] is None else torch.tensor(p["cu"], device=DEVICE[0])
    o, fin = ht.forward(p["op"], xs["q"], xs["k"], xs["v"], xs["g"], lam=xs.get("lam"), beta=xs.get("beta"),
                        cu_seqlens=cu, initial_state=init, output_final_state=True, chunk=CHUNK, **opts)
    loss = (o * p["o_w"]).sum()
    fw = _final_weights(p, fin)
    live = torch.tensor([n > 0 for n in p["seq_lens"]])  # zero-length sequences: final = initial
    for s, w in zip(fin[1:], fw):
        if s is not None:
            loss = loss + (s * w)[live].sum()
    if loss.requires_grad:
        loss.backward()
    return dict(o=o.detach(), fin=fin, fw=fw, grads={k: v.grad for k, v in xs.items()},
                init_grads=None if init is None else [None if s is None else s.grad for s in init[1:]])


def _err(a, b, full=None):
    """max |a - b| relative to the largest entry of the reference (`full`: the whole tensor that
    the shard b was cut from)."""
    if b is not None and b.numel() == 0:
        return 0.0 if a is None or a.numel() == 0 else float("inf")
    if a is None or b is None:  # an absent gradient stands for zeros
        return 0.0 if (a is None) == (b is None) or (b is not None and not b.abs().max() > 0) else float("inf")
    if a.shape != b.shape:
        return float("inf")
    if not torch.isfinite(a).all():
        return float("inf")
    ref = (b if full is None else full).double().abs().max().clamp(min=1e-30)
    return ((a.double() - b.double()).abs().max() / ref).item()


def _sharded_vs_reference(p, lens, opts, group):
    """Runs the sharded call on this rank and returns {quantity: relative error} for the rows and
    gradients this rank holds (initial-state gradients summed over the group)."""
    rank = dist.get_rank(group)
    ref = _reference(p, opts)
    a = sum(lens[:rank])
    xs, init = _leaves(p, (a, a + lens[rank]))
    cu = None if p["cu"] is None else torch.tensor(p["cu"], device=DEVICE[0])
    o, fin = hd.forward(p["op"], xs["q"], xs["k"], xs["v"], xs["g"], lam=xs.get("lam"), beta=xs.get("beta"),
                        cu_seqlens=cu, initial_state=init, output_final_state=True, group=group,
                        shard_lens=lens, chunk=CHUNK, **opts)
    errs = {"o": _err(o.detach(), ref["o"][:, a:a + lens[rank]], ref["o"])}
    loss = (o * p["o_w"][:, a:a + lens[rank]]).sum()
    # final states: the rows whose sequence ends on this rank
    if p["cu"] is None:
        last = max(j for j in range(len(lens)) if lens[j] > 0)
        rows = [(b, b) for b in range(o.shape[0])] if rank == last else []
    else:
        rows = [(i, s) for i, (s, end) in enumerate(hd.local_sequences(cu, lens, rank)) if end]
    for name, s, rs, w in zip(("S", "P", "H"), fin[1:], ref["fin"][1:], ref["fw"]):
        if s is None or not rows:
            continue
        loc = torch.tensor([i for i, _ in rows])
        glob = torch.tensor([j for _, j in rows])
        got, want, ww = s[loc], rs[glob], w[glob]
        if got.dim() == 5:  # Fenwick slots: compare on the larger count (extra slots are zero)
            L = max(got.shape[2], want.shape[2])
            got, want = _pad_slots(got, L), _pad_slots(want, L)
            ww = _pad_slots(ww, L)[:, :, :s.shape[2]]
            loss = loss + (s[loc] * ww).sum()
        else:
            loss = loss + (s[loc] * ww).sum()
        errs[f"final.{name}"] = _err(got.detach(), want.detach(), rs.detach())
        errs["final.pos"] = 0.0 if fin.pos[loc].tolist() == ref["fin"].pos[glob].tolist() else float("inf")
    if o.requires_grad:
        loss.backward()
    for k, v in xs.items():
        want = ref["grads"][k]
        errs[f"d{k}"] = _err(v.grad, None if want is None else want[:, a:a + lens[rank]], want)
    if init is not None:
        for name, s, want in zip(("S", "P", "H"), init[1:], ref["init_grads"]):
            if s is None:
                continue
            got = s.grad if s.grad is not None else torch.zeros_like(s)
            dist.all_reduce(got, group=group)   # a sequence's gradient arrives where it starts
            errs[f"dinit.{name}"] = _err(got, want)
    return errs


# ----------------------------------------------------------------------------- cases

def _operator_cases(world):
    geo = GEOMETRY[world]
    cases = []
    for op in OPS:
        t = hila.op_traits(op)
        n0_dense = [5, 13] if t["loglinear"] else [3, 6]
        for dtype in (torch.float64, torch.float32):
            cases.append((f"{op}-dense-{dtype}", op, dict(dtype=dtype), geo["dense"][0], {}))
            n0 = [0, 9, 2, 17, 1][:len(geo["cu"]) - 1]
            cases.append((f"{op}-varlen-init-{dtype}", op, dict(dtype=dtype, cu=geo["cu"], n0=n0), geo["varlen"], {}))
        cases.append((f"{op}-dense-init-untied", op, dict(dtype=torch.float64, n0=n0_dense,
                                                         untied=t["hla_family"]), geo["dense"][1], {}))
        cases.append((f"{op}-varlen-noinit", op, dict(dtype=torch.float64, cu=geo["cu"]), geo["varlen"], {}))
    return cases


def _option_cases(world):
    geo = GEOMETRY[world]
    f64 = torch.float64
    return [
        ("hla2-normalize", "hla2", dict(dtype=f64, normalize=True), geo["dense"][0], dict(normalize=True)),
        ("hla3-normalize-varlen", "hla3", dict(dtype=f64, normalize=True, cu=geo["cu"]), geo["varlen"],
         dict(normalize=True)),
        ("loglinear_ahla-normalize", "loglinear_ahla", dict(dtype=f64, normalize=True, n0=[3, 12]), geo["dense"][0],
         dict(normalize=True)),
        ("hla2-ridge-scale", "hla2", dict(dtype=f64, n0=[2, 7]), geo["dense"][0], dict(ridge=0.3, scale=0.8)),
        ("loglinear_hla2-ridge-varlen", "loglinear_hla2", dict(dtype=f64, cu=geo["cu"]), geo["varlen"],
         dict(ridge=0.3)),
        ("gdn-l2norm", "gdn", dict(dtype=f64), geo["dense"][1], dict(qk_l2norm=True, scale=0.7)),
        ("loglinear_gdn-l2norm-varlen", "loglinear_gdn",
         dict(dtype=f64, cu=geo["cu"], n0=[4, 0, 6, 11, 3][:len(geo["cu"]) - 1]), geo["varlen"], dict(qk_l2norm=True)),
        ("loglinear-scan-form", "loglinear", dict(dtype=f64, n0=[7, 1]), geo["dense"][0], dict(form="scan")),
        # only some inputs need a gradient (no rank may wait for another in the backward)
        ("hla3-grad-v-only", "hla3", dict(dtype=f64, grads=("v",)), geo["dense"][0], {}),
        ("loglinear_gdn-grad-init-only", "loglinear_gdn", dict(dtype=f64, n0=[5, 9], grads=("init",)),
         geo["dense"][1], {}),
        ("ahla-no-grad", "ahla", dict(dtype=f64, grads=()), geo["dense"][0], {}),
        # bfloat16 inputs (states and sums in float32): the rounding of the outputs only
        ("hla3-bf16-varlen", "hla3", dict(dtype=torch.bfloat16, cu=geo["cu"]), geo["varlen"], {}),
        ("gdn-bf16", "gdn", dict(dtype=torch.bfloat16, n0=[3, 5]), geo["dense"][0], {}),
        ("loglinear_gdn-bf16", "loglinear_gdn", dict(dtype=torch.bfloat16), geo["dense"][0], {}),
        ("loglinear_hla2-bf16", "loglinear_hla2", dict(dtype=torch.bfloat16), geo["dense"][1], {}),
    ]


def _comm_cases(group):
    """Bytes per rank from the implementation's record, for T = 16 ... 1024 on 2 ranks: halves
    (the boundary T/2 is a power of two: one Fenwick level is sent) and a boundary at T/2 - 1
    (all bitlen(T/2 - 1) levels of the boundary are live)."""
    out = {}
    rank = dist.get_rank(group)
    for op in OPS:
        for name, cut in (("halves", lambda T: T // 2), ("odd", lambda T: T // 2 - 1)):
            rows = []
            for T in (16, 64, 256, 1024):
                lens = [cut(T), T - cut(T)]
                p = _problem(op, seed=3, dtype=torch.float32, T=T, B=1)
                xs, _ = _leaves(p, (0, lens[0]) if rank == 0 else (lens[0], T))
                with torch.no_grad():
                    hd.forward(op, xs["q"], xs["k"], xs["v"], xs["g"], lam=xs.get("lam"), beta=xs.get("beta"),
                               group=group, shard_lens=lens, chunk=16)
                c = hd.last_comm
                rows.append(dict(T=T, boundary=lens[0], payload=c.payload_elements, message_bytes=c.message_bytes,
                                 levels=c.levels, formula=H * hd.summary_elements(op, DK, DV, levels=c.levels)))
            out[f"{op}-{name}"] = rows
    return out


def _layer_cases(group, lens, cu):
    """Layers with cp_group: outputs, input gradient and parameter gradients (summed over ranks)."""
    D = 16
    makers = {
        "hla2-conv": lambda: ht.HLAAttention(D, num_heads=2, head_dim=4, op="hla2"),
        "loglinear_hla3-untied": lambda: ht.HLAAttention(D, num_heads=2, head_dim=4, op="loglinear_hla3",
                                                         gates="untied", max_len=64),
        "loglinear_mamba2": lambda: ht.LogLinearMamba2(D, max_len=64, state_size=4, head_dim=8, n_groups=2),
        "loglinear_gdn": lambda: ht.LogLinearGatedDeltaNet(D, max_len=64, num_heads=2, head_dim=4),
    }
    rank = dist.get_rank(group)
    errs = {}
    for name, make in makers.items():
        for packed in (False, True):
            torch.manual_seed(0)
            layer = make().double().to(DEVICE[0])
            T = sum(lens)
            x = torch.randn(1 if packed else 2, T, D, generator=torch.Generator().manual_seed(7),
                            dtype=torch.float64).to(DEVICE[0])
            w = torch.randn(x.shape, generator=torch.Generator().manual_seed(8), dtype=torch.float64).to(DEVICE[0])
            cuq = torch.tensor(cu, device=DEVICE[0]) if packed else None
            xr = x.clone().requires_grad_()
            y, _ = layer(xr, cu_seqlens=cuq)
            (y * w).sum().backward()
            ref_p = {k: p.grad.clone() for k, p in layer.named_parameters()}
            layer.zero_grad()
            a = sum(lens[:rank])
            xl = x[:, a:a + lens[rank]].clone().requires_grad_()
            # hla2-conv gathers the shard lengths itself (cp_shard_lens=None)
            yl, _ = layer(xl, cu_seqlens=cuq, cp_group=group, cp_shard_lens=None if name == "hla2-conv" else lens)
            (yl * w[:, a:a + lens[rank]]).sum().backward()
            key = f"{name}-{'packed' if packed else 'dense'}"
            errs[f"{key}.y"] = _err(yl.detach(), y.detach()[:, a:a + lens[rank]], y.detach())
            errs[f"{key}.dx"] = _err(xl.grad, xr.grad[:, a:a + lens[rank]], xr.grad)
            worst = 0.0
            for k, p in layer.named_parameters():
                gsum = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                dist.all_reduce(gsum, group=group)
                worst = max(worst, _err(gsum, ref_p[k]))
            errs[f"{key}.dparams"] = worst
    return errs


def _error_cases(group, lens):
    """Bad input on one rank, or ranks that disagree on gradients: every rank raises the same
    HilaError after the exchange (none waits forever), and the group still works afterwards."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    a = sum(lens[:rank])
    out = {}

    def call(op, p, **kw):
        xs, _ = _leaves(p, (a, a + lens[rank]))
        xs.update({k: v for k, v in kw.items() if k in xs})
        try:
            o, _ = hd.forward(op, xs["q"], xs["k"], xs["v"], xs["g"], lam=xs.get("lam"), beta=xs.get("beta"),
                              group=group, shard_lens=lens, chunk=CHUNK, check_values=True)  # also on CUDA
            return "ok" if torch.isfinite(o).all() else "non-finite"
        except hila.HilaError as e:
            return f"HilaError({e.argument}): {e}"

    for op in ("hla2", "loglinear_gdn"):
        p = _problem(op, seed=11, dtype=torch.float64, B=1)
        g = p["x"]["g"][:, a:a + lens[rank]].clone()
        if rank == world - 1 and g.numel():
            g[0, -1, 0] = 0.5                       # a positive gate on the last rank only
        out[f"{op}-positive-gate"] = call(op, p, g=g)
        q = p["x"]["q"][:, a:a + lens[rank]].clone().requires_grad_(rank == 0)
        p2 = dict(p, grads=())
        out[f"{op}-grad-disagreement"] = call(op, p2, q=q)
        out[f"{op}-after"] = call(op, p)
    return out


# ----------------------------------------------------------------------------- the spawned ranks

def _worker(rank, world, init_file, out_dir):
    torch.set_num_threads(1)
    if CUDA:
        DEVICE[0] = torch.device("cuda", rank)
        torch.cuda.set_device(DEVICE[0])
    dist.init_process_group("nccl" if CUDA else "gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    group = dist.group.WORLD
    result = {"cases": {}, "errors": []}
    try:
        for name, op, prob, lens, opts in _operator_cases(world) + _option_cases(world):
            seed = zlib.crc32(name.encode()) % 10000
            p = _problem(op, seed=seed, **prob)
            try:
                result["cases"][name] = dict(errs=_sharded_vs_reference(p, lens, opts, group),
                                             tol=TOL[prob["dtype"]])
            except Exception:  # noqa: BLE001 - reported by the test
                result["errors"].append(f"{name}: {traceback.format_exc()}")
                raise
        result["errors_raised"] = _error_cases(group, GEOMETRY[world]["dense"][0])
        if world == 2:
            result["comm"] = _comm_cases(group)
        geo = GEOMETRY[world]
        result["layers"] = _layer_cases(group, geo["varlen"], geo["cu"])
    except Exception:  # noqa: BLE001
        result["errors"].append(traceback.format_exc())
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


_RESULTS = {}


def _run(world):
    if world not in _RESULTS:
        with tempfile.TemporaryDirectory() as d:
            mp.spawn(_worker, args=(world, os.path.join(d, "init"), d), nprocs=world, join=True)
            _RESULTS[world] = [json.load(open(os.path.join(d, f"rank{r}.json"))) for r in range(world)]
    return _RESULTS[world]


def _check(results, key):
    bad = []
    for rank, res in enumerate(results):
        assert not res["errors"], f"rank {rank}:\n" + "\n".join(res["errors"])
        for name, case in res[key].items() if key == "cases" else ():
            for q, e in case["errs"].items():
                if not e <= case["tol"]:
                    bad.append(f"rank {rank} {name} {q}: {e:.2e} > {case['tol']:.0e}")
    return bad


@pytest.mark.parametrize("world", [2, 3, 4])
def test_sharded_equals_single_process(world):
    """Every operator x dtype x geometry, and the option cases, on `world` gloo ranks."""
    results = _run(world)
    bad = _check(results, "cases")
    n = sum(len(c["errs"]) for r in results for c in r["cases"].values())
    worst = max((e, f"{name} {q}") for r in results for name, c in r["cases"].items() for q, e in c["errs"].items()
                if c["tol"] == 1e-10)
    print(f"{world} ranks: {len(results[0]['cases'])} cases, {n} comparisons; "
          f"worst float64 {worst[0]:.1e} ({worst[1]})")
    assert len(results[0]["cases"]) == len(_operator_cases(world)) + len(_option_cases(world))
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_layers_with_cp_group(world):
    """HLAAttention, LogLinearMamba2 and LogLinearGatedDeltaNet with cp_group (halo included):
    outputs, input gradients and the parameter gradients summed over the ranks (float64)."""
    results = _run(world)
    for rank, res in enumerate(results):
        assert not res["errors"], f"rank {rank}:\n" + "\n".join(res["errors"])
        assert len(res["layers"]) == 4 * 2 * 3
        bad = {k: e for k, e in res["layers"].items() if not e <= 1e-10}
        assert not bad, f"rank {rank}: {bad}"


def test_communicated_bytes():
    """One rank's message is the formula of summary_elements times the heads. gla, the HLA family
    and gdn: independent of T. Log-linear operators: one slot per Fenwick level the boundary's
    tokens fall in, at most bitlen(boundary) = O(log T): 1 at T/2 (a power of two), and
    bitlen(T/2 - 1) at T/2 - 1, growing by two slots (of fixed size) each time T grows 4x."""
    comm = _run(2)[0]["comm"]
    assert len(comm) == 2 * len(OPS)
    for key, rows in comm.items():
        op, geometry = key.rsplit("-", 1)
        loglin = hila.op_traits(op)["loglinear"]
        for row in rows:
            assert row["payload"] == row["formula"], (key, row)
            assert row["message_bytes"] == 4 * (row["payload"] + 2), (key, row)
            want = 1 if not loglin or geometry == "halves" else row["boundary"].bit_length()
            assert row["levels"] == want, (key, row)
        payloads = [row["payload"] for row in rows]
        if loglin and geometry == "odd":
            steps = [b - a for a, b in zip(payloads, payloads[1:])]
            assert len(set(steps)) == 1 and steps[0] > 0, (key, payloads)
            assert steps[0] == 2 * (hd.summary_elements(op, DK, DV, levels=2) -
                                    hd.summary_elements(op, DK, DV, levels=1)) * H, (key, payloads)
        else:
            assert len(set(payloads)) == 1, (key, payloads)
    # the closed forms of docs/DISTRIBUTED.md
    dk, dv, L = 64, 64, 12
    tri = dk * (dk + 1) // 2
    assert hd.summary_elements("gla", dk, dv) == 1 + dk * dv
    assert hd.summary_elements("hla2", dk, dv) == 2 + tri + 2 * dk * dv
    assert hd.summary_elements("ahla", dk, dv) == 2 + dk * dk + 2 * dk * dv
    assert hd.summary_elements("hla3", dk, dv) == 3 + 2 * dk * dk + dk + 3 * dk * dv
    assert hd.summary_elements("gdn", dk, dv) == dk * dk + dk * dv
    assert hd.summary_elements("loglinear_gdn", dk, dv, levels=L) == dk * dk + L * dk * dv
    assert hd.summary_elements("loglinear_hla2", dk, dv, levels=L) == 2 + tri + 2 * L * dk * dv
    assert hd.summary_elements("hla2", dk, dv, normalize=True) == 2 + tri + 2 * dk * (dv + 1)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_errors_reach_every_rank(world):
    """A positive gate on the last rank only, or a gradient needed on rank 0 only: every rank
    raises HilaError (none hangs in a collective); the next call works."""
    for rank, res in enumerate(_run(world)):
        assert not res["errors"], f"rank {rank}:\n" + "\n".join(res["errors"])
        e = res["errors_raised"]
        for op in ("hla2", "loglinear_gdn"):
            if rank == world - 1:   # hila's own message about the gate there
                assert e[f"{op}-positive-gate"].startswith("HilaError(g)"), e
            else:
                assert e[f"{op}-positive-gate"].startswith("HilaError(g)"), e
                assert f"rank(s) [{world - 1}] of the group rejected" in e[f"{op}-positive-gate"], e
            assert "need a gradient" in e[f"{op}-grad-disagreement"], e
            assert e[f"{op}-after"] == "ok", e


def test_errors_without_a_group():
    q = torch.zeros(1, 4, 1, 2)
    with pytest.raises(hila.HilaError, match="group"):
        hd.forward("gla", q, q, torch.zeros(1, 4, 1, 2), shard_lens=[4])
