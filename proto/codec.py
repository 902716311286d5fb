"""msgpack codec for the protocol's messages, compiled by msgspec: tagged structs in and out.

A message is a msgpack map `{"kind": tag, field: value, ...}`, decoded against the union of
`MESSAGE_TYPES` only: an unknown kind, an unknown or missing field, or a value of the wrong
type is a `ProtocolError`. No pickle and no class-name lookup. `TokenIds` travel as one msgpack
`ext` value (type `TOKEN_IDS_EXT`) of packed uint32s: sent from the array without a copy and
copied once out of the frame (docs/design.md "Protocol").
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from switchyard.proto import base, gateway_scheduler, scheduler_kvstore, scheduler_worker
from switchyard.proto.base import Message
from switchyard.proto.tokens import TokenIds


class ProtocolError(ValueError):
    """A frame that is not a valid message of this protocol version."""


# msgpack ext type of a `TokenIds`: its ids as native uint32 (the wire never leaves the machine).
TOKEN_IDS_EXT = 1


def _enc_hook(value: Any) -> Any:
    if isinstance(value, TokenIds):
        return msgspec.msgpack.Ext(TOKEN_IDS_EXT, value.view())
    raise NotImplementedError(f"{type(value).__name__} cannot travel in a message")


def _ext_hook(code: int, data: memoryview) -> Any:
    if code != TOKEN_IDS_EXT:
        raise ValueError(f"unknown msgpack ext type {code}")
    return TokenIds.frombytes(data)  # a copy: `data` points into the frame


def _dec_hook(kind: type, value: Any) -> Any:
    if kind is TokenIds:
        if not isinstance(value, TokenIds):
            raise TypeError(f"token ids must be packed (ext {TOKEN_IDS_EXT}), "
                            f"got {type(value).__name__}")
        return value
    raise NotImplementedError(f"{kind.__name__} is not a protocol type")


# Every direction's messages: the union a frame is decoded against.
MESSAGE_TYPES: tuple[type[Message], ...] = (
    base.MESSAGES + gateway_scheduler.MESSAGES + scheduler_worker.MESSAGES
    + scheduler_kvstore.MESSAGES)

_kinds = [cls.kind for cls in MESSAGE_TYPES]
if len(_kinds) != len(set(_kinds)):
    raise RuntimeError("duplicate message kinds")

_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_decoder = msgspec.msgpack.Decoder(Union[MESSAGE_TYPES], dec_hook=_dec_hook,  # noqa: UP007
                                   ext_hook=_ext_hook)


def encode(message: Message) -> bytes:
    if type(message) not in MESSAGE_TYPES:
        raise ProtocolError(f"not a protocol message: {type(message).__name__}")
    try:
        return _encoder.encode(message)
    except (TypeError, NotImplementedError, OverflowError) as exc:
        raise ProtocolError(f"{message.kind}: cannot encode: {exc}") from None


def decode(frame: bytes) -> Message:
    try:
        return _decoder.decode(frame)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"invalid message: {exc}") from None
    except (msgspec.DecodeError, ValueError) as exc:  # ValueError: from `_ext_hook`
        raise ProtocolError(f"undecodable frame: {exc}") from None
