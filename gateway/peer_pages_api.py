"""`POST /switchyard/peer/pages`: another Switchyard server (a `--peer`) asks for KV pages
(docs/design/kv-pages.md "Pages from a peer"; docs/design/security.md "Peers").

Mounted only with `--peer`. Outside /v1: no API key opens it; the ask's MAC under the peer key
does (proto/peer_pages.py), checked here before anything else. The gateway holds no pages: it
forwards the checked ask to the kvstore's `peer-pages.sock` from a thread (off the event
loop) and streams back the page records the kvstore answers, already MAC'd with the peer key.
A kvstore that does not answer within the asker's deadline gives an empty answer: the asker
prefills.
"""

from __future__ import annotations

import secrets

import structlog
import zmq
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from switchyard.common.endpoints import Endpoints
from switchyard.proto.peer_pages import (MAC_HEADER, MAX_ASK_BYTES, PEER_PAGES_PATH, PeerAskError,
                                         decode_ask)
from switchyard.common.secret_keys import load_peer_key
from switchyard.common.settings import Settings
from switchyard.proto.sockets import connect_dealer

log = structlog.get_logger()
PAGES_HEADER = "x-switchyard-pages"  # how many page records the answer holds


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "peer_error",
                                   "code": "peer_refused" if status == 403 else "bad_peer_ask"}},
                        status_code=status)


def ask_kvstore(endpoint: str, body: bytes, wait_s: float) -> tuple[int, bytes]:
    """(count, records) from the kvstore for a checked ask; (0, b"") when it is not there."""
    ctx = zmq.Context.instance()
    sock = connect_dealer(ctx, endpoint, b"peer-" + secrets.token_bytes(6))
    try:
        sock.send(body)
        if not sock.poll(int(wait_s * 1000)):
            return 0, b""
        count, blob = sock.recv_multipart()[:2]
        return int(count), blob
    finally:
        sock.close(0)


def mount(app: Starlette, settings: Settings) -> None:
    if not settings.peer:
        return
    key = load_peer_key(settings.peer_key_file, settings.cache_path)
    endpoint = Endpoints(settings.runtime_path).peer_pages

    async def peer_pages(request: Request) -> Response:
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_ASK_BYTES:
                return _error(400, f"a peer ask is at most {MAX_ASK_BYTES} bytes")
        try:
            ask = decode_ask(body, request.headers.get(MAC_HEADER), key)
        except PeerAskError as exc:
            log.warning("peer.ask_refused", status=exc.status, reason=str(exc))
            return _error(exc.status, str(exc))
        # Past the asker's deadline nobody reads the answer: the thread is given back then.
        count, blob = await run_in_threadpool(ask_kvstore, endpoint, body, ask.deadline_s)
        return Response(blob, media_type="application/octet-stream",
                        headers={PAGES_HEADER: str(count), "Cache-Control": "no-store"})

    app.router.routes.append(Route(PEER_PAGES_PATH, peer_pages, methods=["POST"]))
