"""SufficientStatistics: the fused statistics pass, exact addition, validation, transport."""

import functools
import io
import itertools
import math
import operator

import pytest
import torch

from inference.conjugate.statistics import SufficientStatistics
from inference.errors import InvalidInputError
from tests.devices import DEVICES


def batch(B=50, m=4, C=3, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, m, generator=g).to(dtype), torch.randint(0, C, (B,), generator=g)


def loop_reference(features, labels, C):
    """Naive per-sample accumulation of [1, phi] into row y (float64)."""
    table = torch.zeros(C, features.shape[1] + 1, dtype=torch.float64)
    for phi, y in zip(features.double(), labels.tolist(), strict=True):
        table[y, 0] += 1.0
        table[y, 1:] += phi
    return table


@pytest.mark.parametrize("device", DEVICES)
def test_table_holds_counts_then_class_feature_sums(device):
    x, y = batch()
    stats = SufficientStatistics.from_features(x.to(device), y.to(device), num_classes=5)
    assert stats.table.device.type == device
    assert stats.table.dtype == torch.float64
    assert stats.table.shape == (5, 5)
    assert (stats.num_classes, stats.feature_dim, stats.n, stats.privatized) == (5, 4, 50, False)
    torch.testing.assert_close(stats.table.cpu(), loop_reference(x, y, 5), rtol=1e-12, atol=1e-12)
    assert torch.equal(stats.class_counts.cpu(), torch.bincount(y, minlength=5).double())
    stats.validate()


def test_statistics_of_a_union_equal_the_sum_of_the_parts():
    x, y = batch(B=200, seed=1)
    whole = SufficientStatistics.from_features(x, y, 3)
    parts = SufficientStatistics.from_features(x[:70], y[:70], 3) + \
        SufficientStatistics.from_features(x[70:], y[70:], 3)
    torch.testing.assert_close(parts.table, whole.table, rtol=1e-13, atol=1e-13)
    assert parts.n == whole.n == 200


def test_sums_are_bitwise_independent_of_order_and_grouping():
    # Values spread over 12 orders of magnitude make plain float64 addition order-dependent.
    g = torch.Generator().manual_seed(2)
    clients = []
    for i in range(6):
        x = torch.randn(20, 3, generator=g, dtype=torch.float64) * 10.0 ** (3 * (i % 5) - 6)
        y = torch.randint(0, 2, (20,), generator=g)
        clients.append(SufficientStatistics.from_features(x, y, 2))
    reference = sum(clients)
    for order in itertools.islice(itertools.permutations(clients), 0, 720, 37):
        assert torch.equal(sum(order).table, reference.table)
    grouped = (clients[0] + (clients[1] + clients[2])) + ((clients[3] + clients[4]) + clients[5])
    assert torch.equal(grouped.table, reference.table)
    assert torch.equal(SufficientStatistics.sum(clients).table, reference.table)
    naive = [sum((c.table for c in order), torch.zeros(2, 4, dtype=torch.float64))
             for order in itertools.permutations(clients)]
    assert any(not torch.equal(a, naive[0]) for a in naive)  # the property is not vacuous


def test_zero_is_the_neutral_element_for_python_sum():
    x, y = batch()
    stats = SufficientStatistics.from_features(x, y, 3)
    assert (0 + stats) is stats
    empty = SufficientStatistics.zeros(3, 4)
    assert torch.equal((empty + stats).table, stats.table)


def test_adding_statistics_of_different_shapes_is_rejected():
    a = SufficientStatistics.from_features(*batch(m=4), 3)
    b = SufficientStatistics.from_features(*batch(m=5), 3)
    with pytest.raises(InvalidInputError, match="shapes"):
        _ = a + b


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_features_are_rejected(bad):
    x, y = batch()
    x[3, 1] = bad
    with pytest.raises(InvalidInputError, match="NaN or Inf"):
        SufficientStatistics.from_features(x, y, 3)


@pytest.mark.parametrize("label", [-1, 3])
def test_labels_outside_the_class_range_are_rejected(label):
    x, y = batch()
    y[0] = label
    with pytest.raises(InvalidInputError, match=r"\[0, 3\)"):
        SufficientStatistics.from_features(x, y, 3)


def test_non_integer_labels_are_rejected():
    x, y = batch()
    with pytest.raises(InvalidInputError, match="integer"):
        SufficientStatistics.from_features(x, y.float(), 3)


def test_an_empty_batch_is_rejected():
    with pytest.raises(InvalidInputError, match="empty"):
        SufficientStatistics.from_features(torch.zeros(0, 4), torch.zeros(0, dtype=torch.int64), 3)


def test_mismatched_batch_sizes_are_rejected():
    x, y = batch()
    with pytest.raises(InvalidInputError, match="labels"):
        SufficientStatistics.from_features(x, y[:-1], 3)


def test_a_bias_column_that_disagrees_with_the_count_fails_validation():
    stats = SufficientStatistics.from_features(*batch(), 3)
    wrong_total = SufficientStatistics(table=stats.table, n=stats.n + 1)
    with pytest.raises(InvalidInputError, match="counts disagree"):
        wrong_total.validate()
    fractional = stats.table.clone()
    fractional[0, 0] += 0.5
    with pytest.raises(InvalidInputError, match="integer"):
        SufficientStatistics(table=fractional, n=stats.n).validate()


def test_privatised_statistics_skip_the_count_check_but_not_finiteness():
    stats = SufficientStatistics.from_features(*batch(), 3)
    noisy = stats.table + 0.3
    SufficientStatistics(table=noisy, n=stats.n, privatized=True).validate()
    noisy[0, 1] = math.nan
    with pytest.raises(InvalidInputError, match="NaN"):
        SufficientStatistics(table=noisy, n=stats.n, privatized=True).validate()


def test_state_dict_round_trips_through_weights_only_load():
    a = SufficientStatistics.from_features(*batch(seed=3), 3)
    b = SufficientStatistics.from_features(*batch(seed=4), 3)
    client_state = a.state_dict()
    assert set(client_state) == {"table", "count", "privatized"}  # C (m + 1) floats + count
    total = a + b
    buffer = io.BytesIO()
    torch.save(total.state_dict(), buffer)
    buffer.seek(0)
    restored = SufficientStatistics.from_state_dict(torch.load(buffer, weights_only=True))
    assert torch.equal(restored.table, total.table)
    assert torch.equal(restored.low, total.low)
    assert restored.n == total.n and restored.privatized == total.privatized


def test_from_state_dict_rejects_missing_keys_and_bad_counts():
    state = SufficientStatistics.from_features(*batch(), 3).state_dict()
    with pytest.raises(InvalidInputError, match="lacks"):
        SufficientStatistics.from_state_dict({"table": state["table"]})
    state["count"] = torch.tensor(7)
    with pytest.raises(InvalidInputError, match="disagree"):
        SufficientStatistics.from_state_dict(state)


@pytest.mark.parametrize("device", DEVICES)
def test_to_moves_a_copy(device):
    stats = SufficientStatistics.from_features(*batch(), 3)
    moved = stats.to(device)
    assert moved.table.device.type == device and stats.table.device.type == "cpu"
    assert torch.equal(moved.table.cpu(), stats.table)


@pytest.mark.parametrize("k", [1, 2, 5, 64, 333])
def test_sum_of_stacked_tables_is_the_correctly_rounded_exact_sum(k):
    g = torch.Generator().manual_seed(k)
    tables = torch.randn(k, 3, 5, generator=g, dtype=torch.float64) * torch.logspace(
        -8, 8, 5, dtype=torch.float64
    )
    stacked = SufficientStatistics.sum_tables(tables, 2 * k)
    one_by_one = functools.reduce(operator.add, (SufficientStatistics(t, 2) for t in tables))
    pairwise = SufficientStatistics.sum(SufficientStatistics(t, 2) for t in tables)
    exact = torch.tensor(
        [[math.fsum(tables[:, i, j].tolist()) for j in range(5)] for i in range(3)],
        dtype=torch.float64,
    )  # math.fsum: the correctly rounded sum, an independent reference
    assert stacked.n == one_by_one.n == pairwise.n == 2 * k
    for total in (stacked, one_by_one, pairwise):
        assert torch.equal(total.table, exact)
