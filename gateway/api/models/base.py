"""What every request model shares: the base Struct, JSON integers, and decoding a parsed body
into a model with each failure a 400 that names the field's path.

Decoding is msgspec's `convert` in strict mode ("5" is never 5) from the body the gateway has
already parsed (api/json_body.py, off the event loop for large bodies). JSON has one number
type, so an integer field also takes an integral float (5.0 is 5, 1e20 is 10**20, as JSON Schema
and OpenAI's API take it): `integer()` declares such a field with its range, and the models'
`__post_init__` normalizes and bounds it (strict mode refuses 5.0, lax mode takes "5").
"""

from __future__ import annotations

import functools
import re
import types
import typing
from typing import Annotated, Any, Literal, Union

import msgspec
from msgspec import Meta

from switchyard.gateway.errors import APIError, invalid, invalid_type, out_of_range


class FieldError(ValueError):
    """A model's own check failed (raised in `__post_init__`; msgspec adds the struct's path).
    `field`: the member it names ("" for the struct itself); `text` follows the field's name."""

    def __init__(self, field: str, text: str, code: str = "invalid_value") -> None:
        super().__init__(text)
        self.field = field
        self.text = text
        self.code = code


class IntRange:
    """The bounds of an `integer()` field (Annotated metadata; msgspec ignores it)."""

    __slots__ = ("lo", "hi")

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


class Model(msgspec.Struct, kw_only=True):
    """A request model: unknown members are ignored (clients change faster than servers), an
    optional member given as null is absent."""

    def __post_init__(self) -> None:
        for name, bounds in _integer_fields(type(self)):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or bounds.lo is not None
                                      or bounds.hi is not None):
                setattr(self, name, bounds.check(value, name))


@functools.cache
def _integer_fields(cls: type) -> tuple[tuple[str, IntRange], ...]:
    hints = typing.get_type_hints(cls, include_extras=True)
    found = []
    for name in cls.__struct_fields__:
        for option in _options(hints[name]):
            bounds = next((m for m in getattr(option, "__metadata__", ())
                           if isinstance(m, IntRange)), None)
            if bounds is not None:
                found.append((name, bounds))
    return tuple(found)


def _options(tp: Any) -> tuple[Any, ...]:
    """The members of a union (a type alone: itself)."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        return typing.get_args(tp)
    return (tp,)


def known_fields(model: type[msgspec.Struct]) -> frozenset[str]:
    return frozenset(model.__struct_fields__)


# --- decoding ------------------------------------------------------------------------------------


def decode(body: Any, model: Any) -> Any:
    """`body` (parsed JSON) as `model`, or the 400 naming the first field that does not fit."""
    try:
        return msgspec.convert(body, model, strict=True)
    except msgspec.ValidationError as exc:
        raise api_error(exc, model, body) from None


_AT = re.compile(r" - at `\$(.*)`$", re.S)
_STEP = re.compile(r"\.([^.\[]+)|\[(\d+)\]")
_WRONG_TYPE = re.compile(r"Expected `([^`]+)`, got `([^`]+)`$")
_BOUND = re.compile(r"Expected `([^`]+)` (.+)$")
_TYPE_WORDS = {"int": "an integer", "float": "a number", "str": "a string", "bool": "a boolean",
               "array": "an array", "object": "an object"}


def api_error(exc: msgspec.ValidationError, model: Any, body: Any) -> APIError:
    text = str(exc)
    at = _AT.search(text)
    path = at.group(1) if at else ""
    text = text[:at.start()] if at else text
    param = path.lstrip(".")
    cause = exc.__cause__
    if isinstance(cause, FieldError):
        param = _join(param, cause.field)
        return invalid(f"'{param}' {cause.text}", param=param, code=cause.code)
    if text.startswith("Object missing required field `"):
        param = _join(param, text.split("`")[1])
        return invalid(f"'{param}' is required", param=param, code="missing_required_parameter")
    if match := _WRONG_TYPE.match(text):
        return invalid_type(param, _describe(match.group(1)))
    if match := _BOUND.match(text):
        return out_of_range(param, _bound_words(match.group(1), match.group(2)))
    if text.startswith(("Invalid value", "Invalid enum value")):
        allowed = allowed_values(model, body, _steps(path))
        if allowed:
            words = [repr(v) for v in allowed]
            listed = words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]
            given = text.split(" value ", 1)[-1]
            return invalid(f"'{param}' must be {listed}; {given} is not supported",
                           param=param, code="invalid_value")
    return invalid(f"'{param}': {text}", param=param or None, code="invalid_value")


def _bound_words(kind: str, bound: str) -> str:
    """msgspec's "of length >= 1" and the like, as the API's errors say it."""
    if bound.startswith("matching regex "):
        return "a string matching " + bound.removeprefix("matching regex ")
    if not bound.startswith("of length "):
        return bound
    op, _, size = bound.removeprefix("of length ").partition(" ")
    noun = "a string" if kind == "str" else "an array"
    if op == ">=" and size == "1":
        return f"a non-empty {noun.split()[-1]}"
    unit = "characters" if kind == "str" else "items"
    return f"{noun} of {'at least' if op == '>=' else 'at most'} {size} {unit}"


def _join(path: str, field: str) -> str:
    return f"{path}.{field}" if path and field else path or field


def _describe(expected: str) -> str:
    names = [n for n in expected.split(" | ") if n != "null"]
    if "int" in names:  # an integer() field: int | float
        names = [n for n in names if n != "float"]
    words = [_TYPE_WORDS.get(n, n) for n in names]
    return " or ".join(words) if words else "null"


def _steps(path: str) -> list[str | int]:
    return [name if name else int(index) for name, index in _STEP.findall(path)]


def _strip(tp: Any) -> Any:
    while typing.get_origin(tp) is Annotated:
        tp = typing.get_args(tp)[0]
    return tp


def allowed_values(model: Any, body: Any, steps: list[str | int]) -> list[Any]:
    """The values the field at `steps` may take: a union's tags or a Literal's values (the
    union's member is picked by the body's own tag on the way)."""
    tp, value = model, body
    for i, step in enumerate(steps):
        options = [_strip(o) for o in _options(_strip(tp)) if o is not type(None)]
        structs = [o for o in options if isinstance(o, type) and issubclass(o, msgspec.Struct)]
        if isinstance(step, str):
            tag_field = structs[0].__struct_config__.tag_field if structs else None
            if step == tag_field and i == len(steps) - 1:
                return [s.__struct_config__.tag for s in structs]
            struct = next((s for s in structs if tag_field is None or not isinstance(value, dict)
                           or value.get(tag_field) == s.__struct_config__.tag), None)
            if struct is None:
                return []
            tp = typing.get_type_hints(struct, include_extras=True).get(step)
            value = value.get(step) if isinstance(value, dict) else None
        else:
            lists = [o for o in options if typing.get_origin(o) is list]
            if not lists:
                return []
            tp = typing.get_args(lists[0])[0]
            value = value[step] if isinstance(value, list) and step < len(value) else None
    literals = [o for o in _options(_strip(tp)) if typing.get_origin(_strip(o)) is Literal]
    return [v for o in literals for v in typing.get_args(_strip(o))]
