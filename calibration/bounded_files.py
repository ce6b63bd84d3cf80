"""Opening and reading untrusted files within stated bounds, without ever unpickling.

A prediction file may come from anywhere, so nothing is read before its kind and size are known:

* the path is opened without blocking (a FIFO would otherwise wait for a writer forever) and
  without following a symlink loop, and must be a regular file: a directory, a FIFO, a socket
  or a device (``/dev/zero`` would be read without end) is refused, named as what it is;
* a ``.npy`` array's header declares its shape and dtype: the bytes they need are checked
  against the limit, and against what the file holds, before the array is allocated;
* a ``.npz`` (and a ``.pt``, also a zip archive) declares each member's uncompressed size in
  its directory: a few megabytes that would decompress to gigabytes are refused from those
  declarations, and every member's ``.npy`` header is checked as above. Decompression stops at
  the declared size, so a member cannot yield more than its declaration says.

The limit is `MAX_FILE_BYTES` unless a caller passes another (``bayesfl-calibrate
--max-bytes``). Problems raise `calibration.errors.FileFormatError`.
"""

from __future__ import annotations

import errno
import os
import stat
import struct
import zipfile
from pathlib import Path
from typing import BinaryIO

import numpy as np

from calibration.errors import FileFormatError

MAX_FILE_BYTES = 1 << 30
"""The most bytes one prediction or labels file may hold (or decompress to): 1 GiB by default.

That is 268 million float32 scores (e.g. 2.7 million samples of 100 classes). Scoring needs
a few per-row arrays beside the scores, and a per-client report slices them per client, so peak
memory is a few times the file: 1 GiB keeps a report within a few GB, on a laptop too. A larger
evaluation raises the limit explicitly (``max_bytes=``, ``--max-bytes``)."""

MAX_ARCHIVE_MEMBERS = 1024
"""The most members a ``.npz``/``.pt`` archive may list (a prediction file has a handful)."""

_MAX_HEADER_BYTES = 10_000  # numpy's own default bound on a .npy header


def describe_size(n_bytes: int) -> str:
    """``n_bytes`` for people: "2.25 GB (2,250,000,000 bytes)"."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n_bytes >= scale:
            return f"{n_bytes / scale:.3g} {unit} ({n_bytes:,} bytes)"
    return f"{n_bytes:,} bytes"


def open_regular_file(path: Path) -> BinaryIO:
    """Open ``path`` for binary reading if it is a regular file (following sane symlinks).

    Never blocks: the open is non-blocking, so a FIFO without a writer returns at once and is
    then refused for what it is. The handle is positioned at the start.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    flags |= getattr(os, "O_NOCTTY", 0)
    try:
        fd = os.open(path, flags)
    except OSError as err:
        raise FileFormatError(f"{path}: {_open_problem(path, err)}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise FileFormatError(f"{path}: {_not_regular(mode)}")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _open_problem(path: Path, err: OSError) -> str:
    """Why ``path`` could not be opened, in words (not only "no such file")."""
    if err.errno == errno.ELOOP:
        return "a symbolic link loop (the link points, directly or not, back to itself)"
    if err.errno == errno.ENOENT:
        if os.path.islink(path):
            return f"a broken symbolic link (to {os.readlink(path)!r}, which does not exist)"
        return "no such file"
    if err.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    if err.errno == errno.ENXIO:  # opening a socket (or a device without its driver)
        try:
            return _not_regular(os.stat(path).st_mode)
        except OSError:
            pass
    return err.strerror or str(err)


def _not_regular(mode: int) -> str:
    for test, what in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe (FIFO)"),
                       (stat.S_ISCHR, "a character device (such as /dev/zero)"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return f"is {what}, not a regular file; give the path of a prediction file"
    return "is not a regular file; give the path of a prediction file"


def check_size(n_bytes: int, what: str, max_bytes: int, note: str = "") -> None:
    """Refuse ``n_bytes`` beyond ``max_bytes``, saying how much and how to allow it."""
    if n_bytes > max_bytes:
        raise FileFormatError(
            f"{what} {describe_size(n_bytes)}{note}, more than the limit of "
            f"{describe_size(max_bytes)}; if this is expected, raise the limit (max_bytes= / "
            "--max-bytes)"
        )


def file_size(handle: BinaryIO) -> int:
    return os.fstat(handle.fileno()).st_size


def read_npy(handle: BinaryIO, name: str, max_bytes: int) -> np.ndarray:
    """The array of a ``.npy`` file after its header passed `_checked_header`."""
    _checked_header(handle, name, max_bytes, file_size(handle))
    handle.seek(0)
    return _read_array(handle, name)


def read_npz(handle: BinaryIO, name: str, max_bytes: int) -> dict[str, np.ndarray]:
    """The arrays of a ``.npz`` archive (member name without ``.npy`` -> array)."""
    archive = open_archive(handle, name, max_bytes)
    arrays = {}
    with archive:
        for info in archive.infolist():
            if not info.filename.endswith(".npy") or info.is_dir():
                continue  # np.savez writes only .npy members; anything else is not an array
            try:
                with archive.open(info) as member:
                    _checked_header(member, f"{name}:{info.filename}", max_bytes,
                                    info.file_size)
                with archive.open(info) as member:
                    arrays[info.filename[:-4]] = _read_array(member, name)
            except FileFormatError:
                raise
            except Exception as err:  # corrupt compressed data fails in many ways
                raise FileFormatError(
                    f"{name}: member {info.filename!r} is not readable ({_reason(err)})"
                ) from None
    return arrays


def is_zip_archive(handle: BinaryIO) -> bool:
    """Whether ``handle`` ends in a zip directory (read from the start again afterwards)."""
    try:
        return zipfile.is_zipfile(handle)
    except Exception:  # e.g. BadZipFile for a damaged directory: not a readable archive
        return False
    finally:
        handle.seek(0)


# What zipfile raises on a damaged central directory: a bad signature or offsets
# (BadZipFile, struct.error, EOFError, OSError), an unsupported zip feature in the header
# (NotImplementedError), undecodable or inconsistent fields (ValueError, incl. UnicodeError),
# a member table larger than memory allows (MemoryError, OverflowError).
_ZIP_ERRORS = (zipfile.BadZipFile, struct.error, EOFError, OSError, NotImplementedError,
               ValueError, MemoryError, OverflowError)


def open_archive(handle: BinaryIO, name: str, max_bytes: int) -> zipfile.ZipFile:
    """A zip archive whose declared, uncompressed content fits in ``max_bytes``."""
    try:
        archive = zipfile.ZipFile(handle)
    except _ZIP_ERRORS as err:
        raise FileFormatError(f"{name}: not a readable zip archive ({_reason(err)})") from None
    infos = archive.infolist()
    if len(infos) > MAX_ARCHIVE_MEMBERS:
        archive.close()
        raise FileFormatError(
            f"{name}: the archive lists {len(infos):,} members, more than the "
            f"{MAX_ARCHIVE_MEMBERS:,} a prediction file may hold (MAX_ARCHIVE_MEMBERS)"
        )
    total = sum(info.file_size for info in infos)
    if total > max_bytes:
        archive.close()
        check_size(total, f"{name}: decompressed, its content would take", max_bytes,
                   f" (the file holds {describe_size(file_size(handle))})")
    return archive


def _checked_header(stream: BinaryIO, name: str, max_bytes: int, available: int) -> None:
    """Read a ``.npy`` header from ``stream``; refuse pickles, and data beyond the limit or
    beyond the ``available`` bytes (the file, or the member's declared size)."""
    try:
        version = np.lib.format.read_magic(stream)
        reader = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                  else np.lib.format.read_array_header_2_0)
        shape, _, dtype = reader(stream, max_header_size=_MAX_HEADER_BYTES)
    except Exception as err:  # a corrupt header fails in many ways (TokenError, ...)
        raise FileFormatError(f"{name}: not a readable .npy array ({_reason(err)})") from None
    if dtype.hasobject:
        raise FileFormatError(f"{name}: refusing pickled data (an array of Python objects)")
    count = 1
    for extent in shape:
        count *= int(extent)
    n_bytes = count * dtype.itemsize
    shown = " x ".join(f"{int(extent):,}" for extent in shape) or "a scalar"
    check_size(n_bytes, f"{name}: its header declares {shown} {dtype} values, that is",
               max_bytes)
    header_end = stream.tell()
    if header_end + n_bytes > available:
        raise FileFormatError(
            f"{name}: truncated: the header declares {shown} {dtype} values "
            f"({describe_size(n_bytes)}) but only {describe_size(max(available - header_end, 0))}"
            " follow it"
        )


def _read_array(stream: BinaryIO, name: str) -> np.ndarray:
    try:
        return np.lib.format.read_array(stream, allow_pickle=False,
                                        max_header_size=_MAX_HEADER_BYTES)
    except Exception as err:  # after the header checks, only corrupt data can fail here
        if "pickle" in str(err).lower() or "object arrays" in str(err).lower():
            raise FileFormatError(f"{name}: refusing pickled data") from None
        raise FileFormatError(f"{name}: not a readable .npy array ({_reason(err)})") from None


def _reason(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text or type(err).__name__
