"""The engine's setup: each client's seed of a round, computed for all clients at once."""

import numpy as np
import pytest

from bayesfl.engine.setup import client_seeds
from bayesfl.strategies.base import derived_seed


@pytest.mark.parametrize("seed", [0, 1, 7, 2**31, 2**32 - 1, 2**32, 2**40 + 5, 2**64 + 3,
                                  12345678901234567890123])
@pytest.mark.parametrize("round", [0, 1, 5, 2**31 - 1, 2**32 + 3])
def test_client_seeds_are_derived_seeds(seed, round):
    # SeedSequence's words differ with the sizes of the seed and the round (one word, two,
    # more than its pool of four): every path of its mixing is compared, on every client id
    ids = [0, 1, 2, 9, 1000, 15999, 2**31 - 1, 2**32 - 1, 2**32 + 4]
    ids += np.random.default_rng(seed % 2**32).integers(0, 20_000, 30).tolist()
    assert client_seeds(seed, round, ids) == [derived_seed(seed, round, c) for c in ids]


def test_client_seeds_of_no_client_are_none():
    assert client_seeds(0, 1, []) == []
