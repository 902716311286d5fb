"""What every request model shares: the base Struct and the checks msgspec does not make
(decoding.py turns a parsed body into a model).

Decoding is msgspec's `convert` in strict mode ("5" is never 5) from the body the gateway has
already parsed (api/json_body.py, off the event loop for large bodies). JSON has one number
type, so an integer field also takes an integral float (5.0 is 5, 1e20 is 10**20, as JSON Schema
and OpenAI's API take it): `integer()` declares such a field with its range, and the models'
`__post_init__` normalizes and bounds it (strict mode refuses 5.0; lax mode would take "5").
"""

from __future__ import annotations

import functools
import types
import typing
from typing import Annotated, Any, Union

import msgspec
from msgspec import Meta


class FieldError(ValueError):
    """A model's own check failed (raised in `__post_init__`; msgspec adds the struct's path).
    `field`: the member it names ("" for the struct itself); `text` follows the field's name."""

    def __init__(self, field: str, text: str, code: str = "invalid_value") -> None:
        super().__init__(text)
        self.field = field
        self.text = text
        self.code = code


class FieldCheck:
    """Annotated metadata (which msgspec ignores) that checks a decoded member and may
    normalize it: `Checked` models call `check(value, field)` and keep what it returns."""

    def check(self, value: Any, field: str) -> Any:
        raise NotImplementedError


class IntRange(FieldCheck):
    """The bounds of an `integer()` field."""

    def __init__(self, lo: int | None, hi: int | None) -> None:
        self.lo, self.hi = lo, hi

    def check(self, value: int | float, field: str) -> int:
        if isinstance(value, float):
            if not value.is_integer():
                raise FieldError(field, "must be an integer", "invalid_type")
            value = int(value)
        if (self.lo is not None and value < self.lo) or (self.hi is not None and value > self.hi):
            raise FieldError(field, f"must be {self.text()}")
        return value

    def text(self) -> str:
        if self.lo is not None and self.lo == self.hi:
            return str(self.lo)
        if self.lo is not None and self.hi is not None:
            return f"between {self.lo} and {self.hi}"
        return f">= {self.lo}" if self.lo is not None else f"<= {self.hi}"


def integer(lo: int | None = None, hi: int | None = None, description: str | None = None
            ) -> Any:
    """An integer field within [lo, hi], given as a JSON integer or an integral number."""
    schema: dict[str, Any] = {"type": "integer"}
    if lo is not None:
        schema["minimum"] = lo
    if hi is not None:
        schema["maximum"] = hi
    return Annotated[int | float, Meta(extra_json_schema=schema, description=description),
                     IntRange(lo, hi)]


class Unsupported(FieldCheck):
    """A field this server does not support beyond the values in `allowed`: any other value
    is a 400 `unsupported_parameter`."""

    def __init__(self, allowed: tuple[Any, ...], text: str) -> None:
        self.allowed = allowed
        self.text = text

    def check(self, value: Any, field: str) -> Any:
        if not any(value == a and type(value) is type(a) for a in self.allowed):
            raise FieldError(field, self.text, "unsupported_parameter")
        return value


def unsupported(*allowed: Any, text: str = "is not supported by this server") -> Any:
    """A field that may only be absent, null or one of `allowed`."""
    return Annotated[Any, Meta(extra_json_schema={"enum": [*allowed, None]}),
                     Unsupported(allowed, text)]


class Whole:
    """A failure inside this member is reported as the member's own ("'stop' must be a string
    or an array of strings"), as each API always named it: a failure of one of its items
    (`scope` "items"), of its shape (a member missing, a tag or value not among those allowed:
    "shape"; a member of the wrong type still names itself), or any failure inside it
    ("all")."""

    def __init__(self, expected: str, scope: str = "items") -> None:
        self.expected = expected
        self.scope = scope


class Model(msgspec.Struct, kw_only=True):
    """A request model: unknown members are ignored (clients change faster than servers), an
    optional member given as null is absent. `schema_rules` adds to the published schema what
    msgspec cannot state (wire/schema.py)."""

    @classmethod
    def schema_rules(cls, schema: Any) -> dict[str, Any]:
        """What the published schema adds to msgspec's for this model, given the `Schema`
        being made (wire/schema.py says which keys it takes)."""
        return {}


class Checked(Model, kw_only=True):
    """A model with `FieldCheck` members (`integer()`, `unsupported()`, ...), checked after
    decoding (only such models pay for a `__post_init__`: a request has thousands of content
    blocks)."""

    def __post_init__(self) -> None:
        for name, check in checked_fields(type(self)):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, check.check(value, name))


def marker(tp: Any, kind: type) -> Any:
    """The Annotated metadata of class `kind` on `tp` (or on a member of its union)."""
    for option in (tp, *members(tp)):
        found = next((m for m in getattr(option, "__metadata__", ()) if isinstance(m, kind)),
                     None)
        if found is not None:
            return found
    return None


@functools.cache
def hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=True)


@functools.cache
def checked_fields(cls: type) -> tuple[tuple[str, Any], ...]:
    found = []
    for name in cls.__struct_fields__:
        check = marker(hints(cls)[name], FieldCheck)
        if check is not None:
            found.append((name, check))
    return tuple(found)


def members(tp: Any) -> tuple[Any, ...]:
    """The members of a union (a type alone: itself)."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        return typing.get_args(tp)
    return (tp,)


def known_fields(model: type[msgspec.Struct]) -> frozenset[str]:
    return frozenset(model.__struct_fields__)
