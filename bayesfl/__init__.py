"""bayesfl: federated classification with probabilistic heads.

The federation layer: partitions, client bodies, strategies (each a server half and a client
half that share only messages, see `bayesfl.strategies.base`), messages, the embedded
simulator (a transport) and the CLI. Depends on [`inference`][inference] and `calibration`.

The public names below are imported on first use (PEP 562): ``import bayesfl`` alone loads
nothing else, so a process that needs one corner of the package (a Flower ClientApp, started
afresh for every message) pays only for that corner. ``from bayesfl import simulate`` and
``bayesfl.simulate(...)`` work as with eager imports.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the names are, for readers, type checkers and the API docs
    from bayesfl import data, ensemble
    from bayesfl.bodies import register_body
    from bayesfl.data import Dataset, load_dataset, make_clients, partition
    from bayesfl.ensemble import DeepEnsemble, simulate_ensemble
    from bayesfl.errors import (
        BayesFLError,
        CheckpointError,
        ConfigError,
        DataError,
        MessageRejected,
    )
    from bayesfl.executor import ClientExecutor, SimulatedClient
    from bayesfl.loaded_run import LoadedRun, load_run
    from bayesfl.posterior import ClientPosterior
    from bayesfl.shift_evaluation import ShiftReport, evaluate_shift
    from bayesfl.shift_protocol import stored_shift_report
    from bayesfl.simulate import SimulationConfig, SimulationResult, simulate
    from bayesfl.strategies import (
        STRATEGIES,
        ClientConfig,
        RoundPlan,
        Strategy,
        StrategyContext,
        make_strategy,
    )

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "data": "bayesfl.data",
    "ensemble": "bayesfl.ensemble",
    "DeepEnsemble": "bayesfl.ensemble",
    "simulate_ensemble": "bayesfl.ensemble",
    "register_body": "bayesfl.bodies",
    "Dataset": "bayesfl.data",
    "load_dataset": "bayesfl.data",
    "make_clients": "bayesfl.data",
    "partition": "bayesfl.data",
    "BayesFLError": "bayesfl.errors",
    "CheckpointError": "bayesfl.errors",
    "ConfigError": "bayesfl.errors",
    "DataError": "bayesfl.errors",
    "MessageRejected": "bayesfl.errors",
    "ClientExecutor": "bayesfl.executor",
    "SimulatedClient": "bayesfl.executor",
    "LoadedRun": "bayesfl.loaded_run",
    "load_run": "bayesfl.loaded_run",
    "ClientPosterior": "bayesfl.posterior",
    "ShiftReport": "bayesfl.shift_evaluation",
    "evaluate_shift": "bayesfl.shift_evaluation",
    "stored_shift_report": "bayesfl.shift_protocol",
    "SimulationConfig": "bayesfl.simulate",
    "SimulationResult": "bayesfl.simulate",
    "simulate": "bayesfl.simulate",
    "STRATEGIES": "bayesfl.strategies",
    "ClientConfig": "bayesfl.strategies",
    "RoundPlan": "bayesfl.strategies",
    "Strategy": "bayesfl.strategies",
    "StrategyContext": "bayesfl.strategies",
    "make_strategy": "bayesfl.strategies",
}
"""Public name -> the module it is imported from on first use (the same names as ``__all__``)."""

_MODULES = frozenset({"data", "ensemble"})
"""Public names that are modules themselves (the others are attributes of their module)."""

__all__ = [
    "STRATEGIES",
    "BayesFLError",
    "CheckpointError",
    "ClientConfig",
    "ClientExecutor",
    "ClientPosterior",
    "ConfigError",
    "DataError",
    "Dataset",
    "DeepEnsemble",
    "LoadedRun",
    "MessageRejected",
    "RoundPlan",
    "ShiftReport",
    "SimulatedClient",
    "SimulationConfig",
    "SimulationResult",
    "Strategy",
    "StrategyContext",
    "data",
    "ensemble",
    "evaluate_shift",
    "load_dataset",
    "load_run",
    "make_clients",
    "make_strategy",
    "partition",
    "register_body",
    "simulate",
    "simulate_ensemble",
    "stored_shift_report",
]


def __getattr__(name: str) -> Any:
    """Import a public name on first use and keep it in the package (PEP 562)."""
    source = _EXPORTS.get(name)
    if source is None:
        raise AttributeError(f"module 'bayesfl' has no attribute {name!r}")
    module = importlib.import_module(source)
    value = module if name in _MODULES else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """The package's module type: importing the submodule ``bayesfl.simulate`` must not replace
    the function ``bayesfl.simulate`` with the module (the import system sets a submodule as an
    attribute of its package when it first loads it; eager imports used to rebind the name
    afterwards). The submodule stays reachable as ``sys.modules["bayesfl.simulate"]`` and by
    ``from bayesfl.simulate import ...``."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and name in _EXPORTS and name not in _MODULES:
            return  # a submodule named like a public function or class: the function wins
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
