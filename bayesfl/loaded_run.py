"""A finished run, loaded back from its run directory: [`load_run`][bayesfl.loaded_run.load_run].

``simulate(..., out=DIR)`` ends by writing `RESULT_NAME`
(``result.safetensors``, `bayesfl.run_result`) beside ``summary.json``, ``metrics.jsonl``
and ``partition.json``. ``load_run(DIR)`` reads them back, re-runs nothing, and returns a
[`LoadedRun`][bayesfl.loaded_run.LoadedRun]: a `SimulationResult` (what ``simulate`` returns,
so ``result.posterior(k)``, ``result.predict_proba(k, x)``, ``result.summary`` and
``result.metrics`` work alike) that also carries the partition and the manifest.

The strategy is rebuilt from the configuration (``make_strategy``), every client state is
checked against the layout of a fresh client of its body (names, shapes, dtypes), and the
posterior and predictive are the strategy's own, so a loaded run predicts exactly as the run
did at its end. A body given as a callable (``simulate(body=make_body)``) is recorded by its
qualified name only — a callable cannot be serialised: in a new process it must be importable
under that name (a module-level function or class) or be registered again
(``bayesfl.register_body(name, factory)``) before ``load_run``, else the error says so.

What a run directory does not hold: the data (a loaded run's ``clients[k].data`` has no samples,
only the input shape; ``partition`` has the counts and sizes) and the ``calibrate`` step's
fitted temperature (its figures are in ``summary["calibration"]``; ``calibration`` is None).

A **Flower** run directory cannot be loaded: its clients' states stayed at their sites and the
server never held them (`load_run` says so). Evaluate such a run off distribution while
it runs, with the run keys ``shift``/``ood`` (`bayesfl.shift_protocol`: every site scores
its own state and sends mergeable states only); its report is then in ``RUN_DIR/shift``,
returned by `bayesfl.stored_shift_report` and shown by ``bayesfl evaluate RUN_DIR``. A
simulator run directory loads, and `bayesfl.evaluate_shift` evaluates it on any shift.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bayesfl.config import SimulationConfig
from bayesfl.data.clients import ClientData
from bayesfl.errors import BayesFLError, CheckpointError, ConfigError
from bayesfl.executor import SimulatedClient
from bayesfl.messages import decode
from bayesfl.run_directory import CHECKPOINT_NAME, METRICS_NAME, RESULT_NAME, parse_metrics
from bayesfl.run_result import (
    BROADCAST_TENSOR,
    header_metadata,
    read_run_result,
    result_client_states,
)
from bayesfl.simulate import SimulationResult
from bayesfl.strategies import make_strategy
from bayesfl.strategies.base import ClientConfig, StrategyContext
from bayesfl.training import LocalTraining


@dataclass
class LoadedRun(SimulationResult):
    """A finished run read back from its directory ([`load_run`][bayesfl.loaded_run.load_run]); a
    [`SimulationResult`][bayesfl.simulate.SimulationResult] with two more attributes.

    Attributes (beyond [`SimulationResult`][bayesfl.simulate.SimulationResult]'s):
        partition: ``partition.json``: ``scheme``, ``counts`` (clients x classes),
            ``train_sizes``, ``test_sizes``, ``bodies`` (per client), ``novel``.
        manifest: ``manifest.json``: configuration, seed, package versions, git commit.

    Differences from the object ``simulate`` returned: ``clients[k].data`` holds no samples
    (a run directory does not keep the data; its tensors have the input shape and 0 rows),
    ``clients[k].state`` is the state predictions use (personalised where the strategy
    personalises, also listed in ``personalized``), and ``calibration`` is None (the fitted
    temperature is not kept; its figures are in ``summary["calibration"]``).
    """

    partition: dict[str, Any] = field(default_factory=dict)
    manifest: dict[str, Any] = field(default_factory=dict)


def load_run(run_dir: str | Path, *, device: str = "cpu") -> LoadedRun:
    """The finished run in ``run_dir`` (written by ``simulate(..., out=run_dir)``), without
    re-running anything.

    Args:
        run_dir: the run directory.
        device: where the clients' networks and states are put (``"cpu"``, ``"cuda"``, ...).

    Returns:
        A `LoadedRun`: ``summary`` (``summary.json``), ``metrics`` (``metrics.jsonl``,
        one dict per round), ``partition``, ``manifest``, ``config``; ``posterior(k)``
        (posterior strategies: ``.sample(n)`` draws head parameters, ``.predict_proba(x)``
        takes client k's inputs) and ``predict_proba(k, x)`` (the strategy's headline
        predictive), exactly as the run had them at its end.

    A Flower run directory is refused (its clients' states stayed at their sites): its shift
    report, if the run was started with the run keys ``shift``/``ood``, is
    [`bayesfl.stored_shift_report`][bayesfl.stored_shift_report] (``bayesfl evaluate RUN_DIR``).

    Raises:
        CheckpointError: no finished run there (a missing directory, a run still going or
            killed before its end, a run continued with other settings and unfinished, a
            Flower run), a corrupt file, or another format version; the message says what
            to do.
        ConfigError: a body factory the run used that cannot be found in this process
            (register it with `bayesfl.register_body`), an unavailable ``device``.
    """
    from bayesfl.config import resolve_device

    root = Path(run_dir)
    device_ = resolve_device(device)
    if not root.is_dir():
        what = "does not exist" if not root.exists() else "is not a directory"
        raise CheckpointError(f"run directory {root} {what}; pass the directory a run wrote "
                              "with simulate(..., out=DIR) or bayesfl run --out DIR")
    path = root / RESULT_NAME
    if not path.is_file():
        raise CheckpointError(_unfinished(root))
    tensors, meta = read_run_result(path)
    identity, context_meta = meta["identity"], meta["context"]
    _check_not_continued(root, meta["fingerprint"])
    summary = _read_json(root / "summary.json", root)
    partition = _read_json(root / "partition.json", root)
    manifest = _read_json(root / "manifest.json", root)
    try:
        config_fields = {k: v for k, v in identity.items() if k != "data"}
        config = SimulationConfig(**config_fields)
        if summary.get("data") != identity.get("data"):
            raise ValueError("summary.json describes other data than result.safetensors")
        first = int(meta["first_round"])
        metrics = parse_metrics((root / METRICS_NAME).read_bytes(),
                                list(range(first, config.rounds + 1)))
    except (OSError, TypeError, ValueError, KeyError, BayesFLError) as err:
        if isinstance(err, ConfigError) and "body" in str(err):
            raise
        raise CheckpointError(f"run directory {root} does not hold one consistent finished "
                              f"run ({_one_line(err)}); run it again with --force "
                              "(force=True)") from err
    context = StrategyContext(
        num_classes=int(context_meta["num_classes"]),
        feature_dim=int(context_meta["feature_dim"]),
        training=LocalTraining(**{k: tuple(v) if isinstance(v, list) else v
                                  for k, v in context_meta["training"].items()}),
        rounds=int(context_meta["rounds"]), device=device_, seed=int(context_meta["seed"]),
        input_shape=tuple(int(s) for s in context_meta["input_shape"]),
        bodies=tuple(context_meta["bodies"]), clients=int(context_meta["clients"]))
    strategy = make_strategy(config.strategy, context, **config.strategy_options)
    personal = {int(k) for k in meta.get("personalized", [])}
    configs = [_client_config(entry, path) for entry in meta["clients"]]
    try:
        saved = result_client_states(tensors, meta, [c.client_id for c in configs])
    except ValueError as err:
        raise CheckpointError(f"{path} is corrupt ({_one_line(err)}); run it again with "
                              "--force (force=True)") from err
    clients = [_client(strategy, context, config, saved[config.client_id], device_, path,
                       personalized=config.client_id in personal)
               for config in configs]
    for spec in dict.fromkeys(c.config.body for c in clients):
        strategy.template(spec)  # built now: the loaded run needs no body factory later
    state = {k[len("server/"):]: v.to(device_) for k, v in tensors.items()
             if k.startswith("server/")}
    try:
        broadcast = decode(tensors[BROADCAST_TENSOR].numpy().tobytes())
    except (KeyError, BayesFLError) as err:
        raise CheckpointError(f"{path} is corrupt ({_one_line(err)}); run it again with "
                              "--force (force=True)") from err
    personalized = {k: clients[k].state for k in sorted(personal)}
    return LoadedRun(config, summary, metrics, root, state, clients, strategy, broadcast,
                     personalized, None, tuple(int(k) for k in meta.get("novel", [])),
                     partition=partition, manifest=manifest)


def _unfinished(root: Path) -> str:
    checkpoint = root / CHECKPOINT_NAME
    if checkpoint.is_file():
        where = _checkpoint_round(checkpoint)
        return (f"the run in {root} has not finished{where}: continue it with "
                "simulate(..., out=DIR, resume=True) or bayesfl run --resume, then load it")
    if run_transport(root) == "flower":
        return (f"{root} holds a Flower run: its clients' states stay at their sites (the "
                "server never holds them), so there is nothing to load; its shift report, "
                "if it ran with the run keys shift/ood, is bayesfl.stored_shift_report(DIR) "
                "(bayesfl evaluate DIR); else run the experiment with simulate(..., out=DIR) "
                "to load it, or read summary.json and metrics.jsonl there")
    if (root / "summary.json").is_file():
        return (f"{root} holds a run written before runs saved {RESULT_NAME} (or the file was "
                "deleted): run it again with --force (force=True) to load it")
    return (f"{root} holds no finished run (no {RESULT_NAME}); pass the directory a run wrote "
            "with simulate(..., out=DIR) or bayesfl run --out DIR")


def run_transport(root: str | Path) -> str | None:
    """The ``transport`` a run directory's summary or manifest names (``"flower"``), or None
    (the simulator's, or no run there)."""
    root = Path(root)
    for name in ("summary.json", "manifest.json"):
        try:
            found = json.loads((root / name).read_text()).get("transport")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(found, str):
            return found
    return None


def _checkpoint_round(checkpoint: Path) -> str:
    """`` (checkpoint at round r of R)`` from a checkpoint's unverified meta, or ``""``."""
    try:
        meta = json.loads(header_metadata(checkpoint).get("bayesfl.meta", "{}"))
        return f" (its checkpoint is at round {int(meta['round'])} of " \
               f"{int(meta['config']['rounds'])})"
    except Exception:  # only a hint in a message: an unreadable checkpoint gives none
        return ""


def _check_not_continued(root: Path, fingerprint: str) -> None:
    """Refuse a directory whose checkpoint belongs to a later run with other settings (a
    finished run resumed with more rounds, then stopped): its result file is stale."""
    checkpoint = root / CHECKPOINT_NAME
    if not checkpoint.is_file():
        return
    try:
        found = header_metadata(checkpoint).get("bayesfl.fingerprint")
    except Exception:  # a damaged checkpoint does not make the finished result unreadable
        return
    if found is not None and found != fingerprint:
        raise CheckpointError(_unfinished(root).replace(
            "has not finished", "was continued with other settings and has not finished"))


def _client_config(entry: Any, path: Path) -> ClientConfig:
    """The config of a client ``entry`` of the result's meta."""
    try:
        return ClientConfig(int(entry["client_id"]), str(entry["body"]),
                            int(entry["init_seed"]))
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{path} is corrupt (client entry {entry!r}); run it again with "
                              "--force") from err


def _client(strategy: Any, context: StrategyContext, config: ClientConfig,
            state: dict[str, torch.Tensor], device: torch.device, path: Path,
            personalized: bool) -> SimulatedClient:
    """The client of ``config`` with its saved ``state`` (checked against a fresh client's
    layout: the same names, shapes and dtypes, plus any entries personalisation added) and an
    empty data record of the run's input shape."""
    fresh = strategy.init_client(config)  # builds the body: a missing factory fails here
    layout = {k: (tuple(v.shape), v.dtype) for k, v in fresh.items()}
    saved = {k: (tuple(v.shape), v.dtype) for k, v in state.items()}
    if personalized:  # personalisation may add entries (e.g. FedBABU's flag), never change one
        saved = {k: v for k, v in saved.items() if k in layout}
    if saved != layout:
        raise CheckpointError(
            f"{path}: client {config.client_id}'s saved state does not fit a client of body "
            f"{config.body!r} (names, shapes or dtypes differ); if the body is your own "
            "factory, register the one the run used (bayesfl.register_body), else run it again "
            "with --force")
    empty_x = torch.empty((0, *context.input_shape), dtype=torch.float32, device=device)
    empty_y = torch.empty((0,), dtype=torch.int64, device=device)
    data = ClientData(config.client_id, empty_x, empty_y, empty_x, empty_y)
    return SimulatedClient(config, data, {k: v.to(device) for k, v in state.items()})


def _read_json(path: Path, root: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as err:
        raise CheckpointError(f"{path.name} is missing from {root}: the run did not finish "
                              "writing its files; run it again with --force") from err
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path} is damaged ({_one_line(err)}); run it again with "
                              "--force") from err


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= 300 else text[:297] + "..."




__all__ = ["LoadedRun", "load_run", "run_transport"]
