"""The embedded federated simulator: a transport that drives a strategy round by round.

``simulate(strategy="fedlog", dataset="digits", clients=20, partition="shards:2", rounds=30,
seed=0, out="runs/demo")`` loads the data, partitions it, and builds the strategy twice from
the run configuration: a server half and a client half that share no object (as a Flower
ServerApp and ClientApp would). Every client gets its own config and initial state
(``init_client``). Then per round: samples clients (all, or a seeded ``fraction``), encodes the
server's broadcast (``configure``) with `bayesfl.messages.encode` and decodes it on the
client side, runs the clients' ``fit`` through the `ClientExecutor`
behind the engine's channel interface (`InProcessChannel`) (batched over clients that
share a body spec, one by one otherwise), encodes every upload,
decodes and validates it on receipt against the round's schema (``validate_uploads``, one
verdict per upload) — an invalid upload is *rejected*, its reason logged, and the round goes
on with the others — aggregates, sends the evaluation broadcast (``configure_evaluation``),
lets every client evaluate itself into calibration accumulators and merges them (per client
and pooled), appends a line to ``metrics.jsonl`` and checkpoints atomically. After the last
round, strategies that personalise (FedBABU) do so once, and the final evaluation uses the
personalised states. With ``novel_fraction``, that share of the clients is held out of
training (never sampled, never fitted, not in the round metrics): after the last round they
personalise like the others (or, for strategies that do not personalise, evaluate the global
model) and their metrics go to ``summary["novel"]``.

The rounds are the engine's one round loop (`bayesfl.engine.rounds.RoundLoop`, the
Flower ServerApp's too) in its ``"inline"`` evaluation mode: each round is evaluated within
itself, and a new aggregate whose evaluation fails is reverted in its own round. It aggregates
whatever uploads were accepted (no ``min_replies``). This module supplies the loop's channel and
hooks: the broadcast hook, the in-process evaluation, the timings of a record, the progress
bar, the checkpoint with every client's state and the round callback.

Run directory (``out``): ``metrics.jsonl`` (one JSON object per round), ``summary.json``,
``manifest.json`` (config, seed, versions, git hash), ``partition.txt`` / ``partition.json``
(clients x classes counts), ``predictions.npz`` (final-round test probabilities, labels and
client ids, readable by ``bayesfl-calibrate``), ``checkpoint.safetensors`` and the plots
``accuracy.png`` and ``reliability.png``. The directory must be empty or absent, unless
``resume`` or ``force`` says what to do with it (`bayesfl.run_directory`). The manifest
and the summary record what the data were (`bayesfl.data.datasets.dataset_identity`:
``"custom"`` and a SHA-256 of the contents for ``data=``) and the torch thread count.

Randomness: every random draw of round ``r`` comes from generators derived from
``(seed, r, client)`` (client sampling, mini-batch order, noise), and the global torch RNG is
reseeded from ``(seed, r)`` at the start of each round; the checkpoint also stores the global
torch RNG state. Resuming (``resume=True``) restores the server state, every client's
state and the counters from the last complete round, so a resumed run writes the
same numbers as an uninterrupted one. The checkpoint also carries the configuration with the
data's identity (its fingerprint must match: a mismatch names the settings that differ) and
``metrics.jsonl`` up to its round, from which the file and the summary are rebuilt.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from bayesfl.calibrate import CalibrationOutcome
from bayesfl.config import (
    CONFIG_FIELDS,
    SimulationConfig,
    check_threads,
    resolve_device,
    torch_threads,
)
from bayesfl.data.datasets import Dataset
from bayesfl.engine.channel import Collected, Reply, Step
from bayesfl.engine.phases import InProcessPhases, Phase, Site
from bayesfl.engine.preflight import check_run_config
from bayesfl.engine.rounds import RoundTrace
from bayesfl.engine.run import FinalEvaluation, Run
from bayesfl.engine.setup import (  # noqa: F401 - public here too (tests, callers)
    RunSetup,
    client_seeds,
    novel_clients,
    round_half_up,
    run_identity,
    run_setup,
    sample_clients,
)
from bayesfl.engine.state import compact_client_states, restored_client_states
from bayesfl.engine.steps import (  # noqa: F401 - public here too (tests, callers)
    aggregate_or_keep,
    all_rejected_message,
    build_summary,
    cached_upload_problem,
    evaluate_or_revert,
    non_finite_problem,
    round_view,
    run_rejected_message,
    screen_uploads,
    server_state_problem,
    summary_extras,
)
from bayesfl.errors import (
    ConfigError,
    LocalTrainingWarning,
)
from bayesfl.evaluation import RoundEvaluation, merge_evaluations
from bayesfl.executor import ClientExecutor, SimulatedClient
from bayesfl.inputs import client_index, client_inputs
from bayesfl.messages import KeyRing, Message, decode, encode
from bayesfl.run_directory import (  # noqa: F401 - CHECKPOINT_NAME: public here too (tests)
    CHECKPOINT_NAME,
    prepare_run_directory,
)
from bayesfl.strategies import make_strategy
from bayesfl.strategies.base import (
    PREDICTIVE,
    ClientState,
    ServerState,
    Strategy,
)

UploadHook = Callable[[int, int, bytes], bytes]
"""``hook(round, client_id, encoded_upload) -> bytes actually delivered`` (tests, attacks)."""

BroadcastHook = Callable[[int, bytes], None]
"""``hook(round, encoded_broadcast)``: sees each round's broadcast as it leaves the server
(tests that replay the client half elsewhere, audits); it cannot change it."""

RoundCallback = Callable[[int, dict], None]
"""``callback(round, metrics_record)`` after each complete (checkpointed) round."""

@dataclass
class SimulationResult:
    """What [`simulate`][bayesfl.simulate.simulate] returns.

    ``summary``, the final figures (also ``summary.json``; the same for a run read back with
    `bayesfl.load_run`), has these keys. Accuracies are fractions in [0, 1]; ECE, MCE,
    Brier and NLL are of the headline predictive on the clients' test rows after the last round
    (personalised where the strategy personalises):

    - the run: ``strategy``, ``dataset``, ``partition``, ``clients``, ``rounds``, ``seed``,
      ``data_seed`` (only when given), ``body`` (its spec string), ``data`` (the data's
      identity: name, shapes, classes, SHA-256), ``threads`` (torch threads), ``personalized``
      (whether the clients personalised after training), ``seconds`` (wall time);
    - the figures: ``accuracy`` (mean over clients of each client's accuracy, the papers'
      number), ``accuracy_pooled`` (over all test rows), ``accuracy_client_min``, ``ece``,
      ``mce``, ``brier``, ``nll`` (pooled over all test rows), ``ece_client_mean``,
      ``nll_client_mean``, ``confidence`` (pooled mean top-class probability: above
      ``accuracy_pooled`` is over-confident), ``per_client`` (one dict per client:
      ``client_id``, ``count`` and its own figures), ``best_accuracy`` and ``best_round``
      (the best round's ``accuracy``);
    - ``map_plugin`` (posterior strategies only): the MAP plug-in's ``accuracy``,
      ``accuracy_pooled``, ``ece``, ``mce``, ``brier``, ``nll`` and ``confidence`` on the
      same rows, beside the posterior predictive;
    - communication, summed over the rounds: ``bytes_up``, ``bytes_down`` (the training
      broadcasts), ``bytes_down_evaluation`` (the evaluation broadcasts), ``floats_up``,
      ``floats_down``; ``rejected_uploads`` (a count) and ``rejections`` (round, client and
      reason of each);
    - the strategy's own final figures (``Strategy.server_metrics``, e.g. FedLog's
      ``feature_scale``);
    - when asked for: ``novel`` (``novel_fraction``: the held-out clients' ids and figures),
      ``calibration`` (``calibrate``: the temperature and the figures before and after),
      ``conformal`` (``conformal``: the conformal step's figures), ``shift_evaluation``
      (``shift``/``ood``: what the shift report holds and where).

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
        calibration: the final calibration step (``calibrate``), or None.
        novel: the ids of the novel clients (``novel_fraction``): never trained, personalised
            at the end, reported under ``summary["novel"]``.
        shift_report: the shift evaluation the run asked for (``shift``/``ood``:
            `bayesfl.shift_evaluation.ShiftReport`), or None.
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
    calibration: CalibrationOutcome | None = None
    novel: tuple[int, ...] = ()
    shift_report: Any = None

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
        and device of the client's data (`bayesfl.inputs.client_inputs`).

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
        return self.strategy.posterior(client.config, state, self.evaluation_broadcast)


def simulate(
    strategy: str = "fedlog",
    dataset: str | None = None,
    clients: int = 20,
    partition: str = "shards",
    rounds: int = 30,
    seed: int = 0,
    *,
    out: str | Path | None = None,
    resume: bool = False,
    force: bool = False,
    progress: bool = True,
    threads: int | None = None,
    upload_hook: UploadHook | None = None,
    round_callback: RoundCallback | None = None,
    broadcast_hook: BroadcastHook | None = None,
    data: Dataset | tuple[Any, Any] | None = None,
    shift: Any = None,
    ood: Any = None,
    **options: Any,
) -> SimulationResult:
    """Run a federated experiment (module docstring) and return its results.

    Args:
        strategy: the strategy's name (``bayesfl strategies`` lists them).
        clients: the number of clients.
        partition: how the data are split among them (``iid``, ``dirichlet:ALPHA``, ...).
        rounds: federated rounds.
        seed: the run's seed (initialisation, batch order, sampling; and the data's draws
            unless ``data_seed`` is given).
        dataset: the data set's name (default ``"digits"``); with ``data``, a label for those
            data (default ``"custom"``).
        out: run directory for metrics, summary, manifest, plots and checkpoints; None
            writes nothing (and cannot resume). It must be empty or absent unless ``resume``
            or ``force`` is given.
        resume: continue from ``out``'s checkpoint (from scratch if there is none yet).
        force: start again in a non-empty ``out``: the files a run writes there are deleted
            first (other files are kept).
        progress: show a tqdm progress bar over rounds.
        threads: torch intra-op threads during the run (restored afterwards); None takes
            `bayesfl.config.default_threads` (half the cores, 1 to 4).
        upload_hook: transforms each encoded upload before the server receives it.
        round_callback: called after each complete round with its metrics record.
        broadcast_hook: called with each round's encoded broadcast.
        data: a pre-loaded pooled data set, or your own arrays
            ``(x, y)`` (`bayesfl.data.Dataset.from_arrays`), instead of loading
            ``dataset`` by name; its
            identity (shapes and a SHA-256 of its contents) is recorded and fingerprinted, so
            its run resumes only with the same data.
        shift: after the run, evaluate every client on its shifted test rows
            (`bayesfl.evaluate_shift`'s ``shifts``: ``["rotate:15,30"]``, ...); the report is
            ``result.shift_report`` and, with ``out``, ``out/shift`` (the files ``bayesfl
            evaluate`` writes, and the clients' states: `bayesfl.shift_protocol`). Checked
            before the run trains.
        ood: out-of-distribution sets scored there too (``"unseen-labels"``,
            ``"novel-clients"``).
        **options: the other `SimulationConfig` fields (body: a spec string or
            your own zero-argument factory of a ``torch.nn.Module``, `bayesfl.bodies`;
            feature_dim,
            local_epochs, lr, batch_size, fraction, test_fraction, batched, n_bins, device,
            novel_fraction, data_seed, strategy_options, dataset_options). ``data_seed``
            seeds the data alone (loading, partition, test split, calibrate hold-out, novel
            clients); None (default) takes ``seed``.

    Returns:
        The run's `SimulationResult`: ``summary`` (the final figures, keys listed there),
        ``metrics`` (one dict per round), ``posterior(k)`` and ``predict_proba(k, x)``
        (client k's predictive after the run), ``run_dir``. With ``out``, the same run is
        read back later by [`bayesfl.load_run`][bayesfl.load_run].

    Raises:
        ConfigError: unknown names or options, values of the wrong type or out of range
            (`bayesfl.config`), an unavailable device, a non-empty ``out`` without
            ``resume`` or ``force``.
        DataError: a partition that leaves a client empty, more clients than samples.
        CheckpointError: ``resume`` with a corrupt or foreign checkpoint.
    """
    unknown = sorted(set(options) - set(CONFIG_FIELDS))
    if unknown:
        raise ConfigError(f"unknown option(s) {unknown}; valid: {', '.join(CONFIG_FIELDS)}")
    for name, flag in (("resume", resume), ("force", force), ("progress", progress)):
        if not isinstance(flag, bool):
            raise ConfigError(f"{name} must be True or False, got {flag!r}")
    data, options = _user_data_and_body(data, options)
    if dataset is None:
        dataset = "digits" if data is None else "custom"
    config = SimulationConfig(strategy=strategy, dataset=dataset, clients=clients,
                              partition=partition, rounds=rounds, seed=seed, **options)
    check_run_config(config)  # the strategy, its option names, calibrate: before any data
    threads = check_threads(threads)
    resolve_device(config.device)  # an absent GPU is refused before anything is written
    if resume and out is None:
        raise ConfigError("resume=True needs the run directory `out` of the run to continue")
    run_dir = None if out is None else Path(out)
    if run_dir is not None:  # before any data is loaded: a refusal costs nothing
        prepare_run_directory(run_dir, resume=resume, force=force)
    with torch_threads(threads):
        run = _Run(config, run_dir, data=data, resume=resume, threads=threads, shift=shift,
                   ood=ood)  # a shift or ood the run cannot have is refused here
        run.broadcast_hook, run.round_callback = broadcast_hook, round_callback
        run.progress, run.channel.upload_hook = progress, upload_hook
        summary = run.execute()
        result = SimulationResult(
            config, summary, run.metrics_log.records, run_dir, run.state, run.clients,
            run.client_half, run.broadcast, run.personalized, run.calibration, tuple(run.novel),
            None if run.shift_outcome is None else run.shift_outcome.report)
    if run_dir is not None:  # a directory with it holds a finished run (load_run)
        from bayesfl.run_result import save_run_result

        save_run_result(run_dir, result)
    return result


def _user_data_and_body(data: Any, options: dict[str, Any]) -> tuple[Dataset | None, dict]:
    """``data=(x, y)`` as a [`Dataset`][bayesfl.Dataset]; a callable ``body`` (or a list with some)
    registered as a body spec under its qualified name (`bayesfl.bodies.body_spec`)."""
    from bayesfl.bodies import body_spec
    from bayesfl.data.datasets import as_dataset

    body = options.get("body")
    if callable(body) or isinstance(body, list | tuple):
        options = {**options, "body": body_spec(body)}
    return (None if data is None else as_dataset(data)), options


class InProcessChannel:
    """The simulator's channel (`bayesfl.engine.channel.Channel`): the clients' halves
    run in this process, batched over same-architecture clients by the executor.

    A fit step decodes the broadcast the server encoded (what the clients see is what crossed
    the wire), runs every client's ``fit`` with its generator of the round, and encodes each
    upload with the client's key; ``upload_hook`` (tests, attacks) may change the bytes on
    their way. A client whose training diverged sends nothing: its round is undone and its
    reason goes to ``Collected.unreadable``.
    """

    def __init__(self, run: _Run, keys: KeyRing | None) -> None:
        self.run = run
        self.keys = keys
        self.server_key = None if keys is None else keys.server_key
        self.upload_hook: UploadHook | None = None
        self.divergence_warned = False
        self._collected: Collected | None = None
        self._phases: InProcessPhases | None = None
        self.final_broadcast: Message | None = None
        """What the final phases predict with (the engine sets it after the last round)."""
        self.seconds_encode = 0.0
        """Wall seconds the last fit step spent encoding uploads (part of the local work)."""

    def client_key(self, client_id: int) -> bytes | None:
        """Client ``client_id``'s HMAC key, or None when messages are not authenticated."""
        return None if self.keys is None else self.keys.client_key(client_id)

    def warn_divergence(self, r: int, client_id: int, reason: str) -> None:
        """Warn, once per run, that a client's local training stopped on a non-finite loss."""
        if self.divergence_warned:
            return
        self.divergence_warned = True
        warnings.warn(
            f"round {r}, client {client_id}: {reason}. Its upload was not sent and it keeps "
            "its state from before the round; the run goes on. Every such client is listed "
            "under 'rejections' in metrics.jsonl (this warning is given once per run).",
            LocalTrainingWarning, stacklevel=2)

    def send(self, round: int, client_ids: Sequence[int], messages: Mapping[int, Step]) -> None:
        run, out = self.run, Collected()
        self.seconds_encode = 0.0
        fitting = [cid for cid in client_ids if messages[cid].fit is not None]
        if fitting:
            received = decode(messages[fitting[0]].fit, key=self.server_key)
            fitted = run.executor.fit([run.clients[i] for i in fitting], received,
                                      seed=run.config.seed, round=round)
            for cid in fitting:
                stop = fitted.diverged.get(cid)
                if stop is not None:  # its round undone by the client step: it sends nothing
                    out.unreadable[cid] = f"upload not sent: {stop}"
                    self.warn_divergence(round, cid, stop)
                    continue
                upload = fitted.uploads[cid]
                t = time.perf_counter()
                data = encode(upload, key=self.client_key(cid))
                self.seconds_encode += time.perf_counter() - t
                if self.upload_hook is not None:
                    data = self.upload_hook(round, cid, data)
                out.replies[cid] = Reply(upload=data, elements=upload.num_elements)
        self._collected = out

    def collect(self, deadline: float) -> Collected:
        collected, self._collected = self._collected or Collected(), None
        return collected

    def close(self) -> None:
        """Nothing to release: the clients live in this process."""

    # ---- the final phases (bayesfl.engine.phases) -----------------------------------------
    @property
    def num_test(self) -> dict[int, int]:
        """Client id -> its test rows."""
        return {c.client_id: c.data.num_test for c in self.run.clients}

    def ask(self, phase: Phase, step: int, down: bytes, client_ids: Sequence[int]
            ) -> dict[int, Any]:
        """Every client's answer to a final phase's request, computed here from its site: its
        final state (personalised where the strategy personalises) and the final evaluation
        broadcast the engine set (`final_broadcast`)."""
        if self._phases is None:
            run = self.run
            self._phases = InProcessPhases({c.client_id: Site(
                c.client_id, run.executor.strategy, c.config,  # the client half's view
                run.personalized.get(c.client_id, c.state), self.final_broadcast, c.data,
                run.setup.held_out.get(c.client_id), seed=run.config.seed,
                n_bins=run.config.n_bins, device=run.device, conformal=run.setup.conformal,
                clients=run.setup.client_data, novel=tuple(run.novel),
                server_key=self.server_key, client_key=self.client_key(c.client_id))
                for c in run.clients}, self.keys)
        return self._phases.ask(phase, step, down, client_ids)


class _Run(Run):
    """The simulator's side of a run (`bayesfl.engine.run.Run`): the clients in this
    process, their states in the checkpoint, the progress bars; the final phases ask them
    through `InProcessChannel.ask`."""

    def __init__(self, config: SimulationConfig, run_dir: Path | None, data: Dataset | None,
                 resume: bool = False, threads: int | None = None, shift: Any = None,
                 ood: Any = None):
        super().__init__(config, run_dir, data, resume=resume, shift=shift, ood=ood,
                         threads=torch.get_num_threads() if threads is None else threads)
        context = self.setup.context
        # the client half is built apart from the same run configuration, as a Flower
        # ClientApp would be: nothing set on the server half is seen by it
        self.client_half = make_strategy(config.strategy, context, **config.strategy_options)
        self.clients = [SimulatedClient(  # the data on the run's device
            context.client_config(d.client_id), replace(d, **{
                k: getattr(d, k).to(self.device) for k in ("train_x", "train_y", "test_x",
                                                            "test_y")}),
            self.client_half.init_client(context.client_config(d.client_id)))
            for d in self.setup.client_data]
        self.executor = ClientExecutor(self.client_half, batched=config.batched)
        self.training_clients = [self.clients[c] for c in self.training]
        # fresh per-run keys: they authenticate this process's messages, nothing persists
        keys = KeyRing.generate() if config.authenticate else None
        self.keys, self.server_key = keys, None if keys is None else keys.server_key
        channel = InProcessChannel(self, keys)
        # each round evaluated within it ("inline": a new aggregate whose evaluation fails is
        # reverted in its own round), aggregating whatever uploads were accepted
        self.start_loop(channel, evaluation="inline", evaluate_inline=self.evaluate_inline,
                        min_replies=None, server_key=self.server_key,
                        client_key=channel.client_key)
        self.broadcast_hook: BroadcastHook | None = None
        self.progress = True
        self.personalized: dict[int, ClientState] = {}

    # ---- the run's hooks (bayesfl.engine.run.Run) -----------------------------------------
    def restore_clients(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        states = restored_client_states(tensors, meta, self.client_states(), self.device)
        for c in self.clients:
            c.state = states[c.client_id]

    def rounds_starting(self, first: int) -> None:
        config = self.config
        # the bar counts every round of the run: after a resume it starts at the rounds done
        self.bar = tqdm(total=config.rounds + 1 - self.first_round,
                        initial=first - self.first_round, disable=not self.progress,
                        unit="round", desc=f"{config.strategy} on {config.dataset}", leave=False)
        description = self.server.describe()  # e.g. a FedPart schedule
        if description and self.progress and first == self.first_round:
            tqdm.write(description)
        self.last_eval: RoundEvaluation | None = None

    def rounds_ended(self) -> None:
        self.bar.close()

    def final_evaluation(self, last_round: int) -> FinalEvaluation:
        config, last_eval = self.config, self.last_eval
        self.broadcast = broadcast = decode(encode(
            self.server.configure_evaluation(self.state, last_round), key=self.server_key),
            key=self.server_key)
        personalized: dict[int, ClientState] = {}
        with torch.random.fork_rng(devices=self.rng_devices()):
            if self.client_half.personalizes:
                # personalisation can take as long as the rounds (FedSI refits every
                # client's Laplace): a bar of its own, one step per client
                # (mininterval 0: every client's step is shown, they are seconds apart)
                with tqdm(total=len(self.clients), disable=not self.progress, unit="client",
                          desc=f"{config.strategy}: personalising", leave=False,
                          mininterval=0) as bar:
                    personalized = self.executor.personalize(
                        self.clients, broadcast, seed=config.seed, round=last_round,
                        on_client=lambda _: bar.update(1))
                last_eval = None
            if last_eval is None:  # personalised, or resumed a finished run: evaluate once
                last_eval = merge_evaluations(self.executor.evaluate(
                    self.training_clients, broadcast, n_bins=config.n_bins, keep_probs=True,
                    states=personalized or None))
            novel_eval = None
            if self.novel:  # never trained: personalised above (if the strategy does) or not
                novel_eval = merge_evaluations(self.executor.evaluate(
                    [self.clients[i] for i in self.novel], broadcast, n_bins=config.n_bins,
                    keep_probs=False, states=personalized or None))
        self.personalized = personalized
        return FinalEvaluation(last_eval, bool(personalized), novel_eval, broadcast)

    # ---- the round loop's hooks (bayesfl.engine.rounds.RoundHooks) ----------------------
    def round_started(self, round: int) -> list[dict[str, Any]]:
        return []

    def reachable(self, client_ids: Sequence[int]) -> list[int]:
        return list(client_ids)  # every client lives in this process

    def broadcast_encoded(self, round: int, data: bytes) -> None:
        if self.broadcast_hook is not None:
            self.broadcast_hook(round, data)

    def evaluate_inline(self, r: int, state: ServerState) -> tuple[int, RoundEvaluation]:
        """Every training client's evaluation of server state ``state`` after round ``r``:
        the bytes of the evaluation broadcasts sent and the merged evaluation."""
        eval_bytes = encode(self.server.configure_evaluation(state, r), key=self.server_key)
        self.last_eval = merge_evaluations(self.executor.evaluate(
            self.training_clients, decode(eval_bytes, key=self.server_key),
            n_bins=self.config.n_bins, keep_probs=r == self.config.rounds))
        return len(eval_bytes) * len(self.clients), self.last_eval

    def record_extras(self, record: dict[str, Any], trace: RoundTrace) -> None:
        record.update({
            "seconds_local_updates": trace.seconds_exchange,
            # CPU time of this process (all its threads): the compute itself, unlike the wall
            # time, does not grow when other processes share the machine
            "seconds_local_updates_cpu": trace.seconds_exchange_cpu,
            "seconds_evaluation": trace.seconds_evaluation,
            # the split of the server's side: the uploads' encoding (inside the local
            # updates: each client encodes its own), their decoding and validation on
            # receipt, and the aggregation
            "seconds_upload_encoding": self.channel.seconds_encode,
            "seconds_receipt": trace.seconds_receipt,
            "seconds_aggregation": trace.seconds_aggregation,
        })

    def round_recorded(self, record: dict[str, Any]) -> None:
        self.bar.update(1)
        self.bar.set_postfix(acc=f"{record['accuracy']:.3f}", ece=f"{record['ece']:.3f}")
        # restack the clients' states when the round stacks their row views keep alive
        # outgrow them (a fraction of the clients trains each round)
        states = compact_client_states(self.client_states())
        for c in self.clients:
            c.state = states[c.client_id]

    def client_states(self) -> dict[int, ClientState]:
        return {c.client_id: c.state for c in self.clients}
