"""Exact mean-field references for the MFVI and SGLD tests (independent of pyro and the fitters).

* `logistic_data`: a seeded 2-class problem with 2 features (a ``(2, 3)`` head with bias).
* `logistic_elbo`: the ELBO of a diagonal Gaussian ``q = N(μ, diag σ²)`` over the softmax
  head under the prior ``N(μ₀, I/λ)``, by exact 1-D Gauss–Hermite quadrature. With two classes
  ``log p(y | W, x) = log σ(s (w₀ − w₁)·[1, x])`` (``s = ±1``), and under ``q`` the margin
  ``(w₀ − w₁)·[1, x]`` is Gaussian with mean ``(μ₀ − μ₁)·[1, x]`` and variance
  ``(σ₀² + σ₁²)·[1, x]²``, so each row's expected log likelihood is a 1-D Gaussian integral of the
  smooth ``log σ`` (analytic in the strip ``|Im z| < π``), which Gauss–Hermite quadrature
  computes to near machine precision; the KL to the prior is in closed form.
* `mean_field_optimum`: the maximiser of that ELBO over ``(μ, log σ)`` by scipy's L-BFGS-B
  on float64 autograd gradients.
* `gaussian_regression`: the closed-form posterior of Bayesian linear regression at any
  prior precision and mean (for the mean-field optimum of a Gaussian posterior: exact means,
  variances ``1 / Λᵢᵢ``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import scipy.optimize
import torch
from torch import Tensor

F64 = torch.float64

#: Gauss–Hermite order. log σ(z) is analytic in |Im z| < π, so the rule's error decays
#: geometrically, more slowly the wider the Gaussian (the strip is π / sd wide in standard
#: units): at variance 10, 80 nodes err by 5e-9 and 200 by 1e-13 (checked against mpmath's
#: 30-digit quadrature in the tests).
QUADRATURE_NODES = 200


@dataclass(frozen=True)
class LogisticData:
    features: Tensor  # (N, 2) float64
    labels: Tensor  # (N,) int64 in {0, 1}


@functools.cache
def logistic_data(num_data: int = 40, seed: int = 0) -> LogisticData:
    """``num_data`` rows of 2 standard-normal features, labels from a logistic model."""
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(num_data, 2, generator=gen, dtype=F64)
    margin = 0.4 + 1.5 * features[:, 0] - 1.0 * features[:, 1]
    labels = (torch.rand(num_data, generator=gen, dtype=F64) > torch.sigmoid(margin)).long()
    return LogisticData(features, labels)


@functools.cache
def _hermite_rule() -> tuple[Tensor, Tensor]:
    """Probabilists' Gauss–Hermite nodes and weights normalised to integrate against N(0, 1)."""
    nodes, weights = np.polynomial.hermite_e.hermegauss(QUADRATURE_NODES)
    return torch.tensor(nodes, dtype=F64), torch.tensor(weights / math.sqrt(2 * math.pi), dtype=F64)


def expected_log_sigmoid(mean: Tensor, variance: Tensor) -> Tensor:
    """``E[log σ(z)]`` for ``z ~ N(mean, variance)``, elementwise (any shape)."""
    nodes, weights = _hermite_rule()
    z = mean[..., None] + variance.sqrt()[..., None] * nodes
    return (torch.nn.functional.logsigmoid(z) * weights).sum(-1)


def logistic_elbo(data: LogisticData, loc: Tensor, scale: Tensor, prior_precision: float,
                  prior_mean: float = 0.0) -> Tensor:
    """The exact ELBO (nats) of ``q = N(loc, diag scale²)`` over the ``(2, 3)`` head."""
    inputs = torch.cat([torch.ones(len(data.labels), 1, dtype=F64), data.features], 1)
    sign = 1.0 - 2.0 * data.labels.to(F64)  # +1: class 0, −1: class 1
    margin_mean = sign * (inputs @ (loc[0] - loc[1]))
    margin_var = inputs**2 @ (scale[0] ** 2 + scale[1] ** 2)
    expected_log_lik = expected_log_sigmoid(margin_mean, margin_var).sum()
    prior_var = 1.0 / prior_precision
    kl = (0.5 * torch.log(torch.as_tensor(prior_var, dtype=F64)) - torch.log(scale)
          + (scale**2 + (loc - prior_mean) ** 2) / (2 * prior_var) - 0.5).sum()
    return expected_log_lik - kl


@dataclass(frozen=True)
class MeanFieldOptimum:
    loc: Tensor  # (2, 3)
    scale: Tensor  # (2, 3)
    elbo: float
    grad_norm: float  # max |∂ELBO| over (μ, log σ) at the optimum


@functools.cache
def mean_field_optimum(prior_precision: float, prior_mean: float = 0.0, num_data: int = 40,
                       seed: int = 0) -> MeanFieldOptimum:
    """Maximise `logistic_elbo` over ``(μ, log σ)`` (12 numbers) with L-BFGS-B, from
    the prior."""
    data = logistic_data(num_data, seed)

    def negative_elbo(flat: np.ndarray) -> tuple[float, np.ndarray]:
        params = torch.tensor(flat, dtype=F64, requires_grad=True)
        loc, log_scale = params[:6].reshape(2, 3), params[6:].reshape(2, 3)
        value = -logistic_elbo(data, loc, log_scale.exp(), prior_precision, prior_mean)
        (grad,) = torch.autograd.grad(value, params)
        return float(value.detach()), grad.numpy()

    start = np.concatenate([np.full(6, prior_mean), np.full(6, -0.5 * math.log(prior_precision))])
    result = scipy.optimize.minimize(negative_elbo, start, jac=True, method="L-BFGS-B",
                                     options={"gtol": 1e-11, "ftol": 1e-15, "maxiter": 5000})
    value, grad = negative_elbo(result.x)
    flat = torch.tensor(result.x, dtype=F64)
    return MeanFieldOptimum(flat[:6].reshape(2, 3), flat[6:].exp().reshape(2, 3), -value,
                            float(np.abs(grad).max()))


@functools.cache
def empirical_bayes_optimum(num_data: int = 40, seed: int = 0) -> tuple[float, MeanFieldOptimum]:
    """The joint maximiser of `logistic_elbo` over ``(μ, log σ, log λ)`` (13 numbers,
    L-BFGS-B), prior mean 0: the λ that variational EM should find, and the guide there."""
    data = logistic_data(num_data, seed)

    def negative_elbo(flat: np.ndarray) -> tuple[float, np.ndarray]:
        params = torch.tensor(flat, dtype=F64, requires_grad=True)
        loc, log_scale = params[:6].reshape(2, 3), params[6:12].reshape(2, 3)
        value = -logistic_elbo(data, loc, log_scale.exp(), params[12].exp())
        (grad,) = torch.autograd.grad(value, params)
        return float(value.detach()), grad.numpy()

    result = scipy.optimize.minimize(negative_elbo, np.concatenate([np.zeros(6), np.zeros(7)]),
                                     jac=True, method="L-BFGS-B",
                                     options={"gtol": 1e-11, "ftol": 1e-15, "maxiter": 5000})
    value, grad = negative_elbo(result.x)
    flat = torch.tensor(result.x, dtype=F64)
    optimum = MeanFieldOptimum(flat[:6].reshape(2, 3), flat[6:12].exp().reshape(2, 3), -value,
                               float(np.abs(grad).max()))
    return math.exp(result.x[12]), optimum


@dataclass(frozen=True)
class RegressionTruth:
    features: Tensor  # (N, 2) float64
    targets: Tensor  # (N,) float64
    noise_std: float
    prior_precision: float
    mean: Tensor  # (1, 3)
    covariance: Tensor  # (3, 3)
    precision: Tensor  # (3, 3)


@functools.cache
def gaussian_regression(prior_precision: float, prior_mean: float = 0.0, noise_std: float = 2.0,
                        num_data: int = 40, seed: int = 0, weight_scale: float = 1.0,
                        ) -> RegressionTruth:
    """Closed-form posterior of ``y = W [1, x] + N(0, σ²)``, ``W ~ N(μ₀, I/λ)``:
    ``Λ = λ I + XᵀX / σ²``, ``μ = Λ⁻¹ (λ μ₀ + Xᵀ y / σ²)``. With the default ``σ = 2`` the
    data's precision (``XᵀX / σ² ≈ 10`` per direction) is comparable to a prior of λ = 25, so
    confusing λ with √λ or 1/λ changes the posterior by a large factor. The data are drawn
    with the weights ``weight_scale · [1.5, −0.7, 0.3]``."""
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(num_data, 2, generator=gen, dtype=F64)
    inputs = torch.cat([torch.ones(num_data, 1, dtype=F64), features], 1)
    true_w = weight_scale * torch.tensor([1.5, -0.7, 0.3], dtype=F64)
    targets = inputs @ true_w + noise_std * torch.randn(num_data, generator=gen, dtype=F64)
    precision = prior_precision * torch.eye(3, dtype=F64) + inputs.T @ inputs / noise_std**2
    covariance = torch.linalg.inv(precision)
    mean = covariance @ (prior_precision * prior_mean + inputs.T @ targets / noise_std**2)
    return RegressionTruth(features, targets, noise_std, prior_precision, mean[None],
                           covariance, precision)
