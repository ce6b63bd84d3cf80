"""The bayesfl ServerApp: the round engine (:mod:`bayesfl.engine`) driving SuperNodes over
Flower's Grid.

Per run (:class:`FlowerServer`): parse the run config (:mod:`bayesfl.flower.protocol`), build
the strategy's server half from it exactly as the simulator does
(:func:`bayesfl.engine.setup.run_setup`), wait for ``min-nodes`` SuperNodes and ask each who it
is (``query.info``: its client id, its test-set size and the run's fingerprint; a node set up
with other settings or data is refused and logged). Then the engine's one round loop
(:class:`bayesfl.engine.rounds.RoundLoop`, the simulator's too) runs the rounds in its
``"carried"`` evaluation mode over :class:`FlowerChannel`, with this module's hooks (node
discovery, the reachable nodes, the ``"flower"`` timings and ``events`` of a record, the
checkpoint). Per round ``r``, **one message per client** (``train.round``):

1. sample the training clients as the simulator does (novel clients, ``novel-fraction``, never
   train); a sampled client whose node is not connected is logged as unavailable;
2. ``configure`` -> the broadcast, encoded once, goes to every sampled node (``fit``); every
   connected training node also gets the evaluation broadcast of round ``r - 1``'s state
   (``evaluate``, when that round is evaluated): it evaluates before it fits, with the state
   the simulator would have evaluated, and returns accumulator states only;
3. collect the replies until all are in, ``round-timeout`` passes, or a node goes offline; a
   missing reply, a Flower error reply, bytes that do not decode and an upload that fails
   :meth:`Strategy.validate_uploads` are each an event with its reason in ``metrics.jsonl``
   (``events``; invalid uploads also under ``rejections``, as in the simulator), never a crash;
4. round ``r - 1``'s record gets its evaluation (the merge of the accumulators:
   :func:`bayesfl.evaluation.merge_evaluations`), is appended and checkpointed;
5. with at least ``min-replies`` accepted uploads, aggregate or keep the previous state
   (:func:`bayesfl.engine.steps.aggregate_or_keep`); with fewer, the round is skipped
   (``skipped``; the simulator has no such minimum: docs/architecture.md, "One round loop,
   two channels"); the new state's evaluation broadcast is built or the previous state comes
   back (:func:`bayesfl.engine.steps.evaluate_or_revert`).

The last message of a run (``evaluate``, ``personalize`` for strategies that personalise)
completes the last round's record, personalises, and evaluates every node, the novel clients'
too (``summary["novel"]``). With ``calibrate``, the temperature-scaling step
(:func:`bayesfl.calibrate.temperature_search_over`) runs over ``query.calibrate`` messages on
the nodes' held-out data and reports as in the simulator (``summary["calibration"]``). With
the run keys ``shift``/``ood`` every site then evaluates its final state on its own shifted
and out-of-distribution rows over ``query.shift`` messages (:mod:`bayesfl.shift_protocol`);
the server merges the validated states into the report ``bayesfl evaluate`` writes
(``out/shift``, ``summary["shift_evaluation"]``).
``authenticate`` is simulator-only: on Flower use its TLS and SuperNode authentication.

The run directory is the simulator's (``metrics.jsonl``, ``summary.json``, ``manifest.json``,
``partition.txt/json``, ``checkpoint.safetensors`` in the one format of
:mod:`bayesfl.engine.state`, ``accuracy.png``, ``reliability.png``), minus
``predictions.npz``: no prediction leaves a client, and the reliability diagram is drawn from
the merged bins. A run resumes from its checkpoint (``resume = true``): the server state, RNG
and metrics come back. The clients' own states live on the SuperNodes, in the Flower run's
``context.state``, which Flower gives every new run empty: a node whose node config names a
``state-dir`` (:class:`bayesfl.flower.local.LocalFederation` gives every node one) also keeps
its trained state after each fit there, and every message of a resumed run tells the nodes the
round it resumed from, so each goes on from its state of that round and the resumed run
writes the uninterrupted run's numbers. A node without ``state-dir`` starts its client again
from its initial state (logged as a ``resume`` event): strategies whose client state carries
from round to round (FedLog's local body, FedPer's head, ...) then differ from an
uninterrupted run. A round's record is checkpointed when its evaluation arrives, with the next
round's message (or the final one): a run stopped between the two repeats that next round.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from flwr.app import Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp

from bayesfl.calibrate import CalibrationOutcome, temperature_search_over
from bayesfl.config import check_threads, torch_threads
from bayesfl.data.datasets import load_dataset
from bayesfl.engine.channel import Collected, Reply, Step
from bayesfl.engine.rounds import RoundLoop, RoundTrace
from bayesfl.engine.run import FinalEvaluation, Run
from bayesfl.errors import (
    BayesFLError,
    MessageRejected,
)
from bayesfl.evaluation import merge_evaluations
from bayesfl.flower.protocol import (
    CALIBRATE,
    INFO,
    MAX_EVALUATION_BYTES,
    ROUND,
    SHIFT,
    describe_error,
    pack,
    part,
    read_evaluation,
    record_values,
    round_timeline,
    scalar,
    timings,
)
from bayesfl.messages import encode
from bayesfl.run_directory import prepare_run_directory
from bayesfl.strategies.base import PREDICTIVE, Evaluation

app = ServerApp()

_NODE_CHECK_SECONDS = 2.0  # how often a step re-reads which nodes are online


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Flower's entry point: run the experiment of ``context.run_config``."""
    FlowerServer(grid, context.run_config).run()


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

    ``nodes`` maps client ids to node ids (the server's discovery fills it); ``read`` turns an
    encoded evaluation reply of a client into an :class:`Evaluation` (MessageRejected when it
    is not one).
    """

    def __init__(self, grid: Grid, *, round_timeout: float, poll_interval: float,
                 nodes: dict[int, int],
                 read: Callable[[bytes, int, int], Evaluation]) -> None:
        self.grid = grid
        self.round_timeout = round_timeout
        self.poll_interval = poll_interval
        self.nodes = nodes
        self.read = read
        self._sent: tuple[int, dict[int, Step], dict[int, int]] | None = None
        self.resumed_from: int | None = None  # told to every node: they resume their state
        self._pushed: Any = None

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
                    out.events.append(_event(cid, nodes[cid], "evaluate", error))
                problem = values.get("resume-problem")
                if isinstance(problem, str):
                    out.events.append(_event(cid, nodes[cid], "resume", problem))
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
                    out.events.append(_event(cid, nodes[cid], "evaluate", err.reason))
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
                events.append(_event(cid, requests[cid][0], message_type,
                                     "the SuperLink did not accept the message"))
        return pending, requests, events, t0, time.time()

    def poll(self, pushed: tuple[dict[str, int], Mapping[int, tuple[int, RecordDict]],
                                 list[dict[str, Any]], float, float],
             deadline: float, *, step_of: Callable[[int], str]) -> Exchange:
        """Poll the SuperLink for the replies of :meth:`push` until all are in, ``deadline``
        (``time.monotonic()``) passes, or their node goes offline. A reply's timings get the
        server's stamps ``at.pushed`` (its message was pushed) and ``at.received`` (this poll
        got the reply), seconds since the epoch
        (:func:`bayesfl.flower.protocol.message_segments`)."""
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
                    out.events.append(_event(cid, requests[cid][0], step_of(cid),
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
                    out.events.append(_event(cid, requests[cid][0], step_of(cid),
                                             f"no reply within {self.round_timeout:g} s"))
                break
            if now >= next_check:
                online = self.online()
                for mid, cid in list(pending.items()):
                    if requests[cid][0] not in online:
                        del pending[mid]
                        out.events.append(_event(cid, requests[cid][0], step_of(cid),
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


def _step_name(step: Step) -> str:
    """The step an event of a round message is logged under: ``fit`` when it trains."""
    return "fit" if step.fit is not None else "evaluate"


class FlowerServer(Run):
    """One run of a strategy's server half over a Flower Grid (module docstring): the engine's
    run (:class:`bayesfl.engine.run.Run`) with node discovery, the ``"carried"`` round loop,
    the ``flower`` record keys and the final steps over ``query.*`` messages."""

    def __init__(self, grid: Grid, run_config: Mapping[str, Any]) -> None:
        from bayesfl.flower.protocol import parse_run_config

        config, self.options = parse_run_config(run_config)
        run_dir = None if self.options.out is None else Path(self.options.out)
        if run_dir is not None:
            prepare_run_directory(run_dir, resume=self.options.resume, force=self.options.force)
        # the server loads the data set only for its shapes and the partition's sizes (the
        # same setup as every node's); nothing it trains or evaluates reads the data
        dataset = load_dataset(config.dataset, seed=config.data_rng_seed, **config.dataset_options)
        super().__init__(config, run_dir, dataset, threads=check_threads(self.options.threads),
                         resume=self.options.resume, data_loader=self.options.data_loader)
        self.manifest_extras = {"transport": "flower", "data_loader": self.options.data_loader}
        self.transport = "flower"
        self.strategy = self.server
        self.num_classes = dataset.num_classes
        self.refused: set[int] = set()  # node ids refused at discovery
        self.num_test: dict[int, int] = {}
        self.num_train: dict[int, int] = {}
        self.startup: list[dict[str, Any]] = []  # discovery's events, for the first record
        self._round_started_at = time.time()
        self.shift_request = None  # the shift step after the run (run keys shift, ood)
        self.shift_outcome = None
        if self.options.shift or self.options.ood:  # refused now, before any round, if bad
            from bayesfl.shift_protocol import shift_request

            self.shift_request = shift_request(
                config, dataset, None if self.data_loader is not None else
                self.setup.client_data, self.novel, self.options.shift, self.options.ood)
        self.channel = FlowerChannel(grid, round_timeout=self.options.round_timeout,
                                     poll_interval=self.options.poll_interval,
                                     nodes={}, read=self._read_evaluation)
        # the one round loop of every transport; each round's evaluation rides on the next
        # round's message ("carried": one message per client per round), and a round with
        # fewer than min-replies accepted uploads is skipped
        self.loop = RoundLoop(
            self.server, self.channel, self, state=self.server.init(), seed=config.seed,
            rounds=config.rounds, first_round=self.first_round, fraction=config.fraction,
            training=self.training, evaluation="carried",
            min_replies=self.options.min_replies, evaluate_every=self.options.evaluate_every,
            round_timeout=self.options.round_timeout, rng_devices=self.rng_devices())

    @property
    def nodes(self) -> dict[int, int]:
        """Client id -> node id of the admitted nodes (the channel's address book)."""
        return self.channel.nodes

    @nodes.setter
    def nodes(self, nodes: dict[int, int]) -> None:
        self.channel.nodes = nodes

    @property
    def grid(self) -> Grid:
        return self.channel.grid

    @grid.setter
    def grid(self, grid: Grid) -> None:
        self.channel.grid = grid

    def run(self) -> dict[str, Any]:
        """Every round, the final steps and the files; returns the summary."""
        with torch_threads(self.threads):
            try:
                return self.execute()
            finally:
                self.channel.close()

    # ---- the run's hooks (bayesfl.engine.run.Run) ---------------------------------------
    def restore_clients(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """The clients' states live on their nodes: every message tells them the round."""
        self.channel.resumed_from = meta["round"]

    def rounds_starting(self, first: int) -> None:
        self.startup = self.discover(wait=True)
        _log(f"{len(self.nodes)} of {self.config.clients} clients connected")
        if self.data_loader is not None and self.run_dir is not None:
            self._write_site_sizes()

    def final_evaluation(self, last_round: int) -> FinalEvaluation:
        """The last message (the last round's evaluation, personalisation, the novel
        clients) to every connected node."""
        personalize = self.server.personalizes
        eval_bytes, collected, unrecorded = self.loop.final_message(
            last_round, sorted(self.nodes), personalize=personalize)
        kind = "personalized" if personalize else "evaluation"
        mine = [getattr(collected.replies[c], kind) for c in self.training
                if c in collected.replies]
        mine = [e for e in mine if e is not None]
        if not mine:
            raise BayesFLError("no client returned an evaluation after the last round; "
                               "see the events in metrics.jsonl")
        self.final_accumulators = [e.accumulators[PREDICTIVE] for e in mine]
        novel = [getattr(collected.replies[c], kind) for c in self.novel
                 if c in collected.replies]
        novel = [e for e in novel if e is not None]
        metrics = self.metrics_log.records
        return FinalEvaluation(
            merge_evaluations(mine), personalize,
            merge_evaluations(novel) if novel else None, eval_bytes, extras={
                "events": [{"round": m["round"], **e} for m in metrics
                           for e in m.get("events", [])] + unrecorded,
                "skipped_rounds": [m["round"] for m in metrics if m.get("skipped")],
                "transport": "flower"})

    def final_steps(self, final: FinalEvaluation, summary: dict[str, Any]) -> None:
        """Calibrate, conformal and shift over ``query.*`` messages, as the run asks."""
        calibration = self._calibrate(final.broadcast)
        if calibration is not None:
            summary["calibration"] = calibration.summary(summary)
        from bayesfl.flower.conformal_step import server_conformal_step

        server_conformal_step(self, final.broadcast, summary)  # conformal=: bayesfl.conformal
        if self.shift_request is not None:
            summary["shift_evaluation"] = self._shift_evaluation(final.broadcast)
        _log(f"done: accuracy {summary['accuracy']:.4f}, ECE {summary['ece']:.4f}, "
             f"{len(summary['events'])} event(s)")

    def log(self, text: str) -> None:
        _log(text)

    # ---- the round loop's hooks (bayesfl.engine.rounds.RoundHooks) ----------------------
    def round_started(self, round: int) -> list[dict[str, Any]]:
        self._round_started_at = time.time()  # the round's timeline starts here
        return self.discover()

    def reachable(self, client_ids: Sequence[int]) -> list[int]:
        return [c for c in client_ids if c in self.nodes]

    def broadcast_encoded(self, round: int, data: bytes) -> None:
        """Nothing to do: the channel sends it."""

    def record_extras(self, record: dict[str, Any], trace: RoundTrace) -> None:
        collected = trace.collected
        fit_timings = [collected.replies[c].timings for c in trace.sent
                       if c in collected.replies]
        record["seconds_local_updates"] = collected.seconds
        record["flower"] = {
            "round_wall": collected.seconds, "round_polling": collected.seconds_waiting,
            "client_setup": _slowest(fit_timings, "setup"),
            "client_fit": _slowest(fit_timings, "fit"),
            "client_evaluate": _slowest(fit_timings, "evaluate"),
            "client_encode": _slowest(fit_timings, "encode"),
            "server_encode": trace.seconds_encode,
            "server_decode_validate": trace.seconds_receipt,
            "server_aggregate": trace.seconds_aggregation + trace.seconds_evaluation,
            "client_import": _slowest(fit_timings, "import"),
            "client_save": _slowest(fit_timings, "save"),
            # the critical path, message by message (bayesfl.flower.protocol.round_timeline)
            "timeline": round_timeline(
                self._round_started_at, time.time(),
                {c: collected.replies[c].timings for c in trace.sent
                 if c in collected.replies}),
        }
        record["events"] = trace.events + [
            {**rej, "node_id": self.nodes.get(rej["client_id"]), "step": "fit"}
            for rej in trace.rejections]

    def round_recorded(self, record: dict[str, Any]) -> None:
        """Log a round's record (discovery's events go to the first)."""
        if self.startup:
            record["events"] = self.startup + record["events"]
            self.startup = []
        _log(_round_line(record))

    # ---- nodes --------------------------------------------------------------------------
    def online(self) -> set[int]:
        return self.channel.online()

    def discover(self, *, wait: bool = False) -> list[dict[str, Any]]:
        """Ask every online node not yet known who it is; drop known nodes that went
        offline. With ``wait``, first wait (up to ``node-wait`` seconds) for ``min-nodes``
        nodes. Returns the events (refused nodes, nodes gone)."""
        want = self.options.min_nodes or self.config.clients
        deadline = time.monotonic() + self.options.node_wait
        online = self.online()
        while wait and len(online) < want and time.monotonic() < deadline:
            time.sleep(min(1.0, self.options.poll_interval * 5))
            online = self.online()
        events = []
        for cid, node in list(self.nodes.items()):
            if node not in online:
                del self.nodes[cid]
                events.append({"client_id": cid, "node_id": node, "step": "discover",
                               "reason": "node went offline"})
        new = sorted(online - set(self.nodes.values()) - self.refused)
        if not new:
            return events
        # keyed by placeholders (-1, -2, ...) until a node says which client it serves
        requests = {-1 - i: (node, pack(round=0)) for i, node in enumerate(new)}
        exchange = self.channel.exchange(INFO, requests, step="discover")
        events += [{**e, "client_id": None,  # unknown: the node never said who it is
                    "reason": f"discovery request to node {e['node_id']} unanswered: "
                              f"{e['reason']}"} for e in exchange.events]
        for key, reply in exchange.replies.items():
            node = requests[key][0]
            problem, cid = self._admit(reply)
            if problem is not None:
                self.refused.add(node)
                _log(f"node {node} left out of the run: {problem}")
                events.append({"client_id": cid, "node_id": node, "step": "discover",
                               "reason": problem})
            else:
                self.nodes[cid] = node
        return events

    def _admit(self, reply: Message) -> tuple[str | None, int | None]:
        """(None, client id) for a node that belongs in this run, else (why not, its id)."""
        try:
            values = dict(reply.content.config_records["bayesfl"])
            refused = values.get("refused")
            if isinstance(refused, str):  # e.g. a data loader its node config does not allow
                cid = values.get("client_id")
                valid = isinstance(cid, int) and 0 <= cid < self.config.clients
                return f"the node refused the run: {refused[:1000]}", cid if valid else None
            cid = scalar(values, "client_id", int)
            if not 0 <= cid < self.config.clients:
                return f"client id {cid} outside [0, {self.config.clients})", cid
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

    def _read_evaluation(self, data: bytes, round: int, client_id: int) -> Evaluation:
        return read_evaluation(self.strategy, data, round=round, client_id=client_id,
                               n_bins=self.config.n_bins, num_test=self.num_test[client_id])

    # ---- calibration --------------------------------------------------------------------
    def _calibrate(self, eval_bytes: bytes) -> CalibrationOutcome | None:
        """The temperature-scaling step over ``query.calibrate`` messages (``calibrate``)."""
        spec = self.setup.calibration
        if spec is None:
            return None
        t0 = time.perf_counter()
        held = self.setup.held_out
        connected = [c for c in self.training if c in self.nodes]
        participants = [c for c in connected if c in held and held[c].size > 0]

        def ask(step: int, down: bytes, client_ids: Sequence[int]) -> dict[int, bytes | str]:
            exchange = self.channel.exchange(
                CALIBRATE, {c: (self.nodes[c], pack(step=step, broadcast=eval_bytes,
                                                    proposal=down)) for c in client_ids},
                step="calibrate", round=step)
            answers: dict[int, bytes | str] = {e["client_id"]: e["reason"]
                                               for e in exchange.events}
            for cid, reply in exchange.replies.items():
                try:
                    answers[cid] = part(record_values(reply.content), "reply",
                                        max_bytes=MAX_EVALUATION_BYTES) or b""
                except MessageRejected as err:
                    answers[cid] = err.reason
            return answers

        search = temperature_search_over(ask, participants, self.num_classes)
        evaluation = None
        if search.fit is not None:
            from bayesfl.calibrate import result_message

            result = encode(result_message(search.steps, search.fit.temperature))
            search.bytes_down += len(result) * len(connected)
            search.floats_down += len(connected)
            exchange = self.channel.exchange(
                CALIBRATE, {c: (self.nodes[c], pack(step=search.steps, broadcast=eval_bytes,
                                                    result=result)) for c in connected},
                step="calibrate", round=search.steps)
            evaluations = []
            for cid in sorted(exchange.replies):
                try:
                    data = part(record_values(exchange.replies[cid].content), "evaluation",
                                max_bytes=MAX_EVALUATION_BYTES) or b""
                    evaluations.append(read_evaluation(
                        self.strategy, data, round=search.steps, client_id=cid,
                        n_bins=self.config.n_bins, num_test=self.num_test[cid],
                        predictives={PREDICTIVE}))
                except MessageRejected as err:
                    search.rejections.append({"step": search.steps, "client_id": cid,
                                              "reason": err.reason})
            search.rejections += [{"step": search.steps, "client_id": e["client_id"],
                                   "reason": e["reason"]} for e in exchange.events]
            evaluation = merge_evaluations(evaluations) if evaluations else None
        return CalibrationOutcome(search, evaluation, held, spec.held_out_fraction,
                                  time.perf_counter() - t0)

    # ---- the shift evaluation ------------------------------------------------------------
    def _shift_evaluation(self, eval_bytes: bytes) -> dict[str, Any]:
        """The shift step over ``query.shift`` messages (:mod:`bayesfl.shift_protocol`):
        every connected site scores its final state on its own rows and replies with its
        mergeable states; the report of the valid replies goes to ``out/shift``. A bad or
        missing reply is a rejection; nothing here stops the run."""
        from bayesfl.shift_protocol import (
            MAX_REPLY_BYTES,
            expected_replies,
            federated_shift_evaluation,
            report_settings,
            write_shift_outcome,
        )
        from bayesfl.strategies.base import MAP_PLUGIN

        request, config = self.shift_request, self.config
        connected = sorted(self.nodes)

        def ask(down: bytes, client_ids: Sequence[int]) -> dict[int, Any]:
            exchange = self.channel.exchange(
                SHIFT, {c: (self.nodes[c], pack(request=down.decode(), broadcast=eval_bytes))
                        for c in client_ids}, step="shift")
            answers: dict[int, Any] = {e["client_id"]: e["reason"] for e in exchange.events}
            for cid, reply in exchange.replies.items():
                try:
                    values = record_values(reply.content)
                    data = part(values, "reply", max_bytes=MAX_REPLY_BYTES)
                    if data is None:
                        raise MessageRejected("the shift reply carries no states")
                    notes = json.loads(values.get("notes") or "[]")
                    answers[cid] = (data, [str(n)[:500] for n in notes]
                                    if isinstance(notes, list) else [])
                except (MessageRejected, ValueError, TypeError) as err:
                    answers[cid] = getattr(err, "reason", None) or f"unreadable reply: {err}"
            return answers

        try:
            expected, notes = expected_replies(
                request, None if self.data_loader is not None else
                self.setup.client_data, self.novel, {c: self.num_test[c] for c in connected})
            settings = report_settings(
                request, run_dir=self.run_dir, strategy=config.strategy,
                dataset=config.dataset, clients=config.clients, novel=self.novel,
                partition=config.partition, rounds=config.rounds)
            predictives = {PREDICTIVE, MAP_PLUGIN} if self.strategy.is_posterior \
                else {PREDICTIVE}
            outcome = federated_shift_evaluation(
                ask, connected, request, expected=expected, predictives=predictives,
                num_classes=self.num_classes, novel=self.novel, settings=settings,
                notes=notes)
            if outcome.report is not None and self.run_dir is not None:
                write_shift_outcome(self.run_dir, outcome.report, outcome.states,
                                    novel=self.novel, num_classes=self.num_classes)
        except (BayesFLError, OSError, ValueError) as err:  # a report problem, not the run's
            _log(f"shift evaluation failed: {err}")
            return {"report": None, "error": f"shift evaluation failed: {err}"}
        self.shift_outcome = outcome
        for rejection in outcome.rejections:
            _log(f"shift evaluation: client {rejection['client_id']} left out: "
                 f"{rejection['reason']}")
        _log(f"shift evaluation: {len(outcome.states)} of {len(connected)} sites, bytes up "
             f"{outcome.bytes_up:,}, down {outcome.bytes_down:,}")
        return outcome.summary()

    # ---- files ---------------------------------------------------------------------------
    def _write_site_sizes(self) -> None:
        """``partition.json`` of a per-site run: the sizes each site reported (its data never
        left it)."""
        (self.run_dir / "partition.json").write_text(json.dumps({
            "scheme": "per-site", "data_loader": self.options.data_loader,
            "train_sizes": [self.num_train.get(c) for c in range(self.config.clients)],
            "test_sizes": [self.num_test.get(c) for c in range(self.config.clients)],
            "novel": list(self.novel)}) + "\n")



def _event(client_id: int, node_id: int | None, step: str, reason: str) -> dict[str, Any]:
    return {"client_id": client_id, "node_id": node_id, "step": step, "reason": reason}


def _slowest(client_timings: Sequence[Mapping[str, float]], key: str) -> float:
    """The slowest client's ``key`` seconds (0 when none reported it)."""
    return max((t.get(key, 0.0) for t in client_timings), default=0.0)


def _round_line(record: Mapping[str, Any]) -> str:
    acc = record.get("accuracy")
    shown = "not evaluated" if acc is None else f"accuracy {acc:.4f}, ECE {record['ece']:.4f}"
    extra = f", skipped ({record['skipped']})" if record.get("skipped") else ""
    return (f"round {record['round']}: {record['accepted']} upload(s) accepted, {shown}, "
            f"{len(record.get('events', []))} event(s){extra}")


def _log(text: str) -> None:
    print(f"[bayesfl] {text}", flush=True)


__all__ = ["Exchange", "FlowerChannel", "FlowerServer", "app", "main"]
