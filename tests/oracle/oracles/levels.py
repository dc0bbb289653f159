# SPDX-License-Identifier: Apache-2.0
"""Fenwick levels of log-linear attention (docs/math/LOGLINEAR.md §2), in exact integer arithmetic.

Positions are absolute, 0-indexed Python ints (any size; numpy int64 arrays where vectorised).
"""
import numpy as np


def bitlen(x):
    """bitlen(x) = floor(log2 x) + 1, bitlen(0) = 0 (integer, exact at every size)."""
    return int(x).bit_length()


def bitlen_array(x):
    """elementwise bitlen of a non-negative int64 array, by repeated shifts (exact, no float log)."""
    y = np.array(x, dtype=np.int64, copy=True)
    assert y.size == 0 or y.min() >= 0
    out = np.zeros(y.shape, dtype=np.int64)
    while np.any(y > 0):
        out += y > 0
        y >>= 1
    return out


def level(t, s):
    """ℓ(t, s) = bitlen(t XOR s) for s ≤ t: 0 on the diagonal (§2.1)."""
    assert 0 <= s <= t
    return bitlen(int(t) ^ int(s))


def ctz(n):
    """number of trailing zero bits of n > 0."""
    n = int(n)
    assert n > 0
    return (n & -n).bit_length() - 1


def sigma(n, l):
    """first position of bucket B_l(n) = [σ_l(n), σ_l(n) + 2^(l-1)) (§2.2)."""
    return (int(n) >> l) << l


def live_levels(n):
    """levels l ≥ 1 whose bucket B_l(n) is non-empty: the set bits l-1 of n (§2.2)."""
    n = int(n)
    return [l for l in range(1, n.bit_length() + 1) if (n >> (l - 1)) & 1]


def bucket(n, l):
    """B_l(n) as a range of positions (empty unless l is live at n)."""
    if l not in live_levels(n):
        return range(0)
    return range(sigma(n, l), sigma(n, l) + (1 << (l - 1)))


def levels_needed(n0, T):
    """λ levels read by queries at positions n0 … n0+T-1: bitlen(n0+T-1) + 1, 0 for T = 0 (§2.3)."""
    return 0 if T == 0 else bitlen(int(n0) + int(T) - 1) + 1


def state_slots(n):
    """slots of the canonical state at position n: bitlen(n) + 1 (slot = level; §2.5)."""
    return bitlen(n) + 1


def level_matrix(n0, T):
    """LV[i, j] = ℓ(n0+i, n0+j) for j ≤ i, -1 above the diagonal ([T, T] int64)."""
    pos = np.arange(T, dtype=np.int64) + np.int64(n0)
    LV = bitlen_array(pos[:, None] ^ pos[None, :])
    return np.where(np.tril(np.ones((T, T), dtype=bool)), LV, -1)


def read_levels(n0, T, l):
    """level at which rows n0 … n0+T-1 read bucket l of the state at n0: ℓ(t, σ_l(n0)) (§2.4)."""
    pos = np.arange(T, dtype=np.int64) + np.int64(n0)
    return bitlen_array(pos ^ np.int64(sigma(n0, l)))
