"""Aggregating client Gaussian posteriors: the exact product and the moment-matched average.

**The prior, counted once.** Each client's posterior is ``prior + likelihood term``; the
combination is ``prior + Σ_k likelihood_k``, so the clients must agree on one prior. Which one
(`global_prior`):

* ``prior=`` given (a `GaussianTerm`, or a number: the isotropic precision around the
  clients' common prior mean) is used as is;
* a prior every client shares (each fitted with the same given ``prior_precision``) is used;
* clients whose priors are isotropic ``N(μ₀, I/λ_k)`` around one mean ``μ₀`` but differ in
  ``λ_k`` — ``fit_head``'s default, each client choosing its own ``λ_k`` by its own evidence —
  get one global ``λ`` chosen by the **federated evidence**: the log evidence of the combined
  model whose client likelihoods are the Gaussian factors the clients sent,

      log Z(λ) = ½ d log λ − ½ λ |μ₀|² − ½ log|λI + Σ_k Λ_k| + ½ ηᵀ (λI + Σ_k Λ_k)⁻¹ η + const,
      η = λ μ₀ + Σ_k η_k,

  maximised over ``log λ`` as a client's own ``"marglik"`` is (grid, then bounded Brent,
  `inference.hyperparameters`; the same default bounds). It needs nothing beyond the
  likelihood terms the server already holds (no extra round). A Laplace client's term is the
  second-order Taylor expansion of its log likelihood at its mode — which does not depend on
  the prior it was fitted with except through that point — so ``Z`` is the Laplace-style
  evidence of the pooled model; for a Gaussian likelihood the terms are the exact likelihoods
  and ``λ`` is the pooled data's own evidence maximiser, the posterior the pooled posterior
  (tests/inference/test_gaussian_combine_priors.py). For a softmax likelihood it is an
  approximation: on digits pixels / 16 in three splits of 400 (``fit_head("laplace", ...,
  structure="diag")``, the KL-optimal default) it chose λ = 0.65 where the pooled data's own
  Laplace evidence chooses 0.46, both inside the flat minimum of the combined posterior's
  held-out NLL (0.163-0.167 over λ = 0.3-1); with ``approximation="laplace"`` terms it chose
  higher (1.8 diagonal; 0.41 full, pooled 0.041) — pass ``prior=`` where that matters.
  The choice is recorded on the result's
  ``prior_selection`` (a `HyperparameterChoice`, method
  ``"federated_marglik"``); it is ``None`` when the prior was given or shared.

Priors with different means, or that are not isotropic, are refused: pass ``prior=``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from inference.errors import InvalidInputError
from inference.gaussian.cholesky import cholesky_with_jitter
from inference.gaussian.diagonal import DiagonalPrecision
from inference.gaussian.full import FullPrecision
from inference.gaussian.posterior import GaussianPosterior
from inference.gaussian.term import GaussianTerm
from inference.hyperparameters import (
    DEFAULT_BOUNDS,
    Criterion,
    HyperparameterChoice,
    search_log_space,
)

#: Relative tolerance within which two priors are the same prior (float64 round-off of
#: ``λ`` and ``λ μ₀`` built the same way on different clients).
PRIOR_RTOL = 1e-12


def _isotropic(prior: GaussianTerm) -> tuple[float, Tensor] | None:
    """``(λ, μ₀ (d,))`` of an isotropic diagonal prior ``N(μ₀, I/λ)``, else ``None``."""
    diag = prior.diag
    if prior.structure.value != "diag" or diag is None:
        return None
    lam = float(diag[0])
    if not lam > 0 or not torch.allclose(diag, torch.full_like(diag, lam), rtol=PRIOR_RTOL,
                                         atol=0.0):
        return None
    return lam, prior.shift.to(torch.float64) / lam


def global_prior(
    posteriors: Sequence[GaussianPosterior], prior: GaussianTerm | float | None = None,
    bounds: tuple[float, float] = DEFAULT_BOUNDS,
) -> tuple[GaussianTerm, HyperparameterChoice | None]:
    """The one prior the combination of ``posteriors`` counts, and how a chosen one was found
    (module docstring): ``prior`` if given (a number is the isotropic precision around the
    clients' common prior mean), the clients' shared prior, or the isotropic prior whose ``λ``
    maximises the federated evidence over ``bounds``.

    Raises:
        InvalidInputError: the clients' priors differ other than in an isotropic precision
            (different means, or not isotropic), or ``prior`` is not a positive number or a
            term of the posteriors' dimension.
    """
    _check_same_space(posteriors)
    first = posteriors[0].prior
    if isinstance(prior, GaussianTerm):
        if prior.dim != first.dim:
            raise InvalidInputError(f"prior has dimension {prior.dim}; the posteriors have "
                                    f"{first.dim}.")
        return prior, None
    if prior is None and all(p.prior.allclose(first, rtol=PRIOR_RTOL, atol=1e-300)
                             for p in posteriors[1:]):
        return first, None
    isotropic = [_isotropic(p.prior.to(first.device, torch.float64)) for p in posteriors]
    means = [iso[1] for iso in isotropic if iso is not None]
    if len(means) < len(posteriors) or not all(
            torch.allclose(m, means[0], rtol=1e-10, atol=1e-12) for m in means[1:]):
        raise InvalidInputError(
            "the posteriors were built against different priors that are not one isotropic "
            "prior N(μ₀, I/λ) with different λ (their means differ, or one is not isotropic): "
            "pass prior= (a GaussianTerm, or a prior precision), or fit the clients against "
            "one prior (the prior must be counted exactly once).")
    mean = means[0]
    if prior is not None:
        if isinstance(prior, bool) or not isinstance(prior, int | float) or not (
                math.isfinite(prior) and prior > 0):
            raise InvalidInputError(
                f"prior must be a GaussianTerm, a prior precision > 0 or None; got {prior!r}.")
        return GaussianTerm(DiagonalPrecision(torch.full_like(mean, float(prior))),
                            float(prior) * mean), None
    likelihood = _summed_likelihood(posteriors).to(first.device, torch.float64)
    choice = search_log_space(
        Criterion(lambda lam: _federated_log_evidence(lam, mean, likelihood), "log_evidence",
                  "federated_marglik", maximise=True),
        "prior_precision", bounds, points_per_decade=1, refine=True)
    term = GaussianTerm(DiagonalPrecision(torch.full_like(mean, choice.value)),
                        choice.value * mean)
    return term, choice


def _federated_log_evidence(prior_precision: float, prior_mean: Tensor,
                            likelihood: GaussianTerm) -> float:
    """``log Z(λ)`` up to a constant in ``λ`` (module docstring), nats; float64 throughout."""
    d = prior_mean.shape[0]
    prior = GaussianTerm(DiagonalPrecision(torch.full_like(prior_mean, prior_precision)),
                         prior_precision * prior_mean)
    total = prior + likelihood
    shift = total.shift
    return float(0.5 * d * math.log(prior_precision)
                 - 0.5 * prior_precision * (prior_mean @ prior_mean)
                 - 0.5 * total.precision.logdet()
                 + 0.5 * shift @ total.precision.solve(shift))


def _summed_likelihood(posteriors: Sequence[GaussianPosterior]) -> GaussianTerm:
    likelihood = posteriors[0].likelihood
    for post in posteriors[1:]:
        likelihood = likelihood + post.likelihood
    return likelihood


def _check_same_space(posteriors: Sequence[GaussianPosterior]) -> None:
    if len(posteriors) == 0:
        raise InvalidInputError("nothing to aggregate: the list of posteriors is empty.")
    shapes = {p.shape for p in posteriors}
    if len(shapes) != 1:
        raise InvalidInputError(f"posteriors have different parameter shapes: {sorted(shapes)}.")


def combine(
    posteriors: Sequence[GaussianPosterior], prior: GaussianTerm | float | None = None
) -> GaussianPosterior:
    """Exact product combination: ``prior + Σ_k likelihood_k`` (the prior counted once).

    Order-independent up to floating-point summation (terms are summed in float64 when the
    inputs are float64). The structure is the richest among the inputs (diag < lowrank < full).

    Args:
        posteriors: the clients' posteriors over one parameter shape.
        prior: the prior to count, a `GaussianTerm` or a prior precision (isotropic,
            around the clients' common prior mean); by default the clients' shared prior, or —
            when each chose its own precision by evidence — the prior precision that maximises
            the federated evidence (module docstring), recorded on ``prior_selection``.

    Returns:
        A `GaussianPosterior` with ``n_data`` the clients' total; its attribute
        ``prior_selection`` is the federated choice, or ``None``.

    Raises:
        InvalidInputError: no posteriors, different shapes, or priors that cannot be reconciled.
    """
    prior, choice = global_prior(posteriors, prior)
    likelihood = _summed_likelihood(posteriors)
    n_data = sum(p.n_data for p in posteriors)
    result = GaussianPosterior(prior.to(likelihood.device, likelihood.dtype), likelihood,
                               posteriors[0].shape, n_data)
    result.prior_selection = choice
    return result


def average(
    posteriors: Sequence[GaussianPosterior],
    weights: Sequence[float] | Tensor | None = None,
    prior: GaussianTerm | float | None = None,
) -> GaussianPosterior:
    """Moment-matched average: the Gaussian with the mean and covariance of the mixture
    ``Σ_k w_k N(μ_k, Σ_k)``.

    ``weights`` default to the clients' ``n_data`` (uniform if any is 0) and are normalised.
    The result is diagonal if every input is diagonal, else full (mixture covariances are dense).
    Its likelihood term is the moment-matched natural parameters minus the prior, which is
    the one `combine` would count (module docstring; ``prior_selection`` records a
    federated choice). The prior changes only that split, not the averaged Gaussian.
    """
    prior, choice = global_prior(posteriors, prior)
    device, dtype = posteriors[0].device, posteriors[0].dtype
    w = _normalised_weights(posteriors, weights, device)
    means = torch.stack([p.flat_mean.to(torch.float64) for p in posteriors])  # (K, d)
    mean = (w[:, None] * means).sum(0)
    centred = means - mean
    precisions = [p.natural.precision for p in posteriors]
    # a mixture of diagonal-covariance Gaussians has a diagonal covariance; any other is dense
    if all(isinstance(p, DiagonalPrecision) for p in precisions):
        variances = torch.stack([p.variance() for p in precisions])
        variance = (w[:, None] * (variances + centred**2)).sum(0)
        total = GaussianTerm(DiagonalPrecision(1.0 / variance), mean / variance)
    else:
        cov = sum(wk * p.covariance() for wk, p in zip(w, precisions, strict=True))
        cov = cov + centred.T @ (w[:, None] * centred)
        chol = cholesky_with_jitter(cov, "mixture covariance")
        precision = torch.cholesky_inverse(chol)
        total = GaussianTerm(FullPrecision(precision), precision @ mean)
    total = total.to(dtype=dtype)
    n_data = sum(p.n_data for p in posteriors)
    result = GaussianPosterior.from_total(total, prior, posteriors[0].shape, n_data)
    result.prior_selection = choice
    return result


def _normalised_weights(posteriors: Sequence[GaussianPosterior],
                        weights: Sequence[float] | Tensor | None,
                        device: torch.device) -> Tensor:
    """``(K,)`` float64 weights summing to one (default: the clients' ``n_data``, or uniform
    if any is 0); `InvalidInputError` unless non-negative and finite with a positive sum."""
    if weights is None:
        counts = [p.n_data for p in posteriors]
        weights = counts if min(counts) > 0 else [1.0] * len(posteriors)
    w = torch.as_tensor(weights, dtype=torch.float64, device=device).reshape(-1)
    valid = w.shape[0] == len(posteriors) and bool(torch.isfinite(w).all())
    if not valid or (w < 0).any() or w.sum() <= 0:
        raise InvalidInputError(f"weights must be {len(posteriors)} non-negative finite numbers "
                                "with a positive sum.")
    return w / w.sum()


__all__ = ["average", "combine", "global_prior"]
