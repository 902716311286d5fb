"""Connection limits a server on a shared machine needs (docs/design.md "Security").

uvicorn bounds concurrent connections (`limit_concurrency`: beyond it, 503), idle keep-alive
connections (`timeout_keep_alive`) and the size of an incomplete request head (h11), but gives
a client unlimited time to finish sending its headers: a few hundred connections that trickle
one byte a second (slowloris) hold file descriptors forever, before any API key is checked.
`DeadlineH11Protocol` closes a connection whose request head is not complete `read_timeout_s`
after the connection opened or its previous response ended (as nginx's
`client_header_timeout`). The body has its own deadline in `Gateway.read_body` (a 408).
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

# Largest request head (request line + headers) h11 buffers; uvicorn's default too.
MAX_HEAD_BYTES = 16 * 1024
KEEP_ALIVE_S = 5


class DeadlineH11Protocol(H11Protocol):
    read_timeout_s: float = 30.0  # set per server by `protocol_class`

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_deadline: asyncio.TimerHandle | None = None
        self._arm_head_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_deadline()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not None and not self.cycle.response_complete:
            self._disarm_head_deadline()  # a request head arrived: the app's deadline now

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_head_deadline()  # the next request's head must come in time too

    def _arm_head_deadline(self) -> None:
        self._disarm_head_deadline()
        self._head_deadline = self.loop.call_later(self.read_timeout_s, self._head_too_slow)

    def _disarm_head_deadline(self) -> None:
        handle = getattr(self, "_head_deadline", None)
        if handle is not None:
            handle.cancel()
            self._head_deadline = None

    def _head_too_slow(self) -> None:
        self._head_deadline = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a request is being served
        try:
            self.conn.send(h11.ConnectionClosed())
        except h11.LocalProtocolError:
            pass
        self.transport.close()


def protocol_class(read_timeout_s: float) -> type[DeadlineH11Protocol]:
    return type("DeadlineH11Protocol", (DeadlineH11Protocol,),
                {"read_timeout_s": read_timeout_s})


def server_limits(max_connections: int, read_timeout_s: float) -> dict[str, Any]:
    """uvicorn.Config keywords for these limits."""
    return {"http": protocol_class(read_timeout_s), "limit_concurrency": max_connections,
            "timeout_keep_alive": KEEP_ALIVE_S, "h11_max_incomplete_event_size": MAX_HEAD_BYTES}
