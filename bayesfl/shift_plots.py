"""Plots of a `ShiftReport`: accuracy, NLL and ECE against
severity (``shift_metrics.png``), and pooled risk-coverage curves (``risk_coverage.png``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt
import seaborn as sns
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from bayesfl.shifts import SEVERITY_UNITS, format_severity
from bayesfl.strategies.base import MAP_PLUGIN, PREDICTIVE

_METRICS = (("accuracy", "accuracy (higher is better)"), ("nll", "NLL (lower is better)"),
            ("ece", "ECE (lower is better)"))
_STYLE = {PREDICTIVE: {"color": "#1f5fa8", "linestyle": "-", "marker": "o",
                       "label": "headline predictive"},
          MAP_PLUGIN: {"color": "#d2691e", "linestyle": "--", "marker": "s",
                       "label": "MAP plug-in"}}


def _style(key: str) -> dict[str, Any]:
    return _STYLE.get(key, {"color": "0.3", "linestyle": ":", "marker": "^", "label": key})


def _series(report: Any, kind: str, key: str, metric: str, scope: str = "pooled",
            client: int | None = None) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for severity in sorted({0.0, *report.settings["shifts"][kind]}):
        shift = "none" if severity == 0 else kind
        where = {"scope": scope, "shift": shift, "severity": severity, "predictive": key}
        if client is not None:
            where["client"] = client
        found = report.rows(**where)
        if found and found[0][metric] is not None:
            xs.append(severity)
            ys.append(found[0][metric])
    return xs, ys


def shift_metrics_figure(report: Any) -> Figure:
    """One row per shift kind, one column per metric (accuracy, NLL, ECE) against severity:
    pooled lines, headline and plug-in; the band is the spread (min to max) over the clients
    that trained (a pyplot figure: close it when done)."""
    sns.set_theme(style="whitegrid")
    kinds = list(report.settings["shifts"])
    fig, axes = plt.subplots(len(kinds), len(_METRICS), figsize=(13, 3.6 * len(kinds)),
                             squeeze=False)
    clients = sorted({r["client"] for r in report.rows(scope="client") if not r.get("novel")})
    for row, kind in enumerate(kinds):
        for col, (metric, label) in enumerate(_METRICS):
            ax = axes[row][col]
            for key in report.predictives:
                style = _style(key)
                per_client = [_series(report, kind, key, metric, "client", k) for k in clients]
                xs, _ = _series(report, kind, key, metric)
                low = [min((ys[i] for xs_k, ys in per_client for i in range(len(xs_k))
                            if xs_k[i] == x), default=float("nan")) for x in xs]
                high = [max((ys[i] for xs_k, ys in per_client for i in range(len(xs_k))
                             if xs_k[i] == x), default=float("nan")) for x in xs]
                if key == report.predictives[0]:  # one band: the headline's clients
                    ax.fill_between(xs, low, high, color=style["color"], alpha=0.15,
                                    linewidth=0)
                xs, ys = _series(report, kind, key, metric)
                ax.plot(xs, ys, color=style["color"], linestyle=style["linestyle"],
                        marker=style["marker"], markersize=5)
            severities = sorted({0.0, *report.settings["shifts"][kind]})
            ax.set_xticks(severities, [format_severity(v) for v in severities])
            ax.set(xlabel=f"{kind} severity ({SEVERITY_UNITS[kind]})", ylabel=label)
            if metric == "accuracy":
                ax.set_ylim(-0.02, 1.02)
            else:
                ax.set_ylim(bottom=0)
            if col == 0:
                ax.set_title(f"{kind}", loc="left", fontweight="bold")
    handles = [Line2D([], [], color=_style(k)["color"], linestyle=_style(k)["linestyle"],
                      marker=_style(k)["marker"], label=f"{_style(k)['label']} (pooled)")
               for k in report.predictives]
    first = _style(report.predictives[0])
    handles.append(Patch(color=first["color"], alpha=0.15,
                                            label=f"band: {first['label']}, clients' min "
                                                  "to max"))
    s = report.settings
    fig.suptitle(f"{s['strategy']} on {s['dataset']}: shifted test rows "
                 f"({len(clients)} clients, pooled)", fontsize=13)
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False)
    fig.tight_layout(rect=(0, 0.06 if len(kinds) > 1 else 0.1, 1, 0.97))
    return fig


def risk_coverage_figure(report: Any) -> Figure:
    """One panel per shift kind: the pooled risk-coverage curve at each severity (darker =
    more severe), headline solid, plug-in dashed (a pyplot figure: close it when done)."""
    sns.set_theme(style="whitegrid")
    kinds = list(report.settings["shifts"]) or [None]
    fig, axes = plt.subplots(1, len(kinds), figsize=(5.2 * len(kinds) + 0.6, 4.4),
                             squeeze=False)
    coverage = report.settings["coverage"]
    for ax, kind in zip(axes[0], kinds, strict=True):
        severities = sorted({0.0, *(report.settings["shifts"][kind] if kind else [])})
        palette = sns.color_palette("viridis_r", n_colors=len(severities))
        for colour, severity in zip(palette, severities, strict=True):
            shift = "none" if severity == 0 else kind
            for key in report.predictives:
                curve = report.curves.get((shift, severity, key))
                if curve is None:
                    continue
                style = _style(key)
                label = (f"{format_severity(severity)}" if key == PREDICTIVE
                         or len(report.predictives) == 1 else None)
                ax.step(curve[0], curve[1], where="post", color=colour,
                        linestyle=style["linestyle"], linewidth=1.6, label=label)
        ax.axvline(coverage, color="0.5", linewidth=0.8, linestyle=":",
                   label=f"{100 * coverage:g}% coverage")
        ax.set(xlim=(0, 1.01), ylim=(0, None), xlabel="coverage (most confident rows kept)",
               ylabel="risk (error rate among kept rows)",
               title=f"{kind} ({SEVERITY_UNITS[kind]})" if kind else "clean rows")
        ax.legend(title="severity", fontsize=8, title_fontsize=8, loc="upper left")
    s = report.settings
    styles = "; solid: headline, dashed: MAP plug-in" if MAP_PLUGIN in report.predictives else ""
    fig.suptitle(f"{s['strategy']} on {s['dataset']}: risk–coverage, pooled{styles}",
                 fontsize=12)
    fig.text(0.5, 0.01, "rows sharing a confidence are kept or dropped together: a curve "
             "starts at the share of rows tied at its highest confidence",
             ha="center", fontsize=8, color="0.4")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    return fig


def plot_shift_report(report: Any, out_dir: Path) -> list[Path]:
    """Write ``shift_metrics.png`` (when there are shifts) and ``risk_coverage.png`` into
    ``out_dir``; returns their paths."""
    paths = []
    figures = []
    if report.settings["shifts"]:
        figures.append(("shift_metrics.png", shift_metrics_figure))
    if report.curves:
        figures.append(("risk_coverage.png", risk_coverage_figure))
    for name, make in figures:
        fig = make(report)
        path = out_dir / name
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


__all__ = ["plot_shift_report", "risk_coverage_figure", "shift_metrics_figure"]
