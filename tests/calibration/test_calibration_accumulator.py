"""Mergeable accumulators: merging client states gives the pooled metrics (property tests)."""

import numpy as np
import pytest
import torch
from calibration_reference import calibrated_labels, random_probs
from hypothesis import given, settings
from hypothesis import strategies as st

from calibration.accumulator import Accumulator
from calibration.errors import InvalidInputError
from calibration.metrics import ece, evaluate, mce

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
MERGE_TOL = 1e-12  # float64 sums added in a different order


def dataset(seed, n, k, one_hot_rows=0):
    rng = np.random.default_rng(seed)
    probs = random_probs(rng, n, k, scale=float(rng.uniform(0.5, 4)))
    probs[:one_hot_rows] = np.eye(k)[rng.integers(0, k, min(one_hot_rows, n))]
    return probs, calibrated_labels(rng, probs ** float(rng.uniform(0.4, 2.0)))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(2, 300), k=st.integers(2, 6),
       parts=st.integers(1, 5), n_bins=st.integers(1, 20), one_hot=st.integers(0, 5))
def test_merging_accumulators_of_a_random_split_equals_the_pooled_metrics(
        seed, n, k, parts, n_bins, one_hot):
    probs, labels = dataset(seed, n, k, one_hot)
    rng = np.random.default_rng(seed + 1)
    assignment = rng.integers(0, parts, n)
    clients = [Accumulator(n_bins).update(probs[assignment == p], labels[assignment == p])
               for p in range(parts) if np.any(assignment == p)]
    pooled = evaluate(probs, labels, n_bins)
    for merged in (Accumulator.merged(clients), sum(clients), clients[0].merge(
            Accumulator.merged(clients[1:])) if len(clients) > 1 else clients[0]):
        result = merged.compute()
        assert result["count"] == pooled["count"]
        for key in ("accuracy", "ece", "mce", "brier", "nll"):
            assert result[key] == pytest.approx(pooled[key], abs=MERGE_TOL), key


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 200), k=st.integers(2, 8),
       n_bins=st.integers(1, 30), quantile=st.booleans(), one_hot=st.integers(0, 3))
def test_ece_and_mce_lie_in_the_unit_interval(seed, n, k, n_bins, quantile, one_hot):
    probs, labels = dataset(seed, n, k, one_hot)
    binning = "quantile" if quantile else "uniform"
    assert 0.0 <= ece(probs, labels, n_bins, binning) <= 1.0
    assert 0.0 <= mce(probs, labels, n_bins, binning) <= 1.0
    assert ece(probs, labels, n_bins, binning) <= mce(probs, labels, n_bins, binning) + 1e-12


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 200), k=st.integers(2, 6),
       quantile=st.booleans())
def test_permuting_samples_changes_nothing(seed, n, k, quantile):
    probs, labels = dataset(seed, n, k)
    order = np.random.default_rng(seed).permutation(n)
    binning = "quantile" if quantile else "uniform"
    before = evaluate(probs, labels, binning=binning)
    after = evaluate(probs[order], labels[order], binning=binning)
    for key, value in before.items():
        assert after[key] == pytest.approx(value, abs=1e-12), key


def test_streaming_updates_equal_one_batch():
    probs, labels = dataset(0, 500, 5)
    streamed = Accumulator(15)
    for start in range(0, 500, 64):
        streamed.update(probs[start:start + 64], labels[start:start + 64])
    whole = evaluate(probs, labels)
    for key, value in streamed.compute().items():
        assert value == pytest.approx(whole[key], abs=MERGE_TOL), key


def test_merge_returns_a_new_object_and_leaves_inputs_unchanged():
    a = Accumulator(10).update(*dataset(1, 50, 3))
    b = Accumulator(10).update(*dataset(2, 70, 3))
    before = a.compute()
    merged = a.merge(b)
    assert merged is not a and merged is not b
    assert a.compute() == before and merged.count == 120


def test_state_dict_round_trip_holds_tensors_only():
    acc = Accumulator(12).update(*dataset(3, 100, 4))
    state = acc.state_dict()
    assert all(isinstance(v, torch.Tensor) for v in state.values())
    restored = Accumulator.from_state_dict({k: v.numpy() for k, v in state.items()})
    assert restored.n_bins == 12 and restored.compute() == acc.compute()


@pytest.mark.parametrize("corrupt", ["missing", "negative", "nan", "inconsistent", "shape"])
def test_corrupt_state_dicts_are_refused(corrupt):
    state = Accumulator(5).update(*dataset(4, 40, 3)).state_dict()
    if corrupt == "missing":
        del state["nll_sum"]
    elif corrupt == "negative":
        state["bin_counts"][0] = -1
    elif corrupt == "nan":
        state["brier_sum"] = torch.tensor(float("nan"), dtype=torch.float64)
    elif corrupt == "inconsistent":
        state["bin_correct_counts"] = state["bin_counts"] + 1
    else:
        state["bin_confidence_sums"] = torch.zeros(4, dtype=torch.float64)
    with pytest.raises(InvalidInputError):
        Accumulator.from_state_dict(state)


def test_merging_different_bin_counts_is_refused():
    with pytest.raises(InvalidInputError, match="bins"):
        Accumulator(5).merge(Accumulator(6))


def test_computing_an_empty_accumulator_is_refused():
    with pytest.raises(InvalidInputError, match="empty"):
        Accumulator().compute()


@pytest.mark.parametrize("device", DEVICES)
def test_accumulator_state_stays_on_the_input_device(device):
    probs, labels = dataset(5, 80, 4)
    acc = Accumulator(8).update(torch.tensor(probs, device=device),
                                torch.tensor(labels, device=device))
    assert all(t.device.type == device for t in acc.state_dict().values())
    assert acc.compute()["ece"] == pytest.approx(ece(probs, labels, 8), abs=1e-12)


def test_per_group_accumulators_equal_one_update_per_group():
    g = torch.Generator().manual_seed(0)
    sizes = [int(s) for s in torch.randint(1, 25, (40,), generator=g)]
    n = sum(sizes)
    probs = torch.softmax(3 * torch.randn(n, 7, generator=g, dtype=torch.float64), dim=1)
    probs[:6] = 1 / 7  # ties: the first maximal class is the prediction
    probs[6, :] = 0.0
    probs[6, 2] = 1.0  # confidence exactly 1 lands in the last bin
    labels = torch.randint(0, 7, (n,), generator=g)
    groups = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    for n_bins in (1, 10, 15):
        together = Accumulator.per_group(probs, labels, groups, len(sizes), n_bins=n_bins)
        start = 0
        for acc, size in zip(together, sizes, strict=True):
            alone = Accumulator(n_bins).update(probs[start:start + size],
                                               labels[start:start + size])
            start += size
            want, got = alone.state_dict(), acc.state_dict()
            for key in ("bin_counts", "bin_correct_counts"):  # integers: exact
                assert torch.equal(got[key], want[key])
            for key in ("bin_confidence_sums", "brier_sum", "nll_sum"):  # summation order only
                torch.testing.assert_close(got[key], want[key], rtol=1e-13, atol=1e-15)
        # compute_each is compute, vectorised; merged is the pooled data's metrics
        for got, acc in zip(Accumulator.compute_each(together), together, strict=True):
            assert got == pytest.approx(acc.compute(), rel=1e-12, abs=1e-15)
        pooled = Accumulator(n_bins).update(probs, labels).compute()
        assert Accumulator.merged(together).compute() == pytest.approx(pooled, rel=1e-12,
                                                                       abs=1e-15)


def test_per_group_rows_merge_and_compute_as_their_own_states_in_any_selection():
    # per_group's accumulators hold views of one stacked state, which merged and compute_each
    # read directly: any selection, order or mix of them with other accumulators, and an
    # update after per_group, must give bitwise what their own states give (the same numbers
    # stacked in the same order; equality, not a tolerance: a stale or misaligned row differs)
    g = torch.Generator().manual_seed(1)
    n, groups_n = 200, 9
    probs = torch.softmax(2 * torch.randn(n, 4, generator=g, dtype=torch.float64), dim=1)
    labels = torch.randint(0, 4, (n,), generator=g)
    groups = torch.randint(0, groups_n, (n,), generator=g)
    rows = Accumulator.per_group(probs, labels, groups, groups_n, n_bins=6)
    rows[3].update(probs[:7], labels[:7])  # writes its own row only
    other = Accumulator.per_group(probs[:50], labels[:50], groups[:50], groups_n, n_bins=6)
    alone = Accumulator(6).update(probs[50:80], labels[50:80])

    def copies(items):  # the same states, held by accumulators built from their state dicts
        return [Accumulator.from_state_dict(a.state_dict()) for a in items]

    for selection in (rows, rows[::-1], rows[2:5], [rows[4], rows[4], rows[0]],
                      rows[:3] + other[5:] + [alone], [alone, *rows]):
        want = Accumulator.merged(copies(selection)).state_dict()
        got = Accumulator.merged(selection).state_dict()
        assert all(torch.equal(got[key], want[key]) for key in want)
        assert Accumulator.compute_each(selection) == Accumulator.compute_each(copies(selection))
    assert rows[3].count == int((groups == 3).sum()) + 7
    assert rows[2].count == int((groups == 2).sum())


def test_per_group_and_compute_each_refuse_bad_input():
    probs = torch.full((4, 2), 0.5, dtype=torch.float64)
    labels = torch.tensor([0, 1, 0, 1])
    with pytest.raises(InvalidInputError, match="groups"):
        Accumulator.per_group(probs, labels, torch.tensor([0, 0, 3, 3]), 3)
    empty = Accumulator.per_group(probs, labels, torch.tensor([0, 0, 2, 2]), 3)
    with pytest.raises(InvalidInputError, match="empty"):
        Accumulator.compute_each(empty)
    bad = probs.clone()
    bad[1] = torch.tensor([1.5, -0.5], dtype=torch.float64)
    with pytest.raises(InvalidInputError, match="negative"):
        Accumulator.per_group(bad, labels, torch.tensor([0, 0, 1, 1]), 2)
