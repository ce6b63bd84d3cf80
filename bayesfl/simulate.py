"""The embedded federated simulator: a transport that drives a strategy round by round.

``simulate(strategy="fedlog", dataset="digits", clients=20, partition="shards:2", rounds=30,
seed=0, out="runs/demo")`` loads the data, partitions it, builds every client's body, then per
round: samples clients (all, or a seeded ``fraction``), encodes the broadcast with
:func:`bayesfl.messages.encode` and decodes it on the client side, runs local training
(batched over clients that share one architecture, a plain loop otherwise), encodes every
upload, decodes and validates it on receipt (the strategy's ``validate_uploads``, one verdict
per upload) — an invalid upload is *rejected*, its reason logged, and the round goes on with
the others — aggregates, evaluates every client with :mod:`calibration` (per client and pooled
by merging accumulators; batched runs score all clients of a round in one vectorised pass),
appends a line to ``metrics.jsonl`` and checkpoints atomically.

Run directory (``out``): ``metrics.jsonl`` (one JSON object per round), ``summary.json``,
``manifest.json`` (config, seed, versions, git hash), ``partition.txt`` / ``partition.json``
(clients x classes counts), ``predictions.npz`` (final-round test probabilities, labels and
client ids, readable by ``bayesfl-calibrate``), ``checkpoint.safetensors`` and the plots
``accuracy.png`` and ``reliability.png``.

Randomness: every random draw of round ``r`` comes from generators derived from
``(seed, r, client)`` (client sampling, mini-batch order, noise), and the global torch RNG is
reseeded from ``(seed, r)`` at the start of each round; the checkpoint also stores the global
torch RNG state. Resuming (``resume=True``) restores the server state, every client's
persistent tensors and the counters from the last complete round, so a resumed run writes the
same numbers as an uninterrupted one.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from bayesfl.bodies import build_body, check_feature_dim
from bayesfl.checkpoint import config_fingerprint, load_checkpoint, save_checkpoint
from bayesfl.data.clients import ClientData, make_clients
from bayesfl.data.datasets import Dataset, load_dataset
from bayesfl.data.partition import format_partition_summary, partition_summary
from bayesfl.errors import BayesFLError, ConfigError, MessageRejected
from bayesfl.evaluation import RoundEvaluation, evaluate_clients
from bayesfl.messages import Message, decode, encode
from bayesfl.strategies import Client, make_strategy, strategy_options
from bayesfl.strategies.base import BaseStrategy, ServerState, StrategyContext
from bayesfl.training import LocalTraining, architecture_key
from inference.errors import InferenceError

UploadHook = Callable[[int, int, bytes], bytes]
"""``hook(round, client_id, encoded_upload) -> bytes actually delivered`` (tests, attacks)."""

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
        clients: the clients (data, trained models) at the end of the run.
        strategy: the strategy object (for predictions after the run).
    """

    config: SimulationConfig
    summary: dict[str, Any]
    metrics: list[dict[str, Any]]
    run_dir: Path | None
    state: ServerState
    clients: list[Client]
    strategy: BaseStrategy

    def predict_proba(self, client_id: int, x: torch.Tensor) -> torch.Tensor:
        """Probabilities (B, C) of client ``client_id`` for inputs x with the final state."""
        return self.strategy.predict_proba(self.clients[client_id], self.state, x)


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
    return run.execute(resume=resume, progress=progress, upload_hook=upload_hook,
                       round_callback=round_callback)


def derived_seed(seed: int, *keys: int) -> int:
    """A 63-bit seed derived from ``seed`` and integer ``keys`` (numpy SeedSequence)."""
    words = np.random.SeedSequence([seed, *[k % 2**32 for k in keys]]).generate_state(2)
    return int((int(words[0]) << 31) ^ int(words[1])) & (2**63 - 1)


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
        context = StrategyContext(num_classes=self.dataset.num_classes,
                                  feature_dim=config.feature_dim, training=training,
                                  rounds=config.rounds, device=self.device, seed=config.seed)
        self.strategy = make_strategy(config.strategy, context, **config.strategy_options)
        self._initial_models: dict[str, torch.nn.Module] = {}
        self.clients = [self._build_client(d) for d in client_data]
        del self._initial_models
        self.state = self.strategy.init(self.clients)
        self.fingerprint = config_fingerprint(config.to_dict())

    def _build_client(self, data: ClientData) -> Client:
        specs = self.config.body_specs
        spec = specs[data.client_id % len(specs)]
        shape = self.dataset.input_shape
        # one seed per spec: clients with the same body start from the same weights (a
        # deepcopy of one model, as the papers do); different architectures initialise
        # independently
        if spec not in self._initial_models:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(derived_seed(self.config.seed, 11, specs.index(spec)))
                body = build_body(spec, shape, self.config.feature_dim)
                check_feature_dim(body, shape, self.config.feature_dim)
                self._initial_models[spec] = self.strategy.build_model(body).to(self.device)
        model = copy.deepcopy(self._initial_models[spec])
        data = ClientData(
            client_id=data.client_id,
            train_x=data.train_x.to(self.device), train_y=data.train_y.to(self.device),
            test_x=data.test_x.to(self.device), test_y=data.test_y.to(self.device),
            train_indices=data.train_indices, test_indices=data.test_indices,
        )
        return Client(client_id=data.client_id, data=data, model=model, body_spec=spec)

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
        first = 0 if self.strategy.init_round else 1
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
            rng_devices = [self.device] if self.device.type == "cuda" else []
            with torch.random.fork_rng(devices=rng_devices):
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
        if last_eval is None:  # nothing left to run (resumed a finished run): evaluate once
            last_eval = evaluate_clients(self.strategy, self.clients, self.state,
                                         n_bins=config.n_bins, batched=config.batched)
        seconds = self.seconds_before + time.perf_counter() - start
        summary = build_summary(config, metrics, last_eval, seconds)
        if self.run_dir is not None:
            self._write_results(summary, metrics, last_eval)
        return SimulationResult(config, summary, metrics, self.run_dir, self.state,
                                self.clients, self.strategy)

    def _round(self, r: int, upload_hook: UploadHook | None) -> tuple[dict, RoundEvaluation]:
        config, strategy = self.config, self.strategy
        torch.manual_seed(derived_seed(config.seed, r))
        participants = sample_clients(config.clients, config.fraction, config.seed, r)
        down = strategy.broadcast(self.state, r)
        down_bytes = encode(down)
        received = decode(down_bytes)  # what the clients see is what crossed the wire
        t_local = time.perf_counter()
        uploads = self._local_updates([self.clients[i] for i in participants], received, r)
        t_local = time.perf_counter() - t_local
        bytes_up: list[int] = []
        floats_up = 0
        limit = strategy.max_upload_bytes()
        reasons: dict[int, str] = {}  # client id -> why its upload was rejected
        received_up: list[tuple[int, Message]] = []
        for cid, upload in zip(participants, uploads, strict=True):
            data = encode(upload)
            floats_up += upload.num_elements
            if upload_hook is not None:
                data = upload_hook(r, cid, data)
            bytes_up.append(len(data) if isinstance(data, bytes | bytearray) else 0)
            try:
                received_up.append((cid, decode(data, max_bytes=limit)))
            except MessageRejected as err:
                reasons[cid] = err.reason
        verdicts = strategy.validate_uploads([m for _, m in received_up], round=r,
                                             client_ids=[cid for cid, _ in received_up])
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
            self.state = strategy.aggregate(self.state, accepted, r, server_gen)
        except (BayesFLError, InferenceError) as err:  # keep the previous state; go on
            aggregate_error = str(err)
        t_eval = time.perf_counter()
        evaluation = evaluate_clients(strategy, self.clients, self.state, n_bins=config.n_bins,
                                      batched=config.batched)
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
            "floats_up": int(floats_up),
            "floats_down": down.num_elements * len(participants),
            "per_client": evaluation.per_client,
            "seconds_local_updates": t_local,
            "seconds_evaluation": t_eval,
        }
        if aggregate_error is not None:
            record["aggregate_error"] = aggregate_error
        return record, evaluation

    def _local_updates(
        self, clients: Sequence[Client], message: Message, r: int
    ) -> list[Message]:
        seed = self.config.seed
        gens = {c.client_id: torch.Generator().manual_seed(derived_seed(seed, r, c.client_id))
                for c in clients}
        if not (self.config.batched and self.strategy.supports_batched_training):
            return [self.strategy.client_update(c, message, gens[c.client_id]) for c in clients]
        groups: dict[tuple, list[Client]] = {}
        for c in clients:
            groups.setdefault(architecture_key(c.model), []).append(c)
        out: dict[int, Message] = {}
        for group in groups.values():
            messages = self.strategy.client_update_batch(
                group, message, [gens[c.client_id] for c in group])
            out.update({c.client_id: m for c, m in zip(group, messages, strict=True)})
        return [out[c.client_id] for c in clients]

    # ---- checkpoints ----------------------------------------------------------------------
    def _checkpoint(self, r: int, seconds: float) -> None:
        tensors = {f"server/{k}": v for k, v in self.state.items()}
        for c in self.clients:
            tensors.update({f"client/{c.client_id}/{k}": v
                            for k, v in c.persistent_state().items()})
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
            c.load_persistent_state({k[len(prefix):]: v.to(self.device)
                                     for k, v in tensors.items() if k.startswith(prefix)})
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
        "floats_up": int(sum(m["floats_up"] for m in metrics)),
        "floats_down": int(sum(m["floats_down"] for m in metrics)),
        "rejected_uploads": len(rejections),
        "rejections": rejections,
        "seconds": seconds,
    }
