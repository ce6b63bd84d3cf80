"""bayesfl on Flower: a real SuperLink and SuperNodes on 127.0.0.1 against the simulator.

The integration tests start ``flower-superlink`` and three ``flower-supernode`` processes
(each in its own process group, stopped in a fixture whatever happens), submit the example
app with ``flwr run`` and read the final status with ``flwr ls``. The server's final state
(from its checkpoint) and pooled ECE (from summary.json) must equal the embedded simulator's
for the same config, seeds and partition. Every step costs Flower a fresh ClientApp process
(Python, torch and bayesfl imported again), so the runs evaluate only after the last round.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("flwr")

from flwr.app import ConfigRecord, RecordDict
from safetensors.torch import load_file

from bayesfl.engine.state import save_round
from bayesfl.errors import ConfigError, MessageRejected
from bayesfl.flower.local import LocalFederation, _start_time
from bayesfl.flower.protocol import (
    evaluation_tensors,
    pack,
    parse_run_config,
    read_evaluation,
    record_values,
    unpack,
)
from bayesfl.messages import read_safetensors_metadata
from bayesfl.run_directory import CHECKPOINT_NAME
from bayesfl.simulate import simulate
from bayesfl.strategies import make_strategy
from bayesfl.strategies.base import PREDICTIVE, Evaluation, StrategyContext
from calibration.accumulator import Accumulator

TAMPER_APP = Path(__file__).parent / "flower_tamper_app"
EXPERIMENT = {"dataset": "digits", "clients": 3, "partition": "iid", "seed": 0,
              "local-epochs": 1}
# generous: three ClientApp processes each import torch on a loaded 2-core machine
DEPLOYMENT = {"threads": 1, "round-timeout": 400.0, "node-wait": 300.0, "evaluate-every": 100}
RUN_TIMEOUT = 900.0


@pytest.fixture(scope="module")
def federation():
    with LocalFederation(3, start_timeout=300.0) as fed:
        yield fed


def run_on_flower(fed: LocalFederation, out: Path, strategy: str, rounds: int,
                  app: Path | None = None, **extra: Any) -> dict[str, Any]:
    config = {**EXPERIMENT, **DEPLOYMENT, "strategy": strategy, "rounds": rounds,
              "out": str(out), **extra}
    kwargs = {} if app is None else {"app": app}
    status = fed.run(config, timeout=RUN_TIMEOUT, done_marker=out / "summary.json", **kwargs)
    assert status.completed, (status.status, status.details, fed.log("superlink")[-4000:])
    return json.loads((out / "summary.json").read_text())


def run_in_simulator(strategy: str, rounds: int, **strategy_options: Any) -> Any:
    return simulate(strategy, rounds=rounds, clients=3, partition="iid", seed=0,
                    local_epochs=1, progress=False, batched=False, threads=1,
                    strategy_options=strategy_options)


def server_state(out: Path) -> dict[str, torch.Tensor]:
    tensors = load_file(out / "checkpoint.safetensors")
    return {k[len("server/"):]: v for k, v in tensors.items() if k.startswith("server/")}


def assert_matches_simulator(out: Path, summary: dict[str, Any], strategy: str,
                             rounds: int, **strategy_options: Any) -> None:
    sim = run_in_simulator(strategy, rounds, **strategy_options)
    flower = server_state(out)
    assert sorted(flower) == sorted(sim.state)
    for name, tensor in sim.state.items():
        # the same float32 operations in the same order on both sides: equal up to float
        # rounding of a differently laid-out batch at most (1e-6 on O(1) values)
        torch.testing.assert_close(flower[name], tensor.cpu(), rtol=0, atol=1e-6,
                                   msg=f"server tensor {name!r}")
    # pooled metrics merge the same accumulator sums (float64): equal to 1e-12
    for key in ("ece", "accuracy", "accuracy_pooled", "nll", "brier"):
        assert summary[key] == pytest.approx(sim.summary[key], abs=1e-12), key
        if "map_plugin" in sim.summary:
            assert summary["map_plugin"][key] == pytest.approx(
                sim.summary["map_plugin"][key], abs=1e-12), f"map_plugin {key}"
    assert summary["bytes_up"] == sim.summary["bytes_up"]
    assert summary["bytes_down"] == sim.summary["bytes_down"]


def checkpointed_round(path: Path) -> int | None:
    """The round of the checkpoint at ``path`` (from its safetensors header only), or None
    while there is none: the checkpoint is written atomically after each round is complete."""
    try:
        with path.open("rb") as f:
            head = f.read(8)
            header = f.read(int.from_bytes(head, "little")) if len(head) == 8 else b""
    except FileNotFoundError:
        return None
    return json.loads(read_safetensors_metadata(head + header)["bayesfl.meta"])["round"]


def test_checkpointed_round_reads_the_round_a_checkpoint_was_written_for(tmp_path):
    path = tmp_path / CHECKPOINT_NAME
    assert checkpointed_round(path) is None
    for r in (0, 1):
        save_round(path, round=r, first_round=1, seconds=0.0, identity={}, fingerprint="f",
                   state={"w": torch.zeros(2)}, clients={}, metrics_text=b"",
                   transport="flower")
        assert checkpointed_round(path) == r


def listening_addresses(pids: set[int]) -> set[str]:
    """``ip:port`` of every TCP socket in LISTEN state that one of ``pids`` holds (Linux)."""
    inodes: set[str] = set()
    for pid in pids:
        fd_dir = Path(f"/proc/{pid}/fd")
        try:
            links = [str(f.readlink()) for f in fd_dir.iterdir()]
        except OSError:
            continue
        inodes |= {link[8:-1] for link in links if link.startswith("socket:[")}
    found = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                address, port = cols[1].split(":")
                ip = (".".join(str(int(address[i:i + 2], 16)) for i in (6, 4, 2, 0))
                      if width == 8 else address)
                found.add(f"{ip}:{int(port, 16)}")
    return found


def federation_pids(fed: LocalFederation) -> set[int]:
    from bayesfl.flower.local import _descendants

    roots = {p.pid for p in [fed.superlink, *fed.supernodes] if p is not None}
    return roots | {d for r in roots for d in _descendants(r)}


# ---- without a deployment ------------------------------------------------------------------
def test_run_config_maps_to_the_simulator_config():
    config, options = parse_run_config({
        "strategy": "fedavg", "dataset": "gaussian_mixture", "clients": 4, "option": "",
        "dataset-option.n": 100,
        "out": "", "threads": 0, "min-replies": 2, "round-timeout": 5.0})
    assert (config.strategy, config.clients, config.dataset_options) == ("fedavg", 4,
                                                                         {"n": 100})
    assert options.out is None and options.threads is None and options.min_replies == 2
    with pytest.raises(ConfigError, match="unknown key"):
        parse_run_config({"strateggy": "fedlog"})
    with pytest.raises(ConfigError, match="round-timeout"):
        parse_run_config({"round-timeout": -1.0})
    with pytest.raises(ConfigError, match="authenticate"):
        parse_run_config({"authenticate": True})


def test_records_carry_bytes_and_refuse_oversize():
    data, values = unpack(pack(b"\x00" * 100, round=3))
    assert data == b"\x00" * 100 and values == {"round": 3}
    with pytest.raises(MessageRejected, match="oversized"):
        unpack(pack(b"\x00" * 100), max_bytes=99)
    with pytest.raises(MessageRejected, match="no 'bayesfl'"):
        unpack(RecordDict({"other": ConfigRecord({"message": b""})}))


def test_evaluation_reply_is_checked():
    context = StrategyContext(num_classes=3, feature_dim=4, input_shape=(5,), clients=2)
    strategy = make_strategy("fedavg", context)
    probs = torch.softmax(torch.randn(7, 3, dtype=torch.float64), 1)
    acc = Accumulator(15).update(probs, torch.randint(0, 3, (7,)))
    tensors = evaluation_tensors(Evaluation(1, {PREDICTIVE: acc}))
    from bayesfl.messages import encode

    good = encode(strategy.up_message(2, 1, tensors))
    got = read_evaluation(strategy, good, round=2, client_id=1, n_bins=15, num_test=7)
    assert got.accumulators[PREDICTIVE].compute() == acc.compute()
    with pytest.raises(MessageRejected, match="8 test samples"):
        read_evaluation(strategy, good, round=2, client_id=1, n_bins=15, num_test=8)
    with pytest.raises(MessageRejected, match="client_id"):
        read_evaluation(strategy, good, round=2, client_id=0, n_bins=15, num_test=7)
    bad = dict(tensors)
    bad[f"{PREDICTIVE}.bin_correct_counts"] = tensors[f"{PREDICTIVE}.bin_counts"] + 1
    with pytest.raises(MessageRejected, match="exceed"):
        read_evaluation(strategy, encode(strategy.up_message(2, 1, bad)), round=2,
                        client_id=1, n_bins=15, num_test=7)


class InProcessGrid:
    """A Grid whose nodes (node id 100 + client id) answer fit requests in this process with
    the strategy's client half; records the bayesfl bytes pushed to each client."""

    def __init__(self, server, nodes):
        self.server, self.nodes = server, nodes
        self.pushed: dict[int, int] = {}
        self.uploaded: dict[int, int] = {}
        self.replies: dict[str, Any] = {}

    def get_node_ids(self):
        return list(self.nodes)

    def push_messages(self, messages):
        from types import SimpleNamespace

        from bayesfl.messages import decode, encode

        ids = []
        for message in messages:
            cid = message.metadata.dst_node_id - 100
            values = record_values(message.content)
            data = values["fit"]
            self.pushed[cid] = len(data)
            # the clients' half of the run's strategy (the server holds only its ServerView)
            from bayesfl.strategies.halves import ClientView
            strategy = ClientView(object.__getattribute__(self.server.strategy, "_strategy"))
            config = strategy.context.client_config(cid)
            _, upload = strategy.fit(config, strategy.init_client(config),
                                     self.server.setup.client_data[cid], decode(data),
                                     torch.Generator().manual_seed(cid))
            up = encode(upload)
            self.uploaded[cid] = len(up)
            mid = f"m{len(self.replies)}"
            self.replies[mid] = SimpleNamespace(
                content=pack(upload=up, round=values["round"]), has_error=lambda: False,
                metadata=SimpleNamespace(reply_to_message_id=mid))
            ids.append(mid)
        return ids

    def pull_messages(self, ids):
        return [self.replies.pop(i) for i in ids if i in self.replies]


@pytest.mark.parametrize("connected", [6, 5])
def test_a_flower_round_counts_bytes_for_the_sampled_clients_it_sent_to(connected, monkeypatch):
    # fraction 0.5 of 6 clients: 3 sampled; the broadcast goes to each sampled client that
    # has a node (all of them, or all but the first sampled one) and nobody else
    from flwr.supercore.task_identity import TaskIdentity

    from bayesfl.flower.server_app import FlowerServer
    from bayesfl.simulate import sample_clients

    for key in ("_run_id", "_node_id", "_task_id"):  # what a ServerApp process has set
        monkeypatch.setattr(TaskIdentity, key, 1)
    run_config = {"strategy": "fedavg", "dataset": "gaussian_mixture", "clients": 6,
                  "partition": "iid", "rounds": 3, "seed": 3, "body": "mlp:8",
                  "feature-dim": 4, "local-epochs": 1, "fraction": 0.5, "evaluate-every": 100,
                  "dataset-option.n": 120, "dataset-option.num_classes": 3,
                  "dataset-option.dim": 5}
    server = FlowerServer(None, run_config)
    sampled = sample_clients(6, 0.5, seed=3, round=1)
    assert len(sampled) == 3
    missing = [] if connected == 6 else sampled[:1]
    server.nodes = {cid: 100 + cid for cid in range(6) if cid not in missing}
    server.grid = grid = InProcessGrid(server, server.nodes.values())
    record, pending = server.loop.run_round(1), server.loop.pending
    # round 1 of 3, evaluate-every 100: complete without an evaluation, none to follow
    assert pending is None and record["accuracy"] is None
    sent = [cid for cid in sampled if cid not in missing]
    assert record["participants"] == sampled and sorted(grid.pushed) == sent
    down = set(grid.pushed.values())
    assert len(down) == 1 and record["bytes_down_per_client"] == down.pop()
    assert record["bytes_down"] == len(sent) * record["bytes_down_per_client"]
    assert record["bytes_up_per_client"] == [grid.uploaded.get(cid, 0) for cid in sampled]
    assert record["bytes_up"] == sum(grid.uploaded.values())
    params = sum(p.numel() for p in server.strategy.template("mlp:8").parameters())
    assert record["floats_down"] == len(sent) * params
    assert record["floats_up"] == len(sent) * (params + 1)
    assert record["accepted"] == len(sent)


# ---- on a loopback deployment ----------------------------------------------------------------
# Two deployments carry every check: each Flower step starts a fresh ClientApp process per node
# (torch and bayesfl imported again), so a run costs minutes on a busy 2-core machine.
@pytest.mark.flower
@pytest.mark.slow  # ~1-3 minutes on a 2-core machine, depending on its load
def test_fedsi_on_flower_equals_the_simulator(federation, tmp_path):
    # FedSI exercises every step of the protocol: fit, the server's posterior aggregation,
    # personalize (head fine-tuning and the Laplace refit on the nodes) and the evaluation of
    # the personalised states, with the MAP plug-in beside the predictive
    summary = run_on_flower(federation, tmp_path / "run", "fedsi", 2)
    # nothing the deployment started listens beyond loopback
    addresses = listening_addresses(federation_pids(federation))
    assert len(addresses) >= 4 and all(a.startswith("127.0.0.1:") for a in addresses), \
        addresses
    assert summary["transport"] == "flower" and summary["events"] == []
    assert summary["personalized"] is True and "map_plugin" in summary
    assert_matches_simulator(tmp_path / "run", summary, "fedsi", 2)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    # FedSI has no round-0 evaluation (its clients hold no posterior before training)
    assert [json.loads(line)["round"] for line in lines] == [1, 2]
    assert (tmp_path / "run" / "reliability.png").stat().st_size > 0


@pytest.mark.flower
@pytest.mark.slow  # ~2-7 minutes on a 2-core machine, depending on its load
def test_a_probabilistic_head_on_flower_equals_the_simulator(federation, tmp_path):
    # head=laplace (issue 25): FedPer's nodes personalise by fitting the head posterior on
    # their own features, keep it in Context.state (safetensors) and evaluate with it, the
    # plug-in beside it
    summary = run_on_flower(federation, tmp_path / "run", "fedper", 2,
                            option="head=laplace")
    assert summary["personalized"] is True and "map_plugin" in summary
    assert summary["nll"] != summary["map_plugin"]["nll"]
    assert_matches_simulator(tmp_path / "run", summary, "fedper", 2, head="laplace")


@pytest.mark.flower
@pytest.mark.slow  # ~2-3 minutes: Flower declares a SIGKILLed node dead after missed heartbeats
def test_an_invalid_upload_and_a_killed_supernode_do_not_stop_the_run(tmp_path):
    # the tamper app's client 1 uploads NaN in round 1; SuperNode 2 is SIGKILLed once round 1
    # is complete: its checkpoint (written atomically after the round's record, evaluate-every
    # 100: rounds 0 and 1 are recorded as they end, unevaluated) says round 1, so node 2's
    # round-1 upload is in and only round 2 can miss it. The run must reject the one, log the
    # other and complete round 2 with the two clients left.
    out = tmp_path / "run"
    killed = threading.Event()
    run_over = threading.Event()
    with LocalFederation(3, start_timeout=300.0) as fed:
        def kill_after_round_one() -> None:
            # the checkpoint is replaced whole (write-then-rename), never seen half-written,
            # unlike a line being appended to metrics.jsonl
            while not run_over.wait(0.2):
                if (checkpointed_round(out / CHECKPOINT_NAME) or 0) >= 1:
                    fed.kill_node(2)
                    killed.set()
                    return

        killer = threading.Thread(target=kill_after_round_one, daemon=True)
        killer.start()
        # the dead node's messages wait round-timeout at most (Flower notices a SIGKILLed
        # node after two missed heartbeats, ~60 s)
        try:
            summary = run_on_flower(fed, out, "fedlog", 2, app=TAMPER_APP,
                                    **{"round-timeout": 120.0})
        finally:
            run_over.set()
            killer.join(timeout=30)
        assert killed.is_set(), "the run ended before its round-1 checkpoint was seen"
        pids = federation_pids(fed) | {fed.supernodes[2].pid}
    # stopped on leaving the block: every process it started and their descendants
    assert not [pid for pid in pids if _start_time(pid) is not None]
    assert summary["rejected_uploads"] == 1
    (rejection,) = summary["rejections"]
    assert rejection["round"] == 1 and rejection["client_id"] == 1
    assert "non-finite" in rejection["reason"]
    events = [e for e in summary["events"] if e["client_id"] == 2]
    assert events, summary["events"]
    assert all(e["round"] >= 2 for e in events if "round" in e)
    records = [json.loads(line) for line in out.joinpath("metrics.jsonl").read_text()
               .splitlines()]
    # round 0 is the initial state; round 1 lost the NaN upload, round 2 the dead node
    assert [r["accepted"] for r in records] == [3, 2, 2]
    assert [c["client_id"] for c in summary["per_client"]] == [0, 1]


OWNER = """\
import sys, time
from bayesfl.flower.local import LocalFederation
fed = LocalFederation(1, start_timeout=300.0)
fed.start()
print(*[p.pid for p in [fed.superlink, *fed.supernodes]], flush=True)
time.sleep(600)
"""


@pytest.mark.flower
def test_a_federation_whose_owner_is_killed_does_not_outlive_it():
    """SIGKILL leaves its owner no stop() to run: the SuperLink and SuperNode it started get
    SIGTERM from the kernel instead (with_parent_death_signal), and none is left running."""
    import os
    import signal
    import subprocess
    import sys

    from bayesfl.flower.local import with_parent_death_signal

    if with_parent_death_signal(["x"]) == ["x"]:
        pytest.skip("no parent-death signal on this platform")
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(pid) for pid in owner.stdout.readline().split()]
        assert len(pids) == 2, "the owner did not start its federation"
        started = {pid: _start_time(pid) for pid in pids}
        assert all(started.values())
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(timeout=30)
        deadline = time.monotonic() + 60.0
        while time.monotonic() < deadline and any(
                _start_time(pid) == when for pid, when in started.items()):
            time.sleep(0.1)
        assert not [pid for pid, when in started.items() if _start_time(pid) == when]
    finally:
        if owner.poll() is None:
            owner.kill()
        owner.stdout.close()


def test_the_example_app_lists_every_key_bayesfl_flower_sends():
    # `flwr run --run-config` refuses keys the app's pyproject.toml does not list: every
    # setting of `bayesfl run` and every deployment flag must be there, and the listed
    # defaults must parse
    import tomllib

    from bayesfl.cli import SETTINGS
    from bayesfl.flower.command import run_config
    from bayesfl.flower.local import EXAMPLE_APP
    from bayesfl.flower.options import deployment_flags

    listed = tomllib.loads((EXAMPLE_APP / "pyproject.toml").read_text())
    listed = listed["tool"]["flwr"]["app"]["config"]
    values = {"str": "x", "int": 1, "float": 0.5, "path": "p", "options": {"a": 1},
              "switch": True, "toggle": True, "list": ["rotate:15"]}
    settings = {s.target: values[s.kind] for s in SETTINGS if s.target != "progress"}
    sent = set(run_config(settings, Path("/tmp/out"))) | {f.key for f in deployment_flags()}
    assert sent - set(listed) == set()
    config, options = parse_run_config(listed)
    assert (config.strategy, config.clients, options.out) == ("fedlog", 3, None)


# ---- the whole ServerApp over an in-process federation (issue 27) ----------------------------
# The ClientApp's own handlers answer every step in this process, each node keeping its
# Context.state as a SuperNode does: FlowerServer.run() end to end in seconds, no processes.
SMALL = {"dataset": "gaussian_mixture", "clients": 3, "partition": "iid", "rounds": 2,
         "seed": 3, "body": "mlp:8", "feature-dim": 4, "local-epochs": 1,
         "dataset-option.n": 90, "dataset-option.num_classes": 3, "dataset-option.dim": 5}


class InProcessFederation:
    """A Grid whose nodes (node id 100 + partition id) run the ClientApp's handlers here.

    ``node_configs`` overrides a node's run config (a foreign node); ``node_config`` adds keys
    to every node's node config (``allows``: the data loaders they allow); ``silent`` nodes
    never answer; ``gone`` nodes go offline after their first fit."""

    def __init__(self, run_config, *, node_configs=None, silent=(), gone=(), failing=(),
                 garbage=(), state_dir=None, stop_at_push=None, node_config=None):
        from flwr.app import Context, RecordDict

        extra = {} if state_dir is None else {"state-dir": str(state_dir)}
        extra.update(node_config or {})
        self.contexts = {
            100 + k: Context(run_id=1, node_id=100 + k,
                             node_config={"partition-id": k,
                                          "num-partitions": run_config["clients"], **extra},
                             state=RecordDict(),
                             run_config=(node_configs or {}).get(k, run_config))
            for k in range(run_config["clients"])}
        self.silent, self.gone, self.offline = set(silent), set(gone), set()
        self.failing, self.garbage = set(failing), set(garbage)  # fit replies: error / junk
        self.replies, self.pushed, self.groups = {}, [], []
        self.stop_at_push, self.pushes = stop_at_push, 0  # the ServerApp "dies" there

    def get_node_ids(self):
        return [n for n in self.contexts if n not in self.offline]

    def push_messages(self, messages):
        from types import SimpleNamespace

        from bayesfl.flower import client_app
        from bayesfl.flower.protocol import CALIBRATE, INFO, ROUND, SHIFT

        handlers = {INFO: client_app.info, ROUND: client_app.round_step,
                    CALIBRATE: client_app.calibrate, SHIFT: client_app.shift}
        self.pushes += 1
        if self.pushes == self.stop_at_push:
            raise ServerStoppedError
        ids = []
        for message in messages:
            node, kind = message.metadata.dst_node_id, message.metadata.message_type
            self.pushed.append((node, kind))
            self.groups.append((kind, message.metadata.group_id))
            mid = f"m{len(self.pushed)}"
            ids.append(mid)
            if node - 100 in self.silent or node in self.offline:
                continue
            reply = handlers[kind](message, self.contexts[node])
            content, error = reply.content, None
            fit = kind == ROUND and "fit" in record_values(message.content)
            if fit and node - 100 in self.garbage:
                content = pack(upload=b"\x00garbage" * 10, round=int(message.metadata.group_id))
            if fit and node - 100 in self.failing:
                error = SimpleNamespace(code=3, reason="ClientApp raised\n  ValueError")
            self.replies[mid] = SimpleNamespace(
                content=content, has_error=lambda error=error: error is not None, error=error,
                metadata=SimpleNamespace(reply_to_message_id=mid))
            if fit and node - 100 in self.gone:
                self.offline.add(node)
        return ids

    def pull_messages(self, ids):
        return [self.replies.pop(i) for i in ids if i in self.replies]


class ServerStoppedError(Exception):
    """The in-process ServerApp stopped mid-run (as a killed process would)."""


@pytest.fixture
def task_identity(monkeypatch):
    from flwr.supercore.task_identity import TaskIdentity

    for key in ("_run_id", "_node_id", "_task_id"):  # what a ServerApp process has set
        monkeypatch.setattr(TaskIdentity, key, 1)


def serve(run_config, **federation):
    from bayesfl.flower.server_app import FlowerServer

    server = FlowerServer(None, run_config)
    server.grid = InProcessFederation(run_config, **federation)
    return server


def test_an_in_process_flower_run_equals_the_simulator(task_identity, tmp_path):
    out = tmp_path / "run"
    summary = serve({**SMALL, "strategy": "fedavg", "threads": 1, "out": str(out)}).run()
    sim = simulate("fedavg", dataset="gaussian_mixture", clients=3, partition="iid", rounds=2,
                   seed=3, body="mlp:8", feature_dim=4, local_epochs=1, progress=False,
                   batched=False, threads=1,
                   dataset_options={"n": 90, "num_classes": 3, "dim": 5})
    for key in ("ece", "accuracy", "nll", "brier", "bytes_up", "bytes_down", "floats_up",
                "floats_down"):
        assert summary[key] == pytest.approx(sim.summary[key], abs=1e-12), key
    assert summary["transport"] == "flower" and summary["personalized"] is False
    assert summary["events"] == [] and summary["rejections"] == []
    assert summary["rejected_uploads"] == 0 and summary["skipped_rounds"] == []
    assert summary["threads"] == 1
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [1, 2]
    assert [r["accepted"] for r in records] == [3, 3]
    assert summary["bytes_up"] == sum(r["bytes_up"] for r in records)
    assert json.loads((out / "summary.json").read_text()) == summary
    for name in ("manifest.json", "partition.txt", "partition.json", "accuracy.png",
                 "reliability.png", "checkpoint.safetensors"):
        assert (out / name).stat().st_size > 0, name
    partition = json.loads((out / "partition.json").read_text())
    assert partition["scheme"] == "iid" and partition["bodies"] == ["mlp:8"] * 3
    assert sum(partition["train_sizes"]) + sum(partition["test_sizes"]) == 90
    torch.testing.assert_close(server_state(out), sim.state, rtol=0, atol=1e-6)


def test_an_in_process_run_resumes_from_its_checkpoint_to_the_same_summary(task_identity,
                                                                          tmp_path):
    config = {**SMALL, "strategy": "fedavg", "threads": 1, "out": str(tmp_path / "run")}
    first = serve(config).run()
    again = serve({**config, "resume": True})
    summary = again.run()
    assert again.resumed_from == 2
    # no round is run again: only the final evaluation, whose figures are the same
    for key in ("ece", "accuracy", "nll", "bytes_up", "bytes_down"):
        assert summary[key] == first[key], key
    assert [m["round"] for m in again.metrics_log.records] == [1, 2]


def test_a_personalizing_strategy_personalizes_every_node_then_evaluates_that(task_identity):
    server = serve({**SMALL, "strategy": "fedbabu", "rounds": 1})
    summary = server.run()
    grid = server.grid
    kinds = [kind for _, kind in grid.pushed]
    assert summary["personalized"] is True
    # discovery, then one message per client and round: the fit of round 1, and the last one
    # (round 1's evaluation, the personalisation and the evaluation of the personalised state)
    assert kinds == ["query.info"] * 3 + ["train.round"] * 6


def test_foreign_silent_and_vanishing_nodes_are_logged_and_the_run_goes_on(task_identity):
    from bayesfl.errors import BayesFLError

    # node 0 runs another seed (its fingerprint differs): refused at discovery; node 1 never
    # answers (round-timeout 0.2 s); node 2 goes offline after its first fit. Round 1
    # aggregates node 2's upload alone (min-replies 1); round 2 has nobody left and is skipped
    config = {**SMALL, "strategy": "fedavg", "round-timeout": 0.2, "node-wait": 0.0,
              "poll-interval": 0.01}
    server = serve(config, node_configs={0: {**config, "seed": 4}}, silent={1}, gone={2})
    with pytest.raises(BayesFLError, match="no client returned an evaluation"):
        server.run()
    records = server.metrics_log.records
    assert [r["accepted"] for r in records] == [1, 0]
    assert records[1]["skipped"] == ("0 accepted upload(s) < min-replies 1: round skipped, "
                                     "previous state kept")
    first, second = ({(e["client_id"], e["node_id"], e["step"], e["reason"])
                      for e in r["events"]} for r in records)
    assert (0, 100, "discover", "the node's run fingerprint differs from the server's (other "
            "settings, data or bayesfl version)") in first
    assert {e["reason"] for e in records[0]["events"] if e["node_id"] == 101} \
        == {"discovery request to node 101 unanswered: no reply within 0.2 s"}
    assert {(0, None, "fit", "sampled client has no connected node"),
            (1, None, "fit", "sampled client has no connected node")} <= first
    # node 2's evaluation of round 1 would ride on round 2's message: it is gone by then
    assert records[0]["accuracy"] is None
    assert (2, 102, "discover", "node went offline") in second
    assert (2, None, "fit", "sampled client has no connected node") in second


def test_a_node_that_never_answers_skips_every_round_that_needs_all_uploads(task_identity,
                                                                             tmp_path):
    # min-replies 3: with node 1 silent no round has enough uploads; the two others still
    # evaluate, so the run ends with a summary that lists the skipped rounds and the events
    config = {**SMALL, "strategy": "fedavg", "round-timeout": 0.2, "node-wait": 0.0,
              "poll-interval": 0.01, "min-replies": 3}
    summary = serve(config, silent={1}).run()
    assert summary["skipped_rounds"] == [1, 2]
    assert {(e["round"], e["node_id"], e["step"], e["reason"]) for e in summary["events"]
            if e["node_id"] == 101} >= {(1, 101, "discover", "discovery request to node 101 "
                                                               "unanswered: no reply within 0.2 s")}
    assert [c["client_id"] for c in summary["per_client"]] == [0, 2]


def test_an_unanswered_discovery_request_is_logged_by_its_node_not_as_a_negative_client(
        task_identity):
    # node 1 never answers its discovery request: who it is stays unknown, so its event names
    # the node and no client (before: client -1, -2, ... for the requests' placeholder keys)
    config = {**SMALL, "strategy": "fedavg", "round-timeout": 0.2, "node-wait": 0.0,
              "poll-interval": 0.01}
    summary = serve(config, silent={1}).run()
    assert all(e["client_id"] is None or e["client_id"] >= 0 for e in summary["events"])
    asked = [e for e in summary["events"] if e["step"] == "discover"]  # asked again each round
    assert asked and {(e["client_id"], e["node_id"], e["reason"]) for e in asked} == {
        (None, 101, "discovery request to node 101 unanswered: no reply within 0.2 s")}


def test_a_resumed_run_says_so_in_its_manifest(task_identity, tmp_path):
    config = {**SMALL, "strategy": "fedavg", "threads": 1, "out": str(tmp_path / "run")}
    serve(config).run()
    serve({**config, "resume": True}).run()
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["resumed_from_round"] == 2 and manifest["transport"] == "flower"


def test_failing_junk_and_vanishing_replies_are_logged_with_their_node(task_identity):
    # one round: node 0's ClientApp raises (a Flower error reply), node 1 uploads junk bytes,
    # node 2 answers its fit and then goes offline before its evaluation reply (the last
    # message; noticed at the next check of the online nodes, 2 s later); every message
    # carries its round as the Flower group id
    config = {**SMALL, "strategy": "fedavg", "rounds": 1, "round-timeout": 10.0,
              "poll-interval": 0.01}
    server = serve(config, failing={0}, garbage={1}, gone={2})
    summary = server.run()
    (record,) = server.metrics_log.records
    events = {(e["client_id"], e["node_id"], e["step"]): e["reason"] for e in record["events"]}
    assert events[(0, 100, "fit")] == "Flower error 3: ClientApp raised ValueError"
    assert events[(1, 101, "fit")].startswith("not a bayesfl message")
    assert events[(2, 102, "evaluate")] == "node went offline before replying"
    assert record["accepted"] == 1 and record["accuracy"] is not None
    assert [c["client_id"] for c in summary["per_client"]] == [0, 1]
    assert [r["client_id"] for r in record["rejections"]] == [1]
    assert {group for kind, group in server.grid.groups if kind != "query.info"} == {"1"}


def test_a_round_record_carries_the_strategys_server_metrics(task_identity):
    server = serve({**SMALL, "strategy": "colearn", "rounds": 1})
    server.run()
    record = server.metrics_log.records[-1]
    assert record["round"] == 1 and record["prototype_spread"] > 0


# ---- Flower equals the simulator, one strategy of each family (issue 28) --------------------
def simulate_small(strategy: str, **extra: Any) -> Any:
    return simulate(strategy, dataset="gaussian_mixture", clients=3, partition="iid",
                    rounds=2, seed=3, body="mlp:8", feature_dim=4, local_epochs=1,
                    progress=False, batched=False, threads=1,
                    dataset_options={"n": 90, "num_classes": 3, "dim": 5}, **extra)


FIGURES = ("ece", "accuracy", "accuracy_pooled", "nll", "brier")


def assert_figures_equal(flower: dict[str, Any], sim: dict[str, Any], what: str) -> None:
    # both sides merge the same float64 accumulator sums of the same float32 predictions:
    # 1e-6 leaves room for a differently laid-out batch, far below any real difference
    for key in FIGURES:
        assert flower[key] == pytest.approx(sim[key], abs=1e-6), f"{what} {key}"
    assert [c["client_id"] for c in flower["per_client"]] == \
        [c["client_id"] for c in sim["per_client"]], what


@pytest.mark.parametrize("strategy", [
    "fedlog",   # FedLog: sufficient statistics, a posterior strategy with a round 0
    "fedper",   # parameter averaging with a personal head
    "fedsi",    # FedSI: the Gaussian body, personalisation on every node
    "fedpa",    # a whole-network Bayesian baseline
    "colearn",  # representation sharing
])
def test_each_family_on_flower_equals_the_simulator(task_identity, tmp_path, strategy):
    out = tmp_path / "run"
    summary = serve({**SMALL, "strategy": strategy, "threads": 1, "out": str(out),
                     "evaluate-every": 1}).run()
    sim = simulate_small(strategy)
    assert summary["events"] == [] and summary["rejections"] == []
    assert summary["personalized"] == sim.summary["personalized"]
    assert_figures_equal(summary, sim.summary, strategy)
    if "map_plugin" in sim.summary:
        for key in FIGURES:
            assert summary["map_plugin"][key] == pytest.approx(
                sim.summary["map_plugin"][key], abs=1e-6), f"map_plugin {key}"
    for key in ("bytes_up", "bytes_down", "floats_up", "floats_down"):
        assert summary[key] == sim.summary[key], key
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [m["round"] for m in sim.metrics]
    for flower_round, sim_round in zip(records, sim.metrics, strict=True):
        assert flower_round["accuracy"] == pytest.approx(sim_round["accuracy"], abs=1e-6)
        assert flower_round["ece"] == pytest.approx(sim_round["ece"], abs=1e-6)
    state = server_state(out)
    assert sorted(state) == sorted(sim.state)
    for name, tensor in sim.state.items():
        torch.testing.assert_close(state[name], tensor.cpu(), rtol=0, atol=1e-6,
                                   msg=f"server tensor {name!r}")


def test_calibrate_and_novel_clients_on_flower_equal_the_simulator(task_identity):
    # one client of three is novel (never trained, evaluated at the end); every training
    # client holds out 20 % of its training data to fit one temperature over messages
    summary = serve({**SMALL, "strategy": "fedlog", "threads": 1,
                     "calibrate": "temperature", "novel-fraction": 0.34}).run()
    sim = simulate_small("fedlog", calibrate="temperature", novel_fraction=0.34)
    assert summary["events"] == []
    assert_figures_equal(summary, sim.summary, "headline")
    assert summary["novel"]["clients"] == sim.summary["novel"]["clients"] != []
    assert_figures_equal(summary["novel"], sim.summary["novel"], "novel")
    flower, simulated = summary["calibration"], sim.summary["calibration"]
    assert flower["error"] is None and flower["participants"] == simulated["participants"]
    assert flower["temperature"] == pytest.approx(simulated["temperature"], rel=1e-6)
    for key in ("steps", "restarts", "held_out_samples", "bytes_up", "bytes_down"):
        assert flower[key] == simulated[key], key
    assert_figures_equal({**flower["calibrated"]}, simulated["calibrated"], "calibrated")
    assert flower["uncalibrated"] == pytest.approx(simulated["uncalibrated"], abs=1e-6)


# ---- a per-site data loader (issue 26) --------------------------------------------------------
SITE_APP = Path(__file__).parent / "flower_site_app"
SITES = {"strategy": "fedavg", "dataset": "digits", "clients": 3, "partition": "iid",
         "rounds": 1, "seed": 0, "body": "mlp:8", "feature-dim": 4, "local-epochs": 1,
         "threads": 1, "data-loader": "site_app.site_data:load"}
ALLOWS = {"data-loaders": "site_app.site_data:load site_app.site_data:other"}
"""Every site's node config: the loaders its operator allows runs to call on it."""


def test_a_data_seed_on_flower_equals_the_simulator(task_identity):
    # data-seed drives the data on every node and on the server (data set draws, partition,
    # calibrate hold-out, novel clients); seed the models: Flower equals the simulator with it
    extra = {"calibrate": "temperature", "novel_fraction": 0.34}
    summary = serve({**SMALL, "strategy": "fedlog", "threads": 1, "data-seed": 11,
                     "calibrate": "temperature", "novel-fraction": 0.34}).run()
    sim = simulate_small("fedlog", data_seed=11, **extra)
    assert summary["events"] == [] and summary["data_seed"] == sim.summary["data_seed"] == 11
    assert_figures_equal(summary, sim.summary, "headline")
    assert summary["novel"]["clients"] == sim.summary["novel"]["clients"]
    assert_figures_equal(summary["novel"], sim.summary["novel"], "novel")
    assert summary["calibration"]["temperature"] == pytest.approx(
        sim.summary["calibration"]["temperature"], rel=1e-6)
    # and the data seed is not the seed: the same run without it has other data
    assert simulate_small("fedlog", **extra).summary["data"] != sim.summary["data"]


def test_each_node_loads_its_own_site_data_with_the_run_configs_loader(task_identity,
                                                                       monkeypatch, tmp_path):
    # site k holds digits k, k+3, ... (599 each); it splits them 3:1 into train and test itself,
    # and reports only their sizes
    monkeypatch.syspath_prepend(str(SITE_APP))
    out = tmp_path / "run"
    summary = serve({**SITES, "out": str(out)}, node_config=ALLOWS).run()
    assert summary["events"] == [] and summary["rejections"] == []
    assert [c["count"] for c in summary["per_client"]] == [150, 150, 150]
    partition = json.loads((out / "partition.json").read_text())
    assert partition["scheme"] == "per-site"
    assert partition["train_sizes"] == [449, 449, 449]
    assert partition["test_sizes"] == [150, 150, 150]
    assert 0.0 < summary["accuracy"] <= 1.0


def test_a_node_with_another_data_loader_is_refused(task_identity, monkeypatch):
    monkeypatch.syspath_prepend(str(SITE_APP))
    other = {**SITES, "data-loader": "site_app.site_data:other"}
    server = serve(SITES, node_configs={0: other}, node_config=ALLOWS)
    events = server.channel.discover(wait=False)
    assert sorted(server.nodes) == [1, 2]
    assert [(e["client_id"], e["step"]) for e in events] == [(0, "discover")]
    assert "fingerprint differs" in events[0]["reason"]


def test_a_node_refuses_a_data_loader_its_node_config_does_not_allow(task_identity,
                                                                      monkeypatch):
    # the run config names the loader, but which code a site runs is its operator's call:
    # node 0 allows no loader, node 1 another one, node 2 this one. Nodes 0 and 1 refuse (and
    # import nothing: the refusal comes before the loader is looked at); the server logs
    # their reasons and the run goes on with node 2
    monkeypatch.syspath_prepend(str(SITE_APP))
    imported = []
    from bayesfl import user_code

    real = user_code.import_object
    monkeypatch.setattr(user_code, "import_object",
                        lambda name, **kw: imported.append(name) or real(name, **kw))
    server = serve({**SITES, "node-wait": 0.0, "round-timeout": 30.0})
    grid = server.grid
    grid.contexts[101].node_config["data-loaders"] = "site_app.site_data:other"
    grid.contexts[102].node_config["data-loaders"] = "site_app.site_data:load"
    summary = server.run()
    assert sorted(server.nodes) == [2] and imported == ["site_app.site_data:load"]
    refusals = {e["client_id"]: e["reason"] for e in summary["events"]
                if e["step"] == "discover"}
    assert sorted(refusals) == [0, 1]
    for reason in refusals.values():
        assert reason.startswith("the node refused the run: this node does not allow the data "
                                 "loader 'site_app.site_data:load'"), reason
        assert "data-loaders=" in reason  # says how to allow it
    assert "allows: none" in refusals[0] and "allows: site_app.site_data:other" in refusals[1]
    assert [c["client_id"] for c in summary["per_client"]] == [2]
    # a refused node is asked once: its refusal is logged once
    assert len([e for e in summary["events"] if e["step"] == "discover"]) == 2


def test_a_node_allows_loaders_by_its_node_config_alone():
    from bayesfl.errors import LoaderRefused
    from bayesfl.flower.client_app import allowed_loader

    loader = "site_app.site_data:load"
    assert allowed_loader({"data-loader": ""}, {}) is None  # the run's named data set
    assert allowed_loader({}, {}) is None
    assert allowed_loader({"data-loader": loader}, {"data-loaders": f"a.b:c,{loader}"}) == loader
    for node in ({}, {"data-loaders": ""}, {"data-loaders": "site_app.site_data:other"},
                 {"data-loaders": 3}, {"data-loaders": "site_app.site_data"}):
        with pytest.raises(LoaderRefused, match="does not allow the data loader"):
            allowed_loader({"data-loader": loader}, node)
    # the run config cannot allow it itself: only the node config counts
    with pytest.raises(LoaderRefused):
        allowed_loader({"data-loader": loader, "data-loaders": loader}, {})


def test_a_data_loader_must_name_a_module_and_a_function():
    with pytest.raises(ConfigError, match=r"package\.module:function"):
        parse_run_config({**SITES, "data-loader": "site_app.site_data"})
    with pytest.raises(ConfigError, match="calibrate"):
        parse_run_config({**SITES, "calibrate": "temperature"})


@pytest.mark.flower
@pytest.mark.slow  # ~1-3 minutes: three SuperNodes, two messages each
def test_real_supernodes_load_their_site_data_as_the_in_process_nodes_do(task_identity,
                                                                         monkeypatch,
                                                                         tmp_path):
    # SuperNode 0's operator allows no loader (flower-supernode --node-config without
    # data-loaders): it refuses the run at discovery, the ServerApp records why (summary.json
    # events) and the run completes with the two sites that allow it, as in process
    out = tmp_path / "run"
    with LocalFederation(3, start_timeout=300.0, node_config=ALLOWS,
                         node_configs={0: {"data-loaders": ""}}) as fed:
        status = fed.run({**SITES, "out": str(out), "round-timeout": 400.0,
                          "node-wait": 300.0}, app=SITE_APP, timeout=RUN_TIMEOUT)
    assert status.completed, (status.status, status.details)
    summary = json.loads((out / "summary.json").read_text())
    ((cid, reason),) = [(e["client_id"], e["reason"]) for e in summary["events"]
                        if e["step"] == "discover"]
    assert cid == 0 and {(e["client_id"], e["reason"]) for e in summary["events"]
                         if e["step"] != "discover"} == {(0, "sampled client has no connected "
                                                             "node")}, summary["events"]
    assert reason.startswith("the node refused the run: this node does not allow the data "
                             "loader 'site_app.site_data:load' the run config names (its node "
                             "config allows: none)"), reason
    assert [c["client_id"] for c in summary["per_client"]] == [1, 2]
    monkeypatch.syspath_prepend(str(SITE_APP))
    server = serve(SITES, node_config=ALLOWS)
    server.grid.contexts[100].node_config["data-loaders"] = ""
    here = server.run()
    assert [(e["client_id"], e["step"], e["reason"]) for e in here["events"]] == \
        [(e["client_id"], e["step"], e["reason"]) for e in summary["events"]]
    for key in FIGURES:
        assert summary[key] == pytest.approx(here[key], abs=1e-9), key


def test_a_resumed_flower_run_reproduces_the_uninterrupted_one(task_identity, tmp_path):
    # FedLog's clients keep their own bodies from round to round. The first run stops when it
    # pushes its last message (pushes: discovery, rounds 0, 1, 2, final): its checkpoint holds
    # round 1, and the nodes have trained round 2. The resumed run is a new Flower run (fresh
    # Context.state); each node goes on from its state of round 1 kept in its state-dir
    config = {**SMALL, "strategy": "fedlog", "threads": 1, "evaluate-every": 1}
    whole = serve({**config, "out": str(tmp_path / "whole")},
                  state_dir=tmp_path / "whole-nodes").run()
    out, nodes = str(tmp_path / "run"), tmp_path / "nodes"
    with pytest.raises(ServerStoppedError):
        serve({**config, "out": out}, state_dir=nodes, stop_at_push=5).run()
    resumed = serve({**config, "out": out, "resume": True}, state_dir=nodes)
    summary = resumed.run()
    assert resumed.resumed_from == 1 and summary["events"] == []
    for key in FIGURES:  # the same operations on the same numbers: equal
        assert summary[key] == whole[key], key
    assert [m["round"] for m in resumed.metrics_log.records] == [0, 1, 2]
    torch.testing.assert_close(server_state(tmp_path / "run"),
                               server_state(tmp_path / "whole"), rtol=0, atol=0)


def test_a_node_without_a_state_dir_says_its_client_starts_again(task_identity, tmp_path):
    config = {**SMALL, "strategy": "fedlog", "threads": 1, "out": str(tmp_path / "run")}
    with pytest.raises(ServerStoppedError):
        serve(config, stop_at_push=5).run()
    summary = serve({**config, "resume": True}).run()
    assert {(e["client_id"], e["step"]) for e in summary["events"]} == \
        {(0, "resume"), (1, "resume"), (2, "resume")}
    assert all("initial state" in e["reason"] for e in summary["events"])


@pytest.mark.flower
@pytest.mark.slow  # ~2-5 minutes: three SuperNodes, about ten calibration messages each
def test_calibrate_novel_clients_and_shift_evaluation_on_supernodes_equal_the_simulator(
        federation, tmp_path):
    # One deployment run carries the three steps that end a run, each against the simulator
    # run of the same settings: the calibration step, the novel clients, and the shift
    # evaluation (issue 40: each site scores its own final state on its own rows and replies
    # with mergeable states only; test_flower_shift.py tests the rest in process). They were
    # two runs (calibration and novel clients; novel clients and the shift evaluation, one
    # round), each a minute or two of Flower processes; each step's figures are compared on
    # their own, so a step that went wrong on Flower still fails here by name.
    from test_flower_shift import assert_reports_equal

    from bayesfl.shift_protocol import stored_shift_report

    out = tmp_path / "run"
    summary = run_on_flower(federation, out, "fedlog", 2, calibrate="temperature",
                            shift="rotate:30", ood="novel-clients", **{"novel-fraction": 0.34})
    sim = simulate("fedlog", rounds=2, clients=3, partition="iid", seed=0, local_epochs=1,
                   progress=False, batched=False, threads=1, calibrate="temperature",
                   novel_fraction=0.34, shift=["rotate:30"], ood=["novel-clients"])
    assert summary["events"] == [] and summary["shift_evaluation"]["rejections"] == []
    assert summary["novel"]["clients"] == sim.summary["novel"]["clients"] != []
    assert_figures_equal(summary["novel"], sim.summary["novel"], "novel")
    flower, simulated = summary["calibration"], sim.summary["calibration"]
    assert flower["temperature"] == pytest.approx(simulated["temperature"], rel=1e-6)
    assert_figures_equal(flower["calibrated"], simulated["calibrated"], "calibrated")
    assert_reports_equal(stored_shift_report(out), sim.shift_report)
    assert summary["shift_evaluation"]["bytes_up"] == \
        sim.summary["shift_evaluation"]["bytes_up"]


def test_a_done_marker_counts_only_when_written_after_the_submission(tmp_path):
    # LocalFederation.run asks `flwr ls` (1.5 s of CPU each) once the ServerApp's summary.json is
    # written anew: a summary left by an earlier run in the same directory must not count.
    from bayesfl.flower.local import _written_since

    marker = tmp_path / "summary.json"
    assert not _written_since(marker, time.time()) and not _written_since(None, 0.0)
    marker.write_text("{}")
    written = marker.stat().st_mtime
    assert _written_since(marker, written) and not _written_since(marker, written + 1.0)


# ---- one client step for every transport (issue 42) -----------------------------------------
STRATEGY_METHODS = ("fit", "fit_group", "personalize", "evaluate", "evaluate_group")


def client_step_callers(run) -> set[tuple[str, Any]]:
    """Run ``run()`` and return (method, caller's code) of every call of a strategy's client
    half (`STRATEGY_METHODS`) from outside ``bayesfl/strategies`` (a strategy's own
    ``fit_group`` calling its ``fit`` is inside): who drives the client half."""
    import sys

    strategies = str(Path(__file__).resolve().parents[2] / "bayesfl" / "strategies")
    seen: set[tuple[str, Any]] = set()

    def profile(frame, event, arg):
        code = frame.f_code
        if event == "call" and code.co_name in STRATEGY_METHODS \
                and code.co_filename.startswith(strategies):
            back = frame.f_back
            while "/torch/" in back.f_code.co_filename:  # a decorator's wrapper (no_grad)
                back = back.f_back
            caller = back.f_code
            if not caller.co_filename.startswith(strategies):
                seen.add((code.co_name, caller))

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return seen


def test_the_simulator_and_the_flower_client_app_call_the_same_client_step(task_identity):
    # FedBABU personalises: fit, personalise and evaluate all run. Every call of the client
    # half, in the simulator's executor and in the Flower ClientApp's handlers, comes from the
    # functions of bayesfl.client.step, and from the same ones on both transports
    from bayesfl.client import step

    simulated = client_step_callers(lambda: simulate_small("fedbabu"))
    on_flower = client_step_callers(
        lambda: serve({**SMALL, "strategy": "fedbabu", "threads": 1}).run())
    assert simulated == on_flower
    assert {caller for _, caller in on_flower} == {
        step.fit_clients.__code__, step.personalize_clients.__code__,
        step.evaluate_clients.__code__}


DIVERGING = {**SITES, "data-loader": "site_app.site_data:overflowing", "rounds": 2,
             "evaluate-every": 1, "body": "mlp:200"}
"""Site 0's digit-3 inputs overflow (3e38): its training loss is non-finite every round (Adam
keeps the weights small, so it takes a hidden unit overflowing float32: with 200 of them one
does from the first mini-batch; mlp:8's logits stay finite, about 4e37)."""


def assert_diverged_client_sent_nothing(records: list[dict[str, Any]]) -> None:
    """What the simulator's divergence tests assert (tests/bayesfl/test_simulate.py): every
    round the diverging client (0) is rejected with the guard's reason and sent 0 bytes, the
    others' uploads are accepted."""
    import re

    assert [r["round"] for r in records] == [1, 2]
    for record in records:
        (rejection,) = record["rejections"]
        assert rejection["client_id"] == 0
        assert re.match(r"upload not sent: local training loss became (nan|inf) at epoch 1 of "
                        r"1, mini-batch \d+, and training stopped there; lower the learning "
                        r"rate", rejection["reason"]), rejection["reason"]
        assert record["accepted"] == 2 and record["bytes_up_per_client"][0] == 0
        assert all(b > 0 for b in record["bytes_up_per_client"][1:])


def test_a_diverging_client_on_flower_sends_nothing_as_in_the_simulator(task_identity,
                                                                        monkeypatch):
    from safetensors.torch import load as load_tensors

    monkeypatch.syspath_prepend(str(SITE_APP))
    server = serve(DIVERGING, node_config={"data-loaders": DIVERGING["data-loader"]})
    summary = server.run()
    assert_diverged_client_sent_nothing(server.metrics_log.records)
    assert summary["rejected_uploads"] == 2
    # its round undone: the state the node keeps is its initial one, nothing non-finite
    record = server.grid.contexts[100].state.config_records.get("bayesfl-state")
    assert record is None or "trained" not in record
    for cid in (1, 2):
        trained = load_tensors(server.grid.contexts[100 + cid].state.config_records[
            "bayesfl-state"]["trained"])
        assert all(bool(t.isfinite().all()) for t in trained.values() if t.is_floating_point())
    # its own test rows overflow too: each of its evaluations fails, is reported, and the run
    # goes on with the two others; the only other events are its rejected uploads
    assert {(e["client_id"], e["step"]) for e in summary["events"]} == \
        {(0, "evaluate"), (0, "fit")}, summary["events"]
    assert all(e["reason"].startswith("upload not sent: ") for e in summary["events"]
               if e["step"] == "fit")
    assert [c["client_id"] for c in summary["per_client"]] == [1, 2]


@pytest.mark.flower
@pytest.mark.slow  # ~1-3 minutes: three SuperNodes, three messages each
def test_a_diverging_client_on_real_supernodes_sends_nothing(task_identity, monkeypatch,
                                                             tmp_path):
    out = tmp_path / "run"
    with LocalFederation(3, start_timeout=300.0,
                         node_config={"data-loaders": DIVERGING["data-loader"]}) as fed:
        status = fed.run({**DIVERGING, "out": str(out), "round-timeout": 400.0,
                          "node-wait": 300.0}, app=SITE_APP, timeout=RUN_TIMEOUT,
                         done_marker=out / "summary.json")
    assert status.completed, (status.status, status.details)
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert_diverged_client_sent_nothing(records)
    monkeypatch.syspath_prepend(str(SITE_APP))
    here = serve(DIVERGING, node_config={"data-loaders": DIVERGING["data-loader"]}).run()
    for key in FIGURES:
        assert summary[key] == pytest.approx(here[key], abs=1e-9), key
