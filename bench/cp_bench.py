# SPDX-License-Identifier: Apache-2.0
"""Context-parallel scaling of hila's operators (hila.torch.distributed) against the single-device
call. One process per device, launched with torchrun:

    torchrun --standalone --nproc_per_node=8 bench/cp_bench.py --T 262144 --local-T 32768 \\
        --ops gla,hla2,loglinear,gdn,loglinear_gdn --out bench/results/cp_h200x8

* Strong scaling: one sequence of --T tokens sharded over w = 1, 2, 4, ... ranks (the first w
  ranks of the launch; the others wait), against the single-device call on the whole sequence
  (rank 0 alone): speedup = t_single / t_w, efficiency = speedup / w.
* Weak scaling: --local-T tokens per rank, w * local_T in all, against the single-device call on
  local_T tokens: efficiency = t_single(local_T) / t_w (1 is ideal).

Times are the median over --iters calls of the slowest rank (each call starts after a barrier);
`fwd` is the forward with autograd recording, `fwdbwd` forward + backward. Rows (CSV, stdout):
mode,op,dtype,world,T,T_local,B,H,G,dk,dv,direction,ms,single_ms,speedup,efficiency,msg_bytes,peak_mib
(msg_bytes: what one rank sends per call, hila.torch.distributed.last_comm; peak_mib: the largest
peak CUDA memory of a rank). With --out, also <out>.csv and <out>.png (needs matplotlib).

CUDA runs use NCCL; the environment's NCCL settings (NCCL_NVLS_ENABLE, TORCH_SYMM_MEM_DISABLE_
MULTICAST, ...) are used as they are and printed. --device cpu runs gloo (a smoke test).
"""
import argparse
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import hila
import hila.torch as ht
from hila.torch import distributed as hd

FIELDS = ("mode,op,dtype,world,T,T_local,B,H,G,dk,dv,direction,ms,single_ms,speedup,efficiency,"
          "msg_bytes,peak_mib").split(",")


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", default="gla,hla2,ahla,hla3,loglinear,loglinear_hla2,gdn,loglinear_gdn")
    p.add_argument("--T", type=int, default=65536, help="strong scaling: tokens of the sequence")
    p.add_argument("--local-T", type=int, default=16384, help="weak scaling: tokens per rank")
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--G", type=int, default=None, help="q/k groups (default H)")
    p.add_argument("--dk", type=int, default=128)
    p.add_argument("--dv", type=int, default=128)
    p.add_argument("--dtype", default="bf16", choices=("bf16", "f16", "f32", "f64"))
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--mode", default="strong,weak")
    p.add_argument("--direction", default="fwd,fwdbwd")
    p.add_argument("--worlds", default=None, help="comma list (default 1, 2, 4, ... up to the launch)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None, help="path prefix of the CSV and PNG")
    return p.parse_args()


DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32, "f64": torch.float64}


def inputs(op, a, T_total, n, args, device, seed):
    """Rows [a, a + n) of a sequence of T_total tokens (each shard drawn from its own seed)."""
    t = hila.op_traits(op)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    G = args.G or args.H
    dt = DTYPES[args.dtype]

    def r(*s, lo=None, hi=None):
        x = torch.rand(*s, generator=gen) * (hi - lo) + lo if lo is not None else torch.randn(*s, generator=gen)
        return x.to(device)

    q = (r(args.B, n, G, args.dk) / args.dk ** 0.5).to(dt)
    k = (r(args.B, n, G, args.dk) / args.dk ** 0.5).to(dt)
    v = r(args.B, n, args.H, args.dv).to(dt)
    g = r(args.B, n, args.H, lo=-0.1, hi=-0.001)
    kw = {}
    if t["loglinear"]:
        kw["lam"] = r(args.B, n, args.H, hila.levels_needed(0, T_total), lo=0.5, hi=1.5)
    if t["delta"]:
        kw["beta"] = r(args.B, n, args.H, lo=0.1, hi=0.9)
    return q, k, v, g, kw


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, args, device, group):
    """Median over iters of the slowest rank of `group` (ms); each call starts after a barrier."""
    out = []
    for i in range(args.warmup + args.iters):
        dist.barrier(group=group)
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        ms = torch.tensor([(time.perf_counter() - t0) * 1e3], dtype=torch.float64, device=device)
        dist.all_reduce(ms, op=dist.ReduceOp.MAX, group=group)
        if i >= args.warmup:
            out.append(ms.item())
    return statistics.median(out)


def one_call(op, q, k, v, g, kw, direction, args, cp=None):
    """A closure running the call once (fwd, or fwd + bwd with a fixed cotangent)."""
    leaves = [q, k, v, g] + list(kw.values())
    if direction == "fwdbwd":
        for x in leaves:
            x.requires_grad_(True)
    do = [None]

    def fn():
        for x in leaves:
            x.grad = None
        if cp is None:
            o, _ = ht.forward(op, q, k, v, g, chunk=args.chunk, check_values=False, **kw)
        else:
            o, _ = hd.forward(op, q, k, v, g, chunk=args.chunk, check_values=False, group=cp[0],
                              shard_lens=cp[1], **kw)
        if direction == "fwdbwd":
            if do[0] is None:
                do[0] = torch.randn_like(o)
            o.backward(do[0])
    return fn


def peak_mib(device, group):
    if device.type != "cuda":
        return float("nan")
    m = torch.tensor([torch.cuda.max_memory_allocated(device) / 2**20], dtype=torch.float64, device=device)
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    torch.cuda.reset_peak_memory_stats(device)
    return m.item()


def single(op, T, direction, args, device, rank):
    """The single-device call on rank 0 (the other ranks wait); nan when it does not fit."""
    ms = torch.tensor([float("nan")], dtype=torch.float64, device=device)
    if rank == 0:
        try:
            q, k, v, g, kw = inputs(op, 0, T, T, args, device, seed=1)
            fn = one_call(op, q, k, v, g, kw, direction, args)
            times = []
            for i in range(args.warmup + args.iters):
                sync(device)
                t0 = time.perf_counter()
                fn()
                sync(device)
                if i >= args.warmup:
                    times.append((time.perf_counter() - t0) * 1e3)
            ms[0] = statistics.median(times)
            del q, k, v, g, kw, fn
        except torch.cuda.OutOfMemoryError:
            print(f"# single-device {op} T={T} {direction}: out of memory", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    dist.broadcast(ms, src=0)
    return ms.item()


def sharded(op, T, w, direction, args, device, rank, groups):
    """The call sharded over ranks 0..w-1 (equal shards, the remainder on the last); (ms, bytes)."""
    lens = [T // w] * w
    lens[-1] += T - sum(lens)
    res = torch.tensor([float("nan"), 0.0], dtype=torch.float64, device=device)
    if rank < w:
        a = sum(lens[:rank])
        q, k, v, g, kw = inputs(op, a, T, lens[rank], args, device, seed=100 + rank)
        fn = one_call(op, q, k, v, g, kw, direction, args, cp=(groups[w], lens))
        res[0] = timed(fn, args, device, groups[w])
        res[1] = hd.last_comm.message_bytes
        del q, k, v, g, kw, fn
    dist.broadcast(res, src=0)
    return res[0].item(), int(res[1].item())


def plot(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("# matplotlib is not installed: no PNG", flush=True)
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, mode, key, title in ((axes[0], "strong", "speedup", "strong scaling: speedup over 1 device"),
                                 (axes[1], "weak", "efficiency", "weak scaling: efficiency")):
        curves = {}
        for r in rows:
            if r["mode"] == mode and not math.isnan(r[key]):
                curves.setdefault((r["op"], r["direction"]), []).append((r["world"], r[key]))
        ops = sorted({op for op, _ in curves})
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        for (op, d), pts in sorted(curves.items()):   # colour: operator; line: direction
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=colors[ops.index(op) % len(colors)],
                    linestyle="-" if d == "fwd" else ":", label=f"{op} {d}")
        ws = sorted({r["world"] for r in rows})
        if ws:
            ax.plot(ws, ws if mode == "strong" else [1] * len(ws), "k--", lw=0.8, label="ideal")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("ranks")
        ax.set_ylabel(key)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=6)
    r0 = rows[0]
    fig.suptitle(f"hila context parallelism, H={r0['H']}, dk={r0['dk']}, dv={r0['dv']}, {r0['dtype']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"# wrote {path}", flush=True)


def main():
    args = parse()
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    worlds = ([int(x) for x in args.worlds.split(",")] if args.worlds else
              sorted({2 ** i for i in range(int(math.log2(world)) + 1)} | {world}))
    if any(w < 1 or w > world for w in worlds):
        raise SystemExit(f"--worlds: each between 1 and the launch's {world} ranks, got {worlds}")
    groups = {w: dist.new_group(list(range(w))) for w in worlds}   # every rank creates every group
    if rank == 0:
        env = {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST")}
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        print(f"# {world} ranks, {dist.get_backend()}, {name}, torch {torch.__version__}, env {env}", flush=True)
        print(",".join(FIELDS), flush=True)
    rows = []
    for op in args.ops.split(","):
        for direction in args.direction.split(","):
            for mode in args.mode.split(","):
                base_T = args.T if mode == "strong" else args.local_T
                t1 = single(op, base_T, direction, args, device, rank)
                peak_mib(device, dist.group.WORLD)
                for w in worlds:
                    T = args.T if mode == "strong" else w * args.local_T
                    ms, nbytes = sharded(op, T, w, direction, args, device, rank, groups)
                    speed = t1 / ms
                    row = dict(mode=mode, op=op, dtype=args.dtype, world=w, T=T, T_local=T // w, B=args.B,
                               H=args.H, G=args.G or args.H, dk=args.dk, dv=args.dv, direction=direction,
                               ms=ms, single_ms=t1, speedup=speed,
                               efficiency=speed / w if mode == "strong" else speed, msg_bytes=nbytes,
                               peak_mib=peak_mib(device, dist.group.WORLD))
                    rows.append(row)
                    if rank == 0:
                        print(",".join(f"{row[f]:.4g}" if isinstance(row[f], float) else str(row[f])
                                       for f in FIELDS), flush=True)
    if rank == 0 and args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out + ".csv", "w") as f:
            f.write(",".join(FIELDS) + "\n")
            for row in rows:
                f.write(",".join(str(row[k]) for k in FIELDS) + "\n")
        print(f"# wrote {args.out}.csv", flush=True)
        plot(rows, args.out + ".png")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
