"""A parsed body as a request model, and a body that does not fit as a 400 in the API's terms:
msgspec's message ("Expected `int`, got `str` - at `$.messages[0].content`") becomes the
gateway's ("'messages[0].content' must be an integer", param `messages[0].content`).

Clients change faster than servers: a top-level field this server does not know is accepted
and logged once per name (`note_ignored`; the names seen are bounded, so junk keys cannot grow
memory)."""

from __future__ import annotations

import re
import threading
import typing
from collections.abc import Iterator
from typing import Annotated, Any, Literal

import msgspec
import structlog

from switchyard.gateway.request.wire.base import (FieldError, Whole, hints, known_fields, marker,
                                                  members)
from switchyard.gateway.errors import APIError, invalid, invalid_type, out_of_range

# msgspec ends its message with where the failure is: " - at `$.messages[0].role`", or " - at
# `key` in `$.logit_bias`" for a map's key. It builds that path from the model's member names
# and the body's list indices, never from a value, but the message before it may echo the
# value ("Invalid enum value 'x - at `$.a[9]`'"). So the path is read only at the very end and
# only in that grammar (names, indices of at most 9 digits, a map's value "[...]"), then found
# in the body step by step: text a client wrote never chooses the member a 400 names.
_NAME, _INDEX = r"[A-Za-z_][A-Za-z0-9_]*", r"[0-9]{1,9}|\.\.\."
_STEP = re.compile(rf"\.({_NAME})|\[({_INDEX})\]")
_AT = re.compile(rf" - at (`key` in )?`\$((?:\.{_NAME}|\[(?:{_INDEX})\])*)`\Z")
MAX_ECHO_CHARS = 200  # of msgspec's own words, in a 400 no other rule phrases
_WRONG_TYPE = re.compile(r"Expected `([^`]+)`, got `([^`]+)`$")
_BOUND = re.compile(r"Expected `([^`]+)` (.+)$")
_TYPE_WORDS = {"int": "an integer", "float": "a number", "str": "a string", "bool": "a boolean",
               "array": "an array", "object": "an object"}

log = structlog.get_logger()

MAX_NOTED_NAMES = 256
_noted: set[str] = set()
_noted_lock = threading.Lock()


def note_ignored(name: str) -> None:
    """Log `request.field_ignored` the first time `name` is seen."""
    name = "".join(c if c.isprintable() else "?" for c in name[:80])
    with _noted_lock:
        if name in _noted or len(_noted) >= MAX_NOTED_NAMES:
            return
        _noted.add(name)
    log.info("request.field_ignored", field=name)


def decode_body(body: dict[str, Any], model: type[msgspec.Struct], api: str) -> Any:
    """`body` as the API's request `model` (or the 400 naming the field that does not fit),
    its top-level fields that `model` does not know noted as ignored."""
    known = known_fields(model)
    for key in body:
        if key not in known:
            note_ignored(f"{api}.{key}")
    return decode(body, model)


def decode(value: Any, model: Any, param: str = "") -> Any:
    """`value` (parsed JSON; at `param` in the body) as `model`, or the 400 naming the first
    field that does not fit."""
    try:
        return msgspec.convert(value, model, strict=True)
    except msgspec.ValidationError as exc:
        raise api_error(exc, model, value, param) from None


def api_error(exc: msgspec.ValidationError, model: Any, body: Any, prefix: str = ""
              ) -> APIError:
    text = str(exc)
    at = _AT.search(text)
    steps = _steps(at.group(2)) if at else []
    if at and _in_body(body, steps):
        steps += ["[key]"] if at.group(1) else []
    else:
        steps = []  # no path msgspec could have written: the failure names no member
    text = text[:at.start()] if at else text
    cause = exc.__cause__
    missing = text.startswith("Object missing required field `")
    if missing:
        steps.append(text.split("`")[1])
    elif isinstance(cause, FieldError) and cause.field:
        steps.append(cause.field)
    trail = list(_trail(model, body, steps))
    whole = _whole(model, steps, trail, missing or text.startswith("Invalid"), missing, prefix)
    if whole is not None:
        return whole
    param = _param(prefix, steps)
    if isinstance(cause, FieldError):
        return invalid(f"'{param}' {cause.text}", param=param, code=cause.code)
    if missing:
        return invalid(f"'{param}' is required", param=param, code="missing_required_parameter")
    if match := _WRONG_TYPE.match(text):
        return invalid_type(param, _describe(match.group(1)))
    if match := _BOUND.match(text):
        return out_of_range(param, _bound_words(match.group(1), match.group(2)))
    given = text.split(" value ", 1)[-1][:64]
    allowed = _allowed(model, body, steps, trail)
    if text.startswith(("Invalid value", "Invalid enum value")) and allowed:
        words = [repr(v) for v in allowed]
        listed = words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]
        # a content part's or an item's type this server does not take (as it always said)
        tag = text.startswith("Invalid value")  # "Invalid enum value": a Literal's
        code = "unsupported_content" if tag and steps[-1] == "type" else "invalid_value"
        return invalid(f"'{param}' must be {listed}; {given} is not supported", param=param,
                       code=code)
    return invalid(f"'{param}': {text[:MAX_ECHO_CHARS]}", param=param or None,
                   code="invalid_value")


def _whole(model: Any, steps: list[str | int], trail: list[tuple[int, Any]], shape: bool,
           missing: bool, prefix: str) -> APIError | None:
    """The 400 of a failure inside a `Whole` member, reported as the member's own."""
    for i, hint in [(-1, model), *trail]:
        whole = marker(hint, Whole) if hint is not None else None
        if whole is None or i >= len(steps) - 1:
            continue
        items = all(isinstance(s, int) for s in steps[i + 1:])
        if whole.scope == "all" or (whole.scope == "items" and items) or (
                whole.scope == "shape" and shape):
            param = _param(prefix, steps[:i + 1])
            code = {"items": "invalid_type", "all": "invalid_value"}.get(
                whole.scope, "missing_required_parameter" if missing else "invalid_value")
            return invalid(f"'{param}' must be {whole.expected}", param=param, code=code)
    return None


def _param(prefix: str, steps: list[str | int]) -> str:
    out = prefix
    for step in steps:
        if isinstance(step, int):
            out = f"{out}[{step}]"
        else:  # a member, or a map's "[key]" / value "[...]"
            out = f"{out}{step}" if step.startswith("[") else f"{out}.{step}" if out else step
    return out


def _steps(path: str) -> list[str | int]:
    return [name or ("[...]" if index == "..." else int(index))
            for name, index in _STEP.findall(path)]


def _in_body(body: Any, steps: list[str | int]) -> bool:
    """Whether `steps` lead somewhere in `body`: each name a member of an object, each index
    within a list (past a map's value "[...]", which msgspec does not say, no further)."""
    value = body
    for step in steps:
        if step == "[...]":
            return isinstance(value, dict)
        if isinstance(step, int):
            if not isinstance(value, list) or step >= len(value):
                return False
        elif not isinstance(value, dict) or step not in value:
            return False
        value = value[step]
    return True


def _bound_words(kind: str, bound: str) -> str:
    """msgspec's "of length >= 1" and the like, as the API's errors say it."""
    if bound.startswith("matching regex "):
        return "a string matching " + bound.removeprefix("matching regex ")
    if not bound.startswith("of length "):
        return bound
    op, _, size = bound.removeprefix("of length ").partition(" ")
    noun = "string" if kind == "str" else "array"
    if op == ">=" and size == "1":
        return f"a non-empty {noun}"
    unit = "characters" if kind == "str" else "items"
    return f"a{'n' if noun == 'array' else ''} {noun} of " \
           f"{'at least' if op == '>=' else 'at most'} {size} {unit}"


def _describe(expected: str) -> str:
    names = [n for n in expected.split(" | ") if n != "null"]
    if "int" in names:  # an integer() field: int | float
        names = [n for n in names if n != "float"]
    words = [_TYPE_WORDS.get(n, n) for n in names]
    return " or ".join(words) if words else "null"


def _strip(tp: Any) -> Any:
    while typing.get_origin(tp) is Annotated:
        tp = typing.get_args(tp)[0]
    return tp


def _structs(tp: Any) -> list[type]:
    return [o for o in (_strip(m) for m in members(_strip(tp)))
            if isinstance(o, type) and issubclass(o, msgspec.Struct)]


def _trail(model: Any, body: Any, steps: list[str | int]) -> Iterator[tuple[int, Any]]:
    """(step index, the declared type of the member there; None for a list item), following
    the body: a tagged union's member is the one the body's tag names."""
    tp, value = model, body
    for i, step in enumerate(steps):
        if isinstance(step, int):
            lists = [o for o in members(_strip(tp)) if typing.get_origin(_strip(o)) is list]
            if not lists:
                return
            tp = typing.get_args(_strip(lists[0]))[0]
            value = value[step] if isinstance(value, list) and step < len(value) else None
            yield i, None
            continue
        structs = _structs(tp)
        tag_field = structs[0].__struct_config__.tag_field if structs else None
        struct = next((s for s in structs if tag_field is None or not isinstance(value, dict)
                       or value.get(tag_field) == s.__struct_config__.tag), None)
        if struct is None or step not in hints(struct):
            return
        tp = hints(struct)[step]
        value = value.get(step) if isinstance(value, dict) else None
        yield i, tp


def _allowed(model: Any, body: Any, steps: list[str | int], trail: list[tuple[int, Any]]
             ) -> list[Any]:
    """The values the member at `steps` may take: its union's tags, or its Literal's values."""
    if not steps:
        return []
    if isinstance(steps[-1], str):
        parent = _parent_type(model, steps, trail)
        structs = _structs(parent)
        if structs and structs[0].__struct_config__.tag_field == steps[-1]:
            return [s.__struct_config__.tag for s in structs]
    if len(trail) < len(steps) or trail[-1][1] is None:
        return []
    literals = [_strip(o) for o in members(_strip(trail[-1][1]))
                if typing.get_origin(_strip(o)) is Literal]
    return [v for o in literals for v in typing.get_args(o)]


def _parent_type(model: Any, steps: list[str | int], trail: list[tuple[int, Any]]) -> Any:
    """The declared type of what holds the last step's member."""
    if len(steps) == 1:
        return model
    if len(trail) < len(steps) - 1:
        return None
    i, hint = trail[len(steps) - 2]
    if hint is not None:
        return hint
    # a list item: the item type of the list before it
    holder = model if i == 0 else trail[i - 1][1]
    lists = [o for o in members(_strip(holder)) if typing.get_origin(_strip(o)) is list]
    return typing.get_args(_strip(lists[0]))[0] if lists else None
