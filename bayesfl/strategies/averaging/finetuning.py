"""Personalisation by local fine-tuning, shared by the strategies that end with it (FedBABU,
FedAvg-FT): after federated training (and for a novel client that never trained) a client
loads the global network, fine-tunes it on its own training data and from then on predicts
with its own parameters (the client state is marked `PERSONALIZED`).

``finetune = "head"`` trains the last layer only (the classifier), ``"all"`` the whole
network; the epochs run at the local learning rate and batch size. ``finetune_stop =
"heldout_nll"`` (the default of both strategies) chooses how many of the ``finetune_epochs``
to run by the NLL of 20% of the client's training data held out, then runs them on all of it
(`bayesfl.strategies.head_tuning`): the fine-tuning length, which decides whether the
plug-in ends under- or over-confident, is measured per client instead of fixed.
``"fixed"`` runs ``finetune_epochs`` (the schedule before this option).
"""

from __future__ import annotations

import torch

from bayesfl.data.clients import ClientData
from bayesfl.errors import ConfigError
from bayesfl.messages import Message
from bayesfl.strategies.averaging.parameter_averaging import (
    PERSONALIZED,
    ParameterAveraging,
    everything,
    with_epochs,
)
from bayesfl.strategies.base import ClientConfig, ClientState, model_state
from bayesfl.strategies.head_tuning import HEAD_STOPS, HeadTuning, fine_tune_stopped
from bayesfl.strategies.networks import last_layers
from bayesfl.training import train_plain

FINETUNE_SCOPES = ("head", "all")


def check_finetuning(strategy: str, epochs: object, scope: object,
                     stop: object = "fixed") -> tuple[int, str, str]:
    """``(epochs, scope, stop)`` validated: an integer >= 0, one of `FINETUNE_SCOPES`
    and one of `HEAD_STOPS`."""
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 0:
        raise ConfigError(f"{strategy} finetune_epochs must be an integer >= 0, got {epochs!r}")
    if scope not in FINETUNE_SCOPES:
        raise ConfigError(f"{strategy} finetune must be one of {FINETUNE_SCOPES}, got "
                          f"{scope!r}")
    if stop not in HEAD_STOPS:
        raise ConfigError(f"{strategy} finetune_stop must be one of {HEAD_STOPS}, got "
                          f"{stop!r}")
    return epochs, str(scope), str(stop)


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
    stop: str = "fixed",
) -> ClientState:
    """The client's personalised state: the global network (broadcast shared parameters,
    the client's own personal ones) fine-tuned on its training data, ``epochs`` of them
    (``stop="fixed"``) or as many, up to ``epochs``, as minimise the NLL of a held-out 20%
    (``"heldout_nll"``: `fine_tune_stopped`)."""
    model = strategy.global_model(config, state, broadcast)
    head = last_layers(model, 1)
    trainable = head.__contains__ if scope == "head" else everything
    training = strategy.context.training
    tuning = HeadTuning(epochs, training.lr, training.batch_size, stop)
    if stop == "fixed":  # the schedule of the run's local training, bit for bit
        train_plain(model, data.train_x, data.train_y, strategy.objective,
                    with_epochs(training, epochs), generator=generator, trainable=trainable)
    else:
        fine_tune_stopped(model, data.train_x, data.train_y, strategy.objective, tuning,
                          generator, trainable)
    return {**model_state(model), PERSONALIZED: torch.ones(1, dtype=torch.bool)}
