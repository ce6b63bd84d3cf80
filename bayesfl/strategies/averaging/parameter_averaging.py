"""Strategies that average (part of) the client networks' parameters.

A client network is `ClassifierNet` (``body.*`` then
``head.*``). Each subclass says which parameters are *shared* (averaged by the server,
broadcast every round) and which stay *personal* on the client, and how local training
proceeds (which parameters are trained, in which phases). The upload is the shared parameters
plus the sample count; aggregation is their mean, weighted by sample counts or not, as each
paper does.

What is shared is counted in layers (`layer_parameter_names`),
as the [FedLog paper](https://arxiv.org/abs/2407.08337) describes its baselines (section
"Communication Cost", Table 1):

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

Robust options (every strategy of this family; `bayesfl.strategies.robust` gives the
sources): ``aggregation`` = ``"mean"`` (default; the paper's weighting), ``"median"`` or
``"trimmed-mean"`` (coordinate-wise, with ``trim_fraction``); ``norm_bound`` (clip each
update ``w_c - w_global`` to that L2 norm; default None); ``screening_ratio`` (default 10:
reject an upload whose update norm or sample count exceeds 10x the round's median, with the
reason in metrics.jsonl). A client's ``num_samples`` may not exceed its first declared one.

**Schedules** (every strategy of this family): ``schedule="fedpart"`` (or a dict with kind
``"fedpart"`` and its options, `bayesfl.strategies.averaging.fedpart_schedule`) trains one
layer group (`bayesfl.layer_groups`, of the shared parameters) per partial round: its
parameters (and statistics) are the round's upload schema, the broadcast carries the groups
changed since the previous round (``downlink="changed"``) or everything (``"full"``),
everything else is frozen on the client (``requires_grad=False``: bit-identical, no
gradient, backpropagation stops at the first trainable group) and only the uploaded names are
averaged. Personal parameters (FedPer, FedRep, ...) keep training as their strategy says.

**Normalisation statistics** (``bn_stats``): ``"aggregate"`` (default) shares the running
mean and variance of every BatchNorm layer whose parameters are shared: uploaded with them,
averaged with the same weights (never clipped or screened), broadcast and used by every
client's evaluation; in a partial round the frozen groups' statistics are restored after
local training (their layers still normalise with batch statistics, as in the paper's code).
``"local"`` (the FedPart paper's code, FedBN-like) never sends them: each client keeps and
evaluates with its own.

**Compute** (`ParameterAveraging.compute_metrics`): the analytic FLOPs of the round's
local training (`bayesfl.flops`: forward over every layer, backward from the output down
to the first trainable one), from each upload's sample count and the local epochs.

**Probabilistic head** (every strategy of this family; `bayesfl.strategies.
probabilistic_head`): ``head`` = None (default: the plug-in network, as the papers do) or an
``inference.fit_head`` kind, ``"laplace"``, ``"conjugate"``, ``"mfvi"`` or ``"sgld"``. After
training (FedBABU and FedAvg-FT after their fine-tuning) each client fits that head posterior on
its own body's training features, its Laplace prior centred at zero (``head_prior="zero"``,
the default, chosen by measurement) or on the global head where the strategy has one
(``"global"``), and predicts with its
posterior predictive; the strategy then reports its plug-in beside it as ``map_plugin``.
``head_options``: options of ``fit_head`` (a table).

Each module's docstring gives the source of its weighting. With the FedLog paper's shard
partitions every client holds the same number of samples, so weighted and unweighted means
coincide there; they differ under Dirichlet or unequal partitions.

The split is computed from a client's own network (`ParameterAveraging.shared_names`);
the server's `init` checks that every body spec of the run shares
parameters of the same names and shapes (clients with different bodies work only where the
body is personal, e.g. ``lg-fedavg`` with its one global layer, the head).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from bayesfl.data.clients import ClientData
from bayesfl.errors import ConfigError, MessageRejected
from bayesfl.layer_groups import LayerGroup, is_statistic, layer_groups
from bayesfl.messages import Message, Schema, TensorSpec
from bayesfl.strategies.averaging.fedpart_schedule import (
    FedPartSchedule,
    LocalFlops,
    PartialTraining,
)
from bayesfl.strategies.base import (
    PREDICTIVE,
    ClientConfig,
    ClientState,
    RoundPlan,
    ServerState,
    Strategy,
    StrategyContext,
    check_one_body,
    model_state,
    stacked_tensors,
    with_parameters,
)
from bayesfl.strategies.networks import (
    ClassifierNet,
    cross_entropy_per_sample,
    last_layers,
    layer_parameter_names,
)
from bayesfl.strategies.probabilistic_head import (
    HEAD_KINDS,
    HEAD_PRIORS,
    HeadPosterior,
    head_from_options,
    head_parameters,
)
from bayesfl.strategies.registry import Option
from bayesfl.strategies.robust import (
    AGGREGATIONS,
    DECLARED,
    check_robust_options,
    combine,
    count_problems,
    declarations,
    first_reasons,
    norm_scales,
    screening_reasons,
)
from bayesfl.strategies.uploads import (
    NUM_SAMPLES_SPEC,
    client_weights,
    num_samples_tensor,
    sample_counts,
)
from bayesfl.training import (
    LocalTraining,
    ParameterFilter,
    forward_stacked_tensors,
    train_plain,
    train_stacked,
)

BN_STATS = ("aggregate", "local")

PERSONALIZED = "personalized"
"""Client-state key set by `personalize`: the client
then predicts with its own parameters only (not the broadcast's shared ones)."""


def everything(_: str) -> bool:
    return True


class ParameterAveraging(Strategy):
    """Base of FedAvg, FedPer, FedRep, LG-FedAvg and FedBABU (see the module docstring).

    Args:
        context: the run configuration.

    Options: declared once, as data, in ``OPTIONS`` (types, defaults, bounds, help);
    their table is on the family's docs page and in ``bayesfl strategies NAME``
    (generated by ``python -m bayesfl.strategies.listing``).
    """

    weighted: ClassVar[bool] = True
    """Weight client parameters by their sample counts when averaging."""

    OPTIONS: ClassVar[tuple[Option, ...]] = (
        Option("aggregation", str, "mean",
               "`\"mean\"` (weighted as the strategy's paper does), `\"median\"` or "
               '`"trimmed-mean"` (coordinate-wise, unweighted; Yin et al. 2018).',
               choices=AGGREGATIONS),
        Option("trim_fraction", float, 0.1,
               "beta of the trimmed mean: the fraction of values dropped at each end."),
        Option("norm_bound", float, None,
               "clip every update `w_c - w_global` to this L2 norm before aggregating (norm "
               "bounding, Sun et al. 2019); None: no clipping."),
        Option("screening_ratio", float, 10.0,
               "reject uploads whose update norm or sample count exceeds this many times the "
               "round's median; None: no screening.",
               nullable=True),
        Option("schedule", (str, dict), None,
               'None (every round trains and sends every shared parameter), `"fedpart"` or '
               '`{"kind": "fedpart", **options}` (module docstring).'),
        Option("bn_stats", str, "aggregate",
               '`"aggregate"` or `"local"` BatchNorm running statistics (module docstring).',
               choices=BN_STATS),
        Option("head", str, None,
               "None (the plug-in network) or the `inference.fit_head` kind of the head "
               "posterior each client fits when it personalises (module docstring).",
               choices=HEAD_KINDS),
        Option("head_prior", str, "zero",
               '`"zero"` (a zero-centred Laplace prior) or `"global"` (centred on the global '
               "head where the strategy has one).",
               choices=HEAD_PRIORS),
        Option("head_options", dict, None,
               "`fit_head` options of the head posterior (a table)."),
    )

    def __init__(
        self,
        context: StrategyContext,
        *,
        aggregation: str = "mean",
        trim_fraction: float = 0.1,
        norm_bound: float | None = None,
        screening_ratio: float | None = 10.0,
        schedule: str | dict[str, Any] | None = None,
        bn_stats: str = "aggregate",
        head: str | None = None,
        head_prior: str = "zero",
        head_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(context)
        option = head_from_options(self.name, head, head_prior, head_options)
        self.head: HeadPosterior | None = None if option is None else HeadPosterior(
            option, self.num_classes, context.input_shape or None)
        """The probabilistic head (client half: personalise, predict), or None."""
        if self.head is not None:  # every client personalises; evaluations carry both
            self.personalizes = True
            self.is_posterior = True
        check_robust_options(aggregation, trim_fraction, norm_bound, screening_ratio)
        self.aggregation, self.trim_fraction = aggregation, float(trim_fraction)
        self.norm_bound = None if norm_bound is None else float(norm_bound)
        self.screening_ratio = None if screening_ratio is None else float(screening_ratio)
        if bn_stats not in BN_STATS:
            raise ConfigError(f"{self.name} bn_stats must be one of {BN_STATS}, got "
                              f"{bn_stats!r}")
        self.bn_stats = bn_stats
        self.partial = PartialTraining(self.name, schedule, context, shared=self.shared_names,
                                       statistics=self.shared_statistics,
                                       template=self.template, phases=self.phases)
        """What each round trains, uploads and broadcasts (FedPart's schedule; both halves)."""
        self.flops = LocalFlops(self.template, context)
        """The local training's analytic FLOPs (server half: `compute_metrics`)."""

    @property
    def schedule_options(self) -> dict[str, Any] | None:
        """The ``schedule`` option as ``{"kind": "fedpart", **options}``, or None."""
        return self.partial.options

    # ==== statistics, round metrics (both halves) ==========================================
    def shared_statistics(self, body: str) -> frozenset[str]:
        """Running-statistic names of the BatchNorm layers whose parameters are shared
        (``bn_stats="aggregate"``; none with ``"local"``)."""
        if self.bn_stats != "aggregate":
            return frozenset()
        template, shared = self.template(body), self.shared_names(body)
        return frozenset(b for g in layer_groups(template) for b in g.buffers
                         if set(g.parameters) <= shared)

    def groups(self, body: str) -> list[LayerGroup]:
        """The layer groups of the shared parameters (and statistics) of body ``body``."""
        return self.partial.groups(body)

    def schedule(self) -> FedPartSchedule | None:
        """The run's schedule, or None."""
        return self.partial.schedule()

    def group_at(self, round: int) -> int:
        """The 0-based layer group trained in ``round``, or ``FULL``."""
        return self.partial.group_at(round)

    def describe(self) -> str | None:
        """The schedule of the run and the layer groups, as text (None without a schedule)."""
        return self.partial.describe()

    def compute_metrics(self, plan: RoundPlan, uploads: Sequence[Message]) -> dict[str, float]:
        """Analytic FLOPs of the local training behind ``uploads`` (module docstring):
        ``flops_local`` = sum over uploads of samples x epochs x FLOPs per sample of each
        training phase with the round's trainable set."""
        total = 0
        for m in uploads:
            body = self.context.client_config(m.header.client_id).body
            total += self.flops.local(body, self.partial.phases(body, plan.round),
                                      int(m.tensors["num_samples"].item()))
        return {"flops_local": float(total)}

    def penalty(self, anchor: dict[str, Tensor]) -> Callable[[dict[str, Tensor]], Tensor] | None:
        """A term added to every local mini-batch loss, given the round's global values
        ``anchor`` (default none; FedProx's proximal term)."""
        return None

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
            names = self.shared_parameters(model) | self.shared_statistics(spec)
            shared.append({k: v.detach().clone() for k, v in model.state_dict().items()
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
        if not self.partial.active:
            return shared_state(state)
        names = self.partial.broadcast_names(self.context.bodies[0], round)
        return {k: v for k, v in shared_state(state).items() if k in names}

    def configure_evaluation(self, state: ServerState, round: int) -> Message:
        """Every shared value: clients evaluate the whole global model."""
        return self.down_message(round, shared_state(state))

    def upload_schema(self, state: ServerState, round: int) -> Schema:
        shared = shared_state(state)
        names = set(shared) if not self.partial.active else self.partial.round_names(
            self.context.bodies[0], round)
        schema = {name: TensorSpec(tuple(t.shape), torch.float32)
                  for name, t in shared.items() if name in names}
        schema["num_samples"] = NUM_SAMPLES_SPEC
        return schema

    def upload_problems(self, plan: RoundPlan, messages: Sequence[Message]) -> list[str | None]:
        """Per upload: a valid sample count, not above the client's first declared one, and
        (screening) an update norm and sample count within ``screening_ratio`` times the
        round's medians."""
        ratio = self.screening_ratio
        return first_reasons(
            count_problems(plan, messages, ratio),
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
        counts = sample_counts(uploads)
        weights = client_weights(counts, self.weighted)
        params = shared_state(state)
        scales = norm_scales(update_norms(params, uploads), self.norm_bound)
        new = dict(params)  # what the round does not send stays exactly as it was
        for name in uploads[0].tensors:
            if name == "num_samples":
                continue
            old = params[name]
            stacked = torch.stack([m.tensors[name].to(torch.float64) for m in uploads])
            if self.norm_bound is not None and not is_statistic(name):
                start = old.to(torch.float64)
                shape = (-1,) + (1,) * old.dim()
                stacked = start + scales.view(shape) * (stacked - start)
            combined = combine(stacked, weights, self.aggregation, self.trim_fraction)
            new[name] = combined.to(dtype=old.dtype, device=old.device)
        new.update(declarations(state, [m.header.client_id for m in uploads], counts))
        return new

    # ==== client half ======================================================================
    def init_client(self, config: ClientConfig) -> ClientState:
        """The initial network, plus (under a schedule) the round the client last synced:
        0, as every client starts from the global initial values."""
        return self.partial.synced(super().init_client(config), 0)

    def shared_names(self, body: str) -> frozenset[str]:
        """The shared parameter names of a client network of body spec ``body`` (the client
        computes them from its own network, not from the server)."""
        return self.shared_parameters(self.template(body))

    def _received(
        self, body: str, broadcast: Message, expected: frozenset[str] | None = None
    ) -> dict[str, Tensor]:
        """The broadcast's shared values, checked against this client's network: exactly
        ``expected`` (default: every shared parameter and statistic)."""
        template = self.template(body).state_dict()
        shared = expected if expected is not None else (self.shared_names(body)
                                                        | self.shared_statistics(body))
        if set(broadcast.tensors) != shared:
            raise MessageRejected(f"broadcast names {sorted(broadcast.tensors)[:4]}... do not "
                                  f"match this client's shared values {sorted(shared)[:4]}...")
        for name, value in broadcast.tensors.items():
            if value.shape != template[name].shape:
                raise MessageRejected(f"broadcast {name!r} has shape {tuple(value.shape)}, this "
                                      f"client's network has {tuple(template[name].shape)}")
        device = self.context.device
        return {k: v.to(device=device, dtype=template[k].dtype)
                for k, v in broadcast.tensors.items()}

    def global_model(
        self, config: ClientConfig, state: ClientState, broadcast: Message,
        expected: frozenset[str] | None = None,
    ) -> nn.Module:
        """The client's network with the broadcast's global shared values loaded."""
        model = self.client_model(config, state)
        values = model.state_dict()  # shares storage with the model's tensors
        with torch.no_grad():
            for name, value in self._received(config.body, broadcast, expected).items():
                values[name].copy_(value)
        return model

    def _upload(self, config: ClientConfig, data: ClientData, round: int,
                values: dict[str, Tensor]) -> Message:
        tensors = {k: values[k] for k in sorted(self.partial.round_names(config.body, round))}
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
        """Load the global shared values, train (phases, restricted to the round's group),
        upload the round's names; frozen statistics are restored (``bn_stats="aggregate"``)."""
        round = broadcast.header.round
        expected = self.partial.fit_names(config.client_id, state, config.body, round)
        model = self.global_model(config, state, broadcast, expected)
        anchor = {k: v.detach().clone() for k, v in model.named_parameters()}
        keep = self.shared_statistics(config.body) - self.partial.round_names(config.body,
                                                                             round)
        kept = {k: v.clone() for k, v in model.state_dict().items() if k in keep}
        penalty = self.penalty(anchor)
        for trainable, phase in self.partial.phases(config.body, round):
            train_plain(model, data.train_x, data.train_y, self.objective, phase,
                        generator=generator, trainable=trainable, penalty=penalty)
        model.load_state_dict(kept, strict=False)
        upload = self._upload(config, data, round, model.state_dict())
        return self.partial.synced(model_state(model), round), upload

    def fit_group(
        self,
        configs: Sequence[ClientConfig],
        states: Sequence[ClientState],
        datas: Sequence[ClientData],
        broadcast: Message,
        generators: Sequence[torch.Generator],
    ) -> list[tuple[ClientState, Message]]:
        """`fit` of same-body clients with one vmapped training per phase (one by one
        under a schedule or for a body with BatchNorm statistics)."""
        body = check_one_body(configs)
        if self.partial.active or self.shared_statistics(body):
            return super().fit_group(configs, states, datas, broadcast, generators)
        template = self.template(body)
        params, buffers = stacked_tensors(template, states)
        received = self._received(body, broadcast)
        for p in params:
            p.update({k: v.clone() for k, v in received.items()})
        xs, ys = [d.train_x for d in datas], [d.train_y for d in datas]
        penalty = self.penalty({k: v.clone() for k, v in received.items()})
        for trainable, phase in self.phases(self.shared_names(body)):
            train_stacked(template, params, buffers, xs, ys, self.objective, phase,
                          generators=generators, trainable=trainable, penalty=penalty)
        round = broadcast.header.round
        # buffers too: a body with batch-norm statistics has them updated by training
        return [(with_parameters(s, {**b, **p}), self._upload(c, d, round, p))
                for c, s, p, b, d in zip(configs, states, params, buffers, datas, strict=True)]

    # ==== probabilistic head (module docstring; `HeadPosterior`) =========================
    def personalize(
        self,
        config: ClientConfig,
        state: ClientState,
        data: ClientData,
        broadcast: Message,
        generator: torch.Generator,
    ) -> ClientState:
        """Without a probabilistic head: unchanged (the transport does not call it). With one:
        the network the client predicts with (the global shared values and its own personal
        ones), kept as its own, plus its head posterior (`with_head_posterior`)."""
        if self.head is None:
            return state
        own = {**self._predict_parameters(config, state, broadcast),
               PERSONALIZED: torch.ones(1, dtype=torch.bool)}
        return self.with_head_posterior(config, state, own, data, broadcast)

    def has_global_head(self, body: str) -> bool:
        """Whether every client of body ``body`` holds the same head (the head is shared);
        FedBABU's never-trained head counts too."""
        return last_layers(self.template(body), 1) <= self.shared_names(body)

    def with_head_posterior(
        self,
        config: ClientConfig,
        trained: ClientState,
        personalized: ClientState,
        data: ClientData,
        broadcast: Message,
    ) -> ClientState:
        """``personalized`` plus the head posterior fitted on the features of its network
        (none without a ``head``); with ``head_prior="global"`` the prior mean is the global
        head of the client's ``trained`` state and the ``broadcast`` where the strategy has
        one."""
        if self.head is None:
            return personalized
        prior_mean = None
        if self.has_global_head(config.body):
            prior_mean = head_parameters(self.global_model(config, trained, broadcast))
        return self.head.fit(personalized, self.client_model(config, personalized), data,
                             config.client_id, prior_mean)

    def posterior(self, config: ClientConfig, state: ClientState, broadcast: Message) -> Any:
        """The client's head posterior behind its own body (``head`` set, personalised):
        `HeadPosterior.body_posterior`."""
        if self.head is None:
            return super().posterior(config, state, broadcast)
        return self.head.body_posterior(config.client_id, state, partial(
            self.client_model, config, self._predict_parameters(config, state, broadcast)))

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
        states = [self._predict_parameters(c, s, broadcast) for c, s in zip(configs, states,
                                                                            strict=True)]
        plugins = self._plugin_rows(configs, states, xs).split([int(x.shape[0]) for x in xs])
        if self.head is None:
            return [{PREDICTIVE: p} for p in plugins]
        return [self.head.rows(s, x, p, partial(self.client_model, c, s))
                for c, s, x, p in zip(configs, states, xs, plugins, strict=True)]

    def predict_rows(
        self,
        configs: Sequence[ClientConfig],
        states: Sequence[ClientState],
        broadcast: Message,
        xs: Sequence[Tensor],
    ) -> dict[str, Tensor]:
        """Without a probabilistic head, the group's softmax rows as computed: one tensor
        (with ``head=``, each client's own posterior: `predict_group`'s, concatenated)."""
        if self.head is not None:
            return super().predict_rows(configs, states, broadcast, xs)
        states = [self._predict_parameters(c, s, broadcast) for c, s in zip(configs, states,
                                                                            strict=True)]
        return {PREDICTIVE: self._plugin_rows(configs, states, xs)}

    def _plugin_rows(self, configs: Sequence[ClientConfig], states: Sequence[ClientState],
                     xs: Sequence[Tensor]) -> Tensor:
        """Softmax (sum_k B_k, C) float64 on the CPU of the group's networks (the states to
        predict with) on their inputs, client after client."""
        template = self.template(check_one_body(configs))
        params, buffers = stacked_tensors(template, states)
        logits = forward_stacked_tensors(template, params, buffers, xs)
        return torch.softmax(logits.to(torch.float64), dim=-1).cpu()


def shared_state(state: ServerState) -> dict[str, Tensor]:
    """The shared parameters of a parameter-averaging server state (without its ledger of
    declared sample counts)."""
    return {k: v for k, v in state.items() if not k.startswith(DECLARED)}


def update_norms(params: ServerState, messages: Sequence[Message]) -> Tensor:
    """(K,) float64: the L2 norm of each upload's shared parameters minus ``params`` (over
    the parameters the uploads carry; normalisation statistics are not updates)."""
    norms = torch.zeros(len(messages), dtype=torch.float64)
    sent = set(messages[0].tensors) if messages else set()
    for name, old in params.items():
        if name not in sent or is_statistic(name):
            continue
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
