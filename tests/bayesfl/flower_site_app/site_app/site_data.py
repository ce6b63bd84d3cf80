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
