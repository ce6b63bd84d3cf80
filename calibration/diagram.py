"""Reliability diagrams drawn with seaborn on matplotlib's Agg backend.

The upper panel shows, for every non-empty confidence bin, the accuracy as a bar spanning the
bin, the identity line (perfect calibration), and the gap between accuracy and mean confidence
shaded in one colour where the bin is over-confident (mean confidence above accuracy: the gap
sits on top of the bar) and in another where it is under-confident (accuracy above mean
confidence: the gap is the top of the bar itself); empty bins get no bar. A strip beneath shows
how many samples fall in each bin. The legend (one entry per colour) and the ECE, MCE and
sample count stand to the right of the panel, outside it, so they never cover a bar. Figures
are created without pyplot (a bare ``matplotlib.figure.Figure`` renders with the Agg canvas),
so the global backend is left alone, nothing is registered in pyplot and nothing needs
closing; an ``ax`` passed in is drawn into.

With ``smooth=True`` the diagram has no bins: the kernel-smoothed accuracy against confidence
(drawn thicker where confidences are dense, and only where their density is at least 1% of its
peak) with the smooth ECE annotated, and the kernel density of the confidences beneath
(`calibration.smooth_ece`, Błasiok & Nakkiran 2023).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import seaborn as sns
from matplotlib.axes import Axes
from matplotlib.collections import LineCollection
from matplotlib.figure import Figure
from mpl_toolkits.axes_grid1 import make_axes_locatable

from calibration.bin_stats import BinStats
from calibration.binning import Binning
from calibration.errors import InvalidInputError
from calibration.inputs import path_argument
from calibration.metrics import reliability_stats

SAVE_FORMATS = (".png", ".svg", ".pdf")
ACCURACY_BARS_LABEL = "Accuracy"
GAP_LABEL = "Gap to confidence"
OVER_LABEL = "Gap: over-confident\n(confidence > accuracy)"
UNDER_LABEL = "Gap: under-confident\n(accuracy > confidence)"
OVER_COLOR = 3  # indices into seaborn's "deep" palette: red
UNDER_COLOR = 1  # orange, readable over the blue accuracy bars
GAP_ALPHA = {OVER_COLOR: 0.45, UNDER_COLOR: 0.8}  # the under-confident gap lies over a blue bar


def reliability_diagram(
    stats_or_probs: BinStats | Any,
    labels: Any = None,
    *,
    n_bins: int = 15,
    binning: Binning | str = "uniform",
    from_logits: bool = False,
    ax: Axes | None = None,
    title: str | None = None,
    smooth: bool = False,
    bandwidth: float | None = None,
) -> Figure:
    """Draw a reliability diagram and return its Figure.

    ``stats_or_probs`` is a `BinStats` (then ``labels`` must be None) or probabilities
    (N, K) with ``labels`` (N,), binned with ``n_bins``/``binning``/``from_logits``.
    ``smooth=True`` draws the smooth reliability diagram instead (probabilities only): the
    kernel-smoothed accuracy against confidence and the density of the confidences, at the
    smooth ECE's automatic bandwidth or ``bandwidth`` (`calibration.smooth_ece`).
    """
    if ax is not None and not isinstance(ax, Axes):
        raise InvalidInputError(f"ax must be a matplotlib Axes (or None); got {type(ax).__name__}")
    if smooth:
        return _smooth_reliability_diagram(stats_or_probs, labels, from_logits, bandwidth, ax,
                                           title)
    if isinstance(stats_or_probs, BinStats):
        if labels is not None:
            raise InvalidInputError("pass labels only with probabilities, not with BinStats")
        stats = stats_or_probs
    else:
        if labels is None:
            raise InvalidInputError("labels are required when passing probabilities")
        stats = reliability_stats(stats_or_probs, labels, n_bins, binning, from_logits)
    if stats.total == 0:
        raise InvalidInputError("cannot draw a reliability diagram without samples")

    with sns.axes_style("whitegrid"), sns.plotting_context("notebook", font_scale=0.9):
        figure, ax, strip = _diagram_axes(ax)
        _draw_reliability(ax, stats, title)
        _draw_count_strip(strip, stats)
    return figure


def _diagram_axes(ax: Axes | None) -> tuple[Any, Axes, Axes]:
    """The figure, the main axes and the strip below it: a new two-panel figure, or ``ax``
    with a strip appended underneath."""
    if ax is None:  # wide enough for the legend and the figures right of the panel
        figure = Figure(figsize=(7.6, 6.2), layout="constrained")
        ax, strip = figure.subplots(2, 1, sharex=True, height_ratios=(3.2, 1))
        return figure, ax, strip
    strip = make_axes_locatable(ax).append_axes("bottom", size="28%", pad=0.1, sharex=ax)
    return ax.get_figure(), ax, strip


def _draw_reliability(ax: Axes, stats: BinStats, title: str | None) -> None:
    palette = sns.color_palette("deep")
    mask = stats.nonempty
    left = stats.edges[:-1][mask]
    width = np.diff(stats.edges)[mask]
    accuracy = stats.accuracy[mask]
    confidence = stats.mean_confidence[mask]

    ax.plot([0, 1], [0, 1], linestyle="--", color="0.35", linewidth=1.2,
            label="Perfect calibration")
    ax.bar(left, accuracy, width=width, align="edge", color=palette[0], edgecolor="white",
           linewidth=0.8, alpha=0.9, label=ACCURACY_BARS_LABEL)
    # Gap shading between the bar top and the bin's mean confidence, coloured by its sign:
    # over-confident gaps stand on the bar, under-confident ones cover the bar's top part.
    over = confidence > accuracy
    for where, color, hatch, label in ((over, OVER_COLOR, "//", OVER_LABEL),
                                       (~over, UNDER_COLOR, "\\\\", UNDER_LABEL)):
        low = np.minimum(accuracy, confidence)[where]
        ax.bar(left[where], np.abs(confidence - accuracy)[where], bottom=low,
               width=width[where], align="edge", color=palette[color], alpha=GAP_ALPHA[color],
               edgecolor=palette[color], linewidth=0.8, hatch=hatch, label=label)
    ax.scatter(left + width / 2, confidence, marker="_", s=120, color="0.15", zorder=3,
               label="Mean confidence")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_aspect("auto")
    ax.set_ylabel("Accuracy")
    ax.tick_params(labelbottom=False)
    _outside_legend(ax, palette)
    ax.text(1.03, 0.0, f"ECE = {100 * stats.ece:.2f}%\nMCE = {100 * stats.mce:.2f}%\n"
            f"N = {stats.total:,}", transform=ax.transAxes, ha="left", va="bottom",
            fontsize="small", bbox=dict(boxstyle="round", facecolor="white", alpha=0.85))
    ax.set_title(title if title is not None else f"Reliability diagram ({stats.n_bins} bins)")


def _outside_legend(ax: Axes, palette: Any) -> None:
    """The legend right of ``ax``, outside it, with an entry for both gap colours (also when
    no bin has that sign, so the colours always read the same)."""
    from matplotlib.patches import Patch

    handles, labels = ax.get_legend_handles_labels()
    for label, color, hatch in ((OVER_LABEL, OVER_COLOR, "//"), (UNDER_LABEL, UNDER_COLOR,
                                                                 "\\\\")):
        if label not in labels:
            handles.append(Patch(facecolor=palette[color], edgecolor=palette[color],
                                 alpha=GAP_ALPHA[color], hatch=hatch))
            labels.append(label)
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.03, 1.0), borderaxespad=0,
              frameon=True, fontsize="small")


def _draw_count_strip(ax: Axes, stats: BinStats) -> None:
    centers = (stats.edges[:-1] + stats.edges[1:]) / 2
    table = {"confidence": centers, "count": stats.counts}
    sns.histplot(data=table, x="confidence", weights="count", bins=stats.edges.tolist(), ax=ax,
                 color=sns.color_palette("deep")[7], edgecolor="white", linewidth=0.5)
    ax.set_xlim(0, 1)
    ax.set_xlabel("Confidence")
    nonzero = stats.counts[stats.counts > 0]
    if nonzero.max() > 100 * nonzero.min():  # keep sparse bins visible beside a dominant one
        ax.set_yscale("log")
        ax.set_ylabel("Count (log)")
    else:
        ax.set_ylabel("Count")


SMOOTH_CURVE_LABEL = "Smoothed accuracy"
SUPPORT_FRACTION = 0.01
"""The smooth curve is drawn where the confidences' density is at least this share of its
peak; elsewhere the kernel smoother has (almost) no samples and only extrapolates."""


def _smooth_reliability_diagram(
    probs: Any, labels: Any, from_logits: bool, bandwidth: float | None, ax: Axes | None,
    title: str | None,
) -> Figure:
    from calibration.smooth_ece import smooth_reliability_curve, top_label

    if isinstance(probs, BinStats):
        raise InvalidInputError("a smooth reliability diagram needs the probabilities and "
                                "labels, not BinStats (binning discards what it smooths)")
    if labels is None:
        raise InvalidInputError("labels are required when passing probabilities")
    confidence, correct = top_label(probs, labels, from_logits)
    curve = smooth_reliability_curve(confidence.cpu(), correct.cpu(), bandwidth=bandwidth)
    with sns.axes_style("whitegrid"), sns.plotting_context("notebook", font_scale=0.9):
        figure, ax, strip = _diagram_axes(ax)
        _draw_smooth_curve(ax, curve, title)
        _draw_density_strip(strip, curve)
    return figure


def _draw_smooth_curve(ax: Axes, curve: Any, title: str | None) -> None:
    palette = sns.color_palette("deep")
    t = curve.mesh.numpy()
    accuracy = curve.mean_outcome.numpy()
    density = curve.density.numpy()
    ax.plot([0, 1], [0, 1], linestyle="--", color="0.35", linewidth=1.2,
            label="Perfect calibration")
    # where almost no confidences lie the smoother only extrapolates: nothing is drawn there
    supported = density >= SUPPORT_FRACTION * float(density.max())
    over = accuracy < t
    ax.fill_between(t, accuracy, t, where=supported & over, color=palette[OVER_COLOR],
                    alpha=0.3, linewidth=0, label=OVER_LABEL, interpolate=True)
    ax.fill_between(t, accuracy, t, where=supported & ~over, color=palette[UNDER_COLOR],
                    alpha=0.3, linewidth=0, label=UNDER_LABEL, interpolate=True)
    # thick where confidences are dense
    points = np.stack([t, accuracy], axis=1)
    keep = supported[:-1] & supported[1:]
    segments = np.stack([points[:-1], points[1:]], axis=1)[keep]
    weight = ((density[:-1] + density[1:]) / 2)[keep]
    widths = 0.5 + 3.5 * weight / max(float(weight.max(initial=0.0)), 1e-300)
    ax.add_collection(LineCollection(segments, linewidths=widths, color=palette[0],
                                     capstyle="round", label=SMOOTH_CURVE_LABEL))
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_ylabel("Accuracy")
    ax.tick_params(labelbottom=False)
    _outside_legend(ax, palette)
    value = curve.smooth_ece
    ax.text(1.03, 0.0, f"smECE = {100 * value.value:.2f}%\n"
            f"bandwidth = {value.bandwidth:.3g}\nN = {value.count:,}", transform=ax.transAxes,
            ha="left", va="bottom", fontsize="small",
            bbox=dict(boxstyle="round", facecolor="white", alpha=0.85))
    ax.set_title(title if title is not None else "Smooth reliability diagram")


def _draw_density_strip(ax: Axes, curve: Any) -> None:
    t = curve.mesh.numpy()
    density = curve.density.numpy()
    color = sns.color_palette("deep")[7]
    ax.fill_between(t, 0, density, color=color, alpha=0.5, linewidth=0)
    ax.plot(t, density, color=color, linewidth=1)
    ax.set_xlim(0, 1)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("Confidence")
    ax.set_ylabel("Density")


def save_figure(figure: Figure, path: str | Path) -> Path:
    """Save ``figure`` to ``path``; the format comes from the extension (.png, .svg or .pdf)."""
    if not isinstance(figure, Figure):
        raise InvalidInputError(
            f"figure must be a matplotlib Figure (e.g. from reliability_diagram); got "
            f"{type(figure).__name__}"
        )
    path = path_argument(path, "path")
    if path.suffix.lower() not in SAVE_FORMATS:
        raise InvalidInputError(
            f"cannot save a figure as {path.suffix or 'a file without extension'!r}; "
            f"use one of {', '.join(SAVE_FORMATS)}"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=150)
    return path
