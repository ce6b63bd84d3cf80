"""Seeded bootstrap confidence intervals for the ECE."""

from __future__ import annotations

import math
import operator
from typing import Any, NamedTuple

import torch

from calibration.bin_stats import bin_stats_from_confidence
from calibration.binning import Binning, bin_edges, bin_indices, check_n_bins
from calibration.errors import InvalidInputError
from calibration.inputs import positive_int
from calibration.row_scores import row_scores

MAX_BOOTSTRAP = 1_000_000
"""The most bootstrap replicates [`bootstrap_ece`][calibration.bootstrap.bootstrap_ece] accepts.

The replicates are held at once (8 bytes each) to take their quantiles, and each costs a pass
over the N samples; 10**12 replicates asked for 8 TB. A percentile interval is settled long
before this: its Monte Carlo error shrinks like 1 / sqrt(n_boot), and 1,000-10,000 replicates
are the usual choice.
"""

_DRAWS_PER_BLOCK = 4_000_000  # resampled indices held at once (memory bound, ~32 MB)
_CELLS_PER_BLOCK = 4_000_000  # (replicate, bin) sums held at once (memory bound, ~32 MB)


class ECEInterval(NamedTuple):
    """ECE point estimate on the full data and a percentile bootstrap interval [low, high]."""

    estimate: float
    low: float
    high: float


def bootstrap_ece(
    probs: Any,
    labels: Any,
    n_boot: int = 1000,
    alpha: float = 0.05,
    seed: int = 0,
    n_bins: int = 15,
    binning: Binning | str = "uniform",
    from_logits: bool = False,
) -> ECEInterval:
    """Percentile bootstrap ``(1 - alpha)`` interval for the ECE.

    Samples are resampled with replacement ``n_boot`` times from a ``torch.Generator`` seeded
    with ``seed`` (an integer in ``[0, 2**63)``) on the input's device, so a call is
    reproducible on the same device. The bin
    edges are those of the full data (for ``"quantile"`` binning they are not re-estimated per
    resample). The estimate is the ECE of the full data, not the bootstrap mean.
    """
    n_boot = positive_int(n_boot, "n_boot", MAX_BOOTSTRAP,
                          " (MAX_BOOTSTRAP: the replicates are held in memory; 1,000-10,000 "
                          "are usual)")
    alpha = _alpha(alpha)
    seed = _seed(seed)
    n_bins = check_n_bins(n_bins)
    scores = row_scores(probs, labels, from_logits=from_logits)
    confidence, correct = scores.confidence.to(torch.float64), scores.correct
    n = confidence.shape[0]
    device = confidence.device
    edges = bin_edges(confidence, n_bins, binning)
    estimate = bin_stats_from_confidence(confidence, correct, edges).ece
    bins = bin_indices(confidence, edges)

    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    replicates = torch.empty(n_boot, dtype=torch.float64, device=device)
    block = max(1, min(_DRAWS_PER_BLOCK // n, _CELLS_PER_BLOCK // n_bins))
    for start in range(0, n_boot, block):
        size = min(block, n_boot - start)
        draws = torch.randint(0, n, (size, n), generator=generator, device=device)
        # Flat index (replicate, bin) so one index_add per block fills every replicate's bins.
        slots = (torch.arange(size, device=device)[:, None] * n_bins + bins[draws]).reshape(-1)
        gap_sums = torch.zeros(size * n_bins, dtype=torch.float64, device=device)
        gap_sums.index_add_(0, slots, (correct.double() - confidence)[draws].reshape(-1))
        # ECE = sum_b |sum_{i in b} (correct_i - conf_i)| / N
        replicates[start : start + size] = gap_sums.view(size, n_bins).abs().sum(1) / n
    quantiles = torch.tensor([alpha / 2, 1 - alpha / 2], dtype=torch.float64, device=device)
    low, high = torch.quantile(replicates, quantiles).tolist()
    return ECEInterval(estimate, low, high)


def _alpha(alpha: Any) -> float:
    """``alpha`` as a float strictly between 0 and 1, or InvalidInputError."""
    try:
        value = float(alpha)
    except (TypeError, ValueError):
        raise InvalidInputError(f"alpha must be a number in (0, 1); got {alpha!r}") from None
    if isinstance(alpha, bool) or not 0.0 < value < 1.0 or math.isnan(value):
        raise InvalidInputError(f"alpha must lie in (0, 1); got {alpha!r}")
    return value


def _seed(seed: Any) -> int:
    """``seed`` as an int in ``[0, 2**63)``, or InvalidInputError. Seeds are non-negative, as
    everywhere in the project (a run's seed, NumPy's generators): torch would take
    -1 as 2**64 - 1, so two spellings of one stream, and a typo would go unnoticed."""
    try:
        value = operator.index(seed)
    except TypeError:
        raise InvalidInputError(f"seed must be an integer; got {seed!r}") from None
    if isinstance(seed, bool) or not 0 <= value < 2**63:
        raise InvalidInputError(f"seed must be an integer in [0, 2**63) (seeds are "
                                f"non-negative, as NumPy's); got {seed!r}")
    return value
