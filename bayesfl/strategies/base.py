"""The strategy protocol: one federated algorithm as pure-ish functions over messages.

A strategy knows one algorithm (FedLog, FedAvg, ...) and nothing about transport. The
simulator (and any other transport) drives it like this, once per round ``r``::

    down = strategy.broadcast(state, r)                       # server -> every sampled client
    up_k = strategy.client_update(client_k, down, generator)  # local training, then the upload
    strategy.validate_upload(up_k, round=r, client_id=k)      # raises MessageRejected
                                                              # (validate_uploads: many)
    state = strategy.aggregate(state, accepted_uploads, r, generator)
    probs = strategy.predict_proba(client_k, state, x)        # (B, C) for evaluation

``state`` (the server state) is a flat ``dict[str, Tensor]`` so that it can be checkpointed
as is. What a client keeps across rounds lives in :class:`Client` (its model's parameters and
``extra`` tensors such as a personal head) and is checkpointed by the transport too.

A strategy with ``init_round = True`` needs a round 0 before training starts (FedLog's
"pretrain" round: statistics of the untrained bodies give the first head); the transport runs
it with every client and counts its bytes like any other round.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from bayesfl.data.clients import ClientData
from bayesfl.errors import MessageRejected
from bayesfl.messages import Header, Message, Schema, TensorSpec, validate
from bayesfl.training import LocalTraining

ServerState = dict[str, Tensor]


@dataclass
class Client:
    """One simulated client.

    Attributes:
        client_id: 0-based index, equal to ``data.client_id``.
        data: its local train/test data.
        model: the module it trains (built by :meth:`Strategy.build_model` from its body).
        body_spec: the body's spec string, e.g. ``"mlp:200"``.
        extra: other tensors the client keeps across rounds (strategy-specific).
    """

    client_id: int
    data: ClientData
    model: nn.Module
    body_spec: str
    extra: dict[str, Tensor] = field(default_factory=dict)

    def persistent_state(self) -> dict[str, Tensor]:
        """Every tensor the client keeps across rounds, flat and name-prefixed."""
        state = {f"model.{k}": v.detach().clone() for k, v in self.model.state_dict().items()}
        state.update({f"extra.{k}": v.detach().clone() for k, v in self.extra.items()})
        return state

    def load_persistent_state(self, state: Mapping[str, Tensor]) -> None:
        """Restore what :meth:`persistent_state` returned."""
        model_state = {k[6:]: v for k, v in state.items() if k.startswith("model.")}
        self.model.load_state_dict(model_state, strict=True)
        self.extra = {k[6:]: v.clone() for k, v in state.items() if k.startswith("extra.")}


@dataclass(frozen=True)
class StrategyContext:
    """What every strategy is built with.

    Attributes:
        num_classes: C.
        feature_dim: d, the output width of every client body.
        training: local-training hyperparameters.
        rounds: number of training rounds of the run (DP accounting needs it).
        device: where client models and server tensors live.
        seed: the run's seed (strategies derive their own deterministic generators from it).
    """

    num_classes: int
    feature_dim: int
    training: LocalTraining = field(default_factory=LocalTraining)
    rounds: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    seed: int = 0


@runtime_checkable
class Strategy(Protocol):
    """Structural type of a federated algorithm (see the module docstring)."""

    name: str
    init_round: bool

    def build_model(self, body: nn.Module) -> nn.Module: ...

    def init(self, clients: Sequence[Client]) -> ServerState: ...

    def broadcast(self, state: ServerState, round: int) -> Message: ...

    def client_update(
        self, client: Client, message: Message, generator: torch.Generator
    ) -> Message: ...

    def client_update_batch(
        self, clients: Sequence[Client], message: Message, generators: Sequence[torch.Generator]
    ) -> list[Message]: ...

    def upload_schema(self) -> Schema: ...

    def max_upload_bytes(self) -> int: ...

    def validate_upload(self, message: Message, *, round: int, client_id: int) -> None: ...

    def validate_uploads(
        self, messages: Sequence[Message], *, round: int, client_ids: Sequence[int]
    ) -> list[str | None]: ...

    def aggregate(
        self,
        state: ServerState,
        uploads: Sequence[Message],
        round: int,
        generator: torch.Generator,
    ) -> ServerState: ...

    def predict_proba(self, client: Client, state: ServerState, x: Tensor) -> Tensor: ...

    def predict_proba_batch(
        self, clients: Sequence[Client], state: ServerState, xs: Sequence[Tensor]
    ) -> list[Tensor]: ...


class BaseStrategy:
    """Shared plumbing: headers, schema validation, size limits, the per-client batch loop.

    Subclasses set ``name`` and implement the algorithm; they add algorithm invariants by
    overriding :meth:`check_invariants` (called after the schema check).
    """

    name: ClassVar[str] = "base"
    init_round: ClassVar[bool] = False
    supports_batched_training: ClassVar[bool] = False

    def __init__(self, context: StrategyContext) -> None:
        self.context = context

    @property
    def num_classes(self) -> int:
        return self.context.num_classes

    @property
    def feature_dim(self) -> int:
        return self.context.feature_dim

    # ---- messages -------------------------------------------------------------------------
    def header(self, round: int, client_id: int, direction: str) -> Header:
        return Header(strategy=self.name, round=round, client_id=client_id, direction=direction)

    def down_message(self, round: int, tensors: dict[str, Tensor]) -> Message:
        return Message(self.header(round, -1, "down"), _wire(tensors))

    def up_message(self, round: int, client_id: int, tensors: dict[str, Tensor]) -> Message:
        return Message(self.header(round, client_id, "up"), _wire(tensors))

    def upload_schema(self) -> Schema:  # pragma: no cover - every strategy overrides it
        raise TypeError(f"{type(self).__name__} must define upload_schema()")

    def max_upload_bytes(self) -> int:
        """Reject encoded uploads above this size before parsing them: twice the schema's
        tensor bytes plus 64 KiB for the safetensors header."""
        total = 0
        for spec in self.upload_schema().values():
            numel = 1
            for dim in spec.shape:
                numel *= dim if dim is not None else 1
            total += numel * torch.empty((), dtype=spec.dtype).element_size()
        return 2 * total + 64 * 1024

    def validate_upload(self, message: Message, *, round: int, client_id: int) -> None:
        """Schema (names, shapes, dtypes, finiteness), header, then algorithm invariants.

        Raises:
            MessageRejected: with the precise reason.
        """
        validate(
            message,
            self.upload_schema(),
            strategy=self.name,
            round=round,
            client_id=client_id,
            direction="up",
        )
        self.check_invariants(message)

    def check_invariants(self, message: Message) -> None:
        """Algorithm-specific checks of a schema-valid upload; raise MessageRejected."""

    def validate_uploads(
        self, messages: Sequence[Message], *, round: int, client_ids: Sequence[int]
    ) -> list[str | None]:
        """:meth:`validate_upload` of many uploads: per upload None (accepted) or the reason
        it is rejected. Strategies may check many uploads together, but the verdicts and
        reasons must be those of :meth:`validate_upload` one upload at a time."""
        reasons: list[str | None] = []
        for message, cid in zip(messages, client_ids, strict=True):
            try:
                self.validate_upload(message, round=round, client_id=cid)
            except MessageRejected as err:
                reasons.append(err.reason)
            else:
                reasons.append(None)
        return reasons

    # ---- client side ----------------------------------------------------------------------
    def client_update_batch(
        self, clients: Sequence[Client], message: Message, generators: Sequence[torch.Generator]
    ) -> list[Message]:
        """Default: one :meth:`client_update` per client (strategies may batch)."""
        return [
            self.client_update(c, message, g) for c, g in zip(clients, generators, strict=True)
        ]

    def predict_proba_batch(
        self, clients: Sequence[Client], state: ServerState, xs: Sequence[Tensor]
    ) -> list[Tensor]:
        """``[predict_proba(clients[k], state, xs[k]) for k]`` (strategies may batch)."""
        return [self.predict_proba(c, state, x) for c, x in zip(clients, xs, strict=True)]

    def client_update(
        self, client: Client, message: Message, generator: torch.Generator
    ) -> Message:  # pragma: no cover - every strategy overrides it
        raise TypeError(f"{type(self).__name__} must define client_update()")


def _wire(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Tensors as they travel: detached, contiguous, on the CPU."""
    return {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}


def num_samples_tensor(n: int) -> Tensor:
    """The sample count as it travels in uploads: shape (1,), int64."""
    return torch.tensor([n], dtype=torch.int64)


NUM_SAMPLES_SPEC = TensorSpec((1,), torch.int64)


def check_num_samples(message: Message) -> int:
    """The upload's positive sample count, or MessageRejected."""
    n = int(message.tensors["num_samples"].item())
    if n < 1:
        raise MessageRejected(f"num_samples must be >= 1, got {n}",
                              client_id=message.header.client_id)
    return n
