"""Fine-tuning a client's linear head on fixed features, stopped by held-out NLL.

Strategies that personalise by fine-tuning a head on a shared body (FedSI, FedBABU, FedAvg-FT
with ``finetune="head"``) decide their calibration by how long they fine-tune: on the FedSI
paper's MNIST setting, 10 epochs leave the plug-in under-confident and 300 over-confident.
`tune_head` makes that length a measurement instead of a constant: with
``stop="heldout_nll"`` it holds out a slice of the client's training data, trains the head on
the rest for up to ``max_epochs``, picks the epoch count of lowest held-out NLL (0 included),
then trains the head again from its starting point on *all* the training data for that many
epochs (so no sample is lost to the choice). ``stop="fixed"`` trains ``max_epochs`` on all of
it, the older protocol.

`tune_head` trains a head on features computed once (the body is frozen): cheap enough
to run every round (`bayesfl.strategies.fedsi.fedsi`'s per-round view).
`fine_tune_stopped` is the same rule for any module and any of its parameters (FedBABU,
FedAvg-FT: `bayesfl.strategies.averaging.finetuning`).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from bayesfl.adam import adam_update_
from bayesfl.errors import ConfigError
from bayesfl.strategies.networks import batched_apply, cross_entropy_per_sample
from bayesfl.training import (
    LocalTraining,
    Objective,
    ParameterFilter,
    loss_diverged,
    train_plain,
)

HEAD_STOPS = ("heldout_nll", "fixed")


@dataclass(frozen=True)
class HeadTuning:
    """How a head is fine-tuned (`tune_head`).

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
    docstring). `fine_tune_stopped` with the head as the module.

    On an accelerator the head is tuned on a CPU copy and copied back: a few thousand steps
    on a (n, d) head are kernel launches, not arithmetic (on an H200, FedSI's per-round view
    spent most of a round launching them).

    A plain ``nn.Linear`` head on CPU features takes `tune_linear_head`: the same
    schedule with the cross-entropy's gradient written out (no autograd graph, no module
    calls), ~6x cheaper a step; its numbers equal the autograd path's up to float rounding."""
    if features.device.type == "cpu":
        if linear_head_tunable(head, features, labels):
            return tune_linear_head(head, features, labels, tuning, generator)
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


def linear_head_tunable(head: nn.Module, features: Tensor, labels: Tensor) -> bool:
    """Whether `tune_linear_head` applies: a plain ``nn.Linear`` (its subclasses may
    override ``forward``) with a bias, float32 or float64 parameters and features of its dtype
    on the CPU, one label per row."""
    return (type(head) is nn.Linear and head.bias is not None
            and features.device.type == "cpu" and head.weight.device.type == "cpu"
            and head.weight.dtype in (torch.float32, torch.float64)
            and features.dtype == head.weight.dtype and features.dim() == 2
            and features.shape[1] == head.in_features and labels.dim() == 1
            and labels.shape[0] == features.shape[0])


def tune_linear_head(head: nn.Linear, features: Tensor, labels: Tensor, tuning: HeadTuning,
                     generator: torch.Generator) -> int:
    """`fine_tune_stopped` of a linear head by cross-entropy, with the gradient written
    out: same held-out split, same shuffles (the same ``generator`` draws in the same order),
    same Adam (`bayesfl.adam.adam_update_`), same divergence stop and the same epoch
    choice; returns the epoch count of the final training.

    The weight and the bias are stepped as one (C, d + 1) matrix on features with a column of
    ones appended: the mean cross-entropy of a mini-batch of B rows has gradient
    ``((softmax(logits) - onehot(y)) / B)^T [x, 1]``, the number autograd computes, rounded in
    another order (the tests bound the difference against `fine_tune_stopped`).

    Args:
        head: updated in place; ``weight`` (C, d), ``bias`` (C,).
        features: (n, d) in the head's dtype, on the CPU; labels: (n,) class indices.
    """
    n = labels.shape[0]
    with torch.no_grad():
        start = torch.cat([head.weight, head.bias.unsqueeze(1)], dim=1)  # (C, d + 1)
    x = torch.cat([features, features.new_ones(n, 1)], dim=1)
    if tuning.stop == "fixed" or n < 2 or tuning.max_epochs == 0:
        theta = _train_linear(start.clone(), x, labels, tuning.training(tuning.max_epochs),
                              generator)
        _write_linear(head, theta)
        return tuning.max_epochs
    held = min(n - 1, max(1, math.floor(tuning.heldout_fraction * n)))
    order = torch.randperm(n, generator=generator)
    held_idx, fit_idx = order[:held], order[held:]
    x_held, y_held = x[held_idx], labels[held_idx]

    def held_nll(theta: Tensor) -> float:  # mean_nll's number: float64 CE of the logits
        logits = (x_held @ theta.T).to(torch.float64)
        return float(cross_entropy_per_sample(logits, y_held).mean())

    nlls = [held_nll(start)]
    _train_linear(start.clone(), x[fit_idx], labels[fit_idx],
                  tuning.training(tuning.max_epochs), generator,
                  after_epoch=lambda theta: nlls.append(held_nll(theta)))
    best_epochs = min(range(len(nlls)), key=nlls.__getitem__)  # the first of equal minima
    theta = _train_linear(start.clone(), x, labels, tuning.training(best_epochs), generator)
    _write_linear(head, theta)
    return best_epochs


def _write_linear(head: nn.Linear, theta: Tensor) -> None:
    with torch.no_grad():
        head.weight.copy_(theta[:, :-1])
        head.bias.copy_(theta[:, -1])


def linear_ce_gradient(logits: Tensor, x: Tensor, onehot: Tensor) -> Tensor:
    """The gradient (C, p) of the mean cross-entropy of B rows with respect to the matrix
    ``theta`` of ``logits = x @ theta^T``: ``((softmax(logits) - onehot) / B)^T x``.

    Args:
        logits: (B, C), overwritten; x: (B, p); onehot: (B, C) one-hot labels.
    """
    return torch.softmax(logits, dim=1).sub_(onehot).div_(x.shape[0]).T @ x


def _train_linear(theta: Tensor, x: Tensor, labels: Tensor, config: LocalTraining,
                  generator: torch.Generator, after_epoch=None) -> Tensor:
    """`train_plain` of the linear map ``x @ theta^T`` (x with its
    column of ones) by mean cross-entropy: ``theta`` (C, d + 1) updated in place and returned.
    One Adam state for the whole call unless ``config.reset_optimizer_each_epoch``.

    Each epoch gathers its shuffled rows once (features and one-hot labels side by side), so
    a mini-batch is a slice; the divergence check reads the sum of the logits (finite unless
    a logit is not, or they overflow together: then the loss itself decides)."""
    n, d, C = x.shape[0], x.shape[1], theta.shape[0]
    rows = torch.cat([x, torch.nn.functional.one_hot(labels, C).to(x.dtype)], dim=1)
    beta1, beta2 = config.betas
    exp_avg = exp_avg_sq = None
    step = 0
    for epoch in range(config.epochs):
        if exp_avg is None or (config.reset_optimizer_each_epoch and epoch > 0):
            exp_avg, exp_avg_sq, step = torch.zeros_like(theta), torch.zeros_like(theta), 0
        order = torch.randperm(n, generator=generator)
        shuffled = rows[order]
        for batch, first in enumerate(range(0, n, config.batch_size)):
            chunk = shuffled[first : first + config.batch_size]
            xb, onehot = chunk[:, :d], chunk[:, d:]
            logits = xb @ theta.T
            if not math.isfinite(float(logits.sum())):
                loss = cross_entropy_per_sample(logits, onehot.argmax(1)).mean()
                if loss_diverged(loss, generator, epoch=epoch, step=batch,
                                 epochs=config.epochs, lr=config.lr):
                    return theta
            step += 1
            adam_update_(theta, linear_ce_gradient(logits, xb, onehot), exp_avg, exp_avg_sq,
                         float(step),
                         lr=config.lr, beta1=beta1, beta2=beta2, eps=config.eps)
        if after_epoch is not None:
            after_epoch(theta)
    return theta
