"""A per-site loader: site k holds the digits whose position is k modulo 3 (its own "files"),
and returns them as NumPy arrays, as a user's loader reading local files would."""

import numpy as np

from bayesfl.data.datasets import load_dataset


def load(partition_id: int) -> tuple[np.ndarray, np.ndarray]:
    digits = load_dataset("digits", seed=0)
    rows = np.arange(partition_id, len(digits.y), 3)
    return digits.x[rows].numpy(), digits.y[rows].numpy()


def other(partition_id: int) -> tuple[np.ndarray, np.ndarray]:
    """The same data under another loader's name (a node set up for another run)."""
    return load(partition_id)


def overflowing(partition_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Site 0's inputs of digit 3 overflow the layers (3e38, as the simulator's divergence
    tests poison a class): its local training loss is non-finite from the first mini-batch
    that holds one, so its client step sends nothing; the other sites train as with
    `load`."""
    x, y = load(partition_id)
    if partition_id == 0:
        x = x.copy()
        x[y == 3] = 3e38
    return x, y
