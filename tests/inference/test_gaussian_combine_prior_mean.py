"""combine()'s federated prior precision under a non-zero prior mean: with a Gaussian
likelihood each client's term is its exact likelihood, so the chosen λ must be the maximiser
of the pooled data's marginal likelihood ``y ~ N(X μ₀, σ² I + X Xᵀ / λ)`` — written here from
scratch with scipy — and the combined posterior the pooled closed form at that λ. Zero-mean
priors cannot tell a prior-mean term's sign: this one is far from the data's weights."""

import math

import numpy as np
import pytest
import torch
from scipy.optimize import minimize_scalar
from scipy.stats import multivariate_normal

from inference.gaussian import combine
from inference.laplace_head import fit_laplace_head

F64 = torch.float64
NOISE = 0.5
PRIOR_MEAN = torch.tensor([1.0, -2.0, 0.5], dtype=F64)  # (C = 1, m + 1 = 3), bias first


def regression(n=60, seed=0):
    """``y = [1, x] w + N(0, σ²)`` with ``w`` 1.2 away from the prior mean (|w - μ₀|² = 1.44):
    the evidence's λ lands near d / |w - μ₀|² ~ 2, inside the search's (1e-4, 1e4)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, generator=g, dtype=F64)
    w = PRIOR_MEAN + torch.tensor([0.8, -0.6, 0.6], dtype=F64)
    X = torch.cat([torch.ones(n, 1, dtype=F64), x], 1)
    return x, X @ w + NOISE * torch.randn(n, generator=g, dtype=F64), X


def pooled_log_marginal(X, y, lam):
    X, y, mu = X.numpy(), y.numpy(), PRIOR_MEAN.numpy()
    cov = NOISE ** 2 * np.eye(len(y)) + X @ X.T / lam
    return float(multivariate_normal(X @ mu, cov).logpdf(y))


def test_the_federated_precision_is_the_pooled_evidence_maximiser_under_a_nonzero_mean():
    x, y, X = regression()
    options = dict(likelihood="gaussian", noise_std=NOISE, prior_mean=PRIOR_MEAN)
    clients = [fit_laplace_head(xk, yk, 1, **options)
               for xk, yk in zip(x.chunk(3), y.chunk(3), strict=True)]
    lams = [float(c.prior.diag[0]) for c in clients]
    assert max(lams) > 1.01 * min(lams)  # each chose its own: combine must choose one
    combined = combine(clients)
    choice = combined.prior_selection
    assert choice.method == "federated_marglik" and not choice.hit_bound

    best = minimize_scalar(lambda t: -pooled_log_marginal(X, y, math.exp(t)),
                           bounds=(math.log(1e-4), math.log(1e4)), method="bounded",
                           options={"xatol": 1e-9})
    reference = math.exp(best.x)
    assert 1e-2 < reference < 1e2  # an interior optimum, far from either bound
    # Both are Brent optima of the same smooth function of log λ (up to a constant): the
    # library's to 1e-6 in log λ (LOG_XATOL), this one to 1e-9, so 1e-5 relative.
    assert choice.value == pytest.approx(reference, rel=1e-5)
    # and it is the maximum: the pooled evidence there is at least a grid's best
    grid = np.exp(np.linspace(math.log(1e-3), math.log(1e3), 241))
    assert pooled_log_marginal(X, y, choice.value) >= max(
        pooled_log_marginal(X, y, float(lam)) for lam in grid) - 1e-9

    # the combined posterior is the pooled one at that λ, prior mean included (closed form)
    lam = choice.value
    precision = lam * torch.eye(3, dtype=F64) + X.T @ X / NOISE ** 2
    mean = torch.linalg.solve(precision, lam * PRIOR_MEAN + X.T @ y / NOISE ** 2)
    # float64 solves of a 3 x 3 system of condition ~1e2: 1e-10 absolute
    torch.testing.assert_close(combined.mean.reshape(-1), mean, atol=1e-10, rtol=0)
    torch.testing.assert_close(combined.covariance(), torch.linalg.inv(precision), atol=1e-10,
                               rtol=0)


def test_the_average_under_a_nonzero_mean_is_the_mixture_with_that_prior_counted_once():
    # average(): the moment-matched mixture (computed here from the clients' means and
    # covariances) with the same federated prior as combine's, its likelihood term the total
    # minus that prior, shift λ μ₀ included
    from inference.gaussian import average

    x, y, _ = regression()
    options = dict(likelihood="gaussian", noise_std=NOISE, prior_mean=PRIOR_MEAN)
    clients = [fit_laplace_head(xk, yk, 1, **options)
               for xk, yk in zip(x.chunk(3), y.chunk(3), strict=True)]
    averaged = average(clients)
    lam = combine(clients).prior_selection.value
    assert averaged.prior_selection.value == lam
    w = torch.tensor([c.n_data for c in clients], dtype=F64)
    w = w / w.sum()
    means = torch.stack([c.mean.reshape(-1) for c in clients])
    mean = (w[:, None] * means).sum(0)
    centred = means - mean
    cov = sum(wk * c.covariance() for wk, c in zip(w, clients, strict=True)) \
        + centred.T @ (w[:, None] * centred)
    # float64 moments and one 3 x 3 inversion each way: 1e-10 absolute
    torch.testing.assert_close(averaged.mean.reshape(-1), mean, atol=1e-10, rtol=0)
    torch.testing.assert_close(averaged.covariance(), cov, atol=1e-10, rtol=0)
    torch.testing.assert_close(averaged.prior.shift, lam * PRIOR_MEAN, atol=1e-10, rtol=1e-12)
    precision = torch.linalg.inv(cov)
    torch.testing.assert_close(averaged.likelihood.shift, precision @ mean - lam * PRIOR_MEAN,
                               atol=1e-8, rtol=0)
