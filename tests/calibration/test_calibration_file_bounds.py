"""Prediction files: refused from their own declarations before anything large is allocated.

Sizes are checked from what a file says about itself (its length, a zip member's declared
uncompressed size, a .npy header's shape and dtype), so a small file that would expand to
gigabytes is refused in milliseconds, with the number that was too large. Each refusal is also
checked to allocate almost nothing (tracemalloc sees numpy's and Python's allocations).
"""

import io
import struct
import tracemalloc
import zipfile

import numpy as np
import pytest
import torch
from calibration_reference import calibrated_labels, random_probs

from calibration.bounded_files import MAX_FILE_BYTES, describe_size
from calibration.errors import FileFormatError, InvalidInputError
from calibration.prediction_files import load_predictions

SMALL_ALLOCATION = 20 * 2**20  # a refusal may parse headers and zip directories, nothing more


@pytest.fixture
def arrays():
    rng = np.random.default_rng(0)
    probs = random_probs(rng, 200, 4)
    return probs, calibrated_labels(rng, probs)


def refused(path, match, **kwargs):
    """Load ``path``, expect FileFormatError matching ``match``; return the peak allocation."""
    tracemalloc.start()
    try:
        with pytest.raises(FileFormatError, match=match):
            load_predictions(path, **kwargs)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def npy_header(shape, descr="<f8") -> bytes:
    stream = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        stream, {"descr": descr, "fortran_order": False, "shape": shape})
    return stream.getvalue()


def test_the_default_limit_is_one_gibibyte():
    assert MAX_FILE_BYTES == 2**30
    assert describe_size(2_250_000_000) == "2.25 GB (2,250,000,000 bytes)"


def test_a_npy_header_declaring_1e12_rows_is_refused_before_reading(tmp_path):
    path = tmp_path / "huge.npy"
    path.write_bytes(npy_header((10**12, 2)) + b"\0" * 64)
    peak = refused(path, r"1,000,000,000,000 x 2 float64 values, that is 16 TB "
                         r"\(16,000,000,000,000 bytes\), more than the limit of 1.07 GB",
                   labels_path=path)
    assert peak < SMALL_ALLOCATION


def test_a_npy_header_promising_more_data_than_the_file_holds_is_truncated(tmp_path):
    path = tmp_path / "short.npy"
    path.write_bytes(npy_header((1000, 4)) + b"\0" * 800)
    refused(path, r"truncated: the header declares 1,000 x 4 float64 values \(32 kB "
                  r"\(32,000 bytes\)\) but only 800 bytes follow it", labels_path=path)


def test_a_compressed_npz_that_expands_beyond_the_limit_is_refused(tmp_path, arrays):
    """A real zip bomb at a small scale: 40 MB of zeros compress to ~40 kB."""
    _, labels = arrays
    path = tmp_path / "bomb.npz"
    np.savez_compressed(path, probs=np.zeros((5_000_000, 1)), labels=labels)
    assert path.stat().st_size < 100_000
    peak = refused(path, r"decompressed, its content would take 40 MB .* \(the file holds "
                         r"\d+(\.\d+)? kB .*more than the limit of 4 MB", max_bytes=4_000_000)
    assert peak < SMALL_ALLOCATION
    assert load_predictions(path, max_bytes=50_000_000).scores.shape == (5_000_000, 1)


def forged_npz(path, declared_size: int) -> None:
    """A small valid .npz whose zip directory declares ``declared_size`` uncompressed bytes for
    its member (what a 3 MB archive of 2.25 GB of zeros declares)."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("probs.npy", npy_header((4, 2)) + np.full(8, 0.5).tobytes())
    data = bytearray(path.read_bytes())
    central = data.rindex(b"PK\x01\x02")  # the central directory entry of the member
    struct.pack_into("<I", data, central + 24, declared_size)
    path.write_bytes(bytes(data))


def test_an_npz_declaring_gigabytes_is_refused_at_the_default_limit(tmp_path):
    path = tmp_path / "declared.npz"
    forged_npz(path, 2_250_000_000)
    peak = refused(path, r"decompressed, its content would take 2.25 GB \(2,250,000,000 bytes\)")
    assert peak < SMALL_ALLOCATION


def test_a_member_header_larger_than_its_declared_size_is_refused(tmp_path, arrays):
    """The .npy header inside a member is checked against the member's declared size."""
    _, labels = arrays
    path = tmp_path / "lying.npz"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("probs.npy", npy_header((10**6, 4)) + b"\0" * 100)
        archive.writestr("labels.npy", npy_header((200,), "<i8") + labels.astype("<i8").tobytes())
    refused(path, r"probs.npy: truncated: the header declares 1,000,000 x 4 float64")


def test_a_sparse_2gb_csv_is_refused_from_its_length(tmp_path):
    path = tmp_path / "sparse.csv"
    with open(path, "wb") as handle:
        handle.write(b"p0,p1,label\n0.5,0.5,0\n")
        handle.truncate(2 * 10**9)  # a hole: nothing is written to disk
    peak = refused(path, r"the CSV file holds 2 GB \(2,000,000,000 bytes\), more than the limit")
    assert peak < SMALL_ALLOCATION


def test_a_pt_archive_beyond_the_limit_is_refused(tmp_path, arrays):
    probs, labels = arrays
    path = tmp_path / "p.pt"
    torch.save({"probs": torch.tensor(probs), "labels": torch.tensor(labels)}, path)
    refused(path, r"decompressed, its content would take .* more than the limit of 1 kB",
            max_bytes=1000)
    assert load_predictions(path).scores.shape == (200, 4)


def test_an_old_format_pt_is_refused(tmp_path, arrays):
    """The pre-1.6 format declares storage sizes inside its pickle, where no bound is checked."""
    probs, labels = arrays
    path = tmp_path / "old.pt"
    torch.save({"probs": torch.tensor(probs), "labels": torch.tensor(labels)}, path,
               _use_new_zipfile_serialization=False)
    refused(path, "not a zip-format .pt file")


def test_the_labels_file_is_bounded_too(tmp_path, arrays):
    probs, _ = arrays
    np.save(tmp_path / "scores.npy", probs)
    (tmp_path / "labels.npy").write_bytes(npy_header((10**12,), "<i8"))
    with pytest.raises(FileFormatError, match=r"labels\.npy: its header declares 1,000,000,"):
        load_predictions(tmp_path / "scores.npy", tmp_path / "labels.npy")


def test_files_within_the_limit_load_exactly(tmp_path, arrays):
    probs, labels = arrays
    np.savez(tmp_path / "p.npz", probs=probs, labels=labels)
    size = (tmp_path / "p.npz").stat().st_size
    loaded = load_predictions(tmp_path / "p.npz", max_bytes=size)  # content <= file size here
    np.testing.assert_array_equal(loaded.scores, probs)
    np.testing.assert_array_equal(loaded.labels, labels)
    np.save(tmp_path / "fortran.npy", np.asfortranarray(probs))
    np.save(tmp_path / "y.npy", labels)
    np.testing.assert_array_equal(
        load_predictions(tmp_path / "fortran.npy", tmp_path / "y.npy").scores, probs)


@pytest.mark.parametrize("value", [0, -5, 1.5, "1G"])
def test_max_bytes_must_be_a_positive_integer(tmp_path, arrays, value):
    probs, labels = arrays
    np.savez(tmp_path / "p.npz", probs=probs, labels=labels)
    with pytest.raises(InvalidInputError, match="max_bytes must be a positive integer"):
        load_predictions(tmp_path / "p.npz", max_bytes=value)
