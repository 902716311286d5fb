"""OpenAI response bodies and stream chunks, for chat completions and text completions.

Both are `driver.Output`s: `body(result)` for a JSON reply, `head`/`frames`/`tail` for SSE.
Chat shows reasoning as `reasoning_content` and tool calls as `tool_calls` (streamed as a delta
with id and name when the call is recognised, then one with its arguments).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from switchyard.gateway.errors import APIError
from switchyard.gateway.generation import Usage
from switchyard.gateway.output.parser import Event, ReasoningDelta, TextDelta, ToolCallDone, ToolCallStart
from switchyard.gateway.streaming import SSE_DONE, SSE_KEEPALIVE, sse_data
from switchyard.gateway.output.tools import ToolCall
from switchyard.gateway.turn import TurnResult


@dataclass
class ResponseFormat:
    """What differs between `/v1/chat/completions` and `/v1/completions`."""

    rid: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))
    include_usage: bool = False

    object_name = ""
    chunk_object_name = ""
    keepalive = SSE_KEEPALIVE

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        body = {"id": self.rid, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None, "choices": choices}
        return body

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        body = self._envelope(self.chunk_object_name, [choice])
        if self.include_usage:
            body["usage"] = None  # OpenAI: null on every chunk but the usage chunk
        return body

    def head(self) -> list[bytes]:
        return []

    def frames(self, events: list[Event]) -> list[bytes]:
        raise NotImplementedError

    def finish_chunk(self, reason: str) -> dict[str, Any]:
        raise NotImplementedError

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        body = self._envelope(self.chunk_object_name, [])
        body["usage"] = usage.to_dict()
        return body

    def tail(self, result: TurnResult) -> list[bytes]:
        frames = [sse_data(self.finish_chunk(result.finish_reason))]
        if self.include_usage:
            frames.append(sse_data(self.usage_chunk(result.usage)))
        return frames + [SSE_DONE]

    def error_frames(self, error: APIError) -> list[bytes]:
        return [sse_data(error.body()), SSE_DONE]

    def body(self, result: TurnResult) -> dict[str, Any]:
        raise NotImplementedError


def tool_call_dict(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


class ChatFormat(ResponseFormat):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def _delta(self, delta: dict[str, Any], reason: str | None = None) -> dict[str, Any]:
        return self._chunk({"index": 0, "delta": delta, "logprobs": None,
                            "finish_reason": reason})

    def head(self) -> list[bytes]:
        return [sse_data(self._delta({"role": "assistant", "content": ""}))]

    def frames(self, events: list[Event]) -> list[bytes]:
        frames = []
        for event in events:
            if isinstance(event, TextDelta):
                delta: dict[str, Any] = {"content": event.text}
            elif isinstance(event, ReasoningDelta):
                delta = {"reasoning_content": event.text}
            elif isinstance(event, ToolCallStart):
                delta = {"tool_calls": [{"index": event.index, "id": event.id,
                                         "type": "function",
                                         "function": {"name": event.name, "arguments": ""}}]}
            elif isinstance(event, ToolCallDone):
                delta = {"tool_calls": [{"index": event.index,
                                         "function": {"arguments": event.call.arguments}}]}
            else:
                continue
            frames.append(sse_data(self._delta(delta)))
        return frames

    def finish_chunk(self, reason: str) -> dict[str, Any]:
        return self._delta({}, reason)

    def body(self, result: TurnResult) -> dict[str, Any]:
        content: str | None = result.content
        if result.tool_calls and not result.content.strip():
            content = None
        message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
        if result.reasoning:
            message["reasoning_content"] = result.reasoning
        if result.tool_calls:
            message["tool_calls"] = [tool_call_dict(c) for c in result.tool_calls]
        body = self._envelope(self.object_name, [
            {"index": 0, "message": message, "logprobs": None,
             "finish_reason": result.finish_reason}])
        body["usage"] = result.usage.to_dict()
        return body


class CompletionFormat(ResponseFormat):
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def _choice(self, text: str, reason: str | None) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}

    def frames(self, events: list[Event]) -> list[bytes]:
        return [sse_data(self._chunk(self._choice(e.text, None))) for e in events
                if isinstance(e, TextDelta)]

    def finish_chunk(self, reason: str) -> dict[str, Any]:
        return self._chunk(self._choice("", reason))

    def body(self, result: TurnResult) -> dict[str, Any]:
        body = self._envelope(self.object_name,
                              [self._choice(result.content, result.finish_reason)])
        body["usage"] = result.usage.to_dict()
        return body


def models_body(model_ids: tuple[str, ...], created: int, ctx: int) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(m, created, ctx) for m in model_ids]}


def model_card(model_id: str, created: int, ctx: int) -> dict[str, Any]:
    """A model as /v1/models lists it, with its context window under the names clients and
    routers read: vLLM's `max_model_len`, and `context_length` / `context_window`."""
    return {"id": model_id, "object": "model", "created": created, "owned_by": "switchyard",
            "max_model_len": ctx, "context_length": ctx, "context_window": ctx}
