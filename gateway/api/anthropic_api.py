"""Anthropic Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

A request is decoded against its model (request/wire/anthropic.py: its shape, checks and
limits) and translated into the gateway's one chat shape (request.model.ChatRequest): `system`
becomes a system message (volatile per-request lines such as Claude Code's
`x-anthropic-billing-header:` are removed from its start, so they do not break prefix reuse),
`tool_use` blocks become assistant tool calls, `tool_result` blocks tool messages, `thinking`
blocks reasoning. Any model name is accepted (clients such as Claude Code send their own) and
echoed back. Errors use Anthropic's format (errors.py, chosen by the route).

Usage: `input_tokens` counts the prompt tokens that were not read from cache,
`cache_read_input_tokens` those that were (as Anthropic counts them), `output_tokens` the
generated ones.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

import structlog
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from switchyard.gateway.request import structured
from switchyard.gateway.context import RequestContext
from switchyard.gateway.driver import plan_chat, respond, start_chat
from switchyard.gateway.errors import APIError
from switchyard.gateway.generation import Usage
from switchyard.gateway.output.parser import Event, ReasoningDelta, TextDelta, ToolCallDone, ToolCallStart
from switchyard.gateway.streaming import sse_event
from switchyard.gateway.request.tools import check_tool_choice, function_tool
from switchyard.gateway.turn import TurnResult
from switchyard.gateway.api.json_body import message_limits, read_json
from switchyard.gateway.request import wire
from switchyard.gateway.request.wire.decoding import decode, decode_body, note_ignored
from switchyard.gateway.vision.parts import ImageRef, decode_base64, from_url, image_part
from switchyard.gateway.request.model import AUTO, NONE, ChatRequest, Options, ToolChoice

log = structlog.get_logger()

# Lines some clients put at the start of the system prompt that change on every request.
VOLATILE_SYSTEM_PREFIXES = ("x-anthropic-billing-header:",)


# --- request ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class MessagesRequest:
    chat: ChatRequest
    model: str | None


def strip_volatile_lines(texts: list[str]) -> list[str]:
    """Drop volatile lines (billing headers) from the start of the system prompt."""
    out, leading = [], True
    for text in texts:
        if leading:
            lines = text.split("\n")
            while lines and lines[0].strip().lower().startswith(VOLATILE_SYSTEM_PREFIXES):
                lines.pop(0)
            text = "\n".join(lines)
            if not text.strip():
                continue
            leading = False
        out.append(text)
    return out


def parse_system(value: Any) -> str | None:
    """The leading system prompt (`system`, as the request gives it)."""
    return system_text(decode(value, wire.anthropic.SystemText | None))


def system_text(system: wire.anthropic.SystemText | None) -> str | None:
    if system is None:
        return None
    texts = strip_volatile_lines([system] if isinstance(system, str)
                                 else [block.text for block in system])
    return "\n".join(texts) if texts else None


def _image(block: wire.anthropic.ImageBlock, param: str) -> dict[str, Any]:
    source = block.source
    if isinstance(source, wire.anthropic.Base64Source):
        return image_part(ImageRef(f"{param}.source.data",
                                   data=decode_base64(source.data, f"{param}.source.data")))
    return image_part(from_url(source.url, f"{param}.source.url"))


def _tool_result_content(block: wire.anthropic.ToolResultBlock, param: str
                         ) -> str | list[dict[str, Any]]:
    """A tool result's text; with image blocks, its parts in order (gateway/vision/parts.py)."""
    content = block.content
    if content is None or isinstance(content, str):
        return content or ""
    if not any(isinstance(b, wire.anthropic.ImageBlock) for b in content):
        return "\n".join(b.text for b in content)
    return [_image(b, f"{param}.content[{j}]") if isinstance(b, wire.anthropic.ImageBlock)
            else {"type": "text", "text": b.text} for j, b in enumerate(content)]


def chat_messages(message: wire.anthropic.Message, index: int) -> list[dict[str, Any]]:
    """One Anthropic message as canonical chat messages (a user message carrying tool results
    becomes tool messages, then the user's text)."""
    content = message.content
    kind = type(message)
    if kind is wire.anthropic.SystemMessage:  # between turns (Claude Code's agent list): kept there
        return [{"role": "system", "content": content if isinstance(content, str)
                 else "\n".join(b.text for b in content)}]
    role = "user" if kind is wire.anthropic.UserMessage else "assistant"
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    texts = [b.text for b in content if type(b) is wire.anthropic.TextBlock]
    if len(texts) == len(content):  # text alone: the common case
        return [{"role": role, "content": "\n".join(texts)}]
    reasoning, calls, results = [], [], []
    parts: list[dict[str, Any]] = []  # text and images in order, when there are images
    for j, block in enumerate(content):
        if isinstance(block, wire.anthropic.TextBlock):
            parts.append({"type": "text", "text": block.text})
        elif isinstance(block, wire.anthropic.ImageBlock):
            parts.append(_image(block, f"messages[{index}].content[{j}]"))
        elif isinstance(block, wire.anthropic.ThinkingBlock):
            reasoning.append(block.thinking)
        elif isinstance(block, wire.anthropic.ToolUseBlock):
            arguments = json.dumps(block.input or {}, ensure_ascii=False)
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": arguments}})
        elif isinstance(block, wire.anthropic.ToolResultBlock):
            results.append({"role": "tool", "tool_call_id": block.tool_use_id, "content":
                            _tool_result_content(block, f"messages[{index}].content[{j}]")})
    text = "\n".join(texts)
    if role == "user":
        if len(parts) > len(texts):  # images: the parts, in order
            return results + [{"role": "user", "content": parts}]
        return results + ([{"role": "user", "content": text}] if texts or not results else [])
    out: dict[str, Any] = {"role": "assistant", "content": text}
    if reasoning:
        out["reasoning_content"] = "\n".join(reasoning)
    if calls:
        out["tool_calls"] = calls
    return [out]


def client_tools(tools: list[dict[str, Any]] | None) -> list[wire.anthropic.CustomTool]:
    """The client tools; Anthropic's server tools (web search, ...) are not available here
    and are left out."""
    found = [wire.anthropic.client_tool(t, f"tools[{i}]") for i, t in enumerate(tools or ())]
    offered = [t for t in found if t is not None]
    if len(offered) < len(found):
        log.info("anthropic.server_tools_skipped", num_skipped=len(found) - len(offered))
    return offered


_CHOICES = {wire.anthropic.ToolChoiceNone: NONE,
            wire.anthropic.ToolChoiceAny: ToolChoice("required")}


def chat_tool_choice(value: wire.anthropic.MessagesToolChoice | None,
                     tools: list[dict[str, Any]] | None
                     ) -> tuple[ToolChoice, bool]:
    """(choice, parallel allowed)."""
    if value is None or isinstance(value, wire.anthropic.ToolChoiceAuto):
        choice = AUTO if tools else NONE
    elif isinstance(value, wire.anthropic.ToolChoiceTool):
        choice = ToolChoice("function", value.name)
    else:
        choice = _CHOICES[type(value)]
    parallel = not (value is not None and value.disable_parallel_tool_use)
    return check_tool_choice(choice, tools, "tool_choice"), parallel


# `thinking`: `enabled` and `disabled` set the template's thinking switch; `adaptive` leaves
# the model's default.
_THINKING = {wire.anthropic.ThinkingEnabled: {"enable_thinking": True},
             wire.anthropic.ThinkingDisabled: {"enable_thinking": False}}


def _template_kwargs(request: wire.anthropic.MessagesFields) -> dict[str, Any]:
    """`thinking`, and `output_config.effort` as the template's `reasoning_effort` (gpt-oss's
    switch; decoded as the template takes it: wire/common.py EffortLevel)."""
    kwargs = dict(_THINKING.get(type(request.thinking), {}))
    config = request.output_config
    if config is not None and config.effort:
        kwargs["reasoning_effort"] = config.effort
    return kwargs


# Anthropic's context-management edits: `clear_thinking_*` changes what the model sees (earlier
# turns' thinking); the others act on Anthropic's own server-side state or triggers.
CLEAR_THINKING = "clear_thinking_"


def clear_thinking(messages: list[dict[str, Any]], value: wire.anthropic.ContextManagement | None
                   ) -> list[dict[str, Any]]:
    """`context_management.edits`: a `clear_thinking` edit keeps the thinking of the last
    `keep` assistant turns that have some (`"all"`: every turn's, the default) and drops the
    rest before rendering. Other edit types are accepted and not applied."""
    for edit in (value.edits or ()) if value is not None else ():
        if not edit.type.startswith(CLEAR_THINKING):
            note_ignored(f"context_management.edits[].type={edit.type[:64]}")
            continue
        if not isinstance(edit.keep, wire.anthropic.Keep):  # "all" (the default)
            continue
        with_thinking = [j for j, m in enumerate(messages) if m.get("reasoning_content")]
        cleared = set(with_thinking[:max(0, len(with_thinking) - edit.keep.value)])
        messages = [{k: v for k, v in m.items() if k != "reasoning_content"}
                    if j in cleared else m for j, m in enumerate(messages)]
    return messages


def output_constraint(request: wire.anthropic.MessagesFields) -> structured.Constraint | None:
    """Structured outputs: `output_format` (the beta's spelling) or `output_config.format`."""
    config = request.output_config
    if config is not None and config.format is not None:
        return structured.json_schema(config.format.schema, "output_config.format.schema")
    if request.output_format is not None:
        return structured.json_schema(request.output_format.schema, "output_format.schema")
    return None


def parse_messages_request(body: dict[str, Any], *, count_only: bool = False) -> MessagesRequest:
    """A Messages body (a count_tokens body with `count_only`) decoded against its model
    (wire/anthropic.py), then translated (`translate`)."""
    model = wire.anthropic.CountTokensRequest if count_only else wire.anthropic.MessagesRequest
    return translate(decode_body(body, model, "messages"))


def translate(request: wire.anthropic.MessagesFields) -> MessagesRequest:
    """The gateway's chat shape of a decoded Messages request."""
    messages: list[dict[str, Any]] = []
    system = system_text(request.system)
    if system is not None:
        messages.append({"role": "system", "content": system})
    for i, message in enumerate(request.messages):
        messages += chat_messages(message, i)
    offered = client_tools(request.tools)
    tools = [function_tool(t.name, t.description, t.input_schema) for t in offered] or None
    choice, parallel = chat_tool_choice(request.tool_choice, tools)
    chat = ChatRequest(messages=clear_thinking(messages, request.context_management),
                       options=_options(request), tools=tools, tool_choice=choice,
                       parallel_tool_calls=parallel, template_kwargs=_template_kwargs(request),
                       constraint=output_constraint(request),
                       strict_tools=frozenset(t.name for t in offered if t.strict))
    return MessagesRequest(chat, request.model)


def _options(request: wire.anthropic.MessagesFields) -> Options:
    return Options(
        model=request.model, max_tokens=request.max_tokens,
        temperature=_default(request.temperature, 1.0), top_p=_default(request.top_p, 1.0),
        top_k=_default(request.top_k, 0), stop=tuple(s for s in request.stop_sequences or () if s),
        stream=bool(request.stream), priority=request.priority,
        speculative=request.speculative is not False, cache_salt=request.cache_salt)


def _default(value: Any, default: Any) -> Any:
    return default if value is None else value


# --- response --------------------------------------------------------------------------------


def anthropic_usage(usage: Usage) -> dict[str, Any]:
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens,
            "output_tokens": usage.completion_tokens,
            "cache_read_input_tokens": usage.cached_tokens,
            "cache_creation_input_tokens": 0}


def stop_reason(result: TurnResult) -> str:
    if result.finish_reason == "tool_calls":
        return "tool_use"
    if result.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if result.stop_sequence else "end_turn"


class AnthropicFormat:
    """Message bodies and the stream's event lifecycle (message_start, ping,
    content_block_start/delta/stop, message_delta, message_stop)."""

    keepalive = sse_event("ping", {"type": "ping"})

    def __init__(self, message_id: str, model: str, num_prompt_tokens: int) -> None:
        self.message_id = message_id
        self.model = model
        self.num_prompt_tokens = num_prompt_tokens
        self._index = -1
        self._open: str | None = None  # type of the open content block
        self._pending_space = ""  # whitespace before any text block: sent once text follows

    def _message(self, content: list[dict[str, Any]], result: TurnResult | None
                 ) -> dict[str, Any]:
        usage = anthropic_usage(result.usage) if result else {
            "input_tokens": self.num_prompt_tokens, "output_tokens": 0,
            "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}
        return {"id": self.message_id, "type": "message", "role": "assistant",
                "model": self.model, "content": content,
                "stop_reason": stop_reason(result) if result else None,
                "stop_sequence": result.stop_sequence if result else None, "usage": usage}

    def head(self) -> list[bytes]:
        return [sse_event("message_start", {"type": "message_start",
                                            "message": self._message([], None)}),
                self.keepalive]

    def _start(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        frames = self._stop()
        self._index += 1
        self._open = kind
        frames.append(sse_event("content_block_start", {
            "type": "content_block_start", "index": self._index, "content_block": block}))
        return frames

    def _stop(self) -> list[bytes]:
        if self._open is None:
            return []
        self._open = None
        return [sse_event("content_block_stop",
                          {"type": "content_block_stop", "index": self._index})]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return sse_event("content_block_delta", {"type": "content_block_delta",
                                                 "index": self._index, "delta": delta})

    def frames(self, events: list[Event]) -> list[bytes]:
        frames: list[bytes] = []
        for event in events:
            if isinstance(event, ReasoningDelta):
                if self._open != "thinking":
                    frames += self._start("thinking", {"type": "thinking", "thinking": "",
                                                       "signature": ""})
                frames.append(self._delta({"type": "thinking_delta", "thinking": event.text}))
            elif isinstance(event, TextDelta):
                if self._open != "text":
                    if not event.text.strip():
                        self._pending_space += event.text
                        continue
                    frames += self._start("text", {"type": "text", "text": ""})
                text, self._pending_space = self._pending_space + event.text, ""
                frames.append(self._delta({"type": "text_delta", "text": text}))
            elif isinstance(event, ToolCallStart):
                self._pending_space = ""
                frames += self._start("tool_use", {"type": "tool_use", "id": event.id,
                                                   "name": event.name, "input": {}})
            elif isinstance(event, ToolCallDone):
                frames.append(self._delta({"type": "input_json_delta",
                                           "partial_json": event.call.arguments}))
                frames += self._stop()
        return frames

    def tail(self, result: TurnResult) -> list[bytes]:
        return self._stop() + [
            sse_event("message_delta", {
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason(result),
                          "stop_sequence": result.stop_sequence},
                "usage": anthropic_usage(result.usage)}),
            sse_event("message_stop", {"type": "message_stop"})]

    def error_frames(self, error: APIError) -> list[bytes]:
        return [sse_event("error", error.anthropic_body())]

    def body(self, result: TurnResult) -> dict[str, Any]:
        content: list[dict[str, Any]] = []
        if result.reasoning:
            content.append({"type": "thinking", "thinking": result.reasoning, "signature": ""})
        if result.content.strip():
            content.append({"type": "text", "text": result.content})
        for call in result.tool_calls:
            content.append({"type": "tool_use", "id": call.id, "name": call.name,
                            "input": call.input})
        return self._message(content, result)


# --- handlers --------------------------------------------------------------------------------


async def messages(request: Request) -> Response:
    ctx = RequestContext.of(request)
    limits = message_limits(ctx.gateway)
    body = await read_json(ctx, limits)
    parsed = parse_messages_request(body)
    message_id = "msg_" + secrets.token_hex(12)
    turn, submit = await start_chat(ctx, parsed.chat, rid=message_id, id_prefix="toolu_")
    fmt = AnthropicFormat(message_id, parsed.model or ctx.gateway.model_id,
                          len(submit.prompt_token_ids))
    return await respond(ctx, turn, submit, fmt, stream=parsed.chat.options.stream)


async def count_tokens(request: Request) -> Response:
    ctx = RequestContext.of(request)
    limits = message_limits(ctx.gateway)
    body = await read_json(ctx, limits)
    parsed = parse_messages_request(body, count_only=True)
    plan, _, _ = await plan_chat(ctx, parsed.chat)  # refused past a turn's bounds
    return JSONResponse({"input_tokens": len(plan.prompt_ids)})
