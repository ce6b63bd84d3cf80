"""FedLog's server state: one stacked tensor per kind of per-client value, indexed by client id.

The stacks (``latest/<upload tensor>``, ``latest/present``, ``declared``) have a row for each
of the run's clients, so the engine's check of a resumed state against a fresh one refuses
every layout a run of this configuration cannot have written: other rows (a client that is
not this run's), another dtype, non-finite values, and the former per-client layout. A resumed
run with absent clients equals the uninterrupted one.
"""

import json
import shutil
from dataclasses import replace

import pytest
import torch
from strategy_helpers import context, run_round

from bayesfl.checkpoint import load_checkpoint, save_checkpoint
from bayesfl.errors import CheckpointError
from bayesfl.messages import Message, read_safetensors_metadata
from bayesfl.simulate import CHECKPOINT_NAME, simulate
from bayesfl.strategies import make_strategy

# 4 clients, 4 classes, 8 features: statistics (4, 9) per client, (4, 4, 9) stacked
SMALL = dict(
    dataset="gaussian_mixture", clients=4, partition="shards:2", rounds=3, seed=3,
    body="mlp:16", feature_dim=8, local_epochs=1, batch_size=16, lr=1e-2, progress=False,
    fraction=0.5, dataset_options={"num_classes": 4, "dim": 10, "n": 320, "separation": 4.0},
)


def test_the_fresh_state_has_a_row_per_client_and_none_present():
    strategy = make_strategy("fedlog", context(sizes=(5, 6, 7)), feature_scale="evidence")
    state = strategy.init()
    C, m = strategy.num_classes, strategy.m
    assert state["latest/statistics"].shape == (3, C, m)
    assert state["latest/statistics"].dtype == torch.float32  # the upload's dtype
    assert state["latest/num_samples"].shape == (3, 1)
    assert state["latest/square_sum"].shape == (3, 1)
    assert state["latest/present"].tolist() == [False, False, False]
    assert state["declared"].tolist() == [0, 0, 0]
    assert not any(k.count("/") > 1 for k in state)  # no tensor per client


def test_omit_keeps_the_ledger_only_and_local_dp_no_ledger():
    omit = make_strategy("fedlog", context(), absent_clients="omit").init()
    assert "declared" in omit and not any(k.startswith("latest/") for k in omit)
    local = make_strategy("fedlog-dp-local", context(), epsilon=50.0).init()
    assert "declared" not in local and local["latest/present"].shape == (3,)


def test_the_ledger_keeps_each_clients_first_accepted_count(build):
    strategy, clients, state = build("fedlog")
    state, ups0 = run_round(strategy, clients, state, 0)
    first = [int(u.tensors["num_samples"]) for u in ups0]
    assert state["declared"].tolist() == first
    state, _ = run_round(strategy, clients[:2], state, 1)
    assert state["declared"].tolist() == first


def test_aggregate_leaves_the_previous_state_as_it_was(build):
    # the engine keeps the previous state when a new aggregate fails: it must be untouched
    strategy, clients, state = build("fedlog")
    state, _ = run_round(strategy, clients, state, 0)
    before = {k: v.clone() for k, v in state.items()}
    run_round(strategy, clients[:2], state, 1)
    for name, value in before.items():
        assert torch.equal(state[name], value), name


def test_an_upload_of_a_client_the_run_does_not_have_is_rejected(build):
    strategy, clients, state = build("fedlog")
    plan = strategy.configure(state, 0)
    upload = strategy.fit(clients[0].config, clients[0].state, clients[0].data,
                          plan.broadcast, torch.Generator().manual_seed(0))[1]
    forged = Message(replace(upload.header, client_id=7), upload.tensors)
    (reason,) = strategy.upload_problems(plan, [forged])
    assert reason == "client id 7 is not one of this run's clients (0 to 2)"


def stop_after(round_):
    def callback(r, record):
        if r == round_:
            raise KeyboardInterrupt(f"stopped after round {round_}")
    return callback


@pytest.fixture(scope="module")
def cut(tmp_path_factory):
    """A FedLog run (half the clients a round, so some are absent) stopped after round 1."""
    out = tmp_path_factory.mktemp("fedlog_state") / "cut"
    with pytest.raises(KeyboardInterrupt):
        simulate("fedlog", out=out, round_callback=stop_after(1), **SMALL)
    return out


def numbers(run_dir):
    return [{k: v for k, v in json.loads(line).items() if not k.startswith("seconds")}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_resumed_run_with_absent_clients_equals_the_uninterrupted_one(cut, tmp_path):
    full = tmp_path / "full"
    simulate("fedlog", out=full, **SMALL)
    resumed = tmp_path / "resumed"
    shutil.copytree(cut, resumed)
    simulate("fedlog", out=resumed, resume=True, **SMALL)
    assert numbers(resumed) == numbers(full)
    assert [m["accepted"] for m in numbers(full)][1:] == [2, 2, 2]  # 2 of 4 clients absent


def fingerprint(run_dir):
    return read_safetensors_metadata((run_dir / CHECKPOINT_NAME).read_bytes())[
        "bayesfl.fingerprint"]


def forge(run_dir, change):
    """Re-sign the checkpoint with its server tensors (names without ``server/``) and keys
    changed by ``change(server) -> server`` (a digest-valid forgery: the digest has no key)."""
    path, fp = run_dir / CHECKPOINT_NAME, fingerprint(run_dir)
    tensors, meta = load_checkpoint(path, fingerprint=fp)
    server = change({k[len("server/"):]: v for k, v in tensors.items()
                     if k.startswith("server/")})
    tensors = {k: v for k, v in tensors.items() if not k.startswith("server/")}
    tensors.update({f"server/{k}": v for k, v in server.items()})
    save_checkpoint(path, tensors, {**meta, "server_keys": sorted(server)}, fingerprint=fp)


def replaced(name, change):
    return lambda server: {**server, name: change(server[name])}


def nan_row(tensor):
    tensor = tensor.clone()
    tensor[1, 0, 0] = float("nan")
    return tensor


def former_layout(server):
    """The layout before the stacks: a tensor per client and kind."""
    out = {k: v for k, v in server.items() if not k.startswith(("latest/", "declared"))}
    for cid in server["latest/present"].nonzero().flatten().tolist():
        out[f"latest/{cid}/statistics"] = server["latest/statistics"][cid]
        out[f"latest/{cid}/num_samples"] = server["latest/num_samples"][cid]
        out[f"declared/{cid}"] = server["declared"][cid]
    return out


@pytest.mark.parametrize(("change", "expected"), [
    (replaced("latest/present", lambda t: t.long()),
     "server tensor 'latest/present' is torch.int64, this run's is torch.bool"),
    (replaced("declared", lambda t: t[:3]),
     "server tensor 'declared' has shape (3,), this run's has (4,)"),
    (replaced("latest/num_samples", lambda t: t.reshape(-1)),
     "server tensor 'latest/num_samples' has shape (4,), this run's has (4, 1)"),
    (replaced("latest/statistics", lambda t: t.double()),
     "server tensor 'latest/statistics' is torch.float64, this run's is torch.float32"),
    (replaced("latest/statistics", nan_row),
     "server tensor 'latest/statistics' has 1 non-finite value(s) of 144"),
    (lambda server: {k: v for k, v in server.items() if k != "latest/statistics"},
     "server tensor 'latest/statistics' is missing"),
    (former_layout, "server tensor 'latest/present' is missing"),
])
def test_a_malformed_or_former_layout_is_refused_naming_the_tensor(cut, tmp_path, change,
                                                                    expected):
    out = tmp_path / "run"
    shutil.copytree(cut, out)
    forge(out, change)
    with pytest.raises(CheckpointError, match="not written by this run") as info:
        simulate("fedlog", out=out, resume=True, **SMALL)
    assert expected in str(info.value) and "--force" in str(info.value)
