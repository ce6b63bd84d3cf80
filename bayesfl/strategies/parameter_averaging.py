"""Strategies that average (part of) the client networks' parameters.

A client network is :class:`~bayesfl.strategies.networks.ClassifierNet` (``body.*`` then
``head.*``). Each subclass says which parameters are *shared* (averaged by the server,
broadcast every round) and which stay *personal* on the client, and how local training
proceeds (which parameters are trained, in which phases). The upload is the shared parameters
plus the sample count; aggregation is their mean, weighted by sample counts or not, as each
paper does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import ClassVar

import torch
from torch import Tensor, nn
from torch.func import functional_call

from bayesfl.errors import ConfigError
from bayesfl.messages import Message, Schema, TensorSpec
from bayesfl.strategies.base import (
    NUM_SAMPLES_SPEC,
    BaseStrategy,
    Client,
    ServerState,
    check_num_samples,
    num_samples_tensor,
)
from bayesfl.strategies.networks import ClassifierNet, cross_entropy_per_sample
from bayesfl.training import (
    LocalTraining,
    ParameterFilter,
    architecture_key,
    train_batched,
    train_plain,
)


def is_body(name: str) -> bool:
    return name.startswith("body.")


def is_head(name: str) -> bool:
    return name.startswith("head.")


def everything(_: str) -> bool:
    return True


class ParameterAveraging(BaseStrategy):
    """Base of FedAvg, FedPer, FedRep, LG-FedAvg and FedBABU (see the module docstring)."""

    supports_batched_training: ClassVar[bool] = True
    weighted: ClassVar[bool] = True
    """Weight client parameters by their sample counts when averaging."""

    def shared(self, name: str) -> bool:
        """Whether parameter ``name`` is averaged by the server."""
        return True

    def phases(self) -> list[tuple[ParameterFilter, LocalTraining]]:
        """Local training as (which parameters, hyperparameters) phases run in order."""
        return [(everything, self.context.training)]

    def objective(self, model_output: object, labels: Tensor) -> Tensor:
        return cross_entropy_per_sample(model_output, labels)  # type: ignore[arg-type]

    # ---- setup ----------------------------------------------------------------------------
    def build_model(self, body: nn.Module) -> nn.Module:
        return ClassifierNet(body, self.feature_dim, self.num_classes)

    def init(self, clients: Sequence[Client]) -> ServerState:
        """The shared parameters of client 0's initial network (all clients start equal)."""
        first = self._shared_of(clients[0].model)
        for c in clients[1:]:
            other = self._shared_of(c.model)
            if {k: v.shape for k, v in other.items()} != {k: v.shape for k, v in first.items()}:
                raise ConfigError(
                    f"{self.name} averages {sorted(first)[:3]}...; client {c.client_id}'s body "
                    f"{c.body_spec!r} has different shared parameter shapes than client 0's "
                    f"{clients[0].body_spec!r}: use one body for all clients with {self.name}"
                )
        state = {k: v.detach().clone() for k, v in first.items()}
        self._shared_shapes = {k: tuple(v.shape) for k, v in state.items()}
        return state

    def _shared_of(self, model: nn.Module) -> dict[str, Tensor]:
        return {k: v for k, v in model.named_parameters() if self.shared(k)}

    # ---- protocol -------------------------------------------------------------------------
    def broadcast(self, state: ServerState, round: int) -> Message:
        return self.down_message(round, dict(state))

    def _receive(self, client: Client, message: Message) -> None:
        params = dict(client.model.named_parameters())
        with torch.no_grad():
            for name, value in message.tensors.items():
                params[name].copy_(value)

    def _upload(self, client: Client, round: int) -> Message:
        tensors = {k: v.detach() for k, v in self._shared_of(client.model).items()}
        tensors["num_samples"] = num_samples_tensor(client.data.num_train)
        return self.up_message(round, client.client_id, tensors)

    def client_update(
        self, client: Client, message: Message, generator: torch.Generator
    ) -> Message:
        self._receive(client, message)
        for trainable, config in self.phases():
            train_plain(client.model, client.data.train_x, client.data.train_y, self.objective,
                        config, generator=generator, trainable=trainable)
        return self._upload(client, message.header.round)

    def client_update_batch(
        self, clients: Sequence[Client], message: Message, generators: Sequence[torch.Generator]
    ) -> list[Message]:
        if len({architecture_key(c.model) for c in clients}) != 1:
            return super().client_update_batch(clients, message, generators)
        for c in clients:
            self._receive(c, message)
        for trainable, config in self.phases():
            train_batched([c.model for c in clients], [c.data.train_x for c in clients],
                          [c.data.train_y for c in clients], self.objective, config,
                          generators=generators, trainable=trainable)
        return [self._upload(c, message.header.round) for c in clients]

    def upload_schema(self) -> Schema:
        schema = {name: TensorSpec(tuple(shape), torch.float32)
                  for name, shape in self._shared_shapes.items()}
        schema["num_samples"] = NUM_SAMPLES_SPEC
        return schema

    def check_invariants(self, message: Message) -> None:
        check_num_samples(message)

    def aggregate(
        self,
        state: ServerState,
        uploads: Sequence[Message],
        round: int,
        generator: torch.Generator,
    ) -> ServerState:
        if not uploads:
            return state
        weights = torch.tensor(
            [float(m.tensors["num_samples"].item()) if self.weighted else 1.0 for m in uploads],
            dtype=torch.float64,
        )
        weights = weights / weights.sum()
        new = {}
        for name, old in state.items():
            stacked = torch.stack([m.tensors[name].to(torch.float64) for m in uploads])
            mean = torch.tensordot(weights, stacked, dims=1)
            new[name] = mean.to(dtype=old.dtype, device=old.device)
        return new

    def predict_proba(self, client: Client, state: ServerState, x: Tensor) -> Tensor:
        """Softmax of the client network with the global shared and its personal parameters."""
        params = {k: v for k, v in client.model.named_parameters() if not self.shared(k)}
        params.update({k: v.to(x.device) for k, v in state.items()})
        return _softmax_of(client.model, params, x)


@torch.no_grad()
def _softmax_of(model: nn.Module, params: dict[str, Tensor], x: Tensor) -> Tensor:
    was_training = model.training
    model.eval()
    try:
        out = functional_call(model, params, (x,), strict=False)
    finally:
        model.train(was_training)
    logits = out[0] if isinstance(out, tuple) else out
    return torch.softmax(logits.to(torch.float64), dim=-1)


def with_epochs(config: LocalTraining, epochs: int) -> LocalTraining:
    return replace(config, epochs=epochs)
