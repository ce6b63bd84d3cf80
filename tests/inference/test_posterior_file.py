"""Posterior files: a digest catches corruption, reading is bounded, every bad file is a
PosteriorFileError that says what it is, and a valid file round-trips bit for bit."""

from __future__ import annotations

import json
import os
import pickle
import threading

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from inference.errors import InferenceError, InvalidInputError, PosteriorFileError
from inference.posterior_file import (
    FORMAT,
    SCHEMA_VERSION,
    json_depth,
    load_posterior,
    save_posterior,
    state_digest,
)
from tests.inference.test_posterior import MAKERS, conjugate_posterior, head_posterior

F64 = torch.float64


@pytest.fixture
def saved(tmp_path):
    """A saved conjugate posterior: (path, posterior)."""
    post = conjugate_posterior()
    path = tmp_path / "post.safetensors"
    save_posterior(post, path)
    return path, post


def forge(path, state, kind, *, digest=None, **metadata):
    """Write ``state`` as a posterior file whose digest matches it (a careful forger, or a
    buggy writer), unless ``digest`` is given."""
    meta = {"format": FORMAT, "schema_version": SCHEMA_VERSION, "kind": kind,
            "digest": digest or state_digest(state, kind)}
    meta.update(metadata)
    save_file({k: v.contiguous() for k, v in state.items()}, str(path), metadata=meta)


def data_offset(path) -> int:
    """Where the tensor bytes start in a safetensors file."""
    return 8 + int.from_bytes(path.read_bytes()[:8], "little")


# -- round trip ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [n for n in MAKERS if n != "subnet_laplace"])
def test_round_trip_gives_bit_identical_predictions(tmp_path, name):
    post = MAKERS[name]()
    save_posterior(post, tmp_path / "p.safetensors")
    loaded = load_posterior(tmp_path / "p.safetensors")
    x = np.random.default_rng(0).normal(size=(6, 3))
    assert torch.equal(loaded.predict_proba(torch.from_numpy(x)),
                       post.predict_proba(torch.from_numpy(x)))
    assert torch.equal(loaded.mean, post.mean)


def test_the_file_records_format_version_kind_and_a_sha256_digest(saved):
    path, post = saved
    header = json.loads(path.read_bytes()[8:data_offset(path)])
    meta = header["__metadata__"]
    assert meta["format"] == FORMAT and meta["schema_version"] == SCHEMA_VERSION == "2"
    assert meta["kind"] == "conjugate"
    assert meta["digest"] == state_digest(post.state_dict(), "conjugate")
    assert meta["digest"].startswith("sha256:") and len(meta["digest"]) == 7 + 64


def test_the_digest_matches_an_independent_sha256(saved):
    import hashlib

    path, _ = saved
    state = load_file(str(path))
    reference = hashlib.sha256(json.dumps([FORMAT, "2", "conjugate"]).encode())
    for name in sorted(state):
        t = state[name]
        reference.update(json.dumps([name, str(t.dtype), list(t.shape)]).encode())
        reference.update(t.contiguous().numpy().tobytes())  # little-endian machine
    assert state_digest(state, "conjugate") == "sha256:" + reference.hexdigest()


def test_save_is_atomic_and_leaves_no_temporary_file(saved):
    path, _ = saved
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]


# -- corruption and forgery -----------------------------------------------------------------------


def test_a_flipped_bit_in_the_tensors_is_caught(saved):
    path, _ = saved
    data = bytearray(path.read_bytes())
    data[data_offset(path) + 3] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(PosteriorFileError, match=r"digest .* does not match.*corrupted"):
        load_posterior(path)


def test_a_statistic_multiplied_by_eight_is_caught_by_the_digest(saved):
    """The trial of issue 11: one statistic x8 changed predictions by 0.31, silently."""
    path, post = saved
    state = load_file(str(path))
    meta = json.loads(path.read_bytes()[8:data_offset(path)])["__metadata__"]
    state["table"][1, 2] *= 8
    save_file(state, str(path), metadata=meta)  # the stored digest is left as it was
    with pytest.raises(PosteriorFileError, match=r"digest"):
        load_posterior(path)
    # the same change under a recomputed digest loads (an unkeyed digest is no signature) and
    # is what the digest protects against: predictions really change
    forge(path, state, "conjugate")
    x = torch.randn(50, 3, generator=torch.Generator().manual_seed(0), dtype=F64)
    change = (load_posterior(path).predict_proba(x) - post.predict_proba(x)).abs().max()
    assert change > 0.01


def test_a_nan_term_is_refused_even_under_a_valid_digest(saved, tmp_path):
    path, _ = saved
    state = load_file(str(path))
    state["table"][0, 1] = float("nan")
    forge(path, state, "conjugate")
    with pytest.raises(PosteriorFileError, match=r"'table' holds 1 NaN or infinite"):
        load_posterior(path)
    gaussian = head_posterior().state_dict()
    gaussian["likelihood.shift"] = gaussian["likelihood.shift"].clone()
    gaussian["likelihood.shift"][0] = float("inf")
    forge(tmp_path / "g.safetensors", gaussian, "gaussian")
    with pytest.raises(PosteriorFileError, match=r"likelihood.shift"):
        load_posterior(tmp_path / "g.safetensors")


def test_a_precision_that_is_not_positive_definite_is_refused(tmp_path):
    state = {k: v.clone() for k, v in head_posterior("diag").state_dict().items()}
    state["likelihood.diag"][2] = -10.0  # prior 1 + (-10): a negative variance
    forge(tmp_path / "p.safetensors", state, "gaussian")
    with pytest.raises(PosteriorFileError,
                       match=r"does not hold a valid gaussian posterior.*positive"):
        load_posterior(tmp_path / "p.safetensors")
    full = {k: v.clone() for k, v in head_posterior("full").state_dict().items()}
    full["likelihood.dense"] = -10 * torch.eye(8, dtype=F64)
    forge(tmp_path / "f.safetensors", full, "gaussian")
    with pytest.raises(PosteriorFileError, match=r"positive definite"):
        load_posterior(tmp_path / "f.safetensors")


@pytest.mark.parametrize(("edit", "message"), [
    (lambda s: s.pop("likelihood.shift"), "likelihood.shift"),
    (lambda s: s.update({"likelihood.diag": torch.ones(5, dtype=F64)}), r"shape \(8,\)"),
    (lambda s: s.update({"shape": torch.tensor([3, 4])}), "must agree"),
    (lambda s: s.update({"n_data": torch.tensor(-3)}), "n_data"),
    (lambda s: s.update({"n_data": torch.ones(2, 2, dtype=torch.int64)}), "n_data"),
    (lambda s: s.update({"shape": torch.ones(2, 2, dtype=torch.int64)}), "valid gaussian"),
])
def test_shapes_inconsistent_with_the_kind_are_refused(tmp_path, edit, message):
    state = {k: v.clone() for k, v in head_posterior("diag").state_dict().items()}
    edit(state)
    forge(tmp_path / "p.safetensors", state, "gaussian")
    with pytest.raises(PosteriorFileError, match=message):
        load_posterior(tmp_path / "p.safetensors")


def test_conjugate_statistics_that_break_their_invariants_are_refused(saved):
    path, _ = saved
    state = load_file(str(path))
    state["table"][0, 0] += 1  # the bias column no longer sums to n
    forge(path, state, "conjugate")
    with pytest.raises(PosteriorFileError,
                       match=r"does not hold a valid conjugate posterior.*counts"):
        load_posterior(path)


def test_an_unknown_kind_is_refused(tmp_path):
    state = head_posterior().state_dict()
    forge(tmp_path / "p.safetensors", state, "kron")
    with pytest.raises(PosteriorFileError, match=r"unknown posterior kind 'kron'"):
        load_posterior(tmp_path / "p.safetensors")


# -- what is not a posterior file ---------------------------------------------------------------


def test_a_missing_file(tmp_path):
    with pytest.raises(PosteriorFileError, match=r"no such file"):
        load_posterior(tmp_path / "absent.safetensors")


def test_a_directory(tmp_path):
    with pytest.raises(PosteriorFileError, match=r"is a directory"):
        load_posterior(tmp_path)


def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    outcome = []

    def load():
        try:
            load_posterior(fifo)
        except PosteriorFileError as error:
            outcome.append(str(error))

    reader = threading.Thread(target=load, daemon=True)
    reader.start()
    reader.join(timeout=20)
    if reader.is_alive():  # unblock the reader so the test process can end, then fail
        with open(fifo, "wb"):
            pass
        pytest.fail("load_posterior blocked on a FIFO")
    assert outcome and "a FIFO (named pipe), not a regular file" in outcome[0]


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero on this system")
def test_a_symlink_to_dev_zero_is_refused_unread(tmp_path):
    (tmp_path / "zero.safetensors").symlink_to("/dev/zero")
    with pytest.raises(PosteriorFileError, match=r"a character device, not a regular file"):
        load_posterior(tmp_path / "zero.safetensors")


def test_a_symlink_loop(tmp_path):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    with pytest.raises(PosteriorFileError, match=r"loop of symbolic links"):
        load_posterior(tmp_path / "a")


def test_an_empty_file(tmp_path):
    (tmp_path / "empty").write_bytes(b"")
    with pytest.raises(PosteriorFileError, match=r"is empty"):
        load_posterior(tmp_path / "empty")


def test_a_file_larger_than_the_limit_is_refused_unread(saved):
    path, _ = saved
    size = path.stat().st_size
    with pytest.raises(PosteriorFileError, match=rf"{size:,} bytes, more than the limit of 100"):
        load_posterior(path, max_bytes=100)
    assert load_posterior(path, max_bytes=size).kind == "conjugate"


@pytest.mark.parametrize("keep", [5, 8, 40, "header", "half", -1])
def test_truncated_files(saved, keep):
    path, _ = saved
    data = path.read_bytes()
    cut = {"header": data_offset(path), "half": len(data) // 2}.get(keep, keep)
    path.write_bytes(data[:cut])
    with pytest.raises(PosteriorFileError, match=r"truncated|corrupted"):
        load_posterior(path)


def test_pickles_and_other_formats_are_named_and_never_unpickled(tmp_path):
    class Bomb:
        def __reduce__(self):
            return (pytest.fail, ("the file was unpickled",))

    (tmp_path / "p.pkl").write_bytes(pickle.dumps({"x": Bomb()}))
    with pytest.raises(PosteriorFileError, match=r"a Python pickle"):
        load_posterior(tmp_path / "p.pkl")
    torch.save({"x": torch.zeros(2)}, tmp_path / "t.pt")
    with pytest.raises(PosteriorFileError, match=r"zip archive"):
        load_posterior(tmp_path / "t.pt")
    np.save(tmp_path / "a.npy", np.zeros(3))
    with pytest.raises(PosteriorFileError, match=r"NumPy .npy"):
        load_posterior(tmp_path / "a.npy")


@pytest.mark.parametrize("header", [b"{not json", b"\xff\xfe", b"[1, 2]", b'{"__metadata__": 3}',
                                    b'{"__metadata__": {"kind": 3}}'])
def test_bad_header_json(tmp_path, header):
    (tmp_path / "bad").write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(PosteriorFileError, match=r"not JSON|no string metadata"):
        load_posterior(tmp_path / "bad")


def test_a_deeply_nested_header_is_refused_before_parsing(tmp_path):
    header = b"[" * 30000 + b"]" * 30000  # json.loads would raise RecursionError
    (tmp_path / "deep").write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(PosteriorFileError, match=r"nests 30000 levels"):
        load_posterior(tmp_path / "deep")
    assert json_depth(b'{"a": {"b": ["[[[", 1]}}') == 3  # brackets in strings do not count


def test_a_header_longer_than_the_limit(tmp_path):
    header = b'{"__metadata__": {"pad": "' + b"x" * (2**20) + b'"}}'
    (tmp_path / "long").write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(PosteriorFileError, match=r"exceeds the limit"):
        load_posterior(tmp_path / "long")


def test_metadata_from_another_schema_version(saved):
    path, post = saved
    forge(path, post.state_dict(), "conjugate", schema_version="3")
    with pytest.raises(PosteriorFileError, match=r"schema version '3'.*reads '2'"):
        load_posterior(path)
    forge(path, post.state_dict(), "conjugate", comment="hello")
    with pytest.raises(PosteriorFileError, match=r"unexpected"):
        load_posterior(path)


@pytest.mark.parametrize("dtype", [
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e5m2,
    # torch.isfinite is not implemented for these: the check widens them first
    torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
])
def test_nan_draws_of_an_ensemble_are_refused_whatever_their_dtype(tmp_path, dtype):
    from tests.inference.test_posterior import ensemble_posterior

    samples = ensemble_posterior().samples.to(dtype)
    samples[3, 1, 2] = float("nan")  # one draw of an SGLD chain that diverged
    forge(tmp_path / "e", {"samples": samples, "n_data": torch.tensor(5)}, "ensemble")
    with pytest.raises(PosteriorFileError, match=r"'samples' holds 1 NaN or infinite value\(s\) "
                                                 r"of 240; no posterior has them"):
        load_posterior(tmp_path / "e")


def test_files_of_the_previous_format_need_allow_legacy(tmp_path):
    post = head_posterior()
    path = tmp_path / "v1.safetensors"
    save_file({k: v.clone() for k, v in post.state_dict().items()}, str(path),
              metadata={"kind": "gaussian", "schema_version": "1"})  # what version 1 wrote
    with pytest.raises(PosteriorFileError, match=r"schema 1.*no checksum.*allow_legacy=True"):
        load_posterior(path)
    legacy = load_posterior(path, allow_legacy=True)
    assert torch.equal(legacy.mean, post.mean)
    save_posterior(legacy, path)  # saved again: now with a digest
    assert torch.equal(load_posterior(path).mean, post.mean)


def test_a_legacy_file_is_still_validated(tmp_path):
    state = {k: v.clone() for k, v in head_posterior().state_dict().items()}
    state["prior.shift"][0] = float("nan")
    save_file(state, str(tmp_path / "v1"), metadata={"kind": "gaussian", "schema_version": "1"})
    with pytest.raises(PosteriorFileError, match=r"NaN"):
        load_posterior(tmp_path / "v1", allow_legacy=True)


# -- authenticated files ------------------------------------------------------------------------


def test_keyed_files_need_their_key(tmp_path):
    post, path = head_posterior(), tmp_path / "k.safetensors"
    save_posterior(post, path, key=b"client-7-secret")
    assert torch.equal(load_posterior(path, key=b"client-7-secret").mean, post.mean)
    with pytest.raises(PosteriorFileError, match=r"authenticated with a key"):
        load_posterior(path)
    with pytest.raises(PosteriorFileError, match=r"key differs"):
        load_posterior(path, key=b"another key")
    # a forger without the key can only write an unkeyed file, which a keyed load refuses
    forge(tmp_path / "forged", post.state_dict(), "gaussian")
    with pytest.raises(PosteriorFileError, match=r"not authenticated"):
        load_posterior(tmp_path / "forged", key=b"client-7-secret")
    with pytest.raises(InvalidInputError, match=r"key must be non-empty bytes"):
        load_posterior(path, key="client-7-secret")


# -- saving ---------------------------------------------------------------------------------------


def test_save_refuses_what_it_could_not_load_back(tmp_path):
    class Wrapper:  # like a BodyPosterior (bayesfl's ClientPosterior): a kind no class loads
        kind = "client"

        def state_dict(self):
            return head_posterior().state_dict()

    with pytest.raises(InvalidInputError, match=r"kind 'client'.*post.head"):
        save_posterior(Wrapper(), tmp_path / "w")
    nan = head_posterior()
    nan.likelihood.shift[0] = float("nan")
    with pytest.raises(InvalidInputError, match=r"'likelihood.shift' holds NaN"):
        save_posterior(nan, tmp_path / "nan")
    assert list(tmp_path.iterdir()) == []


def test_save_to_a_missing_directory_or_onto_a_directory(tmp_path):
    with pytest.raises(PosteriorFileError, match=r"exist"):
        save_posterior(head_posterior(), tmp_path / "no" / "such" / "dir" / "p")
    with pytest.raises(PosteriorFileError, match=r"is a directory"):
        save_posterior(head_posterior(), tmp_path)


def test_bad_load_arguments(saved):
    path, _ = saved
    with pytest.raises(InvalidInputError, match=r"max_bytes"):
        load_posterior(path, max_bytes=0)
    with pytest.raises(InvalidInputError, match=r"not a torch device"):
        load_posterior(path, device="bogus")
    if not torch.cuda.is_available():
        with pytest.raises(InvalidInputError, match=r"CUDA is not available"):
            load_posterior(path, device="cuda")


def test_every_file_error_is_an_inference_error_and_a_value_error(tmp_path):
    with pytest.raises(InferenceError) as caught:
        load_posterior(tmp_path / "absent")
    assert isinstance(caught.value, ValueError)
