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
import difflib
import os
import shlex
import stat
import sys
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bayesfl.errors import BayesFLError, ConfigError
from bayesfl.run_directory import CHECKPOINT_NAME

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for a process stopped by Ctrl-C

MAX_CONFIG_BYTES = 1 << 20
"""The largest TOML config file read (1 MiB; a config is a few hundred bytes)."""


@dataclass(frozen=True)
class Setting:
    """One setting of ``bayesfl run``: its flag(s), its TOML key(s) and where it goes.

    Attributes:
        names: flag names without ``--``; the first is the one ``--help`` leads with. Each is
            also a TOML key (with ``-`` or ``_``).
        target: the :class:`~bayesfl.config.SimulationConfig` field, or a keyword of
            :func:`~bayesfl.simulate.simulate` (``out``, ``resume``, ``force``, ``progress``,
            ``threads``).
        kind: ``str``, ``int``, ``float``, ``path``, ``options`` (KEY=VALUE pairs / a table),
            ``switch`` (a flag that turns the target on) or ``toggle`` (``--NAME`` /
            ``--no-NAME``).
        help: the ``--help`` text.
    """

    names: tuple[str, ...]
    target: str
    kind: str
    help: str


SETTINGS: tuple[Setting, ...] = (
    Setting(("strategy",), "strategy", "str",
            "strategy name (see `bayesfl strategies`); default fedlog"),
    Setting(("dataset",), "dataset", "str", "data set name; default digits"),
    Setting(("clients",), "clients", "int", "number of clients; default 20"),
    Setting(("partition",), "partition", "str",
            "iid, dirichlet:ALPHA, shards:K or per_class:N; default shards:2"),
    Setting(("rounds",), "rounds", "int", "training rounds; default 30"),
    Setting(("seed",), "seed", "int", "seed of everything random, 0 <= SEED < 2**63; default 0"),
    Setting(("body",), "body", "str",
            "body spec, or specs separated by commas assigned to clients in turn "
            "(e.g. mlp:200,mlp:100-100); default mlp:200"),
    Setting(("feature-dim",), "feature_dim", "int",
            "output width d of every body, at most 16384; default 50"),
    Setting(("local-epochs",), "local_epochs", "int", "local epochs per round; default 5"),
    Setting(("lr",), "lr", "float", "local Adam learning rate, in (0, 1]; default 1e-3"),
    Setting(("batch-size",), "batch_size", "int",
            "local mini-batch size (larger than a client's data: full batch); default 10"),
    Setting(("fraction",), "fraction", "float",
            "fraction of clients sampled per round, in (0, 1]; default 1.0"),
    Setting(("test-fraction",), "test_fraction", "float",
            "per-client test share, in (0, 1); default 0.25"),
    Setting(("novel-fraction",), "novel_fraction", "float",
            "share of clients held out of training as novel clients, in [0, 1): they only "
            "personalise at the end, reported under `novel` in summary.json; default 0"),
    Setting(("bins", "n-bins"), "n_bins", "int", "calibration bins, at most 10000; default 15"),
    Setting(("calibrate",), "calibrate", "str",
            "final calibration step: temperature, or temperature:FRACTION (the share of "
            "each client's training data held out to fit it, default 0.2); default none"),
    Setting(("device",), "device", "str", "cpu, cuda, cuda:N or mps; default cpu"),
    Setting(("batched",), "batched", "toggle",
            "train clients of one architecture together, or one by one; default on"),
    Setting(("authenticate",), "authenticate", "toggle",
            "sign every message with HMAC-SHA256 under per-client keys drawn for the run; "
            "default off"),
    Setting(("option", "strategy-options"), "strategy_options", "options",
            "strategy option KEY=VALUE, repeatable (e.g. --option alpha=0.01)"),
    Setting(("dataset-option", "dataset-options"), "dataset_options", "options",
            "data set option KEY=VALUE, repeatable (e.g. --dataset-option n=500)"),
    Setting(("out",), "out", "path",
            "run directory; default runs/STRATEGY_DATASET_seedSEED; must be empty or absent "
            "unless --resume or --force"),
    Setting(("resume",), "resume", "switch", "continue the run whose checkpoint is in --out"),
    Setting(("force",), "force", "switch",
            "start again in a non-empty --out: the files a run writes there are replaced "
            "(other files are kept)"),
    Setting(("threads",), "threads", "int",
            "torch threads; default half the CPU cores, 1 to 4 (small models run slower "
            "with more)"),
    Setting(("progress",), "progress", "toggle", "progress bar over rounds; default on"),
)

_RUN_KEYWORDS = ("out", "resume", "force", "progress", "threads")


def _key(name: str) -> str:
    return name.strip().replace("_", "-")


def _names_to_settings() -> dict[str, tuple[Setting, bool]]:
    """Every accepted name (``-`` form) -> (setting, whether the name negates it)."""
    table: dict[str, tuple[Setting, bool]] = {}
    for setting in SETTINGS:
        for name in setting.names:
            table[name] = (setting, False)
            if setting.kind == "toggle":
                table[f"no-{name}"] = (setting, True)
    return table


_BY_NAME = _names_to_settings()


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
    _add_settings(run)
    commands.add_parser("strategies", help="list strategies and their options")
    from bayesfl.flower.command import add_parser as add_flower_parser

    add_flower_parser(commands, _add_settings)
    return parser


def _add_settings(run: argparse.ArgumentParser) -> None:
    """Every setting of :data:`SETTINGS` as a flag of ``run`` (``bayesfl run``, ``bayesfl
    flower``)."""
    types = {"str": str, "int": int, "float": float, "path": Path}
    for s in SETTINGS:
        flags = [f"--{name}" for name in s.names]
        if s.kind == "toggle":
            run.add_argument(*flags, dest=s.target, action=argparse.BooleanOptionalAction,
                             default=None, help=s.help)
        elif s.kind == "switch":
            run.add_argument(*flags, dest=s.target, action="store_true", default=None,
                             help=s.help)
        elif s.kind == "options":
            run.add_argument(*flags, dest=s.target, action="append", default=None,
                             metavar="KEY=VALUE", help=s.help)
        else:
            run.add_argument(*flags, dest=s.target, type=types[s.kind], default=None,
                             metavar=s.names[0].replace("-", "_").upper(), help=s.help)


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
            from bayesfl.flower.command import run_flower

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
    run = {k: settings.pop(k) for k in _RUN_KEYWORDS if k in settings}
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


def settings_from_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The settings given as flags, by target (``out``, ``resume`` ... or config field)."""
    settings: dict[str, Any] = {}
    for s in SETTINGS:
        value = getattr(args, s.target)
        if value is None:
            continue
        settings[s.target] = parse_options(value) if s.kind == "options" else value
    return settings


def read_config(path: Path) -> dict[str, Any]:
    """Settings from a TOML file, by target (see :func:`settings_from_mapping`).

    Raises:
        ConfigError: the file is missing, not a regular file, larger than
            :data:`MAX_CONFIG_BYTES`, not UTF-8 TOML, or holds an unknown key or a value of the
            wrong type (the message names the file and the key).
    """
    source = f"config {path}"
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"{source} is not a regular file (a directory, device or pipe); "
                              "give a TOML file")
        if info.st_size > MAX_CONFIG_BYTES:
            raise ConfigError(f"{source} is {info.st_size:,} bytes, more than the limit "
                              f"{MAX_CONFIG_BYTES:,} for a config; give a TOML file of settings")
        with open(path, "rb") as f:
            raw = tomllib.loads(f.read(MAX_CONFIG_BYTES + 1).decode("utf-8"))
    except FileNotFoundError as err:
        raise ConfigError(f"{source} does not exist; give the path of a TOML file") from err
    except OSError as err:
        raise ConfigError(f"{source} cannot be read: {err.strerror or err}") from err
    except UnicodeDecodeError as err:
        raise ConfigError(f"{source} is not a text file (not UTF-8: {err.reason} at byte "
                          f"{err.start}); give a TOML file of settings") from err
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{source} is not valid TOML: {err}") from err
    return settings_from_mapping(raw, source)


def settings_from_mapping(raw: Mapping[str, Any], source: str = "config") -> dict[str, Any]:
    """Map TOML keys (the flag names, ``-`` or ``_``) to targets and check each value's type
    (and, for :class:`~bayesfl.config.SimulationConfig` fields, its range).

    Raises:
        ConfigError: an unknown key (with the valid keys and the nearest match), a setting
            given twice under two names, or a value of the wrong type.
    """
    from bayesfl.config import CONFIG_FIELDS, check_setting, check_threads, describe

    settings: dict[str, Any] = {}
    given: dict[str, str] = {}  # target -> the key that set it
    for key, value in raw.items():
        name = _key(key)
        if name == "config":
            raise ConfigError(f"{source}: a config file cannot name another config file; put "
                              "the settings in this one")
        if name not in _BY_NAME:
            near = difflib.get_close_matches(name, list(_BY_NAME), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            valid = ", ".join(s.names[0] for s in SETTINGS)
            raise ConfigError(f"{source}: unknown key {key!r}{hint}; valid keys are the flags "
                              f"of `bayesfl run` (- or _): {valid} (on/off keys also as "
                              "no-NAME, e.g. no-progress = true)")
        setting, negated = _BY_NAME[name]
        if setting.target in given:
            raise ConfigError(f"{source}: {setting.target} is given twice (as "
                              f"{given[setting.target]!r} and {key!r}); keep one")
        given[setting.target] = key
        try:
            if setting.kind in ("switch", "toggle"):
                if not isinstance(value, bool):
                    raise ConfigError(f"{key} must be true or false, got {describe(value)}")
                value = not value if negated else value
            elif setting.kind == "options":
                value = _options_value(key, value)
            elif setting.kind == "path":
                if not isinstance(value, str) or not value.strip():
                    raise ConfigError(f"{key} must be a path (a string), got {describe(value)}")
            elif setting.target == "threads":
                value = check_threads(value)
            if setting.target in CONFIG_FIELDS:
                value = check_setting(setting.target, value, label=key)
        except ConfigError as err:
            raise ConfigError(f"{source}: {err}") from err
        settings[setting.target] = value
    return settings


def _options_value(key: str, value: Any) -> dict[str, Any]:
    if isinstance(value, Mapping):
        return {_key(k).replace("-", "_"): v for k, v in value.items()}
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return parse_options(value)
    raise ConfigError(f"{key} must be a table ([{key}] with KEY = VALUE lines) or a list of "
                      f"\"KEY=VALUE\" strings, got {value!r}")


def parse_options(pairs: Sequence[str]) -> dict[str, Any]:
    """``["alpha=0.01", "upload_dtype=float64"]`` -> typed values (TOML literals, else text).

    Raises:
        ConfigError: a pair without ``=`` or without a key.
    """
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


__all__ = ["SETTINGS", "Setting", "main", "parse_options", "read_config", "resume_command",
           "settings_from_mapping"]
