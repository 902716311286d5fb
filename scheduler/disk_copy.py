"""Whether a slot's KV is on disk, true to the disk (docs/design/kv-pages.md "A disk smaller
than memory").

Write-through puts every full page of every slot on disk, so with a disk smaller than memory
disk eviction takes pages that resident slots still hold. Such a slot's count of pages on disk
(`Slot.num_persisted`) is lowered to the first page the disk lost (`recount`): it is never
released from memory as if its pages were on disk. Its KV is still in memory, so losing the
disk copy cost nothing yet: the slot is written again only once it must leave memory
(`rewrite_now`), not at once, where each rewrite would take another slot's pages and the disk
would churn. Written again as far as the disk takes it, it may leave knowing (`settle`): the
rest is re-read when its conversation is back. With --kv-write-back an attention-only model
writes back to such a disk instead (`written_later`): a slot is written only once it must
leave memory, and until then counts as a slot whose copy was taken. Pure: the page cache
passes what is kept and how many pages left the disk so far.
"""

from __future__ import annotations

from collections.abc import Callable

from switchyard.scheduler.requests import Slot


def recount(slot: Slot, kept: Callable[[bytes], bool], removals: int) -> bool:
    """Lower the slot's persisted count to its first page no longer on disk nor on its way
    there, when pages left the disk since it last looked (`removals`: how many so far).
    Whether the disk lost pages the slot counted (`Slot.disk_gap`, until written again)."""
    if slot.removals_seen != removals:
        slot.removals_seen = removals
        for k in range(slot.num_persisted):
            if not kept(slot.page_ids[k]):
                slot.num_persisted = k
                slot.disk_gap = True
                break
    if slot.num_persisted >= len(slot.page_ids):
        slot.disk_gap = False  # cut back before what the disk lost
    return slot.disk_gap


def rewrite_now(slot: Slot) -> bool:
    """Whether a slot whose disk copy was taken is written again now: it must leave memory
    (the KV budget or a newcomer wants the room, or it is past --slots)."""
    return slot.leaving or slot.disk_wanted


def stages_now(slot: Slot, kept: Callable[[bytes], bool], removals: int,
               writes_back: bool) -> bool:
    """Whether the slot's pages not on disk are staged in this step: not where the disk let
    go of its copy and it stays in memory (written again when it leaves, `recount`), nor,
    with `writes_back`, where they wait for it to leave (`written_later`)."""
    if recount(slot, kept, removals) and not rewrite_now(slot):
        return False
    return not (writes_back and written_later(slot))


def written_later(slot: Slot) -> bool:
    """Written back (`CoreConfig.writes_back`), whether the slot's pages wait to be written
    until it leaves memory: it stays, and some are not on disk. Such a slot counts as one
    whose copy was taken (`Slot.disk_gap`), and everything that follows for those follows for
    it: it leaves last within its rank, is written when it must go, and a newcomer beside
    running requests waits for them rather than send it out."""
    if rewrite_now(slot) or slot.num_persisted >= len(slot.page_ids):
        return False
    slot.disk_gap = True
    return True


def settle(slot: Slot) -> None:
    """The slot's stages are planned: one that must leave memory (or be overwritten) whose
    disk copy was taken has been written again as far as the disk takes it, and may now go
    knowing (`Slot.disk_tried`: the rest is re-read)."""
    if slot.disk_gap and rewrite_now(slot):
        slot.disk_tried = True
    slot.disk_gap = False


def gaps_last(keep: Callable[[Slot], tuple]) -> Callable[[Slot], tuple]:
    """The residency order (scheduler/residency.py `keep_key`) with, within each of its ranks
    (its first key: a side call, the end of a turn, no word, a tool call, a turn waiting),
    slots whose disk copy was taken last: one leaves memory only where slots of its rank that
    can go at once do not make room, for it costs a rewrite, and a re-read of what the disk
    cannot take. A rank still comes first: an end of turn written again goes before a tool
    loop whose pages are on disk, whose result is due within seconds and would restore them."""
    def key(slot: Slot) -> tuple:
        order = keep(slot)  # computed once per slot
        return order[0], slot.disk_gap, order

    return key
