"""A path that is no regular file is named for what it is, and never read or waited on.

A directory, a FIFO (which would block a plain open until a writer came), a device such as
/dev/zero (which would be read without end), a socket, a symlink loop and a broken symlink each
get a FileFormatError saying what the path is, whatever its suffix. Also here: the CSV a pandas
user writes by default, with the frame's index as an unnamed first column.
"""

import os
import socket
import tempfile
import threading
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from calibration_reference import calibrated_labels, random_probs

from calibration.errors import CalibrationWarning, FileFormatError, InvalidInputError
from calibration.metrics import evaluate
from calibration.prediction_files import load_predictions
from calibration.report import report


def load_within(seconds, *args, **kwargs):
    """load_predictions in a thread: a call that blocks fails the test instead of hanging it."""
    outcome = {}

    def target():
        try:
            outcome["value"] = load_predictions(*args, **kwargs)
        except Exception as err:  # reported to the test below
            outcome["error"] = err

    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"load_predictions blocked for more than {seconds} s"
    return outcome


def refused_as(path, what, labels_path=None):
    outcome = load_within(20, path, labels_path)
    error = outcome.get("error")
    assert isinstance(error, FileFormatError), outcome
    assert what in str(error)
    assert "no such file" not in str(error) or what == "no such file"
    return str(error)


@pytest.mark.parametrize("name", ["preds.npz", "preds.csv", "preds"])
def test_a_directory_is_named_a_directory(tmp_path, name):
    (tmp_path / name).mkdir()
    refused_as(tmp_path / name, "is a directory, not a regular file")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs os.mkfifo")
@pytest.mark.parametrize("name", ["preds.npz", "preds.csv", "labels.npy"])
def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path, name):
    os.mkfifo(tmp_path / name)
    refused_as(tmp_path / name, "is a named pipe (FIFO)")


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_dev_zero_is_a_character_device_and_is_not_read():
    refused_as(Path("/dev/zero"), "is a character device")
    refused_as(Path("/dev/null"), "is a character device")


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_dev_zero_as_a_labels_file_or_behind_a_symlink(tmp_path):
    np.save(tmp_path / "scores.npy", np.full((4, 2), 0.5))
    refused_as(tmp_path / "scores.npy", "is a character device", labels_path="/dev/zero")
    (tmp_path / "zero.npy").symlink_to("/dev/zero")
    refused_as(tmp_path / "zero.npy", "is a character device")


def test_a_symlink_loop_is_named_a_loop(tmp_path):
    (tmp_path / "a.npz").symlink_to(tmp_path / "b.npz")
    (tmp_path / "b.npz").symlink_to(tmp_path / "a.npz")
    refused_as(tmp_path / "a.npz", "symbolic link loop")


def test_a_broken_symlink_says_where_it_points(tmp_path):
    (tmp_path / "p.npz").symlink_to(tmp_path / "gone.npz")
    message = refused_as(tmp_path / "p.npz", "broken symbolic link")
    assert "gone.npz" in message


def test_a_missing_file_is_still_no_such_file(tmp_path):
    refused_as(tmp_path / "absent.npz", "no such file")


@pytest.mark.skipif(not hasattr(socket, "AF_UNIX"), reason="needs unix sockets")
def test_a_socket_is_named_a_socket():
    with tempfile.TemporaryDirectory(dir="/tmp") as short:  # socket paths are short
        path = Path(short) / "p.npz"
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            server.bind(str(path))
            refused_as(path, "is a socket")
        finally:
            server.close()


def test_a_symlink_to_a_regular_file_is_read(tmp_path):
    probs = random_probs(np.random.default_rng(1), 30, 3)
    np.savez(tmp_path / "real.npz", probs=probs, labels=np.arange(30) % 3)
    (tmp_path / "link.npz").symlink_to(tmp_path / "real.npz")
    np.testing.assert_array_equal(load_predictions(tmp_path / "link.npz").scores, probs)


# -- the CSV pandas writes by default ----------------------------------------------------------
@pytest.fixture
def frame():
    rng = np.random.default_rng(2)
    probs = random_probs(rng, 444, 3)
    table = pd.DataFrame(probs, columns=["cat", "dog", "bird"])
    table["label"] = calibrated_labels(rng, probs)
    table["client_id"] = np.array(["a", "b", "c", "d"])[rng.integers(0, 4, 444)]
    return table


def test_a_pandas_index_column_is_ignored_with_a_warning(tmp_path, frame):
    frame.to_csv(tmp_path / "p.csv")  # index=True: a first column ",0,1,2,..." without a name
    assert (tmp_path / "p.csv").read_text().startswith(",cat,dog,bird,label,client_id")
    with pytest.warns(CalibrationWarning, match=r"ignoring the first column: it has no header "
                      r"name and holds rows numbered 0\.\.443.*index=False"):
        loaded = load_predictions(tmp_path / "p.csv")
    np.testing.assert_allclose(loaded.scores, frame[["cat", "dog", "bird"]].to_numpy(),
                               rtol=1e-15)
    np.testing.assert_array_equal(loaded.labels, frame["label"])
    result = report(loaded.scores, loaded.labels, loaded.client_ids)
    assert result.pooled.count == 444 and len(result.clients) == 4
    assert result.pooled.ece == pytest.approx(
        evaluate(frame[["cat", "dog", "bird"]].to_numpy(), frame["label"].to_numpy())["ece"],
        abs=1e-12)


def test_a_filtered_frame_index_is_recognised_too(tmp_path, frame):
    frame.iloc[::3].to_csv(tmp_path / "p.csv")  # index 0, 3, 6, ...
    with pytest.warns(CalibrationWarning, match="holds distinct integers"):
        loaded = load_predictions(tmp_path / "p.csv")
    assert loaded.scores.shape == (148, 3)


def test_without_the_index_nothing_is_dropped_or_warned(tmp_path, frame):
    frame.to_csv(tmp_path / "p.csv", index=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_predictions(tmp_path / "p.csv").scores.shape == (444, 3)


def test_an_unnamed_first_column_that_is_no_index_is_kept(tmp_path):
    """One-hot scores in an unnamed first column repeat values: a score column, not an index."""
    (tmp_path / "p.csv").write_text(",p1,label\n1,0,0\n0,1,1\n1,0,0\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = load_predictions(tmp_path / "p.csv")
    np.testing.assert_array_equal(loaded.scores, [[1, 0], [0, 1], [1, 0]])


def test_a_client_column_with_empty_cells_is_refused(tmp_path, frame):
    frame.loc[[10, 20], "client_id"] = None
    frame.to_csv(tmp_path / "p.csv", index=False)
    loaded = load_predictions(tmp_path / "p.csv")
    with pytest.raises(InvalidInputError, match=r"client_ids\[10\] is missing"):
        report(loaded.scores, loaded.labels, loaded.client_ids)
