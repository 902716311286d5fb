"""Assertions about tool calls the tiny random models make."""

from __future__ import annotations

import json


def assert_forced_call(finish_reason: str, arguments: str) -> None:
    """A forced call comes back as a call: complete (its arguments an object), or cut by
    max_tokens (a random model may not close it in a few tokens): "length" and the arguments
    as far as they were written, never a repaired `{}` (as after a model that wrote digits
    until max_tokens)."""
    if finish_reason == "tool_calls":
        assert isinstance(json.loads(arguments), dict)
    else:
        assert finish_reason == "length" and arguments.startswith("{"), arguments
