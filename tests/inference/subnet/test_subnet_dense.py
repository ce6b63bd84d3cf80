"""The tiled symmetric kernels and the LAPACK factorisations against torch's own routines."""

from __future__ import annotations

import pytest
import torch

from inference.subnet.dense import (
    TILE,
    cholesky_overwrite,
    mirror_upper_,
    symmetric_part,
    symmetrize_,
    triangular_inverse,
)

# sizes below one tile, one tile plus a remainder, and several tiles with a ragged edge
SIZES = (7, TILE + 1, 2 * TILE + 37)


def spd(n: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, n + 5, generator=g, dtype=torch.float64)
    return (x @ x.T / n + 0.5 * torch.eye(n, dtype=torch.float64)).to(dtype)


@pytest.mark.parametrize("n", SIZES)
def test_symmetric_part_is_the_average_with_the_transpose_exactly(n):
    m = torch.randn(n, n, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    expected = 0.5 * (m + m.T)  # elementwise: the same two roundings in any order
    got = symmetric_part(m)
    assert torch.equal(got, expected) and torch.equal(got, got.T)
    in_place = m.clone()
    assert symmetrize_(in_place) is in_place and torch.equal(in_place, expected)


@pytest.mark.parametrize("n", SIZES)
def test_mirror_keeps_the_upper_triangle_and_copies_it_below(n):
    m = torch.randn(n, n, dtype=torch.float32, generator=torch.Generator().manual_seed(2))
    upper = m.triu().clone()
    mirror_upper_(m)
    assert torch.equal(m.triu(), upper) and torch.equal(m, m.T)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("n", SIZES)
def test_cholesky_overwrite_equals_torch(n, dtype):
    a = spd(n, dtype)
    expected = torch.linalg.cholesky(a)
    factor, info = cholesky_overwrite(a.clone())
    assert info == 0 and factor.mT.is_contiguous()  # column-major, as torch returns it
    assert torch.equal(factor, factor.tril())
    # both are backward-stable LAPACK factorisations of a matrix with condition ~ 1e2:
    # they agree to a few hundred units of rounding (float64 2e-16, float32 1.2e-7)
    tol = 1e-13 if dtype == torch.float64 else 5e-5
    torch.testing.assert_close(factor, expected, rtol=0, atol=tol)


def test_cholesky_overwrite_reports_the_failing_column():
    a = spd(20)
    a[5, 5] = -1.0
    _, info = cholesky_overwrite(a.clone())
    _, expected = torch.linalg.cholesky_ex(a)
    assert info == int(expected) == 6


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("n", SIZES)
def test_triangular_inverse_equals_a_triangular_solve(n, dtype):
    lower = torch.linalg.cholesky(spd(n, torch.float64))
    eye = torch.eye(n, dtype=torch.float64)
    expected = torch.linalg.solve_triangular(lower, eye, upper=False)
    # both layouts: column-major (a Cholesky factor) and row-major (a contiguous copy)
    for layout in (lower, lower.contiguous()):
        got = triangular_inverse(layout.to(dtype))
        assert got.dtype == dtype and torch.equal(got, got.tril())
        # relative to the largest entry: rounding of n^3/3 flops (float32: its own inputs are
        # rounded first, 6e-8 relative, amplified by cond(L) ~ 10)
        tol = 1e-13 if dtype == torch.float64 else 1e-5
        err = (got.double() - expected).abs().max() / expected.abs().max()
        assert err < tol, (layout.stride(), float(err))
