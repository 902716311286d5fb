"""A request's JSON body, parsed without holding the event loop, its top-level lists bounded,
its cost in memory bounded by its size.

`json.loads` holds the GIL from the first byte to the last: 32 MB of empty messages took 1.4 s
here, during which no other request got a byte. A small body is parsed
at once; a large one member by member (a value whose end is near is parsed at once, at C
speed), yielding to the event loop every few milliseconds. A list longer than its limit
(messages, input items, a prompt's token ids and a message's content parts at the context's
tokens; tools at 512) is refused as soon as it is passed, so parsing one costs work in
proportion to the limit, not to the body.

A value costs the gateway about 80 bytes however short its text (`[],` is three bytes: a
30 MiB body of empty arrays in an ignored field grew it by 775 MiB, where a 30 MiB string
costs 30). So a large body may hold at most `max_values` values (`value_budget`: eight per
token of the context, at least 2**19: about 40 MiB), counted as they are built, and nest at
most MAX_NESTING levels; past either it is refused (413, 400). A small body cannot hold that
many values. How many large bodies the gateway holds at once is bounded too (http_limits.py
`BodyBytes`).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from typing import Any

from switchyard.gateway.request.wire.common import MAX_TOOLS
from switchyard.gateway.context import Gateway, RequestContext
from switchyard.gateway.errors import APIError, invalid
from switchyard.gateway.http_limits import LARGE_BODY_BYTES, RETRY_AFTER_S

COOPERATIVE_BYTES = LARGE_BODY_BYTES  # smaller bodies parse in a few milliseconds: at once
SMALL_CHARS = 4096  # a value whose end is this near is parsed at once (C speed)
MAX_NESTING = 128  # arrays and objects within each other (a tool's schema nests a few)
MIN_VALUE_BUDGET = 1 << 19  # more than a small body can hold (3 bytes a value)
SLICE_S = 0.005  # parsing between two yields to the event loop
_WS = re.compile(r"[ \t\n\r]*")
# JSON may spell a lone UTF-16 surrogate ("\\ud800"), which Python keeps in its str but which is
# not text: no tokenizer or encoder takes it.
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class ListLimit:
    """At most `limit` elements in a top-level list; `reason` says why (for the 400)."""

    def __init__(self, limit: int, reason: str, code: str = "invalid_value") -> None:
        self.limit = limit
        self.reason = reason
        self.code = code

    def error(self, key: str) -> Exception:
        return invalid(f"'{key}' has more than {self.limit} items: {self.reason}", param=key,
                       code=self.code)


def value_budget(ctx: int) -> int:
    """The values a body may hold: more than any body whose prompt fits the context (a text
    part of one token is three values: the part, its type and its text)."""
    return max(MIN_VALUE_BUDGET, 8 * ctx)


async def parse_body(raw: bytes, limits: dict[str, ListLimit],
                     max_values: int = MIN_VALUE_BUDGET) -> dict[str, Any]:
    """The body as a JSON object (400 `invalid_json` if it is not one), with every top-level
    list within its limit, and at most `max_values` values (413)."""
    if len(raw) < COOPERATIVE_BYTES:
        body = parse_json(raw)
    else:
        body = await _Cooperative(raw, limits, max_values).parse()
    for key, limit in limits.items():
        if isinstance(body.get(key), list) and len(body[key]) > limit.limit:
            raise limit.error(key)
    return body


class _Cooperative:
    def __init__(self, raw: bytes, limits: dict[str, ListLimit], max_values: int) -> None:
        self.raw = raw
        self.limits = limits
        self.max_values = max_values
        self.values_left = max_values
        self.decoder = json.JSONDecoder(parse_constant=_no_constants)
        self.deadline = time.perf_counter() + SLICE_S

    async def parse(self) -> dict[str, Any]:
        try:
            text = self.raw.decode(json.detect_encoding(self.raw))
            body = await self._object(text)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError
            raise invalid_json(exc) from None
        if SURROGATE_ESCAPE.search(self.raw):
            await self._refuse_lone_surrogates(body)
        return body

    async def _yield(self) -> None:
        if time.perf_counter() > self.deadline:
            await asyncio.sleep(0)
            self.deadline = time.perf_counter() + SLICE_S

    def _ws(self, text: str, pos: int) -> int:
        if pos < len(text) and text[pos] not in " \t\n\r":
            return pos
        return _WS.match(text, pos).end()

    def _expect(self, text: str, pos: int, chars: str) -> str:
        if pos >= len(text) or text[pos] not in chars:
            raise ValueError(f"Expecting one of {chars!r}: char {pos}")
        return text[pos]

    async def _object(self, text: str) -> dict[str, Any]:
        pos = self._ws(text, 0)
        if self._expect(text, pos, "{[\"-0123456789tfn") != "{":
            raise ValueError("The request body must be a JSON object")
        body, pos = await self._members(text, pos, depth=0)
        if self._ws(text, pos) != len(text):
            raise ValueError(f"Extra data: char {pos}")
        return body

    async def _value(self, text: str, pos: int, depth: int, key: str | None = None
                     ) -> tuple[Any, int]:
        """A value at `pos`: an object or a list that does not end within SMALL_CHARS member
        by member (a message with a million content parts is one element of `messages`),
        the rest at once."""
        opening = text[pos:pos + 1]
        if opening in ("[", "{"):
            small = self._small(text, pos, "]" if opening == "[" else "}")
            if small is not None and (depth > 0 or opening == "{"):
                return small
            if depth >= MAX_NESTING:
                raise invalid(f"The request body nests arrays and objects more than "
                              f"{MAX_NESTING} levels deep", code="invalid_json")
            self._spend(1)
            if opening == "[":
                return await self._list(text, pos, depth + 1, key)
            return await self._members(text, pos, depth + 1)
        self._spend(1)
        value, pos = self.decoder.raw_decode(text, pos)
        await self._yield()
        return value, pos

    def _spend(self, num_values: int) -> None:
        self.values_left -= num_values
        if self.values_left < 0:
            raise APIError(413, f"The request body holds more than {self.max_values} JSON "
                                f"values (arrays, objects, strings, numbers)",
                           code="request_too_large")

    def _small(self, text: str, pos: int, closing: str) -> tuple[Any, int] | None:
        """The value at `pos` if it ends at the first `closing` within SMALL_CHARS: parsed at
        once from that slice (whole, or not at all: a bracket inside a string, or a nested
        value, makes the slice incomplete, and the value is parsed member by member)."""
        end = text.find(closing, pos, pos + SMALL_CHARS)
        if end < 0:
            return None
        try:
            value, used = self.decoder.raw_decode(text[pos:end + 1])
        except ValueError:
            return None
        if used != end + 1 - pos:
            return None
        # At most one value per opening bracket and comma (fewer: some are in strings).
        self._spend(1 + sum(text.count(c, pos, end) for c in "[{,"))
        return value, end + 1

    async def _members(self, text: str, pos: int, depth: int) -> tuple[dict[str, Any], int]:
        members: dict[str, Any] = {}
        pos = self._ws(text, pos + 1)
        if text[pos:pos + 1] == "}":
            return members, pos + 1
        while True:
            self._expect(text, pos, '"')
            key, pos = self.decoder.raw_decode(text, pos)
            pos = self._ws(text, pos)
            self._expect(text, pos, ":")
            members[key], pos = await self._value(text, self._ws(text, pos + 1), depth, key)
            pos = self._ws(text, pos)
            if self._expect(text, pos, ",}") == "}":
                return members, pos + 1
            pos = self._ws(text, pos + 1)

    async def _list(self, text: str, pos: int, depth: int, key: str | None
                    ) -> tuple[list[Any], int]:
        limit = self.limits.get(key) if key is not None else None
        items: list[Any] = []
        pos = self._ws(text, pos + 1)
        if text[pos:pos + 1] == "]":
            return items, pos + 1
        while True:
            item, pos = await self._value(text, pos, depth)
            items.append(item)
            if limit is not None and len(items) > limit.limit:
                raise limit.error(key)
            pos = self._ws(text, pos)
            if self._expect(text, pos, ",]") == "]":
                return items, pos + 1
            pos = self._ws(text, pos + 1)
            await self._yield()

    async def _refuse_lone_surrogates(self, body: Any) -> None:
        for item in _items(body):
            if isinstance(item, str):
                lone_surrogate(item)
            await self._yield()


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object; NaN and Infinity are not JSON and are refused. (Large bodies
    are parsed member by member, yielding to the event loop: `_Cooperative`.)"""
    try:
        # Decoded strictly: json.loads(bytes) decodes with 'surrogatepass', which lets a raw
        # encoded surrogate (b"\xed\xa0\x80") through as a lone surrogate.
        text = raw.decode(json.detect_encoding(raw))
        body = json.loads(text, parse_constant=_no_constants)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError
        raise invalid_json(exc) from None
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.", code="invalid_json")
    if SURROGATE_ESCAPE.search(raw):  # only a \\uD800-\\uDFFF escape can make one
        _refuse_lone_surrogates(body)
    return body


def invalid_json(exc: Exception) -> Exception:
    return invalid(f"We could not parse the JSON body of your request: {exc}",
                   code="invalid_json")


def lone_surrogate(text: str) -> None:
    """A 400 if `text` holds a lone surrogate."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise invalid("The JSON body holds a lone UTF-16 surrogate (an unpaired "
                      "\\ud800-\\udfff escape), which is not text.",
                      code="invalid_json") from None


def _refuse_lone_surrogates(body: Any) -> None:
    for item in _items(body):
        if isinstance(item, str):
            lone_surrogate(item)


def _items(body: Any) -> Iterator[Any]:
    """Every value and key of a parsed JSON body, depth first, without recursion."""
    stack = [body]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        yield item


def per_token(ctx: int, num_tokens: int = 1) -> ListLimit:
    """A list each element of which takes at least `num_tokens` tokens of the context
    (messages, input items, a prompt's token ids)."""
    if num_tokens == 1:
        return ListLimit(ctx, f"each takes at least one token of the {ctx}-token context",
                         "context_length_exceeded")
    return ListLimit(ctx // num_tokens, f"each takes at least {num_tokens} tokens of the "
                     f"{ctx}-token context", "context_length_exceeded")


def chat_limits(ctx: int, key: str = "messages", message_tokens: int = 1
                ) -> dict[str, ListLimit]:
    """Messages (or input items: `message_tokens` each, the fewest a chat message costs under
    the model's template), tools, and any message's content parts (each adds to the prompt:
    a million empty parts in one message took seconds to parse and join)."""
    return {key: per_token(ctx, message_tokens), "content": per_token(ctx),
            "tools": ListLimit(MAX_TOOLS, "the most tools one request may define")}


def message_limits(gw: Gateway) -> dict[str, ListLimit]:
    """`chat_limits` of a chat request's `messages` under the model's own chat template."""
    return chat_limits(gw.settings.ctx, message_tokens=gw.message_tokens)


async def read_json(ctx: RequestContext, limits: dict[str, ListLimit]) -> dict[str, Any]:
    """The request's body (`read_body` bounds its size and time) as a JSON object, parsed as
    `parse_body` does."""
    max_values = value_budget(ctx.gateway.settings.ctx)
    raw = await read_body(ctx)
    return await parse_body(raw, limits, max_values)


async def read_body(ctx: RequestContext) -> bytes:
    """The whole body, or a 413 as soon as it is known to be too large."""
    settings = ctx.gateway.settings
    limit = settings.max_body_bytes
    length = ctx.headers.get("content-length", "")  # h11: at most 20 ASCII digits
    declared = int(length) if length.isascii() and length.isdigit() else 0
    if declared > limit:
        raise body_too_large(limit)
    _hold_body(ctx, declared)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(settings.read_timeout_s):
            async for chunk in ctx.body():
                size += len(chunk)
                if size > limit:
                    raise body_too_large(limit)
                _hold_body(ctx, size)
                chunks.append(chunk)
    except TimeoutError:
        raise APIError(408, f"The request body did not arrive within "
                            f"{settings.read_timeout_s:g} s",
                       code="request_timeout", headers={"Connection": "close"}) from None
    return b"".join(chunks)


def _hold_body(ctx: RequestContext, size: int) -> None:
    """Counts a large body of `size` bytes against the gateway's `bodies` until its request
    ends (the logging middleware gives it back), or a 503 when they are all taken."""
    record, bodies = ctx.record, ctx.gateway.bodies
    if size < LARGE_BODY_BYTES or size <= record.body_bytes:
        return
    if not bodies.take(size - record.body_bytes):
        raise APIError(503, f"The server holds all the large request bodies it takes at "
                            f"once ({bodies.limit >> 20} MiB); try again shortly",
                       type="server_error", code="overloaded", retry_after_s=RETRY_AFTER_S,
                       headers={"Connection": "close"})
    record.body_bytes = size


def body_too_large(limit: int) -> APIError:
    return APIError(413, f"The request body is larger than {limit} bytes",
                    code="request_too_large")
