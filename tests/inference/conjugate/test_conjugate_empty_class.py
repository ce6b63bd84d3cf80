"""A class without data in the conjugate posterior's Laplace approximation (inference.conjugate
.laplace, "Classes without data"): its block is the moment-matched Gaussian of its conditional
posterior, not the inverse of its (vanishing) curvature at the MAP."""

import math

import numpy as np
import pytest
import torch
from scipy import integrate

from inference.conjugate.laplace import ConjugateLaplace, empty_class_variance
from inference.conjugate.posterior import ConjugatePosterior
from inference.conjugate.prior import ConjugatePrior
from inference.conjugate.solver import map_objective
from inference.conjugate.statistics import SufficientStatistics


@pytest.mark.parametrize(("A", "N", "k"), [(40.0, 1000.0, 51), (5.0, 30.0, 3), (0.7, 2.0, 1),
                                          (120.0, 5000.0, 11)])
def test_the_empty_class_variance_is_the_radial_second_moment(A, N, k):
    # independent reference: adaptive quadrature in u = r^2 (the implementation works in r on
    # a grid), scaled by the log-integrand's maximum and split where the density falls off
    # (u = 4 (A - log N) to 4 A); relative error 1e-7 leaves room for quad's tolerance and is
    # far below the effect (the old variance was about e^A / N times larger)
    def log_integrand(u, j):
        return (k / 2.0 - 1.0 + j) * np.log(u) - N * np.logaddexp(0.0, u / 4.0 - A)

    def moment(j):
        end = 4.0 * (max(A, 0.0) + 900.0 / N + 50.0)
        grid = np.linspace(end * 1e-9, end, 100_001)
        top = float(log_integrand(grid, j).max())
        cut = [4.0 * (A - math.log(N)), 4.0 * A]
        value, _ = integrate.quad(lambda u: math.exp(log_integrand(u, j) - top) if u > 0 else 0.0,
                                  0.0, end, points=[p for p in cut if 0.0 < p < end],
                                  limit=1000, epsabs=0.0, epsrel=1e-11)
        return math.log(value) + top

    reference = math.exp(moment(1) - moment(0)) / k
    assert empty_class_variance(A, N, k) == pytest.approx(reference, rel=1e-7)


def test_the_empty_class_variance_brute_force_against_the_exact_conditional_density():
    # the density of W_y given the other rows at the MAP is the exact posterior's
    # (map_objective) along W_y: sampling W_y uniformly in a box and weighting by it gives its
    # second moment; 400,000 points in k = 2 give ~0.5% Monte-Carlo error (tolerance 3%)
    generator = torch.Generator().manual_seed(0)
    S = torch.tensor([[10.0, 3.0], [12.0, -2.0], [0.0, 0.0]], dtype=torch.float64)
    N = 25.0
    W = torch.tensor([[4.0, 1.2], [4.2, -0.8], [0.0, 0.0]], dtype=torch.float64)
    A = float(torch.logsumexp(W[:2].pow(2).sum(1) / 4.0, 0))
    box = 2.0 * math.sqrt(A) + 6.0
    points = (torch.rand(400_000, 2, generator=generator, dtype=torch.float64) * 2 - 1) * box
    heads = W.expand(points.shape[0], 3, 2).clone()
    heads[:, 2] = points
    log_density = map_objective(heads, S, N)
    weights = torch.softmax(log_density, 0)
    second = float((weights * points.pow(2).sum(1)).sum()) / 2
    assert empty_class_variance(A, N, 2) == pytest.approx(second, rel=0.03)


def digits_like_posterior(seed: int = 0) -> tuple[ConjugatePosterior, torch.Tensor, torch.Tensor]:
    """Three classes of well-separated 6-d features (two seen: 200 rows each), a third class no
    client holds: the statistics' third row is zero."""
    generator = torch.Generator().manual_seed(seed)
    means = torch.zeros(3, 6, dtype=torch.float64)
    means[0, 0], means[1, 1], means[2, 2] = 4.0, 4.0, 4.0
    labels = torch.tensor([0] * 200 + [1] * 200)
    features = means[labels] + torch.randn(400, 6, generator=generator,
                                           dtype=torch.float64) / math.sqrt(2)
    stats = SufficientStatistics.from_features(features, labels, num_classes=3)
    return ConjugatePosterior(ConjugatePrior(), stats), features, labels


def test_an_empty_class_gets_the_moment_matched_block_and_the_others_keep_theirs():
    posterior, _, _ = digits_like_posterior()
    laplace = posterior.laplace()
    plain = ConjugateLaplace(laplace.mean, laplace.N)  # the curvature at the MAP everywhere
    assert laplace.empty.tolist() == [False, False, True]
    k = laplace.mean.shape[1]
    A = float(torch.logsumexp(laplace.mean[:2].pow(2).sum(1) / 4.0, 0))
    variances = laplace.marginal_variances()
    torch.testing.assert_close(variances[2], torch.full((k,), empty_class_variance(
        A, laplace.N, k), dtype=torch.float64), rtol=1e-12, atol=0)
    torch.testing.assert_close(variances[:2], plain.marginal_variances()[:2], rtol=1e-12, atol=0)
    assert float(plain.marginal_variances()[2, 0]) > 1e3 * float(variances[2, 0])
    # still one Gaussian: the precision is the covariance's inverse, and the factor its root
    cov, prec = laplace.dense_covariance(), laplace.dense_precision()
    torch.testing.assert_close(cov @ prec, torch.eye(cov.shape[0], dtype=torch.float64),
                               rtol=0, atol=1e-9)
    eye = torch.eye(cov.shape[0], dtype=torch.float64).reshape(-1, *laplace.mean.shape)
    factor = laplace.factor_matvec(eye).reshape(cov.shape[0], -1).T
    torch.testing.assert_close(factor @ factor.T, cov, rtol=1e-10, atol=1e-12)
    # and the logit moments agree with the covariance
    x = torch.cat([torch.ones(1, 1, dtype=torch.float64),
                   torch.randn(1, k - 1, dtype=torch.float64)], 1)
    _, variance = laplace.logit_moments(x)
    dense = torch.stack([x[0] @ cov.reshape(3, k, 3, k)[c, :, c, :] @ x[0] for c in range(3)])
    torch.testing.assert_close(variance[0], dense, rtol=1e-10, atol=1e-12)


def test_the_mc_predictive_no_longer_favours_a_class_without_data():
    # the bug: the Laplace variance 2 / (N p_y) of the empty class (p_y ~ e^-A) made its MC
    # logits huge, and the MC predictive put most of its mass on it (digits: accuracy 0 against
    # the plug-in's 0.99). On the seen classes' rows the MC predictive must now predict as the
    # plug-in and give the empty class little mass
    posterior, features, _ = digits_like_posterior()
    generator = torch.Generator().manual_seed(1)
    mc = posterior.predict_proba(features, method="mc", n_samples=512, generator=generator)
    plug_in = posterior.predict_proba(features, method="map")
    assert bool((mc.argmax(1) == plug_in.argmax(1)).all())
    assert float(mc[:, 2].mean()) < 0.05
    # the same draws through the curvature at the MAP: the failure this guards against
    plain = ConjugateLaplace(posterior.laplace().mean, posterior.laplace().N)
    draws = plain.sample(512, generator=torch.Generator().manual_seed(1))
    broken = posterior.predict_proba(features, method="mc", samples=draws)
    assert float(broken[:, 2].mean()) > 0.3
