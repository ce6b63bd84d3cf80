"""Personalisation by local fine-tuning, shared by the strategies that end with it (FedBABU,
FedAvg-FT): after federated training (and for a novel client that never trained) a client
loads the global network, fine-tunes it on its own training data and from then on predicts
with its own parameters (the client state is marked :data:`PERSONALIZED`).

``finetune = "head"`` trains the last layer only (the classifier), ``"all"`` the whole
network; the epochs run at the local learning rate and batch size.
"""

from __future__ import annotations

import torch

from bayesfl.data.clients import ClientData
from bayesfl.errors import ConfigError
from bayesfl.messages import Message
from bayesfl.strategies.base import ClientConfig, ClientState, model_state
from bayesfl.strategies.networks import last_layers
from bayesfl.strategies.parameter_averaging import (
    PERSONALIZED,
    ParameterAveraging,
    everything,
    with_epochs,
)
from bayesfl.training import train_plain

FINETUNE_SCOPES = ("head", "all")


def check_finetuning(strategy: str, epochs: object, scope: object) -> tuple[int, str]:
    """``(epochs, scope)`` validated: an integer >= 0 and one of :data:`FINETUNE_SCOPES`."""
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 0:
        raise ConfigError(f"{strategy} finetune_epochs must be an integer >= 0, got {epochs!r}")
    if scope not in FINETUNE_SCOPES:
        raise ConfigError(f"{strategy} finetune must be one of {FINETUNE_SCOPES}, got "
                          f"{scope!r}")
    return epochs, str(scope)


def fine_tune(
    strategy: ParameterAveraging,
    config: ClientConfig,
    state: ClientState,
    data: ClientData,
    broadcast: Message,
    generator: torch.Generator,
    *,
    epochs: int,
    scope: str,
) -> ClientState:
    """The client's personalised state: the global network (broadcast shared parameters,
    the client's own personal ones) fine-tuned for ``epochs`` on its training data."""
    model = strategy.global_model(config, state, broadcast)
    head = last_layers(model, 1)
    trainable = head.__contains__ if scope == "head" else everything
    train_plain(model, data.train_x, data.train_y, strategy.objective,
                with_epochs(strategy.context.training, epochs), generator=generator,
                trainable=trainable)
    return {**model_state(model), PERSONALIZED: torch.ones(1, dtype=torch.bool)}
