"""CoLearn (representation sharing) against IL, FL, FD, FedProto and FedLog in the CoLearn
paper's MNIST setting (Berdoz et al. 2022, Table 1), scaled to this machine.

Setting: ``mnist-5k`` (5,000 real MNIST digits), 1,200 training images split over N = 2, 5
and 10 clients (``labels:10:train=120/N``: every client holds every class with 120/N
training images each, i.e. an IID split balanced per class), LeNet5-like bodies (d' = 84),
1 local epoch of Adam (lr 1e-3, batch 16) per round as in the paper. The paper reports every
client's personal model on the full 10k test set; here every client is scored on the same
*common* test set, the 3,800 mnist-5k images no client trains on (the clients' own held-out
samples, 5 per class, only feed the simulator's per-round log). Metrics: mean over clients
of accuracy, ECE (15 bins) and NLL on the common test set, and uplink and downlink bytes
per client per round (encoded messages, headers included; round 0 of CoLearn's bootstrap and
FedLog's statistics counted; downlink: the training broadcast a client receives, the
evaluation broadcast -- the same model again for FL -- not counted). Mean +- standard error
over seeds.

Methods: ``colearn`` (defaults: lam_kd 10 on the mean squared distance, lam_disc 1, n_avg
10, M = 1, the paper's downlink: prototypes plus M_down = 1 peer set, ``relay="sets"``),
``il`` = ``local-only`` (no communication), ``fl`` = ``fedavg`` (whole network
averaged), ``fd`` (per-class mean logits), ``fedproto``, ``fedlog``. Also a heterogeneous run
(clients alternate ``lenet5`` / ``cnn:16-32``, both d' = 84) for the methods that allow it,
and ablations at N = 5: the spec-literal KD (``kd_reduction="sum"``), no disc term, no KD
term, the whole-pool relay (``relay="pool"``), no class counts uploaded (``share_counts``).

The paper's figures (100 rounds, 10k test set) are printed beside ours; ratios against IL
and FL (the named peers) are measured in the same run. Last line: JSON.

Usage: ``python bench/colearn.py [--rounds 100] [--seeds 3] [--clients 2,5,10] [--groups
rows,heterogeneous,ablation] [--quick] [--cache bench/results/colearn.jsonl] [--budget
SECONDS] [--jobs K]`` (``--quick``: 1 seed, 3 rounds, N = 5 only; ``--cache``: one JSON line
per finished run, keyed by its settings, so an interrupted bench continues where it stopped
(`bench.run_cache`); ``--budget`` starts no run after that many seconds; ``--jobs``: runs
in K processes of one torch thread). Runs go seed by seed, N = 10 first, the main rows before
the heterogeneous and ablation runs. The defaults are the paper's protocol (100 rounds, N = 2,
5, 10, 3 seeds); ``docs/seeds.md`` says what of it was run and where.

Cost (measured, 1 torch thread): a 100-round run took 29-54 s on a 16-core Xeon running 16
runs at once (N = 10 the dearest), about 9x that on the shared 2-core development machine;
the main grid is 54 runs (36 for the paper's four methods), 72 with the extra groups.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

# `python bench/x.py` puts bench/ first on sys.path, where bench/calibration.py would shadow the
# calibration package: use the repository root instead.
sys.path[0] = str(Path(__file__).resolve().parents[1])

from bayesfl.data.datasets import load_dataset  # noqa: E402
from bayesfl.simulate import simulate  # noqa: E402
from bench.run_cache import provenance, run_cached  # noqa: E402
from calibration.accumulator import Accumulator  # noqa: E402

PAPER = {  # Table 1, MNIST, average client test accuracy (%) after 100 rounds
    "colearn": {2: 94.19, 5: 90.63, 10: 82.07},
    "fl": {2: 92.64, 5: 86.79, 10: 70.06},
    "il": {2: 91.46, 5: 85.26, 10: 72.86},
    "fd": {2: 94.45, 5: 90.55, 10: 77.90},
}
METHODS = {
    "colearn": dict(strategy="colearn"),
    "il": dict(strategy="local-only"),
    "fl": dict(strategy="fedavg"),
    "fd": dict(strategy="fd"),
    "fedproto": dict(strategy="fedproto"),
    "fedlog": dict(strategy="fedlog", strategy_options={"feature_scale": 1}),  # the paper's s
}
HETEROGENEOUS = ("colearn", "il", "fd")
HETERO_BODY = "lenet5,cnn:16-32"
COMMON = dict(dataset="mnist-5k", feature_dim=84, local_epochs=1, lr=1e-3, batch_size=16,
              progress=False, threads=1)
TRAIN_IMAGES = 1200
ABLATIONS = {  # issue 29's options first: an interrupted bench has them
    "colearn, whole-pool relay (relay = pool)": {"relay": "pool"},
    "colearn, no class counts uploaded (share_counts = false)": {"share_counts": False},
    "colearn, KD summed over d' (spec-literal)": {"kd_reduction": "sum"},
    "colearn without the disc term (lam_disc = 0)": {"lam_disc": 0.0},
    "colearn without the KD term (lam_kd = 0)": {"lam_kd": 0.0}}
DATASET: list = []  # the process's mnist-5k, loaded once (a run in a worker process too)


def common_test(result, dataset) -> tuple[torch.Tensor, torch.Tensor]:
    """The images no client trains on (every client is scored on all of them)."""
    used = np.concatenate([c.data.train_indices for c in result.clients])
    assert len(used) == TRAIN_IMAGES == len(np.unique(used))
    rest = np.setdiff1d(np.arange(len(dataset.y)), used)
    return dataset.x[rest], dataset.y[rest]


def score(result, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """Mean over clients of accuracy, ECE and NLL on (x, y)."""
    per_client = []
    for k in range(len(result.clients)):
        probs = result.predict_proba(k, x)
        per_client.append(Accumulator(15).update(probs, y).compute())
    return {m: statistics.fmean(c[m] for c in per_client) for m in ("accuracy", "ece", "nll")}


def run(method: str, n: int, seed: int, rounds: int, body: str = "lenet5",
        options: dict | None = None) -> dict[str, float]:
    """One run's scores on the common test set, bytes up and down per client and round."""
    if not DATASET:
        DATASET.append(load_dataset("mnist-5k", seed=0))
    dataset = DATASET[0]
    t0 = time.perf_counter()
    config = dict(METHODS[method])
    options = {**config.pop("strategy_options", {}), **(options or {})}
    result = simulate(clients=n, partition=f"labels:10:train={TRAIN_IMAGES // (10 * n)}:test=5",
                      rounds=rounds, seed=seed, body=body, **COMMON, **config,
                      strategy_options=options)
    x, y = common_test(result, dataset)
    out = score(result, x, y)
    upload_rounds = len(result.metrics)  # round 0 included where a strategy has one
    out["bytes_up_per_client_round"] = result.summary["bytes_up"] / (n * upload_rounds)
    # every client takes part in every round: the training broadcast reaches all n of them
    out["bytes_down_per_client_round"] = result.summary["bytes_down"] / (n * upload_rounds)
    out["rejected"] = result.summary["rejected_uploads"]
    out["seconds"] = round(time.perf_counter() - t0, 1)
    out["protocol"] = {**{k: v for k, v in COMMON.items() if k != "progress"},
                       "method": method, "clients": n, "seed": seed, "rounds": rounds,
                       "body": body, "strategy_options": options,
                       "train_images": TRAIN_IMAGES}
    return out | provenance()


def mean_se(values: list[float]) -> tuple[float, float]:
    mean = statistics.fmean(values)
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
    return mean, se


def summarise(runs: list[dict[str, float]]) -> dict[str, float]:
    out = {}
    for key in ("accuracy", "ece", "nll", "bytes_up_per_client_round",
                "bytes_down_per_client_round", "seconds"):
        out[key], out[key + "_se"] = mean_se([r[key] for r in runs])
    out["rejected"] = sum(r["rejected"] for r in runs)
    return out


def table(rows: dict[str, dict[int, dict[str, float]]], ns: list[int]) -> str:
    lines = ["| method | N | accuracy % (paper) | ECE | NLL | uplink B / client / round | "
             "downlink B / client / round | s / run | seeds |",
             "|---|---|---|---|---|---|---|---|---|"]
    for label, by_n in rows.items():
        for n in ns:
            if n not in by_n:
                continue
            r = by_n[n]
            paper = PAPER.get(label, {}).get(n)
            lines.append(
                f"| {label} | {n} | {100 * r['accuracy']:.2f} ± {100 * r['accuracy_se']:.2f}"
                f" ({paper if paper is not None else '-'}) | {r['ece']:.3f} | {r['nll']:.3f} | "
                f"{r['bytes_up_per_client_round']:,.0f} | "
                f"{r['bytes_down_per_client_round']:,.0f} | {r['seconds']:.0f} | {r['seeds']} |")
    return "\n".join(lines)


def plan(ns: list[int], seeds: int, groups: tuple[str, ...] = ("rows", "heterogeneous",
                                                                "ablation"),
         ) -> list[tuple[str, str, int, int, str, dict]]:
    """Every run as (group, label, N, seed, body, options): the main rows seed-major and
    N = 10 first, then the heterogeneous and ablation runs, so that an interrupted bench has
    every method at the first seeds (the cache keeps them)."""
    runs = []
    hetero_n, ablation_n = ns[-1], (5 if 5 in ns else ns[0])
    for seed in range(seeds):
        if "rows" in groups:
            for n in sorted(ns, reverse=True):
                runs += [("rows", label, n, seed, "lenet5", {}) for label in METHODS]
    for seed in range(seeds):
        if "heterogeneous" in groups:
            runs += [("heterogeneous", label, hetero_n, seed, HETERO_BODY, {})
                     for label in HETEROGENEOUS]
        if "ablation" in groups:
            runs += [("ablation", label, ablation_n, seed, "lenet5", options)
                     for label, options in ABLATIONS.items()]
    return runs


def run_key(group: str, label: str, n: int, seed: int, rounds: int) -> str:
    """The cache key of a run: its settings (the default relay is the paper's, relay=sets;
    runs of the whole-pool default before issue 29 were keyed without it)."""
    return f"{group}|{label}|{n}|{seed}|{rounds}|relay=sets"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--clients", default="2,5,10", help="the N to run, comma-separated")
    parser.add_argument("--groups", default="rows,heterogeneous,ablation")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help="the main rows' methods to run (the table shows every cached one)")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--ablations", default="",
                        help="run only the ablations whose label holds one of these "
                             "comma-separated words (e.g. relay,share_counts); empty: all")
    parser.add_argument("--quick", action="store_true", help="1 seed, 3 rounds, N = 5 only")
    parser.add_argument("--cache", type=Path, default=None,
                        help="JSON-lines file of finished runs: kept runs are not run again")
    parser.add_argument("--budget", type=float, default=float("inf"),
                        help="seconds after which no new run starts (the table reports the "
                             "finished ones and their seed counts)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # small models on a shared CPU: threads cost more than they gain
    rounds, seeds, ns = args.rounds, args.seeds, [int(n) for n in args.clients.split(",")]
    if args.quick:
        rounds, seeds, ns = 3, 1, [5]
    dataset = load_dataset("mnist-5k", seed=0)
    methods = set(args.methods.split(","))
    tasks = [(run_key(group, label, n, seed, rounds), run,
              ("colearn" if group == "ablation" else label, n, seed, rounds, body, options))
             for group, label, n, seed, body, options in plan(ns, seeds,
                                                               tuple(args.groups.split(",")))
             if (group != "rows" or label in methods)
             and (group != "ablation" or not args.ablations
                  or any(w in label for w in args.ablations.split(",")))]
    start = time.perf_counter()
    cache = run_cached(tasks, args.cache, jobs=args.jobs, budget=args.budget,
                       label=lambda key, r: f"{r['accuracy']:.4f}")
    seconds = time.perf_counter() - start
    grouped: dict[str, dict[str, dict[int, list[dict]]]] = {}
    for key, value in cache.items():
        group, label, n, _, r, _ = key.split("|")
        if int(r) == rounds and int(n) in ns:
            grouped.setdefault(group, {}).setdefault(label, {}).setdefault(int(n), []).append(
                value)
    tables = {g: {label: {n: {**summarise(v), "seeds": len(v)} for n, v in by_n.items()}
                  for label, by_n in rows.items()} for g, rows in grouped.items()}
    print(f"mnist-5k, {TRAIN_IMAGES} training images split over N clients, {rounds} rounds "
          f"(paper: 100), 1 local epoch, Adam 1e-3, batch 16, up to {seeds} seed(s); every "
          f"client scored on the {len(dataset.y) - TRAIN_IMAGES} common test images\n")
    titles = {"rows": "", "heterogeneous": "\nHeterogeneous bodies (lenet5 / cnn:16-32):\n",
              "ablation": "\nAblations:\n"}
    for group, title in titles.items():
        if group in tables:
            print(title + table(tables[group], ns))
    rows = tables.get("rows", {})
    gaps = {}
    for n in ns:
        if all(n in rows.get(m, {}) for m in ("colearn", "il", "fl", "fd")):
            gaps[n] = {f"colearn_minus_{m}": rows["colearn"][n]["accuracy"] - rows[m][n]["accuracy"]
                       for m in ("il", "fl", "fd")}
            gaps[n]["fl_over_colearn_uplink"] = (rows["fl"][n]["bytes_up_per_client_round"]
                                                 / rows["colearn"][n]["bytes_up_per_client_round"])
            gaps[n]["fl_over_colearn_downlink"] = (
                rows["fl"][n]["bytes_down_per_client_round"]
                / rows["colearn"][n]["bytes_down_per_client_round"])
    print(f"\n{seconds:.0f} s")
    print(json.dumps({"bench": "colearn", "rounds": rounds, "seeds": seeds, "clients": ns,
                      "seconds": round(seconds, 1), **tables, "gaps": gaps}))


if __name__ == "__main__":
    main()
