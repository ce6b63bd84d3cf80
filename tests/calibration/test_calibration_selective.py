"""Risk-coverage, AURC, E-AURC and accuracy at coverage against explicit loops over thresholds."""

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from calibration import (
    InvalidInputError,
    accuracy_at_coverage,
    aurc,
    e_aurc,
    optimal_aurc,
    risk_coverage,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
ORACLE_TOL = 1e-12


def random_rows(rng, n, ties):
    if ties == "none":
        confidence = rng.random(n)
    elif ties == "some":
        confidence = np.round(rng.random(n), 1)
    else:
        confidence = rng.integers(0, 3, size=n) / 2
    correct = rng.random(n) < rng.uniform(0.0, 1.0)
    return confidence, correct


def brute_force_curve(confidence, correct):
    """One point per distinct threshold, highest first: accept rows with confidence >= t."""
    points = []
    for t in sorted(set(confidence.tolist()), reverse=True):
        accepted = confidence >= t
        points.append((accepted.mean(), 1.0 - correct[accepted].mean()))
    return points


def brute_force_aurc(confidence, correct):
    area, previous = 0.0, 0.0
    for coverage, risk in brute_force_curve(confidence, correct):
        area += (coverage - previous) * risk
        previous = coverage
    return area


def geifman_aurc(confidence, correct):
    """Without ties: (1/N) sum_i risk of the i most confident rows."""
    order = np.argsort(-confidence, kind="stable")
    errors = np.cumsum(~correct[order])
    return float(np.mean(errors / np.arange(1, len(order) + 1)))


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 300),
       ties=st.sampled_from(["none", "some", "heavy"]))
def test_curve_and_aurc_equal_a_loop_over_thresholds(seed, n, ties):
    rng = np.random.default_rng(seed)
    confidence, correct = random_rows(rng, n, ties)
    coverage, risk = risk_coverage(confidence, correct)
    expected = np.array(brute_force_curve(confidence, correct))
    np.testing.assert_allclose(coverage, expected[:, 0], rtol=0, atol=ORACLE_TOL)
    np.testing.assert_allclose(risk, expected[:, 1], rtol=0, atol=ORACLE_TOL)
    assert coverage[-1] == 1.0
    assert aurc(confidence, correct) == pytest.approx(brute_force_aurc(confidence, correct),
                                                      abs=ORACLE_TOL)
    assert e_aurc(confidence, correct) >= -1e-15
    if ties == "none" and len(set(confidence.tolist())) == n:
        assert aurc(confidence, correct) == pytest.approx(geifman_aurc(confidence, correct),
                                                          abs=ORACLE_TOL)


@pytest.mark.parametrize("n", range(1, 8))
def test_optimal_aurc_is_the_minimum_over_every_strict_ranking(n):
    for n_errors in range(n + 1):
        correct = np.r_[np.ones(n - n_errors, bool), np.zeros(n_errors, bool)]
        best = min(geifman_aurc(-np.array(order, float), correct)
                   for order in itertools.permutations(range(n)))
        assert optimal_aurc(n, n_errors) == pytest.approx(best, abs=ORACLE_TOL)
        # a confidence ranking every correct row strictly first has E-AURC 0
        assert e_aurc(np.arange(n, 0, -1) * 1.0, correct) == pytest.approx(0.0, abs=ORACLE_TOL)


def test_optimal_aurc_approaches_its_large_n_limit():
    r = 0.2
    assert optimal_aurc(100_000, 20_000) == pytest.approx(r + (1 - r) * np.log(1 - r), abs=1e-5)


def test_ties_are_accepted_together():
    confidence = np.array([0.9, 0.9, 0.9, 0.5])
    correct = np.array([True, False, True, True])
    coverage, risk = risk_coverage(confidence, correct)
    np.testing.assert_array_equal(coverage, [0.75, 1.0])
    np.testing.assert_allclose(risk, [1 / 3, 1 / 4], atol=ORACLE_TOL)
    assert aurc(confidence, correct) == pytest.approx(0.75 / 3 + 0.25 / 4, abs=ORACLE_TOL)
    # any coverage up to 0.75 needs the whole tie group
    assert accuracy_at_coverage(confidence, correct, 0.1) == pytest.approx(2 / 3)
    assert accuracy_at_coverage(confidence, correct, 0.75) == pytest.approx(2 / 3)
    assert accuracy_at_coverage(confidence, correct, 0.76) == 0.75
    # row order does not matter
    order = [3, 1, 0, 2]
    assert aurc(confidence[order], correct[order]) == aurc(confidence, correct)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 200),
       ties=st.sampled_from(["none", "some", "heavy"]), target=st.floats(0.01, 1.0))
def test_accuracy_at_coverage_equals_a_loop(seed, n, ties, target):
    rng = np.random.default_rng(seed)
    confidence, correct = random_rows(rng, n, ties)
    for t in sorted(set(confidence.tolist()), reverse=True):
        accepted = confidence >= t
        if accepted.sum() / n >= target:
            expected = correct[accepted].mean()
            break
    assert accuracy_at_coverage(confidence, correct, target) == pytest.approx(expected,
                                                                             abs=ORACLE_TOL)


@pytest.mark.parametrize("device", DEVICES)
def test_probabilities_and_labels_equal_confidence_and_correctness(device):
    rng = np.random.default_rng(4)
    probs = rng.dirichlet(np.ones(6) * 0.5, size=300)
    probs[:40] = probs[0]  # a block of tied rows
    labels = rng.integers(0, 6, size=300)
    confidence, correct = probs.max(1), probs.argmax(1) == labels
    p = torch.tensor(probs, device=device)
    y = torch.tensor(labels, device=device)
    for got, want in zip(risk_coverage(p, y), risk_coverage(confidence, correct), strict=True):
        np.testing.assert_array_equal(got, want)
    assert aurc(p, y) == aurc(confidence, correct)
    assert e_aurc(p, y) == e_aurc(confidence, correct)
    assert accuracy_at_coverage(p, y, 0.5) == accuracy_at_coverage(confidence, correct, 0.5)
    # logits when told so, and a confidence of the caller's choice for the ranking
    assert aurc(np.log(probs), labels, from_logits=True) == pytest.approx(aurc(probs, labels),
                                                                          abs=ORACLE_TOL)
    other = rng.random(300)
    assert aurc(probs, labels, confidence=other) == aurc(other, correct)


@pytest.mark.parametrize("args, kwargs, match", [
    (([], []), {}, "empty"),
    (([0.5, float("nan")], [1, 0]), {}, "NaN or Inf"),
    (([0.5, 0.2], [1, 0, 1]), {}, "shape"),
    (([0.5, 0.2], [1, 2]), {}, "correct"),
    (([[0.5, 0.6]] * 2, [0, 1]), {}, "sum to 1"),
    (([[0.5, 0.5]] * 2, [0, 1, 1]), {}, "shape mismatch"),
    (([[0.5, 0.5]] * 2, [0, 1]), {"confidence": [0.1]}, "shape mismatch"),
    (([0.5, 0.2], [1, 0]), {"confidence": [0.1, 0.2]}, "confidence="),
    ((np.zeros((2, 2, 2)), [1, 0]), {}, "shape"),
])
def test_invalid_inputs_say_what_to_do(args, kwargs, match):
    for metric in (risk_coverage, aurc, e_aurc, accuracy_at_coverage):
        with pytest.raises(InvalidInputError, match=match):
            metric(*args, **kwargs)


def test_invalid_coverage():
    for bad in (0.0, 1.5, "half", True):
        with pytest.raises(InvalidInputError, match="coverage"):
            accuracy_at_coverage([0.5, 0.2], [1, 0], bad)
