"""Local Only (the FedSI paper's "Local Only", CoLearn's "Independent Learning"): every client
trains its own network on its own data and never exchanges a parameter.

It runs on the same transport as every strategy so that its figures are comparable (same
rounds, epochs, seeds and evaluation): each round a client trains its network for the local
epochs and uploads only its sample count (8 bytes; the header is the transport's round
bookkeeping), the server aggregates nothing, and the broadcast carries no tensor. Total local
training is rounds x local epochs, as for every other strategy of the run. Clients may have
different bodies (nothing is shared).
"""

from __future__ import annotations

from torch import nn

from bayesfl.strategies.averaging.parameter_averaging import ParameterAveraging
from bayesfl.strategies.base import ServerState
from bayesfl.strategies.registry import register_strategy


@register_strategy("local-only",
                   broadcast="nothing",
                   upload="`num_samples` only",
                   aggregate="nothing (each client trains its own network)")
class LocalOnly(ParameterAveraging):
    """No communication: each client trains and predicts with its own network only."""

    weighted = True

    def shared_parameters(self, model: nn.Module) -> frozenset[str]:
        return frozenset()

    def init(self) -> ServerState:
        """An empty server state (nothing is shared, so bodies may differ)."""
        return {}
