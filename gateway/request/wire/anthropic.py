"""The Anthropic Messages request (`POST /v1/messages`, `/v1/messages/count_tokens`), declared
once: gateway/api/anthropic_api.py translates it into the gateway's chat shape, and
/openapi.json is made from it (wire/schema.py). What a schema cannot state (a named tool must
be one of `tools`, an image's bytes, the context) is checked at runtime and documented as a 400.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from msgspec import Meta

from switchyard.gateway.request.wire.base import Checked, FieldError, Model, integer
from switchyard.gateway.request.wire.decoding import decode
from switchyard.gateway.request.wire.common import (IMAGE_URL, MAX_STOP, AnyValue, CacheSalt,
                                                    effort_level, JsonObject, MaxTokens, ModelName,
                                                    NonEmpty, Priority, Speculative, Temperature,
                                                    TopK, TopP, needs_tools)



class Block(Model, tag_field="type", kw_only=True):
    """A content block; its `type` is the tag."""


class TextBlock(Block, tag="text"):
    text: str


class Base64Source(Model, tag_field="type", tag="base64"):
    media_type: Annotated[str, Meta(pattern="^image/", description=(
        "image/png, image/jpeg, image/webp, image/gif, ..."))]
    data: Annotated[str, Meta(min_length=1, extra_json_schema={"contentEncoding": "base64"})]


class UrlSource(Model, tag_field="type", tag="url"):
    url: IMAGE_URL


class ImageBlock(Block, tag="image"):
    """A vision model's image (user turns and tool results)."""

    image: ClassVar[bool] = True
    source: Base64Source | UrlSource


class ToolResultBlock(Block, tag="tool_result"):
    tool_use_id: NonEmpty
    content: str | list[TextBlock | ImageBlock] | None = None


class ThinkingBlock(Block, tag="thinking"):
    thinking: str


class RedactedThinkingBlock(Block, tag="redacted_thinking"):
    """Not shown to the model (its text is Anthropic's, encrypted)."""


class ToolUseBlock(Block, tag="tool_use"):
    id: NonEmpty
    name: NonEmpty
    input: JsonObject | None = None


class SystemBlock(Model):
    """A text block of a system prompt (a tagged struct alone would take a block without its
    `type`: msgspec reads a tag only among a union's members)."""

    type: Literal["text"]
    text: str


UserBlock = TextBlock | ImageBlock | ToolResultBlock
AssistantBlock = TextBlock | ThinkingBlock | RedactedThinkingBlock | ToolUseBlock
SystemText = str | list[SystemBlock]


class Message(Model, tag_field="role", kw_only=True):
    """A turn; its `role` is the tag."""


class UserMessage(Message, tag="user"):
    content: str | list[UserBlock]


class AssistantMessage(Message, tag="assistant"):
    content: str | list[AssistantBlock]


class SystemMessage(Message, tag="system"):
    """A system message between turns (Claude Code's): kept where it stands."""

    content: SystemText


class ToolType(Model):
    """A tool's `type`, read first: only a client tool's other members are checked."""

    type: str | None = None


class CustomTool(Model):
    """A client tool (`type` custom or left out)."""

    name: NonEmpty
    description: str | None = None
    input_schema: JsonObject | None = None
    strict: bool | None = None
    type: Literal["custom"] | None = None


SERVER_TOOL = {"type": "object", "required": ["type"], "properties": {
    "type": {"type": "string", "not": {"const": "custom"}}}}


def client_tool(tool: dict[str, Any], param: str) -> CustomTool | None:
    """`tool` as a client tool; None for a server tool (any other type: web search, ...),
    which is not available here and is skipped whatever its members."""
    if decode(tool, ToolType, param).type not in (None, "custom"):
        return None
    return decode(tool, CustomTool, param)


class MessagesToolChoice(Model, tag_field="type", kw_only=True):
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAuto(MessagesToolChoice, tag="auto"):
    pass


class ToolChoiceNone(MessagesToolChoice, tag="none"):
    pass


class ToolChoiceAny(MessagesToolChoice, tag="any"):
    pass


class ToolChoiceTool(MessagesToolChoice, tag="tool"):
    name: NonEmpty


class Thinking(Checked, tag_field="type", kw_only=True):
    """`budget_tokens` is checked, not enforced: max_tokens bounds the turn."""

    budget_tokens: integer(lo=0) | None = None


class ThinkingEnabled(Thinking, tag="enabled"):
    pass


class ThinkingDisabled(Thinking, tag="disabled"):
    pass


class ThinkingAdaptive(Thinking, tag="adaptive"):
    pass


class OutputFormat(Model):
    type: Literal["json_schema"]
    schema: JsonObject  # a JSON schema (true or false compile to no grammar: a 400)


class OutputConfig(Checked):
    effort: effort_level("output_config.effort") | None = None
    format: OutputFormat | None = None


class Keep(Checked):
    value: integer(lo=0)
    type: str | None = None


class ContextEdit(Model):
    """clear_thinking_* edits drop earlier turns' thinking (keep: the last N turns' or 'all');
    other edit types are accepted and not applied."""

    type: str | None = None  # required: the 400 names the edit, not its missing member
    keep: Literal["all"] | Keep | None = None

    @classmethod
    def schema_rules(cls, schema: Any) -> dict[str, Any]:
        return {"required": ["type"], "properties": {"type": {"type": "string"}}}

    def __post_init__(self) -> None:
        if self.type is None:
            raise FieldError("", "must be an object with a 'type'")


class ContextManagement(Model):
    edits: list[ContextEdit] | None = None


# "any" or "tool" needs a client tool to call.
NEEDS_TOOLS = needs_tools(
    {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["any", "tool"]}}},
    {"type": "object", "properties": {"type": {"enum": ["custom", None]}}})


class MessagesFields(Checked, kw_only=True):
    """The members of a Messages request."""

    model: ModelName | None = None
    messages: Annotated[list[UserMessage | AssistantMessage | SystemMessage], Meta(min_length=1)]
    system: SystemText | None = None
    tools: list[dict[str, Any]] | None = None  # client and server tools: client_tool()
    tool_choice: ToolChoiceAuto | ToolChoiceNone | ToolChoiceAny | ToolChoiceTool | None = None
    thinking: ThinkingEnabled | ThinkingDisabled | ThinkingAdaptive | None = None
    output_config: OutputConfig | None = None
    output_format: OutputFormat | None = None
    context_management: ContextManagement | None = None
    cache_salt: CacheSalt | None = None
    max_tokens: MaxTokens | None = None
    stop_sequences: Annotated[list[str], Meta(max_length=MAX_STOP)] | None = None
    stream: bool | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    metadata: JsonObject | None = None
    priority: Priority | None = None
    speculative: Speculative | None = None
    # Accepted, not used.
    service_tier: AnyValue = None
    container: AnyValue = None
    mcp_servers: AnyValue = None

    @classmethod
    def schema_rules(cls, schema: Any) -> dict[str, Any]:
        tools = {"type": "array", "items": {"anyOf": [schema.of(CustomTool), SERVER_TOOL]}}
        return {"properties": {"tools": {"anyOf": [tools, {"type": "null"}]}}, **NEEDS_TOOLS}


class MessagesRequest(MessagesFields, kw_only=True):
    """`/v1/messages`: a turn."""

    max_tokens: MaxTokens


class CountTokensRequest(MessagesFields, kw_only=True):
    """`/v1/messages/count_tokens`: the prompt a turn would have. A turn's own members are
    read and checked as in a turn, and published only for the turn."""

    @classmethod
    def schema_rules(cls, schema: Any) -> dict[str, Any]:
        return {**super().schema_rules(schema), "unpublished": {
            "max_tokens", "stop_sequences", "stream", "temperature", "top_p", "top_k",
            "metadata", "priority", "speculative", "service_tier", "container", "mcp_servers"}}
