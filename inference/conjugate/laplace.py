"""Analytic Laplace approximation of the conjugate posterior at its MAP (spec §2.5).

The negative log posterior is ``-J(W) = -<W, S> + N logsumexp_y(||W_y||^2 / 4)``. With
``v_y = W_y / 2`` and ``p = softmax(||W_y||^2 / 4)`` its Hessian is

    H = N (B - q q^T),   B = blockdiag_y( p_y (I / 2 + v_y v_y^T) ),   q_y = p_y v_y,

block-diagonal (each block identity plus rank one) minus rank one. Sherman–Morrison twice gives

    Cov = H^-1 = (1/N) (B^-1 + gamma r r^T),
    B_y^-1 = (2 / p_y) (I - c_y v_y v_y^T),   c_y = 2 / (1 + 2 ||v_y||^2),
    r_y = 2 v_y / (1 + 2 ||v_y||^2),   1 / gamma = sum_y p_y / (1 + 2 ||v_y||^2)  (> 0),

and a square factor ``Cov = L L^T``:
``L z = (1/sqrt(N)) B^-1/2 (z + kappa w_hat (w_hat . z))`` with ``kappa = sqrt(gamma) - 1``,
``w_y ∝ sqrt(p_y) v_y / sqrt(1 + 2 ||v_y||^2)`` and
``B_y^-1/2 = sqrt(2 / p_y) (I - (1 - s_y) v_hat_y v_hat_y^T)``, ``s_y = 1 / sqrt(1 + 2||v_y||^2)``.
Every operation is O(C k) time and memory; dense ``(C k)^2`` matrices are built only on request.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from inference.errors import MemoryBudgetError

# Dense covariances are refused above this many entries (8 bytes each): 2^27 = 1 GiB.
DENSE_ENTRY_LIMIT = 2**27


class ConjugateLaplace:
    """Gaussian ``N(W*, H^-1)`` over heads ``W (C, k)`` with the structured covariance above.

    Args:
        mean: the MAP ``W*``, float64 ``(C, k)`` (column 0 = bias).
        N: the natural count ``nu + n`` (> 0).
    """

    def __init__(self, mean: Tensor, N: float) -> None:
        self.mean = mean.to(torch.float64)
        self.N = float(N)
        tiny = torch.finfo(torch.float64).tiny
        self.p = torch.softmax(self.mean.pow(2).sum(dim=1) / 4.0, dim=0).clamp(min=tiny)
        self.v = self.mean / 2.0
        v_norm2 = self.v.pow(2).sum(dim=1)
        self._one_plus = 1.0 + 2.0 * v_norm2  # 1 + 2 ||v_y||^2
        v_norm = torch.sqrt(v_norm2)
        self._v_hat = self.v / torch.where(v_norm > 0, v_norm, torch.ones_like(v_norm)).unsqueeze(1)
        self._c = 2.0 / self._one_plus
        self.r = 2.0 * self.v / self._one_plus.unsqueeze(1)
        self.gamma = 1.0 / float((self.p / self._one_plus).sum())
        w = torch.sqrt(2.0 * self.p / self._one_plus).unsqueeze(1) * self.v
        w_norm = float(torch.linalg.vector_norm(w))
        self._w_hat = w / w_norm if w_norm > 0 else torch.zeros_like(w)
        self._kappa = math.sqrt(self.gamma) - 1.0

    @property
    def shape(self) -> torch.Size:
        """``(C, k)``, the shape of one head."""
        return self.mean.shape

    def to(self, device: torch.device | str) -> ConjugateLaplace:
        """The same approximation on ``device`` (its factors are recomputed there)."""
        return ConjugateLaplace(self.mean.to(device), self.N)

    # ------------------------------------------------------------------ linear algebra

    def precision_matvec(self, X: Tensor) -> Tensor:
        """``H X`` for ``X`` of shape ``(..., C, k)``."""
        p = self.p.unsqueeze(-1)
        block = p * (X / 2.0 + self.v * (self.v * X).sum(dim=-1, keepdim=True))
        q_dot = (p * self.v * X).sum(dim=(-2, -1), keepdim=True)
        return self.N * (block - p * self.v * q_dot)

    def covariance_matvec(self, X: Tensor) -> Tensor:
        """``H^-1 X`` for ``X`` of shape ``(..., C, k)``."""
        c = self._c.unsqueeze(-1)
        block = (2.0 / self.p).unsqueeze(-1) * (X - c * self.v * (self.v * X).sum(-1, keepdim=True))
        r_dot = (self.r * X).sum(dim=(-2, -1), keepdim=True)
        return (block + self.gamma * self.r * r_dot) / self.N

    def factor_matvec(self, Z: Tensor) -> Tensor:
        """``L Z`` with ``L L^T = H^-1``, for ``Z`` of shape ``(..., C, k)``: maps standard
        normal draws to draws of ``W - W*``."""
        Z = Z + self._kappa * self._w_hat * (self._w_hat * Z).sum(dim=(-2, -1), keepdim=True)
        s = 1.0 / torch.sqrt(self._one_plus)
        along = (self._v_hat * Z).sum(dim=-1, keepdim=True)
        Z = Z - (1.0 - s).unsqueeze(-1) * self._v_hat * along
        return torch.sqrt(2.0 / (self.N * self.p)).unsqueeze(-1) * Z

    def marginal_variances(self) -> Tensor:
        """Diagonal of ``H^-1``, shape ``(C, k)``."""
        block = (2.0 / self.p).unsqueeze(-1) * (1.0 - self._c.unsqueeze(-1) * self.v.pow(2))
        return (block + self.gamma * self.r.pow(2)) / self.N

    def dense_covariance(self) -> Tensor:
        """``H^-1`` as a ``(C k, C k)`` matrix (row-major over ``(class, column)``)."""
        return self._dense(self.covariance_matvec)

    def dense_precision(self) -> Tensor:
        """``H`` as a ``(C k, C k)`` matrix (row-major over ``(class, column)``)."""
        return self._dense(self.precision_matvec)

    def _dense(self, matvec) -> Tensor:
        size = self.mean.numel()
        if size * size > DENSE_ENTRY_LIMIT:
            raise MemoryBudgetError(
                f"a dense ({size} x {size}) covariance needs {size * size * 8 / 2**30:.1f} GiB; "
                "use covariance_matvec, marginal_variances or sample instead"
            )
        eye = torch.eye(size, dtype=torch.float64, device=self.mean.device)
        return matvec(eye.reshape(size, *self.mean.shape)).reshape(size, size).T.contiguous()

    # ------------------------------------------------------------------ draws and predictive

    def sample(self, n: int, generator: torch.Generator | None = None) -> Tensor:
        """``n`` draws, shape ``(n, C, k)``, float64, on the mean's device."""
        Z = torch.randn(
            (n, *self.mean.shape), generator=generator, dtype=torch.float64,
            device=self.mean.device,
        )
        return self.mean + self.factor_matvec(Z)

    def logit_moments(self, inputs: Tensor) -> tuple[Tensor, Tensor]:
        """Mean and marginal variance of the logits ``W x`` for augmented inputs ``x (B, k)``.

        Returns:
            ``(mean, variance)``, each ``(B, C)`` float64.
        """
        x = inputs.to(torch.float64)
        mean = x @ self.mean.T
        along = x @ self._v_hat.T  # (B, C)
        shrink = 1.0 - 1.0 / self._one_plus  # 1 - s_y^2
        block = (2.0 / self.p) * (x.pow(2).sum(dim=1, keepdim=True) - shrink * along.pow(2))
        variance = (block + self.gamma * (x @ self.r.T).pow(2)) / self.N
        return mean, variance.clamp(min=0.0)
