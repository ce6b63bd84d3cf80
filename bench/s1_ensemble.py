"""S1 under shift, the federated deep ensemble (issue 40): M = 5 independently seeded runs of a
point-estimate method on the same clients, predictive averaged — the standard uncertainty
anchor beside the posterior strategies of ``bench/s1_shift.py``.

S1 as in `bench.s1_shift`: ``mnist-5k``, 10 clients, ``labels:5:train=50``, MLP 784-100-10
(``mlp``, feature width 100), batch 50, lr 1e-3, full participation, ``--rounds`` (30) rounds of
``--epochs`` (5) local epochs, one thread. For each data seed, `bayesfl.simulate_ensemble`
runs the members with ``data_seed`` = that seed (member 0 is the single run of that seed, the
others take seeds derived from it), and `bayesfl.evaluate_shift` scores the ensemble's
mean predictive on every client's own test rows clean and rotated by 30 and 60 degrees, and the
unseen-label rows against the client's own (AUROC of the entropy, and of the members' mutual
information). Each member is scored alone too (``members``: the single-model figures beside the
ensemble's, the first being the plain run of that seed).

One JSON line per (method, seed) is appended to ``--cache`` (default
``bench/results/s1_shift.jsonl``) in the format of ``bench/s1_shift.py`` (``label``,
``strategy``, ``options``, ``seed``, ``rounds``, ``epochs``, ``summary``: the ensemble's clean
pooled figures and the members' bytes summed, ``map_plugin``: None (an ensemble has no
plug-in), ``shift``, ``seconds``) plus ``members`` (M), ``member_seeds``, ``data_seed`` and
``member_figures``; a (label, seed, rounds) already there is skipped.

Usage: ``python bench/s1_ensemble.py [--methods fedavg-ft,fedbabu] [--seeds 0,1,2]
[--members 5] [--rounds 30]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path[0] = str(Path(__file__).resolve().parents[1])

from bayesfl.ensemble import simulate_ensemble  # noqa: E402
from bayesfl.shift_evaluation import evaluate_shift  # noqa: E402
from bench.fedsi_small import COMMON  # noqa: E402
from bench.run_cache import read_jsonl  # noqa: E402

LABELS = {"fedavg-ft": "FedAvg-FT", "fedbabu": "FedBABU"}
SHIFTS = [("rotate", [30, 60])]
OOD = ["unseen-labels"]


def figures(report) -> dict:
    """Pooled accuracy/NLL/ECE/Brier per (severity, predictive), the unseen-label AUROC of the
    entropy per predictive and (where drawn) of the mutual information."""
    out: dict = {}
    for row in report.rows("shift", scope="pooled"):
        where = "clean" if row["shift"] == "none" else f"{row['severity']:g}"
        out[f"{row['predictive']}/{where}"] = {k: float(row[k])
                                               for k in ("accuracy", "nll", "ece", "brier")}
    for row in report.rows("ood", scope="pooled"):
        if row["score"] in ("entropy", "mutual_information"):
            out[f"{row['predictive']}/auroc_{row['score']}"] = float(row["auroc"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="fedavg-ft,fedbabu")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--members", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--cache", default="bench/results/s1_shift.jsonl")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cache = Path(args.cache)
    done = {(r["label"], r["seed"], r["rounds"]) for r in read_jsonl(cache)}
    for seed in [int(s) for s in args.seeds.split(",")]:
        for strategy in args.methods.split(","):
            label = f"{LABELS.get(strategy, strategy)} ensemble (M = {args.members})"
            if (label, seed, args.rounds) in done:
                print(f"{label} seed {seed}: cached", flush=True)
                continue
            t0 = time.perf_counter()
            ens = simulate_ensemble(args.members, strategy=strategy, rounds=args.rounds,
                                    seed=seed, data_seed=seed, local_epochs=args.epochs,
                                    lr=1e-3, **COMMON)
            train_s = time.perf_counter() - t0
            report = evaluate_shift(ens, shifts=SHIFTS, ood=OOD, progress=False)
            member_figures = [figures(evaluate_shift(run, shifts=SHIFTS, ood=OOD,
                                                     posterior_samples=0, progress=False))
                              for run in ens.members]
            shift = figures(report)
            info = ens.summary
            record = {"label": label, "strategy": strategy, "options": {}, "seed": seed,
                      "rounds": args.rounds, "epochs": args.epochs,
                      "summary": {**shift["predictive/clean"],
                                  "bytes_up": float(info["bytes_up"]),
                                  "bytes_down": float(info["bytes_down"])},
                      "map_plugin": None, "shift": shift, "chosen": [],
                      "members": args.members, "member_seeds": ens.seeds,
                      "data_seed": info["data_seed"], "member_figures": member_figures,
                      "seconds": round(time.perf_counter() - t0, 1),
                      "train_seconds": round(train_s, 1)}
            with cache.open("a") as f:
                f.write(json.dumps(record) + "\n")
            single = member_figures[0]
            print(f"{label} seed {seed}: acc {shift['predictive/clean']['accuracy']:.4f} NLL "
                  f"{shift['predictive/clean']['nll']:.3f} 30deg "
                  f"{shift['predictive/30']['nll']:.3f} 60deg "
                  f"{shift['predictive/60']['nll']:.3f} AUROC entropy "
                  f"{shift['predictive/auroc_entropy']:.3f} MI "
                  f"{shift.get('predictive/auroc_mutual_information', float('nan')):.3f} | "
                  f"member 0: acc {single['predictive/clean']['accuracy']:.4f} NLL "
                  f"{single['predictive/clean']['nll']:.3f} 30deg "
                  f"{single['predictive/30']['nll']:.3f} 60deg "
                  f"{single['predictive/60']['nll']:.3f} AUROC "
                  f"{single['predictive/auroc_entropy']:.3f} ({record['seconds']:.0f} s)",
                  flush=True)


if __name__ == "__main__":
    main()
