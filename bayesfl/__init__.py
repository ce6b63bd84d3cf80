"""bayesfl: federated classification with probabilistic heads.

The federation layer: partitions, client bodies, strategies, messages, the embedded
simulator and the CLI. Depends on :mod:`inference` and :mod:`calibration`.
"""

from bayesfl import data
from bayesfl.data import load_dataset, make_clients, partition
from bayesfl.errors import BayesFLError, CheckpointError, ConfigError, DataError, MessageRejected
from bayesfl.simulate import SimulationConfig, SimulationResult, simulate
from bayesfl.strategies import STRATEGIES, make_strategy

__version__ = "0.1.0"

__all__ = [
    "STRATEGIES",
    "BayesFLError",
    "CheckpointError",
    "ConfigError",
    "DataError",
    "MessageRejected",
    "SimulationConfig",
    "SimulationResult",
    "data",
    "load_dataset",
    "make_clients",
    "make_strategy",
    "partition",
    "simulate",
]
