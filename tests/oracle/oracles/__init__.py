# SPDX-License-Identifier: Apache-2.0
"""hila's float64 numpy oracles: every operator written from its math (docs/math/HLA.md,
docs/math/LOGLINEAR.md), in masked-matrix form with hand-derived VJPs, plus independent serial
recurrences and plain-loop definitions that test_reference_selfcheck.py checks them against.

    levels        Fenwick levels, buckets, canonical state slots (exact integers)
    core          the masked-matrix form shared by the first-order operators, and its VJP
    first_order   gla, loglinear, gdn, loglinear_gdn (+ *_vjp), flat and Fenwick states
    recurrences   serial recurrences (decode steps) and definitions as plain sums
    hla           hla2 / ahla / hla3 (plain and log-linear): sums, masked forms, serial, composition, VJPs
    transforms    qk_l2norm and its VJP; central finite differences
"""
from . import core, first_order, hla, levels, recurrences, transforms  # noqa: F401
from .first_order import (gdn, gdn_vjp, gla, gla_vjp, loglinear, loglinear_gdn, loglinear_gdn_vjp,  # noqa: F401
                          loglinear_vjp)
from .transforms import fd_grad, l2norm, l2norm_vjp  # noqa: F401
