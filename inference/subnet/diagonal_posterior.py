"""A diagonal GGN linearised-Laplace posterior over all trainable parameters (FedSI-Fac).

``q(theta) = N(mean, diag(v))`` with ``v_r = 1 / (diag GGN_r + prior_precision_r)``, the GGN
summed over the data (`inference.subnet.diagonal_ggn`). The predictive linearises the
network at ``mean`` (GLM): the logit variance of output o is ``sum_r J_or(x)^2 v_r``, computed
from the Jacobian of *all* trainable parameters in chunks of rows with the subnet engine
(`inference.subnet.SubnetJacobian` over every index, the columns scaled by ``sqrt(v)``),
never a (P, P) matrix. Same index space, model handling and predictive methods as
`inference.subnet.SubnetLaplacePosterior` (``"glm_probit"``, ``"glm_mc"``, ``"map"``).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import ClassVar

import torch
from torch import Tensor, nn

from inference.errors import InvalidInputError, NumericalError
from inference.subnet.diagonal import diagonal_ggn
from inference.subnet.jacobian import SubnetJacobian
from inference.subnet.parameters import (
    check_prior_precision,
    flat_trainable_parameters,
    trainable_slots,
)
from inference.subnet.predictive import PredictiveMethod, check_method, glm_predict

__all__ = ["DiagonalLaplacePosterior", "fit_diagonal_laplace"]

_STATE_KEYS = ("mean", "ggn_diagonal", "prior_precision", "n_data")


def fit_diagonal_laplace(
    model: nn.Module,
    loader: Iterable,
    prior_precision: float | Tensor = 1.0,
    *,
    max_memory_bytes: int | None = None,
    ggn_diagonal: Tensor | None = None,
) -> DiagonalLaplacePosterior:
    """Diagonal GGN Laplace over every trainable parameter, at the model's current parameters.

    Args:
        model: returns (B, C) logits; evaluated in eval mode.
        loader: yields ``(X, y)``; the GGN diagonal is summed over all of it.
        prior_precision: scalar or (P,) per-parameter prior precision, > 0.
        max_memory_bytes: memory budget override for the preflight.
        ggn_diagonal: (P,) the diagonal GGN of ``model`` on ``loader`` when the caller has
            computed it already (`diagonal_ggn`, e.g. for subnet selection), so it is not
            computed twice; ``loader`` is then not read.

    Returns:
        `DiagonalLaplacePosterior` holding a reference to ``model``.
    """
    n_params = sum(s.numel for s in trainable_slots(model))
    prior = check_prior_precision(prior_precision, n_params)
    mean = flat_trainable_parameters(model)
    if ggn_diagonal is None:
        diag = diagonal_ggn(model, loader, max_memory_bytes=max_memory_bytes)
    else:
        diag = _checked_ggn_diagonal(ggn_diagonal, n_params).to(mean.device)
    return DiagonalLaplacePosterior(mean, diag, prior.to(mean.device), model=model)


def _checked_ggn_diagonal(diag: Tensor, n_params: int) -> Tensor:
    if not isinstance(diag, Tensor) or diag.shape != (n_params,):
        raise InvalidInputError(
            f"ggn_diagonal must be a ({n_params},) tensor, one entry per trainable parameter, "
            f"got {getattr(diag, 'shape', type(diag).__name__)}"
        )
    if not diag.is_floating_point() or not bool(torch.isfinite(diag).all()) or bool(
        (diag < 0).any()
    ):
        raise InvalidInputError("ggn_diagonal must be finite and >= 0 (a GGN diagonal is)")
    return diag


class DiagonalLaplacePosterior:
    """Factorised Gaussian over all trainable parameters.

    ``sample(n)`` draws whole flat parameter vectors ``(n, P)``, each entry from its own
    Gaussian.

    Args:
        mean: (P,) MAP (model dtype and device).
        ggn_diagonal: (P,) diagonal of the likelihood GGN (no prior), >= 0.
        prior_precision: (P,) prior precisions, > 0.
        model: the network the mean belongs to (for `predict_proba`).
        n_data: number of data points the GGN was summed over (recorded).
    """

    kind: ClassVar[str] = "diagonal_laplace"

    def __init__(
        self,
        mean: Tensor,
        ggn_diagonal: Tensor,
        prior_precision: Tensor,
        model: nn.Module | None = None,
        n_data: int = 0,
    ) -> None:
        if mean.dim() != 1 or not mean.dtype.is_floating_point:
            raise InvalidInputError(f"mean must be a flat float vector, got {tuple(mean.shape)}")
        P, device = mean.numel(), mean.device
        ggn = ggn_diagonal.detach().to(device, torch.float64).reshape(-1)
        prior = prior_precision.detach().to(device, torch.float64).reshape(-1)
        if ggn.numel() != P or prior.numel() != P:
            raise InvalidInputError(
                f"ggn_diagonal {tuple(ggn_diagonal.shape)} and prior_precision "
                f"{tuple(prior_precision.shape)} must both have {P} entries (one per parameter)"
            )
        if not bool(torch.isfinite(prior).all() & (prior > 0).all()):
            raise InvalidInputError("prior_precision must be finite and > 0 everywhere")
        if not bool(torch.isfinite(ggn).all() & torch.isfinite(mean).all()):
            raise NumericalError("mean or GGN diagonal contains non-finite values")
        self._mean = mean.detach()
        self._ggn = ggn.clamp_min(0.0)  # rounding can leave -1e-20 on zero-curvature entries
        self._prior_precision = prior
        self._variance = 1.0 / (self._ggn + prior)
        self.n_data = int(n_data)
        self._model = model
        self._engine: SubnetJacobian | None = None

    @property
    def mean(self) -> Tensor:
        """(P,) posterior mean (the MAP)."""
        return self._mean

    @property
    def n_params(self) -> int:
        return self._mean.numel()

    @property
    def variance(self) -> Tensor:
        """(P,) float64 marginal variances ``1 / (diag GGN + prior precision)``."""
        return self._variance

    @property
    def ggn_diagonal(self) -> Tensor:
        """(P,) float64 likelihood GGN diagonal."""
        return self._ggn

    @property
    def prior_precision(self) -> Tensor:
        """(P,) float64 prior precisions."""
        return self._prior_precision

    @property
    def model(self) -> nn.Module | None:
        return self._model

    def marginal_std_full(self) -> Tensor:
        """(P,) marginal standard deviations (all > 0), in the mean's dtype."""
        return self._variance.sqrt().to(self._mean.dtype)

    def sample(self, n: int, generator: torch.Generator | None = None) -> Tensor:
        """``n`` parameter vectors (n, P) drawn from ``N(mean, diag(v))``."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InvalidInputError(f"n must be a positive int, got {n!r}")
        z = torch.randn(n, self.n_params, dtype=torch.float64, device=self._mean.device,
                        generator=generator)
        return (self._mean.to(torch.float64) + z * self._variance.sqrt()).to(self._mean.dtype)

    def _jacobian(self) -> SubnetJacobian:
        if self._model is None:
            raise InvalidInputError("this posterior holds no model: pass model=... to predict")
        if self._engine is None:
            every = torch.arange(self.n_params, dtype=torch.int64)
            self._engine = SubnetJacobian(self._model, every, self._mean)
        return self._engine

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
        """Predictive class probabilities (B, C); see the module docstring for the methods
        (`inference.subnet.predictive.glm_predict`, as the subnet posterior's).

        ``"glm_mc"`` draws ``n_samples`` weight-space samples ``delta = sqrt(v) z`` once and
        averages ``softmax(f + J delta)`` over them.
        """
        method = check_method(method, n_samples)
        engine = self._jacobian()

        def draws(n: int) -> Tensor:  # z; scaled by sqrt(v) inside the Jacobian
            z = torch.randn(self.n_params, n, dtype=torch.float64, device=self._mean.device,
                            generator=generator)
            return z.to(self._mean.dtype)

        return glm_predict(
            self._model, engine, inputs, method,
            column_scale=self._variance.sqrt().to(self._mean.dtype),
            logit_variance=_diagonal_logit_variance, draws=draws, n_samples=n_samples,
            chunk_size=chunk_size, max_memory_bytes=max_memory_bytes,
            dtype=self._mean.dtype, device=self._mean.device)

    def to(self, device: torch.device | str,
           model: nn.Module | None = None) -> DiagonalLaplacePosterior:
        """A copy on ``device`` (the posterior protocol's ``to``). The model: ``model`` if
        given, else the held model when it is already on ``device``, else a deep copy of it
        moved there (the original is untouched)."""
        device = torch.empty(0, device=device).device  # "cuda" -> "cuda:0"
        if model is None and self._model is not None:
            held = next(iter(self._model.parameters()))
            model = self._model if held.device == device else \
                copy.deepcopy(self._model).to(device)
        return DiagonalLaplacePosterior(self._mean.to(device), self._ggn.to(device),
                                        self._prior_precision.to(device), model=model,
                                        n_data=self.n_data)

    def state_dict(self) -> dict[str, Tensor]:
        """Tensors only: ``mean, ggn_diagonal, prior_precision, n_data``."""
        return {"mean": self._mean, "ggn_diagonal": self._ggn,
                "prior_precision": self._prior_precision,
                "n_data": torch.tensor(self.n_data, dtype=torch.int64)}

    @classmethod
    def from_state_dict(
        cls, state: Mapping[str, Tensor], model: nn.Module | None = None
    ) -> DiagonalLaplacePosterior:
        """Rebuild from `state_dict`, binding ``model``."""
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise InvalidInputError(f"state is missing {missing} (expected {list(_STATE_KEYS)})")
        return cls(state["mean"], state["ggn_diagonal"], state["prior_precision"], model=model,
                   n_data=int(state["n_data"]))


def _diagonal_logit_variance(Jt: Tensor) -> Tensor:
    """(B, C) ``sum_r J_or(x)^2 v_r`` from ``J^T sqrt(v)`` (P, C, B)."""
    return Jt.square().sum(0).T
