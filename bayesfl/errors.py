"""Exceptions raised by the federation layer.

Every error subclasses :class:`BayesFLError`; configuration problems are also ``ValueError``.
"""


class BayesFLError(Exception):
    """Base class of every error raised by :mod:`bayesfl`."""


class ConfigError(BayesFLError, ValueError):
    """An unknown strategy/dataset/partition name or an inconsistent experiment configuration."""


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
