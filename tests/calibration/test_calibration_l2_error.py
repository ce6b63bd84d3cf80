"""L2 calibration error: the plug-in estimate and Kumar et al.'s debiased one."""

import math

import numpy as np
import pytest
from calibration_reference import calibrated_labels, random_probs, reference_bins

from calibration import Accumulator, ece, l2_calibration_error, reliability_stats
from calibration.errors import InvalidInputError


def reference_l2(probs, labels, n_bins=15, debiased=False):
    """Kumar et al.'s estimators over reference bins, by explicit loops (squared, unclipped)."""
    probs = probs.astype(np.float64)
    confidence, correct = probs.max(1), (probs.argmax(1) == labels).astype(np.float64)
    total = 0.0
    for count, mean_conf, acc in reference_bins(confidence, correct, n_bins):
        if count == 0 or (debiased and count < 2):
            continue
        error = (acc - mean_conf) ** 2
        if debiased:
            error -= acc * (1.0 - acc) / (count - 1.0)
        total += count / len(labels) * error
    return total


def two_class_predictions(rng, n, accuracy_shift=0.0):
    """Top-label confidences c ~ U(0.5, 1) and correctness ~ Bernoulli(c + accuracy_shift)."""
    confidence = rng.uniform(0.5, 1.0, n)
    probs = np.stack([confidence, 1.0 - confidence], axis=1)
    correct = rng.random(n) < confidence + accuracy_shift
    return probs, np.where(correct, 0, 1)


@pytest.mark.parametrize("debiased", [False, True])
@pytest.mark.parametrize("n_bins", [1, 5, 15])
def test_matches_the_definition_on_random_data(n_bins, debiased):
    rng = np.random.default_rng(n_bins)
    probs = random_probs(rng, 777, 6)
    labels = rng.integers(0, 6, 777)
    expected = reference_l2(probs, labels, n_bins, debiased)
    stats = reliability_stats(probs, labels, n_bins)
    assert stats.squared_l2_error(debiased) == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert l2_calibration_error(probs, labels, n_bins, debiased=debiased) == pytest.approx(
        math.sqrt(max(expected, 0.0)), rel=1e-12, abs=1e-15)


def test_l2_lies_between_ece_and_mce_and_in_the_unit_interval():
    rng = np.random.default_rng(3)
    probs = random_probs(rng, 2000, 4)
    labels = rng.integers(0, 4, 2000)
    stats = reliability_stats(probs, labels)
    l2 = l2_calibration_error(probs, labels)
    assert stats.ece <= l2 + 1e-15 <= stats.mce + 2e-15 and 0.0 <= l2 <= 1.0
    assert ece(probs, labels) == stats.ece


def test_debiasing_removes_the_sampling_bias_of_a_calibrated_model():
    """Calibrated model, 300 repetitions of 400 samples: the plug-in squared error is clearly
    positive on average, the debiased one is zero within 4 standard errors."""
    rng = np.random.default_rng(0)
    plug_in, debiased = [], []
    for _ in range(300):
        probs, labels = two_class_predictions(rng, 400)
        stats = reliability_stats(probs, labels, n_bins=10, binning="quantile")
        plug_in.append(stats.squared_l2_error())
        debiased.append(stats.squared_l2_error(debiased=True))
    plug_in, debiased = np.array(plug_in), np.array(debiased)
    stderr = debiased.std(ddof=1) / math.sqrt(len(debiased))
    assert abs(debiased.mean()) < 4 * stderr
    assert plug_in.mean() > debiased.mean() + 10 * stderr


def test_debiased_estimate_finds_a_known_miscalibration():
    """Accuracy = confidence - 0.1 everywhere: the squared L2 error is 0.01 in every binning."""
    rng = np.random.default_rng(1)
    estimates = []
    for _ in range(200):
        probs, labels = two_class_predictions(rng, 500, accuracy_shift=-0.1)
        estimates.append(reliability_stats(probs, labels, n_bins=10).squared_l2_error(True))
    estimates = np.array(estimates)
    stderr = estimates.std(ddof=1) / math.sqrt(len(estimates))
    assert abs(estimates.mean() - 0.01) < 4 * stderr


def test_bins_with_one_sample_contribute_nothing_to_the_debiased_estimate():
    probs = np.array([[0.95, 0.05], [0.55, 0.45]])
    labels = np.array([1, 1])  # both wrong, each alone in its bin
    stats = reliability_stats(probs, labels, n_bins=10)
    assert stats.squared_l2_error(debiased=True) == 0.0
    assert stats.squared_l2_error() == pytest.approx((0.95**2 + 0.55**2) / 2, rel=1e-12)


def test_merged_accumulators_give_the_pooled_l2_error():
    rng = np.random.default_rng(4)
    probs = random_probs(rng, 900, 5)
    labels = calibrated_labels(rng, probs)
    parts = [Accumulator(15).update(probs[i::3], labels[i::3]) for i in range(3)]
    merged = Accumulator.merged(parts).bin_stats()
    pooled = reliability_stats(probs, labels)
    for debiased in (False, True):
        assert merged.l2_error(debiased) == pytest.approx(pooled.l2_error(debiased), rel=1e-12)


def test_an_empty_table_has_no_l2_error():
    with pytest.raises(InvalidInputError, match="no samples"):
        Accumulator(15).bin_stats().l2_error()
