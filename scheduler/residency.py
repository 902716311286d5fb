"""Which idle conversation leaves memory first, and when: what the agent said when its reply
ended (docs/design/scheduling.md "Residency").

The gateway tells the scheduler how each reply ended (`ReplyEnded`): a tool call is back within
seconds (the tool's result), the end of a turn waits for a person, a reply cut at its token
limit says nothing (no word), and a side call (a title, a summary, a classifier: a reply
whose shape the client forced) is never extended, nor is a slot whose conversation was copied
whole into another slot to go on there (`superseded`). Idle slots leave memory side calls and
superseded slots first, then ends of turns, then slots no word came for (an old gateway, a
plain completion, a reply cut at its limit: with the grace they always had), then tool calls.
Within each, a conversation is expected back as long after its reply as its last turn came
after the reply before it (`expected_back`: twenty sub-agents taking turns come back one
cycle later, a tool loop after its tool's time), and once past that, as long after now as it
is overdue (`next_use`); the one next expected latest goes first. A conversation seen once is
due at its reply: recency alone orders those.
A slot whose conversation's next turn already waits in the queue stays before all of them
(it is used next). Within the same word, a slot holding the start of a waiting request's
prompt that no running slot holds (sub-agents started together, under one system prompt)
stays: the waiting siblings copy it instead of restoring it. Pure: the managers pass the slots
and the time.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Set
from types import MappingProxyType

from switchyard.scheduler.config import CoreConfig
from switchyard.scheduler.requests import Slot

# How a reply ended (ReplyEnded.end) -> how soon its conversation is back, lowest first out;
# BACK_NOW: its next turn is already waiting in the queue.
SIDE_CALL, END_OF_TURN, NO_WORD, BACK_SOON, BACK_NOW = 0, 1, 2, 3, 4
# A reply cut at its token limit says nothing of when its client is back: no word.
_RETURNS = {"side_call": SIDE_CALL, "superseded": SIDE_CALL, "stop": END_OF_TURN,
            "cancelled": END_OF_TURN, "tool_calls": BACK_SOON}


def returns(slot: Slot) -> int:
    """How soon the conversation idle in `slot` is expected back (a rank, higher: sooner)."""
    return _RETURNS.get(slot.reply_end, NO_WORD)


def keep_key(slot: Slot, feeding: Set[int] = frozenset(),
             back: Mapping[int, float] = MappingProxyType({}), now: float | None = None) -> tuple:
    """Idle slots sorted by this leave memory first-to-last: a side call, then the end of a
    turn, then no word, then a tool call, then a conversation whose next turn is waiting
    (`back`: when that turn arrived); a slot feeding waiting siblings after the others of its
    rank; then, at `now`, the one next expected latest (`next_use`); or, of slots whose turn
    waits, the one whose turn arrived last (the queue serves it last). Without `now`, the
    least recently used."""
    if slot.index in back:
        return BACK_NOW, slot.index in feeding, -back[slot.index]
    return (returns(slot), slot.index in feeding,
            slot.last_used if now is None else -next_use(slot, now))


def expected_back(slot: Slot) -> float | None:
    """When the idle slot's conversation is expected back: as long after its reply as its
    last turn came after the reply before it (`Slot.return_gap`); None on its first turn."""
    return None if slot.return_gap is None else slot.last_used + slot.return_gap


def next_use(slot: Slot, now: float) -> float:
    """When the idle slot's conversation is next expected, at `now`: when it is due back
    (`expected_back`; on its first turn, at its reply), or, once past that, as long after
    `now` as it is overdue: the longer a conversation is silent past its time, the less it is
    expected soon. Recency alone orders conversations seen once; one due back in an hour goes
    before one a few seconds late."""
    due = expected_back(slot)
    due = slot.last_used if due is None else due
    return due if due > now else 2 * now - due


def grace_s(slot: Slot, config: CoreConfig) -> float:
    """How long an idle slot past --slots stays before its KV leaves memory: none for a side
    call or the end of a turn (nobody is coming back soon), --release-after-s with no word,
    and `tool_return_s` after a tool call (the tool runs; a main session waits for its
    sub-agents)."""
    rank = returns(slot)
    if rank <= END_OF_TURN:
        return 0.0
    if rank == BACK_SOON:
        return max(config.release_after_s, config.tool_return_s)
    return config.release_after_s


def back_soon(slot: Slot, now: float, config: CoreConfig) -> bool:
    """Whether the idle slot's conversation is expected back within its grace: its reply
    ended in a tool call, whose result comes back in seconds."""
    return returns(slot) >= BACK_SOON and now - slot.last_used < grace_s(slot, config)


def waited_for(slots: Iterable[Slot], waiting_pages: Mapping[tuple[bytes, bytes], float]
               ) -> dict[int, float]:
    """Idle slots whose conversation's next turn is in the queue, with when that turn arrived
    (`waiting_pages`: each waiting request's pages, by the arrival of the first to ask): the
    last full page the slot holds (a page id names its whole prefix) is one of a waiting
    request's. Such a slot is used next; giving it up for another request only trades one
    restore for another."""
    return {s.index: waiting_pages[(s.root, s.page_ids[-1])] for s in slots
            if s.rid is None and s.page_ids and (s.root, s.page_ids[-1]) in waiting_pages}


def feeding(slots: Iterable[Slot], waiting_first_pages: Set[tuple[bytes, bytes]]) -> set[int]:
    """Idle slots whose first page (under its chain root) begins a waiting request's context
    and is held by no running slot: a sibling that waits will copy it from there."""
    slots = list(slots)
    running = {(s.root, s.page_ids[0]) for s in slots if s.rid is not None and s.page_ids}
    return {s.index for s in slots if s.rid is None and s.page_ids
            and (s.root, s.page_ids[0]) in waiting_first_pages
            and (s.root, s.page_ids[0]) not in running}
