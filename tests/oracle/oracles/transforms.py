# SPDX-License-Identifier: Apache-2.0
"""qk_l2norm (docs/math/LOGLINEAR.md §6.1) and central finite differences."""
import numpy as np

L2_EPS = 1e-6


def l2norm(x, eps=L2_EPS):
    """y = x / sqrt(|x|² + ε), row-wise."""
    return x / np.sqrt(np.sum(x * x, -1, keepdims=True) + eps)


def l2norm_vjp(x, dy, eps=L2_EPS):
    """dx = (dy − y (y·dy)) / sqrt(|x|² + ε)."""
    r = np.sqrt(np.sum(x * x, -1, keepdims=True) + eps)
    y = x / r
    return (dy - y * np.sum(y * dy, -1, keepdims=True)) / r


def fd_grad(f, arrays, h=1e-6):
    """Central differences (f(x + h e_i) − f(x − h e_i)) / 2h of the scalar f(*arrays) w.r.t. every
       entry of every array (float64 arrays; f must not modify its arguments)."""
    arrays = [np.array(a, dtype=np.float64) for a in arrays]
    grads = []
    for a in arrays:
        G = np.zeros_like(a)
        for idx in np.ndindex(a.shape):
            x0 = a[idx]
            a[idx] = x0 + h
            fp = f(*arrays)
            a[idx] = x0 - h
            fm = f(*arrays)
            a[idx] = x0
            G[idx] = (fp - fm) / (2 * h)
        grads.append(G)
    return grads
