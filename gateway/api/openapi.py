"""An OpenAPI 3.1 description of the gateway's endpoints, served at `GET /openapi.json`.

Request schemas are made from each API's request model (gateway/request/wire/: the same
declarations the gateway validates with), so they list the fields the gateway reads (unknown
fields are ignored, as the upstream APIs do); response schemas name the top-level shape. The
reference for every field's meaning is the upstream API (OpenAI, Anthropic); differences are
noted in the descriptions.
"""

from __future__ import annotations

from typing import Any

from switchyard.gateway.request.wire import anthropic, openai, responses
from switchyard.gateway.request.wire.schema import request_schema

_OBJ = {"type": "object"}
_STR = {"type": "string"}
_INT = {"type": "integer"}
_NULL = {"type": "null"}


def _arr(items: dict[str, Any], **constraints: Any) -> dict[str, Any]:
    return {"type": "array", "items": items, **constraints}


def _schema(required: list[str], **properties: Any) -> dict[str, Any]:
    """A response object: every optional property may be null."""
    return {"type": "object", "required": required,
            "properties": {k: v if k in required else {"anyOf": [v, _NULL]}
                           for k, v in properties.items()},
            "additionalProperties": True}


OPENAI_ERROR = _schema(["error"], error=_schema(
    ["message", "type"], message=_STR, type=_STR, param={"type": ["string", "null"]},
    code={"type": ["string", "null"]}))
ANTHROPIC_ERROR = _schema(["type", "error"], type={"const": "error"},
                          error=_schema(["type", "message"], type=_STR, message=_STR))


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"content": {"application/json": {"schema": schema}}}


# What a schema cannot state: a valid-looking request the server refuses with a 400, in the
# API's own error format.
_SEMANTIC_400S = (
    "A request the schema allows is still refused (400, the error names the field) when: "
    "tool_choice names a function that is not in tools; a function name is offered twice "
    "(a Responses namespace's included); a previous_response_id is not one "
    "this server still keeps; the prompt does not fit the context; a structured-output "
    "schema or grammar uses what the grammar compiler does not support, or is too complex "
    "to compile within its time bound; the chat template rejects the messages; "
    "chat_template_kwargs is larger than its bound; the grammar of the tools' calls (their "
    "names and parameter schemas) is larger than 64 KiB, or a call the request forces (a "
    "strict tool, a required or named tool_choice) has a parameter schema the grammar "
    "compiler does not take; an image "
    "(a vision model's) is not one this server takes: bytes that are not a PNG, JPEG, WebP, "
    "GIF or BMP image, a data URL that is not base64, more pixels than --max-image-pixels, "
    "more images in the request than --max-images, or an http(s) URL while fetching is off "
    "(--image-fetch).")


def _post(summary: str, description: str, request: dict[str, Any], ok: dict[str, Any],
          error: dict[str, Any], streams: bool = True) -> dict[str, Any]:
    content = {"application/json": {"schema": ok}}
    if streams:
        content["text/event-stream"] = {"schema": _schema([], data=_STR, event=_STR, id=_STR)}
    return {"post": {
        "summary": summary, "description": description,
        "requestBody": {"required": True, **_json(request)},
        "responses": {"200": {"description": "OK", "content": content},
                      "400": {"description": _SEMANTIC_400S, **_json(error)},
                      "4XX": {"description": "Bad request, auth, queue full", **_json(error)},
                      "5XX": {"description": "Server or component unavailable",
                              **_json(error)}}}}


def openapi_spec(model_id: str, version: str = "1", *, vocab_size: int = 2**31,
                 api_key: bool = False, images: bool = False) -> dict[str, Any]:
    """The description; security is declared only when the server requires a key. With
    `images` (a vision-language model) the request schemas take image content in each API's
    own shape (Chat `image_url` parts, Messages `image` blocks, also in tool results, Responses
    `input_image`); whether the bytes are an image the server takes no schema can say (a 400,
    `_SEMANTIC_400S`)."""
    model = {"images": images, "vocab_size": vocab_size}
    spec = {
        "openapi": "3.1.0",
        "info": {"title": "Switchyard", "version": version,
                 "description": "Local LLM server for agents. OpenAI (Chat Completions, "
                                "Completions, Responses) and Anthropic (Messages) APIs for "
                                f"the model '{model_id}'. Usage reports cached prompt "
                                "tokens in each API's own fields." + (
                                    " The model takes images: Chat image_url parts, "
                                    "Messages image blocks (user turns, tool results), "
                                    "Responses input_image parts, as data: URLs (base64) "
                                    "and, when the server fetches images, http(s) URLs."
                                    if images else "")},
        "paths": {
            "/v1/chat/completions": _post(
                "Chat completion (OpenAI)",
                "Tools with tool_choice auto/none/required/named and parallel_tool_calls; "
                "reasoning returned as reasoning_content; n must be 1.",
                request_schema(openai.ChatCompletionRequest, **model),
                _schema(["id", "choices", "usage"], choices=_arr(_OBJ), usage=_OBJ),
                OPENAI_ERROR),
            "/v1/completions": _post(
                "Text completion (OpenAI)", "One prompt (text or token ids) per request.",
                request_schema(openai.CompletionRequest, **model),
                _schema(["id", "choices", "usage"], choices=_arr(_OBJ)), OPENAI_ERROR),
            "/v1/responses": _post(
                "Response (OpenAI Responses API)",
                "Input items: messages, function_call, function_call_output, reasoning. "
                "A previous_response_id the server no longer has is a 400: send the full "
                "input.",
                request_schema(responses.ResponsesRequest, **model),
                _schema(["id", "output", "status"], output=_arr(_OBJ)),
                OPENAI_ERROR),
            "/v1/messages": _post(
                "Message (Anthropic Messages API)",
                "Text, image (a vision model), tool_use, tool_result and thinking blocks; "
                "any model name is "
                "accepted and echoed. Volatile billing-header lines at the start of the "
                "system prompt are removed.",
                request_schema(anthropic.MessagesRequest, **model),
                _schema(["id", "content", "usage"], content=_arr(_OBJ)),
                ANTHROPIC_ERROR),
            "/v1/messages/count_tokens": _post(
                "Count prompt tokens (Anthropic)", "The prompt as it would be rendered.",
                request_schema(anthropic.CountTokensRequest, **model),
                _schema(["input_tokens"], input_tokens=_INT),
                ANTHROPIC_ERROR, streams=False),
            "/v1/models": {"get": {"summary": "List models", "responses": {
                "200": {"description": "OK", **_json(_schema(["data"], data=_arr(_OBJ)))}}}},
            "/v1/models/{model}": {"get": {
                "summary": "Get a model",
                "parameters": [{"name": "model", "in": "path", "required": True,
                                "schema": _STR}],
                "responses": {"200": {"description": "OK", **_json(_OBJ)},
                              "404": {"description": "Unknown model",
                                      **_json(OPENAI_ERROR)}}}},
            "/health": {"get": {"summary": "Health of the process group", "security": [],
                                "responses": {"200": {"description": "Serving"},
                                              "503": {"description": "Starting or a "
                                                                     "component is down"}}}},
            "/openapi.json": {"get": {"summary": "This description", "security": [],
                                      "responses": {"200": {"description": "OK"}}}},
        },
    }
    if api_key:
        spec["components"] = {"securitySchemes": {
            "bearer": {"type": "http", "scheme": "bearer"},
            "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"}}}
        spec["security"] = [{"bearer": []}, {"apiKey": []}]
    return spec
