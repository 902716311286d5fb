"""Connection limits a server on a shared machine needs (docs/design/security.md "Security").

uvicorn bounds idle keep-alive connections (`timeout_keep_alive`) and the size of an
incomplete request head (h11), but gives a client unlimited time to finish sending its headers:
a few hundred connections that trickle one byte a second (slowloris) hold file descriptors
forever, before any API key is checked. `DeadlineH11Protocol` closes a connection whose
request head is not complete `read_timeout_s` after the connection opened or its previous
response ended (as nginx's `client_header_timeout`). The body has its own deadline in
`api/json_body.read_body` (a 408).

`--max-connections` is `ConnectionLimits`' (uvicorn's `limit_concurrency` answers a plain-text
503 without `Retry-After`, and lets one client hold every connection):

- a connection that would pass the limit first closes an idle one (no request in progress:
  between requests, or a head still arriving) of the client host holding the most, the
  longest idle first, so connections nobody uses never keep a request out;
- a request is refused with a 503 in its API's error format, `Retry-After` and `Connection:
  close` when requests in progress or open connections are at the limit, or when its client
  already has all but an eighth of them in progress (the eighth is kept for other clients:
  one client cannot hold every slot). A client is the request's tenant where the key file
  has several keys (local processes all come from one loopback host, so a host would let
  one key shut out the others), else its host.

`BodyBytes` bounds the large bodies (256 KiB or more) the gateway holds at once, from the
first byte read (or the declared length) to the end of their request: a body costs its bytes
and the values parsed from them (api/json_body.py), and every connection may send one.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

# Largest request head (request line + headers) h11 buffers; uvicorn's default too.
MAX_HEAD_BYTES = 16 * 1024
KEEP_ALIVE_S = 5


RETRY_AFTER_S = 1
LARGE_BODY_BYTES = 256 * 1024  # smaller bodies are bounded by the connections that send them
MAX_LARGE_BODIES = 4  # bodies of --max-body-bytes held at once


class BodyBytes:
    """The bytes of large request bodies held at once, within `limit`."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def take(self, num_bytes: int) -> bool:
        if self.held + num_bytes > self.limit:
            return False
        self.held += num_bytes
        return True

    def give(self, num_bytes: int) -> None:
        self.held -= num_bytes


class ConnectionLimits:
    """Open connections and requests in progress, per client (a tenant or a host: the
    gateway's RequestLogMiddleware names it), against one limit."""

    def __init__(self, max_connections: int) -> None:
        self.max_connections = max_connections
        # Requests one client may have in progress: all but an eighth (at least one).
        self.per_client = max(1, max_connections - max(1, max_connections // 8))
        self.connections: dict[Any, float] = {}  # protocol -> when it last went idle
        self.requests: Counter[str] = Counter()  # client -> requests in progress

    # --- connections (the protocol) ----------------------------------------------------------

    def opened(self, protocol: Any) -> None:
        self.connections[protocol] = time.monotonic()
        if len(self.connections) > self.max_connections:
            victim = self._idle_victim(protocol)
            if victim is not None:
                victim.close_idle()

    def closed(self, protocol: Any) -> None:
        self.connections.pop(protocol, None)

    def went_idle(self, protocol: Any) -> None:
        if protocol in self.connections:
            self.connections[protocol] = time.monotonic()

    def _idle_victim(self, newcomer: Any) -> Any | None:
        per_host = Counter(host_of(p.client) for p in self.connections)
        idle = [p for p in self.connections if p is not newcomer and p.is_idle()]
        if not idle:
            return None
        return min(idle, key=lambda p: (-per_host[host_of(p.client)], self.connections[p]))

    # --- requests (the app) ------------------------------------------------------------------

    def refusal(self, host: str) -> str | None:
        """Why a new request of client `host` is refused now, or None (then `started`/`ended`)."""
        if len(self.connections) > self.max_connections:
            return f"all {self.max_connections} connections are in use"
        if sum(self.requests.values()) >= self.max_connections:
            return f"{self.max_connections} requests are in progress"
        if self.requests[host] >= self.per_client:
            return (f"this client already has {self.requests[host]} requests in progress "
                    f"(of {self.max_connections}; the rest are kept for other clients)")
        return None

    def started(self, host: str) -> None:
        self.requests[host] += 1

    def ended(self, host: str) -> None:
        self.requests[host] -= 1
        if self.requests[host] <= 0:
            del self.requests[host]


def host_of(client: Any) -> str:
    return client[0] if client else ""


class DeadlineH11Protocol(H11Protocol):
    read_timeout_s: float = 30.0  # set per server by `protocol_class`
    limits: ConnectionLimits | None = None  # likewise

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_deadline: asyncio.TimerHandle | None = None
        self._arm_head_deadline()
        if self.limits is not None:
            self.limits.opened(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_deadline()
        if self.limits is not None:
            self.limits.closed(self)
        super().connection_lost(exc)

    def is_idle(self) -> bool:
        """No request in progress: between requests, or a request head still arriving."""
        return not self.transport.is_closing() and (
            self.cycle is None or self.cycle.response_complete)

    def close_idle(self) -> None:
        """Close this idle connection to make room for a new one (at --max-connections)."""
        self._disarm_head_deadline()
        if self.limits is not None:
            self.limits.closed(self)
        try:
            self.conn.send(h11.ConnectionClosed())
        except h11.LocalProtocolError:
            pass
        self.transport.close()

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not None and not self.cycle.response_complete:
            self._disarm_head_deadline()  # a request head arrived: the app's deadline now

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_head_deadline()  # the next request's head must come in time too
            if self.limits is not None:
                self.limits.went_idle(self)

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


def protocol_class(read_timeout_s: float,
                   limits: ConnectionLimits | None = None) -> type[DeadlineH11Protocol]:
    return type("DeadlineH11Protocol", (DeadlineH11Protocol,),
                {"read_timeout_s": read_timeout_s, "limits": limits})


def server_limits(limits: ConnectionLimits, read_timeout_s: float) -> dict[str, Any]:
    """uvicorn.Config keywords for these limits (the app refuses requests past `limits`:
    app.RequestLogMiddleware)."""
    return {"http": protocol_class(read_timeout_s, limits),
            "timeout_keep_alive": KEEP_ALIVE_S, "h11_max_incomplete_event_size": MAX_HEAD_BYTES}
