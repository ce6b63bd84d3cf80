"""The round loop, once, for every transport: `RoundLoop`.

Per round ``r`` the loop reseeds the global torch RNG from ``(seed, r)``, samples the training
clients, asks the strategy for the broadcast (``configure``) and encodes it once, hands every
client its `Step` through the transport's
`Channel` and collects the replies, then:

1. **receives** the uploads (`receive_uploads`): each is decoded with its client's key
   under the round's size limit and screened (`ServerStrategy.validate_uploads`); what fails
   is a rejection with its reason, counted in bytes like the rest;
2. warns once per run when every upload of a round was rejected;
3. skips the round (previous state kept, ``skipped`` in its record) when fewer than
   ``min_replies`` uploads were accepted, else aggregates or keeps the previous state
   (`aggregate_or_keep`);
4. evaluates the new state, in one of two **evaluation modes**:

   * ``"inline"`` (the simulator): within round ``r``, by the transport's ``evaluate_inline``;
     an evaluation that fails on a new aggregate reverts round ``r`` to the previous state
     (`evaluate_or_revert`); the record is complete at the end of
     round ``r``;
   * ``"carried"`` (Flower, where each message pays a per-message floor): round ``r``'s
     evaluation broadcast is built (a failure to build it reverts as above) and rides in round
     ``r + 1``'s message, before each client fits (the last round's in the transport's final
     message: `RoundLoop.complete_carried`); round ``r``'s record waits in
     `RoundLoop.pending` and is completed when those replies arrive;

5. builds the round's record: the keys every transport writes (`round_record`,
   `evaluation_keys`, the strategy's ``server_metrics`` and ``compute_metrics``,
   ``skipped``, ``aggregate_error``), then the transport's own (``record_extras``: timings,
   Flower's events), and hands the complete record to ``round_complete`` (append to
   ``metrics.jsonl``, checkpoint, callbacks).

What stays in a transport (`RoundHooks`): which clients it can reach, what happens when
a round starts (Flower: node discovery), what it does with the encoded broadcast, the inline
evaluation, its own record keys and what completing a round means to it.

**The cyclic garbage collector is paused during a round** (`collector_paused`: the
round, then its ``round_complete``). A round allocates hundreds of thousands of Python objects
that outlive gen 0 (every client's new state, message and evaluation), so the collector's own
thresholds started 4-7 full collections a round, each a pass over every tracked object of the
run: 1.0-1.2 s of a 10 s round at 16,000 FedLog clients. Nothing a round builds relies on the
collector (tensors and messages are freed by their reference counts); the reference cycles a
round makes are collected when it ends, by one young-generation pass (0.02 s there).

``min_replies``: ``None`` aggregates whatever was accepted, even nothing (the strategy's
``aggregate`` decides what an empty round means; the simulator's setting); ``0`` needs every
sampled client; ``k`` needs ``k`` accepted uploads (Flower's ``min-replies``, default 1).
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch

from bayesfl.engine.channel import Channel, Collected, Step
from bayesfl.engine.setup import sample_clients
from bayesfl.engine.steps import (
    aggregate_or_keep,
    all_rejected_message,
    evaluate_or_revert,
    round_view,
    screen_uploads,
)
from bayesfl.errors import MessageRejected, UploadsRejectedWarning
from bayesfl.evaluation import RoundEvaluation, merge_evaluations
from bayesfl.messages import Message, decode, encode
from bayesfl.strategies.base import RoundPlan, ServerState, ServerStrategy, derived_seed

EvaluationMode = Literal["inline", "carried"]
EVALUATION_MODES: tuple[str, ...] = ("inline", "carried")


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off inside the block (module docstring), then on
    again with one collection of the youngest generation, which holds every object the block
    allocated: the cycles among them are freed then. A collector the caller had disabled stays
    disabled and nothing is collected."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.collect(0)


# ---- receive: decode, size, key, screen ------------------------------------------------------
@dataclass
class Receipt:
    """What the server made of a round's uploads (`receive_uploads`).

    Attributes:
        accepted: the uploads that passed, in the order of the participants.
        rejections: ``{"client_id", "reason"}`` per rejected upload, in participant order
            (an unreadable reply, one that does not decode, one the strategy's screen refuses).
        bytes_up: bytes that arrived from each participant, in participant order (0 when
            nothing arrived); a rejected upload's bytes count: they crossed the wire.
        floats_up: numbers in the uploads that arrived, as the client counted them
            (``Reply.elements``) or else as decoded.
        seconds: wall time of decoding and screening.
    """

    accepted: list[Message]
    rejections: list[dict[str, Any]]
    bytes_up: list[int]
    floats_up: int
    seconds: float


def receive_uploads(server: ServerStrategy, plan: RoundPlan, participants: Sequence[int],
                    collected: Collected, *,
                    key_of: Callable[[int], bytes | None] = lambda _: None) -> Receipt:
    """Decode every participant's upload (``plan.max_upload_bytes``, the client's HMAC key
    ``key_of(client_id)``) and screen the decoded ones (`screen_uploads`)."""
    t0 = time.perf_counter()
    reasons: dict[int, str] = {}
    bytes_up: list[int] = []
    floats_up = 0
    received: list[tuple[int, Message]] = []
    max_bytes = plan.max_upload_bytes  # one limit for the round (computed from the schema)
    for cid in participants:
        reply = collected.replies.get(cid)
        if cid in collected.unreadable or reply is None:
            # no upload: unanswered, unreadable, or nothing sent (a diverged client, whose
            # reply may still carry its evaluation of the previous round)
            if cid in collected.unreadable:
                reasons[cid] = collected.unreadable[cid]
            bytes_up.append(0)
            continue
        data = reply.upload
        arrived = isinstance(data, bytes | bytearray)
        bytes_up.append(len(data) if arrived else 0)
        try:
            if not arrived:
                raise MessageRejected("not a bayesfl message: the reply carries no upload")
            message = decode(data, max_bytes=max_bytes, key=key_of(cid))
        except MessageRejected as err:
            reasons[cid] = err.reason
            floats_up += reply.elements
            continue
        floats_up += reply.elements or message.num_elements
        received.append((cid, message))
    accepted = screen_uploads(server, plan, received, reasons)
    rejections = [{"client_id": cid, "reason": reasons[cid]}
                  for cid in participants if cid in reasons]
    return Receipt(accepted, rejections, bytes_up, int(floats_up), time.perf_counter() - t0)


# ---- the record --------------------------------------------------------------------------------
def round_record(round: int, *, participants: Sequence[int], sent: int, receipt: Receipt,
                 plan: RoundPlan, broadcast_bytes: int) -> dict[str, Any]:
    """The keys of a round's record that every transport writes: who took part, what was
    accepted and rejected, and the traffic (``sent``: the clients the broadcast went to, of
    ``broadcast_bytes`` each). ``bytes_down_evaluation`` is 0 until `evaluation_keys`."""
    return {
        "round": round,
        "participants": list(participants),
        "accepted": len(receipt.accepted),
        "rejections": receipt.rejections,
        "bytes_up": int(sum(receipt.bytes_up)),
        "bytes_down": broadcast_bytes * sent,
        "bytes_up_per_client": receipt.bytes_up,
        "bytes_down_per_client": broadcast_bytes,
        "bytes_down_evaluation": 0,
        "floats_up": receipt.floats_up,
        "floats_down": plan.broadcast.num_elements * sent,
    }


def evaluation_keys(record: dict[str, Any], evaluation: RoundEvaluation | None,
                    server: ServerStrategy, bytes_down_evaluation: int) -> None:
    """A round's evaluation in its record: the headline figures (``accuracy`` None when no
    client evaluated), the strategy's round view, the per-client figures and the bytes of the
    evaluation broadcast."""
    record.update(evaluation.headline() if evaluation is not None else {"accuracy": None})
    record.update(round_view(server))
    if evaluation is not None:
        record["per_client"] = evaluation.per_client
    record["bytes_down_evaluation"] = int(bytes_down_evaluation)


# ---- the loop ------------------------------------------------------------------------------
@dataclass
class RoundTrace:
    """What a transport's ``record_extras`` may read of one round besides the record.

    Attributes:
        round: the round.
        plan: its plan (broadcast, schema, limits).
        sent: the clients its broadcast went to.
        collected: the channel's replies and events.
        accepted: the accepted uploads.
        rejections: the rejected uploads with their reasons.
        events: the round's events (the transport's start-of-round events, sampled clients it
            cannot reach, and the channel's events of fitting clients); a carried evaluation's
            events go to the record of the round evaluated.
        seconds_encode: encoding the broadcast.
        seconds_exchange: wall time of send and collect (the clients' work, in process);
            ``seconds_exchange_cpu`` the CPU time of this process in it.
        seconds_receipt: decoding and screening the uploads.
        seconds_aggregation: aggregate-or-keep.
        seconds_evaluation: the evaluation (inline) or building its broadcast (carried).
    """

    round: int
    plan: RoundPlan
    sent: list[int]
    collected: Collected
    accepted: list[Message]
    rejections: list[dict[str, Any]]
    events: list[dict[str, Any]] = field(default_factory=list)
    seconds_encode: float = 0.0
    seconds_exchange: float = 0.0
    seconds_exchange_cpu: float = 0.0
    seconds_receipt: float = 0.0
    seconds_aggregation: float = 0.0
    seconds_evaluation: float = 0.0


@dataclass
class CarriedRound:
    """A round whose record waits for its evaluation (``"carried"`` mode): the evaluation
    broadcast that rides on the next message, and the record without its evaluation."""

    round: int
    eval_bytes: bytes
    record: dict[str, Any]


InlineEvaluation = Callable[[int, ServerState], tuple[int, RoundEvaluation]]
"""``"inline"`` mode's evaluation ``(round, state) -> (bytes of the evaluation broadcast sent,
the merged evaluation)`` of every training client; raises what
`evaluate_or_revert` catches when the state cannot be evaluated."""


class RoundHooks(Protocol):
    """What a transport tells the loop (module docstring)."""

    def round_started(self, round: int) -> list[dict[str, Any]]:
        """Round ``round`` begins (after the RNG is seeded); its events so far."""

    def reachable(self, client_ids: Sequence[int]) -> list[int]:
        """The clients of ``client_ids`` a message can go to now, in order."""

    def broadcast_encoded(self, round: int, data: bytes) -> None:
        """The encoded broadcast of ``round``, as it leaves the server."""

    def record_extras(self, record: dict[str, Any], trace: RoundTrace) -> None:
        """Add the transport's own keys (timings, events) to round ``trace.round``'s record."""

    def round_complete(self, record: dict[str, Any]) -> None:
        """A round's record is complete: log, checkpoint, callbacks."""


class RoundLoop:
    """The rounds of one run, driven through ``channel`` (module docstring).

    Args:
        server: the strategy's server half.
        channel: the transport's channel.
        hooks: the transport's side of the loop (`RoundHooks`).
        state: the server state to start from (`state` is the current one).
        seed: the run's seed.
        rounds: the last round.
        first_round: the run's first round (0 for strategies with an init round, else 1).
        fraction: the share of the training clients sampled per round.
        training: the training clients' ids (novel clients excluded), sorted.
        evaluation: ``"inline"`` or ``"carried"`` (module docstring).
        evaluate_inline: the transport's evaluation (`InlineEvaluation`); required in
            ``"inline"`` mode, unused in ``"carried"``.
        min_replies: None, 0 or k (module docstring).
        evaluate_every: evaluate after every this many rounds counted from ``first_round``,
            and always after the last.
        round_timeout: seconds the channel's collect may wait for replies.
        server_key: the server's HMAC key for the broadcast (None: not authenticated).
        client_key: a client's HMAC key for its upload.
        rng_devices: the devices whose RNG each round forks (CUDA devices in use).
    """

    def __init__(self, server: ServerStrategy, channel: Channel, hooks: RoundHooks, *,
                 state: ServerState, seed: int, rounds: int, first_round: int, fraction: float,
                 training: Sequence[int], evaluation: EvaluationMode,
                 evaluate_inline: InlineEvaluation | None = None,
                 min_replies: int | None = None, evaluate_every: int = 1,
                 round_timeout: float = math.inf, server_key: bytes | None = None,
                 client_key: Callable[[int], bytes | None] = lambda _: None,
                 rng_devices: Sequence[torch.device] = ()) -> None:
        if evaluation not in EVALUATION_MODES:
            raise ValueError(f"evaluation mode {evaluation!r}: one of {EVALUATION_MODES}")
        if evaluation == "inline" and evaluate_inline is None:
            raise ValueError("the \"inline\" evaluation mode needs evaluate_inline")
        self.server, self.channel, self.hooks = server, channel, hooks
        self.state = state
        self.seed, self.rounds, self.first_round = seed, rounds, first_round
        self.fraction = fraction
        self.training = list(training)
        self.evaluation = evaluation
        self.evaluate_inline = evaluate_inline
        self.min_replies = min_replies
        self.evaluate_every = evaluate_every
        self.round_timeout = round_timeout
        self.server_key = server_key
        self.client_key = client_key
        self.rng_devices = list(rng_devices)
        self.pending: CarriedRound | None = None
        self.rejection_warned = False

    def run(self, first: int) -> None:
        """Rounds ``first`` to ``rounds``; each in its own fork of the global RNG (the
        caller's RNG state comes back). In ``"carried"`` mode the last evaluated round stays in
        `pending` for the transport's final message."""
        for r in range(first, self.rounds + 1):
            with collector_paused():
                with torch.random.fork_rng(devices=self.rng_devices):
                    record = self.run_round(r)
                if record is not None:
                    self.hooks.round_complete(record)

    def evaluates(self, round: int) -> bool:
        """Whether ``round`` is evaluated (``evaluate_every``; the last always is)."""
        return round == self.rounds or (round - self.first_round + 1) % self.evaluate_every == 0

    def run_round(self, r: int) -> dict[str, Any] | None:
        """Round ``r`` (module docstring). Returns its record when it is complete now; None
        when its evaluation is carried to the next message (`pending`). A carried
        round before it is completed on the way."""
        t0 = time.perf_counter()
        server = self.server
        torch.manual_seed(derived_seed(self.seed, r))
        events = list(self.hooks.round_started(r))
        participants, sent = self._sample(r, events)
        plan = server.configure(self.state, r)
        t_encode = time.perf_counter()
        down = encode(plan.broadcast, key=self.server_key)
        t_encode = time.perf_counter() - t_encode
        self.hooks.broadcast_encoded(r, down)
        collected, t_exchange, cpu_exchange = self._exchange(r, sent, down)
        events += [e for e in collected.events if e["step"] != "evaluate"]
        receipt = receive_uploads(server, plan, participants, collected, key_of=self.client_key)
        self._warn_all_rejected(r, receipt)
        # No upload may stop the run: an aggregate that fails, is not finite, or cannot be
        # evaluated is dropped with its reason, and the round keeps the previous state.
        previous = self.state
        t_aggregate = time.perf_counter()
        skipped, aggregate_error = self._aggregate(r, len(participants), receipt.accepted)
        t_aggregate = time.perf_counter() - t_aggregate
        record = round_record(r, participants=participants, sent=len(sent), receipt=receipt,
                              plan=plan, broadcast_bytes=len(down))
        evaluated = self.evaluates(r)
        t_eval = time.perf_counter()
        eval_bytes, reverted = self._evaluate(r, record, previous) if evaluated else (b"", None)
        aggregate_error = reverted or aggregate_error
        t_eval = time.perf_counter() - t_eval
        self.hooks.record_extras(record, RoundTrace(
            r, plan, sent, collected, receipt.accepted, receipt.rejections, events,
            seconds_encode=t_encode, seconds_exchange=t_exchange,
            seconds_exchange_cpu=cpu_exchange, seconds_receipt=receipt.seconds,
            seconds_aggregation=t_aggregate, seconds_evaluation=t_eval))
        record.update(server.server_metrics(self.state))
        record.update(server.compute_metrics(plan, receipt.accepted))  # e.g. analytic FLOPs
        if skipped is not None:
            record["skipped"] = skipped
        if aggregate_error is not None:
            record["aggregate_error"] = aggregate_error
        record["seconds"] = time.perf_counter() - t0
        if not evaluated:
            record["accuracy"] = None
            return record
        if self.evaluation == "carried":
            self.pending = CarriedRound(r, eval_bytes, record)
            return None
        return record

    def _sample(self, r: int, events: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
        """Round ``r``'s sampled training clients and those of them the transport can reach
        (an event in ``events`` for each one it cannot)."""
        participants = [self.training[i] for i in
                        sample_clients(len(self.training), self.fraction, self.seed, r)]
        sent = self.hooks.reachable(participants)
        if len(sent) != len(participants):
            reached = set(sent)
            events += [{"client_id": cid, "node_id": None, "step": "fit",
                        "reason": "sampled client has no connected node"}
                       for cid in participants if cid not in reached]
        return participants, sent

    def _exchange(self, r: int, sent: list[int], down: bytes
                  ) -> tuple[Collected, float, float]:
        """Send round ``r``'s broadcast ``down`` to ``sent`` (with the carried evaluation of
        the previous round to every reachable training client, which that round's completion
        then reads) and collect the replies: (collected, wall seconds, CPU seconds)."""
        steps = {cid: Step(fit=down) for cid in sent}
        pending = self.pending
        if pending is not None:  # the previous round's evaluation rides on this message
            for cid in self.hooks.reachable(self.training):
                step = steps.setdefault(cid, Step())
                step.evaluate, step.evaluate_round = pending.eval_bytes, pending.round
        t_exchange, cpu_exchange = time.perf_counter(), time.process_time()
        self.channel.send(r, sorted(steps), steps)
        collected = self.channel.collect(time.monotonic() + self.round_timeout)
        t_exchange, cpu_exchange = (time.perf_counter() - t_exchange,
                                    time.process_time() - cpu_exchange)
        if pending is not None:  # the previous round is complete: record and checkpoint
            self.complete_carried(collected, collected.seconds)
        return collected, t_exchange, cpu_exchange

    def _aggregate(self, r: int, sampled: int, accepted: Sequence[Message]
                   ) -> tuple[str | None, str | None]:
        """Aggregate round ``r``'s accepted uploads into `state`, or keep it: (why the
        round was skipped — fewer than ``min_replies`` of the ``sampled`` clients' uploads —,
        why the aggregate was dropped), each None when it was not."""
        need = None if self.min_replies is None else (self.min_replies or sampled)
        if need is not None and len(accepted) < need:
            return (f"{len(accepted)} accepted upload(s) < min-replies {need}: "
                    "round skipped, previous state kept"), None
        self.state, aggregate_error = aggregate_or_keep(self.server, self.state, accepted, r,
                                                        self.seed)
        return None, aggregate_error

    def _evaluate(self, r: int, record: dict[str, Any], previous: ServerState
                  ) -> tuple[bytes, str | None]:
        """Evaluate round ``r``'s new `state` (``"inline"``: now, into ``record``;
        ``"carried"``: only its broadcast is built, to ride on the next message), reverting to
        ``previous`` when that fails: (the carried broadcast or b"", why it reverted or None)."""
        if self.evaluation == "inline":
            self.state, (bytes_down_evaluation, evaluation), reverted = evaluate_or_revert(
                self.state, previous, lambda state: self.evaluate_inline(r, state))
            evaluation_keys(record, evaluation, self.server, bytes_down_evaluation)
            return b"", reverted
        self.state, eval_bytes, reverted = evaluate_or_revert(  # it must build
            self.state, previous, lambda state: encode(self.server.configure_evaluation(state, r),
                                                       key=self.server_key))
        return eval_bytes, reverted

    def complete_carried(self, collected: Collected, seconds: float) -> None:
        """Complete the `pending` round with the evaluations in ``collected`` (the
        replies to the message that carried its evaluation broadcast) and hand its record to
        ``round_complete``. The channel's events of evaluating clients go to its ``events``
        when the transport keeps that list."""
        pending, self.pending = self.pending, None
        assert pending is not None, "complete_carried() without a pending round"
        record = pending.record
        if "events" in record:
            record["events"] += [e for e in collected.events if e["step"] == "evaluate"]
        replies = collected.replies
        evaluations = [replies[c].evaluation for c in self.training
                       if c in replies and replies[c].evaluation is not None]
        evaluation = merge_evaluations(evaluations) if evaluations else None
        receivers = len(self.hooks.reachable(self.training))
        evaluation_keys(record, evaluation, self.server, len(pending.eval_bytes) * receivers)
        record["seconds_evaluation"] = seconds
        self.hooks.round_complete(record)

    def final_message(self, last_round: int, client_ids: Sequence[int], *, personalize: bool
                      ) -> tuple[bytes, Collected, list[dict[str, Any]]]:
        """The run's last message to ``client_ids`` (``"carried"`` mode): evaluate the last
        evaluated state (the `pending` round's broadcast, else the current state's),
        personalise first when asked, and complete the pending round with the replies.
        Returns (the evaluation broadcast, the replies, the channel's events that went to no
        round's record: all of them when no round was pending)."""
        pending = self.pending
        eval_bytes = pending.eval_bytes if pending is not None else encode(
            self.server.configure_evaluation(self.state, last_round), key=self.server_key)
        steps = {c: Step(evaluate=eval_bytes, evaluate_round=last_round,
                         personalize=personalize, final=True) for c in client_ids}
        t0 = time.perf_counter()
        self.channel.send(last_round, sorted(steps), steps)
        collected = self.channel.collect(time.monotonic() + self.round_timeout)
        if pending is None:
            return eval_bytes, collected, list(collected.events)
        self.complete_carried(collected, time.perf_counter() - t0)
        return eval_bytes, collected, []

    def _warn_all_rejected(self, r: int, receipt: Receipt) -> None:
        """Warn, once per run, of a round whose every upload was rejected."""
        message = all_rejected_message(r, receipt.rejections, len(receipt.accepted))
        if message is not None and not self.rejection_warned:
            self.rejection_warned = True
            warnings.warn(message, UploadsRejectedWarning, stacklevel=4)


__all__ = [
    "EVALUATION_MODES",
    "CarriedRound",
    "EvaluationMode",
    "InlineEvaluation",
    "Receipt",
    "RoundHooks",
    "RoundLoop",
    "RoundTrace",
    "collector_paused",
    "evaluation_keys",
    "receive_uploads",
    "round_record",
]
