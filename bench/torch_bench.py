#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""hila.torch against the C++ library on the same calls, in one run (the GPU machine):

* ``train``: per operator and shape (bf16, H = 16, d = 128 by default; B x T = 32x1K, 8x4K,
  2x16K, 1x64K), forward and forward + backward through ``hila.torch.forward`` +
  ``torch.autograd.grad``, as a user calls it (default arguments: ``check_values=None``, no value
  scans on CUDA), with ``check_values=False`` and with ``check_values=True`` (the scans forced on,
  as when debugging); the C++ bench's time for the same call (``hila_bench``, run for that
  operator just before); their ratio; and fla's time where fla has the operator
  (``chunk_simple_gla`` for gla / hla2 / ahla / hla3, ``chunk_gated_delta_rule`` for gdn).
  Timed as ``hila_bench`` and ``bench/anchors.py`` time: a 256 MB memset clears the L2 cache
  before each run, CUDA events around the call, runs back to back (host work overlapping the GPU,
  as in a training loop), warm-up first, median of ``--reps``; ``sync_ms`` is the median with a
  synchronisation after every call (one isolated call, host work included). Two input sets are
  used in turn. Inputs as in hila_bench: q, k ~ N(0, 1/d), v, dO ~ N(0, 1), g float32 in
  [log 0.9, 0], lam bf16 in [0.25, 1.5] with the levels T needs, beta bf16 in [0, 1].
* ``decode``: a 24-layer, hidden-2048 ``HilaLM`` (hla2: HLAAttention with 16 heads of 128; and
  loglinear_gdn: LogLinearGatedDeltaNet with 16 heads of 128, expand_v 1), bf16, at batch 1 and
  64 after a 128-token prefill: the decode time per token of ``generate``'s loop (eager, and with
  its CUDA graph), next to the GPU time of the kernels one eager step launches (torch.profiler).
* ``step``: one ``hila.torch.step_`` from Python at N = 1 (fp32 state at position 4096 for the
  log-linear operators, 0 otherwise; event-timed with a synchronisation per step, and its host
  time; default arguments and ``check_values=True``) against ``hila_bench --decode --batches 1``
  (a C++ ``DecodeState`` step), and the Python part of the host time alone (the same call with
  the extension's ``step_inplace`` replaced by a no-op).

* ``kernels`` (not in the default ``--sections``): per operator and shape, the GPU time of each
  kernel that one forward + backward launches (torch.profiler, averaged over ``--reps`` calls after
  warm-up; short kernel names), for hila.torch with default arguments and for fla where it has the
  operator; rows with ``kernel`` and ``launches`` (per call), and a table per run sorted by time.

Writes ``torch_bench.csv`` and ``torch_bench.png`` (matplotlib) under ``--out`` and prints short
tables last; where the train rows allow, also the kernel targets (``TARGETS``: forward + backward
ratios against fla or hila's gla from the same run) as ``targets.md`` and ``targets.png``.
``--targets LABEL=CSV ...`` makes the same table and plot from earlier runs' CSVs without running
anything (a ratio is only formed within one run). Each section, and each operator in it, runs
under its own try/except: a failure is
reported on stderr and the rest still runs. ``--quick``: one shape, fewer repetitions, a 4-layer
model. ``--device cpu --quick``: a smoke run of the same code on the CPU (tiny shapes, wall-clock
timing, no C++ bench, no fla, no graphs).

    python bench/torch_bench.py --hila-bench .dev/bin/hila_bench --out torch-bench
    python bench/torch_bench.py --device cpu --quick --out /tmp/tb
    python bench/torch_bench.py --sections kernels --ops gdn --l2norm --shapes 8:4096 --out kernels
    python bench/torch_bench.py --targets "H200 run 1=gdn.csv" "H200 run 2=gla.csv" --out targets
"""
import argparse
import contextlib
import csv
import os
import signal
import statistics
import subprocess
import sys
import time
import traceback

import torch

FIELDS = ["section", "op", "B", "T", "H", "d", "direction", "impl", "ms", "sync_ms", "host_us", "note", "kernel",
          "launches"]
TRAIN_OPS = "gla,hla2,ahla,hla3,loglinear,gdn,loglinear_gdn"
SHAPES = "32:1024,8:4096,2:16384,1:65536"


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def failed(what):
    log(f"# {what} failed:\n{traceback.format_exc()}")


class Timer:
    """CUDA: events, L2 flush before each run, back-to-back runs (ms) and runs with a
    synchronisation each (sync_ms). CPU: wall clock around each run (both the same)."""

    def __init__(self, device, warmup, reps):
        self.cuda = device.type == "cuda"
        self.warmup, self.reps = warmup, reps
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device=device) if self.cuda else None

    def __call__(self, fn):
        for _ in range(self.warmup):
            fn()
        if not self.cuda:
            ts = []
            for _ in range(self.reps):
                t0 = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(ts), statistics.median(ts)
        torch.cuda.synchronize()
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(self.reps)]
        for a, b in ev:
            self.flush.zero_()
            a.record()
            fn()
            b.record()
        torch.cuda.synchronize()
        ms = statistics.median(a.elapsed_time(b) for a, b in ev)
        sync = []
        for a, b in ev:
            a.record()
            fn()
            b.record()
            b.synchronize()
            sync.append(a.elapsed_time(b))
        return ms, statistics.median(sync)


# ----------------------------------------------------------------------------- C++ bench

def hila_bench_rows(path, args):
    """Rows of `hila_bench args...` (CSV after its header), as dicts; [] when it is absent."""
    if not path:
        return []
    res = subprocess.run([path] + [str(a) for a in args], capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        log(f"# hila_bench {' '.join(map(str, args))}: rc {res.returncode}\n{res.stderr[-2000:]}")
    lines = [ln for ln in res.stdout.splitlines() if ln and not ln.startswith("#")]
    start = next((i for i, ln in enumerate(lines) if ln.startswith(("impl,", "op,"))), None)
    return [] if start is None else list(csv.DictReader(lines[start:]))


def find_hila_bench(given):
    for p in ([given] if given else []) + [os.environ.get("HILA_BENCH", ""), ".dev/bin/hila_bench",
                                           "build-cuda/hila_bench", "build/hila_bench"]:
        if p and os.path.isfile(p) and os.access(p, os.X_OK):
            return p
    return None


# ----------------------------------------------------------------------------- train

# hila.torch as a user calls it (default arguments: check_values=None, which checks CPU tensors
# and not CUDA ones), with the checks off, and with them forced on (debugging)
IMPLS = (("hila_torch", None), ("hila_torch_nocheck", False), ("hila_torch_checked", True))
NOTE = {None: "default arguments (check_values=None)", False: "check_values=False",
        True: "check_values=True"}


def train_inputs(op, B, T, H, d, device, sets=2):
    import hila
    t = hila.op_traits(op)
    L = hila.levels_needed(0, T)
    out = []
    for _ in range(sets):
        bf = dict(device=device, dtype=torch.bfloat16)
        x = dict(q=torch.randn(B, T, H, d, **bf) * d ** -0.5, k=torch.randn(B, T, H, d, **bf) * d ** -0.5,
                 v=torch.randn(B, T, H, d, **bf),
                 g=torch.empty(B, T, H, device=device).uniform_(float(torch.log(torch.tensor(0.9))), 0.0))
        if t["loglinear"]:
            x["lam"] = torch.empty(B, T, H, L, **bf).uniform_(0.25, 1.5)
        if t["delta"]:
            x["beta"] = torch.rand(B, T, H, **bf)
        for v in x.values():
            v.requires_grad_()
        out.append((x, torch.randn(B, T, H, d, **bf)))
    return out


def rotate(items):
    state = [0]

    def nxt():
        state[0] += 1
        return items[state[0] % len(items)]
    return nxt


def torch_calls(op, sets, check_values, l2norm):
    """The forward (no grad) and forward + backward closures of hila.torch on the input sets in turn.
    check_values None: the call with its default arguments (no check_values passed)."""
    import hila.torch as ht
    kw = dict(qk_l2norm=l2norm) if check_values is None else dict(check_values=check_values, qk_l2norm=l2norm)
    nxt = rotate(sets)

    def fwd():
        x, _ = nxt()
        with torch.no_grad():
            ht.forward(op, **x, **kw)

    def fwdbwd():
        x, do = nxt()
        o, _ = ht.forward(op, **x, **kw)
        torch.autograd.grad(o, list(x.values()), do)
    return {"fwd": fwd, "fwdbwd": fwdbwd}


def time_torch(timer, op, sets, check_values, l2norm):
    return {k: timer(fn) for k, fn in torch_calls(op, sets, check_values, l2norm).items()}


def fla_calls(op, sets, d):
    """fla's closures for the operator fla has (gla for the GLA family, gdn), as bench/anchors.py
    calls it (its fla_impl() lifts fla's Hopper backward guard for timing when needed):
    (impl, fla function, {"fwd": ..., "fwdbwd": ...}), or None."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import anchors
    if op in ("gla", "hla2", "ahla", "hla3"):
        from fla.ops.simple_gla import chunk_simple_gla
        call = lambda x: chunk_simple_gla(x["q"], x["k"], x["v"], x["g"], scale=d ** -0.5)[0]  # noqa: E731
        leaves = ("q", "k", "v", "g")
        name = "chunk_simple_gla"
    elif op == "gdn":
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        call = lambda x: chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=d ** -0.5,  # noqa: E731
                                                use_qk_l2norm_in_kernel=True)[0]
        leaves = ("q", "k", "v", "g", "beta")
        name = "chunk_gated_delta_rule(l2norm)"
    else:
        return None
    impl = anchors.fla_impl()
    nxt = rotate(sets)

    def fwd():
        x, _ = nxt()
        with torch.no_grad():
            call(x)

    def fwdbwd():
        x, do = nxt()
        torch.autograd.grad(call(x), [x[k] for k in leaves], do)
    return impl, name, {"fwd": fwd, "fwdbwd": fwdbwd}


def time_fla(timer, op, sets, d):
    got = fla_calls(op, sets, d)
    if got is None:
        return None
    impl, name, calls = got
    return impl, name, {k: timer(fn) for k, fn in calls.items()}


def op_l2norm(a, op):
    """--l2norm applies to the gdn operators only (qk_l2norm, as fla's gdn anchor)."""
    return a.l2norm and op in ("gdn", "loglinear_gdn")


def section_train(a, device, out, cpp):
    timer = Timer(device, a.warmup, a.reps)
    shapes = [tuple(int(v) for v in s.split(":")) for s in a.shapes.split(",")]
    for op in a.ops.split(","):
        l2norm = op_l2norm(a, op)
        try:
            ref = {}
            if cpp:
                for r in hila_bench_rows(cpp, ["--reps", a.reps, "--warmup", a.warmup, "--ops", op, "--H", a.H,
                                               "--d", a.d, "--shapes", a.shapes] + (["--l2norm"] if l2norm else [])):
                    if r.get("direction") in ("fwd", "fwdbwd"):
                        ref[(int(r["B"]), int(r["T"]), r["direction"])] = (float(r["ms"]), float(r["sync_ms"]))
            for B, T in shapes:
                try:
                    sets = train_inputs(op, B, T, a.H, a.d, device)
                    base = dict(section="train", op=op, B=B, T=T, H=a.H, d=a.d)
                    for impl, cv in IMPLS:
                        if impl not in a.train_impls:
                            continue
                        for dirn, (ms, sync) in time_torch(timer, op, sets, cv, l2norm).items():
                            out.append(dict(base, direction=dirn, impl=impl, ms=ms, sync_ms=sync, note=NOTE[cv]))
                    for dirn in ("fwd", "fwdbwd"):
                        if (B, T, dirn) in ref:
                            ms, sync = ref[(B, T, dirn)]
                            out.append(dict(base, direction=dirn, impl="hila_cpp", ms=ms, sync_ms=sync, note="hila_bench"))
                    if a.fla and device.type == "cuda":
                        try:
                            got = time_fla(timer, op, sets, a.d)
                            if got:
                                impl, name, res = got
                                for dirn, (ms, sync) in res.items():
                                    out.append(dict(base, direction=dirn, impl=impl, ms=ms, sync_ms=sync, note=name))
                        except Exception:
                            failed(f"fla {op} {B}x{T}")
                    del sets
                except Exception:
                    failed(f"train {op} {B}x{T}")
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                flush_csv(a, out)
        except Exception:
            failed(f"train {op}")


# ----------------------------------------------------------------------------- decode

def decode_model(kind, layers, hidden, vocab, max_len, device, dtype):
    import hila.torch as ht
    heads = max(1, hidden // 128)
    head_dim = hidden // heads
    if kind == "hla2":
        mixer, kw = "hla", dict(num_heads=heads, head_dim=head_dim, op="hla2")
    else:
        mixer, kw = "loglinear_gdn", dict(num_heads=heads, head_dim=head_dim, expand_v=1.0)
    cfg = ht.HilaLMConfig(vocab_size=vocab, hidden_size=hidden, num_layers=layers, mixer=mixer,
                          mixer_kwargs=kw, max_len=max_len)
    with torch.device(device):  # parameters initialised where they live
        model = ht.HilaLM(cfg)
    desc = f"{kind}: {layers} layers, hidden {hidden}, {heads} heads of {head_dim}, vocab {vocab}"
    return model.to(dtype).eval(), desc, heads, head_dim


def kernel_name(name):
    """A kernel's short name: no return type, namespaces, template arguments or parameters."""
    name = name.removeprefix("void ").replace("(anonymous namespace)", "anon")
    depth, head = 0, []
    for ch in name:  # drop <...> (nested) and everything from the parameter list on
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0:
            break
        elif depth == 0:
            head.append(ch)
    return "".join(head).split("::")[-1].strip() or name


def kernel_profile(step, steps):
    """GPU time per call of the kernels (and device copies) that `steps` calls of step() launch, by
    short kernel name: {name: (launches per call, ms per call)} (torch.profiler)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    agg = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            n, us = agg.get(kernel_name(e.name), (0, 0.0))
            agg[kernel_name(e.name)] = (n + 1, us + e.time_range.elapsed_us())
    return {k: (n / steps, us / 1e3 / steps) for k, (n, us) in agg.items()}


def kernel_ms_per_step(step, steps):
    """GPU time of the kernels (and device copies) that `steps` calls of step() launch, per call."""
    prof = kernel_profile(step, steps)
    return sum(ms for _, ms in prof.values()), sum(n for n, _ in prof.values())


# ----------------------------------------------------------------------------- kernels

def section_kernels(a, device, out):
    """Per-kernel GPU time of one forward + backward: hila.torch (default arguments) and fla."""
    if device.type != "cuda":
        log("# kernels: needs a CUDA device (torch.profiler's kernel times); skipped")
        return
    shapes = [tuple(int(v) for v in s.split(":")) for s in a.shapes.split(",")]
    for op in a.ops.split(","):
        l2norm = op_l2norm(a, op)
        for B, T in shapes:
            try:
                sets = train_inputs(op, B, T, a.H, a.d, device)
                runs = [("hila_torch", NOTE[None], torch_calls(op, sets, None, l2norm)["fwdbwd"])]
                if a.fla:
                    try:
                        got = fla_calls(op, sets, a.d)
                        if got:
                            runs.append((got[0], got[1], got[2]["fwdbwd"]))
                    except Exception:
                        failed(f"fla {op} {B}x{T}")
                base = dict(section="kernels", op=op, B=B, T=T, H=a.H, d=a.d, direction="fwdbwd")
                for impl, note, fn in runs:
                    for _ in range(max(1, a.warmup)):
                        fn()
                    torch.cuda.synchronize()
                    for name, (n, ms) in kernel_profile(fn, a.reps).items():
                        out.append(dict(base, impl=impl, ms=ms, kernel=name, launches=n, note=note))
                del sets, runs
            except Exception:
                failed(f"kernels {op} {B}x{T}")
            torch.cuda.empty_cache()
            flush_csv(a, out)


def section_decode(a, device, out):
    from hila.torch.models import _Decoder
    q = a.quick
    layers, hidden, vocab = (a.decode_layers or (4 if q else 24)), a.decode_hidden, 32000
    if device.type != "cuda":
        layers, hidden, vocab = 2, 64, 256
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    prompt, tokens = (128, 16 if q else 64) if device.type == "cuda" else (16, 8)
    for kind in ("hla2", "loglinear_gdn"):
        try:
            model, desc, heads, head_dim = decode_model(kind, layers, hidden, vocab, prompt + tokens + 64, device, dtype)
        except Exception:
            failed(f"decode model {kind}")
            continue
        for batch in a.decode_batches:
            try:
                ids = torch.randint(0, vocab, (batch, prompt), device=device)
                base = dict(section="decode", op=kind, B=batch, T=prompt, H=heads, d=head_dim)
                graphs = [False] + ([True] if device.type == "cuda" else [])
                for graph in graphs:
                    with torch.no_grad():
                        res = model(ids, use_cache=True)
                        cache = res.cache
                        cache.in_place = True
                        dec = _Decoder(model, cache, graph=graph and model.decode_graph_capturable)
                        nxt = res.logits[:, -1].argmax(-1)
                        for _ in range(3):  # eager warm-up; with a graph: warm-up, capture, first replay
                            nxt = dec(nxt).argmax(-1)
                        if device.type == "cuda":
                            torch.cuda.synchronize()
                        rounds = []
                        for _ in range(3):
                            t0 = time.perf_counter()
                            for _ in range(tokens // 3):
                                nxt = dec(nxt).argmax(-1)
                            if device.type == "cuda":
                                torch.cuda.synchronize()
                            rounds.append((time.perf_counter() - t0) * 1e3 / (tokens // 3))
                        used = dec.graph is not None
                        note = desc + ("; CUDA graph replay" if used else "; eager" +
                                       ("" if not graph else " (not capturable: log-linear step reads positions on the host)"))
                        out.append(dict(base, direction="decode_per_token", impl="graph" if graph else "eager",
                                        ms=statistics.median(rounds), note=note))
                        if not graph and device.type == "cuda":
                            kms, launches = kernel_ms_per_step(lambda: dec(nxt), 4)
                            out.append(dict(base, direction="decode_per_token", impl="kernels", ms=kms,
                                            note=f"GPU time of the kernels of one eager step ({launches:.0f} launches)"))
                    del cache, dec, res
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
            except Exception:
                failed(f"decode {kind} batch {batch}")
            flush_csv(a, out)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- step

def step_inputs(op, H, d, dtype, device, reps):
    """A State from zero_state at position 4096 (log-linear operators; 0 for the others) with the
    slots of 8 * reps + 64 more steps, and one token of N = 1 sequence."""
    import hila
    import hila.torch as ht
    t = hila.op_traits(op)
    pos = 4096 if t["loglinear"] else 0
    st = ht.zero_state(op, 1, H, d, d, max_len=pos + 8 * reps + 64, device=device)
    st.pos.fill_(pos)
    tok = dict(q=torch.randn(1, H, d, device=device, dtype=dtype) * d ** -0.5,
               k=torch.randn(1, H, d, device=device, dtype=dtype) * d ** -0.5,
               v=torch.randn(1, H, d, device=device, dtype=dtype),
               g=torch.empty(1, H, device=device).uniform_(-0.1, 0.0))
    if t["loglinear"]:
        tok["lam"] = torch.rand(1, H, hila.levels_needed(0, pos + 8 * reps + 64), device=device, dtype=dtype)
    if t["delta"]:
        tok["beta"] = torch.rand(1, H, device=device, dtype=dtype)
    return st, tok


def section_step(a, device, out, cpp):
    import hila
    import hila.torch as ht
    H, d = (a.H, a.d) if device.type == "cuda" else (2, 16)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    reps = 200 if device.type == "cuda" else 50
    import hila.torch.ops as hops
    road = ("C++ road (hila._torch_ops.step_)" if hops._CPP[0] is not None and hops._CPP_STEP is not None
            else "DLPack road (hila._C)")
    # one untimed pass over every operator first: the first steps of a process pay one-time costs
    # (allocator pools, caches) that would otherwise fall on the first operator timed
    for op in a.step_ops.split(","):
        try:
            st, tok = step_inputs(op, H, d, dtype, device, reps)
            with torch.no_grad():
                for _ in range(50):
                    ht.step_(op, **tok, state=st)
            if device.type == "cuda":
                torch.cuda.synchronize()
        except Exception:
            failed(f"step warm-up {op}")
    for op in a.step_ops.split(","):
        try:
            t = hila.op_traits(op)
            pos = 4096 if t["loglinear"] else 0
            st, tok = step_inputs(op, H, d, dtype, device, reps)
            base = dict(section="step", op=op, B=1, T=pos, H=H, d=d, direction="step")
            # the layers' decode call: check_values=False and the bound of the state's capacity
            # (a log-linear step then reads no positions back to the host)
            bounded = ("hila_torch_max_position", False, dict(max_position=pos + 8 * reps + 63))
            # and a decode loop that keeps its output buffer: out= (no allocation per step)
            kept = ("hila_torch_out", False, dict(max_position=pos + 8 * reps + 63, out=torch.empty_like(tok["v"])))
            for impl, cv, *more in IMPLS + (bounded, kept):
                kw = {} if cv is None else dict(check_values=cv, **(more[0] if more else {}))
                with torch.no_grad():
                    for _ in range(10):
                        ht.step_(op, **tok, state=st, **kw)
                    host, dev_ms = [], []
                    # the events are recorded on the stream object fetched once, by the C
                    # method itself (Event.record() makes a Python Stream object per call without
                    # one, and its Python frame is host time inside the timed span that
                    # hila_bench's cudaEventRecord does not have)
                    stream = torch.cuda.current_stream() if device.type == "cuda" else None
                    record = torch._C._CudaEventBase.record if stream is not None else None
                    for _ in range(reps):
                        if stream is not None:
                            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                            record(e0, stream)
                        h0 = time.perf_counter()
                        ht.step_(op, **tok, state=st, **kw)
                        h1 = time.perf_counter()
                        if stream is not None:
                            record(e1, stream)
                            e1.synchronize()
                            dev_ms.append(e0.elapsed_time(e1))
                        host.append((h1 - h0) * 1e6)
                    py = python_part_us(lambda: ht.step_(op, **tok, state=st, **kw), reps, st)
                ms = statistics.median(dev_ms) if dev_ms else statistics.median(host) / 1e3
                note = NOTE[cv] + (f", max_position={kw['max_position']}" if "max_position" in kw else "") + (
                    ", out= a kept buffer" if "out" in kw else "")
                out.append(dict(base, impl=impl, ms=ms, host_us=statistics.median(host),
                                note=note + "; caller-owned state (hila::step on a StateView); " + road))
                out.append(dict(base, impl=impl + "_python", ms=py / 1e3, host_us=py,
                                note=note + "; Python part only: the extension call replaced by a no-op"))
            if cpp:
                for r in hila_bench_rows(cpp, ["--decode", "--reps", reps, "--ops", op, "--batches", 1, "--positions",
                                               max(pos, 4096), "--H", H, "--d", d]):
                    if int(r["N"]) == 1:
                        out.append(dict(base, T=int(r["pos"]), impl="hila_cpp", ms=float(r["us_per_step"]) / 1e3,
                                        host_us=float(r["host_us"]), note="hila_bench --decode (DecodeState)"))
        except Exception:
            failed(f"step {op}")
        flush_csv(a, out)


@contextlib.contextmanager
def extension_steps_off(state):
    """Inside: hila's extension calls of a step (hila._C.step_inplace, and the step of a bound
    state, hila._C.BoundState, on the DLPack road; hila._torch_ops.step_ on the C++ road) are
    no-ops, so hila.torch.step_ runs its Python side alone (on the DLPack road o is allocated, on
    the C++ road the stand-in returns v: nothing runs). ``state``'s binding is dropped on entry and
    exit (the real one is made again at its next step)."""
    import hila.torch.ops as hops
    real, real_cpp = hops._C, hops._CPP_STEP

    class NoStep:
        def __init__(self, *args, **kwargs):
            pass

        def step(self, *args, **kwargs):
            return None

    class NoKernel:
        def __getattr__(self, name):
            if name == "step_inplace":
                return lambda *a, **k: None
            return NoStep if name == "BoundState" else getattr(real, name)
    state.__dict__.pop(hops._BOUND, None)
    hops._C = NoKernel()
    if real_cpp is not None:
        hops._CPP_STEP = lambda plan, q, k, v, *rest: v
    try:
        yield
    finally:
        hops._C, hops._CPP_STEP = real, real_cpp
        state.__dict__.pop(hops._BOUND, None)


def python_part_us(call, reps, state):
    """Median host time (µs) of call() with the extension's step a no-op (extension_steps_off):
    what the Python side of hila.torch.step_ costs."""
    with extension_steps_off(state):
        for _ in range(10):
            call()
        ts = []
        for _ in range(max(reps, 200)):
            t0 = time.perf_counter()
            call()
            ts.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(ts)


# ----------------------------------------------------------------------------- report

def flush_csv(a, rows):
    with open(os.path.join(a.out, "torch_bench.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, restval="")
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.4f}" if isinstance(v, float) else v) for k, v in r.items()})


def tables(rows):
    f = lambda x: "—" if x is None else f"{x:.3f}"  # noqa: E731
    ratio = lambda x, y: "—" if x is None or not y else f"{x / y:.2f}×"  # noqa: E731
    cells = {(r["section"], r["op"], r["B"], r["T"], r["direction"], r["impl"]): r["ms"] for r in rows}
    get = lambda *key: cells.get(key)  # noqa: E731  (section, op, B, T, direction, impl) -> ms
    lines = []
    train = [r for r in rows if r["section"] == "train"]
    if train:
        fla = "fla_guard_lifted" if any(r["impl"] == "fla_guard_lifted" for r in train) else "fla"
        lines += ["", "train (ms): hila.torch with default arguments / check_values=False / check_values=True, "
                  "the C++ bench on the same call, their ratio, fla", "",
                  "| op | B | T | dir | hila.torch | nocheck | checked | C++ | default / C++ | fla | default / fla |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for op, B, T, dirn in dict.fromkeys((r["op"], r["B"], r["T"], r["direction"]) for r in train):
            h = get("train", op, B, T, dirn, "hila_torch")
            n = get("train", op, B, T, dirn, "hila_torch_nocheck")
            k = get("train", op, B, T, dirn, "hila_torch_checked")
            c = get("train", op, B, T, dirn, "hila_cpp")
            fl = get("train", op, B, T, dirn, fla)
            lines.append(f"| {op} | {B} | {T} | {dirn} | {f(h)} | {f(n)} | {f(k)} | {f(c)} | {ratio(h, c)} | "
                         f"{f(fl)} | {ratio(h, fl)} |")
    dec = [r for r in rows if r["section"] == "decode"]
    if dec:
        lines += ["", "decode (ms per token; kernels: GPU time of one eager step's kernels)", "",
                  "| model | batch | eager | graph | kernels | eager / kernels | graph / kernels |",
                  "|---|---|---|---|---|---|---|"]
        for op, B in dict.fromkeys((r["op"], r["B"]) for r in dec):
            e, g, k = (next((r["ms"] for r in dec if (r["op"], r["B"], r["impl"]) == (op, B, i)), None)
                       for i in ("eager", "graph", "kernels"))
            lines.append(f"| {op} | {B} | {f(e)} | {f(g)} | {f(k)} | {ratio(e, k)} | {ratio(g, k)} |")
    step = [r for r in rows if r["section"] == "step"]
    if step:
        lines += ["", "step at N = 1 (µs: device time with a sync per step; host: time in the call; Python: the "
                  "host time with the extension call a no-op)", "",
                  "| op | hila.torch.step_ | host | Python | checked | host | max_position | host | + out= | host "
                  "| C++ step | host | default / C++ | max_position / C++ | out= / C++ |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for op in dict.fromkeys(r["op"] for r in step):
            cell = {r["impl"]: r for r in step if r["op"] == op}
            us = lambda i, k="ms": None if i not in cell else (cell[i][k] * 1e3 if k == "ms" else cell[i][k])  # noqa: E731
            lines.append(f"| {op} | {f(us('hila_torch'))} | {f(us('hila_torch', 'host_us'))} | "
                         f"{f(us('hila_torch_python', 'host_us'))} | {f(us('hila_torch_checked'))} | "
                         f"{f(us('hila_torch_checked', 'host_us'))} | {f(us('hila_torch_max_position'))} | "
                         f"{f(us('hila_torch_max_position', 'host_us'))} | {f(us('hila_torch_out'))} | "
                         f"{f(us('hila_torch_out', 'host_us'))} | {f(us('hila_cpp'))} | "
                         f"{f(us('hila_cpp', 'host_us'))} | {ratio(us('hila_torch'), us('hila_cpp'))} | "
                         f"{ratio(us('hila_torch_max_position'), us('hila_cpp'))} | "
                         f"{ratio(us('hila_torch_out'), us('hila_cpp'))} |")
    kern = [r for r in rows if r["section"] == "kernels"]
    for op, B, T, impl in dict.fromkeys((r["op"], r["B"], r["T"], r["impl"]) for r in kern):
        ks = sorted((r for r in kern if (r["op"], r["B"], r["T"], r["impl"]) == (op, B, T, impl)), key=lambda r: -r["ms"])
        total = sum(r["ms"] for r in ks)
        lines += ["", f"kernels of one forward + backward: {op} {B}x{T}, {impl} ({ks[0]['note']}): "
                  f"{total:.3f} ms GPU time", "", "| kernel | launches | ms | share |", "|---|---|---|---|"]
        lines += [f"| {r['kernel']} | {r['launches']:g} | {r['ms']:.3f} | {r['ms'] / total:.0%} |" for r in ks[:12]]
        if len(ks) > 12:
            rest = sum(r["ms"] for r in ks[12:])
            lines.append(f"| {len(ks) - 12} others | {sum(r['launches'] for r in ks[12:]):g} | {rest:.3f} | "
                         f"{rest / total:.0%} |")
    return "\n".join(lines)


def plot(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("# matplotlib missing: no plot")
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    train = [r for r in rows if r["section"] == "train"]
    ax = axes[0]
    for dirn, mark in (("fwd", "o"), ("fwdbwd", "s")):
        for op in dict.fromkeys(r["op"] for r in train):
            pts = []
            for B, T in dict.fromkeys((r["B"], r["T"]) for r in train if r["op"] == op):
                n = next((r["ms"] for r in train if (r["op"], r["B"], r["T"], r["direction"], r["impl"]) ==
                          (op, B, T, dirn, "hila_torch")), None)
                c = next((r["ms"] for r in train if (r["op"], r["B"], r["T"], r["direction"], r["impl"]) ==
                          (op, B, T, dirn, "hila_cpp")), None)
                if n and c:
                    pts.append((T, n / c))
            if pts:
                ax.plot(*zip(*pts), marker=mark, label=f"{op} {dirn}")
    ax.axhline(1.05, color="gray", linestyle="--", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("T (B·T = 32K tokens)")
    ax.set_ylabel("hila.torch (default arguments) / C++")
    ax.set_title("training calls: hila.torch over the C++ bench")
    if ax.lines[1:]:
        ax.legend(fontsize=6, ncol=2)
    ax = axes[1]
    dec = [r for r in rows if r["section"] == "decode"]
    keys = list(dict.fromkeys((r["op"], r["B"]) for r in dec))
    for i, impl in enumerate(("eager", "graph", "kernels")):
        ys = [next((r["ms"] for r in dec if (r["op"], r["B"], r["impl"]) == (op, B, impl)), 0) for op, B in keys]
        ax.bar([k + 0.27 * (i - 1) for k in range(len(keys))], ys, width=0.27, label=impl)
    ax.set_xticks(range(len(keys)), [f"{op}\nbatch {B}" for op, B in keys], fontsize=7)
    ax.set_ylabel("ms per token")
    ax.set_title("HilaLM decode: per token vs its kernels' GPU time")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# The kernel targets (forward + backward through hila.torch with default arguments, against a
# reference timed in the same run): (name, hila op, reference op, reference impls, bound).
TARGETS = [("gdn / fla chunk_gated_delta_rule", "gdn", "gdn", ("fla", "fla_guard_lifted"), 0.8),
           ("loglinear_gdn / fla chunk_gated_delta_rule", "loglinear_gdn", "gdn", ("fla", "fla_guard_lifted"), 2.0),
           ("hla2 / fla chunk_simple_gla", "hla2", "hla2", ("fla", "fla_guard_lifted"), 1.0),
           ("loglinear / hila gla", "loglinear", "gla", ("hila_torch",), 2.0)]


def kernel_targets(rows):
    """Per target and shape of one run's train rows: (name, B, T, hila ms, reference ms, ratio, bound)."""
    ms = {(r["op"], int(r["B"]), int(r["T"]), r["impl"]): float(r["ms"]) for r in rows
          if r["section"] == "train" and r["direction"] == "fwdbwd" and r["ms"] not in ("", None)}
    out = []
    for name, op, ref_op, ref_impls, bound in TARGETS:
        for B, T in dict.fromkeys((b, t) for o, b, t, i in ms if o == op and i == "hila_torch"):
            ref = next((ms[(ref_op, B, T, i)] for i in ref_impls if (ref_op, B, T, i) in ms), None)
            if ref:
                h = ms[(op, B, T, "hila_torch")]
                out.append((name, B, T, h, ref, h / ref, bound))
    return out


def write_targets(runs, out):
    """targets.md and targets.png under `out` from runs = [(label, rows)], each the rows of one run
    (a ratio is only formed within one run)."""
    got = [(label,) + t for label, rows in runs for t in kernel_targets(rows)]
    lines = ["| target | run | B × T | hila.torch ms | reference ms | ratio | bound |", "|---|---|---|---|---|---|---|"]
    for label, name, B, T, h, ref, r, bound in got:
        lines.append(f"| {name} | {label} | {B} × {T} | {h:.3f} | {ref:.3f} | {r:.2f}×{' (met)' if r <= bound else ''} "
                     f"| ≤ {bound}× |")
    with open(os.path.join(out, "targets.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("# matplotlib missing: no targets plot")
        return "\n".join(lines)
    curves = list(dict.fromkeys((g[0], g[1]) for g in got))  # (run, target): one line each
    if curves:
        fig, ax = plt.subplots(figsize=(7.5, 4.2))
        for k, (label, name) in enumerate(curves):
            pts = [(g[3], g[6], g[7]) for g in got if (g[0], g[1]) == (label, name)]
            line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="os^D"[k % 4],
                            label=name if len({c[0] for c in curves}) == 1 else f"{name} ({label})")
            ax.axhline(pts[0][2], color=line.get_color(), linestyle="--", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("T (B·T = 32K tokens)")
        ax.set_ylabel("forward + backward time ratio (dashed: target)")
        ax.set_title(f"kernel targets: hila.torch, default arguments ({', '.join(dict.fromkeys(g[0] for g in got))})",
                     fontsize=8)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(out, "targets.png"), dpi=110)
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="one shape, fewer repetitions, a 4-layer decode model")
    ap.add_argument("--hila-bench", default=None,
                    help="the hila_bench binary (default: $HILA_BENCH, .dev/bin/hila_bench, build-cuda/hila_bench)")
    ap.add_argument("--out", default="torch-bench")
    ap.add_argument("--sections", default="train,decode,step")
    ap.add_argument("--ops", default=TRAIN_OPS)
    ap.add_argument("--step-ops", default="gla,hla2,loglinear,gdn,loglinear_gdn")
    ap.add_argument("--shapes", default=None)
    ap.add_argument("--H", type=int, default=16)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--decode-layers", type=int, default=0)
    ap.add_argument("--decode-hidden", type=int, default=2048)
    ap.add_argument("--decode-batches", default="1,64")
    ap.add_argument("--l2norm", action="store_true", help="gdn operators with qk_l2norm (as fla's gdn anchor)")
    ap.add_argument("--no-fla", dest="fla", action="store_false")
    ap.add_argument("--train-impls", default=",".join(i for i, _ in IMPLS),
                    help="the hila.torch variants of the train section (hila_torch = default arguments)")
    ap.add_argument("--targets", nargs="+", metavar="LABEL=CSV",
                    help="no run: the kernel targets' table and plot (targets.md, targets.png under --out) from "
                         "the torch_bench.csv of earlier runs, each labelled (e.g. its device)")
    a = ap.parse_args()
    if a.targets:
        os.makedirs(a.out, exist_ok=True)
        runs = []
        for item in a.targets:
            label, _, path = item.rpartition("=")
            with open(path) as f:
                runs.append((label or path, list(csv.DictReader(f))))
        print(write_targets(runs, a.out))
        return
    a.train_impls = set(a.train_impls.split(","))
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("torch sees no CUDA device: run with --device cpu for a smoke run")
    cpu = device.type != "cuda"
    a.shapes = a.shapes or ("1:128" if cpu else ("8:4096" if a.quick else SHAPES))
    if cpu:
        a.H, a.d = 2, 16
    a.reps = a.reps or (5 if a.quick else 20 if not cpu else 10)
    a.decode_batches = [int(b) for b in a.decode_batches.split(",")][: 1 if (a.quick and cpu) else None]
    os.makedirs(a.out, exist_ok=True)
    # on the CPU only an explicit --hila-bench (e.g. a stand-in printing its CSV, to check the parsing)
    cpp = find_hila_bench(a.hila_bench) if (a.hila_bench or not cpu) else None
    import hila
    log(f"# {torch.cuda.get_device_name() if not cpu else 'cpu'}; torch {torch.__version__}; hila from "
        f"{os.path.dirname(hila.__file__)}; hila_bench: {cpp or 'not found (no C++ rows)'}")
    rows = []
    sections = {"train": lambda: section_train(a, device, rows, cpp), "decode": lambda: section_decode(a, device, rows),
                "step": lambda: section_step(a, device, rows, cpp), "kernels": lambda: section_kernels(a, device, rows)}
    def stop(signum, frame):  # a time limit (SIGTERM): keep the rows measured so far
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    try:
        for s in a.sections.split(","):
            try:
                sections[s]()
            except Exception:
                failed(f"section {s}")
    finally:
        flush_csv(a, rows)
        try:
            plot(rows, os.path.join(a.out, "torch_bench.png"))
        except Exception:
            failed("plot")
        print(tables(rows))
        try:
            if kernel_targets(rows):
                print(write_targets([(torch.cuda.get_device_name() if not cpu else "cpu", rows)], a.out))
        except Exception:
            failed("targets")
        log(f"# wrote {os.path.join(a.out, 'torch_bench.csv')} and torch_bench.png")


if __name__ == "__main__":
    main()
