"""Atomic checkpoints of server state: tensors in a safetensors file, JSON meta in its metadata.

``save_checkpoint(path, tensors, meta)`` writes the whole file to a temporary file in the same
directory, fsyncs it, then ``os.replace``s it over ``path`` (and fsyncs the directory), so a
crash at any point leaves either the previous checkpoint or the new one, never a torn file.

The file's safetensors metadata holds ``bayesfl.meta`` (``meta`` as JSON), ``bayesfl.fingerprint``
(the run configuration's :func:`config_fingerprint`) and ``bayesfl.sha256`` (a digest of the
fingerprint, the meta and the tensors). ``load_checkpoint(path, fingerprint=...)`` refuses a
missing, corrupt or foreign file with a :class:`bayesfl.errors.CheckpointError` that says what
to do.

The fingerprint is taken from ``save_checkpoint(..., fingerprint=...)`` or else from
``meta["fingerprint"]``; one of the two is required.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as _safetensors_load
from safetensors.torch import save as _safetensors_save

from bayesfl.errors import CheckpointError, ConfigError
from bayesfl.messages import contiguous_cpu_tensors, read_safetensors_metadata, tensor_digest

_FORMAT = "bayesfl-checkpoint"
_KEY = "bayesfl."


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
) -> None:
    """Write ``tensors`` and ``meta`` to ``path`` atomically (temp file, fsync, ``os.replace``).

    Args:
        path: destination file (conventionally ``*.safetensors``); its directory must exist.
        tensors: named tensors (any device; stored from the CPU, dtypes kept).
        meta: JSON-serialisable run state (round number, RNG seeds, history, ...).
        fingerprint: the run's :func:`config_fingerprint`; defaults to ``meta["fingerprint"]``.

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
    cpu = contiguous_cpu_tensors(tensors)
    metadata = {
        _KEY + "format": _FORMAT,
        _KEY + "fingerprint": fingerprint,
        _KEY + "meta": meta_json,
        _KEY + "sha256": tensor_digest(cpu, fingerprint + meta_json),
    }
    write_atomically(Path(path), _safetensors_save(cpu, metadata=metadata))


def write_atomically(path: Path, data: bytes) -> None:
    """Replace ``path`` by ``data`` so readers see the old or the new content, never a mix.

    Raises:
        CheckpointError: the write failed; the old file is intact and the temp file removed.
    """
    directory = path.parent if str(path.parent) else Path(".")
    try:
        handle, temp_name = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.",
                                             suffix=".tmp")
    except OSError as err:
        raise CheckpointError(f"cannot create a temporary file in {directory}: {err}") from err
    try:
        with os.fdopen(handle, "wb") as temp:
            temp.write(data)
            temp.flush()
            os.fsync(temp.fileno())
        os.replace(temp_name, path)
    except BaseException as err:
        with contextlib.suppress(OSError):
            os.unlink(temp_name)
        if isinstance(err, OSError):
            raise CheckpointError(f"writing checkpoint {path} failed ({err}); the previous "
                                  "checkpoint, if any, is unchanged") from err
        raise
    _fsync_directory(directory)


def _fsync_directory(directory: Path) -> None:
    # makes the rename durable on POSIX; not possible (and not needed) on some platforms
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def load_checkpoint(
    path: str | os.PathLike[str], *, fingerprint: str
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Read a checkpoint written by :func:`save_checkpoint` for the run ``fingerprint``.

    Returns:
        (tensors on the CPU with their saved dtypes, meta as saved; JSON turns tuples into
        lists).

    Raises:
        CheckpointError: the file is missing, is not a bayesfl checkpoint, is corrupt, or was
            written by a run with another configuration fingerprint.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError as err:
        raise CheckpointError(f"no checkpoint at {path}; start the run without resuming") from err
    except OSError as err:
        raise CheckpointError(f"cannot read checkpoint {path}: {err}") from err
    corrupt = (f"checkpoint {path} is corrupt or not a bayesfl checkpoint; delete it (or the "
               "run directory) and start the run again without resuming")
    try:
        metadata = read_safetensors_metadata(data)
    except ValueError as err:
        raise CheckpointError(f"{corrupt} ({err})") from err
    if metadata.get(_KEY + "format") != _FORMAT:
        raise CheckpointError(f"{corrupt} (no {_KEY}format={_FORMAT} in its metadata)")
    found = metadata.get(_KEY + "fingerprint")
    if found != fingerprint:
        raise CheckpointError(
            f"checkpoint {path} belongs to another run configuration (fingerprint {found}, this "
            f"run has {fingerprint}); resume with the original configuration or use a new "
            "output directory")
    try:
        tensors = _safetensors_load(data)
        meta_json = metadata[_KEY + "meta"]
        meta = json.loads(meta_json)
    except Exception as err:  # parser errors on damaged bytes vary; report them all the same way
        raise CheckpointError(f"{corrupt} ({err})") from err
    if tensor_digest(tensors, found + meta_json) != metadata.get(_KEY + "sha256"):
        raise CheckpointError(f"{corrupt} (digest mismatch)")
    return tensors, meta
