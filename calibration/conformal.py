"""Split-conformal prediction sets for classification, on probabilities from any source.

A *conformity score* ``s(x, y)`` says how badly label ``y`` fits the predictive at ``x`` (larger:
worse). Split conformal prediction computes the scores of ``n`` held-out calibration rows
``s_1..s_n`` at their true labels, takes the threshold

    q = the k-th smallest of s_1..s_n,   k = ceil((n + 1)(1 - alpha))

and predicts the set ``C(x) = {y : s(x, y) <= q}``. If the calibration rows and a test row are
exchangeable, ``P(y_test in C(x_test)) >= 1 - alpha`` (Vovk et al. 2005; Angelopoulos & Bates
2021, Thm. D.1), whatever the model, and when the scores are almost surely distinct also
``<= 1 - alpha + 1 / (n + 1)``. The guarantee is *marginal* (averaged over calibration and test
draws), which is why the toolkit reports coverage per client as well as pooled.

**Too few calibration rows.** When ``k > n`` (i.e. ``n < 1/alpha - 1``: fewer than 19 rows at
``alpha = 0.05``), no finite threshold has the guarantee: the test score is the largest of the
``n + 1`` with probability ``1 / (n + 1) > alpha``. The threshold is then ``+inf`` and every set
holds every label (`conformal_threshold` returns ``math.inf``; the coverage is 1, honestly
uninformative).

**Scores** (``score=``; all are computed by one function for every label at once, so a
calibration row's own score and the one compared at prediction time are the same float):

* ``"lac"`` (least ambiguous set-valued classifier, Sadinle et al. 2019): ``1 - p_y``. Smallest
  average sets; coverage can vary across classes and inputs.
* ``"aps"`` (adaptive prediction sets, Romano et al. 2020): the probability mass of every label
  ranked above ``y`` plus ``p_y`` (labels ranked by decreasing probability, ties by class index).
  With ``randomized=True`` the mass of ``y`` itself enters as ``u * p_y`` with ``u ~ U(0, 1)`` drawn
  per row (one ``u`` per row at prediction time too), which makes the coverage exact rather than
  conservative. Sets grow with the predictive's uncertainty.
* ``"raps"`` (regularised APS, Angelopoulos et al. 2021): APS plus ``lam * max(0, rank(y) -
  k_reg)`` with ``rank`` 1-based; the penalty keeps the sets of a model with a long tail of small
  probabilities from growing past ``k_reg`` labels.

Every score is non-decreasing along a row's ranking, so every set is a *prefix* of the labels
sorted by probability (for LAC, up to ties). A set can be empty (a threshold below the top
label's score); that still counts as a miss in coverage and as size 0.

`CoverageAccumulator` keeps coverage and set-size counts as mergeable sums (update /
merge / compute), so a pooled figure over clients is exactly the merge of the clients' states.
The threshold itself can be computed without pooling any client's scores:
`calibration.federated_conformal`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from calibration.errors import InvalidInputError
from calibration.inputs import as_tensor, class_labels, positive_int, score_matrix
from calibration.ood import score_vector as finite_scores
from calibration.row_scores import row_scores

SCORES = ("lac", "aps", "raps")
"""Conformity scores [`conformity_scores`][calibration.conformal.conformity_scores] knows."""


@dataclass(frozen=True)
class ConformalScore:
    """A conformity score and its options.

    Attributes:
        kind: ``"lac"``, ``"aps"`` or ``"raps"`` (module docstring).
        randomized: APS/RAPS only: the label's own mass enters as ``u * p_y``, ``u ~ U(0, 1)``.
        k_reg: RAPS only: labels ranked beyond ``k_reg`` are penalised (>= 0).
        lam: RAPS only: the penalty per rank beyond ``k_reg`` (>= 0).
    """

    kind: str = "aps"
    randomized: bool = False
    k_reg: int = 1
    lam: float = 0.01

    def __post_init__(self) -> None:
        if self.kind not in SCORES:
            raise InvalidInputError(f"unknown conformity score {self.kind!r}; valid: "
                                    f"{', '.join(SCORES)}")
        if not isinstance(self.randomized, bool):
            raise InvalidInputError(f"randomized must be True or False, got {self.randomized!r}")
        if self.kind == "lac" and self.randomized:
            raise InvalidInputError("the LAC score (1 - p_y) has no randomised form; use "
                                    "score='aps' or 'raps' with randomized=True")
        if isinstance(self.k_reg, bool) or not isinstance(self.k_reg, int) or self.k_reg < 0:
            raise InvalidInputError(f"k_reg must be an integer >= 0, got {self.k_reg!r}")
        if not (isinstance(self.lam, int | float) and math.isfinite(self.lam)
                and self.lam >= 0):
            raise InvalidInputError(f"lam must be a finite number >= 0, got {self.lam!r}")

    @classmethod
    def of(cls, score: str | ConformalScore) -> ConformalScore:
        """``score`` as a `ConformalScore` (a name takes the default options)."""
        if isinstance(score, ConformalScore):
            return score
        if not isinstance(score, str):
            raise InvalidInputError(f"score must be one of {SCORES} or a ConformalScore, got "
                                    f"{score!r}")
        return cls(score)


def _probabilities(probs: Any) -> Tensor:
    """Validated probabilities (rows >= 0 summing to 1) as float64 (N, C)."""
    matrix = score_matrix(probs, "probs")
    # row_scores validates the rows (finite, >= 0, sum to 1); the labels are a placeholder
    row_scores(matrix, torch.zeros(matrix.shape[0], dtype=torch.int64, device=matrix.device),
               confidence=False)
    return matrix.to(torch.float64)


def _uniforms(n: int, score: ConformalScore, generator: torch.Generator | None,
              device: torch.device) -> Tensor | None:
    if not score.randomized:
        return None
    u = torch.rand(n, dtype=torch.float64, generator=generator,
                   device="cpu" if generator is None else generator.device)
    return u.to(device)


def all_label_scores(probs: Any, score: str | ConformalScore = "aps", *,
                     generator: torch.Generator | None = None,
                     uniforms: Tensor | None = None) -> Tensor:
    """The conformity score of every label of every row.

    Args:
        probs: (N, C) probabilities (rows >= 0 summing to 1).
        score: a name in `SCORES` or a [`ConformalScore`][calibration.conformal.ConformalScore].
        generator: draws the per-row ``u`` of a randomised score (ignored otherwise).
        uniforms: (N,) the per-row ``u`` themselves, instead of drawing them.

    Returns:
        (N, C) float64 scores, non-decreasing along each row's ranking by probability.
    """
    spec = ConformalScore.of(score)
    p = _probabilities(probs)
    n, c = p.shape
    if spec.kind == "lac":
        return (1.0 - p) + 0.0  # + 0.0: one representation of zero
    # rank labels by decreasing probability, ties by class index (a stable sort)
    order = torch.sort(p, dim=1, descending=True, stable=True).indices
    sorted_p = p.gather(1, order)
    above = torch.cumsum(sorted_p, dim=1) - sorted_p  # mass strictly ranked before each label
    if not spec.randomized:
        uniforms = None
    elif uniforms is None:
        uniforms = _uniforms(n, spec, generator, p.device)
    else:
        uniforms = as_tensor(uniforms, "uniforms").to(device=p.device, dtype=torch.float64)
        if uniforms.shape != (n,):
            raise InvalidInputError(f"uniforms must have shape ({n},), got "
                                    f"{tuple(uniforms.shape)}")
    own = sorted_p if uniforms is None else uniforms[:, None] * sorted_p
    # accumulated as (mass above) + (own mass): the same two-term sum for every label
    sorted_scores = above + own
    if spec.kind == "raps":
        rank = torch.arange(1, c + 1, dtype=torch.float64, device=p.device)
        sorted_scores = sorted_scores + spec.lam * (rank - spec.k_reg).clamp(min=0.0)
    return torch.empty_like(sorted_scores).scatter_(1, order, sorted_scores)


def conformity_scores(probs: Any, labels: Any, score: str | ConformalScore = "aps", *,
                      generator: torch.Generator | None = None) -> Tensor:
    """The calibration scores ``s(x_i, y_i)``: (N,) float64 (see `all_label_scores`)."""
    scores = all_label_scores(probs, score, generator=generator)
    label_index = class_labels(labels, scores.shape[0], scores.shape[1], scores.device)
    return scores.gather(1, label_index[:, None])[:, 0]


def check_alpha(alpha: Any) -> float:
    """``alpha`` as a float in (0, 1), or InvalidInputError."""
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) \
            or not 0.0 < float(alpha) < 1.0:
        raise InvalidInputError(f"alpha (the miscoverage level) must be a number in (0, 1), "
                                f"e.g. 0.1 for 90% sets; got {alpha!r}")
    return float(alpha)


def quantile_rank(n: int, alpha: float) -> int:
    """``k = ceil((n + 1)(1 - alpha))``: the rank of the threshold among ``n`` scores; ``k > n``
    means no finite threshold has the guarantee (module docstring).

    The product is rounded up *exactly*: ``(n + 1)(1 - alpha)`` is formed from ``alpha``'s
    exact binary value with integer arithmetic, so e.g. ``n = 9, alpha = 0.1`` gives 9, not the
    10 that the float ``10 * 0.9 = 9.000000000000002`` would round up to.
    """
    n = positive_int(n, "n")
    alpha = check_alpha(alpha)
    a_num, a_den = alpha.as_integer_ratio()  # alpha = a_num / a_den exactly
    return -((-(n + 1) * (a_den - a_num)) // a_den)  # ceil of an exact rational


def conformal_threshold(scores: Any, alpha: float) -> float:
    """The split-conformal threshold: the ``ceil((n + 1)(1 - alpha))``-th smallest score.

    Args:
        scores: (n,) calibration scores (finite).
        alpha: miscoverage level in (0, 1).

    Returns:
        The threshold (one of the scores), or ``math.inf`` when ``n < 1/alpha - 1`` rows leave
        no finite threshold with the guarantee.
    """
    s = score_vector(scores)
    k = quantile_rank(s.shape[0], alpha)
    if k > s.shape[0]:
        return math.inf
    return float(torch.kthvalue(s.cpu(), k).values)


def score_vector(scores: Any) -> Tensor:
    """Validated finite scores as a non-empty float64 (n,) tensor (``-0.0`` read as ``0.0``)."""
    s = finite_scores(scores, "scores")
    if s.shape[0] == 0:
        raise InvalidInputError("scores are empty: a threshold needs at least one "
                                "calibration row")
    return s


def prediction_sets(probs: Any, threshold: float, score: str | ConformalScore = "aps", *,
                    generator: torch.Generator | None = None,
                    uniforms: Tensor | None = None) -> Tensor:
    """The conformal sets ``{y : s(x, y) <= threshold}`` as a boolean (N, C) mask.

    Args:
        probs: (N, C) probabilities of the rows to predict.
        threshold: from `conformal_threshold` (or the federated search); ``inf`` gives
            every label.
        score: the score the threshold was calibrated with.
        generator: draws the per-row ``u`` of a randomised score (`all_label_scores`).
        uniforms: (N,) the per-row ``u`` themselves, instead of drawing them.
    """
    if isinstance(threshold, bool) or not isinstance(threshold, int | float) \
            or math.isnan(threshold):
        raise InvalidInputError(f"threshold must be a number (inf for every label), got "
                                f"{threshold!r}")
    return all_label_scores(probs, score, generator=generator, uniforms=uniforms) <= threshold


def coverage(sets: Any, labels: Any) -> float:
    """Share of rows whose set holds the true label; ``sets`` (N, C) bool, ``labels`` (N,)."""
    mask = _set_mask(sets)
    label_index = class_labels(labels, mask.shape[0], mask.shape[1], mask.device)
    return float(mask.gather(1, label_index[:, None]).double().mean())


def set_sizes(sets: Any) -> Tensor:
    """Labels per set: (N,) int64."""
    return _set_mask(sets).sum(dim=1)


def _set_mask(sets: Any) -> Tensor:
    mask = as_tensor(sets, "sets")
    if mask.ndim != 2 or mask.shape[0] == 0:
        raise InvalidInputError(f"sets must be a non-empty boolean (N, C) mask, got shape "
                                f"{tuple(mask.shape)}")
    if mask.dtype != torch.bool:
        raise InvalidInputError(f"sets must be a boolean mask, got dtype {mask.dtype}")
    return mask


class CoverageAccumulator:
    """Mergeable coverage and set-size counts of conformal sets over ``num_classes`` labels.

    State: rows, rows covered, and the histogram of set sizes 0..C (int64, (C + 1,)); the
    mean size and coverage are functions of it, so merging clients' states is exact.
    """

    def __init__(self, num_classes: int) -> None:
        self.num_classes = positive_int(num_classes, "num_classes")
        self.count = 0
        self.covered = 0
        self.size_counts = torch.zeros(self.num_classes + 1, dtype=torch.int64)

    def update(self, sets: Any, labels: Any) -> CoverageAccumulator:
        """Add rows: ``sets`` (N, C) boolean mask, ``labels`` (N,)."""
        mask = _set_mask(sets)
        if mask.shape[1] != self.num_classes:
            raise InvalidInputError(f"sets have {mask.shape[1]} classes, the accumulator "
                                    f"{self.num_classes}")
        label_index = class_labels(labels, mask.shape[0], mask.shape[1], mask.device)
        self.count += int(mask.shape[0])
        self.covered += int(mask.gather(1, label_index[:, None]).sum())
        self.size_counts += torch.bincount(mask.sum(dim=1).cpu(),
                                           minlength=self.num_classes + 1)
        return self

    def merge(self, other: CoverageAccumulator) -> CoverageAccumulator:
        """Add another accumulator's counts into this one (same ``num_classes``)."""
        if not isinstance(other, CoverageAccumulator) or other.num_classes != self.num_classes:
            raise InvalidInputError("can only merge a CoverageAccumulator of the same number "
                                    "of classes")
        self.count += other.count
        self.covered += other.covered
        self.size_counts += other.size_counts
        return self

    def state_dict(self) -> dict[str, Tensor]:
        """``counts`` (2,) int64 = (rows, covered), ``size_counts`` (C + 1,) int64."""
        return {"counts": torch.tensor([self.count, self.covered], dtype=torch.int64),
                "size_counts": self.size_counts.clone()}

    @classmethod
    def from_state_dict(cls, state: dict[str, Tensor]) -> CoverageAccumulator:
        sizes = state["size_counts"]
        acc = cls(int(sizes.shape[0]) - 1)
        counts = state["counts"]
        acc.count, acc.covered = int(counts[0]), int(counts[1])
        if acc.count < 0 or not 0 <= acc.covered <= acc.count or bool((sizes < 0).any()) \
                or int(sizes.sum()) != acc.count:
            raise InvalidInputError("inconsistent coverage state: covered must lie in "
                                    "[0, rows] and the size histogram must sum to the rows")
        acc.size_counts = sizes.to(torch.int64).clone()
        return acc

    def compute(self) -> dict[str, Any]:
        """``coverage``, ``mean_set_size``, ``empty_sets`` (share), ``count`` and the size
        histogram ``size_counts`` (list, index = size); NaN figures when empty."""
        n = self.count
        sizes = torch.arange(self.num_classes + 1, dtype=torch.float64)
        return {"count": n,
                "coverage": self.covered / n if n else math.nan,
                "mean_set_size": float((sizes * self.size_counts).sum()) / n if n else math.nan,
                "empty_sets": int(self.size_counts[0]) / n if n else math.nan,
                "size_counts": [int(v) for v in self.size_counts]}


__all__ = [
    "SCORES",
    "ConformalScore",
    "CoverageAccumulator",
    "all_label_scores",
    "check_alpha",
    "conformal_threshold",
    "conformity_scores",
    "coverage",
    "prediction_sets",
    "quantile_rank",
    "score_vector",
    "set_sizes",
]
