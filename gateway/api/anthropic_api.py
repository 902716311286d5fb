"""Anthropic Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

Requests are translated into the gateway's one chat shape (request.model.ChatRequest): `system`
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
from switchyard.gateway.context import gateway_of
from switchyard.gateway.driver import plan_chat, prepare_images, respond, start_chat
from switchyard.gateway.errors import APIError, invalid, invalid_type
from switchyard.gateway.generation import Usage
from switchyard.gateway.output.parser import Event, ReasoningDelta, TextDelta, ToolCallDone, ToolCallStart
from switchyard.gateway.streaming import sse_event
from switchyard.gateway.output.tools import (AUTO, NONE, ToolChoice, check_tool_choice, check_tool_fields,
                                  function_tool, strict_tool_names)
from switchyard.gateway.turn import TurnResult
from switchyard.gateway.api.json_body import message_limits, read_json
from switchyard.gateway.api.validation import (Fields, as_integer, note_ignored,
                                               note_unknown_fields, reasoning_effort,
                                               template_kwargs)
from switchyard.gateway.vision.parts import anthropic_image_block, has_part, mixed_parts
from switchyard.gateway.request.model import ChatRequest, Options, parse_cache_salt, parse_priority

log = structlog.get_logger()

# Lines some clients put at the start of the system prompt that change on every request.
VOLATILE_SYSTEM_PREFIXES = ("x-anthropic-billing-header:",)
MAX_STOP_SEQUENCES = 16
# Top-level fields this server reads or ignores by design (README "Agent clients"); any other
# is accepted and logged once by name.
MESSAGES_FIELDS = frozenset({
    "model", "messages", "system", "max_tokens", "stop_sequences", "stream", "temperature",
    "top_p", "top_k", "tools", "tool_choice", "thinking", "output_config", "output_format",
    "context_management", "metadata", "service_tier", "container", "mcp_servers",
    "priority", "speculative", "cache_salt"})


# --- request ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class MessagesRequest:
    chat: ChatRequest
    model: str | None


def _text_of_blocks(blocks: list[Any], param: str, allowed: tuple[str, ...] = ("text",)
                    ) -> list[str]:
    texts = []
    for j, block in enumerate(blocks):
        if not isinstance(block, dict):
            raise invalid_type(f"{param}[{j}]", "an object")
        kind = block.get("type")
        if kind not in allowed:
            raise invalid(f"{param}[{j}].type: {kind!r} is not supported here; "
                          f"expected {' or '.join(allowed)}", param=f"{param}[{j}].type")
        text = block.get("text")
        if not isinstance(text, str):
            raise invalid_type(f"{param}[{j}].text", "a string")
        texts.append(text)
    return texts


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
    if value is None:
        return None
    if isinstance(value, str):
        texts = [value]
    elif isinstance(value, list):
        texts = _text_of_blocks(value, "system")
    else:
        raise invalid_type("system", "a string or an array of text blocks")
    texts = strip_volatile_lines(texts)
    return "\n".join(texts) if texts else None


def _tool_result_text(block: dict[str, Any], param: str) -> str | list[dict[str, Any]]:
    """A tool result's text; with image blocks, its parts in order (gateway/vision/parts.py)."""
    content = block.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and has_part(content, ("image",)):
        return mixed_parts(content, f"{param}.content", {"text": "text"},
                           {"image": anthropic_image_block}, "text and image blocks")
    if isinstance(content, list):
        return "\n".join(_text_of_blocks(content, f"{param}.content"))
    raise invalid_type(f"{param}.content", "a string or an array of text blocks")


def parse_message(message: Any, index: int) -> list[dict[str, Any]]:
    """One Anthropic message as canonical chat messages (a user message carrying tool results
    becomes tool messages, then the user's text)."""
    prefix = f"messages[{index}]"
    if not isinstance(message, dict):
        raise invalid_type(prefix, "an object")
    role = message.get("role")
    if role not in ("user", "assistant", "system"):
        raise invalid(f"{prefix}.role: must be 'user', 'assistant' or 'system'",
                      param=f"{prefix}.role")
    content = message.get("content")
    if role == "system":  # between turns (Claude Code's agent list): kept where it stands
        text = content if isinstance(content, str) else None
        if isinstance(content, list):
            text = "\n".join(_text_of_blocks(content, f"{prefix}.content"))
        if text is None:
            raise invalid_type(f"{prefix}.content", "a string or an array of text blocks")
        return [{"role": "system", "content": text}]
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise invalid_type(f"{prefix}.content", "a string or an array of content blocks")
    texts, reasoning, calls, results = [], [], [], []
    parts: list[dict[str, Any]] = []  # text and images in order, when there are images
    for j, block in enumerate(content):
        param = f"{prefix}.content[{j}]"
        if not isinstance(block, dict):
            raise invalid_type(param, "an object")
        kind = block.get("type")
        if kind == "text":
            text = block.get("text")
            if not isinstance(text, str):
                raise invalid_type(f"{param}.text", "a string")
            texts.append(text)
            parts.append({"type": "text", "text": text})
        elif kind == "image" and role == "user":
            parts.append(anthropic_image_block(block, param))
        elif kind == "thinking" and role == "assistant":
            thinking = block.get("thinking")
            if not isinstance(thinking, str):
                raise invalid_type(f"{param}.thinking", "a string")
            reasoning.append(thinking)
        elif kind == "redacted_thinking" and role == "assistant":
            continue
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_use(block, param))
        elif kind == "tool_result" and role == "user":
            tool_use_id = block.get("tool_use_id")
            if not isinstance(tool_use_id, str) or not tool_use_id:
                raise invalid(f"{param}.tool_use_id: must be a non-empty string",
                              param=f"{param}.tool_use_id")
            results.append({"role": "tool", "tool_call_id": tool_use_id,
                            "content": _tool_result_text(block, param)})
        else:
            raise invalid(f"{param}.type: {kind!r} is not supported in a {role} message",
                          param=f"{param}.type", code="unsupported_content")
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


def _tool_use(block: dict[str, Any], param: str) -> dict[str, Any]:
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input")
    if not isinstance(call_id, str) or not call_id:
        raise invalid(f"{param}.id: must be a non-empty string", param=f"{param}.id")
    if not isinstance(name, str) or not name:
        raise invalid(f"{param}.name: must be a non-empty string", param=f"{param}.name")
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise invalid_type(f"{param}.input", "an object")
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def parse_tools(value: Any) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise invalid_type("tools", "an array of tool definitions")
    tools, num_skipped = [], 0
    for i, tool in enumerate(value):
        if not isinstance(tool, dict):
            raise invalid_type(f"tools[{i}]", "an object")
        if tool.get("type") is not None and not isinstance(tool["type"], str):
            raise invalid_type(f"tools[{i}].type", "a string")
        if tool.get("type") not in (None, "custom"):
            num_skipped += 1  # Anthropic's server tools (web search, ...): not available here
            continue
        check_tool_fields(tool.get("name"), tool.get("description"), tool.get("input_schema"),
                          f"tools[{i}]", "input_schema", strict=tool.get("strict"))
        tools.append(function_tool(tool["name"], tool.get("description"),
                                   tool.get("input_schema")))
    if num_skipped:
        log.info("anthropic.server_tools_skipped", num_skipped=num_skipped)
    return tools or None


def parse_tool_choice(value: Any, tools: list[dict[str, Any]] | None
                      ) -> tuple[ToolChoice, bool]:
    """(choice, parallel allowed)."""
    if value is None:
        return (AUTO if tools else NONE), True
    if not isinstance(value, dict):
        raise invalid_type("tool_choice", "an object")
    f = Fields(value, "tool_choice.")
    parallel = not f.boolean("disable_parallel_tool_use")
    kind = value.get("type")
    if kind == "auto":
        choice = AUTO if tools else NONE
    elif kind == "none":
        choice = NONE
    elif kind == "any":
        choice = ToolChoice("required")
    elif kind == "tool":
        name = f.string("name")
        if not name:
            raise invalid("tool_choice.name: required when type is 'tool'",
                          param="tool_choice.name")
        choice = ToolChoice("function", name)
    else:
        raise invalid("tool_choice.type: must be 'auto', 'any', 'tool' or 'none'",
                      param="tool_choice.type")
    return check_tool_choice(choice, tools, "tool_choice"), parallel


def _thinking_kwargs(value: Any) -> dict[str, Any]:
    """`thinking`: `enabled` (its `budget_tokens` is not enforced: max_tokens bounds the turn)
    and `disabled` set the template's thinking switch; `adaptive` leaves the model's default."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise invalid_type("thinking", "an object")
    f = Fields(value, "thinking.")
    f.integer("budget_tokens", lo=0)
    kind = value.get("type")
    if kind == "enabled":
        return {"enable_thinking": True}
    if kind == "disabled":
        return {"enable_thinking": False}
    if kind == "adaptive":
        return {}
    raise invalid("thinking.type: must be 'enabled', 'disabled' or 'adaptive'",
                  param="thinking.type")


def _effort_kwargs(config: Any) -> dict[str, Any]:
    """`output_config.effort` as the template's `reasoning_effort` (gpt-oss's switch)."""
    if not isinstance(config, dict):
        return {}
    effort = reasoning_effort(config.get("effort"), "output_config.effort")
    return {"reasoning_effort": effort} if effort else {}


# Anthropic's context-management edits: `clear_thinking_*` changes what the model sees (earlier
# turns' thinking); the others act on Anthropic's own server-side state or triggers.
CLEAR_THINKING = "clear_thinking_"


def clear_thinking(messages: list[dict[str, Any]], value: Any) -> list[dict[str, Any]]:
    """`context_management.edits`: a `clear_thinking` edit keeps the thinking of the last
    `keep` assistant turns that have some (`"all"`: every turn's, the default) and drops the
    rest before rendering. Other edit types are accepted and not applied."""
    if value is None:
        return messages
    f = Fields(value, "context_management.") if isinstance(value, dict) else None
    if f is None:
        raise invalid_type("context_management", "an object")
    for i, edit in enumerate(f.array("edits") or ()):
        param = f"context_management.edits[{i}]"
        if not isinstance(edit, dict) or not isinstance(edit.get("type"), str):
            raise invalid(f"{param}: must be an object with a 'type'", param=param)
        keep = edit.get("keep")
        turns = as_integer(keep.get("value")) if isinstance(keep, dict) else None
        if keep not in (None, "all") and (isinstance(turns, bool) or not isinstance(turns, int)
                                          or turns < 0):
            raise invalid(f"{param}.keep: must be 'all' or {{\"type\": ..., \"value\": N}} "
                          f"with N >= 0", param=f"{param}.keep")
        if not edit["type"].startswith(CLEAR_THINKING):
            note_ignored(f"context_management.edits[].type={edit['type'][:64]}")
            continue
        if turns is None:  # "all" (the default)
            continue
        with_thinking = [j for j, m in enumerate(messages) if m.get("reasoning_content")]
        cleared = set(with_thinking[:max(0, len(with_thinking) - turns)])
        messages = [{k: v for k, v in m.items() if k != "reasoning_content"}
                    if j in cleared else m for j, m in enumerate(messages)]
    return messages


def parse_messages_request(body: dict[str, Any], *, count_only: bool = False) -> MessagesRequest:
    f = Fields(body)
    note_unknown_fields(body, MESSAGES_FIELDS, "messages")
    model = f.string("model")
    max_tokens = f.integer("max_tokens", lo=1)
    if max_tokens is None and not count_only:
        raise invalid("max_tokens: Field required", param="max_tokens",
                      code="missing_required_parameter")
    raw_messages = f.array("messages")
    if not raw_messages:
        raise invalid("messages: at least one message is required", param="messages")
    messages: list[dict[str, Any]] = []
    system = parse_system(body.get("system"))
    if system is not None:
        messages.append({"role": "system", "content": system})
    for i, message in enumerate(raw_messages):
        messages += parse_message(message, i)
    messages = clear_thinking(messages, body.get("context_management"))
    stops = f.array("stop_sequences") or []
    if not all(isinstance(s, str) for s in stops):
        raise invalid_type("stop_sequences", "an array of strings")
    if len(stops) > MAX_STOP_SEQUENCES:
        raise invalid(f"stop_sequences: at most {MAX_STOP_SEQUENCES}", param="stop_sequences")
    tools = parse_tools(body.get("tools"))
    choice, parallel = parse_tool_choice(body.get("tool_choice"), tools)
    f.obj("metadata")
    options = Options(
        model=model, max_tokens=max_tokens,
        temperature=_default(f.number("temperature", 0.0, 2.0), 1.0),
        top_p=_default(f.number("top_p", 0.0, 1.0, lo_open=True), 1.0),
        top_k=_default(f.integer("top_k", lo=0, hi=2**31 - 1), 0),
        stop=tuple(s for s in stops if s), stream=bool(f.boolean("stream")),
        priority=parse_priority(body.get("priority"), "priority"),
        speculative=f.boolean("speculative") is not False,
        cache_salt=parse_cache_salt(body.get("cache_salt")))
    chat = ChatRequest(messages=messages, options=options, tools=tools, tool_choice=choice,
                       parallel_tool_calls=parallel,
                       template_kwargs=template_kwargs(
                           _thinking_kwargs(body.get("thinking"))
                           | _effort_kwargs(f.obj("output_config"))),
                       constraint=parse_output_format(body),
                       strict_tools=strict_tool_names(body.get("tools"), lambda t: t))
    return MessagesRequest(chat, model)


def parse_output_format(body: dict[str, Any]) -> structured.Constraint | None:
    """Structured outputs: `output_format` (the beta's spelling) or `output_config.format`,
    `{"type": "json_schema", "schema": {...}}`."""
    config = body.get("output_config")
    fmt, param = body.get("output_format"), "output_format"
    if isinstance(config, dict) and config.get("format") is not None:
        fmt, param = config["format"], "output_config.format"
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or "schema" not in fmt:
        raise invalid(f"{param}: must be {{\"type\": \"json_schema\", \"schema\": {{...}}}}",
                      param=param)
    return structured.json_schema(fmt["schema"], f"{param}.schema")


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
    gw = gateway_of(request)
    parsed = parse_messages_request(await read_json(request, message_limits(request)))
    message_id = "msg_" + secrets.token_hex(12)
    turn, submit = await start_chat(request, parsed.chat, rid=message_id, id_prefix="toolu_")
    fmt = AnthropicFormat(message_id, parsed.model or gw.model_id,
                          len(submit.prompt_token_ids))
    return await respond(request, turn, submit, fmt, stream=parsed.chat.options.stream)


async def count_tokens(request: Request) -> Response:
    gw = gateway_of(request)
    parsed = parse_messages_request(await read_json(request, message_limits(request)),
                                    count_only=True)
    chat, images = await prepare_images(gw, parsed.chat)
    # The same bounds as a turn (issue 23, #3).
    plan = await plan_chat(request, chat, images=images)
    return JSONResponse({"input_tokens": len(plan.prompt_ids)})
