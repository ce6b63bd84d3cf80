"""The bayesfl ClientApp: a strategy's client half on one SuperNode's own partition.

Each SuperNode is one client: ``node_config`` gives its ``partition-id`` (the client id) and
``num-partitions`` (which must equal the run's ``clients``). The node loads the data set named
in the run config and keeps its own partition (:func:`bayesfl.simulate.run_setup`, the same
clients the simulator builds for the same config and seed). One handler per step:

* ``query.info``: who the node is (client id, test-set size, the run's fingerprint, so the
  server can refuse a node set up with other data or settings);
* ``train.fit``: decode the broadcast, :meth:`Strategy.fit` with the round's generator,
  upload the encoded message;
* ``train.personalize``: :meth:`Strategy.personalize` (strategies that personalise);
* ``evaluate.evaluate``: :meth:`Strategy.evaluate`, reply with the calibration accumulator
  states only (no prediction leaves the node).

The client state lives in ``context.state`` between rounds (safetensors bytes of the state's
named tensors in a ConfigRecord; no pickle). A handler that fails raises: Flower turns that
into an error reply, which the server logs and survives.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
from flwr.app import ConfigRecord, Context, Message
from flwr.clientapp import ClientApp
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from bayesfl.checkpoint import config_fingerprint
from bayesfl.config import SimulationConfig, check_threads, resolve_device, torch_threads
from bayesfl.data.clients import ClientData
from bayesfl.data.datasets import dataset_identity, load_dataset
from bayesfl.errors import ConfigError
from bayesfl.flower.protocol import (
    FlowerOptions,
    evaluation_tensors,
    pack,
    parse_run_config,
    scalar,
    unpack,
)
from bayesfl.messages import DEFAULT_MAX_BYTES, TensorSpec, decode, encode, validate
from bayesfl.simulate import run_setup
from bayesfl.strategies import make_strategy
from bayesfl.strategies.base import (
    PERSONALIZE_SEED_KEY,
    ClientConfig,
    ClientState,
    Strategy,
    derived_seed,
)

app = ClientApp()

STATE_RECORD = "bayesfl-state"
"""Key of the ConfigRecord in ``context.state`` that holds the client state."""


@dataclass
class Node:
    """One SuperNode's side of a run: its config, data and the strategy's client half."""

    config: SimulationConfig
    options: FlowerOptions
    strategy: Strategy
    client: ClientConfig
    data: ClientData
    fingerprint: str

    @property
    def client_id(self) -> int:
        return self.client.client_id


def node_of(context: Context) -> Node:
    """This node's side of the run (memoised per run config and partition).

    Raises:
        ConfigError: a node_config without an integer ``partition-id`` in ``[0, clients)``,
            or a ``num-partitions`` that differs from the run's ``clients``.
    """
    run = tuple(sorted((str(k), v) for k, v in context.run_config.items()))
    node = dict(context.node_config)
    pid, parts = node.get("partition-id"), node.get("num-partitions")
    for name, value in (("partition-id", pid), ("num-partitions", parts)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"node_config {name} must be an integer, got {value!r} "
                              "(flower-supernode --node-config 'partition-id=0 "
                              "num-partitions=N')")
    return _node(run, pid, parts)


@lru_cache(maxsize=4)
def _node(run: tuple[tuple[str, Any], ...], partition_id: int, num_partitions: int) -> Node:
    config, options = parse_run_config(dict(run))
    if num_partitions != config.clients:
        raise ConfigError(f"this node has num-partitions={num_partitions} but the run has "
                          f"clients={config.clients}")
    if not 0 <= partition_id < config.clients:
        raise ConfigError(f"partition-id {partition_id} is outside [0, {config.clients})")
    dataset = load_dataset(config.dataset, seed=config.seed, **config.dataset_options)
    setup = run_setup(config, dataset, resolve_device(config.device))
    strategy = make_strategy(config.strategy, setup.context, **config.strategy_options)
    fingerprint = config_fingerprint({**config.to_dict(), "data": dataset_identity(dataset)})
    return Node(config, options, strategy, setup.context.client_config(partition_id),
                setup.client_data[partition_id], fingerprint)


# ---- the client state in context.state -----------------------------------------------------
def load_state(context: Context, node: Node, slot: str = "trained") -> ClientState:
    """The client state kept in ``context.state`` (``slot``: trained or personalized); the
    initial state when there is none yet."""
    record = context.state.config_records.get(STATE_RECORD)
    data = None if record is None else record.get(slot)
    if not isinstance(data, bytes):
        return node.strategy.init_client(node.client)
    device = resolve_device(node.config.device)
    return {k: v.to(device) for k, v in load_tensors(data).items()}


def store_state(context: Context, slot: str, state: ClientState, round: int) -> None:
    """Keep ``state`` in ``context.state`` under ``slot`` (safetensors bytes)."""
    record = context.state.config_records.get(STATE_RECORD)
    values: dict[str, Any] = {} if record is None else dict(record)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    values[slot] = save_tensors(tensors)
    values[f"{slot}-round"] = int(round)
    context.state[STATE_RECORD] = ConfigRecord(values)


# ---- handlers -------------------------------------------------------------------------------
def _broadcast(msg: Message, node: Node) -> tuple[Any, dict[str, Any]]:
    """The server's decoded broadcast and the step's scalars; the broadcast's header must
    name this run's strategy, the step's round and the down direction."""
    data, values = unpack(msg.content, max_bytes=DEFAULT_MAX_BYTES)
    r = scalar(values, "round", int)
    broadcast = decode(data)
    schema = {k: TensorSpec(tuple(t.shape), t.dtype, finite=False)
              for k, t in broadcast.tensors.items()}
    validate(broadcast, schema, strategy=node.strategy.name, round=r, direction="down")
    return broadcast, values


@app.query("info")
def info(msg: Message, context: Context) -> Message:
    """Who this node is in the run: client id, data sizes, the run's fingerprint."""
    node = node_of(context)
    return Message(pack(client_id=node.client_id, num_partitions=node.config.clients,
                        num_train=node.data.num_train, num_test=node.data.num_test,
                        fingerprint=node.fingerprint), reply_to=msg)


@app.train("fit")
def fit(msg: Message, context: Context) -> Message:
    """One round of local work: the new state stays here, the upload goes back."""
    t0 = time.perf_counter()
    node = node_of(context)
    t_setup = time.perf_counter() - t0
    broadcast, _ = _broadcast(msg, node)
    r = broadcast.header.round
    state = load_state(context, node)
    seed = node.config.seed
    t1 = time.perf_counter()
    with torch_threads(check_threads(node.options.threads)), \
            torch.random.fork_rng(devices=_rng_devices(node)):
        torch.manual_seed(derived_seed(seed, r))
        gen = torch.Generator().manual_seed(derived_seed(seed, r, node.client_id))
        state, upload = node.strategy.fit(node.client, state, node.data, broadcast, gen)
    t_fit = time.perf_counter() - t1
    store_state(context, "trained", state, r)
    t2 = time.perf_counter()
    data = encode(upload)
    t_encode = time.perf_counter() - t2
    return Message(pack(data, round=r, client_id=node.client_id,
                        timing={"setup": t_setup, "fit": t_fit, "encode": t_encode}),
                   reply_to=msg)


@app.train("personalize")
def personalize(msg: Message, context: Context) -> Message:
    """The state this client predicts with after training (kept beside the trained one)."""
    node = node_of(context)
    broadcast, _ = _broadcast(msg, node)
    gen = torch.Generator().manual_seed(
        derived_seed(node.config.seed, PERSONALIZE_SEED_KEY, node.client_id))
    with torch_threads(check_threads(node.options.threads)), \
            torch.random.fork_rng(devices=_rng_devices(node)):
        state = node.strategy.personalize(node.client, load_state(context, node), node.data,
                                          broadcast, gen)
    store_state(context, "personalized", state, broadcast.header.round)
    return Message(pack(round=broadcast.header.round, client_id=node.client_id),
                   reply_to=msg)


@app.evaluate("evaluate")
def evaluate(msg: Message, context: Context) -> Message:
    """Calibration accumulators of this client's test set (no predictions leave the node)."""
    t0 = time.perf_counter()
    node = node_of(context)
    t_setup = time.perf_counter() - t0
    broadcast, values = _broadcast(msg, node)
    personalized = values.get("personalized") is True
    state = load_state(context, node, "personalized" if personalized else "trained")
    t1 = time.perf_counter()
    with torch_threads(check_threads(node.options.threads)):
        evaluation = node.strategy.evaluate(node.client, state, node.data, broadcast,
                                            n_bins=node.config.n_bins)
    t_eval = time.perf_counter() - t1
    reply = node.strategy.up_message(broadcast.header.round, node.client_id,
                                     evaluation_tensors(evaluation))
    return Message(pack(encode(reply), round=broadcast.header.round, client_id=node.client_id,
                        timing={"setup": t_setup, "evaluate": t_eval}), reply_to=msg)


def _rng_devices(node: Node) -> list[torch.device]:
    device = resolve_device(node.config.device)
    return [device] if device.type == "cuda" else []


__all__ = ["STATE_RECORD", "Node", "app", "load_state", "node_of", "store_state"]
