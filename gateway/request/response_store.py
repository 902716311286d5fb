"""Recent Responses-API conversations by response id, for `previous_response_id` (bounded LRU).

A stored entry is the whole conversation up to and including that response's output, as
canonical chat messages (without the request's `instructions`, which OpenAI does not carry
over), holding only what the model saw: reasoning the chat template did not render is not kept
(a 20 MB `reasoning` input item the template drops cost 20 MB per response). The store is bounded by count and by bytes: messages shared between entries (a
conversation's history, carried from one response to the next) are counted once, and the
least recently used entries go when either bound is passed; a conversation larger than the
byte bound is not stored. The server forgets old entries; a request naming one it no longer
has gets a 400 that asks for the full input.

Image files (the bytes of a message's image parts) count toward the byte bound, and each
distinct file is kept once, by content hash: an agent that sends the same screenshot in many
requests, each a new input, costs its bytes once (docs/design/images.md "Images").

Each tenant (API key) has a store of its own (`ResponseStores`), with an equal share of both
bounds: one key's responses evict only its own conversations, never another's, and another
key's response ids are not found. Nothing is shared between them, files included (a shared
file would make a tenant's store cheaper by what another sent).
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_RESPONSES = 256
DEFAULT_MAX_BYTES = 64 << 20


@dataclass
class _Held:
    message: dict[str, Any]
    entries: int  # stored entries holding it
    size: int  # its bytes, its files not counted (they are, once, in `_files`)
    files: tuple[bytes, ...]  # digests of its files, one per occurrence


class _Interned:
    """A message with each byte string replaced by the store's copy of the same content (or
    itself, the first time): its size without its files, and its files by digest."""

    def __init__(self, files: dict[bytes, list]) -> None:
        self._known = files
        self.size = 0
        self.files: dict[bytes, bytes] = {}
        self.digests: list[bytes] = []

    def copy(self, value: Any) -> Any:
        """`value`, or a copy of it holding the shared files; the same object when it holds no
        byte strings (a history without images keeps its identity)."""
        if isinstance(value, bytes):
            digest = hashlib.sha256(value).digest()
            self.digests.append(digest)
            known = self._known.get(digest)
            shared = known[0] if known is not None else self.files.get(digest, value)
            self.files[digest] = shared
            return shared
        if isinstance(value, str):
            self.size += len(value)
            return value
        if isinstance(value, dict):
            self.size += 8 * len(value)
            items = {k: self.copy(v) for k, v in value.items()}
            same = all(items[k] is v for k, v in value.items())
            return value if same else items
        if isinstance(value, list | tuple):
            items = [self.copy(v) for v in value]
            same = all(a is b for a, b in zip(items, value, strict=True))
            return value if same else type(value)(items)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            changes = {}
            for field in dataclasses.fields(value):
                old = getattr(value, field.name)
                new = self.copy(old)
                if new is not old:
                    changes[field.name] = new
            return dataclasses.replace(value, **changes) if changes else value
        self.size += 8
        return value


def message_bytes(value: Any) -> int:
    """About what a message holds, by the store's rule (`_Interned`: the length of its strings,
    a few bytes per key or other value), its files counted at every occurrence."""
    interned = _Interned({})
    interned.copy(value)
    return interned.size + sum(len(interned.files[d]) for d in interned.digests)


class ResponseStore:
    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES,
                 max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()
        # Each stored message once, by identity.
        self._messages: dict[int, _Held] = {}
        # Each image file once, by content hash: [bytes, occurrences in held messages].
        self._files: dict[bytes, list] = {}
        self.num_bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    @property
    def num_files(self) -> int:
        return len(self._files)

    def put(self, response_id: str, messages: list[dict[str, Any]]) -> bool:
        """Keep `messages` under `response_id`; False when the bounds leave no room for it."""
        if self.max_responses <= 0:
            return False
        with self._lock:
            prepared: list[tuple[dict[str, Any], _Held | None, _Interned | None]] = []
            size, files = 0, {}
            for message in messages:
                held = self._messages.get(id(message))
                if held is not None:
                    prepared.append((message, held, None))
                    size += held.size
                    files.update((d, len(self._files[d][0])) for d in held.files)
                    continue
                interned = _Interned(self._files)
                prepared.append((interned.copy(message), None, interned))
                size += interned.size
                files.update((d, len(data)) for d, data in interned.files.items())
            if size + sum(files.values()) > self.max_bytes:
                return False  # alone larger than the store: a later request sends it all
            self._drop(response_id)
            stored = []
            for message, held, interned in prepared:
                if held is None:
                    held = self._hold(message, interned)
                held.entries += 1
                stored.append(held.message)
            self._items[response_id] = stored
            while len(self._items) > self.max_responses or self.num_bytes > self.max_bytes:
                self._drop(next(iter(self._items)))  # never this one: it fits alone
            return True

    def _hold(self, message: dict[str, Any], interned: _Interned) -> _Held:
        held = self._messages.get(id(message))
        if held is not None:  # the same message twice in one conversation
            return held
        held = self._messages[id(message)] = _Held(message, 0, interned.size,
                                                   tuple(interned.digests))
        self.num_bytes += held.size
        for digest in held.files:
            file = self._files.get(digest)
            if file is None:
                file = self._files[digest] = [interned.files[digest], 0]
                self.num_bytes += len(file[0])
            file[1] += 1
        return held

    def _drop(self, response_id: str) -> None:
        messages = self._items.pop(response_id, None)
        for message in messages or ():
            held = self._messages[id(message)]
            held.entries -= 1
            if held.entries:
                continue
            del self._messages[id(message)]
            self.num_bytes -= held.size
            for digest in held.files:
                file = self._files[digest]
                file[1] -= 1
                if file[1] == 0:
                    del self._files[digest]
                    self.num_bytes -= len(file[0])

    def get(self, response_id: str) -> list[dict[str, Any]] | None:
        with self._lock:
            messages = self._items.get(response_id)
            if messages is not None:
                self._items.move_to_end(response_id)
            return messages


class ResponseStores:
    """One `ResponseStore` per tenant, each with an equal share of the bounds (at least one
    response each), so the whole stays within them."""

    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES,
                 max_bytes: int = DEFAULT_MAX_BYTES, tenants: Iterable[str] = ("",)) -> None:
        names = list(tenants) or [""]
        share = len(names)
        self._stores = {name: ResponseStore(max_responses and max(1, max_responses // share),
                                            max_bytes // share) for name in names}

    def of(self, tenant: str) -> ResponseStore:
        """The store of `tenant` (a name of the key file; "" with no keys)."""
        return self._stores[tenant]

    @property
    def num_bytes(self) -> int:
        return sum(store.num_bytes for store in self._stores.values())
