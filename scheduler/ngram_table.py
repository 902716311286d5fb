"""One tenant's n-gram index for the speculative proposer (scheduler/proposer.py;
docs/design/speculative-decoding.md "Speculative decoding", "Tenants"). Pure: numpy arrays, no I/O.

A direct-mapped table: each entry names the sequence and position where an n-gram (by its
hash) was last seen, and an insert overwrites its slot. Shared between tenants, one tenant's
insert could displace another's entry, and whether it did shows in the other's drafts (the
audit's n-gram probe planted an 8-gram in the slot a guessed text would take and read the
draft counters). So each tenant has a table of its own, hashed with a key of its own drawn at
random when the table is made, and keeps its own finished sequences to copy from: nothing
another tenant sends can displace, or find, its entries.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

DRAFT_PRIOR = 0.6  # a draft model's acceptance per token before any is measured


class NgramTable:
    def __init__(self, bits: int, keep_tokens: int, hash_key: int = 0) -> None:
        size = 1 << bits
        self.mask = size - 1
        self.keys = np.zeros(size, dtype=np.uint64)
        self.src = np.full(size, -1, dtype=np.int32)
        self.pos = np.zeros(size, dtype=np.int32)
        # Mixed into every n-gram hash of this table's sequences (0: the hashes of before).
        self.hash_key = hash_key
        self.keep_tokens = keep_tokens
        self.finished: OrderedDict[int, int] = OrderedDict()  # source id -> tokens kept
        self.finished_tokens = 0
        # The draft model's acceptance over this tenant's requests (a new request's prior).
        self.draft_acceptance = DRAFT_PRIOR

    @property
    def size(self) -> int:
        return self.mask + 1

    def slot_of(self, h: int) -> int:
        return (h ^ (h >> 29)) & self.mask

    def put(self, h: int, sid: int, pos: int) -> None:
        slot = self.slot_of(h)
        self.keys[slot] = h
        self.src[slot] = sid
        self.pos[slot] = pos

    def put_many(self, h: np.ndarray, sid: int, ends: np.ndarray) -> None:
        slots = (h ^ (h >> np.uint64(29))).astype(np.int64) & self.mask
        self.keys[slots] = h
        self.src[slots] = sid
        self.pos[slots] = ends

    def get(self, h: int) -> tuple[int, int] | None:
        """(source id, position) of the n-gram of hash `h` last seen, if its slot holds it."""
        slot = self.slot_of(h)
        if int(self.keys[slot]) != h:
            return None
        return int(self.src[slot]), int(self.pos[slot])

    def keep(self, sid: int, num_tokens: int) -> list[int]:
        """A finished sequence of `num_tokens` is kept to copy from; the oldest go past
        `keep_tokens`: returns their ids."""
        self.finished[sid] = num_tokens
        self.finished_tokens += num_tokens
        dropped = []
        while self.finished_tokens > self.keep_tokens and self.finished:
            old, n = self.finished.popitem(last=False)
            self.finished_tokens -= n
            dropped.append(old)
        return dropped
