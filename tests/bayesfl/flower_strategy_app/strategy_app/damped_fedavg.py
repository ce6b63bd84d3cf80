"""Damped FedAvg: a strategy written outside ``bayesfl/strategies/`` in one module, as a user
would write one (the registry's acceptance test, issue 42).

The server keeps a share ``damping`` of its previous shared parameters and takes the rest from
FedAvg's mean: ``w <- damping w + (1 - damping) mean(uploads)``. ``damping=0`` is FedAvg.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from bayesfl.messages import Message
from bayesfl.strategies import Option, register_strategy
from bayesfl.strategies.averaging.fedavg import FedAvg
from bayesfl.strategies.base import ServerState, StrategyContext


@register_strategy("damped-fedavg", family="averaging", broadcast="whole network",
                   upload="whole network, `num_samples`",
                   aggregate="FedAvg's mean, mixed with the previous network by `damping`")
class DampedFedAvg(FedAvg):
    """FedAvg whose server keeps a share of its previous network each round."""

    OPTIONS: ClassVar[tuple[Option, ...]] = (
        Option("damping", float, 0.0,
               "share of the previous shared parameters the server keeps each round (0: FedAvg)",
               minimum=0.0, maximum=0.99),
    )

    def __init__(self, context: StrategyContext, *, damping: float = 0.0,
                 **options: Any) -> None:
        super().__init__(context, **options)
        self.damping = float(damping)

    def aggregate(self, state: ServerState, uploads: Sequence[Message], round: int,
                  generator: torch.Generator) -> ServerState:
        new = super().aggregate(state, uploads, round, generator)
        if self.damping == 0.0:
            return new
        return {name: (self.damping * state[name] + (1.0 - self.damping) * value
                       if value.is_floating_point() and name in state
                       and state[name].shape == value.shape else value)
                for name, value in new.items()}
