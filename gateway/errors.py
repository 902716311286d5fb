"""Errors in each API's own format, with a status.

OpenAI (Chat Completions, Completions, Responses): `{"error": {"message", "type", "param",
"code"}}`. Anthropic (/v1/messages): `{"type": "error", "error": {"type", "message"}}`, the type
chosen by status as Anthropic does. Every way a request can fail at the gateway ends as an
`APIError`; the app's exception handlers turn it into a JSON response in the format of the
route's API. `from_failure` maps the scheduler's `RequestFailed` codes.
"""

from __future__ import annotations

import math
from typing import Any

from starlette.responses import JSONResponse

from switchyard.proto.gateway_scheduler import RequestFailed

# Failure codes the gateway itself puts into request streams (the scheduler sends the others).
CODE_COMPONENT_RESTARTED = "component_restarted"
CODE_SCHEDULER_UNAVAILABLE = "scheduler_unavailable"
CODE_SHUTTING_DOWN = "gateway_shutting_down"

# Seconds a client is told to wait when the scheduler gives no better figure.
DEFAULT_RETRY_AFTER_S = 1.0

STYLE_OPENAI, STYLE_ANTHROPIC = "openai", "anthropic"
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                    429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
                    529: "overloaded_error"}


def api_style(path: str) -> str:
    """Which API's error format a route speaks."""
    return STYLE_ANTHROPIC if path.startswith("/v1/messages") else STYLE_OPENAI


class APIError(Exception):
    """A request that ends with an HTTP error in OpenAI's error format."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 retry_after_s: float | None = None,
                 headers: dict[str, str] | None = None,
                 anthropic_message: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        # Where Anthropic's API words the error otherwise (the context limit).
        self.anthropic_message = anthropic_message or message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})
        if retry_after_s is not None:
            self.headers["Retry-After"] = str(max(1, math.ceil(retry_after_s)))

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def anthropic_body(self) -> dict[str, Any]:
        kind = _ANTHROPIC_TYPES.get(self.status) or (
            "invalid_request_error" if self.status < 500 else "api_error")
        return {"type": "error", "error": {"type": kind, "message": self.anthropic_message}}

    def body_in(self, style: str) -> dict[str, Any]:
        return self.anthropic_body() if style == STYLE_ANTHROPIC else self.body()

    def response(self, style: str = STYLE_OPENAI) -> JSONResponse:
        return JSONResponse(self.body_in(style), status_code=self.status, headers=self.headers)


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 for a request the client must change."""
    return APIError(400, message, param=param, code=code)


def invalid_type(param: str, expected: str) -> APIError:
    return invalid(f"'{param}' must be {expected}", param=param, code="invalid_type")


def out_of_range(param: str, allowed: str) -> APIError:
    return invalid(f"'{param}' must be {allowed}", param=param, code="invalid_value")


def context_length_exceeded(num_prompt_tokens: int, ctx: int, param: str = "messages", *,
                            at_least: bool = False) -> APIError:
    """A prompt that leaves no token of the context to generate, in the words each client
    parses to compact its conversation (docs/design/requests.md "The context limit"): OpenAI's
    (Qwen Code, opencode: "maximum context length is M tokens ... resulted in N tokens"),
    Anthropic's (Claude Code: "prompt is too long: N tokens > M maximum", M the longest
    prompt). `at_least`: N is a lower bound (counted before tokenizing)."""
    bound = "at least " if at_least else ""
    return APIError(
        400, f"This model's maximum context length is {ctx} tokens. However, your messages "
        f"resulted in {bound}{num_prompt_tokens} tokens (at least one token must be left to "
        f"generate). Please reduce the length of the messages.",
        param=param, code="context_length_exceeded",
        anthropic_message=f"prompt is too long: {bound}{num_prompt_tokens} tokens > "
                          f"{ctx - 1} maximum")


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model '{model}' does not exist", param="model",
                    code="model_not_found")


def unavailable(message: str, code: str = CODE_SCHEDULER_UNAVAILABLE,
                retry_after_s: float = DEFAULT_RETRY_AFTER_S) -> APIError:
    return APIError(503, message, type="service_unavailable_error", code=code,
                    retry_after_s=retry_after_s)


_RETRYABLE_503 = (CODE_COMPONENT_RESTARTED, CODE_SCHEDULER_UNAVAILABLE, CODE_SHUTTING_DOWN)


def from_failure(failed: RequestFailed) -> APIError:
    """The HTTP error for a request the scheduler (or the gateway's client) failed."""
    retry_after = failed.retry_after_s if failed.retry_after_s > 0 else DEFAULT_RETRY_AFTER_S
    if failed.code == "queue_full":
        return APIError(429, failed.message or "The server is busy; retry later.",
                        type="rate_limit_error", code="queue_full", retry_after_s=retry_after)
    if failed.code == "invalid_image":  # the worker's processor refused an image
        return invalid(failed.message or "An image could not be used.", param="messages",
                       code="invalid_image")
    if failed.code == "context_length_exceeded":
        return invalid(failed.message or "The prompt does not fit the context.",
                       param="messages", code="context_length_exceeded")
    if failed.code in _RETRYABLE_503:
        return unavailable(failed.message or "A server component restarted; retry.",
                           code=failed.code, retry_after_s=retry_after)
    return APIError(500, failed.message or "Internal server error", type="server_error",
                    code=failed.code or "internal_error")


class Abandoned(Exception):
    """Request work (rendering, tokenizing) whose client left: stopped at its next step."""
