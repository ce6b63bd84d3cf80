"""MFVI head (pyro): ground truth, minibatch scaling, param-store isolation, NaN diagnostics."""

from __future__ import annotations

import math

import mpmath
import pyro
import pytest
import scipy.optimize
import torch
from pyro.infer.autoguide.initialization import init_to_mean

from inference import mfvi
from inference.errors import InvalidInputError, NumericalError
from inference.factory import fit_head
from inference.gaussian import GaussianPosterior, GaussianTerm
from inference.laplace_head import fit_laplace_head
from inference.mfvi import (
    BayesianLinearHead,
    elbo_optimal_precision,
    evidence_lower_bound,
    fit_mfvi_head,
    init_to_prior_mean_copy,
)
from inference.options import Likelihood
from tests.devices import DEVICES
from tests.inference.ground_truth import (  # noqa: F401  (fixture)
    linear_regression,
    single_intra_op_thread,
    softmax_regression,
)
from tests.inference.mean_field_reference import (
    empirical_bayes_optimum,
    expected_log_sigmoid,
    gaussian_regression,
    logistic_data,
    logistic_elbo,
    mean_field_optimum,
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
@pytest.mark.trained
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


@pytest.mark.trained
def test_minibatch_likelihood_is_rescaled_by_n_over_batch():
    truth, post = fit_regression(batch_size=10)  # N = 40: an unscaled ELBO would give ×4
    ratio = post.marginal_variance()[0] * truth.precision.diagonal()
    assert ((ratio - 1).abs() < 0.25).all(), ratio
    sd = truth.covariance.diagonal().sqrt()
    assert ((post.mean - truth.mean) / sd).abs().max() < 0.3


@pytest.mark.trained
def test_softmax_regression_means_near_truth_and_variances_under_dispersed():
    truth = softmax_regression()
    post = fit_mfvi_head(truth.features, truth.labels, 2, batch_size=None,
                         prior_precision=truth.prior_precision, **FAST)
    sd = truth.variance.sqrt()
    # tolerance 0.25 posterior sd: the fits of 3 seeds were 0.06-0.10 sd from the exact mean.
    # (This test once allowed 0.6 sd, blaming a mean-field bias of ≈ 0.44 sd on w₀₀ that was in
    # fact the guide moving the prior mean, issue 12.) A head ignoring the data is 1.2 sd off.
    assert ((post.mean - truth.mean) / sd).abs().max() < 0.25
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
                      num_steps=5, prior_precision=1.0)


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


# -- the exact mean-field optimum (tests/inference/mean_field_reference.py) ----------------------

#: Settings of the fits compared with the exact optimum: full batch, 4 ELBO particles, lr decayed
#: from 0.05 to 5e-4 over 600 steps.
EXACT = dict(num_steps=600, lr=0.05, num_particles=4, final_lr_fraction=0.01, batch_size=None)


def test_reference_quadrature_matches_adaptive_quadrature_and_its_optimum_is_stationary():
    # The reference's E[log σ(z)], z ~ N(m, v), against mpmath's 30-digit tanh-sinh quadrature
    # (an independent method), over the means and variances the fits meet (and beyond).
    mpmath.mp.dps = 30
    for mean, variance in [(0.0, 1e-4), (2.5, 0.3), (-4.0, 3.0), (1.0, 10.0)]:
        sd = mpmath.sqrt(variance)
        exact = mpmath.quad(
            lambda z, m=mean, s=sd: mpmath.npdf(z, m, s) * -mpmath.log1p(mpmath.exp(-z)),
            [-mpmath.inf, mean - 3 * sd, mean, mean + 3 * sd, mpmath.inf])
        got = float(expected_log_sigmoid(torch.tensor(mean, dtype=torch.float64),
                                         torch.tensor(variance, dtype=torch.float64)))
        assert abs(got - float(exact)) < 1e-11, (mean, variance, got, exact)
    for precision in (1.0, 25.0, 1e4):
        assert mean_field_optimum(precision).grad_norm < 1e-6


def test_reference_elbo_matches_a_monte_carlo_estimate_of_its_definition():
    # E_q[log p(y | W)] − KL(q ‖ p) by brute force over W ~ q (no reduction to the margin):
    # 200,000 draws give a standard error of ≈ 0.01 nats; 5 standard errors allowed.
    data = logistic_data()
    gen = torch.Generator().manual_seed(0)
    loc = torch.tensor([[0.1, 0.5, -0.4], [-0.2, -0.3, 0.6]], dtype=torch.float64)
    scale = torch.tensor([[0.3, 0.2, 0.4], [0.25, 0.35, 0.15]], dtype=torch.float64)
    draws = loc + scale * torch.randn(200_000, 2, 3, generator=gen, dtype=torch.float64)
    inputs = torch.cat([torch.ones(len(data.labels), 1, dtype=torch.float64), data.features], 1)
    log_lik = torch.log_softmax(torch.einsum("bp,scp->sbc", inputs, draws), -1)
    log_lik = log_lik.gather(-1, data.labels.expand(len(draws), -1)[..., None]).sum((1, 2))
    prior = torch.distributions.Normal(0.0, 1 / math.sqrt(25.0))
    kl = torch.distributions.kl_divergence(torch.distributions.Normal(loc, scale), prior).sum()
    estimate, se = float(log_lik.mean() - kl), float(log_lik.std() / math.sqrt(len(draws)))
    assert abs(float(logistic_elbo(data, loc, scale, 25.0)) - estimate) < 5 * se


def mean_field_deviation(post: GaussianPosterior, precision: float, prior_mean: float = 0.0
                         ) -> tuple[float, float, float]:
    """Largest |Δμ| in optimum sds, largest |log σ / σ*|, and the exact ELBO's shortfall."""
    optimum = mean_field_optimum(precision, prior_mean=prior_mean)
    loc, scale = post.mean, post.marginal_variance().sqrt()
    elbo = float(logistic_elbo(logistic_data(), loc, scale, precision, prior_mean))
    return (float(((loc - optimum.loc) / optimum.scale).abs().max()),
            float((scale / optimum.scale).log().abs().max()), optimum.elbo - elbo)


@pytest.mark.parametrize("guide", ["auto_normal", "auto_diagonal_normal"])
@pytest.mark.parametrize(("precision", "prior_mean"), [(1.0, 0.0), (25.0, 0.3)])
@pytest.mark.trained
def test_fit_is_the_exact_mean_field_optimum(guide, precision, prior_mean):
    data = logistic_data()
    post = fit_mfvi_head(data.features, data.labels, 2, guide=guide, prior_precision=precision,
                         prior_mean=prior_mean, **EXACT)
    mean_error, log_scale_error, elbo_gap = mean_field_deviation(post, precision, prior_mean)
    # Tolerances ≈ 2x the stochastic optimisation's own noise: over 5 seeds and both guides
    # the final iterate was within 0.094 optimum sds on the means, 0.06 on log σ and 0.017
    # nats of the optimal ELBO, and these shrank ~2x with 4x the particles (noise, not bias).
    # The guide that owned the prior buffer (the bug of issue 12) was 0.48-0.54 sds and
    # 0.38-0.48 nats off at λ = 1 (hidden by the older test's 0.6 sd tolerance), ≥ 3.8 sds and
    # ≥ 27 nats at λ = 25. A prior scale of 1/λ (or 1/√λ read as a variance) moves the λ = 25
    # optimum by several sds.
    assert mean_error < 0.2, mean_error
    assert log_scale_error < 0.12, log_scale_error
    assert 0 <= elbo_gap < 0.04, elbo_gap


@pytest.mark.parametrize("guide", ["auto_normal", "auto_diagonal_normal"])
@pytest.mark.trained
def test_a_strong_prior_holds_the_means_at_the_prior_mean(guide):
    # Issue 12's reproduction: prior sd 0.01 (λ = 1e4). The optimum's means are ≤ 0.0012 and
    # its sds 0.0100. Measured (5 seeds): within 0.24 sds and 0.08 nats of the optimum (Adam's
    # absolute step of 5e-4 is 0.05 prior sds here, hence more noise than at λ ≤ 25); with the
    # aliased prior buffer the default guide ended 41-83 sds away (max |mean| 0.41).
    data = logistic_data()
    post = fit_mfvi_head(data.features, data.labels, 2, guide=guide, prior_precision=1e4,
                         **EXACT)
    mean_error, log_scale_error, elbo_gap = mean_field_deviation(post, 1e4)
    assert float(post.mean.abs().max()) < 0.006
    assert mean_error < 0.5 and log_scale_error < 0.25 and elbo_gap < 0.2


def test_the_guide_does_not_alias_the_model_prior():
    # The root cause: the initial value handed to the guide must be a fresh tensor.
    with pyro.settings.context(module_local_params=True), pyro.get_param_store().scope():
        model = BayesianLinearHead(3, 2, prior_precision=4.0, prior_mean=0.5,
                                   likelihood=Likelihood.SOFTMAX, noise_std=1.0)
        trace = pyro.poutine.trace(model).get_trace(torch.zeros(1, 3), torch.zeros(1).long(), 1,
                                                    torch.arange(1))
        value = init_to_prior_mean_copy(trace.nodes["weight"])
    torch.testing.assert_close(value, torch.full((2, 3), 0.5))
    assert value.untyped_storage().data_ptr() != model.prior_loc.untyped_storage().data_ptr()


@pytest.mark.parametrize("precision", [0.04, 1.0, 25.0])
def test_prior_standard_deviation_is_one_over_root_precision(precision):
    weight = torch.tensor([[0.3, -1.0, 2.0], [0.0, 0.5, -0.4]])
    with pyro.settings.context(module_local_params=True), pyro.get_param_store().scope():
        model = BayesianLinearHead(3, 2, prior_precision=precision, prior_mean=0.2,
                                   likelihood=Likelihood.SOFTMAX, noise_std=1.0)
        conditioned = pyro.poutine.condition(model, data={"weight": weight})
        trace = pyro.poutine.trace(conditioned).get_trace(
            torch.zeros(1, 3), torch.zeros(1).long(), 1, torch.arange(1))
    site = trace.nodes["weight"]
    torch.testing.assert_close(site["fn"].base_dist.scale,
                               torch.full((2, 3), 1 / math.sqrt(precision)))
    # log N(w; 0.2, 1/λ) = ½ log(λ / 2π) − λ (w − 0.2)² / 2, summed over the 6 weights
    expected = (0.5 * math.log(precision / (2 * math.pi))
                - 0.5 * precision * (weight.double() - 0.2) ** 2).sum()
    torch.testing.assert_close(site["fn"].log_prob(weight).double(), expected, rtol=1e-6, atol=0)


@pytest.mark.trained
def test_gaussian_likelihood_at_precision_25_gives_exact_means_and_inverse_diagonal_variances():
    # Closed form at λ = 25 with the data as informative as the prior (σ = 2): the mean-field
    # optimum has the exact posterior mean and variances 1 / Λᵢᵢ. A 1/λ prior scale gives
    # variances ≈ 60x smaller, a √λ precision ≈ 2.3x larger.
    truth = gaussian_regression(25.0)
    post = fit_mfvi_head(truth.features, truth.targets, 1, likelihood="gaussian",
                         noise_std=truth.noise_std, prior_precision=25.0, batch_size=None, **FAST)
    sd = truth.covariance.diagonal().sqrt()
    assert ((post.mean - truth.mean) / sd).abs().max() < 0.2  # as the λ = 1 test above
    ratio = post.marginal_variance()[0] * truth.precision.diagonal()
    assert ((ratio - 1).abs() < 0.2).all(), ratio
    torch.testing.assert_close(post.prior.diag, torch.full((3,), 25.0, dtype=torch.float64))


def test_a_fit_whose_guide_aliases_the_prior_is_refused(monkeypatch):
    # The guard behind the fix: pyro's own init_to_mean (the aliasing initialisation) makes the
    # fit raise instead of returning a posterior fitted against a moving prior.
    monkeypatch.setattr(mfvi, "init_to_prior_mean_copy", init_to_mean)
    truth = softmax_regression()
    with pytest.raises(NumericalError, match="prior's buffers changed"):
        fit_mfvi_head(truth.features, truth.labels, 2, num_steps=5)


# -- the prior precision chosen from the data ----------------------------------------------------


def test_elbo_estimate_matches_the_exact_elbo():
    data = logistic_data()
    loc = torch.tensor([[0.1, 0.5, -0.4], [-0.2, -0.3, 0.6]], dtype=torch.float64)
    scale = torch.tensor([[0.3, 0.2, 0.4], [0.25, 0.35, 0.15]], dtype=torch.float64)
    prior = GaussianTerm.isotropic(6, 25.0, 0.1)
    post = GaussianPosterior.from_mean_and_precision(loc, scale.reshape(-1) ** -2, prior)
    value, se = evidence_lower_bound(post, data.features, data.labels, num_samples=4096)
    exact = float(logistic_elbo(data, loc, scale, 25.0, 0.1))
    assert 0 < se < 0.05
    assert abs(value - exact) < 4 * se, (value, exact, se)  # Monte-Carlo error only


def test_elbo_optimal_precision_maximises_the_exact_elbo_over_the_precision():
    # For a fixed guide, λ* in closed form against a numerical maximisation of the reference
    # ELBO over log λ (Brent to 1e-10): the M-step of variational EM.
    data = logistic_data()
    loc = torch.tensor([[0.1, 0.5, -0.4], [-0.2, -0.3, 0.6]], dtype=torch.float64)
    scale = torch.tensor([[0.3, 0.2, 0.4], [0.25, 0.35, 0.15]], dtype=torch.float64)
    result = scipy.optimize.minimize_scalar(
        lambda t: -float(logistic_elbo(data, loc, scale, math.exp(t), 0.2)), bounds=(-5, 5),
        method="bounded", options={"xatol": 1e-10})
    closed = elbo_optimal_precision(loc, scale, prior_mean=0.2)
    assert abs(math.log(closed) - result.x) < 1e-6, (closed, math.exp(result.x))


@pytest.mark.parametrize("guide", ["auto_normal", "auto_diagonal_normal"])
@pytest.mark.trained
def test_empirical_bayes_finds_the_joint_optimum_of_the_elbo(guide):
    data = logistic_data()
    precision, optimum = empirical_bayes_optimum()  # λ ≈ 2.80 (13-number L-BFGS)
    post = fit_mfvi_head(data.features, data.labels, 2, guide=guide, prior_precision="elbo",
                         **EXACT)
    choice = post.prior_selection
    assert choice.method == "elbo" and choice.name == "prior_precision"
    assert choice.at_bound is None and not choice.hit_bound
    torch.testing.assert_close(post.prior.diag, torch.full((6,), choice.value,
                                                           dtype=torch.float64))
    # The ELBO is flat in λ (±25 % costs 0.03 nats), so the guide's noise moves λ: 3 seeds
    # ended within 5 % of the optimum; 15 % allowed. The guide itself: as for a fixed λ.
    assert abs(choice.value / precision - 1) < 0.15, (choice.value, precision)
    loc, scale = post.mean, post.marginal_variance().sqrt()
    assert float(((loc - optimum.loc) / optimum.scale).abs().max()) < 0.2
    gap = optimum.elbo - float(logistic_elbo(data, loc, scale, choice.value))
    assert 0 <= gap < 0.04, gap
    # The reported criterion is the Monte-Carlo ELBO (256 draws: se ≈ 0.2 nats here).
    assert abs(choice.criterion - optimum.elbo) < 1.0


@pytest.mark.parametrize(("bounds", "end", "value"), [((0.1, 1.0), "upper", 1.0),
                                                      ((10.0, 100.0), "lower", 10.0)])
def test_empirical_bayes_reports_the_bound_it_hits(bounds, end, value):
    data = logistic_data()  # its ELBO-optimal λ is 2.8, outside both intervals
    post = fit_mfvi_head(data.features, data.labels, 2, prior_precision="elbo",
                         prior_precision_bounds=bounds, **{**EXACT, "num_steps": 150})
    assert post.prior_selection.at_bound == end and post.prior_selection.hit_bound
    assert post.prior_selection.value == value
    torch.testing.assert_close(post.prior.diag, torch.full((6,), value, dtype=torch.float64))


def test_default_prior_precision_is_the_laplace_evidence_optimum():
    data = logistic_data()
    post = fit_head("mfvi", data.features, data.labels, 2, num_steps=50)
    laplace = fit_laplace_head(data.features, data.labels, 2, prior_precision="marglik")
    assert post.prior_selection.method == "marglik"
    assert post.prior_selection.value == laplace.prior_selection.value
    # the same evidence at the same λ: the default (KL-optimal) head reports it at the search's
    # last Newton iterate, ≤ 1e-12 nats of decrement from the mode where the Laplace one takes
    # it (measured 4e-15 apart)
    assert post.prior_selection.criterion == pytest.approx(laplace.prior_selection.criterion,
                                                           abs=1e-9)
    torch.testing.assert_close(post.prior.diag, laplace.prior.diag)
    fixed = fit_head("mfvi", data.features, data.labels, 2, num_steps=5, prior_precision=3.0)
    assert fixed.prior_selection is None


@pytest.mark.parametrize(("option", "match"), [
    ({"prior_precision": "validation"}, "prior_precision must be one of 'elbo', 'marglik'"),
    ({"prior_precision": True}, "prior_precision must be a finite number"),
    ({"prior_precision": "elbo", "prior_precision_bounds": (1.0, 0.5)}, "0 < lower < upper"),
    ({"prior_precision": "elbo", "empirical_bayes_warmup": 1.0}, "empirical_bayes_warmup=1.0"),
])
def test_bad_prior_precision_choices_are_rejected(option, match):
    data = logistic_data()
    with pytest.raises(InvalidInputError, match=match):
        fit_mfvi_head(data.features, data.labels, 2, num_steps=5, **option)
