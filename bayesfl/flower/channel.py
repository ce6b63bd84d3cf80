"""The round engine's channel over a Flower Grid (`FlowerChannel`): one ``train.round``
message per client and round, the final phases' requests (`FlowerChannel.ask`:
``query.calibrate``, ``query.shift``), and node discovery (``query.info``: a node says which
client it serves, its data sizes and the run's fingerprint; a node set up with other settings
or data is refused).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from flwr.app import Message, RecordDict
from flwr.serverapp import Grid

from bayesfl.engine.channel import Collected, Reply, Step
from bayesfl.engine.phases import Phase
from bayesfl.engine.rounds import RoundTrace
from bayesfl.errors import MessageRejected
from bayesfl.flower.protocol import (
    INFO,
    MAX_EVALUATION_BYTES,
    ROUND,
    describe_error,
    pack,
    part,
    read_evaluation,
    record_values,
    round_timeline,
    scalar,
    timings,
)
from bayesfl.strategies.base import Evaluation, ServerStrategy

_NODE_CHECK_SECONDS = 2.0  # how often a step re-reads which nodes are online


@dataclass
class Exchange:
    """The outcome of one exchange of Flower messages (out, replies back).

    Attributes:
        replies: client id -> its reply (errors excluded).
        events: what went wrong, one dict each (client_id, node_id, step, reason).
        seconds: wall time of the step; ``seconds_waiting`` of it spent between polls.
        client_timings: client id -> the timings its reply reported.
    """

    replies: dict[int, Message] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    seconds_waiting: float = 0.0
    client_timings: dict[int, dict[str, float]] = field(default_factory=dict)


class FlowerChannel:
    """The round engine's channel over a Flower Grid: one ``train.round`` message per client.

    ``nodes`` maps client ids to node ids (`discover` fills it, admitting nodes of a
    client id in ``[0, clients)`` that report ``fingerprint``); an encoded evaluation reply is
    read and checked against the strategy ``server`` and ``n_bins`` (`read`).
    `discover` with ``wait`` waits up to ``node_wait`` seconds for ``min_nodes``.
    """

    def __init__(self, grid: Grid, *, round_timeout: float, poll_interval: float,
                 server: ServerStrategy, n_bins: int, clients: int,
                 fingerprint: str, min_nodes: int, node_wait: float) -> None:
        self.grid = grid
        self.round_timeout = round_timeout
        self.poll_interval = poll_interval
        self.server, self.n_bins = server, n_bins
        self.clients, self.fingerprint = clients, fingerprint
        self.min_nodes, self.node_wait = min_nodes, node_wait
        self.nodes: dict[int, int] = {}
        self.refused: set[int] = set()  # node ids refused at discovery
        self.num_test: dict[int, int] = {}  # what each admitted node reported
        self.num_train: dict[int, int] = {}
        self._sent: tuple[int, dict[int, Step], dict[int, int]] | None = None
        self.resumed_from: int | None = None  # told to every node: they resume their state
        self._pushed: Any = None
        self.keys = None  # the final phases' messages: Flower authenticates its own way (TLS)
        self.final_broadcast: bytes = b""
        """What the final phases' requests carry to predict with (the engine sets it)."""

    def read(self, data: bytes, round: int, client_id: int) -> Evaluation:
        """Client ``client_id``'s encoded evaluation of round ``round``, checked
        (MessageRejected when it is not one of its test set)."""
        return read_evaluation(self.server, data, round=round, client_id=client_id,
                               n_bins=self.n_bins, num_test=self.num_test[client_id])

    def online(self) -> set[int]:
        return {int(n) for n in self.grid.get_node_ids()}

    # ---- the channel's verbs ------------------------------------------------------------
    def send(self, round: int, client_ids: Sequence[int], messages: Mapping[int, Step]) -> None:
        requests = {}
        for cid in client_ids:
            step = messages[cid]
            requests[cid] = (self.nodes[cid], pack(
                round=round, fit=step.fit, evaluate=step.evaluate,
                **({"evaluate-round": step.evaluate_round} if step.evaluate is not None else {}),
                **({"resumed-from": self.resumed_from} if self.resumed_from is not None else {}),
                personalize=step.personalize, final=step.final))
        self._pushed = self.push(ROUND, requests, round=round)
        self._sent = (round, {c: messages[c] for c in client_ids},
                      {c: n for c, (n, _) in requests.items()})

    def collect(self, deadline: float) -> Collected:
        assert self._sent is not None, "collect() before send()"
        _, steps, nodes = self._sent
        exchange = self.poll(self._pushed, deadline, step_of=lambda c: _step_name(steps[c]))
        self._sent = None
        out = Collected(events=list(exchange.events), seconds=exchange.seconds,
                        seconds_waiting=exchange.seconds_waiting)
        for cid, message in sorted(exchange.replies.items()):
            reply = Reply(timings=exchange.client_timings.get(cid, {}))
            try:
                values = record_values(message.content)
                reply.upload = part(values, "upload", max_bytes=2**62)
                for name in ("evaluation", "personalized"):
                    data = part(values, name, max_bytes=MAX_EVALUATION_BYTES)
                    if data is not None:
                        setattr(reply, name, self.read(data, steps[cid].evaluate_round, cid))
                error = values.get("evaluation-error")
                if isinstance(error, str):
                    out.events.append(event(cid, nodes[cid], "evaluate", error))
                problem = values.get("resume-problem")
                if isinstance(problem, str):
                    out.events.append(event(cid, nodes[cid], "resume", problem))
                diverged = values.get("diverged")
                if steps[cid].fit is not None and isinstance(diverged, str) \
                        and reply.upload is None:  # the client step's divergence guard
                    out.unreadable[cid] = f"upload not sent: {diverged[:1000]}"
                    out.replies[cid] = reply  # its evaluation of the previous round counts
                    continue
                if steps[cid].fit is not None and reply.upload is None:
                    raise MessageRejected("not a bayesfl message: the reply carries no upload")
            except MessageRejected as err:
                if steps[cid].fit is None:
                    out.events.append(event(cid, nodes[cid], "evaluate", err.reason))
                else:  # a sampled client's reply that cannot be read: its upload is rejected
                    out.unreadable[cid] = err.reason
                continue
            out.replies[cid] = reply
        return out

    def close(self) -> None:
        """Nothing to release: the Grid belongs to Flower's ServerApp process."""

    # ---- Flower messages ----------------------------------------------------------------
    def push(self, message_type: str, requests: Mapping[int, tuple[int, RecordDict]], *,
             round: int = 0) -> tuple[dict[str, int], Mapping[int, tuple[int, RecordDict]],
                                      list[dict[str, Any]], float, float]:
        """Push ``requests`` (client id -> (node id, content)); the pending message ids, the
        requests, the events of messages the SuperLink refused, the start time
        (``perf_counter``) and when the SuperLink had them (seconds since the epoch)."""
        t0 = time.perf_counter()
        ids = list(requests)
        messages = [Message(content, dst_node_id=node, message_type=message_type,
                            group_id=str(round), ttl=self.round_timeout + 60.0)
                    for node, content in (requests[c] for c in ids)]
        pushed = list(self.grid.push_messages(messages)) if messages else []
        if len(pushed) != len(ids):  # the SuperLink refused the batch (e.g. too large)
            pushed = [None] * len(ids)
        pending: dict[str, int] = {}
        events = []
        for cid, mid in zip(ids, pushed, strict=True):
            if mid:
                pending[mid] = cid
            else:
                events.append(event(cid, requests[cid][0], message_type,
                                     "the SuperLink did not accept the message"))
        return pending, requests, events, t0, time.time()

    def poll(self, pushed: tuple[dict[str, int], Mapping[int, tuple[int, RecordDict]],
                                 list[dict[str, Any]], float, float],
             deadline: float, *, step_of: Callable[[int], str]) -> Exchange:
        """Poll the SuperLink for the replies of `push` until all are in, ``deadline``
        (``time.monotonic()``) passes, or their node goes offline. A reply's timings get the
        server's stamps ``at.pushed`` (its message was pushed) and ``at.received`` (this poll
        got the reply), seconds since the epoch
        (`bayesfl.flower.protocol.message_segments`)."""
        pending, requests, events, t0, pushed_at = pushed
        pending = dict(pending)
        out = Exchange(events=[{**e, "step": step_of(e["client_id"])} for e in events])
        next_check = time.monotonic() + _NODE_CHECK_SECONDS
        while pending:
            for reply in self.grid.pull_messages(list(pending)):
                cid = pending.pop(reply.metadata.reply_to_message_id, None)
                if cid is None:
                    continue
                if reply.has_error():
                    out.events.append(event(cid, requests[cid][0], step_of(cid),
                                             describe_error(reply.error)))
                else:
                    out.replies[cid] = reply
                    out.client_timings[cid] = {**timings(reply.content), "at.pushed": pushed_at,
                                               "at.received": time.time()}
            if not pending:
                break
            now = time.monotonic()
            if now >= deadline:
                for cid in pending.values():
                    out.events.append(event(cid, requests[cid][0], step_of(cid),
                                             f"no reply within {self.round_timeout:g} s"))
                break
            if now >= next_check:
                online = self.online()
                for mid, cid in list(pending.items()):
                    if requests[cid][0] not in online:
                        del pending[mid]
                        out.events.append(event(cid, requests[cid][0], step_of(cid),
                                                 "node went offline before replying"))
                next_check = now + _NODE_CHECK_SECONDS
            w = time.perf_counter()
            time.sleep(self.poll_interval)
            out.seconds_waiting += time.perf_counter() - w
        out.seconds = time.perf_counter() - t0
        return out

    def exchange(self, message_type: str, requests: Mapping[int, tuple[int, RecordDict]],
                 *, step: str, round: int = 0) -> Exchange:
        """Push ``requests`` and poll for their replies (discovery, calibration)."""
        pushed = self.push(message_type, requests, round=round)
        return self.poll(pushed, time.monotonic() + self.round_timeout, step_of=lambda _: step)



    # ---- the final phases (bayesfl.engine.phases) ---------------------------------------
    def ask(self, phase: Phase, step: int, down: bytes, client_ids: Sequence[int]
            ) -> dict[int, Any]:
        """A final phase's request ``down`` to every client in ``client_ids``, in a
        ``phase.query`` message with the final evaluation broadcast (`final_broadcast`)
        laid out as the phase says; each client's reply bytes (the shift phase: with its notes),
        or why none came (`bayesfl.engine.phases.PhaseChannel`)."""
        fields: dict[str, Any] = {"step": step} if phase.numbered else {}
        fields.update({phase.request: down.decode() if phase.text else down,
                       "broadcast": self.final_broadcast})
        exchange = self.exchange(phase.query, {c: (self.nodes[c], pack(**fields))
                                               for c in client_ids},
                                 step=phase.step, round=step)
        answers: dict[int, Any] = {e["client_id"]: e["reason"] for e in exchange.events}
        for cid, reply in exchange.replies.items():
            try:
                values = record_values(reply.content)
                data = part(values, phase.reply, max_bytes=phase.max_bytes)
                if data is None:
                    raise MessageRejected(f"the {phase.step} reply carries no {phase.reply!r}")
                if not phase.notes:
                    answers[cid] = data
                    continue
                notes = json.loads(values.get("notes") or "[]")
                answers[cid] = (data, [str(n)[:500] for n in notes]
                                if isinstance(notes, list) else [])
            except (MessageRejected, ValueError, TypeError) as err:
                answers[cid] = getattr(err, "reason", None) or f"unreadable reply: {err}"
        return answers

    # ---- nodes --------------------------------------------------------------------------
    def discover(self, *, wait: bool = False) -> list[dict[str, Any]]:
        """Ask every online node not yet known who it is; drop known nodes that went
        offline. With ``wait``, first wait (up to ``node_wait`` seconds) for ``min_nodes``
        nodes. Returns the events (refused nodes, nodes gone)."""
        deadline = time.monotonic() + self.node_wait
        online = self.online()
        while wait and len(online) < self.min_nodes and time.monotonic() < deadline:
            time.sleep(min(1.0, self.poll_interval * 5))
            online = self.online()
        events = []
        for cid, node in list(self.nodes.items()):
            if node not in online:
                del self.nodes[cid]
                events.append(event(cid, node, "discover", "node went offline"))
        new = sorted(online - set(self.nodes.values()) - self.refused)
        if not new:
            return events
        # keyed by placeholders (-1, -2, ...) until a node says which client it serves
        requests = {-1 - i: (node, pack(round=0)) for i, node in enumerate(new)}
        exchange = self.exchange(INFO, requests, step="discover")
        events += [{**e, "client_id": None,  # unknown: the node never said who it is
                    "reason": f"discovery request to node {e['node_id']} unanswered: "
                              f"{e['reason']}"} for e in exchange.events]
        for key, reply in exchange.replies.items():
            node = requests[key][0]
            problem, cid = self.admit(reply)
            if problem is not None:
                self.refused.add(node)
                log(f"node {node} left out of the run: {problem}")
                events.append(event(cid, node, "discover", problem))
            else:
                self.nodes[cid] = node
        return events

    def admit(self, reply: Message) -> tuple[str | None, int | None]:
        """(None, client id) for a node that belongs in this run, else (why not, its id)."""
        try:
            values = dict(reply.content.config_records["bayesfl"])
            refused = values.get("refused")
            if isinstance(refused, str):  # e.g. a data loader its node config does not allow
                cid = values.get("client_id")
                valid = isinstance(cid, int) and 0 <= cid < self.clients
                return f"the node refused the run: {refused[:1000]}", cid if valid else None
            cid = scalar(values, "client_id", int)
            if not 0 <= cid < self.clients:
                return f"client id {cid} outside [0, {self.clients})", cid
            if values.get("fingerprint") != self.fingerprint:
                return ("the node's run fingerprint differs from the server's (other "
                        "settings, data or bayesfl version)"), cid
            if cid in self.nodes:
                return f"client id {cid} is already served by node {self.nodes[cid]}", cid
            self.num_test[cid] = scalar(values, "num_test", int)
            self.num_train[cid] = scalar(values, "num_train", int)
        except (KeyError, MessageRejected) as err:
            return f"malformed info reply: {err}", None
        return None, cid

def _step_name(step: Step) -> str:
    """The step an event of a round message is logged under: ``fit`` when it trains."""
    return "fit" if step.fit is not None else "evaluate"


def event(client_id: int | None, node_id: int | None, step: str, reason: str
          ) -> dict[str, Any]:
    """One event of ``metrics.jsonl``'s ``events``."""
    return {"client_id": client_id, "node_id": node_id, "step": step, "reason": reason}


def round_timings(trace: RoundTrace, started_at: float) -> dict[str, Any]:
    """A round's ``flower`` record key: the wall and polling time of its message, the slowest
    client's seconds per step, the server's, and the critical path message by message
    (`bayesfl.flower.protocol.round_timeline`); ``started_at``: when the round began
    (seconds since the epoch)."""
    collected = trace.collected
    by_client = {c: collected.replies[c].timings for c in trace.sent if c in collected.replies}

    def slowest(key: str) -> float:
        return max((t.get(key, 0.0) for t in by_client.values()), default=0.0)

    return {
        "round_wall": collected.seconds, "round_polling": collected.seconds_waiting,
        "client_setup": slowest("setup"), "client_fit": slowest("fit"),
        "client_evaluate": slowest("evaluate"), "client_encode": slowest("encode"),
        "server_encode": trace.seconds_encode,
        "server_decode_validate": trace.seconds_receipt,
        "server_aggregate": trace.seconds_aggregation + trace.seconds_evaluation,
        "client_import": slowest("import"), "client_save": slowest("save"),
        "timeline": round_timeline(started_at, time.time(), by_client),
    }


def log(text: str) -> None:
    """A line for the ServerApp's operator."""
    print(f"[bayesfl] {text}", flush=True)


__all__ = ["Exchange", "FlowerChannel", "event", "log", "round_timings"]
