"""The starlette app: routes, API-key check, errors in each API's format (OpenAI's, or
Anthropic's under /v1/messages), one log line per request.

`build_app(settings, tokenizer, boot_id=...)` returns an ASGI app whose lifespan connects the
scheduler client and closes it again. The app never holds the model.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import structlog
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from switchyard.gateway import dashboard, metrics, peer_pages_api, router_api
from switchyard.gateway.api import anthropic_api, openai_api, responses_api
from switchyard.gateway.context import (RECORD_SCOPE_KEY, TENANT_SCOPE_KEY, Gateway,
                                        RequestRecord, gateway_of)
from switchyard.gateway.driver import STATUS_CLIENT_CLOSED
from switchyard.gateway.errors import APIError, api_style
from switchyard.gateway.guard import GuardPolicy
from switchyard.gateway.http_limits import RETRY_AFTER_S, BodyBytes, ConnectionLimits, host_of
from switchyard.gateway.prompting.history import TurnMemory
from switchyard.gateway.prompting.tool_text import text_syntax
from switchyard.gateway.prompting.turn_journal import TurnJournal, tokenizer_identity
from switchyard.gateway.api.openapi import openapi_spec
from switchyard.gateway.prompting.system_turns import renders_system_in_place
from switchyard.gateway.prompting.prompts import fewest_tokens_per_message, served_model_id
from switchyard.gateway.vision.inputs import image_inputs
from switchyard.gateway.vision.prompt import image_prompt_for, model_dir
from switchyard.gateway.request.response_store import ResponseStores
from switchyard.gateway.scheduler_client import SchedulerClient
from switchyard.gateway.output.formats import detect_format, hidden_special_ids, token_texts
from switchyard.common.endpoints import Endpoints
from switchyard.common.script import load_script
from switchyard.common.settings import Settings
from switchyard.common.tenants import Tenants, load_salt_key

log = structlog.get_logger()

KEEPALIVE_S = 5.0


class RequestLogMiddleware:
    """Refuses what a web page must not do (gateway.guard), checks the API key on /v1 routes
    (and notes whose it is: the request's tenant) and logs `request.finished` for every HTTP
    request."""

    def __init__(self, app: ASGIApp, api_key: str = "",
                 guard: GuardPolicy | None = None,
                 limits: ConnectionLimits | None = None,
                 tenants: Tenants | None = None, bodies: BodyBytes | None = None) -> None:
        self.app = app
        self.tenants = tenants if tenants is not None else Tenants.from_settings(api_key)
        self.guard = guard
        self.limits = limits
        self.bodies = bodies

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = RequestRecord(scope["method"], scope["path"])
        scope[RECORD_SCOPE_KEY] = record

        async def send_and_note(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
            await send(message)

        try:
            error = self.guard.check(scope) if self.guard is not None else None
            if error is None and not self._authorized(scope, record):
                error = APIError(401, "Incorrect or missing API key", type="authentication_error",
                                 code="invalid_api_key")
            client = self._client(scope)
            refusal = self.limits.refusal(client) if self.limits is not None else None
            if error is None and refusal is not None:
                error = APIError(503, f"The server is at its connection limit: {refusal}; "
                                      f"try again shortly", type="server_error",
                                 code="overloaded", retry_after_s=RETRY_AFTER_S,
                                 headers={"Connection": "close"})
            if error is None:
                if self.limits is not None:
                    self.limits.started(client)
                try:
                    await self.app(scope, receive, send_and_note)
                finally:
                    if self.limits is not None:
                        self.limits.ended(client)
            else:
                record.fail(error)
                await error.response(api_style(scope["path"]))(scope, receive, send_and_note)
        finally:
            if record.status is None:
                record.status = 500
            if self.bodies is not None and record.body_bytes:
                self.bodies.give(record.body_bytes)
            log.info("request.finished", **record.fields())

    def _client(self, scope: Scope) -> str:
        """Whose share of the connection limit a request counts against: its tenant's, with
        several keys (every local tenant comes from one loopback host), else its host's."""
        tenant = scope.get(TENANT_SCOPE_KEY)
        if tenant is not None and self.tenants.several:
            return "tenant:" + tenant.name  # a host is never spelled so
        return host_of(scope.get("client"))

    def _authorized(self, scope: Scope, record: RequestRecord) -> bool:
        if not self.tenants or not scope["path"].startswith("/v1"):
            return True
        headers = dict(scope["headers"])
        given = headers.get(b"x-api-key", b"").decode("latin-1")
        auth = headers.get(b"authorization", b"").decode("latin-1")
        if auth[:7].lower() == "bearer ":
            given = auth[7:].strip()
        tenant = self.tenants.match(given)
        if tenant is None:
            return False
        scope[TENANT_SCOPE_KEY] = tenant
        if self.tenants.several:
            record.tenant = tenant.name
        return True


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    record = request.scope.get(RECORD_SCOPE_KEY)
    if record is not None:
        record.fail(exc)
    return exc.response(api_style(request.url.path))


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        error = APIError(404, f"Unknown route {request.method} {request.url.path}",
                         code="not_found")
    elif exc.status_code == 405:
        error = APIError(405, f"Method {request.method} is not allowed on {request.url.path}",
                         code="method_not_allowed", headers=dict(exc.headers or {}))
    else:
        error = APIError(exc.status_code, str(exc.detail), code="http_error",
                         headers=dict(exc.headers or {}))
    return await _api_error(request, error)


async def _client_gone(request: Request, exc: Exception) -> Response:
    record = request.scope.get(RECORD_SCOPE_KEY)
    if record is not None:
        record.disconnected = True
    return Response(status_code=STATUS_CLIENT_CLOSED)


async def _server_error(request: Request, exc: Exception) -> Response:
    log.error("request.crashed", error_type=type(exc).__name__, path=request.url.path)
    return APIError(500, "Internal server error", type="server_error",
                    code="internal_error").response(api_style(request.url.path))


async def _openapi(request: Request) -> Response:
    gateway = gateway_of(request)
    # Off the event loop: the first description of a served model inlines every request
    # model's schema (tens of milliseconds; cached after, request/wire/schema.py).
    spec = await run_in_threadpool(openapi_spec, gateway.model_id,
                                   vocab_size=len(gateway.tokenizer),
                                   api_key=bool(gateway.tenants),
                                   images=gateway.images is not None
                                   and gateway.images.prompt is not None)
    return JSONResponse(spec)


ROUTES = [
    Route("/v1/chat/completions", openai_api.chat_completions, methods=["POST"]),
    Route("/v1/completions", openai_api.completions, methods=["POST"]),
    Route("/v1/responses", responses_api.create_response, methods=["POST"]),
    Route("/v1/messages", anthropic_api.messages, methods=["POST"]),
    Route("/v1/messages/count_tokens", anthropic_api.count_tokens, methods=["POST"]),
    Route("/v1/models", openai_api.list_models, methods=["GET"]),
    Route("/v1/models/{model:path}", openai_api.get_model, methods=["GET"]),
    Route("/health", openai_api.health, methods=["GET"]),
    Route("/openapi.json", _openapi, methods=["GET"]),
]


def eos_ids(tokenizer: Any) -> tuple[int, ...]:
    """mlx-lm's TokenizerWrapper knows several end tokens; a bare HF tokenizer knows one."""
    ids = set(getattr(tokenizer, "eos_token_ids", None) or ())
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


def salt_key(settings: Settings) -> bytes:
    """The install's salt key (common/tenants.py): SecretKeyError (the gateway does not start)
    when the file is not ours or not private; a key of this run only where none can be made."""
    key, warning = load_salt_key(settings.cache_path)
    if warning:
        log.warning("gateway.salt_key_temporary", reason=warning)
    return key


def build_app(settings: Settings, tokenizer: Any, *, boot_id: str,
              keepalive_s: float = KEEPALIVE_S) -> Starlette:
    client = SchedulerClient(Endpoints(settings.runtime_path).scheduler, boot_id=boot_id,
                             heartbeat_s=settings.heartbeat_s,
                             peer_timeout_s=settings.peer_timeout_s)
    if settings.served_model_name:  # as vLLM: exactly these names, the first one in replies
        model_id, *names = settings.served_model_name
        aliases = tuple(dict.fromkeys(names))
    else:
        model_id = served_model_id(settings.model)
        aliases = tuple({settings.model} - {"", model_id})
    # Sub-agents' model names (--background-model) are the model too, at background priority.
    aliases = tuple(dict.fromkeys((*aliases, *settings.background_model)))
    chat_format = detect_format(tokenizer, settings.chat_format)
    tenants = Tenants.from_settings(settings.api_key, settings.shared_prefix_tenants,
                                    salt_key(settings))
    if tenants.several:  # names only: an operator sees every line the key file made a key
        log.info("gateway.tenants", num_tenants=len(tenants.tenants),
                 names=[t.name for t in tenants.tenants], shared=sorted(tenants.shared))
    gateway = Gateway(settings=settings, tokenizer=tokenizer, client=client, model_id=model_id,
                      model_aliases=aliases, tenants=tenants,
                      stop_token_ids=eos_ids(tokenizer),
                      keepalive_s=keepalive_s,
                      tool_syntax=chat_format.tools, think=chat_format.think,
                      hidden_ids=hidden_special_ids(tokenizer, chat_format),
                      turn_ends=token_texts(tokenizer, eos_ids(tokenizer)),
                      tools_as_text=text_syntax(tokenizer, chat_format.tools),
                      system_in_place=renders_system_in_place(tokenizer),
                      message_tokens=fewest_tokens_per_message(tokenizer),
                      prefix_stable=settings.prefix_stable,
                      keep_reasoning=settings.keep_reasoning,
                      memory=TurnMemory(settings.history_turns, journal=TurnJournal.in_dir(
                          settings.runtime_path, tokenizer_identity(tokenizer))),
                      responses=ResponseStores(settings.max_stored_responses,
                                               tenants=[t.name for t in tenants.tenants]),
                      script=load_script(settings.script) if settings.script else None,
                      images=image_inputs(settings, image_prompt_for(
                          model_dir(settings.model), tokenizer), model_id))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await client.start()
        warming = asyncio.ensure_future(gateway.grammars.warm())
        try:
            yield
        finally:
            await client.close()
            warming.cancel()
            await gateway.grammars.aclose()
            gateway.shutdown()

    limits = ConnectionLimits(settings.max_connections)
    middleware = [Middleware(RequestLogMiddleware, tenants=tenants,
                             guard=GuardPolicy.from_settings(settings), limits=limits,
                             bodies=gateway.bodies)]
    if settings.allowed_origins:  # answers preflights before the guard sees them
        middleware.insert(0, Middleware(
            CORSMiddleware, allow_origins=sorted(GuardPolicy.from_settings(settings).origins),
            allow_methods=["GET", "POST"], allow_headers=["*"]))
    app = Starlette(
        routes=ROUTES,
        middleware=middleware,
        exception_handlers={APIError: _api_error, HTTPException: _http_error,
                            ClientDisconnect: _client_gone, Exception: _server_error},
        lifespan=lifespan,
    )
    app.state.gateway = gateway
    app.state.connection_limits = limits  # shared with the server's protocol (service.py)
    metrics.mount(app, settings, tenants)  # GET /metrics, requests counted by endpoint and status
    dashboard.mount(app, settings, tenants)  # GET /dashboard, GET /v1/switchyard/status
    router_api.mount(app)  # GET /v1/loads, /server_info, /model_info: what a router reads
    peer_pages_api.mount(app, settings)  # POST /switchyard/peer/pages, with --peer
    return app
