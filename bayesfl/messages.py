"""Messages between server and clients: named tensors plus a typed header, without pickle.

Wire format: a safetensors file held in memory (``safetensors.torch.save`` to bytes). The header
travels in the safetensors metadata as strings under ``bayesfl.*`` keys, together with a SHA-256
digest of the header and the tensors (names, dtypes, shapes and raw bytes), so that truncated,
corrupted or foreign bytes are rejected by :func:`decode` rather than used. Bytes counted for
communication accounting are ``len(encode(msg))`` (``Message.nbytes``); the theoretical count of
numbers is ``Message.num_elements``.

Receiving side: ``msg = decode(data)`` checks the format, then ``validate(msg, schema,
strategy=..., round=..., direction=...)`` checks names, shapes, dtypes and finiteness against a
:data:`Schema`. Both raise :class:`bayesfl.errors.MessageRejected` with a precise reason.
Algorithm invariants (e.g. FedLog's bias column) are the strategy's to check on top.

Hostile bytes: the JSON header is bounded in size (:data:`MAX_HEADER_BYTES`) and nesting
(:data:`MAX_HEADER_DEPTH`) before it is parsed, so no input can exhaust memory or the
interpreter's recursion limit; every failure is a :class:`~bayesfl.errors.MessageRejected`.

Authentication: the SHA-256 digest detects corruption but not forgery (anyone can recompute it
after rewriting the header, e.g. to replay an old upload as another round or client). With a
``key``, :func:`encode` stores an HMAC-SHA256 of the same bytes instead, and :func:`decode` with
that key accepts only messages whose HMAC verifies (constant-time comparison). Keys are per
client (see :class:`KeyRing`); distributing them is the deployment's job.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import load as _safetensors_load
from safetensors.torch import save as _safetensors_save

from bayesfl.errors import ConfigError, MessageRejected
from inference.posterior_file import json_depth

SCHEMA_VERSION = 1
DIRECTIONS = ("up", "down")
DEFAULT_MAX_BYTES = 64 * 2**20
MAX_HEADER_BYTES = 16 * 2**20
"""Largest JSON header accepted (bytes). A message's header holds ~100 bytes per tensor and a
checkpoint's one entry per client tensor, so 16 MiB covers ~100,000 tensors."""
MAX_HEADER_DEPTH = 8
"""Deepest JSON nesting accepted. A safetensors header nests 3 deep (object, tensor entry,
shape list); anything much deeper is hostile (30,000 levels exhaust the recursion limit)."""
_PREFIX = "bayesfl."
_FORMAT = "bayesfl-message"
_HMAC = _PREFIX + "hmac-sha256"


@dataclass(frozen=True)
class Header:
    """Who sent a message, in which round, which way.

    Attributes:
        strategy: name of the strategy that produced it (e.g. ``"fedlog"``).
        round: 0-based federated round.
        client_id: the sending (``"up"``) or receiving (``"down"``) client; -1 for a server
            broadcast to all.
        direction: ``"up"`` (client to server) or ``"down"`` (server to client).
        schema_version: wire format version; only :data:`SCHEMA_VERSION` is accepted.
    """

    strategy: str
    round: int
    client_id: int
    direction: str
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        problem = _header_problem(self)
        if problem:
            raise ConfigError(f"invalid message header: {problem}")


def _header_problem(header: Header) -> str | None:
    if not isinstance(header.strategy, str) or not header.strategy:
        return f"strategy must be a non-empty string, got {header.strategy!r}"
    for name, low in (("round", 0), ("client_id", -1), ("schema_version", 1)):
        value = getattr(header, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            return f"{name} must be an integer >= {low}, got {value!r}"
    if header.direction not in DIRECTIONS:
        return f"direction must be one of {DIRECTIONS}, got {header.direction!r}"
    return None


@dataclass(frozen=True, eq=False)
class Message:
    """A header plus a flat mapping of names to tensors (any device; encoded from the CPU)."""

    header: Header
    tensors: dict[str, torch.Tensor]

    def __post_init__(self) -> None:
        for name, tensor in self.tensors.items():
            if not isinstance(name, str) or not name:
                raise ConfigError(f"tensor names must be non-empty strings, got {name!r}")
            if not isinstance(tensor, torch.Tensor):
                raise ConfigError(f"message entry {name!r} is a {type(tensor).__name__}, "
                                  "not a torch.Tensor")

    @property
    def nbytes(self) -> int:
        """Size in bytes of the encoded message, ``len(encode(self))``.

        Encodes on each call (the tensor mapping may change); a sender that needs the bytes
        anyway should call :func:`encode` once and take ``len``.
        """
        return len(encode(self))

    @property
    def num_elements(self) -> int:
        """Total number of tensor elements (the theoretical 'float count' of papers)."""
        return sum(t.numel() for t in self.tensors.values())


def tensor_digest(
    tensors: Mapping[str, torch.Tensor], preamble: str = "", key: bytes | None = None
) -> str:
    """SHA-256 hex digest (HMAC-SHA256 with ``key``) of ``preamble`` then the names, dtypes,
    shapes and raw bytes of ``tensors`` (sorted by name).

    Messages and checkpoints store it to detect corrupted payloads; the preamble binds the
    header (or checkpoint meta) to the tensors. Only the keyed form detects forgery.
    """
    digest = (hashlib.sha256() if key is None
              else hmac.new(_check_key(key), digestmod=hashlib.sha256))
    digest.update(preamble.encode("utf-8"))
    for name in sorted(tensors):
        tensor = tensors[name].detach().to("cpu").contiguous().reshape(-1)
        digest.update(json.dumps([name, str(tensor.dtype), list(tensors[name].shape)]).encode())
        digest.update(tensor.view(torch.uint8).numpy())  # hashes the buffer without a copy
    return digest.hexdigest()


def contiguous_cpu_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU tensors that safetensors can save.

    Copies only where needed: a tensor on another device or not contiguous, and every tensor
    but the first of a group that shares one storage (safetensors refuses shared storage, e.g.
    views of one flat parameter buffer). Fresh allocations are costly, so nothing else is copied.
    """
    out: dict[str, torch.Tensor] = {}
    seen_storages: set[int] = set()
    for name, tensor in tensors.items():
        cpu = tensor.detach().to("cpu").contiguous()
        storage = cpu.untyped_storage().data_ptr()
        if storage in seen_storages and cpu.numel() > 0:
            cpu = cpu.clone()
        seen_storages.add(cpu.untyped_storage().data_ptr())
        out[name] = cpu
    return out


def encode(msg: Message, *, key: bytes | None = None) -> bytes:
    """Serialize ``msg`` to safetensors bytes with the header and a digest in the metadata:
    SHA-256, or HMAC-SHA256 when ``key`` is given (then only holders of the key can produce
    or check it)."""
    tensors = contiguous_cpu_tensors(msg.tensors)
    h = msg.header
    metadata = {
        _PREFIX + "format": _FORMAT,
        _PREFIX + "schema_version": str(h.schema_version),
        _PREFIX + "strategy": h.strategy,
        _PREFIX + "round": str(h.round),
        _PREFIX + "client_id": str(h.client_id),
        _PREFIX + "direction": h.direction,
    }
    digest = tensor_digest(tensors, _header_text(h), key)
    metadata[_HMAC if key is not None else _PREFIX + "sha256"] = digest
    return _safetensors_save(tensors, metadata=metadata)


def _check_key(key: object) -> bytes:
    if not isinstance(key, bytes | bytearray) or len(key) < 16:
        raise ConfigError("a message key must be at least 16 bytes (use KeyRing or "
                          "secrets.token_bytes(32))")
    return bytes(key)


class KeyRing:
    """Per-client HMAC keys derived from one secret: ``client_key(k)`` authenticates client
    k's uploads, ``server_key`` the server's broadcasts.

    The simulator draws a fresh secret per run (:meth:`generate`); a deployment provisions
    each client with its own key out of band. A client holding its key can authenticate only
    messages under its own id: it cannot forge another client's uploads or the server's.
    """

    def __init__(self, secret: bytes) -> None:
        self._secret = _check_key(secret)

    @classmethod
    def generate(cls) -> KeyRing:
        return cls(secrets.token_bytes(32))

    def client_key(self, client_id: int) -> bytes:
        return hmac.new(self._secret, f"client/{int(client_id)}".encode(),
                        hashlib.sha256).digest()

    @property
    def server_key(self) -> bytes:
        return hmac.new(self._secret, b"server", hashlib.sha256).digest()


def _header_text(header: Header) -> str:
    return json.dumps([header.strategy, header.round, header.client_id, header.direction,
                       header.schema_version])


def read_safetensors_metadata(
    data: bytes, *, max_header_bytes: int | None = None
) -> dict[str, str]:
    """The ``__metadata__`` of safetensors bytes, read from its JSON header.

    The header's size and nesting depth are bounded before it is parsed.

    Raises:
        ValueError: the bytes do not start with a well-formed safetensors header, or the
            header is larger than ``max_header_bytes`` (default :data:`MAX_HEADER_BYTES`) or
            nested deeper than :data:`MAX_HEADER_DEPTH`.
    """
    if max_header_bytes is None:
        max_header_bytes = MAX_HEADER_BYTES
    if len(data) < 8:
        raise ValueError(f"{len(data)} bytes is shorter than a safetensors header")
    header_len = int.from_bytes(data[:8], "little")
    if header_len > len(data) - 8:
        raise ValueError(f"header length {header_len} exceeds the {len(data) - 8} bytes present")
    if header_len > max_header_bytes:
        raise ValueError(f"header of {header_len} bytes exceeds the limit of {max_header_bytes}")
    raw = bytes(data[8 : 8 + header_len])
    depth = json_depth(raw)
    if depth > MAX_HEADER_DEPTH:
        raise ValueError(f"header nests {depth} levels deep; a safetensors header nests 3 "
                         f"(limit {MAX_HEADER_DEPTH})")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise ValueError(f"header is not JSON ({err})") from err
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    metadata = header.get("__metadata__") or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError("metadata is not a string-to-string mapping")
    return metadata


def decode(
    data: bytes, *, max_bytes: int = DEFAULT_MAX_BYTES, key: bytes | None = None
) -> Message:
    """Parse bytes produced by :func:`encode`; never unpickles anything.

    With ``key``, only messages whose HMAC-SHA256 verifies under it are accepted (and an
    unauthenticated message is rejected); without, an authenticated message is rejected too
    (its integrity cannot be checked without the key).

    Raises:
        MessageRejected: bytes larger than ``max_bytes``, not a safetensors file (a pickle, an
            ``.npz``, ...), a header too large or too deeply nested, a safetensors file
            without a bayesfl header, a malformed or unsupported header, tensors whose digest
            disagrees (truncated or corrupted), or an HMAC that does not verify.
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        raise MessageRejected(f"expected bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) > max_bytes:
        raise MessageRejected(f"oversized message: {len(data)} bytes > limit {max_bytes}")
    try:
        metadata = read_safetensors_metadata(data)
    except ValueError as err:
        raise MessageRejected(f"not a bayesfl message (corrupt or foreign bytes): {err}") from err
    if metadata.get(_PREFIX + "format") != _FORMAT:
        raise MessageRejected("not a bayesfl message: the safetensors metadata lacks "
                              f"{_PREFIX}format={_FORMAT}")
    header = _header_from_metadata(metadata)
    try:
        tensors = _safetensors_load(data)
    except Exception as err:  # the parser's errors on hostile bytes vary; none may escape
        raise MessageRejected(f"corrupt message: safetensors could not read it ({err})",
                              client_id=header.client_id) from err
    _check_digest(metadata, tensors, header, key)
    return Message(header, tensors)


def _check_digest(metadata: Mapping[str, str], tensors: Mapping[str, torch.Tensor],
                  header: Header, key: bytes | None) -> None:
    sender = header.client_id
    if key is None:
        if _HMAC in metadata:
            raise MessageRejected("authenticated message (HMAC) but this receiver has no key to "
                                  "check it: pass the sender's key", client_id=sender)
        if tensor_digest(tensors, _header_text(header)) != metadata.get(_PREFIX + "sha256"):
            raise MessageRejected("corrupt message: tensor digest mismatch", client_id=sender)
        return
    tag = metadata.get(_HMAC)
    if tag is None:
        raise MessageRejected("unauthenticated message: this receiver requires an HMAC "
                              "(the sender must encode with its key)", client_id=sender)
    if not hmac.compare_digest(tensor_digest(tensors, _header_text(header), key), tag):
        raise MessageRejected("authentication failed: the HMAC does not verify under this "
                              "client's key (forged, replayed under another header, or "
                              "corrupted)", client_id=sender)


def _header_from_metadata(metadata: Mapping[str, str]) -> Header:
    fields: dict[str, Any] = {}
    try:
        for name in ("strategy", "direction"):
            fields[name] = metadata[_PREFIX + name]
        for name in ("round", "client_id", "schema_version"):
            fields[name] = int(metadata[_PREFIX + name])
    except (KeyError, ValueError) as err:
        raise MessageRejected(f"malformed message header: missing or non-integer {err}") from err
    if fields["schema_version"] != SCHEMA_VERSION:
        raise MessageRejected(f"unsupported message schema_version {fields['schema_version']} "
                              f"(this version reads {SCHEMA_VERSION})")
    try:
        return Header(**fields)
    except ConfigError as err:
        raise MessageRejected(f"malformed message header: {err}") from err


@dataclass(frozen=True)
class TensorSpec:
    """Expected shape (``None`` matches any size), dtype and finiteness of one tensor."""

    shape: tuple[int | None, ...]
    dtype: torch.dtype
    finite: bool = True

    def matches_shape(self, shape: tuple[int, ...]) -> bool:
        return len(shape) == len(self.shape) and all(
            want is None or want == got for want, got in zip(self.shape, shape, strict=True))


Schema = Mapping[str, TensorSpec]


def validate(
    msg: Message,
    schema: Schema,
    *,
    strategy: str | None = None,
    round: int | None = None,
    direction: str | None = None,
    client_id: int | None = None,
) -> None:
    """Check ``msg`` against ``schema`` and the expected header fields (those not None).

    Raises:
        MessageRejected: with the first problem found, in this order: a header field that
            differs, missing names, extra names, then per tensor (sorted by name) its dtype, its
            shape, and non-finite values where the spec asks for finiteness.
    """
    sender = msg.header.client_id
    expected = {"strategy": strategy, "round": round, "direction": direction,
                "client_id": client_id}
    for name, want in expected.items():
        got = getattr(msg.header, name)
        if want is not None and got != want:
            raise MessageRejected(f"wrong header: {name} is {got!r}, expected {want!r}",
                                  client_id=sender)
    missing = sorted(set(schema) - set(msg.tensors))
    if missing:
        raise MessageRejected(f"missing tensors {missing}", client_id=sender)
    extra = sorted(set(msg.tensors) - set(schema))
    if extra:
        raise MessageRejected(f"unexpected tensors {extra}", client_id=sender)
    for name in sorted(schema):
        _check_tensor(name, msg.tensors[name], schema[name], sender)


def _check_tensor(name: str, tensor: torch.Tensor, spec: TensorSpec, sender: int) -> None:
    if tensor.dtype != spec.dtype:
        raise MessageRejected(f"tensor {name!r} has dtype {tensor.dtype}, expected {spec.dtype}",
                              client_id=sender)
    shape = tuple(tensor.shape)
    if not spec.matches_shape(shape):
        want = "(" + ", ".join("*" if s is None else str(s) for s in spec.shape) + ")"
        raise MessageRejected(f"tensor {name!r} has shape {shape}, expected {want}",
                              client_id=sender)
    if spec.finite and (tensor.is_floating_point() or tensor.is_complex()):
        bad = int((~torch.isfinite(tensor)).sum())
        if bad:
            raise MessageRejected(f"tensor {name!r} has {bad} non-finite value(s) (NaN or Inf) "
                                  f"of {math.prod(shape)}", client_id=sender)
