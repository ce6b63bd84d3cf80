"""The embedded federated simulator: a transport that drives a strategy round by round.

``simulate(strategy="fedlog", dataset="digits", clients=20, partition="shards:2", rounds=30,
seed=0, out="runs/demo")`` loads the data, partitions it, and builds the strategy twice from
the run configuration: a server half and a client half that share no object (as a Flower
ServerApp and ClientApp would). Every client gets its own config and initial state
(``init_client``). Then per round: samples clients (all, or a seeded ``fraction``), encodes the
server's broadcast (``configure``) with :func:`bayesfl.messages.encode` and decodes it on the
client side, runs the clients' ``fit`` through the :class:`~bayesfl.executor.ClientExecutor`
(batched over clients that share a body spec, one by one otherwise), encodes every upload,
decodes and validates it on receipt against the round's schema (``validate_uploads``, one
verdict per upload) — an invalid upload is *rejected*, its reason logged, and the round goes
on with the others — aggregates, sends the evaluation broadcast (``configure_evaluation``),
lets every client evaluate itself into calibration accumulators and merges them (per client
and pooled), appends a line to ``metrics.jsonl`` and checkpoints atomically. After the last
round, strategies that personalise (FedBABU) do so once, and the final evaluation uses the
personalised states.

Run directory (``out``): ``metrics.jsonl`` (one JSON object per round), ``summary.json``,
``manifest.json`` (config, seed, versions, git hash), ``partition.txt`` / ``partition.json``
(clients x classes counts), ``predictions.npz`` (final-round test probabilities, labels and
client ids, readable by ``bayesfl-calibrate``), ``checkpoint.safetensors`` and the plots
``accuracy.png`` and ``reliability.png``.

Randomness: every random draw of round ``r`` comes from generators derived from
``(seed, r, client)`` (client sampling, mini-batch order, noise), and the global torch RNG is
reseeded from ``(seed, r)`` at the start of each round; the checkpoint also stores the global
torch RNG state. Resuming (``resume=True``) restores the server state, every client's
state and the counters from the last complete round, so a resumed run writes the
same numbers as an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from bayesfl.checkpoint import config_fingerprint, load_checkpoint, save_checkpoint
from bayesfl.data.clients import ClientData, make_clients
from bayesfl.data.datasets import Dataset, load_dataset
from bayesfl.data.partition import format_partition_summary, partition_summary
from bayesfl.errors import BayesFLError, ConfigError, MessageRejected
from bayesfl.evaluation import RoundEvaluation, merge_evaluations
from bayesfl.executor import ClientExecutor, SimulatedClient
from bayesfl.inputs import client_index, client_inputs
from bayesfl.messages import Message, decode, encode
from bayesfl.posterior import ClientPosterior
from bayesfl.strategies import make_strategy, strategy_options
from bayesfl.strategies.base import (
    PREDICTIVE,
    ClientState,
    ServerState,
    Strategy,
    StrategyContext,
    derived_seed,
)
from bayesfl.training import LocalTraining
from inference.errors import InferenceError

UploadHook = Callable[[int, int, bytes], bytes]
"""``hook(round, client_id, encoded_upload) -> bytes actually delivered`` (tests, attacks)."""

BroadcastHook = Callable[[int, bytes], None]
"""``hook(round, encoded_broadcast)``: sees each round's broadcast as it leaves the server
(tests that replay the client half elsewhere, audits); it cannot change it."""

RoundCallback = Callable[[int, dict], None]
"""``callback(round, metrics_record)`` after each complete (checkpointed) round."""

CHECKPOINT_NAME = "checkpoint.safetensors"


@dataclass(frozen=True)
class SimulationConfig:
    """Everything that determines a run's numbers (its fingerprint guards resumption).

    ``body`` is one body spec for all clients, or several separated by commas, assigned to
    clients in turn (client k gets spec ``k % len(specs)``): ``"mlp:200,mlp:100-100"``.
    ``batched`` trains clients of one architecture together (same results up to float
    rounding). ``fraction`` of the clients (at least one) is sampled each training round.
    """

    strategy: str = "fedlog"
    dataset: str = "digits"
    clients: int = 20
    partition: str = "shards:2"
    rounds: int = 30
    seed: int = 0
    body: str = "mlp:200"
    feature_dim: int = 50
    local_epochs: int = 5
    lr: float = 1e-3
    batch_size: int = 10
    fraction: float = 1.0
    test_fraction: float = 0.25
    batched: bool = True
    n_bins: int = 15
    device: str = "cpu"
    strategy_options: dict[str, Any] = field(default_factory=dict)
    dataset_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.clients < 1:
            raise ConfigError(f"clients must be >= 1, got {self.clients}")
        if self.rounds < 0:
            raise ConfigError(f"rounds must be >= 0, got {self.rounds}")
        if not 0.0 < self.fraction <= 1.0:
            raise ConfigError(f"fraction must lie in (0, 1], got {self.fraction}")
        if self.n_bins < 1:
            raise ConfigError(f"n_bins must be >= 1, got {self.n_bins}")
        if not self.body_specs:
            raise ConfigError(f"body must name at least one body spec, got {self.body!r}")
        strategy_options(self.strategy)  # an unknown strategy fails before any data is loaded

    @property
    def body_specs(self) -> list[str]:
        return [s.strip() for s in self.body.split(",") if s.strip()]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(SimulationConfig))


@dataclass
class SimulationResult:
    """What :func:`simulate` returns.

    Attributes:
        config: the run's configuration.
        summary: the dict written to ``summary.json``.
        metrics: one dict per round (the lines of ``metrics.jsonl``).
        run_dir: the run directory, or None when nothing was written.
        state: the final server state.
        clients: the clients (config, data, trained state) at the end of the run.
        strategy: the client half (for predictions and posteriors after the run).
        evaluation_broadcast: what clients evaluate with after the last round.
        personalized: client id -> personalized state (strategies that personalise), used
            for predictions instead of the trained state.
    """

    config: SimulationConfig
    summary: dict[str, Any]
    metrics: list[dict[str, Any]]
    run_dir: Path | None
    state: ServerState
    clients: list[SimulatedClient]
    strategy: Strategy
    evaluation_broadcast: Message
    personalized: dict[int, ClientState] = field(default_factory=dict)

    def client_state(self, client_id: int) -> ClientState:
        """Client ``client_id``'s final state (personalized where the strategy does that).

        Raises:
            ConfigError: ``client_id`` is not an integer in ``[0, clients)``.
        """
        client_id = client_index(client_id, len(self.clients))
        return self.personalized.get(client_id, self.clients[client_id].state)

    def predict_proba(self, client_id: int, x: Any) -> torch.Tensor:
        """Probabilities (B, C) float64 of client ``client_id`` for inputs x (B, ...): the
        strategy's headline predictive (posterior strategies: the posterior predictive).

        ``x`` may be a tensor, NumPy array or list of any real dtype; it is cast to the dtype
        and device of the client's data (:func:`bayesfl.inputs.client_inputs`).

        Raises:
            ConfigError: ``client_id`` is not an integer in ``[0, clients)``.
            DataError: ``x`` is not a finite batch shaped like the client's inputs.
        """
        state = self.client_state(client_id)
        client = self.clients[int(client_id)]
        like = client.data.train_x
        x = client_inputs(x, input_shape=tuple(like.shape[1:]), dtype=like.dtype,
                          device=like.device)
        return self.strategy.predict(client.config, state, self.evaluation_broadcast,
                                     x)[PREDICTIVE]

    def posterior(self, client_id: int) -> Any:
        """The federated posterior as client ``client_id`` holds it (posterior strategies):
        ``sample(n)`` draws head parameters, ``predict_proba(x)`` takes the client's inputs.

        Raises:
            ConfigError: the strategy is not a posterior strategy, or ``client_id`` is not an
                integer in ``[0, clients)``.
        """
        state = self.client_state(client_id)
        client = self.clients[int(client_id)]
        posterior = self.strategy.posterior(client.config, state, self.evaluation_broadcast)
        if isinstance(posterior, ClientPosterior) and posterior.input_shape is None:
            posterior.input_shape = tuple(client.data.train_x.shape[1:])  # checked per batch
        return posterior


def simulate(
    strategy: str = "fedlog",
    dataset: str = "digits",
    clients: int = 20,
    partition: str = "shards:2",
    rounds: int = 30,
    seed: int = 0,
    *,
    out: str | Path | None = None,
    resume: bool = False,
    progress: bool = True,
    upload_hook: UploadHook | None = None,
    round_callback: RoundCallback | None = None,
    broadcast_hook: BroadcastHook | None = None,
    data: Dataset | None = None,
    **options: Any,
) -> SimulationResult:
    """Run a federated experiment (module docstring) and return its results.

    Args:
        strategy, dataset, clients, partition, rounds, seed: the experiment.
        out: run directory for metrics, summary, manifest, plots and checkpoints; None
            writes nothing (and cannot resume).
        resume: continue from ``out``'s checkpoint (from scratch if there is none yet).
        progress: show a tqdm progress bar over rounds.
        upload_hook: transforms each encoded upload before the server receives it.
        round_callback: called after each complete round with its metrics record.
        broadcast_hook: called with each round's encoded broadcast.
        data: a pre-loaded pooled data set instead of loading ``dataset`` by name.
        **options: the other :class:`SimulationConfig` fields (body, feature_dim,
            local_epochs, lr, batch_size, fraction, test_fraction, batched, n_bins, device,
            strategy_options, dataset_options).

    Raises:
        ConfigError: unknown names or options, inconsistent settings.
        DataError: a partition that leaves a client empty, more clients than samples.
        CheckpointError: ``resume`` with a corrupt or foreign checkpoint.
    """
    unknown = sorted(set(options) - set(CONFIG_FIELDS))
    if unknown:
        raise ConfigError(f"unknown option(s) {unknown}; valid: {', '.join(CONFIG_FIELDS)}")
    config = SimulationConfig(strategy=strategy, dataset=dataset, clients=clients,
                              partition=partition, rounds=rounds, seed=seed, **options)
    if resume and out is None:
        raise ConfigError("resume=True needs the run directory `out` of the run to continue")
    run = _Run(config, None if out is None else Path(out), data=data)
    run.broadcast_hook = broadcast_hook
    return run.execute(resume=resume, progress=progress, upload_hook=upload_hook,
                       round_callback=round_callback)


def sample_clients(num_clients: int, fraction: float, seed: int, round: int) -> list[int]:
    """The sorted client ids taking part in ``round``: all when ``fraction == 1`` or in the
    init round 0, else ``max(1, round(fraction * num_clients))`` drawn without replacement."""
    if fraction >= 1.0 or round == 0:
        return list(range(num_clients))
    k = max(1, int(round_half_up(fraction * num_clients)))
    rng = np.random.default_rng([seed, round, 7])
    return sorted(int(i) for i in rng.choice(num_clients, size=k, replace=False))


def round_half_up(x: float) -> int:
    return int(np.floor(x + 0.5))


_SERVER_KEY = 2**31 - 1
_PERSONALIZE_KEY = 2**31 - 2


class _Run:
    """One run: setup, the round loop, and the files it writes."""

    def __init__(self, config: SimulationConfig, run_dir: Path | None, data: Dataset | None):
        self.config = config
        self.run_dir = run_dir
        self.device = torch.device(config.device)
        self.dataset = data if data is not None else load_dataset(
            config.dataset, seed=config.seed, **config.dataset_options)
        client_data = make_clients(self.dataset, config.clients, config.partition,
                                   seed=config.seed, test_fraction=config.test_fraction)
        training = LocalTraining(epochs=config.local_epochs, lr=config.lr,
                                 batch_size=config.batch_size)
        context = StrategyContext(
            num_classes=self.dataset.num_classes, feature_dim=config.feature_dim,
            training=training, rounds=config.rounds, device=self.device, seed=config.seed,
            input_shape=tuple(self.dataset.input_shape), bodies=tuple(config.body_specs),
            clients=config.clients)
        # the two halves are built apart from the same run configuration, as a Flower
        # ServerApp and ClientApp would be: nothing set on one is seen by the other
        self.server = make_strategy(config.strategy, context, **config.strategy_options)
        self.client_half = make_strategy(config.strategy, context, **config.strategy_options)
        self.clients = []
        for d in client_data:
            client_config = context.client_config(d.client_id)
            self.clients.append(SimulatedClient(client_config, self._on_device(d),
                                                self.client_half.init_client(client_config)))
        self.executor = ClientExecutor(self.client_half, batched=config.batched)
        self.state = self.server.init()
        self.fingerprint = config_fingerprint(config.to_dict())
        self.broadcast_hook: BroadcastHook | None = None

    def _on_device(self, data: ClientData) -> ClientData:
        return ClientData(
            client_id=data.client_id,
            train_x=data.train_x.to(self.device), train_y=data.train_y.to(self.device),
            test_x=data.test_x.to(self.device), test_y=data.test_y.to(self.device),
            train_indices=data.train_indices, test_indices=data.test_indices,
        )

    # ---- the loop -------------------------------------------------------------------------
    def execute(
        self,
        *,
        resume: bool,
        progress: bool,
        upload_hook: UploadHook | None,
        round_callback: RoundCallback | None,
    ) -> SimulationResult:
        config = self.config
        first = 0 if self.server.init_round else 1
        metrics: list[dict[str, Any]] = []
        self.seconds_before = 0.0
        if self.run_dir is not None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            if resume and (self.run_dir / CHECKPOINT_NAME).exists():
                first, metrics = self._restore()
            else:
                (self.run_dir / "metrics.jsonl").write_text("")
            self._write_setup_files()
        start = time.perf_counter()
        bar = tqdm(range(first, config.rounds + 1), disable=not progress, unit="round",
                   desc=f"{config.strategy} on {config.dataset}", leave=False)
        last_eval: RoundEvaluation | None = None
        for r in bar:
            t0 = time.perf_counter()
            # Rounds seed the global RNG (layers built inside strategies draw from it); the
            # caller's own RNG state is restored afterwards.
            with torch.random.fork_rng(devices=self._rng_devices()):
                record, last_eval = self._round(r, upload_hook)
            record["seconds"] = time.perf_counter() - t0
            metrics.append(record)
            bar.set_postfix(acc=f"{record['accuracy']:.3f}", ece=f"{record['ece']:.3f}")
            if self.run_dir is not None:
                with open(self.run_dir / "metrics.jsonl", "a") as f:
                    f.write(json.dumps(record) + "\n")
                self._checkpoint(r, self.seconds_before + time.perf_counter() - start)
            if round_callback is not None:
                round_callback(r, record)
        bar.close()
        last_round = max(config.rounds, first - 1)
        broadcast = decode(encode(self.server.configure_evaluation(self.state, last_round)))
        personalized: dict[int, ClientState] = {}
        with torch.random.fork_rng(devices=self._rng_devices()):
            if self.client_half.personalizes:
                gens = {c.client_id: torch.Generator().manual_seed(
                    derived_seed(config.seed, _PERSONALIZE_KEY, c.client_id))
                    for c in self.clients}
                personalized = self.executor.personalize(self.clients, broadcast, gens)
                last_eval = None
            if last_eval is None:  # personalised, or resumed a finished run: evaluate once
                last_eval = merge_evaluations(self.executor.evaluate(
                    self.clients, broadcast, n_bins=config.n_bins, keep_probs=True,
                    states=personalized or None))
        seconds = self.seconds_before + time.perf_counter() - start
        summary = build_summary(config, metrics, last_eval, seconds)
        summary["personalized"] = bool(personalized)
        if self.run_dir is not None:
            self._write_results(summary, metrics, last_eval)
        return SimulationResult(config, summary, metrics, self.run_dir, self.state,
                                self.clients, self.client_half, broadcast, personalized)

    def _rng_devices(self) -> list[torch.device]:
        return [self.device] if self.device.type == "cuda" else []

    def _round(self, r: int, upload_hook: UploadHook | None) -> tuple[dict, RoundEvaluation]:
        config, server = self.config, self.server
        torch.manual_seed(derived_seed(config.seed, r))
        participants = sample_clients(config.clients, config.fraction, config.seed, r)
        plan = server.configure(self.state, r)
        down_bytes = encode(plan.broadcast)
        if self.broadcast_hook is not None:
            self.broadcast_hook(r, down_bytes)
        received = decode(down_bytes)  # what the clients see is what crossed the wire
        t_local = time.perf_counter()
        gens = {cid: torch.Generator().manual_seed(derived_seed(config.seed, r, cid))
                for cid in participants}
        uploads = self.executor.fit([self.clients[i] for i in participants], received, gens)
        t_local = time.perf_counter() - t_local
        bytes_up: list[int] = []
        floats_up = 0
        reasons: dict[int, str] = {}  # client id -> why its upload was rejected
        received_up: list[tuple[int, Message]] = []
        for cid, upload in zip(participants, uploads, strict=True):
            data = encode(upload)
            floats_up += upload.num_elements
            if upload_hook is not None:
                data = upload_hook(r, cid, data)
            bytes_up.append(len(data) if isinstance(data, bytes | bytearray) else 0)
            try:
                received_up.append((cid, decode(data, max_bytes=plan.max_upload_bytes)))
            except MessageRejected as err:
                reasons[cid] = err.reason
        verdicts = server.validate_uploads(plan, [m for _, m in received_up],
                                           [cid for cid, _ in received_up])
        accepted: list[Message] = []
        for (cid, message), reason in zip(received_up, verdicts, strict=True):
            if reason is None:
                accepted.append(message)
            else:
                reasons[cid] = reason
        rejections = [{"client_id": cid, "reason": reasons[cid]}
                      for cid in participants if cid in reasons]
        aggregate_error = None
        try:
            server_gen = torch.Generator().manual_seed(derived_seed(config.seed, r, _SERVER_KEY))
            self.state = server.aggregate(self.state, accepted, r, server_gen)
        except (BayesFLError, InferenceError) as err:  # keep the previous state; go on
            aggregate_error = str(err)
        t_eval = time.perf_counter()
        eval_bytes = encode(server.configure_evaluation(self.state, r))
        evaluations = self.executor.evaluate(self.clients, decode(eval_bytes),
                                             n_bins=config.n_bins,
                                             keep_probs=r == config.rounds)
        evaluation = merge_evaluations(evaluations)
        t_eval = time.perf_counter() - t_eval
        record = {
            "round": r,
            "participants": participants,
            "accepted": len(accepted),
            "rejections": rejections,
            **evaluation.headline(),
            "bytes_up": int(sum(bytes_up)),
            "bytes_down": len(down_bytes) * len(participants),
            "bytes_up_per_client": bytes_up,
            "bytes_down_per_client": len(down_bytes),
            "bytes_down_evaluation": len(eval_bytes) * len(self.clients),
            "floats_up": int(floats_up),
            "floats_down": plan.broadcast.num_elements * len(participants),
            "per_client": evaluation.per_client,
            "seconds_local_updates": t_local,
            "seconds_evaluation": t_eval,
        }
        if aggregate_error is not None:
            record["aggregate_error"] = aggregate_error
        return record, evaluation

    # ---- checkpoints ----------------------------------------------------------------------
    def _checkpoint(self, r: int, seconds: float) -> None:
        tensors = {f"server/{k}": v for k, v in self.state.items()}
        for c in self.clients:
            tensors.update({f"client/{c.client_id}/{k}": v for k, v in c.state.items()})
        tensors["rng/torch"] = torch.get_rng_state()
        meta = {"round": r, "seconds": seconds, "config": self.config.to_dict(),
                "server_keys": sorted(self.state)}
        save_checkpoint(self.run_dir / CHECKPOINT_NAME, tensors, meta,
                        fingerprint=self.fingerprint)

    def _restore(self) -> tuple[int, list[dict[str, Any]]]:
        tensors, meta = load_checkpoint(self.run_dir / CHECKPOINT_NAME,
                                        fingerprint=self.fingerprint)
        last = int(meta["round"])
        self.state = {k: tensors[f"server/{k}"].to(self.device) for k in meta["server_keys"]}
        for c in self.clients:
            prefix = f"client/{c.client_id}/"
            c.state = {k[len(prefix):]: v.to(self.device)
                       for k, v in tensors.items() if k.startswith(prefix)}
        torch.set_rng_state(tensors["rng/torch"])
        self.seconds_before = float(meta["seconds"])
        # keep the metric lines of complete rounds only (a crash may have left one more)
        path = self.run_dir / "metrics.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        metrics = [rec for rec in (json.loads(x) for x in lines if x.strip())
                   if rec["round"] <= last]
        path.write_text("".join(json.dumps(rec) + "\n" for rec in metrics))
        return last + 1, metrics

    # ---- files ----------------------------------------------------------------------------
    def _write_setup_files(self) -> None:
        from bayesfl.manifest import write_manifest

        write_manifest(self.run_dir / "manifest.json", self.config.to_dict())
        labels = self.dataset.y
        parts = [np.concatenate([c.data.train_indices, c.data.test_indices])
                 for c in self.clients]
        C = self.dataset.num_classes
        counts = partition_summary(labels, parts, C)
        (self.run_dir / "partition.txt").write_text(
            format_partition_summary(labels, parts, C) + "\n")
        (self.run_dir / "partition.json").write_text(json.dumps({
            "scheme": self.config.partition, "counts": counts.tolist(),
            "train_sizes": [c.data.num_train for c in self.clients],
            "test_sizes": [c.data.num_test for c in self.clients],
            "bodies": [c.body_spec for c in self.clients]}) + "\n")

    def _write_results(self, summary: dict, metrics: list[dict], last: RoundEvaluation) -> None:
        from bayesfl.plots import plot_accuracy, plot_reliability

        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        np.savez(self.run_dir / "predictions.npz", probs=last.probs.numpy(),
                 labels=last.labels.numpy(), client_ids=last.client_ids.numpy())
        plot_accuracy({self.config.strategy: metrics}, self.run_dir / "accuracy.png")
        plot_reliability(last.probs, last.labels, self.run_dir / "reliability.png",
                         n_bins=self.config.n_bins,
                         title=f"{self.config.strategy}, final round (pooled)")


def build_summary(
    config: SimulationConfig,
    metrics: list[dict[str, Any]],
    last: RoundEvaluation,
    seconds: float,
) -> dict[str, Any]:
    """The summary dict: final-round metrics, best round, byte totals, rejections."""
    training = [m for m in metrics if m["round"] >= 1] or metrics
    best = max(training, key=lambda m: m["accuracy"]) if training else None
    rejections = [{"round": m["round"], **rej} for m in metrics for rej in m["rejections"]]
    return {
        "strategy": config.strategy,
        "dataset": config.dataset,
        "partition": config.partition,
        "clients": config.clients,
        "rounds": config.rounds,
        "seed": config.seed,
        "body": config.body,
        **last.headline(),
        "per_client": last.per_client,
        "best_accuracy": best["accuracy"] if best else None,
        "best_round": best["round"] if best else None,
        "bytes_up": int(sum(m["bytes_up"] for m in metrics)),
        "bytes_down": int(sum(m["bytes_down"] for m in metrics)),
        "bytes_down_evaluation": int(sum(m.get("bytes_down_evaluation", 0) for m in metrics)),
        "floats_up": int(sum(m["floats_up"] for m in metrics)),
        "floats_down": int(sum(m["floats_down"] for m in metrics)),
        "rejected_uploads": len(rejections),
        "rejections": rejections,
        "seconds": seconds,
    }
