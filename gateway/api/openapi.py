"""An OpenAPI 3.1 description of the gateway's endpoints, served at `GET /openapi.json`.

Request schemas list the fields the gateway reads (unknown fields are ignored, as the upstream
APIs do); response schemas name the top-level shape. The reference for every field's meaning
is the upstream API (OpenAI, Anthropic); differences are noted in the descriptions.
"""

from __future__ import annotations

from typing import Any

from switchyard.gateway.request.wire import anthropic, common
from switchyard.gateway.request.wire.schema import request_schema, type_schema

_OBJ = {"type": "object"}
_STR = {"type": "string"}
_NONEMPTY = {"type": "string", "minLength": 1}
_INT = {"type": "integer"}
_NUM = {"type": "number"}
_BOOL = {"type": "boolean"}
_NULL = {"type": "null"}
_MODEL = {"type": ["string", "null"]}  # null: the served model
INT64_MIN, UINT64_MAX = -2**63, 2**64 - 1


def _arr(items: dict[str, Any], **constraints: Any) -> dict[str, Any]:
    return {"type": "array", "items": items, **constraints}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, _NULL]}


def _schema(required: list[str], **properties: Any) -> dict[str, Any]:
    """An object: the parsers read an optional field given as null as absent (as OpenAI's
    API does), so every optional property is declared nullable (issue 23, finding 11)."""
    return {"type": "object", "required": required,
            "properties": {k: v if k in required else _nullable(v)
                           for k, v in properties.items()},
            "additionalProperties": True}


def _any(*options: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": list(options)}


OPENAI_ERROR = _schema(["error"], error=_schema(
    ["message", "type"], message=_STR, type=_STR, param={"type": ["string", "null"]},
    code={"type": ["string", "null"]}))
ANTHROPIC_ERROR = _schema(["type", "error"], type={"const": "error"},
                          error=_schema(["type", "message"], type=_STR, message=_STR))

# What the validators enforce (gateway/api/validation.py and each API's parser), so that every
# request this schema allows is accepted. Rules a JSON schema cannot state are in descriptions:
# a named tool_choice must name one of `tools`; "required" needs `tools`; a
# previous_response_id must be one this server still keeps; the prompt must fit the context.
_TEMPERATURE = type_schema(common.Temperature)
_TOP_P = type_schema(common.TopP)
_TOP_K = type_schema(common.TopK)
_PRIORITY = type_schema(common.Priority)
_SPECULATIVE = type_schema(common.Speculative)
_CACHE_SALT = type_schema(common.CacheSalt)
_MAX_TOKENS = type_schema(common.MaxTokens)
_EFFORT = type_schema(common.Effort)
_STOP = _any(_STR, _arr(_STR, maxItems=common.MAX_STOP))
_NO_CALLS = _arr(_OBJ, maxItems=0)


def _sampling(**extra: Any) -> dict[str, Any]:
    return dict(temperature=_TEMPERATURE, top_p=_TOP_P, top_k=_TOP_K,
                min_p={"type": "number", "minimum": 0, "maximum": 1},
                seed={"type": "integer", "minimum": INT64_MIN, "maximum": UINT64_MAX},
                stream=_BOOL, priority=_PRIORITY, speculative=_SPECULATIVE,
                cache_salt=_CACHE_SALT, **extra)


_RESPONSE_FORMAT = {
    "oneOf": [_schema(["type"], type={"enum": ["text", "json_object"]}),
              _schema(["type", "json_schema"], type={"const": "json_schema"},
                      json_schema=_schema(["schema"], name=_STR, strict=_BOOL,
                                          schema=_OBJ))],
    "description": "also the guided_json / guided_choice / guided_regex fields (structured "
                   "outputs: the schema must be one the grammar compiler supports, else a 400 "
                   "naming what it does not)"}


# -- images (a vision-language model's spec only; gateway/vision/parts.py) --------------------

_IMAGE_URL = {"type": "string", "pattern": "^(data:[^,]*;base64,|[Hh][Tt][Tt][Pp][Ss]?://)",
              "description": "a data: URL (data:image/png;base64,...) or, when the server "
                             "fetches images (--image-fetch), an http(s) URL; the image is PNG, "
                             "JPEG, WebP, GIF or BMP"}
_DETAIL = {"enum": ["auto", "low", "high"],
           "description": "accepted as in OpenAI's API; the model sees every image at the "
                          "resolution its processor makes of it"}
_IMAGE_URL_PART = _schema(["type", "image_url"], type={"const": "image_url"},
                          image_url=_any(_schema(["url"], url=_IMAGE_URL, detail=_DETAIL),
                                         _IMAGE_URL))
_R_IMAGE = _schema(["type", "image_url"], type={"const": "input_image"}, image_url=_IMAGE_URL,
                   detail=_DETAIL)


def _with_images(text_part: dict[str, Any], image_part: dict[str, Any],
                 images: bool) -> dict[str, Any]:
    """Content: a string, or parts (text, and images when the model takes them)."""
    return _any(_STR, _arr(_any(text_part, image_part) if images else text_part))


def _logit_bias(vocab_size: int) -> dict[str, Any]:
    # Keys are token ids; with fewer digits than the vocabulary's size, every id is in it.
    digits = max(1, len(str(vocab_size)) - 1)
    return {"type": "object", "maxProperties": 1024,
            "propertyNames": {"pattern": f"^[0-9]{{1,{digits}}}$"},
            "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
            "description": "token id -> bias added to its logit, as in OpenAI's API"}


# -- OpenAI Chat Completions ------------------------------------------------------------------

_TEXT_PART = _schema(["type", "text"], type={"const": "text"}, text=_STR)
_CHAT_CONTENT = _any(_STR, _arr(_TEXT_PART))
_CHAT_TOOL_CALL = _schema(
    ["function"], id=_STR, type={"const": "function"},
    function=_schema(["name"], name=_NONEMPTY, arguments=_any(_STR, _OBJ)))


def _chat_message(images: bool) -> dict[str, Any]:
    """Images only in user messages and tool results."""
    def message(roles: list[str], content: dict[str, Any]) -> dict[str, Any]:
        return _schema(["role", "content"], role={"enum": roles}, content=content, name=_STR,
                       tool_call_id=_STR, reasoning_content=_STR, reasoning=_STR,
                       tool_calls=_NO_CALLS)

    return {"oneOf": [
        message(["system", "developer", "function"], _CHAT_CONTENT),
        message(["user", "tool"], _with_images(_TEXT_PART, _IMAGE_URL_PART, images)),
        _schema(["role"], role={"const": "assistant"}, content=_any(_CHAT_CONTENT, _NULL),
                name=_STR, tool_call_id=_STR, reasoning_content=_STR, reasoning=_STR,
                tool_calls=_arr(_CHAT_TOOL_CALL)),
    ]}

_FUNCTION = _schema(["name"], name=_NONEMPTY, description=_STR, parameters=_OBJ,
                    strict=_BOOL)
_CHAT_TOOL = _schema(["function"], type={"const": "function"}, function=_FUNCTION)
_CHAT_TOOL_CHOICE = _any(
    {"enum": ["auto", "none", "required"]},
    _schema(["type", "function"], type={"const": "function"},
            function=_schema(["name"], name=_NONEMPTY)))
# "required" or a named choice needs tools (the name must be one of them: not stateable).


def _needs_tools(choice: dict[str, Any], tool: dict[str, Any] | None = None) -> dict[str, Any]:
    """When `choice` forces a call, `tools` must hold a tool it can call (`tool`: one the
    server serves; other tool types are skipped)."""
    tools: dict[str, Any] = {"type": "array", "minItems": 1}
    if tool is not None:
        tools["contains"] = tool
    return {"if": {"required": ["tool_choice"], "properties": {"tool_choice": choice}},
            "then": {"required": ["tools"], "properties": {"tools": tools}}}


_NEEDS_TOOLS = _needs_tools({"not": {"enum": ["auto", "none", None]}})
_R_NEEDS_TOOLS = _needs_tools({"not": {"enum": ["auto", "none", None]}}, _any(
    {"type": "object", "required": ["type"], "properties": {"type": {"const": "function"}}},
    {"type": "object", "required": ["type", "tools"],
     "properties": {"type": {"const": "namespace"},
                    "tools": {"type": "array", "contains": {
                        "type": "object", "required": ["type"],
                        "properties": {"type": {"const": "function"}}}}}}))
_TOOL_CHOICE_RULE = ("'required' or a named function needs 'tools', and the name must be one "
                     "of them")


_TEMPLATE_KWARGS = {
    "type": "object", "propertyNames": {"not": {"enum": sorted(common.RESERVED_TEMPLATE_KEYS)}},
    "description": "the chat template's variables (enable_thinking, reasoning_effort, ...), "
                   "never the template or an argument of its rendering; at most "
                   f"{common.MAX_TEMPLATE_KWARGS_BYTES // 1024} KiB as JSON (else a 400)"}


def chat_request(vocab_size: int, images: bool = False) -> dict[str, Any]:
    return _schema(
        ["messages"], model=_MODEL, messages=_arr(_chat_message(images), minItems=1),
        max_tokens=_MAX_TOKENS, max_completion_tokens=_MAX_TOKENS, n={"const": 1},
        stop=_STOP, stream_options=_schema([], include_usage=_BOOL),
        tools=_arr(_CHAT_TOOL, maxItems=common.MAX_TOOLS),
        tool_choice={**_CHAT_TOOL_CHOICE, "description": _TOOL_CHOICE_RULE},
        parallel_tool_calls=_BOOL, chat_template_kwargs=_TEMPLATE_KWARGS, user=_STR,
        reasoning_effort=_EFFORT, prompt_cache_key=_STR,
        logprobs={"const": False}, top_logprobs={"const": 0},
        response_format=_RESPONSE_FORMAT,
        logit_bias=_logit_bias(vocab_size), **_sampling()) | _NEEDS_TOOLS


def completion_request(vocab_size: int) -> dict[str, Any]:
    token_ids = _arr({"type": "integer", "minimum": 0, "maximum": vocab_size - 1}, minItems=1)
    return _schema(
        ["prompt"], model=_MODEL,
        prompt={**_any(_NONEMPTY, token_ids, _arr(_NONEMPTY, minItems=1, maxItems=1),
                       _arr(token_ids, minItems=1, maxItems=1)),
                "description": "one prompt: text or token ids, alone or as a batch of one"},
        max_tokens=_MAX_TOKENS,
        n={"const": 1}, stop=_STOP, stream_options=_schema([], include_usage=_BOOL), user=_STR,
        logprobs={"const": 0}, echo={"const": False}, suffix={"const": ""},
        best_of={"const": 1}, response_format=_RESPONSE_FORMAT,
        logit_bias=_logit_bias(vocab_size), **_sampling())


# -- OpenAI Responses -------------------------------------------------------------------------

_R_PART = _schema(["type", "text"], type={"enum": ["input_text", "output_text", "text",
                                                   "summary_text", "reasoning_text"]},
                  text=_STR)
_R_TEXT = _any(_STR, _arr(_R_PART))


def _r_item(images: bool) -> dict[str, Any]:
    """Images in user messages and function call outputs."""
    with_images = _with_images(_R_PART, _R_IMAGE, images)
    return {"oneOf": [
        # A message's `type` may be left out (OpenAI's EasyInputMessage).
        _schema(["role", "content"], type={"const": "message"},
                role={"enum": ["system", "developer", "assistant"]}, content=_R_TEXT),
        _schema(["role", "content"], type={"const": "message"},
                role={"const": "user"}, content=with_images),
        _schema(["type", "call_id", "name"], type={"const": "function_call"},
                call_id=_NONEMPTY, name=_NONEMPTY, arguments=_STR),
        _schema(["type", "call_id"], type={"const": "function_call_output"},
                call_id=_NONEMPTY, output=with_images),
        _schema(["type"], type={"const": "reasoning"}, content=_R_TEXT, summary=_R_TEXT),
    ]}

_R_FUNCTION = _schema(["type", "name"], type={"const": "function"}, name=_NONEMPTY,
                      description=_STR, parameters=_OBJ, strict=_BOOL)
_R_BUILT_IN = _schema(["type"], type={"type": "string",
                                      "not": {"enum": ["function", "namespace"]}})
_R_TOOL = {"anyOf": [
    _R_FUNCTION,
    _schema(["type", "name"], type={"const": "namespace"}, name=_NONEMPTY, description=_STR,
            tools=_arr(_any(_R_FUNCTION, _R_BUILT_IN))),
    _R_BUILT_IN],
    "description": "a namespace's functions are offered as functions (a call comes back with "
                   "its namespace); a built-in tool (web search, file search, ...) is not "
                   "available here and is left out; a function name offered twice is a 400"}
_R_TOOL_CHOICE = _any(
    {"enum": ["auto", "none", "required"]},
    _schema(["type", "name"], type={"const": "function"}, name=_NONEMPTY))


def responses_request(images: bool = False) -> dict[str, Any]:
    return _schema(
        ["input"], model=_MODEL, input=_any(_STR, _arr(_r_item(images), minItems=1)),
        instructions=_STR,
        previous_response_id={**_STR, "description": "a response this server still keeps "
                                                     "(recent ones, in memory); else a 400"},
        max_output_tokens=_MAX_TOKENS, tools=_arr(_R_TOOL),
        tool_choice={**_R_TOOL_CHOICE, "description": _TOOL_CHOICE_RULE},
        parallel_tool_calls=_BOOL, store=_BOOL,
        text=_schema([], format={"oneOf": [
            _schema(["type"], type={"enum": ["text", "json_object"]}),
            _schema(["type", "schema"], type={"const": "json_schema"}, name=_STR,
                    strict=_BOOL, schema=_OBJ)]}),
        reasoning=_schema([], effort=_EFFORT, summary=_STR), include=_arr(_STR),
        prompt_cache_key=_STR, client_metadata=_OBJ, metadata=_OBJ, user=_STR, temperature=_TEMPERATURE, top_p=_TOP_P, stream=_BOOL,
        priority=_PRIORITY, speculative=_SPECULATIVE, cache_salt=_CACHE_SALT) | _R_NEEDS_TOOLS


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"content": {"application/json": {"schema": schema}}}


# What a schema cannot state: a valid-looking request the server refuses with a 400, in the
# API's own error format (issue 23, finding 11).
_SEMANTIC_400S = (
    "A request the schema allows is still refused (400, the error names the field) when: "
    "tool_choice names a function that is not in tools; a function name is offered twice "
    "(a Responses namespace's included); a previous_response_id is not one "
    "this server still keeps; the prompt does not fit the context; a structured-output "
    "schema or grammar uses what the grammar compiler does not support, or is too complex "
    "to compile within its time bound; the chat template rejects the messages; "
    "chat_template_kwargs is larger than its bound; the grammar of the tools' calls (their "
    "names and parameter schemas) is larger than 64 KiB; an image "
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
                chat_request(vocab_size, images),
                _schema(["id", "choices", "usage"], choices=_arr(_OBJ), usage=_OBJ),
                OPENAI_ERROR),
            "/v1/completions": _post(
                "Text completion (OpenAI)", "One prompt (text or token ids) per request.",
                completion_request(vocab_size),
                _schema(["id", "choices", "usage"], choices=_arr(_OBJ)), OPENAI_ERROR),
            "/v1/responses": _post(
                "Response (OpenAI Responses API)",
                "Input items: messages, function_call, function_call_output, reasoning. "
                "A previous_response_id the server no longer has is a 400: send the full "
                "input.",
                responses_request(images), _schema(["id", "output", "status"], output=_arr(_OBJ)),
                OPENAI_ERROR),
            "/v1/messages": _post(
                "Message (Anthropic Messages API)",
                "Text, image (a vision model), tool_use, tool_result and thinking blocks; "
                "any model name is "
                "accepted and echoed. Volatile billing-header lines at the start of the "
                "system prompt are removed.",
                request_schema(anthropic.MessagesRequest, images=images),
                _schema(["id", "content", "usage"], content=_arr(_OBJ)),
                ANTHROPIC_ERROR),
            "/v1/messages/count_tokens": _post(
                "Count prompt tokens (Anthropic)", "The prompt as it would be rendered.",
                request_schema(anthropic.CountTokensRequest, images=images),
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
