"""Laplace head on fixed features: mode, exact Hessian, structures, and exactness when Gaussian."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.optimize
import torch

from inference.errors import InvalidInputError
from inference.laplace_head import (
    fit_laplace_head,
    likelihood_hessian,
    log_marginal_likelihood,
    negative_log_posterior,
)
from inference.options import Likelihood
from tests.devices import DEVICES
from tests.inference.ground_truth import linear_regression

F64 = torch.float64


def three_class_data(n: int = 120, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=gen, dtype=F64)
    w = torch.randn(3, 4, generator=gen, dtype=F64)
    logits = torch.cat([torch.ones(n, 1, dtype=F64), x], 1) @ w.T
    y = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)[:, 0]
    return x, y


def objective(x, y, prior_precision=0.7):
    inputs = torch.cat([torch.ones(len(y), 1, dtype=F64), x], 1)

    def f(theta):
        return negative_log_posterior(theta, inputs, y, 3, prior_precision, 0.0,
                                      Likelihood.SOFTMAX, 1.0)

    return f


def test_mode_matches_scipy_lbfgs_and_the_gradient_vanishes():
    x, y = three_class_data()
    post = fit_laplace_head(x, y, 3, prior_precision=0.7)
    f = objective(x, y)

    def value_and_grad(theta_np):
        theta = torch.tensor(theta_np, requires_grad=True)
        value = f(theta)
        value.backward()
        return float(value.detach()), theta.grad.numpy()

    ref = scipy.optimize.minimize(value_and_grad, np.zeros(12), jac=True, method="L-BFGS-B",
                                  options={"gtol": 1e-12, "ftol": 1e-15, "maxiter": 1000})
    # tolerance 1e-6: scipy's L-BFGS stopping accuracy on a condition number ~1e2 problem
    np.testing.assert_allclose(post.flat_mean.numpy(), ref.x, atol=1e-6)
    theta = post.flat_mean.clone().requires_grad_(True)
    f(theta).backward()
    assert theta.grad.abs().max() < 1e-10


def test_newton_and_lbfgs_solvers_find_the_same_mode():
    x, y = three_class_data()
    newton = fit_laplace_head(x, y, 3, prior_precision=0.7, solver="newton")
    lbfgs = fit_laplace_head(x, y, 3, prior_precision=0.7, solver="lbfgs")
    torch.testing.assert_close(newton.mean, lbfgs.mean, atol=1e-6, rtol=0)


def test_posterior_precision_is_the_autograd_hessian_at_the_mode():
    x, y = three_class_data()
    post = fit_laplace_head(x, y, 3, prior_precision=0.7, structure="full")
    hessian = torch.autograd.functional.hessian(objective(x, y), post.flat_mean)
    # tolerance 1e-10: both exact, float64 (sum of 120 terms)
    torch.testing.assert_close(post.natural.precision_matrix(), hessian, atol=1e-10, rtol=0)


def test_likelihood_hessian_formula_matches_autograd_away_from_the_mode():
    x, y = three_class_data()
    inputs = torch.cat([torch.ones(len(y), 1, dtype=F64), x], 1)
    theta = torch.randn(12, dtype=F64, generator=torch.Generator().manual_seed(5))
    reference = torch.autograd.functional.hessian(objective(x, y, 0.0), theta)
    torch.testing.assert_close(likelihood_hessian(theta, inputs, 3, Likelihood.SOFTMAX, 1.0),
                               reference, atol=1e-10, rtol=0)


def test_diag_and_lowrank_structures_keep_the_mode_and_the_exact_diagonal():
    x, y = three_class_data()
    full = fit_laplace_head(x, y, 3, structure="full")
    diag = fit_laplace_head(x, y, 3, structure="diag")
    low = fit_laplace_head(x, y, 3, structure="lowrank", rank=4)
    exact = fit_laplace_head(x, y, 3, structure="lowrank", rank=12)
    for post in (diag, low, exact):
        torch.testing.assert_close(post.mean, full.mean, atol=1e-9, rtol=0)
        torch.testing.assert_close(post.natural.precision_diagonal(),
                                   full.natural.precision_diagonal(), atol=1e-9, rtol=0)
    torch.testing.assert_close(exact.covariance(), full.covariance(), atol=1e-9, rtol=0)
    assert diag.structure.value == "diag" and low.likelihood.factor.shape == (12, 4)


def test_gaussian_likelihood_laplace_is_the_closed_form_posterior():
    truth = linear_regression()
    post = fit_laplace_head(truth.features, truth.targets, 1, likelihood="gaussian",
                            noise_std=truth.noise_std, prior_precision=truth.prior_precision)
    torch.testing.assert_close(post.mean, truth.mean, atol=1e-10, rtol=0)
    torch.testing.assert_close(post.covariance(), truth.covariance, atol=1e-10, rtol=0)


def test_bad_labels_and_options_are_rejected():
    x, y = three_class_data()
    with pytest.raises(InvalidInputError, match="labels must lie in"):
        fit_laplace_head(x, y + 3, 3)
    with pytest.raises(InvalidInputError, match="structure must be one of"):
        fit_laplace_head(x, y, 3, structure="kron")
    with pytest.raises(InvalidInputError, match="NaN"):
        fit_laplace_head(x * float("nan"), y, 3)
    with pytest.raises(InvalidInputError, match="rank must be at least 1"):
        fit_laplace_head(x, y, 3, structure="lowrank", rank=0)
    with pytest.raises(InvalidInputError, match="max_iter must be at least 1"):
        fit_laplace_head(x, y, 3, max_iter=0)
    with pytest.raises(InvalidInputError, match="noise_std must be positive"):
        fit_laplace_head(x, y.double(), 1, likelihood="gaussian", noise_std=0.0)
    with pytest.raises(InvalidInputError, match="one output"):
        fit_laplace_head(x, y.double(), 3, likelihood="gaussian")
    with pytest.raises(InvalidInputError, match="targets must be a tensor"):
        fit_laplace_head(x, y.tolist(), 3)


@pytest.mark.parametrize("device", DEVICES)
def test_fits_and_predicts_on_the_features_device(device):
    x, y = three_class_data()
    post = fit_laplace_head(x.float().to(device), y.to(device), 3, structure="diag")
    probs = post.predict_proba(x.float().to(device))
    assert probs.device.type == device and probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(-1), torch.ones(len(y), device=device))


def test_log_marginal_likelihood_is_exact_for_the_gaussian_likelihood():
    truth = linear_regression()
    for precision in (0.1, 1.0, 10.0):
        post = fit_laplace_head(truth.features, truth.targets, 1, likelihood="gaussian",
                                noise_std=truth.noise_std, prior_precision=precision)
        value = log_marginal_likelihood(post, truth.features, truth.targets, "gaussian",
                                        truth.noise_std)
        inputs = torch.cat([torch.ones(len(truth.targets), 1, dtype=F64), truth.features], 1)
        cov = truth.noise_std**2 * torch.eye(len(truth.targets), dtype=F64)
        cov = cov + inputs @ inputs.T / precision
        exact = torch.distributions.MultivariateNormal(torch.zeros(len(truth.targets),
                                                                   dtype=F64), cov)
        # tolerance 1e-8 nats: both exact in float64
        assert abs(value - float(exact.log_prob(truth.targets))) < 1e-8


def test_log_marginal_likelihood_of_diag_and_lowrank_use_their_own_precision():
    x, y = three_class_data()
    full = fit_laplace_head(x, y, 3, structure="full")
    exact_lowrank = fit_laplace_head(x, y, 3, structure="lowrank", rank=12)
    diag = fit_laplace_head(x, y, 3, structure="diag")
    a = log_marginal_likelihood(full, x, y)
    assert abs(log_marginal_likelihood(exact_lowrank, x, y) - a) < 1e-8
    # Hadamard: log|Λ| ≤ Σ log Λ_ii, so the diagonal evidence is lower
    assert log_marginal_likelihood(diag, x, y) < a


@pytest.mark.parametrize("structure", ["full", "diag"])
def test_probit_predictive_matches_laplace_torch_on_the_same_head(structure):
    from laplace import Laplace
    from torch import nn

    x, y = three_class_data()
    post = fit_laplace_head(x, y, 3, prior_precision=0.7, structure=structure)
    linear = nn.Linear(3, 3).double()
    with torch.no_grad():  # the same MAP head; laplace-torch orders weight before bias
        linear.bias.copy_(post.mean[:, 0])
        linear.weight.copy_(post.mean[:, 1:])
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=40)
    reference = Laplace(linear, "classification", subset_of_weights="all",
                        hessian_structure=structure, prior_precision=0.7)
    reference.fit(loader)
    expected = reference(x, pred_type="glm", link_approx="probit")
    # Same Gaussian (laplace-torch's GGN is the exact softmax Hessian); measured differences
    # are ~2e-8 (float64 round-off through its Jacobian path), tolerance 1e-7.
    torch.testing.assert_close(post.predict_proba(x, "probit"), expected, atol=1e-7, rtol=0)
