"""Evaluation of every client with the current server state, through :mod:`calibration`.

Each client predicts probabilities on its own test set with the strategy's
``predict_proba``; a calibration accumulator per client gives the per-client (macro) metrics,
and the pooled (micro) metrics are the merge of the client accumulators — exactly the metrics
of the concatenated predictions.

With ``batched`` (clients of one architecture predict together), the per-client accumulators
are also computed together: :func:`multi_client_metrics` scores the concatenated predictions
of all clients in one :func:`calibration.row_scores.row_scores` sweep and scatters the
per-sample quantities into a (client, bin) table — the same sums an
:class:`calibration.Accumulator` per client holds, hence the same metrics up to float
rounding — instead of updating a thousand small accumulators one by one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from bayesfl.strategies.base import BaseStrategy, Client, ServerState
from bayesfl.training import architecture_key
from calibration.accumulator import Accumulator
from calibration.bin_stats import BinStats
from calibration.binning import bin_indices, check_n_bins, uniform_edges
from calibration.errors import InvalidInputError
from calibration.metrics import metrics_from_totals
from calibration.row_scores import PROBABILITY_FLOOR, row_scores

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
    of one architecture predict together (:meth:`predict_proba_batch`) and are scored
    together (:func:`multi_client_metrics`)."""
    predictions: dict[int, Tensor] = {}
    groups: dict[tuple, list[Client]] = {}
    for c in clients:
        key = architecture_key(c.model) if batched else (c.client_id,)
        groups.setdefault(key, []).append(c)
    for group in groups.values():
        outs = strategy.predict_proba_batch(group, state, [c.data.test_x for c in group])
        predictions.update({c.client_id: p for c, p in zip(group, outs, strict=True)})
    if batched:
        return _evaluate_together(clients, predictions, n_bins)
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


def _evaluate_together(
    clients: Sequence[Client], predictions: dict[int, Tensor], n_bins: int
) -> RoundEvaluation:
    probs = torch.cat([predictions[c.client_id] for c in clients]).to("cpu", torch.float64)
    labels = torch.cat([c.data.test_y for c in clients]).to("cpu")
    sizes = torch.tensor([c.data.test_y.shape[0] for c in clients], dtype=torch.int64)
    index = torch.repeat_interleave(torch.arange(len(clients)), sizes)
    metrics, pooled = multi_client_metrics(probs, labels, index, len(clients), n_bins=n_bins)
    per_client = [{"client_id": c.client_id, **m} for c, m in zip(clients, metrics, strict=True)]
    ids = torch.tensor([c.client_id for c in clients], dtype=torch.int64)[index]
    return RoundEvaluation(per_client, pooled, probs, labels, ids)


def multi_client_metrics(
    probs: Tensor,
    labels: Tensor,
    client_index: Tensor,
    num_clients: int,
    *,
    n_bins: int = 15,
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Per-client and pooled calibration metrics of many clients' predictions at once.

    Args:
        probs: (N, C) probabilities of all clients' samples (validated as
            :class:`calibration.Accumulator` does: rows >= 0 summing to 1).
        labels: (N,) integer labels.
        client_index: (N,) int64 in ``[0, num_clients)``: whose sample each row is.
        num_clients: K.
        n_bins: equal-width confidence bins.

    Returns:
        ``per_client``: K dicts with count, accuracy, ece, mce, brier, nll — what an
        :class:`~calibration.Accumulator` updated with client k's rows computes — and
        ``pooled``: accuracy, ece, mce, brier, nll of all rows (the merged accumulators).

    Raises:
        InvalidInputError: invalid probabilities or labels, or a client without samples.
    """
    check_n_bins(n_bins)
    K = num_clients
    probs = torch.as_tensor(probs).to(torch.float64)
    scores = row_scores(probs, labels)  # validates; top-label confidence and correctness
    labels = torch.as_tensor(labels).to(device=probs.device, dtype=torch.int64)
    label_prob = probs.gather(1, labels[:, None])[:, 0]
    # per-sample Brier sum_k (p_k - 1[y=k])^2 = ||p||^2 - 2 p_y + 1, and NLL -log max(p_y, floor)
    brier = probs.square().sum(1) - 2.0 * label_prob + 1.0
    nll = -label_prob.clamp(min=PROBABILITY_FLOOR).log()
    client_index = client_index.to(device=probs.device, dtype=torch.int64)
    edges = uniform_edges(n_bins, device=probs.device)
    cell = client_index * n_bins + bin_indices(scores.confidence, edges).to(torch.int64)
    pairs = torch.bincount(cell * 2 + scores.correct, minlength=2 * K * n_bins)
    pairs = pairs.view(K, n_bins, 2).cpu()
    confidence_sums = torch.zeros(K * n_bins, dtype=torch.float64, device=probs.device)
    confidence_sums.index_add_(0, cell, scores.confidence.to(torch.float64))
    sums = torch.zeros(2, K, dtype=torch.float64, device=probs.device)
    sums[0].index_add_(0, client_index, brier)
    sums[1].index_add_(0, client_index, nll)
    counts = pairs.sum(2).numpy()  # (K, n_bins)
    correct = pairs[:, :, 1].numpy()
    conf = confidence_sums.view(K, n_bins).cpu().numpy()
    brier_sum, nll_sum = sums.cpu().numpy()
    totals = counts.sum(1)
    if (totals == 0).any():
        k = int(np.flatnonzero(totals == 0)[0])
        raise InvalidInputError(f"client {k} has no samples to evaluate")
    nonempty = counts > 0
    with np.errstate(invalid="ignore", divide="ignore"):
        gaps = np.abs(correct / counts - conf / counts)
    ece = np.where(nonempty, counts * gaps, 0.0).sum(1) / totals
    mce = np.where(nonempty, gaps, -np.inf).max(1)
    accuracy = correct.sum(1) / totals
    columns = (totals, accuracy, ece, mce, brier_sum / totals, nll_sum / totals)
    per_client = [
        {"count": row[0], "accuracy": row[1], "ece": row[2], "mce": row[3], "brier": row[4],
         "nll": row[5]}
        for row in zip(*(column.tolist() for column in columns), strict=True)
    ]
    stats = BinStats.from_sums(edges, torch.from_numpy(counts.sum(0)),
                               torch.from_numpy(conf.sum(0)), torch.from_numpy(correct.sum(0)))
    pooled = _as_floats(metrics_from_totals(stats, float(brier_sum.sum()), float(nll_sum.sum())))
    return per_client, pooled
