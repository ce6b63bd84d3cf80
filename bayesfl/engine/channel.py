"""What the round engine needs from a transport: a channel with three verbs.

``send(round, client_ids, messages)`` hands each client its step (`Step`: the bytes of
the round's broadcast to fit on and/or of the evaluation broadcast to evaluate with, and the
final steps' flags); ``collect(deadline)`` returns what came back by then (`Reply` per
client) and what went wrong (events: a node that did not answer, an error reply, bytes that do
not parse); ``close()`` ends the federation's side of the run. The in-process channel
(`bayesfl.simulate`) runs the client halves in this process; the Flower channel
(`bayesfl.flower.server_app`) pushes the steps to SuperNodes through Flower's Grid.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from bayesfl.strategies.base import Evaluation


@dataclass
class Step:
    """One client's work of one message.

    Attributes:
        fit: the encoded broadcast to fit on (None: the client does not train this step).
        evaluate: the encoded evaluation broadcast of the previous state to evaluate with
            *before* fitting (None: no evaluation in this step).
        evaluate_round: the round whose state ``evaluate`` is.
        personalize: personalise after evaluating (final step), then evaluate that state.
        final: the last step of the run (the client keeps its final state for calibration).
    """

    fit: bytes | None = None
    evaluate: bytes | None = None
    evaluate_round: int = 0
    personalize: bool = False
    final: bool = False


@dataclass
class Reply:
    """What one client sent back for a `Step`.

    Attributes:
        upload: the encoded upload (None when it did not fit or sent nothing).
        evaluation: its evaluation of the step's evaluation broadcast, checked.
        personalized: its evaluation of its personalised state (final step).
        timings: seconds the client reported (setup, fit, evaluate, encode).
        elements: numbers in the upload as the client sent it (0 when not known).
    """

    upload: Any = None
    evaluation: Evaluation | None = None
    personalized: Evaluation | None = None
    timings: dict[str, float] = field(default_factory=dict)
    elements: int = 0


@dataclass
class Collected:
    """The replies of a step, its events (``{"client_id", "node_id", "step", "reason"}``) and
    the uploads that did not arrive as one (``unreadable``: client id -> why: a reply that
    cannot be read, a client that sent nothing because its training diverged); each is a
    rejected upload of the round."""

    replies: dict[int, Reply] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    unreadable: dict[int, str] = field(default_factory=dict)
    seconds: float = 0.0
    seconds_waiting: float = 0.0


class Channel(Protocol):
    """A transport as the round engine drives it (module docstring)."""

    def send(self, round: int, client_ids: Sequence[int], messages: Mapping[int, Step]) -> None:
        """Hand every client in ``client_ids`` its step ``messages[client_id]``."""

    def collect(self, deadline: float) -> Collected:
        """The replies to the last `send` until all are in or ``deadline``
        (``time.monotonic()`` seconds) passes; what is missing then is an event."""

    def close(self) -> None:
        """End the run on the federation's side."""


__all__ = ["Channel", "Collected", "Reply", "Step"]
