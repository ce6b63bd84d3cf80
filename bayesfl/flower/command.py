"""``bayesfl flower``: one experiment on a Flower deployment on this machine, end to end.

Starts a SuperLink and one SuperNode per client on 127.0.0.1
(`LocalFederation`), submits the example app
(``examples/flower_app``, or ``--app DIR``) with the experiment as its run config, waits for
the run's final status (``flwr ls``, not ``flwr run``'s exit code), prints the summary and
stops every process it started. The flags are those of ``bayesfl run`` plus the deployment's
(``--min-replies``, ``--round-timeout``, ``--evaluate-every``, ``--data-loader``, ``--timeout``,
``--app``, ``--keep``). Exit codes: 0 the run completed; 1 it failed (the SuperLink's log tail is
printed); 2 bad usage or flwr not installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bayesfl.errors import ConfigError
from bayesfl.flower.options import deployment_flags
from bayesfl.settings import add_settings, fold_download, read_config, settings_from_flags

NOT_ON_FLOWER: dict[str, str] = {
    "authenticate": "Flower authenticates nodes itself: use its TLS and SuperNode "
                    "authentication (flower-superlink --enable-supernode-auth)",
    "progress": "there is no progress bar over Flower; the rounds are logged by the SuperLink "
                "(--keep DIR keeps its log)",
}
"""Settings of ``bayesfl run`` that ``bayesfl flower`` does not offer, with the reason (its
``--help`` says them); every other setting is a flag the Flower run accepts."""

def add_parser(commands: Any) -> None:
    """The ``flower`` subcommand on ``commands`` (argparse subparsers): ``bayesfl run``'s flags
    (`bayesfl.settings.add_settings`) and the deployment's."""
    flower = commands.add_parser(
        "flower", help="run an experiment on a local Flower deployment (SuperLink + one "
        "SuperNode per client on 127.0.0.1)", allow_abbrev=False,
        description="Run a federated experiment on Flower on this machine: a SuperLink and "
        "one SuperNode per client on 127.0.0.1, the example app, the final status from "
        "`flwr ls`. Needs the extra: pip install 'bayesfl[flower]'.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Not offered on Flower:\n" + "".join(
            f"  --{name}: {why}\n" for name, why in NOT_ON_FLOWER.items())
        + "Durations printed at the end: wall_s, the whole command (starting the deployment,\n"
        "the run, stopping it); run_s, the Flower run from its submission to its final status;\n"
        "rounds_s, the rounds in the ServerApp (summary.json's seconds, as in the simulator).")
    flower.add_argument("--config", type=Path, metavar="FILE.toml",
                        help="TOML file with settings (keys: the flag names)")
    add_settings(flower, exclude=tuple(NOT_ON_FLOWER))
    for f in deployment_flags():  # FlowerOptions' fields that say they are flags
        flower.add_argument(f.flag, type=f.type, default=None, help=f.help, metavar=f.metavar)
    flower.add_argument("--app", type=Path, default=None,
                        help="the Flower app folder to run; default examples/flower_app")
    flower.add_argument("--timeout", type=float, default=3600.0,
                        help="seconds to wait for the run's final status; default 3600")
    flower.add_argument("--keep", type=Path, default=None, metavar="DIR",
                        help="keep the deployment's FLWR_HOME and logs in DIR")


def run_flower(args: argparse.Namespace) -> int:
    """Run the experiment of ``args`` on a local deployment; the exit code.

    Raises:
        ConfigError: flwr is not installed, or a setting ``bayesfl flower`` does not offer is
            in the ``--config`` file (`NOT_ON_FLOWER`, with the reason).
    """
    start = time.perf_counter()
    if importlib.util.find_spec("flwr") is None:
        raise ConfigError("Flower is not installed: pip install 'bayesfl[flower]' (flwr 1.41)")
    from bayesfl.flower.local import EXAMPLE_APP, LocalFederation

    settings = read_config(args.config) if args.config is not None else {}
    settings.update(settings_from_flags(args))
    for name, why in NOT_ON_FLOWER.items():
        if name in settings and (name != "progress" or settings[name]):
            raise ConfigError(f"config {args.config}: {name} is not offered on Flower: {why}; "
                              "remove it from the file")
    settings.pop("progress", None)  # progress = false: what Flower does anyway
    out = Path(settings.pop("out", None) or
               f"runs/flower_{settings.get('strategy', 'fedlog')}_"
               f"{settings.get('dataset', 'digits')}_seed{settings.get('seed', 0)}")
    config = run_config(settings, out.resolve())
    for f in deployment_flags():
        value = getattr(args, f.key.replace("-", "_"))
        if value is not None:
            config[f.key] = value
    node_config = {}
    if config.get("data-loader"):  # this machine's user is every site's operator: allow it
        node_config["data-loaders"] = config["data-loader"]
    nodes = int(config.get("clients", 20))
    app = args.app or EXAMPLE_APP
    print(f"bayesfl: starting a SuperLink and {nodes} SuperNodes on 127.0.0.1", flush=True)
    with LocalFederation(nodes, workdir=args.keep, node_config=node_config) as fed:
        status = fed.run(config, app=app, timeout=args.timeout,
                         done_marker=out / "summary.json")
        if not status.completed:
            print(f"bayesfl: Flower run {status.run_id} ended as {status.status} "
                  f"({status.details}); SuperLink log tail:\n"
                  f"{fed.log('superlink')[-3000:]}", file=sys.stderr)
            return 1
    summary = json.loads((out / "summary.json").read_text())
    print(f"{summary['strategy']} on {summary['dataset']} over Flower ({nodes} SuperNodes, "
          f"run {status.run_id}): accuracy {summary['accuracy']:.4f}, "
          f"ECE {summary['ece']:.4f}, NLL {summary['nll']:.4f}, bytes up "
          f"{summary['bytes_up']:,}, down {summary['bytes_down']:,}, "
          f"{len(summary['events'])} event(s)")
    print(durations_line(time.perf_counter() - start, status.seconds, summary.get("seconds")))
    print(f"results in {out}")
    return 0


def durations_line(wall_s: float, run_s: float, rounds_s: float | None) -> str:
    """The three durations of a ``bayesfl flower`` command, each named for what it spans.

    Args:
        wall_s: the whole command, seconds: starting the SuperLink and SuperNodes, the run,
            stopping every process.
        run_s: the Flower run, seconds, from its submission (``flwr run``) to its final status
            (``flwr ls``): app start-up on every node included.
        rounds_s: the rounds as the ServerApp timed them (summary.json's ``seconds``, what the
            simulator's summary holds too), or None where the summary has none.
    """
    rounds = "" if rounds_s is None else f", rounds_s {rounds_s:.1f} (the ServerApp's rounds, " \
        "summary.json seconds)"
    return (f"time: wall_s {wall_s:.1f} (the whole command), run_s {run_s:.1f} (the Flower run, "
            f"submission to final status){rounds}")


def run_config(settings: Mapping[str, Any], out: Path) -> dict[str, Any]:
    """``bayesfl run`` settings (SimulationConfig fields and run keywords) as the example
    app's run config (flat; options as one ``KEY=VALUE ...`` string each)."""
    config: dict[str, Any] = {"out": str(out)}
    for target, value in fold_download(dict(settings)).items():
        if value is None:
            continue
        if target in ("strategy_options", "dataset_options"):
            key = "option" if target == "strategy_options" else "dataset-option"
            config[key] = " ".join(f"{k}={shlex.quote(_literal(v))}" for k, v in value.items())
        elif isinstance(value, list | tuple):  # shift, ood: one string of words
            config[target.replace("_", "-")] = " ".join(str(v) for v in value)
        else:
            config[target.replace("_", "-")] = value
    return config


def _literal(value: Any) -> str:
    """A TOML literal of an option value (what `bayesfl.settings.parse_options` reads)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(value) if not isinstance(value, str) else value


__all__ = ["NOT_ON_FLOWER", "add_parser", "durations_line", "run_config", "run_flower"]
