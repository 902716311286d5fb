"""Round-trip every protocol message through msgpack; reject what is not a message."""

import dataclasses
import typing

import msgpack
import pytest

from proto import codec, messages
from proto.messages import MESSAGE_TYPES


def _sample(annotation):
    """A non-default value of the given annotation, so a round trip proves each field travels."""
    if dataclasses.is_dataclass(annotation):
        return _instance(annotation)
    origin = typing.get_origin(annotation)
    if origin is tuple:
        (inner, *_rest) = typing.get_args(annotation)
        return (_sample(inner), _sample(inner))
    return {int: 7, float: 0.25, str: "x", bool: True, bytes: b"\x00\xff"}[annotation]


def _instance(cls):
    hints = typing.get_type_hints(cls)
    return cls(**{f.name: _sample(hints[f.name]) for f in dataclasses.fields(cls)})


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda c: c.kind)
def test_every_message_round_trips(cls):
    msg = _instance(cls)
    assert codec.decode(codec.encode(msg)) == msg


def test_kinds_are_unique():
    kinds = [cls.kind for cls in MESSAGE_TYPES]
    assert len(kinds) == len(set(kinds))


def test_unknown_kind_is_rejected():
    with pytest.raises(codec.ProtocolError, match="unknown message kind"):
        codec.decode(msgpack.packb({"kind": "os.system", "cmd": "rm"}))


def test_unknown_field_is_rejected():
    frame = msgpack.packb({"kind": "cancel_request", "rid": "a", "extra": 1})
    with pytest.raises(codec.ProtocolError, match="unknown fields"):
        codec.decode(frame)


def test_missing_field_is_rejected():
    with pytest.raises(codec.ProtocolError):
        codec.decode(msgpack.packb({"kind": "cancel_request"}))


def test_garbage_is_rejected():
    with pytest.raises(codec.ProtocolError):
        codec.decode(b"\xc1\xc1\xc1")
    with pytest.raises(codec.ProtocolError):
        codec.decode(msgpack.packb([1, 2, 3]))


def test_non_message_cannot_be_encoded():
    with pytest.raises(codec.ProtocolError):
        codec.encode(messages.SamplingParams())
