"""Bad input gets a clear InvalidInputError, never a wrong number."""

import numpy as np
import pytest
import torch

from calibration.binning import Binning
from calibration.errors import InvalidInputError
from calibration.metrics import brier, ece, evaluate, mce, nll
from calibration.row_scores import SUM_TOLERANCE

METRICS = [ece, mce, brier, nll, evaluate]


def good_probs(n=20, k=4, dtype=np.float32):
    rng = np.random.default_rng(0)
    probs = rng.random((n, k)) + 0.05
    return (probs / probs.sum(1, keepdims=True)).astype(dtype)


def labels_for(n=20, k=4):
    return np.arange(n) % k


@pytest.mark.parametrize("metric", METRICS)
def test_shape_mismatch_between_scores_and_labels(metric):
    with pytest.raises(InvalidInputError, match="shape mismatch"):
        metric(good_probs(20), labels_for(19))


@pytest.mark.parametrize("shape", [(20,), (2, 10, 4)])
def test_scores_must_be_two_dimensional(shape):
    with pytest.raises(InvalidInputError, match=r"shape \(N, K\)"):
        ece(np.full(shape, 0.25), labels_for(20))


def test_a_single_class_column_is_refused():
    with pytest.raises(InvalidInputError, match="K >= 2"):
        ece(np.ones((5, 1)), np.zeros(5, dtype=int))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("metric", METRICS)
def test_nan_and_inf_are_refused(metric, bad, dtype):
    probs = good_probs(dtype=dtype)
    probs[7, 2] = bad
    with pytest.raises(InvalidInputError, match="NaN or Inf"):
        metric(probs, labels_for())


def test_negative_nan_is_refused():
    probs = good_probs()
    probs[3, 1] = -np.nan
    with pytest.raises(InvalidInputError, match="NaN or Inf"):
        ece(probs, labels_for())


@pytest.mark.parametrize("metric", METRICS)
def test_rows_that_do_not_sum_to_one_are_refused(metric):
    probs = good_probs()
    probs[5] *= 1 + 3 * SUM_TOLERANCE
    with pytest.raises(InvalidInputError, match="sum to 1"):
        metric(probs, labels_for())


def test_rows_within_the_documented_tolerance_are_accepted():
    probs = good_probs(dtype=np.float64)
    probs[5] *= 1 + 0.5 * SUM_TOLERANCE
    assert 0.0 <= ece(probs, labels_for()) <= 1.0


@pytest.mark.parametrize("metric", METRICS)
def test_negative_probabilities_are_refused_even_when_rows_sum_to_one(metric):
    probs = good_probs(dtype=np.float64)
    probs[4] = [-0.1, 0.6, 0.3, 0.2]
    with pytest.raises(InvalidInputError, match="negative"):
        metric(probs, labels_for())


def test_tiny_negative_value_is_refused():
    probs = good_probs(dtype=np.float64)
    probs[2, 0] = -1e-300
    with pytest.raises(InvalidInputError, match="negative"):
        ece(probs, labels_for())


def test_negative_zero_is_an_ordinary_zero():
    probs = np.array([[-0.0, 1.0, 0.0], [0.5, -0.0, 0.5], [0.2, 0.3, 0.5]], dtype=np.float32)
    labels = np.array([1, 0, 2])
    assert ece(probs, labels) == pytest.approx(ece(np.abs(probs), labels), abs=0.0)


def test_logits_passed_as_probabilities_are_refused_with_a_hint():
    logits = np.random.default_rng(1).normal(size=(20, 4))
    with pytest.raises(InvalidInputError, match="from_logits=True"):
        ece(logits, labels_for())


def test_logits_with_nan_are_refused():
    logits = np.zeros((20, 4))
    logits[3, 3] = np.nan
    with pytest.raises(InvalidInputError, match="logits contain NaN or Inf"):
        evaluate(logits, labels_for(), from_logits=True)


@pytest.mark.parametrize("bad_label", [-1, 4, 100])
@pytest.mark.parametrize("metric", METRICS)
def test_labels_out_of_range_are_refused(metric, bad_label):
    labels = labels_for()
    labels[3] = bad_label
    with pytest.raises(InvalidInputError, match="out of range"):
        metric(good_probs(), labels)


@pytest.mark.parametrize("labels", [np.full(20, 1.5), np.full(20, np.nan)])
def test_non_integer_labels_are_refused(labels):
    with pytest.raises(InvalidInputError, match="integer class indices"):
        ece(good_probs(), labels)


def test_whole_number_float_labels_are_accepted():
    assert ece(good_probs(), labels_for().astype(float)) == ece(good_probs(), labels_for())


def test_one_hot_labels_are_refused_with_a_hint():
    with pytest.raises(InvalidInputError, match="argmax"):
        ece(good_probs(), np.eye(4)[labels_for()])


@pytest.mark.parametrize("metric", METRICS)
def test_empty_input_is_refused(metric):
    with pytest.raises(InvalidInputError, match="empty"):
        metric(np.zeros((0, 4), dtype=np.float32), np.zeros(0, dtype=int))


def test_object_arrays_are_refused():
    with pytest.raises(InvalidInputError, match="object"):
        ece(np.array([[0.5, 0.5]], dtype=object), [0])


@pytest.mark.parametrize("n_bins", [0, -3, 2.5, True])
def test_bad_bin_counts_are_refused(n_bins):
    with pytest.raises(InvalidInputError, match="n_bins"):
        ece(good_probs(), labels_for(), n_bins=n_bins)


def test_binning_accepts_enum_and_strings_and_refuses_others():
    probs, labels = good_probs(), labels_for()
    assert ece(probs, labels, binning=Binning.QUANTILE) == ece(probs, labels, binning="Quantile")
    with pytest.raises(InvalidInputError, match="binning must be one of"):
        ece(probs, labels, binning="adaptive-ish")


def test_torch_inputs_are_validated_the_same_way():
    probs = torch.tensor(good_probs())
    probs[0, 0] = float("nan")
    with pytest.raises(InvalidInputError, match="NaN or Inf"):
        ece(probs, torch.tensor(labels_for()))
