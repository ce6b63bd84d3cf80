"""Time per round of FedLog with 1,000 clients on MNIST-1D: batched (vmap) vs a plain loop.

Both runs use the same configuration (1,000 clients, ``shards:2`` of 10,000 generated MNIST-1D
samples, one shared ``mlp:100`` body with 32 features, 5 local epochs of Adam, batch 10), in
one process. The batched run stacks the clients' parameters and trains all of them with one
``vmap(grad(functional_call))`` per step; the peer trains client after client. Reported: the
mean wall time of the training rounds (local updates, encoding / decoding / validating every
message, aggregation, and the calibration evaluation of all 1,000 clients, which is the same
work in both runs) and of their local-update phase alone, and the ratios plain / batched:
``batched_speedup`` is the whole-round ratio, ``local_update_speedup`` the local-training one.
The final heads of the two runs agree to float rounding (checked and printed).

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
                    dataset_options={"num_samples": args.samples})
    # warm-up: the first vmap call of a process pays a one-off setup cost
    simulate("fedlog", **{**settings, "clients": 20, "rounds": 1,
                          "data": load_dataset("mnist1d", seed=0, num_samples=400),
                          "dataset_options": {"num_samples": 400}})
    results = {}
    for label, batched in (("batched (vmap)", True), ("plain loop", False)):
        r = simulate("fedlog", batched=batched, **settings)
        training = [m for m in r.metrics if m["round"] >= 1]
        print(f"{label}: seconds per round {[round(m['seconds'], 2) for m in r.metrics]}, "
              f"local updates {[round(m['seconds_local_updates'], 2) for m in r.metrics]}",
              flush=True)
        results[label] = {
            "round": statistics.fmean(m["seconds"] for m in training),
            "local": statistics.fmean(m["seconds_local_updates"] for m in training),
            "accuracy": r.summary["accuracy"],
            "head": r.state["head"],
        }
    b, p = results["batched (vmap)"], results["plain loop"]
    head_gap = float((b["head"] - p["head"]).abs().max() / p["head"].abs().max())
    print(f"FedLog, {args.clients} clients, MNIST-1D ({args.samples} samples, shards:2), "
          f"mlp:100 -> 32 features, 5 local epochs, {args.rounds} training rounds\n")
    print("| local training | seconds per round | seconds of local updates per round | "
          "final accuracy |")
    print("|---|---|---|---|")
    for label, v in results.items():
        print(f"| {label} | {v['round']:.2f} | {v['local']:.2f} | {v['accuracy']:.4f} |")
    speedup = p["round"] / b["round"]
    local_speedup = p["local"] / b["local"]
    print(f"\nbatched speedup per round: {speedup:.1f}x (local updates alone: "
          f"{local_speedup:.1f}x); heads agree to {head_gap:.1e} relative")
    print(json.dumps({"clients": args.clients, "batched_seconds_per_round": b["round"],
                      "plain_seconds_per_round": p["round"], "batched_speedup": speedup,
                      "local_update_speedup": local_speedup, "head_relative_gap": head_gap}))


if __name__ == "__main__":
    main()
