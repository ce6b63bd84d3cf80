"""FedPer (Arivazhagan et al. 2019, "Federated Learning with Personalization Layers"): the base
layers are federated, the last ``local_layers`` layers ("personalization layers") stay on the
client. Local training updates all layers jointly, as in FedAvg.

Layers: the FedLog paper runs FedPer with the **last two layers local** (the [FedLog
paper](https://arxiv.org/abs/2407.08337), Table 1 and section "Communication Cost": it uploads
"everything except the last two FC layers"; 5280 of the MNIST CNN's 21840 floats), so
``local_layers`` defaults to 2. ``local_layers=1`` keeps only the head personal.

``head=KIND`` (:mod:`bayesfl.strategies.probabilistic_head`): after training each client fits
that head posterior on its own body's training features (the head is personal: a zero-centred
Laplace prior, its precision by evidence) and predicts with it; FedPer's own network is
reported beside it as ``map_plugin``.

Aggregation: weighted by the clients' sample counts. FedPer trains its base layers with
FedAvg's server step (Arivazhagan et al. 2019), and FedAvg weights by n_c / n. (The FedRep code
base, which also runs FedPer, uses equal weights on MNIST/CIFAR; with the FedLog paper's
equal-size shards both give the same mean.)
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import nn

from bayesfl.strategies.averaging.parameter_averaging import (
    ParameterAveraging,
    all_but_last_layers,
    check_layer_count,
)
from bayesfl.strategies.base import StrategyContext
from bayesfl.strategies.registry import Option, register_strategy


@register_strategy("fedper",
                   broadcast="base layers",
                   upload="base layers, `num_samples`",
                   aggregate="weighted mean; last two layers personal")
class FedPer(ParameterAveraging):
    """Shared base layers, personal last layers, joint local training, weighted averaging.

    Args:
        context: classes, feature dimension, local training, rounds, device, seed.
        local_layers: how many of the network's last layers stay on the client (the FedLog
            paper's FedPer: 2).
    """

    weighted = True

    OPTIONS: ClassVar[tuple[Option, ...]] = (
        Option("local_layers", int, 2,
               "how many of the network's last layers stay on the client (the FedLog paper's "
               "FedPer: 2)."),
    )

    def __init__(
        self, context: StrategyContext, *, local_layers: int = 2, **options: Any
    ) -> None:
        super().__init__(context, **options)
        self.local_layers = check_layer_count(self.name, "local_layers", local_layers)

    def shared_parameters(self, model: nn.Module) -> frozenset[str]:
        return all_but_last_layers(model, self.local_layers, self.name)
