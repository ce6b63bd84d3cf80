r"""Calibration and scoring metrics for multi-class predictions.

All functions take ``probs`` (N, K) and integer ``labels`` (N,) as torch tensors (any device; the
work stays on that device) or numpy arrays, and return Python floats.

* ``probs`` are probabilities: every entry >= 0 and every row summing to 1 within
  ``calibration.row_scores.SUM_TOLERANCE`` (1e-3 absolute). Pass ``from_logits=True`` for logits;
  the kind of input is never guessed.
* ECE/MCE use the top-label confidence ``max_k p_k`` and count a sample correct when the first
  class attaining the maximum (``argmax``) is its label. 2-class input is scored top-label like
  any other (no switch to a positive-class metric based on how many labels occur).
* Bins: see `calibration.binning` (equal-width on [0, 1], ``[a, b)`` with the last bin
  closed; ``binning="quantile"`` for equal-mass bins). With $B_b$ the samples whose confidence
  falls in bin b, $\mathrm{ECE} = \sum_b \frac{|B_b|}{N} \lvert \mathrm{acc}(B_b) -
  \mathrm{conf}(B_b) \rvert$ (empty bins contribute nothing) and MCE is the largest
  $\lvert \mathrm{acc}(B_b) - \mathrm{conf}(B_b) \rvert$ over non-empty bins.
* Brier $= \frac{1}{N} \sum_i \sum_k (p_{ik} - [y_i = k])^2$, in [0, 2].
* NLL $= -\frac{1}{N} \sum_i \log \max(p_{i y_i}, 10^{-12})$ (see ``PROBABILITY_FLOOR``), in
  nats.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from calibration.bin_stats import BinStats, bin_stats_from_confidence
from calibration.binning import Binning, bin_edges, check_n_bins, uniform_edges
from calibration.errors import InvalidInputError
from calibration.inputs import as_tensor, class_labels, flag, score_matrix
from calibration.row_scores import RowScores, row_scores

METRIC_KEYS = ("accuracy", "ece", "mce", "brier", "nll", "count")


def _scores_and_bins(
    probs: Any, labels: Any, n_bins: int, binning: Binning | str, from_logits: bool,
    **wanted: bool,
) -> tuple[RowScores, BinStats]:
    """One sweep, and the reliability table of its top-label confidences.

    Equal-width edges are known before the sweep, which then also fills the histogram;
    quantile edges need the confidences first.
    """
    binning = Binning.parse(binning)
    n_bins = check_n_bins(n_bins)
    if binning is Binning.UNIFORM:  # the histogram is all it needs of the confidences
        edges = uniform_edges(n_bins)
        scores = row_scores(probs, labels, from_logits=from_logits, edges=edges,
                            confidence=False, **wanted)
        return scores, BinStats.from_sums(edges, *scores.bin_sums)
    scores = row_scores(probs, labels, from_logits=from_logits, **wanted)
    edges = bin_edges(scores.confidence, n_bins, binning)
    return scores, bin_stats_from_confidence(scores.confidence, scores.correct, edges)


def reliability_stats(
    probs: Any,
    labels: Any,
    n_bins: int = 15,
    binning: Binning | str = "uniform",
    from_logits: bool = False,
) -> BinStats:
    """Per-bin counts, mean confidence and accuracy of the top-label prediction."""
    return _scores_and_bins(probs, labels, n_bins, binning, from_logits)[1]


def ece(
    probs: Any,
    labels: Any,
    n_bins: int = 15,
    binning: Binning | str = "uniform",
    from_logits: bool = False,
) -> float:
    """Expected calibration error of the top-label confidence, in [0, 1]."""
    return reliability_stats(probs, labels, n_bins, binning, from_logits).ece


def mce(
    probs: Any,
    labels: Any,
    n_bins: int = 15,
    binning: Binning | str = "uniform",
    from_logits: bool = False,
) -> float:
    """Maximum calibration error: largest |accuracy - confidence| over non-empty bins, in [0, 1]."""
    return reliability_stats(probs, labels, n_bins, binning, from_logits).mce


def l2_calibration_error(
    probs: Any,
    labels: Any,
    n_bins: int = 15,
    binning: Binning | str = "uniform",
    from_logits: bool = False,
    debiased: bool = False,
) -> float:
    """L2 calibration error of the top-label confidence, in [0, 1].

    ``sqrt(sum_b (n_b / N) (acc_b - conf_b)^2)``; ``debiased=True`` removes the upward bias of
    this plug-in estimate (Kumar et al. 2019, see `calibration.bin_stats`), best with
    ``binning="quantile"`` as in the paper.
    """
    debiased = flag(debiased, "debiased")
    return reliability_stats(probs, labels, n_bins, binning, from_logits).l2_error(debiased)


def brier(probs: Any, labels: Any, from_logits: bool = False) -> float:
    """Multi-class Brier score: mean_i sum_k (p_ik - 1[y_i = k])^2, in [0, 2]."""
    scores = row_scores(probs, labels, from_logits=from_logits, confidence=False, brier=True)
    return scores.brier_sum / scores.count


def nll(probs: Any, labels: Any, from_logits: bool = False) -> float:
    """Mean negative log-likelihood -log max(p_y, 1e-12) in nats (log-softmax for logits)."""
    scores = row_scores(probs, labels, from_logits=from_logits, confidence=False, log_prob=True)
    return scores.nll_sum / scores.count


def accuracy(probs: Any, labels: Any, from_logits: bool = False) -> float:
    """Fraction of samples whose argmax class equals the label."""
    scores = row_scores(probs, labels, from_logits=from_logits)
    return float(scores.correct.double().mean())


def positive_class_stats(
    probs: Any,
    labels: Any,
    n_bins: int = 15,
    binning: Binning | str = "uniform",
    from_logits: bool = False,
) -> BinStats:
    """Reliability table of a binary classifier's positive-class probability.

    ``probs``: (N,) probabilities of class 1, or (N, 2) rows [p_0, p_1] (logits of either shape
    with ``from_logits=True``: a sigmoid or a softmax); ``labels``: (N,) in {0, 1}. Bins hold p_1
    and the table's ``accuracy`` is the fraction of positives in each bin: the binary
    "positive-class" convention (netcal's mode for two classes), unlike `ece`'s top label.
    """
    return _one_vs_rest_stats(_two_columns(probs, from_logits), labels, [1], n_bins, binning,
                              from_logits)[0]


def positive_class_ece(
    probs: Any,
    labels: Any,
    n_bins: int = 15,
    binning: Binning | str = "uniform",
    from_logits: bool = False,
) -> float:
    """ECE of the positive-class probability of a binary classifier, in [0, 1].

    See `positive_class_stats`; for the top-label ECE of the same data use `ece`.
    """
    return positive_class_stats(probs, labels, n_bins, binning, from_logits).ece


def _two_columns(probs: Any, from_logits: bool) -> torch.Tensor:
    """(N,) positive-class scores as (N, 2) rows; (N, 2) input checked and kept."""
    tensor = as_tensor(probs, "logits" if from_logits else "probs")
    if tensor.ndim == 1:
        if tensor.dtype == torch.bool:
            raise InvalidInputError("probs must be real-valued numbers; got dtype torch.bool")
        if tensor.dtype != torch.float64:
            tensor = tensor.float()
        if from_logits:  # softmax([0, x]) = [1 - sigmoid(x), sigmoid(x)]
            return torch.stack([torch.zeros_like(tensor), tensor], dim=1)
        if not bool(torch.isfinite(tensor).all()):
            raise InvalidInputError("probs contain NaN or Inf")
        if not bool(((tensor >= 0) & (tensor <= 1)).all()):
            raise InvalidInputError(
                "positive-class probabilities must lie in [0, 1] (pass from_logits=True for "
                "logits)"
            )
        return torch.stack([1.0 - tensor, tensor], dim=1)
    matrix = score_matrix(tensor, "logits" if from_logits else "probs")
    if matrix.shape[1] != 2:
        raise InvalidInputError(
            f"a binary classifier has 2 class columns; got {matrix.shape[1]} (use ece or "
            "classwise_ece for multi-class input)"
        )
    return matrix


def classwise_ece(
    probs: Any,
    labels: Any,
    n_bins: int = 15,
    binning: Binning | str = "uniform",
    from_logits: bool = False,
) -> float:
    """Class-wise ECE (Kull et al., 2019): mean over all K classes of the ECE of p_k vs 1[y=k].

    For class k every sample contributes its probability p_k (not only the top label) and the
    outcome 1[y = k]; bins as for `ece` (quantile edges are computed per class). Every class
    column is scored, including classes absent from ``labels`` (their outcome is always 0).
    """
    scores = score_matrix(probs, "logits" if from_logits else "probs")
    classes = range(scores.shape[1])
    stats = _one_vs_rest_stats(scores, labels, classes, n_bins, binning, from_logits)
    return sum(table.ece for table in stats) / len(stats)


def _one_vs_rest_stats(
    scores: torch.Tensor,
    labels: Any,
    classes: Sequence[int],
    n_bins: int,
    binning: Binning | str,
    from_logits: bool,
) -> list[BinStats]:
    """Per class k in ``classes``: the reliability table of p_k against the outcome 1[y = k].

    ``scores`` (N, K) probabilities or logits; the rows are validated exactly as the other
    metrics validate them, and quantile edges are computed per class.
    """
    binning = Binning.parse(binning)
    n_bins = check_n_bins(n_bins)
    row_scores(scores, labels, from_logits=from_logits, confidence=False)  # validates
    if from_logits:
        scores = torch.softmax(scores, dim=1)
    label_index = class_labels(labels, scores.shape[0], scores.shape[1], scores.device)
    return [
        bin_stats_from_confidence(scores[:, k], label_index == k,
                                  bin_edges(scores[:, k], n_bins, binning))
        for k in classes
    ]


def evaluate(
    probs: Any,
    labels: Any,
    n_bins: int = 15,
    binning: Binning | str = "uniform",
    from_logits: bool = False,
) -> dict[str, float]:
    """All headline metrics from one pass over ``probs``.

    Returns a dict with keys "accuracy", "ece", "mce", "brier", "nll" (floats) and "count" (int).
    """
    return evaluate_with_bins(probs, labels, n_bins, binning, from_logits)[0]


def evaluate_with_bins(
    probs: Any,
    labels: Any,
    n_bins: int = 15,
    binning: Binning | str = "uniform",
    from_logits: bool = False,
) -> tuple[dict[str, float], BinStats]:
    """`evaluate` plus the reliability table it was computed from (one pass)."""
    scores, stats = _scores_and_bins(probs, labels, n_bins, binning, from_logits,
                                     brier=True, log_prob=True)
    totals = metrics_from_totals(stats, scores.brier_sum, scores.nll_sum)
    return totals, stats


def metrics_from_totals(stats: BinStats, brier_sum: float, nll_sum: float) -> dict[str, float]:
    """Headline metrics from a reliability table plus summed per-sample Brier and NLL."""
    total = stats.total
    return {
        "accuracy": stats.correct_total / total,
        "ece": stats.ece,
        "mce": stats.mce,
        "brier": brier_sum / total,
        "nll": nll_sum / total,
        "count": total,
    }


__all__ = [
    "METRIC_KEYS",
    "accuracy",
    "brier",
    "classwise_ece",
    "ece",
    "evaluate",
    "evaluate_with_bins",
    "l2_calibration_error",
    "mce",
    "metrics_from_totals",
    "nll",
    "positive_class_ece",
    "positive_class_stats",
    "reliability_stats",
]
