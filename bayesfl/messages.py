"""Messages between server and clients: named tensors plus a typed header, without pickle.

Wire format: a safetensors file held in memory (``safetensors.torch.save`` to bytes). The header
travels in the safetensors metadata as strings under ``bayesfl.*`` keys, together with a SHA-256
digest of the header and the tensors (names, dtypes, shapes and raw bytes), so that truncated,
corrupted or foreign bytes are rejected by `decode` rather than used. Bytes counted for
communication accounting are ``len(encode(msg))`` (``Message.nbytes``); the theoretical count of
numbers is ``Message.num_elements``.

Receiving side: ``msg = decode(data)`` checks the format, then ``validate(msg, schema,
strategy=..., round=..., direction=...)`` checks names, shapes, dtypes and finiteness against a
`Schema`. Both raise `bayesfl.errors.MessageRejected` with a precise reason.
Algorithm invariants (e.g. FedLog's bias column) are the strategy's to check on top.

Hostile bytes: the JSON header is bounded in size (`MAX_HEADER_BYTES`) and nesting
(`MAX_HEADER_DEPTH`) before it is parsed, so no input can exhaust memory or the
interpreter's recursion limit; every failure is a `MessageRejected`.

Authentication: the SHA-256 digest detects corruption but not forgery (anyone can recompute it
after rewriting the header, e.g. to replay an old upload as another round or client). With a
``key``, `encode` stores an HMAC-SHA256 of the same bytes instead, and `decode` with
that key accepts only messages whose HMAC verifies (constant-time comparison). Keys are per
client (see `KeyRing`); distributing them is the deployment's job.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import hmac
import json
import math
import re
import secrets
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii
from typing import Any

import numpy as np
import torch
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
        schema_version: wire format version; only `SCHEMA_VERSION` is accepted.
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
        anyway should call `encode` once and take ``len``.
        """
        return len(encode(self))

    @property
    def num_elements(self) -> int:
        """Total number of tensor elements (the theoretical 'float count' of papers)."""
        return sum(t.numel() for t in self.tensors.values())


def tensor_digest(
    tensors: Mapping[str, torch.Tensor], preamble: str = "", key: bytes | None = None, *,
    raw: Mapping[str, np.ndarray] | None = None,
) -> str:
    """SHA-256 hex digest (HMAC-SHA256 with ``key``) of ``preamble`` then the names, dtypes,
    shapes and raw bytes of ``tensors`` (sorted by name); ``raw`` (name -> `raw_bytes`)
    reuses bytes already taken.

    Messages and checkpoints store it to detect corrupted payloads; the preamble binds the
    header (or checkpoint meta) to the tensors. Only the keyed form detects forgery.
    """
    return _digest({name: (tensors[name], raw_bytes(tensors[name]) if raw is None
                           else raw[name]) for name in tensors}, preamble, key)


def raw_bytes(tensor: torch.Tensor) -> np.ndarray:
    """The bytes of ``tensor`` (C order, on the CPU) as a C-contiguous array (its buffer is
    those bytes; ``nbytes`` their count), without a copy where the tensor already is a
    contiguous CPU tensor."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    if tensor.dtype in _NUMPY_DTYPES and tensor.is_contiguous():
        return tensor.numpy()  # its buffer is the same bytes (hashlib and files take it)
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy()


_NUMPY_DTYPES = frozenset((torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32,
                           torch.int64, torch.float16, torch.float32, torch.float64,
                           torch.complex64, torch.complex128))


def _digest(entries: Mapping[str, tuple[torch.Tensor, np.ndarray]], preamble: str,
            key: bytes | None) -> str:
    """`tensor_digest` of ``name -> (tensor, its raw bytes)``.

    Each tensor's line is ``json.dumps([name, str(dtype), list(shape)])``, written out here
    (the same text, a tenth of the cost: a checkpoint holds a line per client tensor).
    """
    digest = (hashlib.sha256() if key is None
              else hmac.new(_check_key(key), digestmod=hashlib.sha256))
    digest.update(preamble.encode("utf-8"))
    for name in sorted(entries):
        tensor, raw = entries[name]
        digest.update(b"[" + encode_basestring_ascii(name).encode()
                      + _described(tensor.dtype, tensor.shape)[0])
        digest.update(raw)  # hashes the buffer without a copy
    return digest.hexdigest()


@functools.lru_cache(maxsize=4096)
def _described(dtype: torch.dtype, shape: torch.Size) -> tuple[bytes, str, int]:
    """(the end of a tensor's digest line after its name, the start of its safetensors
    header entry after its name, its safetensors dtype rank) for tensors of ``dtype`` and
    ``shape`` (memoised: a checkpoint repeats a few layouts over every client)."""
    line = f', "{dtype}", [{", ".join(map(str, shape))}]]'.encode()
    if dtype not in _SAFETENSORS_DTYPES:
        return line, "", -1
    name, rank = _SAFETENSORS_DTYPES[dtype]
    entry = f':{{"dtype":"{name}","shape":[{",".join(map(str, shape))}],"data_offsets":['
    return line, entry, rank


# safetensors' names of the dtypes it stores, in the order of its ``Dtype`` enum: a file lists
# its tensors by that order, largest first, then by name (so every tensor stays aligned)
_SAFETENSORS_DTYPES = {
    dtype: (name, rank) for rank, (dtype, name) in enumerate((
        (torch.bool, "BOOL"), (torch.uint8, "U8"), (torch.int8, "I8"),
        (getattr(torch, "float8_e5m2", None), "F8_E5M2"),
        (getattr(torch, "float8_e4m3fn", None), "F8_E4M3"),
        (torch.int16, "I16"), (getattr(torch, "uint16", None), "U16"),
        (torch.float16, "F16"), (torch.bfloat16, "BF16"), (torch.int32, "I32"),
        (getattr(torch, "uint32", None), "U32"), (torch.float32, "F32"),
        (torch.complex64, "C64"), (torch.float64, "F64"), (torch.int64, "I64"),
        (getattr(torch, "uint64", None), "U64"),
    )) if dtype is not None
}


def safetensors_bytes(tensors: Mapping[str, torch.Tensor],
                      metadata: Mapping[str, str] | None = None, *,
                      raw: Mapping[str, np.ndarray] | None = None) -> bytes:
    """``tensors`` and ``metadata`` as a safetensors file in memory: what
    ``safetensors.torch.save`` writes (the same layout, header and length; metadata keys
    sorted, where safetensors' order varies from process to process), read back by
    ``safetensors.torch.load``.

    Built here because ``safetensors.torch.save`` spends ~0.3 ms of Python per tensor (and
    refuses tensors sharing a storage, which then need copies): a round of the simulator
    encodes an upload per client and its checkpoint holds every client's state. ``raw``
    (name -> `raw_bytes`) reuses bytes already taken (for the digest).
    """
    return b"".join(safetensors_parts(tensors, metadata, raw=raw))


def safetensors_parts(tensors: Mapping[str, torch.Tensor],
                      metadata: Mapping[str, str] | None = None, *,
                      raw: Mapping[str, np.ndarray] | None = None) -> list[Any]:
    """`safetensors_bytes` as the buffers that make it up, in order (a file can be
    written from them without holding the whole in memory once more)."""
    described = []
    for name, t in tensors.items():
        _, entry, rank = _described(t.dtype, t.shape)
        if rank < 0 or sys.byteorder != "little":  # a dtype not ours to write: safetensors'
            return [_safetensors_save(contiguous_cpu_tensors(tensors),
                                      metadata=None if metadata is None else dict(metadata))]
        described.append((-rank, name, entry))
    if raw is None:
        raw = {name: raw_bytes(t) for name, t in tensors.items()}
    described.sort()
    parts = ['"__metadata__":' + _json_object(metadata)] if metadata is not None else []
    chunks = []
    offset = 0
    for _, name, entry in described:
        data = raw[name]
        end = offset + data.nbytes
        parts.append(f"{_json_string(name)}{entry}{offset},{end}]}}")
        chunks.append(data)
        offset = end
    header = ("{" + ",".join(parts) + "}").encode("utf-8")
    header += b" " * (-len(header) % 8)  # safetensors pads its header to 8 bytes
    return [len(header).to_bytes(8, "little") + header, *chunks]


_JSON_ESCAPES = re.compile(r'["\\\x00-\x1f]')


def _json_string(text: str) -> str:
    """``text`` as a JSON string the way safetensors (serde_json) writes it: UTF-8 as is,
    quotes, backslashes and control characters escaped (as Python's ``json`` escapes them)."""
    if _JSON_ESCAPES.search(text) is None:
        return f'"{text}"'
    return json.dumps(text, ensure_ascii=False)


def _json_object(mapping: Mapping[str, str]) -> str:
    """``mapping`` as a compact JSON object, keys sorted, as serde_json writes strings."""
    return _COMPACT_JSON.encode(dict(sorted(mapping.items())))


# json.dumps(..., ensure_ascii=False, separators=(",", ":")), without building an encoder
# at every call (a message's metadata is one call per upload)
_COMPACT_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


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
    tensors = msg.tensors
    h = msg.header
    raw = {name: raw_bytes(t) for name, t in tensors.items()}  # one pass for both
    digest = _digest({name: (tensors[name], raw[name]) for name in tensors},
                     _header_text(h), key)
    layout = (h.strategy, h.round, h.direction, h.schema_version, key is not None,
              tuple((name, t.dtype, t.shape) for name, t in tensors.items()))
    template = _ENCODE_TEMPLATES.get(layout)
    if template is None:
        if len(_ENCODE_TEMPLATES) >= _KNOWN_HEADERS_MAX:  # the oldest forgotten (a round's)
            _forget_oldest(_ENCODE_TEMPLATES)
        template = _ENCODE_TEMPLATES[layout] = _EncodeTemplate.of(msg, key is not None, raw)
    if template.pieces is None:
        return safetensors_bytes(tensors, _metadata(h, key is not None, str(h.client_id),
                                                    digest), raw=raw)
    return template.fill(str(h.client_id), digest, raw)


def _metadata(header: Header, authenticated: bool, client_id: str, digest: str
              ) -> dict[str, str]:
    """A message's safetensors metadata (``client_id`` and ``digest`` as given)."""
    return {
        _PREFIX + "format": _FORMAT,
        _PREFIX + "schema_version": str(header.schema_version),
        _PREFIX + "strategy": header.strategy,
        _PREFIX + "round": str(header.round),
        _PREFIX + "client_id": client_id,
        _PREFIX + "direction": header.direction,
        _HMAC if authenticated else _PREFIX + "sha256": digest,
    }


class _EncodeTemplate:
    """The safetensors header of a message layout (header fields but the client id, tensor
    names, dtypes and shapes) as the text around its client id and its digest, and the order
    of the tensors' bytes after it: `encode` fills in the two values, the same bytes as
    building the header (a round's uploads share one layout: 3x faster)."""

    _ID, _DIGEST = "@@bayesfl-client-id@@", "@@bayesfl-digest@@"

    def __init__(self, pieces: tuple[bytes, bytes, bytes] | None, order: list[str]) -> None:
        self.pieces, self.order = pieces, order

    @classmethod
    def of(cls, msg: Message, authenticated: bool, raw: Mapping[str, np.ndarray]
           ) -> _EncodeTemplate:
        """The template of ``msg``'s layout (``pieces`` None where safetensors itself writes
        the file, or a name or the strategy holds a placeholder)."""
        metadata = _metadata(msg.header, authenticated, cls._ID, cls._DIGEST)
        parts = safetensors_parts(msg.tensors, metadata, raw=raw)
        text = bytes(parts[0][8:]).rstrip(b" ")  # the JSON (the padding is spaces after it)
        ident, digest = cls._ID.encode(), cls._DIGEST.encode()
        if len(parts) == 1 or text.count(ident) != 1 or text.count(digest) != 1 \
                or text.index(ident) > text.index(digest):
            return cls(None, [])
        before, rest = text.split(ident)
        middle, after = rest.split(digest)
        name_of = {id(array): name for name, array in raw.items()}  # the parts' own order
        return cls((before, middle, after), [name_of[id(part)] for part in parts[1:]])

    def fill(self, client_id: str, digest: str, raw: Mapping[str, np.ndarray]) -> bytes:
        """The message's bytes: the header with these values, then the tensors' bytes."""
        before, middle, after = self.pieces
        header = b"".join((before, client_id.encode(), middle, digest.encode(), after))
        header += b" " * (-len(header) % 8)  # safetensors pads its header to 8 bytes
        return b"".join([len(header).to_bytes(8, "little"), header,
                         *[raw[name] for name in self.order]])


_ENCODE_TEMPLATES: dict[tuple, _EncodeTemplate] = {}


def _check_key(key: object) -> bytes:
    if not isinstance(key, bytes | bytearray) or len(key) < 16:
        raise ConfigError("a message key must be at least 16 bytes (use KeyRing or "
                          "secrets.token_bytes(32))")
    return bytes(key)


class KeyRing:
    """Per-client HMAC keys derived from one secret: ``client_key(k)`` authenticates client
    k's uploads, ``server_key`` the server's broadcasts.

    The simulator draws a fresh secret per run (`generate`); a deployment provisions
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
    """``json.dumps([strategy, round, client_id, direction, schema_version])``, written out
    (the integers are checked by `Header`)."""
    return (f"[{encode_basestring_ascii(header.strategy)}, {header.round}, "
            f"{header.client_id}, {encode_basestring_ascii(header.direction)}, "
            f"{header.schema_version}]")


def read_safetensors_metadata(
    data: bytes, *, max_header_bytes: int | None = None
) -> dict[str, str]:
    """The ``__metadata__`` of safetensors bytes, read from its JSON header.

    The header's size and nesting depth are bounded before it is parsed.

    Raises:
        ValueError: the bytes do not start with a well-formed safetensors header, or the
            header is larger than ``max_header_bytes`` (default `MAX_HEADER_BYTES`) or
            nested deeper than `MAX_HEADER_DEPTH`.
    """
    return _read_header(data, max_header_bytes=max_header_bytes)[1]


def _read_header(
    data: bytes, *, max_header_bytes: int | None = None
) -> tuple[dict[str, Any], dict[str, str], int]:
    """(the JSON header, its ``__metadata__``, the header's length) of safetensors bytes
    (`read_safetensors_metadata`, which raises what this raises)."""
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
    if header_len > _PARSE_FIRST_BYTES:
        _check_depth(raw)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        _check_depth(raw)  # too deep is the reason, if it is one
        raise ValueError(f"header is not JSON ({err})") from err
    if header_len <= _PARSE_FIRST_BYTES and not _at_most_3_deep(header):
        _check_depth(raw)
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    metadata = header.get("__metadata__") or {}
    if not isinstance(metadata, dict) or not _strings(metadata.values()):
        raise ValueError("metadata is not a string-to-string mapping")
    return header, metadata, header_len


def _strings(values: Iterable[object]) -> bool:
    """Whether every value is a string (a loop: a third of ``all()`` over a generator)."""
    for value in values:  # noqa: SIM110 - all() over a generator costs 3x
        if not isinstance(value, str):
            return False
    return True


_PARSE_FIRST_BYTES = 4096
"""Headers up to this size are parsed before their depth is checked, and the text's depth is
counted only when the parsed object is not plainly shallow (the same verdict: JSON that parses
nests as deep as its brackets): at most 4,096 brackets, so ``json`` meets the recursion limit
(a rejection) long before the stack. One upload's header is ~400 bytes; counting its brackets
in the bytes first took as long as parsing it."""


def _check_depth(raw: bytes) -> None:
    """ValueError if the JSON text ``raw`` nests deeper than `MAX_HEADER_DEPTH`."""
    depth = json_depth(raw)
    if depth > MAX_HEADER_DEPTH:
        raise ValueError(f"header nests {depth} levels deep; a safetensors header nests 3 "
                         f"(limit {MAX_HEADER_DEPTH})")


def _at_most_3_deep(value: object) -> bool:
    """Whether parsed JSON ``value`` nests at most 3 deep, as a safetensors header does (an
    object of objects holding strings and arrays of numbers): a few type checks per entry.
    Otherwise the caller counts the depth in the text (`_check_depth`)."""
    items = value.values() if type(value) is dict else value if type(value) is list else ()
    for item in items:
        inner = item.values() if type(item) is dict else item if type(item) is list else ()
        for child in inner:
            if type(child) is list:
                for leaf in child:
                    if type(leaf) is list or type(leaf) is dict:
                        return False
            elif type(child) is dict:
                return False
    return True


def decode(
    data: bytes, *, max_bytes: int = DEFAULT_MAX_BYTES, key: bytes | None = None
) -> Message:
    """Parse bytes produced by `encode`; never unpickles anything.

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
    header_len, masked, values = _masked_header(data)
    known = _KNOWN_HEADERS.get(masked) if masked is not None else None
    read = known.read(data, header_len, values) if known is not None else None
    if read is None:
        read = _read_message_header(data)
    spans, metadata, header = read
    entries = _tensors(memoryview(data)[8 + header_len:], spans)
    _check_digest(metadata, entries, header, key)
    if known is None and masked is not None:
        _remember_header(masked, _KnownHeader(spans, len(data) - 8 - header_len, metadata, header))
    return Message(header, {name: tensor for name, (tensor, _) in entries.items()})


def _read_message_header(data: bytes) -> tuple[list[tuple], dict[str, str], Header]:
    """(the tensors' spans, the metadata, the header) of message bytes, parsed and checked
    in full (`decode` raises what this raises)."""
    try:
        layout, metadata, header_len = _read_header(data)
    except ValueError as err:
        raise MessageRejected(f"not a bayesfl message (corrupt or foreign bytes): {err}") from err
    if metadata.get(_PREFIX + "format") != _FORMAT:
        raise MessageRejected("not a bayesfl message: the safetensors metadata lacks "
                              f"{_PREFIX}format={_FORMAT}")
    header = _header_from_metadata(metadata)
    try:
        spans = _spans(layout, len(data) - 8 - header_len)
    except ValueError as err:
        raise MessageRejected(f"corrupt message: safetensors could not read it ({err})",
                              client_id=header.client_id) from err
    return spans, metadata, header


# A round's uploads have one header but for the sender's id and the digest: a header equal,
# byte for byte, to one already parsed and checked, but for those two values (each a plain
# integer or hex string, found once), is read from what that parse found instead of parsed
# again (json, depth, entries: ~2/3 of decoding a small upload).
_CLIENT_ID_KEY = f'"{_PREFIX}client_id":"'.encode()
_DIGEST_KEYS = (f'"{_PREFIX}sha256":"'.encode(), f'"{_HMAC}":"'.encode())
_KNOWN_HEADERS: dict[bytes, _KnownHeader] = {}
_KNOWN_HEADERS_MAX = 64


def _masked_header(data: bytes) -> tuple[int, bytes | None, tuple[bytes, bytes]]:
    """(the header's length, its JSON text without the client id's and the digest's values,
    those two values) of message bytes; the text is None where the header does not hold each
    exactly once, as an integer and a 64-digit lowercase hex string (then it is not looked up,
    nor remembered). A quote inside a JSON string is escaped, so the keys found are keys."""
    header_len = int.from_bytes(data[:8], "little") if len(data) >= 8 else 0
    if not 0 < header_len <= min(len(data) - 8, _PARSE_FIRST_BYTES):
        return header_len, None, (b"", b"")
    text = data[8 : 8 + header_len]
    digest_keys = [k for k in _DIGEST_KEYS if k in text]
    if text.count(_CLIENT_ID_KEY) != 1 or len(digest_keys) != 1 \
            or text.count(digest_keys[0]) != 1:
        return header_len, None, (b"", b"")
    id_start = text.index(_CLIENT_ID_KEY) + len(_CLIENT_ID_KEY)
    id_end = text.find(b'"', id_start)
    ident = text[id_start:id_end]
    digest_start = text.index(digest_keys[0]) + len(digest_keys[0])
    digest_end = digest_start + 64
    digest = text[digest_start:digest_end]
    if not (0 < len(ident) <= 20 and (ident[1:] if ident[:1] == b"-" else ident).isdigit()) \
            or text[digest_end : digest_end + 1] != b'"' or len(digest) != 64 \
            or digest.translate(None, b"0123456789abcdef"):
        return header_len, None, (b"", b"")
    (a, b), (c, d) = sorted(((id_start, id_end), (digest_start, digest_end)))
    return header_len, b"".join((text[:a], text[b:c], text[d:])), (ident, digest)


class _KnownHeader:
    """What a full read of a header found (its tensors' spans, the data's size, its metadata
    and `Header`), for headers that differ from it in the client id and the digest."""

    def __init__(self, spans: list[tuple], data_size: int, metadata: Mapping[str, str],
                 header: Header) -> None:
        self.spans, self.data_size, self.header = spans, data_size, header
        self.metadata = dict(metadata)
        self.digest_name = _HMAC if _HMAC in metadata else _PREFIX + "sha256"

    def read(self, data: bytes, header_len: int, values: tuple[bytes, bytes]
             ) -> tuple[list[tuple], dict[str, str], Header] | None:
        """(spans, metadata, header) of ``data``, whose header is this one but for the
        ``values`` (client id, digest); None where the data's size differs or the id is out of
        range (the full read then says what is wrong)."""
        if len(data) - 8 - header_len != self.data_size:
            return None
        ident, digest = values[0].decode(), values[1].decode()
        h = self.header
        try:
            header = Header(h.strategy, h.round, int(ident), h.direction, h.schema_version)
        except ConfigError:
            return None
        metadata = dict(self.metadata)
        metadata[_PREFIX + "client_id"], metadata[self.digest_name] = ident, digest
        return self.spans, metadata, header


def _remember_header(masked: bytes, known: _KnownHeader) -> None:
    """Keep ``known`` for headers that mask to ``masked`` (the oldest of
    `_KNOWN_HEADERS_MAX` forgotten: a header holds its round)."""
    if len(_KNOWN_HEADERS) >= _KNOWN_HEADERS_MAX:
        _forget_oldest(_KNOWN_HEADERS)
    _KNOWN_HEADERS[masked] = known


def _forget_oldest(cache: dict) -> None:
    """Drop ``cache``'s oldest entry (a no-op where another thread changed it meanwhile: a
    cache may be one entry over its bound, never wrong)."""
    with contextlib.suppress(StopIteration, KeyError, RuntimeError):
        del cache[next(iter(cache))]


_DTYPES_BY_NAME = {name: dtype for dtype, (name, _) in _SAFETENSORS_DTYPES.items()}


def _spans(layout: Mapping[str, Any], data_size: int) -> list[tuple]:
    """The tensors of safetensors data of ``data_size`` bytes whose parsed JSON header is
    ``layout``, as ``(begin, end, name, dtype, shape)`` sorted by name.

    The checks are safetensors' own: every entry names a known dtype, a shape of
    non-negative integers and ``data_offsets`` ``[begin, end]`` spanning exactly the shape's
    bytes; the entries tile the data section without gap or overlap, to its last byte.

    Raises:
        ValueError: naming the first entry or offset that breaks them.
    """
    spans = []
    for name, entry in layout.items():
        if name == "__metadata__":
            continue
        if not name:  # safetensors allows it, a Message does not (ConfigError, a crash)
            raise ValueError("a tensor without a name")
        if type(entry) is not dict or entry.keys() != _ENTRY_KEYS:
            raise ValueError(f"tensor {name!r}: not an entry of dtype, shape and data_offsets")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        torch_dtype = _DTYPES_BY_NAME.get(dtype) if type(dtype) is str else None
        if torch_dtype is None:
            raise ValueError(f"tensor {name!r}: unknown dtype {dtype!r}")
        if type(shape) is not list or not _sizes(shape):
            raise ValueError(f"tensor {name!r}: shape {shape!r} is not a list of sizes")
        if type(offsets) is not list or len(offsets) != 2 or not _sizes(offsets) \
                or offsets[0] > offsets[1]:
            raise ValueError(f"tensor {name!r}: data_offsets {offsets!r}")
        size = math.prod(shape) * torch_dtype.itemsize
        if offsets[1] - offsets[0] != size:
            raise ValueError(f"tensor {name!r}: data_offsets {offsets} hold "
                             f"{offsets[1] - offsets[0]} bytes, its shape {shape} needs {size}")
        spans.append((offsets[0], offsets[1], name, torch_dtype, shape))
    spans.sort()
    end = 0
    for begin, stop, name, _, _ in spans:
        if begin != end:
            raise ValueError(f"tensor {name!r}: data_offsets start at {begin}, not at {end}")
        end = stop
    if end != data_size:
        raise ValueError(f"the tensors hold {end} bytes of the {data_size} after the header")
    return sorted(spans, key=lambda span: span[2])


def _tensors(view: memoryview, spans: Sequence[tuple]
             ) -> dict[str, tuple[torch.Tensor, memoryview]]:
    """name -> (tensor, its raw bytes) of the data section ``view`` cut at ``spans``
    (`_spans`): each tensor gets its own (writable) copy of its bytes."""
    out = {}
    for begin, stop, name, torch_dtype, shape in spans:
        raw = view[begin:stop]
        if stop == begin:
            tensor = torch.empty(shape, dtype=torch_dtype)
        elif torch_dtype in _NUMPY_OF:  # numpy's view of the copy: a third of frombuffer's cost
            tensor = torch.from_numpy(
                np.frombuffer(bytearray(raw), dtype=_NUMPY_OF[torch_dtype]).reshape(shape))
        else:
            tensor = torch.frombuffer(bytearray(raw), dtype=torch_dtype).reshape(shape)
        out[name] = (tensor, raw)
    return out


_ENTRY_KEYS = frozenset(("dtype", "shape", "data_offsets"))
# the dtypes numpy holds alike (native byte order, as torch.frombuffer reads them)
_NUMPY_OF = {dtype: np.dtype(name) for dtype, name in (
    (torch.bool, "bool"), (torch.uint8, "u1"), (torch.int8, "i1"), (torch.int16, "i2"),
    (torch.int32, "i4"), (torch.int64, "i8"), (torch.float16, "f2"), (torch.float32, "f4"),
    (torch.float64, "f8"), (torch.complex64, "c8"), (torch.complex128, "c16"))}


def _sizes(values: list) -> bool:
    """Whether every item of a JSON list is a non-negative integer (not a bool)."""
    for value in values:  # noqa: SIM110 - all() over a generator costs 3x
        if type(value) is not int or value < 0:
            return False
    return True


def _check_digest(metadata: Mapping[str, str],
                  entries: Mapping[str, tuple[torch.Tensor, memoryview]],
                  header: Header, key: bytes | None) -> None:
    sender = header.client_id
    if key is None:
        if _HMAC in metadata:
            raise MessageRejected("authenticated message (HMAC) but this receiver has no key to "
                                  "check it: pass the sender's key", client_id=sender)
        if _digest(entries, _header_text(header), None) != metadata.get(_PREFIX + "sha256"):
            raise MessageRejected("corrupt message: tensor digest mismatch", client_id=sender)
        return
    tag = metadata.get(_HMAC)
    if tag is None:
        raise MessageRejected("unauthenticated message: this receiver requires an HMAC "
                              "(the sender must encode with its key)", client_id=sender)
    if not hmac.compare_digest(_digest(entries, _header_text(header), key), tag):
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
    reason = validate_many([msg], schema, strategy=strategy, round=round, direction=direction,
                           client_ids=None if client_id is None else [client_id])[0]
    if reason is not None:
        raise MessageRejected(reason, client_id=msg.header.client_id)


def validate_many(
    messages: Sequence[Message],
    schema: Schema,
    *,
    strategy: str | None = None,
    round: int | None = None,
    direction: str | None = None,
    client_ids: Sequence[int] | None = None,
) -> list[str | None]:
    """`validate` of each message (``client_ids[i]``: the sender message i must name):
    None, or the reason it would raise.

    The checks of names, dtypes and shapes run per message; the finiteness of each tensor name
    runs once over every message's tensor of that name (one pass over a round's uploads, not
    one per upload), and each message's reason is still its first problem in
    `validate`'s order.
    """
    names = sorted(schema)
    reasons: list[str | None] = [None] * len(messages)
    # per message, how many of the sorted names passed their dtype and shape checks
    checked = [0] * len(messages)
    fixed = [(field, want) for field, want in
             (("strategy", strategy), ("round", round), ("direction", direction))
             if want is not None]
    wanted = frozenset(names)
    for i, msg in enumerate(messages):
        expected = fixed if client_ids is None else [*fixed, ("client_id", client_ids[i])]
        reasons[i], checked[i] = _structure_problem(msg, schema, names, wanted, expected)
    finite_problem: list[str | None] = [None] * len(messages)
    for k, name in enumerate(names):
        spec = schema[name]
        if not spec.finite or not (spec.dtype.is_floating_point or spec.dtype.is_complex):
            continue
        rows = [i for i in range(len(messages))
                if checked[i] > k and finite_problem[i] is None]
        if not rows:
            continue
        tensors = [messages[i].tensors[name] for i in rows]
        bad = ~torch.isfinite(torch.cat([t.reshape(-1).to("cpu") for t in tensors]))
        if not bool(bad.any()):
            continue
        sizes = torch.tensor([t.numel() for t in tensors])
        counts = torch.zeros(len(rows), dtype=torch.int64).index_add_(
            0, torch.repeat_interleave(torch.arange(len(rows)), sizes), bad.to(torch.int64))
        for i, tensor, count in zip(rows, tensors, counts.tolist(), strict=True):
            if count:
                finite_problem[i] = (f"tensor {name!r} has {count} non-finite value(s) (NaN "
                                     f"or Inf) of {math.prod(tensor.shape)}")
    # a non-finite tensor comes before any dtype or shape problem of a later name
    return [f if f is not None else r for f, r in zip(finite_problem, reasons, strict=True)]


def _structure_problem(msg: Message, schema: Schema, names: list[str], wanted: frozenset[str],
                       expected: Sequence[tuple[str, Any]]) -> tuple[str | None, int]:
    """(the first problem of ``msg``'s header, names, dtypes and shapes in `validate`'s
    order, or None; how many of the sorted ``names`` (``wanted``, as a set) passed their dtype
    and shape checks). ``expected``: the header fields to check, with their values."""
    for field, want in expected:
        got = getattr(msg.header, field)
        if got != want:
            return f"wrong header: {field} is {got!r}, expected {want!r}", 0
    tensors = msg.tensors
    if tensors.keys() != wanted:
        missing = sorted(set(schema) - set(tensors))
        if missing:
            return f"missing tensors {missing}", 0
        return f"unexpected tensors {sorted(set(tensors) - set(schema))}", 0
    for k, name in enumerate(names):
        tensor, spec = tensors[name], schema[name]
        if tensor.dtype != spec.dtype:
            return f"tensor {name!r} has dtype {tensor.dtype}, expected {spec.dtype}", k
        shape = tuple(tensor.shape)
        if shape != spec.shape and not spec.matches_shape(shape):  # equal: no wildcard to try
            want = "(" + ", ".join("*" if s is None else str(s) for s in spec.shape) + ")"
            return f"tensor {name!r} has shape {shape}, expected {want}", k
    return None, len(names)
