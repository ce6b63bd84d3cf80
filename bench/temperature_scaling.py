"""Benchmark: federated temperature scaling at the end of a run (docs/calibration.md's table).

Setting: ``simulate("fedlog", "digits", clients=20, partition="shards:2", rounds=30,
seed=SEED, calibrate="temperature:0.2")``, every other option the default (the run that
``bayesfl run --strategy fedlog --dataset digits --clients 20 --partition shards:2 --rounds 30
--calibrate temperature`` makes). Each client holds out 20% of its training rows; after the
last round the server searches T over the clients' replies (summed held-out NLL, its two
derivatives in log T, a count) and the clients scale their headline predictive as
``p^(1/T)`` renormalised. Figures, from the run's ``summary["calibration"]``: T, the search's
steps, the held-out NLL before and after, and on the pooled test rows (every client's)
accuracy, ECE (15 bins, top label), NLL and Brier score before and after scaling; the step's
bytes up and down beside the whole run's.

Claims checked (docs/calibration.md): scaling lowers the pooled test NLL, the ECE and the Brier
score, per seed; the step's traffic is a small part of the run's.

Run: ``python bench/temperature_scaling.py [--seeds 0,1,2] [--rounds 30] [--out
bench/results/temperature_scaling.jsonl]`` (the table of docs/calibration.md is generated from
the newest record there). One intra-op thread. Prints a table, then, as its last line, one JSON
object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

# `python bench/x.py` puts bench/ first on sys.path, where bench/calibration.py would shadow the
# calibration package: use the repository root instead.
sys.path[0] = str(Path(__file__).resolve().parents[1])

from bayesfl.simulate import simulate  # noqa: E402
from bench.run_cache import append_result  # noqa: E402

SETTING = {"strategy": "fedlog", "dataset": "digits", "clients": 20, "partition": "shards:2",
           "calibrate": "temperature:0.2"}
FIGURES = ("accuracy", "ece", "nll", "brier")


def measure(seed: int, rounds: int) -> dict:
    """One run at ``seed``: its temperature step's figures."""
    t0 = time.perf_counter()
    result = simulate(SETTING["strategy"], SETTING["dataset"], clients=SETTING["clients"],
                      partition=SETTING["partition"], rounds=rounds, seed=seed,
                      calibrate=SETTING["calibrate"], progress=False, threads=1)
    summary = result.summary
    step = summary["calibration"]
    if step.get("error"):
        raise RuntimeError(f"seed {seed}: the temperature step failed: {step['error']}")
    return {"seed": seed, "temperature": step["temperature"], "at_bound": step["at_bound"],
            "steps": step["steps"], "held_out_samples": step["held_out_samples"],
            "held_out_nll_before": step["held_out_nll_before"],
            "held_out_nll_after": step["held_out_nll_after"],
            "test_rows": sum(c["count"] for c in summary["per_client"]),
            "before": {k: step["uncalibrated"][k] for k in FIGURES},
            "after": {k: step["calibrated"][k] for k in FIGURES},
            "step_bytes_up": step["bytes_up"], "step_bytes_down": step["bytes_down"],
            "run_bytes_up": summary["bytes_up"], "run_bytes_down": summary["bytes_down"],
            "seconds": round(time.perf_counter() - t0, 1)}


def print_table(rows: list[dict]) -> None:
    print("| seed | T | ECE before -> after | NLL before -> after | Brier before -> after | "
          "step bytes up / down | run bytes up |")
    for r in rows:
        b, a = r["before"], r["after"]
        print(f"| {r['seed']} | {r['temperature']:.2f} | {b['ece']:.4f} -> {a['ece']:.4f} | "
              f"{b['nll']:.3f} -> {a['nll']:.3f} | {b['brier']:.4f} -> {a['brier']:.4f} | "
              f"{r['step_bytes_up']:,} / {r['step_bytes_down']:,} | {r['run_bytes_up']:,} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--out", default=None,
                        help="append the record, with its provenance, to this file (e.g. "
                             "bench/results/temperature_scaling.jsonl: the table of "
                             "docs/calibration.md is generated from it)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    seeds = [int(s) for s in args.seeds.split(",")]
    load_before = os.getloadavg()
    rows = [measure(seed, args.rounds) for seed in seeds]
    print(f"FedLog on digits, {SETTING['clients']} clients, {SETTING['partition']}, "
          f"{args.rounds} rounds, calibrate={SETTING['calibrate']}\n")
    print_table(rows)
    append_result(args.out, {"bench": "temperature_scaling", **SETTING, "rounds": args.rounds,
                             "rows": rows}, seeds=seeds, load_before=load_before)
    print(json.dumps({f"seed{r['seed']}_{k}": r[k] for r in rows
                      for k in ("temperature", "step_bytes_up")}
                     | {f"seed{r['seed']}_{when}_{k}": r[when][k] for r in rows
                        for when in ("before", "after") for k in ("ece", "nll", "brier")}))


if __name__ == "__main__":
    main()
