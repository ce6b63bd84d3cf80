"""A Gaussian posterior ``prior + likelihood`` over a parameter tensor, and its predictive.

Numerics: every solve, factorisation and sample runs in float64 (in the total precision's
structure, `inference.gaussian.precision`); results come back in the posterior's storage
dtype. No covariance is inverted explicitly except where a caller asks for it
(`GaussianPosterior.covariance`) or a structure's probit predictive needs the per-class
covariance blocks (the dense one does).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from inference.errors import InvalidInputError
from inference.gaussian import factor_memo
from inference.gaussian.full import FullPrecision
from inference.gaussian.precision import precision_class_for_tensors
from inference.gaussian.term import GaussianTerm
from inference.inputs import as_features
from inference.linear_model import augment_with_bias, check_features
from inference.options import CovarianceStructure, PredictiveMethod
from inference.posterior import check_num_draws, register_posterior


@register_posterior
class GaussianPosterior:
    """A Gaussian posterior ``prior + likelihood`` over parameters of shape ``shape``.

    When ``shape == (C, m + 1)`` the Gaussian is over a linear softmax head (bias in column 0,
    see `inference.linear_model`) and `predict_proba` maps features ``(B, m)`` to
    class probabilities. Instances are immutable; the float64 factorisation is cached.
    ``sample(n)`` draws parameters of that shape, ``(n, *shape)`` (for a head: weights in the
    space of its features, the bias in column 0).

    Args:
        prior: the prior's natural parameters (counted once, whatever is combined).
        likelihood: the likelihood term, posterior minus prior natural parameters.
        shape: the parameter shape; ``prod(shape) == d``.
        n_data: number of observations the likelihood term summarises.
    """

    kind = "gaussian"

    def __init__(
        self, prior: GaussianTerm, likelihood: GaussianTerm, shape: Sequence[int], n_data: int = 0
    ) -> None:
        shape = tuple(int(s) for s in shape)
        if math.prod(shape) != prior.dim or prior.dim != likelihood.dim:
            raise InvalidInputError(
                f"shape {shape} (size {math.prod(shape)}), prior dimension {prior.dim} and "
                f"likelihood dimension {likelihood.dim} must agree."
            )
        if prior.device != likelihood.device:
            raise InvalidInputError("prior and likelihood terms must be on the same device.")
        self.prior = prior
        self.likelihood = likelihood
        self.shape = shape
        self.n_data = int(n_data)
        self._cache: dict[str, object] = {}

    # -- constructors -------------------------------------------------------------------------

    @classmethod
    def from_mean_and_precision(
        cls, mean: Tensor, precision: Tensor, prior: GaussianTerm, n_data: int = 0,
        low_rank_factor: Tensor | None = None,
    ) -> GaussianPosterior:
        """From a posterior mean (any shape) and its *total* precision.

        ``precision`` is ``(d,)`` (diagonal), ``(d, d)`` (full), or with ``low_rank_factor``
        ``(d, r)`` the diagonal part of a low-rank-plus-diagonal precision.
        """
        flat = mean.reshape(-1)
        if low_rank_factor is not None:
            total = GaussianTerm(CovarianceStructure.LOWRANK, flat, diag=precision,
                                 factor=low_rank_factor)
        elif precision.ndim == 1:
            total = GaussianTerm(CovarianceStructure.DIAG, flat, diag=precision)
        else:
            total = GaussianTerm(CovarianceStructure.FULL, flat, dense=precision)
        total = GaussianTerm(total.precision, total.matvec(flat))
        return cls.from_total(total, prior, mean.shape, n_data)

    @classmethod
    def from_total(
        cls, total: GaussianTerm, prior: GaussianTerm, shape: Sequence[int], n_data: int = 0
    ) -> GaussianPosterior:
        """From the posterior's total natural parameters (likelihood term = total − prior,
        kept in the total's structure where that is exact)."""
        prior = prior.to(total.device, total.dtype)
        return cls(prior, total.without(prior), shape, n_data)

    # -- natural parameters and moments -------------------------------------------------------

    @property
    def natural(self) -> GaussianTerm:
        """Total natural parameters ``prior + likelihood``."""
        if "natural" not in self._cache:
            self._cache["natural"] = self.prior + self.likelihood
        return self._cache["natural"]

    @property
    def structure(self) -> CovarianceStructure | str:
        return self.natural.structure

    @property
    def precision_times_mean(self) -> Tensor:
        """``η = Λ μ``, shape ``(d,)``."""
        return self.natural.shift

    @property
    def dtype(self) -> torch.dtype:
        return self.likelihood.dtype

    @property
    def device(self) -> torch.device:
        return self.likelihood.device

    @property
    def flat_mean(self) -> Tensor:
        """Posterior mean as a flat ``(d,)`` vector: ``Λ⁻¹ η`` solved in float64."""
        if "mean" not in self._cache:
            solved = self.natural.precision.solve(self.natural.shift)
            self._cache["mean"] = solved.to(self.dtype)
        return self._cache["mean"]

    @property
    def mean(self) -> Tensor:
        """Posterior mean, shape ``shape``."""
        return self.flat_mean.reshape(self.shape)

    def log_det_precision(self) -> Tensor:
        """``log|Λ|`` of the total precision, a float64 scalar tensor."""
        return self.natural.precision.logdet()

    def marginal_variance(self) -> Tensor:
        """Diagonal of the covariance, shape ``shape`` (no dense inverse for diag / low rank)."""
        return self.natural.precision.variance().to(self.dtype).reshape(self.shape)

    def covariance(self) -> Tensor:
        """Dense ``(d, d)`` covariance (an explicit inverse; meant for small ``d``)."""
        return self.natural.precision.covariance().to(self.dtype)

    def sample(self, n: int, generator: torch.Generator | None = None) -> Tensor:
        """``n ≥ 1`` draws, shape ``(n, *shape)``, in the storage dtype on the posterior's
        device, via the precision's factorisation (``generator`` may live on any device)."""
        n = check_num_draws(n)
        draws = self.natural.precision.sample(n, generator)
        flat = self.flat_mean.to(torch.float64) + draws
        return flat.to(self.dtype).reshape(n, *self.shape)

    # -- softmax-head predictive --------------------------------------------------------------

    def _head_shape(self, features: Tensor) -> tuple[int, int]:
        if len(self.shape) != 2:
            raise InvalidInputError(
                f"predict_proba needs a posterior over a (C, m + 1) head; this one has shape "
                f"{self.shape}."
            )
        num_classes, width = self.shape
        check_features(features, width - 1)
        return num_classes, width

    def logit_moments(self, features: Tensor) -> tuple[Tensor, Tensor]:
        """Mean and per-class variance of the logits ``f = W [1, x]``, each ``(B, C)``, float64."""
        features = as_features(features)
        num_classes, _ = self._head_shape(features)
        x = augment_with_bias(features.to(device=self.device, dtype=torch.float64))
        logit_mean = x @ self.mean.to(torch.float64).T
        return logit_mean, self.natural.precision.head_logit_variance(x, num_classes)

    def logit_covariance(self, features: Tensor) -> tuple[Tensor, Tensor]:
        """Mean ``(B, C)`` and full covariance ``(B, C, C)`` of the logits ``f = W [1, x]``,
        float64 (the diagonal is `logit_moments`' variance)."""
        features = as_features(features)
        num_classes, _ = self._head_shape(features)
        x = augment_with_bias(features.to(device=self.device, dtype=torch.float64))
        logit_mean = x @ self.mean.to(torch.float64).T
        return logit_mean, self.natural.precision.head_logit_covariance(x, num_classes)

    def predict_proba(
        self,
        inputs: Tensor,
        method: PredictiveMethod | str = PredictiveMethod.CENTRED_PROBIT,
        n_samples: int = 100,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Class probabilities ``(B, C)`` for features ``inputs (B, m)``.

        ``method``: ``"centred_probit"`` (default; the probit of the centred logits, see
        `PredictiveMethod`), ``"probit"`` (``softmax(f / sqrt(1 +
        π v / 8))`` with the marginal variances, laplace-torch's), ``"mc"`` (average of
        ``n_samples`` softmax draws) or ``"map"`` (softmax at the mean).
        Computed in float64 on the posterior's device; returned in the inputs' dtype there.
        """
        method = PredictiveMethod.parse(method, "method")
        inputs = as_features(inputs)  # NumPy arrays and lists too (inference.inputs)
        self._head_shape(inputs)
        out_dtype = inputs.dtype
        if method is PredictiveMethod.MAP:
            x = augment_with_bias(inputs.to(device=self.device, dtype=torch.float64))
            return torch.softmax(x @ self.mean.to(torch.float64).T, -1).to(out_dtype)
        if method is PredictiveMethod.PROBIT:
            mean, var = self.logit_moments(inputs)
            kappa = 1.0 / torch.sqrt(1.0 + math.pi / 8.0 * var)
            return torch.softmax(kappa * mean, dim=-1).to(out_dtype)
        if method is PredictiveMethod.CENTRED_PROBIT:
            mean, cov = self.logit_covariance(inputs)
            centring = torch.eye(mean.shape[1], dtype=torch.float64, device=mean.device)
            centring = centring - 1.0 / mean.shape[1]
            var = torch.diagonal(centring @ cov @ centring, dim1=1, dim2=2).clamp_min(0.0)
            kappa = 1.0 / torch.sqrt(1.0 + math.pi / 8.0 * var)
            return torch.softmax(kappa * (mean @ centring), dim=-1).to(out_dtype)
        from inference.ensemble import mean_softmax  # avoid a cycle at import time

        weights = self.sample(n_samples, generator).to(torch.float64)
        features = inputs.to(device=self.device, dtype=torch.float64)
        return mean_softmax(weights, features).to(out_dtype)

    # -- federation algebra -------------------------------------------------------------------

    def __add__(self, other: GaussianPosterior) -> GaussianPosterior:
        """Exact product of two posteriors built against the same prior (prior counted once):
        ``prior + likelihood_a + likelihood_b``, what `inference.combine` gives them.

        Raises:
            InvalidInputError: different parameter shapes or priors (clients that chose their
                own prior precision by evidence): `inference.combine` chooses one prior
                for those.
        """
        if not isinstance(other, GaussianPosterior):
            return NotImplemented
        if self.shape != other.shape:
            raise InvalidInputError(f"posteriors have different parameter shapes: {self.shape} "
                                    f"and {other.shape}.")
        other_prior = other.prior.to(self.prior.device, self.prior.dtype)
        if not self.prior.allclose(other_prior, rtol=1e-12, atol=1e-300):
            raise InvalidInputError(
                "a + b needs posteriors built against the same prior; these differ (e.g. each "
                "client chose its own prior precision by evidence): use inference.combine([a, "
                "b]), which chooses one prior by the federated evidence.")
        likelihood = self.likelihood + other.likelihood.to(self.likelihood.device,
                                                           self.likelihood.dtype)
        return GaussianPosterior(self.prior.to(likelihood.device, likelihood.dtype), likelihood,
                                 self.shape, self.n_data + other.n_data)

    # -- devices and state --------------------------------------------------------------------

    def to(self, device: torch.device | str) -> GaussianPosterior:
        """A copy on ``device``."""
        return GaussianPosterior(self.prior.to(device), self.likelihood.to(device),
                                 self.shape, self.n_data)

    def state_dict(self) -> dict[str, Tensor]:
        """Tensors only: ``prior.*``, ``likelihood.*`` (which keys exist says the structure),
        ``shape`` (int64 ``(len(shape),)``) and ``n_data`` (int64 scalar): the terms' own
        tensors, not copies.

        A dense total precision factorised already (a fitted head's) leaves its factor and
        inverse in `inference.gaussian.factor_memo` for these tensor objects: `from_state_dict`
        of this very dict, unmodified, takes them instead of factorising again (issue 41)."""
        state = {f"prior.{k}": v for k, v in self.prior.tensors().items()}
        state.update({f"likelihood.{k}": v for k, v in self.likelihood.tensors().items()})
        natural = self._cache.get("natural")
        if natural is not None and isinstance(natural.precision, FullPrecision):
            factor = natural.precision.computed_factor()
            if factor is not None:
                factor_memo.remember(_term_tensors(state), *factor)
        state["shape"] = torch.tensor(self.shape, dtype=torch.int64)
        state["n_data"] = torch.tensor(self.n_data, dtype=torch.int64)
        return state

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Tensor]) -> GaussianPosterior:
        """Inverse of `state_dict`; raises `InvalidInputError` on missing keys."""
        missing = [k for k in ("shape", "n_data") if k not in state]
        if missing:
            raise InvalidInputError(f"state lacks {missing}; not a Gaussian posterior.")
        terms = {}
        for prefix in ("prior", "likelihood"):
            parts = {k.split(".", 1)[1]: v for k, v in state.items() if k.startswith(prefix + ".")}
            if "shift" not in parts:
                raise InvalidInputError(f"state has no `{prefix}.shift`; not a Gaussian posterior.")
            structure = precision_class_for_tensors(set(parts) - {"shift"})
            terms[prefix] = GaussianTerm(structure, **parts)
        shape = tuple(int(s) for s in state["shape"].tolist())
        posterior = cls(terms["prior"], terms["likelihood"], shape, int(state["n_data"]))
        factor = factor_memo.recall(_term_tensors(state))
        if factor is not None and isinstance(posterior.natural.precision, FullPrecision):
            # the factor of the total these very tensors define (factor_memo): the same bits
            posterior.natural.precision.adopt_factor(*factor)
        return posterior

    def __repr__(self) -> str:
        return (f"GaussianPosterior(shape={self.shape}, structure={self.structure}, "
                f"n_data={self.n_data}, dtype={self.dtype}, device={self.device})")


def _term_tensors(state: Mapping[str, Tensor]) -> list[Tensor]:
    """The prior's and the likelihood's tensors in ``state``, in a fixed order (by name)."""
    return [state[k] for k in sorted(state) if k.startswith(("prior.", "likelihood."))]


__all__ = ["GaussianPosterior"]
