"""Atomic checkpoints of server state: tensors in a safetensors file, JSON meta in its metadata.

``save_checkpoint(path, tensors, meta)`` writes the whole file to a temporary file in the same
directory, fsyncs it, then ``os.replace``s it over ``path`` (and fsyncs the directory), so a
crash at any point leaves either the previous checkpoint or the new one, never a torn file.
Both fsyncs stay: without the first, a power loss after the rename may leave the new name on
a file whose data never reached the disk (file systems need not order data before the
rename's metadata); without the second, the rename itself may be lost, and a resumed run
would redo a round it had finished (the same numbers, but not "the last complete round").

**Cost** (16,000 FedLog clients: 64,004 tensors, 470 MB; one thread, measured on a shared
2-core machine, CPU seconds): taking each tensor's bytes ~0.4, the SHA-256 digest ~0.5 (0.34
of it hashing, the rest a line per tensor), the safetensors header ~0.25, writing ~0.5 (the
kernel's copy into the page cache; the parts go by ``os.writev``, no copy of ours), fsync
~0.8 s of waiting, little CPU; replacing the previous file frees its blocks (~0.3 s of
waiting). So the file is written with a placeholder digest of the same length, the kernel is
asked to start writing it back (``posix_fadvise(DONTNEED)``, ~0.3 s), the digest is computed
meanwhile and written into the header in place, and the fsync that follows waits ~0.0-0.4 s
instead of ~0.8 s (the same bytes as computing the digest first). The per-tensor part is
most of the CPU: the same bytes as 8 stacked tensors take ~0.5-0.9 CPU s instead of
~1.3-1.8. The fsync and the rename need nothing from the caller once the bytes are written:
``durable_in_background=True`` leaves them to a thread (`PendingWrite`), and the
simulator's next round runs meanwhile (waiting on the disk, ~1 s a round at 16,000 clients,
no longer in the round's time). Writing 470 MB into a new file needs as much fresh page cache,
which on this project's VMs (freed memory goes back to the host) made the write itself take
0.95-1.14 s; ``keep_spare=True`` writes over the file replaced one write before, whose pages
are still cached (0.10-0.14 s), and skips the ``DONTNEED`` hint, which would drop them.

The file's safetensors metadata holds ``bayesfl.meta`` (``meta`` as JSON), ``bayesfl.fingerprint``
(the run configuration's `config_fingerprint`) and ``bayesfl.sha256`` (a digest of the
fingerprint, the meta and the tensors). ``load_checkpoint(path, fingerprint=...)`` refuses a
missing, corrupt or foreign file with a `bayesfl.errors.CheckpointError` that says what
to do.

The fingerprint is taken from ``save_checkpoint(..., fingerprint=...)`` or else from
``meta["fingerprint"]``; one of the two is required. When the fingerprint differs and both the
checkpoint's meta and the caller hold the configuration (``meta["config"]``,
``load_checkpoint(..., config=...)``), the error lists the settings that differ.

Only a regular file of at most `MAX_CHECKPOINT_BYTES` is read: a directory, a FIFO, a
device such as ``/dev/zero`` (also behind a symlink) or a symlink loop is refused by name, and
the JSON in the metadata is parsed with its size and nesting bounded.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import hashlib
import json
import os
import stat
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as _safetensors_load

from bayesfl.errors import BayesFLError, CheckpointError, ConfigError
from bayesfl.messages import (
    raw_bytes,
    read_safetensors_metadata,
    safetensors_parts,
    tensor_digest,
)

_FORMAT = "bayesfl-checkpoint"
_KEY = "bayesfl."

MAX_CHECKPOINT_BYTES = 16 * 2**30
"""The largest checkpoint file read (16 GiB): far above any simulator run's server and client
states, and a bound on what a damaged or planted file can make the reader allocate."""

_WRITE_BYTES = 8 * 2**20
"""Bytes of a file given in parts written by one system call (at most)."""

try:
    _IOV_MAX = max(1, min(os.sysconf("SC_IOV_MAX"), 1024))
except (AttributeError, ValueError, OSError):  # no sysconf (Windows) or no such limit
    _IOV_MAX = 16
"""Buffers of one ``os.writev`` (POSIX's limit; Linux's is 1024)."""

MAX_HEADER_BYTES = 256 * 2**20
"""The largest safetensors header read from a checkpoint: ~90 bytes per tensor, and a
simulator's checkpoint holds every client's tensors (112,000 of them, 10 MiB, for FedLog at
16,000 clients; a message's 16 MiB limit would refuse 26,000)."""

MAX_META_BYTES = 64 * 2**20
"""The largest JSON meta read from a checkpoint's header (the metadata JSON is parsed whole)."""


def config_fingerprint(config: Mapping[str, Any]) -> str:
    """SHA-256 hex digest of ``config`` as canonical JSON (sorted keys, no whitespace).

    Paths become strings, numpy scalars Python numbers, tuples lists.

    Raises:
        ConfigError: a value that has no canonical JSON form (NaN, an arbitrary object, ...).
    """
    try:
        text = json.dumps(config, sort_keys=True, separators=(",", ":"), allow_nan=False,
                          ensure_ascii=True, default=_json_default)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"configuration cannot be fingerprinted: {err}") from err
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def _json_default(value: Any) -> Any:
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, set | frozenset):
        return sorted(value)
    raise TypeError(f"{type(value).__name__} value {value!r} is not JSON serialisable")


def save_checkpoint(
    path: str | os.PathLike[str],
    tensors: Mapping[str, torch.Tensor],
    meta: Mapping[str, Any],
    *,
    fingerprint: str | None = None,
    durable_in_background: bool = False,
    keep_spare: bool = False,
) -> PendingWrite:
    """Write ``tensors`` and ``meta`` to ``path`` atomically (temp file, fsync, ``os.replace``).

    ``durable_in_background``: return once the bytes are written (the tensors are no longer
    read), with the fsync and the rename left to a thread: ``wait()`` the returned
    `PendingWrite` before relying on the file (`write_atomically`). Otherwise
    the file is in place on return. ``keep_spare``: the replaced file is kept and
    overwritten by the next save (`write_atomically`; `discard_spare` at the end).

    Args:
        path: destination file (conventionally ``*.safetensors``); its directory must exist.
        tensors: named tensors (any device; stored from the CPU, dtypes kept).
        meta: JSON-serialisable run state (round number, RNG seeds, history, ...).
        fingerprint: the run's `config_fingerprint`; defaults to ``meta["fingerprint"]``.

    Raises:
        CheckpointError: no fingerprint, meta that is not JSON, or a failed write (the previous
            file at ``path``, if any, is left intact and no temporary file remains).
    """
    fingerprint = fingerprint if fingerprint is not None else meta.get("fingerprint")
    if not isinstance(fingerprint, str) or not fingerprint:
        raise CheckpointError("save_checkpoint needs the run's config_fingerprint: pass "
                              "fingerprint=... or put it in meta['fingerprint']")
    try:
        meta_json = json.dumps(dict(meta), sort_keys=True, allow_nan=True, default=_json_default)
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"checkpoint meta is not JSON serialisable: {err}") from err
    # each tensor's bytes taken once, for the digest and the file (no copies of tensors that
    # share a storage: a simulator's client states are views of its stacked parameters)
    raw = {name: raw_bytes(t) for name, t in tensors.items()}
    metadata = {
        _KEY + "format": _FORMAT,
        _KEY + "fingerprint": fingerprint,
        _KEY + "meta": meta_json,
        _KEY + "sha256": _PENDING_DIGEST,
    }
    parts = safetensors_parts(tensors, metadata, raw=raw)

    def with_digest(fd: int) -> None:
        # the digest, computed while the kernel writes the tensors back, replaces the
        # placeholder of the same length in the header already written (the file is still
        # the temporary one: nobody reads it before the rename)
        digest = tensor_digest(tensors, fingerprint + meta_json, raw=raw)
        header = bytes(memoryview(parts[0]).cast("B"))
        start = header.find(_PENDING_MARK, 0, 8 + int.from_bytes(header[:8], "little"))
        if len(parts) == 1 or start < 0 or header.count(_PENDING_MARK) != 1:
            # (one part is a whole file from safetensors itself; a name or meta holding the
            # mark cannot occur unescaped, but if it did: the header made again)
            header = safetensors_parts(tensors, {**metadata, _KEY + "sha256": digest},
                                       raw=raw)[0]
            _pwrite_all(fd, bytes(memoryview(header).cast("B")), 0)
            return
        _pwrite_all(fd, _PENDING_MARK.replace(_PENDING_DIGEST.encode(), digest.encode()),
                    start)

    return write_atomically(Path(path), parts, before_sync=with_digest,
                            durable_in_background=durable_in_background, keep_spare=keep_spare)


_PENDING_DIGEST = "0" * 64
"""The header's digest until it is computed (a SHA-256 hex digest's length)."""

_PENDING_MARK = f'"{_KEY}sha256":"{_PENDING_DIGEST}"'.encode()
"""The placeholder as the header's JSON holds it (keys and values as written, unescaped)."""


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    """``os.pwrite`` until every byte of ``data`` is at ``offset`` onwards."""
    view = memoryview(data)
    while view.nbytes:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def write_atomically(path: Path, data: bytes | Sequence[Any], *,
                     before_sync: Callable[[int], None] | None = None,
                     durable_in_background: bool = False,
                     keep_spare: bool = False) -> PendingWrite:
    """Replace ``path`` by ``data`` (bytes, or bytes-like parts written one after the other)
    so readers see the old or the new content, never a mix. ``before_sync(fd)``, if given,
    may change the temporary file (by ``os.pwrite``) after the data are written and before
    they are made durable: the kernel is asked to start writing them to the disk first, so
    the work it does overlaps that wait.

    ``durable_in_background``: the bytes are written (and ``data`` no longer read) when this
    returns; making them durable and renaming the file over ``path`` (fsync, rename, the
    directory's fsync: waiting on the disk, ~1 s for a 470 MB checkpoint) goes on in a thread,
    and the returned `PendingWrite`'s ``wait()`` ends it. Until then ``path`` holds
    its previous content. Otherwise that happens here and the returned write is complete.

    ``keep_spare``: for a file written again and again (a run's checkpoint, every round).
    The file it replaces is kept as `spare_path` (the two names swapped atomically,
    Linux's ``renameat2(RENAME_EXCHANGE)``) and the next write overwrites that spare in place
    instead of creating a file: its pages are still in the page cache, while a new file's
    need fresh memory (470 MB: 0.10-0.14 s against 1.0-1.1 s on this project's VMs, whose
    freed memory goes back to the host). The spare costs the file's size on the disk until
    `discard_spare`; where the swap is not supported the old file is replaced as usual.
    A write with a spare must not begin before the previous one to ``path`` has ended (its
    ``wait()``): both would write into the spare.

    Raises:
        CheckpointError: the write failed; the old file is intact and the temp file removed
            (from ``wait()`` when it failed in the background).
    """
    directory = path.parent if str(path.parent) else Path(".")
    spare = spare_path(path) if keep_spare else None
    opened = _open_spare(spare) if spare is not None else None
    if opened is not None:
        handle, temp_name = opened, str(spare)
    else:
        try:
            handle, temp_name = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.",
                                                 suffix=".tmp")
        except OSError as err:
            raise CheckpointError(f"cannot create a temporary file in {directory}: "
                                  f"{err}") from err
    try:
        _write_parts(handle, [data] if isinstance(data, bytes | bytearray) else data)
        if opened is not None:  # a spare may be longer than this file
            os.ftruncate(handle, os.lseek(handle, 0, os.SEEK_CUR))
        if before_sync is not None:
            # start the write-back (Linux), not wait; not when a spare is kept: this drops
            # the file's pages once written back, and they are what its next write reuses
            if hasattr(os, "posix_fadvise") and spare is None:
                with contextlib.suppress(OSError):  # (a hint: some file systems refuse it)
                    os.posix_fadvise(handle, 0, 0, os.POSIX_FADV_DONTNEED)
            before_sync(handle)
    except BaseException as err:
        _discard(handle, temp_name)
        if isinstance(err, OSError):
            raise _write_failed(path, err) from err
        raise

    def make_durable() -> None:
        try:
            # durable before it is renamed: a crash after the rename must find the new
            # bytes under the name, not an empty or partly written file
            try:
                os.fsync(handle)
            finally:
                os.close(handle)  # once: a second close could hit a reused descriptor
            if spare is not None and _exchange(temp_name, path):
                if opened is None:  # the old file, under a new temporary name now
                    _keep_as_spare(temp_name, spare)
            else:
                os.replace(temp_name, path)
        except BaseException as err:
            with contextlib.suppress(OSError):
                os.unlink(temp_name)
            if isinstance(err, OSError):
                raise _write_failed(path, err) from err
            raise
        _fsync_directory(directory)

    if durable_in_background:
        return PendingWrite(make_durable)
    make_durable()
    return PendingWrite(None)


def spare_path(path: Path) -> Path:
    """Where ``write_atomically(path, ..., keep_spare=True)`` keeps the file it replaced (a
    name `bayesfl.run_directory` takes for a temporary file)."""
    return path.with_name(f".{path.name}.spare.tmp")


def discard_spare(path: Path) -> None:
    """Delete the spare `write_atomically` keeps for ``path`` (``keep_spare``), if any:
    when the writes end, it is only a copy of an older file."""
    with contextlib.suppress(FileNotFoundError):
        spare = spare_path(path)
        if spare.is_symlink() or spare.is_file():
            spare.unlink()


def _keep_as_spare(name: str, spare: Path) -> None:
    """Rename the replaced file ``name`` to ``spare``; if that fails, delete it (the new file
    is in place either way: only the next write's saving is lost)."""
    try:
        os.replace(name, spare)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(name)


def _open_spare(spare: Path) -> int | None:
    """``spare`` opened to be overwritten, or None if it is missing or not a regular file of
    ours with one link (a symlink is not followed; a FIFO does not block the open)."""
    flags = (os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
             | getattr(os, "O_CLOEXEC", 0))
    try:
        handle = os.open(spare, flags)
    except OSError:
        return None
    info = os.fstat(handle)
    ours = not hasattr(os, "getuid") or info.st_uid == os.getuid()
    if stat.S_ISREG(info.st_mode) and info.st_nlink == 1 and ours:
        os.set_blocking(handle, True)
        return handle
    os.close(handle)
    return None


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_NO_EXCHANGE = frozenset({errno.ENOENT, errno.EINVAL, errno.ENOSYS, errno.EXDEV,
                          errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)})
"""``renameat2`` errors that mean "not swapped, replace instead": no file to swap with yet,
or a file system (or kernel) without ``RENAME_EXCHANGE``."""


@functools.cache
def _renameat2() -> Callable[..., int] | None:
    """glibc's ``renameat2`` (Linux; Python's ``os`` has no flags for a rename), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # a libc without it (glibc < 2.28, some musl)
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                         ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


def _exchange(first: str | Path, second: str | Path) -> bool:
    """Swap the two names atomically; False if ``second`` does not exist or the swap is not
    supported here (nothing changed)."""
    rename = _renameat2()
    if rename is None:
        return False
    if rename(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second),
              _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in _NO_EXCHANGE:
        return False
    raise OSError(code, os.strerror(code), str(second))


class PendingWrite:
    """A file write whose last steps may run in a background thread
    (`write_atomically`); `wait` returns when the file is in place."""

    def __init__(self, finish: Callable[[], None] | None) -> None:
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if finish is not None:
            def run() -> None:
                try:
                    finish()
                except BaseException as err:  # handed to wait(): a thread cannot raise
                    self._error = err
            # not a daemon: an interpreter that exits first waits for the file to be in place
            self._thread = threading.Thread(target=run, name="bayesfl-durable-write")
            self._thread.start()

    @property
    def done(self) -> bool:
        """Whether the write has finished (successfully or not)."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> None:
        """Block until the file is in place (or its write failed).

        Raises:
            CheckpointError: the write failed (raised once; the previous file is intact).
        """
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error


def _discard(handle: int, temp_name: str) -> None:
    """Close and remove a temporary file whose write failed (what is already gone is fine)."""
    with contextlib.suppress(OSError):
        os.close(handle)
    with contextlib.suppress(OSError):
        os.unlink(temp_name)


def _write_failed(path: Path, err: OSError) -> CheckpointError:
    return CheckpointError(f"writing checkpoint {path} failed ({err}); the previous "
                           "checkpoint, if any, is unchanged")


def _write_parts(fd: int, parts: Iterable[Any]) -> None:
    """Write bytes-like ``parts`` to ``fd`` one after the other, many parts to a system call
    (``os.writev`` of up to `_IOV_MAX` buffers or `_WRITE_BYTES` bytes) and none
    copied: a checkpoint has a part per tensor (64,000 at 16,000 clients), which were
    gathered into a bytearray before (a copy of the whole file, ~0.2 s of 470 MB)."""
    batch: list[memoryview] = []
    size = 0
    for part in parts:
        view = memoryview(part)
        if not view.nbytes:  # (an empty tensor's view cannot be cast)
            continue
        batch.append(view.cast("B") if view.ndim != 1 or view.format != "B" else view)
        size += view.nbytes
        if len(batch) == _IOV_MAX or size >= _WRITE_BYTES:
            _writev_all(fd, batch)
            batch, size = [], 0
    _writev_all(fd, batch)


def _writev_all(fd: int, buffers: list[memoryview]) -> None:
    """``os.writev`` until every byte of ``buffers`` is written (a call may write less)."""
    first = 0
    while first < len(buffers):
        written = (os.writev(fd, buffers[first:first + _IOV_MAX]) if hasattr(os, "writev")
                   else os.write(fd, buffers[first]))  # (Windows has no writev)
        while first < len(buffers) and written >= buffers[first].nbytes:
            written -= buffers[first].nbytes
            first += 1
        if written:  # part of a buffer was written: the rest of it next
            buffers[first] = buffers[first][written:]


def _fsync_directory(directory: Path) -> None:
    # makes the rename durable on POSIX; not possible (and not needed) on some platforms
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    fingerprint: str,
    config: Mapping[str, Any] | None = None,
    max_bytes: int = MAX_CHECKPOINT_BYTES,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Read a checkpoint written by `save_checkpoint` for the run ``fingerprint``.

    Args:
        path: the checkpoint file.
        fingerprint: this run's `config_fingerprint`.
        config: this run's configuration (what was fingerprinted); with it, a foreign
            checkpoint's error names the settings that differ from the ``meta["config"]`` saved.
        max_bytes: the largest file read.

    Returns:
        (tensors on the CPU with their saved dtypes, meta as saved; JSON turns tuples into
        lists).

    Raises:
        CheckpointError: the file is missing, is not a regular file (a directory, a device, a
            FIFO, a symlink loop), is larger than ``max_bytes``, is not a bayesfl checkpoint,
            is corrupt, or was written by a run with another configuration fingerprint.
    """
    path = Path(path)
    data = _read_regular_file(path, max_bytes)
    corrupt = (f"checkpoint {path} is corrupt or not a bayesfl checkpoint; delete it (or the "
               "run directory) and start the run again without resuming")
    try:
        metadata = read_safetensors_metadata(data, max_header_bytes=MAX_HEADER_BYTES)
    except (ValueError, RecursionError, BayesFLError) as err:
        raise CheckpointError(f"{corrupt} ({_one_line(err)})") from err
    if metadata.get(_KEY + "format") != _FORMAT:
        raise CheckpointError(f"{corrupt} (no {_KEY}format={_FORMAT} in its metadata)")
    meta_json = metadata.get(_KEY + "meta", "")
    if len(meta_json) > MAX_META_BYTES:
        raise CheckpointError(f"{corrupt} (its meta is {len(meta_json):,} characters, more than "
                              f"the limit {MAX_META_BYTES:,})")
    found = metadata.get(_KEY + "fingerprint")
    if found != fingerprint:
        differences = _differences_from_saved(meta_json, config)
        what = f": {differences}" if differences else ""
        raise CheckpointError(
            f"checkpoint {path} belongs to another run configuration{what} (fingerprint "
            f"{found}, this run has {fingerprint}); resume with the original configuration or "
            "use a new output directory (the run's manifest.json lists its settings)")
    try:
        tensors = _safetensors_load(data)
        meta = json.loads(meta_json)
    except Exception as err:  # parser errors on damaged bytes vary; report them all the same way
        raise CheckpointError(f"{corrupt} ({_one_line(err)})") from err
    if tensor_digest(tensors, found + meta_json) != metadata.get(_KEY + "sha256"):
        raise CheckpointError(f"{corrupt} (digest mismatch)")
    if not isinstance(meta, dict):
        raise CheckpointError(f"{corrupt} (its meta is not a JSON object)")
    return tensors, meta


def _read_regular_file(path: Path, max_bytes: int) -> bytes:
    """The bytes of ``path`` if it is a regular file of at most ``max_bytes`` (symlinks are
    followed; what they lead to is checked on the opened file, so it cannot be swapped)."""
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; regular files ignore it
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError as err:
        raise CheckpointError(f"no checkpoint at {path}; start the run without resuming") from err
    except OSError as err:
        what = "is a symlink loop" if err.errno == errno.ELOOP else f"cannot be opened ({err})"
        raise CheckpointError(f"checkpoint {path} {what}; point it at a checkpoint file or "
                              "start the run without resuming") from err
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointError(f"checkpoint {path} is {_file_kind(info.st_mode)}, not a regular "
                                  "file; point it at a checkpoint file or start the run without "
                                  "resuming")
        if info.st_size > max_bytes:
            raise CheckpointError(f"checkpoint {path} is {info.st_size:,} bytes, more than the "
                                  f"limit {max_bytes:,}; it is not a checkpoint of this run")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as err:
        raise CheckpointError(f"cannot read checkpoint {path}: {err}") from err
    finally:
        os.close(fd)
    if len(data) > max_bytes:  # it grew while being read
        raise CheckpointError(f"checkpoint {path} is more than the limit {max_bytes:,} bytes")
    return data


def _file_kind(mode: int) -> str:
    kinds = [(stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
             (stat.S_ISSOCK, "a socket")]
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= 300 else text[:297] + "..."


def _differences_from_saved(meta_json: str, config: Mapping[str, Any] | None) -> str:
    """The settings in which ``config`` differs from the checkpoint's ``meta["config"]``, in
    words ("" when either is unavailable)."""
    if config is None:
        return ""
    try:
        saved = json.loads(meta_json).get("config")
        current = json.loads(json.dumps(dict(config), default=_json_default))
    except (ValueError, TypeError, AttributeError, RecursionError):
        return ""
    if not isinstance(saved, dict):
        return ""
    lines = config_differences(saved, current)
    shown = "; ".join(lines[:8])
    return shown + (f"; and {len(lines) - 8} more" if len(lines) > 8 else "")


def config_differences(saved: Mapping[str, Any], current: Mapping[str, Any],
                       prefix: str = "") -> list[str]:
    """``"key: checkpoint X, this run Y"`` for every key whose values differ (nested mappings
    compared key by key, named ``outer.inner``)."""
    lines: list[str] = []
    for key in sorted(set(saved) | set(current), key=str):
        a, b = saved.get(key, _ABSENT), current.get(key, _ABSENT)
        if a == b and type(a) is type(b):
            continue
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            lines += config_differences(a, b, f"{prefix}{key}.")
        else:
            lines.append(f"{prefix}{key}: checkpoint {_show(a)}, this run {_show(b)}")
    return lines


_ABSENT = object()


def _show(value: Any) -> str:
    if value is _ABSENT:
        return "(not set)"
    text = json.dumps(value, default=str)
    return text if len(text) <= 40 else text[:37] + "..."
