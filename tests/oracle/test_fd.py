# SPDX-License-Identifier: Apache-2.0
"""hila's gradients vs central finite differences (fd_grad) of the oracle forward, at tiny shapes
(T <= 12, d <= 4), tolerance 1e-7: covers the cases with no direct VJP oracle (log-linear HLA ops,
initial states of the HLA ops, ridge, normalize with a state, qk_l2norm, dead-slot cotangents)."""
import pytest

from cases import backward_forms, check, fd_problems, params


@pytest.mark.parametrize("p,form,chunk", params(fd_problems(), lambda p: backward_forms(p.op, chunks=(4,))))
def test_gradients_vs_finite_differences(hila, p, form, chunk):
    check(hila, p, form, chunk, fd=True)
