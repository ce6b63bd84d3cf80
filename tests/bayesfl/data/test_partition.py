"""Partitions: every sample assigned once, class constraints, determinism, Dirichlet robustness."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bayesfl.data.partition import (
    PARTITION_SCHEMES,
    PartitionScheme,
    _largest_remainder,
    _log_dirichlet,
    assign_classes,
    format_partition_summary,
    partition,
    partition_summary,
)
from bayesfl.errors import ConfigError, DataError


@pytest.fixture(scope="module")
def digits_labels() -> np.ndarray:
    from sklearn.datasets import load_digits

    return load_digits().target.astype(np.int64)


def assert_exact_cover(parts: list[np.ndarray], n: int) -> None:
    for p in parts:
        assert p.dtype == np.int64
        assert np.all(np.diff(p) > 0), "indices must be sorted and unique"
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(n))


def classes_of(labels: np.ndarray, part: np.ndarray) -> set[int]:
    return set(np.unique(labels[part]).tolist())


@pytest.mark.parametrize("scheme", ["iid", "dirichlet:0.1", "dirichlet:1000", "shards:2",
                                    "shards:3", "shards:10"])
def test_every_sample_is_assigned_exactly_once(digits_labels, scheme):
    parts = partition(digits_labels, 20, scheme, seed=0)
    assert len(parts) == 20
    assert all(len(p) > 0 for p in parts)
    assert_exact_cover(parts, len(digits_labels))


def test_iid_sizes_differ_by_at_most_one(digits_labels):
    sizes = [len(p) for p in partition(digits_labels, 7, "iid", seed=3)]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize(("num_clients", "k"), [(20, 2), (50, 2), (30, 3), (7, 5), (10, 10)])
def test_shards_give_each_client_exactly_k_classes_with_balanced_slots(digits_labels,
                                                                       num_clients, k):
    parts = partition(digits_labels, num_clients, f"shards:{k}", seed=1)
    assert [len(classes_of(digits_labels, p)) for p in parts] == [k] * num_clients
    holders = np.zeros(10, dtype=int)
    for p in parts:
        holders[list(classes_of(digits_labels, p))] += 1
    assert holders.sum() == num_clients * k
    assert holders.max() - holders.min() <= 1


def test_shards_give_at_most_k_classes_when_a_class_is_too_small_to_share():
    # class 0 has a single sample but two clients hold it: one of them ends with fewer classes
    labels = np.array([0] + [1] * 40 + [2] * 40 + [3] * 40)
    parts = partition(labels, 4, "shards:2", seed=0)
    counts = [len(classes_of(labels, p)) for p in parts]
    assert max(counts) <= 2
    assert sorted(counts) == [1, 2, 2, 2]
    assert_exact_cover(parts, len(labels))


def test_shards_within_a_class_are_nearly_equal(digits_labels):
    parts = partition(digits_labels, 20, "shards:2", seed=0)
    counts = partition_summary(digits_labels, parts, 10)
    for c in range(10):
        held = counts[:, c][counts[:, c] > 0]
        assert held.max() - held.min() <= 1


def test_shards_reject_more_classes_per_client_than_exist(digits_labels):
    with pytest.raises(DataError, match="only 10 classes"):
        partition(digits_labels, 20, "shards:11", seed=0)


def test_shards_reject_too_few_slots_to_cover_every_class(digits_labels):
    with pytest.raises(DataError, match="class slots"):
        partition(digits_labels, 4, "shards:2", seed=0)


@pytest.mark.parametrize(("scheme", "n", "k"), [("per_class:20", 20, 10), ("per_class:30:5", 30, 5),
                                                 ("per_class:1:1", 1, 1)])
def test_per_class_gives_n_samples_of_each_of_k_classes(digits_labels, scheme, n, k):
    parts = partition(digits_labels, 8, scheme, seed=2)
    counts = partition_summary(digits_labels, parts, 10)
    assert np.all((counts == 0) | (counts == n))
    assert np.all((counts > 0).sum(axis=1) == k)
    all_indices = np.concatenate(parts)
    assert len(np.unique(all_indices)) == len(all_indices), "a sample went to two clients"


def test_per_class_reports_when_a_class_has_too_few_samples(digits_labels):
    with pytest.raises(DataError, match="per_class:100 needs"):
        partition(digits_labels, 10, "per_class:100", seed=0)


@pytest.mark.parametrize("scheme", ["iid", "dirichlet:0.5", "shards:2", "per_class:10:3"])
def test_partition_is_deterministic_given_a_seed_and_differs_across_seeds(digits_labels, scheme):
    first = partition(digits_labels, 15, scheme, seed=7)
    again = partition(digits_labels, 15, scheme, seed=7)
    other = partition(digits_labels, 15, scheme, seed=8)
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(first, other, strict=True))


def test_torch_and_numpy_labels_give_the_same_partition(digits_labels):
    from_numpy = partition(digits_labels, 9, "dirichlet:0.3", seed=0)
    from_torch = partition(torch.from_numpy(digits_labels), 9, "dirichlet:0.3", seed=0)
    assert all(np.array_equal(a, b) for a, b in zip(from_numpy, from_torch, strict=True))


@pytest.mark.parametrize("alpha", [1e-3, 1e-6, 1e-12])
def test_dirichlet_with_tiny_alpha_and_many_clients_leaves_no_client_empty(alpha):
    # 300 clients for 600 samples in 10 classes: most draws put a whole class on one client,
    # which is where other partitioners produce NaN proportions or empty clients
    labels = np.repeat(np.arange(10), 60)
    parts = partition(labels, 300, f"dirichlet:{alpha}", seed=0)
    assert min(len(p) for p in parts) >= 1
    assert_exact_cover(parts, len(labels))


def test_dirichlet_respects_min_samples_by_topping_up_small_clients():
    labels = np.repeat(np.arange(5), 40)
    parts = partition(labels, 50, "dirichlet:0.001", seed=4, min_samples=3)
    assert min(len(p) for p in parts) >= 3
    assert_exact_cover(parts, len(labels))


def test_dirichlet_skew_grows_as_alpha_shrinks(digits_labels):
    def mean_classes(alpha: float) -> float:
        parts = partition(digits_labels, 20, f"dirichlet:{alpha}", seed=0)
        return float(np.mean([len(classes_of(digits_labels, p)) for p in parts]))

    assert mean_classes(0.05) < mean_classes(1.0) < mean_classes(1000.0)
    assert mean_classes(1000.0) == 10.0


def test_log_space_dirichlet_matches_numpy_dirichlet_moments():
    # reference: numpy's own Dirichlet sampler; 20k draws, tolerance 0.01 on means and
    # 10% relative on variances (Monte Carlo error is about 2% here)
    alpha, size, draws = 0.3, 5, 20_000
    rng = np.random.default_rng(0)
    ours = np.stack([_log_dirichlet(alpha, size, rng) for _ in range(draws)])
    reference = np.random.default_rng(1).dirichlet(np.full(size, alpha), size=draws)
    exact_variance = (1 / size) * (1 - 1 / size) / (size * alpha + 1)
    np.testing.assert_allclose(ours.mean(axis=0), 1 / size, atol=0.01)
    np.testing.assert_allclose(ours.var(axis=0), reference.var(axis=0), rtol=0.1)
    np.testing.assert_allclose(ours.var(axis=0), exact_variance, rtol=0.1)


@pytest.mark.parametrize("alpha", [1e-300, 1e-9, 1.0, 1e12])
def test_log_space_dirichlet_is_finite_and_sums_to_one_for_extreme_alpha(alpha):
    p = _log_dirichlet(alpha, 1000, np.random.default_rng(0))
    assert np.all(np.isfinite(p)) and np.all(p >= 0)
    assert abs(p.sum() - 1.0) < 1e-12


def test_largest_remainder_sums_to_total_and_stays_within_one_of_the_quota():
    proportions = np.array([0.333, 0.333, 0.334, 0.0])
    counts = _largest_remainder(proportions, 10)
    assert counts.sum() == 10
    assert np.all(np.abs(counts - proportions * 10) < 1)


def test_assign_classes_gives_distinct_balanced_classes():
    sets = assign_classes(np.arange(10), 23, 4, np.random.default_rng(0))
    assert all(len(set(s.tolist())) == 4 for s in sets)
    usage = np.bincount(np.concatenate(sets), minlength=10)
    assert usage.max() - usage.min() <= 1


def test_more_clients_than_samples_is_a_data_error():
    with pytest.raises(DataError, match="5 clients but only 4 samples"):
        partition(np.array([0, 1, 0, 1]), 5, "iid", seed=0)


@pytest.mark.parametrize("labels", [np.zeros((3, 2), dtype=int), np.array([0.5, 1.0]),
                                    np.array([-1, 0, 1])])
def test_malformed_labels_are_a_data_error(labels):
    with pytest.raises(DataError):
        partition(labels, 1, "iid", seed=0)


@pytest.mark.parametrize("text", ["iid", "dirichlet:0.5", "shards:2", "per_class:50",
                                  "per_class:50:5"])
def test_scheme_strings_parse_and_print_back(text):
    assert str(PartitionScheme.parse(text)) == text


@pytest.mark.parametrize("text", ["", "random", "iid:2", "dirichlet", "dirichlet:0",
                                  "dirichlet:-1", "dirichlet:nan", "dirichlet:inf", "shards:0",
                                  "shards:two", "shards:1.5", "per_class:", "per_class:5:0",
                                  "per_class:1:2:3"])
def test_bad_scheme_is_a_config_error_listing_valid_forms(text):
    with pytest.raises(ConfigError) as info:
        partition(np.arange(10) % 2, 2, text, seed=0)
    for form in PARTITION_SCHEMES.values():
        assert form in str(info.value)


def test_partition_summary_counts_match_a_direct_count(digits_labels):
    parts = partition(digits_labels, 6, "dirichlet:0.5", seed=0)
    counts = partition_summary(digits_labels, parts, 10)
    for i, p in enumerate(parts):
        for c in range(10):
            assert counts[i, c] == sum(1 for j in p if digits_labels[j] == c)
    assert counts.sum() == len(digits_labels)


def test_formatted_summary_lists_each_client_and_the_totals(digits_labels):
    parts = partition(digits_labels, 3, "shards:4", seed=0)
    text = format_partition_summary(digits_labels, parts, 10)
    lines = text.splitlines()
    assert len(lines) == 1 + 3 + 1
    assert lines[0].split()[:3] == ["client", "c0", "c1"]
    assert lines[-1].split()[0] == "total" and lines[-1].split()[-1] == str(len(digits_labels))
    assert lines[1].split()[-1] == "4"  # classes held by client 0


def test_formatted_summary_elides_clients_beyond_the_limit(digits_labels):
    parts = partition(digits_labels, 30, "iid", seed=0)
    text = format_partition_summary(digits_labels, parts, 10, max_clients=5)
    assert "... 25 more clients" in text


@settings(max_examples=60, deadline=None)
@given(
    labels=st.lists(st.integers(0, 5), min_size=1, max_size=120),
    num_clients=st.integers(1, 12),
    scheme=st.sampled_from(["iid", "dirichlet:0.01", "dirichlet:1", "shards:1", "shards:2"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_property_partitions_cover_every_sample_once_or_refuse_clearly(labels, num_clients,
                                                                       scheme, seed):
    y = np.array(labels)
    try:
        parts = partition(y, num_clients, scheme, seed=seed)
    except DataError:
        # refusals are legitimate only for these reasons
        too_many_clients = num_clients > len(y)
        k = int(scheme.split(":")[1]) if scheme.startswith("shards") else 0
        classes, class_sizes = np.unique(y, return_counts=True)
        most_holders = -(-num_clients * k // len(classes))
        shards_impossible = k > 0 and (k > len(classes) or num_clients * k < len(classes)
                                       or class_sizes.min() < most_holders)
        assert too_many_clients or shards_impossible
        return
    assert len(parts) == num_clients and all(len(p) >= 1 for p in parts)
    assert_exact_cover(parts, len(y))
    if scheme.startswith("shards"):
        k = int(scheme.split(":")[1])
        assert all(len(classes_of(y, p)) <= k for p in parts)


@pytest.mark.parametrize("num_clients", [0, -3, 2.5])
def test_a_non_positive_or_fractional_client_count_is_a_config_error(num_clients):
    with pytest.raises(ConfigError, match="num_clients"):
        partition(np.arange(10) % 2, num_clients, "iid", seed=0)


# ---- labels:K (FedSI's sliding window) --------------------------------------------------------
def test_labels_5_gives_each_label_to_exactly_5_of_10_clients_in_a_sliding_window(digits_labels):
    parts = partition(digits_labels, 10, "labels:5", seed=0)
    assert_exact_cover(parts, len(digits_labels))
    for u, part in enumerate(parts):
        assert classes_of(digits_labels, part) == {(u + j) % 10 for j in range(5)}
    holders = (partition_summary(digits_labels, parts, 10) > 0).sum(axis=0)
    assert holders.tolist() == [5] * 10


def test_labels_with_train_n_fixes_n_training_samples_per_class_per_client(digits_labels):
    from bayesfl.data.partition import fixed_split

    pairs = fixed_split(digits_labels, 10, "labels:5:train=10", seed=3)
    used = np.concatenate([np.concatenate(p) for p in pairs])
    assert len(np.unique(used)) == len(used), "a sample went to two places"
    for u, (train, test) in enumerate(pairs):
        window = [(u + j) % 10 for j in range(5)]
        train_counts = np.bincount(digits_labels[train], minlength=10)
        assert all(train_counts[c] == 10 for c in window)
        assert train_counts.sum() == 50
        assert set(np.unique(digits_labels[test]).tolist()) == set(window)
    # the rest of every class is shared out as test samples: nothing is left unused
    assert len(used) == len(digits_labels)
    # test=M caps the test share per class per client
    capped = fixed_split(digits_labels, 10, "labels:5:train=10:test=4", seed=3)
    assert all(np.bincount(digits_labels[te], minlength=10).max() == 4 for _, te in capped)
    assert [tr.tolist() for tr, _ in capped] == [tr.tolist() for tr, _ in pairs]


def test_labels_random_draws_balanced_label_sets_instead_of_the_window(digits_labels):
    parts = partition(digits_labels, 10, "labels:5:random", seed=1)
    sets = [classes_of(digits_labels, p) for p in parts]
    assert all(len(s) == 5 for s in sets)
    assert sets != [{(u + j) % 10 for j in range(5)} for u in range(10)]
    holders = (partition_summary(digits_labels, parts, 10) > 0).sum(axis=0)
    assert holders.tolist() == [5] * 10


def test_labels_refuses_more_training_samples_than_a_class_holds(digits_labels):
    # digits has 174..183 samples per class; 5 holders x 36 = 180 leaves some class no test
    with pytest.raises(DataError, match="train=N"):
        partition(digits_labels, 10, "labels:5:train=36", seed=0)
    with pytest.raises(DataError, match="at most 10"):
        partition(digits_labels, 10, "labels:11", seed=0)


@pytest.mark.parametrize("text", ["labels:5", "labels:5:train=50", "labels:5:train=50:test=20",
                                  "labels:3:random", "labels:5:train=50:random"])
def test_labels_scheme_strings_parse_and_print_back(text):
    assert str(PartitionScheme.parse(text)) == text


@pytest.mark.parametrize("text", ["labels", "labels:0", "labels:5:train=0", "labels:5:test=5",
                                  "labels:5:train=5:train=6", "labels:5:size=3",
                                  "labels:5:random:random"])
def test_malformed_labels_scheme_is_a_config_error(text):
    with pytest.raises(ConfigError, match="labels:K"):
        PartitionScheme.parse(text)
