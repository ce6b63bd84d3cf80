"""Fixtures of the strategy tests (helpers live in strategy_helpers.py)."""

import pytest
from strategy_helpers import context, make_clients

from bayesfl.strategies import make_strategy


@pytest.fixture
def build():
    """``build(name, sizes, bodies, **options) -> (strategy, clients, initial state)``."""

    def _build(name, sizes=(12, 20, 7), bodies=("mlp:8",), **options):
        strategy = make_strategy(name, context(), **options)
        clients = make_clients(strategy, sizes, bodies)
        return strategy, clients, strategy.init(clients)

    return _build
