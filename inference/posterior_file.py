"""Posterior files: `save_posterior` and `load_posterior`, never pickle.

Format (schema version 2). A safetensors file: the posterior's ``state_dict()`` tensors plus
string metadata

=================  ===========================================================================
``format``         ``"inference-posterior"``
``schema_version`` ``"2"``
``kind``           the posterior's registered kind (``"gaussian"``, ``"conjugate"``, ...)
``digest``         ``"sha256:<hex>"``: SHA-256 of the JSON list ``[format, schema_version,
                   kind]`` followed, tensor by tensor in name order, by the JSON list
                   ``[name, dtype, shape]`` and the tensor's raw bytes; or
                   ``"hmac-sha256:<hex>"``, the same bytes under HMAC-SHA256 with a caller's key
=================  ===========================================================================

A plain SHA-256 digest detects corruption (a flipped bit, a truncated copy, a value edited in
place); it cannot detect a deliberate forgery, since anyone can recompute it. Files that cross a
trust boundary should be saved and loaded with ``key=`` (HMAC): without the key no one can
produce a file that loads. Whatever the digest, every file is validated on load: finite values,
the shapes the kind needs, and a usable posterior (its mean is computed, which factorises a
Gaussian's precision and so proves it positive definite; the mean is cached for predictions).
Loading a posterior therefore costs what its first prediction would: e.g. about 5 s for a full
Gaussian over a 10 x 513 head (200 MiB), single-threaded, of which 0.2 s is the digest.

Reading is bounded: the path must name a regular file (a directory, FIFO, device such as
``/dev/zero`` or socket is refused by what it is, before any byte is read; a FIFO is opened
without blocking), at most ``max_bytes`` long (default `DEFAULT_MAX_BYTES`, 2 GiB),
with a JSON header of at most `MAX_HEADER_BYTES` nested at most
`MAX_HEADER_DEPTH` deep. Every failure is a `PosteriorFileError`
naming the file, what was wrong and what to do.

Files of schema version 1 (written before this format had a digest) are refused by default,
since their integrity cannot be checked; ``load_posterior(path, allow_legacy=True)`` reads one
(still validated) so that it can be saved again in this format.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import os
import re
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from inference.errors import InferenceError, InvalidInputError, PosteriorFileError
from inference.posterior import Posterior, posterior_class

FORMAT = "inference-posterior"
SCHEMA_VERSION = "2"
#: The schema version of files written before the digest existed (``allow_legacy=True``).
LEGACY_SCHEMA_VERSION = "1"
#: Largest file `load_posterior` reads by default (bytes); pass ``max_bytes`` to change.
DEFAULT_MAX_BYTES = 2 * 2**30
#: Largest JSON header read (bytes). A posterior's header lists a handful of tensors (< 2 KiB);
#: 1 MiB leaves room for kinds with thousands of named tensors.
MAX_HEADER_BYTES = 2**20
#: A safetensors header nests 3 levels (``{name: {"shape": [...]}}``).
MAX_HEADER_DEPTH = 3
_METADATA_KEYS = {"format", "schema_version", "kind", "digest"}
_LEGACY_METADATA_KEYS = {"schema_version", "kind"}


# -- the digest ---------------------------------------------------------------------------------


def state_digest(
    state: Mapping[str, Tensor], kind: str, *, schema_version: str = SCHEMA_VERSION,
    key: bytes | None = None,
) -> str:
    """The ``digest`` metadata of a posterior file holding ``state`` (module docstring).

    Args:
        state: the tensors, by name (any device; hashed from CPU copies).
        kind: the posterior kind recorded beside them.
        key: an HMAC key (bytes); None for a plain SHA-256 digest.

    Returns:
        ``"sha256:<64 hex digits>"`` or ``"hmac-sha256:<64 hex digits>"``.
    """
    preamble = json.dumps([FORMAT, schema_version, kind]).encode()
    digest = hashlib.sha256() if key is None else hmac.new(_checked_key(key), digestmod="sha256")
    digest.update(preamble)
    for name in sorted(state):
        tensor = state[name].detach().to("cpu").contiguous()
        digest.update(json.dumps([name, str(tensor.dtype), list(tensor.shape)]).encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy())  # the buffer, no copy
    return ("sha256:" if key is None else "hmac-sha256:") + digest.hexdigest()


def _checked_key(key: Any) -> bytes:
    if not isinstance(key, bytes | bytearray) or len(key) == 0:
        raise InvalidInputError(
            f"key must be non-empty bytes (e.g. secrets.token_bytes(32)); got {type(key).__name__}."
        )
    return bytes(key)


# -- saving -------------------------------------------------------------------------------------


def save_posterior(posterior: Posterior, path: str | os.PathLike, *, key: bytes | None = None
                   ) -> None:
    """Write ``posterior.state_dict()`` to ``path`` as a posterior file (module docstring).

    The write is atomic: a temporary file in the same directory, flushed to disk, then renamed
    over ``path`` (removed if anything fails), so ``path`` never holds a partial file.

    Args:
        posterior: any registered posterior (`inference.posterior.register_posterior`).
        path: the file to write; its directory must exist.
        key: HMAC key (bytes) to authenticate the file; `load_posterior` then needs it.

    Raises:
        InvalidInputError: a posterior whose kind no class is registered to load, or that holds
            NaN or infinite values (it could not be loaded back).
        PosteriorFileError: the file cannot be written (no such directory, a directory at
            ``path``, permissions, a full disk).
    """
    from safetensors.torch import save

    kind = getattr(posterior, "kind", None)
    if not isinstance(kind, str) or not kind:
        raise InvalidInputError(
            f"a {type(posterior).__name__} has no `kind`; it is not a posterior."
        )
    try:
        posterior_class(kind)
    except InvalidInputError:
        raise InvalidInputError(
            f"cannot save a posterior of kind {kind!r}: no class is registered to load it back. "
            "Register its class with @register_posterior, or save the inference posterior it "
            "wraps (a BodyPosterior, bayesfl's ClientPosterior: save_posterior(post.head, path))."
        ) from None
    # CPU copies: safetensors refuses tensors that share memory (views of one buffer).
    state = {name: tensor.detach().to("cpu", copy=True).contiguous()
             for name, tensor in posterior.state_dict().items()}
    for name, tensor in state.items():
        if _non_finite_count(tensor):
            raise InvalidInputError(
                f"the posterior's {name!r} holds NaN or infinite values, so it could not be "
                "loaded back; refit it (inference.check(posterior) finds such problems)."
            )
    metadata = {"format": FORMAT, "schema_version": SCHEMA_VERSION, "kind": kind,
                "digest": state_digest(state, kind, key=key)}
    _write_atomically(Path(path), save(state, metadata=metadata))


def _write_atomically(path: Path, data: bytes) -> None:
    if path.is_dir():
        raise PosteriorFileError(f"{path} is a directory; pass a file name to save to.")
    # A fresh name beside the target (the rename stays on one file system), created
    # exclusively with the umask's mode, as a plain open() would.
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    try:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0),
                     0o666)
    except OSError as error:
        raise PosteriorFileError(
            f"cannot write {path}: {error.strerror or error} (does {path.parent} exist and is it "
            "writable?)."
        ) from None
    try:
        with open(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except OSError as error:
        raise PosteriorFileError(f"cannot write {path}: {error.strerror or error}.") from None
    finally:
        Path(temporary).unlink(missing_ok=True)


# -- loading ------------------------------------------------------------------------------------


def load_posterior(
    path: str | os.PathLike,
    device: torch.device | str = "cpu",
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    key: bytes | None = None,
    allow_legacy: bool = False,
) -> Posterior:
    """Read and validate a posterior written by `save_posterior`, onto ``device``.

    Args:
        path: the file.
        device: where the posterior's tensors go.
        max_bytes: the largest file read (default 2 GiB); larger files are refused unread.
        key: the HMAC key the file was saved with (None for a plain SHA-256 digest).
        allow_legacy: read a schema-1 file (no digest), still validated; save it again to
            give it one.

    Raises:
        PosteriorFileError: the file is missing, not a regular file, too large, empty,
            truncated, not a posterior file (a pickle, another safetensors file), of another
            schema version, fails its digest (corrupted, or authenticated with another key), or
            holds no valid posterior (NaN, wrong shapes, a precision not positive definite).
        InvalidInputError: a bad ``device``, ``max_bytes`` or ``key``.
    """
    device = _checked_device(device)
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
        raise InvalidInputError(f"max_bytes must be a positive integer; got {max_bytes!r}.")
    if key is not None:
        key = _checked_key(key)
    path = Path(path)
    data = _read_bounded(path, max_bytes)
    metadata = _metadata(data, path)
    kind, legacy = _kind_and_version(metadata, path, allow_legacy)
    state = _tensors(data, path)
    del data
    if not legacy:
        _verify_digest(state, kind, metadata["digest"], key, path)
    _check_finite(state, path)
    posterior = _rebuild(kind, state, path)
    return posterior.to(device)


def _checked_device(device: Any) -> torch.device:
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise InvalidInputError(f"device {device!r} is not a torch device ({error}).") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidInputError(f"device {str(device)!r} was asked for but CUDA is not available.")
    return device


def _read_bounded(path: Path, max_bytes: int) -> bytes:
    """The bytes of the regular file ``path``, refused unread if it is anything else or larger
    than ``max_bytes``."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)  # a FIFO must not block
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise PosteriorFileError(f"{path}: no such file; check the path.") from None
    except IsADirectoryError:
        raise PosteriorFileError(f"{path} is a directory, not a posterior file.") from None
    except PermissionError:
        raise PosteriorFileError(f"{path}: permission denied; check the file's mode.") from None
    except OSError as error:
        what = ("a loop of symbolic links" if error.errno == errno.ELOOP
                else error.strerror or str(error))
        raise PosteriorFileError(f"cannot open {path}: {what}.") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise PosteriorFileError(
                f"{path} is {_file_type(info.st_mode)}, not a regular file; pass a file written "
                "by save_posterior."
            )
        size = info.st_size
        if size > max_bytes:
            raise PosteriorFileError(
                f"{path} is {size:,} bytes, more than the limit of {max_bytes:,}; if it is a "
                "posterior you expect to be that large, pass a larger max_bytes."
            )
        if size == 0:
            raise PosteriorFileError(f"{path} is empty (0 bytes); it holds no posterior.")
        with open(fd, "rb", closefd=False) as stream:
            data = stream.read(size)
            grew = bool(stream.read(1))
    except OSError as error:
        raise PosteriorFileError(f"cannot read {path}: {error.strerror or error}.") from None
    finally:
        os.close(fd)
    if len(data) != size or grew:
        raise PosteriorFileError(f"{path} changed size while it was read; read it again once "
                                 "whatever writes it has finished.")
    return data


def _file_type(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "not a regular file")


_JSON_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"')
"""A JSON string. The possessive quantifiers match what the plain pattern matches (nothing can
end a string elsewhere by backtracking into it) without its per-character steps."""
_BRACKETS_ONLY = bytes(c for c in range(256) if c not in b"[]{}")
_BRACKET_STEPS = np.zeros(256, dtype=np.int8)
_BRACKET_STEPS[list(b"[{")], _BRACKET_STEPS[list(b"]}")] = 1, -1
_OPENING = frozenset(b"[{")


def json_depth(raw: bytes) -> int:
    """Deepest bracket nesting of the JSON text ``raw`` (brackets in strings ignored), in
    linear time without recursion, so it is safe to run on hostile bytes before ``json``.

    The brackets are picked out by ``bytes.translate`` first: a header holds a few dozen among
    hundreds of bytes, and the simulator reads one message header per upload, so a short run of
    brackets is counted in Python and a long one with numpy."""
    brackets = _JSON_STRING.sub(b'""', raw).translate(None, _BRACKETS_ONLY)
    if len(brackets) > 256:
        steps = _BRACKET_STEPS[np.frombuffer(brackets, dtype=np.uint8)].astype(np.int64)
        return max(int(np.cumsum(steps).max()), 0)
    depth = deepest = 0
    for code in brackets:  # Python ints (numpy's int8 would wrap past 127)
        depth += 1 if code in _OPENING else -1
        deepest = max(deepest, depth)
    return deepest


def _metadata(data: bytes, path: Path) -> dict[str, str]:
    """The safetensors ``__metadata__`` of ``data``, parsed with bounded size and nesting."""
    foreign = _foreign_format(data)
    if foreign:
        raise PosteriorFileError(
            f"{path} is {foreign}, not a posterior file; posterior files are safetensors written "
            "by save_posterior (pickles are never loaded: they can run code)."
        )
    if len(data) < 8:
        raise PosteriorFileError(f"{path} is only {len(data)} bytes: truncated, or not a "
                                 "posterior file.")
    length = int.from_bytes(data[:8], "little")
    if length > len(data) - 8:
        raise PosteriorFileError(
            f"{path}: its header claims {length:,} bytes but only {len(data) - 8:,} follow: the "
            "file is truncated or not a posterior file; save it again."
        )
    if length > MAX_HEADER_BYTES:
        raise PosteriorFileError(f"{path}: a header of {length:,} bytes exceeds the limit of "
                                 f"{MAX_HEADER_BYTES:,}; not a posterior file.")
    raw = data[8 : 8 + length]
    depth = json_depth(raw)
    if depth > MAX_HEADER_DEPTH:
        raise PosteriorFileError(f"{path}: its header nests {depth} levels deep (a posterior "
                                 f"file's nests {MAX_HEADER_DEPTH}); not a posterior file.")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise PosteriorFileError(f"{path}: its header is not JSON ({error}); the file is "
                                 "corrupted or not a posterior file.") from None
    metadata = header.get("__metadata__", {}) if isinstance(header, dict) else None
    if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise PosteriorFileError(f"{path} has no string metadata in its header; it was not "
                                 "written by save_posterior.")
    return metadata


def _foreign_format(data: bytes) -> str | None:
    """What ``data`` looks like if it is a well-known format that is not safetensors."""
    if data[:1] == b"\x80" and data[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return "a Python pickle"
    if data[:4] == b"PK\x03\x04":
        return "a zip archive (torch.save or numpy .npz)"
    if data[:6] == b"\x93NUMPY":
        return "a NumPy .npy array"
    return None


def _kind_and_version(metadata: Mapping[str, str], path: Path, allow_legacy: bool
                      ) -> tuple[str, bool]:
    """The file's kind, and whether it is a legacy (schema 1) file."""
    version = metadata.get("schema_version")
    if "format" not in metadata and version == LEGACY_SCHEMA_VERSION and "kind" in metadata:
        if set(metadata) != _LEGACY_METADATA_KEYS:
            raise PosteriorFileError(f"{path}: unexpected metadata {sorted(metadata)}.")
        if not allow_legacy:
            raise PosteriorFileError(
                f"{path} was written by an earlier version of inference (posterior file schema "
                f"{LEGACY_SCHEMA_VERSION}), which stored no checksum, so its integrity cannot be "
                "checked. If you trust it, read it with load_posterior(path, allow_legacy=True) "
                "and save it again with save_posterior to add one."
            )
        return metadata["kind"], True
    if metadata.get("format") != FORMAT:
        what = "no `kind`" if "kind" not in metadata else "no posterior-file format marker"
        raise PosteriorFileError(f"{path} is a safetensors file with {what} in its metadata; "
                                 "not a posterior written by save_posterior.")
    if version != SCHEMA_VERSION:
        raise PosteriorFileError(
            f"{path} has posterior file schema version {version!r}; this version of inference "
            f"reads {SCHEMA_VERSION!r} (and {LEGACY_SCHEMA_VERSION!r} with allow_legacy=True). "
            "Save it again with the version that wrote it, or upgrade inference."
        )
    missing = sorted(_METADATA_KEYS - set(metadata))
    extra = sorted(set(metadata) - _METADATA_KEYS)
    if missing or extra:
        raise PosteriorFileError(f"{path}: metadata lacks {missing} or has unexpected {extra}; "
                                 "not a posterior written by save_posterior.")
    return metadata["kind"], False


def _tensors(data: bytes, path: Path) -> dict[str, Tensor]:
    from safetensors.torch import load

    try:
        return load(data)
    except Exception as error:  # the parser's errors on hostile bytes vary; none may escape
        raise PosteriorFileError(f"{path}: its tensors cannot be read ({error}); the file is "
                                 "truncated or corrupted; save it again.") from None


def _verify_digest(state: Mapping[str, Tensor], kind: str, stored: str, key: bytes | None,
                   path: Path) -> None:
    keyed = stored.startswith("hmac-sha256:")
    if keyed and key is None:
        raise PosteriorFileError(f"{path} is authenticated with a key (HMAC-SHA256); pass the "
                                 "key it was saved with: load_posterior(path, key=...).")
    if not keyed and key is not None:
        raise PosteriorFileError(
            f"{path} is not authenticated (a plain SHA-256 digest) but a key was given; refusing "
            "it, since anyone could have written it. Save it again with save_posterior(..., "
            "key=...) from a trusted copy."
        )
    if not hmac.compare_digest(state_digest(state, kind, key=key), stored):
        reason = ("the key differs from the one it was saved with, or the file was altered"
                  if keyed else "the file was corrupted (a changed or truncated byte)")
        raise PosteriorFileError(f"{path}: the digest of its contents does not match the one "
                                 f"stored: {reason}. Use an intact copy or save it again.")


def _non_finite_count(tensor: Tensor) -> int:
    """How many NaN or infinite values ``tensor`` holds (0 for integer and bool tensors).

    ``torch.isfinite`` is not implemented for most float8 dtypes (a file may hold any dtype
    safetensors stores, NaN included), so those are widened to float32 first, which keeps
    every NaN a NaN.
    """
    if not (tensor.is_floating_point() or tensor.is_complex()):
        return 0
    if tensor.is_floating_point() and tensor.element_size() == 1:
        tensor = tensor.to(torch.float32)
    return int((~torch.isfinite(tensor)).sum())


def _check_finite(state: Mapping[str, Tensor], path: Path) -> None:
    for name in sorted(state):
        tensor = state[name]
        bad = _non_finite_count(tensor)
        if bad:
            raise PosteriorFileError(
                f"{path}: {name!r} holds {bad} NaN or infinite value(s) of {tensor.numel()}; "
                "no posterior has them. Refit and save it again."
            )
    count = state.get("n_data")
    if count is not None and (count.numel() != 1 or count.is_floating_point()
                              or int(count.reshape(-1)[0]) < 0):
        raise PosteriorFileError(f"{path}: 'n_data' must be a non-negative integer scalar.")


def _rebuild(kind: str, state: dict[str, Tensor], path: Path) -> Posterior:
    """The posterior of ``kind`` from ``state``, checked to be usable."""
    try:
        cls = posterior_class(kind)
    except InvalidInputError as error:
        raise PosteriorFileError(f"{path}: {error}") from None
    try:
        posterior = cls.from_state_dict(state)
        _check_usable(kind, posterior)
    # A file that passed its digest may still have been crafted (the digest has no key unless
    # one is given): whatever a class's reconstruction raises on such a state becomes a
    # rejection of the file, never a traceback.
    except (InferenceError, TypeError, ValueError, RuntimeError, IndexError, KeyError,
            OverflowError) as error:
        raise PosteriorFileError(
            f"{path} does not hold a valid {kind} posterior: {str(error).rstrip('.')}. Use an "
            "intact copy, or refit and save it again."
        ) from None
    return posterior


def _check_usable(kind: str, posterior: Posterior) -> None:
    """The posterior's mean must be finite. Computing it also proves the precision usable: a
    Gaussian factorises its total precision (full: a Cholesky factorisation, which fails unless
    it is positive definite; diagonal and low rank: every diagonal entry must be positive), the
    conjugate head solves for its MAP; the subnet Laplace posterior factorised its precision
    when it was built. The mean is cached, so the first prediction does not pay for it again."""
    mean = posterior.mean
    if not isinstance(mean, Tensor) or not bool(torch.isfinite(mean).all()):
        raise InvalidInputError(f"its mean is not finite (a {kind} posterior's must be).")


__all__ = [
    "DEFAULT_MAX_BYTES",
    "FORMAT",
    "LEGACY_SCHEMA_VERSION",
    "MAX_HEADER_BYTES",
    "MAX_HEADER_DEPTH",
    "SCHEMA_VERSION",
    "json_depth",
    "load_posterior",
    "save_posterior",
    "state_digest",
]
