"""FedBABU (Oh et al. 2022): the head stays fixed at its random initialisation during
federated training; only the body is trained and averaged (weighted, as FedAvg). For
evaluation each client fine-tunes a copy of the head on its own training data with the global
body frozen (``finetune_epochs``), which is FedBABU's personalisation step."""

from __future__ import annotations

import copy

import torch
from torch import Tensor

from bayesfl.errors import ConfigError
from bayesfl.strategies.base import Client, ServerState, StrategyContext
from bayesfl.strategies.parameter_averaging import (
    ParameterAveraging,
    _softmax_of,
    is_body,
    is_head,
    with_epochs,
)
from bayesfl.training import LocalTraining, ParameterFilter, train_plain


class FedBABU(ParameterAveraging):
    """Shared body, head frozen at init during training, head fine-tuned for evaluation."""

    name = "fedbabu"
    weighted = True

    def __init__(self, context: StrategyContext, *, finetune_epochs: int = 1) -> None:
        super().__init__(context)
        if finetune_epochs < 0:
            raise ConfigError(f"fedbabu finetune_epochs must be >= 0, got {finetune_epochs}")
        self.finetune_epochs = finetune_epochs

    def shared(self, name: str) -> bool:
        return is_body(name)

    def phases(self) -> list[tuple[ParameterFilter, LocalTraining]]:
        return [(is_body, self.context.training)]

    def predict_proba(self, client: Client, state: ServerState, x: Tensor) -> Tensor:
        model = copy.deepcopy(client.model)
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, value in state.items():
                params[name].copy_(value)
        # deterministic per client, so evaluation does not consume any run RNG
        generator = torch.Generator().manual_seed(1_000_003 + client.client_id)
        with torch.enable_grad():  # evaluation may run under no_grad
            train_plain(model, client.data.train_x, client.data.train_y, self.objective,
                        with_epochs(self.context.training, self.finetune_epochs),
                        generator=generator, trainable=is_head)
        return _softmax_of(model, dict(model.named_parameters()), x)
