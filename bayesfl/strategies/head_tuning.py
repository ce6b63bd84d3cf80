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
to run every round (`bayesfl.strategies.fedsi.fedsi`'s per-round view); `tune_heads` tunes
a group of clients' heads at once, stacked where they have the same shapes (the same numbers
as `tune_head` of each, in a tenth of the kernel calls).
`fine_tune_stopped` is the same rule for any module and any of its parameters (FedBABU,
FedAvg-FT: `bayesfl.strategies.averaging.finetuning`).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
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


def tune_heads(heads: Sequence[nn.Module], features: Sequence[Tensor], labels: Sequence[Tensor],
               tuning: HeadTuning, generators: Sequence[torch.Generator]) -> list[int]:
    """`tune_head` of each client ``k`` (``heads[k]`` in place on ``features[k]`` (n_k, d) and
    ``labels[k]`` (n_k,), drawing from ``generators[k]``); returns each final epoch count.

    Where every head is `tune_linear_head`'s kind with the same shapes and dtype and the stop
    is ``"heldout_nll"``, they are tuned together (`_tune_linear_stacked`): each client's own
    held-out split, shuffles (its generator's draws in the same order), Adam and epoch choice,
    its mini-batch products as one batched product. ~10 small kernels a step for the group
    instead of a client (FedSI's per-round view of S1's 10 clients: 0.6 -> 0.3 CPU-s a
    round; 0.15 -> 0.10 with the logits transposed, classes on a non-last axis, where torch's
    CPU softmax is ~10x cheaper at C = 10); the numbers are each client's
    `tune_linear_head`'s up to the rounding of the batched, transposed products and of that
    softmax (the tests bound it: ~4e-7 on S1's heads). Otherwise, or where a mini-batch's
    logits are not finite (the divergence stop is per client), one by one."""
    count = len(heads)
    if not count == len(features) == len(labels) == len(generators):
        raise ValueError("tune_heads needs one head, feature matrix, label vector and "
                         "generator per client")
    stackable = (count > 1 and tuning.stop == "heldout_nll" and tuning.max_epochs > 0
                 and all(linear_head_tunable(h, f, y)
                         for h, f, y in zip(heads, features, labels, strict=True))
                 and len({(tuple(f.shape), f.dtype, h.out_features)
                          for h, f in zip(heads, features, strict=True)}) == 1
                 and features[0].shape[0] >= 2)
    if stackable:
        states = [g.get_state() for g in generators]
        epochs = _tune_linear_stacked(heads, features, labels, tuning, generators)
        if epochs is not None:
            return epochs
        for generator, state in zip(generators, states, strict=True):  # start again, each alone
            generator.set_state(state)
    return [tune_head(h, f, y, tuning, g)
            for h, f, y, g in zip(heads, features, labels, generators, strict=True)]


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


def _tune_linear_stacked(heads: Sequence[nn.Linear], features: Sequence[Tensor],
                         labels: Sequence[Tensor], tuning: HeadTuning,
                         generators: Sequence[torch.Generator]) -> list[int] | None:
    """`tune_linear_head` of K same-shaped heads at once (`tune_heads`); None, with no head
    changed, where a mini-batch's logits are not finite (the caller then tunes one by one)."""
    n = labels[0].shape[0]
    with torch.no_grad():
        start = torch.stack([torch.cat([h.weight, h.bias.unsqueeze(1)], dim=1) for h in heads])
    x = torch.stack([torch.cat([f, f.new_ones(n, 1)], dim=1) for f in features])  # (K, n, p)
    y = torch.stack(list(labels))
    held = min(n - 1, max(1, math.floor(tuning.heldout_fraction * n)))
    orders = torch.stack([torch.randperm(n, generator=g) for g in generators])
    x_held, y_held = _rows(x, orders[:, :held]), _rows(y, orders[:, :held])

    def held_nll(theta: Tensor) -> Tensor:  # (K,): each client's mean_nll
        # the logits transposed, (K, C, held), for the log-softmax along a non-last axis (as
        # in _train_linear_stacked: ~10x cheaper at C = 10)
        logits = torch.bmm(theta, x_held.transpose(1, 2)).to(torch.float64)
        log_probs = torch.log_softmax(logits, dim=1)
        return -log_probs.gather(1, y_held.unsqueeze(1)).squeeze(1).mean(1)

    nlls = [held_nll(start)]
    fitted = _train_linear_stacked(start.clone(), _rows(x, orders[:, held:]),
                                   _rows(y, orders[:, held:]),
                                   tuning.training(tuning.max_epochs), generators,
                                   [tuning.max_epochs] * len(heads),
                                   after_epoch=lambda theta: nlls.append(held_nll(theta)))
    if fitted is None:
        return None
    table = torch.stack(nlls).tolist()  # (epochs + 1, K)
    best = [min(range(len(table)), key=lambda e, k=k: table[e][k])  # the first of equal minima
            for k in range(len(heads))]
    # the longest final trainings first: the clients still training are always a prefix
    order = sorted(range(len(heads)), key=lambda k: -best[k])
    theta = _train_linear_stacked(start[order], x[order], y[order],
                                  tuning.training(max(best)), [generators[k] for k in order],
                                  [best[k] for k in order])
    if theta is None:
        return None
    for position, k in enumerate(order):
        _write_linear(heads[k], theta[position])
    return best


def _rows(values: Tensor, index: Tensor) -> Tensor:
    """``values[k, index[k]]`` for each k: (K, n, ...) by (K, r) int64 -> (K, r, ...)."""
    count, rows = values.shape[0], values.shape[1]
    flat = (index + torch.arange(count)[:, None] * rows).reshape(-1)
    return values.reshape(count * rows, *values.shape[2:]).index_select(0, flat).view(
        count, index.shape[1], *values.shape[2:])


def _train_linear_stacked(theta: Tensor, x: Tensor, labels: Tensor, config: LocalTraining,
                          generators: Sequence[torch.Generator], epochs: Sequence[int],
                          after_epoch=None) -> Tensor | None:
    """`_train_linear` of K heads ``theta`` (K, C, p), in place, on ``x`` (K, n, p) and
    ``labels`` (K, n): client k trains ``epochs[k]`` epochs (non-increasing in k) drawing its
    shuffles from ``generators[k]``; one Adam state per client, never reset. Returns
    ``theta``, or None at the first mini-batch whose logits are not finite."""
    if config.reset_optimizer_each_epoch or list(epochs) != sorted(epochs, reverse=True):
        raise ValueError("_train_linear_stacked: one Adam state a client, longest first")
    _, n, p = x.shape
    num_classes = theta.shape[1]
    rows = torch.cat([x, torch.nn.functional.one_hot(labels, num_classes).to(x.dtype)], dim=2)
    beta1, beta2 = config.betas
    exp_avg, exp_avg_sq = torch.zeros_like(theta), torch.zeros_like(theta)
    step = 0
    for epoch in range(max(epochs, default=0)):
        active = sum(e > epoch for e in epochs)  # clients 0..active-1 train this epoch
        order = torch.stack([torch.randperm(n, generator=generators[k])
                             for k in range(active)])
        shuffled = _rows(rows[:active], order)
        for first in range(0, n, config.batch_size):
            chunk = shuffled[:, first : first + config.batch_size]
            xb, onehot = chunk[:, :, :p], chunk[:, :, p:]
            # the logits transposed, (active, C, B): torch's CPU softmax along a non-last axis
            # is ~7 us at S1's size, along the last (C = 10 classes of (active B, C)) ~100 us
            logits = torch.bmm(theta[:active], xb.transpose(1, 2))
            if not math.isfinite(float(logits.sum())):
                return None
            step += 1
            # linear_ce_gradient of each client: ((softmax - onehot) / B)^T x
            probs = torch.softmax(logits, dim=1)
            gradient = torch.bmm(probs.sub_(onehot.transpose(1, 2)).div_(xb.shape[1]), xb)
            adam_update_(theta[:active], gradient, exp_avg[:active], exp_avg_sq[:active],
                         float(step), lr=config.lr, beta1=beta1, beta2=beta2, eps=config.eps)
        if after_epoch is not None:
            after_epoch(theta)
    return theta
