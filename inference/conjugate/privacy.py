"""Differential privacy for FedLog statistics (spec §4.2): clipping and the Gaussian mechanism.

Neighbouring data sets differ by adding or removing one record (replace-one would double the
sensitivity). With every body feature clipped to ``[-b, b]`` one record contributes
``[1, phi]`` to a single row of the ``(C, m + 1)`` table, so the L2 sensitivity of the table is

    Delta_2 = ||[1, b, ..., b]||_2 = sqrt(1 + m b^2)        (m = body features).

The Gaussian mechanism adds ``N(0, sigma^2)`` to every cell, the count column included. Two
calibrations of ``sigma`` are offered:

* ``"single"`` (v1, Thm 3.1): ``sigma = sqrt(2 Delta_2^2 ln(1.25 / delta)) / epsilon``, the
  classical single-release mechanism; ``(epsilon, delta)`` then holds per release (per round),
  whatever ``rounds`` is.
* ``"k_round"`` (v2, Thm 7, default): ``sigma = sqrt(8 k Delta_2^2 ln(e + epsilon / delta)) /
  epsilon`` over ``k = rounds`` releases (Kairouz et al. 2015 composition); ``(epsilon, delta)``
  covers the whole run.

Placement: *local* DP privatises each client's statistics before upload; *central* DP
privatises the server's sum once per round. :func:`privatize` does either. The total count is
either released as is (the paper's choice: ``n`` treated as public) or replaced by the rounded sum
of the noisy count column (``release_count=False``), which is post-processing of the noisy table.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from inference.conjugate.statistics import SufficientStatistics
from inference.errors import InvalidInputError

Composition = Literal["single", "k_round"]


def clip_features(features: Tensor, bound: float) -> Tensor:
    """Clamp every body feature to ``[-bound, bound]`` (a Hardtanh; differentiable inside).

    Args:
        features: ``(B, m)`` body outputs (any float dtype/device).
        bound: ``b > 0``, finite, in feature units.

    Returns:
        The clipped features, same shape, dtype and device.
    """
    _check_bound(bound)
    return torch.clamp(features, min=-bound, max=bound)


def _check_bound(bound: float) -> None:
    if not bound > 0 or not math.isfinite(bound):
        raise InvalidInputError(f"bound must be a finite number > 0, got {bound!r}")


def l2_sensitivity(feature_dim: int, bound: float) -> float:
    """``sqrt(1 + m b^2)``: the most one record can move the table in L2 norm.

    Args:
        feature_dim: ``m >= 0`` body features (the table has ``m + 1`` columns).
        bound: the clipping bound ``b > 0`` (finite).
    """
    if isinstance(feature_dim, bool) or int(feature_dim) != feature_dim or feature_dim < 0:
        raise InvalidInputError(f"feature_dim must be an integer >= 0, got {feature_dim!r}")
    _check_bound(bound)
    return math.sqrt(1.0 + feature_dim * bound * bound)


def gaussian_sigma(
    epsilon: float,
    delta: float,
    rounds: int,
    feature_dim: int,
    bound: float,
    composition: Composition = "k_round",
) -> float:
    """Noise standard deviation for ``(epsilon, delta)``-DP statistics (module docstring).

    Args:
        epsilon: privacy budget, finite and > 0.
        delta: in (0, 1).
        rounds: releases ``k >= 1`` (unused by ``"single"``).
        feature_dim: ``m`` body features (the table has ``m + 1`` columns).
        bound: the clipping bound ``b``, in feature units.
        composition: ``"k_round"`` (v2, whole-run guarantee) or ``"single"`` (v1, per release).

    Returns:
        ``sigma`` in the units of the table's entries (features, and counts in column 0).

    Example (spec §4.2 table): ``gaussian_sigma(1, 0.01, 1, 100, 2, "single") ≈ 62.2``.
    """
    if not 0 < epsilon < math.inf or not 0 < delta < 1:
        raise InvalidInputError(f"need epsilon > 0 and 0 < delta < 1, got {epsilon}, {delta}")
    if isinstance(rounds, bool) or int(rounds) != rounds or rounds < 1:
        raise InvalidInputError(f"rounds must be an integer >= 1, got {rounds!r}")
    squared_sensitivity = l2_sensitivity(feature_dim, bound) ** 2
    if composition == "single":
        return math.sqrt(2.0 * squared_sensitivity * math.log(1.25 / delta)) / epsilon
    if composition == "k_round":
        return math.sqrt(8.0 * rounds * squared_sensitivity * math.log(math.e + epsilon / delta)
                         ) / epsilon
    raise InvalidInputError(f"composition must be 'single' or 'k_round', got {composition!r}")


def privatize(
    statistics: SufficientStatistics,
    sigma: float,
    generator: torch.Generator | None = None,
    release_count: bool = True,
) -> SufficientStatistics:
    """Gaussian mechanism: ``table + N(0, sigma^2)`` in every cell, flagged ``privatized``.

    The features must have been clipped (:func:`clip_features`) before the statistics were
    built, or ``sigma`` protects nothing. Noise is drawn in float64 on the statistics' device
    (``generator`` must live there).

    Args:
        statistics: one client's statistics (local DP) or the server's sum (central DP).
        sigma: noise standard deviation >= 0 (see :func:`gaussian_sigma`).
        generator: source of the noise.
        release_count: keep ``n`` as is (treated as public, as in the paper); if False, ``n``
            becomes ``max(1, round(sum of the noisy count column))``.

    Returns:
        New statistics (float64 ``(C, m + 1)`` table on the same device) with
        ``privatized=True``.
    """
    if not isinstance(statistics, SufficientStatistics):
        raise InvalidInputError("statistics must be a SufficientStatistics")
    if not sigma >= 0 or not math.isfinite(sigma):
        raise InvalidInputError(f"sigma must be a finite number >= 0, got {sigma!r}")
    noise = torch.randn(
        statistics.table.shape, generator=generator, dtype=torch.float64,
        device=statistics.device,
    )
    table = statistics.table + statistics.low + sigma * noise
    n = statistics.n if release_count else max(1, round(float(table[:, 0].sum())))
    return SufficientStatistics(table=table, n=n, privatized=True)
