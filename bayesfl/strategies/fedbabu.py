"""FedBABU (Oh, Kim & Yun 2022, "FedBABU: Toward Enhanced Representation for Federated Image
Classification"): the head (the last layer) is randomly initialised and never updated during
federated training; only the body is trained locally and averaged. For evaluation each client
personalises by fine-tuning a copy of its network on its own training data, starting from the
global body and the initial head; the client's own model is left untouched.

Layers (spec fedlog.md §5.1): FedBABU uploads "everything except the last layer (the head is
never trained)"; 21330 of the MNIST CNN's 21840 floats.

Aggregation: weighted by the clients' sample counts: FedBABU is FedAvg with the head frozen,
and aggregates the body with FedAvg's n_c / n weights.

Defaults (the FedLog paper gives no FedBABU hyperparameters, spec §7.1, and says it
grid-searched them): ``finetune_epochs = 1`` and ``finetune = "head"``. The paper's abstract
fine-tunes "the head" for personalisation, hence ``"head"`` (``"all"`` fine-tunes body and head
together, the other choice FedBABU discusses). One epoch, at the local learning rate and batch
size, because the simulator evaluates every client every round and fine-tuning is the
dominant cost of a FedBABU evaluation; raise it for final numbers.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from bayesfl.errors import ConfigError
from bayesfl.strategies.base import Client, ServerState, StrategyContext
from bayesfl.strategies.parameter_averaging import (
    ParameterAveraging,
    _softmax_of,
    all_but_last_layers,
    everything,
    with_epochs,
)
from bayesfl.training import LocalTraining, ParameterFilter, train_plain

_FINETUNE = ("head", "all")


class FedBABU(ParameterAveraging):
    """Shared body, head frozen at init during training, fine-tuned for evaluation.

    Args:
        context: classes, feature dimension, local training, rounds, device, seed.
        finetune_epochs: epochs of fine-tuning before each evaluation (0: none).
        finetune: what the evaluation fine-tunes: ``"head"`` (default) or ``"all"``.
    """

    name = "fedbabu"
    weighted = True

    def __init__(
        self, context: StrategyContext, *, finetune_epochs: int = 1, finetune: str = "head"
    ) -> None:
        super().__init__(context)
        if finetune_epochs < 0:
            raise ConfigError(f"fedbabu finetune_epochs must be >= 0, got {finetune_epochs}")
        if finetune not in _FINETUNE:
            raise ConfigError(f"fedbabu finetune must be one of {_FINETUNE}, got {finetune!r}")
        self.finetune_epochs = finetune_epochs
        self.finetune = finetune

    def shared_parameters(self, model: nn.Module) -> frozenset[str]:
        return all_but_last_layers(model, 1, self.name)

    def phases(self) -> list[tuple[ParameterFilter, LocalTraining]]:
        return [(self.shared, self.context.training)]

    def predict_proba(self, client: Client, state: ServerState, x: Tensor) -> Tensor:
        model = copy.deepcopy(client.model)
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, value in state.items():
                params[name].copy_(value)
        # deterministic per client, so evaluation does not consume any run RNG
        generator = torch.Generator().manual_seed(1_000_003 + client.client_id)
        trainable = self.personal if self.finetune == "head" else everything
        with torch.enable_grad():  # evaluation may run under no_grad
            train_plain(model, client.data.train_x, client.data.train_y, self.objective,
                        with_epochs(self.context.training, self.finetune_epochs),
                        generator=generator, trainable=trainable)
        return _softmax_of(model, dict(model.named_parameters()), x)
