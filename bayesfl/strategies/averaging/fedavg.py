"""FedAvg (McMahan et al. 2017, "Communication-Efficient Learning of Deep Networks from
Decentralized Data"): every client trains the whole network; the server averages all
parameters. Evaluation uses the global network.

Aggregation: weighted by the clients' sample counts, w <- sum_c (n_c / n) w_c, as FedAvg's
Algorithm 1 does (n = the participating clients' total).

``fedavg-ft`` (:class:`FedAvgFT`) adds local fine-tuning after training (the FedSI paper's
FedAvg-FT baseline).

``head=KIND`` (:mod:`bayesfl.strategies.probabilistic_head`; both): each client fits that head
posterior on its own features after training (FedAvg-FT: after fine-tuning), the Laplace prior
centred at zero (``head_prior="global"``: on the global head), and predicts with it; the plug-in
is reported beside it as
``map_plugin``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from bayesfl.data.clients import ClientData
from bayesfl.messages import Message
from bayesfl.strategies.averaging.finetuning import (
    FINETUNE_SCOPES,
    check_finetuning,
    fine_tune,
)
from bayesfl.strategies.averaging.parameter_averaging import ParameterAveraging
from bayesfl.strategies.base import ClientConfig, ClientState, StrategyContext
from bayesfl.strategies.head_tuning import HEAD_STOPS
from bayesfl.strategies.registry import Option, register_strategy


@register_strategy("fedavg",
                   broadcast="whole network",
                   upload="whole network, `num_samples`",
                   aggregate="weighted mean (or coordinate median / trimmed mean, norm "
                             "bounding); screens update norm")
class FedAvg(ParameterAveraging):
    """Average the whole network (body and head), weighted by ``n_c``."""

    weighted = True


@register_strategy("fedavg-ft",
                   broadcast="whole network",
                   upload="whole network, `num_samples`",
                   aggregate="as FedAvg; each client fine-tunes after training")
class FedAvgFT(FedAvg):
    """FedAvg, then local fine-tuning to personalise (the FedSI paper's "FedAvg-FT" baseline).

    Federated training is FedAvg's. :meth:`personalize` (after training, and for a novel
    client) fine-tunes the global network on the client's training data
    (:mod:`bayesfl.strategies.averaging.finetuning`). The FedSI paper does not state its fine-tuning
    budget; the default here is as many epochs as one round of local training (``None``) over
    the whole network (``finetune = "all"``), the usual reading of "FedAvg + fine-tuning".

    Args:
        context: the run configuration.
        finetune_epochs: fine-tuning epochs (None: the local training's epochs).
        finetune: ``"all"`` (default) or ``"head"`` (the last layer only).
        finetune_stop: ``"heldout_nll"`` (default): run as many of the ``finetune_epochs`` as
            minimise the NLL of a held-out 20% of the training data, then that many on all
            of it; ``"fixed"``: all of them (:mod:`bayesfl.strategies.averaging.finetuning`).
        options: FedAvg's options (robust aggregation, schedule, ``head``: after fine-tuning,
            a head posterior on the fine-tuned network's features).
    """

    personalizes = True

    OPTIONS: ClassVar[tuple[Option, ...]] = (
        Option("finetune_epochs", int, None,
               "fine-tuning epochs (None: the local training's epochs)."),
        Option("finetune", str, "all",
               '`"all"` (default) or `"head"` (the last layer only).',
               choices=FINETUNE_SCOPES),
        Option("finetune_stop", str, "heldout_nll",
               '`"heldout_nll"` (default): run as many of the `finetune_epochs` as minimise the '
               "NLL of a held-out 20% of the training data, then that many on all of it; "
               '`"fixed"`: all of them (:mod:`bayesfl.strategies.averaging.finetuning`).',
               choices=HEAD_STOPS),
    )

    def __init__(
        self, context: StrategyContext, *, finetune_epochs: int | None = None,
        finetune: str = "all", finetune_stop: str = "heldout_nll", **options: Any,
    ) -> None:
        super().__init__(context, **options)
        epochs = context.training.epochs if finetune_epochs is None else finetune_epochs
        self.finetune_epochs, self.finetune, self.finetune_stop = check_finetuning(
            self.name, epochs, finetune, finetune_stop)

    def personalize(
        self,
        config: ClientConfig,
        state: ClientState,
        data: ClientData,
        broadcast: Message,
        generator: torch.Generator,
    ) -> ClientState:
        """Fine-tune the global network on the client's training data; with ``head``, then
        the head posterior on the fine-tuned network's features."""
        tuned = fine_tune(self, config, state, data, broadcast, generator,
                          epochs=self.finetune_epochs, scope=self.finetune,
                          stop=self.finetune_stop)
        return self.with_head_posterior(config, state, tuned, data, broadcast)
