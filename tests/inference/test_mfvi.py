"""MFVI head (pyro): ground truth, minibatch scaling, param-store isolation, NaN diagnostics."""

from __future__ import annotations

import pyro
import pytest
import torch

from inference.errors import InvalidInputError, NumericalError
from inference.gaussian import GaussianPosterior
from inference.mfvi import fit_mfvi_head
from tests.devices import DEVICES
from tests.inference.ground_truth import (  # noqa: F401  (fixture)
    linear_regression,
    single_intra_op_thread,
    softmax_regression,
)

pytestmark = pytest.mark.usefixtures("single_intra_op_thread")

FAST = dict(num_steps=600, lr=0.05, num_particles=4, final_lr_fraction=0.01)


def fit_regression(**options):
    truth = linear_regression()
    post = fit_mfvi_head(truth.features, truth.targets, 1, likelihood="gaussian",
                         noise_std=truth.noise_std, prior_precision=truth.prior_precision,
                         **{**FAST, **options})
    return truth, post


@pytest.mark.parametrize("guide", ["auto_normal", "auto_diagonal_normal"])
def test_linear_regression_means_are_exact_and_variances_are_the_mean_field_optimum(guide):
    truth, post = fit_regression(batch_size=None, guide=guide)
    assert isinstance(post, GaussianPosterior) and post.structure.value == "diag"
    sd = truth.covariance.diagonal().sqrt()
    # For a Gaussian posterior the mean-field optimum has the exact mean and variance 1/Λ_ii.
    # Tolerances: 0.2 posterior sd on means, 20 % on variances (stochastic-gradient noise).
    assert ((post.mean - truth.mean) / sd).abs().max() < 0.2
    optimum = 1.0 / truth.precision.diagonal()
    ratio = post.marginal_variance()[0] / optimum
    assert ((ratio - 1).abs() < 0.2).all(), ratio
    # Mean-field under-dispersion: 1/Λ_ii ≤ Σ_ii, strictly here (correlated posterior).
    assert (optimum < truth.covariance.diagonal()).all()
    assert (post.marginal_variance()[0] <= 1.05 * truth.covariance.diagonal()).all()


def test_minibatch_likelihood_is_rescaled_by_n_over_batch():
    truth, post = fit_regression(batch_size=10)  # N = 40: an unscaled ELBO would give ×4
    ratio = post.marginal_variance()[0] * truth.precision.diagonal()
    assert ((ratio - 1).abs() < 0.25).all(), ratio
    sd = truth.covariance.diagonal().sqrt()
    assert ((post.mean - truth.mean) / sd).abs().max() < 0.3


def test_softmax_regression_means_near_truth_and_variances_under_dispersed():
    truth = softmax_regression()
    post = fit_mfvi_head(truth.features, truth.labels, 2, batch_size=None, **FAST)
    sd = truth.variance.sqrt()
    # tolerance 0.6 posterior sd: the mean-field mean of this skewed, strongly correlated
    # posterior is biased (≈ 0.44 sd on w₀₀ in long runs) and SVI adds ≈ 0.1 sd of noise.
    # A head that ignored the data would be off by 1.2 sd.
    assert ((post.mean - truth.mean) / sd).abs().max() < 0.6
    assert (post.marginal_variance() < truth.variance).all()


def test_two_heads_fitted_in_one_process_do_not_share_parameters():
    gen = torch.Generator().manual_seed(0)
    x_a, x_b = torch.randn(60, 2, generator=gen), torch.randn(60, 2, generator=gen) + 1.0
    y_a = (x_a[:, 0] > 0).long()
    y_b = (x_b[:, 1] < 1).long() * 2
    options = dict(num_steps=150, lr=0.05, batch_size=None, seed=3)
    alone_b = fit_mfvi_head(x_b, y_b, 3, **options)
    head_a = fit_mfvi_head(x_a, y_a, 3, **options)
    mean_a = head_a.mean.clone()
    head_b = fit_mfvi_head(x_b, y_b, 3, **options)
    # Same seed and data: B fitted after A equals B fitted alone. A leaked param store makes
    # B's AutoNormal start from A's trained loc/scale (same site names) and differ.
    torch.testing.assert_close(head_b.mean, alone_b.mean, atol=1e-6, rtol=0)
    torch.testing.assert_close(head_b.marginal_variance(), alone_b.marginal_variance(),
                               atol=1e-6, rtol=0)
    assert torch.equal(head_a.mean, mean_a)  # fitting B did not move A
    assert (head_a.mean - head_b.mean).abs().max() > 0.1  # the data really differ
    assert len(list(pyro.get_param_store().keys())) == 0  # nothing left in the global store


def test_fit_leaves_the_global_rng_and_param_store_untouched():
    pyro.get_param_store().clear()
    pyro.param("user_param", torch.ones(2))
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    truth = linear_regression()
    fit_mfvi_head(truth.features, truth.targets, 1, likelihood="gaussian", num_steps=5)
    assert torch.equal(torch.rand(3), expected_next)
    assert list(pyro.get_param_store().keys()) == ["user_param"]
    pyro.get_param_store().clear()


def test_non_finite_elbo_stops_training_with_a_diagnostic():
    truth = linear_regression()  # a noise scale of 1e-30 overflows the float32 log density
    with pytest.raises(NumericalError, match=r"ELBO became (nan|inf)"):
        fit_mfvi_head(truth.features, truth.targets, 1, likelihood="gaussian", noise_std=1e-30,
                      num_steps=5)


@pytest.mark.parametrize(("name", "value"), [("batch_size", 0), ("num_particles", 0),
                                             ("init_scale", 0.0), ("prior_precision", -1.0)])
def test_bad_options_are_rejected_before_fitting(name, value):
    truth = softmax_regression()
    with pytest.raises(InvalidInputError, match=f"{name}={value}"):
        fit_mfvi_head(truth.features, truth.labels, 2, num_steps=5, **{name: value})


@pytest.mark.parametrize("device", DEVICES)
def test_fits_on_the_features_device(device):
    truth = softmax_regression()
    post = fit_mfvi_head(truth.features.float().to(device), truth.labels.to(device), 2,
                         num_steps=20)
    assert post.mean.device.type == device
    probs = post.predict_proba(truth.features.float().to(device))
    torch.testing.assert_close(probs.sum(-1), torch.ones(len(truth.labels), device=device))
