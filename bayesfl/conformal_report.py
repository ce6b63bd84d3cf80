"""The conformal step's report: ``conformal.md`` (pooled and per-client coverage and set size)
and ``conformal.png`` (coverage against the target per client; the set-size histogram), from
``summary["conformal"]`` (`bayesfl.conformal.ConformalOutcome.summary`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

LABELS = {"predictive": "predictive", "map_plugin": "MAP plug-in"}


def conformal_markdown(figures: dict[str, Any]) -> str:
    """A markdown report of ``summary["conformal"]``."""
    target = figures["target_coverage"]
    lines = [f"# Conformal prediction sets: {figures['score']}, alpha = {figures['alpha']:g} "
             f"(target coverage {target:.1%}), {figures['method']} threshold", "",
             f"Calibrated on {figures['held_out_samples']} held-out rows of "
             f"{len(figures['participants'])} clients; {figures['steps']} "
             f"message{'' if figures['steps'] == 1 else 's'} to each, "
             f"{figures['bytes_up']:,} bytes up ({figures['bytes_up_per_client']:,.0f} per "
             f"client), {figures['bytes_down']:,} bytes down to calibrate the threshold; "
             f"{figures['evaluation_bytes_up']:,} up and {figures['evaluation_bytes_down']:,} "
             "down to evaluate.", ""]
    if figures.get("error"):
        lines += [f"No threshold: {figures['error']}", ""]
    if figures["rejections"]:
        lines += [f"Rejected: {len(figures['rejections'])} replies "
                  f"({figures['rejections'][0]['reason']} ...)", ""]
    lines += ["| predictive | threshold | coverage (pooled) | client mean | client min | "
              "clients below target | mean set size | empty sets |",
              "|---|---|---|---|---|---|---|---|"]
    for key, f in figures["predictives"].items():
        threshold = f["threshold"] if isinstance(f["threshold"], str) else f"{f['threshold']:.4g}"
        lines.append(f"| {LABELS.get(key, key)} | {threshold} | {f['coverage']:.4f} | "
                     f"{f['coverage_client_mean']:.4f} | {f['coverage_client_min']:.4f} | "
                     f"{f['clients_below_target']} of {len(f['per_client'])} | "
                     f"{f['mean_set_size']:.3f} | {f['empty_sets']:.3f} |")
    bounds = {"one-shot": "FedCP-QQ's stated bound on the expected coverage (for exchangeable "
                          "clients only)",
              "sketch": "the sketch's stated bounds on the expected coverage (under any "
                        "client heterogeneity)"}
    if figures["method"] in bounds:
        stated = []
        for key, f in figures["predictives"].items():
            if f.get("coverage_bound") is None:
                continue
            upper = f.get("coverage_upper_bound")
            stated.append(f"{LABELS.get(key, key)} >= {f['coverage_bound']:.4f}"
                          + ("" if upper is None else f", <= {upper:.4f}"))
        if stated:
            lines += ["", f"{bounds[figures['method']].capitalize()}: {'; '.join(stated)}."]
    lines += ["", "Per client (test rows):", "",
              "| client | rows | " + " | ".join(f"coverage ({LABELS.get(k, k)}) | size "
                                                   f"({LABELS.get(k, k)})"
                                                   for k in figures["predictives"]) + " |",
              "|---|---|" + "---|---|" * len(figures["predictives"])]
    rows: dict[int, list[str]] = {}
    counts: dict[int, int] = {}
    for f in figures["predictives"].values():
        for c in f["per_client"]:
            counts[c["client_id"]] = c["count"]
            rows.setdefault(c["client_id"], []).extend(
                [f"{c['coverage']:.3f}", f"{c['mean_set_size']:.2f}"])
    for cid in sorted(rows):
        lines.append(f"| {cid} | {counts[cid]} | " + " | ".join(rows[cid]) + " |")
    lines += ["", "Coverage is guaranteed >= target on average over calibration and test draws "
              "(marginally), not per client: a client far below it is a client whose rows are "
              "not exchangeable with the others'."]
    return "\n".join(lines) + "\n"


def plot_conformal(figures: dict[str, Any], path: Path) -> None:
    """Two panels: each client's coverage against the target (with the binomial spread a
    client's number of test rows allows), and the histogram of set sizes per predictive."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    target = figures["target_coverage"]
    predictives = list(figures["predictives"].items())
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.8),
                                      gridspec_kw={"width_ratios": [1.4, 1]})
    width = 0.8 / max(1, len(predictives))
    colours = ["#1f77b4", "#ff7f0e"]
    for j, (key, f) in enumerate(predictives):
        clients = [c["client_id"] for c in f["per_client"]]
        x = np.arange(len(clients)) + (j - (len(predictives) - 1) / 2) * width
        left.scatter(x, [c["coverage"] for c in f["per_client"]], color=colours[j % 2],
                     label=f"{LABELS.get(key, key)} (pooled {f['coverage']:.3f})", zorder=3,
                     s=28)
        if j == 0:
            counts = np.array([max(1, c["count"]) for c in f["per_client"]])
            spread = 2 * np.sqrt(target * (1 - target) / counts)
            top = np.minimum(1.0, target + spread)
            left.bar(np.arange(len(clients)), top - (target - spread), bottom=target - spread,
                     width=0.9, color="0.88", zorder=1,
                     label="target ± 2 s.e. (binomial, the client's rows)")
            left.set_xticks(np.arange(len(clients)), [str(c) for c in clients])
    left.axhline(target, color="k", lw=1, ls="--", label=f"target {target:.0%}", zorder=2)
    left.set_xlabel("client")
    left.set_ylabel("coverage on the client's test rows")
    low = min([target - 0.15] + [c["coverage"] - 0.02 for _, f in predictives
                                 for c in f["per_client"]])
    left.set_ylim(max(0.0, low), 1.005)
    left.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, fontsize=8,
                frameon=False)
    left.set_title(f"coverage per client ({figures['score']}, α = {figures['alpha']:g}, "
                   f"{figures['method']})", fontsize=10)
    for j, (key, f) in enumerate(predictives):
        sizes = np.array(f["size_counts"], dtype=float)
        share = sizes / max(1.0, sizes.sum())
        x = np.arange(len(sizes)) + (j - (len(predictives) - 1) / 2) * width
        right.bar(x, share, width=width, color=colours[j % 2],
                  label=f"{LABELS.get(key, key)} (mean {f['mean_set_size']:.2f})")
    if predictives:
        last = max(int(np.nonzero(np.array(f["size_counts"]))[0].max(initial=1))
                   for _, f in predictives)
        right.set_xlim(-0.6, last + 0.6)
        right.set_xticks(range(0, last + 1))
    right.set_xlabel("set size (labels)")
    right.set_ylabel("share of test rows")
    right.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, fontsize=8,
                 frameon=False)
    right.set_title("set sizes (pooled over clients)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_conformal_files(figures: dict[str, Any], directory: Path) -> None:
    """``conformal.md`` and ``conformal.png`` in ``directory``."""
    directory = Path(directory)
    (directory / "conformal.md").write_text(conformal_markdown(figures))
    if figures["predictives"]:
        plot_conformal(figures, directory / "conformal.png")


__all__ = ["conformal_markdown", "plot_conformal", "write_conformal_files"]
