"""LG-FedAvg (Liang et al. 2020, "Think Locally, Act Globally"): local representations, global
top layers. The last ``global_layers`` layers are averaged; the layers below stay on the client
(so clients may use different bodies when only the head is global). Local training updates
every layer jointly.

Layers (Table 1 of the [FedLog paper](https://arxiv.org/abs/2407.08337)): the FedLog paper compares
"LG-FedAvg 1" (one global layer, the head; 510 floats of the MNIST CNN) -- registry name
``lg-fedavg``, ``global_layers=1`` -- and "LG-FedAvg 2" (two global layers; 16560 floats) --
``lg-fedavg-2``, ``global_layers=2``.

``head=KIND`` (:mod:`bayesfl.strategies.probabilistic_head`): after training each client fits
that head posterior on its own body's training features (a zero-centred Laplace prior by
default; the head is global, and ``head_prior="global"`` centres the prior on it; its precision
by evidence) and predicts with it; the plug-in is reported beside it as ``map_plugin``.

Aggregation: unweighted mean over the participating clients, as LG-FedAvg's code does
(``main_lg.py`` sums the global layers of the m sampled clients and divides by m).
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import nn

from bayesfl.strategies.averaging.parameter_averaging import (
    ParameterAveraging,
    check_layer_count,
    only_last_layers,
)
from bayesfl.strategies.base import StrategyContext
from bayesfl.strategies.registry import Option, register_strategy


@register_strategy("lg-fedavg",
                   broadcast="last layer",
                   upload="that layer, `num_samples`",
                   aggregate="unweighted mean; lower layers personal")
class LGFedAvg(ParameterAveraging):
    """Personal lower layers, shared last layers, joint local training, unweighted averaging.

    Args:
        context: classes, feature dimension, local training, rounds, device, seed.
        global_layers: how many of the network's last layers are averaged (``lg-fedavg``: 1,
            the FedLog paper's "LG-FedAvg 1"; ``lg-fedavg-2``: 2).
    """

    weighted = False

    OPTIONS: ClassVar[tuple[Option, ...]] = (
        Option("global_layers", int, 1,
               "how many of the network's last layers are averaged (`lg-fedavg`: 1, the FedLog "
               "paper's \"LG-FedAvg 1\"; `lg-fedavg-2`: 2)."),
    )

    def __init__(
        self, context: StrategyContext, *, global_layers: int = 1, **options: Any
    ) -> None:
        super().__init__(context, **options)
        self.global_layers = check_layer_count(self.name, "global_layers", global_layers)

    def shared_parameters(self, model: nn.Module) -> frozenset[str]:
        return only_last_layers(model, self.global_layers, self.name)


@register_strategy("lg-fedavg-2",
                   broadcast="last 2 layers",
                   upload="those layers, `num_samples`",
                   aggregate="unweighted mean; lower layers personal")
class LGFedAvg2(LGFedAvg):
    """LG-FedAvg with two global layers: the FedLog paper's "LG-FedAvg 2"."""

    OPTIONS: ClassVar[tuple[Option, ...]] = (
        Option("global_layers", int, 2,
               "how many of the network's last layers are averaged (`lg-fedavg`: 1, the FedLog "
               "paper's \"LG-FedAvg 1\"; `lg-fedavg-2`: 2)."),
    )

    def __init__(
        self, context: StrategyContext, *, global_layers: int = 2, **options: Any
    ) -> None:
        super().__init__(context, global_layers=global_layers, **options)
