"""Fixtures of the strategy tests (helpers live in strategy_helpers.py)."""

import pytest
from strategy_helpers import SIZES, context, make_clients

from bayesfl.strategies import make_strategy


@pytest.fixture
def build():
    """``build(name, sizes, bodies, **options) -> (strategy, clients, initial server state)``."""

    def _build(name, sizes=SIZES, bodies=("mlp:8",), **options):
        strategy = make_strategy(name, context(sizes=sizes, bodies=bodies), **options)
        clients = make_clients(strategy, sizes)
        return strategy, clients, strategy.init()

    return _build
