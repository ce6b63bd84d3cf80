"""Diagonal precision ``Λ = diag(λ)``: a mean-field Gaussian, ``O(d)`` in every operation."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar

import torch
from torch import Tensor

from inference.errors import NumericalError
from inference.gaussian.precision import Precision, columns
from inference.options import CovarianceStructure


def positive_diagonal(diag: Tensor) -> Tensor:
    """``diag`` in float64 if every entry is positive and finite, else `NumericalError`
    (a diagonal or low-rank-plus-diagonal precision is positive definite only then)."""
    diag = diag.to(torch.float64)
    if not torch.isfinite(diag).all() or (diag <= 0).any():
        bad = int((~(diag > 0)).sum())
        raise NumericalError(
            f"the precision's diagonal part has {bad} entries that are not positive and "
            "finite; a diagonal (or low-rank-plus-diagonal) posterior needs all of them > 0."
        )
    return diag


@dataclass(frozen=True, eq=False)
class DiagonalPrecision(Precision):
    """``Λ = diag(diag)`` with ``diag`` of shape ``(d,)``."""

    diag: Tensor

    structure: ClassVar[CovarianceStructure] = CovarianceStructure.DIAG
    richness: ClassVar[int] = 0
    canonical: ClassVar[bool] = True
    shapes: ClassVar[dict[str, tuple[str, ...]]] = {"diag": ("d",)}

    @classmethod
    def zeros(cls, dim: int, *, dtype: torch.dtype = torch.float64,
              device: torch.device | str | None = None) -> DiagonalPrecision:
        return cls(torch.zeros(dim, dtype=dtype, device=device))

    @property
    def dim(self) -> int:
        return self.diag.shape[0]

    # -- algebra ------------------------------------------------------------------------------

    def to_dense(self) -> Tensor:
        return torch.diag(self.diag)

    def diagonal(self) -> Tensor:
        return self.diag

    def matmul(self, vector: Tensor) -> Tensor:
        return (self.diag if vector.ndim == 1 else self.diag[:, None]) * vector

    def scale(self, weight: float) -> DiagonalPrecision:
        return DiagonalPrecision(self.diag * weight)

    def _add_same(self, other: DiagonalPrecision) -> DiagonalPrecision:
        return DiagonalPrecision(self.diag + other.diag)

    def _subtract_same(self, other: DiagonalPrecision) -> DiagonalPrecision:
        return DiagonalPrecision(self.diag - other.diag)

    # -- factorised ---------------------------------------------------------------------------

    @cached_property
    def _positive(self) -> Tensor:
        return positive_diagonal(self.diag)

    def solve(self, rhs: Tensor) -> Tensor:
        b, column = columns(rhs)
        x = b / self._positive[:, None]
        return x[:, 0] if column else x

    def logdet(self) -> Tensor:
        return torch.log(self._positive).sum()

    def from_standard_normals(self, *normals: Tensor) -> Tensor:
        (eps,) = normals
        return (eps / self._positive.sqrt()[:, None]).T

    def variance(self) -> Tensor:
        return 1.0 / self._positive

    def head_logit_variance(self, inputs: Tensor, num_classes: int) -> Tensor:
        # independent weights: Var f_bc = Σ_p x_bp² Var θ_cp
        var_w = self.variance().reshape(num_classes, self.dim // num_classes)
        return (inputs**2) @ var_w.T

    def head_logit_covariance(self, inputs: Tensor, num_classes: int) -> Tensor:
        # classes have disjoint, independent weights: the logits are uncorrelated
        return torch.diag_embed(self.head_logit_variance(inputs, num_classes))


__all__ = ["DiagonalPrecision", "positive_diagonal"]
