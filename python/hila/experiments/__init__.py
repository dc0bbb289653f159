# SPDX-License-Identifier: Apache-2.0
"""Recall experiments with hila's layers: small models trained on synthetic tasks.

    python -m hila.experiments mqar   [--preset gpu|smoke] [--grid ...] [--parallel N] ...
    python -m hila.experiments niah   [--preset gpu|smoke] ...
    python -m hila.experiments report [--results experiments/results]

* :mod:`.data`: the tasks: multi-query associative recall (Zoology's generator) and a synthetic
  needle in a haystack (single and multi-needle), as vectorized torch code on any device.
* :mod:`.mixers`: the compared token mixers by name (softmax attention, hila's layers, and the
  first-order Mamba-2 / Gated DeltaNet mixers built from the same pieces).
* :mod:`.model`: the two-layer decoder (pre-norm mixer + SwiGLU blocks) they are trained in.
* :mod:`.train`: one run: AdamW, warmup + cosine, progress bar, evaluation, result rows.
* :mod:`.runner`: grids of runs, appended to CSV files, resumable, in parallel processes.
* :mod:`.report`: markdown tables and PNG plots from the CSV files.

Needs torch, tqdm (progress bars) and matplotlib (report): ``pip install hila[experiments]``.
See docs/EXPERIMENTS.md.
"""
from .data import mqar, niah, pairs_for_length
from .mixers import DEFAULT_MIXERS, MIXERS, build_mixer
from .model import RecallLM
from .train import RunConfig, run

__all__ = ["DEFAULT_MIXERS", "MIXERS", "RecallLM", "RunConfig", "build_mixer", "mqar", "niah",
           "pairs_for_length", "run"]
