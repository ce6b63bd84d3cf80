"""Strategies that average (part of) the client networks' parameters.

A client network is :class:`~bayesfl.strategies.networks.ClassifierNet` (``body.*`` then
``head.*``). Each subclass says which parameters are *shared* (averaged by the server,
broadcast every round) and which stay *personal* on the client, and how local training
proceeds (which parameters are trained, in which phases). The upload is the shared parameters
plus the sample count; aggregation is their mean, weighted by sample counts or not, as each
paper does.

What is shared is counted in layers (:func:`~bayesfl.strategies.networks.layer_parameter_names`),
as the FedLog paper describes its baselines (spec fedlog.md §5.1, §8):

=================  ===========================================  =======================
registry name      shared with the server                       aggregation
=================  ===========================================  =======================
``fedavg``         every layer                                  weighted by n_c
``fedper``         all but the last ``local_layers`` (2)        weighted by n_c
``fedrep``         all but the last ``local_layers`` (2)        unweighted
``fedrep-1``       all but the last ``local_layers`` (1)        unweighted
``lg-fedavg``      the last ``global_layers`` (1)               unweighted
``lg-fedavg-2``    the last ``global_layers`` (2)               unweighted
``fedbabu``        all but the last layer (the head)            weighted by n_c
=================  ===========================================  =======================

Robust options (every strategy of this family; :mod:`bayesfl.strategies.robust` gives the
sources): ``aggregation`` = ``"mean"`` (default; the paper's weighting), ``"median"`` or
``"trimmed-mean"`` (coordinate-wise, with ``trim_fraction``); ``norm_bound`` (clip each
update ``w_c - w_global`` to that L2 norm; default None); ``screening_ratio`` (default 10:
reject an upload whose update norm or sample count exceeds 10x the round's median, with the
reason in metrics.jsonl). A client's ``num_samples`` may not exceed its first declared one.

Each module's docstring gives the source of its weighting. With the FedLog paper's shard
partitions every client holds the same number of samples, so weighted and unweighted means
coincide there; they differ under Dirichlet or unequal partitions.

The split is computed from a client's own network (:meth:`ParameterAveraging.shared_names`);
the server's :meth:`~ParameterAveraging.init` checks that every body spec of the run shares
parameters of the same names and shapes (clients with different bodies work only where the
body is personal, e.g. ``lg-fedavg`` with its one global layer, the head).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import ClassVar

import torch
from torch import Tensor, nn

from bayesfl.data.clients import ClientData
from bayesfl.errors import ConfigError, MessageRejected
from bayesfl.messages import Message, Schema, TensorSpec
from bayesfl.strategies.base import (
    NUM_SAMPLES_SPEC,
    PREDICTIVE,
    ClientConfig,
    ClientState,
    RoundPlan,
    ServerState,
    Strategy,
    StrategyContext,
    check_one_body,
    model_state,
    num_samples_problem,
    num_samples_tensor,
    stacked_tensors,
    with_parameters,
)
from bayesfl.strategies.networks import (
    ClassifierNet,
    cross_entropy_per_sample,
    last_layers,
    layer_parameter_names,
)
from bayesfl.strategies.robust import (
    DECLARED,
    check_robust_options,
    combine,
    declarations,
    declared_problems,
    first_reasons,
    norm_scales,
    screening_reasons,
)
from bayesfl.training import (
    LocalTraining,
    ParameterFilter,
    forward_stacked_tensors,
    train_plain,
    train_stacked,
)

PERSONALIZED = "personalized"
"""Client-state key set by :meth:`~bayesfl.strategies.base.Strategy.personalize`: the client
then predicts with its own parameters only (not the broadcast's shared ones)."""


def everything(_: str) -> bool:
    return True


class ParameterAveraging(Strategy):
    """Base of FedAvg, FedPer, FedRep, LG-FedAvg and FedBABU (see the module docstring).

    Args:
        context: the run configuration.
        aggregation: ``"mean"`` (weighted as the strategy's paper does), ``"median"`` or
            ``"trimmed-mean"`` (coordinate-wise, unweighted; Yin et al. 2018).
        trim_fraction: beta of the trimmed mean: the fraction of values dropped at each end.
        norm_bound: clip every update ``w_c - w_global`` to this L2 norm before aggregating
            (norm bounding, Sun et al. 2019); None: no clipping.
        screening_ratio: reject uploads whose update norm or sample count exceeds this many
            times the round's median; None: no screening.
    """

    weighted: ClassVar[bool] = True
    """Weight client parameters by their sample counts when averaging."""

    def __init__(
        self,
        context: StrategyContext,
        *,
        aggregation: str = "mean",
        trim_fraction: float = 0.1,
        norm_bound: float | None = None,
        screening_ratio: float | None = 10.0,
    ) -> None:
        super().__init__(context)
        check_robust_options(aggregation, trim_fraction, norm_bound, screening_ratio)
        self.aggregation, self.trim_fraction = aggregation, float(trim_fraction)
        self.norm_bound = None if norm_bound is None else float(norm_bound)
        self.screening_ratio = None if screening_ratio is None else float(screening_ratio)

    def shared_parameters(self, model: nn.Module) -> frozenset[str]:
        """Names of the parameters of ``model`` that the server averages (default: all)."""
        return frozenset(name for name, _ in model.named_parameters())

    def phases(self, shared: frozenset[str]) -> list[tuple[ParameterFilter, LocalTraining]]:
        """Local training as (which parameters, hyperparameters) phases run in order, given
        the names of the ``shared`` parameters."""
        return [(everything, self.context.training)]

    def objective(self, model_output: object, labels: Tensor) -> Tensor:
        return cross_entropy_per_sample(model_output, labels)  # type: ignore[arg-type]

    def build_model(self, body: nn.Module) -> nn.Module:
        return ClassifierNet(body, self.feature_dim, self.num_classes)

    # ==== server half ======================================================================
    def init(self) -> ServerState:
        """The shared parameters of the initial network of the run's first body spec (every
        client with that spec starts from the same weights).

        Raises:
            ConfigError: a layer count that does not fit the networks, or body specs whose
                shared parameters differ in names or shapes.
        """
        specs = list(dict.fromkeys(self.context.bodies))
        shared = []
        for spec in specs:
            model = self.initial_model(ClientConfig(0, spec, self.context.init_seed(spec)))
            names = self.shared_parameters(model)
            shared.append({k: v.detach().clone() for k, v in model.named_parameters()
                           if k in names})
        first = shared[0]
        for spec, other in zip(specs[1:], shared[1:], strict=True):
            if {k: v.shape for k, v in other.items()} != {k: v.shape for k, v in first.items()}:
                raise ConfigError(
                    f"{self.name} averages {sorted(first)[:3]}...; body {spec!r} has different "
                    f"shared parameter shapes than {specs[0]!r}: use one body for all clients "
                    f"with {self.name}")
        return first

    def broadcast_tensors(self, state: ServerState, round: int) -> dict[str, Tensor]:
        return shared_state(state)

    def upload_schema(self, state: ServerState, round: int) -> Schema:
        schema = {name: TensorSpec(tuple(t.shape), torch.float32)
                  for name, t in shared_state(state).items()}
        schema["num_samples"] = NUM_SAMPLES_SPEC
        return schema

    def upload_problems(self, plan: RoundPlan, messages: Sequence[Message]) -> list[str | None]:
        """Per upload: a valid sample count, not above the client's first declared one, and
        (screening) an update norm and sample count within ``screening_ratio`` times the
        round's medians."""
        ids = [m.header.client_id for m in messages]
        counts = [int(m.tensors["num_samples"].item()) for m in messages]
        ratio = self.screening_ratio
        return first_reasons(
            [num_samples_problem(m) for m in messages],
            declared_problems(plan.state, ids, counts),
            screening_reasons(torch.tensor(counts, dtype=torch.float64), ratio, "num_samples"),
            screening_reasons(update_norms(shared_state(plan.state), messages), ratio,
                              "update norm"),
        )

    def aggregate(
        self,
        state: ServerState,
        uploads: Sequence[Message],
        round: int,
        generator: torch.Generator,
    ) -> ServerState:
        """The (weighted) mean, median or trimmed mean of the uploads' shared parameters,
        after norm bounding if set, plus the ledger of declared sample counts."""
        if not uploads:
            return state
        counts = [int(m.tensors["num_samples"].item()) for m in uploads]
        weights = torch.tensor([float(n) if self.weighted else 1.0 for n in counts],
                               dtype=torch.float64)
        weights = weights / weights.sum()
        params = shared_state(state)
        scales = norm_scales(update_norms(params, uploads), self.norm_bound)
        new = {}
        for name, old in params.items():
            stacked = torch.stack([m.tensors[name].to(torch.float64) for m in uploads])
            if self.norm_bound is not None:
                start = old.to(torch.float64)
                shape = (-1,) + (1,) * old.dim()
                stacked = start + scales.view(shape) * (stacked - start)
            combined = combine(stacked, weights, self.aggregation, self.trim_fraction)
            new[name] = combined.to(dtype=old.dtype, device=old.device)
        new.update(declarations(state, [m.header.client_id for m in uploads], counts))
        return new

    # ==== client half ======================================================================
    def shared_names(self, body: str) -> frozenset[str]:
        """The shared parameter names of a client network of body spec ``body`` (the client
        computes them from its own network, not from the server)."""
        return self.shared_parameters(self.template(body))

    def _received(self, body: str, broadcast: Message) -> dict[str, Tensor]:
        """The broadcast's shared parameters, checked against this client's network."""
        template = dict(self.template(body).named_parameters())
        shared = self.shared_names(body)
        if set(broadcast.tensors) != shared:
            raise MessageRejected(f"broadcast names {sorted(broadcast.tensors)[:4]}... do not "
                                  f"match this client's shared parameters {sorted(shared)[:4]}...")
        for name, value in broadcast.tensors.items():
            if value.shape != template[name].shape:
                raise MessageRejected(f"broadcast {name!r} has shape {tuple(value.shape)}, this "
                                      f"client's network has {tuple(template[name].shape)}")
        device = self.context.device
        return {k: v.to(device=device, dtype=template[k].dtype)
                for k, v in broadcast.tensors.items()}

    def global_model(
        self, config: ClientConfig, state: ClientState, broadcast: Message
    ) -> nn.Module:
        """The client's network with the broadcast's global shared parameters loaded."""
        model = self.client_model(config, state)
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, value in self._received(config.body, broadcast).items():
                params[name].copy_(value)
        return model

    def _upload(self, config: ClientConfig, data: ClientData, round: int,
                params: dict[str, Tensor]) -> Message:
        tensors = {k: params[k] for k in sorted(self.shared_names(config.body))}
        tensors["num_samples"] = num_samples_tensor(data.num_train)
        return self.up_message(round, config.client_id, tensors)

    def fit(
        self,
        config: ClientConfig,
        state: ClientState,
        data: ClientData,
        broadcast: Message,
        generator: torch.Generator,
    ) -> tuple[ClientState, Message]:
        """Load the global shared parameters, train (phases), upload the shared ones."""
        model = self.global_model(config, state, broadcast)
        for trainable, phase in self.phases(self.shared_names(config.body)):
            train_plain(model, data.train_x, data.train_y, self.objective, phase,
                        generator=generator, trainable=trainable)
        upload = self._upload(config, data, broadcast.header.round,
                              dict(model.named_parameters()))
        return model_state(model), upload

    def fit_group(
        self,
        configs: Sequence[ClientConfig],
        states: Sequence[ClientState],
        datas: Sequence[ClientData],
        broadcast: Message,
        generators: Sequence[torch.Generator],
    ) -> list[tuple[ClientState, Message]]:
        """:meth:`fit` of same-body clients with one vmapped training per phase."""
        body = check_one_body(configs)
        template = self.template(body)
        params, buffers = stacked_tensors(template, states)
        received = self._received(body, broadcast)
        for p in params:
            p.update({k: v.clone() for k, v in received.items()})
        xs, ys = [d.train_x for d in datas], [d.train_y for d in datas]
        for trainable, phase in self.phases(self.shared_names(body)):
            train_stacked(template, params, buffers, xs, ys, self.objective, phase,
                          generators=generators, trainable=trainable)
        round = broadcast.header.round
        # buffers too: a body with batch-norm statistics has them updated by training
        return [(with_parameters(s, {**b, **p}), self._upload(c, d, round, p))
                for c, s, p, b, d in zip(configs, states, params, buffers, datas, strict=True)]

    def _predict_parameters(
        self, config: ClientConfig, state: ClientState, broadcast: Message
    ) -> ClientState:
        """The client state to predict with: its own personal parameters and the global
        shared ones, or all its own once it is personalized."""
        if PERSONALIZED in state:
            return state
        return with_parameters(state, self._received(config.body, broadcast))

    def predict(
        self, config: ClientConfig, state: ClientState, broadcast: Message, x: Tensor
    ) -> dict[str, Tensor]:
        """Softmax of the client network with the global shared and its personal parameters."""
        return self.predict_group([config], [state], broadcast, [x])[0]

    def predict_group(
        self,
        configs: Sequence[ClientConfig],
        states: Sequence[ClientState],
        broadcast: Message,
        xs: Sequence[Tensor],
    ) -> list[dict[str, Tensor]]:
        template = self.template(check_one_body(configs))
        states = [self._predict_parameters(c, s, broadcast) for c, s in zip(configs, states,
                                                                            strict=True)]
        params, buffers = stacked_tensors(template, states)
        logits = forward_stacked_tensors(template, params, buffers, xs)
        probs = torch.softmax(logits.to(torch.float64), dim=-1).cpu()
        return [{PREDICTIVE: p} for p in probs.split([int(x.shape[0]) for x in xs])]


def shared_state(state: ServerState) -> dict[str, Tensor]:
    """The shared parameters of a parameter-averaging server state (without its ledger of
    declared sample counts)."""
    return {k: v for k, v in state.items() if not k.startswith(DECLARED)}


def update_norms(params: ServerState, messages: Sequence[Message]) -> Tensor:
    """(K,) float64: the L2 norm of each upload's shared parameters minus ``params``."""
    norms = torch.zeros(len(messages), dtype=torch.float64)
    for name, old in params.items():
        start = old.detach().to("cpu", torch.float64)
        for k, m in enumerate(messages):
            norms[k] += (m.tensors[name].to(torch.float64) - start).square().sum()
    return norms.sqrt()


def with_epochs(config: LocalTraining, epochs: int) -> LocalTraining:
    return replace(config, epochs=epochs)


def check_layer_count(strategy: str, option: str, value: object) -> int:
    """``value`` as a layer count >= 1, or ConfigError naming ``strategy`` and ``option``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{strategy} {option} must be an integer >= 1, got {value!r}")
    return value


def all_but_last_layers(model: nn.Module, count: int, strategy: str) -> frozenset[str]:
    """Parameter names of every layer of ``model`` except the last ``count`` (which stay on
    the client); ConfigError if that leaves nothing to share."""
    layers = len(layer_parameter_names(model))
    if count >= layers:
        raise ConfigError(f"{strategy} keeps the last {count} layer(s) local, but the client "
                          f"network has only {layers} (body layers + head): nothing would be "
                          f"shared; use fewer local layers or a deeper body")
    every = frozenset(name for name, _ in model.named_parameters())
    return every - last_layers(model, count)


def only_last_layers(model: nn.Module, count: int, strategy: str) -> frozenset[str]:
    """Parameter names of the last ``count`` layers of ``model`` (the shared ones);
    ConfigError if the network has fewer layers."""
    layers = len(layer_parameter_names(model))
    if count > layers:
        raise ConfigError(f"{strategy} shares the last {count} layer(s), but the client "
                          f"network has only {layers} (body layers + head)")
    return last_layers(model, count)
