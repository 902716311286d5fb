"""The scheduler's index of KV pages on disk: a forest of content-addressed pages. No I/O.

A page names its whole prefix through `parent_id` (docs/design/kv-pages.md "KV pages"), so the pages on disk
form a tree: a conversation is a path from a root, a shared system prompt is a common prefix
with several children. A page whose parent is not on disk (evicted, or not written yet) is
kept: it cannot be restored past the gap, but it is a root for eviction and is linked again if
its parent arrives. The kvstore's inventory rebuilds the tree at start.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

PAGE_ID_BYTES = 16
ROOT_ID = bytes(PAGE_ID_BYTES)  # the parent of the first page of every sequence


class PageLike(Protocol):
    """What `from_inventory` reads: `proto.scheduler_kvstore.PageInfo` fits."""

    page_id: bytes
    parent_id: bytes
    nbytes: int
    last_used: float


class _Page:
    __slots__ = ("parent_id", "nbytes", "last_used")

    def __init__(self, parent_id: bytes, nbytes: int, last_used: float):
        self.parent_id, self.nbytes, self.last_used = parent_id, nbytes, last_used


class DiskPageTree:
    def __init__(self) -> None:
        self._pages: dict[bytes, _Page] = {}
        # Keyed by parent id whether or not the parent is on disk, so that a parent arriving
        # after its children finds them without a scan.
        self._children: dict[bytes, set[bytes]] = {}
        self._total_bytes = 0

    @classmethod
    def from_inventory(cls, pages: Iterable[PageLike]) -> DiskPageTree:
        tree = cls()
        for p in pages:
            tree.add(p.page_id, p.parent_id, p.nbytes, p.last_used)
        return tree

    # --- changes -------------------------------------------------------------------------------

    def add(self, page_id: bytes, parent_id: bytes, nbytes: int, last_used: float) -> None:
        """Record a page on disk. Adding a known page again updates its size and recency."""
        _check_id(page_id, "page_id")
        _check_id(parent_id, "parent_id")
        if page_id == ROOT_ID:
            raise ValueError("page_id must not be the all-zero root id")
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        old = self._pages.get(page_id)
        if old is not None:
            # The id hashes the parent id, so a different parent means a bug upstream.
            if old.parent_id != parent_id:
                raise ValueError(f"page {page_id.hex()} re-added with a different parent")
            self._total_bytes += nbytes - old.nbytes
            old.nbytes, old.last_used = nbytes, max(old.last_used, last_used)
            return
        self._pages[page_id] = _Page(parent_id, nbytes, last_used)
        self._children.setdefault(parent_id, set()).add(page_id)
        self._total_bytes += nbytes

    def remove(self, page_id: bytes) -> None:
        """Forget a page (evicted, or found corrupt). Its children, if any, become roots."""
        page = self._pages.pop(page_id)
        siblings = self._children[page.parent_id]
        siblings.discard(page_id)
        if not siblings:
            del self._children[page.parent_id]
        self._total_bytes -= page.nbytes

    def touch(self, path_page_ids: Iterable[bytes], now: float) -> None:
        """A request used this chain: every page on it (that is on disk) was used at `now`.

        Touching the whole chain, not only the leaf, keeps the invariant that a prefix is at
        least as recent as any conversation through it. Recency never goes backwards.
        """
        for page_id in path_page_ids:
            page = self._pages.get(page_id)
            if page is not None and page.last_used < now:
                page.last_used = now

    # --- queries -------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._pages)

    def __contains__(self, page_id: object) -> bool:
        return page_id in self._pages

    def contains(self, page_id: bytes) -> bool:
        return page_id in self._pages

    @property
    def total_bytes(self) -> int:
        return self._total_bytes

    def page_ids(self) -> list[bytes]:
        return list(self._pages)

    def nbytes(self, page_id: bytes) -> int:
        return self._pages[page_id].nbytes

    def last_used(self, page_id: bytes) -> float:
        return self._pages[page_id].last_used

    def parent(self, page_id: bytes) -> bytes | None:
        """The parent if it is on disk; None for a first page or a page after a gap."""
        parent_id = self._pages[page_id].parent_id
        return parent_id if parent_id in self._pages else None

    def num_children(self, page_id: bytes) -> int:
        """How many pages on disk have `page_id` as their parent."""
        return len(self._children.get(page_id, ()))

    def leaves(self) -> list[bytes]:
        """Pages with no child on disk: the only ones eviction may take."""
        return [pid for pid in self._pages if pid not in self._children]

    def longest_prefix(self, page_ids: Sequence[bytes]) -> int:
        """How many of a request's chain pages are on disk, contiguous from the first."""
        for i, page_id in enumerate(page_ids):
            if page_id not in self._pages:
                return i
        return len(page_ids)

    def subtree_recency(self) -> dict[bytes, float]:
        """For every page, the latest use of it or of any page below it on disk.

        A conversation's recency is its leaf's; a prefix is as recent as its most recent
        conversation. Normally `touch` already gives that, but an inventory read from files
        may not. One pass from the leaves up, O(pages).
        """
        recency = {pid: p.last_used for pid, p in self._pages.items()}
        waiting = {pid: len(kids) for pid, kids in self._children.items() if pid in self._pages}
        ready = self.leaves()
        while ready:
            page_id = ready.pop()
            parent_id = self._pages[page_id].parent_id
            if parent_id not in self._pages:
                continue
            if recency[page_id] > recency[parent_id]:
                recency[parent_id] = recency[page_id]
            waiting[parent_id] -= 1
            if waiting[parent_id] == 0:
                ready.append(parent_id)
        return recency


def _check_id(value: bytes, name: str) -> None:
    if not isinstance(value, bytes) or len(value) != PAGE_ID_BYTES:
        raise ValueError(f"{name} must be {PAGE_ID_BYTES} bytes")
