"""Turn one request's scheduler events into text and a final outcome (pure, no I/O).

`Generation.on_event` takes `TokensGenerated`, `RequestFinished` and `RequestFailed` in order and
returns an `Update`: the text that became final, whether the caller must send `CancelRequest`
(a stop string matched), and at the end the finish reason with usage, or the error.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from switchyard.gateway.output.detokenizer import IncrementalDetokenizer, StopMatcher
from switchyard.gateway.errors import APIError, from_failure
from switchyard.proto.gateway_scheduler import RequestFailed, RequestFinished, TokensGenerated


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@dataclass(frozen=True)
class Finish:
    reason: str  # "stop" | "length" (| "cancelled" when someone else cancelled)
    usage: Usage


@dataclass(frozen=True)
class Update:
    text: str = ""
    cancel: bool = False
    finish: Finish | None = None
    error: APIError | None = None

    @property
    def done(self) -> bool:
        return self.finish is not None or self.error is not None


class Generation:
    def __init__(self, tokenizer: Any, *, prompt_ids: Sequence[int], stop: Iterable[str] = (),
                 skip_ids: Iterable[int] = (), show_special: bool = False) -> None:
        self.num_prompt_tokens = len(prompt_ids)
        self.num_tokens = 0  # generated tokens received so far
        self.token_ids: list[int] = []  # every generated token, as the scheduler sent them
        self._detok = IncrementalDetokenizer(tokenizer, skip_ids, context_ids=prompt_ids,
                                             show_special=show_special)
        self._stops = StopMatcher(stop)

    @property
    def stop_matched(self) -> bool:
        return self._stops.matched

    @property
    def matched_stop(self) -> str | None:
        return self._stops.matched_stop

    def on_event(self, event: Any) -> Update:
        if isinstance(event, TokensGenerated):
            return self._on_tokens(event)
        if isinstance(event, RequestFinished):
            return self._on_finished(event)
        if isinstance(event, RequestFailed):
            return self._on_failed(event)
        raise TypeError(f"not a request event: {type(event).__name__}")

    def _on_tokens(self, event: TokensGenerated) -> Update:
        if self.stop_matched:
            return Update()
        self.num_tokens += len(event.token_ids)
        self.token_ids.extend(event.token_ids)
        text = self._stops.push(self._detok.add(event.token_ids))
        return Update(text=text, cancel=self.stop_matched)

    def _on_finished(self, event: RequestFinished) -> Update:
        text = ""
        if not self.stop_matched:
            text = self._stops.push(self._detok.flush())
            text += self._stops.flush()
        usage = Usage(event.num_prompt_tokens or self.num_prompt_tokens,
                      event.num_generated_tokens, event.num_cached_tokens)
        reason = "stop" if self.stop_matched else event.finish_reason
        return Update(text=text, finish=Finish(reason, usage))

    def _on_failed(self, event: RequestFailed) -> Update:
        if self.stop_matched:  # the client already has all it asked for
            usage = Usage(self.num_prompt_tokens, self.num_tokens, 0)
            return Update(finish=Finish("stop", usage))
        return Update(error=from_failure(event))
