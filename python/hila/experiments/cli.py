# SPDX-License-Identifier: Apache-2.0
"""Command line of hila.experiments (``python -m hila.experiments {mqar,niah,report} ...``).

Every setting has a flag; a preset fills the flags not given. ``--preset gpu`` (the default) is
the full grid with a learning-rate sweep, sized for an H200 with several processes at once
(``--parallel``); ``mqar --preset gpu-budget`` the same table with two learning rates, to be
spread over device calls of a few minutes (docs/EXPERIMENTS.md,
"Presets"); ``niah --preset gpu-small`` every mixer trained at 256 tokens with 16 needles in a
filler haystack and evaluated at 256-8K tokens with 1 and 4 needles, one learning rate;
``--preset smoke`` is a tiny run that finishes on a 2-core CPU in well under two minutes.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Dict, List, Optional

from .data import HAYSTACKS
from .mixers import DEFAULT_MIXERS, MIXERS
from .runner import GRID_AXES, execute, grid, parse_grid

__all__ = ["main", "PRESETS", "FAMILY_LRS"]

# One learning rate per mixer family, for grids that cannot afford the sweep (the values of the
# CPU smoke runs and of the families' papers; a preset takes them as ``lrs=FAMILY_LRS``; the niah
# runs of experiments/results/gpu-small/niah.csv were trained with them):
#   softmax attention 1e-3; the Mamba-2 family (gla, loglinear) and the Gated DeltaNet family
#   (gdn, loglinear_gdn) 3e-3; the HLA family (hla2, ahla, hla3, loglinear_hla2 and the normalized
#   variants) 1e-3.
FAMILY_LRS: Dict[str, List[float]] = {
    "sdpa": [1e-3],
    "gla": [3e-3], "loglinear": [3e-3],
    "gdn": [3e-3], "loglinear_gdn": [3e-3],
    "hla2": [1e-3], "ahla": [1e-3], "hla3": [1e-3], "loglinear_hla2": [1e-3],
    "hla2_normalized": [1e-3], "ahla_normalized": [1e-3], "hla3_normalized": [1e-3],
}

# Grid axes (lists) and shared run settings of each task's presets.
PRESETS: Dict[str, Dict[str, Dict]] = {
    "mqar": {
        "gpu": dict(mixers=list(DEFAULT_MIXERS), dims=[16, 32, 64, 128], lengths=[256, 512], seeds=[0, 1],
                    lrs=[1e-3, 3e-3, 1e-2], vocab=8192, steps=2000, batch=128, train_examples=100_000,
                    eval_examples=1000, eval_every=500),
        # The whole table with learning rates 3e-3 and 1e-2 (9 mixers x 4 dims x 2 lengths x 2 seeds
        # x 2 = 288 runs), 2000 steps of 128 sequences, tied head: sized to be spread over device
        # calls of a few minutes (--grid, --time-limit; finished runs are skipped). The CPU runs
        # behind it are in docs/EXPERIMENTS.md, "Training budget".
        "gpu-budget": dict(mixers=list(DEFAULT_MIXERS), dims=[16, 32, 64, 128], lengths=[256, 512], seeds=[0, 1],
                           lrs=[3e-3, 1e-2], vocab=8192, steps=2000, batch=128, train_examples=100_000,
                           eval_examples=1000, eval_every=500, tie_embeddings=True),
        # hla3 passes the recall plateau early at this size (docs/EXPERIMENTS.md): one run, ~1 min.
        "smoke": dict(mixers=["hla3"], dims=[32], lengths=[32], seeds=[0], lrs=[3e-3], pairs=4,
                      vocab=32, steps=800, batch=32, train_examples=8192, eval_examples=256, eval_every=100,
                      state_size=16, tie_embeddings=False),
    },
    "niah": {
        # gpu-small's design (below) with two seeds, two learning rates and twice the steps (36 runs).
        "gpu": dict(mixers=list(DEFAULT_MIXERS), dims=[64], lengths=[256, 1024, 2048, 4096, 8192], needles=[16],
                    seeds=[0, 1], lrs=[3e-3, 1e-2], vocab=8192, steps=3000, batch=256, eval_examples=64,
                    eval_every=500, depths="0,0.2,0.4,0.6,0.8,1", train_lengths="256", eval_needles="1,4",
                    haystack="filler"),
        # Every mixer at D = 64 (9 runs): trained at 256 tokens with 16 needles (16 labels per
        # sequence) in a filler haystack, 1500 steps of 256 sequences (64K tokens per step, as mqar
        # gpu-budget at T = 512), learning rate 1e-2; evaluated with 1 and 4 needles at the training
        # length and at 1K-8K tokens (length generalisation, 4 to 32 times the training length) and
        # 6 depths. Both choices rest on the CPU check of docs/EXPERIMENTS.md ("Needle in a
        # haystack"): at vocabulary 8192 the family rates 1e-3 and 3e-3 leave sdpa and gla at
        # chance where 1e-2 trains both, and within 1500 steps both learn at 256 tokens, not at 1024.
        "gpu-small": dict(mixers=list(DEFAULT_MIXERS), dims=[64], lengths=[256, 1024, 2048, 4096, 8192],
                          needles=[16], seeds=[0], lrs=[1e-2], vocab=8192, steps=1500, batch=256,
                          eval_examples=32, eval_every=250, depths="0,0.2,0.4,0.6,0.8,1",
                          train_lengths="256", eval_needles="1,4", haystack="filler"),
        "smoke": dict(mixers=["gla"], dims=[32], lengths=[32, 64], needles=[1], seeds=[0], lrs=[3e-3],
                      vocab=64, steps=100, batch=16, eval_examples=16, eval_every=100, depths="0,0.5,1"),
    },
}

_LISTS = dict(mixers=str, dims=int, lengths=int, seeds=int, lrs=float, needles=int)
_SHARED = dict(vocab=int, steps=int, batch=int, train_examples=int, eval_examples=int, eval_every=int,
               warmup=float, weight_decay=float, layers=int, head_dim=int, state_size=int, init_std=float,
               pairs=int, power_a=float, depths=str, train_lengths=str, eval_needles=str, haystack=str,
               train_tail=int)


def _csv_list(kind):
    return lambda s: [kind(x) for x in s.split(",") if x]


def _csv_string(kind):
    """A comma list checked item by item, kept as the comma string "a,b" (a RunConfig field)."""
    return lambda s: ",".join(str(kind(x)) for x in s.split(",") if x)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hila.experiments", description="Recall experiments with "
                                "hila's layers (MQAR, needle in a haystack).")
    sub = p.add_subparsers(dest="command", required=True)
    for task, what in (("mqar", "multi-query associative recall (Zoology's setup)"),
                       ("niah", "synthetic needle in a haystack, single and multi-needle")):
        t = sub.add_parser(task, help=what, description=f"Train and evaluate {what}.")
        t.add_argument("--preset", choices=sorted(PRESETS[task]), default="gpu",
                       help="defaults of every flag not given (default: gpu)")
        t.add_argument("--grid", help="sub-grid, e.g. 'mixers=gla,hla2 dims=16,32 seeds=0' (axes: "
                       + ", ".join(GRID_AXES) + "); overrides the axis flags")
        t.add_argument("--mixers", type=_csv_list(str), help=f"comma list of: {', '.join(MIXERS)}")
        t.add_argument("--dims", type=_csv_list(int), help="model widths")
        t.add_argument("--lengths", type=_csv_list(int),
                       help="sequence lengths (niah: the lengths every run is evaluated at, and trains at "
                            "unless --train-lengths)")
        t.add_argument("--seeds", type=_csv_list(int))
        t.add_argument("--lrs", type=_csv_list(float), help="learning rates (peak of warmup + cosine)")
        if task == "niah":
            t.add_argument("--needles", type=_csv_list(int),
                           help="needles per training sequence (one label each), e.g. 1,4 (a grid axis)")
            t.add_argument("--depths", help="evaluation depths in [0, 1], comma list (default 0,0.1,...,1)")
            t.add_argument("--train-lengths", type=_csv_string(int),
                           help="lengths of the training batches, comma list (default: --lengths); "
                                "evaluation stays at --lengths")
            t.add_argument("--eval-needles", type=_csv_string(int),
                           help="needle counts evaluated, comma list (default: the run's --needles)")
            t.add_argument("--haystack", choices=HAYSTACKS,
                           help="haystack tokens: kv (drawn from the key and value tokens, the default) or "
                                "filler (a range of the vocabulary disjoint from keys and values)")
            t.add_argument("--train-tail", type=int,
                           help="haystack tokens after the queries of a training batch, drawn in [0, TRAIN_TAIL] "
                                "per batch (default 0): needles at the low Fenwick levels of their queries too")
        else:
            t.add_argument("--pairs", type=int, help="key-value pairs (default: Zoology's for the length)")
            t.add_argument("--power-a", type=float, help="power law of the query gaps (default 0.01)")
            t.add_argument("--random-non-queries", action="store_true",
                           help="fill the non-query positions with random tokens instead of 0")
            t.add_argument("--train-examples", type=int, help="size of the fixed training set")
        t.add_argument("--vocab", type=int)
        t.add_argument("--steps", type=int, help="optimizer steps per run")
        t.add_argument("--batch", type=int)
        t.add_argument("--eval-examples", type=int, help="test sequences (niah: per length x depth cell)")
        t.add_argument("--eval-every", type=int, help="steps between evaluations (the learning curve)")
        t.add_argument("--warmup", type=float, help="warmup fraction of the steps (default 0.1)")
        t.add_argument("--weight-decay", type=float, help="AdamW weight decay (default 0.1)")
        t.add_argument("--layers", type=int, help="blocks (default 2)")
        t.add_argument("--head-dim", type=int, help="largest head dim (default 64)")
        t.add_argument("--state-size", type=int, help="Mamba-2 state size N of gla/loglinear (default 64)")
        t.add_argument("--init-std", type=float, help="std of linear and embedding weights (default 0.02)")
        t.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction, default=None,
                       help="the vocabulary head is the embedding (default: on, as Zoology)")
        t.add_argument("--out", type=Path, default=Path("experiments/results"),
                       help=f"results folder; rows go to OUT/{task}.csv (default experiments/results)")
        t.add_argument("--parallel", type=int, default=1,
                       help="training processes at once (default 1; one fewer after each run that runs out of "
                            "device memory, which is queued again)")
        t.add_argument("--device", default="auto",
                       help="auto (CUDA when present), cpu, cuda, or a comma list of devices for the workers")
        t.add_argument("--threads", type=int, help="torch CPU threads per process (default: 1 in one CPU "
                       "process; with --parallel N: 1 per worker on GPUs, cores / N on the CPU)")
        t.add_argument("--time-limit", type=float, help="seconds after which no new run starts")
        t.add_argument("--no-progress", action="store_true", help="no progress bars")
        t.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=True,
                       help="on CUDA, replay each training step from a CUDA graph (the same updates, "
                            "without the launch cost of its ~1000 kernels; default: on; --no-cuda-graph: "
                            "eager steps)")
        t.add_argument("--checkpoint-seconds", type=float, default=60.0,
                       help="each run saves its training state beside the CSV (checkpoints/) this often "
                            "(seconds, at logging points; 0: at every one) and a stopped run goes on from "
                            "it when the command runs again (default 60)")
        t.add_argument("--no-checkpoints", action="store_true", help="no checkpoints: a stopped run starts over")
        t.add_argument("--list", action="store_true", help="print the runs to do and exit")
    r = sub.add_parser("report", help="summary tables (markdown) and plots (PNG) from the result CSVs")
    r.add_argument("--results", type=Path, default=Path("experiments/results"),
                   help="folder of mqar.csv / niah.csv (default experiments/results)")
    r.add_argument("--out", type=Path, help="output folder (default: the results folder)")
    return p


def _runs(task: str, args) -> List:
    preset = dict(PRESETS[task][args.preset])
    axes = {a: preset.pop(a) for a in list(preset) if a in _LISTS}
    for a in _LISTS:
        if getattr(args, a, None) is not None:
            axes[a] = getattr(args, a)
    if args.grid:
        for a, values in parse_grid(args.grid).items():
            axes[a] = [_LISTS[a](v) for v in values]
    shared = dict(preset)
    for name in _SHARED:
        if getattr(args, name, None) is not None:
            shared[name] = getattr(args, name)
    if getattr(args, "random_non_queries", False):
        shared["random_non_queries"] = True
    if args.tie_embeddings is not None:
        shared["tie_embeddings"] = args.tie_embeddings
    if task == "mqar":
        axes.pop("needles", None)
    return grid(task, **axes, **shared)


def main(argv: Optional[List[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command != "report" and not args.checkpoint_seconds >= 0:
        parser.error(f"--checkpoint-seconds: expected a number >= 0, got {args.checkpoint_seconds}")
    if args.command == "report":
        from .report import build_report
        for path in build_report(args.results, args.out or args.results):
            print(path)
        return 0
    runs = _runs(args.command, args)
    csv_path = args.out / f"{args.command}.csv"
    if args.list:
        from .runner import checkpoint_path, done_keys
        from .train import load_checkpoint
        done = done_keys(csv_path)
        for r in runs:
            if r.key() in done:
                print("done  " + r.label())
                continue
            saved = load_checkpoint(checkpoint_path(args.out / "checkpoints", r), r.key())
            print("todo  " + r.label() + (f"  (resumes after step {saved['step']})" if saved else ""))
        return 0
    failures = execute(runs, csv_path, parallel=args.parallel, devices=args.device.split(","),
                       time_limit=args.time_limit, progress=not args.no_progress, threads=args.threads,
                       cuda_graph=args.cuda_graph,
                       checkpoint_seconds=None if args.no_checkpoints else args.checkpoint_seconds)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
