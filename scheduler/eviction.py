"""Disk eviction choices and budget sizing. Pure: the caller passes the time and applies the plan.

Policy (docs/design/kv-pages.md "Disk eviction policy"):
- Only leaf pages go, so a conversation loses its tail first and a prefix shared by several
  conversations (a system prompt) goes only after every conversation through it is gone.
  Evicting a leaf can expose its parent, which joins the candidates in the same pass.
- Least recently used conversation first. A page's recency is the latest use of it or of any
  page below it: hit counts are never used (the newest checkpoint has zero hits and is the
  one the next switch needs).
- Pages used within the protection window go last; taking one is thrash, reported with the
  working set and a budget that would hold it.
- Pinned pages (a request is restoring them, or waits to) never go; nor, therefore, their prefix.
- `evict_first` pages (superseded state snapshots) go before everything else, leaves only.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Set
from dataclasses import dataclass, field

from switchyard.scheduler.page_tree import DiskPageTree

GIB = 1 << 30
DEFAULT_PROTECT_WINDOW_S = 86400.0

# Candidate classes, evicted in this order.
_FIRST, _NORMAL, _PROTECTED = 0, 1, 2


@dataclass(frozen=True)
class ThrashReport:
    """Fields for the `kv.thrash` log line: the budget is smaller than the working set."""

    num_protected_evicted: int
    working_set_bytes: int  # pages used within the window (and pinned ones)
    budget_bytes: int
    suggested_budget_bytes: int  # working set + incoming, rounded up to a whole GiB


@dataclass(frozen=True)
class EvictionPlan:
    page_ids: list[bytes] = field(default_factory=list)  # in eviction order, leaves first
    freed_bytes: int = 0
    thrash: ThrashReport | None = None
    # False: even evicting all that may go leaves no room for the incoming pages; the caller
    # skips writing them, and the plan only brings what is already on disk within budget.
    fits: bool = True


def plan_eviction(
    tree: DiskPageTree,
    budget_bytes: int,
    incoming_bytes: int,
    now: float,
    protect_window_s: float = DEFAULT_PROTECT_WINDOW_S,
    pinned: Set[bytes] = frozenset(),
    evict_first: Set[bytes] = frozenset(),
) -> EvictionPlan:
    """Choose pages to delete so that `tree.total_bytes + incoming_bytes <= budget_bytes`."""
    if budget_bytes < 0 or incoming_bytes < 0:
        raise ValueError("budget_bytes and incoming_bytes must be >= 0")
    need = tree.total_bytes + incoming_bytes - budget_bytes
    if need <= 0:
        return EvictionPlan()
    recency = tree.subtree_recency()
    protect_since = now - protect_window_s
    picked, freed, num_protected = _pick(tree, need, recency, protect_since, pinned, evict_first)
    fits = freed >= need
    if not fits:
        # No room for the incoming pages whatever we delete: don't delete for them. Only
        # bring the pages already on disk within budget (the budget may have been lowered).
        need = tree.total_bytes - budget_bytes
        picked, freed, num_protected = (
            _pick(tree, need, recency, protect_since, pinned, evict_first)
            if need > 0 else ([], 0, 0))
    thrash = None
    if num_protected:
        working_set = sum(tree.nbytes(pid) for pid, t in recency.items()
                          if t >= protect_since or pid in pinned)
        thrash = ThrashReport(num_protected, working_set, budget_bytes,
                              round_up_gib(working_set + incoming_bytes))
    return EvictionPlan(picked, freed, thrash, fits)


def _pick(
    tree: DiskPageTree,
    need: int,
    recency: dict[bytes, float],
    protect_since: float,
    pinned: Set[bytes],
    evict_first: Set[bytes],
) -> tuple[list[bytes], int, int]:
    """Pop leaves in (class, recency) order until `need` bytes are freed or none are left."""

    def entry(pid: bytes) -> tuple[int, float, bytes]:
        if pid in evict_first:
            cls = _FIRST
        elif recency[pid] >= protect_since:
            cls = _PROTECTED
        else:
            cls = _NORMAL
        # page_id breaks ties so that plans are deterministic.
        return cls, recency[pid], pid

    heap = [entry(pid) for pid in tree.leaves() if pid not in pinned]
    heapq.heapify(heap)
    children_left: dict[bytes, int] = {}
    picked: list[bytes] = []
    freed = num_protected = 0
    while heap and freed < need:
        cls, _, pid = heapq.heappop(heap)
        picked.append(pid)
        freed += tree.nbytes(pid)
        num_protected += cls == _PROTECTED
        parent = tree.parent(pid)
        if parent is None:
            continue
        left = children_left.get(parent, tree.num_children(parent)) - 1
        children_left[parent] = left
        if left == 0 and parent not in pinned:
            heapq.heappush(heap, entry(parent))  # exposed: a leaf once its children go
    return picked, freed, num_protected


def round_up_gib(nbytes: int) -> int:
    return max(1, math.ceil(nbytes / GIB)) * GIB


def budget_report(
    kv_bytes_per_token: int, budget_bytes: int, conversation_tokens: int = 100_000
) -> dict:
    """What the disk budget holds, for the start-up line: tokens and conversations."""
    if kv_bytes_per_token <= 0 or conversation_tokens <= 0:
        raise ValueError("kv_bytes_per_token and conversation_tokens must be > 0")
    budget_tokens = budget_bytes // kv_bytes_per_token
    return {
        "budget_bytes": budget_bytes,
        "budget_gib": round(budget_bytes / GIB, 2),
        "kv_bytes_per_token": kv_bytes_per_token,
        "budget_tokens": budget_tokens,
        "conversation_tokens": conversation_tokens,
        "budget_conversations": round(budget_tokens / conversation_tokens, 1),
    }


def plan_budget(
    kv_bytes_per_token: int,
    conversations: int,
    tokens: int,
    page_overhead_bytes: int,
    page_tokens: int = 256,
) -> int:
    """Bytes of disk that hold `conversations` conversations of `tokens` tokens each.

    For `switchyard cache plan`. Counts every page in full and shares no prefix between
    conversations, so it errs on the side of enough. `page_overhead_bytes` is what a page
    costs beyond its KV (header, token ids, a recurrent-state snapshot if it carries one).
    """
    if kv_bytes_per_token <= 0 or page_tokens <= 0:
        raise ValueError("kv_bytes_per_token and page_tokens must be > 0")
    if min(conversations, tokens, page_overhead_bytes) < 0:
        raise ValueError("conversations, tokens and page_overhead_bytes must be >= 0")
    num_pages = math.ceil(tokens / page_tokens)
    page_bytes = page_tokens * kv_bytes_per_token + page_overhead_bytes
    return conversations * num_pages * page_bytes
