"""The offline optimum inside Switchyard's own memory layout, for bench/residency.py.

`optimal` in bench/residency_policies.py keeps pages: a prefix shared by twenty conversations
is held once, in memory and on disk. The worker keeps whole slots: each conversation in memory
holds its own copy of what it shares (docs/design/kv-pages.md "Memory plan"). The two differ
in what fits, not only in what they choose to keep. `optimal-slots` separates the two: it is
the scheduler core itself (bench/residency_core.py) with its two choices told the future:

- which idle slot leaves memory (`MemoryManager._keep_key`) and which one a new request
  displaces (`placement.returns`): the one whose content is next needed furthest ahead;
- which disk page goes (the recency that `plan_eviction` ranks leaves by): the one next
  needed furthest ahead (Belady's MIN over pages).

"Next needed" is the trace order of the first unfinished request whose prompt holds the page.
The core's other rules (the memory plan, pinned pages, leaves only) stay as they are, so the
row is the best that this residency and eviction could do with the core's memory layout: what
Switchyard's policy loses against it is the policy's; what `optimal-slots` loses against
`optimal` is the layout's.
"""

from __future__ import annotations

import contextlib

from switchyard.scheduler import memory_manager, placement
from switchyard.scheduler.page_tree import DiskPageTree
from switchyard.scheduler.requests import Slot

NEVER = float(1 << 60)


class Oracle:
    """What each page is next needed for, from the trace's prompts, as the replay goes on."""

    def __init__(self, chains: list[list[bytes]], finished) -> None:
        self.users: dict[bytes, list[int]] = {}  # page id -> requests whose prompt holds it
        for i, chain in enumerate(chains):
            for pid in chain:
                self.users.setdefault(pid, []).append(i)
        self.finished = finished  # request index -> whether it has finished (live)
        self.first_open: dict[bytes, int] = {}  # where the search of a page's users resumes

    def next_use(self, pid: bytes) -> float:
        """The trace index of the first unfinished request whose prompt holds `pid`."""
        users = self.users.get(pid)
        if not users:
            return NEVER
        k = self.first_open.get(pid, 0)
        while k < len(users) and self.finished(users[k]):
            k += 1
        self.first_open[pid] = k
        return float(users[k]) if k < len(users) else NEVER

    def slot_next_use(self, slot: Slot) -> tuple[float, float]:
        """When the slot's whole content (its last full page), then its prefix (its first),
        is next needed."""
        if not slot.page_ids:
            return NEVER, NEVER
        return self.next_use(slot.page_ids[-1]), self.next_use(slot.page_ids[0])

    def leave_key(self, slot: Slot) -> tuple[int, float, float]:
        """Idle slots sorted by this leave memory first-to-last: the furthest need first, all
        of one rank (the first key, as the core's `keep_key` has a word's: so that
        `disk_copy.gaps_last` still sends slots whose disk copy was taken last)."""
        deep, first = self.slot_next_use(slot)
        return 0, -deep, -first

    def returns(self, slot: Slot) -> float:
        """`placement.returns`: higher is needed sooner (displaced last)."""
        return -self.slot_next_use(slot)[0]

    def recency(self, tree) -> dict[bytes, float]:
        """Disk leaves go lowest first: the furthest need first."""
        return {pid: -self.next_use(pid) for pid in tree.page_ids()}


@contextlib.contextmanager
def told_the_future(oracle: Oracle):
    """Every core's residency order, displacement and disk eviction ranked by `oracle`, while
    it lasts."""
    saved = (memory_manager.MemoryManager._keep_key, placement.returns,
             DiskPageTree.subtree_recency)
    memory_manager.MemoryManager._keep_key = lambda self, now: oracle.leave_key
    placement.returns = oracle.returns
    DiskPageTree.subtree_recency = lambda tree: oracle.recency(tree)
    try:
        yield
    finally:
        (memory_manager.MemoryManager._keep_key, placement.returns,
         DiskPageTree.subtree_recency) = saved
