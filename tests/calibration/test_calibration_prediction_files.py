"""Reading prediction files safely: formats, keys, refusals."""

import pickle

import numpy as np
import pytest
import torch
from calibration_reference import calibrated_labels, random_probs

from calibration.errors import FileFormatError
from calibration.prediction_files import load_predictions


@pytest.fixture
def arrays():
    rng = np.random.default_rng(0)
    probs = random_probs(rng, 120, 4)
    return probs, calibrated_labels(rng, probs), rng.integers(0, 3, 120)


def test_npz_with_probs_labels_and_client_ids(tmp_path, arrays):
    probs, labels, clients = arrays
    np.savez(tmp_path / "p.npz", probs=probs, labels=labels, client_ids=clients)
    loaded = load_predictions(tmp_path / "p.npz")
    np.testing.assert_array_equal(loaded.scores, probs)
    np.testing.assert_array_equal(loaded.labels, labels)
    np.testing.assert_array_equal(loaded.client_ids, clients)
    assert loaded.from_logits is False


def test_npz_logits_must_be_asked_for(tmp_path, arrays):
    probs, labels, _ = arrays
    np.savez(tmp_path / "l.npz", logits=np.log(probs), labels=labels)
    with pytest.raises(FileFormatError, match="--logits"):
        load_predictions(tmp_path / "l.npz")
    assert load_predictions(tmp_path / "l.npz", logits=True).from_logits is True


def test_npy_scores_with_a_separate_labels_file(tmp_path, arrays):
    probs, labels, _ = arrays
    np.save(tmp_path / "s.npy", probs)
    np.save(tmp_path / "y.npy", labels)
    loaded = load_predictions(tmp_path / "s.npy", tmp_path / "y.npy")
    np.testing.assert_array_equal(loaded.labels, labels)
    with pytest.raises(FileFormatError, match="--labels"):
        load_predictions(tmp_path / "s.npy")


def test_pt_dict_of_tensors(tmp_path, arrays):
    probs, labels, clients = arrays
    torch.save({"probs": torch.tensor(probs), "labels": torch.tensor(labels),
                "site": torch.tensor(clients)}, tmp_path / "p.pt")
    loaded = load_predictions(tmp_path / "p.pt", client_key="site")
    assert torch.equal(loaded.scores, torch.tensor(probs))
    np.testing.assert_array_equal(loaded.client_ids, clients)


def test_csv_with_label_client_and_class_columns(tmp_path, arrays):
    probs, labels, clients = arrays
    lines = ["c0,c1,c2,c3,label,client_id"]
    lines += [",".join(f"{v:.17g}" for v in row) + f",{y},site{c}"
              for row, y, c in zip(probs, labels, clients, strict=True)]
    (tmp_path / "p.csv").write_text("\n".join(lines) + "\n")
    loaded = load_predictions(tmp_path / "p.csv")
    np.testing.assert_allclose(loaded.scores, probs, rtol=0, atol=1e-16)
    np.testing.assert_array_equal(loaded.labels, labels)
    assert set(loaded.client_ids) == {f"site{c}" for c in clients}


def test_pickled_npy_and_npz_are_refused(tmp_path):
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(FileFormatError, match="pickled"):
        load_predictions(tmp_path / "obj.npy", tmp_path / "obj.npy")
    np.savez(tmp_path / "obj.npz", probs=np.array([{"a": 1}], dtype=object), labels=[0])
    with pytest.raises(FileFormatError, match="pickled"):
        load_predictions(tmp_path / "obj.npz")
    (tmp_path / "raw.npy").write_bytes(pickle.dumps({"probs": [[0.5, 0.5]]}))
    with pytest.raises(FileFormatError):
        load_predictions(tmp_path / "raw.npy", tmp_path / "raw.npy")


class Payload:
    """Not a tensor: torch.load(weights_only=True) must refuse to rebuild it."""


def test_pt_with_arbitrary_objects_is_refused(tmp_path):
    torch.save({"probs": Payload(), "labels": torch.zeros(2)}, tmp_path / "bad.pt")
    with pytest.raises(FileFormatError, match="weights_only"):
        load_predictions(tmp_path / "bad.pt")
    torch.save({"probs": torch.zeros(2, 2), "labels": [0, 1]}, tmp_path / "list.pt")
    with pytest.raises(FileFormatError, match="tensor"):
        load_predictions(tmp_path / "list.pt")


def test_wrong_keys_and_columns_are_refused(tmp_path, arrays):
    probs, labels, _ = arrays
    np.savez(tmp_path / "k.npz", scores=probs, labels=labels)
    with pytest.raises(FileFormatError, match="no 'probs' entry"):
        load_predictions(tmp_path / "k.npz")
    np.savez(tmp_path / "n.npz", probs=probs)
    with pytest.raises(FileFormatError, match="labels"):
        load_predictions(tmp_path / "n.npz")
    np.savez(tmp_path / "c.npz", probs=probs, labels=labels)
    with pytest.raises(FileFormatError, match="'site'"):
        load_predictions(tmp_path / "c.npz", client_key="site")
    (tmp_path / "t.csv").write_text("a,b,label\n0.5,x,1\n")
    with pytest.raises(FileFormatError, match="numeric"):
        load_predictions(tmp_path / "t.csv")


@pytest.mark.parametrize(("name", "content"), [("broken.npz", b"not a zip"),
                                               ("broken.pt", b"garbage"),
                                               ("empty.csv", b""),
                                               ("header.csv", b"a,b,label\n"),
                                               ("data.txt", b"1,2")])
def test_unreadable_files_are_refused(tmp_path, name, content):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(FileFormatError):
        load_predictions(tmp_path / name)


def test_missing_file_is_refused(tmp_path):
    with pytest.raises(FileFormatError, match="no such file"):
        load_predictions(tmp_path / "absent.npz")


def corrupted(data: bytes, rng) -> list[bytes]:
    """Every 1/30th truncation of ``data`` and 30 copies with a few random bytes changed."""
    variants = [data[:k] for k in range(0, len(data), max(1, len(data) // 30))]
    for _ in range(30):
        copy = bytearray(data)
        for position in rng.integers(0, len(data), rng.integers(1, 8)):
            copy[position] = rng.integers(0, 256)
        variants.append(bytes(copy))
    return variants


@pytest.mark.parametrize("suffix", [".npz", ".npy", ".pt", ".csv", ".compressed.npz"])
def test_a_truncated_or_corrupted_file_is_always_a_file_format_error(tmp_path, arrays, suffix):
    """Whatever the damage, the outcome is the file loading (if the damage missed what is read)
    or a CalibrationError: never another exception (numpy's header tokenizer, torch's unpickler
    and zlib raise many kinds)."""
    from calibration.errors import CalibrationError
    from calibration.report import report

    probs, labels, clients = arrays
    source = tmp_path / f"valid{suffix}"
    if suffix == ".npz":
        np.savez(source, probs=probs, labels=labels, client_ids=clients)
    elif suffix == ".compressed.npz":
        np.savez_compressed(source, probs=probs, labels=labels)
    elif suffix == ".npy":
        np.save(source, probs)
    elif suffix == ".pt":
        torch.save({"probs": torch.tensor(probs), "labels": torch.tensor(labels)}, source)
    else:
        source.write_text("p0,p1,p2,p3,label\n" + "\n".join(
            ",".join(f"{v:.17g}" for v in row) + f",{y}" for row, y in zip(probs, labels,
                                                                            strict=True)))
    np.save(tmp_path / "labels.npy", labels)
    damaged = tmp_path / f"damaged{source.suffix}"
    for variant in corrupted(source.read_bytes(), np.random.default_rng(len(suffix))):
        damaged.write_bytes(variant)
        try:
            loaded = load_predictions(damaged, tmp_path / "labels.npy" if suffix == ".npy"
                                      else None)
            report(loaded.scores, loaded.labels, loaded.client_ids)
        except CalibrationError:
            pass


def test_arguments_that_are_no_paths_or_flags_are_refused(tmp_path, arrays):
    from calibration.errors import InvalidInputError

    probs, labels, _ = arrays
    np.savez(tmp_path / "p.npz", probs=probs, labels=labels)
    for bad in (None, 3, ["p.npz"], ""):
        with pytest.raises(InvalidInputError, match="path must be a file path"):
            load_predictions(bad)
    with pytest.raises(InvalidInputError, match="labels_path must be a file path"):
        load_predictions(tmp_path / "p.npz", 5)
    with pytest.raises(InvalidInputError, match="logits must be True or False"):
        load_predictions(tmp_path / "p.npz", logits="yes")
    with pytest.raises(InvalidInputError, match="label_key must be a column or entry name"):
        load_predictions(tmp_path / "p.npz", label_key=0)
    assert load_predictions(str(tmp_path / "p.npz")).scores.shape == (120, 4)
