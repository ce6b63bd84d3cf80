"""FedProto (Tan et al. 2022, "FedProto: Federated Prototype Learning across Heterogeneous
Clients"): clients exchange class prototypes, not parameters.

Each client keeps its whole network (body and head) personal. Local training minimises
cross-entropy plus ``lam * mean_j (phi_j(x) - P_y,j)^2`` (MSE to the global prototype of
the sample's class; classes without a global prototype contribute no such term). After
training, a client uploads its per-class mean features (C, d) and class counts (C,).

Prediction (``inference``): FedProto's rule is the nearest global prototype,
``argmin_j ||phi(x) - P_j||_2``; ``inference="prototype"`` (default) turns it into
probabilities as prototypical networks do, ``softmax_j(-||phi(x) - P_j||^2)`` over the classes
that have a global prototype (the others get 0), so its argmax is that rule. Before any
prototype exists it falls back to the head. ``inference="head"`` uses each client's own
network (its head's softmax), what FedProto's code reports as accuracy "w/o protos".

Aggregation: the global prototype of class y averages the prototypes of the clients that hold
y. By default weighted by their counts of y, ``sum_i |D_iy| / N_y * C_iy``: the weights of
FedProto's aggregation equation (its extra 1/|N_y| factor would shrink the prototype towards 0
and is not applied) and of its convergence analysis. ``weighted=False`` gives the plain mean
over those clients, which is what FedProto's published code computes.

Defaults (the [FedLog paper](https://arxiv.org/abs/2407.08337) gives no FedProto hyperparameters):
``lam = 1``, FedProto's tuned value for MNIST and FEMNIST (0.1 for CIFAR-10) and the optimum
of its lambda sweep; the distance is the MSE (mean over feature dimensions), as the
``nn.MSELoss`` of FedProto's code. Local training (optimiser, epochs, batch size) is the
run's, as for the other baselines (the FedLog paper: "mostly follow LG-FedAvg").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch
from torch import Tensor, nn

from bayesfl.data.clients import ClientData
from bayesfl.errors import ConfigError
from bayesfl.messages import Message, Schema, TensorSpec
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
from bayesfl.strategies.networks import PrototypeNet, batched_apply, cross_entropy_per_sample
from bayesfl.strategies.options import option_number
from bayesfl.strategies.registry import Option, register_strategy
from bayesfl.strategies.uploads import NUM_SAMPLES_SPEC, num_samples_problem, num_samples_tensor
from bayesfl.training import train_plain, train_stacked


class PrototypeObjective:
    """Per-sample CE of the logits plus ``lam`` times the MSE of the features to the global
    prototype of the label (only where that prototype exists)."""

    def __init__(self, prototypes: Tensor, present: Tensor, lam: float) -> None:
        self.prototypes, self.present, self.lam = prototypes, present, lam

    def __call__(self, output: tuple[Tensor, Tensor], labels: Tensor) -> Tensor:
        logits, features = output
        loss = cross_entropy_per_sample(logits, labels)
        gap = (features - self.prototypes[labels]).pow(2).mean(dim=-1)
        return loss + self.lam * self.present[labels] * gap


@register_strategy("fedproto",
                   broadcast="global prototypes, which classes are present",
                   upload="class prototypes, counts, `num_samples`",
                   aggregate="count-weighted mean; nearest-prototype prediction")
class FedProto(Strategy):
    """FedProto: personal networks; class prototypes exchanged and count-weighted averaged.

    Args:
        context: classes, feature dimension, local training, rounds, device, seed.
        lam: weight of the prototype regulariser (FedProto's MNIST/FEMNIST value 1).
        weighted: weight client prototypes by their class counts (default) or not.
        inference: ``"prototype"`` (nearest global prototype, default) or ``"head"``.
    """

    INFERENCE: ClassVar[tuple[str, ...]] = ("prototype", "head")

    OPTIONS: ClassVar[tuple[Option, ...]] = (
        Option("lam", float, 1.0,
               "weight of the prototype regulariser (FedProto's MNIST/FEMNIST value 1).",
               minimum=0.0),
        Option("weighted", bool, True,
               "weight client prototypes by their class counts (default) or not."),
        Option("inference", str, "prototype",
               '`"prototype"` (nearest global prototype, default) or `"head"`.'),
    )

    def __init__(
        self,
        context: StrategyContext,
        *,
        lam: float = 1.0,
        weighted: bool = True,
        inference: str = "prototype",
    ) -> None:
        super().__init__(context)
        if not isinstance(weighted, bool):
            raise ConfigError(f"fedproto weighted must be true or false, got {weighted!r}")
        if inference not in self.INFERENCE:
            raise ConfigError(f"fedproto inference must be one of {', '.join(self.INFERENCE)}; "
                              f"got {inference!r}")
        self.lam = option_number("fedproto", "lam", lam)
        self.weighted = weighted
        self.inference = inference

    def build_model(self, body: nn.Module) -> nn.Module:
        return PrototypeNet(body, self.feature_dim, self.num_classes)

    # ==== server half ======================================================================
    def init(self) -> ServerState:
        return {"prototypes": torch.zeros(self.num_classes, self.feature_dim),
                "counts": torch.zeros(self.num_classes, dtype=torch.float64)}

    def broadcast_tensors(self, state: ServerState, round: int) -> dict[str, Tensor]:
        present = (state["counts"] > 0).to(torch.float32)
        return {"prototypes": state["prototypes"], "present": present}

    def upload_schema(self, state: ServerState, round: int) -> Schema:
        return {"prototypes": TensorSpec((self.num_classes, self.feature_dim), torch.float32),
                "counts": TensorSpec((self.num_classes,), torch.int64),
                "num_samples": NUM_SAMPLES_SPEC}

    def upload_problems(self, plan: RoundPlan, messages: Sequence[Message]) -> list[str | None]:
        """Non-negative counts summing to ``num_samples``; zero prototypes of absent classes."""
        return [self._problem(m) for m in messages]

    @staticmethod
    def _problem(message: Message) -> str | None:
        problem = num_samples_problem(message)
        if problem:
            return problem
        n = int(message.tensors["num_samples"].item())
        counts = message.tensors["counts"]
        if (counts < 0).any():
            return "negative class counts"
        if int(counts.sum()) != n:
            return f"class counts sum to {int(counts.sum())} but num_samples is {n}"
        if (message.tensors["prototypes"][counts == 0] != 0).any():
            return "non-zero prototype for a class with count 0"
        return None

    def aggregate(
        self,
        state: ServerState,
        uploads: Sequence[Message],
        round: int,
        generator: torch.Generator,
    ) -> ServerState:
        if not uploads:
            return state
        counts = torch.stack([u.tensors["counts"].to(torch.float64) for u in uploads])
        protos = torch.stack([u.tensors["prototypes"].to(torch.float64) for u in uploads])
        total = counts.sum(0)
        weights = counts if self.weighted else (counts > 0).to(counts)
        mean = (weights[:, :, None] * protos).sum(0) / weights.sum(0).clamp_min(1.0)[:, None]
        return {"prototypes": mean.to(torch.float32), "counts": total}

    # ==== client half ======================================================================
    def _objective(self, message: Message) -> PrototypeObjective:
        device = self.context.device
        return PrototypeObjective(message.tensors["prototypes"].to(device),
                                  message.tensors["present"].to(device), self.lam)

    def fit(
        self,
        config: ClientConfig,
        state: ClientState,
        data: ClientData,
        broadcast: Message,
        generator: torch.Generator,
    ) -> tuple[ClientState, Message]:
        model = self.client_model(config, state)
        train_plain(model, data.train_x, data.train_y, self._objective(broadcast),
                    self.context.training, generator=generator)
        _, features = batched_apply(model, data.train_x)
        return model_state(model), self._upload(config, data, broadcast.header.round, features)

    def fit_group(
        self,
        configs: Sequence[ClientConfig],
        states: Sequence[ClientState],
        datas: Sequence[ClientData],
        broadcast: Message,
        generators: Sequence[torch.Generator],
    ) -> list[tuple[ClientState, Message]]:
        template = self.template(check_one_body(configs))
        params, buffers = stacked_tensors(template, states)
        train_stacked(template, params, buffers, [d.train_x for d in datas],
                      [d.train_y for d in datas], self._objective(broadcast),
                      self.context.training, generators=generators)
        out = []
        for c, s, p, d in zip(configs, states, params, datas, strict=True):
            new = with_parameters(s, p)
            _, features = batched_apply(self.client_model(c, new), d.train_x)
            out.append((new, self._upload(c, d, broadcast.header.round, features)))
        return out

    def _upload(self, config: ClientConfig, data: ClientData, round: int,
                features: Tensor) -> Message:
        y = data.train_y
        counts = torch.bincount(y, minlength=self.num_classes)
        sums = torch.zeros(self.num_classes, self.feature_dim, dtype=torch.float64,
                           device=features.device)
        sums.index_add_(0, y, features.to(torch.float64))
        protos = sums / counts.clamp_min(1).to(sums)[:, None]
        return self.up_message(round, config.client_id, {
            "prototypes": protos.to(torch.float32), "counts": counts.to(torch.int64),
            "num_samples": num_samples_tensor(data.num_train)})

    def predict(
        self, config: ClientConfig, state: ClientState, broadcast: Message, x: Tensor
    ) -> dict[str, Tensor]:
        """(n, C) float64 class probabilities of ``x`` (n, ...) for the client."""
        logits, features = batched_apply(self.client_model(config, state), x)
        present = broadcast.tensors["present"].to(features.device) > 0
        if self.inference == "head" or not bool(present.any()):
            return {PREDICTIVE: torch.softmax(logits.to(torch.float64), dim=-1).cpu()}
        prototypes = broadcast.tensors["prototypes"].to(device=features.device,
                                                        dtype=torch.float64)
        distances = torch.cdist(features.to(torch.float64), prototypes).square()
        scores = (-distances).masked_fill(~present, float("-inf"))
        return {PREDICTIVE: torch.softmax(scores, dim=-1).cpu()}
