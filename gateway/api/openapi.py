"""An OpenAPI 3.1 description of the gateway's endpoints, served at `GET /openapi.json`.

Request schemas list the fields the gateway reads (unknown fields are ignored, as the upstream
APIs do); response schemas name the top-level shape. The reference for every field's meaning
is the upstream API (OpenAI, Anthropic); differences are noted in the descriptions.
"""

from __future__ import annotations

from typing import Any

_OBJ = {"type": "object"}
_STR = {"type": "string"}
_INT = {"type": "integer"}
_NUM = {"type": "number"}
_BOOL = {"type": "boolean"}


def _arr(items: dict[str, Any]) -> dict[str, Any]:
    return {"type": "array", "items": items}


def _schema(required: list[str], **properties: Any) -> dict[str, Any]:
    return {"type": "object", "required": required, "properties": properties,
            "additionalProperties": True}


OPENAI_ERROR = _schema(["error"], error=_schema(
    ["message", "type"], message=_STR, type=_STR, param={"type": ["string", "null"]},
    code={"type": ["string", "null"]}))
ANTHROPIC_ERROR = _schema(["type", "error"], type={"const": "error"},
                          error=_schema(["type", "message"], type=_STR, message=_STR))

_SAMPLING = dict(temperature=_NUM, top_p=_NUM, top_k=_INT, min_p=_NUM, seed=_INT,
                 stream=_BOOL, priority={"enum": ["interactive", "background"]})
_TOOL_CHOICE = {"oneOf": [{"enum": ["auto", "none", "required"]}, _OBJ]}

CHAT_REQUEST = _schema(
    ["messages"], model=_STR, messages=_arr(_OBJ), max_tokens=_INT, max_completion_tokens=_INT,
    stop={"oneOf": [_STR, _arr(_STR)]}, stream_options=_OBJ, tools=_arr(_OBJ),
    tool_choice=_TOOL_CHOICE, parallel_tool_calls=_BOOL, chat_template_kwargs=_OBJ,
    user=_STR, **_SAMPLING)
COMPLETION_REQUEST = _schema(
    ["prompt"], model=_STR, prompt={"oneOf": [_STR, _arr(_INT)]}, max_tokens=_INT,
    stop={"oneOf": [_STR, _arr(_STR)]}, stream_options=_OBJ, **_SAMPLING)
MESSAGES_REQUEST = _schema(
    ["model", "max_tokens", "messages"], model=_STR, max_tokens=_INT, messages=_arr(_OBJ),
    system={"oneOf": [_STR, _arr(_OBJ)]}, stop_sequences=_arr(_STR), tools=_arr(_OBJ),
    tool_choice=_OBJ, thinking=_OBJ, metadata=_OBJ, **_SAMPLING)
COUNT_TOKENS_REQUEST = _schema(
    ["messages"], model=_STR, messages=_arr(_OBJ), system={"oneOf": [_STR, _arr(_OBJ)]},
    tools=_arr(_OBJ), tool_choice=_OBJ, thinking=_OBJ)
RESPONSES_REQUEST = _schema(
    ["input"], model=_STR, input={"oneOf": [_STR, _arr(_OBJ)]}, instructions=_STR,
    previous_response_id=_STR, max_output_tokens=_INT, tools=_arr(_OBJ),
    tool_choice=_TOOL_CHOICE, parallel_tool_calls=_BOOL, store=_BOOL, text=_OBJ,
    reasoning=_OBJ, user=_STR, **_SAMPLING)


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"content": {"application/json": {"schema": schema}}}


def _post(summary: str, description: str, request: dict[str, Any], ok: dict[str, Any],
          error: dict[str, Any], streams: bool = True) -> dict[str, Any]:
    content = {"application/json": {"schema": ok}}
    if streams:
        content["text/event-stream"] = {"schema": _STR}
    return {"post": {
        "summary": summary, "description": description,
        "requestBody": {"required": True, **_json(request)},
        "responses": {"200": {"description": "OK", "content": content},
                      "4XX": {"description": "Bad request, auth, queue full", **_json(error)},
                      "5XX": {"description": "Server or component unavailable",
                              **_json(error)}}}}


def openapi_spec(model_id: str, version: str = "1") -> dict[str, Any]:
    return {
        "openapi": "3.1.0",
        "info": {"title": "Switchyard", "version": version,
                 "description": "Local LLM server for agents. OpenAI (Chat Completions, "
                                "Completions, Responses) and Anthropic (Messages) APIs for "
                                f"the model '{model_id}'. Usage reports cached prompt "
                                "tokens in each API's own fields."},
        "components": {"securitySchemes": {
            "bearer": {"type": "http", "scheme": "bearer"},
            "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"}}},
        "security": [{"bearer": []}, {"apiKey": []}],
        "paths": {
            "/v1/chat/completions": _post(
                "Chat completion (OpenAI)",
                "Tools with tool_choice auto/none/required/named and parallel_tool_calls; "
                "reasoning returned as reasoning_content; n must be 1.",
                CHAT_REQUEST, _schema(["id", "choices", "usage"], choices=_arr(_OBJ),
                                      usage=_OBJ), OPENAI_ERROR),
            "/v1/completions": _post(
                "Text completion (OpenAI)", "One prompt (text or token ids) per request.",
                COMPLETION_REQUEST, _schema(["id", "choices", "usage"], choices=_arr(_OBJ)),
                OPENAI_ERROR),
            "/v1/responses": _post(
                "Response (OpenAI Responses API)",
                "Input items: messages, function_call, function_call_output, reasoning. "
                "A previous_response_id the server no longer has is a 400: send the full "
                "input.",
                RESPONSES_REQUEST, _schema(["id", "output", "status"], output=_arr(_OBJ)),
                OPENAI_ERROR),
            "/v1/messages": _post(
                "Message (Anthropic Messages API)",
                "Text, tool_use, tool_result and thinking blocks; any model name is "
                "accepted and echoed. Volatile billing-header lines at the start of the "
                "system prompt are removed.",
                MESSAGES_REQUEST, _schema(["id", "content", "usage"], content=_arr(_OBJ)),
                ANTHROPIC_ERROR),
            "/v1/messages/count_tokens": _post(
                "Count prompt tokens (Anthropic)", "The prompt as it would be rendered.",
                COUNT_TOKENS_REQUEST, _schema(["input_tokens"], input_tokens=_INT),
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
