"""Federated algorithms, one module each, on the two-halves contract of
:class:`~bayesfl.strategies.base.Strategy`, and the registry :data:`STRATEGIES` that maps names
to them."""

from __future__ import annotations

import inspect
from typing import Any

from bayesfl.errors import ConfigError
from bayesfl.strategies.averaging.fedavg import FedAvg, FedAvgFT
from bayesfl.strategies.averaging.fedbabu import FedBABU
from bayesfl.strategies.averaging.fedpart import FedPart, FedProxPart
from bayesfl.strategies.averaging.fedper import FedPer
from bayesfl.strategies.averaging.fedprox import FedProx
from bayesfl.strategies.averaging.fedrep import FedRep, FedRep1
from bayesfl.strategies.averaging.lg_fedavg import LGFedAvg, LGFedAvg2
from bayesfl.strategies.averaging.local_only import LocalOnly
from bayesfl.strategies.base import (
    MAP_PLUGIN,
    PREDICTIVE,
    ClientConfig,
    ClientState,
    Evaluation,
    RoundPlan,
    ServerState,
    Strategy,
    StrategyContext,
)
from bayesfl.strategies.bayes.fedpa import FedPA
from bayesfl.strategies.bayes.fedpop import FedPop
from bayesfl.strategies.bayes.pfedbayes import PFedBayes
from bayesfl.strategies.fedlog.fedlog import FedLog, FedLogC, FedLogCentralDP, FedLogLocalDP
from bayesfl.strategies.fedsi.fedsi import FedSI, FedSIFac
from bayesfl.strategies.representation.colearn import CoLearn
from bayesfl.strategies.representation.fd import FederatedDistillation
from bayesfl.strategies.representation.fedproto import FedProto

STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls
    for cls in (
        # the FedLog family (posterior strategies), then the FedLog paper's baselines
        FedLog, FedLogC, FedLogLocalDP, FedLogCentralDP, FedAvg, FedPer, FedRep, FedRep1,
        LGFedAvg, LGFedAvg2, FedBABU, FedProto,
        # FedSI and the FedSI paper's baselines, Bayesian and not
        FedSI, FedSIFac, LocalOnly, FedAvgFT, PFedBayes, FedPop, FedPA,
        # partial updates (FedPart), representation sharing (CoLearn)
        FedProx, FedPart, FedProxPart, CoLearn, FederatedDistillation,
    )
}
"""Registry: strategy name -> class. The FedLog paper's named baseline variants are entries of
their own: ``fedrep`` (its "FedRep" / "FedRep 2", two local layers), ``fedrep-1`` ("FedRep 1"),
``lg-fedavg`` ("LG-FedAvg 1", one global layer) and ``lg-fedavg-2`` ("LG-FedAvg 2")."""


def strategy_options(name: str) -> dict[str, Any]:
    """The keyword options (with defaults) that strategy ``name`` accepts."""
    cls = _lookup(name)
    options: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        if "__init__" not in vars(klass):
            continue
        for p in inspect.signature(klass.__init__).parameters.values():
            if p.kind is p.KEYWORD_ONLY:
                options[p.name] = p.default
    return options


def make_strategy(name: str, context: StrategyContext, **options: Any) -> Strategy:
    """Build strategy ``name`` with its ``options``.

    Raises:
        ConfigError: an unknown name or option (the message lists the valid ones).
    """
    cls = _lookup(name)
    valid = strategy_options(name)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ConfigError(f"unknown option(s) {unknown} for strategy {name!r}; valid: "
                          f"{', '.join(sorted(valid)) or 'none'}")
    return cls(context, **options)


def _lookup(name: str) -> type[Strategy]:
    key = name.strip().lower().replace("_", "-") if isinstance(name, str) else name
    if key not in STRATEGIES:
        raise ConfigError(f"unknown strategy {name!r}; valid names: {', '.join(STRATEGIES)}")
    return STRATEGIES[key]


__all__ = [
    "MAP_PLUGIN",
    "PREDICTIVE",
    "STRATEGIES",
    "ClientConfig",
    "ClientState",
    "CoLearn",
    "Evaluation",
    "FedAvg",
    "FedAvgFT",
    "FedBABU",
    "FedLog",
    "FedLogC",
    "FedLogCentralDP",
    "FedLogLocalDP",
    "FedPA",
    "FedPart",
    "FedPer",
    "FedPop",
    "FedProto",
    "FedProx",
    "FedProxPart",
    "FedRep",
    "FedRep1",
    "FedSI",
    "FedSIFac",
    "FederatedDistillation",
    "LGFedAvg",
    "LGFedAvg2",
    "LocalOnly",
    "PFedBayes",
    "RoundPlan",
    "ServerState",
    "Strategy",
    "StrategyContext",
    "make_strategy",
    "strategy_options",
]
