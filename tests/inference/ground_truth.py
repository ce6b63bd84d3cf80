"""Small seeded problems with known posteriors, shared by the inference tests.

* Bayesian linear regression (Gaussian likelihood, known noise): the posterior is Gaussian in
  closed form, ``Λ = λ I + XᵀX / σ²``, ``μ = Λ⁻¹ Xᵀ y / σ²`` (bias column included in X).
* Bayesian softmax regression with 2 classes and 1 feature (4 weights): no closed form; the
  reference is a long, seeded NUTS run with pyro (computed once per test session, a few
  seconds), whose moments carry a Monte-Carlo standard error computed by batch means.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor


@dataclass(frozen=True)
class GaussianTruth:
    features: Tensor  # (N, m) float64
    targets: Tensor  # (N,) float64
    noise_std: float
    prior_precision: float
    mean: Tensor  # (1, m + 1)
    covariance: Tensor  # (m + 1, m + 1)
    precision: Tensor  # (m + 1, m + 1)


@functools.cache
def linear_regression(num_data: int = 40, seed: int = 0) -> GaussianTruth:
    """Closed-form posterior of ``y = W [1, x] + N(0, σ²)``, ``W ~ N(0, I/λ)``, m = 2."""
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(num_data, 2, generator=gen, dtype=torch.float64)
    true_w = torch.tensor([1.5, -0.7, 0.3], dtype=torch.float64)
    inputs = torch.cat([torch.ones(num_data, 1, dtype=torch.float64), features], 1)
    noise_std, prior_precision = 0.5, 1.0
    targets = inputs @ true_w + noise_std * torch.randn(num_data, generator=gen,
                                                       dtype=torch.float64)
    precision = (prior_precision * torch.eye(3, dtype=torch.float64)
                 + inputs.T @ inputs / noise_std**2)
    covariance = torch.linalg.inv(precision)
    mean = covariance @ (inputs.T @ targets) / noise_std**2
    return GaussianTruth(features, targets, noise_std, prior_precision, mean[None], covariance,
                         precision)


@dataclass(frozen=True)
class SoftmaxTruth:
    features: Tensor  # (N, 1) float64
    labels: Tensor  # (N,)
    prior_precision: float
    mean: Tensor  # (2, 2) posterior mean of W
    covariance: Tensor  # (4, 4) posterior covariance of W.reshape(-1)

    @property
    def variance(self) -> Tensor:
        return self.covariance.diagonal().reshape(2, 2)


def batch_means_std_error(samples: Tensor, num_batches: int = 20) -> Tensor:
    """Monte-Carlo standard error of the mean of a (correlated) chain, by batch means."""
    usable = samples.shape[0] // num_batches * num_batches
    batches = samples[:usable].reshape(num_batches, -1, *samples.shape[1:]).mean(1)
    return batches.std(0) / num_batches**0.5


@functools.cache
def softmax_regression(num_data: int = 50, seed: int = 0, grid_size: int = 401) -> SoftmaxTruth:
    """Exact posterior moments of a 2-class, 1-feature softmax regression, prior N(0, I).

    With 2 classes the likelihood depends on W only through ``u = (w₀ − w₁)/√2`` (2-D); the
    orthogonal ``s = (w₀ + w₁)/√2`` keeps its N(0, I) prior and is independent of ``u``. The
    moments of ``u`` are integrated on a ``grid_size²`` grid over [−8, 8]² (Riemann sums of a
    smooth, rapidly decaying density: error far below 1e-8 here), then mapped back to W.
    (A pyro NUTS run was the first choice of reference; on this machine it took ~0.2 s per
    iteration, far beyond a test's budget, so the exact reduction is used instead.)
    """
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(num_data, 1, generator=gen, dtype=torch.float64)
    inputs = torch.cat([torch.ones(num_data, 1, dtype=torch.float64), features], 1)
    true_w = torch.tensor([[1.2, 0.3], [-0.8, -0.2]], dtype=torch.float64)
    labels = torch.multinomial(torch.softmax(inputs @ true_w.T, -1), 1, generator=gen)[:, 0]

    axis = torch.linspace(-8.0, 8.0, grid_size, dtype=torch.float64)
    grid = torch.cartesian_prod(axis, axis)  # (G², 2) values of u
    margin = 2**0.5 * grid @ inputs.T  # f₀ − f₁ for every grid point and row
    sign = 1.0 - 2.0 * labels.to(torch.float64)  # +1 for class 0, −1 for class 1
    log_density = torch.nn.functional.logsigmoid(sign * margin).sum(1) - 0.5 * (grid**2).sum(1)
    weights = torch.softmax(log_density, 0)
    mean_u = weights @ grid
    centred = grid - mean_u
    cov_u = centred.T @ (weights[:, None] * centred)
    # W = [w₀; w₁] = [(s + u)/√2; (s − u)/√2], s ~ N(0, I) independent of u.
    lift = torch.cat([torch.eye(2), -torch.eye(2)], 0).to(torch.float64) / 2**0.5  # u part
    mean = (lift @ mean_u).reshape(2, 2)
    s_part = torch.cat([torch.eye(2), torch.eye(2)], 0).to(torch.float64) / 2**0.5
    covariance = lift @ cov_u @ lift.T + s_part @ s_part.T
    return SoftmaxTruth(features, labels, 1.0, mean, covariance)


@pytest.fixture
def single_intra_op_thread():
    """Run a test with one intra-op torch thread (restored after).

    On the shared 2-core CI machine, under load, torch's parallel kernels (exp, softmax) on
    tiny tensors wait milliseconds for descheduled worker threads; the many-small-step samplers
    tested here then run 50x slower. Results do not depend on the thread count.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
