"""The price of differential privacy in FedLog: accuracy, ECE and NLL against epsilon.

digits, 20 clients, ``shards:2``, the default ``mlp:200`` body (50 features), 30 rounds, clip
2, delta 0.01, the v2 k-round accountant over every release of the run (rounds + the init
round), local and central placement, epsilon in {0.5, 1, 2, 4, 8, 16} and no DP (plain FedLog,
the peer measured in the same run), ``--seeds`` seeds (mean ± std). Sigma grows as
sqrt(rounds + 1): ``--rounds 10`` shows what a shorter run (FedLog on digits converges in under
10 rounds) buys, every DP row ``sqrt(31 / 11) = 1.7`` times less noisy. About 4.5 minutes on
one thread at 30 rounds, 1.5 at 10.

Each DP run reports its headline, the noise-aware posterior predictive (MC over the Laplace
approximation widened by the propagated noise, ``NoisyConjugatePosterior``), its
``dp_noise_to_signal`` and whether it raised the ``PrivacyNoiseWarning``; then the same final
clients are evaluated again with the noisy statistic taken at face value (the broadcast's
``noise_variance`` zeroed: the predictive before this change; the bodies, statistic and draws
are the same, so the comparison is paired).

Prints a markdown table, then one JSON line: per placement and epsilon the mean figures, and
each accuracy and NLL divided by the non-DP FedLog run's of the same seeds.

Every run is one JSON line in ``--cache`` (default ``bench/results/dp_price.jsonl``, keyed by
strategy, epsilon, seed and rounds; with commit, date and machine, `bench.run_cache`): a
cached run is not run again, and ``bench/published_tables.py`` generates the published DP table
from it.

Usage: ``python bench/dp_price.py [--seeds 3] [--rounds 30] [--epsilons 0.5,1,2,4,8,16]
[--cache PATH]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

# `python bench/x.py` puts bench/ first on sys.path, where bench/calibration.py would shadow the
# calibration package: use the repository root instead.
sys.path[0] = str(Path(__file__).resolve().parents[1])

from bayesfl.evaluation import merge_evaluations  # noqa: E402
from bayesfl.messages import Message  # noqa: E402
from bayesfl.simulate import SimulationResult, simulate  # noqa: E402
from bench.run_cache import provenance, run_cached  # noqa: E402
from inference.conjugate import PrivacyNoiseWarning  # noqa: E402

COMMON = dict(dataset="digits", clients=20, partition="shards:2", feature_dim=50,
              progress=False, threads=1)
PLACEMENTS = {"local": "fedlog-dp-local", "central": "fedlog-dp-central"}
METRICS = ("accuracy", "ece", "nll")


def face_value_headline(result: SimulationResult) -> dict[str, float]:
    """The final clients evaluated with the noisy statistic taken at face value: the
    evaluation broadcast with ``noise_variance`` zeroed (what FedLog's DP predictive was)."""
    broadcast = result.evaluation_broadcast
    tensors = dict(broadcast.tensors)
    tensors["noise_variance"] = torch.zeros_like(tensors["noise_variance"])
    face = Message(broadcast.header, tensors)
    evaluations = [result.strategy.evaluate(c.config, result.client_state(c.config.client_id),
                                            c.data, face, n_bins=result.config.n_bins)
                   for c in result.clients]
    return merge_evaluations(evaluations).headline()


def run(strategy: str, seed: int, rounds: int, epsilon: float | None) -> dict[str, float]:
    # the DP variants keep s = 1, so the plain baseline does too (FedLog's default since issue
    # 40 is the held-out scale): the gap is the noise's price alone
    options = ({"strategy_options": {"feature_scale": 1}} if epsilon is None
               else {"strategy_options": {"epsilon": epsilon}})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", PrivacyNoiseWarning)
        result = simulate(strategy=strategy, rounds=rounds, seed=seed, **COMMON, **options)
    s = result.summary
    row = {k: float(s[k]) for k in METRICS}
    if epsilon is not None:
        face = face_value_headline(result)
        row |= {f"face_{k}": float(face[k]) for k in METRICS}
        row["noise_to_signal"] = float(s["dp_noise_to_signal"])
        row["sigma"] = float(s["dp_sigma"])
        row["warned"] = float(any(issubclass(w.category, PrivacyNoiseWarning) for w in caught))
    placement = next((p for p, name in PLACEMENTS.items() if name == strategy), "none")
    return {"bench": "dp_price", "strategy": strategy, "placement": placement,
            "epsilon": epsilon, "seed": seed, "rounds": rounds, **row,
            "protocol": {**{k: v for k, v in COMMON.items() if k != "progress"},
                         "clip": 2.0, "delta": 0.01, "accountant": "v2, rounds + 1 releases"},
            **provenance()}


def run_key(strategy: str, seed: int, rounds: int, epsilon: float | None) -> str:
    return f"{strategy}|eps={epsilon if epsilon is None else f'{epsilon:g}'}|seed={seed}|" \
           f"rounds={rounds}"


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def cell(values: list[float], digits: int = 3) -> str:
    mean, std = mean_std(values)
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--epsilons", default="0.5,1,2,4,8,16")
    parser.add_argument("--cache", type=Path,
                        default=Path(__file__).resolve().parent / "results" / "dp_price.jsonl")
    args = parser.parse_args()
    epsilons = [float(e) for e in args.epsilons.split(",")]
    torch.set_num_threads(1)  # small models on a shared CPU: threads cost more than they gain
    start = time.perf_counter()
    tasks = []
    for seed in range(args.seeds):
        tasks.append((run_key("fedlog", seed, args.rounds, None), run,
                      ("fedlog", seed, args.rounds, None)))
        tasks += [(run_key(strategy, seed, args.rounds, epsilon), run,
                   (strategy, seed, args.rounds, epsilon))
                  for strategy in PLACEMENTS.values() for epsilon in epsilons]
    done = run_cached(tasks, args.cache, label=lambda k, r: (
        f"accuracy {r['accuracy']:.4f} ECE {r['ece']:.4f} NLL {r['nll']:.4f}"
        + (f" (face value ECE {r['face_ece']:.4f} NLL {r['face_nll']:.4f}, noise-to-signal "
           f"{r['noise_to_signal']:.3f})" if "face_ece" in r else "")))
    plain = [done[run_key("fedlog", seed, args.rounds, None)] for seed in range(args.seeds)]
    rows: dict[tuple[str, float], list[dict[str, float]]] = {
        (placement, epsilon): [done[run_key(strategy, seed, args.rounds, epsilon)]
                               for seed in range(args.seeds)]
        for placement, strategy in PLACEMENTS.items() for epsilon in epsilons}
    print(f"\ndigits, 20 clients, shards:2, {args.rounds} rounds (+ the init round), clip 2, "
          f"delta 0.01, v2 accountant, {args.seeds} seeds (mean ± std over seeds; accuracy = "
          "final-round mean client accuracy, ECE and NLL pooled). Headline: the noise-aware "
          "predictive; 'face value' takes the noisy statistic as exact (the predictive before "
          "the noise-aware posterior), on the same clients.\n")
    print("| placement | ε | σ | noise-to-signal | warned | accuracy | ECE | NLL | "
          "ECE (face value) | NLL (face value) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    figures: dict[str, float] = {}
    base = {k: [p[k] for p in plain] for k in METRICS}
    for placement in PLACEMENTS:
        for epsilon in epsilons:
            group = rows[(placement, epsilon)]
            v = {k: [r[k] for r in group] for k in group[0]
                 if isinstance(group[0][k], float)}
            print(f"| {placement} | {epsilon:g} | {statistics.fmean(v['sigma']):.1f} | "
                  f"{cell(v['noise_to_signal'], 2)} | {int(sum(v['warned']))}/{len(group)} | "
                  f"{cell(v['accuracy'])} | {cell(v['ece'])} | {cell(v['nll'])} | "
                  f"{cell(v['face_ece'])} | {cell(v['face_nll'])} |")
            key = f"{placement}_eps{epsilon:g}"
            for k in ("accuracy", "ece", "nll", "face_ece", "face_nll", "noise_to_signal"):
                figures[f"{key}_{k}"] = statistics.fmean(v[k])
            for k in ("accuracy", "nll"):  # paired by seed with the non-DP run
                figures[f"{key}_{k}_ratio_vs_fedlog"] = statistics.fmean(
                    [a / b for a, b in zip(v[k], base[k], strict=True)])
        print(f"| {placement} | ∞ (no DP) | 0 | 0 | – | {cell(base['accuracy'])} | "
              f"{cell(base['ece'])} | {cell(base['nll'])} | – | – |")
    for k in METRICS:
        figures[f"fedlog_{k}"] = statistics.fmean(base[k])
    figures["seeds"] = args.seeds
    figures["rounds"] = args.rounds
    figures["seconds"] = time.perf_counter() - start
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
