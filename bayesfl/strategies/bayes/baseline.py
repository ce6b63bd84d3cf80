"""The skeleton the whole-network Bayesian baselines share: `BayesianBaseline` (FedPA,
pFedBayes, FedPop) and `NetworkGaussianBaseline` (FedPA, pFedBayes: a Gaussian over the
whole network as the posterior).

All three federate one network of one body spec: the server state is named tensors from the
initial network (plus server-only bookkeeping: the clients' declared sample counts, FedPA's
momentum), all of which but the bookkeeping is broadcast; an upload has one float32 tensor per
broadcast tensor plus the client's sample count; the server checks every upload the same way
(the sample count, one method-specific invariant, and an update norm within
``screening_ratio`` times the round's median) and combines the accepted ones with weights
proportional to the sample counts (``weighted``) or uniform. What differs is only this:

=============  ==========================  ======================  =======================
               FedPA                       pFedBayes               FedPop
=============  ==========================  ======================  =======================
broadcast      ``theta`` (the global mode)  ``mu.*``, ``rho.*`` of  ``body.*``, prior mean
                                           the global Gaussian     and std
upload         ``delta.*`` = ``Sigma_k^-1   the localized global's  body and prior after
               (mu_k - theta)``             ``mu.*``, ``rho.*``     local Adam epochs
invariant      —                           every ``softplus(rho)``  prior std in range
                                           in range
update norm    ``||delta||``                ``||mu_k - mu||``       ``||body_k - body||``
combine        server step (momentum)      ``(1 - beta) z + beta   weighted mean
                                           mean_k z_k``
posterior      ``NetworkGaussian``: SWAG    ``NetworkGaussian``:    ``BodyPosterior``: SGLD
               covariance of IASG samples  personal mean field     heads behind the body
=============  ==========================  ======================  =======================

The posteriors are [`inference`][inference]'s (`inference.NetworkGaussian`,
[`inference.BodyPosterior`][inference.BodyPosterior]), built with bayesfl's input boundary
(`bayesfl.inputs.client_inputs`), so a bad batch is a ``DataError``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar

import torch
from torch import Tensor, nn

from bayesfl.data.clients import ClientData
from bayesfl.errors import ConfigError, MessageRejected
from bayesfl.inputs import client_inputs
from bayesfl.messages import Message, Schema, TensorSpec
from bayesfl.strategies.base import (
    MAP_PLUGIN,
    PREDICTIVE,
    ClientConfig,
    ClientState,
    RoundPlan,
    ServerState,
    Strategy,
    StrategyContext,
    derived_seed,
)
from bayesfl.strategies.networks import ClassifierNet
from bayesfl.strategies.options import option_integer, option_number
from bayesfl.strategies.registry import Option
from bayesfl.strategies.robust import (
    DECLARED,
    count_problems,
    declarations,
    first_reasons,
    screening_reasons,
)
from bayesfl.strategies.uploads import (
    NUM_SAMPLES_SPEC,
    client_weights,
    num_samples_tensor,
    sample_counts,
    weighted_mean,
)
from inference.network_gaussian import NetworkGaussian


def screening_option(norm: str) -> Option:
    """The family's ``screening_ratio`` option, naming the norm of an upload it screens (the
    strategy's ``update_norm_label``): one declaration, one wording for every member."""
    return Option("screening_ratio", float, 10.0,
                  f"reject uploads whose {norm} or sample count exceeds this many times the "
                  "round's median (None: no screening).",
                  minimum=1.0, nullable=True)


WEIGHTED = Option("weighted", bool, True, "weight the server average by sample counts.")
"""The ``weighted`` option of the members that average (FedPop, pFedBayes)."""
MC_SAMPLES = Option("mc_samples", int, 32, "draws of the Monte Carlo predictive.", minimum=1)
"""The ``mc_samples`` option of the network-Gaussian members (FedPA, pFedBayes)."""


class BayesianBaseline(Strategy):
    """The server half, the upload checks and the client's reading of a broadcast that FedPA,
    pFedBayes and FedPop share (module docstring).

    Subclasses set:
        sharing: what the method does with the network, for the one-body-spec error.
        server_only: prefixes of server-state keys that are never broadcast.
        upload_prefix: the prefix of an upload's name for each broadcast tensor.
        screened_prefix: the server-state keys whose difference to the upload is the update
            norm (FedPA overrides `update_norms` instead).
        update_norm_label: what the update norm is called in a rejection.
    and override `combine` (the aggregation rule; default: the weighted mean) and
    `upload_problem` (the method's invariant of one upload; default none).

    Its ``__init__`` keywords ``weighted`` and ``screening_ratio`` are options its subclasses
    declare (``OPTIONS``; their table is on the family's docs page and in
    ``bayesfl strategies NAME``, generated by ``python -m bayesfl.strategies.listing``).
    """

    is_posterior = True
    sharing: ClassVar[str] = "averages every parameter of the network"
    server_only: ClassVar[tuple[str, ...]] = (DECLARED,)
    upload_prefix: ClassVar[str] = ""
    screened_prefix: ClassVar[str] = ""
    update_norm_label: ClassVar[str] = "update norm"

    def __init__(self, context: StrategyContext, *, weighted: bool,
                 screening_ratio: float | None) -> None:
        super().__init__(context)
        if len(set(context.bodies)) != 1:
            raise ConfigError(f"{self.name} {self.sharing}: use one body spec for all clients, "
                              f"got {sorted(set(context.bodies))}")
        if not isinstance(weighted, bool):
            raise ConfigError(f"{self.name} weighted must be true or false, got {weighted!r}")
        self.weighted = weighted
        self.screening_ratio = None if screening_ratio is None else option_number(
            self.name, "screening_ratio", screening_ratio, minimum=1.0)

    # ==== server half ======================================================================
    def initial_network(self) -> nn.Module:
        """The initial network of the run's body spec (the server state starts from it)."""
        spec = self.context.bodies[0]
        return self.initial_model(ClientConfig(0, spec, self.context.init_seed(spec)))

    def broadcast_tensors(self, state: ServerState, round: int) -> dict[str, Tensor]:
        """The server state without its server-only entries."""
        return {k: v for k, v in state.items() if not k.startswith(self.server_only)}

    def upload_schema(self, state: ServerState, round: int) -> Schema:
        """One float32 tensor per broadcast tensor (named with `upload_prefix`) and the
        sample count."""
        schema = {self.upload_prefix + k: TensorSpec(tuple(v.shape), torch.float32)
                  for k, v in self.broadcast_tensors(state, round).items()}
        schema["num_samples"] = NUM_SAMPLES_SPEC
        return schema

    def upload_problems(self, plan: RoundPlan, messages: Sequence[Message]) -> list[str | None]:
        """Per upload, the first of: its sample count (`count_problems`), the method's
        invariant (`upload_problem`), its update norm (`update_norms`) within
        ``screening_ratio`` times the round's median."""
        return first_reasons(
            count_problems(plan, messages, self.screening_ratio),
            [self.upload_problem(m) for m in messages],
            screening_reasons(self.update_norms(plan, messages), self.screening_ratio,
                              self.update_norm_label))

    def upload_problem(self, message: Message) -> str | None:
        """The method's invariant of one upload: None, or what it violates (default none)."""
        return None

    def update_norms(self, plan: RoundPlan, messages: Sequence[Message]) -> Tensor:
        """(K,) float64 norms of the uploads' differences to the server state over the keys
        starting with `screened_prefix`."""
        keys = {k: k for k in plan.state if k.startswith(self.screened_prefix)}
        return difference_norms(plan.state, messages, keys)

    def aggregate(
        self,
        state: ServerState,
        uploads: Sequence[Message],
        round: int,
        generator: torch.Generator,
    ) -> ServerState:
        """`combine` of the uploads with their weights, plus the clients' declared sample
        counts; the state unchanged without uploads."""
        if not uploads:
            return state
        counts = sample_counts(uploads)
        new = self.combine(state, uploads, client_weights(counts, self.weighted), round)
        new.update(declarations(state, [m.header.client_id for m in uploads], counts))
        return new

    def combine(self, state: ServerState, uploads: Sequence[Message], weights: Tensor,
                round: int) -> dict[str, Tensor]:
        """The new broadcast tensors: the weighted mean of the uploads' (default)."""
        return {key: weighted_mean(uploads, key, weights).to(old.dtype)
                for key, old in self.broadcast_tensors(state, round).items()}

    # ==== client half ======================================================================
    def received(self, broadcast: Message, shapes: Mapping[str, torch.Size], what: str,
                 extra: Sequence[str] = ()) -> dict[str, Tensor]:
        """The broadcast tensors named in ``shapes``, checked: the broadcast holds exactly
        those names and ``extra``, each of its shape in ``shapes``.

        Raises:
            MessageRejected: other names (``what`` the client compares them with), or a shape
                that differs.
        """
        if set(broadcast.tensors) != {*shapes, *extra}:
            raise MessageRejected(f"{self.name} broadcast names do not match this client's "
                                  f"{what}")
        out = {}
        for name, shape in shapes.items():
            value = broadcast.tensors[name]
            if value.shape != shape:
                raise MessageRejected(f"broadcast {name!r} has shape {tuple(value.shape)}, "
                                      f"expected {tuple(shape)}")
            out[name] = value
        return out

    def upload(self, broadcast: Message, config: ClientConfig, data: ClientData,
               tensors: Mapping[str, Tensor]) -> Message:
        """The upload of ``tensors`` with the client's training sample count."""
        tensors = {**tensors, "num_samples": num_samples_tensor(data.num_train)}
        return self.up_message(broadcast.header.round, config.client_id, tensors)


class NetworkGaussianBaseline(BayesianBaseline):
    """A `BayesianBaseline` whose clients predict with a Gaussian over the whole network
    (`inference.NetworkGaussian`): FedPA and pFedBayes. The network is the body with
    a linear head (`ClassifierNet`).

    Subclasses implement `posterior` (with `network_gaussian`) and set
    ``predict_seed_tag``, which seeds the predictive's draws with the run seed, the round
    and the client, so an evaluation is reproducible.

    Its ``__init__`` keyword ``mc_samples`` is an option its subclasses declare, as
    `BayesianBaseline`'s are.
    """

    predict_seed_tag: ClassVar[int]

    def __init__(self, context: StrategyContext, *, mc_samples: int, weighted: bool,
                 screening_ratio: float | None) -> None:
        super().__init__(context, weighted=weighted, screening_ratio=screening_ratio)
        self.mc_samples = option_integer(self.name, "mc_samples", mc_samples, 1)

    def build_model(self, body: nn.Module) -> nn.Module:
        return ClassifierNet(body, self.feature_dim, self.num_classes)

    def network_gaussian(self, model: nn.Module, mean: Tensor, variance: Tensor,
                         factor: Tensor | None = None) -> NetworkGaussian:
        """``N(mean, diag(variance) + factorᵀ factor)`` over ``model``'s parameters, predicting
        with ``mc_samples`` draws from inputs of the run's shape (checked by bayesfl's input
        boundary)."""
        return NetworkGaussian(model, mean, variance, factor, method="mc",
                               n_samples=self.mc_samples,
                               input_shape=self.context.input_shape or None,
                               prepare=client_inputs)

    def posterior(self, config: ClientConfig, state: ClientState,
                  broadcast: Message) -> NetworkGaussian:  # pragma: no cover - overridden
        raise TypeError(f"{type(self).__name__} must define posterior()")

    def predict(
        self, config: ClientConfig, state: ClientState, broadcast: Message, x: Tensor
    ) -> dict[str, Tensor]:
        """The MC predictive of `posterior` (headline) and the softmax at its mean
        (``map_plugin``); a posterior without spread (zero covariance) predicts the plug-in."""
        post = self.posterior(config, state, broadcast)
        plug = post.predict_proba(x, "map").cpu()
        if post.factor is None and not bool((post.variance > 0).any()):
            return {PREDICTIVE: plug, MAP_PLUGIN: plug}
        generator = torch.Generator().manual_seed(derived_seed(
            self.context.seed, broadcast.header.round, config.client_id, self.predict_seed_tag))
        return {PREDICTIVE: post.predict_proba(x, "mc", generator=generator).cpu(),
                MAP_PLUGIN: plug}


def difference_norms(reference: Mapping[str, Tensor], messages: Sequence[Message],
                     names: Mapping[str, str]) -> Tensor:
    """(K,) float64 L2 norm of each upload's tensors ``names[key]`` minus ``reference[key]``
    (``names`` maps server-state keys to upload keys)."""
    norms = torch.zeros(len(messages), dtype=torch.float64)
    for key, up in names.items():
        start = reference[key].detach().to("cpu", torch.float64)
        for k, m in enumerate(messages):
            norms[k] += (m.tensors[up].to(torch.float64) - start).square().sum()
    return norms.sqrt()


__all__ = ["BayesianBaseline", "NetworkGaussianBaseline", "difference_norms"]
