"""Plots of federated runs: accuracy against rounds and against communicated bytes, and the
reliability diagram of the final predictions (drawn by [`calibration`][calibration])."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt
import seaborn as sns
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator
from torch import Tensor


def plot_accuracy(
    runs: Mapping[str, Sequence[Mapping[str, Any]]], path: str | Path
) -> Path:
    """Mean client test accuracy vs round (left) and vs cumulative bytes up + down (right,
    log scale), one line per run, saved to ``path``. ``runs`` maps a label to its metrics
    records (`accuracy_figure`)."""
    fig = accuracy_figure(runs)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def accuracy_figure(runs: Mapping[str, Sequence[Mapping[str, Any]]]) -> Figure:
    """The figure of `plot_accuracy` (a pyplot figure: close it when done). Rounds are
    whole numbers, so the round axis has integer ticks only."""
    sns.set_theme(style="whitegrid")
    fig, (by_round, by_bytes) = plt.subplots(1, 2, figsize=(11, 4))
    for label, metrics in runs.items():
        rounds = [m["round"] for m in metrics]
        accuracy = [m["accuracy"] for m in metrics]
        total, cumulative = 0, []
        for m in metrics:
            total += m["bytes_up"] + m["bytes_down"]
            cumulative.append(max(total, 1))
        by_round.plot(rounds, accuracy, marker=".", label=label)
        by_bytes.plot(cumulative, accuracy, marker=".", label=label)
    by_round.set(xlabel="round", ylabel="mean client test accuracy", title="accuracy vs round")
    by_round.xaxis.set_major_locator(MaxNLocator(integer=True))  # no round 0.5
    by_bytes.set(xlabel="cumulative bytes (up + down)", ylabel="mean client test accuracy",
                 title="accuracy vs communication", xscale="log")
    by_round.legend()
    fig.tight_layout()
    return fig


def plot_reliability(
    probs: Tensor, labels: Tensor, path: str | Path, *, n_bins: int = 15, title: str = ""
) -> Path:
    """Reliability diagram (drawn by `calibration.diagram.reliability_diagram`) of
    probabilities (N, C) against labels (N,), saved to ``path``."""
    from calibration.diagram import reliability_diagram

    fig = reliability_diagram(probs, labels, n_bins=n_bins, title=title or None)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)
