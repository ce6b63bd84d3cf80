"""The published tables of issues 40 and 41, generated from the stored runs in ``bench/results/``.

Each table lies in ``docs/results.md`` (and ``s1_shift_readme`` in ``README.md``) between
``<!-- table:NAME -->`` and ``<!-- /table -->``; ``python bench/published_tables.py`` prints
every table, ``--write`` replaces the blocks in both pages, and
``tests/bench/test_published_tables.py`` fails when a page and the caches disagree.

Tables:

* ``s1_shift`` (``s1_shift.jsonl``, written by ``bench/s1_shift.py`` and
  ``bench/s1_ensemble.py``): S1 at 30 rounds, pooled over the clients, mean ± standard error
  over the seeds present: accuracy and NLL in distribution, NLL at 30° and 60° rotation, the
  unseen-label AUROC of the predictive entropy; the headline predictive, and beside it the MAP
  plug-in where the method has one.
* ``s1_cost`` (``s1_cost.jsonl``, ``bench/s1_cost.py``): CPU seconds of whole S1 runs and the
  ratio to each method's point-estimate peer.
* ``head_speed`` (``laplace_head_speed.jsonl``, ``bench/laplace_head_speed.py``): the Laplace
  head's fit against laplace-torch's last-layer Laplace at each size (the newest record of
  each size).
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import sys
from pathlib import Path

# `python bench/published_tables.py` puts bench/ first on sys.path (where bench/calibration.py
# would shadow the package): the repository root instead; an importer's path is left alone
if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from bench.run_cache import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PAGE = ROOT / "docs" / "results.md"
README = ROOT / "README.md"
BLOCK = re.compile(r"(<!-- table:(\w+) -->\n)(.*?)(<!-- /table -->)", re.S)


def mean_se(values: list[float], digits: int) -> str:
    if not values:
        return "–"
    mean = statistics.fmean(values)
    if len(values) == 1:
        return f"{mean:.{digits}f}"
    se = statistics.stdev(values) / math.sqrt(len(values))
    return f"{mean:.{digits}f} ± {se:.{digits}f}"


#: The README's rows of the S1 shift table: the recommended configuration, the point
#: estimates, the ensembles and FedLog's default (the rest is on the results page).
README_LABELS = ("FedAvg-FT + head=laplace", "FedPer + head=laplace", "FedPer", "FedBABU",
                 "FedAvg-FT", "FedAvg-FT ensemble (M = 5)", "FedBABU ensemble (M = 5)",
                 "FedLog (default)")


def s1_shift_readme_table(records: list[dict] | None = None) -> str:
    """:func:`s1_shift_table` for the README: its rows of :data:`README_LABELS`, headline
    predictives, and the recommended configuration's plug-in."""
    records = read_jsonl(RESULTS / "s1_shift.jsonl") if records is None else records
    table = s1_shift_table([r for r in records if r["label"] in README_LABELS])
    keep = [line for line in table.splitlines()
            if "| plug-in |" not in line or line.startswith(f"| {RECOMMENDED} |")]
    return "\n".join(keep) + "\n"


def s1_shift_table(records: list[dict] | None = None) -> str:
    records = read_jsonl(RESULTS / "s1_shift.jsonl") if records is None else records
    runs: dict[str, dict[int, dict]] = {}
    for r in records:
        if r.get("rounds") == 30:
            runs.setdefault(r["label"], {})[r["seed"]] = r  # the newest run of a seed counts
    lines = ["| method | predictive | seeds | accuracy (%) | NLL | NLL 30° | NLL 60° | "
             "unseen-label AUROC |", "|---|---|---|---|---|---|---|---|"]
    for label, by_seed in runs.items():
        for predictive, name in (("predictive", "headline"), ("map_plugin", "plug-in")):
            if f"{predictive}/clean" not in next(iter(by_seed.values()))["shift"]:
                continue
            shift = [r["shift"] for r in by_seed.values()]
            cells = [
                mean_se([100 * s[f"{predictive}/clean"]["accuracy"] for s in shift], 2),
                mean_se([s[f"{predictive}/clean"]["nll"] for s in shift], 3),
                mean_se([s[f"{predictive}/30"]["nll"] for s in shift], 3),
                mean_se([s[f"{predictive}/60"]["nll"] for s in shift], 3),
                mean_se([s[f"{predictive}/auroc_entropy"] for s in shift
                         if f"{predictive}/auroc_entropy" in s], 3)]
            seeds = ",".join(str(s) for s in sorted(by_seed))
            lines.append(f"| {label} | {name} | {seeds} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


#: The configuration the toolkit recommends, the point-estimate methods it must beat and the
#: federated deep ensembles it is reported beside (labels of ``s1_shift.jsonl``).
RECOMMENDED = "FedAvg-FT + head=laplace"
POINT_ESTIMATES = ("FedPer", "FedBABU", "FedAvg-FT")


def _paired(records: list[dict], label: str) -> dict[int, dict]:
    return {r["seed"]: r["shift"] for r in records if r["label"] == label and r["rounds"] == 30}


def s1_verdict_table(records: list[dict] | None = None) -> str:
    """Issue 40's acceptance, each line holds / does not hold: the recommended configuration
    against its plug-in, the best point estimate (per figure, over the seeds both have) and
    each ensemble, on NLL at 30° and 60° and the unseen-label AUROC; its accuracy within 1
    point of the most accurate method."""
    records = read_jsonl(RESULTS / "s1_shift.jsonl") if records is None else records
    ours = _paired(records, RECOMMENDED)
    if not ours:
        return "No runs of the recommended configuration in the cache.\n"
    figures = (("NLL at 30°", "30", "nll", -1), ("NLL at 60°", "60", "nll", -1),
               ("unseen-label AUROC", "auroc_entropy", None, 1))

    def value(shift: dict, predictive: str, key: str, metric: str | None) -> float:
        item = shift[f"{predictive}/{key}"]
        return item if metric is None else item[metric]

    def mean_of(runs: dict[int, dict], predictive: str, key: str, metric: str | None,
                seeds: list[int]) -> float:
        return statistics.fmean(value(runs[s], predictive, key, metric) for s in seeds)

    lines = ["| comparison | figure | recommended | other | verdict |", "|---|---|---|---|---|"]
    rivals = [("its plug-in", ours, "map_plugin")]
    labels = sorted({r["label"] for r in records if r["rounds"] == 30})
    for label in POINT_ESTIMATES:
        if label in labels:
            rivals.append((label, _paired(records, label), "predictive"))
    rivals += [(label, _paired(records, label), "predictive") for label in labels
               if "ensemble" in label]
    for name, runs, predictive in rivals:
        seeds = sorted(set(ours) & set(runs))
        if not seeds:
            continue
        for figure, key, metric, sign in figures:
            mine = mean_of(ours, "predictive", key, metric, seeds)
            other = mean_of(runs, predictive, key, metric, seeds)
            holds = sign * (mine - other) > 0
            lines.append(f"| vs {name} (seeds {','.join(map(str, seeds))}) | {figure} | "
                         f"{mine:.3f} | {other:.3f} | "
                         f"{'holds' if holds else 'does not hold'} |")
    accuracy = {label: statistics.fmean(100 * r["predictive/clean"]["accuracy"]
                                        for r in _paired(records, label).values())
                for label in labels if _paired(records, label)}
    best = max(accuracy, key=accuracy.get)
    gap = accuracy[best] - accuracy[RECOMMENDED]
    lines.append(f"| accuracy within 1 point of the most accurate ({best}) | accuracy (%) | "
                 f"{accuracy[RECOMMENDED]:.2f} | {accuracy[best]:.2f} | "
                 f"{'holds' if gap <= 1.0 else 'does not hold'} |")
    return "\n".join(lines) + "\n"


def s1_cost_table(records: list[dict] | None = None) -> str:
    from bench.s1_cost import PAIRS

    records = read_jsonl(RESULTS / "s1_cost.jsonl") if records is None else records
    newest = {(r["method"], r["seed"], r["rounds"]): r for r in records}
    lines = ["| method | peer | CPU-s | peer CPU-s | ratio | accuracy | NLL | commit, date |",
             "|---|---|---|---|---|---|---|---|"]
    for (method, seed, rounds), r in newest.items():
        for a, peer in PAIRS:
            p = newest.get((peer, seed, rounds))
            if a == method and p is not None:
                lines.append(
                    f"| {method} | {peer} | {r['cpu_s']:.1f} | {p['cpu_s']:.1f} | "
                    f"{r['cpu_s'] / p['cpu_s']:.1f}x | {r['accuracy']:.4f} | {r['nll']:.4f} | "
                    f"{r['commit']}, {r['date']} |")
    return "\n".join(lines) + "\n"


def head_speed_table(records: list[dict] | None = None) -> str:
    records = read_jsonl(RESULTS / "laplace_head_speed.jsonl") if records is None else records
    newest: dict[tuple[int, int], tuple[dict, dict]] = {}
    for record in records:
        for row in record["rows"]:
            newest[(row["n"], row["P"])] = (row, record)
    lines = ["| n | P | ours (s) | NLL | ECE | laplace-torch (s) | NLL | ECE | peer / ours | "
             "commit, date |", "|---|---|---|---|---|---|---|---|---|---|"]
    for (n, params), (row, record) in sorted(newest.items(), key=lambda i: (i[0][1], i[0][0])):
        ours, peer = row["ours"], row.get("laplace_torch")
        peer_cells = (f"{peer['fit_s']:.2f} | {peer['nll']:.3f} | {peer['ece']:.3f} | "
                      f"{row['ratio']:.2f}x" if peer else "– | – | – | –")
        lines.append(f"| {n} | {params} | {ours['fit_s']:.2f} | {ours['nll']:.3f} | "
                     f"{ours['ece']:.3f} | {peer_cells} | {record['commit']}, "
                     f"{record['date']} |")
    return "\n".join(lines) + "\n"


TABLES = {"s1_shift": s1_shift_table, "s1_shift_readme": s1_shift_readme_table,
          "s1_verdict": s1_verdict_table,
          "s1_cost": s1_cost_table, "head_speed": head_speed_table}


def render(page: str) -> str:
    """``page`` with every table block regenerated from the caches."""
    return BLOCK.sub(lambda m: m.group(1) + TABLES[m.group(2)]() + m.group(4), page)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"rewrite the blocks of {PAGE}")
    args = parser.parse_args()
    if args.write:
        for page in (PAGE, README):
            page.write_text(render(page.read_text()))
    for name, table in TABLES.items():
        print(f"<!-- table:{name} -->\n{table()}<!-- /table -->\n")


if __name__ == "__main__":
    main()
