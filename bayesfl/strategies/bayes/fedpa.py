"""FedPA (Al-Shedivat, Gillenwater, Xing & Rostamizadeh, ICLR 2021, "Federated Learning via
Posterior Averaging"): the global posterior mode from local posteriors' means and covariances.

**Idea.** With a flat prior the global posterior is the product of the clients' local
posteriors; if they are Gaussian, ``N(mu_k, Sigma_k)``, its mode is the precision-weighted mean
``mu = (sum_k Sigma_k^-1)^-1 sum_k Sigma_k^-1 mu_k``, the minimiser of
``Q(theta) = 1/2 sum_k (theta - mu_k)^T Sigma_k^-1 (theta - mu_k)``. The server never forms it
in one go: every client uploads ``Delta_k = Sigma_k^-1 (mu_k - theta)`` at the current global
``theta``, and the server treats the (weighted) mean of the deltas as a negative
pseudo-gradient of Q and takes a server step, ``theta <- theta + server_lr * mean_k Delta_k``
(with optional heavy-ball momentum), whose fixed point is exactly ``mu`` for uniform weights.
On a linear-Gaussian (least-squares) model with exact local posteriors that fixed point is the
global least-squares solution (tests/bayesfl/strategies/bayes/test_fedpa.py checks both the product
and the iteration).

**Client (IASG).** A client starts from the broadcast ``theta`` and runs plain SGD
(``client_lr``, the run's batch size) for the run's local epochs. The average of the iterates of
one epoch is one approximate posterior sample (iterate-averaged SGD, Mandt et al. 2017); epochs
before ``burn_in_epochs`` (at least the first) give none. From ``l`` samples with mean
``mu_hat`` and sample covariance ``S`` the client forms the shrinkage estimate
``Sigma_hat = rho_l I + (1 - rho_l) S``, ``rho_l = 1 / (1 + (l - 1) rho)``, and computes
``Delta = Sigma_hat^-1 (mu_hat - theta)`` without forming any d x d matrix by the paper's dynamic
program (`posterior_delta`: O(l^2 d), checked against the explicit solve as the authors'
test does). With no sample (``burn_in_rounds`` not reached yet, or too few epochs) the client
sends the FedAvg delta, last iterate minus ``theta``, as the reference code does.

**The delta's scale (``normalize_delta``).** The shrinkage target is the identity, whose unit
scale has nothing to do with the spread of the IASG samples, and ``S`` has rank ``l - 1``: on
every direction orthogonal to the samples' deviations (all but ``l - 1`` of the network's
P = 79,510), ``Sigma_hat = rho_l I`` and ``Sigma_hat^-1 (mu_hat - theta)`` is ``(1 + (l - 1)
rho) (mu_hat - theta)``: FedAvg's step on the samples' mean, made ``1 / rho_l`` times longer
(4 times with rho = 1 and l = 4 samples of 5 epochs), a factor set by the number of local
epochs. The paper absorbs it in server learning rates tuned per task and in
FedAvg burn-in rounds; with ``server_lr = 1`` and no burn-in it overshoots (FedSI small
regime, 5 rounds x 5 epochs, 3 seeds: 43.2 % accuracy against FedAvg's 87.6 %; normalised:
85.4 %, ``bench/bayes_baselines.py``). By default a client therefore
uploads ``rho_l Sigma_hat^-1 (mu_hat - theta) = (I + (1 - rho_l) / rho_l S)^-1 (mu_hat -
theta)``: FedAvg's step off the samples' span and a shorter one along the directions in
which they spread. All clients of a round have the same ``l``, so the fixed
point of the server iteration, ``sum_k w_k Sigma_hat_k^-1 (mu_hat_k - theta) = 0``, is
unchanged. ``normalize_delta = False`` uploads the paper's ``Delta`` (then tune ``server_lr``,
e.g. ``rho_l``).

**Posterior and predictions.** FedPA estimates only the mode of the global posterior. For a
posterior predictive the client uses ``N(theta, Sigma_swag)``: the broadcast mode with the
covariance of its own IASG samples of its last round in SWAG's form (Maddox et al. 2019):
``1/2 (diag(s^2) + D^T D / (l - 1))``, ``D`` the samples' deviations from their mean
([`inference.NetworkGaussian`][inference.NetworkGaussian]). This is our choice, not the
paper's: with no samples (l = 0) the covariance is zero and the predictive equals the plug-in.
Headline: the MC average over ``mc_samples`` (32) draws; ``map_plugin``: softmax at ``theta``.

**Defaults** (the paper tunes them per data set): ``client_lr = 0.05``, ``rho = 1`` (the
reference's default shrinkage), ``burn_in_epochs = 1``, ``burn_in_rounds = 0``,
``server_lr = 1``, ``server_momentum = 0``, ``normalize_delta = True``, deltas weighted by
sample counts (the reference's default client weight).

**What an upload must satisfy**: a sample count >= 1, not above the client's first declared one
nor ``screening_ratio`` (10) times the round's median, and a delta norm within
``screening_ratio`` times the round's median (schema: names, shapes, float32, finite).

Registry name: ``fedpa``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bayesfl.data.clients import ClientData
from bayesfl.errors import ConfigError
from bayesfl.messages import Message
from bayesfl.strategies.base import (
    ClientConfig,
    ClientState,
    RoundPlan,
    ServerState,
    StrategyContext,
    model_state,
)
from bayesfl.strategies.bayes.baseline import (
    MC_SAMPLES,
    NetworkGaussianBaseline,
    screening_option,
)
from bayesfl.strategies.options import option_integer, option_number
from bayesfl.strategies.registry import Option, register_strategy
from bayesfl.strategies.robust import DECLARED
from bayesfl.training import loss_diverged
from inference.network_gaussian import (
    NetworkGaussian,
    Prepare,
    flatten,
    parameter_layout,
    unflatten,
)

DELTA, MOMENTUM = "delta.", "momentum."
SAMPLES, COUNT = "iasg.samples", "iasg.count"
"""Client-state keys: the IASG samples of the client's last round, (L, P) with L the most a
round can give (its first ``iasg.count`` rows hold them), for the SWAG covariance; the shapes
stay fixed (a checkpoint restores client states by their initial layout)."""


def shrinkage_weight(num_samples: int, rho: float) -> float:
    """``rho_l = 1 / (1 + (l - 1) rho)``, the weight of the identity in the shrinkage estimate."""
    return 1.0 / (1.0 + (num_samples - 1) * rho)


def posterior_delta(theta: Tensor, samples: Sequence[Tensor], rho: float) -> Tensor:
    """``Sigma_hat^-1 (mu_hat - theta)`` for flat samples ``samples`` (l of (P,)) by the FedPA
    dynamic program (paper §4, Appendix C): O(l^2 P) time, O(l P) memory, in float64.

    ``Sigma_hat = rho_l I + (1 - rho_l) S`` with ``S`` the unbiased sample covariance and
    ``rho_l = 1 / (1 + (l - 1) rho)``; for l = 1 it is the identity. The recursion keeps
    ``Delta_n`` and, per sample, ``v_k = S_{k-1}'^-1 u_k`` (``u_k`` the k-th sample's deviation
    from the mean of the previous ones) with ``v_k . u_k``, each new sample being a rank-one
    (Sherman-Morrison) update of the previous inverse.

    Args:
        theta: (P,) the point the delta is taken from (the broadcast global parameters).
        samples: l >= 1 flat samples (P,).
        rho: the shrinkage coefficient >= 0.
    Returns:
        (P,) float64.
    """
    if len(samples) == 0:
        raise ConfigError("posterior_delta needs at least one sample")
    theta = theta.to(torch.float64)
    mean = samples[0].to(torch.float64).clone()
    delta = mean - theta
    vs: list[Tensor] = []
    dots: list[float] = []
    for count, raw in enumerate(samples[1:], start=2):
        sample = raw.to(torch.float64)
        scaled = delta / (1 + (count - 2) * rho)
        u = sample - mean
        mean = mean + u / count
        v = u.clone()
        for k, (vk, dot) in enumerate(zip(vs, dots, strict=True), start=2):
            gamma = rho * (k - 1) / k
            v = v - gamma * float(vk @ u) / (1 + gamma * dot) * vk
        dot_vu = float(v @ u)
        vs.append(v)
        dots.append(dot_vu)
        gamma = rho * (count - 1) / count
        coeff = 1 - gamma * (count * float(scaled @ u) + dot_vu) / (1 + gamma * dot_vu)
        delta = (scaled + coeff * v / count) * (1 + (count - 1) * rho)
    return delta


def client_delta(theta: Tensor, samples: Sequence[Tensor], rho: float,
                 normalize: bool = True) -> Tensor:
    """A client's upload from l >= 1 samples: ``Sigma_hat^-1 (mu_hat - theta)``
    (`posterior_delta`), times ``rho_l`` when ``normalize`` (module docstring: then a
    sample spread of zero gives ``mu_hat - theta``, FedAvg's delta on the samples' mean).

    Args: theta (P,), samples l of (P,), rho >= 0. Returns: (P,) float64."""
    delta = posterior_delta(theta, samples, rho)
    return delta * shrinkage_weight(len(samples), rho) if normalize else delta


def server_step(
    params: Mapping[str, Tensor],
    deltas: Sequence[Mapping[str, Tensor]],
    weights: Tensor,
    lr: float,
    momentum: float = 0.0,
    buffers: Mapping[str, Tensor] | None = None,
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """One FedPA server step: ``m <- momentum m + sum_k w_k Delta_k``, ``theta <- theta + lr m``
    (``m`` the weighted mean delta without momentum). Weights are normalised here.

    Returns: (new params, new momentum buffers), float64 computations cast back to each
    parameter's dtype."""
    w = weights.to(torch.float64) / weights.to(torch.float64).sum()
    new, new_buffers = {}, {}
    for name, old in params.items():
        stacked = torch.stack([d[name].to(torch.float64) for d in deltas])
        step = (w.view(-1, *[1] * old.dim()) * stacked).sum(0)
        if momentum > 0:
            previous = (buffers or {}).get(name)
            if previous is not None:
                step = momentum * previous.to(torch.float64) + step
            new_buffers[name] = step.to(old.dtype)
        new[name] = (old.to(torch.float64) + lr * step).to(old.dtype)
    return new, new_buffers


def swag_covariance(samples: Tensor, theta: Tensor) -> tuple[Tensor, Tensor | None]:
    """``(variance (P,), factor (l, P))`` of SWAG's ``1/2 (diag(s^2) + D^T D / (l - 1))`` from
    (l, P) samples, in ``theta``'s dtype: zero variance and no factor for l < 2 (l = 1 spreads
    nothing either)."""
    samples = samples.to(torch.float64)
    if samples.shape[0] < 2:
        return torch.zeros(theta.shape[0], dtype=theta.dtype), None
    deviations = samples - samples.mean(0)
    variance = 0.5 * deviations.square().mean(0)
    factor = deviations / (2 * (samples.shape[0] - 1)) ** 0.5
    return variance.to(theta.dtype), factor.to(theta.dtype)


def swag_gaussian(model: nn.Module, theta: Tensor, samples: Tensor, *, n_samples: int,
                  input_shape: tuple[int, ...] | None,
                  prepare: Prepare | None = None) -> NetworkGaussian:
    """``N(theta, 1/2 (diag(s^2) + D^T D / (l - 1)))`` from (l, P) samples (SWAG's form,
    `swag_covariance`); zero covariance for l < 2."""
    return NetworkGaussian(model, theta, *swag_covariance(samples, theta), n_samples=n_samples,
                           input_shape=input_shape, prepare=prepare)


@register_strategy("fedpa",
                   broadcast="global network θ",
                   upload="posterior delta Σ⁻¹(μ − θ), `num_samples`",
                   aggregate="server step on the mean delta; screens delta norm")
class FedPA(NetworkGaussianBaseline):
    """FedPA: IASG local posteriors, precision-weighted deltas, a server step (module docstring).

    Options: declared once, as data, in ``OPTIONS`` (types, defaults, bounds, help);
    their table is on the family's docs page and in ``bayesfl strategies NAME``
    (generated by ``python -m bayesfl.strategies.listing``).
    """

    server_only = (DECLARED, MOMENTUM)
    upload_prefix = DELTA
    update_norm_label = "delta norm"
    predict_seed_tag = 19

    OPTIONS: ClassVar[tuple[Option, ...]] = (
        Option("client_lr", float, 0.05,
               "SGD learning rate of local training (IASG).",
               minimum=1e-12),
        Option("rho", float, 1.0,
               "shrinkage coefficient of the covariance estimate (>= 0; 0 gives FedAvg's "
               "delta).",
               minimum=0.0),
        Option("burn_in_epochs", int, 1,
               "local epochs before the first sample (at least 1, as the reference).",
               minimum=1),
        Option("burn_in_rounds", int, 0,
               "rounds that send FedAvg deltas before posterior averaging starts (rounds 1..b "
               "draw no IASG sample; 0: every round samples).",
               minimum=0),
        Option("server_lr", float, 1.0,
               "server step size.",
               minimum=1e-12),
        Option("server_momentum", float, 0.0,
               "heavy-ball momentum of the server step in [0, 1).",
               minimum=0.0),
        Option("normalize_delta", bool, True,
               "upload `rho_l Delta` (FedAvg's step where the samples do not spread) instead of "
               "the paper's `Delta` (module docstring)."),
        Option("weighted", bool, True,
               "weight the deltas by sample counts (else uniformly: the exact product of the "
               "local posteriors)."),
        MC_SAMPLES,
        screening_option("delta norm"),
    )

    def __init__(
        self,
        context: StrategyContext,
        *,
        client_lr: float = 0.05,
        rho: float = 1.0,
        burn_in_epochs: int = 1,
        burn_in_rounds: int = 0,
        server_lr: float = 1.0,
        server_momentum: float = 0.0,
        normalize_delta: bool = True,
        weighted: bool = True,
        mc_samples: int = 32,
        screening_ratio: float | None = 10.0,
    ) -> None:
        super().__init__(context, mc_samples=mc_samples, weighted=weighted,
                         screening_ratio=screening_ratio)
        self.client_lr = option_number(self.name, "client_lr", client_lr, minimum=1e-12)
        self.rho = option_number(self.name, "rho", rho)
        self.burn_in_epochs = option_integer(self.name, "burn_in_epochs", burn_in_epochs, 1)
        self.burn_in_rounds = option_integer(self.name, "burn_in_rounds", burn_in_rounds, 0)
        self.server_lr = option_number(self.name, "server_lr", server_lr, minimum=1e-12)
        self.server_momentum = option_number(self.name, "server_momentum", server_momentum)
        if self.server_momentum >= 1:
            raise ConfigError(f"fedpa server_momentum must be in [0, 1), got {server_momentum!r}")
        if not isinstance(normalize_delta, bool):
            raise ConfigError("fedpa normalize_delta must be true or false, got "
                              f"{normalize_delta!r}")
        self.normalize_delta = normalize_delta

    # ==== server half ======================================================================
    def init(self) -> ServerState:
        return {n: p.detach().clone() for n, p in self.initial_network().named_parameters()}

    def parameters(self, state: ServerState) -> dict[str, Tensor]:
        """The global parameters ``theta`` (the broadcast: no momentum, no declarations)."""
        return self.broadcast_tensors(state, 0)

    def update_norms(self, plan: RoundPlan, messages: Sequence[Message]) -> Tensor:
        """(K,) float64: the norm of each upload's delta."""
        return torch.tensor([
            sum(float(v.to(torch.float64).square().sum()) for k, v in m.tensors.items()
                if k.startswith(DELTA)) ** 0.5 for m in messages], dtype=torch.float64)

    def combine(self, state: ServerState, uploads: Sequence[Message], weights: Tensor,
                round: int) -> dict[str, Tensor]:
        """`server_step` with the uploads' deltas (and the momentum buffers)."""
        params = self.parameters(state)
        deltas = [{k: m.tensors[DELTA + k] for k in params} for m in uploads]
        buffers = {k[len(MOMENTUM):]: v for k, v in state.items() if k.startswith(MOMENTUM)}
        new, new_buffers = server_step(params, deltas, weights, self.server_lr,
                                       self.server_momentum, buffers)
        new.update({MOMENTUM + k: v for k, v in new_buffers.items()})
        return new

    # ==== client half ======================================================================
    @property
    def max_samples(self) -> int:
        """The most IASG samples one round gives: one per epoch from ``burn_in_epochs`` on."""
        return max(0, self.context.training.epochs - self.burn_in_epochs)

    def init_client(self, config: ClientConfig) -> ClientState:
        state = super().init_client(config)
        size = sum(p.numel() for p in self.template(config.body).parameters())
        state[SAMPLES] = torch.zeros(self.max_samples, size)
        state[COUNT] = torch.zeros(1, dtype=torch.int64)
        return state

    def _global_model(self, config: ClientConfig, state: ClientState,
                      broadcast: Message) -> nn.Module:
        model = self.client_model(config, state)
        params = dict(model.named_parameters())
        received = self.received(broadcast, {n: p.shape for n, p in params.items()}, "network")
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(received[name])
        return model

    def fit(
        self,
        config: ClientConfig,
        state: ClientState,
        data: ClientData,
        broadcast: Message,
        generator: torch.Generator,
    ) -> tuple[ClientState, Message]:
        """IASG from the broadcast parameters, then the posterior delta (module docstring)."""
        model = self._global_model(config, state, broadcast)
        layout = parameter_layout(model)
        theta = flatten(dict(model.named_parameters()), layout).detach().clone()
        samples, last = self.iasg(model, data, generator, broadcast.header.round)
        if samples:
            delta = client_delta(theta, samples, self.rho, self.normalize_delta)
        else:
            delta = last.to(torch.float64) - theta.to(torch.float64)
        tensors = {DELTA + k: v.to(torch.float32) for k, v in unflatten(delta, layout).items()}
        new_state = model_state(model)
        stacked = torch.zeros(self.max_samples, theta.shape[0])
        if samples:
            stacked[: len(samples)] = torch.stack(samples).to(torch.float32)
        new_state[SAMPLES] = stacked
        new_state[COUNT] = torch.tensor([len(samples)], dtype=torch.int64)
        return new_state, self.upload(broadcast, config, data, tensors)

    def iasg(self, model: nn.Module, data: ClientData, generator: torch.Generator,
             round: int) -> tuple[list[Tensor], Tensor]:
        """Local SGD; returns the per-epoch iterate averages that count as samples and the
        last iterate (flat)."""
        layout = parameter_layout(model)
        params = [p for _, p in model.named_parameters()]
        training = self.context.training
        n, x, y = data.num_train, data.train_x, data.train_y
        sampling = round > self.burn_in_rounds  # rounds count from 1: b rounds draw none
        samples: list[Tensor] = []
        model.train()
        for epoch in range(training.epochs):
            total, steps = None, 0
            order = torch.randperm(n, generator=generator).to(x.device)
            for step, start in enumerate(range(0, n, training.batch_size)):
                idx = order[start : start + training.batch_size]
                loss = F.cross_entropy(model(x[idx]), y[idx])
                if loss_diverged(loss, generator, epoch=epoch, step=step,
                                 epochs=training.epochs, lr=self.client_lr):
                    return samples, flatten(dict(model.named_parameters()), layout).detach()
                for p in params:
                    p.grad = None
                loss.backward()
                with torch.no_grad():  # torch.optim.SGD's plain step, without its first use's
                    for p in params:  # import of torch._dynamo (seconds per Flower message)
                        if p.grad is not None:
                            p.add_(p.grad, alpha=-self.client_lr)
                flat = flatten(dict(model.named_parameters()), layout).detach().to(torch.float64)
                total = flat if total is None else total + flat
                steps += 1
            if sampling and epoch >= self.burn_in_epochs and steps:
                samples.append(total / steps)
        last = flatten(dict(model.named_parameters()), layout).detach()
        return samples, last

    def posterior(
        self, config: ClientConfig, state: ClientState, broadcast: Message
    ) -> NetworkGaussian:
        """``N(theta, Sigma_swag)``: the broadcast mode with the SWAG covariance of this
        client's last IASG samples (module docstring)."""
        model = self._global_model(config, state, broadcast)
        theta = flatten(dict(model.named_parameters()), parameter_layout(model)).detach()
        samples = state[SAMPLES][: int(state[COUNT].item())]
        return self.network_gaussian(model, theta, *swag_covariance(samples, theta))


__all__ = ["FedPA", "client_delta", "posterior_delta", "server_step", "shrinkage_weight",
           "swag_covariance", "swag_gaussian"]
