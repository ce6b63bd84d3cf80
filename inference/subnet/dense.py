"""Dense symmetric and triangular kernels for the subnet posterior, without transposed passes.

At FedSI's size (|S| = 3,925: one S x S float64 matrix is 123 MB) the O(S^2) passes cost as
much as the O(S^3) factorisation when written naively: ``0.5 * (M + M.T)`` reads one operand
column-wise, which misses cache on every element (0.4 s at S = 3,925 on one core, a third of
the Cholesky itself). These helpers walk such matrices in square tiles that fit the L2 cache,
and invert triangular factors with LAPACK's ``trtri`` (S^3 / 3 flops) instead of a triangular
solve against the identity (S^3 flops: the solve does not know its right-hand side is
triangular).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from functools import lru_cache

import torch
from torch import Tensor

__all__ = [
    "cholesky_overwrite",
    "lapack_threads",
    "mirror_upper_",
    "symmetric_part",
    "symmetrize_",
    "triangular_inverse",
]

TILE = 256
"""Tile edge: two float64 tiles are 1 MiB, within a core's L2 cache on the machines we use."""


@lru_cache(maxsize=1)
def _blas_controller():
    import scipy.linalg  # noqa: F401  (loads SciPy's OpenBLAS before the scan, so the limit reaches it)
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController()


def lapack_threads() -> AbstractContextManager:
    """Run SciPy's LAPACK (OpenBLAS) on torch's thread count, not on every core.

    OpenBLAS starts one thread per core by default; on a shared or pinned machine that
    oversubscribes the cores the caller gave torch: measured on 2 busy cores at n = 3,925,
    ``dpotrf`` took 2.4 s of CPU with its default threads and 0.55 s with one.
    """
    return _blas_controller().limit(limits=torch.get_num_threads(), user_api="blas")


def _tiles(n: int) -> list[tuple[int, int]]:
    return [(a, min(a + TILE, n)) for a in range(0, n, TILE)]


def symmetric_part(matrix: Tensor, out: Tensor | None = None) -> Tensor:
    """``0.5 * (matrix + matrix^T)``, tile by tile, exactly symmetric.

    Args:
        matrix: (n, n) floating tensor, contiguous (rows).
        out: where to write it (a new tensor if None); ``out=matrix`` works in place.
    """
    out = torch.empty_like(matrix, memory_format=torch.contiguous_format) if out is None else out
    tiles = _tiles(matrix.shape[0])
    for i, (a, b) in enumerate(tiles):
        diagonal = matrix[a:b, a:b]
        out[a:b, a:b].copy_(0.5 * (diagonal + diagonal.T))
        for c, d in tiles[i + 1 :]:
            mean = 0.5 * (matrix[a:b, c:d] + matrix[c:d, a:b].T)
            out[a:b, c:d].copy_(mean)
            out[c:d, a:b].copy_(mean.T)
    return out


def symmetrize_(matrix: Tensor) -> Tensor:
    """``matrix <- 0.5 * (matrix + matrix^T)`` in place (`symmetric_part`)."""
    return symmetric_part(matrix, out=matrix)


def mirror_upper_(matrix: Tensor) -> Tensor:
    """Copy the upper triangle onto the lower one in place (the lower is ignored); returns
    ``matrix``, now exactly symmetric.

    Args:
        matrix: (n, n) floating tensor, contiguous (rows).
    """
    tiles = _tiles(matrix.shape[0])
    for i, (a, b) in enumerate(tiles):
        diagonal = matrix[a:b, a:b]
        diagonal.copy_(diagonal.triu() + diagonal.triu(1).T)
        for c, d in tiles[i + 1 :]:
            matrix[c:d, a:b].copy_(matrix[a:b, c:d].T)
    return matrix


def triangular_inverse(lower: Tensor) -> Tensor:
    """``L^{-1}`` of a lower-triangular (n, n) ``L`` with positive diagonal (a Cholesky factor).

    On the CPU in float32/float64 this is LAPACK ``?trtri`` through SciPy (n^3 / 3 flops; 0.8 s
    at n = 3,925 on one thread); elsewhere a triangular solve against the identity (n^3 flops;
    2.4 s there). Both are backward stable;
    they agree to rounding. The result is lower triangular, same dtype and device as ``L``.
    """
    if lower.device.type == "cpu" and lower.dtype in (torch.float32, torch.float64):
        from scipy.linalg import lapack

        trtri = lapack.dtrtri if lower.dtype == torch.float64 else lapack.strtri
        lower = lower.detach()
        # LAPACK is column-major. A column-major L (what torch.linalg.cholesky returns) is
        # handed over as it is; a row-major L as its transpose, an upper factor in columns.
        column_major = lower.mT.is_contiguous()
        factor = lower.numpy() if column_major else lower.T.numpy()
        with lapack_threads():
            inverse, info = trtri(factor, lower=int(column_major))
        if info == 0:
            inverse = torch.from_numpy(inverse)
            # trtri leaves the other triangle as it found it: clear it, through the row-major
            # view (torch's tril_ on a column-major tensor takes a strided path, 10x slower)
            if column_major:
                inverse.mT.triu_()
                return inverse
            return inverse.T.tril_()
    eye = torch.eye(lower.shape[0], dtype=lower.dtype, device=lower.device)
    return torch.linalg.solve_triangular(lower, eye, upper=False)


def cholesky_overwrite(matrix: Tensor) -> tuple[Tensor, int]:
    """``(L, info)``: the lower Cholesky factor of a symmetric positive definite (n, n)
    ``matrix``, computed in ``matrix``'s memory (its contents are destroyed); ``info`` is 0 on
    success, else the 1-based column where the factorisation failed.

    On the CPU in float32/float64 this is LAPACK ``?potrf`` through SciPy on the matrix's own
    memory, read as the column-major transpose (the same matrix): no copy, and the other
    triangle cleared by LAPACK. ``torch.linalg.cholesky_ex`` copies the input into column order
    and then clears the triangle with a strided ``tril_``: 0.5 s of its 1.3 s at n = 3,925.
    Elsewhere that is what runs. ``L`` is column-major (``L.mT`` contiguous), as torch returns
    it; on the LAPACK path only the upper triangle (in rows) of ``matrix`` is read.
    """
    if matrix.device.type == "cpu" and matrix.dtype in (torch.float32, torch.float64) and (
        matrix.is_contiguous()
    ):
        from scipy.linalg import lapack

        potrf = lapack.dpotrf if matrix.dtype == torch.float64 else lapack.spotrf
        # The rows' transpose is a column-major array holding the same symmetric matrix; its
        # lower triangle is the rows' upper one. The factor overwrites it, in column order.
        with lapack_threads():
            factor, info = potrf(matrix.detach().mT.numpy(), lower=1, clean=1, overwrite_a=1)
        return torch.from_numpy(factor), int(info)
    factor, info = torch.linalg.cholesky_ex(matrix)
    return factor, int(info)
