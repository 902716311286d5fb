"""The turns the scheduler remembers, and the tails each ended in (docs/design/kv-pages.md "KV pages").

A tail is where a conversation resumes. Conversations that share a prefix (sub-agents under a
main session's system prompt) keep their tails side by side under the shared page, so a
request that passes that page must not take the others' tails with it: only those of its own
conversation are superseded, and those nobody is known to end in (`PageCache.drop_passed_tails`).

There are no conversation ids: a conversation is known by its prompts. A request whose context
starts with a remembered turn's whole prompt context (the prompt less its last token, what its
tail holds) is that conversation's next turn, or the same turn again: that turn's tails (its
prompt's and its reply's, a branch the client may have left) are superseded by it. Sub-agents
differ from the main session and from each other before their prompts end, so none of them
supersedes another.

Pure bookkeeping, bounded: the oldest turns are forgotten first, and a forgotten turn's tails
are nobody's (deleted by the next request that passes them, or by eviction).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

# Turns remembered: far more conversations than a disk budget keeps tails of (a tail is up
# to a page, megabytes); a record is a few ids.
REMEMBERED_TURNS = 4096


@dataclass(frozen=True)
class Anchor:
    """Where a turn's prompt context ends: after `num_tokens` tokens, whose last partial page
    has the id `tail_id` under the full page `parent_id` (ROOT_ID: none); with no partial
    page (`tail_id` empty), `parent_id` is the context's last full page."""

    num_tokens: int
    parent_id: bytes
    tail_id: bytes


class RecentTurns:
    def __init__(self, capacity: int = REMEMBERED_TURNS):
        self.capacity = capacity
        self._tails: OrderedDict[Anchor, set[bytes]] = OrderedDict()  # oldest first
        self._owners: dict[bytes, set[Anchor]] = {}  # tail id -> turns that ended in it
        self._by_parent: dict[bytes, set[Anchor]] = {}
        self._replied: dict[Anchor, float] = {}  # when each turn's reply ended

    def __len__(self) -> int:
        return len(self._tails)

    def begin(self, anchor: Anchor) -> None:
        """A request with this prompt context was placed: its turn is remembered (from now
        on the newest)."""
        if anchor in self._tails:
            self._tails.move_to_end(anchor)
            return
        self._tails[anchor] = set()
        self._by_parent.setdefault(anchor.parent_id, set()).add(anchor)
        while len(self._tails) > self.capacity:
            self.retire(next(iter(self._tails)))

    def ended_in(self, anchor: Anchor, tail_id: bytes) -> None:
        """The turn's slot stored (or found stored) a tail where its prompt or reply ended."""
        self.begin(anchor)
        self._tails[anchor].add(tail_id)
        self._owners.setdefault(tail_id, set()).add(anchor)

    def replied(self, anchor: Anchor, now: float) -> None:
        """The turn's request left its slot at `now`: its reply ended (or it was preempted)."""
        if anchor in self._tails:
            self._replied[anchor] = now

    def retire(self, anchor: Anchor) -> float | None:
        """Forget a turn: superseded by its conversation's next one, or the oldest. Returns
        when its reply ended (None: it had not)."""
        replied = self._replied.pop(anchor, None)
        tails = self._tails.pop(anchor, None)
        if tails is None:
            return replied
        for tid in tails:
            owners = self._owners[tid]
            owners.discard(anchor)
            if not owners:
                del self._owners[tid]
        siblings = self._by_parent[anchor.parent_id]
        siblings.discard(anchor)
        if not siblings:
            del self._by_parent[anchor.parent_id]
        return replied

    def forget_tail(self, tail_id: bytes) -> None:
        """The tail left the disk (deleted, evicted, unreadable)."""
        for anchor in self._owners.pop(tail_id, ()):
            self._tails[anchor].discard(tail_id)

    def owned(self, tail_id: bytes) -> bool:
        """Whether a remembered turn ended in this tail: its conversation may resume there."""
        return tail_id in self._owners

    def under(self, parent_ids) -> list[Anchor]:
        """The remembered turns whose prompt context ends in a page below one of `parent_ids`
        (the candidates a request with those full pages may supersede)."""
        return [a for pid in parent_ids for a in self._by_parent.get(pid, ())]
