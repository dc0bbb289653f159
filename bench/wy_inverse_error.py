# SPDX-License-Identifier: Apache-2.0
"""Float32 error of the WY kernel's gated inverse Tg = (I + A)^-1, by row substitution and by doubling.

A = tril_-1(diag(beta) (Gam o K K^T)) for one chunk of C = 64 rows (docs/math/LOGLINEAR.md §6.4):
K rows l2-normalised and rounded to bf16 (gdn with qk_l2norm), beta ~ U(0, 1), log-gates g with
Gam_ij = e^{b_i - b_j}, b the chunk-local cumsum. Both inversions run in float32 as wy_kernel
(src/cuda/delta/wy_sm80.cu) orders them:

  * substitution: row i of Tg = e_i - sum_{m<i} A[i, m] Tg[m], the rows one after the other;
  * doubling: the four 16 x 16 diagonal blocks by that substitution, then for n = 16 (two pairs) and
    n = 32 (one pair) of n x n blocks Tg_21 = -Tg_22 (A_21 Tg_11).

Printed: the relative Frobenius error of each against the float64 inverse of the same float32 A,
median and largest over the chunks.

    python bench/wy_inverse_error.py --d 128 --g=-1e-3
    python bench/wy_inverse_error.py --d 64 --g=logsigmoid16
"""
import argparse

import numpy as np

from dg_cancellation import bf16  # round to bfloat16 (nearest even), as float64

C = 64


def substitute(a):
    """(I + a)^-1 of a strictly lower triangular float32 a, row by row in float32."""
    n = a.shape[0]
    t = np.eye(n, dtype=np.float32)
    for i in range(1, n):
        acc = np.zeros(n, dtype=np.float32)
        for m in range(i):  # sequential float32 sum, as one thread accumulates it
            acc = acc - a[i, m] * t[m]
        acc[i] = 1.0
        t[i] = acc
    return t


def doubling(a):
    """(I + a)^-1 from the 16 x 16 diagonal blocks' inverses and two merges (float32)."""
    t = np.zeros_like(a)
    for b in range(0, C, 16):
        t[b:b + 16, b:b + 16] = substitute(a[b:b + 16, b:b + 16])
    for n in (16, 32):
        for b1 in range(0, C, 2 * n):
            b2 = b1 + n
            x = np.zeros((n, n), dtype=np.float32)  # X = A_21 Tg_11, a float32 sum over m in order
            for m in range(n):
                x += np.outer(a[b2:b2 + n, b1 + m], t[b1 + m, b1:b1 + n]).astype(np.float32)
            y = np.zeros((n, n), dtype=np.float32)  # Tg_21 = -Tg_22 X
            for m in range(n):
                y += np.outer(t[b2:b2 + n, b2 + m], x[m]).astype(np.float32)
            t[b2:b2 + n, b1:b1 + n] = -y
    return t


def chunk_a(rng, d, gates):
    k = rng.standard_normal((C, d))
    k = bf16(k / np.linalg.norm(k, axis=1, keepdims=True))
    beta = 1.0 / (1.0 + np.exp(-rng.standard_normal(C)))
    g = np.full(C, -1e-3) if gates == "-1e-3" else -np.log1p(np.exp(-rng.standard_normal(C))) / 16
    b = np.cumsum(g)
    gam = np.exp(b[:, None] - b[None, :])
    return np.tril(beta[:, None] * gam * (k @ k.T), -1).astype(np.float32)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--g", default="-1e-3", choices=["-1e-3", "logsigmoid16"])
    p.add_argument("--chunks", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = np.random.default_rng(args.seed)
    errs = {"substitution": [], "doubling": []}
    for _ in range(args.chunks):
        a = chunk_a(rng, args.d, args.g)
        ref = np.linalg.inv(np.eye(C) + a.astype(np.float64))
        for name, f in (("substitution", substitute), ("doubling", doubling)):
            t = f(a).astype(np.float64)
            errs[name].append(np.linalg.norm(t - ref) / np.linalg.norm(ref))
    print(f"d = {args.d}, g = {args.g}, {args.chunks} chunks of {C} rows: relative error of Tg in float32")
    for name, e in errs.items():
        print(f"  {name:13s} median {np.median(e):.2e}  max {np.max(e):.2e}")


if __name__ == "__main__":
    main()
