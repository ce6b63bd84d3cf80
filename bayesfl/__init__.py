"""bayesfl: federated classification with probabilistic heads.

The federation layer: partitions, client bodies, strategies (each a server half and a client
half that share only messages, see :mod:`bayesfl.strategies.base`), messages, the embedded
simulator (a transport) and the CLI. Depends on :mod:`inference` and :mod:`calibration`.
"""

from bayesfl import data
from bayesfl.bodies import register_body
from bayesfl.data import Dataset, load_dataset, make_clients, partition
from bayesfl.errors import BayesFLError, CheckpointError, ConfigError, DataError, MessageRejected
from bayesfl.executor import ClientExecutor, SimulatedClient
from bayesfl.loaded_run import LoadedRun, load_run
from bayesfl.posterior import ClientPosterior
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
    "LoadedRun",
    "MessageRejected",
    "RoundPlan",
    "SimulatedClient",
    "SimulationConfig",
    "SimulationResult",
    "Strategy",
    "StrategyContext",
    "data",
    "load_dataset",
    "load_run",
    "make_clients",
    "make_strategy",
    "partition",
    "register_body",
    "simulate",
]
