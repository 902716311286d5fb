"""OpenAI's Chat Completions (`POST /v1/chat/completions`) and Completions (`/v1/completions`)
requests, declared once: gateway/api/openai_request.py translates them into the gateway's request
shapes, and /openapi.json is made from them (wire/schema.py). What a schema cannot state (a
named tool must be one of `tools`, token ids within the vocabulary, an image's bytes, the
context) is checked at runtime and documented as a 400.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from msgspec import Meta

from switchyard.gateway.request.wire.base import (Checked, FieldError, Model, Whole, integer,
                                                  unsupported)
from switchyard.gateway.request.wire.common import (IMAGE_URL, INT64_MIN, MAX_STOP, MAX_TOOLS, UINT64_MAX,
                                                  AnyValue, CacheSalt, effort_level, JsonObject,
                                                  MaxTokens, ModelName, NonEmpty, Priority,
                                                  Speculative, Temperature, TemplateKwargs,
                                                  TopK, TopP, needs_tools)

MAX_LOGIT_BIAS = 1024
Detail = Annotated[Literal["auto", "low", "high"], Meta(description=(
    "accepted as in OpenAI's API; the model sees every image at the resolution its processor "
    "makes of it"))]


# --- messages ------------------------------------------------------------------------------------


class Part(Model, tag_field="type", kw_only=True):
    """A content part; its `type` is the tag."""


class TextPart(Part, tag="text"):
    text: str


class ImageUrl(Model):
    url: IMAGE_URL
    detail: Detail | None = None


class ImageUrlPart(Part, tag="image_url"):
    """A vision model's image (user messages and tool results)."""

    image: ClassVar[bool] = True
    image_url: ImageUrl | IMAGE_URL


class CallFunction(Model):
    name: NonEmpty
    arguments: str | JsonObject | None = None  # an object is written as its JSON


class ToolCall(Model):
    function: CallFunction
    id: str | None = None
    type: Literal["function"] | None = None


Content = str | list[TextPart | ImageUrlPart]
TextContent = str | list[TextPart]


class ChatMessage(Model, tag_field="role", kw_only=True):
    """A message; its `role` is the tag. Members this server does not read are passed to the
    chat template as they are."""

    content: Content | None = None
    name: str | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None  # another client's name for reasoning_content
    tool_calls: list[ToolCall] | None = None

    takes_images: ClassVar[bool] = False

    def __post_init__(self) -> None:
        role = self.__struct_config__.tag
        if not self.takes_images and isinstance(self.content, list) \
                and any(isinstance(p, ImageUrlPart) for p in self.content):
            raise FieldError("content", "images are taken in user messages and tool results "
                             "only", "unsupported_content")
        if self.content is None and role != "assistant":
            raise FieldError("content", "is required", "missing_required_parameter")
        if self.tool_calls and role != "assistant":
            raise FieldError("tool_calls", "is only allowed in assistant messages")

    @classmethod
    def schema_rules(cls, schema: Any) -> dict[str, Any]:
        return {"required": ["content"], "properties": {
            "content": schema.of(Content if cls.takes_images else TextContent),
            "tool_calls": schema.of(Annotated[list[ToolCall], Meta(max_length=0)] | None)}}


class SystemMessage(ChatMessage, tag="system"):
    pass


class DeveloperMessage(ChatMessage, tag="developer"):
    """OpenAI's newer name for system: rendered as a system message."""


class FunctionMessage(ChatMessage, tag="function"):
    pass


class UserMessage(ChatMessage, tag="user"):
    takes_images: ClassVar[bool] = True


class ToolMessage(UserMessage, tag="tool"):
    pass


class AssistantMessage(ChatMessage, tag="assistant"):
    @classmethod
    def schema_rules(cls, schema: Any) -> dict[str, Any]:
        return {"properties": {"content": schema.of(TextContent | None)}}


Message = (SystemMessage | DeveloperMessage | FunctionMessage | UserMessage | ToolMessage
           | AssistantMessage)


# --- tools ---------------------------------------------------------------------------------------


class FunctionDef(Model):
    name: NonEmpty
    description: str | None = None
    parameters: JsonObject | None = None
    strict: bool | None = None  # true: the arguments follow `parameters` exactly


class ChatTool(Model):
    function: FunctionDef
    type: Literal["function"] | None = None


ChatTools = Annotated[list[ChatTool], Meta(max_length=MAX_TOOLS), Whole("an array of objects")]


class FunctionName(Model):
    name: NonEmpty


class NamedToolChoice(Model):
    """`{"type": "function", "function": {"name"}}` (or the Responses API's flat `name`)."""

    type: Literal["function"]
    function: FunctionName | None = None
    name: NonEmpty | None = None

    @classmethod
    def schema_rules(cls, schema: Any) -> dict[str, Any]:
        return {"required": ["function"], "properties": {
            "function": {"type": "object", "required": ["name"],
                         "properties": {"name": {"type": "string", "minLength": 1}}}}}

    @property
    def function_name(self) -> str:
        return self.function.name if self.function is not None else self.name

    def __post_init__(self) -> None:
        if self.function is None and self.name is None:
            raise FieldError("", 'must name a function: {"type": "function", "function": '
                             '{"name": ...}}')


ChatToolChoice = Annotated[Literal["auto", "none", "required"] | NamedToolChoice, Meta(description=(
    "'required' or a named function needs 'tools', and the name must be one of them")),
    Whole("'auto', 'none', 'required' or a function", scope="all")]


# --- structured outputs --------------------------------------------------------------------------


class ResponseFormat(Model, tag_field="type", kw_only=True):
    pass


class TextFormat(ResponseFormat, tag="text"):
    pass


class JsonObjectFormat(ResponseFormat, tag="json_object"):
    pass


class JsonSchemaSpec(Model):
    schema: JsonObject  # a JSON schema (true or false compile to no grammar: a 400)
    name: str | None = None  # not used: output is always held to the schema
    strict: bool | None = None


class JsonSchemaFormat(ResponseFormat, tag="json_schema"):
    json_schema: JsonSchemaSpec

    def spec(self, param: str) -> tuple[Any, str]:
        return self.json_schema.schema, f"{param}.json_schema.schema"


ResponseFormats = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Meta(description=(
    "also the guided_json / guided_choice / guided_regex fields (structured outputs: the "
    "schema must be one the grammar compiler supports, else a 400 naming what it does not)")),
    Whole("'text', 'json_object' or 'json_schema' (with 'json_schema.schema')", scope="shape")]
GUIDED_FIELDS = frozenset({"guided_json", "guided_regex", "guided_grammar", "guided_choice",
                           "structured_outputs"})


# --- requests ------------------------------------------------------------------------------------


class StreamOptions(Model):
    include_usage: bool | None = None


MinP = Annotated[float, Meta(ge=0, le=1)]
Stop = Annotated[str | Annotated[list[str], Meta(max_length=MAX_STOP)],
                 Whole("a string or an array of strings")]
# A token id is below 2**31: ten digits at most (longer keys are refused before any int()).
LogitBias = Annotated[
    dict[Annotated[str, Meta(pattern="^[0-9]{1,10}$")], Annotated[float, Meta(ge=-100, le=100)]],
    Meta(max_length=MAX_LOGIT_BIAS, description="token id -> bias added to its logit, as in "
                                                "OpenAI's API"),
    Whole("a map of token ids to numbers from -100 to 100", scope="all")]


class ServedRequest(Checked, kw_only=True):
    """What every OpenAI-style request (Chat, Completions, Responses) shares."""

    model: ModelName | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stream: bool | None = None
    user: str | None = None
    priority: Priority | None = None
    speculative: Speculative | None = None
    cache_salt: CacheSalt | None = None
    # vLLM's structured outputs, read as the body gives them (request/structured.py); not
    # published: whether a regex or grammar compiles no schema can say.
    guided_json: AnyValue = None
    guided_regex: AnyValue = None
    guided_grammar: AnyValue = None
    guided_choice: AnyValue = None
    structured_outputs: AnyValue = None
    # Accepted, not used.
    service_tier: AnyValue = None
    safety_identifier: AnyValue = None

    @classmethod
    def schema_rules(cls, schema: Any) -> dict[str, Any]:
        return {"unpublished": GUIDED_FIELDS}


class OptionsRequest(ServedRequest, kw_only=True):
    """What Chat and Completions read: sampling, limits, streaming."""

    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None  # wins over max_tokens
    n: integer(lo=1, hi=1, description="only 1") | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    seed: integer(lo=INT64_MIN, hi=UINT64_MAX) | None = None
    stop: Stop | None = None
    stream_options: StreamOptions | None = None
    logit_bias: LogitBias | None = None
    response_format: ResponseFormats | None = None
    # Accepted, not used.
    frequency_penalty: AnyValue = None
    presence_penalty: AnyValue = None
    metadata: AnyValue = None
    store: AnyValue = None

    @classmethod
    def schema_rules(cls, schema: Any) -> dict[str, Any]:
        digits = max(1, len(str(schema.vocab_size)) - 1)  # fewer digits: every id is in it
        bias = schema.of(LogitBias)
        bias["propertyNames"] = {"pattern": f"^[0-9]{{1,{digits}}}$"}
        return {"properties": {"logit_bias": {"anyOf": [bias, {"type": "null"}]}},
                **super().schema_rules(schema)}


# "required" or a named function needs a tool.
FORCES_A_CALL = {"not": {"enum": ["auto", "none", None]}}
NEEDS_TOOLS = needs_tools(FORCES_A_CALL)


class ChatCompletionRequest(OptionsRequest, kw_only=True):
    messages: Annotated[list[Message], Meta(min_length=1)]
    tools: ChatTools | None = None
    tool_choice: ChatToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: TemplateKwargs | None = None
    chat_template: unsupported(text="is not accepted: the chat template is the model's, never "
                                    "a request's") = None
    reasoning_effort: effort_level("reasoning_effort") | None = None
    prompt_cache_key: str | None = None
    logprobs: unsupported(False) = None
    top_logprobs: unsupported(0) = None
    # Accepted, not used.
    verbosity: AnyValue = None
    modalities: AnyValue = None
    prediction: AnyValue = None
    audio: AnyValue = None
    web_search_options: AnyValue = None

    @classmethod
    def schema_rules(cls, schema: Any) -> dict[str, Any]:
        return {**super().schema_rules(schema), **NEEDS_TOOLS}


class CompletionRequest(OptionsRequest, kw_only=True):
    """One prompt per request: text or token ids, alone or as a batch of one."""

    prompt: AnyValue = None  # its shape depends on the vocabulary: schema_rules, openai_request.py
    logprobs: unsupported(0) = None
    echo: unsupported(False) = None
    suffix: unsupported("") = None
    best_of: unsupported(1) = None
    prompt_cache_key: AnyValue = None

    @classmethod
    def schema_rules(cls, schema: Any) -> dict[str, Any]:
        ids = {"type": "array", "minItems": 1, "items": {
            "type": "integer", "minimum": 0, "maximum": schema.vocab_size - 1}}
        text = {"type": "string", "minLength": 1}
        rules = super().schema_rules(schema)
        rules["required"] = ["prompt"]
        rules["properties"]["prompt"] = {
            "anyOf": [text, ids, {"type": "array", "items": text, "minItems": 1, "maxItems": 1},
                      {"type": "array", "items": ids, "minItems": 1, "maxItems": 1}],
            "description": "one prompt: text or token ids, alone or as a batch of one"}
        return rules
