"""Dense precision: any symmetric ``Λ``, factorised by a jittered Cholesky ``Λ = L Lᵀ``.

Every structure converts to this one exactly (`Precision.to_dense`), so it is where sums
and differences that leave a poorer structure land.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar

import torch
from torch import Tensor

from inference.gaussian.cholesky import cholesky_with_jitter, solve_with_factor
from inference.gaussian.precision import Precision, columns
from inference.options import CovarianceStructure


@dataclass(frozen=True, eq=False)
class FullPrecision(Precision):
    """``Λ = dense``, a symmetric ``(d, d)`` matrix."""

    dense: Tensor

    structure: ClassVar[CovarianceStructure] = CovarianceStructure.FULL
    richness: ClassVar[int] = 2
    canonical: ClassVar[bool] = True
    shapes: ClassVar[dict[str, tuple[str, ...]]] = {"dense": ("d", "d")}

    @classmethod
    def zeros(cls, dim: int, *, dtype: torch.dtype = torch.float64,
              device: torch.device | str | None = None) -> FullPrecision:
        return cls(torch.zeros(dim, dim, dtype=dtype, device=device))

    @classmethod
    def convert(cls, other: Precision) -> FullPrecision:
        same = super().convert(other)
        return same if same is not None else cls(other.to_dense())

    @property
    def dim(self) -> int:
        return self.dense.shape[0]

    # -- algebra ------------------------------------------------------------------------------

    def to_dense(self) -> Tensor:
        return self.dense

    def diagonal(self) -> Tensor:
        return self.dense.diagonal()

    def matmul(self, vector: Tensor) -> Tensor:
        return self.dense @ vector

    def scale(self, weight: float) -> FullPrecision:
        return FullPrecision(self.dense * weight)

    def _add_same(self, other: FullPrecision) -> FullPrecision:
        return FullPrecision(self.dense + other.dense)

    # -- factorised ---------------------------------------------------------------------------

    @cached_property
    def _chol(self) -> Tensor:
        return cholesky_with_jitter(self.dense)

    def adopt_factor(self, chol: Tensor, covariance: Tensor | None = None) -> None:
        """Take ``chol`` as this precision's factor, and ``covariance`` as its inverse, where
        the caller computed them from this very matrix (`cholesky_with_jitter`, then
        ``torch.cholesky_inverse``): what `cholesky` and the logit covariances would compute,
        bit for bit, without computing them again (a fitted head's posterior, issue 41). The
        caller answers for that; `inference.laplace_head.gaussian_head_posterior` checks the
        matrix is equal before it hands them over."""
        self.__dict__["_chol"] = chol  # where the cached property keeps its value
        if covariance is not None:
            self._memo["covariance"] = covariance

    def computed_factor(self) -> tuple[Tensor, Tensor | None] | None:
        """``(chol, covariance)`` where the factor is computed or adopted already (the
        covariance None where it is not), else None: nothing is computed."""
        chol = self.__dict__.get("_chol")
        return None if chol is None else (chol, self._memo.get("covariance"))

    def cholesky(self) -> Tensor:
        """The lower Cholesky factor of the precision, ``(d, d)`` float64 (cached: the one
        `solve` and `logdet` use)."""
        return self._chol

    def solve(self, rhs: Tensor) -> Tensor:
        b, column = columns(rhs)
        x = solve_with_factor(self._chol, b)
        return x[:, 0] if column else x

    def logdet(self) -> Tensor:
        return 2 * torch.log(self._chol.diagonal()).sum()

    def from_standard_normals(self, *normals: Tensor) -> Tensor:
        (eps,) = normals  # z = L⁻ᵀ ε has covariance (L Lᵀ)⁻¹
        return torch.linalg.solve_triangular(self._chol.T, eps, upper=True).T

    def covariance(self) -> Tensor:
        return torch.cholesky_inverse(self._chol)

    def variance(self) -> Tensor:
        eye = torch.eye(self.dim, dtype=torch.float64, device=self._chol.device)
        inv_chol = torch.linalg.solve_triangular(self._chol, eye, upper=False)
        return (inv_chol**2).sum(0)


__all__ = ["FullPrecision"]
