"""The ``bayesfl`` command line.

``bayesfl run --strategy fedlog --dataset digits --clients 20 --partition shards:2 --rounds 30
--seed 0 --out runs/demo`` runs :func:`bayesfl.simulate.simulate`. Settings may also come from
a TOML file (``--config FILE.toml``) whose top-level keys are the option names (dashes or
underscores), with optional tables ``[strategy_options]`` and ``[dataset_options]``; flags
given on the command line override the file. ``bayesfl strategies`` lists the strategies and
their options.

Exit codes: 0 success, 2 bad usage or configuration (unknown names, a bad partition, a corrupt
or foreign checkpoint: one line on stderr that says what to do).
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bayesfl.errors import BayesFLError

EXIT_USAGE = 2

# flag name -> (SimulationConfig field, type, help)
_RUN_FLAGS: dict[str, tuple[str, type, str]] = {
    "--strategy": ("strategy", str, "strategy name (see `bayesfl strategies`); default fedlog"),
    "--dataset": ("dataset", str, "data set name; default digits"),
    "--clients": ("clients", int, "number of clients; default 20"),
    "--partition": ("partition", str, "iid, dirichlet:ALPHA, shards:K or per_class:N; "
                    "default shards:2"),
    "--rounds": ("rounds", int, "training rounds; default 30"),
    "--seed": ("seed", int, "seed of everything random; default 0"),
    "--body": ("body", str, "body spec, or specs separated by commas assigned to clients in "
               "turn (e.g. mlp:200,mlp:100-100); default mlp:200"),
    "--feature-dim": ("feature_dim", int, "output width d of every body; default 50"),
    "--local-epochs": ("local_epochs", int, "local epochs per round; default 5"),
    "--lr": ("lr", float, "local Adam learning rate; default 1e-3"),
    "--batch-size": ("batch_size", int, "local mini-batch size; default 10"),
    "--fraction": ("fraction", float, "fraction of clients sampled per round; default 1.0"),
    "--test-fraction": ("test_fraction", float, "per-client test share; default 0.25"),
    "--bins": ("n_bins", int, "calibration bins; default 15"),
    "--device": ("device", str, "torch device, e.g. cpu or cuda; default cpu"),
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bayesfl", description="Bayesian federated "
                                     "classification: run experiments in the embedded simulator.")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run a federated experiment",
                              description="Run a federated experiment; writes metrics.jsonl, "
                              "summary.json, manifest.json and plots into --out.")
    run.add_argument("--config", type=Path, help="TOML file with the settings")
    for flag, (_, kind, text) in _RUN_FLAGS.items():
        run.add_argument(flag, type=kind, default=None, help=text)
    run.add_argument("--out", type=Path, default=None,
                     help="run directory; default runs/STRATEGY_DATASET_seedSEED")
    run.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                     help="strategy option, repeatable (e.g. --option alpha=0.01)")
    run.add_argument("--dataset-option", action="append", default=[], metavar="KEY=VALUE",
                     help="data set option, repeatable (e.g. --dataset-option n=500)")
    run.add_argument("--no-batched", action="store_true", default=None,
                     help="train clients one by one instead of batching same-architecture ones")
    run.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    commands.add_parser("strategies", help="list strategies and their options")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``bayesfl`` console script; returns the exit code."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "strategies":
            return _list_strategies()
        return _run(args)
    except (BayesFLError, OSError, tomllib.TOMLDecodeError) as err:
        print(f"bayesfl: error: {err}", file=sys.stderr)
        return EXIT_USAGE


def _list_strategies() -> int:
    from bayesfl.strategies import STRATEGIES, strategy_options

    for name, cls in STRATEGIES.items():
        doc = (cls.__doc__ or "").strip().splitlines()[0]
        options = ", ".join(f"{k}={v!r}" for k, v in strategy_options(name).items())
        print(f"{name:18s} {doc}" + (f"\n{'':18s} options: {options}" if options else ""))
    return 0


def _run(args: argparse.Namespace) -> int:
    from bayesfl.errors import ConfigError
    from bayesfl.simulate import CONFIG_FIELDS, simulate

    settings: dict[str, Any] = {}
    if args.config is not None:
        settings.update(read_config(args.config))
    for flag, (field, _, _) in _RUN_FLAGS.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            settings[field] = value
    if args.no_batched:
        settings["batched"] = False
    options = dict(settings.pop("strategy_options", {}))
    options.update(parse_options(args.option))
    settings["strategy_options"] = options
    dataset_options = dict(settings.pop("dataset_options", {}))
    dataset_options.update(parse_options(args.dataset_option))
    settings["dataset_options"] = dataset_options
    unknown = sorted(set(settings) - set(CONFIG_FIELDS) - {"out"})
    if unknown:
        raise ConfigError(f"unknown setting(s) {unknown}; valid: {', '.join(CONFIG_FIELDS)}")
    out = args.out or settings.pop("out", None)
    settings.pop("out", None)
    if out is None:
        out = Path("runs") / (f"{settings.get('strategy', 'fedlog')}_"
                              f"{settings.get('dataset', 'digits')}_seed{settings.get('seed', 0)}")
    result = simulate(out=out, resume=args.resume, progress=not args.no_progress, **settings)
    s = result.summary
    print(f"{s['strategy']} on {s['dataset']} ({s['clients']} clients, {s['partition']}, "
          f"{s['rounds']} rounds): accuracy {s['accuracy']:.4f} (pooled "
          f"{s['accuracy_pooled']:.4f}), ECE {s['ece']:.4f}, NLL {s['nll']:.4f}, "
          f"bytes up {s['bytes_up']:,}, down {s['bytes_down']:,}, "
          f"rejected uploads {s['rejected_uploads']}, {s['seconds']:.1f} s")
    print(f"results in {result.run_dir}")
    return 0


def read_config(path: Path) -> dict[str, Any]:
    """Settings from a TOML file: keys normalised to underscores."""
    with open(path, "rb") as f:
        raw = tomllib.load(f)
    return {key.replace("-", "_"): value for key, value in raw.items()}


def parse_options(pairs: Sequence[str]) -> dict[str, Any]:
    """``["alpha=0.01", "upload_dtype=float64"]`` -> typed values (TOML literals, else text)."""
    from bayesfl.errors import ConfigError

    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"options are given as KEY=VALUE, got {pair!r}")
        try:
            value = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            value = text
        options[key.strip().replace("-", "_")] = value
    return options


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())


__all__ = ["main", "parse_options", "read_config"]
