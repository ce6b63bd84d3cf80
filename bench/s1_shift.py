"""S1 (the FedSI paper's MNIST small regime) under shift: in-distribution, rotated and
unseen-label figures of a strategy's headline predictive and its MAP plug-in (issue 40).

S1: ``mnist-5k``, 10 clients, ``labels:5:train=50``, MLP 784-100-10 (``mlp``, feature width
100), batch 50, full participation, ``--rounds`` (30) rounds of ``--epochs`` (5) local epochs,
the learning rates of `bench.fedsi_small`. After training, `bayesfl.evaluate_shift`
scores every client's own test rows clean and rotated by 30 and 60 degrees (bilinear; the
uncovered corners filled with the data's minimum, the background: zero fill in pixel units),
and the rows of the labels a client never trained on against its own (unseen-label OOD,
AUROC of the predictive entropy). Pooled figures (every client's rows merged).

Usage: ``python bench/s1_shift.py --label NAME --strategy fedlog --options '{"feature_scale":
1}' --seeds 0,1,2 [--rounds 30] [--runs DIR] [--cache bench/results/s1_shift.jsonl]``. One
JSON line per seed is appended to the cache (a seed already there is skipped); ``--runs``
keeps every run directory (``DIR/LABEL/seed``) for later analysis (``bayesfl.load_run``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path[0] = str(Path(__file__).resolve().parents[1])

from bayesfl.shift_evaluation import evaluate_shift  # noqa: E402
from bayesfl.simulate import simulate  # noqa: E402
from bench.fedsi_small import COMMON  # noqa: E402
from bench.run_cache import read_jsonl  # noqa: E402

LR = {"fedsi": 1e-2, "fedsi-fac": 1e-2}
PREDICTIVES = ("predictive", "map_plugin")


def figures(report) -> dict:
    """Pooled accuracy/NLL/ECE/Brier per (severity, predictive) and the unseen-label AUROC of
    the entropy score per predictive."""
    out: dict = {}
    for row in report.rows("shift", scope="pooled"):
        where = "clean" if row["shift"] == "none" else f"{row['severity']:g}"
        key = f"{row['predictive']}/{where}"
        out[key] = {k: float(row[k]) for k in ("accuracy", "nll", "ece", "brier")}
    for row in report.rows("ood", scope="pooled", score="entropy"):
        out[f"{row['predictive']}/auroc_entropy"] = float(row["auroc"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", required=True)
    parser.add_argument("--strategy", default="fedlog")
    parser.add_argument("--options", default="{}")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--runs", default=None)
    parser.add_argument("--cache", default="bench/results/s1_shift.jsonl")
    args = parser.parse_args()
    torch.set_num_threads(1)
    options = json.loads(args.options)
    cache = Path(args.cache)
    done = {(r["label"], r["seed"], r["rounds"]) for r in read_jsonl(cache)}
    for seed in [int(s) for s in args.seeds.split(",")]:
        if (args.label, seed, args.rounds) in done:
            print(f"{args.label} seed {seed}: cached", flush=True)
            continue
        t0 = time.perf_counter()
        chosen: list[float] = []

        def on_round(r: int, record: dict, chosen=chosen) -> None:
            for key in ("feature_scale", "fedsi_alpha"):
                if key in record:
                    chosen.append(float(record[key]))

        out = None if args.runs is None else Path(args.runs) / args.label / str(seed)
        result = simulate(args.strategy, rounds=args.rounds, seed=seed,
                          local_epochs=args.epochs, lr=LR.get(args.strategy, 1e-3),
                          strategy_options=options, round_callback=on_round,
                          out=out, force=out is not None, **COMMON)
        train_s = time.perf_counter() - t0
        report = evaluate_shift(result, shifts=[("rotate", [30, 60])], ood=["unseen-labels"],
                                posterior_samples=0, progress=False)
        s = result.summary
        record = {"label": args.label, "strategy": args.strategy, "options": options,
                  "seed": seed, "rounds": args.rounds, "epochs": args.epochs,
                  "summary": {k: float(s[k]) for k in ("accuracy", "nll", "ece", "brier",
                                                        "bytes_up", "bytes_down")},
                  "map_plugin": ({k: float(s["map_plugin"][k])
                                  for k in ("accuracy", "nll", "ece", "brier")}
                                 if "map_plugin" in s else None),
                  "shift": figures(report), "chosen": chosen,
                  "seconds": round(time.perf_counter() - t0, 1),
                  "train_seconds": round(train_s, 1)}
        with cache.open("a") as f:
            f.write(json.dumps(record) + "\n")
        sh = record["shift"]
        print(f"{args.label} seed {seed}: acc {s['accuracy']:.4f} NLL {s['nll']:.3f} | "
              f"clean {sh['predictive/clean']['nll']:.3f} 30deg {sh['predictive/30']['nll']:.3f} "
              f"60deg {sh['predictive/60']['nll']:.3f} AUROC "
              f"{sh.get('predictive/auroc_entropy', float('nan')):.3f} "
              f"({record['seconds']:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
