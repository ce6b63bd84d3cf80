"""Differential privacy for statistics (spec §4.2): sigma formulas, noise, clipping."""

import math

import pytest
import torch

from inference.conjugate.privacy import clip_features, gaussian_sigma, l2_sensitivity, privatize
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
    noisy = privatize(stats, sigma, generator=torch.Generator(device=device).manual_seed(0))
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
