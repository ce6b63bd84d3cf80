"""Plumbing of strategies whose clients keep *personal* networks that are never averaged
(CoLearn, FD): independent initialisation, Adam state kept across rounds, per-class means.

* **Independent initialisation** (``independent_init=True``): client k's network is drawn
  from a seed derived from its body's init seed and k, as the CoLearn paper's "independent
  random w_u" (Algorithm 1); ``False`` keeps the contract's default (one init per body spec).
* **Adam across rounds** (``keep_optimizer=True``): the client state holds Adam's moments
  (``optim.exp_avg.<param>``, ``optim.exp_avg_sq.<param>``) and step count (``optim.step``,
  shape (1,)); local training resumes them, so a personal model trains as if its rounds were
  one long run (open in the CoLearn paper). ``False`` follows the run's
  `LocalTraining` (a fresh Adam per round, reset per epoch when it
  says so). The update is ``torch.optim.Adam``'s own (`bayesfl.adam.Adam`, bit for bit).
* **Per-class means** (`class_means`): float64 sums over the global class list; a class
  without samples has count 0 and a zero row (never NaN).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from bayesfl.adam import Adam
from bayesfl.data.clients import ClientData
from bayesfl.errors import ConfigError
from bayesfl.strategies.base import (
    ClientConfig,
    ClientState,
    Strategy,
    StrategyContext,
    derived_seed,
    model_state,
)
from bayesfl.training import loss_diverged

OPTIM_PREFIX = "optim."
LOSS_PREFIX = "loss."

BatchTerms = Callable[[nn.Module, Tensor, Tensor, torch.Generator],
                      tuple[dict[str, Tensor], Tensor]]
"""``terms(model, x (B, ...), y (B,), generator) -> ({name: per-sample term (B,)}, features
(B, d))``: the unweighted loss terms and the batch's features (detached by the caller)."""


def class_means(features: Tensor, labels: Tensor, num_classes: int) -> tuple[Tensor, Tensor]:
    """Per-class means of ``features`` (n, d) by ``labels`` (n,) over ``num_classes`` classes.

    Returns:
        means (C, d) float64 (zero rows for absent classes) and counts (C,) int64.
    """
    counts = torch.bincount(labels, minlength=num_classes)
    sums = torch.zeros(num_classes, features.shape[1], dtype=torch.float64,
                       device=features.device)
    sums.index_add_(0, labels, features.to(torch.float64))
    return sums / counts.clamp_min(1).to(sums)[:, None], counts.to(torch.int64)


class PersonalStrategy(Strategy):
    """A strategy of personal networks (module docstring): options ``independent_init`` and
    ``keep_optimizer``, the client state's optimiser and loss-log entries, the training loop.

    Subclasses declare the per-batch loss terms in `LOSS_TERMS` and their weights in
    `loss_weights`; the mini-batch loss is the batch mean of ``sum_k w_k term_k``. Each
    term's unweighted mean over the last local epoch is logged in the client state as
    ``loss.<term>``, shape (1,) float64 (each term apart).
    """

    LOSS_TERMS: tuple[str, ...] = ("ce",)

    def loss_weights(self) -> dict[str, float]:
        """Weight of every term of `LOSS_TERMS` (default 1 each)."""
        return dict.fromkeys(self.LOSS_TERMS, 1.0)

    def __init__(self, context: StrategyContext, *, independent_init: bool = True,
                 keep_optimizer: bool = True) -> None:
        super().__init__(context)
        for option, value in (("independent_init", independent_init),
                              ("keep_optimizer", keep_optimizer)):
            if not isinstance(value, bool):
                raise ConfigError(f"{self.name} {option} must be true or false, got {value!r}")
        self.independent_init = independent_init
        self.keep_optimizer = keep_optimizer

    # ---- client state ---------------------------------------------------------------------
    def init_client(self, config: ClientConfig) -> ClientState:
        """Network, zero Adam state (with ``keep_optimizer``) and zero loss logs."""
        if self.independent_init:
            config = ClientConfig(config.client_id, config.body,
                                  derived_seed(config.init_seed, 23, config.client_id))
        model = self.initial_model(config)
        state = model_state(model)
        if self.keep_optimizer:
            for name, p in model.named_parameters():
                state[f"{OPTIM_PREFIX}exp_avg.{name}"] = torch.zeros_like(p.detach())
                state[f"{OPTIM_PREFIX}exp_avg_sq.{name}"] = torch.zeros_like(p.detach())
            state[OPTIM_PREFIX + "step"] = torch.zeros(1)
        for term in self.LOSS_TERMS:
            state[LOSS_PREFIX + term] = torch.zeros(1, dtype=torch.float64)
        return state

    def _optimizer(self, model: nn.Module, state: ClientState) -> Adam:
        t = self.context.training
        named = list(model.named_parameters())
        opt = Adam([p for _, p in named], lr=t.lr, betas=t.betas, eps=t.eps)
        if self.keep_optimizer and float(state[OPTIM_PREFIX + "step"]) > 0:
            step = state[OPTIM_PREFIX + "step"].reshape(()).to(torch.float32).cpu()
            for name, p in named:
                opt.state[p] = {
                    "step": step.clone(),
                    "exp_avg": state[f"{OPTIM_PREFIX}exp_avg.{name}"].clone().to(p),
                    "exp_avg_sq": state[f"{OPTIM_PREFIX}exp_avg_sq.{name}"].clone().to(p)}
        return opt

    def _saved_optimizer(self, model: nn.Module, opt: Adam,
                         old: ClientState) -> ClientState:
        if not self.keep_optimizer:
            return {}
        out: ClientState = {}
        step = old[OPTIM_PREFIX + "step"].clone()
        for name, p in model.named_parameters():
            slot = opt.state.get(p)
            if not slot:  # no step taken this round: keep what was there
                out[f"{OPTIM_PREFIX}exp_avg.{name}"] = old[f"{OPTIM_PREFIX}exp_avg.{name}"]
                out[f"{OPTIM_PREFIX}exp_avg_sq.{name}"] = old[f"{OPTIM_PREFIX}exp_avg_sq.{name}"]
                continue
            out[f"{OPTIM_PREFIX}exp_avg.{name}"] = slot["exp_avg"].detach().clone()
            out[f"{OPTIM_PREFIX}exp_avg_sq.{name}"] = slot["exp_avg_sq"].detach().clone()
            step = torch.as_tensor(slot["step"], dtype=torch.float32).reshape(1).clone()
        out[OPTIM_PREFIX + "step"] = step.to(old[OPTIM_PREFIX + "step"])
        return out

    # ---- training -------------------------------------------------------------------------
    def train_personal(
        self,
        model: nn.Module,
        state: ClientState,
        data: ClientData,
        terms: BatchTerms,
        generator: torch.Generator,
        on_last_epoch: Callable[[Tensor, Tensor], None] | None = None,
    ) -> ClientState:
        """Train ``model`` in place for the run's local epochs in shuffled mini-batches
        (one ``randperm`` of ``generator`` per epoch, as `bayesfl.training.train_plain`).

        Args:
            model: the client network (mutated).
            state: the client's state before the round (optimiser and loss entries read).
            data: the client's data.
            terms: the per-sample loss terms of a mini-batch (`BatchTerms`).
            generator: the client's generator of the round.
            on_last_epoch: called with ``(indices (B,), features (B, d) detached)`` of every
                mini-batch of the last epoch (statistics collected on the fly).

        Returns:
            The state entries besides the network: optimiser state, ``loss.<term>``.
        """
        t = self.context.training
        x, y = data.train_x, data.train_y
        n = x.shape[0]
        opt = self._optimizer(model, state)
        weights = self.loss_weights()
        sums = {k: 0.0 for k in self.LOSS_TERMS}
        seen = 0
        model.train()
        for epoch in range(t.epochs):
            if epoch > 0 and t.reset_optimizer_each_epoch and not self.keep_optimizer:
                opt = self._optimizer(model, state)
            order = torch.randperm(n, generator=generator).to(x.device)
            for step, start in enumerate(range(0, n, t.batch_size)):
                idx = order[start : start + t.batch_size]
                parts, features = terms(model, x[idx], y[idx], generator)
                loss = sum(weights[k] * parts[k] for k in self.LOSS_TERMS).mean()
                if loss_diverged(loss, generator, epoch=epoch, step=step, epochs=t.epochs,
                                 lr=t.lr):
                    break
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                if epoch == t.epochs - 1:
                    for k in sums:
                        sums[k] += float(parts[k].detach().sum())
                    seen += len(idx)
                    if on_last_epoch is not None:
                        on_last_epoch(idx, features.detach())
            else:
                continue
            break  # the loss diverged: the model stays as of the last finite mini-batch
        logs = {LOSS_PREFIX + k: torch.tensor([v / max(seen, 1)], dtype=torch.float64)
                for k, v in sums.items()}
        return {**self._saved_optimizer(model, opt, state), **logs}


def loss_log(state: ClientState) -> dict[str, float]:
    """The ``loss.<term>`` entries of a client state as floats (the last round's means)."""
    return {k[len(LOSS_PREFIX):]: float(v) for k, v in state.items()
            if k.startswith(LOSS_PREFIX)}
