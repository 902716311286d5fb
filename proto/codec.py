"""msgpack codec for `proto.messages`: explicit tags in, frozen dataclasses out.

A message is packed as a map `{"kind": tag, field: value, ...}`. Nested value types
(`SamplingParams`, `PrefillChunk`, ...) are packed as plain maps and rebuilt from the field's
type annotation. No pickle and no class-name lookup: only the types in `MESSAGE_TYPES` decode.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable
from typing import Any

import msgpack

from proto.messages import MESSAGE_TYPES


class ProtocolError(ValueError):
    """A frame that is not a valid message of this protocol version."""


def _to_wire(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _to_wire(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [_to_wire(v) for v in value]
    return value


def _decoder_for(annotation: Any) -> Callable[[Any], Any]:
    """Build a function that turns the wire form of `annotation` back into its Python type."""
    origin = typing.get_origin(annotation)
    if dataclasses.is_dataclass(annotation):
        return _dataclass_decoder(annotation)
    if origin is tuple:
        args = typing.get_args(annotation)
        inner = _decoder_for(args[0]) if args else (lambda v: v)
        return lambda v: tuple(inner(x) for x in v)
    return lambda v: v


def _dataclass_decoder(cls: type) -> Callable[[Any], Any]:
    hints = typing.get_type_hints(cls)
    field_decoders = {
        f.name: _decoder_for(hints[f.name]) for f in dataclasses.fields(cls) if f.init
    }

    def decode(raw: Any) -> Any:
        if not isinstance(raw, dict):
            raise ProtocolError(f"{cls.__name__}: expected a map, got {type(raw).__name__}")
        unknown = set(raw) - set(field_decoders) - {"kind"}
        if unknown:
            raise ProtocolError(f"{cls.__name__}: unknown fields {sorted(unknown)}")
        try:
            return cls(**{k: field_decoders[k](v) for k, v in raw.items() if k != "kind"})
        except TypeError as exc:  # missing required fields
            raise ProtocolError(f"{cls.__name__}: {exc}") from None

    return decode


_DECODERS: dict[str, Callable[[Any], Any]] = {}
for _cls in MESSAGE_TYPES:
    if _cls.kind in _DECODERS:
        raise RuntimeError(f"duplicate message kind {_cls.kind!r}")
    _DECODERS[_cls.kind] = _dataclass_decoder(_cls)


def encode(message: Any) -> bytes:
    kind = getattr(type(message), "kind", None)
    if kind not in _DECODERS:
        raise ProtocolError(f"not a protocol message: {type(message).__name__}")
    wire = _to_wire(message)
    wire["kind"] = kind
    return msgpack.packb(wire, use_bin_type=True)


def decode(frame: bytes) -> Any:
    try:
        raw = msgpack.unpackb(frame, raw=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"undecodable frame: {exc}") from None
    if not isinstance(raw, dict) or "kind" not in raw:
        raise ProtocolError("frame is not a tagged message")
    decoder = _DECODERS.get(raw["kind"])
    if decoder is None:
        raise ProtocolError(f"unknown message kind {raw['kind']!r}")
    return decoder(raw)
