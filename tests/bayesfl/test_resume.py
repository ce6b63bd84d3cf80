"""Resuming a run: the checkpoint vouches for the metrics, the data and the configuration.

Whatever happened to ``metrics.jsonl`` after a round was checkpointed (a torn last line, a line
without ``"round"``, deletion, edits), a resume writes exactly the file and the summary of an
uninterrupted run. A checkpoint that is not this run's (another configuration, other data, a
round the configuration cannot have, a device file, deep JSON) is a CheckpointError that says
what differs and what to do.
"""

import importlib
import json
import os
import shutil
import struct

import pytest
import torch

from bayesfl.checkpoint import load_checkpoint, save_checkpoint
from bayesfl.data.datasets import Dataset, dataset_identity, load_dataset
from bayesfl.errors import CheckpointError
from bayesfl.simulate import CHECKPOINT_NAME, simulate

SMALL = dict(
    dataset="gaussian_mixture", clients=4, partition="shards:2", rounds=3, seed=3,
    body="mlp:16", feature_dim=8, local_epochs=1, batch_size=16, lr=1e-2, progress=False,
    dataset_options={"num_classes": 4, "dim": 10, "n": 320, "separation": 4.0},
)


def numbers(records):
    """Records without wall-clock times."""
    if isinstance(records, dict):
        return {k: numbers(v) for k, v in records.items() if not k.startswith("seconds")}
    if isinstance(records, list):
        return [numbers(r) for r in records]
    return records


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def summary_numbers(run_dir):
    return numbers(json.loads((run_dir / "summary.json").read_text()))


def stop_after(round_):
    def callback(r, record):
        if r == round_:
            raise KeyboardInterrupt(f"stopped after round {round_}")
    return callback


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """An uninterrupted run: what every resumed run must equal."""
    out = tmp_path_factory.mktemp("full")
    simulate("fedavg", out=out, **SMALL)
    return out


@pytest.fixture
def cut(tmp_path):
    """The same run stopped after round 1 (its checkpoint is of round 1)."""
    out = tmp_path / "cut"
    with pytest.raises(KeyboardInterrupt):
        simulate("fedavg", out=out, round_callback=stop_after(1), **SMALL)
    return out


def test_kill_then_resume_equals_an_uninterrupted_run(full, cut):
    simulate("fedavg", out=cut, resume=True, **SMALL)
    assert numbers(read_metrics(cut)) == numbers(read_metrics(full))
    assert summary_numbers(cut) == summary_numbers(full)


@pytest.mark.parametrize("damage", [
    "torn_last_line", "line_without_round", "deleted", "emptied", "later_round_appended",
    "edited_accuracy", "binary_garbage",
])
def test_damaged_metrics_are_rebuilt_from_the_checkpoint(full, cut, damage):
    path = cut / "metrics.jsonl"
    text = path.read_text()
    if damage == "torn_last_line":
        path.write_text(text + text.splitlines()[0][:50])  # a crash mid-write of round 2
    elif damage == "line_without_round":
        path.write_text(text + json.dumps({"accuracy": 1.0}) + "\n")
    elif damage == "deleted":
        path.unlink()
    elif damage == "emptied":
        path.write_text("")
    elif damage == "later_round_appended":
        path.write_text(text + json.dumps({**json.loads(text.splitlines()[0]), "round": 2})
                        + "\n")
    elif damage == "edited_accuracy":
        first = json.loads(text.splitlines()[0])
        first.update(accuracy=1.0, bytes_up=1)
        path.write_text(json.dumps(first) + "\n" + "\n".join(text.splitlines()[1:]) + "\n")
    else:
        path.write_bytes(b"\xff\x00" * 100)
    resumed = simulate("fedavg", out=cut, resume=True, **SMALL)
    assert numbers(read_metrics(cut)) == numbers(read_metrics(full))
    assert summary_numbers(cut) == summary_numbers(full)
    # the byte totals and the best round come from the rounds the checkpoint vouches for
    assert resumed.summary["bytes_up"] == sum(m["bytes_up"] for m in read_metrics(full))


def test_a_finished_run_resumes_to_the_same_summary(full, tmp_path):
    out = tmp_path / "again"
    simulate("fedavg", out=out, **SMALL)
    (out / "metrics.jsonl").unlink()
    simulate("fedavg", out=out, resume=True, **SMALL)
    assert numbers(read_metrics(out)) == numbers(read_metrics(full))
    assert summary_numbers(out) == summary_numbers(full)


def _rewrite_meta(path, fingerprint, **changes):
    """Re-sign the checkpoint at ``path`` with its meta changed (as a forger could: the
    digest has no key)."""
    tensors, meta = load_checkpoint(path, fingerprint=fingerprint)
    save_checkpoint(path, tensors, {**meta, **changes}, fingerprint=fingerprint)


def _fingerprint(run_dir):
    from bayesfl.messages import read_safetensors_metadata

    return read_safetensors_metadata((run_dir / CHECKPOINT_NAME).read_bytes())[
        "bayesfl.fingerprint"]


@pytest.mark.parametrize(("changes", "expected"), [
    ({"round": 7}, "its round is 7, outside this run's rounds 1 to 3"),
    ({"round": -1}, "its round is -1"),
    ({"round": True}, "its round is True"),
    ({"round": "2"}, "its round is '2'"),
    ({"seconds": "soon"}, "elapsed seconds 'soon'"),
    ({"format": 2}, "format 2, this version writes 3"),
    ({"server_keys": ["no_such_tensor"]}, "does not hold this run's state"),
])
def test_a_checkpoint_this_run_cannot_have_written_is_refused(cut, changes, expected):
    _rewrite_meta(cut / CHECKPOINT_NAME, _fingerprint(cut), **changes)
    with pytest.raises(CheckpointError, match="not written by this run") as info:
        simulate("fedavg", out=cut, resume=True, **SMALL)
    assert expected in str(info.value) and "--force" in str(info.value)


def test_a_client_state_of_the_wrong_shape_is_refused(cut):
    path = cut / CHECKPOINT_NAME
    fingerprint = _fingerprint(cut)
    tensors, meta = load_checkpoint(path, fingerprint=fingerprint)
    # the clients' states are stacked (engine/state.py): each client's row of one tensor
    # gets the wrong shape, client 0's included
    name = next(k for k in tensors if k.startswith("clients/0/state/"))
    tensors[name] = torch.zeros(len(tensors["clients/0/ids"]), 3)
    save_checkpoint(path, tensors, meta, fingerprint=fingerprint)
    with pytest.raises(CheckpointError, match="client 0's tensors differ from its layout"):
        simulate("fedavg", out=cut, resume=True, **SMALL)


@pytest.fixture(scope="module")
def fedlog_cut(tmp_path_factory):
    """A FedLog run stopped after round 1 (its server state holds the head, the summed
    statistics and every client's latest statistics); tests forge copies of it."""
    out = tmp_path_factory.mktemp("fedlog") / "cut"
    with pytest.raises(KeyboardInterrupt):
        simulate("fedlog", out=out, round_callback=stop_after(1), **SMALL)
    return out


def _forge_server_tensor(run_dir, name, change):
    """Re-sign the checkpoint in ``run_dir`` with server tensor ``name`` replaced by
    ``change(tensor)`` (a digest-valid forgery: the digest has no key)."""
    path = run_dir / CHECKPOINT_NAME
    fingerprint = _fingerprint(run_dir)
    tensors, meta = load_checkpoint(path, fingerprint=fingerprint)
    tensors[f"server/{name}"] = change(tensors[f"server/{name}"])
    save_checkpoint(path, tensors, meta, fingerprint=fingerprint)


def _nan_first(tensor):
    tensor = tensor.clone()
    tensor.view(-1)[0] = float("nan")
    return tensor


@pytest.mark.parametrize(("name", "change", "expected"), [
    ("head", lambda t: torch.zeros(t.shape[0] + 1, t.shape[1]),
     "server tensor 'head' has shape (5, 9), this run's has (4, 9)"),
    ("head", lambda t: t.double(), "server tensor 'head' is torch.float64, this run's is "
                                   "torch.float32"),
    ("statistics", _nan_first, "server tensor 'statistics' has 1 non-finite value(s) of 36"),
    ("latest/statistics", lambda t: t[:, :, :3], "server tensor 'latest/statistics' has "
     "shape (4, 4, 3), this run's has (4, 4, 9)"),
    # rows for clients this run does not have (ids 4 to 9)
    ("latest/statistics", lambda t: torch.cat([t, t[:1].expand(6, -1, -1)]),
     "server tensor 'latest/statistics' has shape (10, 4, 9), this run's has (4, 4, 9)"),
])
def test_a_server_state_that_a_fresh_run_could_not_have_is_refused_naming_the_tensor(
        fedlog_cut, tmp_path, name, change, expected):
    out = tmp_path / "fedlog"
    shutil.copytree(fedlog_cut, out)
    _forge_server_tensor(out, name, change)
    with pytest.raises(CheckpointError, match="not written by this run") as info:
        simulate("fedlog", out=out, resume=True, **SMALL)
    assert expected in str(info.value) and "--force" in str(info.value)


@pytest.mark.parametrize(("change", "expected"), [
    (lambda t: torch.tensor([int(t), 1, 1]), "server tensor 'declared/0' is torch.int64 of "
     "shape (3,); a declared sample count is a torch.int64 scalar"),
    (lambda t: t.double(), "server tensor 'declared/0' is torch.float64 of shape (); a "
     "declared sample count is a torch.int64 scalar"),
    (lambda t: torch.tensor(-5), "server tensor 'declared/0' declares -5 samples; a declared "
     "sample count is at least 1"),
])
def test_a_forged_declared_sample_count_is_refused_by_shape_and_dtype(cut, change, expected):
    # the ledger of first declared counts (bayesfl/strategies/robust.py) is added as the run
    # goes: no fresh-state counterpart checks it, so its own rule does
    _forge_server_tensor(cut, "declared/0", change)
    with pytest.raises(CheckpointError, match="not written by this run") as info:
        simulate("fedavg", out=cut, resume=True, **SMALL)
    assert expected in str(info.value) and "--force" in str(info.value)


def test_a_declared_sample_count_of_a_client_this_run_has_not_is_refused(cut):
    path, fingerprint = cut / CHECKPOINT_NAME, _fingerprint(cut)
    tensors, meta = load_checkpoint(path, fingerprint=fingerprint)
    tensors["server/declared/9"] = torch.tensor(5)
    save_checkpoint(path, tensors, {**meta, "server_keys": [*meta["server_keys"], "declared/9"]},
                    fingerprint=fingerprint)
    with pytest.raises(CheckpointError, match="server tensor 'declared/9' names no client of "
                                              r"this run \(0 to 3\)"):
        simulate("fedavg", out=cut, resume=True, **SMALL)


def test_a_missing_server_tensor_is_named(cut):
    path, fingerprint = cut / CHECKPOINT_NAME, _fingerprint(cut)
    tensors, meta = load_checkpoint(path, fingerprint=fingerprint)
    name = meta["server_keys"][0]
    save_checkpoint(path, {k: v for k, v in tensors.items() if k != f"server/{name}"},
                    {**meta, "server_keys": meta["server_keys"][1:]}, fingerprint=fingerprint)
    with pytest.raises(CheckpointError, match=f"server tensor '{name}' is missing"):
        simulate("fedavg", out=cut, resume=True, **SMALL)


def test_a_checkpoint_symlinked_to_a_device_is_refused_without_reading_it(cut):
    (cut / CHECKPOINT_NAME).unlink()
    os.symlink("/dev/zero", cut / CHECKPOINT_NAME)
    with pytest.raises(CheckpointError, match="is a character device, not a regular file"):
        simulate("fedavg", out=cut, resume=True, **SMALL)


def test_a_deeply_nested_checkpoint_header_is_a_checkpoint_error(cut):
    header = b"[" * 100_000 + b"]" * 100_000
    (cut / CHECKPOINT_NAME).write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(CheckpointError, match="corrupt or not a bayesfl checkpoint"):
        simulate("fedavg", out=cut, resume=True, **SMALL)


def test_a_foreign_checkpoint_names_the_settings_that_differ(cut):
    with pytest.raises(CheckpointError) as info:
        simulate("fedavg", out=cut, resume=True, **{**SMALL, "lr": 0.5, "seed": 4})
    message = str(info.value)
    assert "belongs to another run configuration" in message
    assert "lr: checkpoint 0.01, this run 0.5" in message
    assert "seed: checkpoint 3, this run 4" in message
    assert "rounds" not in message.split("(fingerprint")[0]  # only what differs is named


def _custom_data(n=320, seed=0):
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 4
    x = torch.randn(n, 10, generator=g) + 3.0 * torch.nn.functional.one_hot(y, 10)
    return Dataset("digits", x.float(), y, num_classes=4, input_shape=(10,))


def test_custom_data_are_recorded_as_what_they_are(tmp_path):
    data = _custom_data()
    settings = {k: v for k, v in SMALL.items() if k not in ("dataset", "dataset_options")}
    result = simulate("fedavg", out=tmp_path, data=data, **{**settings, "rounds": 1})
    identity = dataset_identity(data, custom=True)
    assert identity["name"] == "custom" and identity["num_samples"] == 320
    for name in ("summary.json", "manifest.json"):
        written = json.loads((tmp_path / name).read_text())
        assert written["data"] == identity
    assert result.summary["dataset"] == "custom"
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["config"]["dataset"] == "custom"


def test_the_data_digest_sees_every_number_and_the_shape():
    data = _custom_data()
    digest = dataset_identity(data)["sha256"]
    assert dataset_identity(_custom_data())["sha256"] == digest  # deterministic
    x = data.x.clone()
    x[17, 3] = torch.nextafter(x[17, 3], torch.tensor(float("inf")))
    changed = Dataset("digits", x, data.y, 4, (10,))
    assert dataset_identity(changed)["sha256"] != digest
    reshaped = Dataset("digits", data.x.reshape(320, 2, 5), data.y, 4, (2, 5))
    assert dataset_identity(reshaped)["sha256"] != digest
    named = load_dataset("gaussian_mixture", seed=3, **SMALL["dataset_options"])
    assert dataset_identity(named)["name"] == "gaussian_mixture"


def test_resuming_a_custom_data_run_without_its_data_says_the_data_differ(tmp_path):
    settings = {k: v for k, v in SMALL.items() if k not in ("dataset", "dataset_options")}
    with pytest.raises(KeyboardInterrupt):
        simulate("fedavg", out=tmp_path, data=_custom_data(), round_callback=stop_after(1),
                 **settings)
    with pytest.raises(CheckpointError) as info:
        simulate("fedavg", out=tmp_path, resume=True, **settings)  # digits instead
    message = str(info.value)
    assert 'dataset: checkpoint "custom", this run "digits"' in message
    assert "data.sha256" in message and "data.num_samples: checkpoint 320" in message
    with pytest.raises(CheckpointError, match=r"data\.sha256"):
        simulate("fedavg", out=tmp_path, resume=True, data=_custom_data(seed=1), **settings)
    # with the same data it resumes
    resumed = simulate("fedavg", out=tmp_path, resume=True, data=_custom_data(), **settings)
    assert [m["round"] for m in resumed.metrics] == [1, 2, 3]


def test_the_progress_bar_starts_at_the_rounds_already_done(cut, monkeypatch):
    simulate_module = importlib.import_module("bayesfl.simulate")  # the package's `simulate`
    bars = []                                                     # attribute is the function
    real = simulate_module.tqdm

    def recording_tqdm(*args, **kwargs):
        bars.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(simulate_module, "tqdm", recording_tqdm)
    simulate("fedavg", out=cut, resume=True, **SMALL)
    assert bars[0]["initial"] == 1 and bars[0]["total"] == 3  # 1 of FedAvg's rounds 1..3 done


def test_threads_are_recorded_and_the_callers_count_restored(tmp_path):
    before = torch.get_num_threads()
    result = simulate("fedavg", out=tmp_path, threads=1, **{**SMALL, "rounds": 1})
    assert torch.get_num_threads() == before
    assert result.summary["threads"] == 1
    assert json.loads((tmp_path / "manifest.json").read_text())["threads"] == 1
