# SPDX-License-Identifier: Apache-2.0
"""Time one training step of the MQAR models of ``hila.experiments`` and list where it goes.

For each mixer: the model, optimizer and training step of ``hila.experiments`` (``RecallLM``, fused
AdamW, clipping; the preset ``gpu-budget``'s setting: vocab 8192, batch 128, tied head, TF32
matmuls on CUDA), one process alone on the device. Prints

* a CSV row per mixer on stdout: ``mixer,dim,seq_len,batch,eager_ms,graph_ms,profiled_ms,hila_ms``
  (ms per step: eager; replayed from a CUDA graph, as the runner does by default, empty on the
  CPU; the profiler's device time per step, or CPU time on the CPU; the part of it spent in
  hila's own kernels or, on the CPU, hila's operator calls);
* with ``--top N``, the N most expensive kernels (or CPU ops) of each mixer, on stderr.

Run: python bench/experiment_step.py [--mixers sdpa,gla,hla2,gdn] [--dim 128] [--seq-len 512]
                                     [--batch 128] [--steps 20] [--top 12] [--device auto]
"""
import argparse
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from hila.experiments.train import RunConfig, _build, _EagerSteps, _GraphedSteps, _lr_at, _sync, resolve_device


def _time(steps, task, cfg, dev, n):
    for s in range(3 + _GraphedSteps.WARM):  # warm-up; a graphed step captures after WARM eager ones
        steps(*task.batch(s), _lr_at(s, cfg))
    _sync(dev)
    t0 = time.perf_counter()
    for s in range(n):
        steps(*task.batch(s), _lr_at(s, cfg))
    _sync(dev)
    return (time.perf_counter() - t0) / n * 1e3


def _is_hila(name: str) -> bool:
    return "hila" in name


def measure(mixer: str, dim: int, seq_len: int, batch: int, n: int, dev: torch.device, top: int):
    cfg = RunConfig(task="mqar", mixer=mixer, dim=dim, seq_len=seq_len, lr=3e-3, batch=batch,
                    train_examples=max(4 * batch, 256), eval_examples=batch)
    model, task, opt = _build(cfg, dev)
    eager = _time(_EagerSteps(model, opt), task, cfg, dev, n)
    graph = _time(_GraphedSteps(model, opt, dev), task, cfg, dev, n) if dev.type == "cuda" else None
    steps, k = _EagerSteps(model, opt), 3
    cuda = dev.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for s in range(k):
            steps(*task.batch(s), _lr_at(s, cfg))
        _sync(dev)
    if cuda:
        events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        cost = lambda e: e.self_device_time_total  # noqa: E731
    else:  # the operators' own CPU time; hila's calls are the "hila::" ops and hila.torch's functions
        events = list(prof.key_averages())
        cost = lambda e: e.self_cpu_time_total  # noqa: E731
    total = sum(cost(e) for e in events) / k / 1e3
    hila_ms = sum(cost(e) for e in events if _is_hila(e.key)) / k / 1e3
    events.sort(key=lambda e: -cost(e))
    for e in events[:top]:
        print(f"  {mixer:>14} {cost(e) / k / 1e3:8.3f} ms  x{e.count // k:<4d} {e.key[:100]}", file=sys.stderr)
    return dict(mixer=mixer, dim=dim, seq_len=seq_len, batch=batch, eager_ms=round(eager, 2),
                graph_ms="" if graph is None else round(graph, 2), profiled_ms=round(total, 2),
                hila_ms=round(hila_ms, 2))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mixers", default="sdpa,gla,hla2,gdn,loglinear_hla2")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per mode")
    ap.add_argument("--top", type=int, default=0, help="list the N most expensive kernels per mixer (stderr)")
    ap.add_argument("--device", default="auto")
    a = ap.parse_args(argv)
    for name, v in (("--dim", a.dim), ("--seq-len", a.seq_len), ("--batch", a.batch), ("--steps", a.steps)):
        if v < 1:
            ap.error(f"{name} must be positive, got {v}")
    dev = resolve_device(a.device)
    precision = torch.get_float32_matmul_precision()
    if dev.type == "cuda":
        torch.set_float32_matmul_precision("high")  # as the runner (the ``matmul`` column: tf32)
    try:
        cols = ["mixer", "dim", "seq_len", "batch", "eager_ms", "graph_ms", "profiled_ms", "hila_ms"]
        print(",".join(cols))
        for mixer in a.mixers.split(","):
            row = measure(mixer, a.dim, a.seq_len, a.batch, a.steps, dev, a.top)
            print(",".join(str(row[c]) for c in cols), flush=True)
    finally:
        torch.set_float32_matmul_precision(precision)


if __name__ == "__main__":
    main()
