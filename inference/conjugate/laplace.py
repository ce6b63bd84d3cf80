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

**Classes without data** (``empty``: a class whose natural statistic row is zero, e.g. a class
held only by novel clients, or by none). Their MAP row is ``W_y = 0`` with
``p_y = 1 / (1 + sum_{j != y} e^{a_j})``, ``a_j = ||W_j||^2 / 4``, so the curvature there,
``N p_y / 2``, is next to nothing (``p_y ~ e^{-A}``, A ~ 10-100 for trained bodies) and the
Laplace variance ``2 / (N p_y)`` explodes: Monte-Carlo draws then give that class logits of
any size, and the predictive put ~72% of its mass on two such classes (digits, 5 clients,
``shards:2``, one novel client: accuracy 0.0 against 0.99 for the plug-in). The curvature at
the mode says nothing about this posterior: with the other rows at the MAP, ``W_y``'s density
is ``(1 + e^{||W_y||^2 / 4 - A})^{-N}``, ``A = logsumexp_{j != y} a_j``, flat over a ball of
radius about ``2 sqrt(A)`` and falling off like ``e^{-N ||W_y||^2 / 4}`` beyond it. For these
classes the block is the moment-matched isotropic Gaussian of that conditional instead
(`empty_class_variance`: ``E ||W_y||^2 / k`` by quadrature), the other classes' blocks and
the rank-one coupling are unchanged (``q_y = p_y v_y = 0``: the coupling never reaches them).
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
        empty: ``(C,)`` bool, the classes whose natural statistic is zero (module notes: their
            block is the moment-matched Gaussian of their conditional posterior); None: none.
    """

    def __init__(self, mean: Tensor, N: float, empty: Tensor | None = None) -> None:
        self.mean = mean.to(torch.float64)
        self.N = float(N)
        tiny = torch.finfo(torch.float64).tiny
        a = self.mean.pow(2).sum(dim=1) / 4.0
        self.p = torch.softmax(a, dim=0).clamp(min=tiny)
        # the p of each class's block: p itself, or 2 / (N sigma^2) for a class without data
        self.block_p = self.p.clone()
        self.empty = None if empty is None else empty.to(self.mean.device, torch.bool)
        if self.empty is not None and bool(self.empty.any()) and self.mean.shape[0] > 1:
            k = self.mean.shape[1]
            for y in torch.nonzero(self.empty).flatten().tolist():
                others = torch.cat([a[:y], a[y + 1:]])
                variance = empty_class_variance(float(torch.logsumexp(others, 0)), self.N, k)
                self.block_p[y] = 2.0 / (self.N * variance)
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
        return ConjugateLaplace(self.mean.to(device), self.N, self.empty)

    # ------------------------------------------------------------------ linear algebra

    def precision_matvec(self, X: Tensor) -> Tensor:
        """``H X`` for ``X`` of shape ``(..., C, k)``."""
        p = self.p.unsqueeze(-1)
        block = self.block_p.unsqueeze(-1) * (X / 2.0 + self.v * (self.v * X).sum(dim=-1,
                                                                                keepdim=True))
        q_dot = (p * self.v * X).sum(dim=(-2, -1), keepdim=True)
        return self.N * (block - p * self.v * q_dot)

    def covariance_matvec(self, X: Tensor) -> Tensor:
        """``H^-1 X`` for ``X`` of shape ``(..., C, k)``."""
        c = self._c.unsqueeze(-1)
        block = (2.0 / self.block_p).unsqueeze(-1) * (X - c * self.v * (self.v * X).sum(
            -1, keepdim=True))
        r_dot = (self.r * X).sum(dim=(-2, -1), keepdim=True)
        return (block + self.gamma * self.r * r_dot) / self.N

    def factor_matvec(self, Z: Tensor) -> Tensor:
        """``L Z`` with ``L L^T = H^-1``, for ``Z`` of shape ``(..., C, k)``: maps standard
        normal draws to draws of ``W - W*``."""
        Z = Z + self._kappa * self._w_hat * (self._w_hat * Z).sum(dim=(-2, -1), keepdim=True)
        s = 1.0 / torch.sqrt(self._one_plus)
        along = (self._v_hat * Z).sum(dim=-1, keepdim=True)
        Z = Z - (1.0 - s).unsqueeze(-1) * self._v_hat * along
        return torch.sqrt(2.0 / (self.N * self.block_p)).unsqueeze(-1) * Z

    def marginal_variances(self) -> Tensor:
        """Diagonal of ``H^-1``, shape ``(C, k)``."""
        block = (2.0 / self.block_p).unsqueeze(-1) * (1.0 - self._c.unsqueeze(-1) * self.v.pow(2))
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
        block = (2.0 / self.block_p) * (x.pow(2).sum(dim=1, keepdim=True) - shrink * along.pow(2))
        variance = (block + self.gamma * (x @ self.r.T).pow(2)) / self.N
        return mean, variance.clamp(min=0.0)


def empty_class_variance(A: float, N: float, k: int) -> float:
    """``E ||w||^2 / k`` under the density ``(1 + e^{||w||^2 / 4 - A})^{-N}`` on ``R^k``: the
    per-coordinate variance of a class without data given the other classes (module notes).

    A radial integral, ``int r^{k+1} g dr / int r^{k-1} g dr`` with
    ``g = (1 + e^{r^2/4 - A})^{-N}``, by the trapezoid rule in log space on 200,001 points up to
    where the integrand has fallen by e^-800 (checked against adaptive quadrature: tests).
    """
    if not (N > 0 and k >= 1 and math.isfinite(A)):
        raise ValueError(f"empty_class_variance needs N > 0, k >= 1 and a finite A; got {N}, "
                         f"{k}, {A}")

    def log_g(r: Tensor) -> Tensor:
        return -N * torch.nn.functional.softplus(r * r / 4.0 - A)

    # the density is flat to r^2 / 4 ~ A and falls by at least e^{-N x} beyond A + x
    r_max = 2.0 * math.sqrt(max(A, 0.0) + 1.0)
    while float(log_g(torch.tensor(r_max, dtype=torch.float64))) + (k + 1) * math.log(r_max) > \
            -800.0 + (k + 1) * math.log(2.0 * math.sqrt(max(A, 0.0) + 1.0)):
        r_max *= 1.25
    r = torch.linspace(0.0, r_max, 200_001, dtype=torch.float64)
    base = log_g(r)
    base[0] += math.log(0.5)  # the trapezoid's end weights (the common h cancels)
    base[-1] += math.log(0.5)
    log_r = torch.log(r)  # -inf at 0: r^j vanishes there for j > 0

    def power(j: int) -> Tensor:
        return torch.zeros_like(r) if j == 0 else j * log_r

    moment = torch.logsumexp(base + power(k + 1), 0)
    mass = torch.logsumexp(base + power(k - 1), 0)
    return float(torch.exp(moment - mass)) / k
