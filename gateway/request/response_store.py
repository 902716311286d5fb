"""Recent Responses-API conversations by response id, for `previous_response_id` (bounded LRU).

A stored entry is the whole conversation up to and including that response's output, as
canonical chat messages (without the request's `instructions`, which OpenAI does not carry
over), holding only what the model saw: reasoning the chat template did not render is not kept
(a 20 MB `reasoning` input item the template drops cost 20 MB per response: issue 23,
finding 5). The store is bounded by count and by bytes: messages shared between entries (a
conversation's history, carried from one response to the next) are counted once, and the
least recently used entries go when either bound is passed; a conversation larger than the
byte bound is not stored. The server forgets old entries; a request naming one it no longer
has gets a 400 that asks for the full input.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

DEFAULT_MAX_RESPONSES = 256
DEFAULT_MAX_BYTES = 64 << 20


def message_bytes(value: Any) -> int:
    """About what a message holds: the length of its strings (a bound's unit, not exact)."""
    stack, total = [value], 0
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
            total += 8 * len(item)
        elif isinstance(item, list | tuple):
            stack.extend(item)
        else:
            total += 8
    return total


class ResponseStore:
    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES,
                 max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()
        # Each stored message once, by identity: [message, entries holding it, bytes].
        self._messages: dict[int, list] = {}
        self.num_bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response_id: str, messages: list[dict[str, Any]]) -> bool:
        """Keep `messages` under `response_id`; False when the bounds leave no room for it."""
        if self.max_responses <= 0:
            return False
        with self._lock:
            sizes = {id(m): self._messages[id(m)][2] if id(m) in self._messages
                     else message_bytes(m) for m in messages}
            if sum(sizes.values()) > self.max_bytes:
                return False  # alone larger than the store: a later request sends it all
            self._drop(response_id)
            for message in messages:
                held = self._messages.get(id(message))
                if held is None:
                    held = self._messages[id(message)] = [message, 0, sizes[id(message)]]
                    self.num_bytes += held[2]
                held[1] += 1
            self._items[response_id] = messages
            while len(self._items) > self.max_responses or self.num_bytes > self.max_bytes:
                self._drop(next(iter(self._items)))  # never this one: it fits alone
            return True

    def _drop(self, response_id: str) -> None:
        messages = self._items.pop(response_id, None)
        for message in messages or ():
            held = self._messages[id(message)]
            held[1] -= 1
            if held[1] == 0:
                del self._messages[id(message)]
                self.num_bytes -= held[2]

    def get(self, response_id: str) -> list[dict[str, Any]] | None:
        with self._lock:
            messages = self._items.get(response_id)
            if messages is not None:
                self._items.move_to_end(response_id)
            return messages
