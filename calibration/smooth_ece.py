"""Smooth ECE (Błasiok & Nakkiran, 2023): kernel-smoothed calibration error, no bins.

For predictions ``f_i`` in [0, 1] with binary outcomes ``y_i`` (top-label use: the confidence
and whether the prediction was correct) and residuals ``r_i = f_i - y_i``, the smooth ECE at
bandwidth sigma is

    smECE_sigma = integral_0^1 |sum_i K(t, f_i) r_i| dt / integral_0^1 sum_i K(t, f_i) dt,

the mean absolute value of the Nadaraya-Watson-smoothed residual, weighted by the kernel
density of the predictions. ``K`` is a Gaussian of standard deviation sigma reflected at 0 and 1
(so mass near the ends is not lost). The **automatic bandwidth** is the fixed point
``sigma* = smECE_sigma*`` (smECE_sigma falls as sigma grows), found by bisection; the reported
value is smECE at sigma*. Unlike binned ECE it is continuous in the predictions and has no
bin-count knob.

**This module computes exactly the discretised estimator of the authors' reference
implementation**, ``relplot.smECE`` (version 1.0.3), so the two agree to float rounding (the
tests compare them to 1e-6; relplot is the dev-extra oracle, not a dependency):

* the weights ``w_i`` (residuals, or ones) are spread onto a grid of ``M`` equally spaced
  points of [0, 1] by linear interpolation, ``M = max(2000, round(20 / sigma)) // 2 + 1``;
* the grid is reflected once about each end (without repeating the end point) and convolved
  with the Gaussian density sampled at ``linspace(0, 1, M) - 0.5`` (so offsets beyond 1/2 are
  truncated, and for even ``M`` the samples sit half a grid step off-centre, as relplot's);
* the smoothed grid is linearly interpolated onto ``E = max(200, round(10 / sigma))`` points
  ``linspace(0, 1, E)``, where smECE = ``sum |A_r| / sum (A_1 + 1e-4)`` (relplot adds 1e-4 to
  the density);
* the bandwidth: sigma = 1 if ``1 < smECE_1`` (never, as smECE <= 1), else 10 halvings of
  [0, 1] keeping the upper end where ``sigma >= smECE_sigma`` (a sigma below 0.001 counts as
  too small), so sigma* is a multiple of 2^-10 = 0.000977.

Smooth reliability diagrams (`smooth_reliability_curve`, drawn by
`calibration.diagram.reliability_diagram` with ``smooth=True``) show the kernel-smoothed
outcome ``E[y | f = t]`` and the density of the predictions at the same bandwidth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from calibration.errors import InvalidInputError
from calibration.inputs import as_tensor
from calibration.row_scores import row_scores

MIN_BANDWIDTH = 1e-3
"""Bandwidths below this count as "too small" in the search (relplot's ``eps``)."""
BANDWIDTH_HALVINGS = 10
"""Bisection steps of the bandwidth search on [0, 1] (relplot's ``refine``)."""
DENSITY_FLOOR = 1e-4
"""Added to the smoothed density before dividing (relplot's ``eps`` of ``smooth``)."""
MIN_MESH_POINTS = 200
"""Least number of evaluation points of the smoothed functions (relplot's smECE_mesh_pts)."""


@dataclass(frozen=True)
class SmoothECE:
    """A smooth ECE and the bandwidth it was computed at.

    Attributes:
        value: the smooth ECE, in [0, 1].
        bandwidth: the kernel's standard deviation sigma (the automatic sigma* unless one
            was given).
        count: number of predictions.
    """

    value: float
    bandwidth: float
    count: int


# ---- inputs ------------------------------------------------------------------------------
def top_label(probs: Any, labels: Any, from_logits: bool = False) -> tuple[Tensor, Tensor]:
    """Top-label confidences (N,) float64 and correctness (N,) float64 in {0, 1}.

    ``probs`` (N, K) probabilities (or logits with ``from_logits=True``), validated as every
    metric validates them; the prediction is the first class attaining the maximum.
    """
    scores = row_scores(probs, labels, from_logits=from_logits, confidence=True)
    return scores.confidence.to(torch.float64), scores.correct.to(torch.float64)


def binary_predictions(predictions: Any, outcomes: Any) -> tuple[Tensor, Tensor]:
    """Validated predictions (N,) in [0, 1] and outcomes (N,) in {0, 1}, both float64."""
    f = as_tensor(predictions, "predictions")
    y = as_tensor(outcomes, "outcomes")
    for name, t in (("predictions", f), ("outcomes", y)):
        if t.ndim != 1:
            raise InvalidInputError(f"{name} must be a 1-D array (N,); got shape "
                                    f"{tuple(t.shape)}")
        if t.is_complex():
            raise InvalidInputError(f"{name} must be real-valued; got dtype {t.dtype}")
    if f.shape[0] == 0:
        raise InvalidInputError("predictions are empty: no samples to score")
    if f.shape != y.shape:
        raise InvalidInputError(f"shape mismatch: {f.shape[0]} predictions but {y.shape[0]} "
                                "outcomes")
    f, y = f.to(torch.float64), y.to(torch.float64)
    if not bool(torch.isfinite(f).all()) or not bool(((f >= 0) & (f <= 1)).all()):
        raise InvalidInputError("predictions must be finite probabilities in [0, 1]")
    if not bool(((y == 0) | (y == 1)).all()):
        raise InvalidInputError("outcomes must be 0 or 1 (for multi-class predictions use "
                                "smooth_ece(probs, labels), which scores the top label)")
    return f, y


# ---- the estimator -----------------------------------------------------------------------
def _grid_size(bandwidth: float) -> int:
    return max(2000, round(20 / bandwidth)) // 2 + 1


def _mesh_size(bandwidth: float) -> int:
    return max(round(10 / bandwidth), MIN_MESH_POINTS)


def _spread_on_grid(f: Tensor, weights: Tensor, m: int) -> Tensor:
    """Weights spread onto ``m`` grid points ``j / (m - 1)`` by linear interpolation (m,)."""
    position = f * (m - 1)
    left = position.long().clamp(0, m - 2)  # f >= 0, so long() is floor
    right_share = position - left.to(f.dtype)
    grid = torch.zeros(m, dtype=torch.float64, device=f.device)
    grid.index_add_(0, left, (1 - right_share) * weights)
    grid.index_add_(0, left + 1, right_share * weights)
    return grid


def _reflected_gaussian_smooth(grid: Tensor, bandwidth: float) -> Tensor:
    """``grid`` (m,) reflected about both ends and convolved with the sampled Gaussian.

    Offsets are those of relplot's ``np.convolve(..., "valid")`` of the reflected grid with
    ``pdf(linspace(0, 1, m) - 0.5)``, sliced at ``m // 2`` (module docstring); done by FFT.
    """
    m = grid.shape[0]
    t = torch.linspace(0, 1, m, dtype=torch.float64, device=grid.device)
    kernel = torch.exp(-(t - 0.5).square() / (2 * bandwidth**2)) / (
        math.sqrt(2 * math.pi) * bandwidth)
    # reflect without repeating the end points: grid[m-1..1], grid, grid[m-2..0]
    extended = torch.cat([grid.flip(0)[:-1], grid, grid.flip(0)[1:]])
    # zero-padded to a power of two >= the full linear convolution: no wrap-around, fast FFT
    size = 1 << (extended.shape[0] + m - 2).bit_length()
    full = torch.fft.irfft(torch.fft.rfft(extended, size) * torch.fft.rfft(kernel, size), size)
    # "valid" part starts at m - 1; relplot then keeps m points from offset m // 2
    start = (m - 1) + m // 2
    return full[start:start + m]


def _interpolate(values: Tensor, mesh: Tensor) -> Tensor:
    """Piecewise-linear function through ``(j / (m - 1), values[j])`` at ``mesh`` points."""
    m = values.shape[0]
    index = (mesh * (m - 1)).long().clamp(0, m - 2)
    step = 1.0 / (m - 1)
    share = (mesh - index.to(mesh.dtype) * step) / step  # (a long times a float is float32)
    return values[index] * (1 - share) + values[index + 1] * share


def _smoothed(f: Tensor, weights: Tensor, bandwidth: float, mesh: Tensor) -> Tensor:
    """Kernel sum ``sum_i K(t, f_i) w_i`` at the ``mesh`` points."""
    m = _grid_size(bandwidth)
    return _interpolate(_reflected_gaussian_smooth(_spread_on_grid(f, weights, m), bandwidth),
                        mesh)


def smooth_ece_at(f: Tensor, y: Tensor, bandwidth: float) -> float:
    """smECE_sigma of validated float64 predictions ``f`` (N,) and outcomes ``y`` (N,)."""
    mesh = torch.linspace(0, 1, _mesh_size(bandwidth), dtype=torch.float64, device=f.device)
    residual_sum = _smoothed(f, f - y, bandwidth, mesh)
    density = _smoothed(f, torch.ones_like(f), bandwidth, mesh) + DENSITY_FLOOR
    # relplot: sum(|A_r / dens| * dens) / sum(dens), i.e. this up to rounding
    return float(residual_sum.abs().sum() / density.sum())


def automatic_bandwidth(f: Tensor, y: Tensor) -> float:
    """sigma* with ``sigma* = smECE_sigma*`` (module docstring: relplot's bisection)."""

    def too_small(sigma: float) -> bool:
        return sigma < MIN_BANDWIDTH or sigma < smooth_ece_at(f, y, sigma)

    if too_small(1.0):  # pragma: no cover - smECE <= max |r| <= 1; kept for fidelity
        return 1.0
    small, large = 0.0, 1.0
    for _ in range(BANDWIDTH_HALVINGS):
        middle = (small + large) / 2
        if too_small(middle):
            small = middle
        else:
            large = middle
    return large


def check_bandwidth(bandwidth: float) -> float:
    if isinstance(bandwidth, bool) or not isinstance(bandwidth, int | float) \
            or not (0.0 < float(bandwidth) < math.inf):
        raise InvalidInputError(f"bandwidth must be a finite number > 0, got {bandwidth!r}")
    if bandwidth < 1e-5:
        raise InvalidInputError(f"bandwidth {bandwidth} is too small: the grid would need "
                                f"{_grid_size(bandwidth):,} points; use >= 1e-5")
    return float(bandwidth)


def smooth_calibration_error(
    predictions: Any, outcomes: Any, *, bandwidth: float | None = None
) -> SmoothECE:
    """Smooth ECE of binary predictions: ``predictions`` (N,) in [0, 1] of outcomes (N,) in
    {0, 1} (relplot's ``smECE(f, y)``), at ``bandwidth`` or the automatic one."""
    f, y = binary_predictions(predictions, outcomes)
    sigma = automatic_bandwidth(f, y) if bandwidth is None else check_bandwidth(bandwidth)
    return SmoothECE(smooth_ece_at(f, y, sigma), sigma, int(f.shape[0]))


def smooth_ece(
    probs: Any,
    labels: Any,
    from_logits: bool = False,
    *,
    bandwidth: float | None = None,
) -> float:
    """Smooth ECE of the top-label confidence of ``probs`` (N, K) against ``labels`` (N,).

    In [0, 1]; the automatic bandwidth unless ``bandwidth`` is given. The same as
    ``relplot.smECE(*relplot.multiclass_logits_to_confidences(probs, labels, probs=True))``.
    See [`smooth_ece_details`][calibration.smooth_ece.smooth_ece_details] for the bandwidth.
    """
    return smooth_ece_details(probs, labels, from_logits, bandwidth=bandwidth).value


def smooth_ece_details(
    probs: Any,
    labels: Any,
    from_logits: bool = False,
    *,
    bandwidth: float | None = None,
) -> SmoothECE:
    """`smooth_ece` with the bandwidth it used and the sample count."""
    confidence, correct = top_label(probs, labels, from_logits)
    return smooth_calibration_error(confidence, correct, bandwidth=bandwidth)


@dataclass(frozen=True)
class SmoothReliabilityCurve:
    """A smooth reliability diagram's data, on ``mesh`` (M,) points of [0, 1].

    Attributes:
        mesh: evaluation points t.
        mean_outcome: kernel-smoothed ``E[y | f = t]`` (accuracy at confidence t), (M,).
        density: kernel density of the predictions at t (integrates to about 1), (M,).
        smooth_ece: the smooth ECE at the same bandwidth.
    """

    mesh: Tensor
    mean_outcome: Tensor
    density: Tensor
    smooth_ece: SmoothECE


def smooth_reliability_curve(
    predictions: Any,
    outcomes: Any,
    *,
    bandwidth: float | None = None,
    mesh_points: int = 200,
) -> SmoothReliabilityCurve:
    """The kernel-smoothed reliability curve of binary predictions (N,) and outcomes (N,).

    ``mean_outcome`` is relplot's ``KernelSmoother(ReflectedGaussianKernel(sigma))`` at the
    mesh: ``sum_i K(t, f_i) y_i / (sum_i K(t, f_i) + 1e-4)``; sigma is the automatic
    bandwidth unless given. (relplot's own diagram averages 200 bootstrap refits of that
    smoother; this is the smoother fitted once to all the data.)
    """
    f, y = binary_predictions(predictions, outcomes)
    if isinstance(mesh_points, bool) or not isinstance(mesh_points, int) or mesh_points < 2:
        raise InvalidInputError(f"mesh_points must be an integer >= 2, got {mesh_points!r}")
    sigma = automatic_bandwidth(f, y) if bandwidth is None else check_bandwidth(bandwidth)
    mesh = torch.linspace(0, 1, mesh_points, dtype=torch.float64, device=f.device)
    kernel_sum = _smoothed(f, torch.ones_like(f), sigma, mesh)
    mean_outcome = _smoothed(f, y, sigma, mesh) / (kernel_sum + DENSITY_FLOOR)
    # the sampled kernel is a density in t (grid spacing not included): divide by N
    density = kernel_sum / f.shape[0]
    value = SmoothECE(smooth_ece_at(f, y, sigma), sigma, int(f.shape[0]))
    return SmoothReliabilityCurve(mesh, mean_outcome, density, value)


__all__ = [
    "SmoothECE",
    "SmoothReliabilityCurve",
    "smooth_calibration_error",
    "smooth_ece",
    "smooth_ece_details",
    "smooth_reliability_curve",
    "top_label",
]
