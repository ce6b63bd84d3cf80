"""The posterior of DP-noisy statistics (inference.conjugate.noise_aware): its covariance is the
face-value Laplace covariance plus the DP noise propagated through the MAP, checked against
explicit matrices, finite-difference Jacobians of the exact solver and Monte Carlo over fresh
noise; with no noise it is the face-value posterior."""

import math

import pytest
import torch

from calibration import ece
from inference.conjugate import (
    ConjugateLaplace,
    ConjugatePosterior,
    ConjugatePrior,
    NoiseAwareLaplace,
    NoisyConjugatePosterior,
    SufficientStatistics,
    solve_map,
)
from inference.errors import InvalidInputError
from inference.posterior_file import load_posterior, save_posterior
from tests.devices import DEVICES

CASES = [(False, 1.0), (True, 1.0), (False, 0.5), (True, 0.5)]  # (count_from_noise, scale)


def statistics(C=3, m=4, n=90, seed=0):
    g = torch.Generator().manual_seed(seed)
    features = torch.rand(n, m, generator=g, dtype=torch.float64) * 2
    labels = torch.arange(n) % C
    return SufficientStatistics.from_features(features, labels, C)


def explicit_covariance(laplace: NoiseAwareLaplace) -> torch.Tensor:
    """H^-1 + s2 H^-1 M D^2 M^T H^-1 from dense matrices (M = I - g u^T when the count is
    noisy), model coordinates."""
    C, k = laplace.shape
    H_inv = ConjugateLaplace(laplace.mean, laplace.N).dense_covariance()
    M = torch.eye(C * k, dtype=torch.float64)
    if laplace.count_from_noise:
        u = torch.zeros(C, k, dtype=torch.float64)
        u[:, 0] = 1.0
        p = torch.softmax(laplace.mean.pow(2).sum(1) / 4, 0)
        g = p[:, None] * laplace.mean / 2  # grad A(W*)
        M = M - g.reshape(-1, 1) @ u.reshape(1, -1)
    D2 = torch.diag(laplace.column_scale.repeat(C).pow(2))
    return H_inv + laplace.noise_variance * H_inv @ M @ D2 @ M.T @ H_inv


@pytest.mark.parametrize(("count_from_noise", "scale"), CASES)
def test_structured_covariance_variances_and_logit_moments_equal_explicit_matrices(
        count_from_noise, scale):
    post = NoisyConjugatePosterior(ConjugatePrior(), statistics(), 7.0,
                                   count_from_noise=count_from_noise, feature_scale=scale)
    laplace = post.laplace()
    reference = explicit_covariance(laplace)
    # O(C k) algebra against dense products of 15 x 15 matrices: rounding only (1e-12)
    torch.testing.assert_close(laplace.dense_covariance(), reference, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(laplace.marginal_variances().reshape(-1), reference.diagonal(),
                               rtol=1e-12, atol=1e-14)
    x = torch.randn(6, laplace.shape[1], generator=torch.Generator().manual_seed(1),
                    dtype=torch.float64)
    C, k = laplace.shape
    rows = torch.zeros(6, C, C, k, dtype=torch.float64)  # e_y x^T for every (input, class)
    rows[:, torch.arange(C), torch.arange(C)] = x[:, None, :]
    rows = rows.reshape(6, C, C * k)
    expected = torch.einsum("bci,ij,bcj->bc", rows, reference, rows)
    mean, variance = laplace.logit_moments(x)
    torch.testing.assert_close(variance, expected, rtol=1e-11, atol=1e-14)
    torch.testing.assert_close(mean, x @ laplace.mean.T, rtol=0, atol=0)


@pytest.mark.parametrize(("count_from_noise", "scale"), CASES)
def test_the_noise_term_is_the_propagated_noise_of_the_exact_solver(count_from_noise, scale):
    # Independent reference: the Jacobian of the exact MAP (Lambert-W solver) with respect to
    # the table, by central differences, in body coordinates (W = solve_map(S D + chi, N) D,
    # N = nu + n, n the sum of the count column when it comes from the noise). The noise
    # covariance is s2 J J^T. Step 1e-4 on entries ~10-100: truncation O(h^2) ~ 1e-8 and
    # solver rounding ~1e-15 / 1e-4; measured agreement 5e-10, checked at 1e-7.
    stats = statistics(n=300)
    nu, s2 = 1.0, 2.5
    post = NoisyConjugatePosterior(ConjugatePrior(nu=nu), stats, s2,
                                   count_from_noise=count_from_noise, feature_scale=scale)
    face = ConjugatePosterior(ConjugatePrior(nu=nu), stats, feature_scale=scale)
    C, k = stats.table.shape
    d = torch.full((k,), scale, dtype=torch.float64)
    d[0] = 1.0

    def map_of(table):
        n = float(table[:, 0].sum()) if count_from_noise else stats.n
        return solve_map(table * d, nu + n) * d

    h = 1e-4
    J = torch.zeros(C * k, C * k, dtype=torch.float64)
    for i in range(C * k):
        step = torch.zeros(C * k, dtype=torch.float64)
        step[i] = h
        step = step.reshape(C, k)
        J[:, i] = ((map_of(stats.table + step) - map_of(stats.table - step)) / (2 * h)).reshape(-1)
    noise_part = post.covariance() - face.covariance()
    torch.testing.assert_close(noise_part, s2 * J @ J.T, rtol=1e-7, atol=1e-7 * float(
        noise_part.abs().max()))


@pytest.mark.parametrize("count_from_noise", [False, True])
def test_the_noise_term_matches_the_spread_of_the_map_over_fresh_dp_noise(count_from_noise):
    # Monte Carlo in the linear regime: the MAPs of 1,500 fresh noisy releases of one table
    # (sigma 1 on rows of norm ~100) scatter with the predicted covariance. Compared through
    # the logit variances of 4 inputs x 3 classes: a sample variance of 1,500 draws has a
    # relative standard error sqrt(2 / 1500) = 3.7%, so 15% is ~4 SE (measured: at most 6.6%);
    # the noisy count's term alone changes these variances 2-3.4 fold.
    stats = statistics(n=300)
    sigma = 1.0
    post = NoisyConjugatePosterior(ConjugatePrior(), stats, sigma**2,
                                   count_from_noise=count_from_noise)
    g = torch.Generator().manual_seed(5)
    maps = []
    for _ in range(1500):
        noisy = stats.table + sigma * torch.randn(stats.table.shape, generator=g,
                                                  dtype=torch.float64)
        n = float(noisy[:, 0].sum()) if count_from_noise else stats.n
        maps.append(solve_map(noisy, 1.0 + n))
    maps = torch.stack(maps)
    x = torch.cat([torch.ones(4, 1, dtype=torch.float64),
                   torch.rand(4, 4, generator=g, dtype=torch.float64) * 2], dim=1)
    empirical = torch.einsum("sck,bk->sbc", maps, x).var(dim=0)
    predicted = post.laplace().noise_logit_variances(x)
    torch.testing.assert_close(empirical, predicted, rtol=0.15, atol=0)


def test_draws_have_the_noise_aware_covariance():
    # 40,000 draws: an entry of the sample covariance has standard error <= max variance /
    # sqrt(20,000) = 0.7% of it; 3.5% of the largest variance is ~5 SE.
    post = NoisyConjugatePosterior(ConjugatePrior(), statistics(), 4.0, count_from_noise=True)
    draws = post.sample(40_000, generator=torch.Generator().manual_seed(3)).reshape(40_000, -1)
    reference = post.covariance()
    empirical = torch.cov(draws.T)
    assert float((empirical - reference).abs().max()) <= 0.035 * float(reference.diagonal().max())


def test_without_noise_it_is_the_face_value_posterior():
    stats = statistics()
    face = ConjugatePosterior(ConjugatePrior(), stats)
    noisy = NoisyConjugatePosterior(ConjugatePrior(), stats, 0.0, count_from_noise=True)
    x = torch.rand(5, 4, dtype=torch.float64)
    for method in ("map", "probit"):
        assert torch.equal(noisy.predict_proba(x, method=method),
                           face.predict_proba(x, method=method))
    same = [p.sample(50, generator=torch.Generator().manual_seed(9)) for p in (face, noisy)]
    assert torch.equal(same[0], same[1])
    assert torch.equal(noisy.covariance(), face.covariance())


def test_with_noise_the_face_value_part_of_each_draw_is_kept_and_the_map_is_unchanged():
    stats = statistics()
    face = ConjugatePosterior(ConjugatePrior(), stats)
    noisy = NoisyConjugatePosterior(ConjugatePrior(), stats, 3.0)
    assert torch.equal(noisy.map(), face.map())
    g1, g2 = torch.Generator().manual_seed(4), torch.Generator().manual_seed(4)
    face_draws = face.sample(20, generator=g1)
    draws = noisy.sample(20, generator=g2)
    Z = torch.randn((20, *face.map().shape), generator=g1, dtype=torch.float64)
    torch.testing.assert_close(draws, face_draws + noisy.laplace().noise_matvec(Z),
                               rtol=1e-14, atol=1e-14)


def test_little_noise_changes_the_probit_predictive_by_at_most_its_logit_variance_bound():
    # probit logits mu / sqrt(1 + pi/8 v); adding dv >= 0 moves each by at most
    # |mu| (pi/16) dv, and softmax moves no probability by more than the largest logit move.
    stats = statistics(n=300)
    face = ConjugatePosterior(ConjugatePrior(), stats)
    x = torch.rand(50, 4, dtype=torch.float64) * 2
    augmented = torch.cat([torch.ones(50, 1, dtype=torch.float64), x], 1)
    for s2 in (1e-6, 1e-3):
        noisy = NoisyConjugatePosterior(ConjugatePrior(), stats, s2)
        mean, _ = noisy.laplace().logit_moments(augmented)
        dv = noisy.laplace().noise_logit_variances(augmented)
        bound = float((mean.abs() * math.pi / 16 * dv).max())
        change = (noisy.predict_proba(x, method="probit")
                  - face.predict_proba(x, method="probit")).abs().max()
        assert 0 < float(change) <= bound


def _gaussian_mixture_task(sigma, seed=0, C=10, m=50, per_class=130, tests=4000):
    """Data from FedLog's own generative model (phi | y ~ N(mu_y, I / 2)), the statistics
    perturbed once with N(0, sigma^2), and a fresh test set."""
    g = torch.Generator().manual_seed(seed)
    mu = torch.randn(C, m, generator=g, dtype=torch.float64) * 3 / math.sqrt(m)

    def draw(n):
        y = torch.randint(0, C, (n,), generator=g)
        return mu[y] + torch.randn(n, m, generator=g, dtype=torch.float64) * math.sqrt(0.5), y

    x, y = draw(C * per_class)
    clean = SufficientStatistics.from_features(x, y, C)
    noisy = SufficientStatistics(
        clean.table + sigma * torch.randn(clean.table.shape, generator=g, dtype=torch.float64),
        clean.n, privatized=True)
    return noisy, draw(tests)


@pytest.mark.parametrize("sigma", [100.0, 300.0])
def test_when_the_noise_dominates_the_noise_aware_predictive_is_far_less_confidently_wrong(
        sigma):
    noisy, (x, y) = _gaussian_mixture_task(sigma)
    figures = {}
    for name, post in (("face", ConjugatePosterior(ConjugatePrior(), noisy)),
                       ("aware", NoisyConjugatePosterior(ConjugatePrior(), noisy, sigma**2))):
        p = post.predict_proba(x, method="mc", n_samples=400,
                               generator=torch.Generator().manual_seed(1))
        nll = float(-p[torch.arange(len(y)), y].clamp_min(1e-12).log().mean())
        figures[name] = (nll, float(ece(p, y)), float((p.argmax(1) == y).double().mean()))
    # measured: sigma 100: NLL 3.17 -> 1.16, ECE 0.33 -> 0.02; sigma 300: 16.5 -> 2.6,
    # 0.72 -> 0.22, accuracy unchanged (the MAP is the same)
    assert figures["aware"][0] < 0.5 * figures["face"][0]
    assert figures["aware"][1] < 0.5 * figures["face"][1]
    assert figures["aware"][2] == pytest.approx(figures["face"][2], abs=0.01)


def test_state_dict_file_and_device_round_trips_keep_the_noise(tmp_path):
    post = NoisyConjugatePosterior(ConjugatePrior(nu=2.0), statistics(), 5.0,
                                   count_from_noise=True, feature_scale=0.5)
    again = NoisyConjugatePosterior.from_state_dict(post.state_dict())
    assert (again.noise_variance, again.count_from_noise, again.feature_scale) == (5.0, True, 0.5)
    torch.testing.assert_close(again.covariance(), post.covariance(), rtol=0, atol=0)
    save_posterior(post, tmp_path / "noisy.safetensors")
    loaded = load_posterior(tmp_path / "noisy.safetensors")
    assert isinstance(loaded, NoisyConjugatePosterior) and loaded.noise_variance == 5.0
    moved = post.to("cpu")
    assert moved.noise_variance == 5.0 and moved.count_from_noise
    assert "noise_variance=5" in repr(post)


def test_nuts_draws_carry_the_noise_term():
    stats = statistics(C=2, m=2, n=60)
    face = ConjugatePosterior(ConjugatePrior(), stats)
    noisy = NoisyConjugatePosterior(ConjugatePrior(), stats, 400.0)
    spread = [p.sample(60, generator=torch.Generator().manual_seed(2), method="nuts",
                       warmup_steps=60).var(dim=0).sum() for p in (face, noisy)]
    # the noise term's variance (trace of the noise covariance) is far above the face value's
    noise_trace = float((noisy.covariance() - face.covariance()).diagonal().sum())
    assert noise_trace > 10 * float(face.covariance().diagonal().sum())
    assert float(spread[1]) > 3 * float(spread[0])


@pytest.mark.parametrize("value", [-1.0, float("inf"), float("nan"), True, "1"])
def test_a_noise_variance_must_be_a_finite_number_at_least_zero(value):
    with pytest.raises(InvalidInputError, match="noise_variance"):
        NoisyConjugatePosterior(ConjugatePrior(), statistics(), value)


@pytest.mark.parametrize("device", DEVICES)
def test_the_noise_aware_posterior_gives_the_same_predictive_on_every_device(device):
    post = NoisyConjugatePosterior(ConjugatePrior(), statistics(), 3.0, count_from_noise=True)
    moved = post.to(device)
    x = torch.rand(5, 4, dtype=torch.float64)
    # float64 throughout; devices differ only in rounding
    torch.testing.assert_close(moved.predict_proba(x.to(device), method="probit").cpu(),
                               post.predict_proba(x, method="probit"), rtol=1e-10, atol=1e-12)
    draws = moved.sample(3, generator=torch.Generator(device).manual_seed(0))
    assert draws.device.type == device and bool(torch.isfinite(draws).all())
