"""Slot placement: which free slot a new request runs in, and where its prefix comes from.

For every free slot the request's KV prefix can come from three places: what the slot already
holds (reuse), another slot (copy), or pages on disk (restore). Whatever none of them covers is
prefilled. The cost of an option is its token work, weighted by how expensive each kind is
relative to prefilling, plus the value of what the slot loses: resident tokens past the shared
prefix, cheap if their pages are on disk (they can be restored), full price if not.

Rules (docs/design/scheduling.md "Scheduling"): a slot that displaces nothing (empty, or
holding a prefix of the request) always wins over one that displaces a conversation; of those
that displace one, the conversation expected back last goes (scheduler/residency.py: a side
call, then the end of a turn, ...), then the cheapest, then the least recently used slot.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from switchyard.scheduler.requests import Slot
from switchyard.scheduler.residency import returns

# Cost of a token relative to prefilling it. Restoring reads and verifies a page from disk
# (~1 GB/s) and copies it into the slot; copying is a memory copy inside the worker.
RESTORE_COST = 0.05
COPY_COST = 0.02


@dataclass(frozen=True)
class Placement:
    slot: int
    reused: int  # tokens the slot keeps
    copy_from: int | None = None  # slot to copy the prefix from
    copied: int = 0  # prefix length after the copy
    restore_from: int = 0  # token where loading disk pages starts (page aligned)
    restored: int = 0  # tokens loaded from disk
    to_prefill: int = 0
    displaced: int = 0  # resident tokens the slot loses
    displaced_cost: float = 0.0

    @property
    def work(self) -> float:
        return self.to_prefill + COPY_COST * self.copied + RESTORE_COST * self.restored


@dataclass(frozen=True)
class Sources:
    """Where a request's prefix exists: in slots (reuse, copy) and on disk."""

    num_tokens: int  # the request's context (what must be in the slot before it decodes)
    disk_tokens: int  # tokens restorable from disk from the start (whole pages)
    # Slot index -> tokens of the context it holds and can give (see `usable_match`).
    slot_matches: dict[int, int]
    page_size: int
    trimmable: bool
    # A hybrid or window model: tokens each slot has in common with the context, whether or
    # not it has the state there. A restore brings the state with its last page, so the
    # attention KV before it may come from any of them (`_under_a_restore`).
    slot_shared: dict[int, int] = field(default_factory=dict)


def usable_match(slot: Slot, shared: int, trimmable: bool) -> int:
    """Of the `shared` leading tokens a slot has in common with a context, those it can give
    (keep, or copy to another slot)."""
    if not trimmable and (shared < len(slot.tokens) or slot.stateless_end):
        # Recurrent state cannot be rewound: only a pure extension reuses a slot, or one
        # that goes back to the slot's mark (a repeated prompt: worker/state_marks.py); nor
        # is there any at an end a restore's batch reached without it.
        return slot.state_mark if 0 < slot.state_mark <= shared else 0
    return shared


def options_for(slot: Slot, src: Sources, persisted_beyond: int) -> list[Placement]:
    n = src.num_tokens
    r = src.slot_matches.get(slot.index, 0)
    base = _displacing(slot, r, persisted_beyond)
    options = [Placement(reused=r, to_prefill=n - r, **base)]
    copies = [(m, i) for i, m in src.slot_matches.items() if i != slot.index and m > r]
    P = src.page_size
    if copies:
        c, i = max(copies)
        options.append(Placement(reused=0, copy_from=i, copied=c, to_prefill=n - c, **base))
        # The copy's whole pages, then the rest from disk: the prefix a busy sibling shares,
        # then this conversation's own pages (a main session back among its sub-agents).
        start = c // P * P
        if src.trimmable and src.disk_tokens > c and start > r:
            options.append(Placement(reused=0, copy_from=i, copied=start, restore_from=start,
                                     restored=src.disk_tokens - start,
                                     to_prefill=n - src.disk_tokens, **base))
    if src.disk_tokens > r:
        if src.trimmable:
            start = r // P * P
        else:  # state is restored with the last page: start from a page end the slot holds
            start = r if r == len(slot.tokens) and r % P == 0 else 0
        options.append(Placement(reused=start, restore_from=start,
                                 restored=src.disk_tokens - start,
                                 to_prefill=n - src.disk_tokens, **base))
    if not src.trimmable and src.disk_tokens:
        options += _under_a_restore(slot, src, persisted_beyond, base)
    return options


def _under_a_restore(slot: Slot, src: Sources, persisted_beyond: int,
                     base: dict) -> list[Placement]:
    """A hybrid or window model's restore brings the state with its last page: the attention
    KV before it may come from memory where no state is, the slot's own (cut back to a page
    end) or another slot's (copied there: `CopyPrefix.state_follows`). The restore loads at
    least its last page (docs/design/kv-pages.md "Hybrid models")."""
    P, n, disk = src.page_size, src.num_tokens, src.disk_tokens
    last = (disk - 1) // P * P  # where the page carrying the state starts
    own = min(src.slot_shared.get(slot.index, 0) // P * P, last)
    options = [Placement(reused=own, restore_from=own, restored=disk - own, to_prefill=n - disk,
                         **_displacing(slot, own, persisted_beyond))] if own else []
    copies = [(min(m // P * P, last), i) for i, m in src.slot_shared.items()
              if i != slot.index]
    c, i = max(copies, default=(0, None))
    if c > own:
        options.append(Placement(reused=0, copy_from=i, copied=c, restore_from=c,
                                 restored=disk - c, to_prefill=n - disk, **base))
    return options


def _displacing(slot: Slot, kept: int, persisted: int) -> dict:
    """A placement's slot and what it loses keeping `kept` of its tokens: the resident
    tokens past them, cheap where their pages are on disk (`persisted` of them: restorable
    later), full price where not."""
    displaced = len(slot.tokens) - kept
    persisted = min(persisted, displaced)
    return dict(slot=slot.index, displaced=displaced,
                displaced_cost=displaced - persisted + RESTORE_COST * persisted)


def choose_slot(slots: list[Slot], src: Sources,
                persisted_beyond: dict[int, int]) -> Placement | None:
    """The best placement over all free slots, or None when every slot is busy."""
    last_used = {s.index: s.last_used for s in slots}
    options = [p for s in slots if s.free
               for p in options_for(s, src, persisted_beyond.get(s.index, 0))]
    if not options:
        return None
    harmless = [p for p in options if p.displaced == 0]
    if harmless:
        return min(harmless, key=lambda p: (p.work, last_used[p.slot]))
    back = {s.index: returns(s) for s in slots}  # a side call's slot goes before a tool call's
    return min(options, key=lambda p: (back[p.slot], p.work + p.displaced_cost,
                                       last_used[p.slot]))
