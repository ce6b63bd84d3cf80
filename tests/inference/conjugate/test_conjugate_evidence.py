"""The conjugate model's evidence over its feature scale: the normaliser's Laplace approximation,
the evidence of summed statistics equal to the pooled data's, and the type-II choice of s
against a brute-force grid on the pooled features."""

import math

import numpy as np
import pytest
import torch

from inference.conjugate import ConjugateLaplace, SufficientStatistics, solve_map
from inference.conjugate.evidence import (
    evidence_feature_scale,
    log_det_hessian,
    log_evidence,
    log_normalizer,
)
from inference.conjugate.prior import ConjugatePrior
from inference.errors import InvalidInputError

F64 = torch.float64


def model_draws(n=600, d=5, C=3, scale=0.4, seed=0):
    """Balanced classes whose features are Gaussian as in the conjugate model of
    ``[1, scale phi]``: within-class standard deviation ``1 / (scale sqrt 2)`` in the body's
    units, class means of one norm (the model's class prior ``softmax(||W_y||^2 / 4)`` is then
    uniform, as the classes are). Only the constant coordinate is not the model's (it is 1,
    where the model has it Gaussian)."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % C
    centres = torch.randn(C, d, generator=g, dtype=F64)
    centres = 3.0 * centres / centres.norm(dim=1, keepdim=True) / scale
    noise = torch.randn(n, d, generator=g, dtype=F64) / (scale * math.sqrt(2.0))
    return centres[labels] + noise, labels


def pooled_log_evidence(features, labels, C, scale, nu=1.0):
    """Brute force on pooled data: the model's evidence of the scaled features ``x = s phi``
    computed from their own table and squared norms, moved to the body's units by the
    Jacobian ``n d log s``."""
    x = scale * features
    stats = SufficientStatistics.from_features(x, labels, C)
    n, d = x.shape
    return (log_evidence(stats, float(x.pow(2).sum()), prior=ConjugatePrior(nu=nu))
            + n * d * math.log(scale))


def test_the_hessian_log_determinant_is_that_of_the_dense_precision():
    x, y = model_draws(n=200, d=4)
    stats = SufficientStatistics.from_features(x, y, 3)
    N = stats.n + 1.0
    W = solve_map(stats.table, N)
    dense = ConjugateLaplace(W, N).dense_precision()
    assert log_det_hessian(W, N) == pytest.approx(float(torch.logdet(dense)), rel=1e-12)


def test_one_class_is_gaussian_so_the_laplace_normaliser_is_exact():
    # C = 1: exp(<w, S> - N ||w||^2 / 4) is a Gaussian, log Z = ||S||^2 / N + (k/2) log(4 pi/N)
    S = torch.tensor([[30.0, -12.0, 5.0]], dtype=F64)
    N = 40.0
    exact = float(S.pow(2).sum()) / N + 1.5 * math.log(4 * math.pi / N)
    assert log_normalizer(S, N) == pytest.approx(exact, rel=1e-13)


@pytest.mark.parametrize("N, tolerance", [(100.0, 1e-2), (1000.0, 1e-3)])
def test_the_laplace_normaliser_is_within_order_one_over_n_of_quadrature(N, tolerance):
    # C = 2 classes, k = 1 column: the exact integral by a 2-D grid (step 0.004, the integrand
    # is negligible beyond |w| = 8); the Laplace error was 2.9e-3 at N = 100 and 3.0e-4 at 1000
    S = torch.tensor([[0.6 * N * 1.2], [0.4 * N * -0.9]], dtype=F64)
    w = torch.linspace(-8.0, 8.0, 4001, dtype=F64)
    w1, w2 = torch.meshgrid(w, w, indexing="ij")
    log_f = (w1 * S[0, 0] + w2 * S[1, 0]
             - N * torch.logsumexp(torch.stack([w1.pow(2) / 4, w2.pow(2) / 4]), dim=0))
    exact = float(torch.logsumexp(log_f.flatten(), dim=0)) + 2 * math.log(float(w[1] - w[0]))
    assert abs(log_normalizer(S, N) - exact) <= tolerance


def test_the_evidence_of_summed_client_statistics_is_the_pooled_datas():
    x, y = model_draws(n=900, d=6, C=4)
    parts = torch.tensor_split(torch.arange(900), [100, 450, 520])
    clients = [(SufficientStatistics.from_features(x[i], y[i], 4), float(x[i].pow(2).sum()))
               for i in parts]
    summed = sum(s for s, _ in clients)
    square_sum = sum(q for _, q in clients)
    pooled = SufficientStatistics.from_features(x, y, 4)
    for scale in (0.1, 0.4, 1.0, 3.0):
        federated = log_evidence(summed, square_sum, feature_scale=scale)
        assert federated == pytest.approx(
            log_evidence(pooled, float(x.pow(2).sum()), feature_scale=scale), rel=1e-12)
        # and the column-scaled table with the Jacobian is the evidence of the scaled data
        assert federated == pytest.approx(pooled_log_evidence(x, y, 4, scale), rel=1e-12)


def test_the_chosen_scale_is_the_argmax_of_a_brute_force_grid_on_pooled_data():
    x, y = model_draws(n=600, d=5, C=3, scale=0.4)
    stats = SufficientStatistics.from_features(x, y, 3)
    choice = evidence_feature_scale(stats, float(x.pow(2).sum()))
    grid = np.exp(np.linspace(math.log(0.05), math.log(5.0), 801))  # 0.58% apart
    values = [pooled_log_evidence(x, y, 3, float(s)) for s in grid]
    best = int(np.argmax(values))
    assert 0 < best < len(grid) - 1  # an interior maximum
    assert grid[best - 1] <= choice.value <= grid[best + 1]
    assert choice.criterion >= max(values) - 1e-9  # Brent refines between grid points
    assert choice.method == "evidence" and choice.maximised and choice.at_bound is None


@pytest.mark.parametrize("scale", [0.1, 0.4, 2.5])
def test_on_data_from_the_model_the_evidence_recovers_its_scale(scale):
    # 3,000 draws, 8 feature dimensions: the ML scale's relative sd is about 1/sqrt(2 n d) = 0.3%;
    # seen within 0.5% at 0.1, 0.4 and 2.5 (the constant coordinate is the only misfit)
    x, y = model_draws(n=3000, d=8, C=3, scale=scale, seed=1)
    stats = SufficientStatistics.from_features(x, y, 3)
    choice = evidence_feature_scale(stats, float(x.pow(2).sum()))
    assert choice.value == pytest.approx(scale, rel=0.02)


def test_privatized_statistics_and_bad_square_sums_are_refused():
    x, y = model_draws(n=60)
    stats = SufficientStatistics.from_features(x, y, 3)
    noisy = SufficientStatistics(stats.table, stats.n, privatized=True)
    with pytest.raises(InvalidInputError, match="privatized"):
        log_evidence(noisy, 1.0)
    for bad in (-1.0, math.nan, math.inf, True, "3"):
        with pytest.raises(InvalidInputError, match="square_sum"):
            evidence_feature_scale(stats, bad)
    with pytest.raises(InvalidInputError, match="feature_scale"):
        log_evidence(stats, float(x.pow(2).sum()), feature_scale=0.0)


def test_the_conjugate_head_takes_the_evidence_scale_as_a_method():
    from inference.factory import fit_head

    x, y = model_draws(n=600, d=5, C=3, scale=0.4)
    stats = SufficientStatistics.from_features(x, y, 3)
    expected = evidence_feature_scale(stats, float(x.pow(2).sum()), prior=ConjugatePrior(nu=2.0),
                                      bounds=(1e-4, 1e4))
    head = fit_head("conjugate", x, y, 3, nu=2.0, feature_scale="evidence")
    assert head.feature_scale == expected.value
    assert head.feature_scale_selection == expected
    assert head.feature_scale_selection.summary()["method"] == "evidence"
