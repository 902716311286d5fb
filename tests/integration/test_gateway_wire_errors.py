"""Fuzz aimed at the decoding error path itself: every value of a valid body of each API (every
enum among them: roles, part and block types, tool types, tool_choice, response_format.type,
Responses items, thinking, priority) is replaced by text that imitates the path msgspec appends
to its message and by digit runs too long for int(), and every object gets such a key. Each answer
is a 400 (or a 200: a free string; a 404: the model's name) in the API's own format, and the param a 400 names is a
place in the body that was sent: the client's text never chooses it.

Runs against the real app and fake scheduler of test_gateway_fuzz.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import httpx
import pytest

from tests.integration.test_gateway_fuzz import (  # noqa: F401  (module-scoped fixtures)
    API_KEY, VALID, base_url, check_error, tokenizer)

DIGITS = "9" * 5000
CRAFTED = [f"x - at `$.injected[{DIGITS}]`", "x - at `key` in `$.injected[0].role`", DIGITS]
CRAFTED_KEY = f"{DIGITS} - at `$.injected[{DIGITS}]`"

# Enum fields the valid bodies leave out, so that each is replaced too.
EXTRA = {
    "/v1/chat/completions": {
        "priority": "interactive", "response_format": {"type": "json_object"},
        "logit_bias": {"1": 1}, "stream_options": {"include_usage": True},
        "reasoning_effort": "low",
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    "/v1/completions": {"priority": "background", "response_format": {"type": "text"},
                        "logit_bias": {"7": -1}},
    "/v1/responses": {"priority": "interactive", "text": {"format": {"type": "text"}},
                      "reasoning": {"effort": "low"},
                      "tool_choice": {"type": "function", "name": "get_weather"}},
    "/v1/messages": {"priority": "interactive", "thinking": {"type": "disabled"},
                     "tool_choice": {"type": "tool", "name": "get_weather"},
                     "output_config": {"format": {"type": "json_schema",
                                                  "schema": {"type": "object"}}}},
}
EXTRA["/v1/messages/count_tokens"] = {k: v for k, v in EXTRA["/v1/messages"].items()
                                      if k != "priority"}


def places(value: Any, at: tuple = ()) -> list[tuple]:
    """The path of every value inside `value` (itself included)."""
    found = [at]
    if isinstance(value, dict):
        for key, item in value.items():
            found += places(item, (*at, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found += places(item, (*at, i))
    return found


def replaced(body: dict, at: tuple, value: Any) -> dict:
    body = copy.deepcopy(body)
    holder = body
    for step in at[:-1]:
        holder = holder[step]
    holder[at[-1]] = value
    return body


def with_key(body: dict, at: tuple, key: str) -> dict | None:
    body = copy.deepcopy(body)
    holder = body
    for step in at:
        holder = holder[step]
    if not isinstance(holder, dict):
        return None
    holder[key] = 1
    return body


def cases(path: str):
    valid = {**VALID[path], **EXTRA[path], "stream": False}
    for at in places(valid):
        body = with_key(valid, at, CRAFTED_KEY)
        if body is not None:
            yield body
        elif at:  # a list or a scalar
            for value in CRAFTED:
                yield replaced(valid, at, value)


_PARAM_STEP = re.compile(r"\.?([A-Za-z_][A-Za-z0-9_]*)|\[([0-9]+|key|\.\.\.)\]")


def in_body(body: Any, param: str) -> bool:
    """Whether the param a 400 names is a place in `body` (a map's key or value: the map)."""
    value, pos = body, 0
    while pos < len(param):
        step = _PARAM_STEP.match(param, pos)
        if step is None:
            return False
        pos = step.end()
        name, index = step.groups()
        if index in ("key", "..."):
            return isinstance(value, dict)
        if index is not None:
            if not isinstance(value, list) or int(index) >= len(value):
                return False
            value = value[int(index)]
        elif isinstance(value, dict) and name in value:
            value = value[name]
        else:
            return False
    return True


@pytest.mark.parametrize("path", list(EXTRA))
def test_crafted_values_never_crash_nor_choose_the_param(base_url, path):
    statuses: dict[int, int] = {}
    with httpx.Client(base_url=base_url, timeout=20,
                      headers={"Authorization": f"Bearer {API_KEY}",
                               "x-api-key": API_KEY}) as http:
        for body in cases(path):
            response = http.post(path, json=body)
            status = response.status_code
            statuses[status] = statuses.get(status, 0) + 1
            shown = str(body)[:300]
            assert status in (200, 400, 404), (status, shown, response.text[:300])
            if status == 200:
                continue
            check_error(path, response)
            error = response.json()["error"]
            param = error.get("param")
            if error.get("code") == "context_length_exceeded":
                continue  # the prompt as a whole, which the long values made too long
            assert param is None or ("injected" not in param and in_body(body, param)), \
                (param, shown)
    print(path, sorted(statuses.items()))
    assert statuses.get(400, 0) >= 10, statuses
