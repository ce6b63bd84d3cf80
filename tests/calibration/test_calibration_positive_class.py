"""The binary positive-class convention: bins of p_1 against the fraction of positives."""

import numpy as np
import pytest

from calibration import ece, positive_class_ece, positive_class_stats
from calibration.errors import InvalidInputError

netcal_metrics = pytest.importorskip("netcal.metrics")


def binary_data(seed, n=2000):
    rng = np.random.default_rng(seed)
    p = rng.uniform(size=n)
    p[:5] = [0.0, 1.0, 0.5, 1.0, 0.0]  # the ends of [0, 1] and a bin edge
    labels = (rng.uniform(size=n) < p ** 1.5).astype(int)
    return p, labels


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("n_bins", [10, 15])
def test_agrees_with_netcal_binary_ece(seed, n_bins):
    p, labels = binary_data(seed)
    expected = netcal_metrics.ECE(bins=n_bins).measure(p, labels)
    assert positive_class_ece(p, labels, n_bins) == pytest.approx(expected, abs=1e-6)
    two_columns = np.stack([1.0 - p, p], axis=1)
    assert positive_class_ece(two_columns, labels, n_bins) == pytest.approx(expected, abs=1e-6)


def test_table_accuracy_is_the_fraction_of_positives_per_bin():
    p, labels = binary_data(3)
    stats = positive_class_stats(p, labels, n_bins=4)
    for b, (low, high) in enumerate(zip(stats.edges[:-1], stats.edges[1:], strict=True)):
        member = (p >= low) & ((p <= high) if b == 3 else (p < high))
        assert stats.counts[b] == member.sum()
        assert stats.accuracy[b] == pytest.approx(labels[member].mean(), abs=1e-12)
        assert stats.mean_confidence[b] == pytest.approx(p[member].mean(), abs=1e-12)


def test_logits_go_through_a_sigmoid_or_a_softmax():
    p, labels = binary_data(4)
    p = np.clip(p, 1e-6, 1 - 1e-6)
    logit = np.log(p) - np.log1p(-p)
    expected = positive_class_ece(p, labels)
    assert positive_class_ece(logit, labels, from_logits=True) == pytest.approx(expected, abs=1e-9)
    two_logits = np.stack([np.zeros_like(logit), logit], axis=1)
    assert positive_class_ece(two_logits, labels, from_logits=True) == pytest.approx(
        expected, abs=1e-9)


def test_differs_from_the_top_label_ece_on_the_same_predictions():
    """p_1 = 0.8 with 70% positives and p_1 = 0.2 with 10% positives: each positive-class bin
    is off by 0.1, but the top label is 0.8 in both halves and right 80% of the time overall."""
    p = np.r_[np.full(1000, 0.8), np.full(1000, 0.2)]
    labels = np.r_[np.arange(1000) < 700, np.arange(1000) < 100].astype(int)
    assert positive_class_ece(p, labels) == pytest.approx(0.1, abs=1e-12)
    assert ece(np.stack([1 - p, p], axis=1), labels) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize(("probs", "labels", "match"), [
    (np.array([0.2, 1.2]), np.array([0, 1]), r"\[0, 1\]"),
    (np.array([0.2, np.nan]), np.array([0, 1]), "NaN"),
    (np.full((2, 3), 1 / 3), np.array([0, 1]), "2 class columns"),
    (np.array([0.2, 0.4]), np.array([0, 2]), "out of range"),
    (np.array([0.2, 0.4]), np.array([0]), "shape mismatch"),
])
def test_bad_input_is_refused(probs, labels, match):
    with pytest.raises(InvalidInputError, match=match):
        positive_class_ece(probs, labels)
