"""Server-sent events and client-disconnect handling.

`EventStreamResponse` sends an async iterator of SSE frames while watching the ASGI `receive`
channel: when the client goes away the iterator is closed at once (its `finally` blocks cancel
the request upstream), whatever ASGI spec version the server speaks. `until_disconnect` does the
same for a non-streaming handler's work.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.types import Receive, Scope, Send

T = TypeVar("T")

SSE_DONE = b"data: [DONE]\n\n"
SSE_KEEPALIVE = b": keepalive\n\n"
SSE_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # proxies must not buffer the stream
}


def sse_data(payload: dict[str, Any]) -> bytes:
    """One `data:` event; JSON never contains a raw newline, so one line suffices."""
    text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return b"data: " + text.encode("utf-8") + b"\n\n"


def sse_event(event: str, payload: dict[str, Any]) -> bytes:
    """One named event (`event:` line, then `data:`), as Anthropic and Responses streams use."""
    text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return b"event: " + event.encode() + b"\ndata: " + text.encode("utf-8") + b"\n\n"


class ClientDisconnected(Exception):
    """The HTTP client went away before its response was complete."""


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """Run `work`; if the client disconnects first, cancel it and raise ClientDisconnected."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # we were cancelled (server shutdown): take the work down too
        await _cancel(task)
        raise
    finally:
        watcher.cancel()
    if not task.done():
        await _cancel(task)
        raise ClientDisconnected()
    return task.result()


async def _cancel(task: asyncio.Future[Any]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):  # nobody wants its result
        await task


async def started(frames: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """`frames`, its first pulled now: a failure before the first frame is raised here, while
    the handler can still answer with its own HTTP status. A stream that is under way with
    nothing to send yet yields b"" first (EventStreamResponse sends no empty frame)."""
    return _Started(await anext(frames, b""), frames)


class _Started:
    """`rest` after `first`; closing it closes `rest` (whose `finally` may cancel a request)."""

    def __init__(self, first: bytes, rest: AsyncIterator[bytes]) -> None:
        self._first: bytes | None = first
        self._rest = rest

    def __aiter__(self) -> _Started:
        return self

    async def __anext__(self) -> bytes:
        if self._first is None:
            return await anext(self._rest)
        first, self._first = self._first, None
        return first

    async def aclose(self) -> None:
        aclose = getattr(self._rest, "aclose", None)
        if aclose is not None:
            await aclose()


class EventStreamResponse:
    """An ASGI response streaming SSE frames; `on_close(disconnected)` runs at the end."""

    def __init__(self, frames: AsyncIterator[bytes], *, status_code: int = 200,
                 headers: dict[str, str] | None = None,
                 on_close: Callable[[bool], None] | None = None) -> None:
        self.frames = frames
        self.status_code = status_code
        self.headers = {**SSE_HEADERS, **(headers or {})}
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        disconnected = False
        try:
            await until_disconnect(receive, self._pump(send))
        except (ClientDisconnected, OSError):  # OSError: ASGI 2.4 servers on a closed socket
            disconnected = True
        finally:
            aclose = getattr(self.frames, "aclose", None)
            if aclose is not None:
                await aclose()
            if self.on_close is not None:
                self.on_close(disconnected)

    async def _pump(self, send: Send) -> None:
        raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8")]
        raw_headers += [(k.lower().encode(), v.encode()) for k, v in self.headers.items()]
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": raw_headers})
        async for frame in self.frames:
            if frame:  # b"" says nothing (see `started`)
                await send({"type": "http.response.body", "body": frame, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
