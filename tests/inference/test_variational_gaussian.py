"""The KL-optimal Gaussian of a softmax head: its fixed point checked by exact quadrature, and
what it changes against the Laplace Gaussian where the data are separable."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from inference.laplace_head import fit_laplace_head
from inference.linear_model import augment_with_bias
from tests.inference.ground_truth import linear_regression

F64 = torch.float64


def two_class_data(n: int = 40, seed: int = 0, separation: float = 2.0):
    gen = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 2
    x = torch.randn(n, 2, generator=gen, dtype=F64) + separation * (2.0 * y[:, None] - 1.0)
    return x, y


def quadrature_fixed_point_residuals(post, x, y, prior_precision):
    """Exact (Gauss-Hermite) E_q[∇ log lik] − λ μ and E_q[H] for a 2-class head under the
    posterior's Gaussian: only the logit difference δ = f₁ − f₀ ~ N(m, v) matters."""
    nodes, weights = np.polynomial.hermite_e.hermegauss(120)  # exact for smooth σ to ~1e-14
    nodes, weights = torch.tensor(nodes), torch.tensor(weights) / math.sqrt(2 * math.pi)
    inputs = augment_with_bias(x)
    mean = post.mean.to(F64)
    cov = post.covariance().reshape(2, 3, 2, 3)
    m = inputs @ (mean[1] - mean[0])
    block = cov[1, :, 1] + cov[0, :, 0] - cov[0, :, 1] - cov[1, :, 0]
    v = torch.einsum("np,pq,nq->n", inputs, block, inputs)
    delta = m[:, None] + v.sqrt()[:, None] * nodes[None]
    p1 = (torch.sigmoid(delta) * weights).sum(1)  # E[σ(δ)]
    p01 = (torch.sigmoid(delta) * torch.sigmoid(-delta) * weights).sum(1)  # E[σ(1 − σ)]
    expected = torch.stack([1 - p1, p1], 1)
    one_hot = torch.nn.functional.one_hot(y, 2).to(F64)
    gradient = ((one_hot - expected).T @ inputs).reshape(-1) - prior_precision * post.flat_mean
    sign = torch.tensor([[1.0, -1.0], [-1.0, 1.0]], dtype=F64)
    curvature = torch.einsum("n,ck,np,nq->cpkq", p01, sign, inputs, inputs).reshape(6, 6)
    return gradient, curvature


def test_the_variational_gaussian_satisfies_its_fixed_point_equations_by_exact_quadrature():
    x, y = two_class_data()
    lam = 0.5
    post = fit_laplace_head(x, y, 2, prior_precision=lam, num_draws=20_000)
    gradient, curvature = quadrature_fixed_point_residuals(post, x, y, lam)
    # The solver's expectations are Monte-Carlo averages (20,000 draws a point, 40 points):
    # relative errors ~1/sqrt(20,000 x 40) ≈ 0.1-0.5%, which sets the tolerances; its own
    # stopping rule (predicted gain ≤ 1e-3 nats) is looser than the draws' error here.
    lik_precision = post.likelihood.precision_matrix()
    assert float((lik_precision - curvature).abs().max()) <= 0.02 * float(curvature.abs().max())
    natural = torch.linalg.solve(post.natural.precision_matrix(), gradient)
    assert float(gradient @ natural) / 2 < 2e-3  # the ELBO's predicted gain of a Newton step


def test_on_separable_data_it_is_narrower_than_laplace_where_the_data_rule_heads_out():
    x, y = two_class_data(separation=3.0)  # separated: the curvature at the mode vanishes
    laplace = fit_laplace_head(x, y, 2, prior_precision=0.5, approximation="laplace")
    variational = fit_laplace_head(x, y, 2, prior_precision=0.5)
    inputs = augment_with_bias(x)

    def misclassifying_draws(post):  # share of draws that misclassify some training point
        draws = post.sample(4000, generator=torch.Generator().manual_seed(1))
        logits = torch.einsum("np,scp->snc", inputs, draws)
        return float((logits.argmax(-1) != y).any(1).double().mean())

    assert misclassifying_draws(variational) < 0.5 * misclassifying_draws(laplace)
    confidence = {name: float(post.predict_proba(x, "mc", n_samples=2000,
                                                 generator=torch.Generator().manual_seed(0))
                              .max(1).values.mean())
                  for name, post in (("laplace", laplace), ("variational", variational))}
    assert confidence["variational"] > confidence["laplace"]


@pytest.mark.parametrize("structure", ["diag", "lowrank"])
def test_the_other_structures_are_fitted_too(structure):
    x, y = two_class_data()
    post = fit_laplace_head(x, y, 2, prior_precision=0.5, structure=structure, rank=3,
                            num_draws=20_000)
    assert post.structure.value == structure
    if structure == "diag":  # mean field: Λ_ii = λ + E_q[H_ii], checked by quadrature
        _, curvature = quadrature_fixed_point_residuals(post, x, y, 0.5)
        diag = post.likelihood.precision_diagonal()
        assert float((diag - curvature.diagonal()).abs().max()) <= 0.02 * float(diag.max())


def test_it_is_the_default_reproducible_from_its_seed_and_laplace_for_a_gaussian_likelihood():
    x, y = two_class_data()
    a = fit_laplace_head(x, y, 2, prior_precision=0.5)
    b = fit_laplace_head(x, y, 2, prior_precision=0.5, approximation="variational", seed=0)
    mode = fit_laplace_head(x, y, 2, prior_precision=0.5, approximation="laplace")
    torch.testing.assert_close(a.mean, b.mean, rtol=0, atol=0)
    assert float((a.mean - mode.mean).abs().max()) > 1e-3  # the mean moves off the mode
    truth = linear_regression()
    post = fit_laplace_head(truth.features, truth.targets, 1, likelihood="gaussian",
                            noise_std=truth.noise_std, prior_precision=truth.prior_precision,
                            approximation="variational")
    torch.testing.assert_close(post.mean, truth.mean, atol=1e-10, rtol=0)  # exact either way


def test_a_given_start_factor_gives_the_same_gaussian_as_factorising_the_start():
    """``start_factor`` (the Laplace posterior's cached factor, issue 41) only saves work."""
    from inference.gaussian import cholesky_with_jitter
    from inference.head_objective import likelihood_hessian
    from inference.laplace_head import find_mode
    from inference.options import Likelihood
    from inference.variational_gaussian import variational_gaussian

    x, y = two_class_data()
    inputs = augment_with_bias(x.to(torch.float64))
    mode = find_mode(inputs, y, 2, 1.0)
    precision = likelihood_hessian(mode, inputs, 2, Likelihood.SOFTMAX, 1.0) + torch.eye(
        mode.shape[0], dtype=torch.float64)
    precision = 0.5 * (precision + precision.T)
    plain = variational_gaussian(mode, precision, inputs, y, 2, 1.0, 0.0, num_draws=32)
    given = variational_gaussian(mode, precision, inputs, y, 2, 1.0, 0.0, num_draws=32,
                                 start_factor=cholesky_with_jitter(precision))
    # the same factor of the same matrix: the same iterates up to rounding
    for a, b in zip(plain, given, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


def _laplace_start(x, y, classes, lam):
    from inference.gaussian import cholesky_with_jitter
    from inference.head_objective import likelihood_hessian
    from inference.laplace_head import find_mode
    from inference.options import Likelihood

    inputs = augment_with_bias(x.to(F64))
    mode = find_mode(inputs, y, classes, lam)
    precision = likelihood_hessian(mode, inputs, classes, Likelihood.SOFTMAX, 1.0)
    precision.diagonal().add_(lam)
    return inputs, mode, precision, cholesky_with_jitter(precision)


def test_a_full_fits_mean_step_is_newtons_step_on_its_draws_elbo():
    """The mean's step under a fixed precision (issue 41) solves (λI + E_q[H]) s = g, the fixed
    draws' ELBO Hessian in μ, to the conjugate gradients' stated residual: checked against the
    dense matrix of that Hessian, assembled by the independent einsum below."""
    from inference.variational_gaussian import MEAN_CG_RTOL, _mean_newton_direction, _Problem

    x, y = two_class_data(n=60, separation=1.0)
    y = y + (x[:, 0] > 1.5).long()  # three classes
    lam = 0.7
    inputs, mode, precision, chol = _laplace_start(x, y, 3, lam)
    problem = _Problem(inputs, y, 3, lam, 0.0, False, 32, 0)
    fixed = problem.fix_precision(precision, chol)
    state = problem.newton(problem.at_mean(mode + 0.05, fixed), fixed)
    probs = state.probs  # (S, N, C)
    block = torch.diag_embed(probs.mean(0)) - torch.einsum("snc,snk->nck", probs, probs) / 32
    hessian = torch.einsum("nck,np,nq->cpkq", block, inputs, inputs).reshape(9, 9)
    hessian = hessian + lam * torch.eye(9, dtype=F64)
    residual = state.gradient - hessian @ state.step
    assert float(residual.norm()) <= MEAN_CG_RTOL * float(state.gradient.norm())
    # and the reported decrement is gᵀ s of that step
    assert state.decrement == pytest.approx(float(state.gradient @ state.step), rel=1e-12)
    # run to a tight residual, the same conjugate gradients give the dense solve itself (its
    # products are the Hessian's): 1e-8 relative for a 9 x 9 system of condition ~1e2
    tight = _mean_newton_direction(probs, inputs, lam, state.gradient,
                                   lambda vector: fixed.covariance @ vector, rtol=1e-12)
    exact = torch.linalg.solve(hessian, state.gradient)
    torch.testing.assert_close(tight, exact, rtol=1e-8, atol=1e-10)


def test_a_full_fit_returns_a_precision_and_the_best_mean_under_it():
    """The KL-optimal Gaussian of a full fit is a pair the fit has evaluated: its mean leaves a
    Newton step on the same draws' ELBO under its own precision at most the mean loop's
    ``MEAN_TOL_SHARE · tol`` nats (not a mean paired with the next target precision), and that
    ELBO is above the Laplace start's (the blocks only climb)."""
    from inference.variational_gaussian import (
        MEAN_TOL_SHARE,
        _Problem,
        default_tolerances,
        variational_gaussian,
    )

    x, y = two_class_data(n=80, separation=2.5)
    lam = 0.5
    inputs, mode, precision, chol = _laplace_start(x, y, 2, lam)
    mean, curvature = variational_gaussian(mode, precision, inputs, y, 2, lam, 0.0,
                                           num_draws=64, seed=3)
    problem = _Problem(inputs, y, 2, lam, 0.0, False, 64, 3)  # the same draws
    found = precision.new_tensor(curvature)
    found.diagonal().add_(lam)
    fixed = problem.fix_precision(found, None)
    state = problem.newton(problem.at_mean(mean, fixed), fixed)
    tol, _ = default_tolerances(len(y), 64)
    assert state.decrement / 2 <= MEAN_TOL_SHARE * tol
    start = problem.fix_precision(precision, chol)
    assert state.elbo > problem.at_mean(mode, start).elbo


def test_the_remaining_gain_is_the_tail_of_the_gains_geometric_series():
    from inference.variational_gaussian import remaining_gain

    # gains 2, then 0.2: ratio 0.1, what is left 0.2 (0.1 + 0.01 + ...) = 0.2 * 0.1 / 0.9
    assert remaining_gain([5.0, 2.0, 0.2]) == pytest.approx(0.2 * 0.1 / 0.9, rel=1e-15)
    assert remaining_gain([0.3]) == math.inf  # one gain: no ratio yet
    assert remaining_gain([0.1, 0.2]) == math.inf  # growing: no geometric tail
    assert remaining_gain([0.5, 0.0]) == math.inf  # a flat step proves nothing


def _relu_features(seed: int, separation: float, rows: int = 250):
    """S1-like client features: 5 of 10 classes, ReLU features of clustered inputs (separable
    at the mode, the regime of a head on a trained body)."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.arange(rows) % 5 * 2
    centres = torch.randn(10, 20, generator=gen, dtype=F64) * separation
    z = centres[y] + torch.randn(rows, 20, generator=gen, dtype=F64)
    projection = torch.randn(20, 100, generator=gen, dtype=F64) / math.sqrt(20)
    return torch.relu(z @ projection), y


def test_the_extrapolated_stop_saves_precision_steps_and_loses_nothing_on_fresh_draws(
        monkeypatch):
    """Where the precision steps' gains shrink geometrically, the fit stops once their
    extrapolated tail is below ``tol``: fewer precision evaluations (each a factorisation, an
    inverse and the logit covariances) than running on to the precision's ``rtol`` or the
    draws' floor. What the longer run adds is gained on the fit's own draws only: on eight
    fresh draw sets, the ELBO that both estimate is, paired, no lower for the early stop than
    for the longer run by more than ``tol`` (here it is 0.18 nats higher on average; the
    Laplace start, 2,200 nats lower, would fail)."""
    import inference.variational_gaussian as vg

    x, y = _relu_features(seed=1, separation=2.0)
    lam = 1.0  # here the longer run makes 7 precision evaluations, the extrapolated stop 3
    inputs, mode, precision, chol = _laplace_start(x, y, 10, lam)
    evaluations = []

    def fit():
        evaluations.append(0)
        original = vg._Problem.fix_precision

        def counted(self, *args):
            evaluations[-1] += 1
            return original(self, *args)

        with monkeypatch.context() as patch:
            patch.setattr(vg._Problem, "fix_precision", counted)
            return vg.variational_gaussian(mode, precision, inputs, y, 10, lam, 0.0, seed=0,
                                           start_factor=chol)

    def fresh_elbos(mean, curvature):
        found = curvature.clone()
        found.diagonal().add_(lam)
        elbos = []
        for seed in range(1, 9):  # the fit's own draws are seed 0
            problem = vg._Problem(inputs, y, 10, lam, 0.0, False, vg.DEFAULT_NUM_DRAWS, seed)
            elbos.append(problem.at_mean(mean, problem.fix_precision(found, None)).elbo)
        return torch.tensor(elbos, dtype=F64)

    early = fresh_elbos(*fit())
    monkeypatch.setattr(vg, "remaining_gain", lambda gains: math.inf)
    longer = fresh_elbos(*fit())
    tol, _ = vg.default_tolerances(len(y), vg.DEFAULT_NUM_DRAWS)
    assert evaluations[0] < evaluations[1]
    assert float((early - longer).mean()) >= -tol


def test_a_full_fit_returns_the_factor_and_inverse_of_its_own_precision():
    """``return_factor`` (issue 41): ``(Λ, chol(Λ), Λ⁻¹)`` of the Gaussian returned, with ``Λ``
    exactly the total precision a posterior forms from the prior ``λI`` and the returned
    curvature (``λ + K_ii`` on the diagonal), so that the posterior may take the factor as its
    own; a diagonal fit returns none."""
    from inference.gaussian import cholesky_with_jitter
    from inference.variational_gaussian import variational_gaussian

    x, y = two_class_data()
    inputs, mode, precision, _ = _laplace_start(x, y, 2, 0.7)
    mean, curvature, (total, chol, covariance) = variational_gaussian(
        mode, precision, inputs, y, 2, 0.7, 0.0, num_draws=32, return_factor=True)
    prior = torch.diag_embed(torch.full((total.shape[0],), 0.7, dtype=torch.float64))
    assert torch.equal(total, prior + curvature)  # as GaussianPosterior sums its terms
    assert torch.equal(chol, cholesky_with_jitter(total))
    assert torch.equal(covariance, torch.cholesky_inverse(chol))
    plain = variational_gaussian(mode, precision, inputs, y, 2, 0.7, 0.0, num_draws=32)
    assert torch.equal(plain[0], mean) and torch.equal(plain[1], curvature)
    _, _, none = variational_gaussian(mode, precision.diagonal(), inputs, y, 2, 0.7, 0.0,
                                      num_draws=32, diagonal=True, return_factor=True)
    assert none is None
