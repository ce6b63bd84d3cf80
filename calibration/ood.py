"""Out-of-distribution detection metrics of any score, and a mergeable (federated) AUROC.

Convention: **a higher score means more likely out-of-distribution** (entropy, mutual
information, the negated maximum probability of `calibration.ood_scores`). For a confidence
(higher = more in-distribution, e.g. the maximum probability itself) pass
``higher_is_ood=False``: the scores are negated, which is exact, so ties and order are kept.

Inputs: ``scores`` (N,) real and finite; ``is_ood`` (N,) booleans or 0/1 integers (1 / True = the
row is out-of-distribution, the positive class). Both kinds of rows must be present. Tensors or
numpy arrays; the work runs on the scores' device, in float64 and exact int64 counts.

Definitions (a detector flags a row when its score is >= a threshold t; ties are handled
exactly: rows sharing a score are flagged together):

* **AUROC**: P(score of an OOD row > score of an in-distribution row) + 1/2 P(equal), over all
  (OOD, in) pairs: the Mann-Whitney statistic, equal to scikit-learn's ``roc_auc_score`` (ties
  count 1/2). Computed from integer counts and one correctly rounded division.
* **AUPR** (average precision, scikit-learn's ``average_precision_score``):
  ``sum_k (R_k - R_{k-1}) P_k`` over the distinct scores in descending order, with precision
  P_k and recall R_k of flagging every row scoring >= the k-th value. ``positive="ood"``
  (AUPR-Out) takes OOD rows as positives; ``positive="in"`` (AUPR-In) takes the
  in-distribution rows as positives and the negated scores.
* **FPR at TPR** (FPR@95 for ``tpr=0.95``): the fraction of in-distribution rows flagged by the
  highest threshold t that flags at least the fraction ``tpr`` of OOD rows (``n_flagged_ood /
  n_ood >= tpr`` evaluated in float64, as scikit-learn's ``roc_curve`` does, so 19 of 20 is 95%).
  It equals ``fpr[np.searchsorted(tpr_curve, tpr)]`` of ``roc_curve(..., drop_intermediate=False)``.

All of them are functions of the number of in-distribution and OOD rows at each distinct score,
which is what `AurocAccumulator` keeps: the state of several clients merges exactly, and
the merged metrics equal those of the pooled rows bitwise, in any merge order.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from calibration.accumulator import as_device
from calibration.binning import check_n_bins
from calibration.errors import InvalidInputError
from calibration.inputs import as_tensor, flag, index_array

_INT64_LIMIT = 1 << 63
_EXACT_KEYS = ("values", "in_counts", "ood_counts")
_BINNED_KEYS = ("edges", "in_counts", "ood_counts")


@dataclass(frozen=True, eq=False)
class ScoreCounts:
    """Rows per distinct score: ``values`` (D,) float64 strictly increasing, ``in_counts`` and
    ``ood_counts`` (D,) int64 (the in-distribution and OOD rows scoring exactly that value)."""

    values: Tensor
    in_counts: Tensor
    ood_counts: Tensor

    @property
    def n_in(self) -> int:
        return int(self.in_counts.sum())

    @property
    def n_ood(self) -> int:
        return int(self.ood_counts.sum())


# -- validation ------------------------------------------------------------------------------
def score_vector(scores: Any, name: str = "scores") -> Tensor:
    """(N,) finite real scores as float64 (``-0.0`` read as ``0.0``), N may be 0."""
    tensor = as_tensor(scores, name)
    if tensor.ndim != 1:
        raise InvalidInputError(
            f"{name} must be a 1-D array (N,) with one score per row; got shape "
            f"{tuple(tensor.shape)} (for probabilities compute a score first, e.g. "
            "calibration.ood_scores(probs))"
        )
    values = tensor.to(torch.float64)
    if not bool(torch.isfinite(values).all()):
        row = int((~torch.isfinite(values)).nonzero()[0, 0])
        raise InvalidInputError(
            f"{name} contain NaN or Inf (first at row {row}); every row needs a finite score "
            "(drop or fix those rows)"
        )
    return values + 0.0  # -0.0 + 0.0 = +0.0: one representation per value


def _oriented(values: Tensor, higher_is_ood: bool) -> Tensor:
    flag(higher_is_ood, "higher_is_ood", " (True: higher score = more likely OOD)")
    return values if higher_is_ood else -values + 0.0


def _labels(is_ood: Any, n_rows: int, device: torch.device) -> Tensor:
    """``is_ood`` (N,) as a bool tensor on ``device``."""
    tensor = as_tensor(is_ood, "is_ood")
    if tensor.ndim != 1:
        raise InvalidInputError(
            f"is_ood must be a 1-D array (N,) of booleans or 0/1; got shape {tuple(tensor.shape)}"
        )
    if tensor.shape[0] != n_rows:
        raise InvalidInputError(
            f"shape mismatch: {n_rows} scores but {tensor.shape[0]} is_ood flags (one per row)"
        )
    if tensor.dtype == torch.bool:
        return tensor.to(device)
    return index_array(tensor, "is_ood", 2, "(0 = in-distribution, 1 = out-of-distribution)",
                       device, kind="flags") == 1


def _count(values: Tensor, is_ood: Tensor) -> ScoreCounts:
    """Rows per distinct value of ``values`` (float64, any order)."""
    distinct, inverse = torch.unique(values, sorted=True, return_inverse=True)
    size = distinct.numel()
    ood = torch.bincount(inverse[is_ood], minlength=size)
    total = torch.bincount(inverse, minlength=size)
    return ScoreCounts(distinct, total - ood, ood)


def score_counts(scores: Any, is_ood: Any, *, higher_is_ood: bool = True) -> ScoreCounts:
    """Validate ``scores`` (N,) and ``is_ood`` (N,) and count the rows at each distinct score
    (scores negated when ``higher_is_ood=False``). Empty input gives empty counts."""
    values = score_vector(scores)
    labels = _labels(is_ood, values.shape[0], values.device)
    return _count(_oriented(values, higher_is_ood), labels)


def _check_both(n_in: int, n_ood: int, what: str) -> None:
    if n_in == 0 and n_ood == 0:
        raise InvalidInputError(f"{what} needs rows to score; got none")
    if n_in == 0 or n_ood == 0:
        missing = "in-distribution" if n_in == 0 else "out-of-distribution"
        present = f"{n_ood} OOD" if n_in == 0 else f"{n_in} in-distribution"
        raise InvalidInputError(
            f"{what} needs both in-distribution and out-of-distribution rows; got {present} rows "
            f"and no {missing} rows (add {missing} rows, e.g. merge the states of clients that "
            "hold them; is_ood must be True/1 for OOD rows)"
        )
    if 2 * n_in * n_ood >= _INT64_LIMIT:
        raise InvalidInputError(
            f"{n_in:,} x {n_ood:,} pairs exceed exact int64 counting; score a sample of the rows"
        )


# -- metrics from counts ---------------------------------------------------------------------
def _auroc(counts: ScoreCounts) -> float:
    n_in, n_ood = counts.n_in, counts.n_ood
    _check_both(n_in, n_ood, "AUROC")
    below = torch.cumsum(counts.in_counts, 0) - counts.in_counts  # in-rows scoring lower
    twice_u = int((counts.ood_counts * (2 * below + counts.in_counts)).sum())
    return twice_u / (2 * n_in * n_ood)  # Python ints: one correctly rounded division


def _average_precision(positives: Tensor, negatives: Tensor) -> float:
    """Average precision of flagging by descending value; ``positives``/``negatives`` per
    distinct value in descending order."""
    tp = torch.cumsum(positives, 0)
    fp = torch.cumsum(negatives, 0)
    precision = tp.to(torch.float64) / (tp + fp).to(torch.float64)
    recall = tp.to(torch.float64) / float(tp[-1])
    steps = torch.diff(recall, prepend=recall.new_zeros(1))
    return float((steps * precision).sum())


def _aupr(counts: ScoreCounts, positive: str) -> float:
    _check_both(counts.n_in, counts.n_ood, "AUPR")
    if positive == "ood":  # descending scores
        return _average_precision(counts.ood_counts.flip(0), counts.in_counts.flip(0))
    # in-distribution positive with negated scores: descending -score = ascending score
    return _average_precision(counts.in_counts, counts.ood_counts)


def _fpr_at_tpr(counts: ScoreCounts, tpr: float) -> float:
    _check_both(counts.n_in, counts.n_ood, "FPR at TPR")
    tp = torch.cumsum(counts.ood_counts.flip(0), 0)
    fp = torch.cumsum(counts.in_counts.flip(0), 0)
    rates = tp.to(torch.float64) / float(tp[-1])
    target = torch.tensor([tpr], dtype=torch.float64, device=rates.device)
    first = int(torch.searchsorted(rates, target))  # first threshold with rate >= tpr
    return int(fp[first]) / counts.n_in


def _check_tpr(tpr: Any) -> float:
    if isinstance(tpr, bool | np.bool_) or not isinstance(tpr, numbers.Real):
        raise InvalidInputError(f"tpr must be a number in (0, 1] (e.g. 0.95); got {tpr!r}")
    tpr = float(tpr)
    if not (0.0 < tpr <= 1.0):
        raise InvalidInputError(f"tpr must lie in (0, 1] (e.g. 0.95); got {tpr!r}")
    return tpr


def _check_positive(positive: Any) -> str:
    if positive not in ("ood", "in"):
        raise InvalidInputError(
            f"positive must be 'ood' (AUPR-Out) or 'in' (AUPR-In); got {positive!r}"
        )
    return positive


# -- public functions ------------------------------------------------------------------------
def auroc(scores: Any, is_ood: Any, *, higher_is_ood: bool = True) -> float:
    """Area under the ROC curve of detecting OOD rows by ``scores`` (N,), in [0, 1].

    ``is_ood`` (N,): True/1 for out-of-distribution rows. Ties count 1/2, as in scikit-learn's
    ``roc_auc_score``; 0.5 is chance. See the module notes for the score convention.
    """
    return _auroc(score_counts(scores, is_ood, higher_is_ood=higher_is_ood))


def aupr(scores: Any, is_ood: Any, *, positive: str = "ood", higher_is_ood: bool = True) -> float:
    """Average precision (area under the precision-recall curve, scikit-learn's definition).

    ``positive="ood"`` (default, AUPR-Out): OOD rows are the positives, ranked by ``scores``;
    ``positive="in"`` (AUPR-In): in-distribution rows are the positives, ranked by ``-scores``.
    """
    positive = _check_positive(positive)
    return _aupr(score_counts(scores, is_ood, higher_is_ood=higher_is_ood), positive)


def fpr_at_tpr(scores: Any, is_ood: Any, tpr: float = 0.95, *,
               higher_is_ood: bool = True) -> float:
    """Fraction of in-distribution rows flagged by the highest threshold that flags at least
    the fraction ``tpr`` of OOD rows (FPR@95 for the default), in [0, 1]; lower is better.

    A row is flagged when its score is >= the threshold, so tied rows are flagged together.
    """
    tpr = _check_tpr(tpr)
    return _fpr_at_tpr(score_counts(scores, is_ood, higher_is_ood=higher_is_ood), tpr)


def _report(counts: ScoreCounts, tpr: float) -> dict[str, float]:
    return {
        "auroc": _auroc(counts),
        "aupr_out": _aupr(counts, "ood"),
        "aupr_in": _aupr(counts, "in"),
        "fpr_at_tpr": _fpr_at_tpr(counts, tpr),
        "tpr": tpr,
        "n_in": counts.n_in,
        "n_ood": counts.n_ood,
    }


def ood_report(scores_in: Any, scores_out: Any, *, higher_is_ood: bool = True,
               tpr: float = 0.95) -> dict[str, float]:
    """All detection metrics of in-distribution scores (N_in,) against OOD scores (N_out,).

    Returns a dict: ``auroc``, ``aupr_out``, ``aupr_in``, ``fpr_at_tpr`` (at ``tpr``, 0.95 by
    default: FPR@95), ``tpr``, ``n_in``, ``n_ood``. Same definitions as `auroc`,
    `aupr` and `fpr_at_tpr` on the concatenated rows.
    """
    tpr = _check_tpr(tpr)
    inside = score_vector(scores_in, "scores_in")
    outside = score_vector(scores_out, "scores_out").to(inside.device)
    values = _oriented(torch.cat([inside, outside]), higher_is_ood)
    labels = torch.zeros(values.shape[0], dtype=torch.bool, device=values.device)
    labels[inside.shape[0]:] = True
    return _report(_count(values, labels), tpr)


# -- the mergeable state ---------------------------------------------------------------------
class AurocAccumulator:
    """Mergeable OOD-detection state: AUROC (and, exact, AUPR and FPR@TPR) over clients.

    Two variants, chosen at construction:

    * **exact** (default, ``n_bins=None``): the number of in-distribution and OOD rows at each
      distinct score. Merging adds the counts of equal scores, so the merged state is the pooled
      rows' state and `compute` gives bitwise the metrics of `ood_report` on the
      pooled rows, in any merge order. Its size is 24 bytes per *distinct* score (up to the
      number of rows: float scores rarely repeat), and a client reveals every distinct score it
      saw with how many of its in-distribution and OOD rows had it (its labelled scores, without
      row order).
    * **binned** (``n_bins`` and ``score_range=(low, high)``): counts per equal-width bin on
      [low, high], scores outside the range counted in the end bins. Its size, 16 bytes per bin,
      is fixed (``n_bins`` at most `calibration.binning.MAX_BINS`, checked before
      anything is allocated), and a client reveals only this histogram over public edges. Only
      the AUROC is computed, treating rows that share a bin as tied; bins are ordered like the
      scores, so only pairs of an OOD and an in-distribution row in the same bin can be scored
      differently from the exact AUROC (1/2 instead of 0, 1/2 or 1), hence
      ``|AUROC_binned - AUROC_exact| <= auroc_error_bound = (1/2) sum_b in_b ood_b /
      (n_in n_ood)``, half the fraction of pairs sharing a bin, reported by `compute`.

    ``update`` adds rows, ``merge`` (or ``+``, ``sum(...)``, `merged`) returns a new
    accumulator, ``state_dict``/``from_state_dict`` carry the state as tensors. Every client
    must score the same way (the same score, the same ``higher_is_ood``). For many exact states
    use `merged` (one sort of all their values); a chain of pairwise merges re-sorts the growing
    state at each step.
    """

    def __init__(self, n_bins: int | None = None, score_range: tuple[float, float] | None = None,
                 device: torch.device | str | None = None) -> None:
        self._device = as_device(device)
        self.n_bins: int | None = None
        self.edges: Tensor | None = None
        if n_bins is None:
            if score_range is not None:
                raise InvalidInputError(
                    "score_range is for the binned variant: pass n_bins too (or neither, for "
                    "the exact variant)"
                )
        else:
            self.n_bins = check_n_bins(n_bins)  # bounded before the edges are allocated
            self.edges = _uniform_edges(score_range, self.n_bins, self._device)
        self._counts: ScoreCounts | None = None

    @property
    def binned(self) -> bool:
        return self.n_bins is not None

    @property
    def device(self) -> torch.device:
        if self._counts is not None:
            return self._counts.in_counts.device
        if self.edges is not None:
            return self.edges.device
        return self._device or torch.device("cpu")

    @property
    def n_in(self) -> int:
        return 0 if self._counts is None else self._counts.n_in

    @property
    def n_ood(self) -> int:
        return 0 if self._counts is None else self._counts.n_ood

    @property
    def size(self) -> int:
        """Number of (value or bin, in count, OOD count) entries held."""
        if self.binned:
            return self.n_bins
        return 0 if self._counts is None else int(self._counts.values.numel())

    def _empty_like(self) -> AurocAccumulator:
        twin = AurocAccumulator.__new__(AurocAccumulator)
        twin._device, twin.n_bins, twin.edges, twin._counts = (self.device, self.n_bins,
                                                                self.edges, None)
        return twin

    def update(self, scores: Any, is_ood: Any, *, higher_is_ood: bool = True) -> AurocAccumulator:
        """Add rows: ``scores`` (N,) and ``is_ood`` (N,) as for `auroc`; returns self."""
        values = score_vector(scores)
        labels = _labels(is_ood, values.shape[0], values.device)
        values = _oriented(values, higher_is_ood)
        if self.binned:
            edges = self.edges.to(values.device)
            bins = torch.bucketize(values, edges[1:-1], right=True)  # [0, n_bins), ends clipped
            ood = torch.bincount(bins[labels], minlength=self.n_bins)
            total = torch.bincount(bins, minlength=self.n_bins)
            batch = ScoreCounts(edges[:-1], total - ood, ood)
        else:
            batch = _count(values, labels)
        self._counts = self._combined([self._counts, batch])
        return self

    def _combined(self, parts: list[ScoreCounts | None]) -> ScoreCounts | None:
        held = [p for p in parts if p is not None]
        if not held:
            return None
        device = self._device or held[0].in_counts.device
        if self.binned:
            in_counts = sum(p.in_counts.to(device) for p in held)
            ood_counts = sum(p.ood_counts.to(device) for p in held)
            return ScoreCounts(self.edges.to(device)[:-1], in_counts, ood_counts)
        if len(held) == 1:
            return ScoreCounts(*(t.to(device) for t in (held[0].values, held[0].in_counts,
                                                        held[0].ood_counts)))
        values = torch.cat([p.values.to(device) for p in held])
        distinct, inverse = torch.unique(values, sorted=True, return_inverse=True)
        in_counts = torch.zeros(distinct.numel(), dtype=torch.int64, device=device)
        ood_counts = torch.zeros_like(in_counts)
        in_counts.index_add_(0, inverse, torch.cat([p.in_counts.to(device) for p in held]))
        ood_counts.index_add_(0, inverse, torch.cat([p.ood_counts.to(device) for p in held]))
        return ScoreCounts(distinct, in_counts, ood_counts)

    # -- merging ---------------------------------------------------------------------------
    def _check_compatible(self, other: Any) -> None:
        if not isinstance(other, AurocAccumulator):
            raise InvalidInputError(
                f"can only merge an AurocAccumulator; got {type(other).__name__}"
            )
        if self.binned != other.binned:
            raise InvalidInputError(
                "cannot merge an exact AurocAccumulator with a binned one: every client must use "
                "the same variant"
            )
        if self.binned and (self.n_bins != other.n_bins or not torch.equal(
                self.edges.cpu(), other.edges.cpu())):
            raise InvalidInputError(
                "cannot merge binned AurocAccumulators with different bins: every client must use "
                "the same n_bins and score_range"
            )

    def merge(self, other: AurocAccumulator) -> AurocAccumulator:
        """A new accumulator holding the rows of both (self's device). Inputs are unchanged."""
        self._check_compatible(other)
        merged = self._empty_like()
        merged._counts = merged._combined([self._counts, other._counts])
        return merged

    def __add__(self, other: AurocAccumulator) -> AurocAccumulator:
        return self.merge(other)

    def __radd__(self, other: Any) -> AurocAccumulator:
        if isinstance(other, int) and other == 0:  # sum(accumulators) starts from 0
            return self.merge(self._empty_like())
        return NotImplemented

    @classmethod
    def merged(cls, accumulators: Iterable[AurocAccumulator]) -> AurocAccumulator:
        """Merge any number of accumulators (at least one) into a new one, in one pass."""
        try:
            items = list(accumulators)
        except TypeError:
            raise InvalidInputError(
                f"expected an iterable of AurocAccumulators; got {type(accumulators).__name__}"
            ) from None
        if not items:
            raise InvalidInputError("cannot merge an empty collection of AurocAccumulators")
        if not isinstance(items[0], AurocAccumulator):
            raise InvalidInputError(f"expected AurocAccumulators only; got a "
                                    f"{type(items[0]).__name__}")
        for item in items[1:]:
            items[0]._check_compatible(item)
        result = items[0]._empty_like()
        result._counts = result._combined([a._counts for a in items])
        return result

    # -- results ---------------------------------------------------------------------------
    def _nonempty(self) -> ScoreCounts:
        if self._counts is None or self.n_in + self.n_ood == 0:
            raise InvalidInputError("the accumulator is empty: update it with at least one row")
        return self._counts

    def auroc(self) -> float:
        """AUROC of every row added (exact or binned, see the class notes)."""
        return _auroc(self._nonempty())

    def compute(self, tpr: float = 0.95) -> dict[str, float]:
        """Metrics dict.

        Exact variant: the dict of `ood_report` (``auroc``, ``aupr_out``, ``aupr_in``,
        ``fpr_at_tpr``, ``tpr``, ``n_in``, ``n_ood``). Binned variant: ``auroc``,
        ``auroc_error_bound`` (the bound on its distance to the exact AUROC), ``n_in``,
        ``n_ood``, ``n_bins``.
        """
        counts = self._nonempty()
        if not self.binned:
            return _report(counts, _check_tpr(tpr))
        value = _auroc(counts)
        shared = int((counts.in_counts * counts.ood_counts).sum())
        return {"auroc": value, "auroc_error_bound": shared / (2 * counts.n_in * counts.n_ood),
                "n_in": counts.n_in, "n_ood": counts.n_ood, "n_bins": self.n_bins}

    # -- serialisation ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Tensor]:
        """Tensors only (safe for safetensors/npz messages), copies on the current device.

        Exact: ``values`` (D,) float64 strictly increasing, ``in_counts`` and ``ood_counts``
        (D,) int64. Binned: ``edges`` (n_bins + 1,) float64, ``in_counts`` and ``ood_counts``
        (n_bins,) int64.
        """
        device = self.device
        if self.binned:
            zeros = torch.zeros(self.n_bins, dtype=torch.int64, device=device)
            counts = self._counts or ScoreCounts(self.edges[:-1], zeros, zeros)
            return {"edges": self.edges.to(device).clone(),
                    "in_counts": counts.in_counts.clone(), "ood_counts": counts.ood_counts.clone()}
        if self._counts is None:
            empty = torch.zeros(0, dtype=torch.int64, device=device)
            return {"values": torch.zeros(0, dtype=torch.float64, device=device),
                    "in_counts": empty, "ood_counts": empty.clone()}
        return {key: getattr(self._counts, key).clone() for key in _EXACT_KEYS}

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Tensor],
                        device: torch.device | str | None = None) -> AurocAccumulator:
        """Rebuild an accumulator from `state_dict` output, validating it first."""
        if not isinstance(state, Mapping):
            raise InvalidInputError(
                f"an AurocAccumulator state is a mapping of name -> tensor; got "
                f"{type(state).__name__}"
            )
        keys = set(state)
        if keys not in (set(_EXACT_KEYS), set(_BINNED_KEYS)):
            raise InvalidInputError(
                f"AurocAccumulator state must have the keys {list(_EXACT_KEYS)} (exact) or "
                f"{list(_BINNED_KEYS)} (binned); got {sorted(keys)}"
            )
        tensors = {key: as_tensor(state[key], key) for key in state}
        first = "edges" if "edges" in keys else "values"
        axis = tensors[first]
        if axis.ndim != 1 or axis.dtype == torch.bool or not bool(
                torch.isfinite(axis.to(torch.float64)).all()):
            raise InvalidInputError(f"{first} must be a 1-D array of finite numbers")
        axis = axis.to(torch.float64)
        if axis.numel() > 1 and not bool((axis[1:] > axis[:-1]).all()):
            raise InvalidInputError(f"{first} must be strictly increasing")
        size = axis.numel() - 1 if first == "edges" else axis.numel()
        counts = []
        for key in ("in_counts", "ood_counts"):
            tensor = tensors[key]
            if tuple(tensor.shape) != (size,):
                raise InvalidInputError(f"{key} must have shape ({size},) to match {first}")
            if tensor.dtype == torch.bool or (tensor.is_floating_point() and not bool(
                    (torch.isfinite(tensor) & (tensor == tensor.round())).all())):
                raise InvalidInputError(f"{key} must hold whole numbers (row counts)")
            if bool((tensor < 0).any()):
                raise InvalidInputError(f"{key} contains negative values")
            counts.append(tensor)
        target = as_device(device) or axis.device
        in_counts, ood_counts = (c.to(target, torch.int64).clone() for c in counts)
        if first == "edges":
            accumulator = cls.__new__(cls)
            accumulator._device = target
            accumulator.n_bins = check_n_bins(size)
            accumulator.edges = axis.to(target).clone()
            accumulator._counts = ScoreCounts(accumulator.edges[:-1], in_counts, ood_counts)
            return accumulator
        accumulator = cls(device=target)
        if size:
            accumulator._counts = ScoreCounts(axis.to(target).clone() + 0.0, in_counts,
                                              ood_counts)
        return accumulator

    def __repr__(self) -> str:
        kind = f"n_bins={self.n_bins}" if self.binned else f"distinct={self.size}"
        return (f"AurocAccumulator({kind}, n_in={self.n_in}, n_ood={self.n_ood}, "
                f"device={self.device})")


def _uniform_edges(score_range: Any, n_bins: int, device: torch.device | None) -> Tensor:
    """Equal-width edges on ``score_range``: (n_bins + 1,) float64, strictly increasing.

    Edge k is computed as ``(low (n - k) + high k) / n``, not ``low + (high - low) k / n``: where
    ``low`` and ``high`` are whole numbers (or other short binary fractions) the products and the
    sum are exact, so each edge is the float nearest its exact value and a score written as an
    edge lands in the bin that edge opens (e.g. -0.2 in [-0.2, 0.2) on (-1, 1) with 5 bins; the
    other form put it 2 ulp below its edge). Elsewhere an edge is within ~1.5 ulp of exact.
    """
    try:
        low, high = (float(v) for v in score_range)
    except (TypeError, ValueError):
        raise InvalidInputError(
            f"score_range must be a pair (low, high) of numbers for the binned variant; got "
            f"{score_range!r}"
        ) from None
    if not (math.isfinite(low) and math.isfinite(high) and low < high
            and math.isfinite(high - low)):
        raise InvalidInputError(
            f"score_range must be finite with low < high; got ({low!r}, {high!r}) (e.g. (0, "
            "log(C)) for entropies of C classes)"
        )
    k = torch.arange(n_bins + 1, dtype=torch.float64, device=device)
    edges = (low * (n_bins - k) + high * k) / n_bins
    if not bool(torch.isfinite(edges).all()):  # |low| or |high| near the float64 limit
        edges = low + (high - low) * (k / n_bins)
    edges[0], edges[-1] = low, high
    if not bool((edges[1:] > edges[:-1]).all()):
        raise InvalidInputError(
            f"score_range ({low!r}, {high!r}) is too narrow for {n_bins} distinct float64 bins; "
            "widen it or use fewer bins"
        )
    return edges

