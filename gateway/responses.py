"""OpenAI response bodies and stream chunks, for chat completions and text completions."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from gateway.generation import Usage


@dataclass
class ResponseFormat:
    """What differs between `/v1/chat/completions` and `/v1/completions`."""

    rid: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))
    include_usage: bool = False

    object_name = ""
    chunk_object_name = ""

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        body = {"id": self.rid, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None, "choices": choices}
        return body

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        body = self._envelope(self.chunk_object_name, [choice])
        if self.include_usage:
            body["usage"] = None  # OpenAI: null on every chunk but the usage chunk
        return body

    def first_chunk(self) -> dict[str, Any] | None:
        return None

    def text_chunk(self, text: str) -> dict[str, Any]:
        raise NotImplementedError

    def finish_chunk(self, reason: str) -> dict[str, Any]:
        raise NotImplementedError

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        body = self._envelope(self.chunk_object_name, [])
        body["usage"] = usage.to_dict()
        return body

    def final_body(self, text: str, reason: str, usage: Usage) -> dict[str, Any]:
        raise NotImplementedError


class ChatFormat(ResponseFormat):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def _delta(self, delta: dict[str, Any], reason: str | None = None) -> dict[str, Any]:
        return self._chunk({"index": 0, "delta": delta, "logprobs": None,
                            "finish_reason": reason})

    def first_chunk(self) -> dict[str, Any]:
        return self._delta({"role": "assistant", "content": ""})

    def text_chunk(self, text: str) -> dict[str, Any]:
        return self._delta({"content": text})

    def finish_chunk(self, reason: str) -> dict[str, Any]:
        return self._delta({}, reason)

    def final_body(self, text: str, reason: str, usage: Usage) -> dict[str, Any]:
        message = {"role": "assistant", "content": text, "refusal": None}
        body = self._envelope(self.object_name, [
            {"index": 0, "message": message, "logprobs": None, "finish_reason": reason}])
        body["usage"] = usage.to_dict()
        return body


class CompletionFormat(ResponseFormat):
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def _choice(self, text: str, reason: str | None) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}

    def text_chunk(self, text: str) -> dict[str, Any]:
        return self._chunk(self._choice(text, None))

    def finish_chunk(self, reason: str) -> dict[str, Any]:
        return self._chunk(self._choice("", reason))

    def final_body(self, text: str, reason: str, usage: Usage) -> dict[str, Any]:
        body = self._envelope(self.object_name, [self._choice(text, reason)])
        body["usage"] = usage.to_dict()
        return body


def models_body(model_id: str, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(model_id, created)]}


def model_card(model_id: str, created: int) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "switchyard"}
