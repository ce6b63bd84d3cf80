"""A round's evaluation, federated: the merge of every client's calibration accumulators.

Each client evaluates itself (`bayesfl.strategies.base.Strategy.evaluate`) and returns
`calibration.Accumulator` states, one per predictive (the headline and, for posterior
strategies, the MAP plug-in). The per-client (macro) metrics are each accumulator's; the pooled
(micro) metrics are their merge — exactly the metrics of the concatenated predictions, and the
same computation a Flower server does with the states it receives. Probabilities travel only
inside the simulator (for predictions.npz and the reliability plot), never to a real server.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from bayesfl.errors import MessageRejected
from bayesfl.messages import Message, TensorSpec, decode, validate
from bayesfl.strategies.base import MAP_PLUGIN, PREDICTIVE, Evaluation, Strategy
from calibration.accumulator import Accumulator
from calibration.errors import CalibrationError

METRICS = ("accuracy", "ece", "mce", "brier", "nll")


@dataclass
class PredictiveMetrics:
    """One predictive's metrics over all clients.

    Attributes:
        per_client: one dict per client: client_id, count, accuracy, ece, mce, brier, nll.
        pooled: the same metrics over all clients' test samples (merged accumulators).
    """

    per_client: list[dict[str, Any]]
    pooled: dict[str, float]

    @classmethod
    def merge(cls, ids: Sequence[int], accumulators: Sequence[Accumulator]) -> PredictiveMetrics:
        # compute_each's values are Python ints (count) and floats already: one dict per
        # client, keys in the record's order
        per_client = [{"client_id": cid, "count": m["count"], "accuracy": m["accuracy"],
                       "ece": m["ece"], "mce": m["mce"], "brier": m["brier"], "nll": m["nll"]}
                      for cid, m in zip(ids, Accumulator.compute_each(accumulators),
                                        strict=True)]
        merged = Accumulator.merged(accumulators)
        pooled = _typed(merged.compute())
        state = merged.state_dict()
        # mean top-class probability: beside accuracy it says which way a model miscalibrates
        confidence = float(state["bin_confidence_sums"].sum()) / float(state["bin_counts"].sum())
        return cls(per_client, {**{k: pooled[k] for k in METRICS}, "confidence": confidence})

    def headline(self) -> dict[str, float]:
        """``accuracy`` = mean over clients of client test accuracy (the papers' number);
        ``accuracy_pooled`` and the calibration metrics over the pooled test samples;
        ``confidence``, the pooled mean top-class probability (above ``accuracy_pooled``:
        over-confident, below: under-confident); the client means of ECE and NLL named as
        such."""
        n = len(self.per_client)
        mean = {k: sum(c[k] for c in self.per_client) / n for k in METRICS}
        return {
            "accuracy": mean["accuracy"],
            "accuracy_pooled": self.pooled["accuracy"],
            "ece": self.pooled["ece"],
            "mce": self.pooled["mce"],
            "brier": self.pooled["brier"],
            "nll": self.pooled["nll"],
            "confidence": self.pooled["confidence"],
            "ece_client_mean": mean["ece"],
            "nll_client_mean": mean["nll"],
            "accuracy_client_min": min(c["accuracy"] for c in self.per_client),
        }


@dataclass
class RoundEvaluation:
    """Metrics of one evaluation of all clients.

    Attributes:
        predictives: `PredictiveMetrics` per predictive key (``"predictive"``, the
            headline, and ``"map_plugin"`` for posterior strategies).
        probs: (N_test_total, C) float64 headline probabilities of all clients, client by
            client (empty when the clients were not asked for them).
        labels: (N_test_total,) int64.
        client_ids: (N_test_total,) int64, which client each row belongs to.
    """

    predictives: dict[str, PredictiveMetrics]
    probs: Tensor = field(default_factory=lambda: torch.empty(0, 0, dtype=torch.float64))
    labels: Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    client_ids: Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))

    @property
    def per_client(self) -> list[dict[str, Any]]:
        return self.predictives[PREDICTIVE].per_client

    @property
    def pooled(self) -> dict[str, float]:
        return self.predictives[PREDICTIVE].pooled

    def headline(self) -> dict[str, Any]:
        """The headline predictive's metrics (`PredictiveMetrics.headline`) and, for
        posterior strategies, the MAP plug-in's under ``"map_plugin"``."""
        out: dict[str, Any] = self.predictives[PREDICTIVE].headline()
        if MAP_PLUGIN in self.predictives:
            plugin = self.predictives[MAP_PLUGIN].headline()
            out[MAP_PLUGIN] = {k: plugin[k] for k in ("accuracy", "accuracy_pooled", *METRICS,
                                                      "confidence")}
        return out


def merge_evaluations(evaluations: Sequence[Evaluation]) -> RoundEvaluation:
    """The round's metrics from the clients' evaluations (in client order)."""
    ids = [e.client_id for e in evaluations]
    keys = list(evaluations[0].accumulators)
    predictives = {k: PredictiveMetrics.merge(ids, [e.accumulators[k] for e in evaluations])
                   for k in keys}
    if not all(PREDICTIVE in e.probs for e in evaluations):
        return RoundEvaluation(predictives)
    probs = torch.cat([e.probs[PREDICTIVE] for e in evaluations])
    labels = torch.cat([e.labels for e in evaluations])
    client_ids = torch.repeat_interleave(torch.tensor(ids, dtype=labels.dtype),
                                         torch.tensor([len(e.labels) for e in evaluations]))
    return RoundEvaluation(predictives, probs, labels, client_ids)


# ---- an evaluation as a reply (both transports: the calibrate step's, Flower's rounds') ----
MAX_EVALUATION_BYTES = 4 * 2**20
"""Largest encoded evaluation reply accepted: accumulator states are ~3 x 8 bytes per bin and
predictive (15 bins: about 1 KiB), so 4 MiB bounds even 10,000 bins with room to spare."""


def evaluation_tensors(evaluation: Evaluation) -> dict[str, torch.Tensor]:
    """A client's calibration accumulator states as named tensors ``KEY.STATE``."""
    return {f"{key}.{name}": t.to("cpu")
            for key, acc in evaluation.accumulators.items()
            for name, t in acc.state_dict().items()}


def read_evaluation(strategy: Strategy, data: bytes, *, round: int, client_id: int,
                    n_bins: int, num_test: int, key: bytes | None = None,
                    predictives: set[str] | None = None) -> Evaluation:
    """A client's evaluation from its encoded reply, validated.

    Checks: the bytes (`bayesfl.messages.decode`, bounded), the header (strategy,
    round, sender, direction up), the predictive keys (the headline, and the MAP plug-in for
    posterior strategies), each accumulator state (`Accumulator.from_state_dict`), its
    number of bins and its sample count (the client's test-set size, as it declared it).
    ``predictives``: the keys expected (default: the strategy's evaluation's).

    Raises:
        MessageRejected: with the reason.
    """
    message = decode(data, max_bytes=MAX_EVALUATION_BYTES, key=key)
    _check_header(message, strategy, round, client_id)
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in message.tensors.items():
        head, _, rest = name.partition(".")
        groups.setdefault(head, {})[rest] = tensor
    expected = predictives or ({PREDICTIVE, MAP_PLUGIN} if strategy.is_posterior
                               else {PREDICTIVE})
    if set(groups) != expected:
        raise MessageRejected(f"evaluation holds predictives {sorted(groups)}, expected "
                              f"{sorted(expected)}", client_id=client_id)
    accumulators = {}
    for key_, state in groups.items():
        try:
            acc = Accumulator.from_state_dict(state)
        except CalibrationError as err:
            raise MessageRejected(f"evaluation {key_!r}: {err}", client_id=client_id) from err
        if acc.n_bins != n_bins or acc.count != num_test:
            raise MessageRejected(f"evaluation {key_!r} has {acc.n_bins} bins and "
                                  f"{acc.count} samples, expected {n_bins} bins and the "
                                  f"client's {num_test} test samples", client_id=client_id)
        accumulators[key_] = acc
    return Evaluation(client_id, accumulators)


def _check_header(message: Message, strategy: Strategy, round: int, client_id: int) -> None:
    """The header fields of an evaluation reply (its tensors are checked as accumulator
    states: any names, shapes and dtypes pass this schema)."""
    schema = {k: TensorSpec(tuple(t.shape), t.dtype, finite=False)
              for k, t in message.tensors.items()}
    validate(message, schema, strategy=strategy.name, round=round, client_id=client_id,
             direction="up")


def _typed(metrics: dict[str, Any]) -> dict[str, Any]:
    return {"count": int(metrics["count"]), **{k: float(metrics[k]) for k in METRICS}}
