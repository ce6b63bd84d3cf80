"""Selective prediction: the risk-coverage curve, AURC, E-AURC and accuracy at a coverage.

A selective classifier answers the rows it is most confident about and abstains on the rest.
Two ways to pass the rows, told apart by the first argument's number of dimensions:

* ``(probs, labels)``: probabilities (N, C) (logits with ``from_logits=True``) and integer labels
  (N,), validated like every metric of `calibration`; a row is correct when its argmax is
  its label, and its confidence is its maximum probability unless ``confidence`` (N,) is given
  (any real score, higher = more confident: e.g. ``-mutual_information`` of posterior draws);
* ``(confidence, correct)``: a confidence (N,) and per-row correctness (N,), booleans or 0/1.

Definitions. Rows are sorted by confidence, highest first; rows sharing a confidence are
accepted or rejected **together** (a tie group is never split, so nothing depends on row order).
The curve has one point per distinct confidence t: ``coverage(t)`` = fraction of rows with
confidence >= t, ``risk(t)`` = error rate (1 - accuracy) among them. It ends at coverage 1 with
the overall error rate.

* **AURC** is the area under this step curve: ``sum_t (coverage(t) - coverage(t_prev)) *
  risk(t)``, each tie group's share of the rows times the risk once it is accepted. Without ties
  it is Geifman et al.'s ``(1/N) sum_{i=1}^N risk(first i rows)``; with ties it does not depend on
  how they would be broken.
* **E-AURC** = AURC - the optimal AURC, the AURC of a strict ranking of every correct row above
  every error: ``(1/N) sum_{i=N-E+1}^{N} (i - (N - E)) / i`` for E errors among N rows (the
  exact discrete value; ``r + (1 - r) log(1 - r)`` with r = E/N is its large-N limit). E-AURC
  >= 0 for every confidence (ties included).
* **accuracy at coverage c**: the accuracy among the rows accepted at the highest threshold
  whose coverage is >= c (``accepted / N >= c`` in float64). With ties the coverage reached can
  exceed c by up to the size of the tie group at the boundary.
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np
import torch
from torch import Tensor

from calibration.errors import InvalidInputError
from calibration.inputs import as_tensor, flag, index_array
from calibration.ood import score_vector
from calibration.row_scores import row_scores


def _rows(first: Any, second: Any, confidence: Any, from_logits: bool) -> tuple[Tensor, Tensor]:
    """(confidence float64 (N,), correct bool (N,)) on one device, N >= 1."""
    flag(from_logits, "from_logits", " (the kind of scores is stated, never guessed)")
    given = as_tensor(first, "logits" if from_logits else "probs")
    if given.ndim == 2:
        scores = row_scores(given, second, from_logits=from_logits)
        correct = scores.correct
        if confidence is None:
            return scores.confidence.to(torch.float64) + 0.0, correct
        ranking = score_vector(confidence, "confidence")
        if ranking.shape[0] != correct.shape[0]:
            raise InvalidInputError(
                f"shape mismatch: {correct.shape[0]} rows of probs but {ranking.shape[0]} "
                "confidences (one per row)"
            )
        return ranking, correct.to(ranking.device)
    if given.ndim != 1:
        raise InvalidInputError(
            f"pass probs (N, C) with labels (N,), or a confidence (N,) with correct (N,); got a "
            f"first argument of shape {tuple(given.shape)}"
        )
    if confidence is not None or from_logits:
        raise InvalidInputError(
            "confidence= and from_logits= go with probs (N, C) and labels; with a confidence "
            "(N,) as first argument the second is the per-row correctness"
        )
    ranking = score_vector(given, "confidence")
    outcome = as_tensor(second, "correct")
    if outcome.ndim != 1 or outcome.shape[0] != ranking.shape[0]:
        raise InvalidInputError(
            f"correct must have shape ({ranking.shape[0]},) (one True/1 or False/0 per "
            f"confidence); got shape {tuple(outcome.shape)}"
        )
    if outcome.dtype != torch.bool:
        outcome = index_array(outcome, "correct", 2, "(1 = correct, 0 = wrong)",
                              ranking.device, kind="flags") == 1
    if ranking.shape[0] == 0:
        raise InvalidInputError("confidence is empty: no rows to score")
    return ranking, outcome.to(ranking.device)


def _groups(confidence: Tensor, correct: Tensor) -> tuple[Tensor, Tensor]:
    """Rows and errors per distinct confidence, highest confidence first: int64 (G,) each."""
    _, inverse = torch.unique(confidence, sorted=True, return_inverse=True)
    size = int(inverse.max()) + 1
    rows = torch.bincount(inverse, minlength=size).flip(0)
    errors = torch.bincount(inverse[~correct], minlength=size).flip(0)
    return rows, errors


def _curve(first: Any, second: Any, confidence: Any,
           from_logits: bool) -> tuple[Tensor, Tensor, int, int]:
    """(accepted rows (G,), accepted errors (G,), N, E): the curve's integer form."""
    ranking, correct = _rows(first, second, confidence, from_logits)
    rows, errors = _groups(ranking, correct)
    accepted, wrong = torch.cumsum(rows, 0), torch.cumsum(errors, 0)
    return accepted, wrong, int(accepted[-1]), int(wrong[-1])


def risk_coverage(probs_or_confidence: Any, labels_or_correct: Any, *, confidence: Any = None,
                  from_logits: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The risk-coverage curve: ``(coverage, risk)``, two float64 numpy arrays (G,).

    One point per distinct confidence, most confident first (coverage increasing to 1); risk is
    the error rate among the accepted rows. See the module notes for the inputs and ties.
    """
    accepted, wrong, n_rows, _ = _curve(probs_or_confidence, labels_or_correct, confidence,
                                        from_logits)
    accepted64 = accepted.to(torch.float64)
    coverage = (accepted64 / n_rows).cpu().numpy()
    risk = (wrong.to(torch.float64) / accepted64).cpu().numpy()
    return coverage, risk


def _area(accepted: Tensor, wrong: Tensor, n_rows: int) -> float:
    widths = torch.diff(accepted, prepend=accepted.new_zeros(1)).to(torch.float64)
    return float((widths * (wrong.to(torch.float64) / accepted.to(torch.float64))).sum()) / n_rows


def optimal_aurc(n_rows: int, n_errors: int) -> float:
    """AURC of the best strict ranking (all correct rows first) of ``n_rows`` rows with
    ``n_errors`` errors: ``(1/N) sum_{i=N-E+1}^{N} (i - (N - E)) / i``."""
    if n_errors == 0:
        return 0.0
    i = torch.arange(n_rows - n_errors + 1, n_rows + 1, dtype=torch.float64)
    return float(((i - (n_rows - n_errors)) / i).sum()) / n_rows


def aurc(probs_or_confidence: Any, labels_or_correct: Any, *, confidence: Any = None,
         from_logits: bool = False) -> float:
    """Area under the risk-coverage curve, in [0, 1]; lower is better.

    See the module notes: the step area of `risk_coverage`, tie groups accepted together.
    """
    accepted, wrong, n_rows, _ = _curve(probs_or_confidence, labels_or_correct, confidence,
                                        from_logits)
    return _area(accepted, wrong, n_rows)


def e_aurc(probs_or_confidence: Any, labels_or_correct: Any, *, confidence: Any = None,
           from_logits: bool = False) -> float:
    """Excess AURC: `aurc` minus `optimal_aurc` of the same rows, >= 0 (up to
    rounding); 0 for a confidence that ranks every correct row strictly above every error."""
    accepted, wrong, n_rows, n_errors = _curve(probs_or_confidence, labels_or_correct,
                                               confidence, from_logits)
    return _area(accepted, wrong, n_rows) - optimal_aurc(n_rows, n_errors)


def accuracy_at_coverage(probs_or_confidence: Any, labels_or_correct: Any,
                         coverage: float = 0.9, *, confidence: Any = None,
                         from_logits: bool = False) -> float:
    """Accuracy among the most confident rows covering at least ``coverage`` (in (0, 1]) of
    all rows; the risk at that coverage is 1 minus it. Tie groups are kept whole (see the
    module notes), so the coverage reached can be larger than asked."""
    if isinstance(coverage, bool | np.bool_) or not isinstance(coverage, numbers.Real):
        raise InvalidInputError(f"coverage must be a number in (0, 1]; got {coverage!r}")
    coverage = float(coverage)
    if not (0.0 < coverage <= 1.0):
        raise InvalidInputError(f"coverage must lie in (0, 1] (e.g. 0.9); got {coverage!r}")
    accepted, wrong, n_rows, _ = _curve(probs_or_confidence, labels_or_correct, confidence,
                                        from_logits)
    reached = accepted.to(torch.float64) / n_rows
    target = torch.tensor([coverage], dtype=torch.float64, device=reached.device)
    g = int(torch.searchsorted(reached, target))  # first point with coverage >= target
    return (int(accepted[g]) - int(wrong[g])) / int(accepted[g])
