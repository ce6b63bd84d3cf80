"""The sweeps behind calibration.row_scores: validation and argmax semantics in every chunk.

The torch sweep takes the confidence from the bits' row maximum, with a per-step minimum of the
bits for negative entries and a norm-based tie check per block of steps; the native kernel reads
each row once (see calibration/native_sweep.c). Each test runs with tiny steps so that a problem
can sit in the first, a middle or the last (partial) chunk, and at the label's position.

Every test runs on each backend (``BAYESFL_NATIVE``): the native kernel, its portable build and
the torch sweep alone (the compiled ones skip, with the reason, where no C compiler exists,
unless BAYESFL_REQUIRE_NATIVE=1 demands them). The native blocks are as small as the torch
steps, so rows 0, 500 and 1000 sit in different native blocks, and the blocks are shared out
between two threads.
"""

import numpy as np
import pytest
import torch
from calibration_reference import random_probs, reference_brier, reference_ece_mce
from native_backends import require_kernel

import calibration.row_scores as row_scores_module
from calibration import native_sweep
from calibration.errors import InvalidInputError
from calibration.metrics import accuracy, brier, ece, evaluate, mce, nll

METRICS = [ece, mce, brier, nll, evaluate, accuracy]
N_ROWS, N_CLASSES = 1001, 5  # 1001 rows: 11 steps of 96 rows, the last one partial
ROWS = [0, 500, N_ROWS - 1]  # first, middle and last chunk


@pytest.fixture(autouse=True)
def small_sweep_steps(monkeypatch):
    monkeypatch.setattr(row_scores_module, "_CHUNK_BYTES", 96 * N_CLASSES * 4)
    monkeypatch.setattr(row_scores_module, "_BLOCK_BYTES", 3 * 96 * N_CLASSES * 4)


@pytest.fixture(autouse=True, params=["native", "portable", "torch"])
def backend(request, monkeypatch):
    """Each test on every backend; native blocks of 96 rows, two per call, on two threads."""
    monkeypatch.setenv("BAYESFL_NATIVE", {"native": "1", "portable": "portable",
                                          "torch": "0"}[request.param])
    if request.param != "torch":  # skips without a C compiler (fails if one is required)
        require_kernel(request.param)
    monkeypatch.setattr(native_sweep, "_BLOCK_ELEMENTS", 96 * N_CLASSES)
    monkeypatch.setattr(native_sweep, "_CALL_ELEMENTS", 2 * 96 * N_CLASSES)
    monkeypatch.setattr(native_sweep, "_THREADED_ELEMENTS", 0)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))
    yield request.param
    torch.set_num_threads(threads)


def data(dtype=np.float32):
    rng = np.random.default_rng(3)
    probs = random_probs(rng, N_ROWS, N_CLASSES, dtype=dtype)
    labels = rng.integers(0, N_CLASSES, N_ROWS)
    return probs, labels


def other_column(labels, row):
    return (int(labels[row]) + 1) % N_CLASSES


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("at_label", [True, False])
@pytest.mark.parametrize("row", ROWS)
@pytest.mark.parametrize("bad", [np.nan, -np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("metric", METRICS)
def test_nan_and_inf_are_refused_in_any_chunk_and_column(metric, bad, row, at_label, dtype):
    probs, labels = data(dtype)
    column = int(labels[row]) if at_label else other_column(labels, row)
    probs[row, column] = bad
    with pytest.raises(InvalidInputError, match="NaN or Inf"):
        metric(probs, labels)


@pytest.mark.parametrize("metric", METRICS)
def test_opposite_infinities_in_one_row_are_refused(metric):
    probs, labels = data()
    probs[500, :2] = [np.inf, -np.inf]
    with pytest.raises(InvalidInputError, match="NaN or Inf"):
        metric(probs, labels)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("at_label", [True, False])
@pytest.mark.parametrize("row", ROWS)
@pytest.mark.parametrize("metric", METRICS)
def test_negative_entries_are_refused_when_the_row_still_sums_to_one(metric, row, at_label, dtype):
    probs, labels = data(dtype)
    column = int(labels[row]) if at_label else other_column(labels, row)
    spare = (column + 2) % N_CLASSES
    probs[row, spare] += probs[row, column] + 0.25  # keeps the sum at 1
    probs[row, column] = -0.25
    with pytest.raises(InvalidInputError, match="negative"):
        metric(probs, labels)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("metric", METRICS)
def test_smallest_negative_subnormal_is_refused(metric, dtype):
    probs, labels = data(dtype)
    tiny = -np.finfo(dtype).smallest_subnormal
    probs[N_ROWS - 1, labels[N_ROWS - 1]] = tiny  # row sum moves far less than the tolerance
    with pytest.raises(InvalidInputError, match="negative"):
        metric(probs, labels)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_negative_zero_anywhere_is_an_ordinary_zero(dtype):
    probs, labels = data(dtype)
    probs[::7, 0] = 0.0
    probs[::7] /= probs[::7].sum(1, keepdims=True)
    labels[::14] = 0  # half of those rows have their label's entry at the zero
    signed = probs.copy()
    signed[::7, 0] = -0.0
    assert np.signbit(signed[::7, 0]).all()
    assert evaluate(signed, labels) == evaluate(probs, labels)
    assert accuracy(signed, labels) == pytest.approx((signed.argmax(1) == labels).mean(), abs=0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_ties_with_the_label_follow_argmax_in_every_chunk(dtype):
    probs, labels = data(dtype)
    tied = np.array([0.3, 0.3, 0.3, 0.05, 0.05], dtype=dtype)
    probs[::5] = tied
    probs[1::9] = np.array([0.0, 0.5, 0.0, 0.5, 0.0], dtype=dtype)
    probs[N_ROWS - 1] = np.array([0.2] * 5, dtype=dtype)
    labels[::3] = 2  # tied maximum, not the first: wrong
    labels[::4] = 0  # the first of the tied maximum: right
    expected_ece, expected_mce = reference_ece_mce(probs, labels)
    result = evaluate(probs, labels)
    assert result["accuracy"] == (probs.argmax(1) == labels).mean()
    assert result["ece"] == pytest.approx(expected_ece, abs=1e-9)
    assert result["mce"] == pytest.approx(expected_mce, abs=1e-9)


def test_confidence_of_one_and_zero_label_probability():
    probs, labels = data(np.float64)
    probs[::2] = np.eye(N_CLASSES)[labels[::2]]  # confident and right
    probs[1::4] = np.eye(N_CLASSES)[(labels[1::4] + 1) % N_CLASSES]  # confident and wrong
    expected_ece, expected_mce = reference_ece_mce(probs, labels)
    result = evaluate(probs, labels)
    assert result["accuracy"] == (probs.argmax(1) == labels).mean()
    assert result["ece"] == pytest.approx(expected_ece, abs=1e-12)
    assert result["mce"] == pytest.approx(expected_mce, abs=1e-12)
    assert result["brier"] == pytest.approx(reference_brier(probs, labels), abs=1e-12)
    assert brier(probs, labels) == result["brier"]
