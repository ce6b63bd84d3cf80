"""Metric values: agreement with netcal and with direct numpy formulas, edge cases, devices."""

import numpy as np
import pytest
import torch
from calibration_reference import (
    calibrated_labels,
    random_probs,
    reference_brier,
    reference_ece_mce,
    reference_nll,
)
from netcal.metrics import ECE, MCE

import calibration.row_scores as row_scores_module
from calibration.bin_stats import bin_stats_from_confidence
from calibration.binning import uniform_edges
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

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
NETCAL_TOL = 1e-6  # acceptance tolerance against netcal
EXACT_TOL = 1e-12  # float64 inputs against a float64 numpy reference


def netcal_ece_mce(probs, labels, n_bins=15, equal_intervals=True):
    # netcal switches to a positive-class metric when labels hold <= 2 distinct values.
    assert len(np.unique(labels)) >= 3
    return (ECE(bins=n_bins, equal_intervals=equal_intervals).measure(probs, labels),
            MCE(bins=n_bins, equal_intervals=equal_intervals).measure(probs, labels))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n_bins", [5, 15, 20])
def test_ece_and_mce_equal_netcal_on_random_multiclass_data(dtype, n_bins):
    rng = np.random.default_rng(n_bins)
    probs = random_probs(rng, 4000, 7, dtype=dtype)
    labels = calibrated_labels(rng, probs ** 0.7)  # a miscalibrated model
    expected_ece, expected_mce = netcal_ece_mce(probs, labels, n_bins)
    assert ece(probs, labels, n_bins) == pytest.approx(expected_ece, abs=NETCAL_TOL)
    assert mce(probs, labels, n_bins) == pytest.approx(expected_mce, abs=NETCAL_TOL)


def test_quantile_ece_equals_netcal_equal_mass_bins():
    rng = np.random.default_rng(3)
    probs = random_probs(rng, 3000, 5)
    labels = calibrated_labels(rng, probs ** 1.5)  # under-confident model: gaps change sign
    expected_ece, expected_mce = netcal_ece_mce(probs, labels, 10, equal_intervals=False)
    assert ece(probs, labels, 10, binning="quantile") == pytest.approx(expected_ece, abs=NETCAL_TOL)
    assert mce(probs, labels, 10, binning="quantile") == pytest.approx(expected_mce, abs=NETCAL_TOL)
    assert ece(probs, labels, 10, binning="quantile") != pytest.approx(ece(probs, labels, 10))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_confidence_exactly_one_matches_netcal(dtype):
    # One-hot rows: confidence exactly 1.0 (last bin, closed) and entries exactly 0.0. netcal
    # clips confidences to [eps, 1 - eps] before binning: same bin, mean confidence off by
    # eps (1.2e-7 in float32), inside the 1e-6 tolerance.
    rng = np.random.default_rng(0)
    probs = random_probs(rng, 600, 4, dtype=dtype)
    probs[:300] = np.eye(4, dtype=dtype)[rng.integers(0, 4, 300)]
    labels = calibrated_labels(rng, probs)
    labels[:40] = (probs[:40].argmax(1) + 1) % 4  # some confident mistakes at confidence 1
    expected_ece, expected_mce = netcal_ece_mce(probs, labels)
    assert ece(probs, labels) == pytest.approx(expected_ece, abs=NETCAL_TOL)
    assert mce(probs, labels) == pytest.approx(expected_mce, abs=NETCAL_TOL)
    stats = reliability_stats(probs, labels)
    assert stats.counts[-1] >= 300  # confidence 1.0 lands in the last (closed) bin


def test_confidences_exactly_zero_and_one_and_on_edges_match_netcal_binning():
    # Top-label confidence of valid probabilities is >= 1/K, so 0.0 is tested at the level of
    # (confidence, correct) pairs, which netcal scores in its binary mode (X = confidence,
    # y = correctness) with the same equal-width bins.
    rng = np.random.default_rng(1)
    confidence = np.concatenate([[0.0, 0.0, 1.0, 1.0], np.arange(16) / 15, rng.random(200)])
    correct = rng.random(confidence.size) < confidence
    stats = bin_stats_from_confidence(torch.tensor(confidence), torch.tensor(correct),
                                      uniform_edges(15))
    assert stats.counts[0] >= 3 and stats.counts[-1] >= 3  # 0.0 first bin, 1.0 last bin
    assert stats.ece == pytest.approx(ECE(bins=15).measure(confidence, correct.astype(float)),
                                      abs=NETCAL_TOL)
    assert stats.mce == pytest.approx(MCE(bins=15).measure(confidence, correct.astype(float)),
                                      abs=NETCAL_TOL)


def test_all_correct_and_all_wrong_match_netcal():
    rng = np.random.default_rng(2)
    probs = random_probs(rng, 500, 6)
    predicted = probs.argmax(1)
    all_correct, all_wrong = predicted, (predicted + 1) % 6
    for labels, expected_accuracy in ((all_correct, 1.0), (all_wrong, 0.0)):
        expected_ece, expected_mce = netcal_ece_mce(probs, labels)
        assert ece(probs, labels) == pytest.approx(expected_ece, abs=NETCAL_TOL)
        assert mce(probs, labels) == pytest.approx(expected_mce, abs=NETCAL_TOL)
        assert accuracy(probs, labels) == expected_accuracy
    # All wrong: ECE is the mean confidence.
    assert ece(probs, all_wrong) == pytest.approx(probs.max(1).mean(), abs=EXACT_TOL)


def test_single_sample():
    # netcal cannot score one sample of a 3-class problem (one distinct label -> binary mode ->
    # RuntimeError), so compare with the definition: ECE = MCE = |1[correct] - confidence|.
    probs = np.array([[0.2, 0.7, 0.1]])
    assert ece(probs, [1]) == pytest.approx(0.3, abs=EXACT_TOL)
    assert mce(probs, [2]) == pytest.approx(0.7, abs=EXACT_TOL)
    assert evaluate(probs, [1])["count"] == 1


def test_two_class_input_is_scored_top_label_not_positive_class():
    rng = np.random.default_rng(4)
    probs = random_probs(rng, 1000, 2)
    labels = calibrated_labels(rng, probs ** 0.5)
    expected_ece, expected_mce = reference_ece_mce(probs, labels)
    assert ece(probs, labels) == pytest.approx(expected_ece, abs=EXACT_TOL)
    assert mce(probs, labels) == pytest.approx(expected_mce, abs=EXACT_TOL)


def test_two_class_case_where_top_label_and_positive_class_metrics_differ():
    # 50 rows [0.3, 0.7] always labelled 1, 50 rows [0.7, 0.3] labelled 0 in 40%: the top-label
    # confidence is 0.7 everywhere with 70% accuracy (ECE 0), while the positive-class
    # probability is off by 0.3 in both of its bins (netcal's binary mode reports 0.3).
    probs = np.array([[0.3, 0.7]] * 50 + [[0.7, 0.3]] * 50)
    labels = np.array([1] * 50 + [0] * 20 + [1] * 30)
    assert ece(probs, labels) == pytest.approx(0.0, abs=EXACT_TOL)
    assert ECE(bins=15).measure(probs, labels) == pytest.approx(0.3, abs=NETCAL_TOL)


def test_ties_at_the_maximum_follow_argmax_first_index():
    probs = np.array([[0.4, 0.4, 0.2], [0.4, 0.4, 0.2], [1 / 3, 1 / 3, 1 / 3],
                      [1 / 3, 1 / 3, 1 / 3], [0.5, 0.5, 0.0], [0.5, 0.0, 0.5]])
    labels = np.array([0, 1, 0, 2, 1, 2])
    assert accuracy(probs, labels) == pytest.approx((probs.argmax(1) == labels).mean())
    expected_ece, _ = reference_ece_mce(probs, labels, 15)
    assert ece(probs, labels) == pytest.approx(expected_ece, abs=EXACT_TOL)


@pytest.fixture
def small_sweep_steps(monkeypatch):
    """Tiny sweep steps: many chunks and tie-check blocks, the last of each partial."""
    monkeypatch.setattr(row_scores_module, "_CHUNK_BYTES", 4096)
    monkeypatch.setattr(row_scores_module, "_BLOCK_BYTES", 3 * 4096)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_many_tied_rows_across_sweep_chunks_follow_argmax(dtype, small_sweep_steps):
    rng = np.random.default_rng(12)
    probs = random_probs(rng, 30_000, 3, dtype=dtype)
    probs[::3] = np.array([1 / 3, 1 / 3, 1 / 3], dtype=dtype)
    probs[1::7] = np.array([0.45, 0.45, 0.1], dtype=dtype)
    probs[2::11] = np.array([0.1, 0.45, 0.45], dtype=dtype)
    labels = rng.integers(0, 3, 30_000)
    expected_ece, expected_mce = reference_ece_mce(probs, labels)
    result = evaluate(probs, labels)
    assert result["accuracy"] == (probs.argmax(1) == labels).mean()
    assert result["ece"] == pytest.approx(expected_ece, abs=1e-9)
    assert result["mce"] == pytest.approx(expected_mce, abs=1e-9)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_brier_and_nll_equal_direct_numpy_formulas(dtype):
    rng = np.random.default_rng(5)
    probs = random_probs(rng, 2000, 9, scale=4.0, dtype=dtype)
    probs[:5] = np.eye(9, dtype=dtype)[:5]  # p_y = 0 for mislabelled one-hot rows: floor
    labels = calibrated_labels(rng, probs)
    labels[:5] = 8
    tol = 1e-6 if dtype == np.float32 else EXACT_TOL
    assert brier(probs, labels) == pytest.approx(reference_brier(probs, labels), abs=tol)
    assert nll(probs, labels) == pytest.approx(reference_nll(probs, labels), abs=tol)


def test_logits_give_the_same_metrics_as_their_softmax():
    rng = np.random.default_rng(6)
    logits = rng.normal(size=(800, 5)) * 3
    logits[0] = [200.0, -200.0, 0.0, 0.0, 0.0]  # saturated softmax
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    labels = calibrated_labels(rng, probs)
    from_logits = evaluate(logits, labels, from_logits=True)
    from_probs = evaluate(probs, labels)
    for key in ("accuracy", "ece", "mce", "brier", "nll"):
        assert from_logits[key] == pytest.approx(from_probs[key], abs=1e-9), key
    assert nll(torch.tensor(logits), labels, from_logits=True) == pytest.approx(
        -torch.log_softmax(torch.tensor(logits), 1)[torch.arange(800), labels].mean().item(),
        abs=1e-9)


def test_evaluate_equals_the_separate_functions():
    rng = np.random.default_rng(7)
    probs = random_probs(rng, 3000, 10, dtype=np.float32)
    labels = calibrated_labels(rng, probs)
    result = evaluate(probs, labels, n_bins=12)
    assert set(result) == {"accuracy", "ece", "mce", "brier", "nll", "count"}
    assert result["count"] == 3000
    assert result["ece"] == ece(probs, labels, 12)
    assert result["mce"] == mce(probs, labels, 12)
    assert result["brier"] == pytest.approx(brier(probs, labels), abs=1e-12)
    assert result["nll"] == pytest.approx(nll(probs, labels), abs=1e-12)
    assert result["accuracy"] == accuracy(probs, labels)
    assert all(isinstance(result[key], float) for key in ("accuracy", "ece", "mce", "brier"))


def test_sweep_in_uneven_chunks_equals_reference(small_sweep_steps):
    rng = np.random.default_rng(8)
    probs = random_probs(rng, 20_003, 50, dtype=np.float32)  # 4096-byte steps: 20 rows each
    labels = calibrated_labels(rng, probs ** 0.8)
    expected_ece, expected_mce = reference_ece_mce(probs, labels)
    result = evaluate(probs, labels)
    assert result["ece"] == pytest.approx(expected_ece, abs=1e-9)
    assert result["mce"] == pytest.approx(expected_mce, abs=1e-9)
    assert result["brier"] == pytest.approx(reference_brier(probs, labels), abs=1e-6)


def test_classwise_ece_equals_loop_over_classes():
    rng = np.random.default_rng(9)
    probs = random_probs(rng, 1500, 4)
    labels = calibrated_labels(rng, probs ** 0.6)
    per_class = []
    for k in range(4):
        confidence, outcome = probs[:, k], (labels == k).astype(float)
        edges = np.linspace(0, 1, 16)
        total = 0.0
        for b in range(15):
            upper = confidence <= edges[b + 1] if b == 14 else confidence < edges[b + 1]
            member = (confidence >= edges[b]) & upper
            if member.any():
                total += member.sum() / 1500 * abs(outcome[member].mean()
                                                   - confidence[member].mean())
        per_class.append(total)
    assert classwise_ece(probs, labels) == pytest.approx(np.mean(per_class), abs=EXACT_TOL)


@pytest.mark.parametrize("device", DEVICES)
def test_tensors_on_any_device_give_the_numpy_result(device):
    rng = np.random.default_rng(10)
    probs = random_probs(rng, 1000, 5, dtype=np.float32)
    labels = calibrated_labels(rng, probs)
    expected = evaluate(probs, labels)
    result = evaluate(torch.tensor(probs, device=device), torch.tensor(labels, device=device))
    for key, value in expected.items():
        assert result[key] == pytest.approx(value, abs=1e-9), key


def test_float32_and_float64_inputs_agree():
    rng = np.random.default_rng(11)
    probs = random_probs(rng, 2000, 6)
    labels = calibrated_labels(rng, probs)
    single = evaluate(probs.astype(np.float32), labels)
    double = evaluate(probs, labels)
    for key in ("ece", "mce", "brier", "nll"):
        assert single[key] == pytest.approx(double[key], abs=1e-5), key
