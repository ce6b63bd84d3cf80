"""The native calibration sweep (``calibration/native_sweep.c`` through ``native_sweep.py``).

On the CPU, float32/float64 probabilities are scored by a compiled kernel that reads every row
once; ``BAYESFL_NATIVE`` picks the backend: unset or "1" the native build (its AVX-512 float32
path where the CPU has one), "portable" the plain-C loops, "0" only the torch sweep. The kernel
only flags invalid input; the torch sweep then re-examines the array and raises the error.

The specification checked here: the three backends are interchangeable. Counts, correct counts
and accuracy are equal; ECE, MCE and bin confidences agree to 1e-12; the native Brier score is a
float64 sum (1e-12 of an exact reference); argmax ties go to the first index; bins follow
`calibration.binning.bin_indices`; -0.0 is a zero; invalid input raises the torch sweep's
exact error; the thread count changes nothing; and without a compiler everything still works.

Tests of a compiled backend skip, with the reason, where it cannot be built (no C compiler),
unless BAYESFL_REQUIRE_NATIVE=1 demands it (see native_backends.py); the cache's safety checks
are specified in test_calibration_native_cache.py.
"""

import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from calibration_reference import calibrated_labels, random_probs
from native_backends import forget_kernels, require_kernel

import calibration.row_scores as row_scores_module
from calibration import Accumulator, native_sweep
from calibration.binning import bin_indices, edges_in_dtype, uniform_edges
from calibration.errors import InvalidInputError
from calibration.metrics import (
    accuracy,
    brier,
    classwise_ece,
    ece,
    evaluate,
    mce,
    nll,
    reliability_stats,
)
from calibration.row_scores import SUM_TOLERANCE

BACKENDS = {"native": "1", "portable": "portable", "torch": "0"}
COMPILED = ("native", "portable")
DTYPES = [np.float32, np.float64]
# 16-lane vectors: K below, at and around one and two vectors, and a long row with a tail.
CLASS_COUNTS = [2, 3, 15, 16, 17, 31, 32, 33, 100]


def use_backend(monkeypatch, backend: str) -> None:
    """Score through ``backend``; a compiled one must build, else the test skips (or fails,
    under BAYESFL_REQUIRE_NATIVE=1)."""
    monkeypatch.setenv("BAYESFL_NATIVE", BACKENDS[backend])
    if backend in COMPILED:
        require_kernel(backend)


@pytest.fixture
def torch_sweeps(monkeypatch):
    """Counts calls of the torch sweep (a compiled backend must not fall back on valid input)."""
    calls = []
    real = row_scores_module._torch_sweep

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(row_scores_module, "_torch_sweep", spy)
    return calls


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def small_blocks(monkeypatch, restore_threads):
    """Native blocks of 200 elements, 3 blocks per call, always on two threads."""
    monkeypatch.setattr(native_sweep, "_BLOCK_ELEMENTS", 200)
    monkeypatch.setattr(native_sweep, "_CALL_ELEMENTS", 600)
    monkeypatch.setattr(native_sweep, "_THREADED_ELEMENTS", 0)
    torch.set_num_threads(2)


def block_rows(n_classes: int) -> int:
    return max(1, native_sweep._BLOCK_ELEMENTS // n_classes)


def kernel(probs: np.ndarray, labels: np.ndarray, n_bins: int = 15):
    """Everything the kernel can compute, in one direct call (the current backend)."""
    probs_t = torch.from_numpy(probs)
    return native_sweep.sweep(
        probs_t, torch.from_numpy(np.asarray(labels, dtype=np.int64)),
        tolerance=SUM_TOLERANCE, top=True, label_prob=True, squares=True,
        edges=edges_in_dtype(uniform_edges(n_bins), probs_t.dtype),
    )


def all_metrics(probs, labels):
    """Every public metric that goes through the sweep (uniform and quantile bins)."""
    return {
        "evaluate": evaluate(probs, labels),
        "stats": reliability_stats(probs, labels),
        "quantile": reliability_stats(probs, labels, n_bins=10, binning="quantile"),
        "ece": ece(probs, labels),
        "mce": mce(probs, labels),
        "accuracy": accuracy(probs, labels),
        "brier": brier(probs, labels),
        "nll": nll(probs, labels),
        # the accumulator asks for bins, Brier and NLL but not the per-row confidence
        "accumulator": Accumulator(15).update(probs, labels).bin_stats(),
    }


def exact_brier(probs: np.ndarray, labels: np.ndarray) -> float:
    """Brier score of the float64-widened values with exactly rounded sums (math.fsum)."""
    wide = probs.astype(np.float64)
    squares = math.fsum((wide * wide).ravel())  # float32 squares are exact in float64
    label_total = math.fsum(wide[np.arange(len(labels)), labels])
    return math.fsum([squares, -2.0 * label_total, len(labels)]) / len(labels)


def assert_same_stats(got, expected, confidence_rtol=1e-12):
    np.testing.assert_array_equal(got.edges, expected.edges)
    np.testing.assert_array_equal(got.counts, expected.counts)
    # accuracy = correct count / count: equal arrays mean equal correct counts
    np.testing.assert_array_equal(got.accuracy, expected.accuracy)
    np.testing.assert_allclose(got.mean_confidence, expected.mean_confidence,
                               rtol=confidence_rtol, atol=0)


def assert_backends_agree(got, expected, brier_rtol):
    assert_same_stats(got["stats"], expected["stats"])
    assert_same_stats(got["quantile"], expected["quantile"])
    assert_same_stats(got["accumulator"], expected["accumulator"])
    assert got["accuracy"] == expected["accuracy"]
    assert got["evaluate"]["accuracy"] == expected["evaluate"]["accuracy"]
    assert got["evaluate"]["count"] == expected["evaluate"]["count"]
    for name in ("ece", "mce"):
        assert got[name] == pytest.approx(expected[name], rel=1e-12, abs=0)
        assert got["evaluate"][name] == pytest.approx(expected["evaluate"][name], rel=1e-12, abs=0)
    assert got["brier"] == pytest.approx(expected["brier"], rel=brier_rtol, abs=0)
    assert got["evaluate"]["brier"] == pytest.approx(expected["evaluate"]["brier"], rel=brier_rtol,
                                                     abs=0)
    assert got["nll"] == pytest.approx(expected["nll"], rel=1e-7, abs=0)
    assert got["evaluate"]["nll"] == pytest.approx(expected["evaluate"]["nll"], rel=1e-7, abs=0)


def bits(value: int, dtype) -> np.ndarray:
    """A float from its IEEE bit pattern (to get -NaN without relying on negation)."""
    int_type = np.uint32 if dtype == np.float32 else np.uint64
    return np.array([value], dtype=int_type).view(dtype)[0]


# -- the backends agree ------------------------------------------------------------------------
@pytest.mark.parametrize("n_classes", CLASS_COUNTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_backends_agree_on_random_data(dtype, n_classes, monkeypatch, torch_sweeps, small_blocks):
    rng = np.random.default_rng(n_classes)
    n_rows = 2003
    assert n_rows % block_rows(n_classes) != 0  # the last native block is partial
    probs = random_probs(rng, n_rows, n_classes, dtype=dtype)
    labels = calibrated_labels(rng, probs)

    results = {}
    for backend in BACKENDS:
        use_backend(monkeypatch, backend)
        torch_sweeps.clear()
        results[backend] = all_metrics(probs, labels)
        if backend in COMPILED:
            assert torch_sweeps == [], f"{backend}: valid input fell back to the torch sweep"

    reference = exact_brier(probs, labels)
    for backend in COMPILED:
        assert_backends_agree(results[backend], results["torch"], brier_rtol=1e-6)
        assert results[backend]["brier"] == pytest.approx(reference, rel=1e-12, abs=0)
        assert results[backend]["evaluate"]["brier"] == pytest.approx(reference, rel=1e-12, abs=0)
    assert_backends_agree(results["native"], results["portable"], brier_rtol=1e-12)
    assert results["torch"]["brier"] == pytest.approx(reference, rel=1e-6, abs=0)
    assert results["torch"]["accuracy"] == np.mean(probs.argmax(1) == labels)


@pytest.mark.parametrize("n_classes", [3, 33])
@pytest.mark.parametrize("dtype", DTYPES)
def test_backends_agree_on_logits(dtype, n_classes, monkeypatch, torch_sweeps, small_blocks):
    rng = np.random.default_rng(7)
    logits = (rng.normal(size=(1001, n_classes)) * 3).astype(dtype)
    labels = rng.integers(0, n_classes, 1001)
    results = {}
    for backend in BACKENDS:
        use_backend(monkeypatch, backend)
        torch_sweeps.clear()
        results[backend] = evaluate(logits, labels, from_logits=True)
        if backend in COMPILED:
            assert torch_sweeps == []
    for backend in COMPILED:
        got, expected = results[backend], results["torch"]
        assert got["accuracy"] == expected["accuracy"]
        assert got["nll"] == expected["nll"]  # from the log-softmax, not the sweep
        for name in ("ece", "mce"):
            assert got[name] == pytest.approx(expected[name], rel=1e-12, abs=0)
        assert got["brier"] == pytest.approx(expected["brier"], rel=1e-6, abs=0)


@pytest.mark.parametrize("n_classes", [*CLASS_COUNTS, 1025])  # 1025: a block is one row
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", COMPILED)
def test_kernel_rows_are_exact(backend, dtype, n_classes, monkeypatch, small_blocks):
    """Per row: the top value, the label's value and argmax == label, exactly as numpy has them;
    the histogram is that of bin_indices; the squares are a float64 sum."""
    use_backend(monkeypatch, backend)
    rng = np.random.default_rng(100 + n_classes)
    n_rows = 997 if n_classes <= 100 else 151
    probs = random_probs(rng, n_rows, n_classes, dtype=dtype)
    labels = calibrated_labels(rng, probs)
    result = kernel(probs, labels)
    assert result.valid
    np.testing.assert_array_equal(result.top.numpy(), probs.max(1))
    assert result.top.dtype == torch.from_numpy(probs).dtype
    np.testing.assert_array_equal(result.label_prob.numpy(), probs[np.arange(n_rows), labels])
    np.testing.assert_array_equal(result.correct.numpy(), probs.argmax(1) == labels)
    wide = probs.astype(np.float64)
    assert result.squares == pytest.approx(math.fsum((wide * wide).ravel()), rel=1e-12, abs=0)

    index = bin_indices(torch.from_numpy(probs.max(1)), uniform_edges(15)).numpy()
    counts, confidence_sums, correct_counts = (t.numpy() for t in result.bin_sums)
    np.testing.assert_array_equal(counts, np.bincount(index, minlength=15))
    np.testing.assert_array_equal(
        correct_counts, np.bincount(index, weights=probs.argmax(1) == labels, minlength=15))
    np.testing.assert_allclose(
        confidence_sums, np.bincount(index, weights=probs.max(1).astype(np.float64), minlength=15),
        rtol=1e-12, atol=0)

    # Only the histogram (row_scores(confidence=False, edges=...)): the same bins.
    probs_t = torch.from_numpy(probs)
    histogram = native_sweep.sweep(
        probs_t, torch.from_numpy(labels), tolerance=SUM_TOLERANCE, top=False, label_prob=False,
        squares=False, edges=edges_in_dtype(uniform_edges(15), probs_t.dtype))
    assert histogram.valid and histogram.top is None and histogram.correct is None
    for got, expected in zip(histogram.bin_sums, result.bin_sums, strict=True):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("backend", COMPILED)
def test_views_and_strided_tensors_are_read_where_they_are(backend, dtype, monkeypatch,
                                                           torch_sweeps, small_blocks):
    use_backend(monkeypatch, backend)
    rng = np.random.default_rng(8)
    whole = torch.from_numpy(random_probs(rng, 700, 19)).to(dtype)
    labels = torch.from_numpy(rng.integers(0, 19, 700))
    expected = evaluate(whole[5:].clone(), labels[5:].clone())
    assert evaluate(whole[5:], labels[5:]) == expected  # a view with a storage offset
    transposed = whole.t().contiguous().t()  # same values, column-major
    assert not transposed.is_contiguous()
    assert evaluate(transposed[5:], labels[5:]) == expected
    assert evaluate(whole[5:].numpy(), labels[5:].numpy()) == expected
    assert evaluate(np.asfortranarray(whole[5:].numpy()), labels[5:].numpy()) == expected
    assert torch_sweeps == []


# -- argmax semantics --------------------------------------------------------------------------
def interesting_positions(n_classes: int) -> list[int]:
    """Columns at the edges of the 16-lane vectors, of the two lane sets and of the tail."""
    around = {0, 1, 14, 15, 16, 17, 30, 31, 32, 33, 47, 48, 49, 63, 64, 65}
    around |= {n_classes - 2, n_classes - 1, n_classes - n_classes % 16, n_classes // 2}
    return sorted(p for p in around if 0 <= p < n_classes)


def tie_cases(n_classes: int, dtype) -> tuple[np.ndarray, np.ndarray]:
    """Rows whose maximum is tied (pairs and triples), all-equal rows, one-hot rows and rows
    tied below the maximum, each with labels at, before, between and after the tied entries."""
    positions = interesting_positions(n_classes)
    rows, labels = [], []

    def add(row, candidates):
        for label in sorted({c for c in candidates if 0 <= c < n_classes}):
            rows.append(row)
            labels.append(label)

    for i in positions:
        for j in (p for p in positions if p > i):
            row = np.full(n_classes, 0.1 / max(1, n_classes - 2))
            row[[i, j]] = 0.5 if n_classes == 2 else 0.45
            add(row, [i, j, i - 1, i + 1, (i + j) // 2, j - 1, j + 1, 0, n_classes - 1])
            if n_classes >= 4:
                for m in (p for p in positions if p > j):
                    row = np.full(n_classes, 0.1 / (n_classes - 3))
                    row[[i, j, m]] = 0.3
                    add(row, [i, j, m, i - 1, m + 1])
                    # tied, but below the maximum at the last position
                    row = np.full(n_classes, 0.05 / (n_classes - 3))
                    row[[i, j]] = 0.2
                    row[m] = 0.55
                    add(row, [i, j, m])
        one_hot = np.zeros(n_classes)
        one_hot[i] = 1.0
        add(one_hot, [i, i - 1, i + 1, 0, n_classes - 1])
    add(np.full(n_classes, 1.0 / n_classes), range(n_classes))
    return np.stack(rows).astype(dtype), np.array(labels)


def random_ties(rng, n_rows: int, n_classes: int, dtype) -> tuple[np.ndarray, np.ndarray]:
    """Small integer weights (many ties anywhere), each label drawn among the row's maxima."""
    weights = rng.integers(0, 4, size=(n_rows, n_classes)).astype(np.float64)
    weights[weights.sum(1) == 0, 0] = 1.0
    probs = (weights / weights.sum(1, keepdims=True)).astype(dtype)
    labels = np.array([rng.choice(np.flatnonzero(row == row.max())) for row in probs])
    return probs, labels


@pytest.mark.parametrize("n_classes", [2, 3, 15, 16, 17, 31, 32, 33, 48, 49, 64, 100])
@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_at_the_maximum_go_to_the_first_index(dtype, n_classes, monkeypatch, torch_sweeps,
                                                   small_blocks):
    probs, labels = tie_cases(n_classes, dtype)
    more_probs, more_labels = random_ties(np.random.default_rng(n_classes), 300, n_classes, dtype)
    probs, labels = np.concatenate([probs, more_probs]), np.concatenate([labels, more_labels])
    expected = probs.argmax(1) == labels
    assert 0 < expected.sum() < len(labels)
    index = bin_indices(torch.from_numpy(probs.max(1)), uniform_edges(15)).numpy()
    with np.errstate(invalid="ignore"):
        bin_accuracy = (np.bincount(index, weights=expected, minlength=15)
                        / np.bincount(index, minlength=15))
    for backend in BACKENDS:
        use_backend(monkeypatch, backend)
        torch_sweeps.clear()
        assert accuracy(probs, labels) == expected.mean(), backend
        stats = reliability_stats(probs, labels)
        np.testing.assert_array_equal(stats.accuracy, bin_accuracy)
        if backend in COMPILED:
            assert torch_sweeps == []
            result = kernel(probs, labels)
            assert result.valid
            wrong = np.flatnonzero(result.correct.numpy() != expected)
            assert wrong.size == 0, (backend, probs[wrong[:3]], labels[wrong[:3]])
            np.testing.assert_array_equal(result.top.numpy(), probs.max(1))


# -- bins --------------------------------------------------------------------------------------
def edge_confidences(n_bins: int, dtype) -> np.ndarray:
    """Every upper bin edge k / n_bins as the dtype has it (nearest and rounded up, see
    edges_in_dtype), one ulp either side, and just above 1 (still a valid maximum)."""
    edges = uniform_edges(n_bins)
    exact = edges_in_dtype(edges, torch.float32 if dtype == np.float32 else torch.float64)
    values = set()
    for k in range(1, n_bins + 1):
        for value in (dtype(edges[k].item()), dtype(exact[k].item())):
            values |= {value, np.nextafter(value, dtype(0)), np.nextafter(value, dtype(2))}
    return np.array(sorted(values), dtype=dtype)


@pytest.mark.parametrize("n_bins", [15, 10, 7])
@pytest.mark.parametrize("dtype", DTYPES)
def test_confidences_on_bin_edges_fall_where_bin_indices_puts_them(dtype, n_bins, monkeypatch,
                                                                     torch_sweeps):
    confidence = edge_confidences(n_bins, dtype)
    n_classes = 40  # the other entries, (1 - c) / 39 each, stay below c >= 1 / 15
    probs = np.empty((len(confidence), n_classes), dtype=dtype)
    for row, c in enumerate(confidence):
        probs[row] = max(0.0, (1.0 - float(c)) / (n_classes - 1))
        probs[row, row % n_classes] = c  # the maximum in every lane and in the tail
    assert np.array_equal(probs.max(1), confidence)
    labels = np.where(np.arange(len(probs)) % 3 == 0, np.arange(len(probs)) % n_classes, 0)

    index = bin_indices(torch.from_numpy(confidence), uniform_edges(n_bins)).numpy()
    # bin_indices decides as a float64 comparison with the float64 edges would
    wide = confidence.astype(np.float64)
    exact = np.searchsorted(uniform_edges(n_bins).numpy(), wide, side="right") - 1
    np.testing.assert_array_equal(index, np.clip(exact, 0, n_bins - 1))
    correct = probs.argmax(1) == labels
    counts = np.bincount(index, minlength=n_bins)
    with np.errstate(invalid="ignore"):
        expected_accuracy = np.bincount(index, weights=correct, minlength=n_bins) / counts
        expected_confidence = np.bincount(index, weights=wide, minlength=n_bins) / counts

    for backend in BACKENDS:
        use_backend(monkeypatch, backend)
        torch_sweeps.clear()
        stats = reliability_stats(probs, labels, n_bins=n_bins)
        np.testing.assert_array_equal(stats.counts, counts, err_msg=backend)
        np.testing.assert_array_equal(stats.accuracy, expected_accuracy, err_msg=backend)
        np.testing.assert_allclose(stats.mean_confidence, expected_confidence, rtol=1e-12,
                                   err_msg=backend)
        if backend in COMPILED:
            assert torch_sweeps == []
            result = kernel(probs, labels, n_bins)
            np.testing.assert_array_equal(result.bin_sums[0].numpy(), counts)


# -- negative zero -----------------------------------------------------------------------------
@pytest.mark.parametrize("n_classes", [3, 17, 33])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_negative_zero_is_an_ordinary_zero(backend, dtype, n_classes, monkeypatch, torch_sweeps,
                                           small_blocks):
    use_backend(monkeypatch, backend)
    rng = np.random.default_rng(5)
    probs = random_probs(rng, 600, n_classes, dtype=dtype)
    labels = calibrated_labels(rng, probs)
    zeros = np.zeros_like(probs, dtype=bool)
    zeros[::4, 0] = True  # first column
    zeros[1::4, n_classes - 1] = True  # last column (the tail lanes)
    zeros[2::4, 1:] = True  # everything but column 0: one-hot rows
    zeros[-1, :-1] = True  # the last row: one-hot in the last column
    labels[::8] = 0  # some labels on a zero
    labels[1::8] = n_classes - 1
    labels[2::8] = 1
    labels[-1] = n_classes - 1
    probs[zeros] = 0.0
    probs /= probs.sum(1, keepdims=True)
    signed = probs.copy()
    signed[zeros] = -0.0
    assert np.signbit(signed[zeros]).all() and not np.signbit(probs).any()

    torch_sweeps.clear()
    got, expected = all_metrics(signed, labels), all_metrics(probs, labels)
    if backend in COMPILED:
        assert torch_sweeps == [], "-0.0 must not send the array back to the torch sweep"
        assert kernel(signed, labels).valid
    assert got["evaluate"] == expected["evaluate"]
    for name in ("ece", "mce", "accuracy", "brier", "nll"):
        assert got[name] == expected[name]
    for name in ("stats", "quantile", "accumulator"):
        np.testing.assert_array_equal(got[name].counts, expected[name].counts)
        np.testing.assert_array_equal(got[name].accuracy, expected[name].accuracy)
        np.testing.assert_array_equal(got[name].mean_confidence, expected[name].mean_confidence)
    assert got["accuracy"] == np.mean(signed.argmax(1) == labels)


# -- invalid input -----------------------------------------------------------------------------
INVALID_ROWS, INVALID_CLASSES, INVALID_LABEL = 1001, 33, 17
INVALID_BLOCK_ROWS = 64  # 16 native blocks; the last (rows 960..1000) is partial
ROW_PLACES = {"first": 0, "middle": 500, "last-block": 960, "last-row": 1000}
COLUMN_PLACES = {"label": INVALID_LABEL, "column-0": 0, "tail": INVALID_CLASSES - 1}
BAD_VALUES = ["nan", "-nan", "inf", "-inf", "negative", "negative-subnormal", "sum-high",
              "sum-low", "overflow"]


def spoil(probs: np.ndarray, row: int, column: int, bad: str) -> None:
    dtype = probs.dtype.type
    spare = (column + 5) % probs.shape[1]
    finfo = np.finfo(dtype)
    quiet_nan = 0x7FC00000 if dtype == np.float32 else 0x7FF8000000000000
    sign = 0x80000000 if dtype == np.float32 else 0x8000000000000000
    if bad == "nan":
        probs[row, column] = bits(quiet_nan, dtype)
    elif bad == "-nan":
        probs[row, column] = bits(quiet_nan | sign, dtype)
        assert np.isnan(probs[row, column]) and np.signbit(probs[row, column])
    elif bad == "inf":
        probs[row, column] = np.inf
    elif bad == "-inf":
        probs[row, column] = -np.inf
    elif bad == "negative":  # the row still sums to 1
        probs[row, spare] += probs[row, column] + dtype(0.25)
        probs[row, column] = -0.25
    elif bad == "negative-subnormal":  # the row sum moves far less than the tolerance
        probs[row, spare] += probs[row, column]
        probs[row, column] = -finfo.smallest_subnormal
    elif bad == "sum-high":
        probs[row, column] += dtype(0.01)
    elif bad == "sum-low":
        probs[row, column] -= dtype(0.01)  # the row is mixed with uniform: entries > 0.015
        assert probs[row, column] > 0
    elif bad == "overflow":  # finite entries whose sum overflows
        probs[row, column] = finfo.max
        probs[row, spare] = finfo.max
    else:
        raise AssertionError(bad)


@pytest.mark.parametrize("row", ROW_PLACES)
@pytest.mark.parametrize("bad", BAD_VALUES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_invalid_input_raises_the_torch_error_on_every_backend(dtype, bad, row, monkeypatch,
                                                               small_blocks):
    monkeypatch.setattr(native_sweep, "_BLOCK_ELEMENTS", INVALID_BLOCK_ROWS * INVALID_CLASSES)
    monkeypatch.setattr(native_sweep, "_CALL_ELEMENTS", 2 * INVALID_BLOCK_ROWS * INVALID_CLASSES)
    rng = np.random.default_rng(11)
    valid = random_probs(rng, INVALID_ROWS, INVALID_CLASSES, dtype=np.float64)
    valid = (0.5 * valid + 0.5 / INVALID_CLASSES).astype(dtype)
    labels = rng.integers(0, INVALID_CLASSES, INVALID_ROWS)
    labels[ROW_PLACES[row]] = INVALID_LABEL
    for column, index in COLUMN_PLACES.items():
        probs = valid.copy()
        spoil(probs, ROW_PLACES[row], index, bad)
        use_backend(monkeypatch, "torch")
        with pytest.raises(InvalidInputError) as raised:
            evaluate(probs, labels)
        message = str(raised.value)
        assert f"row {ROW_PLACES[row]}" in message
        assert ("NaN or Inf" in message) == (bad in ("nan", "-nan", "inf", "-inf", "overflow"))
        for backend in COMPILED:
            use_backend(monkeypatch, backend)
            assert not kernel(probs, labels).valid, (backend, column)  # flagged by the kernel
            # each metric asks the kernel for a different set of outputs (the Python side is
            # the same for both builds: the portable one is checked with the extremes)
            metrics = [evaluate, reliability_stats, accuracy, brier, nll, classwise_ece]
            for metric in metrics if backend == "native" else [evaluate, classwise_ece]:
                with pytest.raises(InvalidInputError) as raised:
                    metric(probs, labels)
                assert str(raised.value) == message, (backend, column, metric.__name__)


@pytest.mark.parametrize("backend", COMPILED)
def test_rows_within_the_tolerance_are_accepted(backend, monkeypatch, torch_sweeps):
    use_backend(monkeypatch, backend)
    rng = np.random.default_rng(2)
    probs = random_probs(rng, 200, 33, dtype=np.float64)
    probs[::2] *= 1 + 0.9 * SUM_TOLERANCE
    probs[1::2] *= 1 - 0.9 * SUM_TOLERANCE
    labels = rng.integers(0, 33, 200)
    for dtype in DTYPES:
        assert kernel(probs.astype(dtype), labels).valid
        evaluate(probs.astype(dtype), labels)
    assert torch_sweeps == []


# -- threads -----------------------------------------------------------------------------------
@pytest.mark.parametrize("n_classes", [17, 100])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", COMPILED)
def test_results_do_not_depend_on_threads_or_calls(backend, dtype, n_classes, monkeypatch,
                                                   restore_threads):
    use_backend(monkeypatch, backend)
    rng = np.random.default_rng(9)
    probs = random_probs(rng, 3001, n_classes, dtype=dtype)
    labels = calibrated_labels(rng, probs)
    monkeypatch.setattr(native_sweep, "_BLOCK_ELEMENTS", 50 * n_classes)  # 61 blocks
    threaded_calls = []
    real = native_sweep._run_threaded

    def spy(*args, **kwargs):
        threaded_calls.append(args[1:])
        return real(*args, **kwargs)

    monkeypatch.setattr(native_sweep, "_run_threaded", spy)
    outcomes = []
    # (threads, blocks per call, threaded above this many elements)
    for threads, blocks_per_call, threshold in [(1, 1, 0), (2, 1, 0), (2, 3, 0), (2, 7, 0),
                                                (2, 1000, 0), (2, 1, 10**9)]:
        torch.set_num_threads(threads)
        monkeypatch.setattr(native_sweep, "_CALL_ELEMENTS", blocks_per_call * 50 * n_classes)
        monkeypatch.setattr(native_sweep, "_THREADED_ELEMENTS", threshold)
        threaded_calls.clear()
        result = kernel(probs, labels)
        assert bool(threaded_calls) == (threads > 1 and threshold == 0)
        outcomes.append((result, evaluate(probs, labels), reliability_stats(probs, labels)))

    first, first_metrics, first_stats = outcomes[0]
    assert first.valid
    for result, metrics, stats in outcomes[1:]:
        assert result.valid
        for name in ("top", "label_prob", "correct"):
            assert torch.equal(getattr(result, name), getattr(first, name)), name
        assert result.squares == first.squares
        for got, expected in zip(result.bin_sums, first.bin_sums, strict=True):
            assert torch.equal(got, expected)
        assert metrics == first_metrics
        np.testing.assert_array_equal(stats.mean_confidence, first_stats.mean_confidence)
        np.testing.assert_array_equal(stats.counts, first_stats.counts)


# -- switching off, other devices and dtypes, building -----------------------------------------
@pytest.mark.parametrize(("setting", "expected"), [
    (None, "native"), ("1", "native"), ("portable", "portable"), (" Portable ", "portable"),
    ("0", None), ("off", None), ("false", None), ("no", None), ("torch", None), ("OFF", None),
])
def test_variant_follows_bayesfl_native(setting, expected, monkeypatch):
    if setting is None:
        monkeypatch.delenv("BAYESFL_NATIVE", raising=False)
    else:
        monkeypatch.setenv("BAYESFL_NATIVE", setting)
    assert native_sweep.variant() == expected


def test_native_build_takes_the_avx512_path_where_the_cpu_has_it(monkeypatch):
    use_backend(monkeypatch, "native")
    use_backend(monkeypatch, "portable")
    has_avx512f = "avx512f" in native_sweep._cpu_identity().split()  # the CPU's flags line
    assert native_sweep.library("native").bfl_sweep_variant() == int(has_avx512f)
    assert native_sweep.library("portable").bfl_sweep_variant() == 0


def test_turned_off_the_sweep_declines(monkeypatch):
    monkeypatch.setenv("BAYESFL_NATIVE", "0")
    probs = random_probs(np.random.default_rng(0), 10, 4, dtype=np.float32)
    assert kernel(probs, np.zeros(10, dtype=np.int64)) is None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_other_dtypes_are_declined(dtype, monkeypatch):
    use_backend(monkeypatch, "native")
    probs = torch.full((4, 4), 0.25, dtype=dtype)
    labels = torch.zeros(4, dtype=torch.int64)
    assert native_sweep.sweep(probs, labels, tolerance=SUM_TOLERANCE, top=True,
                              label_prob=True, squares=True) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_are_declined(monkeypatch):
    use_backend(monkeypatch, "native")
    probs = torch.full((4, 4), 0.25, device="cuda")
    labels = torch.zeros(4, dtype=torch.int64, device="cuda")
    assert native_sweep.sweep(probs, labels, tolerance=SUM_TOLERANCE, top=True,
                              label_prob=True, squares=True) is None
    assert evaluate(probs, labels)["accuracy"] == 1.0


def test_unknown_library_kind_is_refused():
    with pytest.raises(ValueError, match="kind must be"):
        native_sweep.library("avx2")


def _data():
    rng = np.random.default_rng(4)
    probs = random_probs(rng, 300, 7, dtype=np.float32)
    return probs, calibrated_labels(rng, probs)


@pytest.mark.parametrize("backend", COMPILED)
def test_without_a_compiler_metrics_use_the_torch_sweep(backend, monkeypatch, tmp_path, caplog):
    probs, labels = _data()
    use_backend(monkeypatch, "torch")
    expected = all_metrics(probs, labels)

    monkeypatch.setenv("BAYESFL_NATIVE", BACKENDS[backend])
    monkeypatch.setenv("BAYESFL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("BAYESFL_REQUIRE_NATIVE", raising=False)  # not demanded: fall back
    monkeypatch.setattr(native_sweep, "_compiler", lambda: None)
    forget_kernels(monkeypatch)
    with caplog.at_level("WARNING", logger=native_sweep.__name__):
        assert native_sweep.library(backend) is None
        assert kernel(probs, labels) is None
        warned = len(caplog.records)
        got = all_metrics(probs, labels)
    assert warned >= 1 and all("no C compiler" in r.message for r in caplog.records)
    assert "no C compiler" in native_sweep.unavailable_reason(backend)
    assert len(caplog.records) == warned  # said once, not on every call
    assert got["evaluate"] == expected["evaluate"]
    assert got["accuracy"] == expected["accuracy"]
    assert_same_stats(got["stats"], expected["stats"], confidence_rtol=0)
    assert list(tmp_path.iterdir()) == []


def test_a_failing_compiler_leaves_the_torch_sweep(monkeypatch, tmp_path, caplog):
    probs, labels = _data()
    use_backend(monkeypatch, "torch")
    expected = evaluate(probs, labels)

    failing = tmp_path / "cc-that-fails"
    failing.write_text("#!/bin/sh\nexit 1\n")
    failing.chmod(0o755)
    cache = tmp_path / "cache"
    monkeypatch.setenv("BAYESFL_NATIVE", "1")
    monkeypatch.setenv("BAYESFL_CACHE_DIR", str(cache))
    monkeypatch.setenv("CC", str(failing))  # runs, and fails every compilation
    monkeypatch.delenv("BAYESFL_REQUIRE_NATIVE", raising=False)  # not demanded: fall back
    forget_kernels(monkeypatch)
    assert native_sweep._compiler() == str(failing)
    with caplog.at_level("WARNING", logger=native_sweep.__name__):
        assert native_sweep.library("native") is None
        assert kernel(probs, labels) is None
        assert evaluate(probs, labels) == expected
    assert caplog.records and all("cc-that-fails failed" in r.message for r in caplog.records)
    assert list(cache.iterdir()) == []  # no scratch file left behind


def test_native_falls_back_to_the_portable_build(monkeypatch, torch_sweeps):
    use_backend(monkeypatch, "portable")
    monkeypatch.setenv("BAYESFL_NATIVE", "1")
    monkeypatch.delenv("BAYESFL_REQUIRE_NATIVE", raising=False)  # not demanded: fall back
    monkeypatch.setitem(native_sweep._libraries, "native", None)  # as if it failed to build
    probs, labels = _data()
    result = kernel(probs, labels)
    assert result is not None and result.valid
    np.testing.assert_array_equal(result.correct.numpy(), probs.argmax(1) == labels)
    evaluate(probs, labels)
    assert torch_sweeps == []


def test_an_unusable_cache_dir_falls_back_to_a_private_temporary_directory(monkeypatch,
                                                                           tmp_path, caplog):
    """A fresh mkdtemp directory (0700, random name) that is removed once the library is
    loaded: nothing that was already there is ever loaded."""
    require_kernel("portable")
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache directory should be")
    (tmp_path / "tmp").mkdir()
    monkeypatch.delenv("BAYESFL_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    forget_kernels(monkeypatch)
    with caplog.at_level("WARNING", logger=native_sweep.__name__):
        lib = native_sweep.library("portable")
    assert lib is not None
    built = Path(lib._name)
    assert built.parent.parent == tmp_path / "tmp"
    assert built.parent.name.startswith("bayesfl-native-")
    assert not built.parent.exists()  # removed after loading; the mapping stays valid
    assert lib.bfl_sweep_variant() == 0
    assert blocked.is_file()
    assert any("not using the kernel cache" in r.message and "blocked" in r.message
               for r in caplog.records)


@pytest.mark.parametrize("kind", COMPILED)
def test_build_into_a_fresh_cache_dir(kind, monkeypatch, tmp_path, torch_sweeps):
    require_kernel(kind)
    cache = tmp_path / "not" / "yet" / "there"
    monkeypatch.setenv("BAYESFL_CACHE_DIR", str(cache))
    monkeypatch.setenv("BAYESFL_NATIVE", BACKENDS[kind])
    forget_kernels(monkeypatch)

    lib = native_sweep.library(kind)
    assert lib is not None
    built = sorted(cache.iterdir())
    assert [p.name for p in built] == [Path(lib._name).name]
    assert re.fullmatch(rf"native_sweep-{kind}-[0-9a-f]{{20}}\.so", built[0].name)
    assert native_sweep.library(kind) is lib  # loaded once per process

    probs, labels = _data()
    result = kernel(probs, labels)
    assert result.valid
    np.testing.assert_array_equal(result.correct.numpy(), probs.argmax(1) == labels)
    assert evaluate(probs, labels)["accuracy"] == np.mean(probs.argmax(1) == labels)
    assert torch_sweeps == []

    # A new process (here: a cleared registry) loads the cached build without compiling.
    def no_compiling(*args):
        raise AssertionError("rebuilt although the cache holds the library")

    forget_kernels(monkeypatch)
    monkeypatch.setattr(native_sweep, "_compile", no_compiling)
    again = native_sweep.library(kind)
    assert again is not None and Path(again._name) == built[0]
    assert sorted(cache.iterdir()) == built


@pytest.mark.parametrize("backend", COMPILED)
def test_many_bins_widen_the_blocks_instead_of_the_histogram_memory(backend, monkeypatch,
                                                                    small_blocks):
    """Per-block histograms are capped at _MAX_BIN_ENTRIES entries: blocks grow instead."""
    rng = np.random.default_rng(11)
    probs = random_probs(rng, 3001, 7)
    labels = rng.integers(0, 7, 3001)
    use_backend(monkeypatch, "torch")
    expected = reliability_stats(probs, labels, n_bins=2000)
    use_backend(monkeypatch, backend)
    monkeypatch.setattr(native_sweep, "_MAX_BIN_ENTRIES", 20_000)  # 10 blocks of 2,000 bins
    seen = []
    real_zeros = torch.zeros
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: seen.append(a) or real_zeros(*a, **k))
    got = reliability_stats(probs, labels, n_bins=2000)
    assert_same_stats(got, expected)
    histograms = [shape for shape in seen if len(shape) == 2 and shape[1] == 2000]
    assert histograms and all(shape[0] * shape[1] <= 20_000 for shape in histograms)


FORKED_CHILD_SCRIPT = """
import multiprocessing, sys
import numpy as np, torch
from calibration import native_sweep
native_sweep._THREADED_ELEMENTS, native_sweep._BLOCK_ELEMENTS = 0, 200
torch.get_num_threads = lambda: 3  # three workers, without touching torch's own thread pool
rng = np.random.default_rng(5)
probs = torch.from_numpy(rng.dirichlet(np.ones(9), 500).astype(np.float32))
labels = torch.from_numpy(rng.integers(0, 9, 500))

def top_sum(_=None):
    found = native_sweep.sweep(probs, labels, tolerance=1e-3, top=True, label_prob=False,
                               squares=False)
    return float(found.top.sum())

parent = top_sum()  # the parent's pool of workers now exists
with multiprocessing.get_context("fork").Pool(1) as pool:
    child = pool.apply_async(top_sum).get(timeout=60)
print(parent == child, flush=True)
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_can_still_use_the_threaded_sweep(monkeypatch):
    """A child inherits the worker pool object but not its threads; it must not wait on them.

    Runs in a fresh interpreter: torch's own OpenMP pool cannot be used after a fork once the
    parent has set its thread count, which pytest processes here have.
    """
    use_backend(monkeypatch, "native")
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", FORKED_CHILD_SCRIPT], cwd=root,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "True"


@pytest.mark.parametrize("flush", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_negative_subnormal_is_refused_even_when_denormals_are_flushed(backend, dtype, flush,
                                                                        monkeypatch):
    """torch.set_flush_denormal(True) makes float compares see -1e-40 as -0.0; bits do not.

    The flushed case skips only where the CPU has no flush-to-zero mode (torch returns False:
    non-x86 CPUs without it): there no flushing can hide the sign, so there is nothing to check
    beyond the unflushed case, which runs everywhere."""
    use_backend(monkeypatch, backend)
    rng = np.random.default_rng(2)
    probs, labels = random_probs(rng, 50, 5, dtype=dtype), rng.integers(0, 5, 50)
    probs[7, 3] = -np.finfo(dtype).smallest_subnormal
    if flush and not torch.set_flush_denormal(True):
        pytest.skip("this CPU has no flush-to-zero mode (torch.set_flush_denormal is False)")
    try:
        with pytest.raises(InvalidInputError, match="negative"):
            evaluate(probs, labels)
    finally:
        torch.set_flush_denormal(False)
