"""What every API's request translation shares: decoding a body into its request model, where
fields a client sends that this server does not read are accepted, and logged once per name; reasoning effort, and the chat template's variables.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import msgspec
import structlog

from switchyard.gateway.errors import invalid, invalid_type
from switchyard.gateway.request.wire.base import known_fields
from switchyard.gateway.request.wire.common import (MAX_TEMPLATE_KWARGS_BYTES,
                                                    RESERVED_TEMPLATE_KEYS)
from switchyard.gateway.request.wire.decoding import decode

log = structlog.get_logger()

# Clients change faster than servers: a top-level field this server does not know is accepted
# and logged once per name (the names seen are bounded, so junk keys cannot grow memory).
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
    """`body` as the API's request `model` (or the 400 naming the field that does not fit:
    wire/decoding.py), its top-level fields that `model` does not know noted as ignored."""
    known = known_fields(model)
    for key in body:
        if key not in known:
            note_ignored(f"{api}.{key}")
    return decode(body, model)


# Reasoning effort as chat templates take it (`reasoning_effort`: gpt-oss's low/medium/high);
# the other APIs' names for the ends of the scale map to the nearest.
EFFORTS = {"minimal": "low", "low": "low", "medium": "medium", "high": "high",
           "xhigh": "high", "max": "high"}


def reasoning_effort(value: Any, param: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise invalid_type(param, "a string")
    if value == "none":
        return None
    effort = EFFORTS.get(value)
    if effort is None:
        note_ignored(f"{param}={value[:32]}")
    return effort


def template_kwargs(kwargs: dict[str, Any], param: str = "chat_template_kwargs"
                    ) -> dict[str, Any]:
    """The template variables a request sets; a reserved key or oversized values are a 400."""
    for key in kwargs:
        if key in RESERVED_TEMPLATE_KEYS:
            raise invalid(f"'{param}.{key}' is not accepted: '{param}' sets the chat "
                          f"template's variables, not the template or its arguments",
                          param=f"{param}.{key}", code="invalid_value")
    if kwargs and len(json.dumps(kwargs, ensure_ascii=False, default=str)) \
            > MAX_TEMPLATE_KWARGS_BYTES:
        raise invalid(f"'{param}' is larger than {MAX_TEMPLATE_KWARGS_BYTES} bytes",
                      param=param, code="invalid_value")
    return dict(kwargs)
