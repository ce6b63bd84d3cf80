"""Bayesian personalised-FL baselines (pFedBayes, FedPop, FedPA) beside FedPer, one run each.

The FedSI small regime of ``bench/fedsi_small.py`` (its ``COMMON`` settings: ``mnist-5k``,
10 clients x 5 labels by sliding window, 50 training images per label per client, the
784-100-10 MLP, batch 50, Adam), with pFedBayes at the paper's ``lr = 1e-4`` *and* at 1e-3
(1e-4 is far from converged at this machine's round counts), FedPop and FedPA at their
defaults, and FedPer (one local layer, lr 1e-3) as the named peer measured in the same run.
Per method: final-round client-mean accuracy, pooled ECE, MCE, Brier and NLL of the headline
predictive (the posterior predictive for the Bayesian ones), the MAP plug-in's accuracy, ECE
and NLL, the pooled mean confidence (top probability) of the predictive and of the plug-in
beside the pooled accuracy (confidence below accuracy: under-confident), uplink and downlink
bytes of the run (all clients; downlink: the training broadcasts), mean ± standard error
over seeds. The last line is JSON (rows and each method's accuracy
and NLL ratio to FedPer).

Variants beside the defaults: ``pfedbayes-paper-eps`` draws with the paper's ``eps ~ N(0, I)``
(``epsilon_std = 1``) instead of the reference code's ``N(0, 0.001^2)``; ``fedpa-paper-delta``
uploads the paper's unnormalised ``Delta`` (``normalize_delta = False``) with ``server_lr = 1``.

Usage: ``python bench/bayes_baselines.py [--seeds 3] [--rounds 20] [--epochs 5]
[--methods fedper,pfedbayes-1e-4,...] [--dataset digits --partition labels:5 --feature-dim 50]``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

# `python bench/x.py` puts bench/ first on sys.path, where bench/calibration.py would shadow the
# calibration package: use the repository root instead.
sys.path[0] = str(Path(__file__).resolve().parents[1])

from bayesfl.data.datasets import load_dataset  # noqa: E402
from bayesfl.simulate import simulate  # noqa: E402
from bayesfl.strategies.base import MAP_PLUGIN, PREDICTIVE  # noqa: E402

COMMON = dict(dataset="mnist-5k", clients=10, partition="labels:5:train=50", body="mlp",
              feature_dim=100, batch_size=50, progress=False, threads=1)
METHODS: dict[str, tuple[str, dict[str, Any], float]] = {
    "fedper": ("fedper", {"local_layers": 1}, 1e-3),
    "pfedbayes-1e-4": ("pfedbayes", {}, 1e-4),
    "pfedbayes-1e-3": ("pfedbayes", {}, 1e-3),
    "pfedbayes-paper-eps": ("pfedbayes", {"epsilon_std": 1.0}, 1e-3),
    "fedpop": ("fedpop", {}, 1e-3),
    "fedpa": ("fedpa", {}, 1e-3),
    "fedpa-paper-delta": ("fedpa", {"normalize_delta": False}, 1e-3),
}
KEYS = ("accuracy", "ece", "mce", "brier", "nll")


def confidences(result: Any) -> dict[str, float]:
    """Pooled mean top probability of the predictive and the plug-in, and pooled accuracy."""
    top, plug_top, hits = [], [], []
    for client in result.clients:
        cid = client.config.client_id
        x, y = client.data.test_x, client.data.test_y.cpu()
        probs = result.strategy.predict(client.config, result.client_state(cid),
                                        result.evaluation_broadcast, x)
        headline = probs[PREDICTIVE]
        plug = probs.get(MAP_PLUGIN, headline)
        top.append(headline.max(-1).values)
        plug_top.append(plug.max(-1).values)
        hits.append((headline.argmax(-1) == y).double())
    return {"confidence": float(torch.cat(top).mean()),
            "plugin_confidence": float(torch.cat(plug_top).mean()),
            "pooled_accuracy": float(torch.cat(hits).mean())}


def mean_se(values: list[float]) -> tuple[float, float]:
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
    return statistics.fmean(values), se


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--dataset", default=COMMON["dataset"],
                        help="e.g. digits (64-pixel images, far cheaper) on a loaded machine")
    parser.add_argument("--partition", default=COMMON["partition"])
    parser.add_argument("--feature-dim", type=int, default=COMMON["feature_dim"])
    args = parser.parse_args()
    COMMON.update(dataset=args.dataset, partition=args.partition, feature_dim=args.feature_dim)
    torch.set_num_threads(1)
    data = load_dataset(args.dataset)
    rows: dict[str, dict[str, Any]] = {}
    for label in [m.strip() for m in args.methods.split(",") if m.strip()]:
        strategy, options, lr = METHODS[label]
        runs = []
        for seed in range(args.seeds):
            start = time.perf_counter()
            result = simulate(strategy, rounds=args.rounds, seed=seed,
                              local_epochs=args.epochs, lr=lr, strategy_options=options,
                              data=data, **COMMON)
            s = result.summary
            plug = s.get("map_plugin", s)
            runs.append({**{k: float(s[k]) for k in KEYS}, "bytes_up": float(s["bytes_up"]),
                         "bytes_down": float(s["bytes_down"]),
                         "plugin_accuracy": float(plug["accuracy"]),
                         "plugin_ece": float(plug["ece"]),
                         "plugin_nll": float(plug["nll"]),
                         **confidences(result),
                         "seconds": time.perf_counter() - start})
            print(f"{label:15s} seed {seed}: " + " ".join(
                f"{k} {v:.4f}" for k, v in runs[-1].items() if not k.startswith("bytes")),
                flush=True)
        rows[label] = {k: mean_se([r[k] for r in runs]) for k in runs[0]}
        r = rows[label]
        print(f"| {label} | {100 * r['accuracy'][0]:.2f} ± {100 * r['accuracy'][1]:.2f} | "
              + " | ".join(f"{r[k][0]:.4f} ± {r[k][1]:.4f}" for k in KEYS[1:])
              + f" | {100 * r['plugin_accuracy'][0]:.2f} / {r['plugin_ece'][0]:.4f} / "
              f"{r['plugin_nll'][0]:.4f} | {r['confidence'][0]:.3f} / "
              f"{r['plugin_confidence'][0]:.3f} / {r['pooled_accuracy'][0]:.3f} | "
              f"{r['bytes_up'][0]:,.0f} | {r['bytes_down'][0]:,.0f} |", flush=True)
    peer = rows.get("fedper")
    ratios = ({m: {"accuracy": r["accuracy"][0] / peer["accuracy"][0],
                   "nll": r["nll"][0] / peer["nll"][0]} for m, r in rows.items()}
              if peer else {})
    print(json.dumps({"setting": {**vars(args), **{k: v for k, v in COMMON.items()
                                                   if k != "progress"}},
                      "rows": {m: {k: v[0] for k, v in r.items()} for m, r in rows.items()},
                      "ratio_vs_fedper": ratios}))


if __name__ == "__main__":
    main()
