"""The OpenAI Responses request (`POST /v1/responses`), declared once:
gateway/api/responses_api.py translates it into the gateway's chat shape, and /openapi.json is
made from it (wire/schema.py). What a schema cannot state (a named tool must be one of `tools`,
a function is offered once, a previous_response_id this server still keeps, an image's bytes,
the context) is checked at runtime and documented as a 400.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

import msgspec
from msgspec import Meta

from switchyard.gateway.errors import invalid
from switchyard.gateway.request.wire.base import Checked, FieldError, Model, Whole
from switchyard.gateway.request.wire.decoding import decode
from switchyard.gateway.request.wire.common import (IMAGE_URL, AnyValue, effort_level, JsonObject,
                                                    MaxTokens, NonEmpty, needs_tools)
from switchyard.gateway.request.wire.openai import (FORCES_A_CALL, Detail, JsonObjectFormat,
                                                    NamedToolChoice, ResponseFormat,
                                                    ServedRequest, TextFormat)

# --- content -------------------------------------------------------------------------------------


class Part(Model, tag_field="type", kw_only=True):
    """A content part; its `type` is the tag."""


class InputText(Part, tag="input_text"):
    text: str


class OutputText(Part, tag="output_text"):
    text: str


class Text(Part, tag="text"):
    text: str


class SummaryText(Part, tag="summary_text"):
    text: str


class ReasoningText(Part, tag="reasoning_text"):
    text: str


class Refusal(Part, tag="refusal"):
    text: str = msgspec.field(name="refusal")


class InputImage(Part, tag="input_image"):
    """A vision model's image (user messages and function call outputs); `file_id` (an
    uploaded file) is not served here."""

    image: ClassVar[bool] = True
    image_url: IMAGE_URL | None = None
    file_id: AnyValue = None
    detail: Detail | None = None

    @classmethod
    def schema_rules(cls, schema: Any) -> dict[str, Any]:
        return {"required": ["image_url"], "properties": {"image_url": schema.of(IMAGE_URL)}}

    def __post_init__(self) -> None:
        if self.image_url is None and self.file_id is not None:
            raise FieldError("file_id", "uploaded files are not served here; send the image "
                             "as a data: URL in 'image_url'", "unsupported_content")


TextPart = InputText | OutputText | Text | SummaryText | ReasoningText | Refusal
TextContent = str | list[TextPart]
Content = str | list[InputText | OutputText | Text | SummaryText | ReasoningText | Refusal
                     | InputImage]


# --- input items ---------------------------------------------------------------------------------


class Item(Model, tag_field="type", kw_only=True):
    """An input item; its `type` is the tag (a message's may be left out: responses_api.py)."""


class MessageItem(Item, tag="message"):
    role: Literal["user", "system", "developer", "assistant"]
    content: Content

    @classmethod
    def schema_rules(cls, schema: Any) -> dict[str, Any]:
        # OpenAI's EasyInputMessage: `type` left out or null; images in user messages only.
        return {"optional": ["type"], "properties": {"type": {"enum": ["message", None]}},
                "if": {"properties": {"role": {"const": "user"}}},
                "else": {"properties": {"content": schema.of(TextContent)}}}

    def __post_init__(self) -> None:
        if self.role != "user" and _has_image(self.content):
            raise FieldError("content", "images are taken in user messages and function call "
                             "outputs only", "unsupported_content")


def _has_image(content: Any) -> bool:
    return isinstance(content, list) and any(isinstance(p, InputImage) for p in content)


class FunctionCallItem(Item, tag="function_call"):
    call_id: NonEmpty
    name: NonEmpty
    arguments: str | None = None


class FunctionCallOutputItem(Item, tag="function_call_output"):
    call_id: NonEmpty
    output: Content | None = None


class ReasoningItem(Item, tag="reasoning"):
    content: TextContent | None = None
    summary: TextContent | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
Input = str | Annotated[list[InputItem], Meta(min_length=1)]


# --- tools ---------------------------------------------------------------------------------------


class ToolType(Model):
    """A tool's `type`, read first: only a function's or a namespace's other members are
    checked."""

    type: str


class FunctionTool(Model):
    """A function: flat, `name`, `description`, `parameters`."""

    type: Literal["function"]
    name: NonEmpty
    description: str | None = None
    parameters: JsonObject | None = None
    strict: bool | None = None


class NamespaceTool(Model):
    """Codex's sub-agent tools: its functions are offered as functions, a call comes back with
    its namespace."""

    type: Literal["namespace"]
    name: NonEmpty
    description: str | None = None
    tools: list[dict[str, Any]] | None = None  # functions and built-in tools: tool()

    @classmethod
    def schema_rules(cls, schema: Any) -> dict[str, Any]:
        inner = {"type": "array", "items": {"anyOf": [schema.of(FunctionTool), BUILT_IN]}}
        return {"properties": {"tools": {"anyOf": [inner, {"type": "null"}]}}}


# A built-in tool (web search, file search, ...) runs on OpenAI's servers, not here: it is left
# out whatever its other members.
BUILT_IN = {"type": "object", "required": ["type"], "properties": {
    "type": {"type": "string", "not": {"enum": ["function", "namespace"]}}}}


def tool(value: dict[str, Any], param: str, in_namespace: bool = False
         ) -> FunctionTool | NamespaceTool | str:
    """A tool of `tools` (or of a namespace's): a function, a namespace, or a built-in tool's
    type."""
    kind = decode(value, ToolType, param).type
    if kind == "function":
        return decode(value, FunctionTool, param)
    if kind != "namespace":
        return kind
    if in_namespace:
        raise invalid(f"'{param}' must be a function or a built-in tool", param=param,
                      code="invalid_value")
    return decode(value, NamespaceTool, param)


class ResponsesNamedToolChoice(NamedToolChoice):
    """`{"type": "function", "name"}`; another type forces a built-in tool: a 400."""

    type: str

    @classmethod
    def schema_rules(cls, schema: Any) -> dict[str, Any]:
        return {"required": ["name"], "properties": {
            "type": {"const": "function"}, "name": {"type": "string", "minLength": 1}}}

    def __post_init__(self) -> None:
        if self.type != "function":
            raise FieldError("", f"forces the built-in tool '{self.type[:64]}', which runs on "
                             "OpenAI's servers; this server runs only the functions in 'tools'",
                             "unsupported_value")
        super().__post_init__()


ResponsesToolChoice = Annotated[Literal["auto", "none", "required"] | ResponsesNamedToolChoice, Meta(description=(
    "'required' or a named function needs 'tools', and the name must be one of them")),
    Whole("'auto', 'none', 'required' or a function", scope="all")]


# --- structured outputs --------------------------------------------------------------------------


class JsonSchemaFormat(ResponseFormat, tag="json_schema"):
    """The json_schema fields sit on the format itself."""

    schema: JsonObject  # a JSON schema (true or false compile to no grammar: a 400)
    name: str | None = None  # not used: output is always held to the schema
    strict: bool | None = None

    def spec(self, param: str) -> tuple[Any, str]:
        return self.schema, f"{param}.schema"


TextFormats = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Whole(
    "'text', 'json_object' or 'json_schema' (with 'schema')", scope="shape")]


class TextConfig(Model):
    format: TextFormats | None = None


class Reasoning(Checked):
    effort: effort_level("reasoning.effort") | None = None
    summary: str | None = None  # accepted


# --- the request ---------------------------------------------------------------------------------


class ResponsesRequest(ServedRequest, kw_only=True):
    input: Input
    instructions: str | None = None
    previous_response_id: Annotated[str, Meta(description=(
        "a response this server still keeps (recent ones, in memory); else a 400"))] | None = None
    max_output_tokens: MaxTokens | None = None
    tools: list[dict[str, Any]] | None = None  # functions, namespaces, built-in: tool()
    tool_choice: ResponsesToolChoice | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    include: Annotated[list[str], Whole("an array of strings")] | None = None
    prompt_cache_key: str | None = None
    client_metadata: JsonObject | None = None
    metadata: JsonObject | None = None
    # Accepted, not used.
    stream_options: AnyValue = None
    truncation: AnyValue = None
    max_tool_calls: AnyValue = None
    top_logprobs: AnyValue = None

    @classmethod
    def schema_rules(cls, schema: Any) -> dict[str, Any]:
        tools = {"type": "array", "items": {"anyOf": [
            schema.of(FunctionTool), schema.of(NamespaceTool), BUILT_IN]}}
        return {**super().schema_rules(schema), **NEEDS_FUNCTION,
                "properties": {"tools": {"anyOf": [tools, {"type": "null"}]}}}


# "required" or a named choice needs a function to call (the name must be one: a 400).
NEEDS_FUNCTION = needs_tools(FORCES_A_CALL, {"anyOf": [
    {"type": "object", "required": ["type"], "properties": {"type": {"const": "function"}}},
    {"type": "object", "required": ["type", "tools"],
     "properties": {"type": {"const": "namespace"}, "tools": {
         "type": "array", "contains": {
             "type": "object", "required": ["type"],
             "properties": {"type": {"const": "function"}}}}}}]})
