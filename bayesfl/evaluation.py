"""A round's evaluation, federated: the merge of every client's calibration accumulators.

Each client evaluates itself (:meth:`bayesfl.strategies.base.Strategy.evaluate`) and returns
:class:`calibration.Accumulator` states, one per predictive (the headline and, for posterior
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

from bayesfl.strategies.base import MAP_PLUGIN, PREDICTIVE, Evaluation
from calibration.accumulator import Accumulator

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
        predictives: :class:`PredictiveMetrics` per predictive key (``"predictive"``, the
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
        """The headline predictive's metrics (:meth:`PredictiveMetrics.headline`) and, for
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


def _typed(metrics: dict[str, Any]) -> dict[str, Any]:
    return {"count": int(metrics["count"]), **{k: float(metrics[k]) for k in METRICS}}
