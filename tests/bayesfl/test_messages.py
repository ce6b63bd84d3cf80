"""Messages: exact round trip, byte accounting, and every rejection path of decode/validate."""

import io
import json
import os
import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

from bayesfl.errors import ConfigError, MessageRejected
from bayesfl.messages import (
    Header,
    KeyRing,
    Message,
    TensorSpec,
    decode,
    encode,
    tensor_digest,
    validate,
)
from tests.devices import DEVICES

HEADER = Header(strategy="fedlog", round=3, client_id=7, direction="up")


def fedlog_upload(**overrides) -> Message:
    tensors = {"stats": torch.arange(20, dtype=torch.float64).reshape(4, 5),
               "counts": torch.tensor([3, 1, 0, 2]),
               "num_samples": torch.tensor(6)}
    tensors.update(overrides)
    return Message(HEADER, tensors)


SCHEMA = {"stats": TensorSpec((4, None), torch.float64),
          "counts": TensorSpec((4,), torch.int64),
          "num_samples": TensorSpec((), torch.int64)}


def assert_same_message(a: Message, b: Message) -> None:
    assert a.header == b.header
    assert set(a.tensors) == set(b.tensors)
    for name, tensor in a.tensors.items():
        other = b.tensors[name]
        assert other.dtype == tensor.dtype and other.shape == tensor.shape
        assert torch.equal(other, tensor.cpu())


@pytest.mark.parametrize("device", DEVICES)
def test_round_trip_keeps_header_names_dtypes_shapes_and_values(device):
    tensors = {
        "f32": torch.randn(3, 4, device=device),
        "f64": torch.randn(5, dtype=torch.float64, device=device),
        "f16": torch.randn(2, 2, device=device).half(),
        "bf16": torch.randn(7, device=device).bfloat16(),
        "i64": torch.tensor([-1, 0, 2**40], device=device),
        "i32": torch.tensor([[1, 2]], dtype=torch.int32, device=device),
        "u8": torch.tensor([0, 255], dtype=torch.uint8, device=device),
        "mask": torch.tensor([True, False, True], device=device),
        "scalar": torch.tensor(1.5, device=device),
        "empty": torch.zeros(0, 3, device=device),
        "nan_ok": torch.tensor([float("nan"), float("inf")], device=device),
    }
    msg = Message(Header("fedavg", 0, -1, "down"), tensors)
    decoded = decode(encode(msg))
    assert decoded.header == msg.header
    for name, tensor in tensors.items():
        got = decoded.tensors[name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape
        assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(tensor.cpu())), name


def test_nbytes_is_the_length_of_the_encoded_bytes():
    msg = fedlog_upload()
    assert msg.nbytes == len(encode(msg))
    payload = 20 * 8 + 4 * 8 + 8
    assert payload < msg.nbytes < payload + 1024  # the header is small next to real payloads
    assert msg.num_elements == 20 + 4 + 1


def test_encode_accepts_views_sharing_storage_and_non_contiguous_tensors():
    base = torch.arange(12.0)
    msg = Message(HEADER, {"a": base[:6], "b": base[6:], "t": base.reshape(3, 4).T})
    assert_same_message(msg, decode(encode(msg)))


def test_encoded_size_is_stable_across_encodings():
    # safetensors may order metadata keys differently from call to call; sizes never differ
    sizes = {len(encode(fedlog_upload())) for _ in range(5)}
    assert sizes == {fedlog_upload().nbytes}


# --- rejections by decode -------------------------------------------------------------------

def test_oversized_bytes_are_rejected_before_parsing():
    data = encode(fedlog_upload())
    assert decode(data, max_bytes=len(data)).header == HEADER
    with pytest.raises(MessageRejected, match=f"oversized message: {len(data)} bytes"):
        decode(data, max_bytes=len(data) - 1)


@pytest.mark.parametrize("keep", [0, 4, 8, 50, -1, -8])
def test_truncated_bytes_are_rejected(keep):
    data = encode(fedlog_upload())
    with pytest.raises(MessageRejected):
        decode(data[:keep])


def test_a_flipped_byte_in_the_tensor_data_is_rejected():
    data = bytearray(encode(fedlog_upload()))
    data[-3] ^= 0x01
    with pytest.raises(MessageRejected, match="digest mismatch"):
        decode(bytes(data))


def test_a_tampered_header_value_is_rejected():
    data = encode(fedlog_upload())
    tampered = data.replace(b'"bayesfl.round":"3"', b'"bayesfl.round":"4"')
    assert tampered != data
    with pytest.raises(MessageRejected, match="digest mismatch"):
        decode(tampered)


@settings(max_examples=150, deadline=None)
@given(position=st.integers(0, 10_000), flip=st.integers(1, 255))
def test_property_any_single_byte_corruption_is_rejected_or_harmless(position, flip):
    original = fedlog_upload()
    data = bytearray(encode(original))
    data[position % len(data)] ^= flip
    try:
        decoded = decode(bytes(data))
    except MessageRejected:
        return
    # only JSON-insignificant bytes (e.g. header padding spaces turned into tabs) may pass
    assert_same_message(original, decoded)


def _malicious_pickle(marker: str) -> bytes:
    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    return pickle.dumps({"stats": Exploit()})


def test_a_pickle_is_rejected_and_never_executed(tmp_path):
    marker = tmp_path / "pwned"
    with pytest.raises(MessageRejected, match="not a bayesfl message"):
        decode(_malicious_pickle(str(marker)))
    assert not marker.exists()


def test_foreign_formats_are_rejected():
    npz = io.BytesIO()
    np.savez(npz, stats=np.zeros((4, 5)))
    torch_file = io.BytesIO()
    torch.save({"stats": torch.zeros(4, 5)}, torch_file)
    foreign = [npz.getvalue(), torch_file.getvalue(), pickle.dumps([1, 2, 3]),
               b"\xff" * 64, json.dumps({"stats": [1, 2]}).encode(), b"", os.urandom(256)]
    for data in foreign:
        with pytest.raises(MessageRejected, match="not a bayesfl message"):
            decode(data)


def test_a_plain_safetensors_file_without_a_bayesfl_header_is_rejected():
    data = safetensors_save({"stats": torch.zeros(4, 5)}, metadata={"format": "pt"})
    with pytest.raises(MessageRejected, match=r"lacks bayesfl\.format"):
        decode(data)


def _reencode_with_metadata(msg: Message, **changes: str) -> bytes:
    """Encode, then rewrite metadata fields and re-save (a well-formed but unexpected file)."""
    from bayesfl.messages import read_safetensors_metadata

    metadata = dict(read_safetensors_metadata(encode(msg)))
    metadata.update({f"bayesfl.{k}": v for k, v in changes.items()})
    return safetensors_save(dict(msg.tensors), metadata=metadata)


@pytest.mark.parametrize(("changes", "reason"), [
    ({"schema_version": "2"}, "unsupported message schema_version 2"),
    ({"round": "three"}, "malformed message header"),
    ({"direction": "sideways"}, "direction must be one of"),
    ({"client_id": "-5"}, "client_id must be an integer >= -1"),
])
def test_a_malformed_or_unsupported_header_is_rejected(changes, reason):
    with pytest.raises(MessageRejected, match=reason):
        decode(_reencode_with_metadata(fedlog_upload(), **changes))


def test_non_bytes_input_is_rejected():
    with pytest.raises(MessageRejected, match="expected bytes"):
        decode("not bytes")  # type: ignore[arg-type]


# --- rejections by validate -----------------------------------------------------------------

def test_a_valid_message_passes_validation_after_a_round_trip():
    validate(decode(encode(fedlog_upload())), SCHEMA, strategy="fedlog", round=3,
             direction="up", client_id=7)


@pytest.mark.parametrize(("expect", "reason"), [
    ({"strategy": "fedavg"}, "strategy is 'fedlog', expected 'fedavg'"),
    ({"round": 4}, "round is 3, expected 4"),
    ({"direction": "down"}, "direction is 'up', expected 'down'"),
    ({"client_id": 8}, "client_id is 7, expected 8"),
])
def test_a_wrong_header_is_rejected(expect, reason):
    with pytest.raises(MessageRejected, match=f"wrong header: {reason}") as info:
        validate(fedlog_upload(), SCHEMA, **expect)
    assert info.value.client_id == 7


def test_missing_tensors_are_rejected_by_name():
    msg = Message(HEADER, {"stats": torch.zeros(4, 5, dtype=torch.float64)})
    with pytest.raises(MessageRejected, match=r"missing tensors \['counts', 'num_samples'\]"):
        validate(msg, SCHEMA)


def test_extra_tensors_are_rejected_by_name():
    with pytest.raises(MessageRejected, match=r"unexpected tensors \['smuggled'\]"):
        validate(fedlog_upload(smuggled=torch.zeros(1)), SCHEMA)


@pytest.mark.parametrize(("stats", "reason"), [
    (torch.zeros(5, 5, dtype=torch.float64), r"shape \(5, 5\), expected \(4, \*\)"),
    (torch.zeros(4, dtype=torch.float64), r"shape \(4,\), expected \(4, \*\)"),
    (torch.zeros(4, 5, 1, dtype=torch.float64), r"shape \(4, 5, 1\)"),
])
def test_a_wrong_shape_is_rejected(stats, reason):
    with pytest.raises(MessageRejected, match=reason):
        validate(fedlog_upload(stats=stats), SCHEMA)


def test_a_wildcard_dimension_accepts_any_size():
    validate(fedlog_upload(stats=torch.zeros(4, 51, dtype=torch.float64)), SCHEMA)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.float16])
def test_a_wrong_dtype_is_rejected(dtype):
    with pytest.raises(MessageRejected, match=f"dtype {dtype}, expected torch.float64"):
        validate(fedlog_upload(stats=torch.zeros(4, 5, dtype=dtype)), SCHEMA)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values_are_rejected(bad):
    stats = torch.zeros(4, 5, dtype=torch.float64)
    stats[2, 3] = bad
    with pytest.raises(MessageRejected, match="1 non-finite value"):
        validate(fedlog_upload(stats=stats), SCHEMA)
    # and they survive the wire, so the receiver's validate sees them
    with pytest.raises(MessageRejected, match="non-finite"):
        validate(decode(encode(fedlog_upload(stats=stats))), SCHEMA)


def test_a_spec_may_allow_non_finite_values():
    stats = torch.full((4, 5), float("inf"), dtype=torch.float64)
    schema = {**SCHEMA, "stats": TensorSpec((4, None), torch.float64, finite=False)}
    validate(fedlog_upload(stats=stats), schema)


# --- construction ---------------------------------------------------------------------------

@pytest.mark.parametrize("fields", [
    {"strategy": "", "round": 0, "client_id": 0, "direction": "up"},
    {"strategy": "x", "round": -1, "client_id": 0, "direction": "up"},
    {"strategy": "x", "round": 0, "client_id": -2, "direction": "up"},
    {"strategy": "x", "round": 0, "client_id": 0, "direction": "sideways"},
    {"strategy": "x", "round": 1.5, "client_id": 0, "direction": "up"},
])
def test_an_invalid_header_cannot_be_built(fields):
    with pytest.raises(ConfigError, match="invalid message header"):
        Header(**fields)


def test_a_message_holds_only_named_tensors():
    with pytest.raises(ConfigError, match=r"not a torch\.Tensor"):
        Message(HEADER, {"stats": np.zeros(3)})  # type: ignore[dict-item]


def test_digest_depends_on_names_dtypes_shapes_and_values():
    base = {"a": torch.zeros(2, 2)}
    variants = [{"b": torch.zeros(2, 2)}, {"a": torch.zeros(2, 2, dtype=torch.float64)},
                {"a": torch.zeros(4)}, {"a": torch.eye(2)}]
    digests = {tensor_digest(v) for v in variants} | {tensor_digest(base)}
    assert len(digests) == 5
    assert tensor_digest(base) != tensor_digest(base, preamble="header")


# ---- hostile headers ----------------------------------------------------------------------
def safetensors_bytes_with_header(header: bytes) -> bytes:
    return len(header).to_bytes(8, "little") + header


@pytest.mark.parametrize("nested", [b"[" * 30000 + b"]" * 30000,
                                    b'{"a":' * 5000 + b"1" + b"}" * 5000,
                                    b'{"__metadata__": {"x": ' + b"[" * 20 + b"]" * 20 + b"}}"])
def test_a_deeply_nested_header_is_a_rejection_not_a_recursion_error(nested):
    with pytest.raises(MessageRejected, match=r"nests \d+ levels deep"):
        decode(safetensors_bytes_with_header(nested))


@pytest.mark.parametrize("depth", [3, 8, 9, 12])
@pytest.mark.parametrize(("start", "end"), [
    (b'{"__metadata__": {"x": ', b"}}"),  # in the metadata
    (b'{"t": {"dtype": ', b"}}"),  # in a tensor entry
    (b'{"t": {"shape": [', b"]}}"),  # in a shape
    (b'{"__metadata__": {"x": ', b"}}}"),  # not JSON (one brace too many)
    (b'[{"x": ', b"}]"),  # not an object
])
def test_a_small_headers_depth_is_judged_as_in_its_text(depth, start, end):
    # headers up to 4 KiB are parsed first and their text's brackets counted only when the
    # parsed object nests deeper than a safetensors header: the verdict and the depth it
    # reports are those of counting first, for JSON that parses and JSON that does not
    inner = depth - start.count(b"{") - start.count(b"[")
    header = start + b"[" * inner + b"]" * inner + end
    with pytest.raises(MessageRejected) as err:
        decode(safetensors_bytes_with_header(header))
    if depth > 8:
        assert f"nests {depth} levels deep" in err.value.reason
    else:
        assert "nests" not in err.value.reason


def test_brackets_inside_strings_do_not_count_as_nesting():
    metadata = {"bayesfl.note": "[" * 100 + '\\"{' * 50}
    data = safetensors_save({"x": torch.zeros(1)}, metadata=metadata)
    with pytest.raises(MessageRejected, match=r"lacks bayesfl\.format"):  # parsed, then refused
        decode(data)


def test_an_oversized_header_is_rejected_before_it_is_parsed(monkeypatch):
    import bayesfl.messages as messages
    monkeypatch.setattr(messages, "MAX_HEADER_BYTES", 1000)
    data = encode(Message(HEADER, {f"t{i:04d}": torch.zeros(1) for i in range(100)}))
    with pytest.raises(MessageRejected, match="exceeds the limit of 1000"):
        messages.decode(data)


# ---- authenticated messages ---------------------------------------------------------------
def forge_header(data: bytes, round: int, client_id: int) -> bytes:
    """The tensors of ``data`` under a rewritten header with a recomputed plain SHA-256, as
    anyone without a key can produce: the unauthenticated format accepts the result."""
    return encode(Message(Header("fedlog", round, client_id, "up"), safetensors_load(data)))


def test_without_a_key_a_rewritten_header_with_a_recomputed_digest_is_accepted():
    # the threat an HMAC removes: an old upload replayed as another round and client
    replayed = decode(forge_header(encode(fedlog_upload()), round=9, client_id=2))
    assert (replayed.header.round, replayed.header.client_id) == (9, 2)


def test_with_a_key_the_same_forgery_is_rejected():
    keys = KeyRing.generate()
    data = encode(fedlog_upload(), key=keys.client_key(7))
    assert_same_message(decode(data, key=keys.client_key(7)), fedlog_upload())
    with pytest.raises(MessageRejected, match="unauthenticated message"):
        decode(forge_header(data, round=9, client_id=2), key=keys.client_key(2))


def test_an_hmac_verifies_only_under_the_senders_key():
    keys = KeyRing.generate()
    data = encode(fedlog_upload(), key=keys.client_key(7))
    with pytest.raises(MessageRejected, match="authentication failed"):
        decode(data, key=keys.client_key(2))
    with pytest.raises(MessageRejected, match="authentication failed"):
        decode(data, key=KeyRing.generate().client_key(7))
    with pytest.raises(MessageRejected, match="has no key"):
        decode(data)


def test_an_authenticated_message_with_a_flipped_tensor_byte_is_rejected():
    key = KeyRing.generate().client_key(7)
    data = bytearray(encode(fedlog_upload(), key=key))
    data[-3] ^= 0x01
    with pytest.raises(MessageRejected, match="authentication failed"):
        decode(bytes(data), key=key)


def test_keys_are_distinct_per_client_and_the_server_and_short_keys_are_refused():
    keys = KeyRing(b"s" * 32)
    assert len({keys.client_key(0), keys.client_key(1), keys.server_key}) == 3
    assert KeyRing(b"s" * 32).client_key(5) == keys.client_key(5)  # derived, reproducible
    with pytest.raises(ConfigError, match="at least 16 bytes"):
        encode(fedlog_upload(), key=b"short")


# ---- the serializer and the parser of our own ---------------------------------------------
_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
           torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "model.w", "é", 'q"', "z\n", "B/1",
                                           "client/10/x", "\\"]),
                          st.sampled_from(_DTYPES),
                          st.lists(st.integers(0, 3), max_size=3)), max_size=8),
       st.sampled_from([None, {"k": "v"}, {"bayesfl.x": "é\t\x01"}]))
def test_safetensors_bytes_are_the_bytes_safetensors_writes(entries, metadata):
    from bayesfl.messages import safetensors_bytes

    tensors = {f"{name}{i}": (torch.randn(shape) * 3).to(dtype)
               for i, (name, dtype, shape) in enumerate(entries)}
    # byte for byte where safetensors' own output is deterministic (at most one metadata key:
    # it writes several in a per-process hash order)
    assert safetensors_bytes(tensors, metadata) == safetensors_save(tensors, metadata=metadata)


def test_safetensors_bytes_take_views_of_one_storage_and_non_contiguous_tensors():
    from bayesfl.messages import safetensors_bytes

    stacked = torch.randn(3, 4, 5)
    tensors = {"a": stacked[0], "b": stacked[1], "t": stacked[2].T}
    copies = {k: v.clone().contiguous() for k, v in tensors.items()}
    assert safetensors_bytes(tensors) == safetensors_save(copies)


def test_the_json_depth_of_a_header_is_the_inference_check_s():
    import re

    from inference.posterior_file import json_depth

    def reference(raw: bytes) -> int:  # the plain count: strings blanked, then a running sum
        codes = np.frombuffer(re.sub(rb'"(?:[^"\\]|\\.)*"', b'""', raw), dtype=np.uint8)
        steps = (np.isin(codes, (ord("["), ord("{"))).astype(np.int64)
                 - np.isin(codes, (ord("]"), ord("}"))))
        return int(np.cumsum(steps).max(initial=0))

    rng = np.random.default_rng(0)
    alphabet = np.frombuffer(b'[]{}"\\a:,\n', dtype=np.uint8)
    for size in [0, 1, 5, 40, 300, 2000] * 300:
        raw = alphabet[rng.integers(0, len(alphabet), size)].tobytes()
        assert json_depth(raw) == reference(raw), raw
    for depth in (100, 127, 128, 200, 255):  # deep, with fewer brackets than the numpy path
        assert json_depth(b"[" * depth + b"]" * depth) == depth
        assert json_depth(b"{" * depth) == depth


def _with_entry(data: bytes, name: str, entry: object) -> bytes:
    """``data`` with its safetensors header entry ``name`` replaced by ``entry``."""
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    header[name] = entry
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + data[8 + length:]


@pytest.mark.parametrize(("entry", "reason"), [
    ({"dtype": "F99", "shape": [4, 5], "data_offsets": [0, 160]}, "unknown dtype"),
    ({"dtype": "F64", "shape": [4, -5], "data_offsets": [0, 160]}, "not a list of sizes"),
    ({"dtype": "F64", "shape": [4, True], "data_offsets": [0, 160]}, "not a list of sizes"),
    ({"dtype": "F64", "shape": [4, 5], "data_offsets": [0, 80]}, "needs 160"),
    ({"dtype": "F64", "shape": [2, 5], "data_offsets": [0, 80]}, "start at"),
    ({"dtype": "F64", "shape": [4, 5], "data_offsets": [160, 0]}, "data_offsets"),
    ({"dtype": "F64", "shape": [4, 5], "data_offsets": [8, 168]}, "start at"),
    ({"dtype": "F64", "shape": [4, 5]}, "not an entry of"),
    ([1, 2], "not an entry of"),
])
def test_tensor_entries_that_do_not_tile_the_data_are_rejected(entry, reason):
    data = encode(fedlog_upload())
    with pytest.raises(MessageRejected, match=f"safetensors could not read it.*{reason}"):
        decode(_with_entry(data, "stats", entry))


def test_a_tensor_without_a_name_is_a_rejection_not_a_crash():
    # safetensors writes an empty name; a Message refuses one with ConfigError, which decode
    # raised to the receiver before: an upload must be rejected, never stop the server
    tensors = {"": torch.zeros(2)}
    metadata = {"bayesfl.format": "bayesfl-message", "bayesfl.schema_version": "1",
                "bayesfl.strategy": "fedlog", "bayesfl.round": "1", "bayesfl.client_id": "3",
                "bayesfl.direction": "up",
                "bayesfl.sha256": tensor_digest(tensors, '["fedlog", 1, 3, "up", 1]')}
    with pytest.raises(MessageRejected, match="a tensor without a name"):
        decode(safetensors_save(tensors, metadata=metadata))


def test_bytes_after_the_last_tensor_are_rejected():
    with pytest.raises(MessageRejected, match="safetensors could not read it"):
        decode(encode(fedlog_upload()) + b"\0" * 8)


def test_decoded_tensors_own_writable_memory():
    data = encode(fedlog_upload())
    message = decode(data)
    message.tensors["stats"] += 1  # no warning, no effect on the bytes or another decode
    assert torch.equal(decode(data).tensors["stats"], fedlog_upload().tensors["stats"])


def _first_problem(msg: Message, schema, **expected) -> str | None:
    """validate's documented order, one message at a time (the reference validate_many's
    batched finiteness must agree with)."""
    for name, want in expected.items():
        if want is not None and getattr(msg.header, name) != want:
            return f"wrong header: {name}"
    if set(schema) - set(msg.tensors):
        return "missing tensors"
    if set(msg.tensors) - set(schema):
        return "unexpected tensors"
    for name in sorted(schema):
        tensor, spec = msg.tensors[name], schema[name]
        if tensor.dtype != spec.dtype:
            return f"tensor {name!r} has dtype"
        if not spec.matches_shape(tuple(tensor.shape)):
            return f"tensor {name!r} has shape"
        if spec.finite and tensor.is_floating_point():
            bad = int((~torch.isfinite(tensor)).sum())
            if bad:
                return f"tensor {name!r} has {bad} non-finite"
    return None


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["ok", "nan_stats", "inf_counts_dtype", "shape",
                                           "nan_and_late_shape", "missing", "extra", "round",
                                           "sender"]),
                          st.integers(1, 5)), min_size=1, max_size=12))
def test_validate_many_gives_each_message_its_first_problem(kinds):
    from bayesfl.messages import validate_many

    schema = {"a_stats": TensorSpec((4, None), torch.float64),
              "b_counts": TensorSpec((4,), torch.float32),
              "c_num": TensorSpec((), torch.int64)}
    messages, ids = [], []
    for kind, n in kinds:
        tensors = {"a_stats": torch.ones(4, n, dtype=torch.float64),
                   "b_counts": torch.ones(4), "c_num": torch.tensor(6)}
        header = HEADER
        if kind == "nan_stats":
            tensors["a_stats"][0, : min(n, 2)] = float("nan")
        elif kind == "inf_counts_dtype":
            tensors["b_counts"][1] = float("inf")
            tensors["c_num"] = torch.tensor(6.0)
        elif kind == "shape":
            tensors["b_counts"] = torch.ones(3)
        elif kind == "nan_and_late_shape":
            tensors["a_stats"][1, 0] = float("inf")
            tensors["c_num"] = torch.tensor([6])
        elif kind == "missing":
            del tensors["b_counts"]
        elif kind == "extra":
            tensors["z"] = torch.ones(1)
        elif kind == "round":
            header = Header("fedlog", 4, 7, "up")
        messages.append(Message(header, tensors))
        ids.append(8 if kind == "sender" else 7)
    got = validate_many(messages, schema, strategy="fedlog", round=3, direction="up",
                        client_ids=ids)
    for message, cid, reason in zip(messages, ids, got, strict=True):
        want = _first_problem(message, schema, strategy="fedlog", round=3, direction="up",
                              client_id=cid)
        assert (reason is None) == (want is None) and (want is None or reason.startswith(want))


# ---- a round's uploads: one layout, many senders ---------------------------------------------
SENDERS = [7, -1, 0, 10, 123456789012, 7]


@pytest.mark.parametrize("authenticated", [False, True])
def test_uploads_of_one_layout_are_the_bytes_their_metadata_makes(authenticated):
    # encode fills one header layout in with each sender's id and digest: the bytes must be
    # those the safetensors builder writes for the message's metadata, sender after sender
    from bayesfl.messages import read_safetensors_metadata, safetensors_bytes

    ring = KeyRing.generate()
    for sender in SENDERS:
        key = ring.client_key(sender) if authenticated else None
        message = Message(Header("fedlog", 3, sender, "up"), fedlog_upload().tensors)
        data = encode(message, key=key)
        metadata = read_safetensors_metadata(data)
        assert metadata["bayesfl.client_id"] == str(sender)
        assert data == safetensors_bytes(message.tensors, metadata)
        assert_same_message(decode(data, key=key), message)


def test_a_known_header_from_another_sender_is_read_with_that_senders_id_and_values():
    # the second and later uploads of a layout are read from the first one's parse: each must
    # still come back with its own sender, values and digest check
    messages = [Message(Header("fedlog", 4, sender, "up"),
                        fedlog_upload(stats=torch.full((4, 5), float(i))).tensors)
                for i, sender in enumerate(SENDERS)]
    for message in messages:
        assert_same_message(decode(encode(message)), message)
    forged = encode(messages[1]).replace(b'"bayesfl.client_id":"-1"',
                                         b'"bayesfl.client_id":"99"')
    with pytest.raises(MessageRejected, match="digest mismatch"):
        decode(forged)  # another sender's id without its digest
    flipped = bytearray(encode(messages[2]))
    flipped[-1] ^= 0x01
    with pytest.raises(MessageRejected, match="digest mismatch"):
        decode(bytes(flipped))


def test_a_known_header_with_other_data_sizes_or_a_second_id_is_read_in_full():
    data = encode(fedlog_upload())
    decode(data)
    with pytest.raises(MessageRejected, match=r"hold .* bytes of the"):
        decode(data + b"\x00" * 8)  # the known header, data that do not fit it
    # the same header but for a second client id: not the known one (read in full, where the
    # JSON's last value wins and the digest, bound to id 7, does not verify)
    twice = _with_header(data, lambda text: text.replace(
        b'"bayesfl.client_id":"7"', b'"bayesfl.client_id":"7","bayesfl.client_id":"8"'))
    with pytest.raises(MessageRejected, match="digest mismatch"):
        decode(twice)


def _with_header(data: bytes, edit) -> bytes:
    """``data`` with its header's JSON text edited by ``edit`` (length and padding redone)."""
    end = 8 + int.from_bytes(data[:8], "little")
    header = edit(data[8:end].rstrip(b" "))
    header += b" " * (-len(header) % 8)
    return len(header).to_bytes(8, "little") + header + data[end:]


def test_the_header_caches_stay_bounded_over_many_rounds():
    # one layout per round: a long run must not grow them (each keeps its newest 64)
    import bayesfl.messages as messages

    for r in range(3 * messages._KNOWN_HEADERS_MAX):
        message = Message(Header("fedlog", r, 1, "up"), {"a": torch.full((2,), float(r))})
        assert_same_message(decode(encode(message)), message)
    assert len(messages._ENCODE_TEMPLATES) <= messages._KNOWN_HEADERS_MAX
    assert len(messages._KNOWN_HEADERS) <= messages._KNOWN_HEADERS_MAX
