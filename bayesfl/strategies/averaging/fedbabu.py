"""FedBABU (Oh, Kim & Yun 2022, "FedBABU: Toward Enhanced Representation for Federated Image
Classification"): the head (the last layer) is randomly initialised and never updated during
federated training; only the body is trained locally and averaged. After training (and for a
novel client that never trained) each client personalises once
(:meth:`FedBABU.personalize`): it fine-tunes its network on its own training data, starting
from the global body and its initial head, and from then on predicts with its own fine-tuned
parameters. Rounds before that are evaluated with the global body and the initial head (what
FedBABU's paper reports as accuracy "before fine-tuning").

Layers (the [FedLog paper](https://arxiv.org/abs/2407.08337), section "Communication Cost"): FedBABU
uploads "everything except the last layer (the head is never trained)"; 21330 of the MNIST CNN's
21840 floats.

Aggregation: weighted by the clients' sample counts: FedBABU is FedAvg with the head frozen,
and aggregates the body with FedAvg's n_c / n weights.

Defaults (the FedLog paper gives no FedBABU hyperparameters, section "Communication Cost", and says
it grid-searched them): ``finetune_epochs = 1`` and ``finetune = "head"``. The paper's abstract
fine-tunes "the head" for personalisation, hence ``"head"`` (``"all"`` fine-tunes body and head
together, the other choice FedBABU discusses). One epoch, at the local learning rate and batch
size.

``head=KIND`` (:mod:`bayesfl.strategies.probabilistic_head`): after fine-tuning, each client
fits that head posterior on its fine-tuned network's training features (a zero-centred Laplace
prior by default, ``head_prior="global"`` centres it on the shared initial head; its precision
by evidence) and predicts with it; the
fine-tuned network's softmax is reported beside it as ``map_plugin``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from bayesfl.data.clients import ClientData
from bayesfl.messages import Message
from bayesfl.strategies.averaging.finetuning import (
    FINETUNE_SCOPES,
    check_finetuning,
    fine_tune,
)
from bayesfl.strategies.averaging.parameter_averaging import (
    PERSONALIZED,
    ParameterAveraging,
    all_but_last_layers,
)
from bayesfl.strategies.base import (
    ClientConfig,
    ClientState,
    StrategyContext,
    derived_seed,
)
from bayesfl.strategies.head_tuning import HEAD_STOPS
from bayesfl.strategies.registry import Option, register_strategy
from bayesfl.training import LocalTraining, ParameterFilter


@register_strategy("fedbabu",
                   broadcast="body",
                   upload="body, `num_samples`",
                   aggregate="weighted mean; head frozen, fine-tuned once to personalise")
class FedBABU(ParameterAveraging):
    """Shared body, head frozen at init during training, fine-tuned once to personalise.

    Args:
        context: classes, feature dimension, local training, rounds, device, seed.
        finetune_epochs: epochs of fine-tuning in :meth:`personalize` (0: none).
        finetune: what personalisation fine-tunes: ``"head"`` (default) or ``"all"``.
        finetune_stop: ``"heldout_nll"`` (default): as many of the ``finetune_epochs`` as
            minimise the NLL of a held-out 20% of the training data; ``"fixed"``: all.
        options: the family's options (:class:`~bayesfl.strategies.averaging.parameter_averaging.
            ParameterAveraging`), among them ``head``: after fine-tuning, a head posterior on
            the fine-tuned network's features (``head_prior="global"``: its Laplace prior
            centred on the initial head every client shares).
    """

    weighted = True
    personalizes = True
    round_view: ClassVar[str | None] = (
        "each client personalised as it would be now (fine-tuned from the global body)")

    OPTIONS: ClassVar[tuple[Option, ...]] = (
        Option("finetune_epochs", int, 1,
               "epochs of fine-tuning in :meth:`personalize` (0: none)."),
        Option("finetune", str, "head",
               'what personalisation fine-tunes: `"head"` (default) or `"all"`.',
               choices=FINETUNE_SCOPES),
        Option("finetune_stop", str, "heldout_nll",
               '`"heldout_nll"` (default): as many of the `finetune_epochs` as minimise the NLL '
               'of a held-out 20% of the training data; `"fixed"`: all.',
               choices=HEAD_STOPS),
    )

    def __init__(
        self, context: StrategyContext, *, finetune_epochs: int = 1, finetune: str = "head",
        finetune_stop: str = "heldout_nll", **options: Any,
    ) -> None:
        super().__init__(context, **options)
        self.finetune_epochs, self.finetune, self.finetune_stop = check_finetuning(
            self.name, finetune_epochs, finetune, finetune_stop)

    def shared_parameters(self, model: nn.Module) -> frozenset[str]:
        return all_but_last_layers(model, 1, self.name)

    def phases(self, shared: frozenset[str]) -> list[tuple[ParameterFilter, LocalTraining]]:
        return [(shared.__contains__, self.context.training)]

    def has_global_head(self, body: str) -> bool:
        """The head is never trained: every client holds the same initial one."""
        return True

    def personalize(
        self,
        config: ClientConfig,
        state: ClientState,
        data: ClientData,
        broadcast: Message,
        generator: torch.Generator,
    ) -> ClientState:
        """Fine-tune the global body and the client's (initial) head on its training data; with
        ``head``, then the head posterior on the fine-tuned network's features."""
        tuned = fine_tune(self, config, state, data, broadcast, generator,
                          epochs=self.finetune_epochs, scope=self.finetune,
                          stop=self.finetune_stop)
        return self.with_head_posterior(config, state, tuned, data, broadcast)

    def round_state(self, config: ClientConfig, state: ClientState, data: ClientData,
                    broadcast: Message) -> ClientState:
        """Before personalisation, the client personalised as it would be if training stopped
        now (:meth:`personalize` on a copy, its own generator per client and round), not the
        global body with the untrained initial head (:attr:`round_view`)."""
        if PERSONALIZED in state:
            return state
        generator = torch.Generator().manual_seed(derived_seed(
            self.context.seed, 37, config.client_id, broadcast.header.round))
        return self.personalize(config, state, data, broadcast, generator)
