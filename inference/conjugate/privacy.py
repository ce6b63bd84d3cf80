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
privatises the server's sum once per round. `privatize` does either. The total count is
either released as is (the paper's choice: ``n`` treated as public) or replaced by the rounded sum
of the noisy count column (``release_count=False``), which is post-processing of the noisy table.

**When the noise swamps the statistics** (`DPNoiseReport`). ``sigma`` does not shrink with
the data, so a small data set can be drowned. The figure is the *noise-to-signal ratio* of a
class row of the summed table: the root-mean-square norm of the noise on the row,
``sigma sqrt(R) sqrt(m + 1)`` (``R`` noisy releases summed: ``K`` clients under local DP, whose
noise variances add, 1 under central DP), over the norm of the row ``[n_y, S_y]``. With the
clip bound the row's norm is at most ``n_y sqrt(1 + m b^2) = n_y Delta_2`` (basis ``"bound"``,
`privacy_signal_to_noise`: public, computable before any training), so

    noise_to_signal = (sigma / Delta_2) sqrt(R (m + 1)) / n_y,

and since ``sigma`` is proportional to ``Delta_2`` the bound cancels: only the budget, the
number of releases, the width and the class counts matter. Real features sit well below the
bound (the class rows of a trained digits body have about a third of the bound's norm), so this
is a lower bound on the noise-to-signal of the actual statistics. Measured on digits (20
clients, 10 and 30 rounds, 3 seeds, ``bench/dp_price.py``): up to 0.38 the model keeps its
accuracy (0.96-0.99, against 0.99 without DP), at 0.51-0.75 it falls to 0.54-0.77, from 0.96 on
it is near chance (0.07-0.28). A `PrivacyNoiseWarning` is raised above `DEGRADED_RATIO`
(0.5), with the figures and what to do; above `SWAMPED_RATIO` (1) the noise is larger
than anything the statistics could hold. `privatize` checks its own release: against the
bound when given one, else against the norms of the table it perturbs (basis ``"table"``: noise
larger than the statistic itself, warned above 1).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from inference.conjugate.statistics import SufficientStatistics
from inference.errors import InvalidInputError

Composition = Literal["single", "k_round"]
Placement = Literal["local", "central"]
Basis = Literal["bound", "table"]

#: Noise-to-signal (basis "bound") above which the statistics are degraded and a warning is
#: raised: measured on digits, accuracy 0.54-0.77 at 0.51-0.75 and 0.96-0.99 up to 0.38
#: (module docstring; the bound-based figure understates the real one).
DEGRADED_RATIO = 0.5
#: Noise-to-signal above which the noise exceeds the largest signal the statistics can hold
#: (basis "bound") or the statistics themselves (basis "table"): chance-level models.
SWAMPED_RATIO = 1.0


class PrivacyNoiseWarning(UserWarning):
    """The DP noise drowns the statistics: the model will be (close to) chance level. The
    message gives the noise-to-signal figures and what to change."""


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

    Example: ``gaussian_sigma(1, 0.01, 1, 100, 2, "single") ≈ 62.2``.
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


@dataclass(frozen=True)
class DPNoiseReport:
    """How the Gaussian noise of DP compares with the statistics it protects (module
    docstring).

    Attributes:
        sigma: noise standard deviation of one release, in table units.
        releases: noisy releases summed into the table a posterior is built from (``K``
            clients under local DP, 1 under central DP).
        feature_dim: ``m`` body features (rows have ``m + 1`` entries).
        signal: per class, the norm of its row ``[n_y, S_y]`` the noise is compared with (the
            largest it can be, ``n_y sqrt(1 + m b^2)``, or its actual norm); classes with
            signal 0 (absent) are left out of the headline figure.
        basis: ``"bound"`` (the signal is the clip bound's maximum) or ``"table"`` (the norms
            of the statistic itself).
        bound: the clip bound ``b`` (basis ``"bound"``), else None.
    """

    sigma: float
    releases: int
    feature_dim: int
    signal: tuple[float, ...]
    basis: Basis
    bound: float | None = None

    @property
    def noise_std(self) -> float:
        """Standard deviation of the noise in one cell of the summed table: ``sigma sqrt(R)``."""
        return self.sigma * math.sqrt(self.releases)

    @property
    def noise_norm(self) -> float:
        """Root-mean-square norm of the noise on one class row: ``noise_std sqrt(m + 1)``."""
        return self.noise_std * math.sqrt(self.feature_dim + 1)

    @property
    def per_class(self) -> tuple[float, ...]:
        """``noise_norm / signal_y`` per class (inf for a class with no signal)."""
        return tuple(self.noise_norm / s if s > 0 else math.inf for s in self.signal)

    @property
    def noise_to_signal(self) -> float:
        """The headline ratio: ``noise_norm`` over the root-mean-square signal of the classes
        present (equal to each class's ratio when the classes are balanced); inf when no class
        has any signal."""
        present = [s for s in self.signal if s > 0]
        if not present:
            return math.inf
        return self.noise_norm / math.sqrt(sum(s * s for s in present) / len(present))

    @property
    def threshold(self) -> float:
        """The ratio above which `warn` warns: `DEGRADED_RATIO` on the bound basis
        (a lower bound on the real ratio), `SWAMPED_RATIO` on the table basis."""
        return DEGRADED_RATIO if self.basis == "bound" else SWAMPED_RATIO

    @property
    def swamped(self) -> bool:
        """The noise exceeds the largest possible (or the actual) signal: ratio > 1."""
        return self.noise_to_signal > SWAMPED_RATIO

    @property
    def warns(self) -> bool:
        """Whether the ratio is above `threshold`."""
        return self.noise_to_signal > self.threshold

    def message(self) -> str:
        """What the figures mean and what to change."""
        present = [s for s in self.signal if s > 0]
        typical = math.sqrt(sum(s * s for s in present) / len(present)) if present else 0.0
        against = (f"at most {typical:.4g} per class row at clip bound {self.bound:g}"
                   if self.basis == "bound" else f"class rows of norm {typical:.4g}")
        if self.swamped:
            head, outlook = ("swamps", "Expect a chance-level model whose probabilities mean "
                             "nothing.")
        else:
            head, outlook = "degrades", "Expect a large loss of accuracy."
        return (
            f"DP noise {head} the statistics: noise-to-signal {self.noise_to_signal:.3g} "
            f"(warned above {self.threshold:g}; 1 is noise as large as the "
            f"{'largest possible' if self.basis == 'bound' else 'actual'} signal). Noise std "
            f"{self.noise_std:.4g} per cell of the summed statistic (sigma {self.sigma:.4g} "
            f"per release x sqrt({self.releases} releases)), root-mean-square norm "
            f"{self.noise_norm:.4g} per class row, against {against}. {outlook} To lower it: "
            "raise epsilon (sigma ~ 1/epsilon), run fewer rounds (sigma ~ sqrt(rounds) under "
            "k-round composition), add the noise once centrally (secure aggregation or a "
            "trusted server: sqrt(K) times less than local DP over K clients), or pool more "
            "samples per class (the signal grows with n_y, the noise does not)."
        )

    def warn(self, stacklevel: int = 2) -> bool:
        """Emit a `PrivacyNoiseWarning` if `warns`; returns whether it did."""
        if self.warns:
            warnings.warn(self.message(), PrivacyNoiseWarning, stacklevel=stacklevel + 1)
        return self.warns


def privacy_signal_to_noise(
    sigma: float,
    class_counts: float | Sequence[float] | Tensor,
    *,
    feature_dim: int,
    bound: float,
    clients: int = 1,
    placement: Placement = "central",
) -> DPNoiseReport:
    """The noise-to-signal report of DP statistics from public figures (basis ``"bound"``).

    Args:
        sigma: the per-release noise standard deviation (`gaussian_sigma`).
        class_counts: samples per class summed over all clients, ``(C,)``, or one typical
            count (e.g. ``n / C``); a count <= 0 is a class without signal.
        feature_dim: ``m`` body features.
        bound: the clip bound ``b`` (> 0, finite).
        clients: ``K``, the clients whose statistics are summed (local DP: K releases).
        placement: ``"local"`` (each client adds noise: variances add over K) or
            ``"central"`` (noise added once to the sum).

    Returns:
        The report; ``report.warn()`` raises the warning if the noise swamps the statistics.

    Example (the README's budget on digits, about 130 samples per class, central):
    ``privacy_signal_to_noise(gaussian_sigma(1, 1e-2, 100, 50, 2), 130, feature_dim=50,
    bound=2).noise_to_signal`` is about 3.3.
    """
    if not sigma >= 0 or not math.isfinite(sigma):
        raise InvalidInputError(f"sigma must be a finite number >= 0, got {sigma!r}")
    sensitivity = l2_sensitivity(feature_dim, bound)
    if isinstance(clients, bool) or int(clients) != clients or clients < 1:
        raise InvalidInputError(f"clients must be an integer >= 1, got {clients!r}")
    if placement not in ("local", "central"):
        raise InvalidInputError(f"placement must be 'local' or 'central', got {placement!r}")
    counts = torch.as_tensor(class_counts, dtype=torch.float64).reshape(-1)
    if counts.numel() == 0 or not bool(torch.isfinite(counts).all()):
        raise InvalidInputError("class_counts must be finite numbers (one per class, or one)")
    signal = tuple(max(0.0, float(n)) * sensitivity for n in counts.tolist())
    releases = int(clients) if placement == "local" else 1
    return DPNoiseReport(float(sigma), releases, int(feature_dim), signal, "bound", float(bound))


def table_noise_report(statistics: SufficientStatistics, sigma: float) -> DPNoiseReport:
    """The noise-to-signal of perturbing ``statistics`` once with ``sigma`` against the norms
    of its own class rows (basis ``"table"``; what a data holder can check before it
    releases)."""
    rows = torch.linalg.vector_norm(statistics.table + statistics.low, dim=1)
    return DPNoiseReport(float(sigma), 1, statistics.feature_dim,
                         tuple(float(r) for r in rows.tolist()), "table")


def privatize(
    statistics: SufficientStatistics,
    sigma: float,
    generator: torch.Generator | None = None,
    release_count: bool = True,
    *,
    bound: float | None = None,
    check_noise: bool = True,
) -> SufficientStatistics:
    """Gaussian mechanism: ``table + N(0, sigma^2)`` in every cell, flagged ``privatized``.

    The features must have been clipped (`clip_features`) before the statistics were
    built, or ``sigma`` protects nothing. Noise is drawn in float64 on the statistics' device
    (``generator`` must live there).

    Before releasing, the noise is compared with the statistics (module docstring): a
    `PrivacyNoiseWarning` says so when it swamps them. With ``bound`` the comparison is
    `privacy_signal_to_noise` of this table's class counts (one release); without it,
    the table's own row norms (`table_noise_report`). One client's share of a local-DP
    sum is always swamped on its own; such callers pass ``check_noise=False`` and check the
    sum (`privacy_signal_to_noise` with ``placement="local"``).

    Args:
        statistics: one client's statistics (local DP) or the server's sum (central DP).
        sigma: noise standard deviation >= 0 (see `gaussian_sigma`).
        generator: source of the noise.
        release_count: keep ``n`` as is (treated as public, as in the paper); if False, ``n``
            becomes ``max(1, round(sum of the noisy count column))``.
        bound: the clip bound ``b`` the features were clipped at, if known.
        check_noise: whether to compare the noise with the statistics and warn.

    Returns:
        New statistics (float64 ``(C, m + 1)`` table on the same device) with
        ``privatized=True``.

    Warns:
        PrivacyNoiseWarning: the noise swamps the statistics (`DPNoiseReport.warns`).
    """
    if not isinstance(statistics, SufficientStatistics):
        raise InvalidInputError("statistics must be a SufficientStatistics")
    if not sigma >= 0 or not math.isfinite(sigma):
        raise InvalidInputError(f"sigma must be a finite number >= 0, got {sigma!r}")
    if check_noise and sigma > 0:
        report = (table_noise_report(statistics, sigma) if bound is None else
                  privacy_signal_to_noise(sigma, statistics.class_counts,
                                          feature_dim=statistics.feature_dim, bound=bound))
        report.warn(stacklevel=2)
    noise = torch.randn(
        statistics.table.shape, generator=generator, dtype=torch.float64,
        device=statistics.device,
    )
    table = statistics.table + statistics.low + sigma * noise
    n = statistics.n if release_count else max(1, round(float(table[:, 0].sum())))
    return SufficientStatistics(table=table, n=n, privatized=True)
