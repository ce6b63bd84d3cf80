"""The bayesfl ClientApp: a strategy's client half on one SuperNode's own data.

Each SuperNode is one client: ``node_config`` gives its ``partition-id`` (the client id) and
``num-partitions`` (which must equal the run's ``clients``). The node loads the data set named
in the run config and keeps its own partition (`bayesfl.engine.setup.run_setup`, the
same clients the simulator builds for the same config and seed), or, with the run config's
``data-loader = "package.module:function"``, calls that function for its own data
(`site_data`; nothing is sent). Which code a node runs for its data is the site's
decision, not the run submitter's: it calls a run's loader only when its own node config lists
it (``data-loaders``, `allowed_loader`), and refuses the run otherwise. Handlers:

* ``query.info``: who the node is (client id, test-set size, the run's fingerprint, so the
  server can refuse a node set up with other data or settings), or why the node refuses the run
  (``refused``: a data loader its node config does not allow);
* ``train.round``: one message per round (`bayesfl.flower.protocol`): evaluate the
  previous round's state with its evaluation broadcast (accumulator states only: no prediction
  leaves the node), then fit on the round's broadcast; the last message of a run evaluates
  and, for strategies that do, personalises and evaluates the personalised state. Each is the
  simulator's client step (`bayesfl.client.step`): a client whose training diverges
  keeps its state from before the round and replies ``diverged`` (why) instead of an upload;
* ``query.calibrate``: the temperature-scaling step (`bayesfl.calibrate`) on the node's
  held-out data, then its temperature-scaled evaluation;
* ``query.shift``: the shift evaluation (`bayesfl.shift_protocol`) of the node's final
  state on its own test rows: mergeable states only leave the node.

The client state lives in ``context.state`` between rounds (safetensors bytes of the state's
named tensors in a ConfigRecord; no pickle). A handler that fails raises: Flower turns that
into an error reply, which the server logs and survives; an evaluation that fails is reported
in the reply (``evaluation-error``) and the fit goes on.

Flower starts a fresh process per message, so everything this module imports is paid per
message: it imports Flower's app types only, and bayesfl, torch and the strategy inside the
handlers (`import_step_modules`; the top-level ``bayesfl`` package is lazy, so nothing
else is loaded). A reply's ``timing`` says where the handler's time went: ``import`` (those
modules), ``setup`` (data set, partition and strategy), ``evaluate``, ``fit``, ``save`` (the
client state into ``context.state`` and the node's ``state-dir``), ``encode``, ``handler`` (all of
it), ``cpu`` (the process's CPU seconds at the handler's end, Flower's start included), and the
message's timeline on the node's clock (seconds since the epoch, `message_timeline`):
``at.delivered`` (the SuperLink handed the message to the SuperNode's pull), ``at.process``
(this ``flwr-clientapp`` process started), ``at.loaded`` (this module imported: Flower's command,
the task's pull and the FAB's install are done), ``at.start`` and ``at.end`` (the handler).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flwr.app import ConfigRecord, Context, Message
from flwr.clientapp import ClientApp

if TYPE_CHECKING:
    import torch

    from bayesfl.config import SimulationConfig
    from bayesfl.data.clients import ClientData
    from bayesfl.flower.protocol import FlowerOptions
    from bayesfl.strategies.base import ClientConfig, ClientState, ClientStrategy

app = ClientApp()

LOADED_AT = time.time()
"""When this module was imported (seconds since the epoch): in a ``flwr-clientapp`` process,
after Flower's command, the task's pull and the FAB's install."""

STATE_RECORD = "bayesfl-state"
"""Key of the ConfigRecord in ``context.state`` that holds the client state."""


@dataclass
class Node:
    """One SuperNode's side of a run: its config, data and the strategy's client half.

    Attributes:
        held_out: the node's held-out calibration data (``calibrate``), or None.
        clients: every client's data of the run's data set (the rows the shift step scores
            as out-of-distribution: `bayesfl.shift_protocol`), or None on a node that
            loads its own data (``data-loader``).
        novel: the run's novel clients.
    """

    config: SimulationConfig
    options: FlowerOptions
    strategy: ClientStrategy
    client: ClientConfig
    data: ClientData
    fingerprint: str
    held_out: Any = None
    state_dir: Path | None = None
    clients: Any = None
    novel: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        from bayesfl.strategies.halves import client_half

        # the node holds the strategy's client half only (bayesfl.strategies.halves)
        self.strategy = client_half(self.strategy)

    @property
    def client_id(self) -> int:
        return self.client.client_id


def node_of(context: Context) -> Node:
    """This node's side of the run (memoised per run config and partition).

    With ``state-dir`` in its node config, the node also keeps its trained state after every
    fit on its own disk (`save_round_state`), so that a resumed run (a new Flower run,
    whose ``context.state`` starts empty) goes on from the state the server's checkpoint
    belongs to rather than from the initial one.

    Raises:
        ConfigError: a node_config without an integer ``partition-id`` in ``[0, clients)``,
            or a ``num-partitions`` that differs from the run's ``clients``.
        LoaderRefused: the run config names a ``data-loader`` this node's config does not
            allow (`allowed_loader`).
    """
    from bayesfl.errors import ConfigError

    allowed_loader(context.run_config, context.node_config)
    run = tuple(sorted((str(k), v) for k, v in context.run_config.items()))
    node = dict(context.node_config)
    pid, parts = node.get("partition-id"), node.get("num-partitions")
    for name, value in (("partition-id", pid), ("num-partitions", parts)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"node_config {name} must be an integer, got {value!r} "
                              "(flower-supernode --node-config 'partition-id=0 "
                              "num-partitions=N')")
    node_ = _node(run, pid, parts)
    state_dir = node.get("state-dir")
    if isinstance(state_dir, str) and state_dir:
        # one folder per run identity: a node serving several runs keeps them apart
        node_ = replace(node_, state_dir=Path(state_dir) / node_.fingerprint[:16])
    return node_


NODE_LOADERS = "data-loaders"
"""Node-config key of the data loaders a SuperNode allows runs to call on it: one or more
``package.module:function`` separated by spaces or commas (``flower-supernode --node-config
'partition-id=0 num-partitions=3 data-loaders="site.data:load"'``). Absent or empty: the node
runs no loader, only the run's named data set."""


def allowed_loader(run_config: Mapping[str, Any], node_config: Mapping[str, Any]) -> str | None:
    """The run config's ``data-loader`` if this node allows it, None when the run names none.

    A loader is code the node imports and calls with its own data: whoever submits a run must
    not choose it. The node's operator lists the loaders it allows in its node config
    (`NODE_LOADERS`); a run naming any other one is refused before anything is imported.

    Raises:
        LoaderRefused: the run names a loader the node config does not list (the message says
            which, what the node allows and how to allow it).
    """
    from bayesfl.errors import LoaderRefused

    loader = run_config.get("data-loader", run_config.get("data_loader"))
    if loader is None or loader == "":
        return None
    allowed = node_config.get(NODE_LOADERS, "")
    names = allowed.replace(",", " ").split() if isinstance(allowed, str) else []
    if not isinstance(loader, str) or loader.strip() not in names:
        listed = ", ".join(names) if names else "none"
        raise LoaderRefused(
            f"this node does not allow the data loader {loader!r} the run config names "
            f"(its node config allows: {listed}); a node runs only the loaders its operator "
            f"lists: flower-supernode --node-config '... {NODE_LOADERS}=\"{loader}\"'")
    return loader.strip()


@lru_cache(maxsize=4)
def _node(run: tuple[tuple[str, Any], ...], partition_id: int, num_partitions: int) -> Node:
    from bayesfl.checkpoint import config_fingerprint
    from bayesfl.config import resolve_device
    from bayesfl.data.datasets import dataset_identity, load_dataset
    from bayesfl.engine.setup import novel_clients, run_identity, run_setup
    from bayesfl.errors import ConfigError
    from bayesfl.flower.protocol import parse_run_config
    from bayesfl.strategies import make_strategy

    config, options = parse_run_config(dict(run))
    if num_partitions != config.clients:
        raise ConfigError(f"this node has num-partitions={num_partitions} but the run has "
                          f"clients={config.clients}")
    if not 0 <= partition_id < config.clients:
        raise ConfigError(f"partition-id {partition_id} is outside [0, {config.clients})")
    device = resolve_device(config.device)
    if options.data_loader is not None:
        return _site_node(config, options, partition_id, device)
    dataset = load_dataset(config.dataset, seed=config.data_rng_seed, **config.dataset_options)
    setup = run_setup(config, dataset, device)
    strategy = make_strategy(config.strategy, setup.context, **config.strategy_options)
    fingerprint = config_fingerprint(run_identity(config, dataset_identity(dataset)))
    return Node(config, options, strategy, setup.context.client_config(partition_id),
                setup.client_data[partition_id], fingerprint,
                setup.held_out.get(partition_id), clients=setup.client_data,
                novel=tuple(novel_clients(config.clients, config.novel_fraction,
                                          config.data_rng_seed)))


def site_data(loader: str, partition_id: int, node_config: dict[str, Any] | None = None):
    """The data a per-site loader returns for this node, as a bayesfl ``Dataset``.

    ``loader`` names ``package.module:function`` (`bayesfl.user_code.import_object`); it is
    called as ``function(partition_id)`` and returns ``(x, y)`` (arrays or tensors: x (n, ...)
    real, y (n,) integer labels in ``[0, C)``) or a [`bayesfl.data.Dataset`][bayesfl.data.Dataset].

    Raises:
        ConfigError: the loader cannot be imported or is not callable.
        DataError: what it returned is not ``(x, y)`` or a Dataset.
    """
    import numpy as np
    import torch

    from bayesfl.data.datasets import Dataset
    from bayesfl.errors import DataError
    from bayesfl.user_code import import_object

    function = import_object(loader, what="data-loader")
    out = function(partition_id)
    if isinstance(out, Dataset):
        return out
    if not (isinstance(out, tuple) and len(out) == 2):
        raise DataError(f"data-loader {loader} returned {type(out).__name__}; it must return "
                        "(x, y) or a bayesfl.data.Dataset")
    x = torch.as_tensor(np.asarray(out[0]), dtype=torch.float32)
    y = torch.as_tensor(np.asarray(out[1]), dtype=torch.int64)
    if x.ndim < 2 or y.ndim != 1 or len(x) != len(y) or len(y) == 0:
        raise DataError(f"data-loader {loader} returned x {tuple(x.shape)} and y "
                        f"{tuple(y.shape)}; it must return x (n, ...) and y (n,) with n >= 1")
    if not bool(torch.isfinite(x).all()) or int(y.min()) < 0:
        raise DataError(f"data-loader {loader} returned non-finite inputs or negative labels")
    return Dataset("site", x, y, num_classes=int(y.max()) + 1, input_shape=tuple(x.shape[1:]))


def _site_node(config: SimulationConfig, options: FlowerOptions, partition_id: int,
               device: torch.device) -> Node:
    """A node whose data come from the run's per-site loader: the run config's ``dataset``
    and ``partition`` give only the shapes every site agrees on (its number of classes and
    input shape), the site's own data are split into train and test here."""
    from bayesfl.checkpoint import config_fingerprint
    from bayesfl.data.datasets import load_dataset
    from bayesfl.engine.setup import run_setup
    from bayesfl.errors import DataError
    from bayesfl.strategies import make_strategy

    site = site_data(options.data_loader, partition_id)
    # the strategy context (classes, input shape) comes from the run's named data set, as on
    # the server; the site's data must have that shape
    reference = load_dataset(config.dataset, seed=config.data_rng_seed, **config.dataset_options)
    if tuple(site.input_shape) != tuple(reference.input_shape) or \
            int(site.y.max()) >= reference.num_classes:
        raise DataError(f"site {partition_id}'s data ({tuple(site.input_shape)}, labels up to "
                        f"{int(site.y.max())}) do not fit the run's data set "
                        f"{config.dataset} ({tuple(reference.input_shape)}, "
                        f"{reference.num_classes} classes)")
    setup = run_setup(config, reference, device)
    own = _split_site(site, partition_id, config)
    strategy = make_strategy(config.strategy, setup.context, **config.strategy_options)
    fingerprint = config_fingerprint({**config.to_dict(), "data": "per-site",
                                      "data-loader": options.data_loader})
    return Node(config, options, strategy, setup.context.client_config(partition_id), own,
                fingerprint)


def _split_site(site: Any, partition_id: int, config: SimulationConfig) -> ClientData:
    """The site's data as one client's train/test split (stratified, seeded by the run)."""
    import numpy as np

    from bayesfl.data.clients import ClientData, stratified_split

    labels = site.y.numpy()
    if len(labels) < 2:
        from bayesfl.errors import DataError

        raise DataError(f"site {partition_id} has {len(labels)} sample(s): it needs at least "
                        "2 (one to train on, one to test)")
    train, test = stratified_split(labels, config.test_fraction,
                                   np.random.default_rng([config.data_rng_seed, partition_id, 26]))
    train, test = np.asarray(train, dtype=np.int64), np.asarray(test, dtype=np.int64)
    return ClientData(client_id=partition_id, train_x=site.x[train], train_y=site.y[train],
                      test_x=site.x[test], test_y=site.y[test], train_indices=train,
                      test_indices=test)


# ---- the client state in context.state -----------------------------------------------------
def load_state(context: Context, node: Node, slot: str = "trained") -> ClientState:
    """The client state kept in ``context.state`` (``slot``: trained or personalized); the
    initial state when there is none yet."""
    from safetensors.torch import load as load_tensors

    from bayesfl.config import resolve_device

    record = context.state.config_records.get(STATE_RECORD)
    data = None if record is None else record.get(slot)
    if not isinstance(data, bytes):
        return node.strategy.init_client(node.client)
    device = resolve_device(node.config.device)
    return {k: v.to(device) for k, v in load_tensors(data).items()}


def store_state(context: Context, slot: str, state: ClientState, round: int) -> None:
    """Keep ``state`` in ``context.state`` under ``slot`` (safetensors bytes)."""
    from safetensors.torch import save as save_tensors

    record = context.state.config_records.get(STATE_RECORD)
    values: dict[str, Any] = {} if record is None else dict(record)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    values[slot] = save_tensors(tensors)
    values[f"{slot}-round"] = int(round)
    context.state[STATE_RECORD] = ConfigRecord(values)


class ContextStore:
    """This node's `ClientStore`: its one client's states in
    ``context.state`` (`load_state`, `store_state`); a trained state is also kept
    in the node's ``state-dir`` (`save_round_state`). ``seconds`` adds up the time spent
    saving (the reply's ``save`` timing)."""

    def __init__(self, context: Context, node: Node) -> None:
        self.context, self.node = context, node
        self.seconds = 0.0

    def load(self, client_id: int, slot: str = "trained") -> ClientState:
        return load_state(self.context, self.node, slot)

    def save(self, client_id: int, state: ClientState, round: int,
             slot: str = "trained") -> None:
        t0 = time.perf_counter()
        store_state(self.context, slot, state, round)
        if slot == "trained":
            save_round_state(self.node, state, round)
        self.seconds += time.perf_counter() - t0


# ---- the client state on the node's disk (exact resumes) -------------------------------------
_KEEP_STATES = 3  # the server's checkpoint lags the nodes' fits by one round at most


def save_round_state(node: Node, state: ClientState, round: int) -> None:
    """Keep ``state`` (after round ``round``'s fit) in the node's ``state-dir``, atomically;
    only the latest few are kept."""
    from safetensors.torch import save

    from bayesfl.checkpoint import write_atomically

    if node.state_dir is None:
        return
    folder = node.state_dir / f"client-{node.client_id}"
    folder.mkdir(parents=True, exist_ok=True)
    write_atomically(folder / f"round-{round}.safetensors",
                     save({k: v.detach().to("cpu").contiguous() for k, v in state.items()}))
    for old in sorted(_saved_rounds(folder))[:-_KEEP_STATES]:
        (folder / f"round-{old}.safetensors").unlink(missing_ok=True)


def _saved_rounds(folder: Path) -> list[int]:
    rounds = []
    for path in folder.glob("round-*.safetensors"):
        number = path.name[len("round-"):-len(".safetensors")]
        if number.isdigit():
            rounds.append(int(number))
    return rounds


def resume_state(context: Context, node: Node, resumed_from: int) -> str | None:
    """At the first message of a resumed run (nothing in ``context.state`` yet): the node's
    latest saved state of a round ``<= resumed_from`` becomes its trained state. Returns why
    it could not (no ``state-dir``, no saved state: the client starts from its initial state),
    or None."""
    from safetensors.torch import load_file

    record = context.state.config_records.get(STATE_RECORD)
    if record is not None and "trained" in record:
        return None  # this Flower run has trained the client already
    if node.state_dir is None:
        return ("resumed without a state-dir in the node config: the client starts again "
                "from its initial state")
    folder = node.state_dir / f"client-{node.client_id}"
    rounds = [r for r in _saved_rounds(folder) if r <= resumed_from] if folder.exists() else []
    if not rounds:
        return None  # it never trained up to there (never sampled): its initial state is it
    state = load_file(str(folder / f"round-{max(rounds)}.safetensors"))
    store_state(context, "trained", state, max(rounds))
    return None


# ---- handlers -------------------------------------------------------------------------------
def _decoded(data: bytes, node: Node, round: int | None = None):
    """A server broadcast decoded; its header must name this run's strategy, ``round`` (when
    given) and the down direction."""
    from bayesfl.messages import TensorSpec, decode, validate

    broadcast = decode(data)
    schema = {k: TensorSpec(tuple(t.shape), t.dtype, finite=False)
              for k, t in broadcast.tensors.items()}
    validate(broadcast, schema, strategy=node.strategy.name, round=round, direction="down")
    return broadcast


def import_step_modules() -> float:
    """Import the modules a handler needs (torch, safetensors, the run's setup, the strategy
    registry, messages); returns the seconds it took (next to none once they are loaded).
    Handlers call it first so that their ``import`` timing is apart from their ``setup``."""
    t0 = time.perf_counter()
    import safetensors.torch  # noqa: F401
    import torch  # noqa: F401

    import bayesfl.checkpoint
    import bayesfl.config
    import bayesfl.data.datasets
    import bayesfl.engine.setup
    import bayesfl.flower.protocol
    import bayesfl.messages
    import bayesfl.strategies  # noqa: F401

    return time.perf_counter() - t0


def process_started_at() -> float | None:
    """When this process started (seconds since the epoch, to the kernel's 10 ms tick), from
    ``/proc/self/stat`` and the boot time in ``/proc/stat``; None where there is no ``/proc``."""
    import os

    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(float(line.split()[1]) for line in
                    Path("/proc/stat").read_text().splitlines() if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def message_timeline(msg: Message, started: float) -> dict[str, float]:
    """The ``at.*`` stamps of a message's way to its handler (module docstring): when the
    SuperNode's pull got it (Flower's ``metadata.delivered_at``), when this process started and
    this module was loaded, and ``started`` (the handler's start)."""
    stamps = {"at.loaded": LOADED_AT, "at.start": started}
    process = process_started_at()
    if process is not None:
        stamps["at.process"] = process
    delivered = getattr(msg.metadata, "delivered_at", "")
    if isinstance(delivered, str) and delivered:
        with contextlib.suppress(ValueError):
            stamps["at.delivered"] = datetime.fromisoformat(delivered).timestamp()
    return stamps


@app.query("info")
def info(msg: Message, context: Context) -> Message:
    """Who this node is in the run: client id, data sizes, the run's fingerprint; or, for a
    run whose data loader this node does not allow, its partition id and why it refuses
    (``refused``): the server logs it and goes on without this node."""
    from bayesfl.errors import LoaderRefused
    from bayesfl.flower.protocol import pack

    try:
        node = node_of(context)
    except LoaderRefused as err:
        pid = context.node_config.get("partition-id")
        pid = pid if isinstance(pid, int) and not isinstance(pid, bool) else -1
        return Message(pack(client_id=pid, refused=str(err)), reply_to=msg)
    return Message(pack(client_id=node.client_id, num_partitions=node.config.clients,
                        num_train=node.data.num_train, num_test=node.data.num_test,
                        fingerprint=node.fingerprint), reply_to=msg)


@app.train("round")
def round_step(msg: Message, context: Context) -> Message:
    """One message of a round: evaluate the previous state (if asked), personalise (final
    step, if asked), fit (if sampled); the reply carries what each produced."""
    started = time.time()
    t_handler = time.perf_counter()
    timing = {"import": import_step_modules()}
    import torch

    from bayesfl.config import check_threads, torch_threads
    from bayesfl.flower.protocol import pack, part, record_values, scalar
    from bayesfl.messages import DEFAULT_MAX_BYTES

    t0 = time.perf_counter()
    node = node_of(context)
    timing["setup"] = time.perf_counter() - t0
    values = record_values(msg.content)
    r = scalar(values, "round", int)
    out: dict[str, Any] = {}
    resumed_from = values.get("resumed-from")
    if isinstance(resumed_from, int) and not isinstance(resumed_from, bool):
        problem = resume_state(context, node, resumed_from)
        if problem is not None:
            out["resume-problem"] = problem
    with torch_threads(check_threads(node.options.threads)), \
            torch.random.fork_rng(devices=_rng_devices(node)):
        evaluate_data = part(values, "evaluate", max_bytes=DEFAULT_MAX_BYTES)
        if evaluate_data is not None:
            t1 = time.perf_counter()
            out.update(_evaluate_step(context, node, evaluate_data,
                                      scalar(values, "evaluate-round", int),
                                      personalize=values.get("personalize") is True))
            timing["evaluate"] = time.perf_counter() - t1
        fit_data = part(values, "fit", max_bytes=DEFAULT_MAX_BYTES)
        if fit_data is not None:
            out.update(_fit_step(context, node, _decoded(fit_data, node, r), r, timing))
    timing["handler"] = time.perf_counter() - t_handler
    timing["cpu"] = time.process_time()
    timing.update(message_timeline(msg, started), **{"at.end": time.time()})
    content = pack(round=r, client_id=node.client_id, timing=timing, **out)
    return Message(content, reply_to=msg)


def _fit_step(context: Context, node: Node, broadcast: Any, r: int,
              timing: dict[str, float]) -> dict[str, Any]:
    """The client step's fit (`bayesfl.client.step.fit_clients`, the simulator's too):
    the upload, or, for a client whose training diverged, why it sends nothing
    (``diverged``; its state stays the one from before the round)."""
    import torch

    from bayesfl.client.step import LocalClient, fit_clients
    from bayesfl.messages import encode
    from bayesfl.strategies.base import derived_seed

    store = ContextStore(context, node)
    t1 = time.perf_counter()
    # the global generator as the engine's round start leaves it in the simulator
    torch.manual_seed(derived_seed(node.config.seed, r))
    fitted = fit_clients(node.strategy, [LocalClient(node.client, node.data)], store, broadcast,
                         seed=node.config.seed, round=r)
    timing["fit"] = time.perf_counter() - t1 - store.seconds
    timing["save"] = store.seconds
    if node.client_id in fitted.diverged:
        return {"diverged": fitted.diverged[node.client_id]}
    t3 = time.perf_counter()
    data = encode(fitted.uploads[node.client_id])
    timing["encode"] = time.perf_counter() - t3
    return {"upload": data}


def _evaluate_step(context: Context, node: Node, data: bytes, r: int, *,
                   personalize: bool) -> dict[str, Any]:
    """The accumulators of the trained state (``evaluation``) and, with ``personalize``, of the
    personalised one (``personalized``), by the client step (``evaluate_clients``,
    ``personalize_clients`` of `bayesfl.client.step`); an evaluation that fails is
    reported, not raised."""
    from bayesfl.client.step import LocalClient, evaluate_clients, personalize_clients
    from bayesfl.errors import BayesFLError
    from bayesfl.flower.protocol import evaluation_tensors
    from bayesfl.messages import encode
    from calibration.errors import CalibrationError
    from inference.errors import InferenceError

    broadcast = _decoded(data, node, r)
    strategy, out = node.strategy, {}
    client, store = LocalClient(node.client, node.data), ContextStore(context, node)

    def evaluated(state: ClientState) -> bytes:
        (evaluation,) = evaluate_clients(strategy, [client], {node.client_id: state}, broadcast,
                                         n_bins=node.config.n_bins)
        return encode(strategy.up_message(r, node.client_id, evaluation_tensors(evaluation)))

    try:
        out["evaluation"] = evaluated(store.load(node.client_id))
    except (BayesFLError, InferenceError, CalibrationError) as err:
        out["evaluation-error"] = f"evaluation failed: {err}"
    if personalize:
        (state,) = personalize_clients(strategy, [client], store, broadcast,
                                       seed=node.config.seed, round=r).values()
        try:
            out["personalized"] = evaluated(state)
        except (BayesFLError, InferenceError, CalibrationError) as err:
            out["evaluation-error"] = f"evaluation of the personalised state failed: {err}"
    return out


@app.query("calibrate")
def calibrate(msg: Message, context: Context) -> Message:
    """The calibrate and conformal phases on this node (`bayesfl.engine.phases`): a
    temperature proposal (``proposal``) or result (``result``, `bayesfl.calibrate`), a
    conformal request (``conformal``) or the thresholds (``conformal_result``,
    `bayesfl.conformal`), answered by the phase's client function on this node's site."""
    from bayesfl import calibrate as temperature
    from bayesfl import conformal

    return _phase_reply(msg, context, (temperature.PROPOSAL, temperature.RESULT,
                                       conformal.REQUEST, conformal.RESULT))


@app.query("shift")
def shift(msg: Message, context: Context) -> Message:
    """The shift evaluation on this node (`bayesfl.shift_protocol`): its own test rows
    under the request's shifts (and its OOD rows), predicted with its final state; the reply
    carries the mergeable states only (``reply``) and why the mutual information is missing,
    if it is (``notes``, JSON)."""
    from bayesfl.shift_protocol import REQUEST

    return _phase_reply(msg, context, (REQUEST,))


def _phase_reply(msg: Message, context: Context, phases: tuple[Any, ...]) -> Message:
    """A final phase's request answered (`bayesfl.engine.phases.Phase`: the record key
    present says which): the node's site is its final state (the personalised one where it has
    one), its data and held-out rows and the request's final evaluation ``broadcast``.

    Raises:
        MessageRejected: a record without a request of these phases.
    """
    import json

    import torch

    from bayesfl.config import check_threads, resolve_device, torch_threads
    from bayesfl.conformal_spec import parse_conformal
    from bayesfl.engine.phases import Site
    from bayesfl.errors import MessageRejected
    from bayesfl.flower.protocol import pack, part, record_values, scalar
    from bayesfl.messages import DEFAULT_MAX_BYTES

    node = node_of(context)
    values = record_values(msg.content)
    phase = next((p for p in phases if p.request in values), None)
    if phase is None:
        raise MessageRejected(f"the query carries none of {[p.request for p in phases]}")
    if phase.text:
        down = str(values.get(phase.request)).encode()
    else:
        down = part(values, phase.request, max_bytes=DEFAULT_MAX_BYTES) or b""
    broadcast = _decoded(part(values, "broadcast", max_bytes=DEFAULT_MAX_BYTES) or b"", node)
    record = context.state.config_records.get(STATE_RECORD)
    slot = "personalized" if record is not None and "personalized" in record else "trained"
    site = Site(node.client_id, node.strategy, node.client, load_state(context, node, slot),
                broadcast, node.data, node.held_out, seed=node.config.seed,
                n_bins=node.config.n_bins, device=resolve_device(node.config.device),
                conformal=parse_conformal(node.config.conformal), clients=node.clients,
                novel=node.novel)
    with torch_threads(check_threads(node.options.threads)), \
            torch.random.fork_rng(devices=_rng_devices(node)):
        answer = phase.answer(site, down)
    fields: dict[str, Any] = {"step": scalar(values, "step", int)} if phase.numbered else {}
    if phase.notes:
        data, notes = answer
        fields.update({phase.reply: data, "notes": json.dumps(notes)})
    else:
        fields[phase.reply] = answer
    return Message(pack(**fields), reply_to=msg)


def _rng_devices(node: Node) -> list[torch.device]:
    from bayesfl.config import resolve_device

    device = resolve_device(node.config.device)
    return [device] if device.type == "cuda" else []


__all__ = ["LOADED_AT", "NODE_LOADERS", "STATE_RECORD", "ContextStore", "Node", "allowed_loader",
           "app", "import_step_modules", "load_state", "message_timeline", "node_of",
           "process_started_at", "resume_state", "save_round_state", "shift", "site_data",
           "store_state"]
