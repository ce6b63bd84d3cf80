"""The strategy contract (v2): one federated algorithm in a server half and a client half.

The two halves share **no Python objects**, only messages. A transport (the embedded
simulator, a Flower app) builds the strategy from the run configuration on each side and
drives it like this in round ``r``::

    # server half
    plan = strategy.configure(server_state, r)           # RoundPlan: broadcast + upload schema
    # client half, on each sampled client k (its config, data and state are its own)
    state_k, upload_k = strategy.fit(config_k, state_k, data_k, plan.broadcast, generator_k)
    # server half
    verdicts = strategy.validate_uploads(plan, uploads, client_ids)   # None or a reason each
    server_state = strategy.aggregate(server_state, accepted_uploads, r, generator)
    # client half, every client: a calibration accumulator state (+ probabilities on request)
    evaluation_k = strategy.evaluate(config_k, state_k, data_k,
                                     strategy.configure_evaluation(server_state, r))
    # after training, and for a client that never trained
    state_k = strategy.personalize(config_k, state_k, data_k, broadcast, generator_k)

* **Server half** (`ServerStrategy`): `init` (from the run config alone: the
  `StrategyContext`), `configure`, `validate_uploads`, `aggregate`, `configure_evaluation`,
  the round's figures (`server_metrics`, `compute_metrics`) and `describe`. The server state
  is a flat ``dict[str, Tensor]`` (checkpointable as is).
* **Client half** (`ClientStrategy`): `init_client` (from the client's own `ClientConfig`),
  `fit`, `personalize`, `predict`, `evaluate`, `posterior`. The client state is a flat
  ``dict[str, Tensor]`` too (what a Flower ClientApp keeps in ``Context.state``):
  ``model.<name>`` for every parameter and buffer of its network, plus whatever else the
  strategy keeps. A client half needs nothing but its config, its data, its state and the
  bytes it receives.
* **Shared configuration** (`StrategyConfig`, the base of both): the class attributes
  (``name``, ``init_round``, ``personalizes``, ``is_posterior``, ``round_view``), the run
  configuration (``context``), the declared options and the network of a body spec
  (`template`). Both halves read it; neither writes it after construction.
* `Strategy` is both halves in one class (``class Strategy(ServerStrategy, ClientStrategy)``),
  so a strategy is written in one module; each side of a transport holds it through a view of
  its own half (`bayesfl.strategies.halves`: `ServerView` in the engine, `ClientView` in the
  client runner), which refuses the other half's methods. `SERVER_API`, `CLIENT_API` and
  `SHARED_API` name the methods and attributes of each part.
* **Groups**: a transport may hand a strategy several clients *with the same body* at once
  (`fit_group`, `predict_group`); strategies that can train or
  predict them together (vmap over stacked parameters) override these. A group's prediction
  may stay one tensor: `predict_rows` gives the clients' probabilities
  concatenated client after client (what `evaluate_group` scores), and a
  strategy that computes them that way overrides it instead of splitting them per client for
  the caller to concatenate again. Forming the groups is the transport's job
  (`bayesfl.executor`), never a strategy's.

A strategy object holds only its configuration (options and context), which both sides build
from the same run configuration; it is never mutated after construction (templates of client
networks are memoised per body spec on each side: `StrategyConfig.MEMOS`).
A strategy with ``init_round = True`` needs a round 0 before training starts (FedLog's
"pretrain" round); the transport runs it with every client and counts its bytes like any other.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch
from torch import Tensor, nn

from bayesfl.bodies import build_body, check_feature_dim
from bayesfl.data.clients import ClientData
from bayesfl.errors import ConfigError, MessageRejected
from bayesfl.messages import Header, Message, Schema, validate_many
from bayesfl.strategies.uploads import wire
from bayesfl.training import LocalTraining
from calibration.accumulator import Accumulator
from inference.posterior import Posterior

ServerState = dict[str, Tensor]
ClientState = dict[str, Tensor]

PREDICTIVE = "predictive"
"""Key of a strategy's headline predictive in `Strategy.predict` (for posterior
strategies: the posterior predictive)."""
MAP_PLUGIN = "map_plugin"
"""Key of a posterior strategy's MAP plug-in predictive, reported beside the headline."""

MODEL_PREFIX = "model."


PERSONALIZE_SEED_KEY = 2**31 - 2
"""Key of `derived_seed` for the generator each client personalises with
(``derived_seed(run seed, PERSONALIZE_SEED_KEY, client id)``): every transport derives it the
same way, so a Flower node personalises exactly as the simulator's client does."""


def derived_seed(seed: int, *keys: int) -> int:
    """A 63-bit seed derived from ``seed`` and integer ``keys`` (numpy SeedSequence)."""
    words = np.random.SeedSequence([seed, *[k % 2**32 for k in keys]]).generate_state(2)
    return int((int(words[0]) << 31) ^ int(words[1])) & (2**63 - 1)


@contextlib.contextmanager
def seeded_rng(seed: int, device: torch.device | str = "cpu") -> Iterator[None]:
    """Inside the block, the global generators a module on ``device`` draws from are seeded
    with ``seed``: the CPU's, and ``device``'s own when it is a CUDA device. Afterwards they are
    back in their states from before, so the caller's random stream does not move.

    Not ``torch.manual_seed``: that also seeds every other backend (all CUDA devices, XPU,
    MTIA), and each backend not yet started records a traceback for its deferred seeding:
    ~0.5 ms a call inside a simulation, 8 s of setting up 16,000 clients (issue 28).
    """
    device = torch.device(device)
    cuda = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.random.default_generator.manual_seed(seed)
        if cuda:
            torch.cuda.default_generators[device.index if device.index is not None
                                          else torch.cuda.current_device()].manual_seed(seed)
        yield


@dataclass(frozen=True)
class ClientConfig:
    """What one client is configured with (its own, never the server's).

    Attributes:
        client_id: 0-based index.
        body: its body spec, e.g. ``"mlp:200"`` (`bayesfl.bodies.build_body`).
        init_seed: the seed its network is initialised from (clients with the same body and
            seed start from the same weights, as the papers do).
    """

    client_id: int
    body: str
    init_seed: int


@dataclass(frozen=True)
class StrategyContext:
    """The run configuration both halves are built from.

    Attributes:
        num_classes: C.
        feature_dim: d, the output width of every client body.
        training: local-training hyperparameters.
        rounds: number of training rounds of the run (DP accounting needs it).
        device: where client models and server tensors live.
        seed: the run's seed (strategies derive their own deterministic generators from it).
        input_shape: the shape of one input, e.g. ``(64,)`` (builds bodies from specs).
        bodies: the body specs, assigned to clients in turn (client k gets
            ``bodies[k % len(bodies)]``).
        clients: the number of clients of the run.
    """

    num_classes: int
    feature_dim: int
    training: LocalTraining = field(default_factory=LocalTraining)
    rounds: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    seed: int = 0
    input_shape: tuple[int, ...] = ()
    bodies: tuple[str, ...] = ("mlp:200",)
    clients: int = 1

    def client_config(self, client_id: int) -> ClientConfig:
        """Client ``client_id``'s config: its body spec in turn, one init seed per spec."""
        if not 0 <= client_id < self.clients:
            raise ConfigError(f"client id {client_id} out of range [0, {self.clients})")
        spec = self.bodies[client_id % len(self.bodies)]
        return ClientConfig(client_id, spec, self.init_seed(spec))

    def init_seed(self, body: str) -> int:
        """The initialisation seed of every network of body spec ``body`` (one per spec)."""
        return _spec_seed(self.seed, self.bodies.index(body))


@functools.lru_cache(maxsize=1024)
def _spec_seed(seed: int, spec_index: int) -> int:
    """``derived_seed(seed, 11, spec_index)``, memoised: every client asks for its spec's
    (16,000 clients' set-up spent 0.6 s hashing the same few seeds)."""
    return derived_seed(seed, 11, spec_index)


@dataclass(frozen=True)
class RoundPlan:
    """What the server half sends in one round and what it accepts back.

    Attributes:
        round: the round.
        broadcast: the message every sampled client receives.
        upload_schema: names, shapes and dtypes an upload of this round must have (a schedule
            such as FedPart changes it from round to round).
        state: the server state the round starts from (server-side only, never sent): upload
            checks that compare with it (an update's norm, a declared sample count) read it.
    """

    round: int
    broadcast: Message
    upload_schema: Schema
    state: Mapping[str, Tensor] = field(default_factory=dict, repr=False, compare=False)

    @property
    def max_upload_bytes(self) -> int:
        """Encoded uploads above this size are rejected before parsing: twice the schema's
        tensor bytes plus 64 KiB for the safetensors header."""
        total = 0
        for spec in self.upload_schema.values():
            numel = 1
            for dim in spec.shape:
                numel *= dim if dim is not None else 1
            total += numel * torch.empty((), dtype=spec.dtype).element_size()
        return 2 * total + 64 * 1024


@dataclass
class Evaluation:
    """One client's evaluation: calibration accumulator states per predictive.

    Attributes:
        client_id: whose evaluation.
        accumulators: ``{PREDICTIVE: Accumulator, MAP_PLUGIN: Accumulator (posterior
            strategies)}``; what a client sends to a real server (mergeable, exact).
        probs: the same predictives' probabilities (n_test, C), float64 on the CPU, when the
            transport asked for them (the simulator keeps them for plots); else empty.
        labels: (n_test,) int64 labels when ``probs`` are kept.
    """

    client_id: int
    accumulators: dict[str, Accumulator]
    probs: dict[str, Tensor] = field(default_factory=dict)
    labels: Tensor | None = None


class StrategyConfig:
    """The part of a strategy both halves read and neither writes: its declared configuration.

    That is the class attributes below, the run configuration (`context`), the options
    (declared as data in ``OPTIONS``, `bayesfl.strategies.registry`; ``__init__`` checks
    them and keeps them as attributes) and the network of a body spec (`build_model`,
    `initial_model`, `template`): a pure function of the configuration, which the
    server half needs for its initial state and the client half for its own. Everything here
    is set at construction; afterwards only `MEMOS` change, and only by adding entries
    (a memo of a pure function of the configuration: which half fills it first changes no
    value either reads).
    """

    name: ClassVar[str] = "base"
    init_round: ClassVar[bool] = False
    """Whether the run has a round 0 before training (FedLog's "pretrain" round)."""
    personalizes: ClassVar[bool] = False
    """Whether `ClientStrategy.personalize` does anything (the transport skips it
    otherwise)."""
    is_posterior: ClassVar[bool] = False
    """Whether `ClientStrategy.posterior` returns an [`inference`][inference] posterior."""
    round_view: ClassVar[str | None] = None
    """What the figures of rounds before personalisation measure, where that is not the
    strategy's final predictive (the round records of ``metrics.jsonl`` carry it as
    ``round_view``); None: the same predictive."""
    MEMOS: ClassVar[frozenset[str]] = frozenset({"_templates", "_initial_states"})
    """Instance attributes that memoise pure functions of the configuration (written after
    construction, by either half, one new key at a time; never a changed value)."""

    def __init__(self, context: StrategyContext) -> None:
        self.context = context
        self._templates: dict[str, nn.Module] = {}

    @property
    def num_classes(self) -> int:
        return self.context.num_classes

    @property
    def feature_dim(self) -> int:
        return self.context.feature_dim

    def build_model(self, body: nn.Module) -> nn.Module:
        """The client network around a body (default: the body itself)."""
        return body

    def initial_model(self, config: ClientConfig) -> nn.Module:
        """Client ``config``'s initial network: its body spec, initialised from its seed.

        The global RNG is seeded inside and restored afterwards, so building a network never
        moves the caller's random stream (`seeded_rng`; the network is built on the CPU).
        """
        shape, d = self.context.input_shape, self.feature_dim
        with seeded_rng(config.init_seed):
            body = build_body(config.body, shape, d)
            check_feature_dim(body, shape, d)
            model = self.build_model(body)
        return model.to(self.context.device)

    def template(self, body: str) -> nn.Module:
        """A network of body spec ``body`` (structure only: its values are never used; client
        values come from client states). Memoised per spec."""
        if body not in self._templates:
            self._templates[body] = self.initial_model(ClientConfig(0, body, 0))
        return self._templates[body]

    def header(self, round: int, client_id: int, direction: str) -> Header:
        return Header(strategy=self.name, round=round, client_id=client_id, direction=direction)


class ServerStrategy(StrategyConfig):
    """The server half of a strategy: what a transport's server side calls, and nothing else.

    A strategy implements `init`, `broadcast_tensors`, `upload_schema` and
    `aggregate`, and adds the algorithm's invariants of uploads with
    `upload_problems`; `configure`, `configure_evaluation`,
    `validate_uploads` and `down_message` are built on them. The engine
    (`bayesfl.engine`) and Flower's ServerApp hold a strategy through
    `bayesfl.strategies.halves.ServerView`, which has these methods and the shared
    configuration (`StrategyConfig`) only.
    """

    def init(self) -> ServerState:  # pragma: no cover - every strategy overrides it
        """The initial server state, from the run config (`context`) alone."""
        raise TypeError(f"{type(self).__name__} must define init()")

    def broadcast_tensors(self, state: ServerState, round: int) -> dict[str, Tensor]:
        """What every sampled client receives in ``round``."""  # pragma: no cover
        raise TypeError(f"{type(self).__name__} must define broadcast_tensors()")

    def upload_schema(self, state: ServerState, round: int) -> Schema:  # pragma: no cover
        """What an upload of ``round`` must look like."""
        raise TypeError(f"{type(self).__name__} must define upload_schema()")

    def configure(self, state: ServerState, round: int) -> RoundPlan:
        """The broadcast of ``round`` and the schema its uploads must follow."""
        return RoundPlan(round, self.down_message(round, self.broadcast_tensors(state, round)),
                         self.upload_schema(state, round), state)

    def configure_evaluation(self, state: ServerState, round: int) -> Message:
        """What clients evaluate with after ``round``'s aggregation (default: the broadcast a
        next round would send, tagged with ``round``)."""
        return self.down_message(round, self.broadcast_tensors(state, round))

    def validate_uploads(
        self, plan: RoundPlan, messages: Sequence[Message], client_ids: Sequence[int]
    ) -> list[str | None]:
        """Per upload: None (accepted) or the reason it is rejected.

        Header (strategy, round, sender, direction), names, shapes, dtypes and finiteness per
        message against ``plan.upload_schema``; then the algorithm's invariants of all
        schema-valid uploads together (`upload_problems`).
        """
        reasons = validate_many(messages, plan.upload_schema, strategy=self.name,
                                round=plan.round, direction="up", client_ids=client_ids)
        valid = [i for i, reason in enumerate(reasons) if reason is None]
        if valid:
            problems = self.upload_problems(plan, [messages[i] for i in valid])
            for i, problem in zip(valid, problems, strict=True):
                reasons[i] = problem
        return reasons

    def validate_upload(self, plan: RoundPlan, message: Message, client_id: int) -> None:
        """`validate_uploads` of one upload.

        Raises:
            MessageRejected: with the precise reason.
        """
        reason = self.validate_uploads(plan, [message], [client_id])[0]
        if reason is not None:
            raise MessageRejected(reason, client_id=client_id)

    def upload_problems(
        self, plan: RoundPlan, messages: Sequence[Message]
    ) -> list[str | None]:
        """Algorithm invariants of schema-valid uploads: None or the violated one, each.

        One implementation serves one upload and many (the transport validates a round's
        uploads together); the default accepts everything the schema accepts.
        """
        return [None] * len(messages)

    def aggregate(
        self,
        state: ServerState,
        uploads: Sequence[Message],
        round: int,
        generator: torch.Generator,
    ) -> ServerState:  # pragma: no cover - every strategy overrides it
        """The new server state from this round's accepted uploads."""
        raise TypeError(f"{type(self).__name__} must define aggregate()")

    def server_metrics(self, state: ServerState) -> dict[str, float]:
        """Figures of the server state the transport adds to every round's metrics and to the
        summary (default none; DP strategies report their noise-to-signal)."""
        return {}

    def compute_metrics(self, plan: RoundPlan, uploads: Sequence[Message]) -> dict[str, float]:
        """Analytic compute of the local training behind this round's (schema-valid) uploads,
        which the transport adds to the round's metrics (default none; the parameter-averaging
        family reports ``flops_local``)."""
        return {}

    def describe(self) -> str | None:
        """Text the transport shows at the start of a run (default none; a FedPart schedule
        prints its layer groups and rounds)."""
        return None

    def down_message(self, round: int, tensors: Mapping[str, Tensor]) -> Message:
        return Message(self.header(round, -1, "down"), wire(tensors))


class ClientStrategy(StrategyConfig):
    """The client half of a strategy: what a client step calls, and nothing else.

    A strategy implements `fit` and `predict`; `init_client`,
    `personalize`, `evaluate`, the group forms and `posterior` have
    defaults. The client runner (`bayesfl.client.step`, used by the simulator's executor
    and by Flower's ClientApp) holds a strategy through
    `bayesfl.strategies.halves.ClientView`, which has these methods and the shared
    configuration (`StrategyConfig`) only.
    """

    def __init__(self, context: StrategyContext) -> None:
        super().__init__(context)
        self._initial_states: dict[tuple[str, int], ClientState] = {}

    def init_client(self, config: ClientConfig) -> ClientState:
        """The client's initial state: ``model.<name>`` of its initial network, its own
        tensors. The network is a function of the body spec and the seed alone, so it is built
        once per pair and each client gets a copy of its values (60 us a client instead of
        500: 16,000 clients of one spec were 7 s of building). A subclass's own
        ``initial_model`` may use more of the config: it is called for every client."""
        if type(self).initial_model is not StrategyConfig.initial_model:
            return model_state(self.initial_model(config))
        key = (config.body, config.init_seed)
        if key not in self._initial_states:
            self._initial_states[key] = model_state(self.initial_model(config))
        return {name: value.clone() for name, value in self._initial_states[key].items()}

    def client_model(self, config: ClientConfig, state: ClientState) -> nn.Module:
        """A network of the client's body holding (copies of) its state's values."""
        model = copy.deepcopy(self.template(config.body))
        model.load_state_dict(model_entries(state), strict=True)
        return model

    def fit(
        self,
        config: ClientConfig,
        state: ClientState,
        data: ClientData,
        broadcast: Message,
        generator: torch.Generator,
    ) -> tuple[ClientState, Message]:  # pragma: no cover - every strategy overrides it
        """Local work of one round: the client's new state and its upload."""
        raise TypeError(f"{type(self).__name__} must define fit()")

    def fit_group(
        self,
        configs: Sequence[ClientConfig],
        states: Sequence[ClientState],
        datas: Sequence[ClientData],
        broadcast: Message,
        generators: Sequence[torch.Generator],
    ) -> list[tuple[ClientState, Message]]:
        """`fit` of clients that share one body spec (default: one after another;
        strategies may train them together)."""
        return [self.fit(c, s, d, broadcast, g)
                for c, s, d, g in zip(configs, states, datas, generators, strict=True)]

    def personalize(
        self,
        config: ClientConfig,
        state: ClientState,
        data: ClientData,
        broadcast: Message,
        generator: torch.Generator,
    ) -> ClientState:
        """The state a client predicts with after training (or without any, for a novel
        client); default: unchanged. ``broadcast`` is `configure_evaluation`'s."""
        return state

    def predict(
        self, config: ClientConfig, state: ClientState, broadcast: Message, x: Tensor
    ) -> dict[str, Tensor]:  # pragma: no cover - every strategy overrides it
        """Class probabilities (B, C) float64 of inputs ``x`` (B, ...): ``{PREDICTIVE: ...}``
        and, for posterior strategies, ``{MAP_PLUGIN: ...}`` beside it."""
        raise TypeError(f"{type(self).__name__} must define predict()")

    def predict_group(
        self,
        configs: Sequence[ClientConfig],
        states: Sequence[ClientState],
        broadcast: Message,
        xs: Sequence[Tensor],
    ) -> list[dict[str, Tensor]]:
        """`predict` of clients that share one body spec (strategies may batch)."""
        return [self.predict(c, s, broadcast, x)
                for c, s, x in zip(configs, states, xs, strict=True)]

    def predict_rows(
        self,
        configs: Sequence[ClientConfig],
        states: Sequence[ClientState],
        broadcast: Message,
        xs: Sequence[Tensor],
    ) -> dict[str, Tensor]:
        """`predict_group`'s probabilities of each predictive concatenated client after
        client: ``{key: (sum_k B_k, C) float64 on the CPU}``, row for row the same numbers.
        The default concatenates `predict_group`'s; a strategy whose group prediction is
        one tensor to begin with overrides this (and splits it in ``predict_group``), so
        `evaluate_group` scores it without a tensor per client."""
        predictions = self.predict_group(configs, states, broadcast, xs)
        return {key: torch.cat([p[key].to("cpu", torch.float64) for p in predictions])
                for key in predictions[0]}

    def evaluate(
        self,
        config: ClientConfig,
        state: ClientState,
        data: ClientData,
        broadcast: Message,
        *,
        n_bins: int = 15,
        keep_probs: bool = False,
    ) -> Evaluation:
        """The client's calibration accumulators on its test set (module docstring)."""
        return self.evaluate_group([config], [state], [data], broadcast, n_bins=n_bins,
                                   keep_probs=keep_probs)[0]

    def round_state(self, config: ClientConfig, state: ClientState, data: ClientData,
                    broadcast: Message) -> ClientState:
        """The state a client is evaluated with (`round_view`): its own, unless the
        strategy evaluates rounds before personalisation otherwise. Must not change ``state``."""
        return state

    def round_state_group(self, configs: Sequence[ClientConfig], states: Sequence[ClientState],
                          datas: Sequence[ClientData], broadcast: Message) -> list[ClientState]:
        """`round_state` of clients that share one body spec (default: one after another;
        strategies may compute them together)."""
        return [self.round_state(c, s, d, broadcast)
                for c, s, d in zip(configs, states, datas, strict=True)]

    @torch.no_grad()
    def evaluate_group(
        self,
        configs: Sequence[ClientConfig],
        states: Sequence[ClientState],
        datas: Sequence[ClientData],
        broadcast: Message,
        *,
        n_bins: int = 15,
        keep_probs: bool = False,
    ) -> list[Evaluation]:
        """`evaluate` of clients that share one body spec (predictions batched), each
        with its `round_state`."""
        with torch.enable_grad():  # a round view may train (a head fine-tuned for the round)
            states = self.round_state_group(configs, states, datas, broadcast)
        rows = self.predict_rows(configs, states, broadcast, [d.test_x for d in datas])
        labels = torch.cat([d.test_y for d in datas]).cpu()
        sizes = [d.num_test for d in datas]
        group = torch.repeat_interleave(torch.arange(len(datas)), torch.tensor(sizes))
        # every client's accumulator from one sweep over the group's rows (the same state
        # Accumulator.update of its own rows gives)
        accumulators = {key: Accumulator.per_group(p, labels, group, len(datas), n_bins)
                        for key, p in rows.items()}
        probs = {key: p.split(sizes) for key, p in rows.items()} if keep_probs else {}
        out = []
        for k, (c, d) in enumerate(zip(configs, datas, strict=True)):
            kept = {key: probs[key][k] for key in probs}
            out.append(Evaluation(c.client_id, {key: a[k] for key, a in accumulators.items()},
                                  kept, d.test_y.cpu() if keep_probs else None))
        return out

    def posterior(self, config: ClientConfig, state: ClientState,
                  broadcast: Message) -> Posterior:
        """The federated posterior as client ``config`` holds it (posterior strategies): an
        `inference.posterior.Posterior` (``mean``, ``sample``, ``predict_proba`` of the
        client's inputs, ``to``, ``state_dict``). What ``sample(n)`` draws depends on its
        ``kind``, each draw shaped like ``mean``:

        - ``"body"`` (the FedLog family, FedPop, a probabilistic head ``head=KIND`` on any
          strategy): the head's parameters behind the client's body (the conjugate and Laplace
          heads: ``(n, C, d + 1)``, the class weights with their bias); the body is fixed.
        - ``"subnet_laplace"`` (FedSI): the whole flat parameter vector ``(n, P)``, the subnet
          entries drawn from their joint Gaussian, every other entry at the mean.
        - ``"diagonal_laplace"`` (FedSI-Fac): ``(n, P)``, every entry from its own Gaussian.
        - ``"network_gaussian"`` (pFedBayes, FedPA): the whole flat network ``(n, P)``.

        Raises:
            ConfigError: the strategy is not a posterior strategy.
        """
        raise ConfigError(f"{self.name} is not a posterior strategy: it has no posterior to "
                          "return (posterior strategies: the FedLog family)")

    def up_message(self, round: int, client_id: int, tensors: Mapping[str, Tensor]) -> Message:
        return Message(self.header(round, client_id, "up"), wire(tensors))


class Strategy(ServerStrategy, ClientStrategy):
    """Base of every strategy: one algorithm in its two halves (module docstring).

    A subclass is registered (`bayesfl.strategies.registry.register_strategy` sets its
    ``name``), declares its options (``OPTIONS``) and implements the server half
    (`ServerStrategy`: `init`, `broadcast_tensors`, `upload_schema`, `aggregate`) and the client
    half (`ClientStrategy`: `fit`, `predict`). The two halves share only `StrategyConfig`: a
    method of one half never writes an attribute a method of the other reads
    (``tests/bayesfl/strategies/test_halves.py`` checks it for every registered strategy over a
    simulated run).
    """


def model_state(model: nn.Module) -> ClientState:
    """``model.<name>`` -> detached copy, for every parameter and buffer of ``model``."""
    return {MODEL_PREFIX + k: v.detach().clone() for k, v in model.state_dict().items()}


def model_entries(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The network part of a client state, without the ``model.`` prefix."""
    n = len(MODEL_PREFIX)
    return {k[n:]: v for k, v in state.items() if k.startswith(MODEL_PREFIX)}


def stacked_tensors(
    template: nn.Module, states: Sequence[ClientState]
) -> tuple[list[dict[str, Tensor]], list[dict[str, Tensor]]]:
    """Per client: (parameters, buffers) of its network, new dicts holding its state's own
    tensors (not copies), named as in ``template`` (for
    `bayesfl.training.train_stacked`, which replaces the dicts' entries with the trained
    tensors and never writes the ones they held, and
    `bayesfl.training.forward_stacked_tensors`)."""
    p_names = [n for n, _ in template.named_parameters()]
    b_names = [n for n, _ in template.named_buffers()]
    params = [{n: s[MODEL_PREFIX + n] for n in p_names} for s in states]
    buffers = [{n: s[MODEL_PREFIX + n] for n in b_names} for s in states]
    return params, buffers


def with_parameters(state: ClientState, parameters: Mapping[str, Tensor]) -> ClientState:
    """``state`` with its network parameters replaced by ``parameters`` (a new dict)."""
    return {**state, **{MODEL_PREFIX + k: v for k, v in parameters.items()}}


def check_one_body(configs: Sequence[ClientConfig]) -> str:
    """The body spec a group shares, or ConfigError (groups are formed by the transport)."""
    bodies = {c.body for c in configs}
    if len(bodies) != 1:
        raise ConfigError(f"a client group must share one body spec, got {sorted(bodies)}")
    return next(iter(bodies))


def _declared(cls: type) -> frozenset[str]:
    """The public names a class body defines (methods, properties, class attributes)."""
    return frozenset(n for n in vars(cls) if not n.startswith("_"))


SHARED_API: frozenset[str] = _declared(StrategyConfig) | {"context", "registration", "OPTIONS"}
"""What both halves may read: `StrategyConfig`'s names, the run configuration
(``context``), the registration and the option declarations."""
SERVER_API: frozenset[str] = _declared(ServerStrategy)
"""The server half's methods (`ServerStrategy`): what the engine and Flower's ServerApp call."""
CLIENT_API: frozenset[str] = _declared(ClientStrategy)
"""The client half's methods (`ClientStrategy`): what the client runner calls."""
assert not (SERVER_API & CLIENT_API or (SERVER_API | CLIENT_API) & SHARED_API)
