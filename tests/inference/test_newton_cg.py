"""Matrix-free Newton-CG for the softmax head's mode (issue 41): its conjugate-gradient solve
against a dense solve, its mode against factorising Newton and L-BFGS, and the Laplace head's
fit (λ by evidence, then the KL-optimal Gaussian) with and without it."""

from __future__ import annotations

import pytest
import torch

import inference.laplace_head as laplace_head
import inference.laplace_marglik as laplace_marglik
from inference.errors import NumericalError
from inference.head_objective import likelihood_hessian, negative_log_posterior
from inference.laplace_head import find_mode, fit_laplace_head
from inference.laplace_marglik import _preconditioned_cg, newton_cg
from inference.linear_model import augment_with_bias
from inference.options import Likelihood

F64 = torch.float64


def relu_data(rows: int = 60, width: int = 8, classes: int = 4, seed: int = 0):
    """Non-negative, nearly separable features (the regime of a head on a trained body)."""
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes, (rows,), generator=gen)
    centres = 2.0 * torch.randn(classes, width, generator=gen, dtype=F64)
    features = (centres[labels] + torch.randn(rows, width, generator=gen, dtype=F64)).relu()
    return features, labels


def test_preconditioned_cg_solves_a_positive_definite_system():
    gen = torch.Generator().manual_seed(1)
    root = torch.randn(30, 30, generator=gen, dtype=F64)
    matrix = root @ root.T + 0.1 * torch.eye(30, dtype=F64)
    rhs = torch.randn(30, generator=gen, dtype=F64)
    diagonal = matrix.diagonal().clone()
    solution, product = _preconditioned_cg(lambda v: matrix @ v, lambda r: r / diagonal, rhs,
                                           1e-12)
    exact = torch.linalg.solve(matrix, rhs)
    # relative residual 1e-12 with condition number ≲ 1e5: the solution to ~1e-7 relative
    torch.testing.assert_close(solution, exact, atol=1e-6 * float(exact.abs().max()), rtol=0)
    assert product == pytest.approx(float(rhs @ exact), rel=1e-8)


@pytest.mark.parametrize("prior_precision", [0.05, 3.0, 200.0])
def test_newton_cg_reaches_the_mode_factorising_newton_and_lbfgs_find(prior_precision):
    features, labels = relu_data()
    inputs = augment_with_bias(features)
    gen = torch.Generator().manual_seed(2)
    prior_mean = 0.3 * torch.randn(4 * 9, generator=gen, dtype=F64)  # a global head's mean

    def objective(theta):
        return negative_log_posterior(theta, inputs, labels, 4, prior_precision, prior_mean,
                                      Likelihood.SOFTMAX, 1.0)

    one_hot = torch.nn.functional.one_hot(labels, 4).to(F64)
    mode, converged = newton_cg(objective, inputs, one_hot, prior_precision, prior_mean,
                                prior_mean.clone(), 1e-12, 100)
    assert converged
    exact = laplace_head._newton(  # factorising Newton with the exact Hessian
        objective, lambda t: likelihood_hessian(t, inputs, 4, Likelihood.SOFTMAX, 1.0),
        prior_mean.clone(), prior_precision, 100, 1e-12)
    lbfgs = find_mode(inputs, labels, 4, prior_precision, prior_mean, solver="lbfgs")
    # half the squared Newton decrement ≤ 1e-12 nats: the distance to the mode in the
    # precision's norm is ≤ ~1.4e-6, so ≤ 1.4e-6 / sqrt(λ) (≤ 7e-6 at λ = 0.05) per weight;
    # L-BFGS stops at gradient 1e-10, i.e. ≤ 1e-10 / λ = 2e-9
    scale = 1e-5 / min(1.0, prior_precision) ** 0.5
    torch.testing.assert_close(mode, exact, atol=scale, rtol=0)
    torch.testing.assert_close(mode, lbfgs, atol=scale, rtol=0)
    # preconditioned by a covariance (the search's refits: the previous refit's Σ), the same
    precision = likelihood_hessian(prior_mean, inputs, 4, Likelihood.SOFTMAX, 1.0)
    covariance = torch.linalg.inv(precision + prior_precision * torch.eye(36, dtype=F64))
    by_covariance, converged = newton_cg(objective, inputs, one_hot, prior_precision,
                                         prior_mean, prior_mean.clone(), 1e-12, 100,
                                         covariance=covariance)
    assert converged
    torch.testing.assert_close(by_covariance, exact, atol=scale, rtol=0)
    # find_mode's default Newton is this one
    torch.testing.assert_close(find_mode(inputs, labels, 4, prior_precision, prior_mean),
                               mode, atol=1e-12, rtol=0)


def test_newton_cg_says_when_it_has_not_converged_and_find_mode_goes_on_by_factorising():
    features, labels = relu_data(seed=3)
    inputs = augment_with_bias(features)
    one_hot = torch.nn.functional.one_hot(labels, 4).to(F64)

    def objective(theta):
        return negative_log_posterior(theta, inputs, labels, 4, 1.0, 0.0, Likelihood.SOFTMAX,
                                      1.0)

    start = torch.zeros(36, dtype=F64)
    point, converged = newton_cg(objective, inputs, one_hot, 1.0, 0.0, start, 1e-12, 1)
    assert not converged
    assert float(objective(point)) < float(objective(start))  # one damped step descends
    mode = find_mode(inputs, labels, 4, 1.0, max_iter=100)
    torch.testing.assert_close(find_mode(inputs, labels, 4, 1.0, solver="lbfgs"), mode,
                               atol=1e-5, rtol=0)


@pytest.mark.parametrize("scale", [1e38, float("inf")])
def test_overflowing_rows_are_never_reported_as_a_mode(scale):
    """Rows of ~1e38 (a body fed overflowing inputs) make curvatures of ~1e76 whose CG solve
    breaks down at a zero step, which read as a converged mode with a gradient of ~1e42 (the
    FedPop divergence test caught it); infinite rows made torch's eigh raise its own error.
    Newton-CG hands both back unconverged, and find_mode's factorising Newton then refuses
    them with the project's error, as it did before Newton-CG."""
    features, labels = relu_data(seed=1)
    features[labels == 0] = scale
    inputs = augment_with_bias(features)
    one_hot = torch.nn.functional.one_hot(labels, 4).to(F64)

    def objective(theta):
        return negative_log_posterior(theta, inputs, labels, 4, 1.0, 0.0, Likelihood.SOFTMAX,
                                      1.0)

    start = torch.zeros(36, dtype=F64)
    _, converged = newton_cg(objective, inputs, one_hot, 1.0, 0.0, start, 1e-12, 100)
    assert not converged
    with pytest.raises(NumericalError):
        find_mode(inputs, labels, 4, 1.0)


def test_the_fit_chooses_the_same_prior_and_posterior_with_and_without_newton_cg(monkeypatch):
    """Paired: the Laplace head at its defaults (λ by the refitted evidence, then the
    KL-optimal Gaussian), its modes by Newton-CG (default) and by factorising Newton only."""
    features, labels = relu_data(rows=80, seed=4)
    fast = fit_laplace_head(features, labels, 4)

    def no_cg(objective, inputs, one_hot, prior_precision, prior_mean, theta, tol, max_iter,
              gram=None, covariance=None):
        return theta, False  # the caller's factorising Newton does all the work

    monkeypatch.setattr(laplace_marglik, "newton_cg", no_cg)
    monkeypatch.setattr(laplace_head, "newton_cg", no_cg)
    slow = fit_laplace_head(features, labels, 4)
    # the refits with a slope stop at loose modes (LOOSE_MODE_TOL) that the two solvers reach
    # differently, so the two paths of λ differ (by ~1e-3 at the third refit here) and end
    # at two estimates of the maximiser, each within ~1e-3 of it (LAMBDA_RTOL): measured 9e-5
    # apart
    assert fast.prior_selection.value == pytest.approx(slow.prior_selection.value, rel=5e-4)
    assert fast.prior_selection.criterion == pytest.approx(slow.prior_selection.criterion,
                                                           abs=1e-6)
    test_features, _ = relu_data(rows=50, seed=5)
    # the predictive moves with λ (9e-5 relative, measured) and the mode (1e-6): below 1e-4
    torch.testing.assert_close(fast.predict_proba(test_features),
                               slow.predict_proba(test_features), atol=1e-4, rtol=0)


def test_a_softmax_head_of_any_size_defaults_to_matrix_free_newton(monkeypatch):
    """Above `NEWTON_MAX_PARAMETERS` a softmax head's default solver is still Newton-CG (it
    factorises nothing, so its cost does not grow with d³): L-BFGS is not called, and the mode
    it returns is stationary. A Gaussian likelihood above that size keeps L-BFGS (its Newton
    factorises a d x d matrix per step)."""
    called = []
    monkeypatch.setattr(laplace_head, "NEWTON_MAX_PARAMETERS", 20)  # a small head counts as big
    original = laplace_head._lbfgs
    monkeypatch.setattr(laplace_head, "_lbfgs", lambda *args: called.append(1) or original(*args))
    features, labels = relu_data()
    inputs = augment_with_bias(features)  # 4 classes x 9 = 36 > 20 parameters
    mode = find_mode(inputs, labels, 4, 1.0)
    assert not called
    theta = mode.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(negative_log_posterior(
        theta, inputs, labels, 4, 1.0, 0.0, Likelihood.SOFTMAX, 1.0), theta)
    # the decrement test (1e-12 nats) leaves a gradient of ~sqrt(2e-12 · curvature) at most
    assert float(grad.abs().max()) < 1e-5
    targets = features[:, 0].clone()
    find_mode(inputs, targets, 1, 1.0, likelihood="gaussian")  # 9 parameters: Newton
    assert not called
    find_mode(torch.cat([inputs] * 3, 1), targets, 1, 1.0, likelihood="gaussian")  # 27 > 20
    assert called
