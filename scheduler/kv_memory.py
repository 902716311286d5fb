"""Running requests sized by what they hold (docs/design/kv-pages.md "Memory plan"): the KV that slots
hold, plus a reserve for the growth of running requests, stays within the worker's budget.

Pure decisions over the core's slots and requests, counted by common/held_kv.py as the worker
planned them. Before each step `relieve` says what must leave memory when the holds outgrow the
budget: idle slots first (those least worth keeping, scheduler/residency.py; their pages are on
disk or on their way), then
running requests, the newest or lowest-priority first, each staged to disk and resuming later
by restore (never the last one: one request at full context always fits, the worker's plan
checked that). A request is placed only where `room_for` finds its hold fits, making room by
releasing idle slots whose pages are on disk.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from switchyard.common.held_kv import SlotHold, growth_reserve, held_tokens
from switchyard.scheduler.requests import Request, Slot
from switchyard.scheduler.residency import keep_key


def request_hold(req: Request, held: int) -> SlotHold:
    """A running request's hold when its slot has `held` tokens: the rest of its context
    (prefill or restore) and its reply's next growth are its reserve."""
    return SlotHold(held, growth_reserve(req.num_context - held,
                                         req.max_tokens - len(req.generated)), running=True)


def idle_hold(slot: Slot, page_size: int) -> SlotHold:
    """An idle slot's hold: its cache, or, shelved (RunStep.shelves), its tokens exactly with
    its full pages' ids, a page other shelved slots hold too counted once (docs/design/kv-pages.md
    "Shared pages in memory"). `page_size` 0: every slot counted as its own cache."""
    if slot.leaving and slot.cut_to and page_size:
        return shelved_hold(slot, slot.cut_to, page_size)
    if slot.shelved and page_size:
        return shelved_hold(slot, len(slot.tokens), page_size)
    return SlotHold(len(slot.tokens))


def shelved_hold(slot: Slot, num_tokens: int, page_size: int) -> SlotHold:
    """The slot's first `num_tokens` held as shared pages: those tokens exactly, with the
    ids of their full pages."""
    return SlotHold(num_tokens, pages=tuple(slot.page_ids[:num_tokens // page_size]),
                    page_size=page_size)


def slot_hold(slot: Slot, requests: dict[str, Request], page_size: int = 0) -> SlotHold:
    req = requests.get(slot.rid) if slot.rid is not None else None
    return request_hold(req, len(slot.tokens)) if req is not None else idle_hold(slot, page_size)


def holds(slots: Iterable[Slot], requests: dict[str, Request],
          page_size: int = 0) -> list[SlotHold]:
    """What every slot holds that stays: running ones, and idle ones not leaving."""
    return [slot_hold(s, requests, page_size) for s in slots if _held(s)]


def _held(slot: Slot) -> bool:
    """Whether the slot holds KV that stays: running, or idle and not leaving (or leaving
    cut, keeping its front)."""
    return slot.rid is not None or bool(slot.tokens and (not slot.leaving or slot.cut_to))


@dataclass(frozen=True)
class Relief:
    leave: list[int] = field(default_factory=list)  # idle slots whose KV leaves memory
    preempt: list[str] = field(default_factory=list)  # running requests staged to disk
    cut: tuple[int, int] | None = None  # as `Room.cut`


def relieve(slots: list[Slot], requests: dict[str, Request], budget: int, ctx: int,
            goes_first: Callable[[Request], tuple],
            keep: Callable[[Slot], tuple] = keep_key, page_size: int = 0,
            cut: bool = False) -> Relief:
    """What must leave memory for the holds to fit `budget` (tokens): idle slots, the least
    `keep` first (scheduler/residency.py: a side call, the end of a turn, ..., least recently
    used), then running requests, the greatest `goes_first` first (the newest or
    lowest-priority), never the last one running. `cut`: the last idle slot to leave keeps
    the leading pages that fit (as `room_for` cuts)."""
    gone: set[int] = set()
    leave, preempt = [], []

    def held() -> int:
        return held_tokens((slot_hold(s, requests, page_size) for s in slots
                            if s.index not in gone and _held(s)), ctx)

    idle = sorted((s for s in slots if s.rid is None and s.tokens and not s.leaving), key=keep)
    running = sorted((requests[s.rid] for s in slots if s.rid is not None), key=goes_first,
                     reverse=True)
    while held() > budget:
        if idle:
            slot = idle.pop(0)
        elif len(running) > 1:
            req = running.pop(0)
            slot = slots[req.slot]
            preempt.append(req.rid)
        else:
            break  # one request alone fits at full context (the worker's plan)
        gone.add(slot.index)
        leave.append(slot.index)
    last = slots[leave[-1]] if leave and not preempt else None
    if cut and page_size and last is not None:
        kept = [slot_hold(s, requests, page_size) for s in slots
                if s.index not in gone and s is not last and _held(s)]
        pages = _worth_cutting(last, slots, kept, budget, ctx, page_size)
        if pages:
            return Relief(leave, preempt, (last.index, pages * page_size))
    return Relief(leave, preempt)


@dataclass(frozen=True)
class Room:
    leave: list[int]  # idle slots whose KV leaves memory
    # An idle slot that keeps its first tokens (whole pages) and lets only the rest go (the
    # disk holds it): (slot, tokens kept), or None.
    cut: tuple[int, int] | None = None


def room_for(hold: SlotHold, slot_index: int, slots: list[Slot],
             requests: dict[str, Request], budget: int, ctx: int,
             releasable: Callable[[Slot], bool],
             keep: Callable[[Slot], tuple] = keep_key, page_size: int = 0,
             cut: bool = False, its_pages: Iterable[bytes] = ()) -> Room | None:
    """The idle slots that must leave for a request placed in slot `slot_index` with `hold`
    to fit `budget`, or None when it does not fit: idle slots that are `releasable` now (all
    their tokens on disk or on their way) may go, the least `keep` first; the others
    stay (a slot already leaving goes only once releasable, and counts until then). A request
    with none running beside it always runs (then every idle slot that can, leaves).
    `cut`: the room left once the slots that fit whole stay goes to the most worth keeping of
    those leaving: it keeps the leading full pages that fit, held as shared pages
    (docs/design/kv-pages.md "Cut slots"), and only the rest leaves; not where every page it
    would keep is held elsewhere too (another slot's, or the request's own, `its_pages`):
    such a slot would be a second copy, kept at a sibling's cost."""
    fixed, spare = [hold], []
    for s in slots:
        if s.index == slot_index:
            continue
        if s.rid is not None:
            fixed.append(slot_hold(s, requests))
        elif s.tokens and releasable(s) and not s.cut_to:
            spare.append(s)
        elif s.tokens:
            fixed.append(idle_hold(s, page_size))
    alone = not any(s.rid is not None for s in slots if s.index != slot_index)
    if held_tokens(fixed, ctx) > budget and not alone:
        return None  # (alone, a request always runs: one at full context fits the plan)
    kept, leaving = list(fixed), []
    for s in sorted(spare, key=keep, reverse=True):  # the most worth keeping stays
        stays = idle_hold(s, page_size)
        if not s.leaving and held_tokens(kept + [stays], ctx) <= budget:
            kept.append(stays)
        else:
            leaving.append(s)
    for s in leaving if cut and page_size else ():  # the room left, to the most worth keeping
        pages = 0 if s.leaving else _worth_cutting(s, slots, kept, budget, ctx, page_size,
                                                   its_pages)
        if pages:
            return Room([x.index for x in leaving], (s.index, pages * page_size))
    return Room([x.index for x in leaving])


def _worth_cutting(slot: Slot, slots: list[Slot], kept: list[SlotHold], budget: int, ctx: int,
                   page_size: int, its_pages: Iterable[bytes] = ()) -> int:
    """The leading full pages of `slot` to keep beside `kept`: the most that fit, or 0 where
    they fit none or all of them are held elsewhere too (by another slot, or in `its_pages`
    by the request making room): a second copy kept at a sibling's cost."""
    pages = _pages_that_fit(slot, kept, budget, ctx, page_size)
    if not pages:
        return 0
    elsewhere = set(its_pages).union(*(x.page_ids for x in slots if x is not slot))
    return pages if any(pid not in elsewhere for pid in slot.page_ids[:pages]) else 0


def _pages_that_fit(slot: Slot, kept: list[SlotHold], budget: int, ctx: int,
                    page_size: int) -> int:
    """The most leading full pages of `slot` that fit beside `kept` (0: none)."""
    lo, hi = 0, min(len(slot.page_ids), len(slot.tokens) // page_size)
    if len(slot.tokens) == hi * page_size:
        hi -= 1  # all of it is no cut
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if held_tokens(kept + [shelved_hold(slot, mid * page_size, page_size)], ctx) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo
