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


@functools.lru_cache(maxsize=None)
def linear_regression(num_data: int = 40, seed: int = 0) -> GaussianTruth:
    """Closed-form posterior of ``y = W [x, 1] + N(0, σ²)``, ``W ~ N(0, I/λ)``, m = 2."""
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(num_data, 2, generator=gen, dtype=torch.float64)
    true_w = torch.tensor([1.5, -0.7, 0.3], dtype=torch.float64)
    inputs = torch.cat([features, torch.ones(num_data, 1, dtype=torch.float64)], 1)
    noise_std, prior_precision = 0.5, 1.0
    targets = inputs @ true_w + noise_std * torch.randn(num_data, generator=gen,
                                                       dtype=torch.float64)
    precision = prior_precision * torch.eye(3, dtype=torch.float64) + inputs.T @ inputs / noise_std**2
    covariance = torch.linalg.inv(precision)
    mean = covariance @ (inputs.T @ targets) / noise_std**2
    return GaussianTruth(features, targets, noise_std, prior_precision, mean[None], covariance,
                         precision)


@dataclass(frozen=True)
class SampledTruth:
    features: Tensor  # (N, 1)
    labels: Tensor  # (N,)
    prior_precision: float
    mean: Tensor  # (2, 2)
    variance: Tensor  # (2, 2) marginal variances
    mean_std_error: Tensor  # (2, 2) Monte-Carlo standard error of `mean`
    samples: Tensor  # (S, 2, 2)


def batch_means_std_error(samples: Tensor, num_batches: int = 20) -> Tensor:
    """Monte-Carlo standard error of the mean of a (correlated) chain, by batch means."""
    usable = samples.shape[0] // num_batches * num_batches
    batches = samples[:usable].reshape(num_batches, -1, *samples.shape[1:]).mean(1)
    return batches.std(0) / num_batches**0.5


@functools.lru_cache(maxsize=None)
def softmax_regression_nuts(num_data: int = 50, seed: int = 0, num_samples: int = 4000) -> SampledTruth:
    """NUTS reference for a 2-class, 1-feature softmax regression with prior N(0, I)."""
    import pyro
    from pyro.infer import MCMC, NUTS

    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(num_data, 1, generator=gen, dtype=torch.float64)
    inputs = torch.cat([features, torch.ones(num_data, 1, dtype=torch.float64)], 1)
    true_w = torch.tensor([[1.2, 0.3], [-0.8, -0.2]], dtype=torch.float64)
    labels = torch.multinomial(torch.softmax(inputs @ true_w.T, -1), 1, generator=gen)[:, 0]

    def potential(params: dict[str, Tensor]) -> Tensor:  # −log joint, up to a constant
        weight = params["weight"]
        log_lik = torch.log_softmax(inputs @ weight.T, -1).gather(1, labels[:, None]).sum()
        return 0.5 * (weight**2).sum() - log_lik

    init = {"weight": torch.zeros(2, 2, dtype=torch.float64)}
    with pyro.get_param_store().scope(), torch.random.fork_rng():
        pyro.set_rng_seed(seed)
        kernel = NUTS(potential_fn=potential, adapt_mass_matrix=True)
        mcmc = MCMC(kernel, num_samples=num_samples, warmup_steps=500, initial_params=init,
                    disable_progbar=True)
        mcmc.run()
    samples = mcmc.get_samples()["weight"]
    return SampledTruth(features, labels, 1.0, samples.mean(0), samples.var(0),
                        batch_means_std_error(samples), samples)
