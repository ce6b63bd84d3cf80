"""Per-client train/test data: partition the pooled set, then split each client stratified by label.

Each client's test set follows its own training label distribution (as FedLog and FedSI do):
for every class the client holds, about ``test_fraction`` of its samples go to test. The split
is by largest remainder, so a client with n samples gets ``max(1, round(n * test_fraction))``
test samples (at most n - 1), and a class keeps at least one training sample whenever possible.

A ``test_fraction`` that starves a client is refused (`ConfigError`): when a client
would train on fewer samples than the classes it holds *and* on fewer than it tests on, the
test share, not the partition, took its training data (``test_fraction=0.999`` leaves one
training sample to a client of 450); the message names the client and the largest
``test_fraction`` that leaves every client a training sample per class or at least half its
data. A small client that merely cannot spare a test sample for every class is accepted.

Data with a test pool of their own (``Dataset.num_test``: ``Dataset.from_arrays(x, y,
test=(x_test, y_test))``): the partition deals out the training rows only, and each class's
test rows are shared among the clients that train on the class, in proportion to how many of
its training samples each holds (largest remainder, ties at random from the seed): every
client's test set follows its own label distribution, as above, and every test row is used at
most once. ``test_fraction`` is unused. A client whose classes leave it no test row is a
[`DataError`][bayesfl.DataError] (add test samples of those classes, or use fewer clients).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from bayesfl.data.datasets import Dataset
from bayesfl.data.partition import PartitionScheme, fixed_split, partition
from bayesfl.errors import ConfigError, DataError


@dataclass(eq=False)
class ClientData:
    """One client's local data (compared by identity: its fields are tensors).

    Attributes:
        client_id: 0-based client index.
        train_x: (n_train, *input_shape) float32; train_y: (n_train,) int64.
        test_x: (n_test, *input_shape) float32; test_y: (n_test,) int64.
        train_indices, test_indices: the rows of the pooled data set they came from (sorted).
    """

    client_id: int
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    train_indices: np.ndarray | None = None
    test_indices: np.ndarray | None = None

    @property
    def num_train(self) -> int:
        return len(self.train_y)

    @property
    def num_test(self) -> int:
        return len(self.test_y)


def make_clients(
    dataset: Dataset,
    num_clients: int,
    partition: str | PartitionScheme,
    *,
    seed: int,
    test_fraction: float = 0.25,
) -> list[ClientData]:
    """Partition ``dataset`` over ``num_clients`` clients and split each into train/test.

    Args:
        dataset: the pooled data set.
        num_clients: number of clients.
        partition: a partition scheme string, e.g. ``"shards:2"`` (see
            `bayesfl.data.partition`).
        seed: seeds both the partition and the train/test split.
        test_fraction: share of each client's samples (per class) held out for testing, in
            (0, 1); ignored by a scheme that fixes the split (``labels:K:train=N``).

    Raises:
        ConfigError: a bad scheme or ``test_fraction``, or a ``test_fraction`` that leaves a
            client starved of training data (module docstring).
        DataError: more clients than samples, an empty client, or a client too small to hold
            both a training and a test sample.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ConfigError(f"test_fraction must lie in (0, 1), got {test_fraction}")
    labels = dataset.y.numpy()
    scheme = partition if isinstance(partition, PartitionScheme) else \
        PartitionScheme.parse(partition)
    if dataset.num_test:
        splits = _splits_with_test_pool(labels, len(labels) - dataset.num_test, num_clients,
                                        scheme, seed)
    else:
        splits = _splits(labels, num_clients, scheme, seed, test_fraction)
    if not scheme.fixes_split and not dataset.num_test:  # these ignore test_fraction
        check_training_shares(labels, splits, test_fraction)
    clients = []
    for client_id, (train_idx, test_idx) in enumerate(splits):
        clients.append(ClientData(
            client_id=client_id,
            train_x=dataset.x[train_idx], train_y=dataset.y[train_idx],
            test_x=dataset.x[test_idx], test_y=dataset.y[test_idx],
            train_indices=train_idx, test_indices=test_idx,
        ))
    return clients


_partition = partition  # the argument of make_clients shadows the function's name


def check_training_shares(
    labels: np.ndarray, splits: list[tuple[np.ndarray, np.ndarray]], test_fraction: float
) -> None:
    """Refuse a ``test_fraction`` that starves a client (module docstring): one that trains on
    fewer samples than the classes it holds and on fewer than it tests on.

    Raises:
        ConfigError: naming the first such client, how many there are, and the largest
            ``test_fraction`` (two decimals) that leaves each of them a training sample per
            class or at least half its data.
    """
    starved = []  # (client, training samples, classes held, test samples)
    for client_id, (train, test) in enumerate(splits):
        held = len(np.unique(labels[np.concatenate([train, test])]))
        if len(train) < held and len(train) < len(test):
            starved.append((client_id, len(train), held, len(test)))
    if not starved:
        return
    # test_fraction <= m / n caps the test set at m, leaving n - m to train: m = n - classes
    # gives every class a training sample, m = n // 2 half the data
    largest = min(max(n_train + n_test - held, (n_train + n_test) // 2) / (n_train + n_test)
                  for _, n_train, held, n_test in starved)
    client_id, n_train, held, n_test = starved[0]
    raise ConfigError(
        f"test_fraction {test_fraction:g} leaves client {client_id} with {n_train} training "
        f"sample(s) for the {held} classes it holds ({n_train + n_test} samples, {n_test} for "
        f"testing; {len(starved)} of {len(splits)} clients are as short), too few to learn "
        f"its classes from; use test_fraction <= {math.floor(largest * 100) / 100:g} (the "
        "default is 0.25)")


def _splits(
    labels: np.ndarray, num_clients: int, scheme: PartitionScheme, seed: int,
    test_fraction: float,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per client, sorted (train, test) indices of the pooled data set."""
    if scheme.fixes_split:
        return fixed_split(labels, num_clients, scheme, seed=seed)
    # every client needs one sample to train and one to test
    parts = _partition(labels, num_clients, scheme, seed=seed, min_samples=2)
    rng = np.random.default_rng([seed, 1])  # independent of the partition's stream
    pairs = []
    for indices in parts:
        train, test = stratified_split(labels[indices], test_fraction, rng)
        pairs.append((np.sort(indices[train]), np.sort(indices[test])))
    return pairs


def _splits_with_test_pool(
    labels: np.ndarray, num_train: int, num_clients: int, scheme: PartitionScheme, seed: int,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per client, sorted (train, test) row indices when rows ``num_train:`` are the data's
    own test pool (module docstring)."""
    if scheme.fixes_split:
        raise ConfigError(f"partition {str(scheme)!r} fixes each client's test samples itself; "
                          "data with their own test arrays need a scheme that does not (drop "
                          "train=/test= from it, or pass the test arrays pooled with x, y)")
    train_labels, test_labels = labels[:num_train], labels[num_train:]
    parts = _partition(train_labels, num_clients, scheme, seed=seed, min_samples=1)
    rng = np.random.default_rng([seed, 3])  # independent of the partition's stream
    tests: list[list[np.ndarray]] = [[] for _ in parts]
    for c in np.unique(test_labels):
        rows = num_train + rng.permutation(np.flatnonzero(test_labels == c))
        held = np.array([int((train_labels[p] == c).sum()) for p in parts], dtype=np.float64)
        if held.sum() == 0:
            continue  # no client trains on the class: its test rows test no one
        counts = _largest_remainder(held / held.sum(), len(rows), rng)
        for k, (start, stop) in enumerate(zip(np.cumsum(counts) - counts, np.cumsum(counts),
                                              strict=True)):
            tests[k].append(rows[start:stop])
    pairs = []
    for k, (train, test) in enumerate(zip(parts, tests, strict=True)):
        test_rows = np.concatenate(test).astype(np.int64) if test else np.empty(0, np.int64)
        if not len(test_rows):
            classes = sorted(int(c) for c in np.unique(train_labels[train]))
            raise DataError(f"client {k} gets no test sample: the test arrays hold too few "
                            f"samples of its classes {classes} for the clients training on "
                            "them; add test samples of these classes or use fewer clients")
        pairs.append((np.sort(train), np.sort(test_rows)))
    return pairs


def _largest_remainder(shares: np.ndarray, total: int, rng: np.random.Generator) -> np.ndarray:
    """Integer counts summing to ``total`` closest to ``shares * total`` (ties at random)."""
    quota = shares * total
    counts = np.floor(quota).astype(np.int64)
    order = np.lexsort((rng.permutation(len(shares)), -(quota - counts)))
    counts[order[: total - int(counts.sum())]] += 1
    return counts


def stratified_split(
    labels: np.ndarray, test_fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Split positions ``0..n-1`` into train/test with per-class test shares near ``test_fraction``.

    Requires n >= 2. The test size is ``T = clip(round(n * test_fraction), 1, n - 1)``; class c
    with n_c samples gets ``floor(n_c * T / n)`` test samples plus one more for the classes with
    the largest remainders (ties at random), so it gets the floor or the ceiling of its share,
    never taking a class's last training sample unless no other class can give one.

    Returns:
        (train positions, test positions), disjoint int64 arrays covering ``0..n-1``.
    """
    n = len(labels)
    total_test = min(max(1, round(n * test_fraction)), n - 1)
    classes, counts = np.unique(labels, return_counts=True)
    quota = counts * total_test / n
    test_counts = np.minimum(np.floor(quota).astype(np.int64), np.maximum(counts - 1, 0))
    order = np.lexsort((rng.permutation(len(classes)), -(quota - np.floor(quota))))
    ceiling = np.ceil(quota).astype(np.int64)
    # first keep a training sample per class, then relax; never beyond the ceiling of the quota
    for cap in (np.minimum(counts - 1, ceiling), ceiling):
        for c in order:
            if test_counts.sum() == total_test:
                break
            if test_counts[c] < cap[c]:
                test_counts[c] += 1
    train, test = [], []
    for c, k in zip(classes, test_counts, strict=True):
        members = rng.permutation(np.flatnonzero(labels == c))
        test.append(members[:k])
        train.append(members[k:])
    return np.concatenate(train).astype(np.int64), np.concatenate(test).astype(np.int64)
