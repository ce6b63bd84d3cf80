"""FedPop (Kotelevskii, Vono, Durmus & Moulines, NeurIPS 2022, "FedPop: A Bayesian Approach
for Personalised Federated Learning"): a shared deterministic body, a personal Bayesian head.

**Model.** Every client k shares the body ``phi`` and a population prior over personal heads,
``z_k ~ N(m, s^2 I)`` (``m`` (C, d + 1), bias column first, ``s`` a scalar), both learned by the
federation; given its head, client k's labels follow ``softmax(z_k [1, phi(x)])``.

**Round** (the paper's Algorithm 1 with Gaussian prior and a linear head). Client k receives
``phi``, ``m`` and ``s``, computes its training features, and draws its head from the personal
posterior ``p(z_k | D_k, phi, m, s)`` with SGLD (`inference.sgld`: Laplace-preconditioned
Welling-Teh steps started at the posterior mode; ``sgld_burn_in`` steps, then ``sgld_samples``
draws one every ``sgld_thinning`` steps). Holding the draws fixed, it then trains ``phi``, ``m``
and ``log s`` for the run's local epochs with Adam on the Monte Carlo estimate of the negative
log joint, per mini-batch ``mean_draws CE(z [1, phi(x)], y) - mean_draws log N(z; m, s^2) / n_k``,
and uploads ``phi``, ``m`` and ``s``. The server averages them, weighted by sample counts.

**Predictions.** Client k averages the softmax over its head draws on the global body's features
(headline; `inference.EnsemblePosterior`) and reports the softmax of the draws' mean head
as ``map_plugin``. During training the draws a client evaluates with are those of its last round
(sampled under that round's body); after the last round every client (also one that never
trained) draws ``final_samples`` heads under the final body (``personalize``), and the final
metrics use those.

**The predictive against the plug-in** (digits, 5 iid clients, one thread, seeds 0-2; measured
at commit ``216b180``, whose message states the outcome; not stored). After a few rounds the
predictive is worse calibrated than its plug-in, and still after 10; after 20 its NLL is the
lower at every seed. The draws are right: their variances match the Laplace variances at the
mode, and a much longer chain's predictive is as under-confident. What changes is the
population prior: its std ``s`` is learnt by Adam at the run's rate, so it moves by at most
about ``lr`` per step in ``log s``, and comes down from 1 only over the rounds (the message has
its values). Early on, the heads' posterior is as wide as ``s = 1`` allows, around a plug-in
that is under-confident already, which averaging over the draws makes more so.

**Choices the paper leaves open, as options with their defaults.** The prior's initial mean 0
and std ``prior_std_init = 1``; a scalar prior std; ``sgld_step_size = 0.05`` (the Laplace
preconditioner's default of `inference.sgld`), ``sgld_burn_in = 50``, ``sgld_samples =
20``, ``sgld_thinning = 3`` per round (110 steps, about three autocorrelation times ``2 / 0.05``
of the preconditioned chain: the draws only feed a Monte Carlo gradient and the next round's
predictions) and ``final_samples = 100`` (thinning 5 after 100 steps of burn-in) after
training; Newton's search for the mode starts at the client's last mode; full-batch
gradients (clients of the FedSI regime hold 250 images). The body and prior use the run's
Adam learning rate (FedSI paper: 1e-3 for the baselines).

**What an upload must satisfy** (besides the schema: names, shapes, float32, finite): a sample
count >= 1, not above the client's first declared one nor ``screening_ratio`` (10) times the
round's median; a prior std within ``[PRIOR_STD_FLOOR, PRIOR_STD_CEILING]`` (zero or negative
std rejected); a body update norm within ``screening_ratio`` times the round's median.

Registry name: ``fedpop``.
"""

from __future__ import annotations

import math
import warnings
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bayesfl.adam import Adam
from bayesfl.data.clients import ClientData
from bayesfl.errors import LocalTrainingWarning, MessageRejected
from bayesfl.messages import Message
from bayesfl.posterior import ClientPosterior, client_posterior
from bayesfl.strategies.base import (
    MAP_PLUGIN,
    PREDICTIVE,
    ClientConfig,
    ClientState,
    ServerState,
    StrategyContext,
    model_state,
)
from bayesfl.strategies.bayes.baseline import WEIGHTED, BayesianBaseline, screening_option
from bayesfl.strategies.networks import batched_apply
from bayesfl.strategies.options import option_integer, option_number
from bayesfl.strategies.registry import Option, register_strategy
from bayesfl.training import loss_diverged, record_divergence
from inference.ensemble import EnsemblePosterior
from inference.errors import NumericalError
from inference.laplace_head import find_mode
from inference.linear_model import augment_with_bias
from inference.options import Likelihood
from inference.sgld import (
    SGLDConfig,
    laplace_precision_cholesky,
    linear_head_gradients,
    run_sgld,
)

BODY = "body."
PRIOR_MEAN, PRIOR_STD = "prior.mean", "prior.std"
DRAWS = "head.draws"
"""Client-state key: the (S, C, d + 1) head draws the client predicts with."""
MODE = "head.mode"
"""Client-state key: the (C (d + 1),) posterior mode of its last chain (where the next
round's search for the mode starts)."""
PRIOR_STD_FLOOR = 1e-3
PRIOR_STD_CEILING = 1e3


def sample_heads(
    inputs: Tensor,
    labels: Tensor,
    num_classes: int,
    prior_mean: Tensor,
    prior_std: float,
    *,
    burn_in: int,
    num_samples: int,
    thinning: int,
    step_size: float = 0.05,
    num_chains: int = 1,
    seed: int = 0,
    start: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Draws of a softmax head's posterior under the prior ``N(prior_mean, prior_std^2 I)``.

    Laplace-preconditioned full-batch SGLD (`inference.sgld.run_sgld`) from the mode.

    Args:
        inputs: (N, m + 1) float64 bias-augmented features.
        labels: (N,) int64 labels in [0, C).
        prior_mean: (C, m + 1) the prior mean.
        prior_std: the prior standard deviation s > 0.
        start: (C (m + 1),) where Newton's search for the mode starts (default: the prior
            mean); the objective is strictly convex, so it changes the iterations only.
    Returns:
        (num_chains * num_samples, C, m + 1) float64 draws, chain by chain, and the mode
        (C (m + 1),) float64.
    """
    shape = (num_classes, inputs.shape[1])
    mean = prior_mean.to(torch.float64).reshape(-1)
    precision = 1.0 / prior_std**2
    start = mean.clone() if start is None else start.to(torch.float64).reshape(-1)
    mode = find_mode(inputs, labels, num_classes, precision, mean, start=start)
    chol = laplace_precision_cholesky(mode, inputs, num_classes, precision, Likelihood.SOFTMAX,
                                      1.0)
    config = SGLDConfig(step_size, num_samples, burn_in, thinning, "laplace",
                        precision_cholesky=chol)
    n = inputs.shape[0]

    def grad_fn(params: Tensor, index: Tensor) -> tuple[Tensor, Tensor]:
        lik = linear_head_gradients(params, inputs[index], labels[index], num_classes,
                                    Likelihood.SOFTMAX, 1.0)
        return -precision * (params - mean) + (n / index.shape[0]) * lik, lik / index.shape[0]

    generator = torch.Generator(device=inputs.device).manual_seed(seed)
    draws = run_sgld(grad_fn, mode.expand(num_chains, -1), config, n, n, generator)
    return draws.reshape(-1, *shape), mode


@register_strategy("fedpop",
                   broadcast="body, population prior over heads (m, s)",
                   upload="body, prior, `num_samples`",
                   aggregate="weighted mean; personal heads drawn by SGLD; screens body update "
                             "norm")
class FedPop(BayesianBaseline):
    """FedPop: shared body, population prior, SGLD personal heads (module docstring).

    Options: declared once, as data, in ``OPTIONS`` (types, defaults, bounds, help);
    their table is on the family's docs page and in ``bayesfl strategies NAME``
    (generated by ``python -m bayesfl.strategies.listing``).
    """

    personalizes = True
    sharing = "shares the body"
    screened_prefix = BODY
    update_norm_label = "body update norm"

    OPTIONS: ClassVar[tuple[Option, ...]] = (
        Option("prior_std_init", float, 1.0,
               "initial prior std s."),
        Option("sgld_step_size", float, 0.05,
               "the step size of each round's SGLD chain over a client's personal head "
               "(Laplace-preconditioned Welling-Teh steps from the posterior mode; 0.05 is the "
               "preconditioner's default of `inference.sgld`).",
               minimum=1e-12),
        Option("sgld_burn_in", int, 50,
               "SGLD steps discarded at the start of each round's chain (50).",
               minimum=0),
        Option("sgld_samples", int, 20,
               "SGLD draws kept per round (20), one every `sgld_thinning` steps after the "
               "burn-in; the round then trains the body and the prior with the draws fixed.",
               minimum=1),
        Option("sgld_thinning", int, 3,
               "SGLD steps between two kept draws (3: 110 steps a round, about three "
               "autocorrelation times).",
               minimum=1),
        Option("final_samples", int, 100,
               "draws of the chain run after training (thinning 5, burn-in 100).",
               minimum=1),
        WEIGHTED,
        screening_option("body update norm"),
    )

    def __init__(
        self,
        context: StrategyContext,
        *,
        prior_std_init: float = 1.0,
        sgld_step_size: float = 0.05,
        sgld_burn_in: int = 50,
        sgld_samples: int = 20,
        sgld_thinning: int = 3,
        final_samples: int = 100,
        weighted: bool = True,
        screening_ratio: float | None = 10.0,
    ) -> None:
        super().__init__(context, weighted=weighted, screening_ratio=screening_ratio)
        self.prior_std_init = option_number(self.name, "prior_std_init", prior_std_init,
                                            minimum=PRIOR_STD_FLOOR)
        self.sgld_step_size = option_number(self.name, "sgld_step_size", sgld_step_size,
                                            minimum=1e-12)
        self.sgld_burn_in = option_integer(self.name, "sgld_burn_in", sgld_burn_in, 0)
        self.sgld_samples = option_integer(self.name, "sgld_samples", sgld_samples, 1)
        self.sgld_thinning = option_integer(self.name, "sgld_thinning", sgld_thinning, 1)
        self.final_samples = option_integer(self.name, "final_samples", final_samples, 1)

    @property
    def head_shape(self) -> tuple[int, int]:
        return (self.num_classes, self.feature_dim + 1)

    # ==== server half ======================================================================
    def init(self) -> ServerState:
        body = self.initial_network()
        state = {BODY + n: p.detach().clone() for n, p in body.named_parameters()}
        state[PRIOR_MEAN] = torch.zeros(self.head_shape)
        state[PRIOR_STD] = torch.tensor([self.prior_std_init])
        return state

    def upload_problem(self, message: Message) -> str | None:
        """The prior std within [PRIOR_STD_FLOOR, PRIOR_STD_CEILING]
        (`prior_std_problem`); the sample count and the body update norm are the
        skeleton's checks, the server's combination its weighted mean."""
        return prior_std_problem(message)

    # ==== client half ======================================================================
    def init_client(self, config: ClientConfig) -> ClientState:
        state = super().init_client(config)
        # all zeros: never trained, predicts with the prior mean (the shape stays fixed: a
        # checkpoint restores client states by their initial layout)
        state[DRAWS] = torch.zeros(self.sgld_samples, *self.head_shape)
        state[MODE] = torch.zeros(math.prod(self.head_shape), dtype=torch.float64)
        return state

    def _received(self, config: ClientConfig, state: ClientState,
                  broadcast: Message) -> tuple[nn.Module, Tensor, float]:
        """(the client's network with the global body, prior mean (C, d+1), prior std)."""
        body = self.client_model(config, state)
        params = dict(body.named_parameters())
        received = self.received(broadcast, {BODY + n: p.shape for n, p in params.items()},
                                 "body", extra=(PRIOR_MEAN, PRIOR_STD))
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(received[BODY + name])
        mean = broadcast.tensors[PRIOR_MEAN]
        if tuple(mean.shape) != self.head_shape:
            raise MessageRejected(f"broadcast prior mean has shape {tuple(mean.shape)}, "
                                  f"expected {self.head_shape}")
        std = float(broadcast.tensors[PRIOR_STD].item())
        if not PRIOR_STD_FLOOR <= std <= PRIOR_STD_CEILING:
            raise MessageRejected(f"broadcast prior std {std:g} out of range")
        return body, mean.to(self.context.device), std

    def _draw(self, body: nn.Module, data: ClientData, mean: Tensor, std: float, seed: int,
              final: bool, state: ClientState) -> tuple[Tensor, Tensor]:
        """(draws (S, C, d + 1), mode) of the client's head under ``body`` and the prior,
        the search for the mode started at the client's last one."""
        start = state.get(MODE)
        inputs = augment_with_bias(batched_apply(body, data.train_x).to(torch.float64))
        if final:
            burn_in, samples, thinning = 100, self.final_samples, 5
        else:
            burn_in, samples, thinning = self.sgld_burn_in, self.sgld_samples, self.sgld_thinning
        return sample_heads(inputs, data.train_y, self.num_classes, mean, std, burn_in=burn_in,
                            num_samples=samples, thinning=thinning,
                            step_size=self.sgld_step_size, seed=seed,
                            start=None if start is None or not bool(start.any()) else start)

    def fit(
        self,
        config: ClientConfig,
        state: ClientState,
        data: ClientData,
        broadcast: Message,
        generator: torch.Generator,
    ) -> tuple[ClientState, Message]:
        """SGLD head draws under the global body, then local Adam epochs on the body and the
        prior with the draws fixed (module docstring); uploads body and prior."""
        body, mean, std = self._received(config, state, broadcast)
        seed = int(torch.randint(2**62, (1,), generator=generator))
        try:
            draws, mode = self._draw(body, data, mean, std, seed, final=False, state=state)
        except NumericalError as err:  # this client's features: its round stops here
            record_divergence(generator, (
                f"the SGLD draws of the personal head failed ({err}); check the client's "
                f"inputs for extreme values or lower sgld_step_size ({self.sgld_step_size:g})"))
            tensors = {BODY + n: p for n, p in body.named_parameters()}
            tensors[PRIOR_MEAN] = mean.to(torch.float32)
            tensors[PRIOR_STD] = torch.tensor([std], dtype=torch.float32)
            return dict(state), self.upload(broadcast, config, data, tensors)
        prior_mean = mean.clone().to(torch.float32).requires_grad_(True)
        log_std = torch.tensor(math.log(std), requires_grad=True)
        self._train(body, draws.to(torch.float32), prior_mean, log_std, data, generator)
        new_state = model_state(body)
        new_state[DRAWS] = draws.to(torch.float32)
        new_state[MODE] = mode
        tensors = {BODY + n: p for n, p in body.named_parameters()}
        tensors[PRIOR_MEAN] = prior_mean
        tensors[PRIOR_STD] = log_std.exp().reshape(1)
        return new_state, self.upload(broadcast, config, data, tensors)

    def _train(self, body: nn.Module, draws: Tensor, prior_mean: Tensor, log_std: Tensor,
               data: ClientData, generator: torch.Generator) -> None:
        training = self.context.training
        params = [*body.parameters(), prior_mean, log_std]
        optimizer = Adam(params, lr=training.lr, betas=training.betas, eps=training.eps)
        n, x, y = data.num_train, data.train_x, data.train_y
        body.train()
        for epoch in range(training.epochs):
            order = torch.randperm(n, generator=generator).to(x.device)
            for step, start in enumerate(range(0, n, training.batch_size)):
                idx = order[start : start + training.batch_size]
                loss = self.local_loss(body(x[idx]), y[idx], draws, prior_mean, log_std, n)
                if loss_diverged(loss, generator, epoch=epoch, step=step,
                                 epochs=training.epochs, lr=training.lr):
                    return
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()

    @staticmethod
    def local_loss(features: Tensor, labels: Tensor, draws: Tensor, prior_mean: Tensor,
                   log_std: Tensor, n: int) -> Tensor:
        """``mean_draws CE(z [1, f], y) - mean_draws log N(z; m, s^2 I) / n`` for features f
        (B, d), draws (S, C, d + 1)."""
        inputs = augment_with_bias(features)
        logits = torch.einsum("bp,scp->sbc", inputs, draws)
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                              labels.repeat(draws.shape[0]))
        size = draws[0].numel()
        variance = torch.exp(2 * log_std)
        log_prior = (-0.5 * (draws - prior_mean).square().sum((1, 2)) / variance
                     - size * log_std - 0.5 * size * math.log(2 * math.pi)).mean()
        return nll - log_prior / n

    def personalize(
        self,
        config: ClientConfig,
        state: ClientState,
        data: ClientData,
        broadcast: Message,
        generator: torch.Generator,
    ) -> ClientState:
        """``final_samples`` head draws under the final global body and prior; where they
        fail on this client's data (extreme inputs), a warning, and the prior mean as its head
        (one client's data never stop the run)."""
        body, mean, std = self._received(config, state, broadcast)
        seed = int(torch.randint(2**62, (1,), generator=generator))
        try:
            draws, mode = self._draw(body, data, mean, std, seed, final=True, state=state)
        except NumericalError as err:
            warnings.warn(
                f"client {config.client_id}: the SGLD draws of its personal head failed "
                f"({err}); it predicts with the population's prior mean head instead. Check "
                f"the client's inputs for extreme values or lower sgld_step_size "
                f"({self.sgld_step_size:g}).", LocalTrainingWarning, stacklevel=2)
            kept = {MODE: state[MODE]} if MODE in state else {}
            return model_state(body) | {DRAWS: torch.zeros(1, *self.head_shape)} | kept
        return model_state(body) | {DRAWS: draws.to(torch.float32), MODE: mode}

    def _heads(self, config: ClientConfig, state: ClientState,
               broadcast: Message) -> tuple[nn.Module, EnsemblePosterior]:
        body, mean, _ = self._received(config, state, broadcast)
        draws = state[DRAWS].to(torch.float64)
        if not bool(draws.any()):  # never trained: the prior mean
            draws = mean.to(torch.float64)[None]
        return body, EnsemblePosterior(draws, n_data=0)

    def predict(
        self, config: ClientConfig, state: ClientState, broadcast: Message, x: Tensor
    ) -> dict[str, Tensor]:
        body, heads = self._heads(config, state, broadcast)
        features = batched_apply(body, x).to(torch.float64)
        return {PREDICTIVE: heads.predict_proba(features, "mc").cpu(),
                MAP_PLUGIN: heads.predict_proba(features, "map").cpu()}

    def posterior(
        self, config: ClientConfig, state: ClientState, broadcast: Message
    ) -> ClientPosterior:
        """Client k's head draws behind the global body (``sample(n)``: (n, C, d + 1) heads;
        ``predict_proba`` takes inputs)."""
        body, heads = self._heads(config, state, broadcast)
        return client_posterior(body, heads, "mc", input_shape=self.context.input_shape or None)


def prior_std_problem(message: Message) -> str | None:
    """None if the upload's prior std is within [PRIOR_STD_FLOOR, PRIOR_STD_CEILING]."""
    std = float(message.tensors[PRIOR_STD].to(torch.float64).item())
    if not PRIOR_STD_FLOOR <= std <= PRIOR_STD_CEILING:
        return (f"prior std {std:.4g} outside [{PRIOR_STD_FLOOR:g}, {PRIOR_STD_CEILING:g}] "
                "(a variance must be positive and bounded)")
    return None

