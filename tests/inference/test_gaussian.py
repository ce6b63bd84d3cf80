"""GaussianPosterior: natural parameters, moments, sampling, predictive, exact combination."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inference.errors import InvalidInputError, NumericalError
from inference.gaussian import (
    GaussianPosterior,
    GaussianTerm,
    average,
    cholesky_with_jitter,
    combine,
    gaussian_prior,
    solve_with_factor,
)
from inference.laplace_head import fit_laplace_head
from tests.devices import DEVICES
from tests.inference.ground_truth import linear_regression

F64 = torch.float64


def random_posterior(structure: str, shape=(2, 3), seed: int = 0, prior_precision: float = 2.0):
    gen = torch.Generator().manual_seed(seed)
    d = math.prod(shape)
    shift = torch.randn(d, generator=gen, dtype=F64)
    if structure == "diag":
        lik = GaussianTerm("diag", shift, diag=torch.rand(d, generator=gen, dtype=F64) * 3)
    elif structure == "full":
        a = torch.randn(d, d, generator=gen, dtype=F64)
        lik = GaussianTerm("full", shift, dense=a @ a.T)
    else:
        lik = GaussianTerm("lowrank", shift, diag=torch.rand(d, generator=gen, dtype=F64),
                           factor=torch.randn(d, 2, generator=gen, dtype=F64))
    return GaussianPosterior(gaussian_prior(shape, prior_precision), lik, shape, n_data=10)


STRUCTURES = ["diag", "full", "lowrank"]


@pytest.mark.parametrize("structure", STRUCTURES)
def test_mean_and_variances_equal_dense_inverse_of_the_precision(structure):
    post = random_posterior(structure)
    precision = post.natural.precision_matrix()
    covariance = torch.linalg.inv(precision)
    # tolerance 1e-12: float64 solves of a well-conditioned 6x6 system
    torch.testing.assert_close(post.flat_mean, covariance @ post.precision_times_mean,
                               atol=1e-12, rtol=0)
    torch.testing.assert_close(post.marginal_variance().reshape(-1), covariance.diagonal(),
                               atol=1e-12, rtol=0)
    torch.testing.assert_close(post.covariance(), covariance, atol=1e-12, rtol=0)


@pytest.mark.parametrize("structure", STRUCTURES)
def test_samples_reproduce_the_covariance(structure):
    post = random_posterior(structure)
    draws = post.sample(100_000, generator=torch.Generator().manual_seed(1)).reshape(100_000, -1)
    assert draws.shape == (100_000, 6)
    cov = post.covariance()
    # Monte-Carlo tolerance: sd of a sample covariance entry ≈ sqrt(2/n)·scale ≈ 0.0045·scale
    scale = cov.diagonal().max()
    assert (torch.cov(draws.T) - cov).abs().max() < 0.02 * scale
    assert (draws.mean(0) - post.flat_mean).abs().max() < 0.02 * scale.sqrt()


def test_sampling_is_reproducible_with_a_generator():
    post = random_posterior("full")
    a = post.sample(5, generator=torch.Generator().manual_seed(3))
    b = post.sample(5, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b) and a.shape == (5, 2, 3)


@pytest.mark.parametrize("structure", STRUCTURES)
def test_logit_variances_equal_jacobian_quadratic_form(structure):
    post = random_posterior(structure)
    x = torch.randn(7, 2, dtype=F64, generator=torch.Generator().manual_seed(2))
    mean, var = post.logit_moments(x)
    inputs = torch.cat([torch.ones(7, 1, dtype=F64), x], 1)
    jac = torch.zeros(7, 2, 6, dtype=F64)  # d f_c / d vec(W)
    for c in range(2):
        jac[:, c, 3 * c : 3 * c + 3] = inputs
    cov = torch.linalg.inv(post.natural.precision_matrix())
    torch.testing.assert_close(var, torch.einsum("bcd,de,bce->bc", jac, cov, jac),
                               atol=1e-12, rtol=0)
    torch.testing.assert_close(mean, inputs @ post.mean.T, atol=1e-12, rtol=0)


def test_probit_predictive_is_softmax_of_scaled_logits_and_mc_averages_draws():
    post = random_posterior("full")
    x = torch.randn(4, 2, dtype=F64)
    mean, var = post.logit_moments(x)
    expected = torch.softmax(mean / torch.sqrt(1 + math.pi / 8 * var), -1)
    torch.testing.assert_close(post.predict_proba(x, "probit"), expected, atol=1e-14, rtol=0)
    mc = post.predict_proba(x, "mc", n_samples=50, generator=torch.Generator().manual_seed(0))
    draws = post.sample(50, generator=torch.Generator().manual_seed(0))
    inputs = torch.cat([torch.ones(4, 1, dtype=F64), x], 1)
    manual = torch.softmax(torch.einsum("bp,scp->sbc", inputs, draws), -1).mean(0)
    torch.testing.assert_close(mc, manual, atol=1e-12, rtol=0)
    map_probs = torch.softmax(inputs @ post.mean.T, -1)
    torch.testing.assert_close(post.predict_proba(x, "map"), map_probs)
    with pytest.raises(InvalidInputError, match="method must be one of"):
        post.predict_proba(x, "bogus")


def split_linear_gaussian_terms(num_clients: int, structure: str):
    """Exact likelihood terms of the linear-Gaussian model for K disjoint client splits."""
    truth = linear_regression()
    inputs = torch.cat([torch.ones(len(truth.targets), 1, dtype=F64), truth.features], 1)
    prior = gaussian_prior((1, 3), truth.prior_precision)
    chunks = zip(inputs.chunk(num_clients), truth.targets.chunk(num_clients), strict=True)
    posts = []
    for x, y in chunks:
        shift = x.T @ y / truth.noise_std**2
        if structure == "full":
            term = GaussianTerm("full", shift, dense=x.T @ x / truth.noise_std**2)
        elif structure == "lowrank":  # XᵀX/σ² = L Lᵀ with L = Xᵀ/σ: exact
            term = GaussianTerm("lowrank", shift, diag=torch.zeros(3, dtype=F64),
                                factor=x.T / truth.noise_std)
        else:
            term = GaussianTerm("diag", shift, diag=(x**2).sum(0) / truth.noise_std**2)
        posts.append(GaussianPosterior(prior, term, (1, 3), n_data=len(y)))
    return truth, inputs, posts


@pytest.mark.parametrize("structure", STRUCTURES)
@settings(max_examples=15, deadline=None)
@given(order=st.permutations(range(5)))
def test_product_of_client_posteriors_equals_all_data_posterior_in_any_order(structure, order):
    truth, inputs, posts = split_linear_gaussian_terms(5, structure)
    combined = combine([posts[i] for i in order])
    if structure == "diag":  # the all-data posterior of the diagonal-precision model
        precision = truth.prior_precision + (inputs**2).sum(0) / truth.noise_std**2
        expected = (inputs.T @ truth.targets / truth.noise_std**2) / precision
        torch.testing.assert_close(combined.flat_mean, expected, atol=1e-8, rtol=0)
        torch.testing.assert_close(combined.marginal_variance()[0], 1 / precision,
                                   atol=1e-8, rtol=0)
    else:
        torch.testing.assert_close(combined.mean, truth.mean, atol=1e-8, rtol=0)
        torch.testing.assert_close(combined.covariance(), truth.covariance, atol=1e-8, rtol=0)
    assert combined.n_data == len(truth.targets)


def test_combining_client_laplace_fits_equals_the_all_data_fit():
    truth = linear_regression()
    kwargs = dict(likelihood="gaussian", noise_std=truth.noise_std,
                  prior_precision=truth.prior_precision)
    clients = [fit_laplace_head(x, y, 1, **kwargs)
               for x, y in zip(truth.features.chunk(4), truth.targets.chunk(4), strict=True)]
    for order in itertools.permutations(range(4), 4):
        combined = clients[order[0]]
        for i in order[1:]:
            combined = combined + clients[i]
        torch.testing.assert_close(combined.mean, truth.mean, atol=1e-8, rtol=0)
        torch.testing.assert_close(combined.covariance(), truth.covariance, atol=1e-8, rtol=0)


def test_prior_is_counted_once():
    prior = gaussian_prior((2,), precision=3.0, mean=0.5)
    empty = GaussianPosterior(prior, GaussianTerm.zeros(2), (2,))
    combined = combine([empty] * 4)
    torch.testing.assert_close(combined.natural.diag, torch.full((2,), 3.0, dtype=F64))
    torch.testing.assert_close(combined.mean, torch.full((2,), 0.5, dtype=F64))


def test_combining_posteriors_with_priors_of_different_means_is_refused():
    a = random_posterior("diag", prior_precision=1.0)
    b = random_posterior("diag", prior_precision=1.0)
    shifted = GaussianPosterior(gaussian_prior((2, 3), 1.0, mean=0.5), b.likelihood, (2, 3))
    with pytest.raises(InvalidInputError, match="different priors"):
        combine([a, shifted])
    with pytest.raises(InvalidInputError, match="different priors"):
        average([a, shifted])
    combine([a, shifted], prior=gaussian_prior((2, 3), 1.0))  # a prior given: counted once


def test_a_plus_b_is_combine_for_one_prior_and_refers_other_priors_to_combine():
    a = random_posterior("full", seed=1, prior_precision=2.0)
    b = random_posterior("full", seed=2, prior_precision=2.0)
    both = a + b
    reference = combine([a, b])
    torch.testing.assert_close(both.mean, reference.mean, rtol=0, atol=0)
    torch.testing.assert_close(both.covariance(), reference.covariance(), rtol=0, atol=0)
    assert both.n_data == a.n_data + b.n_data
    other = random_posterior("full", seed=3, prior_precision=5.0)
    with pytest.raises(InvalidInputError, match=r"same prior.*inference\.combine"):
        _ = a + other
    combine([a, other])  # the combination chooses one prior for them
    with pytest.raises(InvalidInputError, match="different parameter shapes"):
        _ = a + random_posterior("full", shape=(3, 2), prior_precision=2.0)


def test_average_of_diagonal_posteriors_matches_mixture_moments_in_any_order():
    posts = [random_posterior("diag", seed=s) for s in range(3)]
    weights = [1.0, 2.0, 3.0]
    result = average(posts, weights)
    w = torch.tensor(weights, dtype=F64) / 6
    means = torch.stack([p.flat_mean for p in posts])
    variances = torch.stack([p.marginal_variance().reshape(-1) for p in posts])
    mean = (w[:, None] * means).sum(0)
    second_moment = (w[:, None] * (variances + means**2)).sum(0)
    torch.testing.assert_close(result.flat_mean, mean, atol=1e-12, rtol=0)
    torch.testing.assert_close(result.marginal_variance().reshape(-1), second_moment - mean**2,
                               atol=1e-12, rtol=0)
    assert result.structure.value == "diag"
    swapped = average(posts[::-1], weights[::-1])
    torch.testing.assert_close(swapped.flat_mean, result.flat_mean, atol=1e-12, rtol=0)
    torch.testing.assert_close(swapped.natural.diag, result.natural.diag, atol=1e-10, rtol=1e-12)


def test_average_of_full_posteriors_matches_mixture_covariance():
    posts = [random_posterior("full", seed=s) for s in range(3)] + [random_posterior("lowrank")]
    result = average(posts)  # equal n_data → equal weights
    means = torch.stack([p.flat_mean for p in posts])
    mean = means.mean(0)
    second = sum(p.covariance() + torch.outer(m, m) for p, m in zip(posts, means, strict=True))
    cov = second / 4 - torch.outer(mean, mean)
    torch.testing.assert_close(result.covariance(), cov, atol=1e-10, rtol=0)
    torch.testing.assert_close(result.flat_mean, mean, atol=1e-10, rtol=0)


def test_average_of_one_posterior_is_that_posterior():
    post = random_posterior("full")
    result = average([post])
    torch.testing.assert_close(result.covariance(), post.covariance(), atol=1e-10, rtol=0)
    torch.testing.assert_close(result.mean, post.mean, atol=1e-10, rtol=0)


def test_non_positive_definite_precision_raises_a_clear_error():
    prior = GaussianTerm.zeros(2, "full")
    bad = GaussianTerm("full", torch.zeros(2, dtype=F64),
                       dense=torch.tensor([[1.0, 0.0], [0.0, -1.0]], dtype=F64))
    post = GaussianPosterior(prior, bad, (2,))
    with pytest.raises(NumericalError, match="not positive definite"):
        _ = post.mean
    negative_diag = GaussianPosterior(GaussianTerm.zeros(2), GaussianTerm(
        "diag", torch.zeros(2, dtype=F64), diag=torch.tensor([1.0, -2.0], dtype=F64)), (2,))
    with pytest.raises(NumericalError, match="not positive"):
        negative_diag.sample(3)


def test_cholesky_jitter_rescues_a_singular_psd_matrix_only_slightly():
    v = torch.tensor([[1.0], [1.0]], dtype=F64)
    singular = v @ v.T  # eigenvalues 0 and 2
    factor = cholesky_with_jitter(singular)
    # the jitter added is at most 1e-6 · mean|diag| = 1e-6
    assert (factor @ factor.T - singular).abs().max() <= 1e-6


@pytest.mark.parametrize("columns", [1, 3])
def test_solving_with_a_factor_is_the_dense_solve(columns):
    gen = torch.Generator().manual_seed(4)
    root = torch.randn(40, 60, generator=gen, dtype=F64)
    precision = root @ root.T / 60 + 0.1 * torch.eye(40, dtype=F64)
    rhs = torch.randn(40, columns, generator=gen, dtype=F64)
    factor = torch.linalg.cholesky(precision)
    # condition number <= ~1e2 here: the two solves agree with the dense one to ~1e-13
    torch.testing.assert_close(solve_with_factor(factor, rhs),
                               torch.linalg.solve(precision, rhs), rtol=1e-10, atol=1e-12)


def test_state_dict_round_trips_through_torch_load_weights_only(tmp_path):
    for structure in STRUCTURES:
        post = random_posterior(structure)
        torch.save(post.state_dict(), tmp_path / "p.pt")
        state = torch.load(tmp_path / "p.pt", weights_only=True)
        loaded = GaussianPosterior.from_state_dict(state)
        assert loaded.structure == post.structure and loaded.shape == post.shape
        torch.testing.assert_close(loaded.mean, post.mean, atol=0, rtol=0)
        assert all(isinstance(v, torch.Tensor) for v in state.values())


@pytest.mark.parametrize("device", DEVICES)
def test_to_device_moves_everything(device):
    post = random_posterior("lowrank").to(device)
    assert post.mean.device.type == device
    assert post.sample(2).device.type == device
    # a CPU generator seeds the draws of a posterior on any device, reproducibly
    cpu_draws = random_posterior("lowrank").sample(2, generator=torch.Generator().manual_seed(4))
    draws = post.sample(2, generator=torch.Generator().manual_seed(4))
    assert draws.device.type == device
    torch.testing.assert_close(draws.cpu(), cpu_draws, atol=1e-12, rtol=0)
    x = torch.randn(3, 2, device=device)
    assert post.predict_proba(x).device.type == device


def test_float32_storage_computes_in_float64_and_returns_float32():
    post = random_posterior("full")
    post32 = GaussianPosterior(post.prior.to(dtype=torch.float32),
                               post.likelihood.to(dtype=torch.float32), post.shape)
    assert post32.mean.dtype == torch.float32
    torch.testing.assert_close(post32.mean.double(), post.mean, atol=1e-5, rtol=0)


def test_malformed_terms_and_states_are_rejected():
    with pytest.raises(InvalidInputError, match="one floating dtype and one device"):
        GaussianTerm("diag", torch.zeros(3), diag=torch.ones(3, dtype=F64))
    with pytest.raises(InvalidInputError, match="cannot subtract terms of dimension 3 and 2"):
        _ = GaussianTerm.zeros(3) - GaussianTerm.zeros(2)
    state = random_posterior("diag").state_dict()
    del state["shape"]
    with pytest.raises(InvalidInputError, match="lacks"):
        GaussianPosterior.from_state_dict(state)
    with pytest.raises(InvalidInputError, match="positive int"):
        random_posterior("full").sample(-1)
