"""bayesfl: federated classification with probabilistic heads.

The federation layer: partitions, client bodies, strategies, messages, the embedded
simulator and the CLI. Depends on :mod:`inference` and :mod:`calibration`.
"""

from bayesfl.errors import BayesFLError, CheckpointError, ConfigError, DataError, MessageRejected

__version__ = "0.1.0"

__all__ = ["BayesFLError", "CheckpointError", "ConfigError", "DataError", "MessageRejected"]
