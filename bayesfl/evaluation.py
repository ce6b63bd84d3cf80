"""Evaluation of every client with the current server state, through :mod:`calibration`.

Each client predicts probabilities on its own test set with the strategy's
``predict_proba``; a calibration accumulator per client gives the per-client (macro) metrics,
and the pooled (micro) metrics are the merge of the client accumulators — exactly the metrics
of the concatenated predictions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from bayesfl.strategies.base import BaseStrategy, Client, ServerState
from bayesfl.training import architecture_key
from calibration.accumulator import Accumulator

METRICS = ("accuracy", "ece", "mce", "brier", "nll")


@dataclass
class RoundEvaluation:
    """Metrics of one evaluation of all clients.

    Attributes:
        per_client: one dict per client: client_id, count, accuracy, ece, mce, brier, nll.
        pooled: the same metrics over all clients' test samples (merged accumulators).
        probs: (N_test_total, C) float64 test probabilities of all clients, client by client.
        labels: (N_test_total,) int64.
        client_ids: (N_test_total,) int64, which client each row belongs to.
    """

    per_client: list[dict[str, Any]]
    pooled: dict[str, float]
    probs: Tensor
    labels: Tensor
    client_ids: Tensor

    def headline(self) -> dict[str, float]:
        """``accuracy`` = mean over clients of client test accuracy (the papers' number);
        ``accuracy_pooled`` and the calibration metrics over the pooled test samples; the
        client means of ECE and NLL named as such."""
        mean = {k: sum(c[k] for c in self.per_client) / len(self.per_client) for k in METRICS}
        return {
            "accuracy": mean["accuracy"],
            "accuracy_pooled": self.pooled["accuracy"],
            "ece": self.pooled["ece"],
            "mce": self.pooled["mce"],
            "brier": self.pooled["brier"],
            "nll": self.pooled["nll"],
            "ece_client_mean": mean["ece"],
            "nll_client_mean": mean["nll"],
            "accuracy_client_min": min(c["accuracy"] for c in self.per_client),
        }


def _as_floats(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(metrics[k]) for k in METRICS}


@torch.no_grad()
def evaluate_clients(
    strategy: BaseStrategy,
    clients: Sequence[Client],
    state: ServerState,
    *,
    n_bins: int = 15,
    batched: bool = True,
) -> RoundEvaluation:
    """Evaluate every client on its test set (module docstring); with ``batched``, clients
    of one architecture predict together (:meth:`predict_proba_batch`)."""
    predictions: dict[int, Tensor] = {}
    groups: dict[tuple, list[Client]] = {}
    for c in clients:
        key = architecture_key(c.model) if batched else (c.client_id,)
        groups.setdefault(key, []).append(c)
    for group in groups.values():
        outs = strategy.predict_proba_batch(group, state, [c.data.test_x for c in group])
        predictions.update({c.client_id: p for c, p in zip(group, outs, strict=True)})
    accumulators, per_client, probs, labels, ids = [], [], [], [], []
    for c in clients:
        p = predictions[c.client_id].to("cpu", torch.float64)
        y = c.data.test_y.to("cpu")
        acc = Accumulator(n_bins=n_bins)
        acc.update(p, y)
        accumulators.append(acc)
        per_client.append({"client_id": c.client_id, "count": int(y.numel()),
                           **_as_floats(acc.compute())})
        probs.append(p)
        labels.append(y)
        ids.append(torch.full_like(y, c.client_id))
    pooled = Accumulator.merged(accumulators)
    return RoundEvaluation(per_client, _as_floats(pooled.compute()), torch.cat(probs),
                           torch.cat(labels), torch.cat(ids))
