"""Benchmark of the FedLog conjugate head (inference.conjugate).

1. Server solve at C = 100 classes, k = 513 columns (512 body features + bias): the exact
   solver ``solve_map`` against the paper's Adam loop (lr 0.01, stop when one Adam step moves
   no entry by more than 1e-3; spec §2.2), timed in the same run, with each one's objective gap
   to the best objective found (absolute, and relative to |J_best|).
2. Client statistics pass: ``SufficientStatistics.from_features`` on a batch against one
   forward pass (eval, no grad) of a small body on the same batch (float32, batch 2048): an
   MLP 784 -> 256 -> 256 -> 512 (m = 512, C = 100: the solver's size; ``stats_vs_forward``)
   and the paper's MNIST CNN body (m = 50, C = 10; ``stats_vs_forward_paper_cnn``).

Runs single-threaded by default (``--threads``): on a shared machine torch's spinning
intra-op threads make timings erratic. Prints a table, then one JSON line with
``ratio_vs_adam`` (Adam time / exact time), ``objective_gap_adam``, ``objective_gap_ours``
(absolute gaps J_best - J) and ``stats_vs_forward`` (statistics time / forward time).
The record, with its provenance (`bench.run_cache.append_result`: commit, date, machine,
seeds, torch version, threads, load average before and after), is appended to ``--out``
(default ``bench/results/conjugate.jsonl``; ``--out ''`` stores nothing); the published table
is ``conjugate`` of ``bench/published_tables.py``.

Targets (issue 3): ``solve_map`` at least 300x faster than the Adam loop with at least as high
an objective; the statistics pass under 10% of the forward pass.

    python bench/conjugate.py [--repeats 21] [--out bench/results/conjugate.jsonl]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics as stats_lib
import sys
import time
from pathlib import Path

import torch

# `python bench/x.py` puts bench/ first on sys.path, where bench/calibration.py would shadow the
# calibration package: use the repository root instead.
sys.path[0] = str(Path(__file__).resolve().parents[1])

from bench.run_cache import append_result  # noqa: E402
from inference.conjugate import (  # noqa: E402
    SufficientStatistics,
    map_objective,
    solve_map,
    solve_map_adam,
)

#: Seeds: the solver's mixture features (0) and the statistics pass's inputs and labels (1);
#: the bodies' weights are drawn after ``torch.manual_seed(0)``.
SEEDS = (0, 1)


def median_time(function, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return stats_lib.median(times)


def mixture_batch(n: int, num_classes: int, feature_dim: int, seed: int):
    """Gaussian-mixture body features (the model FedLog assumes), float32."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, num_classes, (n,), generator=generator)
    centres = torch.randn(num_classes, feature_dim, generator=generator)
    features = centres[labels] + torch.randn(n, feature_dim, generator=generator) / 2**0.5
    return features, labels


def bench_solver(num_classes: int, feature_dim: int, n: int, repeats: int) -> dict[str, float]:
    features, labels = mixture_batch(n, num_classes, feature_dim, seed=0)
    table = SufficientStatistics.from_features(features, labels, num_classes).table
    S, N = table, float(n) + 1.0  # paper prior: chi = 0, nu = 1
    W_exact = solve_map(S, N)
    time_exact = median_time(lambda: solve_map(S, N), repeats)  # median: the conservative one
    start = time.perf_counter()
    W_adam, steps = solve_map_adam(S, N)
    time_adam = time.perf_counter() - start
    objective_exact = float(map_objective(W_exact, S, N))
    objective_adam = float(map_objective(W_adam, S, N))
    best = max(objective_exact, objective_adam)
    return {
        "time_exact_s": time_exact,
        "time_adam_s": time_adam,
        "adam_steps": steps,
        "objective_exact": objective_exact,
        "objective_adam": objective_adam,
        "gap_exact": best - objective_exact,
        "gap_adam": best - objective_adam,
        "relative_gap_adam": (best - objective_adam) / abs(best),
        "relative_head_error_adam": float((W_adam - W_exact).abs().max() / W_exact.abs().max()),
    }


def mlp_body() -> tuple[torch.nn.Module, tuple[int, ...]]:
    """MLP 784 -> 256 -> 256 -> 512 (ReLUs): m = 512 features, the solver benchmark's size."""
    body = torch.nn.Sequential(
        torch.nn.Linear(784, 256), torch.nn.ReLU(),
        torch.nn.Linear(256, 256), torch.nn.ReLU(),
        torch.nn.Linear(256, 512), torch.nn.ReLU(),
    )
    return body, (784,)


def paper_mnist_body() -> tuple[torch.nn.Module, tuple[int, ...]]:
    """The FedLog paper's MNIST body (LG-FedAvg CNN, spec §7.1): m = 50 features."""
    body = torch.nn.Sequential(
        torch.nn.Conv2d(1, 10, 5), torch.nn.MaxPool2d(2), torch.nn.ReLU(),
        torch.nn.Conv2d(10, 20, 5), torch.nn.Dropout2d(0.5), torch.nn.MaxPool2d(2),
        torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(320, 50), torch.nn.ReLU(),
    )
    return body, (1, 28, 28)


def bench_statistics(
    body: torch.nn.Module, input_shape: tuple[int, ...], batch: int, num_classes: int,
    repeats: int,
) -> dict[str, float]:
    """Forward pass and statistics pass timed alternately (same load for both); the best of
    ``repeats`` is each one's cost (noise on a shared machine only ever adds time)."""
    body = body.eval()
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(batch, *input_shape, generator=generator)
    labels = torch.randint(0, num_classes, (batch,), generator=generator)
    forward, statistics = [], []
    with torch.no_grad():
        for _ in range(repeats):
            start = time.perf_counter()
            features = body(inputs)
            forward.append(time.perf_counter() - start)
            start = time.perf_counter()
            SufficientStatistics.from_features(features, labels, num_classes)
            statistics.append(time.perf_counter() - start)
    return {
        "time_forward_s": min(forward),
        "time_statistics_s": min(statistics),
        "median_ratio": stats_lib.median(statistics) / stats_lib.median(forward),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--out", default="bench/results/conjugate.jsonl",
                        help="append the JSON record here ('' for nowhere)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    torch.manual_seed(0)  # the bodies' weights (the timings do not depend on them)

    solver = bench_solver(num_classes=100, feature_dim=512, n=20_000, repeats=args.repeats)
    pass_ = bench_statistics(*mlp_body(), batch=2048, num_classes=100, repeats=args.repeats)
    cnn = bench_statistics(*paper_mnist_body(), batch=2048, num_classes=10, repeats=args.repeats)
    cnn_ratio = cnn["time_statistics_s"] / cnn["time_forward_s"]
    ratio = solver["time_adam_s"] / solver["time_exact_s"]
    stats_ratio = pass_["time_statistics_s"] / pass_["time_forward_s"]

    print(f"FedLog conjugate head benchmark (torch {torch.__version__}, {args.threads} thread(s))")
    print("server MAP, C = 100, k = 513 (512 features + bias), n = 20000")
    print(f"  {'solver':<28}{'time [ms]':>12}{'objective J':>20}{'gap to best':>14}")
    print(f"  {'exact (solve_map)':<28}{solver['time_exact_s'] * 1e3:>12.3f}"
          f"{solver['objective_exact']:>20.6f}{solver['gap_exact']:>14.3e}")
    print(f"  {'paper Adam (' + str(solver['adam_steps']) + ' steps)':<28}"
          f"{solver['time_adam_s'] * 1e3:>12.1f}{solver['objective_adam']:>20.6f}"
          f"{solver['gap_adam']:>14.3e}")
    print(f"  speed-up exact vs Adam: {ratio:.0f}x; Adam relative objective gap "
          f"{solver['relative_gap_adam']:.2e}, max-entry head error "
          f"{solver['relative_head_error_adam']:.2%}")
    print("client statistics pass, batch 2048, body MLP 784-256-256-512 (float32, eval)")
    print(f"  forward pass        {pass_['time_forward_s'] * 1e3:8.3f} ms (best of {args.repeats})")
    print(f"  from_features       {pass_['time_statistics_s'] * 1e3:8.3f} ms"
          f"   ({stats_ratio:.1%} of the forward pass; ratio of medians "
          f"{pass_['median_ratio']:.1%})")
    print("client statistics pass, batch 2048, the paper's MNIST CNN body (m = 50, C = 10)")
    print(f"  forward pass        {cnn['time_forward_s'] * 1e3:8.3f} ms (best of {args.repeats})")
    print(f"  from_features       {cnn['time_statistics_s'] * 1e3:8.3f} ms"
          f"   ({cnn_ratio:.1%} of the forward pass; ratio of medians "
          f"{cnn['median_ratio']:.1%})")
    result = {
        "bench": "conjugate",
        "num_classes": 100, "columns": 513, "n": 20_000, "batch": 2048,
        "repeats": args.repeats,
        "ratio_vs_adam": ratio,
        "objective_gap_adam": solver["gap_adam"],
        "objective_gap_ours": solver["gap_exact"],
        "relative_objective_gap_adam": solver["relative_gap_adam"],
        "stats_vs_forward": stats_ratio,
        "stats_vs_forward_median": pass_["median_ratio"],
        "stats_vs_forward_paper_cnn": cnn_ratio,
        "time_exact_ms": solver["time_exact_s"] * 1e3,
        "time_adam_ms": solver["time_adam_s"] * 1e3,
        "adam_steps": solver["adam_steps"],
        "time_statistics_ms": pass_["time_statistics_s"] * 1e3,
        "time_forward_ms": pass_["time_forward_s"] * 1e3,
        "time_statistics_paper_cnn_ms": cnn["time_statistics_s"] * 1e3,
        "time_forward_paper_cnn_ms": cnn["time_forward_s"] * 1e3,
    }
    print(json.dumps(append_result(args.out, result, seeds=SEEDS, load_before=load_before)))


if __name__ == "__main__":
    main()
