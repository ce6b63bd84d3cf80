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

Each module's docstring gives the source of its weighting. With the FedLog paper's shard
partitions every client holds the same number of samples, so weighted and unweighted means
coincide there; they differ under Dirichlet or unequal partitions.

The split is computed per client model at :meth:`ParameterAveraging.init`; every client must
then have the same shared parameter names and shapes (clients with different bodies work only
where the body is personal, e.g. ``lg-fedavg`` with its one global layer, the head).
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
from bayesfl.strategies.networks import (
    ClassifierNet,
    cross_entropy_per_sample,
    last_layers,
    layer_parameter_names,
)
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

    def shared_parameters(self, model: nn.Module) -> frozenset[str]:
        """Names of the parameters of ``model`` that the server averages (default: all)."""
        return frozenset(name for name, _ in model.named_parameters())

    def shared(self, name: str) -> bool:
        """Whether parameter ``name`` is averaged by the server (known after :meth:`init`)."""
        names = getattr(self, "_shared_names", None)
        if names is None:
            raise RuntimeError(f"{self.name}: call init(clients) before asking what is shared")
        return name in names

    def personal(self, name: str) -> bool:
        """Whether parameter ``name`` stays on the client (the complement of :meth:`shared`)."""
        return not self.shared(name)

    def phases(self) -> list[tuple[ParameterFilter, LocalTraining]]:
        """Local training as (which parameters, hyperparameters) phases run in order."""
        return [(everything, self.context.training)]

    def objective(self, model_output: object, labels: Tensor) -> Tensor:
        return cross_entropy_per_sample(model_output, labels)  # type: ignore[arg-type]

    # ---- setup ----------------------------------------------------------------------------
    def build_model(self, body: nn.Module) -> nn.Module:
        return ClassifierNet(body, self.feature_dim, self.num_classes)

    def init(self, clients: Sequence[Client]) -> ServerState:
        """The shared parameters of client 0's initial network (all clients start equal).

        Raises:
            ConfigError: a layer count that does not fit the networks, or clients whose shared
                parameters differ in names or shapes.
        """
        def shared_of(model: nn.Module) -> dict[str, Tensor]:
            names = self.shared_parameters(model)
            return {k: v for k, v in model.named_parameters() if k in names}

        first = shared_of(clients[0].model)
        for c in clients[1:]:
            other = shared_of(c.model)
            if {k: v.shape for k, v in other.items()} != {k: v.shape for k, v in first.items()}:
                raise ConfigError(
                    f"{self.name} averages {sorted(first)[:3]}...; client {c.client_id}'s body "
                    f"{c.body_spec!r} has different shared parameter shapes than client 0's "
                    f"{clients[0].body_spec!r}: use one body for all clients with {self.name}"
                )
        state = {k: v.detach().clone() for k, v in first.items()}
        self._shared_names = frozenset(state)
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
