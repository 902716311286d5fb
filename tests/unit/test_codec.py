"""Round-trip every protocol message through the codec; reject what is not a message."""

import enum
import typing

import msgpack
import msgspec
import pytest

from switchyard.proto import codec
from switchyard.proto.gateway_scheduler import CancelRequest, SubmitRequest
from switchyard.proto.scheduler_kvstore import PageWrite, WritePages
from switchyard.proto.values import SamplingParams
from switchyard.proto.codec import MESSAGE_TYPES
from switchyard.proto.page_flags import PageFlags
from switchyard.proto.tokens import TokenIds


def _sample(annotation):
    """A non-default value of the given annotation, so a round trip proves each field travels."""
    if isinstance(annotation, type) and issubclass(annotation, msgspec.Struct):
        return _instance(annotation)
    if isinstance(annotation, type) and issubclass(annotation, enum.IntFlag):
        return annotation(max(annotation))  # its highest bit: nonzero, so not the default
    if annotation is TokenIds:
        return TokenIds([7, 0, 2**32 - 1])
    origin = typing.get_origin(annotation)
    if origin is tuple:
        (inner, *_rest) = typing.get_args(annotation)
        return (_sample(inner), _sample(inner))
    return {int: 7, float: 0.25, str: "x", bool: True, bytes: b"\x00\xff"}[annotation]


def _instance(cls):
    hints = typing.get_type_hints(cls)
    return cls(**{name: _sample(hints[name]) for name in cls.__struct_fields__})


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda c: c.kind)
def test_every_message_round_trips(cls):
    msg = _instance(cls)
    assert codec.decode(codec.encode(msg)) == msg


def test_page_flags_travel_typed_and_as_the_same_int():
    write = PageWrite(b"\x01" * 16, bytes(16), (1, 2), 0, 8, PageFlags.RECURRENT_STATE)
    frame = codec.encode(WritePages((write,)))
    assert msgpack.unpackb(frame)["writes"][0]["flags"] == 1
    assert codec.decode(frame).writes[0].flags is PageFlags.RECURRENT_STATE


def test_kinds_are_unique():
    kinds = [cls.kind for cls in MESSAGE_TYPES]
    assert len(kinds) == len(set(kinds))


def test_unknown_kind_is_rejected():
    with pytest.raises(codec.ProtocolError, match="kind"):
        codec.decode(msgpack.packb({"kind": "os.system", "cmd": "rm"}))


def test_unknown_field_is_rejected():
    frame = msgpack.packb({"kind": "cancel_request", "rid": "a", "extra": 1})
    with pytest.raises(codec.ProtocolError, match="unknown field"):
        codec.decode(frame)


def test_unknown_field_of_a_nested_value_is_rejected():
    frame = msgpack.packb({"kind": "submit_request", "rid": "a",
                           "prompt_token_ids": msgpack.ExtType(codec.TOKEN_IDS_EXT, b""),
                           "max_tokens": 1, "sampling": {"temperature": 0.0, "typo": 1}})
    with pytest.raises(codec.ProtocolError, match="unknown field"):
        codec.decode(frame)


def test_missing_field_is_rejected():
    with pytest.raises(codec.ProtocolError):
        codec.decode(msgpack.packb({"kind": "cancel_request"}))


def test_wrong_type_is_rejected():
    with pytest.raises(codec.ProtocolError):
        codec.decode(msgpack.packb({"kind": "cancel_request", "rid": 7}))


def test_token_ids_travel_packed_and_nothing_else_passes_for_them():
    submit = SubmitRequest("r", [1, 2, 70000], 4, SamplingParams())
    assert isinstance(submit.prompt_token_ids, TokenIds)  # a list is packed when built
    raw = msgpack.unpackb(codec.encode(submit))
    packed = raw["prompt_token_ids"]
    assert isinstance(packed, msgpack.ExtType) and packed.code == codec.TOKEN_IDS_EXT
    assert len(packed.data) == 12
    assert codec.decode(codec.encode(submit)).prompt_token_ids == (1, 2, 70000)
    bad_values = ([1, 2, 3],  # an int array (protocol 1)
                  packed.data,  # bytes without the ext type
                  msgpack.ExtType(codec.TOKEN_IDS_EXT, b"\x00\x01\x02"),  # a partial uint32
                  msgpack.ExtType(9, packed.data))  # an unknown ext type
    for bad in bad_values:
        raw["prompt_token_ids"] = bad
        with pytest.raises(codec.ProtocolError):
            codec.decode(msgpack.packb(raw))
    raw["rid"] = packed  # token ids where a string belongs
    raw["prompt_token_ids"] = packed
    with pytest.raises(codec.ProtocolError, match="rid"):
        codec.decode(msgpack.packb(raw))


def test_garbage_is_rejected():
    with pytest.raises(codec.ProtocolError):
        codec.decode(b"\xc1\xc1\xc1")
    with pytest.raises(codec.ProtocolError):
        codec.decode(msgpack.packb([1, 2, 3]))


def test_non_message_cannot_be_encoded():
    with pytest.raises(codec.ProtocolError):
        codec.encode(SamplingParams())


def test_messages_are_frozen():
    msg = CancelRequest("a")
    with pytest.raises(AttributeError):
        msg.rid = "b"
