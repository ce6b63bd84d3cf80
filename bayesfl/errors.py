"""Exceptions raised by the federation layer, and the warnings it gives.

Every error subclasses `BayesFLError`; configuration problems are also ``ValueError``.
Every warning subclasses `BayesFLWarning` (a ``UserWarning``: shown by default).
"""


class BayesFLError(Exception):
    """Base class of every error raised by `bayesfl`."""


class ConfigError(BayesFLError, ValueError):
    """An unknown strategy/dataset/partition name or an inconsistent experiment configuration."""


class LoaderRefused(ConfigError):  # noqa: N818 - a node's refusal, which the run survives
    """A run names a data loader the node's own config does not allow: the node refuses the
    run (on Flower its reply says so, and the server goes on without it)."""


class DataError(BayesFLError, ValueError):
    """A data set that cannot be loaded or a partition that leaves a client without data."""


class MessageRejected(BayesFLError):  # noqa: N818 - a rejection the run survives, not a crash
    """An upload or broadcast that failed validation; ``reason`` says why."""

    def __init__(self, reason: str, *, client_id: int | None = None) -> None:
        self.reason = reason
        self.client_id = client_id
        where = f"client {client_id}: " if client_id is not None else ""
        super().__init__(f"{where}{reason}")


class CheckpointError(BayesFLError):
    """A checkpoint that is missing, corrupt, or belongs to another run configuration."""


class BayesFLWarning(UserWarning):
    """Base class of every warning of `bayesfl`: something the run survives, but whose
    results depend on it."""


class UploadsRejectedWarning(BayesFLWarning):
    """Every upload of a round was rejected, so the round kept its state: usually not an
    attacker but a configuration every client shares (a body whose features break the
    strategy's requirements, a schema mismatch); the message gives the first reasons."""


class LocalTrainingWarning(BayesFLWarning):
    """A client's local training stopped early because its loss became NaN or infinite (a
    learning rate too large for the data, or inputs with extreme values); the message says
    where, and what became of the client's round."""
