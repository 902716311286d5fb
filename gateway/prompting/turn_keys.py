"""The keys a remembered turn is found by (history.py): the tokens it followed and the message
it became, each keyed with the request's cache salt."""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Sequence
from typing import Any

from switchyard.gateway.output.tools import partial_object


def canonical_arguments(arguments: Any) -> Any:
    """Arguments as an object. A call the token limit cut has the start of one: its members
    written in full, as an Anthropic client sends such a call back (its `input`), while a
    Chat client sends the text: both name the same turn."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return partial_object(arguments) if arguments.lstrip().startswith("{") \
                else arguments
    return arguments


def calls_of(message: dict[str, Any]) -> list[tuple[str, Any]]:
    out = []
    for call in message.get("tool_calls") or ():
        function = call.get("function", call) if isinstance(call, dict) else {}
        if not isinstance(function, dict):
            function = {}
        out.append((str(function.get("name")), canonical_arguments(function.get("arguments"))))
    return out


def call_ids_of(message: dict[str, Any]) -> list[str]:
    return [c["id"] for c in message.get("tool_calls") or ()
            if isinstance(c, dict) and isinstance(c.get("id"), str) and c["id"]]


def prefix_digest(ids: Sequence[int], salt: bytes = b"") -> bytes:
    """The key of the tokens a turn followed (what the model saw before it)."""
    return PrefixHash(ids, salt).digest()


class PrefixHash:
    """blake2b-128 of token ids as int32, extended as ids are appended; keyed with the
    request's cache salt (its tenant's, and its `cache_salt`), so a turn is found only by
    requests of the salt it was generated under (common/tenants.py)."""

    def __init__(self, ids: Sequence[int] = (), salt: bytes = b"") -> None:
        self._hash = hashlib.blake2b(digest_size=16, key=salt)
        self.add(ids)

    def add(self, ids: Sequence[int]) -> None:
        if len(ids):
            self._hash.update(array("i", ids).tobytes())

    def with_added(self, ids: Sequence[int]) -> bytes:
        h = self._hash.copy()
        if len(ids):
            h.update(array("i", ids).tobytes())
        return h.digest()

    def digest(self) -> bytes:
        return self._hash.digest()


def message_key(message: dict[str, Any], salt: bytes = b"") -> str:
    """A hash of an assistant message as returned: its text and its calls (not reasoning, which
    many clients drop; not ids or whitespace at the ends, which some clients change), keyed
    with the request's cache salt: whether a reply text is remembered is never seen, not even
    in the time a rendering takes, by requests of another salt (another tenant)."""
    content = message.get("content")
    text = content.strip() if isinstance(content, str) else ""
    payload = json.dumps([text, calls_of(message)], sort_keys=True, ensure_ascii=False,
                         default=str)
    return hashlib.blake2b(payload.encode(), digest_size=16, key=salt).hexdigest()
