"""Checkpoints: exact round trip, atomic replacement, and refusal of corrupt or foreign files."""

import hashlib
import json
import os
import pickle
import re
import struct
import threading
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


def test_a_background_write_leaves_the_previous_file_until_it_is_in_place(tmp_path,
                                                                          monkeypatch):
    path = tmp_path / "state.safetensors"
    save_checkpoint(path, *server_state(1))
    disk = threading.Event()
    real_fsync = os.fsync

    def slow_disk(fd):  # the fsync waits until the test lets the disk answer
        assert disk.wait(timeout=60)
        real_fsync(fd)

    monkeypatch.setattr(checkpoint_module.os, "fsync", slow_disk)
    pending = save_checkpoint(path, *server_state(2), durable_in_background=True)
    # the call has returned with the bytes written; the name still holds round 1, whole
    assert not pending.done
    assert_state_equal(load_checkpoint(path, fingerprint=FINGERPRINT), server_state(1))
    disk.set()
    pending.wait()
    assert pending.done
    assert_state_equal(load_checkpoint(path, fingerprint=FINGERPRINT), server_state(2))
    assert [p.name for p in tmp_path.iterdir()] == ["state.safetensors"]


@pytest.mark.parametrize("failing", ["fsync", "replace"])
def test_a_background_write_that_fails_says_so_when_waited_for(tmp_path, monkeypatch, failing):
    path = tmp_path / "state.safetensors"
    save_checkpoint(path, *server_state(1))

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint_module.os, failing, crash)
    pending = save_checkpoint(path, *server_state(2), durable_in_background=True)
    with pytest.raises(CheckpointError, match=r"disk full.*previous checkpoint, if any, is "
                                              r"unchanged"):
        pending.wait()
    pending.wait()  # said once: the failure is not raised again
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


# ---- what is read: regular files of bounded size only --------------------------------------
def _fifo(tmp_path):
    path = tmp_path / "fifo"
    os.mkfifo(path)
    return path


@pytest.mark.parametrize(("make", "expected"), [
    (lambda tmp: tmp, "is a directory, not a regular file"),
    (_fifo, "is a FIFO (named pipe), not a regular file"),
    (lambda tmp: Path("/dev/zero"), "is a character device, not a regular file"),
])
def test_what_is_not_a_regular_file_is_refused_by_name(tmp_path, make, expected):
    with pytest.raises(CheckpointError, match=re.escape(expected)):
        load_checkpoint(make(tmp_path), fingerprint=FINGERPRINT)


def test_a_symlink_is_judged_by_what_it_leads_to(tmp_path):
    link = tmp_path / "link.safetensors"
    os.symlink("/dev/zero", link)
    with pytest.raises(CheckpointError, match="is a character device"):
        load_checkpoint(link, fingerprint=FINGERPRINT)
    save_checkpoint(tmp_path / "real.safetensors", *server_state(1))
    link.unlink()
    os.symlink(tmp_path / "real.safetensors", link)  # a link to a checkpoint is a checkpoint
    assert_state_equal(load_checkpoint(link, fingerprint=FINGERPRINT), server_state(1))


def test_a_symlink_loop_is_named(tmp_path):
    os.symlink(tmp_path / "b", tmp_path / "a")
    os.symlink(tmp_path / "a", tmp_path / "b")
    with pytest.raises(CheckpointError, match="is a symlink loop"):
        load_checkpoint(tmp_path / "a", fingerprint=FINGERPRINT)


def test_a_file_over_the_size_limit_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / "state.safetensors"
    save_checkpoint(path, *server_state(1))
    size = path.stat().st_size
    too_big = f"is {size:,} bytes, more than the limit {size - 1:,}"
    with pytest.raises(CheckpointError, match=too_big):
        load_checkpoint(path, fingerprint=FINGERPRINT, max_bytes=size - 1)
    assert load_checkpoint(path, fingerprint=FINGERPRINT, max_bytes=size)[1]["round"] == 1
    sparse = tmp_path / "huge.safetensors"  # 17 GiB on paper, nothing on disk
    with open(sparse, "wb") as f:
        f.truncate(checkpoint_module.MAX_CHECKPOINT_BYTES + 1)
    with pytest.raises(CheckpointError, match="more than the limit 17,179,869,184"):
        load_checkpoint(sparse, fingerprint=FINGERPRINT)


@pytest.mark.parametrize("where", ["header", "meta"])
def test_deeply_nested_json_is_a_checkpoint_error_not_a_recursion_error(tmp_path, where):
    path = tmp_path / "state.safetensors"
    deep = "[" * 50_000 + "]" * 50_000
    if where == "header":
        path.write_bytes(struct.pack("<Q", len(deep)) + deep.encode())
        expected = "corrupt or not a bayesfl checkpoint"
    else:
        tensors, meta = server_state(1)
        save_checkpoint(path, tensors, meta)
        data = path.read_bytes()
        header_len = struct.unpack("<Q", data[:8])[0]
        header = json.loads(data[8:8 + header_len])
        header["__metadata__"]["bayesfl.meta"] = deep
        text = json.dumps(header).encode()
        path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + header_len:])
        expected = "corrupt or not a bayesfl checkpoint"
    with pytest.raises(CheckpointError, match=expected):
        load_checkpoint(path, fingerprint=FINGERPRINT)


# ---- a foreign checkpoint says which settings differ ---------------------------------------
def test_the_settings_that_differ_are_named(tmp_path):
    path = tmp_path / "state.safetensors"
    config = {**CONFIG, "strategy_options": {"alpha": 0.1}, "data": {"sha256": "a" * 64}}
    tensors, meta = server_state(1)
    meta = {**meta, "config": config}
    save_checkpoint(path, tensors, meta, fingerprint=config_fingerprint(config))
    other = {**config, "seed": 1, "strategy_options": {"alpha": 0.2},
             "data": {"sha256": "b" * 64}}
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, fingerprint=config_fingerprint(other), config=other)
    message = str(info.value)
    assert "seed: checkpoint 0, this run 1" in message
    assert "strategy_options.alpha: checkpoint 0.1, this run 0.2" in message
    assert 'data.sha256: checkpoint "aaaaaaaaaaaa' in message  # long values are shortened
    assert 'this run "bbbbbbbbbbbb' in message and "a" * 64 not in message
    assert "rounds" not in message and "clients" not in message


def test_config_differences_cover_added_removed_and_retyped_settings():
    from bayesfl.checkpoint import config_differences

    assert config_differences({"a": 1, "b": 2}, {"a": 1, "c": 3}) == [
        "b: checkpoint 2, this run (not set)", "c: checkpoint (not set), this run 3"]
    assert config_differences({"lr": 1}, {"lr": 1.0}) == ["lr: checkpoint 1, this run 1.0"]
    assert config_differences({"x": {"y": [1, 2]}}, {"x": {"y": [1, 2]}}) == []


def test_a_checkpoint_header_may_exceed_a_message_header(tmp_path, monkeypatch):
    # a checkpoint holds a tensor per client tensor: its header outgrows a message's limit
    # (16 MiB, ~26,000 FedLog clients) long before its file reaches MAX_CHECKPOINT_BYTES
    import bayesfl.messages as messages

    monkeypatch.setattr(messages, "MAX_HEADER_BYTES", 1000)
    tensors = {f"client/{i}/model.weight": torch.full((2,), float(i)) for i in range(100)}
    save_checkpoint(tmp_path / "ck.safetensors", tensors, {"round": 1}, fingerprint="f")
    loaded, meta = load_checkpoint(tmp_path / "ck.safetensors", fingerprint="f")
    assert meta["round"] == 1 and all(torch.equal(loaded[k], v) for k, v in tensors.items())


def test_a_checkpoint_of_many_parts_is_the_bytes_safetensors_writes(tmp_path):
    # more tensors than one writev takes (1,024 buffers), views of one stacked storage (as a
    # simulator's client states are), empty tensors, every dtype family; the file's tensor
    # section is what safetensors.torch.save writes for the same tensors
    from safetensors.torch import save as safetensors_save

    stacked = torch.randn(3000, 5, 4)
    tensors = {f"client/{i}/w": stacked[i] for i in range(3000)}
    tensors |= {"empty": torch.zeros(0, 3), "flags": torch.tensor([True, False, True]),
                "half": torch.arange(5, dtype=torch.float16), "ids": torch.arange(7),
                "wide": torch.randn(2, 3, dtype=torch.complex64),
                "big": torch.randn(3 * 2**20)}  # 12 MiB: more than one write's bytes
    path = tmp_path / "ck.safetensors"
    save_checkpoint(path, tensors, {"round": 1}, fingerprint="f")
    data = path.read_bytes()
    theirs = safetensors_save({k: v.contiguous() for k, v in tensors.items()})
    start, their_start = (8 + struct.unpack("<Q", b[:8])[0] for b in (data, theirs))
    assert data[start:] == theirs[their_start:]
    loaded, _ = load_checkpoint(path, fingerprint="f")
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())


def test_a_write_that_takes_part_of_its_buffers_goes_on_where_it_stopped(tmp_path, monkeypatch):
    # os.writev may write fewer bytes than asked (a signal, a full disk quota's edge); no
    # file system here does it on demand, so this writev takes at most 1,000 bytes a call
    real_writev = os.writev

    def short_writev(fd, buffers):
        data = b"".join(bytes(b) for b in buffers)[:1000]
        return real_writev(fd, [data])

    monkeypatch.setattr(checkpoint_module.os, "writev", short_writev)
    parts = [b"header", np.arange(700, dtype=np.float32).reshape(7, 100), b"", b"x" * 2500,
             np.array([True, False])]
    path = tmp_path / "parts.bin"
    checkpoint_module.write_atomically(path, parts)
    assert path.read_bytes() == b"".join(bytes(memoryview(p).cast("B")) if len(p) else b""
                                         for p in parts)


def test_the_digest_written_after_the_tensors_is_the_files_own(tmp_path):
    # the header goes out with a placeholder and gets the digest once the tensors are written:
    # the file is the one a digest-first write makes, and its digest verifies on load
    from bayesfl.messages import read_safetensors_metadata, safetensors_bytes, tensor_digest

    tensors, meta = server_state(2)
    path = tmp_path / "ck.safetensors"
    save_checkpoint(path, tensors, meta)
    meta_json = json.dumps(meta, sort_keys=True, allow_nan=True)
    digest = tensor_digest(tensors, FINGERPRINT + meta_json)
    metadata = {"bayesfl.format": "bayesfl-checkpoint", "bayesfl.fingerprint": FINGERPRINT,
                "bayesfl.meta": meta_json, "bayesfl.sha256": digest}
    assert path.read_bytes() == safetensors_bytes(tensors, metadata)
    assert read_safetensors_metadata(path.read_bytes())["bayesfl.sha256"] == digest
    assert_state_equal(load_checkpoint(path, fingerprint=FINGERPRINT), (tensors, meta))



# ---- keep_spare: the replaced file is kept and the next write overwrites it in place ------

needs_exchange = pytest.mark.skipif(checkpoint_module._renameat2() is None,
                                    reason="needs Linux's renameat2(RENAME_EXCHANGE)")


@needs_exchange
def test_a_kept_spare_is_the_file_before_last_and_the_next_write_overwrites_it_in_place(
        tmp_path):
    path = tmp_path / "state.safetensors"
    spare = checkpoint_module.spare_path(path)
    save_checkpoint(path, *server_state(1), keep_spare=True)
    assert not spare.exists()  # nothing was replaced yet
    save_checkpoint(path, *server_state(2), keep_spare=True)
    assert_state_equal(load_checkpoint(path, fingerprint=FINGERPRINT), server_state(2))
    assert_state_equal(load_checkpoint(spare, fingerprint=FINGERPRINT), server_state(1))
    spare_inode = spare.stat().st_ino
    save_checkpoint(path, *server_state(3), keep_spare=True)
    # round 3 went into round 1's file (its pages reused), and round 2's file is the spare
    assert path.stat().st_ino == spare_inode
    assert_state_equal(load_checkpoint(path, fingerprint=FINGERPRINT), server_state(3))
    assert_state_equal(load_checkpoint(spare, fingerprint=FINGERPRINT), server_state(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == [spare.name, path.name]
    checkpoint_module.discard_spare(path)
    checkpoint_module.discard_spare(path)  # (none left: nothing to do)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


@needs_exchange
def test_a_shorter_file_written_over_a_longer_spare_is_exactly_its_own_bytes(tmp_path):
    path = tmp_path / "state.safetensors"
    big = {"w": torch.randn(1000, 100)}
    for _ in range(2):  # the second write leaves the first, 400 kB, as the spare
        save_checkpoint(path, big, {"fingerprint": FINGERPRINT}, keep_spare=True)
    tensors, meta = server_state(4)
    save_checkpoint(path, tensors, meta, keep_spare=True)
    save_checkpoint(tmp_path / "plain.safetensors", tensors, meta)
    assert path.read_bytes() == (tmp_path / "plain.safetensors").read_bytes()


@needs_exchange
@pytest.mark.parametrize("kind", ["symlink", "fifo", "hard link", "directory"])
def test_a_spare_that_is_not_a_plain_file_of_ours_is_never_written_through(tmp_path, kind):
    path = tmp_path / "state.safetensors"
    spare = checkpoint_module.spare_path(path)
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"precious")
    if kind == "symlink":
        spare.symlink_to(victim)
    elif kind == "fifo":
        os.mkfifo(spare)  # opening it to write must not wait for a reader
    elif kind == "hard link":
        os.link(victim, spare)
    else:
        spare.mkdir()
    save_checkpoint(path, *server_state(1), keep_spare=True)
    save_checkpoint(path, *server_state(2), keep_spare=True)
    assert victim.read_bytes() == b"precious"
    assert_state_equal(load_checkpoint(path, fingerprint=FINGERPRINT), server_state(2))


def test_without_the_swap_a_kept_spare_is_a_plain_replace(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint_module, "_renameat2", lambda: None)  # e.g. not Linux
    path = tmp_path / "state.safetensors"
    for r in (1, 2, 3):
        save_checkpoint(path, *server_state(r), keep_spare=True)
        assert_state_equal(load_checkpoint(path, fingerprint=FINGERPRINT), server_state(r))
        assert [p.name for p in tmp_path.iterdir()] == [path.name]


@needs_exchange
@pytest.mark.parametrize("background", [False, True])
def test_a_failed_write_into_the_spare_leaves_the_checkpoint_and_drops_the_spare(
        tmp_path, monkeypatch, background):
    path = tmp_path / "state.safetensors"
    for r in (1, 2):
        save_checkpoint(path, *server_state(r), keep_spare=True)

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint_module.os, "fsync", crash)
    with pytest.raises(CheckpointError, match="previous checkpoint, if any, is unchanged"):
        save_checkpoint(path, *server_state(3), keep_spare=True,
                        durable_in_background=background).wait()
    monkeypatch.undo()
    assert_state_equal(load_checkpoint(path, fingerprint=FINGERPRINT), server_state(2))
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # the torn spare is gone
    save_checkpoint(path, *server_state(4), keep_spare=True)
    assert_state_equal(load_checkpoint(path, fingerprint=FINGERPRINT), server_state(4))
