"""The published tables of issues 40 and 41, generated from the stored runs in ``bench/results/``.

Each table lies in ``docs/results.md``, ``docs/seeds.md``, ``docs/inference.md``,
``docs/calibration.md``, ``docs/development.md`` or ``README.md`` (``PAGES``) between
``<!-- table:NAME -->`` and ``<!-- /table -->``; ``python bench/published_tables.py`` prints
every table, ``--write`` replaces the blocks in those pages, and
``tests/bench/test_published_tables.py`` fails when a page and the caches disagree.

Tables:

* ``s1_shift`` (``s1_shift.jsonl``, written by ``bench/s1_shift.py`` and
  ``bench/s1_ensemble.py``): S1 at 30 rounds, pooled over the clients, mean ± standard error
  over the seeds present: accuracy and NLL in distribution, NLL at 30° and 60° rotation, the
  unseen-label AUROC of the predictive entropy; the headline predictive, and beside it the MAP
  plug-in where the method has one.
* ``s1_cost`` (``s1_cost.jsonl``, ``bench/s1_cost.py``): CPU seconds of whole S1 runs and the
  ratio to each method's point-estimate peer.
* ``s1_conformal`` (``s1_conformal.jsonl``, ``bench/s1_conformal.py``): federated conformal
  sets in S1, coverage per client and set size, clean and under shift (issue 45).
* ``s1_full`` and ``s1_curves`` (``s1_30_h200.jsonl``, ``bench/fedsi_small.py`` on the H200
  machine): the full S1 table at 30 rounds (every configuration, its plug-in, bold computed:
  best beyond the standard error of the difference) and the accuracy over rounds (issue 43).
* ``seeds_colearn``, ``seeds_relay``, ``seeds_fedpart``, ``seeds_fedlog`` (``colearn.jsonl``,
  ``fedpart.jsonl``, ``fedlog_table1.jsonl``): ``docs/seeds.md``'s tables of the seed papers
  at their own protocols (issue 29's runs; issue 43).
* ``head_speed`` (``laplace_head_speed.jsonl``, ``bench/laplace_head_speed.py``): the Laplace
  head's fit against laplace-torch's last-layer Laplace at each size (the newest record of
  each size).
* ``head_exact`` (``head_exact_posterior.jsonl``, ``bench/head_exact_posterior.py``): the
  Laplace head's predictives against the exact posterior's (HMC) on the same features and
  prior, per size over three splits, with the claims paired over splits (issue 41's doubt).
* ``head_prior`` (``head_prior_sweep.jsonl``, ``bench/head_prior_sweep.py``): the head's
  held-out NLL at its evidence's λ, at fixed λ over a grid and at laplace-torch's λ (issue 41).
* ``heads_calibration`` (``heads_calibration.jsonl``, ``bench/heads_calibration.py``):
  docs/inference.md's table of every feature head against the network's softmax on digits,
  and each head's acceptance at every seed (issue 12).
* ``temperature_scaling`` (``temperature_scaling.jsonl``, ``bench/temperature_scaling.py``):
  docs/calibration.md's table of federated temperature scaling at the end of a FedLog run on
  digits (T, ECE/NLL/Brier before and after, the step's bytes) and at how many seeds each claim
  holds.
* ``conformal_methods`` (``s1_conformal.jsonl``, ``bench/s1_conformal.py``):
  docs/calibration.md's table of the three federated conformal thresholds, what each
  guarantees and uploads in S1, and each one's coverage claim over S1's rows.
* ``conjugate``, ``subnet_laplace``, ``fedsi`` (``bench/conjugate.py``,
  ``bench/subnet_laplace.py``, ``bench/fedsi.py``: the timing benches that gate the inference
  layer) and ``calibration``, ``simulate_scale``, ``flower`` (their benches): the newest run
  of each (``<name>.jsonl``, `bench.run_cache.append_result`), its ratios to the peer
  measured in the same run, each stated target's verdict, and a source line with the machine,
  date, commit, seeds, torch version, threads and load average (issue 41).
* ``mutation`` (``mutation.jsonl``, written by ``tools/mutation.py`` at the end of every run):
  docs/development.md's mutation scores, the newest run of each module, kind (full run,
  sample, retest), sample size and seed.
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

from bench.run_cache import read_cache, read_jsonl

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PAGE = ROOT / "docs" / "results.md"
README = ROOT / "README.md"
SEEDS = ROOT / "docs" / "seeds.md"
INFERENCE = ROOT / "docs" / "inference.md"
CALIBRATION = ROOT / "docs" / "calibration.md"
DEVELOPMENT = ROOT / "docs" / "development.md"
#: Every page whose table blocks are generated here.
PAGES = (PAGE, README, SEEDS, INFERENCE, CALIBRATION, DEVELOPMENT)
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
                 "FedLog (default)", "FedLog (s = 1)")


def s1_shift_readme_table(records: list[dict] | None = None) -> str:
    """`s1_shift_table` for the README: its rows of `README_LABELS`, headline
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
    """One row per (method, seed) of the newest runs with their peer run at the same seed and
    rounds, grouped by pair and ordered by seed."""
    from bench.s1_cost import PAIRS

    records = read_jsonl(RESULTS / "s1_cost.jsonl") if records is None else records
    newest = {(r["method"], r["seed"], r["rounds"]): r for r in records}
    lines = ["| method | peer | seed | CPU-s | peer CPU-s | ratio | accuracy | NLL | ECE | "
             "commit, date |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for a, peer in PAIRS:
        for (method, seed, rounds), r in sorted(newest.items(), key=lambda kv: kv[0][1:]):
            p = newest.get((peer, seed, rounds))
            if method != a or p is None:
                continue
            lines.append(
                f"| {method} | {peer} | {seed} | {_cpu_cell(r)} | {_cpu_cell(p)} | "
                f"{r['cpu_s'] / p['cpu_s']:.1f}x | {r['accuracy']:.4f} | {r['nll']:.4f} | "
                f"{r['ece']:.4f} | {r['commit']}, {r['date']} |")
    lines.append("")
    for (a, peer), target in S1_COST_TARGETS.items():
        ratios = [r["cpu_s"] / newest[(peer, seed, rounds)]["cpu_s"]
                  for (method, seed, rounds), r in sorted(newest.items(), key=lambda kv: kv[0][1:])
                  if method == a and (peer, seed, rounds) in newest]
        if ratios:
            held = "holds" if max(ratios) <= target else "does not hold"
            lines.append(f"- Issue 41's target {a} ≤ {target:g}x {peer}: **{held}** (seeds: "
                         + ", ".join(f"{ratio:.1f}x" for ratio in ratios) + ").")
    return "\n".join(lines) + "\n"


def _cpu_cell(record: dict) -> str:
    """A run's CPU seconds, or the median of its ``--repeats`` runs, said so."""
    repeats = record.get("repeats", 1)
    return (f"{record['cpu_s']:.1f}" if repeats == 1
            else f"{record['cpu_s']:.1f} (median of {repeats})")


#: Issue 41's targets for whole S1 runs: CPU time at most this many times the peer's.
S1_COST_TARGETS = {("fedper-laplace", "fedper"): 1.5, ("fedsi", "fedbabu"): 5.0}
#: Issue 41's targets for one Laplace head fit: CPU seconds at n = 250, P = 1,010, and the
#: factor over laplace-torch's last-layer Laplace at every size of the bench.
HEAD_FIT_TARGET_S, HEAD_PEER_TARGET = 0.5, 10.0


def head_speed_table(records: list[dict] | None = None) -> str:
    records = read_jsonl(RESULTS / "laplace_head_speed.jsonl") if records is None else records
    newest: dict[tuple[int, int], tuple[dict, dict]] = {}
    for record in records:
        for row in record["rows"]:
            newest[(row["n"], row["P"])] = (row, record)
    lines = ["| n | P | ours (CPU-s) | wall (s) | NLL | ECE | laplace-torch (s) | NLL | ECE | "
             "peer / ours | mfvi (s) | NLL | sgld (s) | NLL | commit, date |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (n, params), (row, record) in sorted(newest.items(), key=lambda i: (i[0][1], i[0][0])):
        ours, peer = row["ours"], row.get("laplace_torch")
        peer_cells = (f"{peer['fit_s']:.2f} | {peer['nll']:.3f} | {peer['ece']:.3f} | "
                      f"{row['ratio']:.2f}x" if peer else "– | – | – | –")
        wall = f"{ours['wall_s']:.2f}" if "wall_s" in ours else "–"
        other_cells = " | ".join(f"{row[kind]['fit_s']:.2f} | {row[kind]['nll']:.3f}"
                                 if kind in row else "– | –" for kind in ("mfvi", "sgld"))
        lines.append(f"| {n} | {params} | {ours['fit_s']:.2f} | {wall} | {ours['nll']:.3f} | "
                     f"{ours['ece']:.3f} | {peer_cells} | {other_cells} | {record['commit']}, "
                     f"{record['date']} |")
    lines.append("")
    small = newest.get((250, 1010))
    if small is not None:
        fit_s = small[0]["ours"]["fit_s"]
        held = "holds" if fit_s <= HEAD_FIT_TARGET_S else "does not hold"
        lines.append(f"- Issue 41's target, a fit in ≤ {HEAD_FIT_TARGET_S:g} CPU-s at n = 250, "
                     f"P = 1010: **{held}** ({fit_s:.2f}).")
    ratios = [(n, params, row["ratio"]) for (n, params), (row, _) in sorted(newest.items())
              if "ratio" in row]
    if ratios:
        held = ("holds" if all(r >= HEAD_PEER_TARGET for _, _, r in ratios)
                else "does not hold")
        lines.append(f"- Issue 41's target, ≥ {HEAD_PEER_TARGET:g}x laplace-torch at every size: "
                     f"**{held}** (" + ", ".join(f"n = {n}, P = {p}: {r:.1f}x"
                                                 for n, p, r in ratios) + ").")
    return "\n".join(lines) + "\n"


#: The predictives of bench/head_exact_posterior.py, in its table's order.
EXACT_COLUMNS = (("exact", "exact (HMC)"), ("gaussian_mc", "head's Gaussian, MC"),
                 ("head", "head (default)"), ("laplace_mc", "Laplace Gaussian, MC"),
                 ("plugin", "plug-in"))
#: The Gaussian's MC predictive counts as the exact posterior's when their NLLs agree this
#: closely (relative): the issue's own tolerance on a held-out NLL.
EXACT_NLL_RTOL = 0.01


def head_exact_table(records: list[dict] | None = None) -> str:
    """The Laplace head's predictives against the exact posterior's (HMC), from the newest run
    of ``bench/head_exact_posterior.py``: per size, mean ± standard error over the splits of
    NLL / ECE / mean confidence minus accuracy, and the claims paired over splits."""
    records = read_jsonl(RESULTS / "head_exact_posterior.jsonl") if records is None else records
    if not records:
        return "No runs in `bench/results/head_exact_posterior.jsonl` yet.\n"
    record = records[-1]
    by_rows: dict[int, list[dict]] = {}
    for case in record["cases"]:
        by_rows.setdefault(case["rows"], []).append(case)
    lines = ["| n | splits | λ | HMC acceptance | HMC chains' NLL apart | "
             + " | ".join(f"{label}: NLL / ECE / conf − acc" for _, label in EXACT_COLUMNS)
             + " |", "|---" * (5 + len(EXACT_COLUMNS)) + "|"]
    for rows, cases in sorted(by_rows.items()):
        cells = [" / ".join((mean_se([c[key]["nll"] for c in cases], 3),
                             mean_se([c[key]["ece"] for c in cases], 3),
                             mean_se([c[key]["overconfidence"] for c in cases], 3)))
                 for key, _ in EXACT_COLUMNS]
        acceptance = [rate for c in cases for rate in c["acceptance"]]
        apart = max(abs(c["chain_nll"][0] - c["chain_nll"][1]) for c in cases)
        lines.append(f"| {rows} | {len(cases)} | "
                     f"{min(c['prior_precision'] for c in cases):.3g}–"
                     f"{max(c['prior_precision'] for c in cases):.3g} | "
                     f"{min(acceptance):.2f}–{max(acceptance):.2f} | ≤ {apart:.4f} | "
                     + " | ".join(cells) + " |")
    lines += ["", "Claims, per n, paired over the splits (holds: the mean difference is on the "
              "claimed side by more than its standard error):", ""]
    for rows, cases in sorted(by_rows.items()):
        def paired(a: str, b: str, metric: str, cases: list[dict] = cases) -> list[float]:
            return [c[a][metric] - c[b][metric] for c in cases]

        closer = [abs(c["gaussian_mc"]["nll"] - c["exact"]["nll"])
                  - abs(c["laplace_mc"]["nll"] - c["exact"]["nll"]) for c in cases]
        gap = max(abs(c["gaussian_mc"]["nll"] / c["exact"]["nll"] - 1) for c in cases)
        within = "holds" if gap <= EXACT_NLL_RTOL else "does not hold"
        lines.append(
            f"- n = {rows}: the head's ECE ≤ its plug-in's: "
            f"**{verdict(paired('head', 'plugin', 'ece'), -1)}** "
            f"({paired_cell(paired('head', 'plugin', 'ece'), digits=3)}); the exact "
            f"posterior's ECE ≤ the plug-in's: **{verdict(paired('exact', 'plugin', 'ece'), -1)}**"
            f" ({paired_cell(paired('exact', 'plugin', 'ece'), digits=3)}); the head's Gaussian "
            f"nearer the exact NLL than Laplace's: **{verdict(closer, -1)}**; its MC NLL within "
            f"{EXACT_NLL_RTOL:.0%} of the exact: **{within}** (largest gap {gap:.1%}); the head's "
            f"default NLL ≤ the exact posterior's: "
            f"**{verdict(paired('head', 'exact', 'nll'), -1)}** "
            f"({paired_cell(paired('head', 'exact', 'nll'), digits=3)}).")
    return "\n".join(lines) + "\n\n" + source_line(
        "head_exact_posterior.jsonl", [record], record.get("seeds"))


def head_prior_table(records: list[dict] | None = None) -> str:
    """The Laplace head's held-out NLL at its evidence's λ, at fixed λ over a grid and at
    laplace-torch's marglik λ, from the newest run of ``bench/head_prior_sweep.py``."""
    records = read_jsonl(RESULTS / "head_prior_sweep.jsonl") if records is None else records
    if not records:
        return "No runs in `bench/results/head_prior_sweep.jsonl` yet.\n"
    record = records[-1]
    grid = record["grid"]
    lines = ["| n | evidence's λ | NLL | ECE | " + " | ".join(f"λ = {lam:g}" for lam in grid)
             + " | laplace-torch's λ | NLL |", "|---" * (6 + len(grid)) + "|"]
    claims = []
    for size in record["sizes"]:
        chosen, peer = size["evidence"], size["laplace_torch_lambda"]
        lines.append(f"| {size['rows']} | {chosen['prior_precision']:.3g} | {chosen['nll']:.4f} "
                     f"| {chosen['ece']:.4f} | "
                     + " | ".join(f"{point['nll']:.4f}" for point in size["grid"])
                     + f" | {peer['prior_precision']:.3g} | {peer['nll']:.4f} |")
        best = min(size["grid"], key=lambda point: point["nll"])
        gap = chosen["nll"] / best["nll"] - 1
        top = max(size["grid"], key=lambda point: point["prior_precision"])
        cost = top["nll"] / chosen["nll"] - 1
        cheaper = peer["nll"] / chosen["nll"] - 1
        claims.append(
            f"- n = {size['rows']}: the evidence's λ within {EXACT_NLL_RTOL:.0%} of the grid's "
            f"best held-out NLL (λ = {best['prior_precision']:g}, chosen on the test rows): "
            f"**{'holds' if gap <= EXACT_NLL_RTOL else 'does not hold'}** ({gap:+.1%}); "
            f"laplace-torch's λ (the evidence at a fixed MAP) within {EXACT_NLL_RTOL:.0%} of the "
            f"evidence's NLL: **{'holds' if cheaper <= EXACT_NLL_RTOL else 'does not hold'}** "
            f"({cheaper:+.1%}); the grid's far end, λ = {top['prior_precision']:g}: "
            f"{cost:+.1%}.")
    return ("\n".join(lines) + "\n\nClaims, per n:\n\n" + "\n".join(claims) + "\n\n"
            + source_line("head_prior_sweep.jsonl", [record], record.get("seeds")))


def heads_calibration_table(records: list[dict] | None = None) -> str:
    """docs/inference.md's heads table: every feature head's default predictive and MAP
    plug-in beside the network's softmax on digits (``bench/heads_calibration.py``), the
    newest run of each seed: the first seed's figures in full, and each head's acceptance
    (issue 12: ECE ≤ 0.03, NLL ≤ 1.5x the network's and ≤ its own plug-in's) at every seed."""
    records = read_jsonl(RESULTS / "heads_calibration.jsonl") if records is None else records
    newest = {record["seeds"][0]: record for record in records}
    if not newest:
        return "No runs in `bench/results/heads_calibration.jsonl` yet.\n"
    seeds = sorted(newest)
    rows = newest[seeds[0]]["rows"]
    network = rows["network"]
    lines = [f"Seed {seeds[0]}, {newest[seeds[0]]['test_rows']} test images:", "",
             "| head | predictive | accuracy | ECE | NLL | mean confidence | NLL / network's |",
             "|---|---|---|---|---|---|---|",
             f"| network | softmax | {network['accuracy']:.4f} | {network['ece']:.4f} | "
             f"{network['nll']:.4f} | {network['confidence']:.3f} | |"]
    for name, row in rows.items():
        if name == "network":
            continue
        for label, key in (("default", "default"), ("MAP plug-in", "map_plugin")):
            s = row[key]
            ratio = f"{s['nll'] / network['nll']:.2f}x" if key == "default" else ""
            lines.append(f"| {name} | {label} | {s['accuracy']:.4f} | {s['ece']:.4f} | "
                         f"{s['nll']:.4f} | {s['confidence']:.3f} | {ratio} |")
    lines += ["", "Each head's acceptance (issue 12: its default predictive's ECE ≤ 0.03, NLL ≤ "
              "1.5x the network's and ≤ its own plug-in's), per seed:", ""]
    for name in rows:
        if name == "network":
            continue
        passed = [seed for seed in seeds if newest[seed]["rows"][name]["accepted"]]
        held = "holds" if len(passed) == len(seeds) else "does not hold"
        lines.append(f"- {name}: **{held}** (accepted at {len(passed)} of {len(seeds)} seeds"
                     + (f"; not at {', '.join(str(s) for s in seeds if s not in passed)})"
                        if len(passed) < len(seeds) else ")"))
    return "\n".join(lines) + "\n\n" + source_line("heads_calibration.jsonl",
                                                    [newest[s] for s in seeds], seeds)


# ---------------------------------------------------------------------------------------------
# docs/calibration.md: federated temperature scaling (bench/temperature_scaling.py) and the three
# federated conformal thresholds (bench/s1_conformal.py), tables that were typed by hand.
# ---------------------------------------------------------------------------------------------

#: The largest share of the run's upload the temperature step may take to count as "a small
#: part of the run's traffic" (docs/calibration.md).
TEMPERATURE_SHARE = 0.05


def _count_verdict(claim: str, held: list, everything: list, unit: str,
                   name: str = "") -> str:
    """``- CLAIM: **holds at k of n UNIT**`` and, where it is not all of them, the ones where it
    does not hold (each as ``NAME`` and itself: ``seed 2``)."""
    missed = [f"{name}{x}" for x in everything if x not in held]
    return (f"- {claim}: **holds at {len(held)} of {len(everything)} {unit}**"
            + (f" (does not hold at {', '.join(missed)})." if missed else "."))


def temperature_scaling_table(records: list[dict] | None = None) -> str:
    """docs/calibration.md's table of federated temperature scaling at the end of a FedLog run
    on digits (``bench/temperature_scaling.py``), the newest run of each seed: T, the pooled
    test figures before → after and the step's bytes; then per claim (scaling lowers the test
    NLL, the ECE, the Brier score; keeps the accuracy; its upload is at most
    `TEMPERATURE_SHARE` of the run's) at how many seeds it holds."""
    records = read_jsonl(RESULTS / "temperature_scaling.jsonl") if records is None else records
    newest: dict[int, tuple[dict, dict]] = {}
    for record in records:
        for row in record["rows"]:
            newest[row["seed"]] = (row, record)
    if not newest:
        return _none_yet("temperature_scaling.jsonl")
    seeds = sorted(newest)
    first = newest[seeds[0]][1]
    rows = [newest[s][0] for s in seeds]
    tests = sorted({r["test_rows"] for r in rows})
    lines = [f"`{first['strategy']}` on `{first['dataset']}`, {first['clients']} clients, "
             f"`{first['partition']}`, {first['rounds']} rounds, "
             f"`calibrate=\"{first['calibrate']}\"`; pooled test rows per seed: "
             f"{', '.join(map(str, tests))}:", "",
             "| seed | T | accuracy before → after | ECE before → after | NLL before → after | "
             "Brier before → after | step bytes up / down | step's share of the run's upload |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b, a = r["before"], r["after"]
        lines.append(f"| {r['seed']} | {r['temperature']:.2f} | {b['accuracy']:.4f} → "
                     f"{a['accuracy']:.4f} | {b['ece']:.4f} → {a['ece']:.4f} | "
                     f"{b['nll']:.3f} → {a['nll']:.3f} | {b['brier']:.4f} → {a['brier']:.4f} | "
                     f"{r['step_bytes_up']:,} / {r['step_bytes_down']:,} | "
                     f"{r['step_bytes_up'] / r['run_bytes_up']:.1%} |")
    lines += ["", "Claims, per seed (pooled test rows, before → after scaling):", ""]
    for claim, key in (("temperature scaling lowers the test NLL", "nll"),
                       ("it lowers the ECE", "ece"), ("it lowers the Brier score", "brier")):
        lines.append(_count_verdict(claim, [r["seed"] for r in rows
                                            if r["after"][key] < r["before"][key]],
                                    seeds, "seeds", "seed "))
    lines.append(_count_verdict("it keeps the accuracy", [
        r["seed"] for r in rows if r["after"]["accuracy"] == r["before"]["accuracy"]],
        seeds, "seeds", "seed "))
    lines.append(_count_verdict(
        f"the step uploads at most {TEMPERATURE_SHARE:.0%} of the run's bytes",
        [r["seed"] for r in rows
         if r["step_bytes_up"] <= TEMPERATURE_SHARE * r["run_bytes_up"]], seeds, "seeds",
        "seed "))
    used = list({id(newest[s][1]): newest[s][1] for s in seeds}.values())
    return "\n".join(lines) + "\n\n" + source_line("temperature_scaling.jsonl", used, seeds)


#: The three federated conformal thresholds (``--conformal SCORE:ALPHA[:METHOD]``): what each
#: guarantees and under which assumption (calibration.federated_conformal).
CONFORMAL_METHODS = (
    ("exact", "`exact` (default)", "the pooled split-conformal threshold, bit for bit: "
     "coverage ≥ 1 − α", "pooled calibration rows exchangeable with the test row (any client "
     "heterogeneity)"),
    ("sketch", "`sketch`", "a threshold ≥ the pooled one: coverage ≥ 1 − α, and ≤ (k + D)/(N + 1)"
     " (stated per run)", "the same as `exact`"),
    ("one-shot", "`one-shot` (FedCP-QQ)", "coverage ≥ its stated bound M(l, k) ≥ 1 − α",
     "every client's rows exchangeable with every other's (IID clients)"))


def conformal_methods_table(records: list[dict] | None = None) -> str:
    """docs/calibration.md's table of the three federated conformal thresholds: their
    guarantees, and from ``bench/s1_conformal.py``'s newest S1 runs at 30 rounds that measured
    all three (each seed and score): the bytes and messages a client uploads and the bytes a
    client receives; then each threshold's coverage claim over the (score, predictive, α) rows,
    by `s1_conformal_table`'s rules (mean ± standard error over the seeds: exact within ±1.5
    points of 1 − α; the sketch's mean within its stated bounds and FedCP-QQ's not below its
    bound by more than two standard errors), the sketch's coverage against the exact
    threshold's in every run, and the uploads' order."""
    records = read_jsonl(RESULTS / "s1_conformal.jsonl") if records is None else records
    runs: dict[tuple[str, int, str], dict] = {}
    for r in records:
        if r.get("rounds") == 30 and {e["method"] for e in r["results"]} >= {
                m for m, *_ in CONFORMAL_METHODS}:
            runs[(r["label"], r["seed"], r.get("score", "aps"))] = r  # the newest counts
    if not runs:
        return "No S1 runs with all three thresholds in `bench/results/s1_conformal.jsonl` yet.\n"

    def entries(method: str) -> list[dict]:
        return [e for r in runs.values() for e in r["results"] if e["method"] == method]

    def spread(values: list[float]) -> str:
        low, high = min(values), max(values)
        return f"{low:,.0f}" if low == high else f"{low:,.0f}–{high:,.0f}"

    any_run = next(iter(runs.values()))
    clients = len(any_run["results"][0]["predictives"]["predictive"]["clean"]["per_client"])
    held = sorted({r["held_out_rows"] // clients for r in runs.values()})
    labels = sorted({label for label, _, _ in runs})
    lines = [f"S1 ({', '.join(labels)}; {clients} clients, "
             f"{', '.join(map(str, held))} held-out rows a client; every seed, score and α of "
             f"`bench/results/s1_conformal.jsonl` that ran all three):", "",
             "| method | guarantee | under which assumption | bytes up per client (S1) | "
             "messages up per client | bytes down per client |", "|---|---|---|---|---|---|"]
    upload = {}
    for method, name, guarantee, assumption in CONFORMAL_METHODS:
        got = entries(method)
        upload[method] = max(e["bytes_up_per_client"] for e in got)
        lines.append(f"| {name} | {guarantee} | {assumption} | "
                     f"{spread([e['bytes_up_per_client'] for e in got])} | "
                     f"{spread([e['steps'] for e in got])} | "
                     f"{spread([e['bytes_down'] / clients for e in got])} |")
    # the coverage claims per (label, score, predictive, alpha) row, over its seeds
    rows: dict[tuple, dict[str, list[dict]]] = {}
    for (label, _, score), r in runs.items():
        for e in r["results"]:
            for key, p in e["predictives"].items():
                rows.setdefault((label, score, key, e["alpha"]), {}).setdefault(
                    e["method"], []).append(p)
    held_rows: dict[str, list[str]] = {"exact": [], "sketch": [], "one-shot": []}
    names = {"predictive": "headline", "map_plugin": "plug-in"}
    every = []
    for (label, score, key, alpha), by_method in sorted(rows.items()):
        row = (f"{score.upper()} {names.get(key, key)} α = {alpha:g}"
               + (f" ({label})" if len(labels) > 1 else ""))
        every.append(row)
        for method, got in by_method.items():
            mean, se = _mean_and_se([p["clean"]["coverage"] for p in got])
            if method == "exact":
                ok = abs(mean - (1 - alpha)) <= 0.015
            elif method == "sketch":
                ok = (mean + 2 * se >= min(p["coverage_bound"] for p in got)
                      and mean - 2 * se <= max(p["coverage_upper_bound"] for p in got))
            else:
                ok = mean + 2 * se >= min(p["coverage_bound"] for p in got)
            if ok:
                held_rows[method].append(row)
    pairs = {f"seed {seed} {score.upper()} {names.get(key, key)} α = {alpha:g}"
             + (f" ({label})" if len(labels) > 1 else ""):
             (p["clean"]["coverage"], q["clean"]["coverage"])
             for (label, seed, score), r in sorted(runs.items())
             for alpha in sorted({e["alpha"] for e in r["results"]})
             for key in r["results"][0]["predictives"]
             for (_, p), (_, q) in [(_conformal_entry(r, alpha, "sketch", key),
                                     _conformal_entry(r, alpha, "exact", key))] if p and q}
    above = [run for run, (sketch, exact) in pairs.items() if sketch >= exact]
    unit = "score × predictive × α rows (mean over the seeds)"
    ordered = upload["one-shot"] < upload["sketch"] < upload["exact"]
    lines += ["", "Claims, clean test rows (the rules of the S1 conformal table on the results "
              "page):", "",
              _count_verdict("`exact`: pooled coverage within ±1.5 points of 1 − α",
                             held_rows["exact"], every, unit),
              _count_verdict("`sketch`: pooled coverage within its stated bounds",
                             held_rows["sketch"], every, unit),
              _count_verdict("`one-shot`: pooled coverage at or above its stated bound (not "
                             "more than two standard errors below it)",
                             held_rows["one-shot"], every, unit),
              _count_verdict("`sketch`: pooled coverage at or above the exact threshold's",
                             above, list(pairs),
                             "runs (seed × score × predictive × α)"),
              "- a client uploads less with `sketch` than with `exact`, and less with "
              f"`one-shot` than with `sketch`: **{'holds' if ordered else 'does not hold'}**."]
    return "\n".join(lines) + "\n\n" + source_line("s1_conformal.jsonl", list(runs.values()))


# ---------------------------------------------------------------------------------------------
# Issue 43: the figures that were typed by hand (FedLog vs FedAvg, the DP price, FedPart's one
# cycle, CoLearn at 10 rounds), generated from run_cache files whose records carry commit, date,
# machine and protocol. Every block says where and when its runs were measured; every claim the
# page makes gets a verdict in words by one rule (`verdict`).
# ---------------------------------------------------------------------------------------------

#: Caches written before records carried their provenance: what is known of where they ran.
LEGACY_ORIGIN = {
    "fedpart.jsonl": "issue 29's runs on a lent 16-core Intel Xeon beside an NVIDIA H200 (CPU "
                     "processes, one torch thread each, 16 at a time), committed 2026-11-27 "
                     "(1f45db1); the records carry no commit, date or machine",
    "colearn.jsonl": "issue 29's runs: the Table-1 rows on a lent 16-core Intel Xeon beside an "
                     "NVIDIA H200 (CPU processes, one torch thread each, 16 at a time), the "
                     "heterogeneous and relay runs on the 2-core development machine; committed "
                     "2026-11-27 (ba08a4a; the relay runs f0ef2d0); the records carry no commit, "
                     "date or machine",
    "fedlog_table1.jsonl": "issue 29's runs on a lent 16-core Intel Xeon beside an NVIDIA H200 "
                           "(CPU processes, one torch thread each, or the GPU where a row's "
                           "device says cuda), committed 2026-11-27 (ba08a4a); the records "
                           "carry no commit, date or machine",
    "s1_30_h200.jsonl": "an NVIDIA H200 machine (CPU processes, one torch thread each; FedSI "
                        "on the GPU), committed 2026-11-27 (97038cd); the records carry no "
                        "commit, date or machine",
}


def source_line(name: str, records: list[dict], seeds: list[int] | None = None) -> str:
    """One sentence naming a table's cache and where, when and at which commit its runs were
    measured (each distinct value once), and the seeds."""
    def distinct(key: str) -> str:
        values = sorted({str(r[key]) for r in records if key in r})
        return ", ".join(values) if values else "not recorded"

    if not records:
        return f"No runs in `bench/results/{name}` yet.\n"
    commits = list(dict.fromkeys(str(r["commit"]) for r in records if "commit" in r))
    if len(commits) > 3:  # the shared checkout moved on while the runs went: first and last
        commit_text = (f"{len(commits)} commits, {commits[0]} (first run) to {commits[-1]} "
                       "(last), the shared checkout moving on under the bench")
    else:
        commit_text = f"commit {distinct('commit')}"
    where = (LEGACY_ORIGIN[name] if name in LEGACY_ORIGIN and not any("machine" in r
                                                                        for r in records)
             else f"{distinct('machine')}; {distinct('date')}; {commit_text}")
    seed_text = f", seeds {','.join(map(str, sorted(set(seeds))))}" if seeds else ""
    return (f"Source: `bench/results/{name}` ({len(records)} runs{seed_text}): {where}.\n")


def verdict(differences: list[float], direction: int = 1) -> str:
    """A paired claim in words: ``holds`` when the mean difference (claim minus other, each
    seed's pair) is on the claimed side (``direction`` +1: above 0, -1: below) by more than its
    standard error, ``does not hold`` when it is on the other side by more than that, and
    ``not resolved (within one standard error)`` between. One seed: its sign alone."""
    mean = statistics.fmean(differences)
    se = (statistics.stdev(differences) / math.sqrt(len(differences))
          if len(differences) > 1 else 0.0)
    if direction * mean > se:
        return "holds"
    if -direction * mean > se:
        return "does not hold"
    return "not resolved (within one standard error)"


def paired_cell(differences: list[float], scale: float = 1.0, digits: int = 4,
                unit: str = "") -> str:
    scaled = [scale * d for d in differences]
    mean = statistics.fmean(scaled)
    text = f"{mean:+.{digits}f}"
    if len(scaled) > 1:
        text += f" ± {statistics.stdev(scaled) / math.sqrt(len(scaled)):.{digits}f}"
    return text + unit


def _records(name: str, records: list[dict] | None) -> list[dict]:
    return list(read_cache(RESULTS / name).values()) if records is None else records


# --- FedLog against FedAvg on digits (bench/fedlog_vs_fedavg.py) ----------------------------

FEDLOG_ROWS = (("fedlog", "FedLog (s = 1)"), ("fedavg", "FedAvg"),
               ("fedlog (mlp:200 / mlp:100-100)", "FedLog (s = 1), bodies mlp:200 / mlp:100-100"))


def _fedlog_runs(records: list[dict], rounds: int = 30) -> dict[str, dict[int, dict]]:
    runs: dict[str, dict[int, dict]] = {}
    for r in records:
        if r.get("rounds") == rounds:
            runs.setdefault(r["label"], {})[r["seed"]] = r
    return runs


def fedlog_vs_fedavg_table(records: list[dict] | None = None, readme: bool = False) -> str:
    """FedLog against FedAvg on digits: every configuration's headline predictive (FedLog's
    posterior predictive) and, beside each posterior, its MAP plug-in; mean ± standard error
    over seeds; the cache's provenance."""
    records = _records("fedlog_vs_fedavg.jsonl", records)
    runs = _fedlog_runs(records)
    lines = ["| strategy | predictive | mean client accuracy | ECE (pooled) | NLL (pooled) | "
             "uplink bytes (total) |", "|---|---|---|---|---|---|"]
    seeds: list[int] = []
    for label, name in FEDLOG_ROWS[:2] if readme else FEDLOG_ROWS:
        by_seed = runs.get(label, {})
        if not by_seed:
            continue
        seeds += list(by_seed)
        rs = list(by_seed.values())
        predictives = [("posterior predictive", lambda r: r), ("MAP plug-in",
                                                               lambda r: r["map_plugin"])]
        if not label.startswith("fedlog"):
            predictives = [("point estimate", lambda r: r)]
        for predictive, pick in predictives:
            cells = [mean_se([pick(r)["accuracy"] for r in rs], 4),
                     mean_se([pick(r)["ece"] for r in rs], 4),
                     mean_se([pick(r)["nll"] for r in rs], 4),
                     f"{statistics.fmean(r['bytes_up'] for r in rs):,.0f}"
                     if predictive != "MAP plug-in" else "(same run)"]
            lines.append(f"| {name} | {predictive} | " + " | ".join(cells) + " |")
    used = [r for r in records if r.get("rounds") == 30]
    return "\n".join(lines) + "\n\n" + source_line("fedlog_vs_fedavg.jsonl", used, seeds)


def fedlog_vs_fedavg_readme_table(records: list[dict] | None = None) -> str:
    return fedlog_vs_fedavg_table(records, readme=True)


def fedlog_checks_table(records: list[dict] | None = None) -> str:
    """The claims made of FedLog against FedAvg and against its own plug-in, paired by seed,
    each with its verdict (`verdict`)."""
    records = _records("fedlog_vs_fedavg.jsonl", records)
    runs = _fedlog_runs(records)
    lines = ["| claim | paired by seed (mean ± standard error) | seeds | verdict |",
             "|---|---|---|---|"]
    ours, peer = runs.get("fedlog", {}), runs.get("fedavg", {})
    seeds = sorted(set(ours) & set(peer))
    if seeds:
        gain = [ours[s]["accuracy"] - peer[s]["accuracy"] for s in seeds]
        lines.append(f"| FedLog (s = 1) is more accurate than FedAvg | "
                     f"{paired_cell(gain, 100, 2, ' points')} | {len(seeds)} | "
                     f"{verdict(gain)} |")
        ratio = [ours[s]["bytes_up"] / peer[s]["bytes_up"] for s in seeds]
        lines.append(f"| FedLog uploads under 3% of FedAvg's bytes | "
                     f"{100 * statistics.fmean(ratio):.2f}% of FedAvg's | {len(seeds)} | "
                     f"{'holds' if max(ratio) < 0.03 else 'does not hold'} |")
    for label, name in (FEDLOG_ROWS[0], FEDLOG_ROWS[2]):
        by_seed = runs.get(label, {})
        if not by_seed:
            continue
        for metric in ("nll", "ece", "accuracy"):
            diff = [r[metric] - r["map_plugin"][metric] for r in by_seed.values()]
            shown = metric.upper() if metric == "ece" else metric
            claim = (f"{name}: the posterior predictive's NLL is below its plug-in's"
                     if metric == "nll" else f"{name}: predictive minus plug-in, {shown}")
            lines.append(f"| {claim} | {paired_cell(diff, 1, 5)} | {len(by_seed)} | "
                         f"{verdict(diff, -1) if metric == 'nll' else '– (no claim)'} |")
    return "\n".join(lines) + "\n"


# --- the price of differential privacy (bench/dp_price.py) ----------------------------------

def _dp_groups(records: list[dict], rounds: int) -> dict[tuple[str, float | None], list[dict]]:
    """(placement, ε) -> the runs of ``rounds``, over the seeds that have every row (a seed
    an interrupted bench left half done is left out of every row, so rows stay paired)."""
    groups: dict[tuple[str, float | None], dict[int, dict]] = {}
    for r in records:
        if r.get("rounds") == rounds:
            groups.setdefault((r["placement"], r["epsilon"]), {})[r["seed"]] = r
    complete = set.intersection(*(set(g) for g in groups.values())) if groups else set()
    groups = {k: {s: r for s, r in g.items() if s in complete} for k, g in groups.items()}
    order = sorted(groups, key=lambda k: ({"local": 0, "central": 1}.get(k[0], 2),
                                          k[1] if k[1] is not None else math.inf))
    return {k: [groups[k][s] for s in sorted(groups[k])] for k in order}


def dp_price_table(records: list[dict] | None = None, rounds: int = 30) -> str:
    """FedLog under local and central DP at each ε, and without DP: the noise-aware
    predictive (the headline) and the face-value one on the same clients."""
    records = _records("dp_price.jsonl", records)
    groups = _dp_groups(records, rounds)
    lines = ["| placement | ε | σ | noise-to-signal | warned | accuracy | ECE | NLL | "
             "ECE (face value) | NLL (face value) |", "|---|---|---|---|---|---|---|---|---|---|"]
    seeds: list[int] = []
    for (placement, epsilon), rs in groups.items():
        seeds += [r["seed"] for r in rs]
        if epsilon is None:
            lines.append(f"| no DP (FedLog, s = 1) | ∞ | 0 | 0 | – | "
                         f"{mean_se([r['accuracy'] for r in rs], 3)} | "
                         f"{mean_se([r['ece'] for r in rs], 3)} | "
                         f"{mean_se([r['nll'] for r in rs], 3)} | – | – |")
            continue
        lines.append(
            f"| {placement} | {epsilon:g} | {statistics.fmean(r['sigma'] for r in rs):.1f} | "
            f"{mean_se([r['noise_to_signal'] for r in rs], 2)} | "
            f"{sum(int(r['warned']) for r in rs)}/{len(rs)} | "
            + " | ".join(mean_se([r[k] for r in rs], 3)
                         for k in ("accuracy", "ece", "nll", "face_ece", "face_nll")) + " |")
    used = [r for rs in groups.values() for r in rs]
    return "\n".join(lines) + "\n\n" + source_line("dp_price.jsonl", used, seeds)


def dp_price_10_table(records: list[dict] | None = None) -> str:
    return dp_price_table(records, rounds=10)


def dp_checks_table(records: list[dict] | None = None) -> str:
    """The DP section's claims at each run length: the warning fires exactly above a
    noise-to-signal of 0.5; the smallest ε whose accuracy is within 1 point of FedLog without
    DP (paired by seed); where the noise swamps the statistics (noise-to-signal above 0.5) the
    noise-aware predictive's ECE and NLL are below the face-value ones."""
    records = _records("dp_price.jsonl", records)
    lines = ["| rounds | claim | figure | verdict |", "|---|---|---|---|"]
    for rounds in sorted({r["rounds"] for r in records}, reverse=True):
        groups = _dp_groups(records, rounds)
        plain = {r["seed"]: r for r in groups.get(("none", None), [])}
        dp = [r for (placement, _), rs in groups.items() if placement != "none" for r in rs]
        agree = sum(bool(r["warned"]) == (r["noise_to_signal"] > 0.5) for r in dp)
        lines.append(f"| {rounds} | the warning fires exactly where noise-to-signal > 0.5 | "
                     f"{agree} of {len(dp)} runs | "
                     f"{'holds' if agree == len(dp) else 'does not hold'} |")
        for placement in ("local", "central"):
            reached = []
            for (where, epsilon), rs in groups.items():
                if where != placement or not plain:
                    continue
                gap = [100 * (r["accuracy"] - plain[r["seed"]]["accuracy"]) for r in rs
                       if r["seed"] in plain]
                if gap and statistics.fmean(gap) > -1.0:
                    reached.append((epsilon, statistics.fmean(gap)))
            figure = (f"ε = {reached[0][0]:g} ({reached[0][1]:+.2f} points)" if reached
                      else "no ε run reaches it")
            lines.append(f"| {rounds} | {placement} DP: smallest ε within 1 point of FedLog's "
                         f"accuracy without DP | {figure} | – (a measurement) |")
        swamped = [r for r in dp if r["noise_to_signal"] > 0.5]
        for metric in ("ece", "nll"):
            diff = [r[metric] - r[f"face_{metric}"] for r in swamped]
            if diff:
                lines.append(
                    f"| {rounds} | noise-to-signal > 0.5: the noise-aware predictive's "
                    f"{metric.upper()} is below the face-value one | {paired_cell(diff, 1, 3)} "
                    f"({sum(d < 0 for d in diff)} of {len(diff)} runs lower) | "
                    f"{verdict(diff, -1)} |")
    return "\n".join(lines) + "\n"


# --- FedPart (bench/fedpart.py) -------------------------------------------------------------

def _fedpart_runs(records: list[dict]) -> dict[str, dict[str, dict[int, dict]]]:
    runs: dict[str, dict[str, dict[int, dict]]] = {}
    for r in records:
        runs.setdefault(r["partition"], {}).setdefault(r["method"], {})[r["seed"]] = r
    return dict(sorted(runs.items(), key=lambda item: (item[0] != "iid", item[0])))


def fedpart_table(records: list[dict] | None = None, name: str = "fedpart_one_cycle.jsonl"
                  ) -> str:
    """FNU against FedPart: best and final accuracy (mean ± standard error over seeds), the
    whole federation's uplink, the clients' measured local CPU seconds and analytic FLOPs,
    then each claim of the paper paired by seed with its verdict."""
    records = _records(name, records)
    runs = _fedpart_runs(records)
    lines = ["| partition | method | seeds | best acc | final acc | uplink MB | local CPU s | "
             "TFLOP |", "|---|---|---|---|---|---|---|---|"]
    checks = ["| partition | claim (the paper's, FedAvg) | figure | verdict |",
              "|---|---|---|---|"]
    seeds: list[int] = []
    for partition, by_method in runs.items():
        for method in ("FNU", "FedPart"):
            rs = list(by_method.get(method, {}).values())
            if not rs:
                continue
            seeds += [r["seed"] for r in rs]
            lines.append(
                f"| {partition} | {method} | {len(rs)} | "
                f"{mean_se([r['best'] for r in rs], 4)} | "
                f"{mean_se([r['final'] for r in rs], 4)} | "
                f"{statistics.fmean(r['total_bytes'] for r in rs) / 1e6:.2f} | "
                f"{statistics.fmean(r['total_seconds'] for r in rs):.1f} | "
                f"{statistics.fmean(r['total_flops'] for r in rs) / 1e12:.3f} |")
        fnu, part = by_method.get("FNU", {}), by_method.get("FedPart", {})
        paired = sorted(set(fnu) & set(part))
        if not paired:
            continue

        def ratio(key: str, part: dict = part, fnu: dict = fnu, paired: list = paired
                  ) -> float:
            return (statistics.fmean(part[s][key] for s in paired)
                    / statistics.fmean(fnu[s][key] for s in paired))

        up, flops, cpu = ratio("total_bytes"), ratio("total_flops"), ratio("total_seconds")
        checks.append(f"| {partition} | 28% of FNU's upload | {100 * up:.1f}% | "
                      f"{'holds' if up <= 0.285 else 'does not hold'} |")
        checks.append(f"| {partition} | 73% of FNU's compute | {100 * flops:.1f}% of the FLOPs, "
                      f"{100 * cpu:.1f}% of the measured CPU s | "
                      f"{'holds' if max(flops, cpu) <= 0.73 else 'does not hold'} |")
        gap = [part[s]["best"] - fnu[s]["best"] for s in paired]
        checks.append(f"| {partition} | best accuracy equal to or above FNU's | "
                      f"{paired_cell(gap, 100, 2, ' points')} ({len(paired)} seeds) | "
                      f"{'holds' if statistics.fmean(gap) >= 0 else verdict(gap)} |")
    return ("\n".join(lines) + "\n\n" + "\n".join(checks) + "\n\n"
            + source_line(name, records, seeds))


def fedpart_full_table(records: list[dict] | None = None) -> str:
    """`fedpart_table` of the paper's full schedule (125 rounds, ``fedpart.jsonl``)."""
    return fedpart_table(records, name="fedpart.jsonl")


# --- CoLearn at 10 rounds (bench/colearn.py --rounds 10) ------------------------------------

COLEARN_PAPER = {"colearn": {2: 94.19, 5: 90.63, 10: 82.07}, "fl": {2: 92.64, 5: 86.79, 10: 70.06},
                 "il": {2: 91.46, 5: 85.26, 10: 72.86}, "fd": {2: 94.45, 5: 90.55, 10: 77.90}}
COLEARN_NAMES = {"colearn": "CoLearn", "il": "IL (`local-only`)", "fl": "FL (FedAvg)",
                 "fd": "FD", "fedproto": "FedProto", "fedlog": "FedLog (s = 1)"}


UPLINK = "bytes_up_per_client_round"


def _colearn_runs(cache: dict[str, dict], rounds: int) -> dict[str, dict[str, dict[int, dict]]]:
    """group -> 'label|N' -> seed -> record, from the cache keys
    ``group|label|N|seed|rounds|relay=sets``."""
    out: dict[str, dict[str, dict[int, dict]]] = {}
    for key, record in cache.items():
        group, label, n, seed, r, *_ = key.split("|")
        if int(r) == rounds:
            out.setdefault(group, {}).setdefault(f"{label}|{n}", {})[int(seed)] = record
    return out


def colearn_table(cache: dict[str, dict] | None = None, rounds: int = 10) -> str:
    """CoLearn against IL, FL, FD, FedProto and FedLog at N = 2, 5, 10 (accuracy on the common
    test set, mean ± standard error over seeds, the paper's 100-round figure in brackets; ECE
    and NLL at N = 10; uplink per client and round), the heterogeneous-body and ablation runs,
    and the paper's claims paired by seed with their verdicts."""
    name = f"colearn_{rounds}.jsonl"
    cache = read_cache(RESULTS / name) if cache is None else cache
    runs = _colearn_runs(cache, rounds)
    rows = runs.get("rows", {})
    ns = sorted({int(k.split("|")[1]) for k in rows})
    lines = ["| method | seeds | " + " | ".join(f"N={n} acc % (paper)" for n in ns)
             + " | N=10 ECE | N=10 NLL | uplink B/client/round |",
             "|---|---|" + "---|" * (len(ns) + 3)]
    for label, name_ in COLEARN_NAMES.items():
        cells = []
        for n in ns:
            rs = list(rows.get(f"{label}|{n}", {}).values())
            paper = COLEARN_PAPER.get(label, {}).get(n)
            cells.append((mean_se([100 * r["accuracy"] for r in rs], 2) if rs else "–")
                         + (f" ({paper:.2f})" if paper is not None else ""))
        last = list(rows.get(f"{label}|10", {}).values())
        every = [r for k, v in rows.items() if k.startswith(f"{label}|") for r in v.values()]
        if not every:
            continue
        counts = sorted({len(v) for k, v in rows.items() if k.startswith(f"{label}|")})
        seeds_cell = (str(counts[0]) if len(counts) == 1  # the N differ: the range
                      else f"{counts[0]}–{counts[-1]}")
        lines.append(f"| {name_} | {seeds_cell} | " + " | ".join(cells) + " | "
                     + (f"{statistics.fmean(r['ece'] for r in last):.3f} | "
                        f"{statistics.fmean(r['nll'] for r in last):.3f}" if last else "– | –")
                     + f" | {statistics.fmean(r[UPLINK] for r in every):,.0f} |")
    extra = ["| run | N | seeds | accuracy % | ECE | NLL |", "|---|---|---|---|---|---|"]
    for group, title in (("heterogeneous", "heterogeneous bodies (lenet5 / cnn:16-32)"),
                         ("ablation", "ablation")):
        for key, by_seed in runs.get(group, {}).items():
            label, n = key.split("|")
            rs = list(by_seed.values())
            run_name = (f"{COLEARN_NAMES.get(label, label)}, {title}" if group == "heterogeneous"
                        else label)
            extra.append(f"| {run_name} | {n} | {len(rs)} | "
                         f"{mean_se([100 * r['accuracy'] for r in rs], 2)} | "
                         f"{statistics.fmean(r['ece'] for r in rs):.3f} | "
                         f"{statistics.fmean(r['nll'] for r in rs):.3f} |")
    checks = ["| claim (the paper's) | N | CoLearn minus it, paired by seed (points) | seeds | "
              "verdict |", "|---|---|---|---|---|"]
    for peer in ("il", "fl", "fd"):
        for n in ns:
            ours, theirs = rows.get(f"colearn|{n}", {}), rows.get(f"{peer}|{n}", {})
            paired = sorted(set(ours) & set(theirs))
            if not paired:
                continue
            gap = [100 * (ours[s]["accuracy"] - theirs[s]["accuracy"]) for s in paired]
            checks.append(f"| CoLearn beats {COLEARN_NAMES[peer]} | {n} | "
                          f"{paired_cell(gap, 1, 2)} | {len(paired)} | {verdict(gap)} |")
    seeds = [int(k.split("|")[3]) for k in cache if int(k.split("|")[4]) == rounds]
    used = [v for k, v in cache.items() if int(k.split("|")[4]) == rounds]
    return ("\n".join(lines) + "\n\n" + "\n".join(extra) + "\n\n" + "\n".join(checks) + "\n\n"
            + source_line(name, used, seeds))


# --- the S1 table of the README (bench/fedsi_small.py on the H200 machine) ------------------

#: The README's rows of S1 at 30 rounds: label in ``s1_30_h200.jsonl`` -> the name shown.
S1_README_ROWS = {"FedPer (Laplace head)": "FedPer, `head=laplace`", "FedPop": "FedPop",
                  "FedSI": "FedSI", "FedBABU": "FedBABU", "FedAvg-FT": "FedAvg-FT",
                  "pFedBayes": "pFedBayes", "FedLog": "FedLog, `feature_scale=1` (the paper's)",
                  "FedAvg": "FedAvg", "FedPA": "FedPA"}


def s1_h200_readme_table(records: list[dict] | None = None) -> str:
    """S1 at 30 rounds from the H200 machine's cache: each method's headline predictive and,
    under every posterior method, its MAP plug-in from the same runs; mean ± standard error
    over seeds; the cache's provenance."""
    records = read_jsonl(RESULTS / "s1_30_h200.jsonl") if records is None else records
    runs: dict[str, dict[int, dict]] = {}
    for r in records:
        if r.get("rounds") == 30 and not r.get("novel"):
            runs.setdefault(r["label"], {})[r["seed"]] = r
    lines = ["| method | predictive | seeds | accuracy (%) | ECE | NLL | Brier | uplink bytes |",
             "|---|---|---|---|---|---|---|---|"]
    used: list[dict] = []
    for label, name in S1_README_ROWS.items():
        rs = list(runs.get(label, {}).values())
        if not rs:
            continue
        used += rs
        seeds = ",".join(str(s) for s in sorted(runs[label]))
        kinds = [("point estimate", lambda r: r["summary"])]
        if all("map_plugin" in r["summary"] for r in rs):
            kinds = [("posterior", kinds[0][1]),
                     ("MAP plug-in", lambda r: r["summary"]["map_plugin"])]
        for kind, pick in kinds:
            up = (f"{statistics.fmean(r['summary']['bytes_up'] for r in rs):,.0f}"
                  if kind != "MAP plug-in" else "(same run)")
            lines.append(f"| {name} | {kind} | {seeds} | "
                         f"{mean_se([100 * pick(r)['accuracy'] for r in rs], 2)} | "
                         f"{mean_se([pick(r)['ece'] for r in rs], 4)} | "
                         f"{mean_se([pick(r)['nll'] for r in rs], 3)} | "
                         f"{mean_se([pick(r)['brier'] for r in rs], 4)} | {up} |")
    return ("\n".join(lines) + "\n\n"
            + source_line("s1_30_h200.jsonl", used, [r["seed"] for r in used]))



# --- the full S1 table of docs/results.md (bench/fedsi_small.py on the H200 machine) --------

#: Rows of the full S1 table: label in ``s1_30_h200.jsonl`` -> (the name shown, the FedSI
#: paper's figure for that method, quoted from its Tables I–II: accuracy % or
#: "acc % / ECE / MCE / Brier"; None where the paper has none). Cache labels not listed here
#: are appended under their own label, so no run is silently left out.
S1_FULL_ROWS = {
    "FedPer (Laplace head)": ("FedPer, `head=laplace`", None),
    "FedPer": ("FedPer (`local_layers=1`; the Laplace head's plug-in)", "91.82"),
    "FedPop": ("FedPop", "87.63 / 0.049 / 0.716 / 0.137"),
    "FedSI": ("FedSI", "93.98 / 0.040 / 0.242 / 0.101"),
    "FedSI-Fac": ("FedSI-Fac", "91.96 / 0.045 / 0.249 / 0.131"),
    "FedSI (prior var 1e-1)": ("FedSI, α = 1e-1", None),
    "FedSI (prior var 1e-4)": ("FedSI, α = 1e-4 (the paper's)", None),
    "FedSI (paper recipe)": ("FedSI, the paper's recipe (α = 1e-4, prior in Adam's gradient, "
                             "10 head epochs)", None),
    "FedBABU": ("FedBABU", "91.38"),
    "FedAvg-FT": ("FedAvg-FT", "93.15"),
    "FedAvg-FT (Laplace head)": ("FedAvg-FT, `head=laplace`, `head_prior=global`", None),
    "FedRep": ("FedRep", "90.68"),
    "pFedBayes": ("pFedBayes (lr 1e-4, the paper's)", "84.61 / 0.046 / 0.257 / 0.100"),
    "Local Only": ("Local Only", "91.38"),
    "LG-FedAvg": ("LG-FedAvg", "91.64"),
    "FedLog": ("FedLog, `feature_scale=1` (the paper's; the default before issue 40)", None),
    "FedLog (evidence scale)": ("FedLog, `feature_scale=evidence`", None),
    "FedLog-C": ("FedLog-C", None),
    "FedAvg": ("FedAvg", "88.26"),
    "FedPA": ("FedPA", None),
}

#: The columns compared for the bold: (summary key, scale, digits, +1 higher is better / -1
#: lower is better).
S1_FULL_BEST = {"accuracy": (100, 2, 1), "ece": (1, 4, -1), "nll": (1, 3, -1),
                "brier": (1, 4, -1)}


def _se(values: list[float]) -> float:
    return statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0


def _s1_30_runs(records: list[dict]) -> dict[str, dict[int, dict]]:
    runs: dict[str, dict[int, dict]] = {}
    for r in records:
        if r.get("rounds") == 30 and not r.get("novel"):
            runs.setdefault(r["label"], {})[r["seed"]] = r  # the newest run of a seed counts
    return runs


def s1_full_table(records: list[dict] | None = None) -> str:
    """The full S1 table at 30 rounds (H200 machine's cache): every configuration's headline
    predictive and, under each posterior method, its MAP plug-in; mean ± standard error over
    seeds; the FedSI paper's figures quoted beside. A figure is bold only where its row is best
    in that column by more than one standard error of the seed-paired difference against
    every other row (the standard error of the difference of the two means, √(se₁² + se₂²),
    from the ± shown); the note names the columns where no row is."""
    records = read_jsonl(RESULTS / "s1_30_h200.jsonl") if records is None else records
    runs = _s1_30_runs(records)
    labels = [label for label in S1_FULL_ROWS if label in runs]
    labels += [label for label in runs if label not in S1_FULL_ROWS]
    rows: list[tuple[str, dict[int, dict], str, str]] = []  # name, seed -> figures, bytes, paper
    for label in labels:
        by_seed = runs[label]
        name, paper = S1_FULL_ROWS.get(label, (label, None))
        rs = list(by_seed.values())
        up = f"{statistics.fmean(r['summary']['bytes_up'] for r in rs):,.0f}"
        rows.append((name, {s: r["summary"] for s, r in by_seed.items()}, up, paper or "–"))
        if all("map_plugin" in r["summary"] for r in rs):
            rows.append((f"{name} (MAP plug-in)",
                         {s: r["summary"]["map_plugin"] for s, r in by_seed.items()}, "–", "–"))
    best: dict[str, int] = {}
    unresolved: list[str] = []
    for key, (_, _, sign) in S1_FULL_BEST.items():
        means = [statistics.fmean(f[key] for f in figs.values()) for _, figs, _, _ in rows]
        top = max(range(len(rows)), key=lambda i: sign * means[i])
        ses = [_se([f[key] for f in figs.values()]) for _, figs, _, _ in rows]
        # the standard error of a difference of two means, from the ± a reader sees (not
        # paired by seed: the stricter reading, and one a reader can check from the table)
        close = [rows[i][0] for i in range(len(rows)) if i != top
                 and sign * (means[top] - means[i]) <= math.hypot(ses[top], ses[i])]
        shown = {"accuracy": "accuracy", "ece": "ECE", "nll": "NLL", "brier": "Brier"}[key]
        if close:
            unresolved.append(f"{shown} (best mean {rows[top][0]}; within one standard error: "
                              f"{', '.join(close)})")
        else:
            best[key] = top
    lines = ["| method | seeds | accuracy (%) | confidence (%) | ECE | NLL | Brier | "
             "uplink bytes | paper: acc % / ECE / MCE / Brier |",
             "|---|---|---|---|---|---|---|---|---|"]
    for i, (name, figs, up, paper) in enumerate(rows):
        fs = list(figs.values())
        cells = []
        for key, (scale, digits, _) in S1_FULL_BEST.items():
            cell = mean_se([scale * f[key] for f in fs], digits)
            cells.append(f"**{cell}**" if best.get(key) == i else cell)
            if key == "accuracy":
                cells.append(mean_se([100 * f["confidence"] for f in fs], 2))
        seeds = ",".join(map(str, sorted(figs)))
        lines.append(f"| {name} | {seeds} | " + " | ".join(cells) + f" | {up} | {paper} |")
    note = ("Bold: a figure best in its column by more than the standard error of the "
            "difference (√(se₁² + se₂²), from the ± shown) against every other row. "
            + (f"No row is best by that margin in {'; in '.join(unresolved)}. "
               if unresolved else "")
            + "The paper's figures are quoted from the FedSI paper's Tables I–II (800 rounds "
            "x 10 epochs), not measured here. ")
    used = [r for by_seed in runs.values() for r in by_seed.values()]
    return ("\n".join(lines) + "\n\n" + note
            + source_line("s1_30_h200.jsonl", used, [r["seed"] for r in used]))


#: The curves quoted under the full S1 table: label -> the name in the sentence.
S1_CURVE_ROWS = {"FedSI": "FedSI", "FedBABU": "FedBABU",
                 "FedSI (paper recipe)": "the paper's recipe"}


def s1_curves_table(records: list[dict] | None = None) -> str:
    """The S1 runs' accuracy after rounds 1, 5, 15 and 30 (each run's per-round curve: the
    plug-in of a head fine-tuned on that round's global body), mean over seeds."""
    records = read_jsonl(RESULTS / "s1_30_h200.jsonl") if records is None else records
    runs = _s1_30_runs(records)
    parts = []
    for label, name in S1_CURVE_ROWS.items():
        curves = [r["curve"] for r in runs.get(label, {}).values() if len(r.get("curve", [])) >= 30]
        if not curves:
            continue
        points = [statistics.fmean(c[i - 1] for c in curves) for i in (1, 5, 15, 30)]
        final = statistics.fmean(r["summary"]["accuracy"] for r in runs[label].values())
        parts.append(f"{name} ({len(curves)} seeds): {points[0]:.3f} after round 1, "
                     f"{points[1]:.3f} after 5, {points[2]:.3f} after 15, {points[3]:.3f} after "
                     f"30 (final, with its headline predictive: {100 * final:.2f}%)")
    return ("**Accuracy over rounds** (S1, the same runs; each round's figure is the plug-in of "
            "a head fine-tuned on that round's global body, mean over seeds): "
            + "; ".join(parts) + ".\n")


# --- docs/seeds.md: the seed papers at their own protocols (issue 29's runs) ----------------

def mean_sd(values: list[float], digits: int) -> str:
    """Mean ± standard deviation (seeds.md's FedPart table gives the spread, not the error)."""
    mean = statistics.fmean(values)
    if len(values) == 1:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def _seed_runs(cache: dict[str, dict], group: str, rounds: int = 100
               ) -> dict[tuple[str, int], dict[int, dict]]:
    """(label, N) -> seed -> record of ``colearn.jsonl``'s ``group`` at ``rounds``."""
    out: dict[tuple[str, int], dict[int, dict]] = {}
    for key, record in cache.items():
        g, label, n, seed, r, *_ = key.split("|")
        if g == group and int(r) == rounds:
            out.setdefault((label, int(n)), {})[int(seed)] = record
    return out


#: CoLearn's Table 1 rows in seeds.md: label -> (the first row's name, the other rows').
SEEDS_COLEARN = {"colearn": ("CoLearn", "CoLearn"), "il": ("IL (local only)", "IL"),
                 "fl": ("FL (FedAvg)", "FL"), "fd": ("FD", "FD")}


def seeds_colearn_table(cache: dict[str, dict] | None = None) -> str:
    """CoLearn's Table 1 at 100 rounds: each method at N = 2, 5, 10 (accuracy mean ± standard
    error over seeds, the paper's figure in brackets; mean ECE, NLL, bytes per client and
    round, seconds a run), then CoLearn minus each peer paired by seed."""
    cache = read_cache(RESULTS / "colearn.jsonl") if cache is None else cache
    runs = _seed_runs(cache, "rows")
    lines = ["| method | N | accuracy % (paper) | ECE | NLL | uplink B | downlink B | s / run |",
             "|---|---|---|---|---|---|---|---|"]
    used: list[dict] = []
    seeds: list[int] = []
    for label, (first, other) in SEEDS_COLEARN.items():
        ns = sorted(n for lab, n in runs if lab == label)
        for i, n in enumerate(ns):
            by_seed = runs[(label, n)]
            rs = list(by_seed.values())
            used += rs
            seeds += list(by_seed)
            paper = COLEARN_PAPER.get(label, {}).get(n)
            lines.append(
                f"| {first if i == 0 else other} | {n} | "
                f"{mean_se([100 * r['accuracy'] for r in rs], 2)}"
                + (f" ({paper:.2f})" if paper is not None else "") + " | "
                f"{statistics.fmean(r['ece'] for r in rs):.3f} | "
                f"{statistics.fmean(r['nll'] for r in rs):.3f} | "
                f"{statistics.fmean(r[UPLINK] for r in rs):,.0f} | "
                f"{statistics.fmean(r['bytes_down_per_client_round'] for r in rs):,.0f} | "
                f"{statistics.fmean(r['seconds'] for r in rs):.0f} |")
    paired = ["| N | minus IL | minus FL | minus FD |", "|---|---|---|---|"]
    for n in sorted({n for lab, n in runs if lab == "colearn"}):
        ours = runs[("colearn", n)]
        cells = []
        for peer in ("il", "fl", "fd"):
            theirs = runs.get((peer, n), {})
            both = sorted(set(ours) & set(theirs))
            gap = [100 * (ours[s]["accuracy"] - theirs[s]["accuracy"]) for s in both]
            cells.append(f"{paired_cell(gap, 1, 2)}" if gap else "–")
        paired.append(f"| {n} | " + " | ".join(cells) + " |")
    hetero = _seed_runs(cache, "heterogeneous")
    hetero_text = ", ".join(
        f"{COLEARN_NAMES.get(label, label).split(' (')[0]} "
        f"{mean_se([100 * r['accuracy'] for r in by_seed.values()], 2)}% "
        f"({len(by_seed)} seed{'s' if len(by_seed) > 1 else ''})"
        for (label, _), by_seed in hetero.items())
    return ("\n".join(lines) + "\n\nPaired by seed, CoLearn minus each peer (points, mean ± "
            "standard error of the differences):\n\n" + "\n".join(paired) + "\n\n"
            + (f"Heterogeneous bodies (lenet5 / cnn:16-32 alternating, N = 10): {hetero_text}."
               "\n\n" if hetero_text else "")
            + source_line("colearn.jsonl", used, seeds))


#: The relay ablation's rows: (group, label) in ``colearn.jsonl`` at N = 5 -> the name shown.
SEEDS_RELAY = {("rows", "colearn"): '`relay="sets"` (default, the paper\'s downlink)',
               ("ablation", "colearn, whole-pool relay (relay = pool)"):
                   '`relay="pool"` (every peer\'s set, drawn per client)',
               ("ablation", "colearn, no class counts uploaded (share_counts = false)"):
                   "`share_counts=False` (presence only)"}


def seeds_relay_table(cache: dict[str, dict] | None = None) -> str:
    """CoLearn's relay and class-count variants at N = 5, 100 rounds, each seed's accuracy,
    and the whole pool minus the paper's relay paired by seed."""
    cache = read_cache(RESULTS / "colearn.jsonl") if cache is None else cache
    lines = ["| CoLearn at N = 5, 100 rounds | accuracy % (seeds) | mean ± se | ECE | NLL | "
             "uplink B | downlink B |", "|---|---|---|---|---|---|---|"]
    found: dict[str, dict[int, dict]] = {}
    for (group, label), name in SEEDS_RELAY.items():
        by_seed = _seed_runs(cache, group).get((label, 5), {})
        if not by_seed:
            continue
        found[name] = by_seed
        rs = [by_seed[s] for s in sorted(by_seed)]
        accuracies = " / ".join(f"{100 * r['accuracy']:.2f}" for r in rs)
        lines.append(
            f"| {name} | {accuracies} "
            f"({'/'.join(map(str, sorted(by_seed)))}) | "
            f"{mean_se([100 * r['accuracy'] for r in rs], 2)} | "
            f"{statistics.fmean(r['ece'] for r in rs):.3f} | "
            f"{statistics.fmean(r['nll'] for r in rs):.3f} | "
            f"{statistics.fmean(r[UPLINK] for r in rs):,.0f} | "
            f"{statistics.fmean(r['bytes_down_per_client_round'] for r in rs):,.0f} |")
    names = list(SEEDS_RELAY.values())
    text = ""
    if names[0] in found and names[1] in found:
        ours, pool = found[names[0]], found[names[1]]
        both = sorted(set(ours) & set(pool))
        gap = [100 * (pool[s]["accuracy"] - ours[s]["accuracy"]) for s in both]
        text = ("\nPaired by seed, the whole pool minus the paper's relay: "
                + ", ".join(f"{g:+.2f}" for g in gap)
                + f" points ({paired_cell(gap, 1, 2)}; {verdict(gap)} that the pool is more "
                "accurate).\n")
    used = [r for by_seed in found.values() for r in by_seed.values()]
    return "\n".join(lines) + "\n" + text + "\n" + source_line("colearn.jsonl", used)


FEDPART_PARTITIONS = {"iid": "IID", "dirichlet:1.0": "Dirichlet(1)"}


def _fedpart_full(records: list[dict]) -> dict[str, dict[str, dict[int, dict]]]:
    out: dict[str, dict[str, dict[int, dict]]] = {}
    for r in records:
        out.setdefault(r["partition"], {}).setdefault(r["method"], {})[r["seed"]] = r
    return out


def seeds_fedpart_table(records: list[dict] | None = None) -> str:
    """FedPart against FNU at the paper's schedule (``fedpart.jsonl``, 125 rounds): best and
    final accuracy (mean ± standard deviation over seeds), bytes, measured CPU seconds and
    analytic FLOPs; FedPart over FNU (ratios of the means); the best accuracy at the end of
    each cycle (rounds 25, 50, ..., 125)."""
    records = _records("fedpart.jsonl", records)
    runs = _fedpart_full(records)
    main = ["| partition | method | best acc | final acc | uplink MB | downlink MB | "
            "local CPU s | TFLOP | seeds |", "|---|---|---|---|---|---|---|---|---|"]
    ratios = ["| partition | uplink FedPart / FNU | downlink | compute (CPU s) | "
              "compute (FLOPs) |", "|---|---|---|---|---|"]
    cycles = ["| partition | method | C = 1 (r 25) | 2 (50) | 3 (75) | 4 (100) | 5 (125) |",
              "|---|---|---|---|---|---|---|"]
    seeds: list[int] = []
    for partition, by_method in sorted(runs.items(), key=lambda i: i[0] != "iid"):
        shown = FEDPART_PARTITIONS.get(partition, partition)
        means: dict[str, dict[str, float]] = {}
        for method in ("FNU", "FedPart"):
            rs = list(by_method.get(method, {}).values())
            if not rs:
                continue
            seeds += [r["seed"] for r in rs]
            means[method] = {k: statistics.fmean(r[k] for r in rs) for k in
                             ("total_bytes", "total_bytes_down", "total_seconds", "total_flops")}
            m = means[method]
            main.append(f"| {shown} | {method} | {mean_sd([r['best'] for r in rs], 4)} | "
                        f"{mean_sd([r['final'] for r in rs], 4)} | "
                        f"{m['total_bytes'] / 1e6:.2f} | {m['total_bytes_down'] / 1e6:.2f} | "
                        f"{m['total_seconds']:.1f} | {m['total_flops'] / 1e12:.3f} | "
                        f"{len(rs)} |")
            ends = [statistics.fmean(100 * max(r["accuracy"][:end]) for r in rs)
                    for end in (25, 50, 75, 100, 125)]
            cycles.append(f"| {shown} | {method} | " + " | ".join(f"{e:.2f}" for e in ends)
                          + " |")
        if len(means) == 2:
            part, fnu = means["FedPart"], means["FNU"]
            ratios.append(f"| {shown} | " + " | ".join(
                f"{part[k] / fnu[k]:.3f}" for k in ("total_bytes", "total_bytes_down",
                                                     "total_seconds", "total_flops")) + " |")
    ratios.append("| paper (ResNet-8, Table 1) | 0.28 | - | - | 0.73 (analytic) |")
    return ("\n".join(main) + "\n\n" + "\n".join(ratios) + "\n\nBest accuracy (%) at the end "
            "of each cycle, mean over the seeds (the paper's columns C = 1..5):\n\n"
            + "\n".join(cycles) + "\n\n" + source_line("fedpart.jsonl", records, seeds))


#: FedLog's Table 1 rows: label in ``fedlog_table1.jsonl`` -> (the name shown, the paper's
#: accuracy, the paper's uplink bytes per client and round (its bits / 8); None: not given).
SEEDS_FEDLOG = {"fedavg": ("FedAvg", "89.76", 87360), "lg-fedavg": ("LG-FedAvg 1", "97.85", 2040),
                "lg-fedavg-2": ("LG-FedAvg 2", "98.18", 66240),
                "fedper": ("FedPer", "96.16", 21120),
                "fedrep-1": ("FedRep 1 (`fedrep-1`)", "v2: 98.15", None),
                "fedrep": ("FedRep 2 (`fedrep`)", "95.51", 21120),
                "fedbabu": ("FedBABU", "86.30", 85320), "fedproto": ("FedProto", "98.19", 2040),
                "fedlog": ("**FedLog**", "98.15", 2040), "fedlog-c": ("FedLog-C", "98.41", None)}


def seeds_fedlog_table(cache: dict[str, dict] | None = None) -> str:
    """FedLog's Table 1 at 100 rounds (``fedlog_table1.jsonl``): final and best accuracy,
    ECE, NLL, rounds to 97%, bytes per client and round, seconds a run and the devices, the
    paper's figures in brackets; then each seed of FedLog, FedLog-C and FedProto, and both
    minus FedProto paired by seed."""
    cache = read_cache(RESULTS / "fedlog_table1.jsonl") if cache is None else cache
    runs: dict[str, dict[int, dict]] = {}
    for key, record in cache.items():
        label, seed, rounds = key.split("|")
        if int(rounds) == 100:
            runs.setdefault(label, {})[int(seed)] = record
    lines = ["| method | accuracy % (paper) | best % | ECE | NLL | rounds to 97% | "
             "uplink B (paper) | downlink B | s / run | seeds (device) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for label, (name, paper, paper_up) in SEEDS_FEDLOG.items():
        by_seed = runs.get(label, {})
        if not by_seed:
            continue
        rs = [by_seed[s] for s in sorted(by_seed)]
        reach = [r["rounds_to_97"] for r in rs]
        reach_text = ("never" if all(x is None for x in reach)
                      else ", ".join("never" if x is None else str(x) for x in reach))
        devices = [r.get("device", "cpu") for r in rs]
        device_text = (f"{devices[0]} x {len(devices)}" if len(devices) > 1
                       and len(set(devices)) == 1 else ", ".join(devices))
        up = f"{statistics.fmean(r[UPLINK] for r in rs):,.0f}"
        lines.append(
            f"| {name} | {mean_se([100 * r['accuracy'] for r in rs], 2)} ({paper}) | "
            f"{statistics.fmean(100 * r['best'] for r in rs):.2f} | "
            f"{statistics.fmean(r['ece'] for r in rs):.3f} | "
            f"{statistics.fmean(r['nll'] for r in rs):.3f} | {reach_text} | "
            + (f"{up} ({paper_up:,})" if paper_up else up) + " | "
            f"{statistics.fmean(r['bytes_down_per_client_round'] for r in rs):,.0f} | "
            f"{statistics.fmean(r['seconds'] for r in rs):.0f} | {len(rs)} ({device_text}) |")
    per_seed = []
    for label, name in (("fedlog", "FedLog"), ("fedlog-c", "FedLog-C"),
                        ("fedproto", "FedProto")):
        by_seed = runs.get(label, {})
        if by_seed:
            per_seed.append(f"{name} " + " / ".join(f"{100 * by_seed[s]['accuracy']:.2f}"
                                                    for s in sorted(by_seed)))
    seeds_all = sorted({s for by_seed in runs.values() for s in by_seed})
    text = (f"Per seed ({' / '.join(map(str, seeds_all))}): " + ", ".join(per_seed) + ".")
    proto = runs.get("fedproto", {})
    for label, name in (("fedlog", "FedLog"), ("fedlog-c", "FedLog-C")):
        ours = runs.get(label, {})
        both = sorted(set(ours) & set(proto))
        if both:
            gap = [100 * (ours[s]["accuracy"] - proto[s]["accuracy"]) for s in both]
            text += (f" Paired {name} minus FedProto: {paired_cell(gap, 1, 2)} points "
                     f"({len(both)} seeds; at least as accurate: "
                     f"{'holds' if verdict(gap) == 'holds' else verdict(gap)}).")
    used = [r for by_seed in runs.values() for r in by_seed.values()]
    return ("\n".join(lines) + "\n\n" + text + "\n\n"
            + source_line("fedlog_table1.jsonl", used, seeds_all))


def seeds_verdicts_table() -> str:
    """docs/seeds.md's one line per seed paper: each headline claim with its figures, computed
    from the caches of the tables below it (CoLearn, FedPart, FedLog at their protocols) and
    of the full S1 table (FedSI at 30 rounds), the verdict by `verdict` where it is a
    paired comparison."""
    def gaps(ours: dict[int, dict], theirs: dict[int, dict], key: str = "accuracy"
             ) -> list[float]:
        return [100 * (ours[s][key] - theirs[s][key]) for s in sorted(set(ours) & set(theirs))]

    lines = ["| paper | headline claim | here, at its protocol (or the nearest named) |",
             "|---|---|---|"]
    # CoLearn: against IL, FD and FL at N = 2, 5, 10 (paired by seed, mean of the differences)
    runs = _seed_runs(read_cache(RESULTS / "colearn.jsonl"), "rows")
    ns = sorted(n for label, n in runs if label == "colearn")
    parts, traffic = [], ""
    for peer, name in (("il", "IL"), ("fd", "FD"), ("fl", "FL")):
        per_n = [gaps(runs[("colearn", n)], runs.get((peer, n), {})) for n in ns]
        words = {verdict(g) for g in per_n if g}
        word = words.pop() if len(words) == 1 else "mixed: " + ", ".join(
            f"N = {n} {verdict(g)}" for n, g in zip(ns, per_n, strict=True) if g)
        parts.append(f"**{word} against {name}** ("
                     + " / ".join(f"{statistics.fmean(g):+.1f}" for g in per_n if g)
                     + " points at N = " + ", ".join(map(str, ns)) + ")")
    if ("fl", ns[0]) in runs:
        co = [r for n in ns for r in runs[("colearn", n)].values()]
        fl = [r for n in ns for r in runs[("fl", n)].values()]
        up = statistics.fmean(r[UPLINK] for r in fl) / statistics.fmean(r[UPLINK] for r in co)
        down = (statistics.fmean(r["bytes_down_per_client_round"] for r in fl)
                / statistics.fmean(r["bytes_down_per_client_round"] for r in co))
        traffic = f"; {up:.1f}x less traffic than FL up, {down:.1f}x down"
    lines.append("| CoLearn (Table 1, MNIST) | beats independent learning (IL) and FedAvg (FL) at "
                 "N = 2, 5, 10 while sending C d' floats instead of a model | "
                 + ", ".join(parts) + traffic + " |")
    # FedPart: bytes, compute, accuracy against FNU
    fp = _fedpart_full(_records("fedpart.jsonl", None))
    cells = []
    for partition, by_method in sorted(fp.items(), key=lambda i: i[0] != "iid"):
        fnu, part = by_method.get("FNU", {}), by_method.get("FedPart", {})
        both = sorted(set(fnu) & set(part))
        if not both:
            continue

        def ratio(key: str, fnu: dict = fnu, part: dict = part) -> float:
            return (statistics.fmean(r[key] for r in part.values())
                    / statistics.fmean(r[key] for r in fnu.values()))

        gap = [100 * (part[s]["best"] - fnu[s]["best"]) for s in both]
        up, flops, cpu = ratio("total_bytes"), ratio("total_flops"), ratio("total_seconds")
        accuracy = "holds" if statistics.fmean(gap) >= 0 else verdict(gap)
        cells.append(f"{FEDPART_PARTITIONS.get(partition, partition)}: bytes "
                     f"{'hold' if up <= 0.285 else 'do not hold'} ({up:.3f}), compute "
                     f"{'holds' if max(flops, cpu) <= 0.73 else 'does not hold'} ({flops:.2f} "
                     f"FLOPs, {cpu:.2f} measured CPU), **accuracy {accuracy}** "
                     f"({paired_cell(gap, 1, 2)} points best accuracy, {len(both)} seeds "
                     "paired)")
    lines.append("| FedPart (Table 1, ResNet-8) | FedAvg + FedPart: 28% of FNU's upload, 73% of "
                 "its compute, equal or better accuracy | " + "; ".join(cells)
                 + " (1 local epoch instead of 8) |")
    # FedLog: against FedProto, the most accurate baseline, at ~its uplink
    fl_runs: dict[str, dict[int, dict]] = {}
    for key, record in read_cache(RESULTS / "fedlog_table1.jsonl").items():
        label, seed, rounds = key.split("|")
        if int(rounds) == 100:
            fl_runs.setdefault(label, {})[int(seed)] = record
    proto, ours, fedc = (fl_runs.get(k, {}) for k in ("fedproto", "fedlog", "fedlog-c"))
    if proto and ours:
        g, gc = gaps(ours, proto), gaps(fedc, proto)
        share = (statistics.fmean(r[UPLINK] for r in ours.values())
                 / statistics.fmean(r[UPLINK] for r in fl_runs["fedavg"].values()))

        def acc(runs: dict[int, dict]) -> str:
            return f"{statistics.fmean(100 * r['accuracy'] for r in runs.values()):.2f}"

        lines.append(
            "| FedLog (Table 1, MNIST) | FedLog as accurate as the best personalised baselines "
            "at the smallest uplink; v2: FedLog-C the best | **FedLog at least as accurate as "
            f"FedProto: {verdict(g)}**: {acc(ours)} vs {acc(proto)} ({paired_cell(g, 1, 2)} "
            f"paired, {len(g)} seeds), at {100 * share:.1f}% of FedAvg's uplink; **FedLog-C "
            f"above FedProto: {verdict(gc)}** ({acc(fedc)} vs {acc(proto)}, "
            f"{paired_cell(gc, 1, 2)} paired) |")
    # FedSI: S1 at 30 rounds (the paper: 800), against every other method of the full table
    s1 = _s1_30_runs(read_jsonl(RESULTS / "s1_30_h200.jsonl"))
    fedsi = {s: r["summary"] for s, r in s1.get("FedSI", {}).items()}
    if fedsi:
        found = []
        for key, shown, sign, digits in (("accuracy", "accuracy (%)", 1, 2),
                                         ("ece", "ECE", -1, 4)):
            scale = 100 if key == "accuracy" else 1
            others = {label: {s: r["summary"] for s, r in by_seed.items()}
                      for label, by_seed in s1.items() if not label.startswith("FedSI")}
            mine = statistics.fmean(scale * f[key] for f in fedsi.values())
            better = sorted((label for label, runs in others.items()
                             if verdict([scale * (runs[s][key] - fedsi[s][key])
                                         for s in sorted(set(runs) & set(fedsi))], sign)
                             == "holds"),
                            key=lambda label: -sign * statistics.fmean(
                                f[key] for f in others[label].values()))
            found.append(f"{shown} {mine:.{digits}f}: "
                         + (f"{', '.join(better)} better by more than one standard error "
                            "(paired)" if better else "no other method better by more than "
                            "one standard error"))
        holds = all("no other method" in f for f in found)
        lines.append("| FedSI (Tables I–II, MNIST small regime) | FedSI the most accurate and "
                     "best calibrated of the personalised and Bayesian baselines | "
                     f"**{'holds' if holds else 'does not hold'} at 30 rounds (the paper: "
                     f"800; S1, the [results page](results.md#the-fedsi-papers-mnist-small-"
                     f"regime-s1))**: {'; '.join(found)} |")
    return "\n".join(lines) + "\n"


def _mean_bytes(values: list[float]) -> str:
    return f"{statistics.fmean(values):,.0f}" if values else "–"


def _conformal_entry(run: dict, alpha: float, method: str, key: str) -> tuple:
    """(the run's entry of that alpha and threshold, its figures of predictive ``key``)."""
    for e in run["results"]:
        if e["alpha"] == alpha and e["method"] == method:
            return e, e["predictives"].get(key)
    return None, None


def _verdict(ok: bool) -> str:
    return "holds" if ok else "**fails**"


def _mean_and_se(values: list[float]) -> tuple[float, float]:
    mean = statistics.fmean(values)
    return mean, (statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1
                  else 0.0)


def s1_conformal_table(records: list[dict] | None = None) -> str:
    """Issue 45: federated conformal sets in S1 at 30 rounds, per method, score, predictive and
    alpha, mean ± standard error over the seeds, each against ``1 - alpha`` with the acceptance
    verdicts: the exact threshold's pooled coverage within ±1.5 points of the target (with the
    lowest client's coverage, the clients below the target over all seeds and the mean set
    size clean, rotated 60° and on unseen labels); the one-shot sketch's and FedCP-QQ's pooled
    coverage against their stated bounds (holds: the mean is not below the bound by more than
    two standard errors), with the bytes a client uploads; then, per score, whether the
    posterior's mean set size at alpha = 0.1 is at most its plug-in's."""
    records = read_jsonl(RESULTS / "s1_conformal.jsonl") if records is None else records
    runs: dict[tuple[str, str], dict[int, dict]] = {}
    for r in records:
        if r.get("rounds") == 30:  # the newest run of a seed counts
            runs.setdefault((r["label"], r.get("score", "aps")), {})[r["seed"]] = r
    names = {"predictive": "headline", "map_plugin": "plug-in"}
    lines = ["| method | score | predictive | α (target) | seeds | exact: coverage | within "
             "±1.5 points | lowest client | clients below | set size | sketch: coverage "
             "(stated bounds) | bound holds | FedCP-QQ: coverage (stated bound) | bound holds "
             "| bytes up/client exact / sketch / FedCP-QQ | 60°: coverage, size | unseen "
             "labels: coverage, size |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    sizes: dict[tuple[str, str, str], float] = {}
    for (label, score), by_seed in runs.items():
        seeds = sorted(by_seed)
        for key in ("predictive", "map_plugin"):
            for alpha in (0.05, 0.1):
                exact = [_conformal_entry(by_seed[s], alpha, "exact", key) for s in seeds]
                if not exact or any(p is None for _, p in exact):
                    continue
                target = 1 - alpha
                cover, cover_se = _mean_and_se([p["clean"]["coverage"] for _, p in exact])
                within = abs(cover - target) <= 0.015
                below = sum(p["clean"]["clients_below"] for _, p in exact)
                clients = sum(len(p["clean"]["per_client"]) for _, p in exact)
                if alpha == 0.1:
                    sizes[(label, score, key)] = statistics.fmean(
                        [p["clean"]["mean_set_size"] for _, p in exact])

                def col(items, cond, metric, digits=3):
                    return mean_se([p[cond][metric] for _, p in items if p], digits)

                cells = []
                for method in ("sketch", "one-shot"):
                    got = [_conformal_entry(by_seed[s], alpha, method, key) for s in seeds]
                    got = [(e, p) for e, p in got if p]
                    if not got:
                        cells += ["–", "–"]
                        continue
                    mean, se = _mean_and_se([p["clean"]["coverage"] for _, p in got])
                    low = min(p["coverage_bound"] for _, p in got)
                    ups = [p.get("coverage_upper_bound") for _, p in got]
                    if method == "sketch" and all(u is not None for u in ups):
                        up = max(ups)
                        stated = f"[≥ {low:.3f}, ≤ {up:.3f}]"
                        ok = mean + 2 * se >= low and mean - 2 * se <= up
                    else:
                        stated = f"(≥ {low:.3f})"
                        ok = mean + 2 * se >= low
                    cells += [f"{mean_se([p['clean']['coverage'] for _, p in got], 3)} "
                              f"{stated}", _verdict(ok)]
                bytes_cell = " / ".join(
                    _mean_bytes([e["bytes_up_per_client"] for e, _ in
                                 (_conformal_entry(by_seed[s], alpha, m, key) for s in seeds)
                                 if e]) for m in ("exact", "sketch", "one-shot"))
                lines.append(
                    f"| {label} | {score.upper()} | {names[key]} | {alpha:g} ({target:g}) | "
                    f"{','.join(map(str, seeds))} | {col(exact, 'clean', 'coverage')} | "
                    f"{_verdict(within)} ({(cover - target) * 100:+.1f} points"
                    f"{f', {(cover - target) / cover_se:+.1f} SE' if cover_se else ''}) | "
                    f"{col(exact, 'clean', 'client_min')} | {below} of {clients} | "
                    f"{col(exact, 'clean', 'mean_set_size', 2)} | {cells[0]} | {cells[1]} | "
                    f"{cells[2]} | {cells[3]} | {bytes_cell} | "
                    f"{col(exact, 'rotate 60', 'coverage')}, "
                    f"{col(exact, 'rotate 60', 'mean_set_size', 2)} | "
                    f"{col(exact, 'unseen labels', 'coverage')}, "
                    f"{col(exact, 'unseen labels', 'mean_set_size', 2)} |")
    verdicts = []
    for (label, score, key), size in sorted(sizes.items()):
        plug = sizes.get((label, score, "map_plugin"))
        if key == "predictive" and plug is not None:
            verdicts.append(f"{label}, {score.upper()}: posterior {size:.2f} against plug-in "
                            f"{plug:.2f}, {_verdict(size <= plug)}")
    note = ("Set size at α = 0.1 (exact threshold), posterior ≤ its plug-in: "
            + "; ".join(verdicts) + ". " if verdicts else "")
    flat = [r for by_seed in runs.values() for r in by_seed.values()]
    return "\n".join(lines) + "\n\n" + note + source_line("s1_conformal.jsonl", flat)


# ---------------------------------------------------------------------------------------------
# Issue 41: the timing benches that gate the inference layer (bench/conjugate.py,
# bench/subnet_laplace.py, bench/fedsi.py) and the benches whose figures were typed by hand
# (bench/calibration.py, bench/simulate_scale.py, bench/flower.py). Each stores one record per
# invocation (bench.run_cache.append_result); a table shows the newest one, its ratios to the
# peer measured in the same run and each stated target's verdict (`target_verdict`).
# ---------------------------------------------------------------------------------------------

def target_verdict(value: float, bound: float, at_least: bool = True) -> str:
    """``holds`` when ``value`` meets the target (``value >= bound`` where ``at_least``, else
    ``value <= bound``), ``does not hold`` otherwise. A single timed run's figure against a
    stated threshold: no standard error exists to resolve it by."""
    return "holds" if (value >= bound if at_least else value <= bound) else "does not hold"


def _newest_run(name: str, records: list[dict] | None,
                keep=lambda r: True) -> tuple[dict | None, int]:
    """The newest record of ``bench/results/NAME`` that ``keep`` accepts, and how many it
    accepts."""
    records = read_jsonl(RESULTS / name) if records is None else records
    kept = [r for r in records if keep(r)]
    return (kept[-1] if kept else None), len(kept)


def run_source(name: str, record: dict, count: int) -> str:
    """One sentence naming a single run's cache, machine, date, commit, seeds, torch version and
    threads, and the load average (1, 5, 15 minutes) before and after it."""
    def loads(key: str) -> str:
        return " / ".join(f"{v:.2f}" for v in record.get(key, [])) or "not recorded"

    seeds = ",".join(map(str, record.get("seeds", []))) or "none"
    return (f"Source: `bench/results/{name}`, the newest of {count} run(s): "
            f"{record.get('machine', 'machine not recorded')}; {record.get('date', '?')}; "
            f"commit {record.get('commit', '?')} ({record.get('worktree', 'worktree not recorded')}"
            f"); seeds {seeds}; torch "
            f"{record.get('torch', '?')} with {record.get('threads', '?')} thread(s); load "
            f"average (1 / 5 / 15 min) {loads('load_before')} before, {loads('load_after')} "
            "after, on a machine shared with other work: the ratios, measured in the same run, "
            "are the figures to compare.\n")


def _none_yet(name: str) -> str:
    return f"No runs in `bench/results/{name}` yet.\n"


def conjugate_table(records: list[dict] | None = None) -> str:
    """``bench/conjugate.py``: the exact FedLog MAP against the paper's Adam loop, and the
    statistics pass against a forward pass, with issue 3's targets."""
    r, count = _newest_run("conjugate.jsonl", records)
    if r is None:
        return _none_yet("conjugate.jsonl")
    stats_mlp, stats_cnn = r["stats_vs_forward"], r["stats_vs_forward_paper_cnn"]
    lines = ["| figure | ours | peer | ours against the peer | target | verdict |",
             "|---|---|---|---|---|---|",
             f"| server MAP, C = {r['num_classes']}, k = {r['columns']}, n = {r['n']:,} "
             f"(wall time) | `solve_map` {r['time_exact_ms']:.2f} ms (median of "
             f"{r['repeats']}) | the paper's Adam loop {r['time_adam_ms'] / 1e3:.2f} s "
             f"({r['adam_steps']:,} steps) | {r['ratio_vs_adam']:,.0f}x faster | ≥ 300x | "
             f"{target_verdict(r['ratio_vs_adam'], 300)} |",
             f"| objective J, gap to the best found | {r['objective_gap_ours']:.3g} | "
             f"{r['objective_gap_adam']:.3g} ({r['relative_objective_gap_adam']:.1e} "
             f"relative) | – | ours at least as high | "
             f"{target_verdict(r['objective_gap_adam'] - r['objective_gap_ours'], 0)} |",
             f"| statistics pass, batch {r['batch']:,}, MLP 784-256-256-512 body (m = 512, "
             f"C = 100) | `from_features` {r['time_statistics_ms']:.3f} ms (best of "
             f"{r['repeats']}) | forward pass {r['time_forward_ms']:.3f} ms | "
             f"{100 * stats_mlp:.1f}% of it (ratio of medians "
             f"{100 * r['stats_vs_forward_median']:.1f}%) | < 10% | "
             f"{target_verdict(stats_mlp, 0.10, at_least=False)} |",
             f"| statistics pass, batch {r['batch']:,}, the paper's MNIST CNN body (m = 50, "
             f"C = 10) | {r['time_statistics_paper_cnn_ms']:.3f} ms | "
             f"{r['time_forward_paper_cnn_ms']:.3f} ms | {100 * stats_cnn:.1f}% of it | < 10% | "
             f"{target_verdict(stats_cnn, 0.10, at_least=False)} |"]
    return "\n".join(lines) + "\n\n" + run_source("conjugate.jsonl", r, count)


def _peer_name(key: str) -> str:
    return key.removeprefix("laplace-torch ").removeprefix("FullSubnetLaplace ")


def subnet_laplace_table(records: list[dict] | None = None) -> str:
    """``bench/subnet_laplace.py``: our subnet Laplace fit and GLM-probit predictive against
    laplace-torch's ``FullSubnetLaplace`` per backend, with issue 6's targets."""
    r, count = _newest_run("subnet_laplace.jsonl", records)
    if r is None:
        return _none_yet("subnet_laplace.jsonl")
    peers = list(r["peer_fit_s"])
    head = ("| step | ours (s) | " + " | ".join(f"laplace-torch {_peer_name(p)} (s)"
                                                for p in peers)
            + " | fastest peer / ours | target | verdict |")
    dashes = "|---|---|" + "---|" * len(peers) + "---|---|---|"
    fit = " | ".join(f"{r['peer_fit_s'][p]:.4f}" for p in peers)
    predict = " | ".join(f"{r['peer_predict_s'][p]:.3f}" for p in peers)
    others = " | ".join("–" for _ in peers[1:])
    lines = [head, dashes,
             f"| fit: GGN of the subnet and its factorisation (best of {r['repeats']}) | "
             f"{r['fit_s']:.4f} | {fit} | {r['fit_ratio']:.1f}x | ≥ 2x | "
             f"{target_verdict(r['fit_ratio'], 2)} |",
             f"| GLM-probit predictive of {r['predict_on']} inputs (ours best of "
             f"{r['repeats']}, the peer's one call) | {r['predict_s']:.4f} | {predict} | "
             f"{r['predict_ratio']:.0f}x | ≥ 50x | {target_verdict(r['predict_ratio'], 50)} |",
             f"| subnet selection, top {r['subnet_size']} by diagonal-GGN variance (the peer: "
             f"`DiagLaplace`, AsdlGGN) | {r['select_s']:.4f} | {r['peer_select_s']:.4f}"
             + (f" | {others}" if others else "")
             + f" | {r['peer_select_s'] / r['select_s']:.1f}x | – | – (no target) |",
             f"| largest absolute difference of the probabilities, over the peers | "
             f"{r['max_prob_diff']:.1e} | " + " | ".join("" for _ in peers)
             + f" | – | ≤ 1e-5 | {target_verdict(r['max_prob_diff'], 1e-5, at_least=False)} |"]
    note = (f"MLP 64-100-100-10 ({r['n_params']:,} parameters) trained briefly on digits, "
            f"a subnet of {r['subnet_size']} parameters, the GGN on {r['fit_on']} digits; wall "
            "seconds. The "
            "unfiltered selection rule picks the same variances as laplace-torch: "
            f"{'yes' if r['same_selected_variances_as_peer'] else 'no'}.")
    return ("\n".join(lines) + "\n\n" + note + "\n\n"
            + run_source("subnet_laplace.jsonl", r, count))


def fedsi_table(records: list[dict] | None = None) -> str:
    """``bench/fedsi.py``: one FedSI client's subnet Laplace at the paper's MNIST size against
    laplace-torch's ``FullSubnetLaplace`` per backend, with issue 13's targets, and one
    round's split (``--quick`` runs are left out)."""
    r, count = _newest_run("fedsi.jsonl", records, keep=lambda r: not r.get("quick"))
    if r is None:
        return _none_yet("fedsi.jsonl")
    peers = list(r["peer_fit_s"])
    fastest_fit = min(r["peer_fit_s"].values())
    head = ("| figure (CPU-s unless said) | ours | " + " | ".join(
        f"laplace-torch {p}" for p in peers) + " | fastest peer / ours | target | verdict |")
    dashes = "|---|---|" + "---|" * len(peers) + "---|---|---|"

    def cells(key: str, digits: int) -> str:
        return " | ".join(f"{r[key][p]:.{digits}f}" for p in peers)

    blank = " | ".join("" for _ in peers)
    peak = r["peak_mib"]
    lines = [head, dashes,
             "| fit, steady state (median of the 2nd-4th calls of a process; older runs: the "
             f"2nd) | {r['fit_s']:.3f} | "
             f"{cells('peer_fit_s', 3)} | {r['fit_ratio']:.1f}x | ≥ 5x | "
             f"{target_verdict(r['fit_ratio'], 5)} |",
             f"| fit, first call of a process | {r['fit_cold_s']:.3f} | "
             f"{cells('peer_fit_cold_s', 3)} | {r['fit_ratio_first_call']:.1f}x | – | "
             "– (no target) |",
             f"| fit and FedSI's marginal standard deviations | "
             f"{r['fit_s'] + r['marginal_s']:.3f} | {blank} | "
             f"{r['fit_ratio_with_marginals']:.1f}x (against the peer's fit, "
             f"{fastest_fit:.3f}) | – | – (no target) |",
             f"| GLM-probit predictive of {r['n_test']:,} inputs | {r['predict_s']:.3f} | "
             f"{cells('peer_predict_s', 2)} | {r['predict_ratio']:.0f}x | ≥ 50x | "
             f"{target_verdict(r['predict_ratio'], 50)} |",
             f"| peak memory of the fits and the predictive (MiB) | {peak['ours']:,.0f} | "
             + " | ".join(f"{peak.get(f'laplace-torch {p}', float('nan')):,.0f}"
                          for p in peers) + " | – | printed | – |",
             f"| largest absolute difference of the probabilities: the paper's prior / "
             f"prior precision 1 | {r['max_prob_diff_paper_prior']:.1e} / "
             f"{r['max_prob_diff_prior_precision_1']:.1e} | {blank} | – | ≤ 1e-5 | "
             f"{target_verdict(r['max_prob_diff'], 1e-5, at_least=False)} |"]
    split = r["round"]
    note = (f"MLP 784-100-10, a subnet of {r['subnet_size']:,} parameters (5% of the body), "
            f"{r['n_train']} training inputs "
            f"({r['data']}); subnet selection {r['select_s']:.3f} CPU-s. At the paper's prior "
            "(variance 1e-4) the GLM predictive differs from the MAP softmax by at most "
            f"{r['max_glm_vs_map']['paper_prior']:.1e}, at prior precision 1 by "
            f"{r['max_glm_vs_map']['prior_precision_1']:.3f}. One FedSI round of "
            f"{split['clients']} clients: {split['round']:.1f} CPU-s = local training "
            f"{split['local_training']:.1f} + selection {split['selection']:.1f} + the upload's "
            f"standard deviations {split['laplace_fit']:.1f} + messages {split['messages']:.2f}; "
            "upload "
            f"{split['upload_bytes_per_client']:,} bytes per client.")
    return "\n".join(lines) + "\n\n" + note + "\n\n" + run_source("fedsi.jsonl", r, count)


CALIBRATION_TARGETS = {"ours ece+mce+brier (3 calls)": 10.0, "ours evaluate (1 call)": 20.0}


def calibration_table(records: list[dict] | None = None) -> str:
    """``bench/calibration.py``: ECE + MCE + Brier against netcal's ECE + MCE on the same
    probabilities, each contender's best of the interleaved rounds, with issue 2's targets."""
    r, count = _newest_run("calibration.jsonl", records)
    if r is None:
        return _none_yet("calibration.jsonl")
    times = r["times_s"]
    netcal = min(times["netcal ECE+MCE"])
    lines = ["| contender | best (s) | median (s) | netcal / this | target | verdict |",
             "|---|---|---|---|---|---|"]
    for name, values in times.items():
        ratio = netcal / min(values)
        target = CALIBRATION_TARGETS.get(name)
        lines.append(f"| {name} | {min(values):.4f} | {statistics.median(values):.4f} | "
                     f"{ratio:.1f}x | " + (f"≥ {target:g}x | {target_verdict(ratio, target)}"
                                           if target else "– | – (no target)") + " |")
    lines.append(f"| floor: one read of the array (`probs.sum()`) | {r['floor_s']:.4f} | – | "
                 f"{netcal / r['floor_s']:.1f}x | – | – |")
    native, sweep = min(times["ours evaluate (1 call)"]), min(times[
        "ours evaluate, torch sweep"])
    note = (f"{r['rows']:,} x {r['classes']} float32 probabilities, {r['bins']} bins, best of "
            f"{r['rounds']} interleaved rounds (wall seconds); native sweep: "
            f"{r['native_sweep']}. One `evaluate` call costs {native / r['floor_s']:.1f} reads "
            f"of the array; the torch sweep (CUDA tensors, or no C compiler) takes "
            f"{sweep / native:.1f}x the native kernel's time on this CPU. ECE against netcal's: "
            f"absolute difference {r['ece_abs_diff_vs_netcal']:.1e}; MCE "
            f"{r['mce_abs_diff_vs_netcal']:.1e}.")
    runs = read_jsonl(RESULTS / "calibration.jsonl") if records is None else records
    every = ""
    if len(runs) > 1:  # the ratio moves with the machine's load: every stored run beside it
        rows = ["| run (commit, date) | load before (1 min) | netcal (s) | 3 calls | 1 call |",
                "|---|---|---|---|---|"]
        for run in runs:
            best = {name: min(values) for name, values in run["times_s"].items()}
            rows.append(f"| {run.get('commit', '?')}, {run.get('date', '?')} | "
                        f"{run.get('load_before', [math.nan])[0]:.2f} | "
                        f"{best['netcal ECE+MCE']:.4f} | "
                        f"{best['netcal ECE+MCE'] / best['ours ece+mce+brier (3 calls)']:.1f}x | "
                        f"{best['netcal ECE+MCE'] / best['ours evaluate (1 call)']:.1f}x |")
        every = ("Every stored run, netcal's best time over each of ours (the targets: 10x and "
                 "20x):\n\n" + "\n".join(rows) + "\n\n")
    return ("\n".join(lines) + "\n\n" + note + "\n\n" + every
            + run_source("calibration.jsonl", r, count))


SCALE_SPLIT = ("local_training", "evaluation", "messages", "aggregation", "checkpoint", "other")
#: Issue 28's targets at 16,000 clients: seconds a round after round 0, and the peak resident
#: memory when it was filed ("no more memory than now": 4.2 GB).
SCALE_ROUND_S, SCALE_PEAK_GB = 8.0, 4.2


def simulate_scale_table(records: list[dict] | None = None) -> str:
    """``bench/simulate_scale.py``: seconds a round after round 0 and their split at 16,000
    clients against the same run at 4,000, peak memory and the finished run's tail, with
    issue 28's targets."""
    r, count = _newest_run("simulate_scale.jsonl", records)
    if r is None:
        return _none_yet("simulate_scale.jsonl")
    lines = ["| clients | s a round after round 0 (mean) | slowest | CPU s | "
             + " | ".join(k.replace("_", " ") for k in SCALE_SPLIT)
             + " | peak RSS (GB) | result file written (s) | `load_run` (s) |",
             "|---|---|---|---|" + "---|" * len(SCALE_SPLIT) + "---|---|---|"]
    for clients, rounds, peak, save, load in (
            (r["peer_clients"], r["peer_rounds"], r["peer_peak_rss_gb"],
             r["peer_save_result_s"], r["peer_load_run_s"]),
            (r["clients"], r["rounds"], r["peak_rss_gb"], r["save_result_s"],
             r["load_run_s"])):
        after = [x for x in rounds if x["round"] >= 1]
        lines.append(f"| {clients:,} | {statistics.fmean(x['total'] for x in after):.2f} | "
                     f"{max(x['total'] for x in after):.2f} | "
                     f"{statistics.fmean(x['cpu'] for x in after):.2f} | "
                     + " | ".join(f"{statistics.fmean(x[k] for x in after):.2f}"
                                  for k in SCALE_SPLIT)
                     + f" | {peak:.2f} | {save:.2f} | {load:.2f} |")
    factor = r["clients"] / r["peer_clients"]
    checks = ["| claim | figure | verdict |", "|---|---|---|",
              f"| at most {SCALE_ROUND_S:g} s a round after round 0 at {r['clients']:,} clients "
              f"(issue 28) | {r['seconds_per_round']:.2f} s (slowest "
              f"{r['slowest_round']:.2f} s) | "
              f"{target_verdict(r['seconds_per_round'], SCALE_ROUND_S, at_least=False)} |",
              f"| no more memory than when issue 28 was filed ({SCALE_PEAK_GB:g} GB) | "
              f"{r['peak_rss_gb']:.2f} GB | "
              f"{target_verdict(r['peak_rss_gb'], SCALE_PEAK_GB, at_least=False)} |",
              f"| a round's cost against {r['peer_clients']:,} clients' ({factor:g}x the clients;"
              f" {factor:g} is linear) | {r['scaling']:.2f}x | – (a measurement) |",
              f"| `load_run` against {r['peer_clients']:,} clients' ({factor:g} is linear) | "
              f"{r['load_run_s'] / r['peer_load_run_s']:.2f}x | – (a measurement) |"]
    scale = r.get("feature_scale", "heldout (FedLog's default; not recorded)")
    scale = f"{scale:g}" if isinstance(scale, float) else scale
    note = (f"FedLog (`feature_scale` {scale}; issue 28's target was set at 1) on MNIST-1D, "
            "10 samples a client, `shards:2`, `mlp:100` body with 32 "
            "features, 1 local epoch, 2 rounds after round 0, checkpoints on, batched clients, "
            f"huge pages {'on' if r['huge_pages'] else 'off'}; each run in its own process "
            f"(wall seconds; CPU s: the process's); final accuracy {r['accuracy']:.4f}.")
    return ("\n".join(lines) + "\n\n" + "\n".join(checks) + "\n\n" + note + "\n\n"
            + run_source("simulate_scale.jsonl", r, count))


FLOWER_SPLIT = ("before_push", "pull_and_spawn", "flower_start", "import", "setup",
                "evaluate_and_fit", "save_and_encode", "reply", "after_last_reply", "rest")
#: Issue 28's target: a Flower round within this many simulator rounds for the same work.
FLOWER_TARGET = 8.0


def _flower_key(part: str) -> str:
    """The record's key of a split part, as bench/flower.py names it (``flower_start`` ->
    ``flower_start_s``, ``import`` -> ``flower_import_s``)."""
    return f"flower_{part.removeprefix('flower_')}_s"


def flower_table(records: list[dict] | None = None) -> str:
    """``bench/flower.py``: a Flower round on loopback against the simulator's round for the
    same work, its split along the critical path and Flower's own floor, with issue 28's
    target."""
    r, count = _newest_run("flower.jsonl", records)
    if r is None:
        return _none_yet("flower.jsonl")
    sim = r["simulator_round_s"]
    same_ece = r["ece_simulator"] == r["ece_flower"]
    lines = ["| figure | seconds | / simulator round | target | verdict |",
             "|---|---|---|---|---|",
             f"| simulator round (median of both runs' rounds) | {sim:.3f} | 1.0x | – | – |",
             f"| Flower round (median of its {len(r.get('rows', [])) or r['rounds']} rounds) | "
             f"{r['flower_round_s']:.2f} | {r['ratio_flower_over_simulator']:.1f}x | "
             f"≤ {FLOWER_TARGET:g}x | "
             f"{target_verdict(r['ratio_flower_over_simulator'], FLOWER_TARGET, False)} |",
             f"| Flower's own floor: its {PULL_SLEEP_S:g} s pull sleep and a fresh "
             f"`flwr-clientapp` process ({r['flower_process_alone_s']:.2f} s alone) | "
             f"{r['flower_floor_s']:.2f} | {r['ratio_flower_floor_over_simulator']:.1f}x | – | "
             f"– (Flower's, below any ClientApp) |",
             f"| that floor and a torch ClientApp's imports "
             f"({r['client_import_alone_s']:.2f} s alone) | "
             f"{r['flower_floor_with_torch_s']:.2f} | "
             f"{r['ratio_flower_floor_with_torch_over_simulator']:.1f}x | – | – |",
             f"| pooled ECE, simulator and Flower | {r['ece_simulator']:.6f} and "
             f"{r['ece_flower']:.6f} | – | equal | "
             f"{'holds' if same_ece else 'does not hold'} |"]
    split = ["| " + " | ".join(k.replace("_", " ") for k in FLOWER_SPLIT) + " | message CPU s |",
             "|" + "---|" * (len(FLOWER_SPLIT) + 1),
             "| " + " | ".join(f"{r[_flower_key(k)]:.2f}" for k in FLOWER_SPLIT)
             + f" | {r['flower_message_cpu_s']:.2f} |"]
    note = (f"`{r['strategy']}` on digits, {r['clients']} clients (iid, seed 0), {r['rounds']} "
            f"rounds, one message a client a round; a SuperLink and {r['clients']} SuperNodes "
            "on 127.0.0.1 (wall seconds). The split (medians over the rounds) follows each "
            "round's critical path, the message whose reply came last; the nodes' message "
            "processes share the machine's cores.")
    return ("\n".join(lines) + "\n\nA Flower round's split (s):\n\n" + "\n".join(split)
            + "\n\n" + note + "\n\n" + run_source("flower.jsonl", r, count))


#: bench/flower.py's PULL_SLEEP (flwr 1.41's SuperNode sleep after an empty pull), repeated here
#: so that the tables do not import Flower; tests/bench/test_published_tables.py checks both agree.
PULL_SLEEP_S = 3.0


# --- Mutation scores (tools/mutation.py) ----------------------------------------------------

#: The order of a module's rows: the full run, then samples, then retests.
MUTATION_KINDS = ("full", "sample", "retest")


def _mutation_run(r: dict) -> str:
    """What was run: the whole module, or which sample (of how many mutants), and whether the
    run was a retest of the last run's survivors or a resumed one."""
    text = "every mutant" if r["sample_size"] is None else (
        f"sample of {r['sample_size']} of {r['population']}, seed {r['seed']}")
    if r["kind"] == "retest":
        text = f"retest of the survivors ({text})"
    return text + (" (resumed: wall time of the resumed part)" if r.get("resumed") else "")


def _mutation_counts(r: dict) -> tuple[str, str]:
    """The killed cell (timeouts and crashes count as killed, said so) and the survived cell:
    the survivors less the listed equivalents (which have a column of their own), mutants
    that no selected test calls included and said so."""
    killed = str(r["detected"])
    extra = [f"{r[k]} {name}" for k, name in (("timeout", "timeouts"), ("crashed", "crashed"))
             if r[k]]
    if extra:
        killed += f" (incl. {', '.join(extra)})"
    survived = str(r["survived"] + r["no_tests"] - r["equivalent"])
    if r["no_tests"]:
        survived += f" (incl. {r['no_tests']} no tests)"
    return killed, survived


def mutation_table(records: list[dict] | None = None) -> str:
    """docs/development.md's mutation scores: the newest run of each (module, kind, sample size,
    seed) in ``bench/results/mutation.jsonl``, by module, full runs first. The score is killed
    / (total - equivalent), with the 95% Wilson interval for a sample (a full run's score is
    the module's own); a retest's counts are the whole run's after its survivors were rerun."""
    records = read_jsonl(RESULTS / "mutation.jsonl") if records is None else records
    newest: dict[tuple, dict] = {}
    for r in records:  # a later line of the same key replaces an earlier one
        newest[(r["module"], r["kind"], r["sample_size"], r["seed"])] = r
    if not newest:
        return _none_yet("mutation.jsonl")
    rows = sorted(newest.values(), key=lambda r: (r["module"], MUTATION_KINDS.index(r["kind"]),
                                                  r["sample_size"] or 0, r["seed"] or 0))
    lines = ["| module | run | covering tests | killed | survived | equivalent (excluded) | "
             "score (95% interval) | wall time | commit, date |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        killed, survived = _mutation_counts(r)
        score = f"{r['detected']} / {r['scored']} = {100 * r['score']:.1f}%"
        if r["ci95"] is not None:
            score += f" ({100 * r['ci95'][0]:.1f}-{100 * r['ci95'][1]:.1f})"
        worktree = "" if r["worktree"] == "clean" else f" ({r['worktree']})"
        tests = " ".join(f"`{t}`" for t in r["tests"])
        lines.append(f"| `{r['module']}` | {_mutation_run(r)} | {tests} | {killed} | {survived} | "
                     f"{r['equivalent']} | {score} | {r['wall_s'] / 60:.1f} min | "
                     f"{r['commit']}{worktree}, {r['date']} |")
    return "\n".join(lines) + "\n\n" + source_line("mutation.jsonl", rows)


TABLES = {"s1_shift": s1_shift_table, "s1_shift_readme": s1_shift_readme_table,
          "s1_verdict": s1_verdict_table,
          "s1_cost": s1_cost_table, "head_speed": head_speed_table,
          "head_exact": head_exact_table, "head_prior": head_prior_table,
          "heads_calibration": heads_calibration_table,
          "temperature_scaling": temperature_scaling_table,
          "conformal_methods": conformal_methods_table,
          "fedlog_vs_fedavg": fedlog_vs_fedavg_table,
          "fedlog_vs_fedavg_readme": fedlog_vs_fedavg_readme_table,
          "fedlog_checks": fedlog_checks_table,
          "dp_price": dp_price_table, "dp_price_10": dp_price_10_table,
          "dp_checks": dp_checks_table,
          "fedpart_one_cycle": fedpart_table, "fedpart_full": fedpart_full_table,
          "colearn_10": colearn_table, "s1_h200_readme": s1_h200_readme_table,
          "s1_conformal": s1_conformal_table, "s1_full": s1_full_table,
          "s1_curves": s1_curves_table, "seeds_colearn": seeds_colearn_table,
          "seeds_relay": seeds_relay_table, "seeds_fedpart": seeds_fedpart_table,
          "seeds_fedlog": seeds_fedlog_table, "seeds_verdicts": seeds_verdicts_table,
          "conjugate": conjugate_table, "subnet_laplace": subnet_laplace_table,
          "fedsi": fedsi_table, "calibration": calibration_table,
          "simulate_scale": simulate_scale_table, "flower": flower_table,
          "mutation": mutation_table}


def render(page: str) -> str:
    """``page`` with every table block regenerated from the caches."""
    return BLOCK.sub(lambda m: m.group(1) + TABLES[m.group(2)]() + m.group(4), page)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true",
                        help="rewrite the blocks of " + ", ".join(p.name for p in PAGES))
    args = parser.parse_args()
    if args.write:
        for page in PAGES:
            page.write_text(render(page.read_text()))
    for name, table in TABLES.items():
        print(f"<!-- table:{name} -->\n{table()}<!-- /table -->\n")


if __name__ == "__main__":
    main()
