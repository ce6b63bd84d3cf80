"""The ``bayesfl`` command line.

``bayesfl run --strategy fedlog --dataset digits --clients 20 --partition shards:2 --rounds 30
--seed 0 --out runs/demo`` runs :func:`bayesfl.simulate.simulate`. ``bayesfl strategies`` lists
the strategies and their options.

One vocabulary: every setting of ``bayesfl run`` is a flag, and the same names are the keys of
a TOML file given with ``--config FILE.toml`` (dashes or underscores alike: ``feature-dim`` or
``feature_dim``). A flag that takes KEY=VALUE pairs (``--option``, ``--dataset-option``) is a
table in TOML (``[option]``) or a list of ``"KEY=VALUE"`` strings; an on/off flag is a boolean
(``no-progress = true``). Some settings have a second name, the keyword of
:func:`~bayesfl.simulate.simulate`, accepted both as a flag and as a key: ``--bins`` /
``--n-bins``, ``--option`` / ``--strategy-options``, ``--dataset-option`` /
``--dataset-options``, ``--no-batched`` / ``batched = false``. Flags given on the command line
override the file (options tables are merged key by key). An unknown key, or a value of the
wrong type, is an error that names the file, the key and the valid choices.

Exit codes: 0 success; 2 bad usage, configuration or input (one line on stderr that says what
was wrong and what to do); 130 interrupted (Ctrl-C: one line with the exact command that
resumes the run).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bayesfl.errors import BayesFLError
from bayesfl.flower.command import add_parser as add_flower_parser
from bayesfl.flower.command import run_flower
from bayesfl.run_directory import CHECKPOINT_NAME
from bayesfl.settings import (  # noqa: F401 - SETTINGS, Setting, ... were this module's API
    MAX_CONFIG_BYTES,
    RUN_KEYWORDS,
    SETTINGS,
    Setting,
    add_settings,
    parse_options,
    read_config,
    settings_from_flags,
    settings_from_mapping,
)

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for a process stopped by Ctrl-C

def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bayesfl", description="Bayesian federated "
                                     "classification: run experiments in the embedded simulator.",
                                     allow_abbrev=False)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser(
        "run", help="run a federated experiment", allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run a federated experiment; writes metrics.jsonl, summary.json,\n"
        "manifest.json, a checkpoint and plots into --out.",
        epilog="A TOML file (--config) takes the flag names as keys, - or _ alike:\n"
        "  feature-dim = 50\n  bins = 15\n  no-progress = true\n  [option]\n"
        "  alpha = 0.01\n"
        "Flags given on the command line override the file.\n"
        "Ctrl-C stops a run and prints the command that resumes it.")
    run.add_argument("--config", type=Path, metavar="FILE.toml",
                     help="TOML file with settings (keys: the flag names below)")
    add_settings(run)
    commands.add_parser("strategies", help="list strategies and their options")
    add_flower_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``bayesfl`` console script; returns the exit code."""
    from calibration.errors import CalibrationError
    from inference.errors import InferenceError

    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    try:
        if args.command == "strategies":
            return _list_strategies()
        if args.command == "flower":
            return run_flower(args)
        return _run(args, argv)
    except (BayesFLError, InferenceError, CalibrationError, OSError) as err:
        print(f"bayesfl: error: {_one_line(err)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("bayesfl: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def _list_strategies() -> int:
    from bayesfl.strategies import STRATEGIES, strategy_options

    for name, cls in STRATEGIES.items():
        doc = (cls.__doc__ or "").strip().splitlines()[0]
        options = ", ".join(f"{k}={v!r}" for k, v in strategy_options(name).items())
        print(f"{name:18s} {doc}" + (f"\n{'':18s} options: {options}" if options else ""))
    return 0


def _run(args: argparse.Namespace, argv: list[str]) -> int:
    from bayesfl.simulate import simulate

    settings = read_config(args.config) if args.config is not None else {}
    flags = settings_from_flags(args)
    if flags.get("resume") and not flags.get("force"):
        settings.pop("force", None)  # --resume on the command line wins over the file's force
    if flags.get("force") and not flags.get("resume"):
        settings.pop("resume", None)
    for target in ("strategy_options", "dataset_options"):
        if target in flags:
            flags[target] = {**settings.get(target, {}), **flags[target]}
    settings.update(flags)
    run = {k: settings.pop(k) for k in RUN_KEYWORDS if k in settings}
    out = Path(run.pop("out", None) or _default_out(settings))
    if run.get("resume") and not run.get("force") and not (out / CHECKPOINT_NAME).exists():
        # a mistyped --out must not start a long run unnoticed
        print(f"bayesfl: no checkpoint in {out} yet; starting the run from its first round",
              file=sys.stderr)
    try:
        result = simulate(out=out, **run, **settings)
    except KeyboardInterrupt:
        print(f"bayesfl: interrupted; continue the run with: {resume_command(argv, out)}",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    s = result.summary
    print(f"{s['strategy']} on {s['dataset']} ({s['clients']} clients, {s['partition']}, "
          f"{s['rounds']} round{'' if s['rounds'] == 1 else 's'}): accuracy "
          f"{s['accuracy']:.4f} (pooled "
          f"{s['accuracy_pooled']:.4f}), ECE {s['ece']:.4f}, NLL {s['nll']:.4f}, "
          f"bytes up {s['bytes_up']:,}, down {s['bytes_down']:,}, "
          f"rejected uploads {s['rejected_uploads']}, {s['seconds']:.1f} s")
    calibration = s.get("calibration") or {}
    if calibration.get("calibrated"):
        after = calibration["calibrated"]
        print(f"temperature scaling: T = {calibration['temperature']:.4g}, ECE "
              f"{after['ece']:.4f}, NLL {after['nll']:.4f} (uncalibrated above), "
              f"bytes up {calibration['bytes_up']:,}, down {calibration['bytes_down']:,}")
    print(f"results in {result.run_dir}")
    return 0


def _default_out(settings: Mapping[str, Any]) -> Path:
    return Path("runs") / (f"{settings.get('strategy', 'fedlog')}_"
                           f"{settings.get('dataset', 'digits')}_seed{settings.get('seed', 0)}")


def resume_command(argv: Sequence[str], out: Path) -> str:
    """The command that continues an interrupted ``bayesfl run`` ``argv``: the same arguments
    without ``--force``, with ``--resume`` (and ``--out`` where the default was used)."""
    words = [w for w in argv if w not in ("--force", "--no-force")]
    if not any(w == "--out" or w.startswith("--out=") for w in words):
        words += ["--out", str(out)]
    if "--resume" not in words:
        words.append("--resume")
    return shlex.join(["bayesfl", *words])


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())


__all__ = ["SETTINGS", "Setting", "main", "parse_options", "read_config", "resume_command",
           "settings_from_mapping"]
