# SPDX-License-Identifier: Apache-2.0
"""Runs a grid of experiments and appends their rows to a CSV file, skipping the runs already in it.

A grid is the product of mixers x dims x lengths x seeds x lrs (and needles for niah) over one set
of shared settings. Every finished run appends its rows at once (written by this process only, so
parallel workers never interleave), so an interrupted grid keeps what it finished, and running the
same command again (or over several calls, each with a time limit) completes it. A run in progress
saves its training state in ``checkpoints/`` beside the CSV (train.run's ``checkpoint``), so a
run stopped part-way goes on from its last save when the command runs again; the file is removed
once the run's rows are in the CSV.
"""
from __future__ import annotations

import concurrent.futures as cf
import csv
import hashlib
import itertools
import multiprocessing as mp
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Set, Union

from .._errors import HilaError
from .train import IMPLIED, RunConfig

__all__ = ["grid", "done_keys", "append_rows", "read_rows", "execute", "parse_grid", "worker_threads",
           "out_of_memory", "after_out_of_memory", "checkpoint_path"]

GRID_AXES = ("mixers", "dims", "lengths", "seeds", "lrs", "needles")


def parse_grid(spec: str) -> Dict[str, List[str]]:
    """``"mixers=gla,hla2 dims=16,32 lrs=1e-3"`` (axes separated by spaces or ';') -> {axis: values}."""
    out = {}
    for part in spec.replace(";", " ").split():
        name, sep, values = part.partition("=")
        if not sep or name not in GRID_AXES or not values:
            raise HilaError(f"hila: argument 'grid': expected AXIS=V1,V2,... with AXIS in "
                            f"{', '.join(GRID_AXES)}, got '{part}'", "grid")
        out[name] = [v for v in values.split(",") if v]
    return out


def grid(task: str, mixers: Sequence[str], dims: Sequence[int], lengths: Sequence[int],
         seeds: Sequence[int], lrs: Union[Sequence[float], Mapping[str, Sequence[float]]],
         needles: Sequence[int] = (1,), **shared) -> List[RunConfig]:
    """The runs of the grid, largest models first (they take longest: started first, they pack
    the parallel workers better). For niah, ``lengths`` are the lengths of one run (each run trains
    and evaluates at all of them), not an axis. ``lrs``: the learning rates of every mixer, or
    {mixer: its learning rates} (one per mixer family in niah --preset gpu-small)."""
    if task == "niah":
        shared["lengths"] = ",".join(str(x) for x in lengths)
        lengths = [max(lengths)]
    if isinstance(lrs, Mapping):
        missing = [m for m in mixers if m not in lrs]
        if missing:
            raise HilaError(f"hila: argument 'lrs': no learning rate for mixer(s) {', '.join(missing)}", "lrs")
    runs = []
    for mixer, dim, T, n, seed in itertools.product(mixers, dims, lengths, needles, seeds):
        for lr in (lrs[mixer] if isinstance(lrs, Mapping) else lrs):
            kw = dict(shared, needles=int(n)) if task == "niah" else dict(shared)
            runs.append(RunConfig(task=task, mixer=mixer, dim=int(dim), seq_len=int(T), lr=float(lr),
                                  seed=int(seed), **kw))
    return sorted(runs, key=lambda c: -(c.dim * c.seq_len))


def _read_raw(path: Path) -> List[Dict[str, str]]:
    """The rows of a CSV as written (its own columns only)."""
    if not Path(path).exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def read_rows(path: Path) -> List[Dict[str, str]]:
    """The rows of a result CSV; a blank cell of a field added later (train.IMPLIED) holds the
    value the runs written before it had."""
    rows = _read_raw(path)
    for r in rows:
        for name, value in IMPLIED.items():
            if r.get(name, "") in ("", None):
                r[name] = str(value)
    return rows


def done_keys(path: Path) -> Set[str]:
    return {r["key"] for r in read_rows(path) if r.get("key")}


def append_rows(path: Path, rows: List[Dict]) -> None:
    """Appends rows to the CSV at path, creating it (and its folder) with a header when absent. A
    row with columns the file lacks rewrites the file with the union of the columns (old rows
    keep blanks there)."""
    if not rows:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    old = _read_raw(path)
    fields = list(old[0].keys()) if old else []
    new = [k for r in rows for k in r if k not in fields]
    fields += list(dict.fromkeys(new))
    if old and new:
        tmp = path.with_suffix(path.suffix + ".tmp")
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=fields)
            w.writeheader()
            w.writerows(old + rows)
        os.replace(tmp, path)
        return
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        if not old:
            w.writeheader()
        w.writerows(rows)


# ---- parallel workers ---------------------------------------------------------------------------

_SLOT = None  # this worker's index (its progress bar line and its device)


def checkpoint_path(folder: Path, cfg: RunConfig) -> Path:
    """The checkpoint file of a run in folder: named by a hash of its key (keys are long)."""
    return Path(folder) / f"{cfg.task}-{cfg.mixer}-{hashlib.sha1(cfg.key().encode()).hexdigest()[:16]}.pt"


# A worker's checkpoint folder and interval (None: no checkpoints), set by _init_worker.
_CHECKPOINTS: Optional[tuple] = None


def _init_worker(counter, lock, threads: int, checkpoints: Optional[tuple] = None) -> None:
    global _SLOT, _CHECKPOINTS
    _CHECKPOINTS = checkpoints
    with lock:
        _SLOT = counter.value
        counter.value += 1
    import torch
    torch.set_num_threads(threads)
    try:  # a fresh worker has run no parallel work yet; one inter-op thread (a step is a serial chain)
        torch.set_num_interop_threads(threads)
    except RuntimeError:
        pass


def _run_one(cfg: RunConfig, devices: Sequence[str], progress: bool, cuda_graph: bool):
    from .train import run
    slot = _SLOT or 0
    ck = {} if _CHECKPOINTS is None else dict(checkpoint=checkpoint_path(_CHECKPOINTS[0], cfg),
                                              checkpoint_seconds=_CHECKPOINTS[1])
    try:
        return run(cfg, device=devices[slot % len(devices)], progress=progress, position=slot + 1,
                   cuda_graph=cuda_graph, **ck), None
    except Exception:  # reported by the parent, which keeps going with the other runs
        return None, traceback.format_exc()
    finally:  # a worker between runs (or idle at the end) holds no cached device memory
        import torch
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()


# What torch and hila report when a device allocation fails (torch.OutOfMemoryError, a CUDA error
# "out of memory", hila's "could not allocate ... of device memory").
_OOM_MARKS = ("OutOfMemoryError", "out of memory", "of device memory")


def out_of_memory(err: Optional[str]) -> bool:
    """Whether a run's error (its traceback text) is a failed device allocation."""
    return err is not None and any(m in err for m in _OOM_MARKS)


def after_out_of_memory(limit: int, alone: bool, retries: int, max_retries: int) -> Optional[int]:
    """The runs allowed at once (now ``limit``) after a run failed for device memory, ``alone``
    when it ran with no other run beside it, after ``retries`` earlier attempts: one fewer (at
    least 1), and the run goes back to the queue; None (a failure) when it failed alone or had
    ``max_retries`` attempts already."""
    if alone or retries >= max_retries:
        return None
    return max(1, limit - 1)


def execute(runs: Iterable[RunConfig], out_csv: Path, parallel: int = 1, devices: Sequence[str] = ("auto",),
            time_limit: Optional[float] = None, progress: bool = True, threads: Optional[int] = None,
            cuda_graph: bool = False, worker=None, heartbeat: Optional[float] = 60.0,
            checkpoint_seconds: Optional[float] = 60.0) -> int:
    """Runs every run whose key is not in out_csv yet, ``parallel`` at a time (1: in this process),
    appending each one's rows as it finishes. No run starts after ``time_limit`` seconds. Returns
    the number of runs that failed with an error (diverged runs are results, not failures).
    ``cuda_graph``: train.run's (training steps replayed from CUDA graphs on CUDA devices).

    With ``parallel`` > 1 a run that fails for device memory (:func:`out_of_memory`) is not a
    failure yet: it goes back to the front of the queue and one run fewer is allowed at once from
    then on (:func:`after_out_of_memory`), so a grid started with too many processes for the
    card's memory settles at a number that fits. ``worker``: the function each worker process
    calls, ``worker(cfg, devices, progress, cuda_graph) -> (rows, error text)`` (default: train.run's;
    tests give others). With ``parallel`` > 1 each run's start is printed, and every ``heartbeat``
    seconds without a finished run (None: never) the runs still going, so that a log shows where
    a call stood when it was stopped.

    ``checkpoint_seconds``: each run saves its training state in ``checkpoints/`` beside out_csv
    at its first logging point that many seconds after its start or last save, and starts from
    such a file when there is one (module docstring); None: no checkpoints."""
    if checkpoint_seconds is not None and not checkpoint_seconds >= 0:
        raise HilaError(f"checkpoint_seconds: expected a number >= 0 or None, got {checkpoint_seconds}", "checkpoint_seconds")
    ck_dir = Path(out_csv).parent / "checkpoints"
    checkpoints = None if checkpoint_seconds is None else (str(ck_dir), float(checkpoint_seconds))
    runs, done = list(runs), done_keys(out_csv)
    todo = [r for r in runs if r.key() not in done]
    print(f"hila.experiments: {len(todo)} runs to do, {len(runs) - len(todo)} already in {out_csv} "
          f"(parallel {parallel})", file=sys.stderr, flush=True)
    start, failures, finished = time.monotonic(), 0, 0

    def out_of_time():
        return time_limit is not None and time.monotonic() - start > time_limit

    def record(cfg, rows, err):
        nonlocal failures, finished
        if err is not None:
            failures += 1
            print(f"hila.experiments: {cfg.label()} failed:\n{err}", file=sys.stderr, flush=True)
            return
        append_rows(out_csv, rows)
        if checkpoints is not None:  # the rows are kept: the run is not resumed again
            checkpoint_path(ck_dir, cfg).unlink(missing_ok=True)
        finished += 1
        r = rows[0]
        print(f"hila.experiments: [{finished}/{len(todo)}] {cfg.label()}: acc {r['acc']:.4f} "
              f"({r['status']}, {r['ms_per_step']:.1f} ms/step, {r['wall_s']:.0f} s)", file=sys.stderr,
              flush=True)

    if parallel <= 1:
        import torch
        from .train import resolve_device, run
        before = torch.get_num_threads()
        # One torch thread on the CPU by default: torch's intra-op threads and hila's OpenMP
        # regions (one libgomp runtime or two, as torch was packaged) oversubscribe a few cores.
        torch.set_num_threads(threads or (1 if resolve_device(devices[0]).type == "cpu" else before))
        try:
            for cfg in todo:
                if out_of_time():
                    break
                ck = {} if checkpoints is None else dict(checkpoint=checkpoint_path(ck_dir, cfg),
                                                         checkpoint_seconds=checkpoint_seconds)
                try:
                    rows, err = run(cfg, device=devices[0], progress=progress, cuda_graph=cuda_graph, **ck), None
                except Exception:
                    rows, err = None, traceback.format_exc()
                record(cfg, rows, err)
        finally:
            torch.set_num_threads(before)
    else:
        ctx = mp.get_context("spawn")  # CUDA cannot be forked
        counter, lock = ctx.Value("i", 0), ctx.Lock()
        threads = threads or worker_threads(devices, parallel)
        # hila's OpenMP pool (CPU backend) sizes itself from OMP_NUM_THREADS when a worker loads it
        omp = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = str(threads)
        limit, retries = parallel, {}
        try:
            with cf.ProcessPoolExecutor(parallel, mp_context=ctx, initializer=_init_worker,
                                        initargs=(counter, lock, threads, checkpoints)) as pool:
                queue, running = list(todo), {}
                while queue or running:
                    while queue and len(running) < limit and not out_of_time():
                        cfg = queue.pop(0)
                        fut = pool.submit(worker or _run_one, cfg, list(devices), progress, cuda_graph)
                        running[fut] = (cfg, limit == 1)  # alone: no other run starts beside it
                        print(f"hila.experiments: started {cfg.label()} ({len(running)} running)", file=sys.stderr,
                              flush=True)
                    if not running:
                        break
                    ready, _ = cf.wait(running, timeout=heartbeat, return_when=cf.FIRST_COMPLETED)
                    if not ready:
                        print(f"hila.experiments: {len(running)} running after {time.monotonic() - start:.0f} s, "
                              f"{finished} finished: " + ", ".join(c.label() for c, _ in running.values()),
                              file=sys.stderr, flush=True)
                    for fut in ready:
                        cfg, alone = running.pop(fut)
                        try:
                            rows, err = fut.result()
                        except Exception:  # the worker process died
                            rows, err = None, traceback.format_exc()
                        if out_of_memory(err):
                            n = retries.get(cfg.key(), 0)
                            fewer = after_out_of_memory(limit, alone, n, max_retries=parallel)
                            if fewer is not None:
                                retries[cfg.key()] = n + 1
                                limit = fewer
                                queue.insert(0, cfg)
                                print(f"hila.experiments: {cfg.label()} ran out of device memory; queued again, "
                                      f"at most {limit} runs at once from now on", file=sys.stderr, flush=True)
                                continue
                        record(cfg, rows, err)
        finally:
            if omp is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = omp
    left = len(todo) - finished - failures
    if left:
        print(f"hila.experiments: time limit reached, {left} runs left for the next call",
              file=sys.stderr, flush=True)
    return failures


def worker_threads(devices: Sequence[str], parallel: int) -> int:
    """torch threads of each of ``parallel`` worker processes: 1 when every device is a GPU (a
    worker's host work is one thread launching kernels; more threads only contend for the cores
    the other workers use), else the cores split evenly (at least 1)."""
    from .train import resolve_device
    if all(resolve_device(d).type == "cuda" for d in devices):
        return 1
    return max(1, (os.cpu_count() or 1) // parallel)
