"""Recent Responses-API conversations by response id, for `previous_response_id` (bounded LRU).

A stored entry is the whole conversation up to and including that response's output, as
canonical chat messages (without the request's `instructions`, which OpenAI does not carry
over). The server forgets old entries; a request naming one it no longer has gets a 400 that
asks for the full input.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

DEFAULT_MAX_RESPONSES = 256


class ResponseStore:
    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES) -> None:
        self.max_responses = max_responses
        self._items: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response_id: str, messages: list[dict[str, Any]]) -> None:
        if self.max_responses <= 0:
            return
        with self._lock:
            self._items[response_id] = messages
            self._items.move_to_end(response_id)
            while len(self._items) > self.max_responses:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> list[dict[str, Any]] | None:
        with self._lock:
            messages = self._items.get(response_id)
            if messages is not None:
                self._items.move_to_end(response_id)
            return messages
