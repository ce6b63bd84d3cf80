"""The Flower deployment's options, listed once: `FlowerOptions`' fields are the run
config's deployment keys (`bayesfl.flower.protocol.parse_run_config`) and, where a field
says so, the deployment flags of ``bayesfl flower`` (`deployment_flags`).

No ``flwr`` import here: the CLI builds ``bayesfl flower --help`` from it without Flower
installed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

from bayesfl.config import describe
from bayesfl.errors import ConfigError


def _flag(default: Any, kind: type, help: str, metavar: str | None = None) -> Any:
    """A field that ``bayesfl flower`` offers as ``--NAME`` (``kind``, ``help``)."""
    return field(default=default, metadata={"flag": help, "type": kind, "metavar": metavar})


@dataclass(frozen=True)
class FlowerOptions:
    """How the ServerApp drives the federation (run-config keys with ``-`` for ``_``). The
    fields with a ``flag`` in their metadata are ``bayesfl flower``'s deployment flags too
    (`deployment_flags`).

    Attributes:
        out: the server's run directory (a path on the SuperLink's machine); None writes
            nothing.
        resume: continue the run whose checkpoint is in ``out``.
        force: start again in a non-empty ``out`` (the files a run writes are replaced).
        threads: torch threads of every ClientApp and of the ServerApp (None: the
            simulator's default).
        min_replies: the fewest accepted uploads a round aggregates; a round with fewer is
            skipped (its state kept) and logged. 0 means all sampled clients.
        round_timeout: seconds a step waits for its replies; a node that has not answered
            by then is logged and left out of the step.
        min_nodes: nodes the run waits for before it starts (0: ``clients``).
        node_wait: seconds it waits for them; it starts with those it has after that.
        poll_interval: seconds between two polls of the SuperLink for replies. Between
            rounds its wait is hidden: the node that replied last sleeps 3 s after its
            next (empty) pull, so a finer poll shortens no round (docs/flower.md, Cost).
        evaluate_every: evaluate after every this many rounds, counted from the first
            (FedLog's round 0 included), and always after the last.
        data_loader: ``package.module:function`` every SuperNode calls to load its own data
            (`bayesfl.flower.client_app.site_data`): nothing is sent; None loads the
            run's data set and keeps the node's partition of it. A node calls it only if its
            own node config allows it (``data-loaders``,
            `bayesfl.flower.client_app.allowed_loader`); a node that does not refuses
            the run, and the server goes on without it.
        shift: input shifts (``KIND:S1,S2``) every site evaluates its final state on after the
            run (`bayesfl.shift_protocol`); the report goes to ``out/shift``.
        ood: out-of-distribution sets (``unseen-labels``, ``novel-clients``) scored there too.
    """

    out: str | None = None
    resume: bool = False
    force: bool = False
    threads: int | None = None
    min_replies: int = _flag(1, int, "fewest accepted uploads a round aggregates, else it is "
                             "skipped (0: all); default 1")
    round_timeout: float = _flag(600.0, float, "seconds a step waits for replies; default 600")
    min_nodes: int = 0
    node_wait: float = 120.0
    poll_interval: float = 0.2
    evaluate_every: int = _flag(1, int, "evaluate every this many rounds (and after the last); "
                                "default 1")
    data_loader: str | None = _flag(
        None, str, "every SuperNode loads its own data with FUNCTION(partition_id) (x, y) instead "
        "of its partition of --dataset; the local SuperNodes are started allowing it (node "
        "config data-loaders: a node runs only the loaders its operator lists)",
        metavar="PACKAGE.MODULE:FUNCTION")
    shift: tuple[str, ...] = ()
    ood: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("min_replies", "min_nodes"):
            _check(name, getattr(self, name), int, low=0)
        _check("evaluate_every", self.evaluate_every, int, low=1)
        for name in ("round_timeout", "node_wait", "poll_interval"):
            _check(name, getattr(self, name), float, low=0.0)
        if self.poll_interval <= 0 or self.round_timeout <= 0:
            raise ConfigError("round-timeout and poll-interval must be > 0 seconds")
        if self.resume and self.force:
            raise ConfigError("resume and force contradict each other; pass one")
        if self.data_loader is not None and (not isinstance(self.data_loader, str)
                                             or ":" not in self.data_loader):
            raise ConfigError("run config data-loader must be 'package.module:function', got "
                              f"{describe(self.data_loader)}")


FLOWER_KEYS = {f.name.replace("_", "-"): f.name for f in fields(FlowerOptions)}
"""Run-config key -> `FlowerOptions` field."""


class DeploymentFlag(NamedTuple):
    """A ``bayesfl flower`` flag: ``--KEY``, its type, its run-config key, its help."""

    flag: str
    type: type
    key: str
    help: str
    metavar: str | None = None


def deployment_flags() -> tuple[DeploymentFlag, ...]:
    """The fields of `FlowerOptions` that ``bayesfl flower`` offers as flags."""
    return tuple(DeploymentFlag(f"--{f.name.replace('_', '-')}", f.metadata["type"],
                                f.name.replace("_", "-"), f.metadata["flag"],
                                f.metadata.get("metavar"))
                 for f in fields(FlowerOptions) if "flag" in f.metadata)


def _check(name: str, value: Any, kind: type, low: float) -> None:
    ok = not isinstance(value, bool) and (
        isinstance(value, int) if kind is int else isinstance(value, int | float))
    if not ok or (kind is float and not math.isfinite(value)) or value < low:
        raise ConfigError(f"run config {name.replace('_', '-')} must be a "
                          f"{'whole' if kind is int else 'finite'} number >= {low}, got "
                          f"{describe(value)}")


__all__ = ["FLOWER_KEYS", "DeploymentFlag", "FlowerOptions", "deployment_flags"]
