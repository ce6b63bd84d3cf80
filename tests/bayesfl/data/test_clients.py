"""make_clients: stratified per-client train/test splits and clear errors for unusable clients."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bayesfl.data.clients import check_training_shares, make_clients, stratified_split
from bayesfl.data.datasets import Dataset, load_dataset
from bayesfl.errors import ConfigError, DataError


@pytest.fixture(scope="module")
def digits() -> Dataset:
    return load_dataset("digits")


def toy_dataset(labels: list[int], num_classes: int | None = None) -> Dataset:
    y = torch.tensor(labels, dtype=torch.int64)
    x = torch.arange(len(labels), dtype=torch.float32).unsqueeze(1)  # x encodes the row index
    return Dataset("toy", x, y, num_classes or int(y.max()) + 1, (1,))


@pytest.mark.parametrize("scheme", ["iid", "shards:2", "dirichlet:0.3"])
def test_train_and_test_are_disjoint_and_together_cover_the_partition(digits, scheme):
    clients = make_clients(digits, 20, scheme, seed=0)
    assert [c.client_id for c in clients] == list(range(20))
    used = np.concatenate([np.concatenate([c.train_indices, c.test_indices]) for c in clients])
    assert np.array_equal(np.sort(used), np.arange(len(digits)))
    for c in clients:
        assert torch.equal(c.train_x, digits.x[c.train_indices])
        assert torch.equal(c.test_y, digits.y[c.test_indices])
        assert c.num_train >= 1 and c.num_test >= 1


@pytest.mark.parametrize("test_fraction", [0.25, 0.5, 0.1])
def test_test_label_distribution_follows_the_training_distribution(digits, test_fraction):
    clients = make_clients(digits, 20, "shards:2", seed=1, test_fraction=test_fraction)
    for c in clients:
        n_train = np.bincount(c.train_y.numpy(), minlength=10)
        n_test = np.bincount(c.test_y.numpy(), minlength=10)
        held = n_train + n_test
        total_test = max(1, round(held.sum() * test_fraction))
        assert n_test.sum() == total_test
        quota = held * total_test / held.sum()
        # each class gets the floor or the ceiling of its proportional share
        assert np.all((n_test >= np.floor(quota)) & (n_test <= np.ceil(quota)))
        assert set(np.flatnonzero(n_test)) <= set(np.flatnonzero(n_train))


def test_make_clients_is_deterministic_by_seed(digits):
    a = make_clients(digits, 10, "dirichlet:0.5", seed=3)
    b = make_clients(digits, 10, "dirichlet:0.5", seed=3)
    c = make_clients(digits, 10, "dirichlet:0.5", seed=4)
    assert all(np.array_equal(p.test_indices, q.test_indices) for p, q in zip(a, b, strict=True))
    assert not all(np.array_equal(p.test_indices, q.test_indices)
                   for p, q in zip(a, c, strict=True))


def test_per_class_regime_splits_n_per_class_into_train_and_test(digits):
    # FedSI-style: 40 per class per client on 5 classes, a quarter of it for testing
    clients = make_clients(digits, 4, "per_class:40:5", seed=0)
    for c in clients:
        assert np.bincount(c.train_y.numpy(), minlength=10).tolist().count(30) == 5
        assert np.bincount(c.test_y.numpy(), minlength=10).tolist().count(10) == 5


def test_an_empty_client_is_a_data_error():
    # class 0 has one sample but two of the four clients hold it under shards:1
    data = toy_dataset([0] + [1] * 50)
    with pytest.raises(DataError, match="fewer than 2"):
        make_clients(data, 4, "shards:1", seed=0)


def test_more_clients_than_samples_is_a_data_error():
    with pytest.raises(DataError, match="clients but only"):
        make_clients(toy_dataset([0, 1, 0, 1, 0]), 6, "iid", seed=0)


def test_a_client_that_cannot_hold_a_test_sample_is_a_data_error():
    # 5 samples for 3 clients: someone would have a single sample and no test split
    with pytest.raises(DataError, match="at least 2"):
        make_clients(toy_dataset([0, 1, 0, 1, 0]), 3, "iid", seed=0)


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1, 1.5])
def test_test_fraction_outside_the_open_unit_interval_is_a_config_error(digits, fraction):
    with pytest.raises(ConfigError, match="test_fraction"):
        make_clients(digits, 2, "iid", seed=0, test_fraction=fraction)


def test_bad_partition_is_a_config_error(digits):
    with pytest.raises(ConfigError, match="valid forms"):
        make_clients(digits, 2, "pathological", seed=0)


@settings(max_examples=80, deadline=None)
@given(labels=st.lists(st.integers(0, 4), min_size=2, max_size=80),
       fraction=st.floats(0.01, 0.99), seed=st.integers(0, 1000))
def test_property_stratified_split_is_a_partition_with_proportional_class_shares(labels,
                                                                                fraction, seed):
    y = np.array(labels)
    train, test = stratified_split(y, fraction, np.random.default_rng(seed))
    assert np.array_equal(np.sort(np.concatenate([train, test])), np.arange(len(y)))
    total_test = min(max(1, round(len(y) * fraction)), len(y) - 1)
    assert len(test) == total_test and len(train) >= 1
    classes, counts = np.unique(y, return_counts=True)
    quota = counts * total_test / len(y)
    test_counts = np.array([np.sum(y[test] == c) for c in classes])
    assert np.all((test_counts >= np.floor(quota)) & (test_counts <= np.ceil(quota)))


def test_a_test_fraction_that_starves_the_clients_is_a_config_error(digits):
    # 0.999 of 450 samples leaves one to train on for ten classes: no model learns from that
    with pytest.raises(ConfigError) as info:
        make_clients(digits, 4, "iid", seed=0, test_fraction=0.999)
    assert str(info.value) == (
        "test_fraction 0.999 leaves client 0 with 1 training sample(s) for the 10 classes it "
        "holds (450 samples, 449 for testing; 4 of 4 clients are as short), too few to learn "
        "its classes from; use test_fraction <= 0.97 (the default is 0.25)")
    # the suggested fraction is accepted, and leaves every client a sample of every class
    for c in make_clients(digits, 4, "iid", seed=0, test_fraction=0.97):
        assert set(c.train_y.tolist()) == set(range(10))


def test_a_small_client_that_cannot_spare_a_test_sample_per_class_is_accepted():
    # 3 samples of 3 classes: the one test sample takes a class's only training sample, but
    # the partition, not test_fraction, left it short (it trains on 2, more than it tests on)
    labels = np.array([0, 1, 2, 0, 1, 2])
    check_training_shares(labels, [(np.array([0, 1]), np.array([2])),
                                   (np.array([3, 4]), np.array([5]))], 0.25)
    with pytest.raises(ConfigError, match="leaves client 1 with 1 training sample"):
        check_training_shares(labels, [(np.array([0, 1]), np.array([2])),
                                       (np.array([3]), np.array([4, 5]))], 0.6)
