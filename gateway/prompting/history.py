"""Prefix-stable rendering: a returned assistant turn is rendered later as the exact tokens the
model generated, so the next request's prompt extends what the server has in its KV.

Why: KV is reused by exact token prefix. After a turn the server holds prompt + generated
tokens. When the client sends that turn back, the chat template re-renders it from text, and
that rarely gives the same tokens: a tool call's JSON is re-serialised, reasoning is dropped or
reformatted, a Qwen3 template inserts an empty think block, a random or unusual tokenization
does not survive decode + encode. Every such difference cuts the reusable prefix there.

`TurnMemory` remembers, for a bounded number of recent assistant turns, the generated token ids
(the "body": forced opening + generated tokens, excluding the end-of-turn token) and the
generation prompt text they followed (or, for a template without one, the end of the prompt),
keyed by the conversation they belong to: a hash of the prompt tokens they followed (the
prefix), with a hash of the message as returned (text + calls) or a tool-call id. A turn is
spliced only where the tokens before it are exactly the ones it followed, so one conversation
never renders another's reply, hidden reasoning included, just because their texts match.
`render_prompt` renders the conversation with each assistant message that may be remembered
replaced by a sentinel, tokenizes the text between sentinels on its own, and puts the remembered
body where the sentinel was (the one whose prefix is the tokens so far), cutting the template's
own opening of that turn back to the generation prompt the model actually saw.

A turn with tool calls keeps its calls in the sentinel message, with the sentinel as the first
call's only argument: templates need the calls to render what follows (gpt-oss names the tool
in the result's header and refuses a result without a call before it). The template's rendering
of the calls is then cut at the first end-of-turn token after the sentinel (`turn_ends`, the
model's stop tokens as text: `<|im_end|>`, `<|call|>`, `</s>`), which the template writes
where the model stopped. Anything that does not fit (sentinel missing or mangled by the
template, opening or end not found) falls back to the plain template rendering of that message.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import secrets
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from switchyard.gateway.errors import Abandoned, context_length_exceeded, invalid
from switchyard.gateway.output.reasoning import without_reasoning
from switchyard.gateway.output.tools import ToolSyntax
from switchyard.gateway.prompting.system_turns import place_system_messages
from switchyard.gateway.prompting.tool_text import messages_with_tools_as_text
from switchyard.gateway.prompting.turn_keys import (PrefixHash, call_ids_of, calls_of,
                                                    canonical_arguments, message_key)
from switchyard.gateway.prompting.turn_journal import (Placed, TurnJournal, TurnRecord, make_record,
                                            record_calls)

log = structlog.get_logger()

DEFAULT_MAX_TURNS = 1024
_OPENING_WINDOW = 512  # characters before a sentinel searched for the turn's opening
_PROBE = [{"role": "user", "content": "x"}]


# --- memory ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Remembered:
    body: array  # token ids the model saw after the generation prompt
    opening: str | None  # the generation prompt text they followed
    has_reasoning: bool
    key: str
    calls: tuple[tuple[str, Any], ...]
    call_ids: tuple[str, ...] = ()
    prefix: bytes = b""  # prefix_digest of the prompt tokens the body followed

    def record(self) -> TurnRecord:
        return make_record(self.key, self.calls, self.call_ids, self.body, self.opening,
                           self.has_reasoning, self.prefix)


@dataclass(frozen=True)
class Candidates:
    """What may be remembered for one assistant message: the openings to try (each gives the
    tokens before the turn, and so its prefix) for its message hash and its tool-call ids."""
    key: str
    calls: tuple[tuple[str, Any], ...]
    call_ids: tuple[str, ...]
    openings: tuple[str | None, ...]


MAX_OPENINGS_TRIED = 4  # per message: distinct openings (prefix cuts) tried, most recent first


class TurnMemory:
    """Bounded LRU of remembered assistant turns; thread-safe (rendering runs in a thread).

    A turn is found by (message hash, opening, prefix) or by a tool-call id whose prefix and
    calls match: two conversations with the same reply text are two entries, and neither is
    ever found for the other. With a `journal`, turns are also kept on disk and loaded back at start (gateway restart):
    the ones this LRU holds, in its order (a turn it lets go is marked forgotten on disk; a
    lookup marks the turn used when its last mark is more than max_turns/2 remembered turns
    old: docs/design/requests.md "Prefix-stable history").
    """

    def __init__(self, max_turns: int = DEFAULT_MAX_TURNS,
                 journal: TurnJournal | None = None) -> None:
        self.max_turns = max_turns
        self._turns: OrderedDict[int, Remembered] = OrderedDict()  # entry -> turn
        # (message hash, opening, prefix) -> entry; message hash -> its turns' openings, the
        # most recently used last, with the number of turns under each.
        self._exact: dict[tuple[str, str | None, bytes], int] = {}
        self._openings: dict[str, OrderedDict[str | None, int]] = {}
        self._by_call: dict[str, int] = {}  # tool-call id -> entry
        self._next = 0
        self._lock = threading.Lock()
        self.journal = journal if max_turns > 0 else None
        self._placed: dict[int, Placed] = {}  # entry -> where it is in the journal
        if self.journal is not None:
            for rec, placed in self.journal.load()[-max_turns:]:  # least recently used first
                entry = self._insert(Remembered(rec.body_ids(), rec.opening, rec.has_reasoning,
                                                rec.key, record_calls(rec), tuple(rec.call_ids),
                                                rec.prefix))
                self._placed[entry] = placed

    def __len__(self) -> int:
        return len(self._turns)

    def remember(self, message: dict[str, Any], body: Sequence[int], opening: str | None,
                 has_reasoning: bool, prefix: bytes = b"", salt: bytes = b"") -> None:
        """`prefix`: prefix_digest of the prompt tokens the body followed (under `salt`, the
        request's cache salt, which keys the message hash too)."""
        if self.max_turns <= 0 or not body:
            return
        key = message_key(message, salt)
        turn = Remembered(array("l", body), opening, has_reasoning, key,
                          tuple(calls_of(message)), tuple(call_ids_of(message)), prefix)
        with self._lock:
            entry = self._insert(turn)
            if self.journal is not None:
                placed = self.journal.append(turn.record())
                if placed is not None:
                    self._placed[entry] = placed
                if self.journal.needs_rewrite(sum(p.nbytes for p in self._placed.values())):
                    where = self.journal.rewrite([t.record() for t in self._turns.values()])
                    self._placed = {e: p for e, p in zip(self._turns, where) if p is not None}

    def _insert(self, turn: Remembered) -> int:
        entry, self._next = self._next, self._next + 1
        self._turns[entry] = turn
        exact = (turn.key, turn.opening, turn.prefix)
        previous = self._exact.get(exact)
        self._exact[exact] = entry
        if previous is None:  # else the same turn again: it replaces the older entry's place
            openings = self._openings.setdefault(turn.key, OrderedDict())
            openings[turn.opening] = openings.get(turn.opening, 0) + 1
        self._openings[turn.key].move_to_end(turn.opening)
        for call_id in turn.call_ids:
            self._by_call[call_id] = entry
        while len(self._turns) > self.max_turns:
            self._forget(*self._turns.popitem(last=False))
        return entry

    def _forget(self, entry: int, turn: Remembered) -> None:
        placed = self._placed.pop(entry, None)
        if placed is not None and self.journal is not None:
            self.journal.forget(placed)
        exact = (turn.key, turn.opening, turn.prefix)
        if self._exact.get(exact) == entry:
            del self._exact[exact]
            openings = self._openings[turn.key]
            openings[turn.opening] -= 1
            if not openings[turn.opening]:
                del openings[turn.opening]
            if not openings:
                del self._openings[turn.key]
        for call_id in turn.call_ids:
            if self._by_call.get(call_id) == entry:
                del self._by_call[call_id]

    def candidates(self, message: dict[str, Any], salt: bytes = b"") -> Candidates | None:
        """Whether an assistant message the client sent back may be a remembered turn (which
        one is decided by the tokens before it: `find`), and the openings to try; `salt`: the
        request's cache salt (turns of other salts are never candidates)."""
        key, call_ids = message_key(message, salt), tuple(call_ids_of(message))
        calls = tuple(calls_of(message))
        with self._lock:
            openings = list(reversed(self._openings.get(key, {})))
            for call_id in call_ids:
                turn = self._turns.get(self._by_call.get(call_id, -1))
                if turn is not None and turn.calls == calls and turn.opening not in openings:
                    openings.append(turn.opening)
        if not openings:
            return None
        return Candidates(key, calls, call_ids, tuple(openings[:MAX_OPENINGS_TRIED]))

    def find(self, candidates: Candidates, opening: str | None, prefix: bytes
             ) -> Remembered | None:
        """The turn for `candidates`' message that followed exactly the tokens `prefix` names
        (after `opening`), marked used; None if there is none."""
        with self._lock:
            entries = [self._exact.get((candidates.key, opening, prefix))]
            entries += [self._by_call.get(c) for c in candidates.call_ids]
            for entry in entries:
                turn = self._turns.get(entry) if entry is not None else None
                if turn is not None and turn.calls == candidates.calls and \
                        turn.opening == opening and turn.prefix == prefix:
                    self._turns.move_to_end(entry)
                    openings = self._openings.get(turn.key, {})
                    if turn.opening in openings:
                        openings.move_to_end(turn.opening)
                    self._mark_used(entry)
                    return turn
            return None

    def lookup(self, message: dict[str, Any], prefix: bytes = b"",
               opening: str | None = None, salt: bytes = b"") -> Remembered | None:
        """The turn remembered for `message` after the tokens `prefix` names, if any (by
        message hash or tool-call id); with `opening` None, any opening."""
        candidates = self.candidates(message, salt)
        if candidates is None:
            return None
        for tried in (opening,) if opening is not None else candidates.openings:
            turn = self.find(candidates, tried, prefix)
            if turn is not None:
                return turn
        return None

    def _mark_used(self, entry: int) -> None:
        """A "used" record for a looked-up turn whose last mark on disk is more than max_turns/2
        turns old: bounded writes (an agent resends every earlier turn with each request), and
        a reload orders turns by last use to within max_turns/2 remembered turns."""
        placed = self._placed.get(entry)
        if (placed is not None and self.journal is not None
                and self.journal.turns - placed.mark > self.max_turns // 2):
            self.journal.mark_used(placed)


# --- rendering ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rendered:
    ids: list[int]
    text_tail: str  # the end of the rendered text (what the output follows)
    opening: str | None  # the generation prompt text, when the template's is known
    num_spliced: int = 0  # assistant turns rendered from remembered tokens
    num_spliced_tokens: int = 0
    # With RenderOptions.note_unseen: the messages whose reasoning the template did not write
    # (what the model did not see; the Responses store does not keep it).
    unseen_reasoning: frozenset[int] = frozenset()
    prefix: bytes = b""  # prefix_digest(ids): the key a reply to this prompt is remembered by
    salt: bytes = b""  # the request's cache salt (RenderOptions.salt): the reply's too


@dataclass(frozen=True)
class RenderOptions:
    memory: TurnMemory | None = None
    prefix_stable: bool = True
    keep_reasoning: bool = True
    think_start: str | None = None
    turn_ends: tuple[str, ...] = ()  # end-of-generation tokens as text (see the module doc)
    # A vision model's prompt: expands each image marker the template wrote into the image's
    # placeholder tokens, before tokenizing (gateway/vision/prompt.py).
    image_text: Any = None
    # The call syntax tools are written with, as text, for a template that does not render
    # them (tool_text.py); None: the template renders tools itself.
    tools_as_text: ToolSyntax | None = None
    # Whether the template writes a system message after the first user turn where it stands
    # (system_turns.py); if not, such a message joins the user side at its place.
    system_in_place: bool = True
    # The most characters a rendered prompt may have (ctx x the longest token): a longer
    # rendering cannot fit the context and is refused before it is tokenized.
    max_chars: int | None = None
    ctx: int = 0  # the context, in tokens (with max_chars)
    note_unseen: bool = False  # find Rendered.unseen_reasoning
    # Set when the request's client left: rendering stops at its next step (Abandoned).
    abandoned: threading.Event | None = None
    # The request's cache salt: turns are remembered and found under it (PrefixHash).
    salt: bytes = b""

    def check_abandoned(self) -> None:
        if self.abandoned is not None and self.abandoned.is_set():
            raise Abandoned()


class TemplateError(Exception):
    pass


def apply_template(tokenizer: Any, messages: list[dict[str, Any]],
                   tools: list[dict[str, Any]] | None, kwargs: dict[str, Any],
                   add_generation_prompt: bool = True) -> str:
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False,
            **kwargs)
    except Exception as exc:  # request boundary: jinja raises anything the template does
        raise TemplateError(f"{type(exc).__name__}: {exc}") from None
    if not isinstance(text, str):
        raise TemplateError("the chat template did not produce text")
    return text


# Keyed by client-supplied chat_template_kwargs: bounded (LRU) and keyed by a digest, so junk
# kwargs can neither grow memory nor be held.
MAX_OPENINGS = 32
_openings: OrderedDict[bytes, str | None] = OrderedDict()
_openings_lock = threading.Lock()


def generation_opening(tokenizer: Any, kwargs: dict[str, Any]) -> str | None:
    """The text the template appends for `add_generation_prompt` (`<|im_start|>assistant\\n`),
    found by rendering a one-message probe with and without it; cached per template kwargs."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(str(id(tokenizer)).encode())
    digest.update(str(getattr(tokenizer, "chat_template", None)).encode("utf-8", "replace"))
    digest.update(json.dumps(kwargs, sort_keys=True, default=str).encode("utf-8", "replace"))
    cache_key = digest.digest()
    with _openings_lock:
        if cache_key in _openings:
            _openings.move_to_end(cache_key)
            return _openings[cache_key]
    try:
        bare = apply_template(tokenizer, _PROBE, None, kwargs, add_generation_prompt=False)
        full = apply_template(tokenizer, _PROBE, None, kwargs, add_generation_prompt=True)
        opening = full[len(bare):] if full.startswith(bare) and len(full) > len(bare) else None
    except TemplateError:
        opening = None
    with _openings_lock:
        _openings[cache_key] = opening
        while len(_openings) > MAX_OPENINGS:
            _openings.popitem(last=False)
    return opening


def template_messages(messages: list[dict[str, Any]], keep_reasoning: bool) -> list[dict]:
    """Messages as chat templates expect them: content never None, tool-call arguments as
    objects (as mlx-lm passes them), reasoning dropped unless kept. Reasoning goes to the
    template as `reasoning_content` and as `thinking` (gpt-oss's template reads that one)."""
    out = []
    for message in messages if keep_reasoning else without_reasoning(messages):
        message = dict(message)
        if message.get("content") is None:
            message["content"] = ""
        if message.get("reasoning_content") and "thinking" not in message:
            message["thinking"] = message["reasoning_content"]
        if message.get("tool_calls"):
            calls = []
            for call in message["tool_calls"]:
                function = dict(call.get("function") or {})
                function["arguments"] = _template_arguments(function.get("arguments"))
                calls.append({**call, "function": function})
            message["tool_calls"] = calls
        out.append(message)
    return out


def _template_arguments(arguments: Any) -> Any:
    value = canonical_arguments(arguments)
    return value if isinstance(value, dict) else ({} if arguments in (None, "") else arguments)


def _locate_opening(segment: str, opening: str | None, think_start: str | None
                    ) -> tuple[int, str] | None:
    """Where the remembered body goes in `segment` (the text before its sentinel): after the
    turn's opening, with the part of the opening the template did not write (a `<think>\\n`
    the generation prompt had) to be added back. None when the opening is not there."""
    if not opening:
        return len(segment), ""
    lo = max(0, len(segment) - len(opening) - _OPENING_WINDOW)
    at = segment.rfind(opening, lo)
    if at >= 0:
        return at + len(opening), ""
    if think_start and think_start in opening:
        head = opening[:opening.find(think_start)]
        at = segment.rfind(head, lo) if head else -1
        if at >= 0:
            return at + len(head), opening[len(head):]
    return None


def render_prompt(tokenizer: Any, messages: list[dict[str, Any]],
                  tools: list[dict[str, Any]] | None, kwargs: dict[str, Any],
                  options: RenderOptions) -> Rendered:
    """The prompt's token ids: the template's rendering with remembered turns spliced in."""
    placed, origin = place_system_messages(messages, options.system_in_place)
    messages = template_messages(placed, options.keep_reasoning)
    spliced: dict[int, Candidates] = {}
    memory = options.memory if options.prefix_stable else None
    if memory is not None:
        for i, message in enumerate(messages):
            if message.get("role") == "assistant":
                candidates = memory.candidates(message, options.salt)
                if candidates is not None:
                    spliced[i] = candidates
    opening = generation_opening(tokenizer, kwargs)
    turn_ends = options.turn_ends
    skipped = 0
    while True:
        nonce = secrets.token_hex(6)
        sentinels = {i: f"<<switchyard-turn-{nonce}-{i}>>" for i in spliced}
        shown = [_sentinel_message(m, sentinels[i], turn_ends) if i in spliced else m
                 for i, m in enumerate(messages)]
        if options.tools_as_text is not None:
            shown, shown_tools = messages_with_tools_as_text(shown, tools,
                                                             options.tools_as_text), None
        else:
            shown_tools = tools
        try:
            text = apply_template(tokenizer, shown, shown_tools, kwargs)
        except TemplateError as exc:
            if spliced and turn_ends:  # a template that rejects the calls' sentinel: plain one
                turn_ends = ()
                continue
            if spliced:
                spliced = {}
                continue
            raise invalid(f"The chat template rejected the messages: {exc}", param="messages",
                          code="invalid_messages") from None
        options.check_abandoned()
        if options.image_text is not None:
            text = options.image_text(text)
        if options.max_chars is not None and len(text) > options.max_chars:
            raise context_length_exceeded(-(-len(text) * options.ctx // options.max_chars),
                                          options.ctx, at_least=True)
        result = _splice(tokenizer, text, spliced, sentinels, memory, options, turn_ends)
        if isinstance(result, Rendered):
            tail = text[-256:]
            ends_with_opening = opening is not None and text.endswith(opening)
            unseen = frozenset(origin[i] for i in _unseen_reasoning(placed, text, spliced)) \
                if options.note_unseen else frozenset()
            return dataclasses.replace(result, text_tail=tail, unseen_reasoning=unseen,
                                       opening=opening if ends_with_opening else None)
        # Not this conversation's turn (its prefix differs), or the template mangled the
        # sentinel: render that message from its text. Each retry renders the whole prompt
        # again, so after a few every later candidate goes too (a history of many replies
        # that match other conversations' texts costs a bounded number of renderings).
        log.info("history.splice_skipped", message_index=result)
        skipped += 1
        spliced = {i: c for i, c in spliced.items()
                   if i != result and (skipped < MAX_SPLICE_RETRIES or i < result)}


def _unseen_reasoning(messages: list[dict[str, Any]], text: str,
                      spliced: dict[int, Candidates]) -> frozenset[int]:
    """Messages whose reasoning is not in the rendered text (templates drop earlier turns'
    reasoning, or all of it); a spliced turn's reasoning is in its remembered tokens."""
    unseen = set()
    for i, message in enumerate(messages):
        reasoning = message.get("reasoning_content")
        if i not in spliced and isinstance(reasoning, str) and reasoning.strip() \
                and (len(reasoning) > len(text) or reasoning.strip() not in text):
            unseen.add(i)
    return frozenset(unseen)


SENTINEL_ARGUMENT = "__switchyard_turn"


def _sentinel_message(message: dict[str, Any], sentinel: str,
                      turn_ends: tuple[str, ...]) -> dict[str, Any]:
    """What the template renders in place of a remembered turn (see the module doc)."""
    calls = message.get("tool_calls")
    if not calls or not turn_ends:
        return {"role": "assistant", "content": sentinel}
    first = dict(calls[0])
    first["function"] = {**(first.get("function") or {}), "arguments": {
        SENTINEL_ARGUMENT: sentinel}}
    return {"role": "assistant", "content": "", "tool_calls": [first, *calls[1:]]}


MAX_SPLICE_RETRIES = 3


def _find_turn(tokenizer: Any, segment: str, candidates: Candidates, memory: TurnMemory,
               think_start: str | None, prefix: PrefixHash
               ) -> tuple[Remembered, list[int]] | None:
    """The remembered turn that followed exactly the tokens so far (`prefix`) and what
    `segment` (the text before its sentinel) adds up to its opening; tried per opening."""
    for opening in candidates.openings:
        located = _locate_opening(segment, opening, think_start)
        if located is None:
            continue
        cut, extra = located
        segment_ids = _encode(tokenizer, segment[:cut] + extra)
        turn = memory.find(candidates, opening, prefix.with_added(segment_ids))
        if turn is not None:
            return turn, segment_ids
    return None


def _splice(tokenizer: Any, text: str, spliced: dict[int, Candidates],
            sentinels: dict[int, str], memory: TurnMemory | None, options: RenderOptions,
            turn_ends: tuple[str, ...] = ()) -> Rendered | int:
    """The spliced ids, or the index of a message that cannot be spliced."""
    ids: list[int] = []
    prefix = PrefixHash(salt=options.salt)
    pos = 0
    num_tokens = 0
    order = sorted(spliced)
    for n, i in enumerate(order):
        at = text.find(sentinels[i], pos)
        if at < 0 or text.count(sentinels[i]) != 1 or memory is None:
            return i
        options.check_abandoned()
        found = _find_turn(tokenizer, text[pos:at], spliced[i], memory, options.think_start,
                           prefix)
        if found is None:
            return i
        turn, segment_ids = found
        if turn.has_reasoning and not options.keep_reasoning:
            return i
        ids += segment_ids
        ids += turn.body
        prefix.add(segment_ids)
        prefix.add(turn.body)
        num_tokens += len(turn.body)
        pos = at + len(sentinels[i])
        if turn.calls and turn_ends:  # skip the template's calls, up to where the model stopped
            bound = text.find(sentinels[order[n + 1]], pos) if n + 1 < len(order) else -1
            ends = [e for e in (text.find(end, pos, bound if bound >= 0 else len(text))
                                for end in turn_ends) if e >= 0]
            if not ends:
                return i
            pos = min(ends)
    tail_ids = _encode(tokenizer, text[pos:])
    ids += tail_ids
    prefix.add(tail_ids)
    return Rendered(ids, "", None, len(spliced), num_tokens, prefix=prefix.digest(),
                    salt=options.salt)


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False)) if text else []
