"""Incremental detokenization and text stop strings.

`IncrementalDetokenizer` decodes a short window at the tail of the generated tokens and emits
only text that is final: when the window's decoding ends in U+FFFD (an incomplete UTF-8
character, e.g. the first bytes of an emoji split over byte-level tokens), the text before it
goes out and the incomplete tail is held back until the next tokens complete it. It works with
any Hugging Face tokenizer (byte-level BPE, SentencePiece), because it only calls `decode`.

`StopMatcher` cuts the text at the first stop string and holds back a suffix that could still
become one, so a stop string is never emitted, not even partly.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

_REPLACEMENT = "\ufffd"
# Prompt tokens decoded before the first generated token, so that tokenizers whose decoding
# depends on the left context (SentencePiece's leading space) render the first token right.
_CONTEXT_TOKENS = 4


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, skip_ids: Iterable[int] = (),
                 context_ids: Sequence[int] = (), show_special: bool = False) -> None:
        """`show_special`: special tokens are decoded as text (a chat format's markers, such as
        harmony's `<|channel|>`); the caller lists the other special tokens in `skip_ids`."""
        self._tokenizer = tokenizer
        self._skip = frozenset(skip_ids)
        self._skip_special = not show_special
        self._tokens: list[int] = []
        self._prefix_offset = 0  # start of the decoding window
        self._read_offset = 0  # tokens before this are already emitted
        self._held_emitted = 0  # text already emitted from a window still held open
        self._seed(list(context_ids)[-_CONTEXT_TOKENS:])

    def _seed(self, context: list[int]) -> None:
        """Start the window on the prompt's last tokens, unless they end mid-character."""
        if context and not self._decode(context).endswith(_REPLACEMENT):
            self._tokens = context
            self._read_offset = len(context)

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=self._skip_special)

    def add(self, token_ids: Iterable[int]) -> str:
        """Append generated tokens; return the text that became final."""
        before = len(self._tokens)
        self._tokens.extend(t for t in token_ids if t >= 0 and t not in self._skip)
        if len(self._tokens) == before:
            return ""
        prefix_text = self._decode(self._tokens[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._tokens[self._prefix_offset:])
        incomplete = new_text.endswith(_REPLACEMENT)
        stable = new_text.rstrip(_REPLACEMENT) if incomplete else new_text
        start = len(prefix_text) + self._held_emitted
        delta = stable[start:] if len(stable) > start else ""
        if incomplete:  # the window stays open; remember what of it is already out
            self._held_emitted += len(delta)
        elif len(new_text) > len(prefix_text):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._tokens)
            self._held_emitted = 0
        return delta

    def flush(self) -> str:
        """The text still held back (a character that never completed decodes to U+FFFD)."""
        if self._read_offset == len(self._tokens):
            return ""
        prefix_text = self._decode(self._tokens[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._tokens[self._prefix_offset:])
        start = len(prefix_text) + self._held_emitted
        self._prefix_offset = self._read_offset = len(self._tokens)
        self._held_emitted = 0
        return new_text[start:]


class StopMatcher:
    def __init__(self, stops: Iterable[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._pending = ""
        self.matched = False
        self.matched_stop: str | None = None  # the stop string that matched

    def push(self, text: str) -> str:
        """Feed text; return what may be shown. After a match, everything is dropped."""
        if self.matched:
            return ""
        if not self._stops:
            return text
        buffer = self._pending + text
        found = [(i, s) for s in self._stops if (i := buffer.find(s)) >= 0]
        cut = min(found)[0] if found else -1
        if cut >= 0:
            self.matched = True
            self.matched_stop = min(found, key=lambda f: (f[0], -len(f[1])))[1]
            self._pending = ""
            return buffer[:cut]
        keep = self._held_suffix(buffer)
        self._pending = buffer[len(buffer) - keep:]
        return buffer[:len(buffer) - keep]

    def _held_suffix(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that starts some stop string."""
        longest = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def flush(self) -> str:
        out, self._pending = ("" if self.matched else self._pending), ""
        return out
