"""Low-rank-plus-diagonal precision ``Λ = diag(D) + L Lᵀ``, ``L`` of shape ``(d, r)``.

Solves use the Woodbury identity with the ``r x r`` capacitance ``K = I + Lᵀ D⁻¹ L`` (never a
``d x d`` factorisation), the log-determinant the matrix determinant lemma
``log|Λ| = log|D| + log|K|``, and samples perturb-and-solve.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar

import torch
from torch import Tensor

from inference.gaussian.cholesky import cholesky_with_jitter
from inference.gaussian.diagonal import DiagonalPrecision, positive_diagonal
from inference.gaussian.precision import Precision, columns
from inference.options import CovarianceStructure


@dataclass(frozen=True, eq=False)
class LowRankPrecision(Precision):
    """``Λ = diag(diag) + factor factorᵀ`` with ``diag (d,)`` and ``factor (d, r)``."""

    diag: Tensor
    factor: Tensor

    structure: ClassVar[CovarianceStructure] = CovarianceStructure.LOWRANK
    richness: ClassVar[int] = 1
    shapes: ClassVar[dict[str, tuple[str, ...]]] = {"diag": ("d",), "factor": ("d", "r")}

    @classmethod
    def zeros(cls, dim: int, *, dtype: torch.dtype = torch.float64,
              device: torch.device | str | None = None) -> LowRankPrecision:
        diag = torch.zeros(dim, dtype=dtype, device=device)
        return cls(diag, diag.new_zeros(dim, 0))

    @classmethod
    def convert(cls, other: Precision) -> LowRankPrecision | None:
        """A diagonal precision is the rank-0 case; nothing else converts exactly."""
        if isinstance(other, DiagonalPrecision):
            return cls(other.diag, other.diag.new_zeros(other.dim, 0))
        return super().convert(other)

    @property
    def dim(self) -> int:
        return self.diag.shape[0]

    @property
    def rank(self) -> int:
        """``r``, the number of columns of the factor."""
        return self.factor.shape[1]

    # -- algebra ------------------------------------------------------------------------------

    def to_dense(self) -> Tensor:
        return torch.diag(self.diag) + self.factor @ self.factor.T

    def diagonal(self) -> Tensor:
        return self.diag + (self.factor**2).sum(1)

    def matmul(self, vector: Tensor) -> Tensor:
        out = (self.diag if vector.ndim == 1 else self.diag[:, None]) * vector
        return out + self.factor @ (self.factor.T @ vector)

    def scale(self, weight: float) -> LowRankPrecision:
        return LowRankPrecision(self.diag * weight, self.factor * math.sqrt(weight))

    def _add_same(self, other: LowRankPrecision) -> LowRankPrecision:
        return LowRankPrecision(self.diag + other.diag, torch.cat([self.factor, other.factor], 1))

    def without(self, other: Precision) -> Precision:
        """Minus a diagonal prior the factor is untouched (exact); otherwise dense."""
        if isinstance(other, DiagonalPrecision):
            return LowRankPrecision(self.diag - other.diag, self.factor)
        return super().without(other)

    # -- factorised ---------------------------------------------------------------------------

    @cached_property
    def _factors(self) -> tuple[Tensor, Tensor, Tensor]:
        """float64 ``D``, ``L`` and the Cholesky factor of the capacitance ``I + Lᵀ D⁻¹ L``."""
        diag = positive_diagonal(self.diag)
        factor = self.factor.to(torch.float64)
        capacitance = torch.eye(factor.shape[1], dtype=torch.float64, device=diag.device)
        capacitance = capacitance + factor.T @ (factor / diag[:, None])
        return diag, factor, cholesky_with_jitter(capacitance, "capacitance")

    def solve(self, rhs: Tensor) -> Tensor:
        diag, factor, capacitance_chol = self._factors
        b, column = columns(rhs)
        x = b / diag[:, None]  # Woodbury identity
        inner = torch.cholesky_solve(factor.T @ x, capacitance_chol)
        x = x - (factor @ inner) / diag[:, None]
        return x[:, 0] if column else x

    def logdet(self) -> Tensor:
        diag, _, capacitance_chol = self._factors
        return torch.log(diag).sum() + 2 * torch.log(capacitance_chol.diagonal()).sum()

    def noise_shape(self) -> tuple[int, ...]:
        return (self.dim, self.rank)

    def from_standard_normals(self, *normals: Tensor) -> Tensor:
        # perturb-and-solve: x = D^½ ε + L ε' has covariance Λ, so Λ⁻¹ x has covariance Λ⁻¹.
        eps, eps_low = normals
        diag, factor, _ = self._factors
        return self.solve(diag.sqrt()[:, None] * eps + factor @ eps_low).T

    def variance(self) -> Tensor:
        # Woodbury: diag(D⁻¹) - rowsum((D⁻¹ L K^{-T/2})²)
        diag, factor, capacitance_chol = self._factors
        scaled = torch.linalg.solve_triangular(capacitance_chol, (factor / diag[:, None]).T,
                                               upper=False)
        return 1.0 / diag - (scaled**2).sum(0)

    def head_logit_variance(self, inputs: Tensor, num_classes: int) -> Tensor:
        # Woodbury per logit: x D_c⁻¹ x − ‖K^{-1/2} Lᵀ D⁻¹ J_bc‖², J_bc = x_b in block c
        diag, factor, capacitance_chol = self._factors
        width = self.dim // num_classes
        rank, batch = self.rank, inputs.shape[0]  # explicit sizes: rank may be 0
        inv_diag = (1.0 / diag).reshape(num_classes, width)
        scaled = (factor / diag[:, None]).reshape(num_classes, width, rank)
        u = torch.einsum("bp,cpr->bcr", inputs, scaled)  # Lᵀ D⁻¹ J for every (b, c)
        w = torch.linalg.solve_triangular(
            capacitance_chol, u.reshape(batch * num_classes, rank).T, upper=False
        )
        correction = (w**2).sum(0).reshape(batch, num_classes)
        return ((inputs**2) @ inv_diag.T - correction).clamp_min(0.0)

    def head_logit_covariance(self, inputs: Tensor, num_classes: int) -> Tensor:
        # Σ = D⁻¹ − D⁻¹ L K⁻¹ Lᵀ D⁻¹: a diagonal part per class minus a rank-r coupling
        diag, factor, capacitance_chol = self._factors
        width = self.dim // num_classes
        rank, batch = self.rank, inputs.shape[0]
        inv_diag = (1.0 / diag).reshape(num_classes, width)
        scaled = (factor / diag[:, None]).reshape(num_classes, width, rank)
        u = torch.einsum("bp,cpr->bcr", inputs, scaled)
        w = torch.linalg.solve_triangular(
            capacitance_chol, u.reshape(batch * num_classes, rank).T, upper=False
        ).T.reshape(batch, num_classes, rank)
        return (torch.diag_embed((inputs**2) @ inv_diag.T)
                - torch.einsum("bcr,bkr->bck", w, w))


__all__ = ["LowRankPrecision"]
