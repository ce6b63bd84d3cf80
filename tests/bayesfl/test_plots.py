"""The run plots: accuracy against rounds has whole-number round ticks (issue 26)."""

import matplotlib.pyplot as plt
import pytest

from bayesfl.plots import accuracy_figure, plot_accuracy


def _records(rounds: int) -> list[dict]:
    return [{"round": r, "accuracy": 0.5 + 0.1 * r, "bytes_up": 100, "bytes_down": 100}
            for r in range(rounds)]


@pytest.mark.parametrize("rounds", [2, 3, 7, 31])
def test_the_round_axis_has_integer_ticks_only(rounds):
    figure = accuracy_figure({"fedlog": _records(rounds), "fedavg": _records(rounds)})
    try:
        by_round = figure.axes[0]
        figure.canvas.draw()
        ticks = [t for t in by_round.get_xticks() if by_round.get_xlim()[0] <= t
                 <= by_round.get_xlim()[1]]
        assert len(ticks) >= 2
        assert all(float(t).is_integer() for t in ticks), ticks  # 3 rounds once gave 0.5, 1.5
    finally:
        plt.close(figure)


def test_plot_accuracy_writes_the_png_and_leaves_no_figure_open(tmp_path):
    path = plot_accuracy({"fedlog": _records(3)}, tmp_path / "accuracy.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plt.get_fignums() == []
