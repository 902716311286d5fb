"""Split a chat model's streamed text into reasoning, answer text and tool calls (pure).

`OutputParser.push(text)` takes text as it becomes final (after detokenization and stop
strings) and returns events; `finish()` flushes what is held at the end. Text that could still
be the start of a marker (`<tool` of `<tool_call>`) is held back until it is decided, so a
marker is never shown as text. A tool call is buffered until its end marker and then emitted as
`ToolCallStart` + `ToolCallDone`; a forced call (`forced` given) is announced at once, with its
name when known, because the caller wrote its opening into the prompt.

A call that does not parse becomes text (with its markers) and is counted in `num_malformed`;
the caller logs the count, never the text. A forced call that does not parse is repaired
(tools.repair_forced) and counted in `num_repaired`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from switchyard.gateway.output.reasoning import ThinkSyntax
from switchyard.gateway.output.tools import (ToolCall, ToolSyntax, best_tool, parse_calls,
                                             partial_arguments, repair_forced, tool_names)


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    id: str
    name: str | None  # None until known (a forced `required` call announced early)


@dataclass(frozen=True)
class ToolCallDone:
    index: int
    call: ToolCall


Event = TextDelta | ReasoningDelta | ToolCallStart | ToolCallDone


@dataclass(frozen=True)
class Forced:
    """A call whose opening the gateway wrote into the prompt."""

    opening: str  # the text after the start marker that is already in the prompt
    name: str | None  # the forced function; None for `required` with several tools


_NORMAL, _REASONING, _TOOL, _DONE = "normal", "reasoning", "tool", "done"


def _held_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a marker."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:n]):
                longest = n
                break
    return longest


@dataclass
class OutputParser:
    think: ThinkSyntax | None = None
    syntax: ToolSyntax | None = None  # None: tool calls are not parsed (no tools, or "none")
    tools: list[dict[str, Any]] | None = None
    start_in_reasoning: bool = False
    forced: Forced | None = None
    parallel: bool = True
    new_id: Callable[[], str] = lambda: "call_0"

    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: list[ToolCall] = field(default_factory=list)
    num_malformed: int = 0
    num_repaired: int = 0
    malformed: list[str] = field(default_factory=list)  # for logs only with --log-content
    truncated_call: bool = False  # the last call was cut by the token limit (incomplete)

    def __post_init__(self) -> None:
        self._state = _NORMAL
        self._held = ""  # text not yet decided
        self._at_start = True  # nothing but whitespace seen yet
        self._strip_leading = False  # drop whitespace before the answer (after reasoning)
        self._call_text = ""  # text of the open tool call (after its start marker)
        self._call_marker = self.syntax.start if self.syntax is not None else ""
        self._space_before_call = ""  # whitespace before the open call: dropped if it parses
        self._forced_pending = self.forced
        self._early_start: ToolCallStart | None = None
        if self.forced is not None:
            self._state = _TOOL
            self._call_text = self.forced.opening
        elif self.start_in_reasoning and self.think is not None:
            self._state = _REASONING
            self._at_start = False

    # --- API -------------------------------------------------------------------------------

    def start_events(self) -> list[Event]:
        """Events known before any output: the announcement of a call forced by name."""
        if self.forced is None or self.forced.name is None or self._early_start is not None:
            return []
        self._early_start = ToolCallStart(0, self.new_id(), self.forced.name)
        return [self._early_start]

    @property
    def stop_requested(self) -> bool:
        """A single call is complete and no more are allowed: the caller may cancel."""
        return self._state == _DONE

    @property
    def in_open_call(self) -> bool:
        return self._state == _TOOL

    def push(self, text: str) -> list[Event]:
        if not text or self._state == _DONE:
            return []
        self._held += text
        events: list[Event] = []
        while self._held and self._state != _DONE:
            before = (self._state, len(self._held))
            self._step(events, final=False)
            if (self._state, len(self._held)) == before:
                break  # waiting for more text
        return events

    def finish(self, *, closed_by_stop: bool = False, truncated: bool = False) -> list[Event]:
        """Flush held text. `closed_by_stop`: the output ended on the call's end marker as a
        stop token, so an open call is complete; `truncated`: the token limit ended it, so an
        open forced call is returned as far as it was written (`truncated_call`), unrepaired."""
        events: list[Event] = []
        while self._held and self._state not in (_DONE, _TOOL):
            self._step(events, final=True)
        if self._state == _TOOL:
            self._call_text += self._held
            self._held = ""
            closed = closed_by_stop or not self.syntax.end
            if truncated and not closed and self._forced_pending is not None:
                self._cut_forced_call(events)
            else:
                self._close_call(events, closed=closed)
        return events

    def _cut_forced_call(self, events: list[Event]) -> None:
        """A forced call the token limit cut: an incomplete call with the partial arguments
        (never repaired to `{}`, which would present a call its schema forbids as complete)."""
        forced, self._forced_pending = self._forced_pending, None
        text, self._call_text = self._call_text, ""
        name = forced.name or best_tool(self.syntax.guess_name(text), tool_names(self.tools))
        arguments = self._partial_arguments(text, forced)
        start = self._early_start or ToolCallStart(len(self.calls), self.new_id(), name)
        if self._early_start is None:
            events.append(ToolCallStart(start.index, start.id, name))
        call = ToolCall(start.id, name, arguments, complete=False)
        self.calls.append(call)
        events.append(ToolCallDone(start.index, call))
        self.truncated_call = True
        self._state, self._held = _DONE, ""

    # --- states ----------------------------------------------------------------------------

    def _markers(self) -> tuple[str, ...]:
        if self._state == _REASONING:
            return (self.think.end,)
        if self._state == _TOOL:
            return (self.syntax.end,) if self.syntax.end else ()
        markers = []
        if self.syntax is not None and (self._at_start or not self.syntax.only_at_start):
            markers += [self.syntax.start, *self.syntax.alt_starts]
        if self._at_start and self.think is not None:
            markers.append(self.think.start)
        return tuple(markers)

    def _step(self, events: list[Event], final: bool) -> None:
        if self._state == _NORMAL:
            self._step_normal(events, final)
        elif self._state == _REASONING:
            self._step_reasoning(events, final)
        elif self._state == _TOOL:
            self._step_tool(events)

    def _step_normal(self, events: list[Event], final: bool) -> None:
        held = self._held
        if self._at_start and self.think is not None:
            stripped = held.lstrip()
            if stripped.startswith(self.think.start):
                self._held = stripped[len(self.think.start):]
                self._state, self._at_start = _REASONING, False
                return
            if not final and self.think.start.startswith(stripped):
                return  # whitespace or a partial `<think>`: wait
        if self._strip_leading:
            held = held.lstrip()
            if not held:
                self._held = ""
                return
            self._strip_leading = False
        at, start = self._find_start(held)
        if at >= 0:
            before = held[:at]
            text = before.rstrip()  # the whitespace before a call is the template's separator
            self._emit_text(events, text)
            self._space_before_call = before[len(text):]
            keep = self.syntax.keep_start and start == self.syntax.start
            self._call_marker = "" if keep else start
            self._held = held[at + (0 if keep else len(start)):]
            self._state, self._call_text = _TOOL, ""
            return
        if final:
            self._emit_text(events, held)
            self._held = ""
            return
        keep = _held_suffix(held, self._markers())
        body = held[:len(held) - keep]
        ready = body.rstrip() if self.syntax is not None else body
        self._emit_text(events, ready)
        self._held = held[len(ready):]

    def _find_start(self, held: str) -> tuple[int, str]:
        """Where the first call starts in `held` and with which marker; (-1, "") if none."""
        if self.syntax is None:
            return -1, ""
        found = (-1, "")
        for marker in (self.syntax.start, *self.syntax.alt_starts):
            at = held.find(marker) if marker else -1
            if at >= 0 and (found[0] < 0 or at < found[0]):
                found = (at, marker)
        if self.syntax.only_at_start and found[0] >= 0 and (
                not self._at_start or held[:found[0]].strip()):
            return -1, ""  # Llama 3: a call is the whole output, not a `{` in the text
        return found

    def _step_reasoning(self, events: list[Event], final: bool) -> None:
        held, end = self._held, self.think.end
        if not "".join(self.reasoning):
            held = held.lstrip()  # the newline after <think>
        at = held.find(end)
        if at >= 0:
            self._emit_reasoning(events, held[:at].rstrip())
            self._held = held[at + len(end):]
            self._state, self._strip_leading = _NORMAL, True
            return
        if final:
            self._emit_reasoning(events, held)
            self._held = ""
            return
        keep = _held_suffix(held, (end,))
        body = held[:len(held) - keep]
        ready = body.rstrip()  # trailing whitespace waits: it may precede </think>
        self._emit_reasoning(events, ready)
        self._held = held[len(ready):]

    def _step_tool(self, events: list[Event]) -> None:
        end = self.syntax.end
        at = self._held.find(end) if end else -1
        if at < 0:
            keep = _held_suffix(self._held, (end,)) if end else 0
            self._call_text += self._held[:len(self._held) - keep]
            self._held = self._held[len(self._held) - keep:]
            return
        self._call_text += self._held[:at]
        self._held = self._held[at + len(end):]
        self._close_call(events, closed=True)

    def _partial_arguments(self, text: str, forced: Forced) -> str:
        return partial_arguments(self.syntax, text, forced.opening, forced.name is not None)

    # --- output ----------------------------------------------------------------------------

    def _emit_text(self, events: list[Event], text: str) -> None:
        if text:
            if text.strip():
                self._at_start = False
            self.content.append(text)
            events.append(TextDelta(text))

    def _emit_reasoning(self, events: list[Event], text: str) -> None:
        if text:
            self.reasoning.append(text)
            events.append(ReasoningDelta(text))

    def _close_call(self, events: list[Event], closed: bool) -> None:
        forced, self._forced_pending = self._forced_pending, None
        text = self._call_text
        self._call_text = ""
        self._state = _NORMAL
        self._at_start = False
        if forced is not None:
            (name, arguments), repaired = repair_forced(self.syntax, text, forced.name,
                                                        self.tools or [])
            self.num_repaired += repaired
            start = self._early_start or ToolCallStart(len(self.calls), self.new_id(), name)
            self._add_call(events, start, name, arguments, announce=self._early_start is None)
        else:
            parsed = parse_calls(self.syntax, text, self.tools) if closed else None
            if parsed is None:
                self.num_malformed += 1
                raw = self._call_marker + text + (self.syntax.end if closed else "")
                self.malformed.append(raw)
                self._emit_text(events, self._space_before_call + raw)
                self._space_before_call = ""
                return
            self._space_before_call = ""
            for name, arguments in parsed:
                start = ToolCallStart(len(self.calls), self.new_id(), name)
                self._add_call(events, start, name, arguments, announce=True)
        if not self.parallel:
            self._state, self._held = _DONE, ""
        else:
            self._strip_leading = True

    def _add_call(self, events: list[Event], start: ToolCallStart, name: str, arguments: str,
                  announce: bool) -> None:
        if announce:
            events.append(ToolCallStart(start.index, start.id, name))
        call = ToolCall(start.id, name, arguments)
        self.calls.append(call)
        events.append(ToolCallDone(start.index, call))

    # --- results ---------------------------------------------------------------------------

    @property
    def content_text(self) -> str:
        return "".join(self.content)

    @property
    def reasoning_text(self) -> str:
        return "".join(self.reasoning)
