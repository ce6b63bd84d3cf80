"""Reliability diagrams: one bar per non-empty bin, labelled axes, saved by extension."""

import matplotlib.pyplot as plt
import numpy as np
import pytest
from calibration_reference import calibrated_labels, random_probs
from matplotlib.container import BarContainer

from calibration.diagram import ACCURACY_BARS_LABEL, reliability_diagram, save_figure
from calibration.errors import InvalidInputError
from calibration.metrics import reliability_stats


def data():
    rng = np.random.default_rng(0)
    probs = random_probs(rng, 800, 4, scale=1.5)
    return probs, calibrated_labels(rng, probs ** 0.7)


def accuracy_bars(figure):
    top = figure.axes[0]
    containers = [c for c in top.containers
                  if isinstance(c, BarContainer) and c.get_label() == ACCURACY_BARS_LABEL]
    assert len(containers) == 1
    return containers[0]


def test_one_accuracy_bar_per_non_empty_bin_and_labelled_axes():
    probs, labels = data()
    stats = reliability_stats(probs, labels, n_bins=15)
    assert 0 < stats.nonempty.sum() < 15  # the data leave some bins empty
    figure = reliability_diagram(stats)
    bars = accuracy_bars(figure)
    assert len(bars) == int(stats.nonempty.sum())
    heights = sorted(bar.get_height() for bar in bars)
    np.testing.assert_allclose(heights, np.sort(stats.accuracy[stats.nonempty]), atol=1e-12)
    top, strip = figure.axes[:2]
    assert top.get_ylabel() == "Accuracy"
    assert strip.get_xlabel() == "Confidence" and strip.get_ylabel().startswith("Count")
    assert any("ECE" in text.get_text() for text in top.texts)
    assert plt.get_fignums() == []  # nothing registered in pyplot, nothing left open


def test_drawing_from_probabilities_equals_drawing_from_stats():
    probs, labels = data()
    figure = reliability_diagram(probs, labels, n_bins=10)
    assert len(accuracy_bars(figure)) == int(reliability_stats(probs, labels, 10).nonempty.sum())


def test_drawing_into_a_given_axes():
    probs, labels = data()
    figure, ax = plt.subplots()
    try:
        assert reliability_diagram(probs, labels, ax=ax, title="mine") is figure
        assert ax.get_title() == "mine"
    finally:
        plt.close(figure)
    assert plt.get_fignums() == []


@pytest.mark.parametrize(("suffix", "magic"), [(".png", b"\x89PNG"), (".svg", b"<?xml"),
                                               (".pdf", b"%PDF")])
def test_saving_picks_the_format_from_the_extension(tmp_path, suffix, magic):
    figure = reliability_diagram(*data())
    path = save_figure(figure, tmp_path / f"diagram{suffix}")
    assert path.read_bytes().startswith(magic)


def test_unsupported_extension_is_refused(tmp_path):
    with pytest.raises(InvalidInputError, match="png"):
        save_figure(reliability_diagram(*data()), tmp_path / "diagram.jpg")


def test_labels_are_required_with_probabilities():
    with pytest.raises(InvalidInputError, match="labels"):
        reliability_diagram(data()[0])


@pytest.mark.parametrize("smooth", [False, True])
def test_something_that_is_no_axes_is_refused(smooth):
    with pytest.raises(InvalidInputError, match="ax must be a matplotlib Axes"):
        reliability_diagram(*data(), ax="left", smooth=smooth)


@pytest.mark.parametrize(("n_bins", "message"), [(10**8, "exceeds the limit of 1,000,000"),
                                                 (15.0, "positive integer")])
def test_bin_counts_are_checked_before_drawing(n_bins, message):
    with pytest.raises(InvalidInputError, match=message):
        reliability_diagram(*data(), n_bins=n_bins)


def test_a_numpy_bin_count_draws_the_same_bins():
    probs, labels = data()
    figure = reliability_diagram(probs, labels, n_bins=np.int64(10))
    assert "10 bins" in figure.axes[0].get_title()


def test_save_figure_refuses_what_is_no_figure_or_path(tmp_path):
    with pytest.raises(InvalidInputError, match="figure must be a matplotlib Figure"):
        save_figure("diagram", tmp_path / "d.png")
    with pytest.raises(InvalidInputError, match="path must be a file path"):
        save_figure(reliability_diagram(*data()), 42)
