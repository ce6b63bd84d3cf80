"""The settings of a run: one schema read by every way of starting one.

`SETTINGS` lists each setting once: its flag names (``bayesfl run``, ``bayesfl flower``),
its TOML keys (``--config FILE.toml``; the flag names with ``-`` or ``_``), the keys of the
Flower run config (`bayesfl.flower.protocol.parse_run_config`) and where the value goes
(a [`SimulationConfig`][bayesfl.config.SimulationConfig] field, or a keyword of
[`simulate`][bayesfl.simulate.simulate] such as ``out``). The readers here turn flags
(`settings_from_flags`), a TOML file (`read_config`) or any mapping
(`settings_from_mapping`) into settings by target, checked for type and range.

This module sits on the ground floor of the command-line and transport code: the CLI
(`bayesfl.cli`), the Flower command (`bayesfl.flower.command`) and the Flower
protocol (`bayesfl.flower.protocol`) import it, and it imports neither of them, so none of
them imports another just to read a setting.
"""

from __future__ import annotations

import argparse
import difflib
import os
import stat
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bayesfl.config import CONFIG_FIELDS, check_setting, check_threads, describe
from bayesfl.data.datasets import DATASETS
from bayesfl.data.partition import PARTITION_SCHEMES
from bayesfl.errors import ConfigError

MAX_CONFIG_BYTES = 1 << 20
"""The largest TOML config file read (1 MiB; a config is a few hundred bytes)."""


@dataclass(frozen=True)
class Setting:
    """One setting of ``bayesfl run``: its flag(s), its TOML key(s) and where it goes.

    Attributes:
        names: flag names without ``--``; the first is the one ``--help`` leads with. Each is
            also a TOML key (with ``-`` or ``_``).
        target: the [`SimulationConfig`][bayesfl.config.SimulationConfig] field, or a keyword of
            [`simulate`][bayesfl.simulate.simulate] (``out``, ``resume``, ``force``, ``progress``,
            ``threads``), or ``download``, which the readers fold into ``dataset_options``
            (`fold_download`).
        kind: ``str``, ``int``, ``float``, ``path``, ``options`` (KEY=VALUE pairs / a table),
            ``switch`` (a flag that turns the target on), ``toggle`` (``--NAME`` /
            ``--no-NAME``) or ``list`` (a repeatable flag; in TOML a string or a list of
            strings, in Flower's run config one string of words separated by spaces).
        help: the ``--help`` text.
    """

    names: tuple[str, ...]
    target: str
    kind: str
    help: str


SETTINGS: tuple[Setting, ...] = (
    Setting(("strategy",), "strategy", "str",
            "strategy name (see `bayesfl strategies`); default fedlog"),
    Setting(("dataset",), "dataset", "str",
            f"data set name: {', '.join(DATASETS)}; default digits"),
    Setting(("clients",), "clients", "int", "number of clients; default 20"),
    Setting(("partition",), "partition", "str",
            "how the data are split over the clients, one of: "
            + "; ".join(PARTITION_SCHEMES.values())
            + ". Default shards: 2 classes per client, or as many as cover every class"),
    Setting(("rounds",), "rounds", "int",
            "training rounds, >= 0; 0 trains nothing and evaluates the initial model (FedLog: "
            "the head of its round 0 statistics on the initial bodies); default 30"),
    Setting(("seed",), "seed", "int",
            "seed of everything random, 0 <= SEED < 2**63 (of the data too unless --data-seed "
            "is given); default 0"),
    Setting(("data-seed",), "data_seed", "int",
            "seed of the data alone: loading, partition, test split, calibrate hold-out, novel "
            "clients; runs with one data seed and different --seed hold the same clients "
            "(deep-ensemble members); default: --seed"),
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
    Setting(("conformal",), "conformal", "str",
            "final conformal step: prediction sets with coverage >= 1 - ALPHA, SCORE:ALPHA"
            "[:METHOD] with SCORE lac, aps, aps-randomized, raps or raps-randomized and METHOD "
            "exact (default: the pooled threshold over counts), one-shot (FedCP-QQ, its bound "
            "for exchangeable clients only) or sketch (one shot, at or above the pooled "
            "threshold under any heterogeneity, < 1 KB per client), e.g. "
            "aps:0.1; calibrated on the held-out share calibrate uses (0.2 without it); "
            "default none"),
    Setting(("device",), "device", "str", "cpu, cuda, cuda:N or mps; default cpu"),
    Setting(("batched",), "batched", "toggle",
            "train clients of one architecture together, or one by one; default on"),
    Setting(("authenticate",), "authenticate", "toggle",
            "sign every message with HMAC-SHA256 under per-client keys drawn for the run; "
            "default off"),
    Setting(("option", "strategy-options"), "strategy_options", "options",
            "strategy option KEY=VALUE, repeatable (e.g. --option mc_samples=512); "
            "`bayesfl strategies NAME` lists a strategy's options"),
    Setting(("dataset-option", "dataset-options"), "dataset_options", "options",
            "data set option KEY=VALUE, repeatable (e.g. --dataset gaussian_mixture "
            "--dataset-option n=500)"),
    Setting(("download",), "download", "switch",
            "download a torchvision data set's files (mnist, fashion_mnist, cifar10, cifar100) "
            "if they are absent; the same as --dataset-option download=true"),
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
    Setting(("shift",), "shift", "list",
            "after the run, evaluate every client on its test rows under this input shift, "
            "KIND:S1,S2 (rotate, noise, contrast; e.g. rotate:15,30), repeatable; the report "
            "goes to OUT/shift as `bayesfl evaluate` writes it (on Flower each site evaluates "
            "its own state); default none"),
    Setting(("ood",), "ood", "list",
            "after the run, score out-of-distribution rows: unseen-labels or novel-clients, "
            "repeatable (with --shift or alone); default none"),
)

RUN_KEYWORDS = ("out", "resume", "force", "progress", "threads", "shift", "ood")


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



def add_settings(run: argparse.ArgumentParser, exclude: Sequence[str] = ()) -> None:
    """Every setting of `SETTINGS` as a flag of ``run`` (``bayesfl run``, ``bayesfl
    flower``), but those whose target is in ``exclude``."""
    types = {"str": str, "int": int, "float": float, "path": Path}
    for s in SETTINGS:
        if s.target in exclude:
            continue
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
        elif s.kind == "list":
            run.add_argument(*flags, dest=s.target, action="append", default=None,
                             metavar=s.names[0].upper(), help=s.help)
        else:
            run.add_argument(*flags, dest=s.target, type=types[s.kind], default=None,
                             metavar=s.names[0].replace("-", "_").upper(), help=s.help)



def settings_from_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The settings given as flags, by target (``out``, ``resume`` ... or config field)."""
    settings: dict[str, Any] = {}
    for s in SETTINGS:
        value = getattr(args, s.target, None)  # None: not given, or not a flag of the command
        if value is None:
            continue
        settings[s.target] = parse_options(value) if s.kind == "options" else value
        if s.kind == "list":
            settings[s.target] = list_value(s.names[0], value)
    return fold_download(settings)


def read_config(path: Path) -> dict[str, Any]:
    """Settings from a TOML file, by target (see `settings_from_mapping`).

    Raises:
        ConfigError: the file is missing, not a regular file, larger than
            `MAX_CONFIG_BYTES`, not UTF-8 TOML, or holds an unknown key or a value of the
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
    (and, for [`SimulationConfig`][bayesfl.config.SimulationConfig] fields, its range).

    Raises:
        ConfigError: an unknown key (with the valid keys and the nearest match), a setting
            given twice under two names, or a value of the wrong type.
    """
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
            elif setting.kind == "list":
                value = list_value(key, value)
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
    return fold_download(settings)


def fold_download(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` with ``download`` (the ``--download`` flag) moved into ``dataset_options``,
    where the data sets read it; returns ``settings``."""
    if "download" in settings:
        download = settings.pop("download")
        settings["dataset_options"] = {**settings.get("dataset_options", {}),
                                       "download": download}
    return settings


def list_value(key: str, value: Any) -> list[str]:
    """A ``list`` setting: words of a string (split on spaces) or a list of strings, each
    checked (``shift``: ``KIND:S1,S2``; ``ood``: a known set).

    Raises:
        ConfigError: not a string or a list of strings, or a word that is not valid.
    """
    if isinstance(value, str):
        words = value.split()
    elif isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
        words = [w for v in value for w in v.split()]
    else:
        raise ConfigError(f"{key} must be a string or a list of strings, got {describe(value)}")
    name = _key(key)
    if name == "shift":
        from bayesfl.shifts import parse_shift

        for word in words:
            parse_shift(word)
    elif name == "ood":
        from bayesfl.shift_evaluation import ood_kinds

        ood_kinds(words)
    return words


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


__all__ = ["MAX_CONFIG_BYTES", "RUN_KEYWORDS", "SETTINGS", "Setting", "add_settings",
           "fold_download", "list_value", "parse_options", "read_config", "settings_from_flags",
           "settings_from_mapping"]
