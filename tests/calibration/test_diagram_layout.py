"""Reliability diagrams that hide nothing: the legend and the ECE box stand outside the panel,
and over- and under-confident gaps have their own colours and legend entries (issue 26)."""

import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.container import BarContainer

from calibration.diagram import (
    ACCURACY_BARS_LABEL,
    OVER_LABEL,
    UNDER_LABEL,
    reliability_diagram,
)
from calibration.metrics import reliability_stats


def mixed(n: int = 3000, classes: int = 10, seed: int = 0):
    """Predictions under-confident at low confidence and over-confident at high confidence:
    a random softmax whose argmax is right 70% of the time (else a random class)."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(n, classes)) * 2.0
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    labels = np.where(rng.random(n) < 0.7, probs.argmax(1), rng.integers(0, classes, n))
    return probs, labels


def _bars(ax, label):
    found = [c for c in ax.containers if isinstance(c, BarContainer) and c.get_label() == label]
    assert len(found) == 1, label
    return found[0]


def _extent(figure, artist):
    canvas = FigureCanvasAgg(figure)  # what savefig renders with (a bare Figure has no renderer)
    canvas.draw()
    return artist.get_window_extent(canvas.get_renderer())


@pytest.mark.parametrize("smooth", [False, True])
def test_the_legend_and_the_metrics_box_do_not_overlap_the_panel(smooth):
    probs, labels = mixed()
    figure = reliability_diagram(probs, labels, smooth=smooth)
    top = figure.axes[0]
    panel = _extent(figure, top)
    legend = _extent(figure, top.get_legend())
    (box,) = [t for t in top.texts if "ECE" in t.get_text()]
    metrics = _extent(figure, box)
    for name, extent in (("legend", legend), ("metrics box", metrics)):
        assert not extent.overlaps(panel), f"the {name} covers the panel"
    assert not legend.overlaps(metrics)
    # and both are inside the figure (not cut off)
    whole = figure.bbox
    for extent in (legend, metrics):
        assert whole.x0 <= extent.x0 and extent.x1 <= whole.x1 + 0.5


def test_over_and_under_confident_gaps_are_separate_labelled_bars():
    probs, labels = mixed()
    stats = reliability_stats(probs, labels, n_bins=15)
    figure = reliability_diagram(stats)
    top = figure.axes[0]
    mask = stats.nonempty
    accuracy, confidence = stats.accuracy[mask], stats.mean_confidence[mask]
    over, under = confidence > accuracy, confidence <= accuracy
    assert over.any() and (accuracy > confidence).any()  # the data have both kinds
    over_bars, under_bars = _bars(top, OVER_LABEL), _bars(top, UNDER_LABEL)
    assert len(over_bars) == int(over.sum()) and len(under_bars) == int(under.sum())
    # an over-confident gap stands on its bar; an under-confident one is the bar's top part
    np.testing.assert_allclose([b.get_y() for b in over_bars], accuracy[over], atol=1e-12)
    np.testing.assert_allclose([b.get_y() + b.get_height() for b in over_bars],
                               confidence[over], atol=1e-12)
    np.testing.assert_allclose([b.get_y() for b in under_bars], confidence[under], atol=1e-12)
    np.testing.assert_allclose([b.get_y() + b.get_height() for b in under_bars],
                               accuracy[under], atol=1e-12)
    colours = {tuple(over_bars[0].get_facecolor()[:3]), tuple(under_bars[0].get_facecolor()[:3])}
    assert len(colours) == 2
    assert len(_bars(top, ACCURACY_BARS_LABEL)) == int(mask.sum())


def test_the_legend_names_both_gap_colours_even_when_one_kind_is_absent():
    rng = np.random.default_rng(1)
    probs = np.full((400, 2), 0.5)
    probs[:, 0] = rng.uniform(0.9, 1.0, 400)  # confident in class 0 ...
    probs[:, 1] = 1 - probs[:, 0]
    labels = rng.integers(0, 2, 400)  # ... and right half the time: over-confident only
    figure = reliability_diagram(probs, labels, n_bins=10)
    texts = [t.get_text() for t in figure.axes[0].get_legend().get_texts()]
    assert OVER_LABEL in texts and UNDER_LABEL in texts
