"""`GET /dashboard`: a live page of slots, queue, cache hits, disk use and TTFT by cause.

Plain HTML, CSS and JavaScript from `gateway/static/` (package files, no build step, nothing
from a CDN). The page polls `GET /v1/switchyard/status`, which returns the scheduler's
status.json snapshot plus the gateway's HTTP counters; being under /v1 it needs the API key
when one is set (the page takes it from `#key=...` in its URL, or asks for it). The page itself
holds no data and needs no key.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from switchyard.gateway.context import TENANT_SCOPE_KEY
from switchyard.gateway.tenant_view import status_for
from switchyard.common.endpoints import Endpoints
from switchyard.common.settings import Settings
from switchyard.proto.status import Status, read_status
from switchyard.common.tenants import Tenants

STATIC_DIR = Path(__file__).resolve().parent / "static"
ASSETS = {  # the only files served, with their types
    "dashboard.html": "text/html; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
}
STATUS_PATH = "/v1/switchyard/status"
HEADERS = {
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                               "connect-src 'self'; img-src 'self' data:; base-uri 'none'; "
                               "form-action 'none'; frame-ancestors 'none'",
}


def load_assets(directory: Path = STATIC_DIR) -> dict[str, bytes]:
    return {name: (directory / name).read_bytes() for name in ASSETS}


def status_body(status: Status, now: float, http: list[dict]) -> dict:
    """What the page polls: the status document (its JSON fields, as written), its age, the
    gateway's own HTTP counters."""
    return {**msgspec.to_builtins(status), "age_s": max(0.0, now - status.at),
            "gateway": {"pid": os.getpid(), "now": now, "http_requests": http}}


def mount(app: Starlette, settings: Settings, tenants: Tenants | None = None) -> None:
    """Add GET /dashboard, its assets and GET /v1/switchyard/status to `app`. With several
    keys, a key is shown its own requests (gateway/tenant_view.py)."""
    if tenants is None:
        tenants = Tenants.from_settings(settings.api_key, settings.shared_prefix_tenants)
    assets = load_assets()
    status_file = Endpoints(settings.runtime_path).status_file

    def asset(name: str) -> Response:
        return Response(assets[name], media_type=ASSETS[name], headers=HEADERS)

    async def page(request: Request) -> Response:
        return asset("dashboard.html")

    async def static(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in ASSETS:
            return Response("not found", status_code=404, media_type="text/plain")
        return asset(name)

    async def status(request: Request) -> Response:
        snapshot = read_status(status_file)
        if snapshot is None:  # none yet, or a scheduler of another version
            return JSONResponse({"error": {
                "message": "No status yet: the scheduler writes it every heartbeat",
                "type": "server_error", "param": None, "code": "status_unavailable"}},
                status_code=503, headers={"Retry-After": "1", "Cache-Control": "no-store"})
        metrics = getattr(request.app.state, "metrics", None)
        http = metrics.request_counts() if metrics is not None else []
        snapshot = status_for(snapshot, request.scope.get(TENANT_SCOPE_KEY), tenants)
        return JSONResponse(status_body(snapshot, time.time(), http),
                            headers={"Cache-Control": "no-store"})

    app.router.routes.extend([
        Route("/dashboard", page, methods=["GET"]),
        Route("/dashboard/{name}", static, methods=["GET"]),
        Route(STATUS_PATH, status, methods=["GET"]),
    ])
