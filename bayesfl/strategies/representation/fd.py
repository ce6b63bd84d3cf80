"""FD, federated distillation (Jeong et al. 2018, "Communication-Efficient On-Device Machine
Learning: Federated Distillation and Augmentation"), the CoLearn paper's baseline: clients
share per-class mean logits, never weights, and distill from the aggregate.

**Upload** (per round): ``logits`` (C, C) float32, row c the mean logit vector of the
client's class-c training samples (zero row for an absent class), and ``counts`` (C,) int64.
The server keeps the count-weighted mean per class (``logits``, ``counts``) and the round it
was formed in.

**Local objective**, per sample ``(x, y)``::

    CE(z, y) + beta * T^2 * KL(softmax(g_y / T) || softmax(z / T))

where ``g_y`` is the teacher logit vector of class y: by default (``exclude_self=True``, as
Jeong et al.) the aggregate *without* the client's own contribution, which the client removes
exactly when the aggregate is of the round it last uploaded in (it keeps its last upload in
its state, ``fd.*``); otherwise the full aggregate. Samples whose class has no teacher get CE
only. The [CoLearn paper](https://arxiv.org/abs/2211.10943) leaves FD's weight and temperature
unstated:
``beta = 1`` and ``T = 1`` here, both options.

Validation: non-negative counts with at least one sample, zero rows for absent classes,
``|logit| <= max_abs`` (1e4), and a total count at most ``screening_ratio`` (10) times the
round's median total. Prediction is the client's own network. Clients keep personal networks
(``independent_init``, ``keep_optimizer``: :mod:`bayesfl.strategies.representation.personal`).
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
    StrategyContext,
    model_state,
)
from bayesfl.strategies.networks import ClassifierNet, batched_apply, cross_entropy_per_sample
from bayesfl.strategies.options import option_number
from bayesfl.strategies.registry import Option, register_strategy
from bayesfl.strategies.representation.personal import PersonalStrategy, class_means
from bayesfl.strategies.robust import first_reasons, screening_reasons


def teacher_logits(
    mean: Tensor, counts: Tensor, own_mean: Tensor | None = None, own_counts: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Per-class teacher logits (C, C) and their presence (C,) bool: the aggregate ``mean``
    (C, C) with ``counts`` (C,), minus the client's own contribution when given."""
    mean, counts = mean.to(torch.float64), counts.to(torch.float64)
    if own_mean is None or own_counts is None:
        return mean, counts > 0
    own_counts = own_counts.to(torch.float64)
    rest = counts - own_counts
    sums = mean * counts[:, None] - own_mean.to(torch.float64) * own_counts[:, None]
    present = rest > 0.5  # counts are integers: at least one other sample
    return torch.where(present[:, None], sums / rest.clamp_min(1.0)[:, None], 0.0), present


def distillation_terms(logits: Tensor, teacher: Tensor, present: Tensor, labels: Tensor,
                       temperature: float) -> Tensor:
    """(B,) ``T^2 KL(softmax(teacher_y / T) || softmax(logits / T))`` where the label's
    teacher is present, else 0; ``logits`` (B, C), ``teacher`` (C, C), ``present`` (C,)."""
    q = torch.log_softmax(teacher[labels].to(logits.dtype) / temperature, dim=-1)
    p = torch.log_softmax(logits / temperature, dim=-1)
    kl = (q.exp() * (q - p)).sum(-1)
    return temperature ** 2 * present[labels].to(logits.dtype) * kl


@register_strategy("fd",
                   broadcast="per-class mean logits, counts, the round they were formed in",
                   upload="per-class mean logits, class counts",
                   aggregate="count-weighted mean per class; screens total count")
class FederatedDistillation(PersonalStrategy):
    """FD: personal networks distilled from the clients' per-class mean logits.

    Args:
        context: classes, local training, rounds, device, seed, bodies.
        beta: weight of the distillation term (1).
        temperature: T of both softmaxes of the distillation term (1).
        exclude_self: distill from the aggregate without the client's own logits (True).
        max_abs: largest accepted |logit| in an upload.
        screening_ratio: total-count screening against the round's median (None: off).
        independent_init, keep_optimizer: :mod:`bayesfl.strategies.representation.personal`.
    """

    LOSS_TERMS: tuple[str, ...] = ("ce", "distill")

    OPTIONS: ClassVar[tuple[Option, ...]] = (
        Option("beta", float, 1.0,
               "weight of the distillation term (1).",
               minimum=0.0),
        Option("temperature", float, 1.0,
               "T of both softmaxes of the distillation term (1).",
               minimum=1e-6),
        Option("exclude_self", bool, True,
               "distill from the aggregate without the client's own logits (True)."),
        Option("max_abs", float, 10000.0,
               "largest accepted |logit| in an upload.",
               minimum=0.0),
        Option("screening_ratio", float, 10.0,
               "total-count screening against the round's median (None: off).",
               minimum=1.0, nullable=True),
        Option("independent_init", bool, True,
               "draw each client's network from its own seed (derived from its body's init "
               "seed and its id); `false`: one initialisation per body spec "
               "(`bayesfl.strategies.representation.personal`)."),
        Option("keep_optimizer", bool, True,
               "keep Adam's moments and step count in the client state across rounds, so a "
               "personal model trains as one long run; `false`: a fresh Adam per round "
               "(`bayesfl.strategies.representation.personal`)."),
    )

    def __init__(
        self,
        context: StrategyContext,
        *,
        beta: float = 1.0,
        temperature: float = 1.0,
        exclude_self: bool = True,
        max_abs: float = 1e4,
        screening_ratio: float | None = 10.0,
        independent_init: bool = True,
        keep_optimizer: bool = True,
    ) -> None:
        super().__init__(context, independent_init=independent_init,
                         keep_optimizer=keep_optimizer)
        self.beta = option_number(self.name, "beta", beta)
        self.temperature = option_number(self.name, "temperature", temperature, 1e-6)
        self.max_abs = option_number(self.name, "max_abs", max_abs)
        self.screening_ratio = None if screening_ratio is None else option_number(
            self.name, "screening_ratio", screening_ratio, 1.0)
        if not isinstance(exclude_self, bool):
            raise ConfigError(f"fd exclude_self must be true or false, got {exclude_self!r}")
        self.exclude_self = exclude_self

    def build_model(self, body: nn.Module) -> nn.Module:
        return ClassifierNet(body, self.feature_dim, self.num_classes)

    def loss_weights(self) -> dict[str, float]:
        return {"ce": 1.0, "distill": self.beta}

    def init_client(self, config: ClientConfig) -> ClientState:
        """The personal network and optimiser plus the client's last upload (``fd.logits``
        (C, C), ``fd.counts`` (C,), ``fd.round`` (1,), -1 before any)."""
        C = self.num_classes
        return {**super().init_client(config), "fd.logits": torch.zeros(C, C),
                "fd.counts": torch.zeros(C, dtype=torch.int64),
                "fd.round": torch.full((1,), -1, dtype=torch.int64)}

    # ==== server half ======================================================================
    def init(self) -> ServerState:
        C = self.num_classes
        return {"logits": torch.zeros(C, C), "counts": torch.zeros(C, dtype=torch.float64),
                "round": torch.full((1,), -1, dtype=torch.int64)}

    def broadcast_tensors(self, state: ServerState, round: int) -> dict[str, Tensor]:
        return {"logits": state["logits"], "counts": state["counts"],
                "aggregate_round": state["round"]}

    def configure_evaluation(self, state: ServerState, round: int) -> Message:
        """Nothing: a client predicts with its own network."""
        return self.down_message(round, {})

    def upload_schema(self, state: ServerState, round: int) -> Schema:
        C = self.num_classes
        return {"logits": TensorSpec((C, C), torch.float32),
                "counts": TensorSpec((C,), torch.int64)}

    def upload_problems(self, plan: RoundPlan, messages: Sequence[Message]) -> list[str | None]:
        """Non-negative counts, at least one sample, zero rows of absent classes, bounded
        logits, total count screened against the round's median."""
        totals = torch.tensor([float(m.tensors["counts"].sum()) for m in messages],
                              dtype=torch.float64)
        return first_reasons([self._problem(m) for m in messages],
                             screening_reasons(totals, self.screening_ratio, "total count"))

    def _problem(self, message: Message) -> str | None:
        counts, logits = message.tensors["counts"], message.tensors["logits"]
        if (counts < 0).any():
            return "negative class counts"
        if int(counts.sum()) < 1:
            return "no samples: every class count is 0"
        if (logits[counts == 0] != 0).any():
            return "non-zero logits for a class with count 0"
        largest = float(logits.abs().max())
        if largest > self.max_abs:
            return f"logit magnitude {largest:.3g} exceeds max_abs {self.max_abs:g}"
        return None

    def aggregate(self, state: ServerState, uploads: Sequence[Message], round: int,
                  generator: torch.Generator) -> ServerState:
        """Count-weighted per-class mean logits; classes nobody uploaded keep theirs."""
        if not uploads:
            return state
        counts = torch.stack([u.tensors["counts"].to(torch.float64) for u in uploads])
        logits = torch.stack([u.tensors["logits"].to(torch.float64) for u in uploads])
        total = counts.sum(0)
        mean = (counts[:, :, None] * logits).sum(0) / total.clamp_min(1.0)[:, None]
        held = total > 0
        return {"logits": torch.where(held[:, None], mean.to(torch.float32), state["logits"]),
                "counts": torch.where(held, total, state["counts"]),
                "round": torch.tensor([round], dtype=torch.int64)}

    # ==== client half ======================================================================
    def _teacher(self, state: ClientState, broadcast: Message) -> tuple[Tensor, Tensor]:
        t = broadcast.tensors
        own = (self.exclude_self
               and int(state["fd.round"]) == int(t["aggregate_round"]) >= 0)
        teacher, present = teacher_logits(
            t["logits"], t["counts"], state["fd.logits"].cpu() if own else None,
            state["fd.counts"].cpu() if own else None)
        device = self.context.device
        return teacher.to(device, torch.float32), present.to(device)

    def fit(self, config: ClientConfig, state: ClientState, data: ClientData,
            broadcast: Message, generator: torch.Generator) -> tuple[ClientState, Message]:
        """Train on CE + distillation from the teacher logits, then upload class-mean
        logits of the trained network."""
        model = self.client_model(config, state)
        teacher, present = self._teacher(state, broadcast)

        def terms(net: nn.Module, x: Tensor, y: Tensor, _: torch.Generator):
            z = net(x)
            return {"ce": cross_entropy_per_sample(z, y),
                    "distill": distillation_terms(z, teacher, present, y, self.temperature)}, z

        extra = self.train_personal(model, state, data, terms, generator)
        means, counts = class_means(batched_apply(model, data.train_x), data.train_y,
                                    self.num_classes)
        round = broadcast.header.round
        new_state = {**model_state(model), **extra, "fd.logits": means.to(torch.float32),
                     "fd.counts": counts, "fd.round": torch.tensor([round])}
        upload = self.up_message(round, config.client_id,
                                 {"logits": means.to(torch.float32), "counts": counts})
        return new_state, upload

    def predict(self, config: ClientConfig, state: ClientState, broadcast: Message,
                x: Tensor) -> dict[str, Tensor]:
        """(n, C) float64 softmax of the client's own network on ``x`` (n, ...)."""
        logits = batched_apply(self.client_model(config, state), x)
        return {PREDICTIVE: torch.softmax(logits.to(torch.float64), dim=-1).cpu()}
