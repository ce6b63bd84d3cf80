"""FedProx (Li et al. 2020, "Federated Optimization in Heterogeneous Networks"): FedAvg whose
clients minimise the local loss plus the proximal term (mu / 2) ||w - w_global||^2 over the
parameters they train, which keeps local models near the round's global model.

Aggregation as FedAvg (weighted by n_c). ``mu`` defaults to 0.01, the value of the FedPart
authors' generic FedProx configs (the [FedPart paper](https://arxiv.org/abs/2410.11559) does not
state it); the mini-batch loss is the mean per-sample loss plus the proximal term.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor

from bayesfl.strategies.averaging.fedavg import FedAvg
from bayesfl.strategies.base import StrategyContext
from bayesfl.strategies.options import option_number
from bayesfl.strategies.registry import Option, register_strategy


@register_strategy("fedprox",
                   broadcast="whole network",
                   upload="whole network, `num_samples`",
                   aggregate="as FedAvg; proximal local objective")
class FedProx(FedAvg):
    """FedAvg with the proximal term ``mu / 2 ||w - w_global||^2`` in local training.

    Args:
        context: the run configuration.
        mu: the proximal weight (>= 0; 0 is FedAvg).
        **options: the parameter-averaging options.
    """

    OPTIONS: ClassVar[tuple[Option, ...]] = (
        Option("mu", float, 0.01,
               "the proximal weight (>= 0; 0 is FedAvg).",
               minimum=0.0),
    )

    def __init__(self, context: StrategyContext, *, mu: float = 0.01, **options: Any) -> None:
        super().__init__(context, **options)
        self.mu = option_number(self.name, "mu", mu)

    def penalty(
        self, anchor: dict[str, Tensor]
    ) -> Callable[[dict[str, Tensor]], Tensor] | None:
        """``(mu / 2) sum ||w[n] - anchor[n]||^2`` over the trained parameters that have an
        anchor (the global values the round started from)."""
        mu = self.mu

        def proximal(params: dict[str, Tensor]) -> Tensor:
            terms = [(p - anchor[n]).square().sum() for n, p in params.items() if n in anchor]
            return 0.5 * mu * torch.stack(terms).sum() if terms else params_zero(params)

        return proximal if mu > 0 else None


def params_zero(params: dict[str, Tensor]) -> Tensor:
    return next(iter(params.values())).new_zeros(())
