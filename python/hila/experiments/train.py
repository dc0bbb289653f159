# SPDX-License-Identifier: Apache-2.0
"""One training run of a recall task: configuration, data, AdamW with warmup + cosine decay, a
progress bar with loss and accuracy, periodic evaluation, and the result rows it produces.

A run's rows hold its whole configuration (``key`` identifies it: runs with the same key are the
same experiment), its learning curve, its final accuracy, its wall time and its device.

A run given a checkpoint file saves its whole training state there (model, optimizer, data order,
the loss accumulated since its last evaluation, its curve and timings) at logging points, and a
run that finds a checkpoint of its key goes on from it: a run stopped part-way (a time limit, a
killed process) loses at most the steps since its last save and ends with the rows it would have
had without the stop.
"""
from __future__ import annotations

import dataclasses
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import torch
from torch import Tensor

from .._errors import HilaError
from . import data
from .mixers import MixerShape
from .model import RecallLM

__all__ = ["RunConfig", "run", "resolve_device", "warmup_steps", "load_checkpoint"]

TASKS = ("mqar", "niah")

# Fields added to RunConfig after results were written, with the value the older rows had (their
# CSV cells are blank): left out of the key at that value, filled in when rows are read.
# train_lengths "": train at ``lengths``; eval_needles "": evaluate at ``needles``; haystack "kv":
# haystack drawn from the key and value tokens; train_tail 0: the queries end every training sequence.
IMPLIED = {"tie_embeddings": False, "train_lengths": "", "eval_needles": "", "haystack": "kv", "train_tail": 0}


@dataclass
class RunConfig:
    """Everything that defines one run (the fields of its ``key``), for both tasks.

    mqar: sequences of ``seq_len`` tokens with ``pairs`` key-value pairs (0: Zoology's count for
    the length), a fixed training set of ``train_examples`` sequences (as Zoology), a test set of
    ``eval_examples`` sequences drawn with another seed.
    niah: training batches drawn fresh at every step, each of one length of ``train_lengths``
    (uniform; "": ``lengths``), with ``needles`` needles at random depths (``needles`` labels per
    sequence) in a haystack of kind ``haystack`` (data.niah: "kv" or "filler"); evaluation at every
    needle count of ``eval_needles`` ("": ``needles``), every length of ``lengths`` and every depth
    of ``depths``, with ``eval_examples`` sequences per cell. ``train_tail``: each training batch
    ends with a number of haystack tokens after its queries drawn uniformly from [0, train_tail]
    (data.niah's ``tail``; evaluation sequences end with their queries). ``seq_len`` is the longest length
    trained or evaluated at. ``train_lengths`` and ``eval_needles`` take comma lists (or lists of
    ints) and are stored as comma strings, "" where they equal their default (``lengths``,
    ``needles``): one key per experiment.
    """

    task: str
    mixer: str
    dim: int
    seq_len: int
    lr: float
    seed: int = 0
    pairs: int = 0
    needles: int = 1
    lengths: str = ""
    depths: str = ""
    vocab: int = 8192
    steps: int = 2000
    batch: int = 128
    train_examples: int = 100_000
    eval_examples: int = 1000
    eval_every: int = 500
    warmup: float = 0.1
    weight_decay: float = 0.1
    layers: int = 2
    head_dim: int = 64
    state_size: int = 64
    init_std: float = 0.02
    tie_embeddings: bool = True
    power_a: float = 0.01
    random_non_queries: bool = False
    train_lengths: str = ""
    eval_needles: str = ""
    haystack: str = "kv"
    train_tail: int = 0

    def __post_init__(self):
        if self.task not in TASKS:
            raise HilaError(f"hila: argument 'task': expected one of {', '.join(TASKS)}, got "
                            f"'{self.task}'", "task")
        for name in ("dim", "seq_len", "steps", "batch", "eval_examples", "layers", "vocab"):
            if int(getattr(self, name)) < 1:
                raise HilaError(f"hila: argument '{name}': expected >= 1, got {getattr(self, name)}", name)
        if not self.lr > 0:
            raise HilaError(f"hila: argument 'lr': expected > 0, got {self.lr}", "lr")
        if self.task == "mqar" and self.pairs == 0:
            self.pairs = data.pairs_for_length(self.seq_len)
        if self.task == "mqar" and self.train_examples < self.batch:
            raise HilaError(f"hila: argument 'train_examples': expected at least one batch "
                            f"({self.batch}), got {self.train_examples}", "train_examples")
        self.train_lengths = _int_list_field("train_lengths", self.train_lengths)
        self.eval_needles = _int_list_field("eval_needles", self.eval_needles)
        if self.haystack not in data.HAYSTACKS:
            raise HilaError(f"hila: argument 'haystack': expected one of {', '.join(data.HAYSTACKS)}, got "
                            f"'{self.haystack}'", "haystack")
        self.train_tail = int(self.train_tail)
        if self.train_tail < 0:
            raise HilaError(f"hila: argument 'train_tail': expected >= 0, got {self.train_tail}", "train_tail")
        if self.task == "mqar":
            for name in ("train_lengths", "eval_needles", "haystack", "train_tail"):
                if getattr(self, name) != IMPLIED[name]:
                    raise HilaError(f"hila: argument '{name}': a niah setting, expected "
                                    f"'{IMPLIED[name]}' for mqar, got '{getattr(self, name)}'", name)
        if self.task == "niah":
            self._check_niah()

    def _check_niah(self) -> None:
        if not self.lengths:
            self.lengths = str(self.seq_len)
        if not self.depths:
            self.depths = ",".join(f"{i / 10:g}" for i in range(11))
        lengths = _int_list_field("lengths", self.lengths)
        if int(self.needles) < 1:
            raise HilaError(f"hila: argument 'needles': expected >= 1, got {self.needles}", "needles")
        # the defaults spelled out are the defaults: one key per experiment
        if self.train_lengths == lengths:
            self.train_lengths = ""
        if self.eval_needles == str(self.needles):
            self.eval_needles = ""
        # a length holds N needles and their queries when its haystack has N 3-token slots
        fits = lambda T, N: (T - data.QUERY_LEN * N) // data.NEEDLE_LEN >= N  # noqa: E731
        train = "train_lengths" if self.train_lengths else "lengths"
        for T in self.train_length_list():
            if not fits(T - self.train_tail, self.needles):
                raise HilaError(f"hila: argument '{train}': {T} tokens less a tail of {self.train_tail} hold no "
                                f"{self.needles} needles and their queries (at least {5 * self.needles})", train)
        name = "eval_needles" if self.eval_needles else "lengths"
        for N in self.eval_needle_list():
            for T in self.length_list():
                if not fits(T, N):
                    raise HilaError(f"hila: argument '{name}': evaluation length {T} holds no {N} "
                                    f"needles and their queries (at least {5 * N} tokens)", name)
        data.check_niah_vocab(self.vocab, self.haystack, max([self.needles] + self.eval_needle_list()), "vocab")
        self.seq_len = max(self.length_list() + self.train_length_list())

    def length_list(self) -> List[int]:
        """niah: the evaluation lengths (and the training lengths unless ``train_lengths``)."""
        return [int(x) for x in str(self.lengths).split(",") if x]

    def train_length_list(self) -> List[int]:
        """niah: the lengths training batches are drawn at."""
        return [int(x) for x in self.train_lengths.split(",") if x] or self.length_list()

    def eval_needle_list(self) -> List[int]:
        """niah: the needle counts evaluated."""
        return [int(x) for x in self.eval_needles.split(",") if x] or [int(self.needles)]

    def depth_list(self) -> List[float]:
        return [float(x) for x in str(self.depths).split(",") if x]

    def key(self) -> str:
        """The run's identity: every field, in order (same key, same experiment), except a field of
        IMPLIED at the value it names: the rows written before that field existed had that value,
        and keep matching their runs."""
        return "|".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                        if not (f.name in IMPLIED and getattr(self, f.name) == IMPLIED[f.name]))

    def label(self) -> str:
        extra = f"kv{self.pairs}" if self.task == "mqar" else f"n{self.needles}"
        if self.task == "niah" and self.train_lengths:
            extra += f" train T{self.train_lengths}"
        if self.task == "niah" and self.haystack != IMPLIED["haystack"]:
            extra += f" {self.haystack}"
        if self.task == "niah" and self.train_tail:
            extra += f" tail{self.train_tail}"
        return f"{self.mixer} d{self.dim} T{self.seq_len} {extra} lr{self.lr:g} s{self.seed}"


def _int_list_field(name: str, value) -> str:
    """A comma list of positive ints (a string, an int, or a sequence of ints) as the comma string
    "a,b,c" ("" for an empty one); anything else is a HilaError naming the field."""
    items = value if isinstance(value, (list, tuple)) else str(value).replace(" ", "").split(",")
    try:
        ints = [int(x) for x in items if str(x) != ""]
        if any(str(x) != "" and float(x) != int(x) for x in items):
            raise ValueError
    except (TypeError, ValueError):
        ints = None
    if ints is None or any(x < 1 for x in ints):
        raise HilaError(f"hila: argument '{name}': expected a comma list of positive integers, got "
                        f"'{value}'", name)
    return ",".join(str(x) for x in ints)


def resolve_device(device: str = "auto") -> torch.device:
    """'auto': the first CUDA device when torch sees one, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    n = torch.get_num_threads()
    return f"cpu ({n} torch thread{'s' if n > 1 else ''})"


def _lr_at(step: int, cfg: RunConfig) -> float:
    """Linear warmup over warmup * steps, then cosine decay to 0."""
    warm = max(1, int(cfg.warmup * cfg.steps))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    t = (step - warm) / max(1, cfg.steps - warm)
    return cfg.lr * 0.5 * (1.0 + math.cos(math.pi * min(t, 1.0)))


def _optimizer(model: torch.nn.Module, cfg: RunConfig, dev: torch.device) -> torch.optim.Optimizer:
    """AdamW; no weight decay on vectors (biases, norms, gates) nor on ``_no_weight_decay`` params.
    On CUDA the fused implementation (one kernel for all parameters), capturable (its step counts
    and, per group, its learning rate are device tensors: no host work per parameter, no
    synchronisation, and the same update eagerly and inside a CUDA graph; :func:`_set_lr` writes the
    schedule's value into the tensors); on the CPU the foreach one (a few vectorised ops instead of
    a Python loop over the parameters)."""
    decay, no_decay = [], []
    for p in model.parameters():
        (no_decay if p.dim() < 2 or getattr(p, "_no_weight_decay", False) else decay).append(p)
    groups = [dict(params=decay, weight_decay=cfg.weight_decay), dict(params=no_decay, weight_decay=0.0)]
    if dev.type == "cuda":
        for group in groups:
            group["lr"] = torch.tensor(cfg.lr, dtype=torch.float32, device=dev)
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), fused=True, capturable=True)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), foreach=True)


def _set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    """The schedule's learning rate for the next update: a float, or written into the groups' device
    tensors (a fill kernel, no synchronisation; a CUDA graph reads the tensor at replay)."""
    for group in opt.param_groups:
        if isinstance(group["lr"], Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def _update(model, opt, ids, pos, target):
    """Forward, backward, gradient clipping at norm 1 and the AdamW step, on gradients that the
    caller has cleared (set to None). Returns the loss and the correct predictions, device tensors."""
    loss, hits = model.loss(ids, pos, target)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.detach(), hits


class _EagerSteps:
    """Training steps run op by op (the CPU, and CUDA with ``cuda_graph=False``)."""

    def __init__(self, model, opt):
        self.model, self.opt = model, opt
        self.graphs = 0

    def __call__(self, ids, pos, target, lr):
        _set_lr(self.opt, lr)
        self.opt.zero_grad(set_to_none=True)
        return _update(self.model, self.opt, ids, pos, target)


class _GraphedSteps(_EagerSteps):
    """Training steps replayed from CUDA graphs: the whole step (forward, backward, clipping, the
    fused AdamW update) is one graph launch instead of some 800-1200 kernel launches from Python,
    which bound the step time of these small models.

    One graph per batch shape (mqar: one; niah: one per training length). The first ``WARM`` steps
    of a shape run eagerly on a side stream (lazy initialisations -- cuBLAS workspaces, the
    optimizer's state, autograd's buffers -- must happen outside a capture); the next step of that
    shape is captured, and it and every later one copy their batch into the graph's static inputs
    and replay it. The gradients are allocated inside the capture, from the graph's private memory
    pool, so that each replay reads the gradients its own backward wrote. Each graph has its own
    pool: the niah graphs replay in a random order, which a shared pool would not allow. The
    returned loss and hits are the graph's static outputs, overwritten by its next replay."""

    WARM = 3

    def __init__(self, model, opt, dev):
        super().__init__(model, opt)
        self.side = torch.cuda.Stream(dev)
        self.seen, self.captured = {}, {}

    def __call__(self, ids, pos, target, lr):
        _set_lr(self.opt, lr)
        shape = (tuple(ids.shape), tuple(pos.shape))
        entry = self.captured.get(shape)
        if entry is None:
            self.seen[shape] = self.seen.get(shape, 0) + 1
            if self.seen[shape] <= self.WARM:
                self.side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(self.side):
                    out = super().__call__(ids, pos, target, lr)
                torch.cuda.current_stream().wait_stream(self.side)
                return out
            static = (ids.clone(), pos.clone(), target.clone())
            graph = torch.cuda.CUDAGraph()
            self.opt.zero_grad(set_to_none=True)
            with torch.cuda.graph(graph):
                loss, hits = _update(self.model, self.opt, *static)
            entry = self.captured[shape] = (graph, static, loss, hits)
            self.graphs += 1
        graph, static, loss, hits = entry
        for dst, src in zip(static, (ids, pos, target)):
            dst.copy_(src)
        graph.replay()
        return loss, hits


def _progress(total: int, desc: str, position: int, enabled: bool):
    """A tqdm bar on stderr (redrawn every 0.5 s on a terminal, every 30 s into a log); without
    tqdm installed, a line every 10% of the steps."""
    tty = sys.stderr.isatty()
    try:
        from tqdm import tqdm
    except ImportError:
        return _Lines(total, desc, enabled)
    return tqdm(total=total, desc=desc, position=position, leave=position == 0, disable=not enabled,
                mininterval=0.5 if tty else 30.0, dynamic_ncols=True, file=sys.stderr)


class _Lines:
    """The part of tqdm's interface the training loop uses, printing plain lines."""

    def __init__(self, total: int, desc: str, enabled: bool):
        self.total, self.desc, self.enabled = total, desc, enabled
        self.n, self.next, self.postfix, self.t0 = 0, max(1, total // 10), {}, time.time()

    def set_postfix(self, values, refresh=True):
        self.postfix = dict(values)

    def update(self, k: int) -> None:
        self.n += k
        if self.enabled and (self.n >= self.next or self.n == self.total):
            self.next = self.n + max(1, self.total // 10)
            shown = " ".join(f"{k}={v}" for k, v in self.postfix.items())
            print(f"{self.desc}: {self.n}/{self.total} {time.time() - self.t0:.0f}s {shown}", file=sys.stderr,
                  flush=True)

    def close(self) -> None:
        pass


class _Task:
    """Training batches and evaluation of one task on one device."""

    def __init__(self, cfg: RunConfig, dev: torch.device):
        self.cfg, self.dev = cfg, dev

    def batch(self, step: int):
        raise NotImplementedError

    def evaluate(self, model, cells: bool = False) -> Dict:
        """{"acc": accuracy} (and "cells", the per-cell rows of niah, when ``cells``)."""
        raise NotImplementedError

    def state(self) -> Dict:
        """What decides the batches still to come (for a checkpoint)."""
        raise NotImplementedError

    def load_state(self, state: Dict) -> None:
        raise NotImplementedError


class _MQAR(_Task):
    def __init__(self, cfg, dev):
        super().__init__(cfg, dev)
        kw = dict(seq_len=cfg.seq_len, num_pairs=cfg.pairs, vocab_size=cfg.vocab, power_a=cfg.power_a,
                  random_non_queries=cfg.random_non_queries, device=dev)
        ids, labels = data.mqar(cfg.train_examples, seed=cfg.seed, **kw)
        self.train = (ids, *data.labelled(labels))
        ids, labels = data.mqar(cfg.eval_examples, seed=cfg.seed + 1_000_003, **kw)
        self.test = (ids, *data.labelled(labels))
        self.gen = torch.Generator(device=dev).manual_seed(cfg.seed)
        self.order, self.at = None, 0

    def batch(self, step):
        n, B = self.train[0].shape[0], self.cfg.batch
        if self.order is None or self.at + B > n:  # a new epoch: reshuffle
            self.order, self.at = torch.randperm(n, generator=self.gen, device=self.dev), 0
        idx = self.order[self.at:self.at + B]
        self.at += B
        return tuple(t[idx] for t in self.train)

    def state(self):
        return dict(gen=self.gen.get_state(), order=None if self.order is None else self.order.cpu(), at=self.at)

    def load_state(self, state):
        self.gen.set_state(state["gen"])
        self.order = None if state["order"] is None else state["order"].to(self.dev)
        self.at = state["at"]

    @torch.no_grad()
    def evaluate(self, model, cells=False):
        correct, total = _score(model, *self.test, self.cfg.batch)
        return {"acc": correct / total}


class _NIAH(_Task):
    def __init__(self, cfg, dev):
        super().__init__(cfg, dev)
        self.rng = random.Random(cfg.seed)
        self.train_lengths = cfg.train_length_list()

    def batch(self, step):
        T = self.rng.choice(self.train_lengths)
        tail = self.rng.randint(0, self.cfg.train_tail) if self.cfg.train_tail else 0
        b = data.niah(self.cfg.batch, T, self.cfg.needles, self.cfg.vocab, seed=self.cfg.seed * 1_000_003 + step,
                      haystack=self.cfg.haystack, tail=tail, device=self.dev)
        return b.inputs, b.pos, b.target

    def state(self):
        return dict(rng=self.rng.getstate())

    def load_state(self, state):
        self.rng.setstate(state["rng"])

    @torch.no_grad()
    def evaluate(self, model, cells: bool = False):
        """Probe accuracy (needle 0 at the cell's depth) and all-needle accuracy per cell (needle
        count evaluated x length x depth), the cells' rows when ``cells``; "acc" is the mean probe
        accuracy over all cells. The evaluation sequences depend only on the cell (its needle
        count's, length's and depth's places in the run's lists) and the haystack, never on the
        run's seed or mixer: the runs of one grid see the same sequences.

        Sequences longer than the longest training length are evaluated in smaller batches, of at
        most ``batch`` x that length tokens (the training step's), so that evaluating 8K tokens
        after training at 1K needs no more memory than training."""
        out, accs = [], []
        longest = max(self.train_lengths)
        for k, N in enumerate(self.cfg.eval_needle_list()):
            for i, T in enumerate(self.cfg.length_list()):
                batch = min(self.cfg.batch, max(1, self.cfg.batch * longest // T))
                for j, d in enumerate(self.cfg.depth_list()):
                    b = data.niah(self.cfg.eval_examples, T, N, self.cfg.vocab,
                                  seed=10_000_019 + 100_000 * k + 1000 * i + j, depth=d,
                                  haystack=self.cfg.haystack, device=self.dev)
                    probe = b.needle.gather(1, b.pos) == 0                               # [n, N]
                    hits = _hits(model, b.inputs, b.pos, b.target, batch)
                    acc = hits[probe].float().mean().item()
                    accs.append(acc)
                    out.append(dict(eval_needles=N, eval_len=T, depth=d, cell_acc=round(acc, 5),
                                    cell_acc_all=round(hits.float().mean().item(), 5)))
        res = {"acc": sum(accs) / len(accs)}
        if cells:
            res["cells"] = out
        return res


def _hits(model, ids, pos, target, batch) -> Tensor:
    """Correct argmax predictions (bool [n, k]), in batches."""
    model.eval()
    hits = torch.cat([model.loss(ids[i:i + batch], pos[i:i + batch], target[i:i + batch])[1]
                      for i in range(0, ids.shape[0], batch)])
    model.train()
    return hits


def _score(model, ids, pos, target, batch):
    hits = _hits(model, ids, pos, target, batch)
    return int(hits.sum()), hits.numel()


def run(cfg: RunConfig, device="auto", progress: bool = True, position: int = 0,
        cuda_graph: bool = False, checkpoint: Optional[Path] = None, checkpoint_seconds: float = 60.0) -> List[Dict]:
    """Trains and evaluates one run. Returns its result rows: one for mqar; one per (needle count
    evaluated, evaluation length, depth) cell for niah (the run's fields repeated in each; the
    cell's columns ``eval_needles``, ``eval_len``, ``depth``, ``cell_acc``, ``cell_acc_all``; so in
    a niah row ``eval_needles`` is the cell's needle count, the run's list being in its ``key``).

    A run whose loss stops being finite ends there with ``status`` 'diverged' and accuracy 0 (a
    result of that learning rate, kept so that the run is not repeated); otherwise 'ok'.

    The training loop never waits for the device between its logging points: the loss and the
    batch accuracy are read back (one synchronisation) every ``log_every`` steps and at each
    evaluation, nowhere else. On CUDA, float32 matrix products use TF32 tensor cores
    (``torch.set_float32_matmul_precision("high")``, restored afterwards; the ``matmul`` column).
    ``ms_per_step`` is measured after the first ``warmup_steps(cfg)`` steps (kernel loading,
    allocator growth, the first graph capture), without the evaluations.

    ``cuda_graph`` (CUDA only): replay each training step from a CUDA graph (:class:`_GraphedSteps`;
    the same updates as the eager steps, without their per-kernel launch cost). The row's
    ``cuda_graph`` column says whether it did (not part of the run's key: it changes the speed,
    not the experiment).

    ``checkpoint``: a file for the run's training state (module docstring). The run starts from it
    when it holds a state of this run's key (another key's or an unreadable file is ignored, with a
    note on stderr) and saves there at the first logging point ``checkpoint_seconds`` or more after
    its start or last save (0: at every one; it is written whole, then renamed over the old one).
    The caller removes it once the rows are kept. A resumed run leaves the first
    ``warmup_steps(cfg)`` steps after the resume out of ``ms_per_step`` too, and its ``wall_s``
    adds the times of its parts.
    """
    t_start = time.perf_counter()
    dev = resolve_device(device) if isinstance(device, str) else device
    if dev.type == "cuda":
        dev = torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())
        torch.cuda.set_device(dev)
    precision = torch.get_float32_matmul_precision()
    if dev.type == "cuda":
        torch.set_float32_matmul_precision("high")
    try:
        ck = _Checkpoint(Path(checkpoint), checkpoint_seconds) if checkpoint is not None else None
        return _run(cfg, dev, progress, position, t_start, cuda_graph, ck)
    finally:
        torch.set_float32_matmul_precision(precision)


def warmup_steps(cfg: RunConfig) -> int:
    """Steps left out of ``ms_per_step``: the first 10 (fewer in short runs)."""
    return min(10, max(0, cfg.steps // 10))


class _Checkpoint:
    """Where and how often a run saves its training state (:func:`run`'s ``checkpoint``)."""

    def __init__(self, path: Path, seconds: float):
        if not seconds >= 0:
            raise HilaError(f"checkpoint_seconds: expected a number >= 0, got {seconds}", "checkpoint_seconds")
        self.path, self.seconds, self.last = path, seconds, time.monotonic()

    def due(self) -> bool:
        return time.monotonic() - self.last >= self.seconds

    def save(self, state: Dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        torch.save(state, tmp)
        os.replace(tmp, self.path)  # a stop while saving leaves the previous checkpoint whole
        self.last = time.monotonic()


def load_checkpoint(path: Path, key: str) -> Optional[Dict]:
    """The training state saved at path for the run of this key; None when there is none, it is
    another run's or it cannot be read (noted on stderr)."""
    path = Path(path)
    if not path.exists():
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # a file cut short by a full disk, another format: train from the start
        print(f"hila.experiments: ignoring unreadable checkpoint {path}: {e}", file=sys.stderr, flush=True)
        return None
    if not isinstance(state, dict) or state.get("key") != key:
        print(f"hila.experiments: ignoring checkpoint {path}: another run's", file=sys.stderr, flush=True)
        return None
    return state


def _build(cfg: RunConfig, dev: torch.device):
    """A run's model (initialised from its seed), task (data) and optimizer, before any step."""
    torch.manual_seed(cfg.seed)
    model = RecallLM(cfg.vocab, cfg.dim, cfg.mixer, cfg.seq_len, num_layers=cfg.layers, init_std=cfg.init_std,
                     tie_embeddings=cfg.tie_embeddings,
                     shape=MixerShape(head_dim=cfg.head_dim, state_size=cfg.state_size)).to(dev)
    task = (_MQAR if cfg.task == "mqar" else _NIAH)(cfg, dev)
    return model, task, _optimizer(model, cfg, dev)


def _run(cfg: RunConfig, dev: torch.device, progress: bool, position: int, t_start: float,
         cuda_graph: bool, ck: Optional[_Checkpoint] = None) -> List[Dict]:
    model, task, opt = _build(cfg, dev)
    log_every = max(1, min(100, cfg.steps // 20))
    final, curve, status = {}, [], "ok"
    loss_sum, loss_n, shown = None, 0, dict(loss="-", acc="-", eval="-")
    # the parts before a resume: timed steps, their seconds, wall seconds
    done, before = 0, dict(timed=0, train_s=0.0, wall_s=0.0)
    saved = load_checkpoint(ck.path, cfg.key()) if ck is not None else None
    if saved is not None:
        try:
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            for group in opt.param_groups:  # the capturable optimizer's learning rates live on the device
                if isinstance(group["lr"], Tensor):
                    group["lr"] = group["lr"].to(dev)
            task.load_state(saved["task"])
            torch.set_rng_state(saved["rng"])
            if dev.type == "cuda" and saved.get("cuda_rng") is not None:
                torch.cuda.set_rng_state(saved["cuda_rng"], dev)
            done, before, curve, shown, final = (saved["step"], saved["timing"], saved["curve"], saved["shown"],
                                                 saved["final"])
            loss_n = saved["loss_n"]
            loss_sum = None if saved["loss_sum"] is None else saved["loss_sum"].to(dev)
            print(f"hila.experiments: {cfg.label()}: resuming after step {done}", file=sys.stderr, flush=True)
        except Exception as e:  # a state this code cannot take (the model changed since): start over
            print(f"hila.experiments: ignoring checkpoint {ck.path} that does not fit this run: {e}",
                  file=sys.stderr, flush=True)
            model, task, opt = _build(cfg, dev)
            final, curve, loss_sum, loss_n, shown = {}, [], None, 0, dict(loss="-", acc="-", eval="-")
            done, before = 0, dict(timed=0, train_s=0.0, wall_s=0.0)
    steps = _GraphedSteps(model, opt, dev) if cuda_graph and dev.type == "cuda" else _EagerSteps(model, opt)
    warm = done + warmup_steps(cfg)  # this part's timed steps start after its own warm-up
    bar = _progress(cfg.steps, cfg.label(), position, progress)
    if done:
        bar.update(done)
    _sync(dev)
    t_part = time.perf_counter()
    t_timed, excluded, timed_from = t_part, 0.0, done  # excluded: evaluations and saves

    def timing(step: int) -> Dict:
        """The run's timing after ``step`` (a synchronised point): this part's and the earlier ones'."""
        timed, train_s = step - timed_from, time.perf_counter() - t_timed - excluded
        return dict(timed=before["timed"] + timed, train_s=before["train_s"] + train_s,
                    wall_s=before["wall_s"] + time.perf_counter() - t_start)

    step = done
    for step in range(done + 1, cfg.steps + 1):
        ids, pos, target = task.batch(step)
        loss, hits = steps(ids, pos, target, _lr_at(step - 1, cfg))
        loss_sum = loss.clone() if loss_sum is None else loss_sum + loss  # (a graph's loss is overwritten)
        loss_n += 1
        if step == warm:  # the timed steps start after the warm-up
            _sync(dev)
            t_timed, excluded, timed_from = time.perf_counter(), 0.0, warm
        is_eval = step % cfg.eval_every == 0 or step == cfg.steps
        if step % log_every and not is_eval:
            continue
        # the loop's only host reads: one synchronisation per log_every steps
        mean_loss, batch_acc = torch.stack([loss_sum.float() / loss_n, hits.float().mean()]).tolist()
        if not math.isfinite(mean_loss):
            status = "diverged"
            curve.append(f"{step}:nan:0")
            break
        shown.update(loss=f"{mean_loss:.3f}", acc=f"{batch_acc:.3f}")
        if is_eval:
            t0 = time.perf_counter()
            final = task.evaluate(model, cells=step == cfg.steps)
            excluded += time.perf_counter() - t0
            curve.append(f"{step}:{mean_loss:.4f}:{final['acc']:.4f}")
            shown["eval"] = f"{final['acc']:.3f}"
            loss_sum, loss_n = None, 0
        bar.set_postfix(shown, refresh=False)
        bar.update(step - bar.n)
        if ck is not None and step < cfg.steps and ck.due():
            t0 = time.perf_counter()
            ck.save(dict(key=cfg.key(), step=step, model=model.state_dict(), opt=opt.state_dict(),
                         task=task.state(), rng=torch.get_rng_state(),
                         cuda_rng=torch.cuda.get_rng_state(dev) if dev.type == "cuda" else None,
                         timing=timing(step), curve=list(curve), shown=dict(shown), final=final, loss_n=loss_n,
                         loss_sum=None if loss_sum is None else loss_sum.detach().cpu()))
            excluded += time.perf_counter() - t0
    _sync(dev)
    total = timing(step)
    bar.close()
    if status == "diverged":
        final = {"acc": 0.0, "cells": [dict(eval_needles=N, eval_len=T, depth=d, cell_acc=0.0, cell_acc_all=0.0)
                                       for N in cfg.eval_needle_list() for T in cfg.length_list()
                                       for d in cfg.depth_list()]}
    row = dict(dataclasses.asdict(cfg))
    row.update(key=cfg.key(), status=status, acc=round(final["acc"], 5),
               best_acc=round(max(float(c.split(":")[2]) for c in curve), 5),
               final_loss=curve[-1].split(":")[1], curve=" ".join(curve), params=model.num_params(),
               ms_per_step=round(1000 * total["train_s"] / max(1, total["timed"]), 3),
               wall_s=round(total["wall_s"], 2), device=device_name(dev),
               cuda_graph=steps.graphs > 0,
               matmul=("tf32" if dev.type == "cuda" and torch.get_float32_matmul_precision() != "highest"
                       else "fp32"),
               torch=torch.__version__, finished=time.strftime("%Y-%m-%dT%H:%M:%S"))
    if cfg.task == "mqar":
        return [row]
    return [dict(row, **cell) for cell in final["cells"]]


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
