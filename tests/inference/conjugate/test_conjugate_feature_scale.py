"""The conjugate head's feature scale: the model fitted to ``s phi``, heads handed out for
``phi``; and ``fit_conjugate_head`` choosing ``s`` by the labels' likelihood."""

import math

import pytest
import torch

from inference.conjugate import ConjugatePosterior, ConjugatePrior, SufficientStatistics
from inference.conjugate.feature_scale import fit_conjugate_head
from inference.conjugate.solver import map_objective, solve_map
from inference.errors import InvalidInputError
from inference.factory import fit_head

F64 = torch.float64


def overlapping_classes(n=300, m=4, C=3, seed=0, spread=3.0):
    """Class means (fixed, N(0, 1.5²) entries) with within-class sd ``spread`` (noise drawn
    with ``seed``): no head separates them, and the model's within-class sd 1/√2 is wrong by a
    factor of ~4 (so s = 1 is overconfident)."""
    centres = torch.randn(C, m, generator=torch.Generator().manual_seed(100), dtype=F64) * 1.5
    labels = torch.arange(n) % C
    noise = torch.randn(n, m, generator=torch.Generator().manual_seed(seed), dtype=F64)
    return centres[labels] + spread * noise, labels


def column_scale(s, m):
    return torch.tensor([1.0] + [s] * m, dtype=F64)


def test_a_feature_scale_is_the_paper_model_fitted_to_scaled_features():
    x, y = overlapping_classes()
    s = 0.3
    scaled = ConjugatePosterior(ConjugatePrior(), SufficientStatistics.from_features(s * x, y, 3))
    post = ConjugatePosterior(ConjugatePrior(), SufficientStatistics.from_features(x, y, 3),
                              feature_scale=s)
    d = column_scale(s, 4)
    # the same model: heads for phi are heads for s phi times [1, s, ..., s]; float64 round-off
    # of s * x against s * (sum of x) is ~1e-16 relative (tolerance 1e-12)
    torch.testing.assert_close(post.map(), scaled.map() * d, rtol=1e-12, atol=0)
    for method in ("map", "probit"):
        torch.testing.assert_close(post.predict_proba(x, method), scaled.predict_proba(s * x,
                                   method), rtol=0, atol=1e-12)
    draws = post.sample(7, generator=torch.Generator().manual_seed(3))
    reference = scaled.sample(7, generator=torch.Generator().manual_seed(3)) * d
    torch.testing.assert_close(draws, reference, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(post.predict_proba(x, "mc", samples=draws),
                               scaled.predict_proba(s * x, "mc", samples=draws / d),
                               rtol=0, atol=1e-12)
    full_d = d.repeat(3)
    torch.testing.assert_close(post.covariance(),
                               scaled.covariance() * full_d[:, None] * full_d[None, :],
                               rtol=1e-10, atol=1e-14)
    # log density differences are invariant to the linear change of coordinates
    w1, w2 = post.map(), post.map() * 1.1
    torch.testing.assert_close(post.log_posterior(w1) - post.log_posterior(w2),
                               scaled.log_posterior(w1 / d) - scaled.log_posterior(w2 / d),
                               rtol=1e-12, atol=1e-9)


def test_a_server_applies_a_given_scale_to_summed_statistics():
    x, y = overlapping_classes()
    clients = [SufficientStatistics.from_features(xc, yc, 3)
               for xc, yc in zip(x.chunk(3), y.chunk(3), strict=True)]
    pooled = ConjugatePosterior(None, sum(clients), feature_scale=0.25).map()
    direct = solve_map(SufficientStatistics.from_features(0.25 * x, y, 3).table, 301.0)
    torch.testing.assert_close(pooled, direct * column_scale(0.25, 4), rtol=1e-12, atol=0)


def test_the_scale_survives_state_dict_and_to_and_the_default_state_has_no_key():
    x, y = overlapping_classes()
    stats = SufficientStatistics.from_features(x, y, 3)
    post = ConjugatePosterior(None, stats, feature_scale=0.2)
    restored = ConjugatePosterior.from_state_dict(post.state_dict())
    assert restored.feature_scale == 0.2 and post.to("cpu").feature_scale == 0.2
    torch.testing.assert_close(restored.map(), post.map(), rtol=0, atol=0)
    assert "feature_scale" not in ConjugatePosterior(None, stats).state_dict()
    for bad in (0.0, -1.0, float("nan"), float("inf"), True):
        with pytest.raises(InvalidInputError, match="feature_scale must be a finite number"):
            ConjugatePosterior(None, stats, feature_scale=bad)


def training_nll(x, y, s):
    """Independent: the MAP of the scaled statistics by solve_map, its mean cross-entropy."""
    head = solve_map(SufficientStatistics.from_features(s * x, y, 3).table, len(y) + 1.0)
    logits = torch.cat([torch.ones(len(y), 1, dtype=F64), s * x], 1) @ head.T
    return float(torch.nn.functional.cross_entropy(logits, y))


def test_the_conditional_scale_minimises_the_training_nll_on_a_fine_grid():
    x, y = overlapping_classes()
    post = fit_conjugate_head(x, y, 3)
    choice = post.feature_scale_selection
    assert choice.method == "conditional" and choice.at_bound is None
    assert post.feature_scale == choice.value < 0.5  # the features' sd is ~4x the model's
    # Fine grid (h = 0.005 in log s, ±0.15 around the choice): a smooth unimodal criterion's
    # grid minimiser is within h/2 of the true one, Brent's within 1e-6; and no grid point may
    # undercut the choice by more than 1e-12 nats (flat to second order at the minimum).
    h = 0.005
    log_grid = torch.arange(-30, 31, dtype=F64) * h + math.log(choice.value)
    values = torch.tensor([training_nll(x, y, float(s)) for s in log_grid.exp()], dtype=F64)
    assert abs(float(log_grid[values.argmin()]) - math.log(choice.value)) <= h
    assert choice.criterion <= float(values.min()) + 1e-12
    assert abs(choice.criterion - training_nll(x, y, choice.value)) < 1e-12


def test_the_chosen_scale_tempers_an_overconfident_head():
    x, y = overlapping_classes()
    x_test, y_test = overlapping_classes(n=600, seed=1)  # new draws from the same classes
    paper = ConjugatePosterior(None, SufficientStatistics.from_features(x, y, 3))
    chosen = fit_conjugate_head(x, y, 3)

    def nll(post):
        return float(-post.predict_proba(x_test)[torch.arange(600), y_test].log().mean())

    assert nll(chosen) < 0.8 * nll(paper)  # measured 0.79 against 1.33 nats


def test_the_validation_scale_minimises_the_validation_nll_and_needs_data():
    x, y = overlapping_classes(n=300)
    x_val, y_val = overlapping_classes(n=600, seed=2)
    post = fit_conjugate_head(x, y, 3, feature_scale="validation",
                              validation_data=(x_val.numpy(), y_val.numpy()))
    choice = post.feature_scale_selection
    assert choice.method == "validation" and choice.criterion_name == "validation_nll"
    stats = SufficientStatistics.from_features(x, y, 3)

    def validation_nll(s):
        probs = ConjugatePosterior(None, stats, feature_scale=s).predict_proba(x_val)
        return float(-probs[torch.arange(600), y_val].log().mean())

    assert abs(choice.criterion - validation_nll(choice.value)) < 1e-12
    for s in (choice.value * 0.97, choice.value / 0.97):  # a minimum: 3% either way is worse
        assert validation_nll(s) > choice.criterion
    with pytest.raises(InvalidInputError, match="validation_data"):
        fit_conjugate_head(x, y, 3, feature_scale="validation")
    with pytest.raises(InvalidInputError, match="columns"):
        fit_conjugate_head(x, y, 3, feature_scale="validation", validation_data=(x_val[:, :2],
                                                                                 y_val))


def test_separable_training_labels_warn_that_the_conditional_scale_is_unbounded():
    x, y = overlapping_classes(spread=0.05)  # far-apart, tight classes: separated at any s
    with pytest.warns(UserWarning, match="separates the training set"):
        post = fit_conjugate_head(x, y, 3)
    # the training NLL underflows to 0 in float64 well before the upper bound
    assert post.feature_scale_selection.criterion == 0.0


def test_fit_head_conjugate_chooses_the_scale_by_default_and_takes_a_number():
    x, y = overlapping_classes()
    default = fit_head("conjugate", x, y, 3)
    assert default.feature_scale_selection.method == "conditional"
    fixed = fit_head("conjugate", x, y, 3, feature_scale=1.0, nu=2.0)
    assert fixed.feature_scale == 1.0 and fixed.feature_scale_selection is None
    torch.testing.assert_close(fixed.map(), solve_map(
        SufficientStatistics.from_features(x, y, 3).table, len(y) + 2.0), rtol=0, atol=0)
    with pytest.raises(InvalidInputError, match="'conditional', 'validation', 'evidence'"):
        fit_head("conjugate", x, y, 3, feature_scale="marglik")


def test_map_objective_of_the_scaled_model_is_maximal_at_the_handed_out_head():
    x, y = overlapping_classes()
    post = ConjugatePosterior(None, SufficientStatistics.from_features(x, y, 3),
                              feature_scale=0.3)
    best = float(post.log_posterior(post.map()))
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        nudged = post.map() + 1e-3 * torch.randn(3, 5, generator=g, dtype=F64)
        assert float(post.log_posterior(nudged)) < best
    assert best == float(map_objective(post.map() / column_scale(0.3, 4),
                                       post.natural_statistic, post.natural_count))
