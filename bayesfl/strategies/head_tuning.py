"""Fine-tuning a client's linear head on fixed features, stopped by held-out NLL.

Strategies that personalise by fine-tuning a head on a shared body (FedSI, FedBABU, FedAvg-FT
with ``finetune="head"``) decide their calibration by how long they fine-tune: on the FedSI
paper's MNIST setting, 10 epochs leave the plug-in under-confident and 300 over-confident.
:func:`tune_head` makes that length a measurement instead of a constant: with
``stop="heldout_nll"`` it holds out a slice of the client's training data, trains the head on
the rest for up to ``max_epochs``, picks the epoch count of lowest held-out NLL (0 included),
then trains the head again from its starting point on *all* the training data for that many
epochs (so no sample is lost to the choice). ``stop="fixed"`` trains ``max_epochs`` on all of
it, the older protocol.

:func:`tune_head` trains a head on features computed once (the body is frozen): cheap enough
to run every round (:mod:`bayesfl.strategies.fedsi.fedsi`'s per-round view).
:func:`fine_tune_stopped` is the same rule for any module and any of its parameters (FedBABU,
FedAvg-FT: :mod:`bayesfl.strategies.averaging.finetuning`).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from bayesfl.errors import ConfigError
from bayesfl.strategies.networks import batched_apply, cross_entropy_per_sample
from bayesfl.training import LocalTraining, Objective, ParameterFilter, train_plain

HEAD_STOPS = ("heldout_nll", "fixed")


@dataclass(frozen=True)
class HeadTuning:
    """How a head is fine-tuned (:func:`tune_head`).

    Attributes:
        max_epochs: the most epochs (``stop="fixed"``: exactly this many); >= 0.
        lr: Adam's learning rate, > 0.
        batch_size: mini-batch rows, >= 1.
        stop: ``"heldout_nll"`` or ``"fixed"`` (module docstring).
        heldout_fraction: share of the training rows held out to choose the epoch count, in
            (0, 1); at least one row is held out and one kept.
    """

    max_epochs: int
    lr: float
    batch_size: int
    stop: str = "heldout_nll"
    heldout_fraction: float = 0.2

    def __post_init__(self) -> None:
        if self.stop not in HEAD_STOPS:
            raise ConfigError(f"head fine-tuning stop must be one of {', '.join(HEAD_STOPS)}; "
                              f"got {self.stop!r}")
        if not 0 < self.heldout_fraction < 1:
            raise ConfigError("head fine-tuning heldout_fraction must be in (0, 1), got "
                              f"{self.heldout_fraction!r}")
        if self.max_epochs < 0:
            raise ConfigError(f"head fine-tuning epochs must be >= 0, got {self.max_epochs}")

    def training(self, epochs: int) -> LocalTraining:
        return LocalTraining(epochs=epochs, lr=self.lr, batch_size=self.batch_size,
                             reset_optimizer_each_epoch=False)


def mean_nll(module: nn.Module, x: Tensor, labels: Tensor) -> float:
    """Mean negative log-likelihood (nats) of ``labels`` (n,) under ``module(x)``'s logits
    (eval mode, no gradients)."""
    logits = batched_apply(module, x)
    return float(cross_entropy_per_sample(logits.to(torch.float64), labels).mean())


def tune_head(head: nn.Module, features: Tensor, labels: Tensor, tuning: HeadTuning,
              generator: torch.Generator) -> int:
    """Fine-tune ``head`` in place on ``features`` (n, d) and ``labels`` (n,) by
    cross-entropy; returns the number of epochs of the final training on all rows (module
    docstring). :func:`fine_tune_stopped` with the head as the module.

    On an accelerator the head is tuned on a CPU copy and copied back: a few thousand steps
    on a (n, d) head are kernel launches, not arithmetic (on an H200, FedSI's per-round view
    spent most of a round launching them)."""
    if features.device.type == "cpu":
        return fine_tune_stopped(head, features, labels, cross_entropy_per_sample, tuning,
                                 generator)
    local = copy.deepcopy(head).cpu()
    epochs = fine_tune_stopped(local, features.cpu(), labels.cpu(), cross_entropy_per_sample,
                               tuning, generator)
    head.load_state_dict(local.state_dict())  # copies onto the head's device
    return epochs


def fine_tune_stopped(module: nn.Module, x: Tensor, labels: Tensor, objective: Objective,
                      tuning: HeadTuning, generator: torch.Generator,
                      trainable: ParameterFilter | None = None) -> int:
    """Train ``module``'s ``trainable`` parameters in place on ``(x (n, ...), labels (n,))``
    by the per-sample ``objective``, for a number of epochs chosen by held-out NLL
    (``tuning.stop``; module docstring); returns that number.

    With fewer than two rows, or ``stop="fixed"``, it trains ``max_epochs`` on all rows. Ties
    in held-out NLL go to the fewest epochs. The held-out NLL is the cross-entropy of the
    module's logits, whatever the objective.
    """
    n = labels.shape[0]
    if tuning.stop == "fixed" or n < 2 or tuning.max_epochs == 0:
        train_plain(module, x, labels, objective, tuning.training(tuning.max_epochs),
                    generator=generator, trainable=trainable)
        return tuning.max_epochs
    start = {k: v.detach().clone() for k, v in module.state_dict().items()}
    held = min(n - 1, max(1, math.floor(tuning.heldout_fraction * n)))
    order = torch.randperm(n, generator=generator).to(labels.device)
    held_idx, fit_idx = order[:held], order[held:]
    nlls = [mean_nll(module, x[held_idx], labels[held_idx])]

    def record(_: int) -> None:
        nlls.append(mean_nll(module, x[held_idx], labels[held_idx]))

    train_plain(module, x[fit_idx], labels[fit_idx], objective,
                tuning.training(tuning.max_epochs), generator=generator, trainable=trainable,
                after_epoch=record)
    best_epochs = min(range(len(nlls)), key=nlls.__getitem__)  # the first of equal minima
    module.load_state_dict(start)
    train_plain(module, x, labels, objective, tuning.training(best_epochs),
                generator=generator, trainable=trainable)
    return best_epochs
