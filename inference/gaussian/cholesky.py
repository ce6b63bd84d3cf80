"""The one jitter policy for Cholesky factorisations of Gaussian precisions and covariances."""

from __future__ import annotations

import torch
from torch import Tensor

from inference.errors import NumericalError

#: Relative jitter tried, in order, when a Cholesky factorisation fails (times mean |diag|).
JITTER_SCHEDULE = (0.0, 1e-10, 1e-9, 1e-8, 1e-7, 1e-6)


def cholesky_with_jitter(matrix: Tensor, what: str = "precision",
                         symmetric: bool = False) -> Tensor:
    """Lower Cholesky factor of a symmetric positive-definite matrix, in float64.

    Jitter policy: the matrix is symmetrised; if the factorisation fails, ``j · mean|diag|`` is
    added to the diagonal for ``j`` in `JITTER_SCHEDULE` (1e-10 up to 1e-6, relative)
    and the first success is returned. If all fail the matrix is not positive definite in any
    useful sense and `NumericalError` reports its smallest eigenvalue.

    ``symmetric=True``: the caller built ``matrix`` exactly symmetric, bit for bit (e.g.
    `softmax_curvature` plus a diagonal), so the
    symmetrisation, a ``d²`` pass that cost ~1/4 of the factorisation at ``d = 1,010``, is
    skipped (issue 41); the factorisation reads the lower triangle only, so a matrix that is
    not symmetric is factorised as if its upper triangle mirrored the lower.
    """
    a = matrix.to(torch.float64)
    if not symmetric:
        a = 0.5 * (a + a.transpose(-1, -2))
    # The first try without jitter, checked afterwards: LAPACK reports a NaN pivot as a failure
    # (and NaN or inf anywhere in a symmetric matrix reaches a pivot), so the full finiteness
    # scan is only needed to explain a failure.
    factor, info = torch.linalg.cholesky_ex(a)
    if int(info.max()) == 0 and bool(torch.isfinite(factor.diagonal(dim1=-2, dim2=-1)).all()):
        return factor
    if not torch.isfinite(a).all():
        raise NumericalError(f"the {what} matrix contains NaN or inf.")
    scale = a.diagonal(dim1=-2, dim2=-1).abs().mean().clamp_min(torch.finfo(torch.float64).tiny)
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    for jitter in JITTER_SCHEDULE[1:]:
        factor, info = torch.linalg.cholesky_ex(a + jitter * scale * eye)
        if int(info.max()) == 0:
            return factor
    smallest = float(torch.linalg.eigvalsh(a).min())
    raise NumericalError(
        f"the {what} matrix is not positive definite (smallest eigenvalue {smallest:.3e}, "
        f"size {a.shape[-1]}), even with a relative jitter of {JITTER_SCHEDULE[-1]:g}. "
        "Increase the prior precision or check the curvature for NaNs / negative terms."
    )


def solve_with_factor(factor: Tensor, rhs: Tensor) -> Tensor:
    """``(L Lᵀ)⁻¹ rhs`` for a lower Cholesky factor ``L`` ``(d, d)`` and ``rhs`` ``(d, k)``: two
    triangular solves on the factor as it is.

    Why not ``torch.cholesky_solve``: it first copies the factor into column-major order (a
    ``d²`` pass and, at ``d = 1,010``, an 8 MB allocation whose pages fault in anew each
    call), which made one right-hand side 1.23 ms where the two solves take 0.38 (the same
    bits on this machine; issue 41)."""
    lower = torch.linalg.solve_triangular(factor, rhs, upper=False)
    return torch.linalg.solve_triangular(factor.mT, lower, upper=True)


__all__ = ["JITTER_SCHEDULE", "cholesky_with_jitter", "solve_with_factor"]
