"""Checkpoints: exact round trip, atomic replacement, and refusal of corrupt or foreign files."""

import hashlib
import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

import bayesfl.checkpoint as checkpoint_module
from bayesfl.checkpoint import config_fingerprint, load_checkpoint, save_checkpoint
from bayesfl.errors import CheckpointError, ConfigError
from bayesfl.messages import Header, Message, encode
from tests.devices import DEVICES

CONFIG = {"strategy": "fedlog", "dataset": "digits", "clients": 20, "partition": "shards:2",
          "rounds": 30, "seed": 0}
FINGERPRINT = config_fingerprint(CONFIG)


def server_state(round_: int) -> tuple[dict[str, torch.Tensor], dict]:
    generator = torch.Generator().manual_seed(round_)
    tensors = {"head.weight": torch.randn(10, 51, dtype=torch.float64, generator=generator),
               "counts": torch.arange(10) * round_,
               "mask": torch.tensor([True, False])}
    meta = {"round": round_, "fingerprint": FINGERPRINT, "history": [{"acc": 0.5, "ece": 0.1}],
            "rng": [1, 2, 3], "note": None, "nll": float("inf")}
    return tensors, meta


def assert_state_equal(loaded, expected) -> None:
    tensors, meta = loaded
    want_tensors, want_meta = expected
    assert set(tensors) == set(want_tensors)
    for name, tensor in want_tensors.items():
        assert tensors[name].dtype == tensor.dtype
        assert torch.equal(tensors[name], tensor.cpu())
    assert meta == want_meta


@pytest.mark.parametrize("device", DEVICES)
def test_round_trip_is_exact(tmp_path, device):
    tensors, meta = server_state(3)
    tensors = {k: v.to(device) for k, v in tensors.items()}
    path = tmp_path / "state.safetensors"
    save_checkpoint(path, tensors, meta)
    assert_state_equal(load_checkpoint(path, fingerprint=FINGERPRINT), (tensors, meta))


def test_fingerprint_may_be_passed_explicitly(tmp_path):
    tensors, meta = server_state(1)
    meta.pop("fingerprint")
    save_checkpoint(tmp_path / "c", tensors, meta, fingerprint="abc")
    assert load_checkpoint(tmp_path / "c", fingerprint="abc")[1] == meta


def test_saving_without_a_fingerprint_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="config_fingerprint"):
        save_checkpoint(tmp_path / "c", {"w": torch.zeros(1)}, {"round": 0})


def test_a_newer_checkpoint_replaces_the_older(tmp_path):
    path = tmp_path / "state.safetensors"
    save_checkpoint(path, *server_state(1))
    save_checkpoint(path, *server_state(2))
    assert_state_equal(load_checkpoint(path, fingerprint=FINGERPRINT), server_state(2))
    assert [p.name for p in tmp_path.iterdir()] == ["state.safetensors"]


@pytest.mark.parametrize("failing", ["fsync", "replace"])
def test_a_crash_after_the_temp_file_is_created_leaves_the_previous_checkpoint(
        tmp_path, monkeypatch, failing):
    path = tmp_path / "state.safetensors"
    save_checkpoint(path, *server_state(1))
    created = []
    real_mkstemp = checkpoint_module.tempfile.mkstemp

    def recording_mkstemp(*args, **kwargs):
        handle, name = real_mkstemp(*args, **kwargs)
        created.append(Path(name))
        return handle, name

    def crash(*args, **kwargs):
        assert created and created[0].exists(), "the temp file must exist when the crash comes"
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint_module.tempfile, "mkstemp", recording_mkstemp)
    monkeypatch.setattr(checkpoint_module.os, failing, crash)
    with pytest.raises(CheckpointError, match="previous checkpoint, if any, is unchanged"):
        save_checkpoint(path, *server_state(2))
    monkeypatch.undo()
    assert_state_equal(load_checkpoint(path, fingerprint=FINGERPRINT), server_state(1))
    assert not created[0].exists()
    assert [p.name for p in tmp_path.iterdir()] == ["state.safetensors"]


def test_an_interrupt_mid_write_leaves_the_previous_checkpoint_and_propagates(tmp_path,
                                                                              monkeypatch):
    path = tmp_path / "state.safetensors"
    save_checkpoint(path, *server_state(1))

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint_module.os, "fsync", interrupt)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(path, *server_state(2))
    monkeypatch.undo()
    assert_state_equal(load_checkpoint(path, fingerprint=FINGERPRINT), server_state(1))
    assert [p.name for p in tmp_path.iterdir()] == ["state.safetensors"]


def test_a_missing_checkpoint_is_a_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match=r"no checkpoint at .* without resuming"):
        load_checkpoint(tmp_path / "absent.safetensors", fingerprint=FINGERPRINT)


def _corruptions(data: bytes) -> dict[str, bytes]:
    flipped = bytearray(data)
    flipped[-5] ^= 0x10
    return {
        "truncated": data[: len(data) // 2],
        "cut_by_one": data[:-1],
        "flipped_payload_byte": bytes(flipped),
        "empty": b"",
        "garbage": b"\x00" * 100,
        "pickle": pickle.dumps(server_state(1)),
        "json": json.dumps({"round": 1}).encode(),
    }


@pytest.mark.parametrize("kind", ["truncated", "cut_by_one", "flipped_payload_byte", "empty",
                                  "garbage", "pickle", "json"])
def test_a_corrupt_file_is_a_checkpoint_error_that_says_what_to_do(tmp_path, kind):
    path = tmp_path / "state.safetensors"
    save_checkpoint(path, *server_state(1))
    path.write_bytes(_corruptions(path.read_bytes())[kind])
    with pytest.raises(CheckpointError, match="corrupt or not a bayesfl checkpoint; delete it"):
        load_checkpoint(path, fingerprint=FINGERPRINT)


def test_tampered_meta_is_detected(tmp_path):
    path = tmp_path / "state.safetensors"
    save_checkpoint(path, *server_state(1))
    data = path.read_bytes()
    tampered = data.replace(b'\\"round\\": 1', b'\\"round\\": 9')
    assert tampered != data
    path.write_bytes(tampered)
    with pytest.raises(CheckpointError, match="digest mismatch"):
        load_checkpoint(path, fingerprint=FINGERPRINT)


def test_a_message_file_is_not_a_checkpoint(tmp_path):
    path = tmp_path / "state.safetensors"
    path.write_bytes(encode(Message(Header("fedlog", 0, 1, "up"), {"w": torch.zeros(2)})))
    with pytest.raises(CheckpointError, match="not a bayesfl checkpoint"):
        load_checkpoint(path, fingerprint=FINGERPRINT)


def test_a_checkpoint_of_another_configuration_is_refused(tmp_path):
    path = tmp_path / "state.safetensors"
    save_checkpoint(path, *server_state(1))
    other = config_fingerprint({**CONFIG, "seed": 1})
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, fingerprint=other)
    message = str(info.value)
    assert FINGERPRINT in message and other in message
    assert "original configuration or use a new output directory" in message


def test_fingerprint_is_sha256_of_canonical_json():
    reference = hashlib.sha256(
        b'{"clients":20,"dataset":"digits","partition":"shards:2","rounds":30,'
        b'"seed":0,"strategy":"fedlog"}').hexdigest()
    assert config_fingerprint(CONFIG) == reference


def test_fingerprint_ignores_key_order_and_sees_every_value():
    reordered = dict(reversed(list(CONFIG.items())))
    assert config_fingerprint(reordered) == FINGERPRINT
    assert config_fingerprint({**CONFIG, "rounds": 31}) != FINGERPRINT
    assert config_fingerprint({**CONFIG, "lr": {"body": 1e-3}}) != config_fingerprint(
        {**CONFIG, "lr": {"body": 1e-2}})


def test_fingerprint_canonicalises_paths_numpy_scalars_and_tuples():
    assert config_fingerprint({"out": Path("runs/a"), "k": np.int64(3), "s": (1, 2)}) == \
        config_fingerprint({"out": "runs/a", "k": 3, "s": [1, 2]})


@pytest.mark.parametrize("bad", [float("nan"), object(), torch.zeros(1)])
def test_unfingerprintable_configs_are_config_errors(bad):
    with pytest.raises(ConfigError, match="cannot be fingerprinted"):
        config_fingerprint({"x": bad})


def test_the_checkpoint_directory_must_be_writable(tmp_path):
    missing_dir = tmp_path / "nope" / "state.safetensors"
    with pytest.raises(CheckpointError, match="cannot create a temporary file"):
        save_checkpoint(missing_dir, *server_state(1))
    assert not os.path.exists(tmp_path / "nope")
