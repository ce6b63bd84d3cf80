"""``make demo``: FedLog against FedAvg on scikit-learn's digits (no download needed).

20 clients with 2 classes each (``shards:2``), the same small MLP body for every client
(``mlp:200`` to 50 features), local Adam (lr 1e-3, batch 10, 5 epochs per round), 15 rounds.
Prints the comparison table (mean client accuracy, pooled ECE, bytes uploaded), writes each
run's directory under ``runs/demo/<strategy>/`` (metrics, summary, manifest, checkpoint,
plots), the comparison plot ``runs/demo/accuracy.png`` and the calibration reports
``runs/demo/calibration_<strategy>.md``. Takes a minute or two on a laptop CPU.

The demo owns its output directory: running it again replaces its previous results (each
strategy's run directory is started again with ``force=True``). It refuses an output
directory that holds a ``bayesfl run`` of its own (a ``manifest.json`` or checkpoint at its
top level) unless ``--force`` is given, so it never overwrites someone's run.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from bayesfl.errors import BayesFLError, ConfigError
from bayesfl.plots import plot_accuracy
from bayesfl.run_directory import CHECKPOINT_NAME
from bayesfl.simulate import SimulationResult, simulate
from calibration.report import report

STRATEGIES = ("fedlog", "fedavg")
SETTINGS = dict(dataset="digits", clients=20, partition="shards:2", body="mlp:200",
                feature_dim=50, local_epochs=5, lr=1e-3, batch_size=10)


def comparison_table(results: dict[str, SimulationResult]) -> str:
    """A markdown table: accuracy, ECE, NLL, bytes up and down per strategy."""
    lines = ["| strategy | accuracy (client mean) | accuracy (pooled) | ECE | NLL | bytes up "
             "| bytes down |", "|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        s = r.summary
        lines.append(f"| {name} | {s['accuracy']:.4f} | {s['accuracy_pooled']:.4f} | "
                     f"{s['ece']:.4f} | {s['nll']:.4f} | {s['bytes_up']:,} | "
                     f"{s['bytes_down']:,} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("runs/demo"))
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: half the cores, 1 to 4)")
    parser.add_argument("--force", action="store_true",
                        help="write into --out even if it holds a `bayesfl run` directory")
    args = parser.parse_args(argv)
    try:
        check_demo_directory(args.out, force=args.force)
        results = run_demo(args)
    except BayesFLError as err:
        print(f"bayesfl.demo: error: {err}", file=sys.stderr)
        return 2
    report_demo(results, args)
    return 0


def check_demo_directory(out: Path, *, force: bool) -> None:
    """Refuse ``out`` if it is a ``bayesfl run`` directory (not a demo's) unless ``force``."""
    foreign = [name for name in ("manifest.json", CHECKPOINT_NAME) if (out / name).exists()]
    if foreign and not force:
        raise ConfigError(f"{out} holds a `bayesfl run` directory ({', '.join(foreign)}), not a "
                          "demo's results; pass --out elsewhere, or --force to write into it")
    out.mkdir(parents=True, exist_ok=True)


def run_demo(args: argparse.Namespace) -> dict[str, SimulationResult]:
    """Both strategies, each in ``args.out / name``, started again if already there."""
    results: dict[str, SimulationResult] = {}
    for name in STRATEGIES:
        print(f"running {name} ({args.rounds} rounds) ...", flush=True)
        results[name] = simulate(name, rounds=args.rounds, seed=args.seed,
                                 out=args.out / name, force=True, threads=args.threads,
                                 progress=not args.no_progress, **SETTINGS)
    return results


def report_demo(results: dict[str, SimulationResult], args: argparse.Namespace) -> None:
    """Print the comparison and write the plot and the calibration reports."""
    table = comparison_table(results)
    print("\nFedLog vs FedAvg on digits, 20 clients, shards:2, mlp:200 body, "
          f"{args.rounds} rounds, seed {args.seed}\n")
    print(table)
    fedlog = results["fedlog"].summary
    plugin = fedlog["map_plugin"]
    print(f"\nFedLog's posterior predictive vs its MAP plug-in: accuracy {fedlog['accuracy']:.4f} "
          f"vs {plugin['accuracy']:.4f}, ECE {fedlog['ece']:.4f} vs {plugin['ece']:.4f}, "
          f"NLL {fedlog['nll']:.4f} vs {plugin['nll']:.4f}")
    ratio = results["fedavg"].summary["bytes_up"] / results["fedlog"].summary["bytes_up"]
    print(f"\nFedLog uploads {ratio:.0f}x fewer bytes than FedAvg.")
    plot_accuracy({name: r.metrics for name, r in results.items()}, args.out / "accuracy.png")
    for name, r in results.items():
        data = np.load(r.run_dir / "predictions.npz")
        rep = report(data["probs"], data["labels"], client_ids=data["client_ids"])
        (args.out / f"calibration_{name}.md").write_text(
            f"# Calibration of {name} (final round)\n\n{rep.to_markdown()}\n")
    (args.out / "comparison.md").write_text(table + "\n")
    print(f"\nplots and reports in {args.out}/ (accuracy.png, <strategy>/reliability.png, "
          "calibration_<strategy>.md)")


if __name__ == "__main__":
    sys.exit(main())
