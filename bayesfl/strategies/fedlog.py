"""FedLog (Yu, Zhang & Poupart): a federated Bayesian logistic-regression head.

Spec: /work/shared/spec/fedlog.md. Every client keeps its body private and trains it with
cross-entropy through the broadcast head ``W`` (C, m), m = d + 1, bias column first, which it
does not update (§3.1). It then uploads the sufficient statistic of its training features,
``S_c[y] = sum_{i: y_i = y} [1, phi(x_i)]`` (C, m), whose column 0 holds the class counts,
and its sample count ``n_c`` (§1.4, §3.2). The server sums the statistics of this round only
(no carry-over, §2.1), adds the conjugate prior (chi = 0, nu) and sets ``W`` to the posterior
MAP (exact solver of :mod:`inference.conjugate`). Prediction is ``softmax(W [1, phi(x)])``.

Round 0 (``init_round``) is the reference code's "pretrain" round: clients send statistics of
their untrained bodies, so the first head is already a MAP (§3.4, §9.5).

Variants (each its own registry name, so message headers say which one is running):

* ``fedlog-c`` (§4.1): the server broadcasts the aggregated statistic and N instead of W; each
  client solves the same deterministic MAP locally and adds the compactness loss
  ``alpha * ||phi(x) - mean_y||^2`` (global class means from the broadcast statistic,
  constant coordinate excluded; alpha = 0.01 by default).
* ``fedlog-dp-local`` / ``fedlog-dp-central`` (§4.2): features are clamped to [0, b] (after
  the body's ReLU) so one record changes the statistic by at most ``sqrt(1 + (m-1) b^2)`` in
  L2; Gaussian noise is added by each client to its own statistic (local) or once by the server
  to the sum (central). Its sigma comes from the v2 accountant by default
  (``accountant="k_round"``: (epsilon, delta) for the whole run, composed over all releases,
  rounds + the init round), or the v1 one (``accountant="single"``: (epsilon, delta) per
  release, a weaker guarantee for a multi-round run, as in the paper's first version).
  Local-DP uploads carry no ``num_samples`` (it would leak n_c); the server uses the noisy
  counts, clamped at >= 1. Their bias column is not an exact count any more, so the count
  invariant is not checked; central-DP uploads are clean and checked, plus the clamp bound on
  the feature columns.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import ClassVar

import torch
from torch import Tensor, nn

from bayesfl.errors import ConfigError, MessageRejected
from bayesfl.messages import Message, Schema, TensorSpec, validate
from bayesfl.strategies.base import (
    NUM_SAMPLES_SPEC,
    BaseStrategy,
    Client,
    ServerState,
    StrategyContext,
    check_num_samples,
    num_samples_tensor,
)
from bayesfl.strategies.networks import batched_apply
from bayesfl.training import (
    architecture_key,
    forward_stacked,
    forward_stacked_concat,
    train_batched,
    train_plain,
)
from inference.conjugate import (
    ClassMeans,
    ConjugatePosterior,
    ConjugatePrior,
    SufficientStatistics,
    clip_features,
    gaussian_sigma,
    privatize,
)
from inference.conjugate.statistics import checked_batch

_DTYPES = {"float32": torch.float32, "float64": torch.float64}


class HeadObjective:
    """Per-sample cross-entropy of ``softmax(W [1, phi])`` with ``W`` frozen, plus FedLog-C's
    compactness term ``alpha * ||phi - mean_y||^2`` when class means are given.

    Args:
        head: W (C, m) with the bias in column 0.
        class_means: (C, m - 1) global class-mean features, or None.
        alpha: weight of the compactness term.
    """

    def __init__(self, head: Tensor, class_means: Tensor | None = None, alpha: float = 0.0):
        self.bias = head[:, 0].contiguous()
        self.weight = head[:, 1:].contiguous()
        self.class_means = class_means
        self.alpha = alpha

    def __call__(self, features: Tensor, labels: Tensor) -> Tensor:
        logits = features @ self.weight.T + self.bias
        loss = nn.functional.cross_entropy(logits, labels, reduction="none")
        if self.class_means is not None and self.alpha > 0:
            loss = loss + self.alpha * (features - self.class_means[labels]).pow(2).sum(dim=-1)
        return loss


class FeatureClamp(nn.Module):
    """``clamp(body(x), -bound, bound)``: bounded features for differential privacy."""

    def __init__(self, body: nn.Module, bound: float) -> None:
        super().__init__()
        self.body = body
        self.bound = bound

    def forward(self, x: Tensor) -> Tensor:
        return clip_features(self.body(x), self.bound)


def head_logits(head: Tensor, features: Tensor) -> Tensor:
    """Logits (B, C) = ``[1, features] @ head.T`` in float64; head (C, m), features (B, m-1)."""
    head = head.to(device=features.device, dtype=torch.float64)
    return head[:, 0] + features.to(torch.float64) @ head[:, 1:].T


class FedLog(BaseStrategy):
    """FedLog: body trained through the broadcast head, statistics up, MAP head down.

    Args:
        context: classes, feature dimension, local training, rounds, device, seed.
        prior_nu: the conjugate prior's nu (chi = 0); the paper's default is 1.
        upload_dtype: "float32" (the paper's accounting) or "float64" for the statistic.
    """

    name: ClassVar[str] = "fedlog"
    init_round: ClassVar[bool] = True
    supports_batched_training: ClassVar[bool] = True
    broadcasts_statistics: ClassVar[bool] = False
    dp_placement: ClassVar[str | None] = None

    def __init__(
        self,
        context: StrategyContext,
        *,
        prior_nu: float = 1.0,
        upload_dtype: str = "float32",
    ) -> None:
        super().__init__(context)
        if upload_dtype not in _DTYPES:
            raise ConfigError(f"upload_dtype must be one of {sorted(_DTYPES)}, got "
                              f"{upload_dtype!r}")
        if not prior_nu >= 0:
            raise ConfigError(f"prior_nu must be >= 0, got {prior_nu}")
        self.prior_nu = float(prior_nu)
        self.upload_dtype = _DTYPES[upload_dtype]
        self.m = context.feature_dim + 1
        self.alpha = 0.0  # FedLog-C's compactness weight
        self.clip = 0.0  # DP feature bound
        self.sigma = 0.0  # DP noise scale

    # ---- setup ----------------------------------------------------------------------------
    def build_model(self, body: nn.Module) -> nn.Module:
        return body

    def init(self, clients: Sequence[Client]) -> ServerState:
        C, m = self.num_classes, self.m
        return {
            "head": torch.zeros(C, m, dtype=torch.float32),
            "statistics": torch.zeros(C, m, dtype=torch.float64),
            "num_samples": torch.zeros(1, dtype=torch.float64),
        }

    # ---- server -> client -----------------------------------------------------------------
    def broadcast(self, state: ServerState, round: int) -> Message:
        if self.broadcasts_statistics:
            return self.down_message(round, {
                "statistics": state["statistics"].to(self.upload_dtype),
                "num_samples": state["num_samples"].to(torch.float64),
            })
        return self.down_message(round, {"head": state["head"].to(torch.float32)})

    def _head_and_means(self, message: Message) -> tuple[Tensor, Tensor | None]:
        """The head W (C, m) float32 a client trains against, and class means for FedLog-C."""
        if not self.broadcasts_statistics:
            return message.tensors["head"], None
        table = message.tensors["statistics"].to(torch.float64)
        n = float(message.tensors["num_samples"].item())
        head = self.solve_head(table, n).to(torch.float32)
        if not (self.alpha > 0 and n > 0):
            return head, None
        # counts clamped at 1 inside: noisy or absent classes never divide by ~0
        stats = SufficientStatistics(table, 0, privatized=True)
        return head, ClassMeans.from_statistics(stats, dtype=torch.float32).means

    # ---- client ---------------------------------------------------------------------------
    def client_update(
        self, client: Client, message: Message, generator: torch.Generator
    ) -> Message:
        round = message.header.round
        if round > 0:
            head, means = self._head_and_means(message)
            objective = HeadObjective(head.to(self.context.device),
                                      _to(means, self.context.device), self.alpha)
            train_plain(client.model, client.data.train_x, client.data.train_y, objective,
                        self.context.training, generator=generator)
        return self._upload(client, round, generator)

    def client_update_batch(
        self, clients: Sequence[Client], message: Message, generators: Sequence[torch.Generator]
    ) -> list[Message]:
        if len({architecture_key(c.model) for c in clients}) != 1:
            return super().client_update_batch(clients, message, generators)
        round = message.header.round
        if round > 0:
            head, means = self._head_and_means(message)
            objective = HeadObjective(head.to(self.context.device),
                                      _to(means, self.context.device), self.alpha)
            train_batched([c.model for c in clients], [c.data.train_x for c in clients],
                          [c.data.train_y for c in clients], objective, self.context.training,
                          generators=generators)
        features = forward_stacked_concat([c.model for c in clients],
                                          [c.data.train_x for c in clients])
        tables = self.batch_statistics(clients, features).cpu()
        return [self._upload(c, round, g, table=t)
                for c, g, t in zip(clients, generators, tables, strict=True)]

    def batch_statistics(self, clients: Sequence[Client], features: Tensor) -> Tensor:
        """S_c (K, C, m) float64 of K clients at once, from ``features`` (sum_k n_k, m - 1):
        their training features concatenated client after client.

        One scatter over (client, class) rows adds the samples to each table in the order
        :meth:`SufficientStatistics.from_features` adds them, so every table is the one
        :meth:`client_statistics` gives (non-finite features fall back to it, which raises).
        """
        C = self.num_classes
        labels = torch.cat([c.data.train_y for c in clients])
        features, labels = checked_batch(features, labels.to(features.device), C)
        sizes = torch.tensor([c.data.num_train for c in clients], device=features.device)
        owner = torch.repeat_interleave(torch.arange(len(clients), device=features.device), sizes)
        rows = torch.empty(features.shape[0], self.m, dtype=torch.float64, device=features.device)
        rows[:, 0] = 1.0
        rows[:, 1:] = features
        tables = torch.zeros(len(clients) * C, self.m, dtype=torch.float64,
                             device=features.device)
        tables.index_add_(0, owner * C + labels, rows)
        if not bool(torch.isfinite(tables).all()):
            for c, f in zip(clients, features.split(sizes.tolist()), strict=True):
                self.client_statistics(c, f)  # raises for the first client with a bad feature
        return tables.view(len(clients), C, self.m)

    def client_statistics(self, client: Client, features: Tensor | None = None) -> Tensor:
        """S_c (C, m) float64 of the client's training features (eval mode, no grad);
        ``features`` if already computed."""
        if features is None:
            features = batched_apply(client.model, client.data.train_x)
        stats = SufficientStatistics.from_features(features.to(torch.float64),
                                                   client.data.train_y, self.num_classes)
        return stats.table

    def _upload(
        self,
        client: Client,
        round: int,
        generator: torch.Generator,
        features: Tensor | None = None,
        *,
        table: Tensor | None = None,
    ) -> Message:
        if table is None:
            table = self.client_statistics(client, features).cpu()
        if self.dp_placement == "local":
            noisy = privatize(SufficientStatistics(table, client.data.num_train), self.sigma,
                              generator)
            return self.up_message(round, client.client_id,
                                   {"statistics": noisy.table.to(self.upload_dtype)})
        return self.up_message(round, client.client_id, {
            "statistics": table.to(self.upload_dtype),
            "num_samples": num_samples_tensor(client.data.num_train),
        })

    # ---- validation -----------------------------------------------------------------------
    def upload_schema(self) -> Schema:
        schema = {"statistics": TensorSpec((self.num_classes, self.m), self.upload_dtype)}
        if self.dp_placement != "local":
            schema["num_samples"] = NUM_SAMPLES_SPEC
        return schema

    def check_invariants(self, message: Message) -> None:
        """Non-negative integral class counts in column 0 that sum to ``num_samples``;
        with central DP also feature sums within the clamp bound. Local-DP uploads are
        noisy by design and only schema-checked."""
        if self.dp_placement == "local":
            return
        cid = message.header.client_id
        n = check_num_samples(message)
        table = message.tensors["statistics"].to(torch.float64)
        counts = table[:, 0]
        if (counts < 0).any():
            raise MessageRejected("bias column (class counts) has negative entries",
                                  client_id=cid)
        if not torch.equal(counts, counts.round()):
            raise MessageRejected("bias column (class counts) is not integral", client_id=cid)
        if int(counts.sum().item()) != n:
            raise MessageRejected(f"class counts sum to {int(counts.sum().item())} but "
                                  f"num_samples is {n}", client_id=cid)
        if self.dp_placement == "central":
            limit = self.clip * counts[:, None] * (1 + 1e-6) + 1e-6
            if (table[:, 1:].abs() > limit).any():
                raise MessageRejected(f"feature sums exceed the clamp bound {self.clip} times "
                                      "the class counts", client_id=cid)

    def validate_uploads(
        self, messages: Sequence[Message], *, round: int, client_ids: Sequence[int]
    ) -> list[str | None]:
        """:meth:`validate_upload` of many uploads, with the tensor checks done together.

        Header, names, dtypes and shapes are checked per message (cheap); finiteness and the
        count invariants of all schema-valid uploads at once on their stacked statistics.
        Any upload that fails (or that the stacked checks cannot judge exactly) is checked
        again on its own, so verdicts and reasons are those of :meth:`validate_upload`.
        """
        if (type(self).validate_upload is not BaseStrategy.validate_upload
                or type(self).check_invariants is not FedLog.check_invariants):
            return super().validate_uploads(messages, round=round, client_ids=client_ids)
        loose = {name: dataclasses.replace(spec, finite=False)
                 for name, spec in self.upload_schema().items()}
        reasons: list[str | None] = [None] * len(messages)
        shaped: list[int] = []
        for i, (message, cid) in enumerate(zip(messages, client_ids, strict=True)):
            try:
                validate(message, loose, strategy=self.name, round=round, client_id=cid,
                         direction="up")
            except MessageRejected:
                reasons[i] = self._reason(message, round, cid)
            else:
                shaped.append(i)
        if not shaped:
            return reasons
        tables = torch.stack([messages[i].tensors["statistics"] for i in shaped])
        tables = tables.to(torch.float64)
        ok = torch.isfinite(tables).flatten(1).all(1)
        if self.dp_placement != "local":
            n = torch.cat([messages[i].tensors["num_samples"] for i in shaped])
            counts = tables[:, :, 0]
            ok &= (n >= 1) & (n <= 2**52)  # exact in float64 below
            ok &= (counts >= 0).all(1) & (counts == counts.round()).all(1)
            ok &= counts.sum(1) == n.to(torch.float64)
            if self.dp_placement == "central":
                limit = self.clip * counts[:, :, None] * (1 + 1e-6) + 1e-6
                ok &= (tables[:, :, 1:].abs() <= limit).flatten(1).all(1)
        for j in (~ok).nonzero().flatten().tolist():
            i = shaped[j]
            reasons[i] = self._reason(messages[i], round, client_ids[i])
        return reasons

    def _reason(self, message: Message, round: int, client_id: int) -> str | None:
        try:
            self.validate_upload(message, round=round, client_id=client_id)
        except MessageRejected as err:
            return err.reason
        return None

    # ---- server ---------------------------------------------------------------------------
    def solve_head(self, table: Tensor, n: float, *, privatized: bool | None = None) -> Tensor:
        """Posterior MAP head W (C, m) float64 of the summed statistic ``table`` with count
        ``n`` under the prior chi = 0, ``nu`` (exact solver)."""
        if privatized is None:
            privatized = self.dp_placement is not None or self.broadcasts_statistics
        stats = SufficientStatistics(table.to(torch.float64), round(n), privatized=privatized)
        return ConjugatePosterior(ConjugatePrior(nu=self.prior_nu), stats).map()

    def aggregate(
        self,
        state: ServerState,
        uploads: Sequence[Message],
        round: int,
        generator: torch.Generator,
    ) -> ServerState:
        """Sum this round's statistics (plus central noise) and solve the MAP head."""
        if not uploads:
            return state
        private = self.dp_placement == "local"
        total = SufficientStatistics.sum_tables(  # exact (double-double): order-independent
            torch.stack([u.tensors["statistics"] for u in uploads]).to(torch.float64),
            0 if private else int(torch.cat([u.tensors["num_samples"] for u in uploads]).sum()),
            privatized=private)
        if private:  # n_c is not sent: the noisy counts, rounded, at least 1
            noisy_n = int(total.table[:, 0].sum().round().item())
            total = SufficientStatistics(total.table, max(1, noisy_n), privatized=True)
        if self.dp_placement == "central":
            total = privatize(total, self.sigma, generator)
        table, n = total.table, float(total.n)
        if self.broadcasts_statistics:  # clients solve from the wire-dtype table: match it
            table = table.to(self.upload_dtype).to(torch.float64)
        head = self.solve_head(table, n, privatized=total.privatized
                               or self.broadcasts_statistics).to(torch.float32)
        return {"head": head, "statistics": table,
                "num_samples": torch.tensor([n], dtype=torch.float64)}

    # ---- evaluation -----------------------------------------------------------------------
    def predict_proba(self, client: Client, state: ServerState, x: Tensor) -> Tensor:
        features = batched_apply(client.model, x)
        return torch.softmax(head_logits(state["head"], features), dim=-1)

    def predict_proba_batch(
        self, clients: Sequence[Client], state: ServerState, xs: Sequence[Tensor]
    ) -> list[Tensor]:
        if len({architecture_key(c.model) for c in clients}) != 1:
            return super().predict_proba_batch(clients, state, xs)
        features = forward_stacked([c.model for c in clients], list(xs))
        # one head for all clients' rows (the head is shared), split back per client
        probs = torch.softmax(head_logits(state["head"], torch.cat(features)), dim=-1)
        return list(probs.split([f.shape[0] for f in features]))


def _to(t: Tensor | None, device: torch.device) -> Tensor | None:
    return None if t is None else t.to(device)


class FedLogC(FedLog):
    """FedLog-C: broadcast the statistic, local MAP solve, compactness loss.

    Args:
        alpha: weight of the compactness term (not reported in the paper; default 0.01).
    """

    name = "fedlog-c"
    broadcasts_statistics = True

    def __init__(self, context: StrategyContext, *, alpha: float = 0.01, **options) -> None:
        super().__init__(context, **options)
        if not (alpha >= 0 and math.isfinite(alpha)):
            raise ConfigError(f"fedlog-c alpha must be a finite value >= 0, got {alpha}")
        self.alpha = float(alpha)


class _FedLogDP(FedLog):
    """FedLog with clamped features and Gaussian noise on the statistics.

    Args:
        epsilon, delta: the privacy budget: of the whole run (all rounds + the init round) with
            ``accountant="k_round"``, of each release with ``accountant="single"``.
        clip: the feature bound b; features are clamped to [-b, b] (after the body's ReLU).
        accountant: ``"k_round"`` (v2 composition, default) or ``"single"`` (v1, per release).
    """

    ACCOUNTANTS = ("k_round", "single")

    def __init__(
        self,
        context: StrategyContext,
        *,
        epsilon: float = 1.0,
        delta: float = 0.01,
        clip: float = 2.0,
        accountant: str = "k_round",
        **options,
    ) -> None:
        super().__init__(context, **options)
        if not (epsilon > 0 and 0 < delta < 1 and clip > 0):
            raise ConfigError("DP needs epsilon > 0, 0 < delta < 1 and clip > 0; got "
                              f"epsilon={epsilon}, delta={delta}, clip={clip}")
        if accountant not in self.ACCOUNTANTS:
            raise ConfigError(f"DP accountant must be one of {', '.join(self.ACCOUNTANTS)}; "
                              f"got {accountant!r}")
        self.epsilon, self.delta, self.clip = float(epsilon), float(delta), float(clip)
        self.accountant = accountant
        releases = context.rounds + (1 if self.init_round else 0)
        self.sigma = gaussian_sigma(self.epsilon, self.delta, rounds=releases,
                                    feature_dim=context.feature_dim, bound=self.clip,
                                    composition=accountant)

    def build_model(self, body: nn.Module) -> nn.Module:
        return FeatureClamp(body, self.clip)


class FedLogLocalDP(_FedLogDP):
    """FedLog with local differential privacy (each client perturbs its own statistic)."""

    name = "fedlog-dp-local"
    dp_placement = "local"


class FedLogCentralDP(_FedLogDP):
    """FedLog with central differential privacy (the server perturbs the sum once)."""

    name = "fedlog-dp-central"
    dp_placement = "central"
