"""Federated algorithms, one module each in a folder per family, on the two-halves contract of
[`Strategy`][bayesfl.strategies.base.Strategy] (a ``ServerStrategy`` and a ``ClientStrategy`` over
the shared ``StrategyConfig``; each side holds one half through a view,
`bayesfl.strategies.halves`), and the registry `STRATEGIES` that maps names
to them (`bayesfl.strategies.registry`: each strategy registers where it is defined, with
its options declared as data)."""

from __future__ import annotations

import importlib
import pkgutil
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
    ClientStrategy,
    Evaluation,
    RoundPlan,
    ServerState,
    ServerStrategy,
    Strategy,
    StrategyConfig,
    StrategyContext,
)
from bayesfl.strategies.bayes.fedpa import FedPA
from bayesfl.strategies.bayes.fedpop import FedPop
from bayesfl.strategies.bayes.pfedbayes import PFedBayes
from bayesfl.strategies.fedlog.fedlog import FedLog, FedLogC, FedLogCentralDP, FedLogLocalDP
from bayesfl.strategies.fedsi.fedsi import FedSI, FedSIFac
from bayesfl.strategies.registry import (
    FAMILIES,
    STRATEGIES,
    Option,
    check_option_names,
    check_options,
    lookup,
    options_of,
    register_strategy,
    sort_registry,
    strategy_defaults,
)
from bayesfl.strategies.representation.colearn import CoLearn
from bayesfl.strategies.representation.fd import FederatedDistillation
from bayesfl.strategies.representation.fedproto import FedProto


def _import_family_modules() -> None:
    """Import every module of the family folders, so that each strategy registers where it
    is defined (a new strategy module needs no line here); then put the registry in listing
    order."""
    for family in FAMILIES:
        package = importlib.import_module(f"{__name__}.{family}")
        for module in pkgutil.iter_modules(package.__path__):
            importlib.import_module(f"{package.__name__}.{module.name}")
    sort_registry()


_import_family_modules()


def strategy_options(name: str) -> dict[str, Any]:
    """The keyword options (with their defaults) that strategy ``name`` accepts, from its
    declaration (`options_of`).

    Raises:
        ConfigError: an unknown name (the message lists the valid ones and the nearest).
    """
    return strategy_defaults(name)


def make_strategy(name: str, context: StrategyContext, **options: Any) -> Strategy:
    """Build strategy ``name`` with its ``options``, checked against its declaration: unknown
    names first; then the strategy's own checks speak (their messages are the more specific),
    and the declaration refuses what they let through.

    Raises:
        ConfigError: an unknown name or option (the message lists the valid ones and the
            nearest), or an option value of the wrong type, out of bounds or not one of its
            choices (`check`).
    """
    cls = lookup(name)
    check_option_names(name, options)
    try:
        strategy = cls(context, **options)
    except ConfigError:
        raise  # the strategy's own check: the more specific message (e.g. FedLog's prior_nu)
    except Exception:
        check_options(name, options)  # a value the declaration refuses, said as such
        raise
    check_options(name, options)  # what the strategy's own checks let through
    return strategy


__all__ = [
    "FAMILIES",
    "MAP_PLUGIN",
    "PREDICTIVE",
    "STRATEGIES",
    "ClientConfig",
    "ClientState",
    "ClientStrategy",
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
    "Option",
    "PFedBayes",
    "RoundPlan",
    "ServerState",
    "ServerStrategy",
    "Strategy",
    "StrategyConfig",
    "StrategyContext",
    "check_option_names",
    "check_options",
    "make_strategy",
    "options_of",
    "register_strategy",
    "strategy_options",
]
