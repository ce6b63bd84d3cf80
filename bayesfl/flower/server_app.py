"""The bayesfl ServerApp: the round engine (`bayesfl.engine`) driving SuperNodes over
Flower's Grid.

Per run (`FlowerServer`, the engine's run `bayesfl.engine.run.Run` with
Flower's channel and hooks): parse the run config (`bayesfl.flower.protocol`), build the
strategy's server half from it exactly as the simulator does
(`bayesfl.engine.setup.run_setup`), wait for ``min-nodes`` SuperNodes and ask each who it
is (`bayesfl.flower.channel.FlowerChannel.discover`, ``query.info``: its client id, its
test-set size and the run's fingerprint; a node set up with other settings or data is refused
and logged). Then the engine's one round loop (`bayesfl.engine.rounds.RoundLoop`, the
simulator's too) runs the rounds in its ``"carried"`` evaluation mode over
`FlowerChannel`, with this module's hooks (discovery at each
round's start, the reachable nodes, the ``"flower"`` timings and ``events`` of a record).
Per round ``r``, **one message per client** (``train.round``):

1. sample the training clients as the simulator does (novel clients, ``novel-fraction``, never
   train); a sampled client whose node is not connected is logged as unavailable;
2. ``configure`` -> the broadcast, encoded once, goes to every sampled node (``fit``); every
   connected training node also gets the evaluation broadcast of round ``r - 1``'s state
   (``evaluate``, when that round is evaluated): it evaluates before it fits, with the state
   the simulator would have evaluated, and returns accumulator states only;
3. collect the replies until all are in, ``round-timeout`` passes, or a node goes offline; a
   missing reply, a Flower error reply, bytes that do not decode and an upload that fails
   `Strategy.validate_uploads` are each an event with its reason in ``metrics.jsonl``
   (``events``; invalid uploads also under ``rejections``, as in the simulator), never a crash;
4. round ``r - 1``'s record gets its evaluation (the merge of the accumulators:
   `bayesfl.evaluation.merge_evaluations`), is appended and checkpointed;
5. with at least ``min-replies`` accepted uploads, aggregate or keep the previous state
   (`bayesfl.engine.steps.aggregate_or_keep`); with fewer, the round is skipped
   (``skipped``; the simulator has no such minimum: docs/architecture.md, "One round loop,
   two channels"); the new state's evaluation broadcast is built or the previous state comes
   back (`bayesfl.engine.steps.evaluate_or_revert`).

The last message of a run (``evaluate``, ``personalize`` for strategies that personalise)
completes the last round's record, personalises, and evaluates every node, the novel clients'
too (``summary["novel"]``). Then the engine's final phases (`bayesfl.engine.phases`, the
simulator's too) run over `ask`: with
``calibrate`` the temperature-scaling step (`bayesfl.calibrate.calibrate_phase`) and
with ``conformal`` the conformal step (`bayesfl.conformal.conformal_phase`) over
``query.calibrate`` messages on the nodes' held-out rows, reporting as in the simulator
(``summary["calibration"]``, ``summary["conformal"]``); with the run keys ``shift``/``ood``
every site evaluates its final state on its own shifted and out-of-distribution rows over
``query.shift`` messages (`bayesfl.shift_protocol.shift_phase`), and the server merges
the validated states into the report ``bayesfl evaluate`` writes (``out/shift``,
``summary["shift_evaluation"]``).
``authenticate`` is simulator-only: on Flower use its TLS and SuperNode authentication.

The run directory is the simulator's (``metrics.jsonl``, ``summary.json``, ``manifest.json``,
``partition.txt/json``, ``checkpoint.safetensors`` in the one format of
`bayesfl.engine.state`, ``accuracy.png``, ``reliability.png``), minus
``predictions.npz``: no prediction leaves a client, and the reliability diagram is drawn from
the merged bins. A run resumes from its checkpoint (``resume = true``): the server state, RNG
and metrics come back. The clients' own states live on the SuperNodes, in the Flower run's
``context.state``, which Flower gives every new run empty: a node whose node config names a
``state-dir`` (`bayesfl.flower.local.LocalFederation` gives every node one) also keeps
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
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from bayesfl.config import check_threads, torch_threads
from bayesfl.engine.rounds import RoundTrace
from bayesfl.engine.run import FinalEvaluation, Run
from bayesfl.errors import (
    BayesFLError,
)
from bayesfl.evaluation import merge_evaluations
from bayesfl.flower.channel import Exchange, FlowerChannel, log, round_timings
from bayesfl.run_directory import prepare_run_directory
from bayesfl.strategies.base import PREDICTIVE

app = ServerApp()

@app.main()
def main(grid: Grid, context: Context) -> None:
    """Flower's entry point: run the experiment of ``context.run_config``."""
    FlowerServer(grid, context.run_config).run()


class FlowerServer(Run):
    """One run of a strategy's server half over a Flower Grid (module docstring): the engine's
    run (`bayesfl.engine.run.Run`) with node discovery, the ``"carried"`` round loop,
    the ``flower`` record keys and the final steps over ``query.*`` messages."""

    def __init__(self, grid: Grid, run_config: Mapping[str, Any]) -> None:
        from bayesfl.flower.protocol import parse_run_config

        config, options = parse_run_config(run_config)
        self.options = options
        run_dir = None if options.out is None else Path(options.out)
        if run_dir is not None:
            prepare_run_directory(run_dir, resume=options.resume, force=options.force)
        # the data set is loaded only for its shapes and the partition's sizes (the same
        # setup as every node's); nothing the server trains or evaluates reads the data
        super().__init__(config, run_dir, None, threads=check_threads(options.threads),
                         resume=options.resume, data_loader=options.data_loader,
                         shift=options.shift, ood=options.ood)
        self.manifest_extras = {"transport": "flower", "data_loader": options.data_loader}
        self.transport = "flower"
        self.strategy = self.server
        self.num_classes = self.dataset.num_classes
        self.startup: list[dict[str, Any]] = []  # discovery's events, for the first record
        self._round_started_at = time.time()
        # each round's evaluation rides on the next round's message ("carried": one message
        # per client and round); a round with fewer than min-replies accepted uploads is skipped
        self.start_loop(FlowerChannel(
            grid, round_timeout=options.round_timeout, poll_interval=options.poll_interval,
            server=self.server, n_bins=config.n_bins, clients=config.clients,
            fingerprint=self.fingerprint, min_nodes=options.min_nodes or config.clients,
            node_wait=options.node_wait), evaluation="carried",
            min_replies=options.min_replies, evaluate_every=options.evaluate_every,
            round_timeout=options.round_timeout)

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
        self.startup = self.channel.discover(wait=True)
        log(f"{len(self.nodes)} of {self.config.clients} clients connected")
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
        super().final_steps(final, summary)  # calibrate, conformal, shift
        log(f"done: accuracy {summary['accuracy']:.4f}, ECE {summary['ece']:.4f}, "
            f"{len(summary['events'])} event(s)")

    def log(self, text: str) -> None:
        log(text)

    # ---- the round loop's hooks (bayesfl.engine.rounds.RoundHooks) ----------------------
    def round_started(self, round: int) -> list[dict[str, Any]]:
        self._round_started_at = time.time()  # the round's timeline starts here
        return self.channel.discover()

    def reachable(self, client_ids: Sequence[int]) -> list[int]:
        return [c for c in client_ids if c in self.nodes]

    def broadcast_encoded(self, round: int, data: bytes) -> None:
        """Nothing to do: the channel sends it."""

    def record_extras(self, record: dict[str, Any], trace: RoundTrace) -> None:
        record["seconds_local_updates"] = trace.collected.seconds
        record["flower"] = round_timings(trace, self._round_started_at)
        record["events"] = self.startup + trace.events + [  # discovery's go to the first
            {**rej, "node_id": self.nodes.get(rej["client_id"]), "step": "fit"}
            for rej in trace.rejections]
        self.startup = []

    def round_recorded(self, record: dict[str, Any]) -> None:
        log(_round_line(record))

    # ---- files ---------------------------------------------------------------------------
    def _write_site_sizes(self) -> None:
        """``partition.json`` of a per-site run: the sizes each site reported (its data never
        left it)."""
        (self.run_dir / "partition.json").write_text(json.dumps({
            "scheme": "per-site", "data_loader": self.options.data_loader,
            "train_sizes": [self.channel.num_train.get(c) for c in range(self.config.clients)],
            "test_sizes": [self.channel.num_test.get(c) for c in range(self.config.clients)],
            "novel": list(self.novel)}) + "\n")



def _round_line(record: Mapping[str, Any]) -> str:
    acc = record.get("accuracy")
    shown = "not evaluated" if acc is None else f"accuracy {acc:.4f}, ECE {record['ece']:.4f}"
    extra = f", skipped ({record['skipped']})" if record.get("skipped") else ""
    return (f"round {record['round']}: {record['accepted']} upload(s) accepted, {shown}, "
            f"{len(record.get('events', []))} event(s){extra}")


__all__ = ["Exchange", "FlowerChannel", "FlowerServer", "app", "main"]
