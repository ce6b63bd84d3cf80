"""The subnetwork linearised-Laplace posterior (FedSI's client posterior).

``q(theta) = N(theta_S | mean_S, Sigma_S) * prod_{r not in S} delta(theta_r - mean_r)`` with
``Sigma_S^{-1} = H_S + diag(prior_precision_S)``, ``H_S = sum_x J_S^T Lambda J_S`` the GGN block
of the subnet (the likelihood term, kept apart from the prior as laplace-torch keeps ``H``).

**How the model is held.** The posterior keeps a *reference* to the model for the forward
passes of the predictive; it never writes into it. Predictions are linearised at ``mean``, not
at whatever the model's parameters are now: the forward pass is a ``torch.func.functional_call``
with the trainable parameters taken from ``mean`` (frozen parameters and buffers come from the
model). ``state_dict()`` holds tensors only; ``from_state_dict(state, model=...)`` or
`SubnetLaplacePosterior.bind` attaches a model with the same trainable-parameter count.

Numerics: the precision is factorised in float64, ``precision = L L^T`` with ``L = D L_eq``,
``D = sqrt(diag(precision))`` and ``L_eq`` the Cholesky factor of the unit-diagonal
``D^{-1} precision D^{-1}``; the covariance is ``L^{-T} L^{-1}``. The predictive logit variance
of output o is ``||L^{-1} J_S[o]^T||^2 = ||L_eq^{-1} D^{-1} J_S[o]^T||^2``: one triangular solve
on the subnet Jacobian, in the model's dtype (equilibration keeps ``L_eq`` well conditioned),
never the full covariance product.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import ClassVar

import torch
from torch import Tensor, nn

from inference.errors import InvalidInputError, NumericalError
from inference.subnet.dense import cholesky_overwrite, symmetric_part, triangular_inverse
from inference.subnet.jacobian import SubnetJacobian
from inference.subnet.parameters import check_subnet_indices, trainable_slots
from inference.subnet.predictive import (
    DEFAULT_CHUNK_BYTES,  # re-exported: the default chunk budget named where it is used
    PredictiveMethod,
    check_method,
    glm_predict,
)

__all__ = ["DEFAULT_CHUNK_BYTES", "PredictiveMethod", "SubnetLaplacePosterior"]

_STATE_KEYS = ("mean", "subnet_indices", "ggn", "prior_precision", "prior_mean", "n_data")
# Working memory of the factored predictive's (rows, units, S) block, per sub-chunk.
FACTOR_CHUNK_BYTES = 32 * 2**20


class SubnetLaplacePosterior:
    """Full-covariance Gaussian over a parameter subnet, point mass at the MAP elsewhere.

    ``sample(n)`` draws whole flat parameter vectors ``(n, P)``: the subnet's entries from
    their joint Gaussian, every other entry exactly at the MAP.

    Args:
        mean: (P,) MAP of all trainable parameters (model dtype, model device).
        subnet_indices: (S,) int64 indices into the trainable-parameter vector (any device;
            stored on CPU, a device copy is made once).
        ggn: (S, S) likelihood GGN block ``sum_x J_S^T Lambda J_S`` (no prior).
        prior_precision: (S,) prior precision of the subnet entries, > 0.
        prior_mean: (S,) prior mean of the subnet entries (recorded, as laplace-torch does; it
            does not enter the Laplace precision). ``None`` = zeros.
        model: the network the mean belongs to; needed by `predict_proba` only.
        n_data: number of data points the GGN was summed over.
        assume_symmetric: the caller vouches that ``ggn`` (float64) is exactly symmetric (as
            `inference.subnet.fit.subnet_ggn` returns it): it is held as given, not
            symmetrised into a copy (an S x S pass and 123 MB at S = 3,925; bit for bit the
            same matrix then).
    """

    kind: ClassVar[str] = "subnet_laplace"

    def __init__(
        self,
        mean: Tensor,
        subnet_indices: Tensor,
        ggn: Tensor,
        prior_precision: Tensor,
        prior_mean: Tensor | None = None,
        model: nn.Module | None = None,
        n_data: int = 0,
        *,
        assume_symmetric: bool = False,
    ) -> None:
        if mean.dim() != 1 or not mean.dtype.is_floating_point:
            raise InvalidInputError(f"mean must be a flat float vector, got {tuple(mean.shape)}")
        idx = check_subnet_indices(subnet_indices, mean.numel())
        S, device = idx.numel(), mean.device
        ggn = ggn.detach().to(device, torch.float64)
        prior_precision = prior_precision.detach().to(device, torch.float64).reshape(-1)
        prior_mean = (
            torch.zeros(S, dtype=torch.float64, device=device)
            if prior_mean is None
            else prior_mean.detach().to(device, torch.float64).reshape(-1)
        )
        if ggn.shape != (S, S) or prior_precision.numel() != S or prior_mean.numel() != S:
            raise InvalidInputError(
                f"shapes disagree with {S} subnet indices: ggn {tuple(ggn.shape)}, prior_precision "
                f"{tuple(prior_precision.shape)}, prior_mean {tuple(prior_mean.shape)}"
            )
        self._mean = mean.detach()
        self._indices = idx
        self._indices_device = idx.to(device)
        self._ggn = ggn if assume_symmetric else symmetric_part(ggn)
        self._prior_precision = prior_precision
        self._prior_mean = prior_mean
        self.n_data = int(n_data)
        prior_ok = torch.stack(
            [torch.isfinite(prior_mean).all(), (prior_precision > 0).all(),
             torch.isfinite(prior_precision).all()]
        )
        if not bool(prior_ok.all()):
            raise InvalidInputError(
                "prior_precision must be finite and > 0, and prior_mean finite, on every subnet "
                "entry"
            )
        # the sum of the GGN is finite iff every entry is (one pass, not isfinite's three)
        if not bool(torch.isfinite(self._mean).all() & torch.isfinite(self._ggn.sum())):
            raise NumericalError("mean or GGN contains non-finite values")
        self._scale, self._chol_eq = _equilibrated_cholesky(self._ggn, prior_precision)
        # Stored: L_eq (float64, column-major as LAPACK returns it), D (float64), and D^{-1}
        # in the model dtype for the predictive (L_eq^T in that dtype once the triangular-solve
        # predictive needs it: an S x S transposed copy, unused where the factored route runs);
        # precision, L and the covariance are rebuilt from them on demand.
        self._solve_factor_T: Tensor | None = None
        self._solve_scale = self._scale.reciprocal().to(mean.dtype)
        self._model: nn.Module | None = None
        self._inverse_factor: Tensor | None = None  # L^{-1}, for the factored predictive
        self._inv_chol_eq: Tensor | None = None
        self._jacobian: SubnetJacobian | None = None
        if model is not None:
            self._attach(model)

    # ---------------------------------------------------------------- the Gaussian
    @property
    def mean(self) -> Tensor:
        """(P,) MAP of all trainable parameters (the posterior mean)."""
        return self._mean

    @property
    def subnet_indices(self) -> Tensor:
        """(S,) CPU int64 indices of the subnet in the trainable-parameter vector."""
        return self._indices

    @property
    def n_params(self) -> int:
        """P, the number of trainable parameters."""
        return self._mean.numel()

    @property
    def n_subnet(self) -> int:
        """S, the number of subnet entries."""
        return self._indices.numel()

    @property
    def mean_subnet(self) -> Tensor:
        """(S,) the mean restricted to the subnet."""
        return self._mean[self._indices_device]

    @property
    def ggn(self) -> Tensor:
        """(S, S) float64 likelihood term ``sum_x J_S^T Lambda J_S`` (no prior)."""
        return self._ggn

    @property
    def prior_precision(self) -> Tensor:
        """(S,) float64 prior precision of the subnet entries."""
        return self._prior_precision

    @property
    def prior_mean(self) -> Tensor:
        """(S,) float64 prior mean of the subnet entries."""
        return self._prior_mean

    @property
    def precision(self) -> Tensor:
        """(S, S) float64 posterior precision ``ggn + diag(prior_precision)``."""
        return self._ggn + torch.diag(self._prior_precision)

    @property
    def cholesky(self) -> Tensor:
        """(S, S) float64 lower-triangular ``L`` with ``precision = L L^T``."""
        return self._scale.unsqueeze(1) * self._chol_eq

    @property
    def covariance(self) -> Tensor:
        """(S, S) float64 posterior covariance ``precision^{-1}``."""
        return torch.cholesky_inverse(self._chol_eq) / torch.outer(self._scale, self._scale)

    def _inverse_chol_eq(self) -> Tensor:
        """(S, S) float64 ``L_eq^{-1}`` (lower triangular), computed once (S^3 / 3 flops) and
        shared by the marginal variances and the factored predictive."""
        if self._inv_chol_eq is None:
            self._inv_chol_eq = triangular_inverse(self._chol_eq)
        return self._inv_chol_eq

    def marginal_variance_subnet(self) -> Tensor:
        """(S,) float64 ``diag(covariance)``: column sums of squares of ``L_eq^{-1}``, / ``D^2``."""
        column_norms = torch.linalg.vector_norm(self._inverse_chol_eq(), dim=0)
        return (column_norms / self._scale).square()

    def marginal_std_full(self) -> Tensor:
        """(P,) marginal standard deviations, zero outside the subnet (FedSI's upload).

        Same dtype and device as [`mean`][inference.subnet.posterior.SubnetLaplacePosterior.mean].
        """
        std = torch.zeros_like(self._mean)
        std[self._indices_device] = self.marginal_variance_subnet().sqrt().to(std.dtype)
        return std

    def sample(self, n: int, generator: torch.Generator | None = None) -> Tensor:
        """``n`` full parameter vectors, shape (n, P): subnet ~ N(mean_S, Sigma_S), rest = mean.

        ``theta_S = mean_S + L^{-T} z`` with ``z ~ N(0, I)``, so ``Cov = L^{-T} L^{-1} =
        precision^{-1}`` (laplace-torch 0.2.3 multiplied by the wrong transpose here).
        ``generator`` must live on the posterior's device.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InvalidInputError(f"n must be a positive int, got {n!r}")
        z = torch.randn(
            self.n_subnet, n, dtype=torch.float64, device=self._scale.device, generator=generator
        )
        # L^{-T} z = D^{-1} L_eq^{-T} z
        delta = torch.linalg.solve_triangular(self._chol_eq.T, z, upper=True) / self._scale[:, None]
        draws = self._mean.unsqueeze(0).repeat(n, 1)
        draws[:, self._indices_device] += delta.T.to(draws.dtype)
        return draws

    # ---------------------------------------------------------------- the model
    @property
    def model(self) -> nn.Module | None:
        """The network used by `predict_proba` (``None`` until bound)."""
        return self._model

    def _attach(self, model: nn.Module) -> None:
        n = sum(s.numel for s in trainable_slots(model))
        if n != self.n_params:
            raise InvalidInputError(
                f"the model has {n} trainable parameters but the posterior was fitted on "
                f"{self.n_params}; bind the same architecture with the same frozen parameters"
            )
        self._model = model
        self._jacobian = None

    def bind(self, model: nn.Module) -> SubnetLaplacePosterior:
        """A copy of this posterior (sharing tensors) that predicts with ``model``."""
        other = copy.copy(self)
        other._attach(model)
        return other

    def _subnet_jacobian(self) -> SubnetJacobian:
        if self._model is None:
            raise InvalidInputError(
                "this posterior holds no model: use from_state_dict(state, model=...) or "
                "posterior.bind(model) before predict_proba"
            )
        if self._jacobian is None:
            self._jacobian = SubnetJacobian(self._model, self._indices, self._mean)
        return self._jacobian

    # ---------------------------------------------------------------- the predictive
    def predict_proba(
        self,
        inputs: Tensor,
        method: PredictiveMethod | None = None,
        *,
        n_samples: int = 100,
        generator: torch.Generator | None = None,
        chunk_size: int | None = None,
        max_memory_bytes: int | None = None,
    ) -> Tensor:
        """Predictive class probabilities, (B, C), rows summing to one
        (`inference.subnet.predictive.glm_predict`).

        Args:
            inputs: (B, ...) model inputs, a tensor, NumPy array or list (moved to the
                posterior's device; floating inputs cast to the network's dtype, so the
                probabilities come back in that dtype).
            method: ``"glm_probit"`` (default; FedSI Eq. 19): ``softmax(kappa * f)`` with
                ``kappa_o = (1 + pi/8 * var_o)^{-1/2}`` and ``var_o`` the linearised logit
                variance, as laplace-torch's ``link_approx="probit"``; ``"glm_mc"``: average
                softmax of ``f + J_S (theta_S - mean_S)`` over ``n_samples`` weight-space draws
                (exact Gaussian logits, no Cholesky of the C x C logit covariance); ``"map"``:
                ``softmax(f)``.
            n_samples: draws for ``"glm_mc"``.
            generator: their random generator, for ``"glm_mc"``.
            chunk_size: rows per Jacobian chunk; ``None`` picks the largest chunk within
                ``DEFAULT_CHUNK_BYTES`` of working memory.
            max_memory_bytes: memory budget override for the preflight.
        """
        method = check_method(method, n_samples)
        engine = self._subnet_jacobian()

        def draws(n: int) -> Tensor:
            # theta_S - mean_S = L^{-T} z = D^{-1} L_eq^{-T} z; D^{-1} is the column scale
            z = torch.randn(self.n_subnet, n, dtype=torch.float64, device=self._scale.device,
                            generator=generator)
            return torch.linalg.solve_triangular(self._chol_eq.T, z, upper=True).to(
                self._mean.dtype)

        return glm_predict(
            self._model, engine, inputs, method, column_scale=self._solve_scale,
            logit_variance=self._logit_variance, draws=draws, n_samples=n_samples,
            extra_row_bytes=self.n_subnet * self._mean.element_size(), chunk_size=chunk_size,
            max_memory_bytes=max_memory_bytes,
            fast_variance=self._factored_variance if self.factored else None,
            dtype=self._mean.dtype, device=self._mean.device)

    def _logit_variance(self, Jt_eq: Tensor) -> Tensor:
        """(B, C) ``var[b, o] = J_bo P^{-1} J_bo^T = ||L_eq^{-1} D^{-1} J_bo^T||^2`` from
        ``D^{-1} J^T`` (S, C, B).

        Solved from the right on the (C*B, S) view, which BLAS reads without a copy:
        ``A^T = (D^{-1} J^T)^T L_eq^{-T}``."""
        S, C, B = Jt_eq.shape
        if self._solve_factor_T is None:
            self._solve_factor_T = self._chol_eq.T.to(self._mean.dtype,
                                                      memory_format=torch.contiguous_format)
        At = torch.linalg.solve_triangular(
            self._solve_factor_T, Jt_eq.reshape(S, C * B).T, upper=True, left=False
        )
        return At.square().sum(1).reshape(C, B).T

    factored: bool = True
    """Use the factored GLM-probit variance where it applies (`_factored_variance`);
    False forces the triangular solve on the full subnet Jacobian (tests compare the two)."""

    def _factored_variance(self, engine: SubnetJacobian, x: Tensor) -> tuple[Tensor, Tensor] | None:
        """Linearised logit variances (B, C) and logits by the Linear-layer factorisation.

        When every subnet entry is in a Linear layer, ``J[b, o, s] = G[o, b, u_s] A[b, s]``
        (`SubnetJacobian.linear_factors`), so ``L^{-1} J_o^T = sum_u G[o, b, u] V[u, b]``
        with ``V[u, b, r] = sum_{s in unit u} (L^{-1})[r, s] A[b, s]``: one pass of the
        triangular ``L^{-1}`` per input instead of one per (input, output). Cost per input
        about ``S^2`` (half of it, ``L^{-1}`` being triangular) plus ``C U S``, against
        ``C S^2`` for the solve. Returns None where the factorisation does not apply.
        """
        factors = engine.unit_factors(x)
        if factors is None:
            return None
        A, G, logits, plan = factors  # G (C, B, U): the subnet's units only
        if self._inverse_factor is None:  # L^{-1} = L_eq^{-1} D^{-1}, in the model dtype
            self._inverse_factor = (self._inverse_chol_eq() / self._scale).to(self._mean.dtype)
        R, S = self._inverse_factor, self.n_subnet
        B, U = x.shape[0], G.shape[2]
        rows = max(1, min(B, FACTOR_CHUNK_BYTES // (U * S * A.element_size())))
        block = A.new_empty(rows, U, S)  # reused: fresh large buffers cost page faults
        f_var = []
        for i in range(0, B, rows):
            a = A[i : i + rows]
            V = block[: a.shape[0]].zero_()
            for start, end, u in plan.runs:
                # accumulated in place by the GEMM (no product temporary; the same
                # numbers bit for bit on the FedSI bench's 2,500 inputs, issue 41)
                V[:, u, start:].addmm_(a[:, start:end], R[start:, start:end].T)
            W = torch.bmm(G[:, i : i + rows].permute(1, 0, 2).contiguous(), V)  # (b, C, S)
            f_var.append(torch.linalg.vector_norm(W, dim=-1).square())  # one pass, no temporary
        return torch.cat(f_var), logits

    # ---------------------------------------------------------------- moving and saving
    def to(
        self, device: torch.device | str, model: nn.Module | None = None
    ) -> SubnetLaplacePosterior:
        """A copy on ``device``. The model: ``model`` if given, else the held model when it is
        already on ``device``, else a deep copy of it moved there (the original is untouched)."""
        device = torch.empty(0, device=device).device  # "cuda" -> "cuda:0"
        if model is None and self._model is not None:
            held = next(iter(self._model.parameters()))
            on_device = held.device == device
            model = self._model if on_device else copy.deepcopy(self._model).to(device)
        return SubnetLaplacePosterior(
            self._mean.to(device),
            self._indices,
            self._ggn.to(device),
            self._prior_precision.to(device),
            self._prior_mean.to(device),
            model=model,
            n_data=self.n_data,
        )

    def state_dict(self) -> dict[str, Tensor]:
        """Tensors only: ``mean, subnet_indices, ggn, prior_precision, prior_mean, n_data``."""
        return {
            "mean": self._mean,
            "subnet_indices": self._indices,
            "ggn": self._ggn,
            "prior_precision": self._prior_precision,
            "prior_mean": self._prior_mean,
            "n_data": torch.tensor(self.n_data, dtype=torch.int64),
        }

    @classmethod
    def from_state_dict(
        cls, state: Mapping[str, Tensor], model: nn.Module | None = None, *,
        assume_symmetric: bool = False,
    ) -> SubnetLaplacePosterior:
        """Rebuild from `state_dict` (e.g. read back with safetensors), binding ``model``;
        ``assume_symmetric`` as in the constructor."""
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise InvalidInputError(f"state is missing {missing} (expected {list(_STATE_KEYS)})")
        if not all(isinstance(state[k], Tensor) for k in _STATE_KEYS):
            raise InvalidInputError("every entry of a subnet Laplace state must be a tensor")
        return cls(
            state["mean"],
            state["subnet_indices"],
            state["ggn"],
            state["prior_precision"],
            state["prior_mean"],
            model=model,
            n_data=int(state["n_data"]),
            assume_symmetric=assume_symmetric,
        )


def _equilibrated_cholesky(ggn: Tensor, prior_precision: Tensor) -> tuple[Tensor, Tensor]:
    """``(D, L_eq)`` with ``D = sqrt(diag(precision))`` and ``L_eq L_eq^T = D^{-1} precision
    D^{-1}`` (unit diagonal), ``precision = ggn + diag(prior_precision)``; float64.

    Equilibration keeps the factor well conditioned when prior precisions span many orders of
    magnitude (FedSI's 1/g). The scaled matrix is built in one temporary (no S x S outer
    product or diagonal matrix) that the factorisation then overwrites.
    """
    diagonal = ggn.diagonal() + prior_precision
    not_positive = torch.nonzero(~(diagonal > 0)).flatten()  # a PD matrix has a positive diagonal
    info = int(not_positive[0]) + 1 if not_positive.numel() else 0
    if info == 0:
        scale = diagonal.sqrt()
        inv = scale.reciprocal()
        equilibrated = ggn * inv.unsqueeze(1)
        equilibrated *= inv
        equilibrated.diagonal().copy_(diagonal * inv * inv)
        chol_eq, info = cholesky_overwrite(equilibrated)
        if info == 0 and not bool(torch.isfinite(chol_eq.diagonal()).all()):
            info = 1 + int(torch.nonzero(~torch.isfinite(chol_eq.diagonal()))[0])
    if info != 0:
        raise NumericalError(
            f"the subnet posterior precision is not positive definite (Cholesky failed at "
            f"column {info}); increase prior_precision"
        )
    return scale, chol_eq
