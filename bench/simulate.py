"""Time per round of FedLog with 1,000 clients on MNIST-1D: batched (vmap) vs a plain loop.

Both runs use the same configuration (1,000 clients, ``shards:2`` of 10,000 generated MNIST-1D
samples, one shared ``mlp:100`` body with 32 features, 5 local epochs of Adam, batch 10), in
one process. The batched run stacks the clients' parameters and trains all of them with one
``vmap(grad(functional_call))`` per step, computes their upload statistics with one stacked
forward and one scatter, and evaluates them together (one stacked forward over every client's
test set, the per-client calibration sums in one vectorised scatter over (client, bin)); the
peer trains, computes statistics, predicts and scores client after client (one calibration
accumulator each). Both runs encode, decode and validate every upload as its own serialized
message and aggregate the same way (the server side does not depend on how clients ran).
Reported: the mean wall time of the training rounds, of their local-update phase and of their
evaluation phase, and the ratios plain / batched: ``batched_speedup`` is the whole-round
ratio, ``local_update_speedup`` the local-training one. The final heads of the two runs agree
to float rounding, and so do the per-client metrics (checked and printed; the largest gap is
that float rounding of training carried through the metrics, ~1e-5).

Usage: ``python bench/simulate.py [--clients 1000] [--rounds 2]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

# `python bench/x.py` puts bench/ first on sys.path, where bench/calibration.py would shadow the
# calibration package: use the repository root instead.
sys.path[0] = str(Path(__file__).resolve().parents[1])

from bayesfl.data.datasets import load_dataset  # noqa: E402
from bayesfl.simulate import simulate  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--samples", type=int, default=10_000)
    args = parser.parse_args()
    torch.set_num_threads(1)  # the same for both peers; small models on a shared CPU
    data = load_dataset("mnist1d", seed=0, num_samples=args.samples)
    settings = dict(dataset="mnist1d", clients=args.clients, partition="shards:2",
                    rounds=args.rounds, seed=0, body="mlp:100", feature_dim=32,
                    local_epochs=5, batch_size=10, lr=1e-3, progress=False, data=data,
                    dataset_options={"num_samples": args.samples}, threads=1)
    # warm-up: the first vmap call of a process pays a one-off setup cost
    simulate("fedlog", **{**settings, "clients": 20, "rounds": 1,
                          "data": load_dataset("mnist1d", seed=0, num_samples=400),
                          "dataset_options": {"num_samples": 400}})
    results = {}
    for label, batched in (("batched (vmap)", True), ("plain loop", False)):
        r = simulate("fedlog", batched=batched, **settings)
        training = [m for m in r.metrics if m["round"] >= 1]
        print(f"{label}: seconds per round {[round(m['seconds'], 2) for m in r.metrics]}, "
              f"local updates {[round(m['seconds_local_updates'], 2) for m in r.metrics]}, "
              f"evaluation {[round(m['seconds_evaluation'], 2) for m in r.metrics]}",
              flush=True)
        results[label] = {
            "round": statistics.fmean(m["seconds"] for m in training),
            "local": statistics.fmean(m["seconds_local_updates"] for m in training),
            "evaluation": statistics.fmean(m["seconds_evaluation"] for m in training),
            "accuracy": r.summary["accuracy"],
            "head": r.state["head"],
            "per_client": r.summary["per_client"],
        }
    b, p = results["batched (vmap)"], results["plain loop"]
    head_gap = float((b["head"] - p["head"]).abs().max() / p["head"].abs().max())
    metric_gap = max(abs(x[k] - y[k]) for x, y in zip(b["per_client"], p["per_client"],
                                                       strict=True)
                     for k in ("accuracy", "ece", "mce", "brier", "nll"))
    print(f"FedLog, {args.clients} clients, MNIST-1D ({args.samples} samples, shards:2), "
          f"mlp:100 -> 32 features, 5 local epochs, {args.rounds} training rounds\n")
    print("| clients | seconds per round | local updates | evaluation | final accuracy |")
    print("|---|---|---|---|---|")
    for label, v in results.items():
        print(f"| {label} | {v['round']:.2f} | {v['local']:.2f} | {v['evaluation']:.2f} | "
              f"{v['accuracy']:.4f} |")
    speedup = p["round"] / b["round"]
    local_speedup = p["local"] / b["local"]
    print(f"\nbatched speedup per round: {speedup:.1f}x (local updates alone: "
          f"{local_speedup:.1f}x); heads agree to {head_gap:.1e} relative, per-client metrics "
          f"to {metric_gap:.1e}")
    if metric_gap > 1e-3:  # training rounding moves the metrics slightly, not more
        raise SystemExit(f"batched and plain per-client metrics differ by {metric_gap:.1e}")
    print(json.dumps({"clients": args.clients, "batched_seconds_per_round": b["round"],
                      "plain_seconds_per_round": p["round"], "batched_speedup": speedup,
                      "local_update_speedup": local_speedup,
                      "evaluation_speedup": p["evaluation"] / b["evaluation"],
                      "head_relative_gap": head_gap, "per_client_metric_gap": metric_gap}))


if __name__ == "__main__":
    main()
