"""The whole run, once, for every transport: `Run`.

setup (`run_setup`, the strategy's server half, the novel clients)
→ resume (`Run.restore`: the server state, RNG and metrics of the checkpoint) → the
setup files → the rounds (`RoundLoop` over the transport's
channel) → the final evaluation (personalise, evaluate, the novel clients) → the summary
(`Run.summarize`) → the final steps (calibrate, conformal, shift) → the result files.

A transport subclasses `Run` with its channel, its round loop (evaluation mode,
``min_replies``) and these hooks:

* `Run.client_states` / `Run.restore_clients`: the client states a checkpoint
  holds for it;
* `Run.round_recorded`: a round's record is complete (the loop's other hooks,
  `RoundHooks`, are the transport's own);
* `Run.rounds_starting` / `Run.rounds_ended`: around the rounds (the simulator's
  progress bar and background checkpoint write; Flower's node discovery);
* `Run.final_evaluation`: the last evaluation, the personalisation and the novel
  clients, returned as a `FinalEvaluation`;
* the channel's ``ask``, ``keys`` and ``num_test``: the final phases
  (`bayesfl.engine.phases`: calibrate, conformal, shift; `Run.final_steps` runs
  them and writes their figures and files);
* `Run.manifest_extras` and `Run.data_loader` (per-site data: no partition
  file).
"""

from __future__ import annotations

import json
import time
import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bayesfl.checkpoint import PendingWrite, config_fingerprint, discard_spare, load_checkpoint
from bayesfl.config import SimulationConfig, resolve_device
from bayesfl.data.datasets import Dataset, dataset_identity, load_dataset
from bayesfl.data.partition import format_partition_summary, partition_summary
from bayesfl.engine.rounds import RoundLoop
from bayesfl.engine.setup import novel_clients, run_identity, run_setup
from bayesfl.engine.state import foreign_message, restore_round, save_round
from bayesfl.engine.steps import build_summary, run_rejected_message, summary_extras
from bayesfl.errors import BayesFLError, CheckpointError, UploadsRejectedWarning
from bayesfl.evaluation import RoundEvaluation
from bayesfl.run_directory import CHECKPOINT_NAME, METRICS_NAME, MetricsLog
from bayesfl.strategies import make_strategy
from bayesfl.strategies.base import ClientState, ServerState, ServerStrategy
from bayesfl.strategies.halves import server_half


@dataclass
class FinalEvaluation:
    """What the transport's final evaluation returns (`Run.final_evaluation`).

    Attributes:
        last: the training clients' merged evaluation of their final states (personalised
            where the strategy personalises).
        personalized: whether the clients personalised.
        novel: the novel clients' merged evaluation, or None.
        broadcast: the final evaluation broadcast (what the final steps evaluate with), in
            the transport's form (a decoded message in process, bytes over Flower).
        extras: transport keys for the summary (Flower: ``events``, ``skipped_rounds``,
            ``transport``).
    """

    last: RoundEvaluation
    personalized: bool
    novel: RoundEvaluation | None
    broadcast: Any
    extras: dict[str, Any] = field(default_factory=dict)


class Run(ABC):
    """One run of a strategy over a transport's channel (module docstring).

    Args:
        config: the run's configuration.
        run_dir: its run directory, or None (nothing written, no resume).
        dataset: the pooled data set given by the caller (its identity says ``custom``), or
            None to load ``config.dataset`` by name (the Flower ServerApp loads it only for
            its shapes and the partition's sizes).
        threads: torch threads of the run (recorded).
        resume: resume from ``run_dir``'s checkpoint when there is one.
        data_loader: per-site data (Flower's ``data-loader``): every site loads its own, the
            fingerprint names the loader and no partition file is written.
        shift, ood: the run keys of the shift evaluation after the run
            (`bayesfl.shift_protocol.shift_request`, checked here: ``shift_request``).

    Raises:
        CheckpointError: ``resume`` with a corrupt or foreign checkpoint (before the data
            are partitioned or a model is built).
    """

    loop: RoundLoop

    def __init__(self, config: SimulationConfig, run_dir: Path | None, dataset: Dataset | None,
                 *, threads: int, resume: bool, data_loader: str | None = None,
                 shift: Any = None, ood: Any = None) -> None:
        custom = dataset is not None
        if dataset is None:
            dataset = load_dataset(config.dataset, seed=config.data_rng_seed,
                                   **config.dataset_options)
        self.config, self.run_dir, self.dataset, self.threads = config, run_dir, dataset, threads
        self.data_loader = data_loader
        self.device = resolve_device(config.device)
        # what the data really were (shapes and a digest of the contents) is part of the
        # fingerprint: a run resumes only with the data it started with
        self.data_identity = dataset_identity(dataset, custom=custom)
        self.identity = run_identity(config, self.data_identity) if data_loader is None else \
            {**config.to_dict(), "data": "per-site", "data-loader": data_loader}
        self.fingerprint = config_fingerprint(self.identity)
        # the checkpoint to resume is read and compared before the data are partitioned or a
        # model is built: a foreign one fails at once, naming the settings that differ
        path = None if run_dir is None else run_dir / CHECKPOINT_NAME
        self.saved = load_checkpoint(path, fingerprint=self.fingerprint, config=self.identity) \
            if resume and path is not None and (path.exists() or path.is_symlink()) else None
        self.setup = run_setup(config, dataset, self.device)
        # the engine holds the strategy's server half only (bayesfl.strategies.halves)
        self.server: ServerStrategy = server_half(make_strategy(
            config.strategy, self.setup.context, **config.strategy_options))
        # novel clients (novel_fraction) never train: rounds sample and evaluate the others
        self.novel = novel_clients(config.clients, config.novel_fraction, config.data_rng_seed)
        self.training = [c for c in range(config.clients) if c not in self.novel]
        self.first_round = 0 if self.server.init_round else 1
        self.shift_request = None  # the shift step after the run (run keys shift, ood)
        if shift or ood:  # refused now, before any round, if the run cannot have it
            from bayesfl.shift_protocol import shift_request

            self.shift_request = shift_request(
                config, dataset, None if data_loader is not None else self.setup.client_data,
                self.novel, shift, ood)
        self.metrics_log = MetricsLog(None if run_dir is None else run_dir / METRICS_NAME)
        self.seconds_before = 0.0
        self.resumed_from: int | None = None
        self.manifest_extras: dict[str, Any] = {}
        """Keys the transport adds to ``manifest.json`` (Flower: ``transport``)."""
        self.final_accumulators: list[Any] = []
        """The final headline accumulators, where no prediction left a client (Flower)."""
        self.transport = "simulator"
        """The transport's name in the checkpoint."""
        self.round_callback: Any = None
        """``callback(round, record)`` after each complete (checkpointed) round, or None."""
        self.pending_checkpoint: PendingWrite | None = None
        self.calibration: Any = None  # the calibrate step's outcome, when the run has one
        self.shift_outcome: Any = None  # the shift step's (bayesfl.shift_protocol.ShiftOutcome)

    def start_loop(self, channel: Any, **mode: Any) -> None:
        """The run's one round loop (`RoundLoop`) over the
        transport's ``channel``, with this run as its hooks; ``mode``: the transport's
        evaluation mode and limits (``evaluation``, ``min_replies``, ...)."""
        self.channel = channel
        config = self.config
        self.loop = RoundLoop(
            self.server, channel, self, state=self.server.init(), seed=config.seed,
            rounds=config.rounds, first_round=self.first_round, fraction=config.fraction,
            training=self.training, rng_devices=self.rng_devices(), **mode)

    @property
    def state(self) -> ServerState:
        """The server state (the round loop's)."""
        return self.loop.state

    @state.setter
    def state(self, state: ServerState) -> None:
        self.loop.state = state

    # ---- the run --------------------------------------------------------------------------
    def execute(self) -> dict[str, Any]:
        """Resume or start, the rounds, the final evaluation, the summary, the final steps and
        the files; returns the summary."""
        first = self.first_round
        if self.saved is not None:
            first = self.restore()
        else:
            self.metrics_log.start()
        if self.run_dir is not None:
            self.write_setup_files()
        self.start = time.perf_counter()
        self.rounds_starting(first)
        try:
            self.loop.run(first)
        finally:  # the last checkpoint is in place when the rounds end, even by an error
            try:
                self.checkpoint_in_place()
            finally:
                if self.run_dir is not None:
                    discard_spare(self.run_dir / CHECKPOINT_NAME)
                self.rounds_ended()
        final = self.final_evaluation(max(self.config.rounds, first - 1))
        summary = self.summarize(final)
        self.final_steps(final, summary)
        summary["seconds"] = self.seconds_before + time.perf_counter() - self.start
        if self.run_dir is not None:
            self.write_results(summary, final.last)
        return summary

    def summarize(self, final: FinalEvaluation) -> dict[str, Any]:
        """The summary of the rounds and the final evaluation (without the final steps)."""
        metrics = self.metrics_log.records
        rejected = run_rejected_message(metrics)
        if rejected is not None:
            warnings.warn(rejected, UploadsRejectedWarning, stacklevel=3)
            self.log(rejected)
        summary = build_summary(self.config, metrics, final.last, 0.0)
        summary.update(personalized=final.personalized, data=self.data_identity,
                       threads=self.threads, **final.extras)
        summary_extras(summary, novel=self.novel, novel_evaluation=final.novel)
        summary.update(self.server.server_metrics(self.state))
        return summary

    def log(self, text: str) -> None:  # noqa: B027 - optional hook, no-op by default
        """A line for the operator (Flower prints it; the simulator warns instead)."""

    def round_complete(self, record: dict[str, Any]) -> None:
        """The round loop's hook: a round's record is complete; append it to
        ``metrics.jsonl`` (after the transport's `round_recorded`), checkpoint, and call
        `round_callback`."""
        self.round_recorded(record)
        self.metrics_log.append(record)
        if self.run_dir is not None:
            self.checkpoint(record["round"])
        if self.round_callback is not None:
            self.round_callback(record["round"], record)

    # ---- the transport's hooks ------------------------------------------------------------
    def round_recorded(self, record: dict[str, Any]) -> None:  # noqa: B027 - optional hook, no-op by default
        """A round's record is complete, before it is appended (log it, add to it)."""

    def client_states(self) -> dict[int, ClientState]:
        """The client states the transport holds, for the checkpoint (none by default)."""
        return {}

    def restore_clients(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:  # noqa: B027 - optional hook, no-op by default
        """The client states the checkpoint holds for this transport (none by default)."""

    def rounds_starting(self, first: int) -> None:  # noqa: B027 - optional hook, no-op by default
        """Before round ``first`` (after the setup files)."""

    def rounds_ended(self) -> None:  # noqa: B027 - optional hook, no-op by default
        """After the rounds, even when they ended by an error."""

    @abstractmethod
    def final_evaluation(self, last_round: int) -> FinalEvaluation:
        """Every client's evaluation after the last round, with the broadcast it used."""

    def final_steps(self, final: FinalEvaluation, summary: dict[str, Any]) -> None:
        """The final phases (`bayesfl.engine.phases`) as the run asks, each over the
        transport's channel (its ``ask``, ``keys`` and ``num_test``) with the final evaluation
        broadcast: calibrate ([`calibration`][calibration], ``summary["calibration"]`` beside the
        uncalibrated figures), conformal (``summary["conformal"]`` and, with a run directory,
        ``conformal.md`` / ``conformal.png``) and the shift evaluation (`shift_step`).
        Each phase runs on a forked RNG: none draws from the run's."""
        channel, setup, config = self.channel, self.setup, self.config
        channel.final_broadcast = final.broadcast
        clients = self.reachable(self.training)
        if setup.calibration is not None:
            from bayesfl.calibrate import calibrate_phase

            with torch.random.fork_rng(devices=self.rng_devices()):
                self.calibration = calibrate_phase(
                    channel, clients, setup.held_out, spec=setup.calibration,
                    server=self.server, n_bins=config.n_bins, num_test=channel.num_test)
            summary["calibration"] = self.calibration.summary(summary)
        if setup.conformal is not None:
            from bayesfl.conformal import conformal_phase
            from bayesfl.conformal_report import write_conformal_files

            with torch.random.fork_rng(devices=self.rng_devices()):
                summary["conformal"] = conformal_phase(
                    channel, clients, setup.held_out, spec=setup.conformal,
                    held_out_fraction=setup.held_out_fraction,
                    num_classes=self.dataset.num_classes).summary()
            if self.run_dir is not None:
                write_conformal_files(summary["conformal"], self.run_dir)
        if self.shift_request is not None:
            with torch.random.fork_rng(devices=self.rng_devices()):
                summary["shift_evaluation"] = self.shift_step()

    def shift_step(self) -> dict[str, Any]:
        """The shift phase (run keys ``shift``/``ood``,
        `bayesfl.shift_protocol.shift_phase`): every reachable client scores its final
        state on its own shifted and out-of-distribution rows and replies with its mergeable
        states; the report of the valid replies goes to `shift_outcome` and, with a run
        directory, ``out/shift``. A bad or missing reply is a rejection; a report that cannot
        be built or written is the summary's ``error``, never the run's. Returns
        ``summary["shift_evaluation"]``."""
        from bayesfl.shift_protocol import report_settings, shift_phase, write_shift_outcome
        from bayesfl.strategies.base import MAP_PLUGIN, PREDICTIVE

        request, config, num_classes = self.shift_request, self.config, self.dataset.num_classes
        clients = sorted(self.reachable(range(config.clients)))
        try:
            settings = report_settings(
                request, run_dir=self.run_dir, strategy=config.strategy, dataset=config.dataset,
                clients=config.clients, novel=self.novel, partition=config.partition,
                rounds=config.rounds)
            outcome = shift_phase(
                self.channel, clients, request, num_test=self.channel.num_test,
                client_data=None if self.data_loader is not None else self.setup.client_data,
                predictives={PREDICTIVE, MAP_PLUGIN} if self.server.is_posterior
                else {PREDICTIVE}, num_classes=num_classes, novel=self.novel,
                settings=settings)
            if outcome.report is not None and self.run_dir is not None:
                write_shift_outcome(self.run_dir, outcome.report, outcome.states,
                                    novel=self.novel, num_classes=num_classes)
        except (BayesFLError, OSError, ValueError) as err:  # a report problem, not the run's
            self.log(f"shift evaluation failed: {err}")
            return {"report": None, "error": f"shift evaluation failed: {err}"}
        self.shift_outcome = outcome
        for rejection in outcome.rejections:
            self.log(f"shift evaluation: client {rejection['client_id']} left out: "
                     f"{rejection['reason']}")
        self.log(f"shift evaluation: {len(outcome.states)} of {len(clients)} sites, bytes up "
                 f"{outcome.bytes_up:,}, down {outcome.bytes_down:,}")
        summary = outcome.summary()
        if self.run_dir is None:  # nothing written: no report file to name
            summary["report"] = None
        return summary

    # ---- checkpoints ----------------------------------------------------------------------
    def checkpoint(self, r: int) -> None:
        """Write round ``r``'s checkpoint; its fsync and rename (waiting on the disk, ~1 s at
        16,000 clients) overlap the next round and are waited for before the next checkpoint
        and when the rounds end (`checkpoint_in_place`). The tensors it holds are
        written before this returns (the next round replaces client states, it does not
        write into them, but nothing relies on that). Each write overwrites the checkpoint
        before last, kept as a spare until the rounds end (its pages are still in memory: 0.1
        instead of ~1 s at 16,000 clients, `bayesfl.checkpoint.write_atomically`)."""
        self.checkpoint_in_place()
        self.pending_checkpoint = save_round(
            self.run_dir / CHECKPOINT_NAME, round=r, first_round=self.first_round,
            seconds=self.seconds_before + time.perf_counter() - self.start,
            identity=self.identity, fingerprint=self.fingerprint, state=self.state,
            clients=self.client_states(), metrics_text=self.metrics_log.text,
            transport=self.transport, durable_in_background=True, keep_spare=True)

    def checkpoint_in_place(self) -> None:
        """Wait for the last checkpoint's fsync and rename (CheckpointError if they failed)."""
        pending, self.pending_checkpoint = self.pending_checkpoint, None
        if pending is not None:
            pending.wait()

    def restore(self) -> int:
        """Load the run's state from the checkpoint read at setup; returns the next round.

        Raises:
            CheckpointError: it holds a round or state this run cannot have written.
        """
        path = self.run_dir / CHECKPOINT_NAME
        tensors, meta = self.saved
        self.saved = None
        saved = restore_round(path, tensors, meta, first_round=self.first_round,
                              rounds=self.config.rounds, server=self.server, fresh=self.state,
                              num_clients=self.config.clients, device=self.device)
        try:
            self.restore_clients(tensors, meta)
            torch.set_rng_state(saved.rng)
        except (KeyError, TypeError, ValueError, RuntimeError) as err:
            raise CheckpointError(foreign_message(path).format(
                f"it does not hold this run's state: {err}")) from err
        self.metrics_log.restore(saved.metrics, list(range(self.first_round, saved.round + 1)))
        self.state = saved.state
        self.seconds_before = saved.seconds
        self.resumed_from = saved.round
        return saved.round + 1

    # ---- files ----------------------------------------------------------------------------
    def write_setup_files(self) -> None:
        """``manifest.json`` and, unless every site loads its own data, ``partition.txt`` and
        ``partition.json`` (clients x classes counts, held-out rows included)."""
        from bayesfl.manifest import write_manifest

        write_manifest(self.run_dir / "manifest.json", self.config.to_dict(),
                       data=self.data_identity, threads=self.threads,
                       resumed_from_round=self.resumed_from, **self.manifest_extras)
        if self.data_loader is not None:
            return  # the sites' sizes are known after discovery
        clients, labels = self.setup.client_data, self.dataset.y
        held = {k: h.indices for k, h in self.setup.held_out.items() if h.indices is not None}
        parts = [np.concatenate([c.train_indices, c.test_indices,
                                 held.get(c.client_id, np.empty(0, np.int64))])
                 for c in clients]
        C = self.dataset.num_classes
        counts = partition_summary(labels, parts, C)
        (self.run_dir / "partition.txt").write_text(
            format_partition_summary(labels, parts, C) + "\n")
        (self.run_dir / "partition.json").write_text(json.dumps({
            "scheme": self.config.partition, "counts": counts.tolist(),
            "train_sizes": [c.num_train for c in clients],
            "test_sizes": [c.num_test for c in clients],
            "bodies": [self.setup.context.client_config(c.client_id).body for c in clients],
            "novel": list(self.novel)}) + "\n")

    def write_results(self, summary: dict[str, Any], last: RoundEvaluation) -> None:
        """``summary.json``, ``accuracy.png`` and ``reliability.png``; with the predictions at
        hand (in process) also ``predictions.npz``, else the diagram is drawn from the merged
        bins (no prediction left a client)."""
        from bayesfl.plots import plot_accuracy, plot_reliability

        run_dir, name = self.run_dir, self.config.strategy
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        evaluated = [m for m in self.metrics_log.records if m.get("accuracy") is not None]
        if evaluated:
            plot_accuracy({name: evaluated}, run_dir / "accuracy.png")
        if last.probs.numel():
            np.savez(run_dir / "predictions.npz", probs=last.probs.numpy(),
                     labels=last.labels.numpy(), client_ids=last.client_ids.numpy())
            plot_reliability(last.probs, last.labels, run_dir / "reliability.png",
                             n_bins=self.config.n_bins, title=f"{name}, final round (pooled)")
            return
        import matplotlib.pyplot as plt

        from calibration.accumulator import Accumulator
        from calibration.diagram import reliability_diagram

        stats = Accumulator.merged(self.final_accumulators).bin_stats()
        figure = reliability_diagram(stats, title=f"{name}, final round (pooled, merged bins)")
        figure.savefig(run_dir / "reliability.png", dpi=120)
        plt.close(figure)

    def rng_devices(self) -> list[torch.device]:
        """The devices whose RNG a round or a final step forks (CUDA devices in use)."""
        return [self.device] if self.device.type == "cuda" else []


__all__ = ["FinalEvaluation", "Run"]
