"""Seeded bootstrap intervals for the ECE."""

import numpy as np
import pytest
import torch
from calibration_reference import calibrated_labels, random_probs

from calibration.bootstrap import bootstrap_ece
from calibration.errors import InvalidInputError
from calibration.metrics import ece


def data(seed=0, n=400):
    rng = np.random.default_rng(seed)
    probs = random_probs(rng, n, 5)
    return probs, calibrated_labels(rng, probs ** 0.7)


def test_same_seed_reproduces_the_interval_and_another_seed_changes_it():
    probs, labels = data()
    first = bootstrap_ece(probs, labels, n_boot=200, seed=3)
    assert bootstrap_ece(probs, labels, n_boot=200, seed=3) == first
    assert bootstrap_ece(probs, labels, n_boot=200, seed=4) != first


def test_interval_equals_a_loop_of_ece_calls_on_the_same_resamples():
    probs, labels = data(1, 150)
    n_boot, alpha, seed = 60, 0.1, 7
    generator = torch.Generator().manual_seed(seed)
    draws = torch.randint(0, 150, (n_boot, 150), generator=generator).numpy()
    replicates = [ece(probs[d], labels[d]) for d in draws]
    estimate, low, high = bootstrap_ece(probs, labels, n_boot=n_boot, alpha=alpha, seed=seed)
    assert estimate == pytest.approx(ece(probs, labels), abs=1e-15)
    assert low == pytest.approx(np.quantile(replicates, alpha / 2), abs=1e-12)
    assert high == pytest.approx(np.quantile(replicates, 1 - alpha / 2), abs=1e-12)


def test_interval_is_ordered_and_inside_the_unit_interval():
    result = bootstrap_ece(*data(2), n_boot=300)
    assert 0.0 <= result.low <= result.high <= 1.0
    assert result.low <= result.estimate <= result.high


@pytest.mark.parametrize("kwargs", [{"n_boot": 0}, {"alpha": 0.0}, {"alpha": 1.5}])
def test_bad_bootstrap_settings_are_refused(kwargs):
    with pytest.raises(InvalidInputError):
        bootstrap_ece(*data(), **kwargs)


@pytest.mark.parametrize("seed", [-1, -(2**63), 2**63, 2**64 - 1])
def test_a_seed_outside_0_to_2_63_is_refused_as_run_seeds_are(seed):
    # torch would take -1 as 2**64 - 1: two spellings of one stream, and a typo unnoticed
    with pytest.raises(InvalidInputError, match=r"seed must be an integer in \[0, 2\*\*63\).*"
                                                rf"got {seed}$"):
        bootstrap_ece(*data(), n_boot=10, seed=seed)
    assert bootstrap_ece(*data(), n_boot=10, seed=2**63 - 1).low >= 0.0  # the largest accepted
