"""Aggregating client Gaussian posteriors: the exact product and the moment-matched average."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from inference.errors import InvalidInputError
from inference.gaussian.cholesky import cholesky_with_jitter
from inference.gaussian.diagonal import DiagonalPrecision
from inference.gaussian.full import FullPrecision
from inference.gaussian.posterior import GaussianPosterior
from inference.gaussian.term import GaussianTerm


def _shared_prior(posteriors: Sequence[GaussianPosterior]) -> GaussianTerm:
    first = posteriors[0].prior
    for post in posteriors[1:]:
        if not post.prior.allclose(first, rtol=1e-12, atol=1e-300):
            raise InvalidInputError(
                "posteriors were built against different priors; pass `prior=` explicitly or "
                "rebuild them against one prior (the prior must be counted exactly once)."
            )
    return first


def _check_same_space(posteriors: Sequence[GaussianPosterior]) -> None:
    if len(posteriors) == 0:
        raise InvalidInputError("nothing to aggregate: the list of posteriors is empty.")
    shapes = {p.shape for p in posteriors}
    if len(shapes) != 1:
        raise InvalidInputError(f"posteriors have different parameter shapes: {sorted(shapes)}.")


def combine(
    posteriors: Sequence[GaussianPosterior], prior: GaussianTerm | None = None
) -> GaussianPosterior:
    """Exact product combination: ``prior + Σ_k likelihood_k`` (the prior counted once).

    Order-independent up to floating-point summation (terms are summed in float64 when the
    inputs are float64). The structure is the richest among the inputs (diag < lowrank < full).
    If ``prior`` is None, all posteriors must share one prior.
    """
    _check_same_space(posteriors)
    prior = _shared_prior(posteriors) if prior is None else prior
    likelihood = posteriors[0].likelihood
    for post in posteriors[1:]:
        likelihood = likelihood + post.likelihood
    n_data = sum(p.n_data for p in posteriors)
    return GaussianPosterior(prior.to(likelihood.device, likelihood.dtype), likelihood,
                             posteriors[0].shape, n_data)


def average(
    posteriors: Sequence[GaussianPosterior],
    weights: Sequence[float] | Tensor | None = None,
    prior: GaussianTerm | None = None,
) -> GaussianPosterior:
    """Moment-matched average: the Gaussian with the mean and covariance of the mixture
    ``Σ_k w_k N(μ_k, Σ_k)``.

    ``weights`` default to the clients' ``n_data`` (uniform if any is 0) and are normalised.
    The result is diagonal if every input is diagonal, else full (mixture covariances are dense).
    Its likelihood term is the moment-matched natural parameters minus the (shared) prior.
    """
    _check_same_space(posteriors)
    prior = _shared_prior(posteriors) if prior is None else prior
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
    return GaussianPosterior.from_total(total, prior, posteriors[0].shape, n_data)


def _normalised_weights(posteriors: Sequence[GaussianPosterior],
                        weights: Sequence[float] | Tensor | None,
                        device: torch.device) -> Tensor:
    """``(K,)`` float64 weights summing to one (default: the clients' ``n_data``, or uniform
    if any is 0); :class:`InvalidInputError` unless non-negative and finite with a positive sum."""
    if weights is None:
        counts = [p.n_data for p in posteriors]
        weights = counts if min(counts) > 0 else [1.0] * len(posteriors)
    w = torch.as_tensor(weights, dtype=torch.float64, device=device).reshape(-1)
    valid = w.shape[0] == len(posteriors) and bool(torch.isfinite(w).all())
    if not valid or (w < 0).any() or w.sum() <= 0:
        raise InvalidInputError(f"weights must be {len(posteriors)} non-negative finite numbers "
                                "with a positive sum.")
    return w / w.sum()


__all__ = ["average", "combine"]
