"""One socket factory: linger, high-water marks and reconnect timing set in one place.

Long-lived servers bind ROUTER; peers connect DEALER. A DEALER reconnects by itself when the
ROUTER side restarts, so a peer notices a restart only by the new `boot_id` in `Hello`.
"""

from __future__ import annotations

import zmq

from switchyard.proto import codec

_HWM = 100_000


def _configure(sock: zmq.Socket) -> zmq.Socket:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, _HWM)
    sock.setsockopt(zmq.RCVHWM, _HWM)
    sock.setsockopt(zmq.RECONNECT_IVL, 50)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 500)
    return sock


def bind_router(ctx: zmq.Context, endpoint: str | None) -> zmq.Socket:
    """A ROUTER bound to `endpoint` (None: not bound yet, for security options first)."""
    sock = _configure(ctx.socket(zmq.ROUTER))
    # A peer that reconnects with the same identity replaces the stale one.
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    if endpoint is not None:
        sock.bind(endpoint)
    return sock


def connect_dealer(ctx: zmq.Context, endpoint: str, identity: bytes,
                   secure=lambda sock: sock) -> zmq.Socket:
    """`secure` sets security options (a CURVE client's keys) before the connect."""
    sock = _configure(ctx.socket(zmq.DEALER))
    sock.setsockopt(zmq.IDENTITY, identity)
    secure(sock)
    sock.connect(endpoint)
    return sock


def send(sock: zmq.Socket, message) -> None:
    sock.send(codec.encode(message))


def send_to(sock: zmq.Socket, identity: bytes, message) -> None:
    sock.send_multipart([identity, codec.encode(message)])
