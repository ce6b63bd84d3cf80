"""FedRep (Collins et al. 2021, "Exploiting Shared Representations for Personalized Federated
Learning"): a shared representation and a personal head.

Each round a client first trains its personal layers for ``head_epochs`` with the shared ones
frozen, then the shared layers for the local epochs with the personal ones frozen; only the
shared layers are uploaded and averaged. [FedLog paper](https://arxiv.org/abs/2407.08337) settings
(section "Communication Cost"): body epochs = local epochs, head epochs 10 (MNIST, CIFAR-10; 3 for
CIFAR-100) -- the default here.

Layers (Table 1 of its two versions): the FedLog paper's v1 "FedRep" (v2 "FedRep 2") keeps the
**last two layers** local, as FedPer does -- registry name ``fedrep``, ``local_layers=2``; v2 adds
"FedRep 1" with one local layer (the head, as in the original FedRep paper) -- registry name
``fedrep-1``, ``local_layers=1``.

``head=KIND`` (:mod:`bayesfl.strategies.probabilistic_head`): after training each client fits
that head posterior on its own body's training features (personal head: a zero-centred Laplace
prior, its precision by evidence) and predicts with it; the plug-in is reported beside it as
``map_plugin``.

Aggregation: unweighted mean over the participating clients. FedRep's Algorithm 1 sets the new
representation to (1/|I^t|) sum_i phi_i, and its code weights every client by 1 on MNIST and
CIFAR (``lens = np.ones(num_users)``; sample counts only for the LEAF data sets).
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import nn

from bayesfl.strategies.averaging.parameter_averaging import (
    ParameterAveraging,
    all_but_last_layers,
    check_layer_count,
    with_epochs,
)
from bayesfl.strategies.base import StrategyContext
from bayesfl.strategies.options import option_integer
from bayesfl.strategies.registry import Option, register_strategy
from bayesfl.training import LocalTraining, ParameterFilter


@register_strategy("fedrep",
                   broadcast="body (all but the last 2 layers)",
                   upload="body, `num_samples`",
                   aggregate="unweighted mean; head phase then body phase")
class FedRep(ParameterAveraging):
    """Shared representation, personal last layers; head phase then body phase; unweighted.

    Args:
        context: classes, feature dimension, local training, rounds, device, seed.
        head_epochs: epochs of the personal-layer phase each round (paper: 10).
        local_layers: how many of the network's last layers are personal (``fedrep``: 2, the
            FedLog paper's "FedRep 2"; ``fedrep-1``: 1).
    """

    weighted = False

    OPTIONS: ClassVar[tuple[Option, ...]] = (
        Option("head_epochs", int, 10,
               "epochs of the personal-layer phase each round (paper: 10).",
               minimum=0),
        Option("local_layers", int, 2,
               "how many of the network's last layers are personal (`fedrep`: 2, the FedLog "
               "paper's \"FedRep 2\"; `fedrep-1`: 1)."),
    )

    def __init__(
        self, context: StrategyContext, *, head_epochs: int = 10, local_layers: int = 2,
        **options: Any,
    ) -> None:
        super().__init__(context, **options)
        self.head_epochs = option_integer(self.name, "head_epochs", head_epochs)
        self.local_layers = check_layer_count(self.name, "local_layers", local_layers)

    def shared_parameters(self, model: nn.Module) -> frozenset[str]:
        return all_but_last_layers(model, self.local_layers, self.name)

    def phases(self, shared: frozenset[str]) -> list[tuple[ParameterFilter, LocalTraining]]:
        training = self.context.training
        return [(lambda name: name not in shared, with_epochs(training, self.head_epochs)),
                (shared.__contains__, training)]


@register_strategy("fedrep-1",
                   broadcast="body (all but the last layer)",
                   upload="body, `num_samples`",
                   aggregate="unweighted mean; head phase then body phase")
class FedRep1(FedRep):
    """FedRep with one personal layer (the head): the FedLog paper's v2 "FedRep 1"."""

    OPTIONS: ClassVar[tuple[Option, ...]] = (
        Option("head_epochs", int, 10,
               "epochs of the personal-layer phase each round (paper: 10).",
               minimum=0),
        Option("local_layers", int, 1,
               "how many of the network's last layers are personal (`fedrep`: 2, the FedLog "
               "paper's \"FedRep 2\"; `fedrep-1`: 1)."),
    )

    def __init__(
        self, context: StrategyContext, *, head_epochs: int = 10, local_layers: int = 1,
        **options: Any,
    ) -> None:
        super().__init__(context, head_epochs=head_epochs, local_layers=local_layers,
                         **options)
