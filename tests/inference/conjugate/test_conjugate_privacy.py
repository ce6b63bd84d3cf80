"""Differential privacy for statistics (spec §4.2): sigma formulas, noise, clipping, and the
warning when the noise swamps the statistics."""

import math
import warnings

import pytest
import torch

from inference.conjugate.privacy import (
    DEGRADED_RATIO,
    PrivacyNoiseWarning,
    clip_features,
    gaussian_sigma,
    l2_sensitivity,
    privacy_signal_to_noise,
    privatize,
)
from inference.conjugate.statistics import SufficientStatistics
from inference.errors import InvalidInputError
from tests.devices import DEVICES

# spec §4.2, m = 101 augmented (100 body features), b = 2, delta = 0.01; one decimal printed.
SPEC_TABLE = [
    (0.1, 622.3, 903.2, 9032.2),
    (0.5, 124.5, 225.6, 2255.6),
    (1.0, 62.2, 121.9, 1219.0),
    (5.0, 12.4, 28.3, 282.5),
    (10.0, 6.2, 14.9, 148.9),
]


@pytest.mark.parametrize(("epsilon", "single", "one_round", "hundred_rounds"), SPEC_TABLE)
def test_sigma_reproduces_the_spec_table(epsilon, single, one_round, hundred_rounds):
    assert gaussian_sigma(epsilon, 0.01, 1, 100, 2.0, "single") == pytest.approx(single, abs=0.06)
    assert gaussian_sigma(epsilon, 0.01, 1, 100, 2.0, "k_round") == pytest.approx(one_round,
                                                                                  abs=0.06)
    assert gaussian_sigma(epsilon, 0.01, 100, 100, 2.0) == pytest.approx(hundred_rounds,
                                                                         abs=0.1)


def test_single_release_sigma_is_the_classical_formula_and_ignores_rounds():
    expected = math.sqrt(2 * (1 + 7 * 0.25) * math.log(1.25 / 1e-5)) / 0.7
    assert gaussian_sigma(0.7, 1e-5, 1, 7, 0.5, "single") == pytest.approx(expected, rel=1e-15)
    assert gaussian_sigma(0.7, 1e-5, 9, 7, 0.5, "single") == gaussian_sigma(0.7, 1e-5, 1, 7, 0.5,
                                                                             "single")


@pytest.mark.parametrize(
    "kwargs",
    [dict(epsilon=0.0), dict(epsilon=math.inf), dict(delta=0.0), dict(delta=1.0),
     dict(rounds=0), dict(composition="rdp"), dict(bound=0.0), dict(bound=math.inf),
     dict(feature_dim=-1)],
)
def test_invalid_privacy_parameters_are_rejected(kwargs):
    arguments = dict(epsilon=1.0, delta=1e-5, rounds=3, feature_dim=4, bound=1.0) | kwargs
    with pytest.raises(InvalidInputError):
        gaussian_sigma(**arguments)


@pytest.mark.parametrize("device", DEVICES)
def test_noise_standard_deviation_matches_sigma_within_two_percent(device):
    # 100 x 1000 table = 100,000 draws; the std of a sample std is sigma / sqrt(2 * 1e5) =
    # 0.22% of sigma, so 2% is ~9 standard errors.
    features = torch.zeros(1, 999, device=device)
    stats = SufficientStatistics.from_features(features, torch.zeros(1, dtype=torch.int64,
                                                                     device=device), 100)
    sigma = gaussian_sigma(1.0, 1e-5, 10, 999, 0.1)
    noisy = privatize(stats, sigma, generator=torch.Generator(device=device).manual_seed(0),
                      check_noise=False)  # one sample: swamped, and that is not the point here
    noise = (noisy.table - stats.table).reshape(-1)
    assert noise.numel() == 100_000
    assert abs(float(noise.std()) / sigma - 1.0) <= 0.02
    assert abs(float(noise.mean())) <= 5 * sigma / math.sqrt(100_000)
    assert noisy.privatized and not stats.privatized
    assert noisy.table.device.type == device


def test_clipping_bounds_the_l2_sensitivity_of_the_table():
    # Adding one clipped record moves the table by ||[1, clip(phi)]|| <= sqrt(1 + m b^2), with
    # equality for a record whose features are all beyond the bound.
    g = torch.Generator().manual_seed(0)
    m, b, C = 6, 2.0, 3
    features = clip_features(torch.randn(40, m, generator=g) * 5, b)
    labels = torch.randint(0, C, (40,), generator=g)
    base = SufficientStatistics.from_features(features, labels, C)
    bound = l2_sensitivity(m, b)
    assert bound == pytest.approx(math.sqrt(1 + m * b * b))
    for scale in (0.1, 1.0, 100.0):
        record = clip_features(torch.randn(1, m, generator=g) * scale, b)
        label = torch.randint(0, C, (1,), generator=g)
        extra = SufficientStatistics.from_features(record, label, C)
        change = torch.linalg.vector_norm((base + extra).table - base.table)
        assert float(change) <= bound * (1 + 1e-12)
    corner = clip_features(torch.full((1, m), 1e6), b)
    change = (base + SufficientStatistics.from_features(corner, torch.tensor([0]), C)).table
    assert float(torch.linalg.vector_norm(change - base.table)) == pytest.approx(bound, rel=1e-12)


def test_clip_features_clamps_and_rejects_bad_bounds():
    x = torch.tensor([[-5.0, 0.5, 3.0]])
    assert torch.equal(clip_features(x, 2.0), torch.tensor([[-2.0, 0.5, 2.0]]))
    with pytest.raises(InvalidInputError):
        clip_features(x, -1.0)


def test_privatised_statistics_skip_count_validation_and_can_hide_the_count():
    features = torch.randn(30, 4)
    labels = torch.randint(0, 3, (30,))
    stats = SufficientStatistics.from_features(clip_features(features, 1.0), labels, 3)
    generator = torch.Generator().manual_seed(1)
    public = privatize(stats, 0.7, generator=generator)
    assert public.n == 30
    public.validate()  # noisy counts no longer match n, and that is allowed
    hidden = privatize(stats, 0.7, generator=generator, release_count=False)
    assert hidden.n == max(1, round(float(hidden.table[:, 0].sum())))
    assert (public + stats).privatized  # privacy is contagious through sums
    with pytest.raises(InvalidInputError, match="sigma"):
        privatize(stats, -1.0)


# ---- does the noise swamp the statistics? ---------------------------------------------------
# The README's example: gaussian_sigma(epsilon=1, delta=1e-2, rounds=100, feature_dim=50,
# bound=2) on statistics of digits (about 130 training samples per class, 10 classes).
README_SIGMA = dict(epsilon=1.0, delta=1e-2, rounds=100, feature_dim=50, bound=2.0)


def digits_sized_statistics(bound=2.0, per_class=130, classes=10, m=50, seed=0):
    """Clipped non-negative features (a ReLU body clamped at the bound), balanced classes."""
    g = torch.Generator().manual_seed(seed)
    features = clip_features(torch.rand(per_class * classes, m, generator=g) * bound, bound)
    labels = torch.arange(classes).repeat_interleave(per_class)
    return SufficientStatistics.from_features(features, labels, classes)


def test_the_readme_budget_warns_that_the_noise_swamps_digits_statistics():
    sigma = gaussian_sigma(**README_SIGMA)
    assert sigma == pytest.approx(863.0, abs=0.5)
    stats = digits_sized_statistics()
    # against the clip bound: (sigma / Delta_2) sqrt(m + 1) / n_y = 863 sqrt(51) / (130 sqrt(201))
    with pytest.warns(PrivacyNoiseWarning, match=r"swamps the statistics: noise-to-signal 3\.34"):
        privatize(stats, sigma, generator=torch.Generator().manual_seed(0), bound=2.0)
    # without the bound, against the table's own rows (smaller: features below the bound)
    with pytest.warns(PrivacyNoiseWarning, match="raise epsilon.*fewer rounds.*centrally"):
        privatize(stats, sigma, generator=torch.Generator().manual_seed(0))
    report = privacy_signal_to_noise(sigma, 130, feature_dim=50, bound=2.0)
    assert report.swamped and report.warns
    assert report.noise_to_signal == pytest.approx(
        sigma * math.sqrt(51) / (130 * math.sqrt(1 + 50 * 4.0)), rel=1e-12)


@pytest.mark.parametrize(("placement", "epsilon"), [("local", 16.0), ("central", 4.0)])
def test_a_budget_that_leaves_a_useful_model_does_not_warn(placement, epsilon):
    # Measured on digits (20 clients, 10 rounds + the init round, ~135 samples per class):
    # local DP at epsilon 16 and central DP at epsilon 4 keep accuracy 0.97-0.98 (bench
    # dp_price.py); their noise-to-signal is 0.38 and 0.30.
    sigma = gaussian_sigma(epsilon, 1e-2, 11, 50, 2.0)
    report = privacy_signal_to_noise(sigma, 135, feature_dim=50, bound=2.0, clients=20,
                                     placement=placement)
    assert report.noise_to_signal < DEGRADED_RATIO and not report.warns
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrivacyNoiseWarning)
        assert report.warn() is False
        if placement == "central":  # the release itself, against the clip bound
            privatize(digits_sized_statistics(per_class=135), sigma, bound=2.0)


def test_the_noise_of_k_local_releases_adds_up_in_variance():
    # Monte Carlo: the summed noise of K privatized copies has mean squared row norm
    # K sigma^2 (m + 1), the report's noise_norm^2. 4,000 rows of 11 entries: the standard error
    # of the mean of the squared norm is sqrt(2 / (11 * 4000)) = 0.7%, so 4% is ~6 SE.
    stats = digits_sized_statistics(per_class=10, classes=4, m=10)
    sigma, K = 3.0, 7
    g = torch.Generator().manual_seed(2)
    squared = []
    for _ in range(1000):
        total = sum(privatize(stats, sigma, g, check_noise=False) for _ in range(K))
        squared.append((total.table - K * stats.table).pow(2).sum(dim=1))
    report = privacy_signal_to_noise(sigma, 10, feature_dim=10, bound=2.0, clients=K,
                                     placement="local")
    assert report.releases == K and report.noise_std == pytest.approx(sigma * math.sqrt(K))
    assert float(torch.cat(squared).mean()) == pytest.approx(report.noise_norm**2, rel=0.04)
    central = privacy_signal_to_noise(sigma, 10, feature_dim=10, bound=2.0, clients=K)
    assert central.releases == 1  # the server adds the noise once


def test_the_clip_bound_cancels_from_the_noise_to_signal_of_a_budget():
    # sigma is proportional to Delta_2 = sqrt(1 + m b^2), and so is the largest signal n_y Delta_2
    ratios = [privacy_signal_to_noise(gaussian_sigma(2.0, 1e-3, 5, 20, b), [40, 60, 50],
                                      feature_dim=20, bound=b).noise_to_signal
              for b in (0.1, 1.0, 7.0)]
    assert ratios[1] == pytest.approx(ratios[0], rel=1e-12)
    assert ratios[2] == pytest.approx(ratios[0], rel=1e-12)


def test_the_headline_ratio_is_the_rms_over_classes_present():
    report = privacy_signal_to_noise(1.0, [3.0, 0.0, 4.0], feature_dim=0, bound=1.0)
    # m = 0: the rows are counts only; noise norm 1; signals 3, 0 (absent), 4
    assert report.per_class == (1 / 3, math.inf, 1 / 4)
    assert report.noise_to_signal == pytest.approx(1 / math.sqrt((9 + 16) / 2), rel=1e-15)
    assert privacy_signal_to_noise(1.0, [0.0], feature_dim=3, bound=1.0).noise_to_signal == \
        math.inf


def test_one_clients_share_of_a_local_sum_is_released_without_a_check():
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrivacyNoiseWarning)
        privatize(digits_sized_statistics(per_class=3), 1e3, check_noise=False)


@pytest.mark.parametrize("kwargs", [dict(placement="server"), dict(clients=0),
                                    dict(clients=True), dict(class_counts=[float("nan")]),
                                    dict(class_counts=[]), dict(sigma=-1.0), dict(bound=0.0)])
def test_invalid_noise_report_inputs_are_rejected(kwargs):
    arguments = dict(sigma=1.0, class_counts=10.0, feature_dim=3, bound=1.0) | kwargs
    sigma, counts = arguments.pop("sigma"), arguments.pop("class_counts")
    with pytest.raises(InvalidInputError):
        privacy_signal_to_noise(sigma, counts, **arguments)
