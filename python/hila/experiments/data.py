# SPDX-License-Identifier: Apache-2.0
"""Synthetic recall tasks: multi-query associative recall (MQAR, as in Zoology) and needle in a
haystack (NIAH). Both return ``inputs`` int64 [n, T] and ``labels`` int64 [n, T], with
``IGNORE`` (-100) everywhere except at the positions whose next token the model must produce.

Every generator is vectorized torch code on a given device, seeded by a ``torch.Generator`` of that
device: the same (arguments, seed, device type) gives the same examples.
"""
from __future__ import annotations

from typing import Dict, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from .._errors import HilaError

__all__ = ["IGNORE", "ZOOLOGY_PAIRS", "pairs_for_length", "mqar", "niah", "NEEDLE", "QUERY",
           "NIAH_FIRST_KEY", "HAYSTACKS", "niah_vocab", "NIAHBatch", "labelled"]

IGNORE = -100

# Key-value pairs per sequence length in Zoology's MQAR sweeps (64 -> 4, 128 -> 8, 256 -> 16,
# 512 -> 64); 1024 -> 256 is Zoology's longest MQAR test configuration. Every entry satisfies
# 4 * pairs <= T, Zoology's bound (two tokens per pair, and at least as many query slots).
ZOOLOGY_PAIRS: Dict[int, int] = {64: 4, 128: 8, 256: 16, 512: 64, 1024: 256}

_ROWS_PER_DRAW = 1 << 24  # bound on the [rows, choices] random matrix of one distinct-sample draw


def pairs_for_length(seq_len: int) -> int:
    """Zoology's number of key-value pairs for an MQAR sequence of ``seq_len`` tokens."""
    if seq_len not in ZOOLOGY_PAIRS:
        raise HilaError(f"hila: argument 'seq_len': Zoology's MQAR pairs are known for lengths "
                        f"{sorted(ZOOLOGY_PAIRS)}, got {seq_len}; give the pairs explicitly",
                        "seq_len")
    return ZOOLOGY_PAIRS[seq_len]


def labelled(labels: Tensor) -> Tuple[Tensor, Tensor]:
    """The labelled positions of every row (labels != IGNORE, the same count k in each row) and
    their labels: (pos [n, k], target [n, k]) int64, positions ascending."""
    mask = labels != IGNORE
    counts = mask.sum(1)
    k = int(counts[0]) if counts.numel() else 0
    if k == 0 or bool((counts != k).any()):
        raise HilaError("hila: argument 'labels': expected the same positive number of labelled "
                        f"positions in every row, got counts from {int(counts.min())} to "
                        f"{int(counts.max())}", "labels")
    pos = torch.sort(torch.where(mask, torch.arange(labels.shape[1], device=labels.device), labels.shape[1]),
                     dim=1).values[:, :k]
    return pos, labels.gather(1, pos)


def _generator(seed: int, device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(int(seed))


def _distinct(n: int, k: int, m: int, gen: torch.Generator, device,
              weights: Optional[Tensor] = None) -> Tensor:
    """n rows of k distinct integers from [0, m), int64 [n, k] in random order.

    Uniform: the top-k of uniform noise; with ``weights`` [m] (> 0): sampling without replacement
    with probabilities proportional to the weights, by the Gumbel top-k trick
    (argmax of log w + Gumbel noise, repeated without the chosen ones).
    Drawn in row blocks so that one block's [rows, m] noise stays below _ROWS_PER_DRAW entries.
    """
    out = torch.empty(n, k, dtype=torch.int64, device=device)
    step = max(1, _ROWS_PER_DRAW // max(m, 1))
    logw = None if weights is None else weights.log().to(device)
    for r in range(0, n, step):
        rows = min(step, n - r)
        u = torch.rand(rows, m, generator=gen, device=device)
        if logw is not None:
            u = logw - torch.log(-torch.log(u.clamp_min(1e-20)))      # Gumbel(log w)
        out[r:r + rows] = u.topk(k, dim=1).indices
    return out


def mqar(n: int, seq_len: int, num_pairs: int, vocab_size: int = 8192, seed: int = 0,
         power_a: float = 0.01, random_non_queries: bool = False,
         device="cpu") -> Tuple[Tensor, Tensor]:
    """Multi-query associative recall, following Zoology's generator (Arora et al. 2023).

    Layout of one example of T = seq_len tokens with K = num_pairs:

        positions 0 .. 2K-1:  k_1 v_1 k_2 v_2 ... k_K v_K      (keys distinct, values distinct)
        positions 2K .. T-1:  every key once more, as a query, at position 2K + 2 gap_i; the label
                              at that position is its value (the model predicts it as the next token)

    Keys come from [1, V/2), values from [V/2, V) (V = vocab_size); the other positions hold 0, or
    random tokens of the whole vocabulary with ``random_non_queries``. The gaps are K distinct draws
    from {0, ..., (T - 2K)/2 - 1} with probability proportional to (gap + 1)^(power_a - 1): with
    Zoology's power_a = 0.01 most queries come soon after the pairs, a few far away.

    Returns (inputs [n, T], labels [n, T]) int64, labels IGNORE except at the K query positions.
    """
    T, K, V = int(seq_len), int(num_pairs), int(vocab_size)
    if T < 4 or T % 2:
        raise HilaError(f"hila: argument 'seq_len': expected an even length >= 4, got {T}", "seq_len")
    if K < 1 or 4 * K > T:
        raise HilaError(f"hila: argument 'num_pairs': expected 1 <= pairs <= seq_len / 4 = {T // 4}, "
                        f"got {K}", "num_pairs")
    if V // 2 - 1 < K:
        raise HilaError(f"hila: argument 'vocab_size': expected at least {K} keys in [1, V/2), got "
                        f"V = {V}", "vocab_size")
    if n < 1:
        raise HilaError(f"hila: argument 'n': expected >= 1 examples, got {n}", "n")
    if not power_a > 0:
        raise HilaError(f"hila: argument 'power_a': expected > 0, got {power_a}", "power_a")
    gen = _generator(seed, device)
    keys = _distinct(n, K, V // 2 - 1, gen, device) + 1                          # [n, K] in [1, V/2)
    values = _distinct(n, K, V - V // 2, gen, device) + V // 2                   # [n, K] in [V/2, V)
    space = (T - 2 * K) // 2
    w = torch.arange(1, space + 1, dtype=torch.float64) ** (power_a - 1.0)
    gaps = _distinct(n, K, space, gen, device, weights=w)                        # [n, K]
    inputs = torch.zeros(n, T, dtype=torch.int64, device=device)
    labels = torch.full((n, T), IGNORE, dtype=torch.int64, device=device)
    inputs[:, 0:2 * K:2], inputs[:, 1:2 * K:2] = keys, values
    qpos = 2 * K + 2 * gaps                                                      # [n, K]
    inputs.scatter_(1, qpos, keys)
    labels.scatter_(1, qpos, values)
    if random_non_queries:
        filler = torch.randint(0, V, (n, T), generator=gen, device=device)
        inputs = torch.where(inputs == 0, filler, inputs)
    return inputs, labels


# Needle in a haystack vocabulary: 0 unused, the NEEDLE and QUERY markers, then from NIAH_FIRST_KEY
# on the keys, the values and (haystack "filler") the filler tokens: see niah_vocab.
NEEDLE, QUERY, NIAH_FIRST_KEY = 1, 2, 3
NEEDLE_LEN, QUERY_LEN = 3, 2
HAYSTACKS = ("kv", "filler")


def niah_vocab(vocab_size: int, haystack: str = "kv") -> Dict[str, Tuple[int, int]]:
    """The token ranges [lo, hi) of a needle in a haystack vocabulary of V = vocab_size tokens:
    {"keys", "values", "haystack"}.

    haystack "kv": keys and values take half of [NIAH_FIRST_KEY, V) each (h = (V - 3) // 2 tokens),
    and the haystack is drawn from both (keys and values also occur as distractors).
    haystack "filler": keys, values and filler take a third each (t = (V - 3) // 3 tokens; the
    filler also the remainder), and the haystack is drawn from the filler only, disjoint from keys
    and values: a key occurs in a sequence only in its needle and its query.
    """
    V = int(vocab_size)
    if haystack not in HAYSTACKS:
        raise HilaError(f"hila: argument 'haystack': expected one of {', '.join(HAYSTACKS)}, got "
                        f"'{haystack}'", "haystack")
    F = NIAH_FIRST_KEY
    if haystack == "kv":
        h = max(0, (V - F) // 2)
        return dict(keys=(F, F + h), values=(F + h, F + 2 * h), haystack=(F, F + 2 * h))
    t = max(0, (V - F) // 3)
    return dict(keys=(F, F + t), values=(F + t, F + 2 * t), haystack=(F + 2 * t, V))


def check_niah_vocab(vocab_size: int, haystack: str, needles: int, name: str) -> Dict[str, Tuple[int, int]]:
    """:func:`niah_vocab`'s ranges, where they hold ``needles`` distinct keys and some values and
    haystack tokens; a HilaError naming ``name`` (the vocabulary's argument) otherwise."""
    ranges = niah_vocab(vocab_size, haystack)
    (k_lo, k_hi), (v_lo, v_hi), (h_lo, h_hi) = ranges["keys"], ranges["values"], ranges["haystack"]
    if k_hi - k_lo < needles or v_hi <= v_lo or h_hi <= h_lo:
        per = 2 if haystack == "kv" else 3
        raise HilaError(f"hila: argument '{name}': expected at least {NIAH_FIRST_KEY + per * needles} "
                        f"tokens for {needles} needles with haystack '{haystack}', got {vocab_size}", name)
    return ranges


class NIAHBatch(NamedTuple):
    inputs: Tensor     # [n, T] int64
    labels: Tensor     # [n, T] int64, IGNORE except at the query keys
    depth: Tensor      # [n, T] float64: depth of the asked needle at a query key, NaN elsewhere
    needle: Tensor     # [n, T] int64: index of the asked needle (0: the probe), -1 elsewhere
    pos: Tensor        # [n, N] int64: the query key positions (labelled(labels)[0], without a sync)
    target: Tensor     # [n, N] int64: their labels


def niah(n: int, seq_len: int, num_needles: int = 1, vocab_size: int = 8192, seed: int = 0,
         depth: Optional[float] = None, haystack: str = "kv", tail: int = 0, device="cpu") -> "NIAHBatch":
    """Synthetic needle in a haystack with ``num_needles`` key-value needles and one query each.

    Layout of one example of T = seq_len tokens with N = num_needles:

        haystack of H = T - 2N tokens holding N needles ``NEEDLE key value`` (3 tokens each,
        distinct keys, values drawn with replacement, non-overlapping, at slots of 3 tokens:
        positions 3s, 3s + 1, 3s + 2 for slot s < H // 3);
        then N queries ``QUERY key`` in random order at positions H + 2j, H + 2j + 1; the label at
        each query's key (H + 2j + 1) is its needle's value, every other label is IGNORE.

    The haystack's other tokens are drawn uniformly from the range that ``haystack`` names
    (:func:`niah_vocab`): "kv", the key and value tokens (keys and values also occur as
    distractors, so a query's key can occur in the haystack outside its needle); "filler", a range
    of the vocabulary disjoint from keys and values (a key occurs only in its needle and its
    query).

    The depth of a needle is the position of its NEEDLE marker over the last position a needle can
    start at (0: first token, 1: right before the queries). ``depth=None`` places every needle at a
    uniformly random slot; ``depth=d`` places needle 0 (the probe) at the slot nearest to depth d
    and the others at random slots.

    ``tail``: that many haystack tokens after the queries (labels IGNORE); the first
    T - tail tokens are the layout above for a sequence of T - tail tokens. Training batches with
    a random tail put their query block at varying positions, so that the needles before it take
    every Fenwick level of the query keys (log-linear mixers weight each level by its own lambda;
    with the queries always in the last, aligned block of the sequence, a needle is never at the
    low levels of its query in training; docs/EXPERIMENTS.md, "Needle in a haystack").

    Returns a :class:`NIAHBatch`: inputs, labels [n, T] int64; at each query position the depth of
    the needle it asks for (float64 [n, T], NaN elsewhere) and that needle's index (int64 [n, T],
    -1 elsewhere; 0 is the probe); the query positions and their labels [n, N].
    """
    T, N, V, tail = int(seq_len), int(num_needles), int(vocab_size), int(tail)
    if not 0 <= tail < T:
        raise HilaError(f"hila: argument 'tail': expected 0 <= tail < seq_len = {T}, got {tail}", "tail")
    if tail:  # the layout of T - tail tokens (which checks the other arguments), then the tail
        b = niah(n, T - tail, N, V, seed=seed, depth=depth, haystack=haystack, device=device)
        h_lo, h_hi = niah_vocab(V, haystack)["haystack"]
        pad = torch.randint(h_lo, h_hi, (n, tail), generator=_generator(seed + 7_919, device), device=device)
        ends = dict(inputs=pad, labels=torch.full_like(pad, IGNORE), needle=torch.full_like(pad, -1),
                    depth=torch.full(pad.shape, float("nan"), dtype=torch.float64, device=device))
        return b._replace(**{k: torch.cat([getattr(b, k), v], 1) for k, v in ends.items()})
    if N < 1:
        raise HilaError(f"hila: argument 'num_needles': expected >= 1, got {N}", "num_needles")
    slots = (T - QUERY_LEN * N) // NEEDLE_LEN
    if slots < N:
        raise HilaError(f"hila: argument 'seq_len': {T} tokens hold no {N} needles and their queries",
                        "seq_len")
    ranges = check_niah_vocab(V, haystack, N, "vocab_size")
    (k_lo, k_hi), (v_lo, v_hi), (h_lo, h_hi) = ranges["keys"], ranges["values"], ranges["haystack"]
    if depth is not None and not 0.0 <= depth <= 1.0:
        raise HilaError(f"hila: argument 'depth': expected a fraction in [0, 1], got {depth}", "depth")
    if n < 1:
        raise HilaError(f"hila: argument 'n': expected >= 1 examples, got {n}", "n")
    gen = _generator(seed, device)
    H = T - QUERY_LEN * N                                                        # haystack length
    inputs = torch.randint(h_lo, h_hi, (n, T), generator=gen, device=device)
    labels = torch.full((n, T), IGNORE, dtype=torch.int64, device=device)
    keys = _distinct(n, N, k_hi - k_lo, gen, device) + k_lo                      # [n, N]
    values = torch.randint(v_lo, v_hi, (n, N), generator=gen, device=device)
    if depth is None:
        slot = _distinct(n, N, slots, gen, device)                               # [n, N]
    else:
        probe = round(depth * (slots - 1))
        # The other needles take distinct slots among the slots - 1 others: draw from [0, slots-1)
        # and shift those at or past the probe by one.
        rest = _distinct(n, N - 1, slots - 1, gen, device)
        rest = rest + (rest >= probe).to(rest.dtype)
        slot = torch.cat([torch.full((n, 1), probe, dtype=torch.int64, device=device), rest], 1)
    start = slot * NEEDLE_LEN                                                    # [n, N]
    inputs.scatter_(1, start, torch.full_like(start, NEEDLE))
    inputs.scatter_(1, start + 1, keys)
    inputs.scatter_(1, start + 2, values)
    order = _distinct(n, N, N, gen, device)                      # [n, N]: query j asks needle order[:, j]
    qkey = H + QUERY_LEN * torch.arange(N, device=device) + 1                    # [N] key positions
    inputs[:, qkey - 1] = QUERY
    inputs[:, qkey] = keys.gather(1, order)
    labels[:, qkey] = values.gather(1, order)
    needle = torch.full((n, T), -1, dtype=torch.int64, device=device)
    needle[:, qkey] = order
    depth_of = start.double() / max(H - NEEDLE_LEN, 1)                           # [n, N]
    depths = torch.full((n, T), float("nan"), dtype=torch.float64, device=device)
    depths[:, qkey] = depth_of.gather(1, order)
    pos = qkey.expand(n, N)
    return NIAHBatch(inputs, labels, depths, needle, pos, labels.gather(1, pos))
