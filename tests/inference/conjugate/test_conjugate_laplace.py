"""Laplace approximation of the conjugate posterior (spec §2.5) and NUTS on the exact density."""

import pytest
import torch

from inference.conjugate.laplace import ConjugateLaplace
from inference.conjugate.posterior import ConjugatePosterior
from inference.conjugate.prior import ConjugatePrior
from inference.conjugate.solver import map_objective, solve_map
from inference.conjugate.statistics import SufficientStatistics
from inference.errors import MemoryBudgetError
from tests.devices import DEVICES


def small_problem(C=4, k=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    S = torch.randn(C, k, generator=g, dtype=torch.float64) * 3
    S[:, 0] = torch.randint(1, 9, (C,), generator=g).double()
    S[1] = 0.0  # an empty class
    S[-1] *= -1.0  # negative entries
    return S, float(S[:, 0].abs().sum()) + 1.0


def autograd_hessian(W, S, N):
    C, k = W.shape
    return torch.autograd.functional.hessian(
        lambda w: -map_objective(w.reshape(C, k), S, N), W.reshape(-1)
    )


@pytest.mark.parametrize(("C", "k", "seed"), [(2, 2, 0), (4, 3, 1), (6, 5, 2)])
def test_covariance_is_the_inverse_of_the_autograd_hessian(C, k, seed):
    S, N = small_problem(C, k, seed)
    W = solve_map(S, N)
    laplace = ConjugateLaplace(W, N)
    H = autograd_hessian(W, S, N)
    torch.testing.assert_close(laplace.dense_precision(), H, rtol=1e-12, atol=1e-12)
    reference = torch.linalg.inv(H)
    scale = reference.abs().max()
    assert float((laplace.dense_covariance() - reference).abs().max() / scale) <= 1e-10


def test_structured_factor_reproduces_the_covariance():
    S, N = small_problem(5, 4, 3)
    laplace = ConjugateLaplace(solve_map(S, N), N)
    size = S.numel()
    L = laplace.factor_matvec(torch.eye(size, dtype=torch.float64).reshape(size, 5, 4))
    L = L.reshape(size, size).T
    torch.testing.assert_close(L @ L.T, laplace.dense_covariance(), rtol=1e-10, atol=1e-14)


def test_matvecs_invert_each_other_and_marginals_are_the_diagonal():
    S, N = small_problem(5, 4, 4)
    laplace = ConjugateLaplace(solve_map(S, N), N)
    X = torch.randn(3, 5, 4, dtype=torch.float64)
    torch.testing.assert_close(laplace.covariance_matvec(laplace.precision_matvec(X)), X,
                               rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(laplace.marginal_variances().reshape(-1),
                               laplace.dense_covariance().diag(), rtol=1e-12, atol=0)


def test_logit_moments_match_the_dense_covariance():
    S, N = small_problem(4, 3, 5)
    laplace = ConjugateLaplace(solve_map(S, N), N)
    x = torch.randn(7, 3, dtype=torch.float64)
    mean, variance = laplace.logit_moments(x)
    cov = laplace.dense_covariance().reshape(4, 3, 4, 3)
    expected = torch.stack(
        [torch.einsum("bi,ij,bj->b", x, cov[y, :, y, :], x) for y in range(4)], dim=1
    )
    torch.testing.assert_close(mean, x @ laplace.mean.T, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(variance, expected, rtol=1e-10, atol=1e-14)


def test_dense_covariance_beyond_the_memory_budget_is_refused():
    laplace = ConjugateLaplace(torch.zeros(100, 200, dtype=torch.float64), 10.0)
    with pytest.raises(MemoryBudgetError, match="GiB"):
        laplace.dense_covariance()
    assert laplace.sample(2).shape == (2, 100, 200)  # the structured path still works


@pytest.mark.parametrize("device", DEVICES)
def test_laplace_draws_have_the_map_mean_and_the_analytic_covariance(device):
    S, N = small_problem(3, 3, 6)
    laplace = ConjugateLaplace(solve_map(S, N).to(device), N)
    generator = torch.Generator(device=device).manual_seed(0)
    draws = laplace.sample(40_000, generator=generator).cpu().reshape(40_000, -1)
    cov = laplace.to("cpu").dense_covariance()
    std = cov.diag().sqrt()
    # Monte-Carlo tolerances: mean within 5 standard errors; covariance entries within 0.05
    # in correlation units (the standard error of a correlation is <= 1/sqrt(40000) = 0.005).
    assert bool(((draws.mean(0) - laplace.mean.cpu().reshape(-1)).abs() <= 5 * std / 200).all())
    empirical = torch.cov(draws.T)
    assert float(((empirical - cov) / torch.outer(std, std)).abs().max()) <= 0.05


def gaussian_mixture_statistics(n=4000, seed=0):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 2, (n,), generator=g)
    centres = torch.tensor([[1.0, -0.5], [-0.8, 0.7]])
    features = centres[labels] + torch.randn(n, 2, generator=g) / 2**0.5
    return SufficientStatistics.from_features(features, labels, 2)


def test_nuts_and_laplace_agree_where_the_posterior_is_nearly_gaussian():
    # N = 4001: the posterior is close to its Laplace approximation. NUTS (pyro) runs on the
    # exact unnormalised log posterior; its draws must be centred on the MAP and reproduce the
    # Laplace covariance. Tolerances: means within 0.35 posterior std (the NUTS mean has
    # Monte-Carlo error ~ 1/sqrt(ESS)), variances within 35%, correlations within 0.2.
    posterior = ConjugatePosterior(ConjugatePrior(), gaussian_mixture_statistics())
    W = posterior.map()
    cov = posterior.covariance()
    std = cov.diag().sqrt()
    draws = posterior.sample(300, method="nuts", warmup_steps=150,
                             generator=torch.Generator().manual_seed(1)).reshape(300, -1)
    assert bool(torch.isfinite(draws).all())
    assert float(((draws.mean(0) - W.reshape(-1)).abs() / std).max()) <= 0.35
    empirical = torch.cov(draws.T)
    ratio = empirical.diag() / cov.diag()
    assert float((ratio - 1).abs().max()) <= 0.35
    correlation_error = (empirical / torch.outer(empirical.diag().sqrt(),
                                                 empirical.diag().sqrt())
                         - cov / torch.outer(std, std)).abs().max()
    assert float(correlation_error) <= 0.2
    # The log posterior at the draws sits below the mode, ~chi2 with C k dof: mean drop ~ 3.
    drop = posterior.log_posterior(W) - posterior.log_posterior(draws.reshape(300, 2, 3))
    mean_drop = float(drop.mean())
    assert mean_drop >= 1.5 and mean_drop <= 4.5


def test_nuts_is_reproducible_from_a_generator_and_leaves_the_global_rng_alone():
    posterior = ConjugatePosterior(ConjugatePrior(), gaussian_mixture_statistics(n=500))
    state = torch.get_rng_state()
    a = posterior.sample(20, method="nuts", warmup_steps=30,
                         generator=torch.Generator().manual_seed(5))
    assert torch.equal(torch.get_rng_state(), state)
    b = posterior.sample(20, method="nuts", warmup_steps=30,
                         generator=torch.Generator().manual_seed(5))
    assert torch.equal(a, b)
