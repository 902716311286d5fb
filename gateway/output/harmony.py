"""gpt-oss's harmony format: the output is a sequence of messages on channels.

    <|channel|>analysis<|message|>Reasoning.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>
    <|start|>assistant<|channel|>final<|message|>The answer.<|return|>

`analysis` is reasoning, a message with a recipient (`to=functions.NAME`, in the header before
or after the channel) is a tool call whose body is its JSON arguments, and `final` (or
`commentary` without a recipient, a preamble) is text. `<|end|>` closes a message;
`<|call|>` and `<|return|>` end the output (they are stop tokens).

The `openai-harmony` package parses this from token ids, but it loads the o200k vocabulary
file from the network on first use (no offline copy ships with it), and it only knows gpt-oss's
own token ids; the documented text format is parsed here instead, with `OutputParser`'s
streaming rules: markers are held back until decided, so the same events come out however
the text is chunked (docs/design/requests.md "Chat formats").
"""

from __future__ import annotations

import regex as re

from switchyard.gateway.output.parser import _DONE, _NORMAL, _REASONING, _TOOL, Event, OutputParser, \
    _held_suffix

START, CHANNEL, MESSAGE, END = "<|start|>", "<|channel|>", "<|message|>", "<|end|>"
RETURN, CALL = "<|return|>", "<|call|>"
_HEADER = "header"
_MAX_HEADER = 512  # characters: a longer "header" is text that happened to contain <|channel|>
_CHANNEL_RE = re.compile(r"<\|channel\|>\s*([\w.-]+)")
_RECIPIENT_RE = re.compile(r"\bto=([^\s<]+)")


class HarmonyParser(OutputParser):
    def __post_init__(self) -> None:
        super().__post_init__()
        self._call_marker = ""
        self._header = ""
        self._state = _NORMAL
        self._at_start = False
        self._separate = False  # a new text message after earlier text: a blank line between
        if self.forced is not None:  # the prompt ends inside the header of a call message
            self._state, self._header = _HEADER, self.syntax.start + self.forced.opening
            self._call_text = ""
            if MESSAGE in self._header:
                self._open_message()

    # --- states ----------------------------------------------------------------------------

    def _markers(self) -> tuple[str, ...]:
        if self._state == _HEADER:
            return (MESSAGE,)
        if self._state in (_REASONING, _TOOL):
            return (END, CALL, RETURN, START, CHANNEL)
        return (START, CHANNEL, END, RETURN, CALL)

    def _step(self, events: list[Event], final: bool) -> None:
        if self._state == _HEADER:
            self._step_header(events, final)
        else:
            self._step_body(events, final)

    def _step_body(self, events: list[Event], final: bool) -> None:
        """Text of the current message (or between messages) up to the next marker."""
        held = self._held
        found = [(held.find(m), m) for m in self._markers()]
        found = [(at, m) for at, m in found if at >= 0]
        if found:
            at, marker = min(found)
            self._emit_body(events, held[:at])
            self._held = held[at + len(marker):]
            self._end_message(events, closed=True)
            if marker in (START, CHANNEL):
                self._state, self._header = _HEADER, marker
            return
        keep = 0 if final else _held_suffix(held, self._markers())
        self._emit_body(events, held[:len(held) - keep])
        self._held = held[len(held) - keep:]

    def _step_header(self, events: list[Event], final: bool) -> None:
        self._header += self._held
        self._held = ""
        at = self._header.find(MESSAGE)
        if at >= 0:
            self._held = self._header[at + len(MESSAGE):]
            self._header = self._header[:at + len(MESSAGE)]
            self._open_message()
        elif final or len(self._header) > _MAX_HEADER:
            text, self._header = self._header, ""  # not a header after all: it is text
            self._state = _NORMAL
            self._emit_text(events, text)

    def _open_message(self) -> None:
        header = self._header[:-len(MESSAGE)]
        channel = _CHANNEL_RE.search(header)
        recipient = _RECIPIENT_RE.search(header)
        if recipient is not None and self.syntax is not None:
            self._state = _TOOL
            # The call's text as ToolSyntax.parse reads it: `NAME ...<|message|>` + arguments.
            name_at = recipient.start(1)
            if recipient.group(1).startswith("functions."):
                name_at += len("functions.")
            self._call_text = header[name_at:] + MESSAGE
        elif channel is not None and channel.group(1) == "analysis":
            self._state = _REASONING
        else:
            self._state = _NORMAL  # final, or a commentary preamble: text for the user
            self._separate = bool(self.content)
        self._header = ""

    # --- output ----------------------------------------------------------------------------

    def _emit_body(self, events: list[Event], text: str) -> None:
        if self._state == _REASONING:
            self._emit_reasoning(events, text)
        elif self._state == _TOOL:
            self._call_text += text
        elif text:
            if self._separate:
                text, self._separate = "\n\n" + text, False
            self._emit_text(events, text)

    def _end_message(self, events: list[Event], closed: bool) -> None:
        if self._state == _TOOL:
            self._close_call(events, closed=closed)
            self._strip_leading = False
            if self._state != _DONE:
                self._state = _NORMAL
        elif self._state == _REASONING:
            self._state = _NORMAL

    def finish(self, *, closed_by_stop: bool = False, truncated: bool = False) -> list[Event]:
        events: list[Event] = []
        while self._held and self._state not in (_DONE, _TOOL, _HEADER):
            self._step(events, final=True)
        if self._state == _HEADER:
            self._header += self._held
            self._held = ""
            if self.forced is not None:  # a forced call cut off in its header: repair it
                self._state, self._call_text = _TOOL, self._header[len(self.syntax.start):]
            else:
                self._step_header(events, final=True)
        if self._state == _TOOL:
            self._call_text += self._held
            self._held = ""
            if truncated and not closed_by_stop and self._forced_pending is not None:
                self._cut_forced_call(events)
            else:
                self._close_call(events, closed=closed_by_stop)
        return events

    def _partial_arguments(self, text: str, forced) -> str:
        """The call's text is `NAME ...<|message|>` + the JSON arguments."""
        at = text.find(MESSAGE)
        return text[at + len(MESSAGE):].strip() if at >= 0 else ""
