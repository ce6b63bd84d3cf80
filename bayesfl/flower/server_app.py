"""The bayesfl ServerApp: a strategy's server half driving SuperNodes over Flower's Grid.

Per run (:class:`FlowerServer`): parse the run config (:mod:`bayesfl.flower.protocol`), build
the strategy's server half from it exactly as the simulator does
(:func:`bayesfl.simulate.run_setup`), wait for ``min-nodes`` SuperNodes and ask each who it is
(``query.info``: its client id, its test-set size and the run's fingerprint; a node set up with
other settings or data is refused and logged). Then per round:

1. sample clients as the simulator does (:func:`bayesfl.simulate.sample_clients`, all of them
   by default); a sampled client whose node is not connected is logged as unavailable;
2. ``configure`` -> encode the broadcast once, push it to every sampled node (``train.fit``);
3. poll the SuperLink for replies until all are in, or ``round-timeout`` passes, or a node
   goes offline; a missing reply, a Flower error reply, bytes that do not decode and an
   upload that fails :meth:`Strategy.validate_uploads` are each an event with its reason in
   ``metrics.jsonl`` (``events``; invalid uploads also under ``rejections``, as in the
   simulator), never a crash;
4. with at least ``min-replies`` accepted uploads, ``aggregate`` (an aggregate that fails or
   is not finite keeps the previous state, as in the simulator); with fewer, the round is
   skipped and logged (``skipped``);
5. ``configure_evaluation`` -> every connected client evaluates itself (``evaluate``) and
   returns calibration accumulator states only; the server merges them into the per-client
   and pooled report (:func:`bayesfl.evaluation.merge_evaluations`).

After the last round, strategies that personalise do so on every node (``train.personalize``)
and are evaluated once more with their personalised states. The run directory is the
simulator's (``metrics.jsonl``, ``summary.json``, ``manifest.json``, ``partition.txt/json``,
``checkpoint.safetensors``, ``accuracy.png``, ``reliability.png``), minus ``predictions.npz``:
no prediction leaves a client, and the reliability diagram is drawn from the merged bins. A run
resumes from its checkpoint (``resume = true``): the server state, RNG and metrics come back;
the clients' own states live on the SuperNodes, in the Flower run's ``context.state``, so a new
Flower run starts the clients from their initial states.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp

from bayesfl.checkpoint import config_fingerprint, load_checkpoint, save_checkpoint
from bayesfl.config import check_threads, resolve_device, torch_threads
from bayesfl.data.datasets import dataset_identity, load_dataset
from bayesfl.data.partition import format_partition_summary, partition_summary
from bayesfl.errors import BayesFLError, CheckpointError, MessageRejected
from bayesfl.evaluation import RoundEvaluation, merge_evaluations
from bayesfl.flower.protocol import (
    EVALUATE,
    FIT,
    INFO,
    PERSONALIZE,
    describe_error,
    pack,
    parse_run_config,
    read_evaluation,
    scalar,
    timings,
    unpack,
)
from bayesfl.messages import Message as BayesMessage
from bayesfl.messages import decode, encode
from bayesfl.run_directory import CHECKPOINT_NAME, METRICS_NAME, MetricsLog, prepare_run_directory
from bayesfl.simulate import (
    _SERVER_KEY,
    build_summary,
    non_finite_problem,
    round_view,
    run_setup,
    sample_clients,
)
from bayesfl.strategies import make_strategy
from bayesfl.strategies.base import PREDICTIVE, Evaluation, derived_seed
from inference.errors import InferenceError

app = ServerApp()

CHECKPOINT_FORMAT = "flower-1"
_METRICS_TENSOR = "run/metrics.jsonl"
_NODE_CHECK_SECONDS = 2.0  # how often a step re-reads which nodes are online


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Flower's entry point: run the experiment of ``context.run_config``."""
    FlowerServer(grid, context.run_config).run()


@dataclass
class Exchange:
    """The outcome of one step (messages out, replies back).

    Attributes:
        replies: client id -> its reply (errors excluded).
        events: what went wrong, one dict each (client_id, step, reason).
        seconds: wall time of the step; ``seconds_waiting`` of it spent between polls.
        client_timings: client id -> the timings its reply reported.
    """

    replies: dict[int, Message] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    seconds_waiting: float = 0.0
    client_timings: dict[int, dict[str, float]] = field(default_factory=dict)


class FlowerServer:
    """One run of a strategy's server half over a Flower Grid (module docstring)."""

    def __init__(self, grid: Grid, run_config: Mapping[str, Any]) -> None:
        self.grid = grid
        self.config, self.options = parse_run_config(run_config)
        config = self.config
        self.run_dir = None if self.options.out is None else Path(self.options.out)
        if self.run_dir is not None:
            prepare_run_directory(self.run_dir, resume=self.options.resume,
                                  force=self.options.force)
        self.threads = check_threads(self.options.threads)
        self.device = resolve_device(config.device)
        # the server loads the data set only for its shapes and the partition's sizes (the
        # same setup as every node's); nothing it trains or evaluates reads the data
        dataset = load_dataset(config.dataset, seed=config.seed, **config.dataset_options)
        self.data_identity = dataset_identity(dataset)
        self.identity = {**config.to_dict(), "data": self.data_identity}
        self.fingerprint = config_fingerprint(self.identity)
        self.setup = run_setup(config, dataset, self.device)
        self.labels = dataset.y
        self.num_classes = dataset.num_classes
        self.strategy = make_strategy(config.strategy, self.setup.context,
                                      **config.strategy_options)
        self.state = self.strategy.init()
        self.metrics_log = MetricsLog(None if self.run_dir is None else
                                      self.run_dir / METRICS_NAME)
        self.nodes: dict[int, int] = {}  # client id -> node id
        self.refused: set[int] = set()  # node ids refused at discovery
        self.num_test: dict[int, int] = {}
        self.first_round = 0 if self.strategy.init_round else 1
        self.seconds_before = 0.0
        self.resumed_from: int | None = None
        self._last_accumulators: list[Any] = []

    # ---- the run ------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Every round, the final evaluation and the files; returns the summary."""
        with torch_threads(self.threads):
            return self._run()

    def _run(self) -> dict[str, Any]:
        config = self.config
        first = self.first_round
        if self.options.resume and self.run_dir is not None and \
                (self.run_dir / CHECKPOINT_NAME).exists():
            first = self._restore()
        else:
            self.metrics_log.start()
        if self.run_dir is not None:
            self._write_setup_files()
        start = time.perf_counter()
        startup = self.discover(wait=True)
        _log(f"{len(self.nodes)} of {config.clients} clients connected")
        last: RoundEvaluation | None = None
        for r in range(first, config.rounds + 1):
            t0 = time.perf_counter()
            with torch.random.fork_rng(devices=self._rng_devices()):
                record, evaluation = self.round(r)
            if startup:
                record["events"] = startup + record["events"]
                startup = []
            last = evaluation or last
            record["seconds"] = time.perf_counter() - t0
            self.metrics_log.append(record)
            _log(_round_line(record))
            if self.run_dir is not None:
                self._checkpoint(r, self.seconds_before + time.perf_counter() - start)
        last_round = max(config.rounds, first - 1)
        personalized = False
        final_events: list[dict[str, Any]] = []
        if self.strategy.personalizes:
            final_events += self.personalize(last_round)
            personalized = True
            last = None
        if last is None:
            _, last, _, events = self.evaluate(last_round, personalized=personalized)
            final_events += events
        if last is None:
            raise BayesFLError("no client returned an evaluation after the last round; "
                               "see the events in metrics.jsonl")
        return self._finish(last, personalized, final_events,
                            self.seconds_before + time.perf_counter() - start)

    def _finish(self, last: RoundEvaluation, personalized: bool,
                final_events: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
        metrics = self.metrics_log.records
        evaluated = [m for m in metrics if m.get("accuracy") is not None]
        summary = build_summary(self.config, evaluated, last, seconds)
        for key in ("bytes_up", "bytes_down", "bytes_down_evaluation", "floats_up",
                    "floats_down"):
            summary[key] = int(sum(m.get(key, 0) for m in metrics))
        rejections = [{"round": m["round"], **rej} for m in metrics for rej in m["rejections"]]
        summary.update(rejected_uploads=len(rejections), rejections=rejections)
        summary["events"] = [{"round": m["round"], **e} for m in metrics
                             for e in m.get("events", [])] + final_events
        summary["skipped_rounds"] = [m["round"] for m in metrics if m.get("skipped")]
        summary["personalized"] = personalized
        summary["data"] = self.data_identity
        summary["threads"] = self.threads
        summary["transport"] = "flower"
        summary.update(self.strategy.server_metrics(self.state))
        if self.run_dir is not None:
            self._write_results(summary, evaluated, last)
        _log(f"done: accuracy {summary['accuracy']:.4f}, ECE {summary['ece']:.4f}, "
             f"{len(summary['events'])} event(s)")
        return summary

    # ---- nodes --------------------------------------------------------------------------
    def online(self) -> set[int]:
        return {int(n) for n in self.grid.get_node_ids()}

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
        requests = {-1 - i: (node, pack(round=0)) for i, node in enumerate(new)}
        exchange = self.exchange(INFO, requests, step="discover")
        events += exchange.events
        for key, reply in exchange.replies.items():
            node = requests[key][0]
            problem, cid = self._admit(reply)
            if problem is not None:
                self.refused.add(node)
                events.append({"client_id": cid, "node_id": node, "step": "discover",
                               "reason": problem})
            else:
                self.nodes[cid] = node
        return events

    def _admit(self, reply: Message) -> tuple[str | None, int | None]:
        """(None, client id) for a node that belongs in this run, else (why not, its id)."""
        try:
            values = dict(reply.content.config_records["bayesfl"])
            cid = scalar(values, "client_id", int)
            if not 0 <= cid < self.config.clients:
                return f"client id {cid} outside [0, {self.config.clients})", cid
            if values.get("fingerprint") != self.fingerprint:
                return ("the node's run fingerprint differs from the server's (other "
                        "settings, data or bayesfl version)"), cid
            if cid in self.nodes:
                return f"client id {cid} is already served by node {self.nodes[cid]}", cid
            self.num_test[cid] = scalar(values, "num_test", int)
        except (KeyError, MessageRejected) as err:
            return f"malformed info reply: {err}", None
        return None, cid

    # ---- one step -----------------------------------------------------------------------
    def exchange(self, message_type: str, requests: Mapping[int, tuple[int, RecordDict]],
                 *, step: str, round: int = 0) -> Exchange:
        """Push ``requests`` (client id -> (node id, content)) and poll for the replies until
        all are in, ``round-timeout`` passes, or their node goes offline."""
        t0 = time.perf_counter()
        out = Exchange()
        timeout = self.options.round_timeout
        ids = list(requests)
        messages = [Message(content, dst_node_id=node, message_type=message_type,
                            group_id=str(round), ttl=timeout + 60.0)
                    for node, content in (requests[c] for c in ids)]
        pushed = list(self.grid.push_messages(messages)) if messages else []
        if len(pushed) != len(ids):  # the SuperLink refused the batch (e.g. too large)
            pushed = [None] * len(ids)
        pending: dict[str, int] = {}
        for cid, mid in zip(ids, pushed, strict=True):
            if mid:
                pending[mid] = cid
            else:
                out.events.append(_event(cid, requests[cid][0], step,
                                         "the SuperLink did not accept the message"))
        deadline = time.monotonic() + timeout
        next_check = time.monotonic() + _NODE_CHECK_SECONDS
        while pending:
            for reply in self.grid.pull_messages(list(pending)):
                cid = pending.pop(reply.metadata.reply_to_message_id, None)
                if cid is None:
                    continue
                if reply.has_error():
                    out.events.append(_event(cid, requests[cid][0], step,
                                             describe_error(reply.error)))
                else:
                    out.replies[cid] = reply
                    out.client_timings[cid] = timings(reply.content)
            if not pending:
                break
            now = time.monotonic()
            if now >= deadline:
                for cid in pending.values():
                    out.events.append(_event(cid, requests[cid][0], step,
                                             f"no reply within {timeout:g} s"))
                break
            if now >= next_check:
                online = self.online()
                for mid, cid in list(pending.items()):
                    if requests[cid][0] not in online:
                        del pending[mid]
                        out.events.append(_event(cid, requests[cid][0], step,
                                                 "node went offline before replying"))
                next_check = now + _NODE_CHECK_SECONDS
            w = time.perf_counter()
            time.sleep(self.options.poll_interval)
            out.seconds_waiting += time.perf_counter() - w
        out.seconds = time.perf_counter() - t0
        return out

    # ---- a round ------------------------------------------------------------------------
    def round(self, r: int) -> tuple[dict[str, Any], RoundEvaluation | None]:
        """Round ``r``: fit, validate, aggregate (or skip), evaluate; its metrics record."""
        config, server = self.config, self.strategy
        torch.manual_seed(derived_seed(config.seed, r))
        events = self.discover()
        participants = sample_clients(config.clients, config.fraction, config.seed, r)
        for cid in participants:
            if cid not in self.nodes:
                events.append({"client_id": cid, "node_id": None, "step": "fit",
                               "reason": "sampled client has no connected node"})
        sent = [c for c in participants if c in self.nodes]
        plan = server.configure(self.state, r)
        t_encode = time.perf_counter()
        down = encode(plan.broadcast)
        t_encode = time.perf_counter() - t_encode
        fit = self.exchange(FIT, {c: (self.nodes[c], pack(down, round=r)) for c in sent},
                            step="fit", round=r)
        events += fit.events
        t_decode = time.perf_counter()
        reasons: dict[int, str] = {}
        received: list[tuple[int, BayesMessage]] = []
        bytes_up: dict[int, int] = {}
        for cid in sorted(fit.replies):
            try:
                data, _ = unpack(fit.replies[cid].content, max_bytes=plan.max_upload_bytes)
                bytes_up[cid] = len(data)
                received.append((cid, decode(data, max_bytes=plan.max_upload_bytes)))
            except MessageRejected as err:
                reasons[cid] = err.reason
        verdicts = server.validate_uploads(plan, [m for _, m in received],
                                           [c for c, _ in received])
        accepted = []
        for (cid, message), reason in zip(received, verdicts, strict=True):
            if reason is None:
                accepted.append(message)
            else:
                reasons[cid] = reason
        t_decode = time.perf_counter() - t_decode
        rejections = [{"client_id": c, "reason": reasons[c]} for c in sorted(reasons)]
        events += [{**rej, "node_id": self.nodes.get(rej["client_id"]), "step": "fit"}
                   for rej in rejections]
        need = self.options.min_replies or len(participants)
        skipped = aggregate_error = None
        t_aggregate = time.perf_counter()
        if len(accepted) < need:
            skipped = (f"{len(accepted)} accepted upload(s) < min-replies {need}: round "
                       "skipped, previous state kept")
        else:
            try:
                gen = torch.Generator().manual_seed(derived_seed(config.seed, r, _SERVER_KEY))
                new_state = server.aggregate(self.state, accepted, r, gen)
                problem = non_finite_problem(new_state)
                if problem is None:
                    self.state = new_state
                else:
                    aggregate_error = f"aggregate rejected, previous state kept: {problem}"
            except (BayesFLError, InferenceError) as err:
                aggregate_error = f"aggregation failed, previous state kept: {err}"
        t_aggregate = time.perf_counter() - t_aggregate
        record: dict[str, Any] = {
            "round": r, "participants": participants, "accepted": len(accepted),
            "rejections": rejections,
        }
        every = self.options.evaluate_every
        evaluation = None
        eval_bytes, eval_sent, eval_step = b"", 0, Exchange()
        if r == config.rounds or (r - self.first_round + 1) % every == 0:
            eval_bytes, evaluation, eval_step, eval_events = self.evaluate(r)
            eval_sent = len(eval_step.replies) + len(eval_step.events)
            events += eval_events
            record.update(evaluation.headline() if evaluation is not None
                          else {"accuracy": None})
            record.update(round_view(self.strategy))
            if evaluation is not None:
                record["per_client"] = evaluation.per_client
        record.update({
            "bytes_up": int(sum(bytes_up.values())),
            "bytes_down": len(down) * len(sent),
            "bytes_up_per_client": [bytes_up.get(c, 0) for c in participants],
            "bytes_down_per_client": len(down),
            "bytes_down_evaluation": len(eval_bytes) * eval_sent,
            "floats_up": int(sum(m.num_elements for _, m in received)),
            "floats_down": plan.broadcast.num_elements * len(sent),
            "seconds_local_updates": fit.seconds,
            "seconds_evaluation": eval_step.seconds,
            "flower": _step_timings(fit, eval_step, t_encode, t_decode, t_aggregate),
            "events": events,
        })
        record.update(server.server_metrics(self.state))
        if skipped is not None:
            record["skipped"] = skipped
        if aggregate_error is not None:
            record["aggregate_error"] = aggregate_error
        return record, evaluation

    def evaluate(self, r: int, *, personalized: bool = False
                 ) -> tuple[bytes, RoundEvaluation | None, Exchange, list[dict[str, Any]]]:
        """Every connected client's evaluation of the state after round ``r``: the encoded
        broadcast, the merged evaluation (None when no client returned a valid one), the
        step and its events."""
        eval_bytes = encode(self.strategy.configure_evaluation(self.state, r))
        step = self.exchange(EVALUATE, {c: (n, pack(eval_bytes, round=r,
                                                     personalized=personalized))
                                        for c, n in sorted(self.nodes.items())},
                             step="evaluate", round=r)
        events = list(step.events)
        evaluations: list[Evaluation] = []
        for cid in sorted(step.replies):
            try:
                data, _ = unpack(step.replies[cid].content)
                evaluations.append(read_evaluation(
                    self.strategy, data, round=r, client_id=cid, n_bins=self.config.n_bins,
                    num_test=self.num_test[cid]))
            except MessageRejected as err:
                events.append(_event(cid, self.nodes.get(cid), "evaluate", err.reason))
        merged = merge_evaluations(evaluations) if evaluations else None
        if evaluations:
            self._last_accumulators = [e.accumulators[PREDICTIVE] for e in evaluations]
        return eval_bytes, merged, step, events

    def personalize(self, r: int) -> list[dict[str, Any]]:
        """Every connected client personalises its state (strategies that do)."""
        data = encode(self.strategy.configure_evaluation(self.state, r))
        step = self.exchange(PERSONALIZE, {c: (n, pack(data, round=r))
                                           for c, n in sorted(self.nodes.items())},
                             step="personalize", round=r)
        return step.events

    # ---- checkpoints and files ----------------------------------------------------------
    def _checkpoint(self, r: int, seconds: float) -> None:
        tensors = {f"server/{k}": v for k, v in self.state.items()}
        tensors["rng/torch"] = torch.get_rng_state()
        tensors[_METRICS_TENSOR] = torch.from_numpy(
            np.frombuffer(bytes(self.metrics_log.text), dtype=np.uint8).copy())
        meta = {"format": CHECKPOINT_FORMAT, "round": r, "first_round": self.first_round,
                "seconds": seconds, "config": self.identity, "server_keys": sorted(self.state)}
        save_checkpoint(self.run_dir / CHECKPOINT_NAME, tensors, meta,
                        fingerprint=self.fingerprint)

    def _restore(self) -> int:
        """The server's state, RNG and metrics from the checkpoint; returns the next round.

        Raises:
            CheckpointError: a foreign or corrupt checkpoint (naming what differs).
        """
        path = self.run_dir / CHECKPOINT_NAME
        tensors, meta = load_checkpoint(path, fingerprint=self.fingerprint, config=self.identity)
        last, rounds = meta.get("round"), self.config.rounds
        if meta.get("format") != CHECKPOINT_FORMAT or isinstance(last, bool) or \
                not isinstance(last, int) or not self.first_round <= last <= rounds:
            raise CheckpointError(f"checkpoint {path} was not written by this Flower run "
                                  f"(format {meta.get('format')!r}, round {last!r}); delete "
                                  "it or start again with force = true")
        try:
            self.state = {k: tensors[f"server/{k}"].to(self.device)
                          for k in meta["server_keys"]}
            torch.set_rng_state(tensors["rng/torch"])
            log = tensors[_METRICS_TENSOR]
        except (KeyError, TypeError, RuntimeError) as err:
            raise CheckpointError(f"checkpoint {path} does not hold this run's state: "
                                  f"{err}") from err
        self.metrics_log.restore(log.numpy().tobytes(), list(range(self.first_round,
                                                                      last + 1)))
        self.seconds_before = float(meta.get("seconds", 0.0))
        self.resumed_from = last
        return last + 1

    def _write_setup_files(self) -> None:
        from bayesfl.manifest import write_manifest

        write_manifest(self.run_dir / "manifest.json", self.config.to_dict(),
                       data=self.data_identity, threads=self.threads,
                       resumed_from_round=self.resumed_from, transport="flower")
        clients = self.setup.client_data
        parts = [np.concatenate([c.train_indices, c.test_indices]) for c in clients]
        counts = partition_summary(self.labels, parts, self.num_classes)
        (self.run_dir / "partition.txt").write_text(
            format_partition_summary(self.labels, parts, self.num_classes) + "\n")
        (self.run_dir / "partition.json").write_text(json.dumps({
            "scheme": self.config.partition, "counts": counts.tolist(),
            "train_sizes": [c.num_train for c in clients],
            "test_sizes": [c.num_test for c in clients],
            "bodies": [self.setup.context.client_config(c.client_id).body
                       for c in clients]}) + "\n")

    def _write_results(self, summary: dict[str, Any], metrics: list[dict[str, Any]],
                       last: RoundEvaluation) -> None:
        import matplotlib.pyplot as plt

        from bayesfl.plots import plot_accuracy
        from calibration.accumulator import Accumulator
        from calibration.diagram import reliability_diagram

        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if metrics:
            plot_accuracy({self.config.strategy: metrics}, self.run_dir / "accuracy.png")
        # the pooled reliability diagram from the merged bins: no prediction left a client
        stats = Accumulator.merged(self._last_accumulators).bin_stats()
        figure = reliability_diagram(stats, title=f"{self.config.strategy}, final round "
                                     "(pooled, Flower)")
        figure.savefig(self.run_dir / "reliability.png", dpi=120)
        plt.close(figure)

    def _rng_devices(self) -> list[torch.device]:
        return [self.device] if self.device.type == "cuda" else []


def _event(client_id: int, node_id: int | None, step: str, reason: str) -> dict[str, Any]:
    return {"client_id": client_id, "node_id": node_id, "step": step, "reason": reason}


def _step_timings(fit: Exchange, evaluation: Exchange, t_encode: float, t_decode: float,
                  t_aggregate: float) -> dict[str, float]:
    """Where a round's wall time went: each step's wall and polling wait, the clients'
    reported setup / work / encode seconds (slowest client), the server's own work."""
    def slowest(step: Exchange, key: str) -> float:
        return max((t.get(key, 0.0) for t in step.client_timings.values()), default=0.0)

    return {
        "fit_wall": fit.seconds, "fit_polling": fit.seconds_waiting,
        "fit_client_setup": slowest(fit, "setup"), "fit_client_work": slowest(fit, "fit"),
        "fit_client_encode": slowest(fit, "encode"),
        "evaluate_wall": evaluation.seconds, "evaluate_polling": evaluation.seconds_waiting,
        "evaluate_client_setup": slowest(evaluation, "setup"),
        "evaluate_client_work": slowest(evaluation, "evaluate"),
        "server_encode": t_encode, "server_decode_validate": t_decode,
        "server_aggregate": t_aggregate,
    }


def _round_line(record: Mapping[str, Any]) -> str:
    acc = record.get("accuracy")
    shown = "not evaluated" if acc is None else f"accuracy {acc:.4f}, ECE {record['ece']:.4f}"
    extra = f", skipped ({record['skipped']})" if record.get("skipped") else ""
    return (f"round {record['round']}: {record['accepted']} upload(s) accepted, {shown}, "
            f"{len(record.get('events', []))} event(s){extra}")


def _log(text: str) -> None:
    print(f"[bayesfl] {text}", flush=True)


__all__ = ["CHECKPOINT_FORMAT", "Exchange", "FlowerServer", "app", "main"]
