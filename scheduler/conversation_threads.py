"""Which conversation a request belongs to, for the status's timeline of recent requests
(docs/design/scheduling.md "A picture of a session").

There are no conversation ids: as for the turns the page cache keeps (scheduler/turns.py), a
request whose context starts with a remembered turn's whole prompt context (its prompt less
its last token) continues that turn's conversation. Sub-agents started together share their
system prompt and tools but differ before their prompts end, so each is a conversation of its
own, and so is a main session's side request (a title, a quota check).

A label is what the status may show (scheduler/status_rows.py): the keyed hash of the
conversation's first page, the slot table's name for the prefix it holds, and when several
conversations of one tenant start with the same page (sub-agents under one system prompt),
`#2`, `#3`, ... in the order they started. Never a page id; meaningless outside this process.
Bounded: a forgotten turn's next request starts a new label.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from switchyard.scheduler.status_rows import conversation_label
from switchyard.scheduler.turns import REMEMBERED_TURNS, Anchor


class ConversationThreads:
    def __init__(self, capacity: int = REMEMBERED_TURNS) -> None:
        self.capacity = capacity
        self._labels: OrderedDict[Anchor, str] = OrderedDict()  # a turn -> its conversation
        # (tenant, first page's label) -> conversations started under it
        self._started: OrderedDict[tuple[str, str], int] = OrderedDict()

    def place(self, turn: Anchor | None, continued: Iterable[Anchor], first_page: bytes,
              tenant: str) -> str:
        """The label of a request being placed: that of the longest remembered turn whose
        prompt context its own starts with (`continued`), or a new one under `first_page`
        (its first page id, or any id of its start when it has no full page). Its own turn
        is remembered under it from now on."""
        known = [a for a in continued if a in self._labels]
        if known:
            label = self._labels[max(known, key=lambda a: a.num_tokens)]
        else:
            label = self._new_label(conversation_label(first_page), tenant)
        if turn is not None:
            self._remember(turn, label)
        return label

    def _new_label(self, first: str, tenant: str) -> str:
        key = (tenant, first)
        number = self._started.pop(key, 0) + 1
        self._started[key] = number
        while len(self._started) > self.capacity:
            self._started.popitem(last=False)
        return first if number == 1 else f"{first}#{number}"

    def _remember(self, turn: Anchor, label: str) -> None:
        self._labels[turn] = label
        self._labels.move_to_end(turn)
        while len(self._labels) > self.capacity:
            self._labels.popitem(last=False)

    def __len__(self) -> int:
        return len(self._labels)
