# SPDX-License-Identifier: Apache-2.0
"""How much 16-bit rounding of the state costs the gate gradient of Gated DeltaNet (float64, numpy).

The chunk kernels form each chunk's dg from its own rows plus <dS_e, S_e>: dS_e the cotangent that
the later rows send back into the state S_e at the chunk's end (docs/math/LOGLINEAR.md §6.5). This
script runs the plain recurrence in float64 on the inputs of the CUDA gate-gradient tests
(q, k ~ N(0, 1/d), v, dO ~ N(0, 1), beta ~ U(0, 1), a N(0, 1) final-state cotangent; inputs rounded to
bf16) and prints, per chunk end:

  * the cancellation  sum |dS o S| / |<dS, S>|  (median over the chunk ends);
  * the error that rounding S, or dS, to bf16 puts into <dS, S>, relative to max |dg| (the test's norm).

    python bench/dg_cancellation.py --T 4096 --d 128 --g=-1e-3
    python bench/dg_cancellation.py --T 4096 --d 128 --g=logsigmoid16

Recurrence (fla's form): S_t = a_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T, o_t = scale S_t^T q_t,
a_t = e^{g_t}; dg_t = <dS_t, S_t - beta_t k_t v_t^T> with dS_t the total cotangent of S_t.
"""
import argparse

import numpy as np


def bf16(x):
    """Round to bfloat16 (nearest even) and back to float64."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32).astype(np.float64)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--g", default="-1e-3", help="a constant log-gate, or logsigmoid16 (logsigmoid(randn) / 16)")
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    T, d, C = a.T, a.d, a.chunk
    if T < 1 or d < 1 or C < 1:
        ap.error("--T, --d and --chunk must be positive")
    rng = np.random.default_rng(a.seed)
    q = bf16(rng.standard_normal((T, d)) / np.sqrt(d))
    k = bf16(rng.standard_normal((T, d)) / np.sqrt(d))
    v = bf16(rng.standard_normal((T, d)))
    do = bf16(rng.standard_normal((T, d)))
    beta = bf16(rng.uniform(0, 1, T))
    if a.g == "logsigmoid16":
        g = -np.log1p(np.exp(-rng.standard_normal(T))) / 16
    else:
        g = np.full(T, float(a.g))
        if not g[0] <= 0:
            ap.error("--g must be <= 0 or logsigmoid16")
    g = g.astype(np.float32).astype(np.float64)
    d_final = rng.standard_normal((d, d))
    scale = d ** -0.5

    S = np.zeros((d, d))
    states = np.zeros((T, d, d), np.float32)  # S_t, for dg (float32 storage is enough for its size)
    ends = {}
    for t in range(T):  # forward
        S = np.exp(g[t]) * (S - beta[t] * np.outer(k[t], k[t] @ S)) + beta[t] * np.outer(k[t], v[t])
        states[t] = S
        if (t + 1) % C == 0 or t == T - 1:
            ends[t] = S.copy()
    D = d_final.copy()  # cotangent of S_t from the rows after t
    dg = np.zeros(T)
    pairs = []
    for t in range(T - 1, -1, -1):  # reverse
        if t in ends:
            pairs.append((D.copy(), ends[t]))
        dS = D + scale * np.outer(q[t], do[t])  # total cotangent of S_t
        dg[t] = np.sum(dS * (states[t] - beta[t] * np.outer(k[t], v[t])))
        D = np.exp(g[t]) * (dS - beta[t] * np.outer(k[t], k[t] @ dS))
    exact = np.array([np.sum(x * s) for x, s in pairs])
    s16 = np.array([np.sum(x * bf16(s)) for x, s in pairs])
    d16 = np.array([np.sum(bf16(x) * s) for x, s in pairs])
    cancel = np.median([np.abs(x * s).sum() / abs(np.sum(x * s)) for x, s in pairs])
    m = np.abs(dg).max()
    print(f"T = {T}, d = {d}, g = {a.g}: max |dg| {m:.3g}, median |dg| {np.median(np.abs(dg)):.3g}")
    print(f"  cancellation sum |dS o S| / |<dS, S>|, median over chunk ends: {cancel:.1f}")
    print(f"  error of <dS, S> / max |dg|: S in bf16 {np.abs(s16 - exact).max() / m:.2e}, "
          f"dS in bf16 {np.abs(d16 - exact).max() / m:.2e}")


if __name__ == "__main__":
    main()
