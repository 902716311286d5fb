"""Fields more than one API declares: sampling, scheduling and cache options, each with its
range stated once (the validators and /openapi.json both read it from here)."""

from __future__ import annotations

from typing import Annotated, Any

from msgspec import Meta

from switchyard.gateway.request.wire.base import FieldCheck, FieldError, integer
from switchyard.gateway.request.wire.decoding import note_ignored
from switchyard.proto.base import PRIORITIES, PRIORITY_BACKGROUND, PRIORITY_INTERACTIVE
from switchyard.common.tenants import MAX_CACHE_SALT_CHARS

INT32_MIN, INT32_MAX = -2**31, 2**31 - 1  # every integer that reaches the wire must fit msgpack
INT64_MIN, UINT64_MAX = -2**63, 2**64 - 1
MAX_STOP = 16  # stop strings (Chat, Completions) and stop_sequences (Messages)
MAX_TOOLS = 512
# `chat_template_kwargs` are the template's variables (enable_thinking, reasoning_effort, ...).
# A key that is an argument of `apply_chat_template` itself would let a request replace the
# model's template (`chat_template`: the client's own Jinja, run with no time or memory
# bound) or what the gateway passes it: refused. Templates come from the model or the
# operator, never a request.
RESERVED_TEMPLATE_KEYS = frozenset({
    "chat_template", "messages", "conversation", "tools", "documents",
    "add_generation_prompt", "continue_final_message", "tokenize", "sanitize_control_tokens",
    "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})
# The variables' JSON: enough for flags and short strings, never a second prompt (a value the
# template prints or loops over is bounded by it).
MAX_TEMPLATE_KWARGS_BYTES = 16 * 1024

ModelName = Annotated[str, Meta(description="null: the served model")]
MaxTokens = integer(lo=1)
Temperature = Annotated[float, Meta(ge=0, le=2)]
TopP = Annotated[float, Meta(gt=0, le=1)]
TopK = integer(lo=0, hi=INT32_MAX)


class PriorityLevel(FieldCheck):
    """`priority` as a named class, or as SGLang's and vLLM's integer (lower runs first; routers
    such as SMG always send one): 0 and below is interactive, above 0 background. The one place
    an integer becomes a class, so every API reads a name from here on."""

    TEXT = " or ".join(f"'{p}'" for p in PRIORITIES) + \
        f" or an integer between {INT32_MIN} and {INT32_MAX}"

    def check(self, value: Any, field: str) -> str:
        if isinstance(value, str):
            if value not in PRIORITIES:
                raise FieldError(field, f"must be {self.TEXT}")
            return value
        if isinstance(value, float) and not value.is_integer():
            raise FieldError(field, "must be an integer", "invalid_type")
        if not INT32_MIN <= value <= INT32_MAX:
            raise FieldError(field, f"must be {self.TEXT}")
        return PRIORITY_INTERACTIVE if value <= 0 else PRIORITY_BACKGROUND


Priority = Annotated[str | int | float, Meta(extra_json_schema={"oneOf": [
    {"enum": list(PRIORITIES)}, {"type": "integer", "minimum": INT32_MIN, "maximum": INT32_MAX}]},
    description=("a class, or SGLang's and vLLM's integer: lower runs first, 0 and below "
                 "interactive, above 0 background")), PriorityLevel()]
Speculative = Annotated[bool, Meta(description=(
    "false: no speculative decoding for this request (the output is the same either way; "
    "this only changes speed)"))]
CacheSalt = Annotated[str, Meta(min_length=1, max_length=MAX_CACHE_SALT_CHARS, description=(
    "vLLM's cache_salt: cached text (prefix pages, speculative drafts) is shared only with "
    "requests of the same API key giving the same salt"))]


class EffortLevel(FieldCheck):
    """Reasoning effort as chat templates take it (`reasoning_effort`: gpt-oss's low/medium/
    high), decided as the body is decoded: the other APIs' names for the ends of the scale map
    to the nearest, "none" is no effort, and a value this server does not know is logged (as
    `param`, the member's path in its API) and not applied."""

    EFFORTS = {"minimal": "low", "low": "low", "medium": "medium", "high": "high",
               "xhigh": "high", "max": "high"}

    def __init__(self, param: str) -> None:
        self.param = param

    def check(self, value: str, field: str) -> str | None:
        effort = self.EFFORTS.get(value)
        if effort is None and value != "none":
            note_ignored(f"{self.param}={value[:32]}")
        return effort


def effort_level(param: str) -> Any:
    """A reasoning-effort member at `param` (its model is `Checked`): the template's value or
    None."""
    return Annotated[str, Meta(description=(
        "the chat template's reasoning_effort: low, medium or high (minimal is low; xhigh and max "
        "are high); another value is logged and not applied")), EffortLevel(param)]


NonEmpty = Annotated[str, Meta(min_length=1)]
IMAGE_URL = Annotated[str, Meta(extra_json_schema={
    "pattern": "^(data:[^,]*;base64,|[Hh][Tt][Tt][Pp][Ss]?://)"}, description=(
    "a data: URL (data:image/png;base64,...) or, when the server fetches images "
    "(--image-fetch), an http(s) URL; the image is PNG, JPEG, WebP, GIF or BMP"))]
TemplateKwargs = Annotated[dict[str, Any], Meta(
    extra_json_schema={"propertyNames": {"not": {"enum": sorted(RESERVED_TEMPLATE_KEYS)}}},
    description=("the chat template's variables (enable_thinking, reasoning_effort, ...), never "
                 "the template or an argument of its rendering; at most "
                 f"{MAX_TEMPLATE_KWARGS_BYTES // 1024} KiB as JSON (else a 400)"))]
JsonObject = dict[str, Any]
AnyValue = Any  # accepted and not used


def needs_tools(choice: dict[str, Any], tool: dict[str, Any] | None = None) -> dict[str, Any]:
    """The schema rule every API states: a `tool_choice` that matches `choice` (one that forces
    a call) needs `tools` with a tool to call (one that matches `tool`, where only some do).
    Which tool it names is checked at runtime (request/tools.py: a 400)."""
    tools: dict[str, Any] = {"type": "array", "minItems": 1}
    if tool is not None:
        tools["contains"] = tool
    return {"if": {"required": ["tool_choice"], "properties": {"tool_choice": choice}},
            "then": {"required": ["tools"], "properties": {"tools": tools}}}
